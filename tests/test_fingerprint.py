"""The fingerprint covers every operator by construction, and compiling never changes an operator.

An operator's description is derived from its declaration (zephon/ops/base.py: its identity, its
``version`` and every public attribute), for built-ins, your own ``Transform`` subclasses and your
accumulator factories alike. What cannot be described (an object with no stable description, a lambda
without a version) is refused when the pipeline is built, naming the operator, the parameter and the
fix. A checkpoint from a pipeline whose operator differs is refused, naming that operator.
"""

from __future__ import annotations

import functools
import json
import operator
import re
import threading

import numpy as np
import pytest

import zephon as z
from zephon.graph.fingerprint import fingerprint
from zephon.ops.base import describe_value


class KeepLong(z.Transform):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def apply(self, columns):
        return np.array([len(ids) >= self.n for ids in columns["input_ids"]])


class KeepLonger(KeepLong):
    """The same parameters, another class: another operator."""


class KeepLongV2(KeepLong):
    version = 2


class WithLock(KeepLong):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.lock = threading.Lock()  # public: a parameter, which no description can cover


class WithPrivateLock(KeepLong):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self._lock = threading.Lock()  # private: derived state, not a parameter


def long_enough(record: dict) -> bool:
    return len(record["text"]) > 50


def longer_than(record: dict, n: int = 50) -> bool:
    return len(record["text"]) > n


class Dedup:
    def __init__(self, ctx=None, window: int = 8) -> None:
        self.window, self.seen = window, []

    def push(self, doc):
        return [doc]

    def flush(self):
        return []


@pytest.fixture(scope="module")
def base(corpus, sp_model):
    tok = z.tokenizer(str(sp_model))
    return (z.Pipeline(seed=3, lanes=4)
            .source("web", z.read.parquet(str(corpus / "web"), chunk_rows=4))
            .tokenize(tok)), tok


def finish(pipe):
    return pipe.pack(seq_len=64).batch(rows_per_lane=1)


def test_user_transforms_enter_with_their_class_version_and_parameters(base):
    pipe, _ = base
    fps = {name: finish(pipe.apply(op)).fingerprint for name, op in {
        "a": KeepLong(10), "same": KeepLong(10), "other n": KeepLong(11), "other class": KeepLonger(10),
        "version": KeepLongV2(10), "private state": WithPrivateLock(10)}.items()}
    assert fps["a"] == fps["same"]
    assert WithPrivateLock(10).params() == {"sources": None, "n": 10}  # private state is no parameter
    assert len({fps["a"], fps["other n"], fps["other class"], fps["version"]}) == 4
    described = KeepLongV2(10).describe()
    assert described["op"] == "tests.test_fingerprint:KeepLongV2" and described["version"] == 2
    assert described["n"] == 10


def test_an_operator_that_cannot_describe_itself_is_refused_with_the_fix(base):
    pipe, _ = base
    with pytest.raises(z.PipelineError, match=r"operator 'WithLock': parameter 'lock'.*lock.*keep it private"):
        pipe.apply(WithLock(10))


def test_functions_need_a_name_or_a_version(base):
    pipe, _ = base
    with pytest.raises(z.PipelineError, match=r"lambda.*Define it at module level, or pass version="):
        pipe.filter(lambda r: True)
    one = finish(pipe.filter(lambda r: True, version="1")).fingerprint
    two = finish(pipe.filter(lambda r: True, version="2")).fingerprint
    named = finish(pipe.filter(long_enough)).fingerprint
    assert len({one, two, named}) == 3
    p50 = finish(pipe.filter(functools.partial(longer_than, n=50))).fingerprint
    p60 = finish(pipe.filter(functools.partial(longer_than, n=60))).fingerprint
    assert p50 != p60  # a partial's arguments are part of what it does


def test_library_functions_and_builtin_methods_are_told_apart(base):
    """numpy's functions are objects of one class (np.char.upper and np.char.lower described alike before), a
    bound builtin method carries its object ("-".join is not "+".join), and str.upper or operator.itemgetter
    made the description itself fail with a TypeError."""
    _, tok = base
    start = z.Pipeline(seed=3, lanes=4).source("web", z.read.records([{"text": "a b"}, {"text": "c d"}]))

    def prints(*fns):
        return {finish(start.map_field(fn, "text").tokenize(tok)).fingerprint for fn in fns}
    assert len(prints(np.char.upper, np.char.lower, np.char.strip)) == 3
    assert len(prints(str.upper, str.lower, "-".join, "+".join)) == 4
    assert len(prints(operator.itemgetter(0), operator.itemgetter(1))) == 2
    # a builtin method whose object has no description keeps the description it always had
    assert describe_value(re.compile("a").search, "w") == "builtins:Pattern.search"


def test_accumulator_factories_are_described(base):
    pipe, _ = base
    a = finish(pipe.accumulate(Dedup)).fingerprint
    b = finish(pipe.accumulate(functools.partial(Dedup, window=16))).fingerprint
    c = finish(pipe.accumulate(Dedup, version=2)).fingerprint
    assert len({a, b, c}) == 3
    assert finish(pipe.accumulate(Dedup, name="other label")).fingerprint == a  # a name changes no byte


def test_a_resume_under_another_operator_is_refused_naming_it(base):
    pipe, _ = base
    writer = finish(pipe.apply(KeepLong(10))).build()
    next(writer)
    state = json.loads(json.dumps(writer.state_dict()))
    writer.close()
    reader = finish(pipe.apply(KeepLonger(10))).build()
    with pytest.raises(z.StateError, match=r"(?s)different pipeline.*\.op: checkpoint has \"tests\.test_fingerprint:"
                                           r"KeepLong\", this pipeline has \"tests\.test_fingerprint:KeepLonger\""):
        reader.load_state_dict(state)
    reader.close()
    again = finish(pipe.apply(KeepLong(10))).build()
    again.load_state_dict(state)  # the same operator resumes
    next(again)
    again.close()


def test_compiling_never_changes_an_operator_another_pipeline_shares(base):
    """A pipeline is a value: two pipelines sharing a prefix (and its split) are compiled with other token
    fields and row limits; the shared operator objects are left as they were, and each pipeline's batches
    equal those of a pipeline built afresh."""
    pipe, tok = base
    prefix = pipe.split(max_tokens=32)
    shared = prefix.ops[-1]
    before = {k: v for k, v in vars(shared).items()}
    a = prefix.pack(seq_len=64).batch()
    b = prefix.map(with_mask, token_fields={"keep": 1}).pack(seq_len=32, algorithm="wrap").batch()
    a.compile(), b.compile()
    assert vars(shared) == before and prefix.ops[-1] is shared
    fresh = (z.Pipeline(seed=3, lanes=4).source("web", pipe.sources[0].read).tokenize(tok).split(max_tokens=32)
             .pack(seq_len=64).batch())
    with a.build() as la, fresh.build() as lf:
        assert [z.batch_digest(next(la)) for _ in range(3)] == [z.batch_digest(next(lf)) for _ in range(3)]


def with_mask(record: dict) -> dict:
    return {**record, "keep": np.ones(len(record["input_ids"]), dtype=np.uint8)}


def test_the_fingerprint_has_no_fallback_for_other_types():
    with pytest.raises(TypeError):
        fingerprint({"x": object()})


def test_every_operator_is_described_in_the_summary(base):
    """The summary holds every operator, the implied split and mix included, each by its identity."""
    pipe, _ = base
    summary = finish(pipe.apply(KeepLong(5)).shuffle(buffer=4)).compile().summary
    per_source = [op["op"] for op in summary["sources"][0]["ops"]]
    assert per_source == ["zephon.tokenize", "tests.test_fingerprint:KeepLong", "zephon.split"]
    assert [op["op"] for op in summary["ops"]] == ["zephon.mix", "zephon.shuffle", "zephon.pack", "zephon.batch"]
    assert summary["sources"][0]["ops"][0]["tokenizer"]["sha256"]  # the tokenizer's file, by content

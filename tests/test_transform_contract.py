"""Your own stateless operator: a ``zephon.Transform`` subclass with ``apply(columns)``.

``apply`` sees a batch of records as columns and returns columns (a map), a boolean keep-mask (a filter) or
``(columns, counts)`` (one record becomes ``counts[j]`` records). The engine adapts each to its chunks
(resume points included), before the merge on any executor and after it in the lane. Checked here against
the built-in operators that do the same, batch for batch, and for elasticity and resumes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import zephon as z
from zephon.verify import global_hashes


class Upper(z.Transform):
    """A map over columns: the text upper-cased."""

    def apply(self, columns):
        return {**columns, "text": [t.upper() if t else t for t in columns["text"]]}


def upper(record: dict) -> dict:
    return {**record, "text": record["text"].upper() if record["text"] else record["text"]}


class MinTokens(z.Transform):
    """A keep-mask over documents."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def apply(self, columns):
        return np.array([len(ids) >= self.n for ids in columns["input_ids"]])


def at_least_20(record: dict) -> bool:
    return len(record["input_ids"]) >= 20


class Halves(z.Transform):
    """One-to-many: a text of more than 40 characters becomes its two halves, an empty one nothing."""

    def apply(self, columns):
        texts, counts = [], []
        for t in columns["text"]:
            parts = [] if not t else [t[:len(t) // 2], t[len(t) // 2:]] if len(t) > 40 else [t]
            texts += parts
            counts.append(len(parts))
        return {"text": texts}, counts


def halves(record: dict) -> list[dict]:
    t = record["text"]
    return [] if not t else [{"text": t[:len(t) // 2]}, {"text": t[len(t) // 2:]}] if len(t) > 40 else [{"text": t}]


@pytest.fixture(scope="module")
def parts(corpus, sp_model):
    tok = z.tokenizer(str(sp_model))
    start = z.Pipeline(seed=9, lanes=8, flush_every=2).source("web", z.read.parquet(str(corpus / "web"), chunk_rows=4))
    return start, tok


def finish(pipe, tok):
    return pipe.tokenize(tok).split(max_tokens=64).pack(seq_len=64).batch(rows_per_lane=2)


@pytest.mark.parametrize("mine,builtin", [
    (lambda p: p.apply(Upper()), lambda p: p.map(upper)),
    (lambda p: p.apply(Halves()), lambda p: p.flat_map(halves)),
])
def test_columns_and_counts_equal_the_builtin_map_and_flat_map(parts, mine, builtin):
    start, tok = parts
    assert global_hashes(finish(mine(start), tok), 1, 6) == global_hashes(finish(builtin(start), tok), 1, 6)


def test_a_keep_mask_equals_the_builtin_filter_and_is_counted(parts):
    start, tok = parts
    mine = start.tokenize(tok).apply(MinTokens(20)).split(max_tokens=64).pack(seq_len=64).batch(rows_per_lane=2)
    theirs = start.tokenize(tok).filter(at_least_20).split(max_tokens=64).pack(seq_len=64).batch(rows_per_lane=2)
    assert global_hashes(mine, 1, 6) == global_hashes(theirs, 1, 6)
    with mine.build() as loader:
        for _ in range(3):
            next(loader)
        assert loader.metrics()["skipped_by_reason"].get("filtered_records", 0) > 0


def test_your_transform_is_elastic_resumable_and_runs_on_workers(parts):
    start, tok = parts
    pipe = finish(start.apply(Halves()).apply(Upper()), tok)
    reference = global_hashes(pipe, 1, 8)
    assert global_hashes(pipe, 4, 8) == reference
    assert global_hashes(pipe, 2, 8, resume_at=3, resume_world_size=8) == reference  # between two halves too
    assert global_hashes(pipe, 2, 8, num_workers=2, runner="process") == reference


def test_after_the_merge_it_runs_in_the_lane(parts):
    """Declared after an accumulator, the transform runs in the lane, a record at a time, with the same result
    as the built-in filter there."""
    start, tok = parts
    mine = start.tokenize(tok).split(max_tokens=64).shuffle(buffer=4).apply(MinTokens(20)).pack(seq_len=64).batch()
    theirs = start.tokenize(tok).split(max_tokens=64).shuffle(buffer=4).filter(at_least_20).pack(seq_len=64).batch()
    assert "lane: per record" in mine.explain()
    assert global_hashes(mine, 1, 5) == global_hashes(theirs, 1, 5)


class Wrong(z.Transform):
    def __init__(self, result) -> None:
        super().__init__()
        self._result = result

    def apply(self, columns):
        return self._result(len(next(iter(columns.values()))))


@pytest.mark.parametrize("result,match", [
    (lambda n: np.ones(n + 1, dtype=bool), r"a keep-mask needs one entry per record"),
    (lambda n: {"text": ["x"] * (n + 2)}, r"do not have \d+ entries"),
    (lambda n: ({"text": ["x"] * n}, [1] * (n - 1)), r"counts need one entry >= 0 per record"),
    (lambda n: ["not", "columns"], r"apply\(\) must return columns"),
])
def test_a_wrong_result_is_an_error_naming_the_operator(parts, result, match):
    start, tok = parts
    pipe = finish(start.apply(Wrong(result)), tok)
    with pytest.raises(z.PipelineError, match=r"operator 'Wrong' on .*" + match):
        next(pipe.build())


class EmptyShort(z.Transform):
    """A map that leaves documents of fewer than 40 tokens with no tokens at all (as a user's clean-up might)."""

    def apply(self, columns):
        return {**columns, "input_ids": [ids if len(ids) >= 40 else ids[:0] for ids in columns["input_ids"]]}


def empty_short(record: dict) -> dict:
    ids = record["input_ids"]
    return {**record, "input_ids": ids if len(ids) >= 40 else ids[:0]}


def at_least_40(record: dict) -> bool:
    return len(record["input_ids"]) >= 40


@pytest.mark.parametrize("algorithm", ["best_fit", "first_fit", "wrap"])
@pytest.mark.parametrize("where", ["workers", "lane"])
def test_a_document_left_with_no_tokens_goes_into_no_row(parts, algorithm, where):
    """A document a transform leaves without tokens has nothing to put in a row: the batches equal those of the
    filter that drops it. Before the fix, best and first fit gave it a piece of its own (on the batched text path
    too), and so did a held row's top-up after a sentinel with every algorithm; collate then wrote its tail label
    over the previous piece's last label and left the next piece's positions running on."""
    start, tok = parts

    def pipe(step):
        p = start.tokenize(tok).split(max_tokens=64)
        p = step(p.shuffle(buffer=4) if where == "lane" else p)
        return p.pack(seq_len=64, algorithm=algorithm).batch(rows_per_lane=2)

    emptied, filtered = pipe(lambda p: p.apply(EmptyShort())), pipe(lambda p: p.filter(at_least_40))
    assert global_hashes(emptied, 1, 6) == global_hashes(filtered, 1, 6)
    assert global_hashes(pipe(lambda p: p.map(empty_short)), 2, 6, resume_at=3, resume_world_size=4) == \
        global_hashes(filtered, 1, 6)
    with emptied.build() as loader:
        for _ in range(3):
            batch = next(loader)
            starts = np.flatnonzero(np.diff(batch["segment_ids"].numpy(), axis=1, prepend=0).reshape(-1))
            assert (batch["position_ids"].numpy().reshape(-1)[starts] == 0).all()
            assert len(batch["cu_seqlens"]) - 1 == len(starts) + int((batch["segment_ids"] == 0).any(dim=1).sum())


def as_list_or_nothing(record: dict) -> dict:
    """Python ints, and [] for a short document: numpy reads [] as float64, which must not change the others."""
    ids = record["input_ids"]
    return {**record, "input_ids": [int(t) for t in ids] if len(ids) >= 40 else []}


def as_uint64_now_and_then(record: dict) -> dict:
    """Integer ids of two dtypes in one chunk: numpy's common type for uint64 and int32 is float64."""
    ids = record["input_ids"]
    return {**record, "input_ids": ids.astype(np.uint64) if len(ids) % 2 else ids}


@pytest.mark.parametrize("fn", [as_list_or_nothing, as_uint64_now_and_then])
def test_ids_as_python_lists_empty_lists_and_mixed_integer_dtypes_are_token_ids(parts, fn):
    start, tok = parts
    mine = start.tokenize(tok).map(fn).split(max_tokens=64).pack(seq_len=64).batch(rows_per_lane=2)
    keep = at_least_40 if fn is as_list_or_nothing else (lambda r: True)
    theirs = start.tokenize(tok).filter(keep, version=1).split(max_tokens=64).pack(seq_len=64).batch(rows_per_lane=2)
    assert global_hashes(mine, 1, 4) == global_hashes(theirs, 1, 4)


def beyond_int32(record: dict) -> dict:
    return {**record, "input_ids": np.asarray(record["input_ids"], dtype=np.int64) + 2 ** 32}  # wraps to itself


def minus_100_at_the_end(record: dict) -> dict:
    return {**record, "input_ids": np.append(record["input_ids"], -100)}


def as_floats(record: dict) -> dict:
    return {**record, "input_ids": np.asarray(record["input_ids"], dtype=np.float32) + 0.5}


class AsBools(z.Transform):
    def apply(self, columns):
        return {**columns, "input_ids": [ids > 100 for ids in columns["input_ids"]]}


BAD_IDS = [
    (lambda p: p.map(beyond_int32), "map:beyond_int32", r"row \d+: the value 42949\d+"),
    (lambda p: p.map(minus_100_at_the_end), "map:minus_100_at_the_end", r"row \d+: the value -100"),
    (lambda p: p.map(as_floats), "map:as_floats", r"float32 values"),
    (lambda p: p.apply(AsBools()), "AsBools", r"bool values"),
]


@pytest.mark.parametrize("where", ["workers", "lane"])
@pytest.mark.parametrize("step,name,got", BAD_IDS)
def test_ids_a_row_cannot_hold_are_an_error_naming_the_operator(parts, where, step, name, got):
    """Before, the packer's int32 rows took them silently: an id past 2**31 wrapped (here to the true id, so the
    batches looked right), a float was truncated, -100 became a token."""
    start, tok = parts
    p = start.tokenize(tok)
    p = step(p.shuffle(buffer=4) if where == "lane" else p).pack(seq_len=64).batch(rows_per_lane=2)
    if where == "lane":
        got = got.replace(r"row \d+: ", "")
    with pytest.raises(z.OperatorError, match=rf"operator '{name}' made input_ids that packed rows cannot hold as they "
                                              rf"are, on .*{got}\. Token ids must be integers in \[0, 2\*\*31\)"):
        with p.build() as loader:
            next(loader)
    with pytest.raises(z.PipelineError, match=rf"validate: operator '{name}' failed.*{got}"):
        p.validate()


@pytest.mark.parametrize("step,name,got", BAD_IDS)
def test_without_pack_records_become_rows_as_they_are(parts, step, name, got):
    """Only packed rows hold ids as int32: a pipeline without pack() batches what the operators made."""
    start, tok = parts
    with step(start.tokenize(tok)).batch(rows_per_lane=2).build() as loader:
        batch = next(loader)
    assert len(batch["input_ids"]) == 2 * 8


class AppendMinus100:
    """An accumulator that emits each document with -100 appended to its ids."""

    def push(self, record):
        return ({**record, "input_ids": np.append(record["input_ids"], -100)},)

    def flush(self):
        return ()


def test_ids_an_accumulator_emits_are_checked_too(parts):
    start, tok = parts
    p = start.tokenize(tok).accumulate(AppendMinus100).pack(seq_len=64).batch(rows_per_lane=2)
    with pytest.raises(z.OperatorError, match=r"operator 'accumulate:AppendMinus100' made input_ids that packed rows "
                                              r"cannot hold as they are, on a record it emitted: the value -100\."):
        with p.build() as loader:
            next(loader)


def weights_on_odd_documents(record: dict) -> dict:
    """A per-token field on some documents only: the others get the declared default."""
    ids = record["input_ids"]
    return {**record, "weight": np.full(len(ids), 2, dtype=np.uint8)} if len(ids) % 2 else record


class WeightsOnOddDocuments(z.Transform):
    token_fields = {"weight": (np.uint8, 7)}

    def apply(self, columns):
        return {**columns, "weight": [np.full(len(ids), 2, dtype=np.uint8) if len(ids) % 2 else None
                                      for ids in columns["input_ids"]]}


@pytest.mark.parametrize("step", [
    lambda p: p.map(weights_on_odd_documents, token_fields={"weight": 7}),
    lambda p: p.map(weights_on_odd_documents, token_fields={"weight": ("uint8", 7)}),
    lambda p: p.apply(WeightsOnOddDocuments()),
])
def test_a_per_token_field_on_some_documents_gets_its_default_elsewhere(parts, step):
    """As the packer does for a document without the field; on the workers a record without it was a KeyError."""
    start, tok = parts
    with step(start.tokenize(tok)).pack(seq_len=64).batch().build() as loader:
        batch = next(loader)
    weight, seg = batch["weight"].numpy(), batch["segment_ids"].numpy()
    for r in range(len(seg)):
        for s in range(1, seg[r].max() + 1):
            values = set(weight[r][seg[r] == s].tolist())
            assert values in ({2}, {7}), values  # one value per document: its own, or the default
    assert {2, 7} <= set(weight[seg > 0].tolist())


def weights_one_short(record: dict) -> dict:
    return {**record, "weight": np.full(len(record["input_ids"]) - 1, 2, dtype=np.int32)}


class WeightsOneShortAfterDoubling(z.Transform):
    """One-to-many: each document twice; the second copy of the third document has a field one value short."""

    token_fields = {"weight": 7}

    def apply(self, columns):
        ids = [a for ids in columns["input_ids"] for a in (ids, ids)]
        weight = [np.full(len(a) - (j == 2 and k == 1), 2, dtype=np.int32)
                  for j, a in enumerate(columns["input_ids"]) for k in (0, 1)]
        return {"input_ids": ids, "weight": weight}, [2] * len(columns["input_ids"])


@pytest.mark.parametrize("where", ["workers", "lane"])
def test_a_per_token_field_of_another_length_is_an_error_naming_the_operator(parts, where):
    """On the workers it shifted every later document's values in the chunk (or failed inside numpy); after the
    merge the packer cut a longer field silently and failed on a shorter one without a name."""
    start, tok = parts
    p = start.tokenize(tok)
    p = (p.shuffle(buffer=4) if where == "lane" else p).map(weights_one_short, token_fields={"weight": 7})
    match = (r"operator 'map:weights_one_short' .* made a record whose per-token fields do not line up, on .*, row \d+: its per-token "
             r"field 'weight' has (\d+) values for \d+ tokens of input_ids" if where == "workers" else
             r"operator 'map:weights_one_short' made \d+ values of the per-token field 'weight' for \d+ tokens, on a "
             r"record in the lane")
    with pytest.raises(z.OperatorError, match=match):
        with p.pack(seq_len=64).batch().build() as loader:
            next(loader)


def test_a_one_to_many_transform_names_the_record_the_bad_one_came_from(sp_model):
    """The sixth record made comes from the chunk's third record: the error names that one (row 2)."""
    tok = z.tokenizer(str(sp_model))
    start = z.Pipeline(seed=9, lanes=1).source("web", z.read.records([{"text": f"document number {k}"} for k in range(8)],
                                                                     chunk_rows=4))
    pipe = start.tokenize(tok).apply(WeightsOneShortAfterDoubling()).pack(seq_len=64).batch()
    with pytest.raises(z.PipelineError, match=r"operator 'WeightsOneShortAfterDoubling' on .*, row 2: its per-token "
                                              r"field 'weight' has \d+ values"):
        next(pipe.build())


def half_weights(record: dict) -> dict:
    return {**record, "weight": np.full(len(record["input_ids"]), 0.5)}


def big_weights(record: dict) -> dict:
    return {**record, "weight": np.full(len(record["input_ids"]), 300, dtype=np.int64)}


@pytest.mark.parametrize("where", ["workers", "lane"])
@pytest.mark.parametrize("fn,default,got", [
    (half_weights, 1, r"float64 values\. Its rows hold int32"),
    (big_weights, True, r"the value 300\. Its rows hold uint8"),
])
def test_per_token_values_the_declared_dtype_cannot_hold_are_an_error(parts, where, fn, default, got):
    """A field declared with an integer default is packed as int32 (a bool one as uint8): 0.5 became 0 and 300
    became 44, silently."""
    start, tok = parts
    p = start.tokenize(tok)
    p = (p.shuffle(buffer=4) if where == "lane" else p).map(fn, token_fields={"weight": default})
    with pytest.raises(z.OperatorError, match=rf"operator 'map:{fn.__name__}' made weight that packed rows cannot hold "
                                              rf"as they are, on .*: {got} .* declare the default in the values' kind"):
        with p.pack(seq_len=64).batch().build() as loader:
            next(loader)


def int_weights_as_a_list(record: dict) -> dict:
    return {**record, "weight": [2] * len(record["input_ids"])}


def huge_weights(record: dict) -> dict:
    return {**record, "weight": np.full(len(record["input_ids"]), 1e5)}


@pytest.mark.parametrize("fn,default,dtype,value", [
    (half_weights, 1.0, torch.float32, 0.5),
    (int_weights_as_a_list, 1.0, torch.float32, 2.0),  # integers into a float field: exact
    (int_weights_as_a_list, ("int8", 0), torch.int8, 2),
])
def test_per_token_values_that_fit_the_declared_dtype_are_packed_as_they_are(parts, fn, default, dtype, value):
    start, tok = parts
    pipe = start.tokenize(tok).map(fn, token_fields={"weight": default}).pack(seq_len=64).batch()
    with pipe.build() as loader:
        batch = next(loader)
    assert batch["weight"].dtype == dtype
    assert set(batch["weight"][batch["segment_ids"] > 0].tolist()) == {value}


def test_a_float_beyond_a_narrower_float_dtype_is_an_error(parts):
    """1e5 in a float16 field became inf."""
    start, tok = parts
    pipe = start.tokenize(tok).map(huge_weights, token_fields={"weight": ("float16", 0.0)}).pack(seq_len=64).batch()
    with pytest.raises(z.OperatorError, match=r"made weight that packed rows cannot hold as they are, on .*: the value "
                                              r"100000\.0\. Its rows hold float16"):
        next(pipe.build())


class SetUpOnce(z.Transform):
    """Loads its model in setup(): on the object you passed, once, whatever the number of sources."""

    def __init__(self) -> None:
        super().__init__()
        self._loads = 0

    def setup(self) -> None:
        self._loads += 1

    def apply(self, columns):
        assert self._loads, "apply before setup"
        return columns


def test_your_transform_is_set_up_itself_not_a_copy(corpus, sp_model):
    tok = z.tokenizer(str(sp_model))
    mine = SetUpOnce()
    pipe = (z.Pipeline(seed=9, lanes=2).source("web", z.read.parquet(str(corpus / "web")))
            .source("code", z.read.jsonl(str(corpus / "code" / "*.jsonl"))).tokenize(tok).apply(mine)
            .pack(seq_len=64).batch())
    with pipe.build(num_workers=0) as loader:
        next(loader)
    assert mine._loads == 1


class OwnBind(z.Transform):
    """A transform with its own bind() (returning a copy, as built-ins do): still checked."""

    def bind(self, ctx):
        return self._bound(_seen=True)

    def apply(self, columns):
        return {**columns, "input_ids": [np.append(ids, -100) for ids in columns["input_ids"]]}


@pytest.mark.parametrize("where", ["workers", "lane"])
def test_a_transform_with_its_own_bind_is_checked_too(parts, where):
    start, tok = parts
    p = start.tokenize(tok)
    p = (p.shuffle(buffer=4) if where == "lane" else p).apply(OwnBind()).pack(seq_len=64).batch()
    with pytest.raises(z.OperatorError, match=r"operator 'OwnBind' made input_ids .*: the value -100\."):
        next(p.build())


class EmitsNoneUntilFlush:
    """An accumulator whose push returns None (nothing now), as the engine has always accepted."""

    def __init__(self) -> None:
        self.held = []

    def push(self, record):
        self.held.append(record)
        return None

    def flush(self):
        out, self.held = self.held, []
        return out


def test_an_accumulator_may_return_none(parts):
    start, tok = parts
    mine = start.tokenize(tok).accumulate(EmitsNoneUntilFlush).pack(seq_len=64).batch(rows_per_lane=2)
    assert len(global_hashes(mine, 1, 3)) == 3


def first_10(ids):
    return ids[:10]


def cut_to_10(record: dict) -> dict:
    return {**record, "input_ids": record["input_ids"][:10]}


def shout(text: str) -> str:
    return text.upper()


def shout_record(record: dict) -> dict:
    return {**record, "text": record["text"].upper() if record["text"] else record["text"]}


def more_than_30(ids) -> bool:
    return len(ids) > 30


def more_than_30_tokens(record: dict) -> bool:
    return len(record["input_ids"]) > 30


@pytest.mark.timeout(120)  # before the fix, a lane filter_field dropped every record and the loader never returned
@pytest.mark.parametrize("where", ["workers", "lane"])
@pytest.mark.parametrize("mine,theirs,tokenized_first", [
    (lambda p: p.map_field(first_10, "input_ids"), lambda p: p.map(cut_to_10), True),
    (lambda p: p.filter_field(more_than_30, "input_ids"), lambda p: p.filter(more_than_30_tokens), True),
    (lambda p: p.map_field(shout, "text"), lambda p: p.map(shout_record), False),
])
def test_field_operators_see_the_field_on_token_fields_and_in_the_lane(parts, where, mine, theirs, tokenized_first):
    """map_field and filter_field gave their function the whole record for a per-token field, and in the lane for
    every field (a TypeError, or a filter that quietly judged the record's length)."""
    start, tok = parts

    def pipe(step):
        p = start.tokenize(tok) if tokenized_first else start
        p = step(p.shuffle(buffer=4) if where == "lane" else p)
        return (p if tokenized_first else p.tokenize(tok)).pack(seq_len=64).batch(rows_per_lane=2)

    assert global_hashes(pipe(mine), 1, 4) == global_hashes(pipe(theirs), 1, 4)


def first_10_unless_short(ids):
    if len(ids) < 40:
        raise ValueError("too short")
    return ids[:10]


@pytest.mark.parametrize("where", ["workers", "lane"])
def test_map_field_skips_a_per_token_field_it_failed_on(parts, where):
    """on_error='skip' drops the record (a per-token field has no None) and, on the workers, counts it."""
    start, tok = parts
    p = start.tokenize(tok)
    p = (p.shuffle(buffer=4) if where == "lane" else p)
    mine = p.map_field(first_10_unless_short, "input_ids", on_error="skip").pack(seq_len=64).batch(rows_per_lane=2)
    theirs = p.filter(at_least_40).map(cut_to_10).pack(seq_len=64).batch(rows_per_lane=2)
    assert global_hashes(mine, 1, 3) == global_hashes(theirs, 1, 3)
    if where == "workers":
        with mine.build() as loader:
            next(loader)
            assert loader.metrics()["skipped_by_reason"].get("failed_records", 0) > 0


def first_half(columns: dict) -> dict:
    return {k: v[: len(v) // 2] for k, v in columns.items()}


@pytest.mark.timeout(120)  # before the fix, the lane dropped every record and the loader never returned
@pytest.mark.parametrize("where", ["workers", "lane"])
def test_map_batch_that_returns_fewer_records_is_an_error_in_the_lane_too(parts, where):
    """On the workers it was an error; after the merge the lane zipped the shorter columns and dropped records
    (one record a call: all of them)."""
    start, tok = parts
    p = start.tokenize(tok)
    p = (p.shuffle(buffer=4) if where == "lane" else p).map_batch(first_half).pack(seq_len=64).batch()
    with pytest.raises(z.OperatorError, match=r"operator 'map_batch:first_half' .* failed on .*: ValueError: columns "
                                              r"\{'input_ids': \d+\} do not have \d+ entries \(one per record\)"):
        next(p.build())


def never(record: dict) -> bool:
    return False


@pytest.mark.timeout(120)
def test_operators_after_the_merge_that_drop_everything_are_an_error_not_a_hang(parts):
    """Before the merge a source that gives no document is refused (EmptySourceWatch); after it the lane read its
    endless sources for ever. Now it stops after as many units as that watch allows, naming the operators."""
    start, tok = parts
    pipe = start.tokenize(tok).shuffle(buffer=4).filter(never).pack(seq_len=64).batch()
    with pytest.raises(z.OperatorError, match=r"lane \d+ took \d+ units of its sources without making a row: the "
                                              r"operators after the merge \(shuffle, filter:never\) drop every record"):
        next(pipe.build())

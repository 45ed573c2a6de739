"""Property tests (hypothesis): each built-in operator alone, then random whole recipes.

For an operator alone, "elastic resume" means: what it emits after a flush sentinel equals what a
freshly built operator emits when fed only the input after that sentinel. That is exactly what a
lane rebuilt on another rank does, so if it holds for every operator and every input, resumes on
any world size are exact. "Workers change nothing" means the stage buffer returns results in task
order whatever order the workers finish in. Every operator here is driven exactly as a lane drives
it (:class:`zephon.engine.nodes.AccumulatorNode`, :class:`zephon.engine.nodes.MergeNode`).
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torchdata.nodes import BaseNode, IterableWrapper

from zephon import StateError, WorkPlan
from zephon.engine.counters import LaneCounters
from zephon.engine.nodes import AccumulatorNode, MergeNode
from zephon.engine.sentinels import FlushPolicy
from zephon.engine.sources import EmptySourceWatch, SourceStream, StageBuffer, position_of, position_state
from zephon.engine.stages import drop_delivered
from zephon.ops.base import LaneContext
from zephon.ops.mix import Mixer, integer_strides
from zephon.ops.pack import Packer
from zephon.ops.shuffle import ShuffleBuffer
from zephon.ops.split import Split
from zephon.records import IGNORE, Chunk, Doc, Flush, Row
from zephon.testing import check_accumulator
from zephon.verify import global_hashes

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- synthetic document streams ---------------------------------------------------------------------
segments_st = st.lists(st.lists(st.integers(1, 90), max_size=25), min_size=1, max_size=5)


def docs_of(lengths: list[int], first_token: int) -> list[Doc]:
    out, t = [], first_token
    for n in lengths:
        out.append(Doc({"input_ids": np.arange(t, t + n, dtype=np.int32)}))
        t += n
    return out


def stream_with_flushes(segments: list[list[int]]) -> tuple[list[Any], list[list[Any]]]:
    """All segments' documents separated by flush sentinels; and each segment's documents alone."""
    items, per_segment, t = [], [], 0
    for e, lengths in enumerate(segments):
        docs = docs_of(lengths, t)
        t += sum(lengths)
        per_segment.append(docs)
        items += docs + [Flush(e + 1, ())]
    return items, per_segment


def drain(node: BaseNode) -> list[Any]:
    out = []
    while True:
        try:
            out.append(next(node))
        except StopIteration:
            return out


def split_at_flushes(items: list[Any]) -> list[list[Any]]:
    parts, cur = [], []
    for item in items:
        if isinstance(item, Flush):
            parts.append(cur)
            cur = []
        else:
            cur.append(item)
    assert cur == [], "an operator held items back past the last sentinel"
    return parts


def canon(item: Any) -> Any:
    """A comparable form of a document, a packed row or a sentinel."""
    if isinstance(item, Flush):
        return ("flush", item.index, item.carry)
    if isinstance(item, Row):
        return (item.tokens[:item.fill].tolist(), list(item.seg_lens), list(item.tails), item.flushed)
    return (item["input_ids"].tolist(), getattr(item, "tail", IGNORE))


def after_each_flush(items: list[Any]) -> list[tuple[Flush, list[Any]]]:
    return [(x, items[i + 1:]) for i, x in enumerate(items) if isinstance(x, Flush)]


def pieces(items: list[Any], max_len: int, token_fields: tuple[str, ...] = ("input_ids",)) -> list[Any]:
    """Cut documents as ``split`` does: runs of at most ``max_len``, tail = the next token."""
    split = Split(max_len)
    split._token_names = token_fields  # what the pipeline sets: every per-token field is cut alike
    out = []
    for item in items:
        if isinstance(item, Flush):
            out.append(item)
            continue
        out += split._apply_records([item])
    return out


def run(acc: Any, items: list[Any]) -> list[Any]:
    return drain(AccumulatorNode(IterableWrapper(items), lambda ctx: acc, "op", LaneContext(0, 0)))


def operator_factories(seq_len: int, algorithm: str, max_bins: int, buffer: int, lane: int):
    def shuffle(segment, carry):
        assert carry == 0  # only the packer carries tokens over a sentinel
        return ShuffleBuffer(LaneContext(1234, lane, segment), buffer)

    def pack(segment, carry):
        return Packer(LaneContext(1234, lane, segment, carry=carry), seq_len, algorithm, max_bins)

    return {"shuffle": shuffle, "pack": pack}


@FAST
@given(segments=segments_st, seq_len=st.integers(4, 64), algorithm=st.sampled_from(["best_fit", "first_fit", "wrap"]),
       max_bins=st.integers(1, 6), buffer=st.integers(1, 8), lane=st.integers(0, 63),
       op=st.sampled_from(["shuffle", "pack"]))
def test_operator_after_flush_equals_fresh_operator(segments, seq_len, algorithm, max_bins, buffer, lane, op):
    """After each sentinel, the operator's output equals that of a fresh operator built at the
    sentinel (its segment, and the packer's ``carry``) and fed only the input after it."""
    make = operator_factories(seq_len, algorithm, max_bins, buffer, lane)[op]
    items = pieces(stream_with_flushes(segments)[0], seq_len)
    whole = run(make(0, 0), items)
    out_flushes, in_flushes = after_each_flush(whole), after_each_flush(items)
    assert [f.index for f, _ in out_flushes] == [f.index for f, _ in in_flushes] == list(range(1, len(segments) + 1))
    for (f_out, rest_out), (f_in, rest_in) in zip(out_flushes, in_flushes):
        fresh = run(make(f_in.index, f_out.carry), rest_in)
        assert [canon(x) for x in fresh] == [canon(x) for x in rest_out], f"after sentinel {f_in.index}"
    # and it is a pure function of its input: a second run is identical
    again = run(make(0, 0), items)
    assert [canon(x) for x in again] == [canon(x) for x in whole]


@FAST
@given(segments=segments_st, seq_len=st.integers(4, 64), algorithm=st.sampled_from(["best_fit", "first_fit", "wrap"]),
       max_bins=st.integers(1, 6))
def test_packer_loses_and_duplicates_nothing(segments, seq_len, algorithm, max_bins):
    items, per_segment = stream_with_flushes(segments)
    out = run(Packer(LaneContext(0, 0), seq_len, algorithm, max_bins), pieces(items, seq_len))
    rows = [r for r in out if not isinstance(r, Flush)]
    packed = np.concatenate([r.tokens[:r.fill] for r in rows]) if rows else np.zeros(0, np.int32)
    expected = np.concatenate([d["input_ids"] for docs in per_segment for d in docs] or [np.zeros(0, np.int32)])
    # every token exactly once; wrap keeps order, bin packers may reorder pieces
    if algorithm == "wrap":
        assert np.array_equal(packed, expected)
    else:
        assert np.array_equal(np.sort(packed), np.sort(expected))
    for r in rows:
        assert 0 < r.fill <= seq_len and sum(r.seg_lens) == r.fill
        starts = np.cumsum([0] + r.seg_lens[:-1])
        for s, n, tail in zip(starts, r.seg_lens, r.tails):
            piece = r.tokens[s:s + n]
            assert np.all(np.diff(piece) == 1)  # pieces are contiguous runs of one document
            assert tail == IGNORE or tail == piece[-1] + 1  # the tail is the true next token
    # the tokens a sentinel's row took from after it are exactly the carry
    for i, item in enumerate(out):
        if isinstance(item, Flush) and item.carry:
            held = out[i - 1]
            assert held.flushed and held.fill >= item.carry
    # a flush costs no padding when the segment after it can top up the held row; only the row
    # held at the very end of the (finite) input is padded
    if all(sum(e) >= seq_len for e in segments[1:]):
        flush_pad = sum(r.free for r in rows if r.flushed)
        last_pad = rows[-1].free if rows and rows[-1].flushed else 0
        assert flush_pad == last_pad


@FAST
@given(segments=segments_st, seq_len=st.integers(4, 48), algorithm=st.sampled_from(["best_fit", "first_fit", "wrap"]))
def test_packer_keeps_every_per_token_field_aligned_and_payloads_with_their_document(segments, seq_len, algorithm):
    items, _ = stream_with_flushes(segments)
    for item in items:  # a second per-token field (the token's parity) and a payload (the first token)
        if not isinstance(item, Flush):
            item["parity"] = (item["input_ids"] % 2).astype(np.int8)
            item["first"] = int(item["input_ids"][0])
    fields = {"input_ids": (np.int32, 0), "parity": (np.int8, 0)}
    out = run(Packer(LaneContext(0, 0), seq_len, algorithm, 4, fields), pieces(items, seq_len, tuple(fields)))
    for r in (x for x in out if isinstance(x, Row)):
        assert np.array_equal(r.buffers["parity"][:r.fill], r.tokens[:r.fill] % 2)
        at = 0
        for n, payload in zip(r.seg_lens, r.payloads):
            piece = r.tokens[at:at + n]
            assert payload["first"] <= piece[0]  # the piece belongs to the document whose payload it carries
            at += n


@FAST
@given(segments=st.lists(st.lists(st.integers(0, 40), max_size=25), min_size=1, max_size=5),
       seq_len=st.integers(4, 48), algorithm=st.sampled_from(["best_fit", "first_fit", "wrap"]),
       max_bins=st.integers(1, 6))
@example(segments=[[10], [0, 5]], seq_len=8, algorithm="wrap", max_bins=1)  # the held row's top-up
def test_packer_puts_a_document_of_no_tokens_in_no_row(segments, seq_len, algorithm, max_bins):
    """A document of no tokens (a user's map can make one) changes nothing: the rows and sentinels are those of
    the stream without it, at every flush (held rows topped up after a sentinel included). Before the fix, best
    and first fit gave it a segment of its own, which collate turned into a wrong label and wrong positions."""
    items = pieces(stream_with_flushes(segments)[0], seq_len)
    without = [x for x in items if isinstance(x, Flush) or len(x["input_ids"])]
    out = run(Packer(LaneContext(0, 0), seq_len, algorithm, max_bins), items)
    assert [canon(x) for x in out] == [canon(x) for x in run(Packer(LaneContext(0, 0), seq_len, algorithm, max_bins),
                                                             without)]
    assert all(n > 0 for r in out if isinstance(r, Row) for n in r.seg_lens)


def test_packer_refuses_a_carry_longer_than_the_segment():
    items = docs_of([3, 4], 0) + [Flush(1, ())]
    with pytest.raises(StateError, match="sources now hold different data"):
        run(Packer(LaneContext(0, 0, carry=9), 8, "best_fit", 2), items)


@FAST
@given(segments=segments_st, buffer=st.integers(1, 10), lane=st.integers(0, 7))
def test_shuffle_is_a_permutation_within_each_segment(segments, buffer, lane):
    items, per_segment = stream_with_flushes(segments)
    out = split_at_flushes(run(ShuffleBuffer(LaneContext(99, lane), buffer), items))
    for docs, got in zip(per_segment, out):
        assert sorted(int(d["input_ids"][0]) for d in got) == sorted(int(d["input_ids"][0]) for d in docs)


def test_shuffle_actually_shuffles_and_depends_on_lane():
    docs = docs_of([3] * 200, 0)
    a = [int(d["input_ids"][0]) for d in run(ShuffleBuffer(LaneContext(5, 0), 16), docs + [Flush(1, ())])
         if not isinstance(d, Flush)]
    b = [int(d["input_ids"][0]) for d in run(ShuffleBuffer(LaneContext(5, 1), 16), docs + [Flush(1, ())])
         if not isinstance(d, Flush)]
    assert a != sorted(a) and a != b


def test_shuffle_passes_the_public_accumulator_check():
    check_accumulator(lambda ctx: ShuffleBuffer(ctx, 5), docs_of(list(range(1, 30)), 0), conserves=True)


# -- the merge alone, on synthetic chunk streams --------------------------------------------------
class SyntheticChunks(BaseNode):
    """Unit i of this source has ``sizes[i % len(sizes)]`` documents of ``doc_len`` tokens; chunks
    of ``chunk`` documents aligned to multiples of ``chunk``; the cursor is a document index; the
    documents are split into pieces of ``piece_len`` as the stateless stage would."""

    def __init__(self, source: int, sizes: list[int], doc_len: int, chunk: int, piece_len: int) -> None:
        super().__init__()
        self.source, self.sizes, self.doc_len, self.chunk, self.piece_len = source, sizes, doc_len, chunk, piece_len

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self.i, cursor, self.skip = position_of(initial_state, "synthetic") if initial_state else (0, -1, 0)
        self.pos = max(cursor, 0)

    def next(self) -> Chunk:
        size = self.sizes[self.i % len(self.sizes)]
        end = min(size, (self.pos // self.chunk + 1) * self.chunk) if size else 0
        n = end - self.pos
        base = (self.source << 40) + (self.i << 20) + self.pos * self.doc_len
        tokens = (np.arange(n * self.doc_len, dtype=np.int64) + base).astype(np.int64)
        chunk = Chunk(self.source, self.i, end >= size, self.pos, end, "synthetic", {},
                      np.arange(self.pos + 1, end + 1, dtype=np.int64), np.zeros(n, dtype=np.int64),
                      token_fields={"input_ids": tokens}, offsets=np.arange(n + 1, dtype=np.int64) * self.doc_len,
                      skip_pending=self.skip)
        chunk = Split(self.piece_len)._apply_chunk(chunk) if n else chunk
        if chunk.skip_pending:
            chunk = drop_delivered(chunk, f"s{self.source}")
        self.skip = 0
        if end >= size:
            self.i, self.pos = self.i + 1, 0
        else:
            self.pos = end
        return chunk

    def get_state(self) -> dict:
        return {}


def make_mixer(specs, weights, by, flush_every, sentinels=0, positions=None, piece_len=4):
    policy, counters = FlushPolicy(flush_every), LaneCounters()
    streams = [SourceStream(s, f"s{s}", SyntheticChunks(s, sizes, doc_len, chunk, piece_len), 0, policy,
                            EmptySourceWatch(f"s{s}", 1000), counters)
               for s, (sizes, doc_len, chunk) in enumerate(specs)]
    node = MergeNode(lambda ctx: Mixer(weights, by), streams, policy, counters, LaneContext(0, 0))
    node.reset(None if positions is None else  # the merge's state at a sentinel: its sources' positions there
               {"sentinels": sentinels, "emitted": 0,
                "sources": {f"s{s}": position_state(p) for s, p in enumerate(positions)}})
    return node


source_st = st.tuples(st.lists(st.integers(0, 7), min_size=1, max_size=4).filter(any),
                      st.integers(1, 9), st.integers(1, 3))


@FAST
@given(specs=st.lists(source_st, min_size=1, max_size=3), weights=st.lists(st.integers(1, 9), min_size=3,
       max_size=3), by=st.sampled_from(["tokens", "documents"]), flush_every=st.integers(1, 3))
def test_merge_resumes_exactly_from_every_flush(specs, weights, by, flush_every):
    """Documents of up to 9 tokens, pieces of 4: flushes land while other sources are mid-document."""
    weights = [float(w) for w in weights[:len(specs)]]
    mixer = make_mixer(specs, weights, by, flush_every)
    items = [next(mixer) for _ in range(150)]
    flushes = [k for k, x in enumerate(items) if isinstance(x, Flush)]
    for k in flushes[:6]:
        f = items[k]
        fresh = make_mixer(specs, weights, by, flush_every, f.index, list(f.positions))
        assert all(len(p) == 3 for p in f.positions)
        cont = [next(fresh) for _ in range(len(items) - k - 1)]
        expect = items[k + 1:]
        assert [canon(x) if not isinstance(x, Flush) else x for x in cont] == \
               [canon(x) if not isinstance(x, Flush) else x for x in expect]


@FAST
@given(weights=st.lists(st.integers(1, 20), min_size=2, max_size=4), by=st.sampled_from(["tokens", "documents"]),
       doc_lens=st.lists(st.integers(1, 9), min_size=4, max_size=4))
@example(weights=[1, 1, 1, 7], by="documents", doc_lens=[1, 1, 1, 1])  # plain stride scheduling drifts by 2.1
def test_mixture_is_exact_over_every_prefix(weights, by, doc_lens):
    n = len(weights)
    specs = [([10_000], doc_lens[s], 4) for s in range(n)]
    piece = 3
    mixer = make_mixer(specs, [float(w) for w in weights], by, flush_every=10**6, piece_len=piece)
    taken = [0] * n
    total_w = sum(weights)
    for _ in range(400):
        doc = next(mixer)
        s = int(doc["input_ids"][0]) >> 40
        taken[s] += len(doc["input_ids"]) if by == "tokens" else 1
        total = sum(taken)
        for t in range(n):  # within about one piece of the exact share, at every prefix
            bound = 2 * piece if by == "tokens" else 1
            assert abs(taken[t] - total * weights[t] / total_w) <= bound


def test_mixer_picks_of_the_documented_example():
    mixer = make_mixer([([10_000], 1, 4), ([10_000], 1, 4)], [0.7, 0.3], "documents", flush_every=10**6)
    picks = ["web" if int(next(mixer)["input_ids"][0]) >> 40 == 0 else "code" for _ in range(20)]
    assert " ".join(picks[:10]) == "web code web web code web web code web web"
    assert picks[10:] == picks[:10]


def test_integer_strides():
    assert integer_strides([0.7, 0.3]) == [3, 7]
    assert integer_strides([1, 1, 2]) == [2, 2, 1]


# -- the stage buffer: workers finishing in any order ----------------------------------------------
class JitterExecutor:
    """Runs tasks on real threads with random delays, so they complete out of order."""

    kind, num_workers = "thread", 1

    def __init__(self, workers: int, seed: int) -> None:
        self.pool = ThreadPoolExecutor(workers)
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def submit(self, source: int, stage: int, task: int):
        with self.lock:
            delay = self.rng.random() * 0.003
        return self.pool.submit(lambda: (time.sleep(delay), task * task)[1])


@settings(max_examples=15, deadline=None)
@given(workers=st.integers(1, 6), depth=st.integers(1, 8), seed=st.integers(0, 1000))
def test_stage_buffer_returns_task_order(workers, depth, seed):
    executor = JitterExecutor(workers, seed)
    node = StageBuffer(IterableWrapper(range(60)), executor, 0, 0, depth)
    assert [next(node) for _ in range(60)] == [k * k for k in range(60)]
    executor.pool.shutdown()


# -- random whole recipes -----------------------------------------------------------------------------
def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_recipes_are_elastic(make_recipe, data):
    lanes = data.draw(st.sampled_from([2, 4, 8, 16]), "lanes")
    algorithm = data.draw(st.sampled_from(["best_fit", "first_fit", "wrap"]), "algorithm")
    recipe = make_recipe(
        seed=data.draw(st.integers(0, 2**31), "seed"), lanes=lanes,
        seq_len=data.draw(st.integers(8, 96), "seq_len"), batch_per_lane=data.draw(st.integers(1, 3), "bpl"),
        flush_every=data.draw(st.integers(1, 3), "flush_every"),
        pack={"algorithm": algorithm, "max_open_bins": data.draw(st.integers(1, 8), "bins")},
        mix={"by": data.draw(st.sampled_from(["tokens", "documents"]), "mix_by")},
        shuffle={"buffer": data.draw(st.integers(0, 6), "shuffle")},
        tokenizer={"add_bos": data.draw(st.booleans(), "bos")},
    )
    steps = 6
    plan = WorkPlan(recipe.to_pipeline())
    reference = global_hashes(recipe, 1, steps, plan=plan)
    w = data.draw(st.sampled_from(divisors(lanes)), "world")
    w2 = data.draw(st.sampled_from(divisors(lanes)), "resume_world")
    k = data.draw(st.integers(1, steps - 1), "resume_at")
    workers = data.draw(st.sampled_from([0, 1, 2]), "workers")
    assert global_hashes(recipe, w, steps, num_workers=workers, plan=plan) == reference
    assert global_hashes(recipe, w, steps, resume_at=k, resume_world_size=w2, plan=plan) == reference


@pytest.mark.parametrize("by", ["tokens", "documents"])
def test_whole_pipeline_mixture_tracks_weights(make_recipe, by):
    from zephon import build_loader
    recipe = make_recipe(lanes=4, flush_every=50, mix={"by": by})
    loader = build_loader(recipe)
    for _ in range(30):
        next(loader)
    share = loader.metrics()["source_token_share"]
    if by == "tokens":  # within one piece (seq_len tokens) per lane of 0.7 of what each lane took
        assert abs(share["web"] - 0.7) < 4 * 64 / loader.metrics()["doc_tokens"] + 1e-9
    else:
        assert share["web"] > 0 and share["code"] > 0

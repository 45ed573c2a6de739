"""Every node of a lane passes torchdata's own node-state conventions.

torchdata's ``test/nodes/utils.py: run_test_save_load_state`` (pytorch/data) checks a node under its
``Loader``: save at a midpoint and resume there; a second epoch after the resume; reload the initial
state; reload the end-of-epoch state with and without ``restart_on_stop_iteration``. :func:`check_save_load`
below makes the same checks, in the same order (written here, not copied), comparing items by content.
It runs over every node of a lane (sources, stage buffers, the merge, each accumulator, the packer), the
lane and the rank node, at several midpoints (before the first sentinel, between two, after many), and
under torchdata's ``Batcher`` and ``Prefetcher``. The pipeline's sources stop after one pass, so every
node's epoch ends; the lane and rank nodes never end (padding rows), so they are taken a fixed number of
items at a time (:class:`Take`, a node like torchdata's ``Header``).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from torchdata.nodes import BaseNode, Batcher, Loader, Prefetcher

import zephon as z
from zephon import merge_states
from zephon.plan import ChunkTask
from zephon.records import Chunk, Doc, Flush, Row


def canon(x: Any) -> Any:
    """An item as plain, comparable data (numpy arrays by their bytes)."""
    if isinstance(x, np.ndarray):
        return (x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, Flush):
        return ("flush", x.index, x.positions, x.carry, x.release)
    if isinstance(x, ChunkTask):
        return ("task", x.source, x.path, x.start, x.end, x.unit_seq, x.unit_end, x.empty, x.skip)
    if isinstance(x, Row):
        return ("row", canon(x.tokens[:x.fill]), tuple(x.seg_lens), tuple(x.tails), canon(x.payloads))
    if isinstance(x, Chunk):
        return ("chunk", x.source, x.unit_seq, x.start_cursor, x.end_cursor, canon(x.columns), canon(x.token_fields),
                canon(x.offsets), canon(x.resume_cursor), canon(x.resume_skip), canon(x.tails))
    if isinstance(x, Doc):
        return ("doc", canon(dict(x)), x.tail, x.source)
    if isinstance(x, dict):
        return tuple((k, canon(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return tuple(canon(v) for v in x)
    if hasattr(x, "numpy"):  # a torch tensor
        return canon(x.numpy())
    if hasattr(x, "to_pylist"):  # a TokenColumn
        return canon(x.to_pylist())
    return x


def check_save_load(node: BaseNode, midpoint: int) -> None:
    """torchdata's ``run_test_save_load_state`` conventions, items compared with :func:`canon`."""
    loader = Loader(node)
    initial = loader.state_dict()
    it = iter(loader)
    results = [canon(next(it)) for _ in range(midpoint)]
    middle = loader.state_dict()
    results += [canon(x) for x in it]
    end = loader.state_dict()
    second_epoch = [canon(x) for x in loader]
    assert len(results) > midpoint, "the node must go on past the midpoint for the check to mean something"

    loader.load_state_dict(middle)  # from the midpoint, then a whole epoch again
    assert [canon(x) for x in loader] == results[midpoint:]
    assert [canon(x) for x in loader] == second_epoch

    loader.load_state_dict(initial)  # from the start
    assert [canon(x) for x in loader] == results
    assert [canon(x) for x in loader] == second_epoch

    once = Loader(node, restart_on_stop_iteration=False)  # from the end of the first epoch
    once.load_state_dict(end)
    assert list(once) == []
    again = Loader(node)
    again.load_state_dict(end)
    assert [canon(x) for x in again] == second_epoch


class Take(BaseNode):
    """The first ``n`` items of a node that never ends (as torchdata's ``Header``); state nests its source's."""

    def __init__(self, source: BaseNode, n: int) -> None:
        super().__init__()
        self.source, self.n = source, n

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(None if initial_state is None else initial_state["source"])
        self.taken = 0 if initial_state is None else initial_state["taken"]

    def next(self) -> Any:
        if self.taken >= self.n:
            raise StopIteration
        self.taken += 1
        return next(self.source)

    def get_state(self) -> dict:
        return {"source": self.source.state_dict(), "taken": self.taken}


def with_src(record: dict) -> dict:
    return {**record, "src": "web"}


@pytest.fixture(scope="module")
def pipe(corpus_texts, sp_model) -> z.Pipeline:
    """Two sources of one pass each (so every node's epoch ends), a map, tokenize, split, mix, shuffle and
    best-fit packing with sentinels every chunk: the packer holds rows over sentinels and tops them up."""
    tok = z.tokenizer(str(sp_model))
    web = [{"text": t} for t in corpus_texts[:200]]
    code = [{"text": t} for t in corpus_texts[400:560]]
    return (z.Pipeline(seed=5, lanes=2, flush_every=1)
            .source("web", z.read.records(web, chunk_rows=4), weight=0.6, passes=1)
            .source("code", z.read.records(code, chunk_rows=4), weight=0.4, passes=1)
            .map(with_src, sources=["web"]).tokenize(tok).split(max_tokens=24).mix(by="tokens").shuffle(buffer=3)
            .pack(seq_len=48, max_open_bins=3).batch(rows_per_lane=2, partial="pad"))


def node_names(nodes) -> list[str]:
    names = [f"source:{s.source.spec.name}" for s in nodes.sources]
    names += [f"stage:{s}:{k}" for s, buffers in enumerate(nodes.stages) for k in range(len(buffers))]
    return names + ["merge"] + [f"accumulator:{n.name}" for n in nodes.accumulators]


def pick(nodes, name: str) -> BaseNode:
    kind, _, rest = name.partition(":")
    if kind == "source":
        return next(s for s in nodes.sources if s.source.spec.name == rest)
    if kind == "stage":
        s, k = map(int, rest.split(":"))
        return nodes.stages[s][k]
    if kind == "merge":
        return nodes.merge
    return next(n for n in nodes.accumulators if n.name == rest)


NAMES = ["source:web", "source:code", "stage:0:0", "stage:1:0", "merge", "accumulator:shuffle", "accumulator:pack"]


FRACTIONS = (0.02, 0.37, 0.81)  # of the node's epoch: near its start, and twice between later sentinels


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_every_node_of_a_lane_passes_the_save_load_conventions(pipe, name, fraction):
    nodes = pipe.lane_nodes(1)
    try:
        assert node_names(nodes) == NAMES
        node = pick(nodes, name)
        epoch = sum(1 for _ in Loader(node))
        check_save_load(node, max(1, int(fraction * epoch)))
    finally:
        nodes.close()


def test_the_midpoints_fall_inside_segments(pipe):
    """For the packer (whose state holds a row over a sentinel), the later midpoints above fall several rows
    past a sentinel, with many sentinels before them: the checks restore mid-segment states."""
    nodes = pipe.lane_nodes(1)
    try:
        items = list(Loader(nodes.rows))
        flushes = [k for k, x in enumerate(items) if isinstance(x, Flush)]
        assert len(flushes) >= 20 and any(x.carry for x in items if isinstance(x, Flush))
        for fraction in FRACTIONS[1:]:
            m = int(fraction * len(items))
            assert sum(k < m for k in flushes) >= 5 and m - 1 not in flushes and m not in flushes
    finally:
        nodes.close()


@pytest.mark.parametrize("wrap", ["batcher", "prefetcher"])
def test_nodes_under_torchdata_batcher_and_prefetcher(pipe, wrap):
    nodes = pipe.lane_nodes(0)
    try:
        node = Batcher(nodes.rows, batch_size=3, drop_last=False) if wrap == "batcher" else \
            Prefetcher(nodes.merge, prefetch_factor=4)
        check_save_load(node, 5)
    finally:
        nodes.close()


def test_nodes_with_worker_threads(pipe):
    nodes = pipe.lane_nodes(1, num_workers=2)
    try:
        check_save_load(nodes.rows, 9)
    finally:
        nodes.close()


@pytest.mark.parametrize("midpoint", [2, 9])
def test_the_lane_and_the_rank_pass_them(pipe, midpoint):
    loader = pipe.build()
    try:
        from zephon.engine.lane import Lane

        lane = loader._host._lanes[1]
        assert isinstance(lane, Lane)
        check_save_load(Take(lane, 30), midpoint)
        check_save_load(Take(loader.node, 30), midpoint)
    finally:
        loader.close()


def test_reset_none_starts_over_with_empty_buffers(pipe):
    """reset(None) in the middle of a segment: the shuffle buffer's and the packer's contents are gone, the
    node starts from the beginning."""
    nodes = pipe.lane_nodes(0)
    try:
        first = [canon(next(nodes.rows)) for _ in range(12)]
        nodes.rows.reset(None)
        assert [canon(next(nodes.rows)) for _ in range(12)] == first
        nodes.accumulators[0].reset(None)  # the shuffle, alone: its buffer too
        alone = [canon(next(nodes.accumulators[0])) for _ in range(5)]
        fresh = pipe.lane_nodes(0)
        assert alone == [canon(next(fresh.accumulators[0])) for _ in range(5)]
        fresh.close()
    finally:
        nodes.close()


def test_states_are_json_and_nested_as_batcher_nests_its_source(pipe):
    nodes = pipe.lane_nodes(0)
    try:
        for _ in range(9):
            next(nodes.rows)
        state = nodes.rows.state_dict()
        assert json.loads(json.dumps(state)) == state
        assert set(state) == {"source", "sentinel", "emitted"}
        assert set(state["source"]) == {"source", "sentinel", "emitted"}  # the shuffle's, at the packer's sentinel
        merge = state["source"]["source"]
        assert set(merge) == {"sentinels", "sources", "emitted"} and set(merge["sources"]) == {"web", "code"}
        assert merge["sources"]["web"]["source"].keys() == {"unit_seq", "cursor", "skip"}  # stage buffer > source
    finally:
        nodes.close()


def test_a_bad_node_state_is_a_state_error(pipe):
    nodes = pipe.lane_nodes(0)
    try:
        state = nodes.rows.state_dict()
        with pytest.raises(z.StateError, match="operator 'pack'.*'sentinel'"):
            nodes.rows.reset({"source": {}, "emitted": 0})
        with pytest.raises(z.StateError, match="merge: 'sources' must map every source"):
            nodes.merge.reset({"sentinels": 0, "emitted": 0, "sources": {"web": {}}})
        with pytest.raises(z.StateError, match="items came after its last sentinel, but the segment after it holds only"):
            nodes.rows.reset({**state, "emitted": 10**6})
            next(nodes.rows)
    finally:
        nodes.close()


def test_merge_states_takes_states_as_torchdata_wraps_them(pipe):
    """Two ranks' loaders under torchdata's Loader: their wrapped states merge (wrapped alike) and resume on
    one rank, elastically (2 -> 1), where the plain loader states would."""
    ranks = [pipe.build(rank=r, world_size=2) for r in range(2)]
    try:
        loaders = [Loader(r.node) for r in ranks]
        its = [iter(ld) for ld in loaders]
        for _ in range(4):
            for it in its:
                next(it)
        wrapped = [ld.state_dict() for ld in loaders]
        assert all(set(w) == {"root", "num_yielded"} for w in wrapped)
        merged = merge_states(wrapped)
        assert set(merged) == {"root", "num_yielded"} and merged["num_yielded"] == 4
        assert merged["root"] == merge_states([r.state_dict() for r in ranks])
        want = z.global_digest([next(it) for it in its])
        one = pipe.build(rank=0, world_size=1)
        resumed = Loader(one.node)
        resumed.load_state_dict(merged)
        assert z.global_digest([next(iter(resumed))]) == want
        plain = pipe.build()
        plain.load_state_dict(merged)  # the loader unwraps it too
        assert z.global_digest([next(plain)]) == want
        batched = merge_states([{"source": w} for w in wrapped])
        assert batched == {"source": merged}
        with pytest.raises(z.StateError, match="wrapped as"):
            merge_states([wrapped[0], wrapped[1]["root"]])
        one.close(), plain.close()
    finally:
        for r in ranks:
            r.close()

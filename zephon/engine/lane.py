"""One lane: its operator chain, its rows per step, and its tiny state.

The chain is built from a :class:`LaneProgram` (the compiled pipeline): per source, a
:class:`~zephon.engine.sources.ChunkSource` and one :class:`~zephon.engine.sources.StageBuffer` per
stateless stage; the :class:`~zephon.engine.nodes.MergeNode` where the sources meet; one
:class:`~zephon.engine.nodes.AccumulatorNode` per operator after it (the packer last). :class:`Lane`
takes ``rows_per_lane`` rows per global step. It watches the flush sentinels go by, so it always knows
the position of the last sentinel *before the last row it delivered*, that sentinel's ``carry`` and how
many rows it has delivered since. That is the lane's whole checkpoint (:class:`~zephon.state.lane.LaneState`):
to resume, the chain is rebuilt fresh at the sentinel's positions, the packer drops ``carry`` tokens,
and the already-delivered rows are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from torchdata.nodes import BaseNode

from ..ops.base import LaneContext
from ..ops.batch import RecordBlock, RecordRow, RecordSpan
from ..plan import WorkPlan
from ..records import INPUT_IDS, Flush, Row
from ..state.lane import LaneState, parse_lane_state
from ..errors import OperatorError, StateError
from .clock import LaneClock
from .counters import LaneCounters
from .executors import Executor
from .nodes import EMITTED, SENTINEL, SENTINELS, SOURCE, SOURCES, AccumulatorNode, MergeNode
from .sentinels import FlushPolicy
from .sources import ChunkSource, EmptySourceWatch, ReadAhead, SourceStream, StageBuffer, position_state
from .stages import StageProgram


@dataclass
class LaneProgram:
    """Everything a lane needs to build its chain, compiled once per process from a pipeline."""

    seed: int
    lanes: int
    names: list[str]
    plan: WorkPlan
    stages: StageProgram
    stage_kinds: list[list[str | None]]  # per source, per stage: executor kind (None: the loader's runner)
    merge: Callable[[LaneContext], Any]
    lane_ops: list[tuple[str, Callable[[LaneContext], Any]]]  # (name, factory) after the merge, the rows' last
    rows_per_lane: int
    flush_every: int
    seq_len: int
    flush_by: str = "chunks"
    max_empty_units: list[int] = field(default_factory=list)
    token_fields: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # name -> (dtype, default)
    finite: bool = False  # some source stops after its passes: lanes end, the loader agrees on when
    partial: str = "drop"  # the last global batch some lanes cannot fill: "drop" it, or "pad" it
    records: bool = False  # no pack(): a row is one record (zephon.ops.batch), seq_len is 1

    def empty_row(self) -> Any:
        """A row of padding only: what an ended lane delivers until every lane has ended (or the batch is
        dropped); it has every per-token field the pipeline's rows have."""
        if self.records:
            return RecordRow(None)
        fields = self.token_fields or {INPUT_IDS: (np.int32, 0)}
        return Row(self.seq_len, {k: np.zeros(self.seq_len, dtype=dt) for k, (dt, _) in fields.items()})

    def parse_state(self, d: Any, lane: int, check_plan: bool = True) -> LaneState:
        return parse_lane_state(d, lane, self.names, self.seq_len, self.plan if check_plan else None)


REPLAY_PRIME_MAX = 256  # chunks per source put in flight at once for a resumed lane's replay


@dataclass
class LaneNodes:
    """One lane's chain of torchdata nodes (see :func:`lane_nodes`): per source a :class:`ChunkSource` under
    one :class:`StageBuffer` per stateless stage, the :class:`MergeNode` where the sources meet, one
    :class:`AccumulatorNode` per operator after it (the last makes the lane's rows), and the lane's step
    clock. Each node iterates on its own (``reset(None)`` starts at the lane's beginning) with honest
    ``state_dict()``/``reset(state)``."""

    sources: list[ChunkSource]
    stages: list[list[StageBuffer]]
    merge: MergeNode
    accumulators: list[AccumulatorNode]
    clock: LaneClock
    counters: LaneCounters
    executor: Executor | None = None  # the stateless stages' executor, when these nodes own it (close())

    def close(self) -> None:
        """Stop the executor these nodes own (worker threads), if any."""
        if self.executor is not None:
            self.executor.close()

    @property
    def rows(self) -> AccumulatorNode:
        """The last node: the lane's rows and its sentinels."""
        return self.accumulators[-1]

    def all(self) -> list[BaseNode]:
        """Every node, upstream first: the sources' chains, the merge, the accumulators."""
        chains = [node for source, stages in zip(self.sources, self.stages) for node in (source, *stages)]
        return [*chains, self.merge, *self.accumulators]


def lane_nodes(program: LaneProgram, lane: int, executor_for: Callable[[int, int], Executor],
               depth: "int | ReadAhead" = 1, events: list | None = None,
               counters: LaneCounters | None = None) -> LaneNodes:
    """Build ``lane``'s chain of nodes for ``program`` (stateless stages on ``executor_for(source, stage)``,
    ``depth`` chunks in flight per stage; ``events``: the mixture interventions in force, shared)."""
    counters = counters if counters is not None else LaneCounters()
    clock = LaneClock(program.rows_per_lane, events)
    ctx = LaneContext(program.seed, lane, 0, tuple(program.names), 0, clock, -1)
    policy = FlushPolicy(program.flush_every, program.flush_by)
    sources, stages, streams = [], [], []
    for s, (src, name) in enumerate(zip(program.plan.sources, program.names)):
        node: BaseNode = ChunkSource(src, lane)
        sources.append(node)
        buffers = []
        for k in range(program.stages.n_stages(s)):
            node = StageBuffer(node, executor_for(s, k), s, k, depth, name)
            buffers.append(node)
        stages.append(buffers)
        streams.append(SourceStream(s, name, node, len(buffers), policy,
                                    EmptySourceWatch(name, program.max_empty_units[s]), counters))
    merge = MergeNode(program.merge, streams, policy, counters, ctx)
    chain: BaseNode = merge
    accumulators = []
    for i, (name, factory) in enumerate(program.lane_ops):
        chain = AccumulatorNode(chain, factory, name, ctx, counts_rows=i == len(program.lane_ops) - 1)
        accumulators.append(chain)
    return LaneNodes(sources, stages, merge, accumulators, clock, counters)


def chain_state(nodes: LaneNodes, state: LaneState) -> dict[str, Any]:
    """The state of a lane's last node that restarts the chain right after ``state``'s sentinel: every node
    at that sentinel, nothing emitted since (the lane replays its delivered rows itself)."""
    s = state.sentinels
    upstream: dict[str, Any] = {SENTINELS: s, EMITTED: 0, SOURCES: {
        st.name: position_state(state.positions[st.name], st.stages) for st in nodes.merge.streams}}
    last = len(nodes.accumulators) - 1
    for i in range(last + 1):
        sentinel = {"index": s, "carry": 0, "release": -1}
        if i == last:
            sentinel.update(carry=state.carry, release=state.clock[1], rows=state.clock[0])
        upstream = {SOURCE: upstream, SENTINEL: sentinel, EMITTED: 0}
    return upstream


class Lane(BaseNode[list[Row]]):
    """Yields the ``rows_per_lane`` rows of ``lane`` for each global step.

    Its state is the compact :class:`~zephon.state.lane.LaneState` (what a checkpoint holds per lane): its
    chain's state at the last sentinel before its last delivered row, and the rows delivered since."""

    def __init__(self, program: LaneProgram, lane: int, executor_for: Callable[[int, int], Executor],
                 depth: "int | ReadAhead", events: list | None = None) -> None:
        super().__init__()
        self.program, self.lane, self.executor_for, self.depth = program, lane, executor_for, depth
        self.events = events if events is not None else []  # mixture interventions (shared with the loader)
        self.nodes = lane_nodes(program, lane, executor_for, depth, self.events)
        self._rows = self.nodes.rows
        self._streams = self.nodes.merge.streams
        self._counters = self.nodes.counters
        self.clock = self.nodes.clock
        self._state = LaneState.initial(program.names)
        self.blocks = False  # the batched record-rows path (set at reset, once the operators are built)

    @property
    def counters(self) -> LaneCounters:
        """What the lane did since it was built (metrics), exact to the last document taken."""
        for stream in self._streams:
            stream.settle()
        return self._counters

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:  # torchdata's contract: reset(None) starts from the beginning
            self._state = LaneState.initial(self.program.names)
        else:
            self._state = initial_state if isinstance(initial_state, LaneState) else \
                self.program.parse_state(initial_state, self.lane)
        self._rows.reset(chain_state(self.nodes, self._state) if self._state.sentinels else None)
        # the batched record-rows path (RecordSpan, RecordBlock: zephon.ops.batch): nothing per record between
        # the merge and the rows, and a merge that takes runs of one source
        self.blocks = self.program.records and len(self.nodes.accumulators) == 1 and \
            hasattr(self._rows.acc, "push_span") and hasattr(self.nodes.merge.merge, "take_run")
        self._segment_start = self._state  # state at the last sentinel seen
        self._since = 0  # rows emitted after that sentinel
        self.ended = False  # the chain has no more rows: the lane delivers padding rows
        self._to_skip = self._state.rows_since_flush  # replay-and-skip, on the first next()
        self._taken_base = (0,) * len(self._streams)  # chunks taken by the sources at the last sentinel
        self._units_at_row = 0  # the lane's units taken when it last made a row (see _no_row_for_ever)

    def prime(self, limit: int | None = None) -> None:
        """Submit the first stateless tasks of every source now (a host calls this for all its lanes
        before pulling any, so that workers start on every lane at once); ``limit`` per (source, stage)."""
        self._rows.prime(limit)

    def prime_replay(self) -> None:
        """A resumed lane that must replay rows since its last sentinel: submit the chunks of that segment
        now (the state's ``replay``: how many each source had given), so that the workers re-read and
        re-tokenize every lane's segment in parallel. A hint: any value gives the same rows."""
        if self._to_skip and self._state.replay:
            self._rows.prime_replay([min(n, REPLAY_PRIME_MAX) for n in self._state.replay])

    def _start_segment(self, item: Flush) -> None:  # a sentinel went by
        self._segment_start = LaneState(item.index, dict(zip(self.program.names, item.positions)), 0,
                                        item.carry, (self.clock.rows, item.release))
        self._since = 0
        self._taken_base = item.taken or self._taken_base

    def _next_row(self) -> Row:
        while True:
            if self.ended:
                self._since += 1
                return self.program.empty_row()
            try:
                item = next(self._rows)
            except StopIteration:  # every source of the lane has stopped, and the packer emitted all it held
                self.ended = True
                continue
            if isinstance(item, Flush):
                if self._to_skip:
                    raise StateError(f"lane {self.lane}: the state says {self._state.rows_since_flush} rows were "
                                     f"delivered after its last sentinel, but the segment after that sentinel "
                                     f"holds only {self._since}. The state was edited or does not belong to this "
                                     f"data; resume from the state as it was written.")
                self._no_row_for_ever()
                self._start_segment(item)
                continue
            self._since += 1
            self._units_at_row = self._counters.units
            return item

    def _no_row_for_ever(self) -> None:
        """Refuse a lane of endless sources that takes more units than :class:`EmptySourceWatch` allows every
        source together without making a row: an operator after the merge drops every record (before the
        merge, the watch refuses a source that gives nothing), and the lane would otherwise read for ever."""
        program = self.program
        taken = self._counters.units - self._units_at_row
        if program.finite or taken <= sum(program.max_empty_units):
            return
        names = [name for name, _ in program.lane_ops[:-1]]
        raise OperatorError(f"lane {self.lane} took {taken} units of its sources without making a row: the "
                            f"operators after the merge ({', '.join(names) or 'none'}) drop every record they are "
                            f"given. Check them on a few records (pipeline.validate()), or declare a filter before "
                            f"the merge, where a source that gives no document is an error naming it.")

    def skip_delivered(self) -> None:
        """Replay the rows the state says were delivered since its sentinel (done by the first next())."""
        if self._to_skip:
            while self._to_skip:
                self._next_row()
                self._to_skip -= 1
            self.counters.clear()  # the replayed work was counted by the run that wrote the checkpoint
            self._units_at_row = 0

    @property
    def decided_step(self) -> int:
        """The latest step the lane's merge has decided documents for (see :mod:`zephon.engine.clock`)."""
        return self.clock.decided

    def _next_block(self) -> RecordBlock:
        """The step's rows on the batched record-rows path: spans of records, then padding once ended."""
        need, parts = self.program.rows_per_lane, []
        rows = self._rows
        while need:
            if self.ended:
                parts.append(need)
                self._since += need
                break
            try:
                item = rows.next_block(need)
            except StopIteration:
                self.ended = True
                continue
            if type(item) is Flush:
                self._start_segment(item)
                continue
            n = len(item) if type(item) is RecordSpan else 1
            parts.append(item)
            need -= n
            self._since += n
        return RecordBlock(parts)

    def next(self) -> Sequence[Row]:
        """This lane's rows of the next step: a list, or on the batched record-rows path a
        :class:`~zephon.ops.batch.RecordBlock` (a sequence of the same rows, not a ``list``)."""
        self.skip_delivered()
        if self.blocks:
            rows: Any = self._next_block()
        else:
            rows = [self._next_row() for _ in range(self.program.rows_per_lane)]
        self._counters.rows += len(rows)
        start = self._segment_start
        replay = tuple(s.taken - b for s, b in zip(self._streams, self._taken_base)) if self._since else ()
        self._state = LaneState(start.sentinels, start.positions, self._since, start.carry, start.clock, replay)
        return rows

    def get_state(self) -> dict[str, Any]:
        return self._state.to_dict()


READ_AHEAD_BASE, READ_AHEAD_MOST = 2, 8  # with workers, unless build(prefetch=N) fixes the depth


def lane_depth(num_workers: int, bursty: bool = False) -> ReadAhead | int:
    """Chunks in flight per (lane, source, stage), for one loader's lanes: enough to keep workers busy,
    bounded for memory. With workers, 2; for lanes that take heavy tasks in bursts (``bursty``: packing
    decoded images), 2 while no lane waits for the workers, up to 8 while they do
    (:class:`~zephon.engine.sources.ReadAhead`, one per loader: pass the same one to all its lanes). Light
    tasks gain nothing from more in flight (fetch-only pipelines lost 6-8% at 2 workers: BENCHMARKS.md 8e)."""
    if not num_workers:
        return 1
    return ReadAhead(READ_AHEAD_BASE, READ_AHEAD_MOST) if bursty else READ_AHEAD_BASE


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

from dataclasses import dataclass, field
from typing import Any, Callable

from torchdata.nodes import BaseNode

from ..ops.base import LaneContext, call_factory
from ..plan import WorkPlan
from ..records import Flush, Row
from ..state.lane import LaneState, StateError, parse_lane_state
from .counters import LaneCounters
from .executors import Executor
from .nodes import AccumulatorNode, MergeNode
from .sentinels import FlushPolicy
from .sources import ChunkSource, EmptySourceWatch, SourceStream, StageBuffer
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
    steps: list[tuple[str, Callable[[LaneContext], Any]]]  # (name, factory) after the merge, the packer last
    rows_per_lane: int
    flush_every: int
    seq_len: int
    max_empty_units: list[int] = field(default_factory=list)

    def context(self, lane: int, state: LaneState) -> LaneContext:
        return LaneContext(self.seed, lane, state.sentinels, tuple(self.names), state.carry)

    def parse_state(self, d: Any, lane: int, check_plan: bool = True) -> LaneState:
        return parse_lane_state(d, lane, self.names, self.seq_len, self.plan if check_plan else None)


class Lane(BaseNode[list[Row]]):
    """Yields the ``rows_per_lane`` rows of ``lane`` for each global step."""

    def __init__(self, program: LaneProgram, lane: int, executor_for: Callable[[int, int], Executor],
                 depth: int) -> None:
        super().__init__()
        self.program, self.lane, self.executor_for, self.depth = program, lane, executor_for, depth
        self.counters = LaneCounters()
        self._state = LaneState.initial(program.names)

    # -- construction ---------------------------------------------------------------------------
    def _build(self, state: LaneState) -> BaseNode:
        p = self.program
        ctx = p.context(self.lane, state)
        policy = FlushPolicy(p.flush_every)
        streams = []
        for s, (src, name) in enumerate(zip(p.plan.sources, p.names)):
            position = state.positions[name]
            node: BaseNode = ChunkSource(src, self.lane, position)
            for k in range(p.stages.n_stages(s)):
                node = StageBuffer(node, self.executor_for(s, k), s, k, self.depth)
            streams.append(SourceStream(s, name, node, position, policy,
                                        EmptySourceWatch(name, p.max_empty_units[s]), self.counters))
        chain: BaseNode = MergeNode(call_factory(p.merge, ctx), streams, policy, state.sentinels, self.counters)
        for name, factory in p.steps:
            chain = AccumulatorNode(chain, call_factory(factory, ctx), name)
        return chain

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self._state = initial_state if isinstance(initial_state, LaneState) else \
                self.program.parse_state(initial_state, self.lane)
        self._rows = self._build(self._state)
        self._rows.reset(None)
        self._segment_start = self._state  # state at the last sentinel seen
        self._since = 0  # rows emitted after that sentinel
        self._to_skip = self._state.rows_since_flush  # replay-and-skip, on the first next()

    def prime(self) -> None:
        """Submit the first stateless tasks of every source now (a host calls this for all its lanes
        before pulling any, so that workers start on every lane at once)."""
        self._rows.prime()

    def _next_row(self) -> Row:
        while True:
            item = next(self._rows)
            if isinstance(item, Flush):
                if self._to_skip:
                    raise StateError(f"lane {self.lane}: the state says {self._state.rows_since_flush} rows were "
                                     f"delivered after its last sentinel, but the segment after that sentinel "
                                     f"holds only {self._since}. The state was edited or does not belong to this "
                                     f"data; resume from the state as it was written.")
                self._segment_start = LaneState(item.index, dict(zip(self.program.names, item.positions)), 0,
                                                item.carry)
                self._since = 0
                continue
            self._since += 1
            return item

    def next(self) -> list[Row]:
        if self._to_skip:
            while self._to_skip:
                self._next_row()
                self._to_skip -= 1
            self.counters.clear()  # the replayed work was counted by the run that wrote the checkpoint
        rows = [self._next_row() for _ in range(self.program.rows_per_lane)]
        c = self.counters
        for row in rows:
            c.rows += 1
            c.pad_tokens += row.free
            if row.flushed:
                c.flush_pad_tokens += row.free
        start = self._segment_start
        self._state = LaneState(start.sentinels, start.positions, self._since, start.carry, start.events)
        return rows

    def get_state(self) -> dict[str, Any]:
        return self._state.to_dict()


def lane_depth(num_workers: int) -> int:
    """Chunks in flight per (lane, source, stage): enough to keep workers busy, bounded for memory."""
    return 2 if num_workers else 1


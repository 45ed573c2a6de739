"""One lane: its operator chain, its ``batch_per_lane`` rows per step, and its tiny state.

The chain is ``chunks -> reorder buffer -> mix (+split) -> shuffle -> pack`` and this node takes
``batch_per_lane`` rows per global step. It watches the flush sentinels go by, so it always knows
the position of the last sentinel *before the last row it delivered*, that sentinel's ``carry`` and
how many rows it has delivered since. That is the lane's whole checkpoint (:class:`LaneState`): to
resume, the chain is rebuilt fresh at the sentinel's positions, the packer drops ``carry`` tokens,
and the already-delivered rows are skipped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from torchdata.nodes import BaseNode

from ..plan import WorkPlan
from ..recipe import Recipe
from ..runner import Runner
from .chunks import ChunkSource, ReorderBuffer
from .items import Flush, LaneCounters, Row
from .mix import Mixer
from .pack import Packer
from .shuffle import ShuffleBuffer


@dataclass(frozen=True)
class LaneState:
    """A lane's resumable state: where its last flush sentinel stood, and rows delivered since.

    ``epoch``: number of sentinels before that point; ``positions``: per source name,
    ``[unit_seq, cursor, offset]`` of its reader (cursor -1: start of the unit; offset: tokens of the
    document at the cursor already taken, when a long document was cut there); ``rows_since_flush``:
    rows of this lane delivered to the trainer after that sentinel; ``carry``: tokens after that
    sentinel that went into the row before it (the packer's top-up, so a flush costs no padding).
    """

    epoch: int
    positions: dict[str, list[int]]
    rows_since_flush: int
    carry: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "LaneState":
        return LaneState(int(d["epoch"]), {k: [int(v[0]), int(v[1]), int(v[2])] for k, v in d["positions"].items()},
                         int(d["rows_since_flush"]), int(d["carry"]))

    @staticmethod
    def initial(names: Sequence[str]) -> "LaneState":
        return LaneState(0, {n: [0, -1, 0] for n in names}, 0)


class Lane(BaseNode[list[Row]]):
    """Yields the ``batch_per_lane`` rows of ``lane`` for each global step."""

    def __init__(self, recipe: Recipe, plan: WorkPlan, runner: Runner, lane: int, prefetch: int) -> None:
        super().__init__()
        self.recipe, self.plan, self.runner, self.lane, self.prefetch = recipe, plan, runner, lane, prefetch
        self.names = [s.spec.name for s in plan.sources]
        self.counters = LaneCounters()
        self._state = LaneState.initial(self.names)

    # -- construction ---------------------------------------------------------------------------
    def _build(self, state: LaneState) -> BaseNode:
        r = self.recipe
        streams = self._streams = [ReorderBuffer(ChunkSource(src, self.lane), self.runner, self.prefetch)
                                   for src in self.plan.sources]
        positions = [tuple(state.positions[n]) for n in self.names]
        self._mixer = Mixer(streams, [s.weight for s in r.sources], r.mix_by, r.flush_every, state.epoch,
                            positions, self.counters, self.names,
                            [2 * len(s.units) + r.lanes for s in self.plan.sources], r.split_len)
        node: BaseNode = self._mixer
        if r.shuffle_buffer > 0:
            node = ShuffleBuffer(node, r.shuffle_buffer, r.seed, self.lane, state.epoch)
        return Packer(node, r.seq_len, r.pack.algorithm, r.pack.max_open_bins, self.counters, skip=state.carry)

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            missing = set(self.names) - set(initial_state["positions"])
            if missing:
                raise ValueError(f"lane {self.lane}: the state has no position for sources {sorted(missing)}")
            self._state = LaneState.from_dict(initial_state)
        self._rows = self._build(self._state)
        self._epoch_start = self._state  # state at the last sentinel seen
        self._since = 0  # rows emitted by the packer after that sentinel
        self._to_skip = self._state.rows_since_flush  # replay-and-skip, on the first next()

    def prime(self) -> None:
        """Submit the first chunk tasks of every source now (a host calls this for all its lanes
        before pulling any, so that workers start on every lane at once)."""
        self._mixer.reset(None)  # otherwise done lazily by the first next(); places the streams
        for stream in self._streams:
            stream.prime()

    def _next_row(self) -> Row:
        while True:
            item = next(self._rows)
            if isinstance(item, Flush):
                self._epoch_start = LaneState(item.epoch, dict(zip(self.names, map(list, item.positions))), 0,
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
        rows = [self._next_row() for _ in range(self.recipe.batch_per_lane)]
        start = self._epoch_start
        self._state = LaneState(start.epoch, start.positions, self._since, start.carry)
        return rows

    def get_state(self) -> dict[str, Any]:
        return self._state.to_dict()

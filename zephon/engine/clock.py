"""The lane's step clock: which training step a mixing decision belongs to, deterministically.

A schedule or an intervention says "from step s"; the mixer decides ahead of delivery (documents wait in
the shuffle buffer and in the packer's open rows), and its decisions must not depend on timing, ranks or
workers, nor change when a lane is rebuilt at a sentinel. So the clock is made of the lane's own counts,
all of them recorded at sentinels:

- ``T``: the tokens the lane's merge has taken so far (counted by the merge, exact on replay: the
  sentinel carries it);
- ``C_j``: the rows the lane had received when sentinel ``j`` reached it (the lane's delivered rows are
  exactly ``step * rows_per_lane``, so rows are steps).

A decision in segment ``j`` (after sentinel ``j``) estimates the rows delivered when its document will
be, from the last sentinel the lane has certainly seen by then, ``j - 1``::

    step = floor((C_{j-1} + (T - T_{j-1}) / seq_len) / rows_per_lane)

The lane has always seen sentinel ``j - 1`` before the first decision of segment ``j`` (the packer holds
at most one sentinel, and releases it before it pulls the next segment), in the first run and in any
replay, so the estimate is the same everywhere. Between two anchors it leads the step at which the
document is delivered by at most the tokens buffered downstream (shuffle buffer, open rows) and trails
it by at most the padding of one segment: a bound, with no drift over a run (BENCHMARKS.md measures it).
"""

from __future__ import annotations

from typing import Any


class ClockError(RuntimeError):
    """A decision whose anchor sentinel the lane has not seen: an accumulator held a sentinel too long."""


class LaneClock:
    """Shared by a lane's merge (which counts tokens) and the lane (which records rows at sentinels)."""

    def __init__(self, seq_len: int, rows_per_lane: int, events: list | None = None) -> None:
        self.seq_len, self.rows_per_lane = seq_len, rows_per_lane
        self.mixed = 0  # T: tokens taken by the merge
        self.rows_at: dict[int, int] = {-1: 0, 0: 0}  # C_j: rows received when sentinel j reached the lane
        self.mixed_at: dict[int, int] = {-1: 0, 0: 0}  # T_j: tokens taken when sentinel j was emitted
        self.segment = 0  # the merge's current segment (the last sentinel it emitted)
        self.events: list[tuple[int, dict]] = events if events is not None else []  # interventions (at_step, weights)
        self.decision_mixed: int | None = None  # T at the segment's latest decision (None: none yet)
        self._decided_before = -1  # the latest step decided in the segments before this one

    def start(self, segment: int, rows: int, mixed: int, prev_rows: int, prev_mixed: int) -> None:
        """A lane rebuilt at sentinel ``segment``: its counts there and at the sentinel before."""
        self.segment, self.mixed = segment, mixed
        self.rows_at = {segment: rows, segment - 1: prev_rows}
        self.mixed_at = {segment: mixed, segment - 1: prev_mixed}

    def step(self) -> int:
        """The step the merge's next decision belongs to (see the module docstring)."""
        return self.step_at(self.mixed)

    def step_at(self, mixed: int) -> int:
        """The step of a decision of the current segment taken when the merge had taken ``mixed`` tokens."""
        j = self.segment - 1
        if j not in self.rows_at:
            raise ClockError(f"segment {self.segment}: the lane has not yet seen sentinel {j}; an accumulator "
                             f"held a flush sentinel past the next segment's first decision, which schedules "
                             f"and interventions cannot allow")
        rows = self.rows_at[j] + (mixed - self.mixed_at[j]) / self.seq_len
        return int(rows // self.rows_per_lane)

    def close_segment(self, segment: int) -> None:
        """The merge emitted sentinel ``segment``: fold the ending segment's decisions into :attr:`decided`
        and start counting the next one's."""
        self._decided_before = self.decided
        self.decision_mixed = None
        self.mixed_at[segment] = self.mixed
        self.segment = segment

    @property
    def decided(self) -> int:
        """The latest step a decision was made for (-1: none). The merge only records ``T`` at each decision
        (:attr:`decision_mixed`): within a segment the step grows with ``T``, so the segment's latest
        decision has its latest step, computed here when asked (an intervention) rather than per document."""
        if self.decision_mixed is None:
            return self._decided_before
        return max(self._decided_before, self.step_at(self.decision_mixed))

    def forget_before(self, segment: int) -> None:
        """Drop anchors no decision can need any more."""
        for d in (self.rows_at, self.mixed_at):
            for k in [k for k in d if k < segment - 1]:
                del d[k]

    def snapshot(self, segment: int) -> list[int]:
        """``[C_j, T_j, C_{j-1}, T_{j-1}]`` of sentinel ``j = segment``: what a lane state keeps."""
        return [self.rows_at[segment], self.mixed_at[segment], self.rows_at[segment - 1], self.mixed_at[segment - 1]]

    def describe(self) -> dict[str, Any]:
        return {"mixed": self.mixed, "segment": self.segment}

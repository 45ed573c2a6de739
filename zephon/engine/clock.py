"""The lane's step clock: which training step a mixing decision belongs to, exactly.

A schedule point or an intervention says "from step s". The mixer decides ahead of delivery (documents
wait in the shuffle buffer and in the packer's open rows), and its decisions must not depend on timing,
ranks or workers, nor change when a lane is rebuilt at a sentinel. The clock is the lane's own count of
**rows completed**: ``R``, the rows its last operator (the packer, or the record rows of a pipeline
without ``pack()``) has emitted and the lane has received. A decision made when ``R`` rows are complete
belongs to step ``floor(R / rows_per_lane)``.

Why that is exact. A lane's chain is pulled: its merge decides only while the lane asks for its next row
and the packer has nothing ready, so at every decision every row emitted so far has reached the lane. A
document decided at ``R`` can only land in row ``R`` or later (completed rows never change), so:

- every row of the steps before ``s`` (rows ``< s * rows_per_lane``) holds only documents decided for
  steps before ``s``: a change for step ``s`` leaves those global batches byte-identical;
- once the lane has received its rows of the steps before ``s``, every decision is for step ``s`` or
  later: it follows the change. The delivered mixture lags only by what the lane already holds then (the
  shuffle buffer, the packer's open rows), never by a drift.

Replay from a sentinel. A lane rebuilt at sentinel ``j`` starts with ``R = C_j`` (the rows it had received
when the sentinel reached it), except where the packer held its last part-filled row over the sentinel to
top it up with the next segment's first tokens (:mod:`zephon.ops.pack`). Then the first decisions after
the sentinel were made with that row still open, at ``C_j - 1``; the rebuilt packer does not emit the row
again (it drops its ``carry`` tokens instead), so it counts it complete where the original released it:
after the same number of documents (the sentinel's ``release``), or at the next sentinel. Both numbers
are in the lane state, so every replay assigns every decision to the same step as the first run.
"""

from __future__ import annotations

from typing import Any


class LaneClock:
    """Shared by a lane (which counts the rows it receives), its merge (which records when it decides) and,
    on a resume, its packer (which completes the row it held over the sentinel)."""

    __slots__ = ("rows_per_lane", "rows", "events", "decision_rows")

    def __init__(self, rows_per_lane: int, events: list | None = None, rows: int = 0) -> None:
        self.rows_per_lane = rows_per_lane
        self.rows = rows  # R: rows completed (received by the lane, plus a held row completed on replay)
        self.events: list[tuple[int, dict]] = events if events is not None else []  # interventions (at_step, weights)
        self.decision_rows = -1  # R at the merge's latest decision (-1: none since the lane was built)

    def step(self) -> int:
        """The step the merge's next decision belongs to."""
        return self.rows // self.rows_per_lane

    @property
    def decided(self) -> int:
        """The latest step a decision was made for since the lane was built (-1: none)."""
        return -1 if self.decision_rows < 0 else self.decision_rows // self.rows_per_lane

    def describe(self) -> dict[str, Any]:
        return {"rows": self.rows, "decided": self.decided}

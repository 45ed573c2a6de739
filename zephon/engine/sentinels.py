"""When a lane injects a flush sentinel: its cadence, as a small policy object the sources report to.

A sentinel is due after every ``flush_every`` completed *chunks* (``by="chunks"``: the stateless tasks,
a few dozen records each, counted over all the lane's sources in the order the merge consumes them) or
completed *units* (``by="units"``: files, row groups or byte ranges). Chunks bound what a resume replays
by data volume whatever the files' sizes (a unit may be a whole multi-gigabyte file); units were the
cadence before and remain for pipelines that ask for it. The policy only counts: the merge asks it after
each chunk it finishes, and resets it at each sentinel, so a lane rebuilt at a sentinel counts exactly as
the original.
"""

from __future__ import annotations

FLUSH_BY = ("chunks", "units")


class FlushPolicy:
    """Sentinel cadence of one lane (see the module docstring)."""

    def __init__(self, flush_every: int, by: str = "chunks") -> None:
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        if by not in FLUSH_BY:
            raise ValueError(f"flush_by must be one of {FLUSH_BY}, got {by!r}")
        self.flush_every, self.by = flush_every, by
        self._units = by == "units"
        self.count = 0

    def chunk_done(self, unit_end: bool) -> bool:
        """A source finished a chunk (``unit_end``: the last of its unit); True when a sentinel is due."""
        if self._units and not unit_end:
            return False
        self.count += 1
        return self.count % self.flush_every == 0

    def reset(self) -> None:
        """A sentinel was emitted: the next window starts."""
        self.count = 0

    def describe(self) -> dict:
        return {"flush_every": self.flush_every, "flush_by": self.by}

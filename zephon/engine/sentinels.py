"""When a lane injects a flush sentinel: its cadence, as a small policy object the sources report to.

A sentinel is due after every ``flush_every`` completed *units* (counted over all the lane's sources,
in the order the merge consumes them). The policy only counts: the merge asks it after each chunk it
finishes, and resets it at each sentinel, so a lane rebuilt at a sentinel counts exactly as the original.
"""

from __future__ import annotations


class FlushPolicy:
    """Sentinel cadence of one lane (see the module docstring)."""

    def __init__(self, flush_every: int) -> None:
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self.flush_every = flush_every
        self.units = 0

    def chunk_done(self, unit_end: bool) -> bool:
        """A source finished a chunk (``unit_end``: the last of its unit); True when a sentinel is due."""
        if not unit_end:
            return False
        self.units += 1
        return self.units % self.flush_every == 0

    def reset(self) -> None:
        """A sentinel was emitted: the next window starts."""
        self.units = 0

    def describe(self) -> dict:
        return {"flush_every_units": self.flush_every}

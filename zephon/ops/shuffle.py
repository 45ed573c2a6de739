"""``shuffle``: a seeded per-lane shuffle buffer that drains at every flush sentinel.

The buffer holds up to ``size`` records; once full, each new record replaces a uniformly chosen one,
which is emitted. At a sentinel the buffer drains in random order. The generator is seeded by
(seed, lane, segment) only and reseeded for each segment, so a lane rebuilt at a sentinel draws the
same numbers as the original did. The shuffle's window is therefore ``size`` records within one
segment (between two sentinels): a record never moves across a sentinel.
"""

from __future__ import annotations

from typing import Any, Iterable

from .base import Accumulator, LaneContext, LaneOperator, positive_int

PURPOSE = 0x5348  # separates shuffle draws from any other use of (seed, lane, segment)


class Shuffle(LaneOperator):
    """A seeded shuffle within a window of ``buffer`` records, per lane, drained at each sentinel.

    Args:
        buffer: the records held (a larger window mixes more, and holds more in memory).
    """

    op = "shuffle"

    def __init__(self, buffer: int) -> None:
        super().__init__()
        self.buffer = positive_int(buffer, "shuffle(buffer=...)")

    def make(self, ctx: LaneContext) -> "ShuffleBuffer":
        return ShuffleBuffer(ctx, self.buffer)


class ShuffleBuffer(Accumulator):
    """Emits records in a seeded random order within a window of ``size`` records."""

    def __init__(self, ctx: LaneContext, size: int) -> None:
        self.ctx, self.size = ctx, size
        self._buf: list[Any] = []
        self._rng = ctx.rng(PURPOSE)

    def _pop_random(self) -> Any:
        buf = self._buf
        j = int(self._rng.integers(len(buf)))
        buf[j], buf[-1] = buf[-1], buf[j]
        return buf.pop()

    def push(self, record: Any) -> Iterable[Any]:
        self._buf.append(record)
        if len(self._buf) > self.size:
            return (self._pop_random(),)
        return ()

    def flush(self) -> Iterable[Any]:
        out = [self._pop_random() for _ in range(len(self._buf))]
        self.ctx = self.ctx.after_flush()
        self._rng = self.ctx.rng(PURPOSE)
        return out

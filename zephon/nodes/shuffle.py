"""A seeded per-lane shuffle buffer that drains at every flush sentinel.

The buffer holds up to ``size`` documents; once full, each new document replaces a uniformly chosen
one, which is emitted. The generator is seeded by (seed, lane, epoch) only, and the buffer is empty
at every sentinel, so a lane rebuilt at an epoch start draws the same numbers as the original did.
"""

from __future__ import annotations

from typing import Any

from torchdata.nodes import BaseNode

from .._perm import rng_for
from .items import Flush

_PURPOSE = 0x5348  # separates shuffle draws from any other use of (seed, lane, epoch)


class ShuffleBuffer(BaseNode):
    """Emits documents in a seeded random order within a window of ``size`` documents."""

    def __init__(self, upstream: BaseNode, size: int, seed: int, lane: int, epoch: int) -> None:
        super().__init__()
        self.upstream, self.size, self.seed, self.lane = upstream, size, seed, lane
        self._epoch = epoch

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self._epoch = int(initial_state["epoch"])
        self._buf: list = []
        self._draining: Flush | None = None
        self._rng = rng_for(self.seed, self.lane, self._epoch, _PURPOSE)

    def _pop_random(self) -> Any:
        j = int(self._rng.integers(len(self._buf)))
        self._buf[j], self._buf[-1] = self._buf[-1], self._buf[j]
        return self._buf.pop()

    def next(self) -> Any:
        while True:
            if self._draining is not None:
                if self._buf:
                    return self._pop_random()
                flush, self._draining = self._draining, None
                self._epoch = flush.epoch
                self._rng = rng_for(self.seed, self.lane, self._epoch, _PURPOSE)
                return flush
            item = next(self.upstream)
            if isinstance(item, Flush):
                self._draining = item
                continue
            self._buf.append(item)
            if len(self._buf) > self.size:
                return self._pop_random()

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch}

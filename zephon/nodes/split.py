"""Split documents longer than ``max_len`` into pieces that fit a row.

Stateless per document (so nothing to flush). A piece that is not the document's last keeps the
next token as its tail label, so the loss at the cut still trains on the true continuation.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from torchdata.nodes import BaseNode

from .items import Flush, LaneCounters


class Splitter(BaseNode):
    """Cuts each document into pieces of at most ``max_len`` tokens; forwards sentinels."""

    def __init__(self, upstream: BaseNode, max_len: int, counters: LaneCounters) -> None:
        super().__init__()
        self.upstream, self.max_len, self.counters = upstream, max_len, counters
        self._out: deque = deque()

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._out.clear()

    def next(self) -> Any:
        if self._out:
            return self._out.popleft()
        item = next(self.upstream)
        if isinstance(item, Flush):
            return item
        tokens, tail = item
        n, m = len(tokens), self.max_len
        if n <= m:
            return item
        cuts = range(0, n, m)
        self.counters.pieces_split += len(cuts) - 1
        for a in cuts:
            b = min(a + m, n)
            self._out.append((tokens[a:b], int(tokens[b]) if b < n else tail))
        return self._out.popleft()

    def get_state(self) -> dict[str, Any]:
        return {}

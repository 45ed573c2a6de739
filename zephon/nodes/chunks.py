"""Chunk tasks of one (lane, source) and the reorder buffer that runs them on workers.

:class:`ChunkSource` walks the lane's closed-form work plan from a position. :class:`ReorderBuffer`
submits up to ``depth`` tasks ahead to a shared :class:`~zephon.runner.Runner` and hands results
back strictly in submission order, whichever worker finishes first: the stateless work is parallel,
the order the accumulators see is not.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator

from torchdata.nodes import BaseNode

from ..plan import ChunkTask, SourcePlan
from ..runner import Runner, TokenizedChunk


class ChunkSource(BaseNode[ChunkTask]):
    """Endless chunk tasks of ``lane`` in ``source``, from ``(unit_seq, cursor)``."""

    def __init__(self, source: SourcePlan, lane: int, unit_seq: int = 0, cursor: int = -1) -> None:
        super().__init__()
        self.source, self.lane = source, lane
        self._start = (unit_seq, cursor)
        self._it: Iterator[ChunkTask] | None = None

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self._start = (int(initial_state["unit_seq"]), int(initial_state["cursor"]))
        self._it = self.source.chunk_tasks(self.lane, *self._start)

    def next(self) -> ChunkTask:
        assert self._it is not None
        return next(self._it)

    def get_state(self) -> dict[str, Any]:
        return {"unit_seq": self._start[0], "cursor": self._start[1]}


class ReorderBuffer(BaseNode[TokenizedChunk]):
    """Runs ``tasks`` on ``runner`` with ``depth`` in flight; yields results in task order."""

    def __init__(self, tasks: BaseNode[ChunkTask], runner: Runner, depth: int) -> None:
        super().__init__()
        self.tasks, self.runner, self.depth = tasks, runner, max(1, depth)
        self._pending: deque = deque()

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._pending.clear()
        self._exhausted = False
        self.tasks.reset(None if initial_state is None else
                         {"unit_seq": initial_state["unit_seq"], "cursor": initial_state["cursor"]})

    def _fill(self) -> None:
        while not self._exhausted and len(self._pending) < self.depth:
            try:
                task = next(self.tasks)
            except StopIteration:
                self._exhausted = True
                return
            self._pending.append(self.runner.submit(task))

    def prime(self) -> None:
        """Submit up to ``depth`` tasks now, before the first ``next()``."""
        self._fill()

    def next(self) -> TokenizedChunk:
        self._fill()
        if not self._pending:
            raise StopIteration
        result = self._pending.popleft().result()
        self._fill()  # keep the workers busy while the accumulator digests this chunk
        return result

    def get_state(self) -> dict[str, Any]:
        return self.tasks.get_state()

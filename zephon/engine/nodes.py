"""The lane's serial operators as torchdata nodes: the merge, and any accumulator after it.

:class:`MergeNode` is where a lane's sources meet. It asks its :class:`~zephon.ops.base.Merge` (the
mixer) which source it wants, takes that source's next document from its
:class:`~zephon.engine.sources.SourceStream`, and injects a :class:`~zephon.records.Flush` sentinel
whenever the lane's :class:`~zephon.engine.sentinels.FlushPolicy` says one is due, carrying every
source's position. :class:`AccumulatorNode` drives any accumulator (built-in or yours) with
``push``/``flush`` (or ``on_flush``) and forwards the sentinels in order.

These nodes are rebuilt by their lane at a sentinel, never restored on their own: their ``get_state``
says where they stand (the sentinels they have passed) for inspection, and ``reset`` takes no state.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable, Sequence

from torchdata.nodes import BaseNode

from ..records import Flush
from .counters import LaneCounters
from .sentinels import FlushPolicy
from .sources import SourceStream


def _no_state(node: BaseNode, initial_state: dict | None) -> None:
    if initial_state is not None:
        raise ValueError(f"{type(node).__name__} is rebuilt by its lane at a flush sentinel; restore the lane "
                         f"(zephon.engine.lane.Lane) with a LaneState instead of this node.")


class MergeNode(BaseNode):
    """Interleaves the lane's source streams into one record stream with flush sentinels."""

    def __init__(self, merge: Any, streams: Sequence[SourceStream], policy: FlushPolicy, sentinels: int,
                 counters: LaneCounters, clock: Any = None) -> None:
        super().__init__()
        self.merge, self.streams, self.policy = merge, list(streams), policy
        self.counters = counters
        self.clock = clock  # the lane's step clock: the merge records the rows complete at each decision
        self._sentinels = sentinels
        self._queue: deque = deque()

    def reset(self, initial_state: dict | None = None) -> None:
        _no_state(self, initial_state)
        super().reset(initial_state)
        self._queue.clear()
        for stream in self.streams:
            stream.chunks.reset(None)

    def prime(self, limit: int | None = None) -> None:
        for stream in self.streams:
            stream.chunks.prime(limit)

    def prime_replay(self, counts: Sequence[int]) -> None:
        """Put each source's next ``counts[s]`` chunks in flight (a resumed lane's replay)."""
        for stream, n in zip(self.streams, counts):
            if n and hasattr(stream.chunks, "prime_replay"):
                stream.chunks.prime_replay(n)

    def get_state(self) -> dict[str, Any]:
        return {"sentinels": self._sentinels, "positions": {s.name: list(s.position) for s in self.streams}}

    def _sentinel(self) -> None:
        self._queue.extend(self.merge.flush())
        self._sentinels += 1
        self.policy.reset()
        self.counters.flushes += 1
        self._queue.append(Flush(self._sentinels, tuple(s.position for s in self.streams),
                                 taken=tuple(s.taken for s in self.streams)))

    def next(self) -> Any:
        # Once per document: keep it lean. The streams count documents and tokens per chunk (metrics), and
        # the clock's latest decided step is worked out only when asked (LaneClock.decided).
        queue = self._queue
        clock = self.clock
        merge, streams = self.merge, self.streams
        while not queue:
            if clock is not None:
                clock.decision_rows = clock.rows
            s = merge.next_source()
            if s < 0:  # every source the mixer may choose has ended: so has this lane's data
                raise StopIteration
            stream = streams[s]
            doc, flush_due = stream.take()
            if doc is None:
                if stream.ended:  # a finite source's last document was taken: choose among the rest
                    merge.source_ended(s)
                    continue
                self._sentinel()  # a unit completed empty and made a flush due: the choice is made again after it
                continue
            out = merge.push_from(doc, s)
            if flush_due:
                queue.extend(out)
                self._sentinel()
            elif len(out) == 1:  # the usual case: the document itself, straight through
                return out[0]
            else:
                queue.extend(out)
        return queue.popleft()


class AccumulatorNode(BaseNode):
    """Drives one accumulator over its upstream's records and sentinels (see the module docstring)."""

    def __init__(self, upstream: BaseNode, accumulator: Any, name: str) -> None:
        super().__init__()
        self.upstream, self.acc, self.name = upstream, accumulator, name
        self._on_flush = getattr(accumulator, "on_flush", None)
        self._out: deque = deque()
        self._sentinels = 0
        self._ended = False

    def reset(self, initial_state: dict | None = None) -> None:
        _no_state(self, initial_state)
        super().reset(initial_state)
        self._out.clear()
        self._ended = False
        self.upstream.reset(None)
        self._pull = self.upstream.next  # reset just now: BaseNode.__next__'s start-up check, once per record, is moot

    def prime(self, limit: int | None = None) -> None:
        self.upstream.prime(limit)

    def prime_replay(self, counts: Sequence[int]) -> None:
        self.upstream.prime_replay(counts)

    def get_state(self) -> dict[str, Any]:
        return {"operator": self.name, "sentinels_passed": self._sentinels}

    def _extend(self, items: Iterable[Any] | None) -> None:
        if items:
            self._out.extend(items)

    def next(self) -> Any:
        out = self._out
        pull, push = self._pull, self.acc.push
        while not out:
            if self._ended:
                raise StopIteration
            try:
                item = pull()
            except StopIteration:  # a finite stream: emit what is held, then end
                self._ended = True
                self._extend(self.acc.flush())
                continue
            if isinstance(item, Flush):
                self._sentinels += 1
                if self._on_flush is not None:
                    self._extend(self._on_flush(item))
                else:
                    self._extend(self.acc.flush())
                    out.append(item)
            else:
                items = push(item)
                if items:
                    out.extend(items)
        return out.popleft()


class TransformStep:
    """A stateless transform placed after the merge, as an accumulator that holds nothing."""

    def __init__(self, transform: Any) -> None:
        self.transform = transform
        transform.setup()

    def push(self, record: Any) -> list[Any]:
        return self.transform.apply_records([record])

    def flush(self) -> tuple:
        return ()

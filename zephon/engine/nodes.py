"""The lane's serial operators as torchdata nodes: the merge, and any accumulator after it.

:class:`MergeNode` is where a lane's sources meet. It asks its :class:`~zephon.ops.base.Merge` (the
mixer) which source it wants, takes that source's next document from its
:class:`~zephon.engine.sources.SourceStream`, and injects a :class:`~zephon.records.Flush` sentinel
whenever the lane's :class:`~zephon.engine.sentinels.FlushPolicy` says one is due, carrying every
source's position. :class:`AccumulatorNode` drives any accumulator (built-in or yours) with
``push``/``flush`` (or ``on_flush``) and forwards the sentinels in order.

**State, mapped to flush sentinels.** After a sentinel every operator is as if freshly built, so a node's
state is its upstream's state at the last sentinel it passed, plus how many items it has emitted since,
nested as torchdata's ``Batcher`` nests its source::

    MergeNode:        {"sentinels": j, "sources": {name: <source chain state at sentinel j>}, "emitted": k}
    AccumulatorNode:  {"source": <upstream state when sentinel j entered>, "sentinel": {"index": j, "carry": c,
                       "release": r[, "rows": R]}, "emitted": k}

``reset(state)`` rebuilds the operator fresh for the segment after sentinel ``j`` (the packer told the
sentinel's ``carry`` and ``release``), resets the upstream to its state there, and replays ``k`` items
(on the first ``next()``); ``reset(None)`` starts over from the lane's beginning, contents included. No
buffer is ever stored: the replay rebuilds it, as a lane's resume does.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from typing import Any, Callable, Iterable, Mapping, Sequence

from torchdata.nodes import BaseNode

from ..ops.base import LaneContext, call_factory
from ..ops.fields import Fields, check_record
from ..ops.batch import RecordSpan
from ..records import Flush, TextRun
from ..errors import StateError
from .counters import LaneCounters
from .sentinels import FlushPolicy
from .sources import SourceStream, position_of, position_state

TEXT_RUN = 16  # documents a packer may take from the mixer in one go (it stops at the first completed row)

SOURCE, SOURCES, SENTINEL, SENTINELS, EMITTED = "source", "sources", "sentinel", "sentinels", "emitted"


def _get(state: Any, key: str, where: str) -> Any:
    if not isinstance(state, Mapping) or key not in state:
        raise StateError(f"{where}: the node state has no '{key}' (got {state!r:.100}); pass a state this node's "
                         f"state_dict() returned")
    return state[key]


def _count(state: Any, key: str, where: str) -> int:
    value = _get(state, key, where)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise StateError(f"{where}: '{key}' must be an integer >= 0, got {value!r:.40}")
    return value


class _Replaying:
    """The replay both nodes share: after ``reset(state)``, the first ``next()`` re-emits (and drops) the
    ``emitted`` items the state says came after its sentinel."""

    where: str
    _replay_to: int

    def next(self) -> Any:
        if self._replay_to:
            self._replay()
        return self._next_item()  # type: ignore[attr-defined]

    def _replay(self) -> None:
        n, self._replay_to = self._replay_to, 0
        for done in range(n):
            try:
                item = self._next_item()  # type: ignore[attr-defined]
            except StopIteration:
                raise StateError(f"{self.where}: the state says {n} items came after its last sentinel, but the data "
                                 f"end after {done}. The state was edited or does not belong to this data.") from None
            if type(item) is Flush:
                raise StateError(f"{self.where}: the state says {n} items came after its last sentinel, but the "
                                 f"segment after it holds only {done}. The state was edited or does not belong to "
                                 f"this data.")


class MergeNode(_Replaying, BaseNode):
    """Interleaves the lane's source streams into one record stream with flush sentinels.

    ``make_merge(ctx)`` builds the mixer for a segment; ``ctx`` is the lane's context (its segment is set at
    each reset); ``streams`` are the sources' streams, each over its chain of nodes."""

    def __init__(self, make_merge: Callable[..., Any], streams: Sequence[SourceStream], policy: FlushPolicy,
                 counters: LaneCounters, ctx: LaneContext) -> None:
        super().__init__()
        self.make_merge, self.streams, self.policy, self.counters, self.ctx = make_merge, list(streams), policy, \
            counters, ctx
        self.clock = ctx.clock  # the lane's step clock: the merge records the rows complete at each decision
        self.where = f"lane {ctx.lane}, merge"
        self._queue: deque = deque()
        self._replay_to = 0

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            sentinels, positions, emitted = 0, [(0, -1, 0)] * len(self.streams), 0
        else:
            sentinels = _count(initial_state, SENTINELS, self.where)
            sources = _get(initial_state, SOURCES, self.where)
            if not isinstance(sources, Mapping) or set(sources) != {s.name for s in self.streams}:
                raise StateError(f"{self.where}: 'sources' must map every source ({[s.name for s in self.streams]}) "
                                 f"to its state, got {sources!r:.100}")
            positions = [position_of(sources[s.name], f"{self.where}, source {s.name!r}") for s in self.streams]
            emitted = _count(initial_state, EMITTED, self.where)
        for stream, position in zip(self.streams, positions):
            stream.restart(position)
        self.policy.reset()
        self._queue.clear()
        self._sentinels = sentinels
        self._anchor = Flush(sentinels, tuple(positions))
        self._emitted, self._replay_to = 0, emitted
        self._runs = True  # the batched text path may be taken (feed)
        ctx = dataclasses.replace(self.ctx, segment=sentinels, carry=0, release=-1)
        self.merge = call_factory(self.make_merge, ctx)
        if self.clock is not None:
            self.clock.decision_rows = -1

    def prime(self, limit: int | None = None) -> None:
        for stream in self.streams:
            stream.chunks.prime(limit)

    def prime_replay(self, counts: Sequence[int]) -> None:
        """Put each source's next ``counts[s]`` chunks in flight (a resumed lane's replay)."""
        for stream, n in zip(self.streams, counts):
            if n and hasattr(stream.chunks, "prime_replay"):
                stream.chunks.prime_replay(n)

    def get_state(self) -> dict[str, Any]:
        anchor = self._anchor
        return {SENTINELS: anchor.index, EMITTED: self._emitted + self._replay_to,
                SOURCES: {s.name: position_state(p, s.stages) for s, p in zip(self.streams, anchor.positions)}}

    def _sentinel(self) -> None:
        self._queue.extend(self.merge.flush())
        self._sentinels += 1
        self.policy.reset()
        self.counters.flushes += 1
        self._queue.append(Flush(self._sentinels, tuple(s.position for s in self.streams),
                                 taken=tuple(s.taken for s in self.streams)))

    def _next_item(self) -> Any:
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
                self._emitted += 1
                return out[0]
            else:
                queue.extend(out)
        item = queue.popleft()
        if type(item) is Flush:
            self._anchor, self._emitted = item, 0
        else:
            self._emitted += 1
        return item

    def feed(self, push_text_run: Callable[[TextRun], tuple[int, Iterable[Any]]], limit: int) -> Iterable[Any] | None:
        """The batched text path: the next run of up to ``limit`` documents the mixer picks from one source
        (within its open chunk, plain token ids) given to ``push_text_run`` (:meth:`zephon.ops.pack.Packer.push_text_run`),
        which takes them one by one until one makes it emit a row; only those it took are taken from the source,
        booked by the mixer and counted as emitted, so the positions, sentinels, state and step clock are those
        of as many :meth:`next` calls. The merge must have ``take_run``/``book_run`` (the built-in mixer).

        Returns:
            What ``push_text_run`` released (possibly nothing), or None where the next item must come
            through :meth:`next` (one is queued, a replay is due, the source has no open chunk of plain ids
            or has ended, every source has ended; after a chunk of more than token ids, until the next reset).
        """
        if self._queue or self._replay_to or not self._runs:
            return None
        clock = self.clock
        if clock is not None:
            clock.decision_rows = clock.rows
        s, n = self.merge.take_run(limit)
        if s < 0:
            return None
        stream = self.streams[s]
        run = stream.text_run(n)
        if run is None:
            # a chunk whose documents carry more than token ids (payloads, other per-token fields): its source's
            # chunks all will, so the lane stays on next() until it is rebuilt (else every pick is decided twice)
            self._runs = stream.open_documents == 0
            return None
        taken, out = push_text_run(run)
        self.merge.book_run(s, taken, run.offsets[run.first + taken] - run.offsets[run.first])
        self._emitted += taken
        if stream.advance(taken):
            self._sentinel()
        return out

    def next_block(self, limit: int) -> Any:
        """The batched record-rows path: the next up to ``limit`` records as one
        :class:`~zephon.ops.batch.RecordSpan` (a run of picks of one source, within one chunk), or the next
        sentinel; the same records, positions and sentinels as ``limit`` calls of ``next()``. The merge must
        have ``take_run``/``push_run`` (the built-in mixer). ``StopIteration`` once every source has ended."""
        if self._replay_to:
            self._replay()
        queue = self._queue
        clock, merge, streams = self.clock, self.merge, self.streams
        while not queue:
            if clock is not None:
                clock.decision_rows = clock.rows  # the span's decisions all belong to this row's step
            s, n = merge.take_run(limit)
            if s < 0:
                raise StopIteration
            stream = streams[s]
            span, flush_due = stream.take_span(n)
            if span is None:
                if stream.ended:
                    merge.source_ended(s)
                    continue
                self._sentinel()
                continue
            merge.push_run(span, s)
            queue.append(span)
            if flush_due:
                self._sentinel()
        item = queue.popleft()
        if type(item) is Flush:
            self._anchor, self._emitted = item, 0
        else:
            self._emitted += len(item) if type(item) is RecordSpan else 1
        return item


class AccumulatorNode(_Replaying, BaseNode):
    """Drives one accumulator over its upstream's records and sentinels (see the module docstring).

    ``factory(ctx)`` builds the accumulator for a segment. ``counts_rows``: this is the lane's last operator,
    whose outputs are its rows: it counts them on the lane's step clock (:mod:`zephon.engine.clock`)."""

    def __init__(self, upstream: BaseNode, factory: Callable[..., Any], name: str, ctx: LaneContext,
                 counts_rows: bool = False) -> None:
        super().__init__()
        self.upstream, self.factory, self.name, self.ctx = upstream, factory, name, ctx
        self.clock = ctx.clock if counts_rows else None
        self.where = f"lane {ctx.lane}, operator '{name}'"
        self._out: deque = deque()
        self._entries: deque = deque()  # the upstream's state as each sentinel not yet emitted entered
        self._replay_to = 0

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self.upstream.reset(None)
            sentinel: Mapping[str, Any] = {"index": 0, "carry": 0, "release": -1, "rows": 0}
            emitted = 0
        else:  # this node's own fields are checked before its upstream's
            source = _get(initial_state, SOURCE, self.where)
            sentinel = _get(initial_state, SENTINEL, self.where)
            emitted = _count(initial_state, EMITTED, self.where)
        index = _count(sentinel, "index", self.where)
        carry, release = _count(sentinel, "carry", self.where), _get(sentinel, "release", self.where)
        if not isinstance(release, int) or isinstance(release, bool) or release < -1:
            raise StateError(f"{self.where}: the sentinel's 'release' must be an integer >= -1, got {release!r:.40}")
        if initial_state is not None:
            self.upstream.reset(source)
        if self.clock is not None:  # the row held over the sentinel is complete where the replay releases it
            self.clock.rows = _count(sentinel, "rows", self.where) - (release >= 0)
        self._anchor = (self.upstream.state_dict(), {"index": index, "carry": carry, "release": release,
                                                     **({"rows": sentinel["rows"]} if self.clock is not None else {})})
        ctx = dataclasses.replace(self.ctx, segment=index, carry=carry, release=release)
        self.acc = call_factory(self.factory, ctx)
        self._on_flush = getattr(self.acc, "on_flush", None)
        self._out.clear()
        self._entries.clear()
        self._ended = False
        self._emitted, self._replay_to = 0, emitted
        self._pull = self.upstream.next  # reset just now: BaseNode.__next__'s start-up check, once per record, is moot
        # the batched text path: a packer straight after the built-in mixer takes runs of documents from it
        push_text_run = getattr(self.acc, "push_text_run", None)
        self._feed = functools.partial(self.upstream.feed, push_text_run, TEXT_RUN) \
            if push_text_run is not None and getattr(self.acc, "takes_text_runs", False) \
            and isinstance(self.upstream, MergeNode) and hasattr(self.upstream.merge, "book_run") else None

    def prime(self, limit: int | None = None) -> None:
        self.upstream.prime(limit)

    def prime_replay(self, counts: Sequence[int]) -> None:
        self.upstream.prime_replay(counts)

    def get_state(self) -> dict[str, Any]:
        source, sentinel = self._anchor
        return {SOURCE: source, SENTINEL: dict(sentinel), EMITTED: self._emitted + self._replay_to}

    def _extend(self, items: Iterable[Any] | None) -> None:
        if items:
            self._out.extend(items)

    def _next_item(self) -> Any:
        out = self._out
        pull, push, feed = self._pull, self.acc.push, self._feed
        while not out:
            if self._ended:
                raise StopIteration
            if feed is not None:
                items = feed()
                if items is not None:
                    if items:
                        out.extend(items)
                    continue
            try:
                item = pull()
            except StopIteration:  # a finite stream: emit what is held, then end
                self._ended = True
                self._extend(self.acc.flush())
                continue
            if type(item) is Flush:
                self._entries.append(self.upstream.get_state())
                if self._on_flush is not None:
                    self._extend(self._on_flush(item))
                else:
                    self._extend(self.acc.flush())
                    out.append(item)
            else:
                items = push(item)
                if items:
                    out.extend(items)
        item = out.popleft()
        if type(item) is Flush:
            sentinel = {"index": item.index, "carry": item.carry, "release": item.release}
            if self.clock is not None:
                sentinel["rows"] = self.clock.rows
            self._anchor, self._emitted = (self._entries.popleft(), sentinel), 0
        else:
            self._emitted += 1
            if self.clock is not None:
                self.clock.rows += 1
        return item

    def next_block(self, limit: int) -> Any:
        """The batched record-rows path (this node drives ``RecordRows``, straight after the merge): the next
        up to ``limit`` rows as one :class:`~zephon.ops.batch.RecordSpan`, or a single row, or the next
        sentinel; the same rows, sentinels, clock and state as ``next()`` calls. Only ``RecordRows`` takes this
        path (the lane chooses it), whose flush at a sentinel gives nothing, so ``on_flush`` is not consulted."""
        if self._replay_to:
            self._replay()
        if self._out or self._ended:
            return self._next_item()
        try:
            item = self.upstream.next_block(limit)
        except StopIteration:
            self._ended = True
            self._extend(self.acc.flush())
            return self._next_item()
        if type(item) is Flush:
            self._entries.append(self.upstream.get_state())
            self._extend(self.acc.flush())
            self._out.append(item)
            return self._next_item()
        if type(item) is not RecordSpan:
            self._out.extend(self.acc.push(item))
            return self._next_item()
        rows = self.acc.push_span(item)
        n = len(rows)
        self._emitted += n
        if self.clock is not None:
            self.clock.rows += n
        return rows


class TransformStep:
    """A stateless transform placed after the merge, as an accumulator that holds nothing. ``rows``: in a pipeline
    that packs, its per-token fields, which what one of your operators makes must fit (:mod:`zephon.ops.fields`)."""

    def __init__(self, transform: Any, rows: Fields | None = None) -> None:
        self.transform = transform
        self._rows = rows if rows is not None and transform._rows_checked else None
        transform.setup()

    def push(self, record: Any) -> list[Any]:
        out = self.transform._apply_records([record])
        if self._rows is not None:
            for rec in out:
                check_record(self.transform, rec, self._rows, "a record in the lane")
        return out

    def flush(self) -> tuple:
        return ()

"""One lane's view of one source: tasks from its work plan, stateless stages on executors, documents
in order, and where the reader stands after each.

- :class:`ChunkSource` walks the lane's closed-form unit sequence (:meth:`SourcePlan.chunk_tasks`) from
  a position.
- :class:`StageBuffer` submits up to ``depth`` items ahead to an executor and hands results back strictly
  in submission order, whichever worker finishes first: the stateless work is parallel, the order the
  accumulators see is not. One buffer per stage of the source's transforms. Its depth may adapt
  (:class:`ReadAhead`); only when work is submitted depends on it, never what a lane sees.
- :class:`SourceStream` turns the chunks into documents for the merge and keeps the source's position
  ``(unit_seq, cursor, skip)`` after the last document taken; it reports each completed chunk to the
  lane's :class:`~zephon.engine.sentinels.FlushPolicy`, and refuses a source that gives nothing for
  too long (:class:`EmptySourceWatch`).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator, Mapping

import numpy as np

from torchdata.nodes import BaseNode

from ..errors import SourceError, StateError
from ..ops.batch import RecordSpan
from ..plan import ChunkTask, SourcePlan
from ..records import IGNORE, INPUT_IDS, Chunk, Doc, TextRun
from .counters import LaneCounters
from .executors import Executor
from .sentinels import FlushPolicy

new_doc = dict.__new__  # an empty Doc without Doc.__init__'s defaults (this runs once per document)


POSITION_KEYS = ("unit_seq", "cursor", "skip")


def position_state(position: tuple[int, int, int], stages: int = 0) -> dict[str, Any]:
    """The node state of a source chain (a :class:`ChunkSource` under ``stages`` :class:`StageBuffer` nodes)
    that restarts it at ``position``: ``{"source": ... {"unit_seq", "cursor", "skip"}}``, nested as the nodes
    are."""
    state: dict[str, Any] = dict(zip(POSITION_KEYS, (int(v) for v in position)))
    for _ in range(stages):
        state = {StageBuffer.SOURCE_KEY: state}
    return state


def position_of(state: Any, where: str) -> tuple[int, int, int]:
    """The position a source chain's node state (see :func:`position_state`) restarts at."""
    while isinstance(state, Mapping) and StageBuffer.SOURCE_KEY in state:
        state = state[StageBuffer.SOURCE_KEY]
    if not isinstance(state, Mapping) or set(state) != set(POSITION_KEYS) or \
            not all(isinstance(state[k], int) and not isinstance(state[k], bool) for k in POSITION_KEYS):
        raise StateError(f"{where}: a source position is {{unit_seq, cursor, skip}} (integers), got {state!r:.80}")
    return state["unit_seq"], state["cursor"], state["skip"]


class ChunkSource(BaseNode[ChunkTask]):
    """Endless chunk tasks of ``lane`` in ``source`` (or ending after the source's passes).

    State: the position of the next task, ``{"unit_seq", "cursor", "skip"}`` (the lane's ``unit_seq``-th
    unit, the reader cursor in it, the records made from there already taken); ``reset(None)`` starts at
    the lane's first unit."""

    def __init__(self, source: SourcePlan, lane: int) -> None:
        super().__init__()
        self.source, self.lane = source, lane
        self._it: Iterator[ChunkTask] | None = None
        self._position: tuple[int, int, int] = (0, -1, 0)

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._position = (0, -1, 0) if initial_state is None else \
            position_of(initial_state, f"lane {self.lane}, source {self.source.spec.name!r}")
        self._it = self.source.chunk_tasks(self.lane, *self._position)

    def next(self) -> ChunkTask:
        assert self._it is not None
        task = next(self._it)
        self._position = (task.unit_seq + 1, -1, 0) if task.unit_end else (task.unit_seq, task.end, 0)
        return task

    def get_state(self) -> dict[str, Any]:
        return position_state(self._position)


class ReadAhead:
    """Items in flight per (lane, source, stage), shared by every stage buffer of a loader: ``base``, raised
    by one each time the trainer is about to wait for a result (up to ``most``), and lowered by one after
    ``settle`` results in a row, from any buffer, that were ready when asked for.

    Why adapt, and why one depth for all: a lane takes its chunks in bursts (a packer hands out rows from
    the documents it holds, then takes many at once), so with a fixed depth the shared workers run out of
    tasks while every lane sits on finished chunks, and later the lanes wait. A wait anywhere raises the
    depth everywhere, which keeps the workers busy; lanes that stop waiting bring it back down, since
    each finished chunk held costs memory (decoded images: megabytes). A lane that refills many open rows
    at once waits at each refill even when the model is the slower side, so for such pipelines the depth
    stays near ``most``: budget memory as for a fixed ``most``. Only when tasks are submitted depends on
    it, never what a lane sees.
    """

    def __init__(self, base: int, most: int, settle: int = 64) -> None:
        if not 1 <= base <= most or settle < 1:
            raise ValueError(f"ReadAhead needs 1 <= base <= most and settle >= 1, got base={base}, most={most}, "
                             f"settle={settle}")
        self.base, self.most, self.settle = base, most, settle
        self.depth = base  # now
        self._ready_run = 0  # results in a row that were ready when asked for

    @classmethod
    def of(cls, depth: "int | ReadAhead") -> "ReadAhead":
        """``depth`` as a :class:`ReadAhead` (an int: a fixed depth of that many)."""
        if isinstance(depth, ReadAhead):
            return depth
        return cls(max(1, int(depth)), max(1, int(depth)))

    @property
    def adapts(self) -> bool:
        return self.most > self.base

    def asked(self, ready: bool) -> None:
        """A buffer hands out its next result, which was (or was not) ready when asked for."""
        if not ready:
            self.depth = min(self.depth + 1, self.most)
            self._ready_run = 0
            return
        self._ready_run += 1
        if self._ready_run >= self.settle and self.depth > self.base:
            self.depth -= 1
            self._ready_run = 0

    def __repr__(self) -> str:
        return f"ReadAhead(base={self.base}, most={self.most}, settle={self.settle}, depth={self.depth})"


def _finished(handle: Any) -> bool | None:
    """Whether a task handle's result is ready (``None``: the handle cannot tell, as an inline one)."""
    done = getattr(handle, "done", None)
    return done() if callable(done) else None


class StageBuffer(BaseNode[Chunk]):
    """Runs stage ``stage`` of ``source`` on ``executor`` with ``depth`` items in flight; in order.

    State: ``{"source": upstream state}`` as of the last chunk it handed out (nested, as torchdata's
    ``Batcher`` nests its source); the chunks in flight are computed again after a ``reset(state)``."""

    SOURCE_KEY = "source"

    def __init__(self, upstream: BaseNode, executor: Executor, source: int, stage: int,
                 depth: "int | ReadAhead", name: str | None = None) -> None:
        super().__init__()
        self.upstream, self.executor = upstream, executor
        self.source, self.stage = source, stage
        self.name = name if name is not None else str(source)  # the source's name, for messages
        self.read_ahead = ReadAhead.of(depth)
        self._pending: deque = deque()  # task handles in flight, in submission order
        self._after: deque = deque()  # the upstream's state after each of their items
        self._exhausted = False
        self._state: dict[str, Any] | None = None

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._pending.clear()
        self._after.clear()
        self._exhausted = False
        if initial_state is None:
            self.upstream.reset(None)
        else:
            if not isinstance(initial_state, Mapping) or self.SOURCE_KEY not in initial_state:
                raise StateError(f"source '{self.name}', stage {self.stage}: a stage buffer's state is "
                                 f"{{'source': <its upstream's state>}}, got {initial_state!r:.80}")
            self.upstream.reset(initial_state[self.SOURCE_KEY])
        self._state = self.upstream.state_dict()

    @property
    def depth(self) -> int:
        return self.read_ahead.depth

    def _submit(self) -> bool:
        try:
            item = next(self.upstream)
        except StopIteration:
            self._exhausted = True
            return False
        self._pending.append(self.executor.submit(self.source, self.stage, item))
        self._after.append(self.upstream.get_state())
        return True

    def _fill(self, limit: int | None = None) -> None:
        limit = self.depth if limit is None else min(limit, self.depth)
        while not self._exhausted and len(self._pending) < limit and self._submit():
            pass

    def prime(self, limit: int | None = None) -> None:
        """Submit up to ``limit`` (default ``depth``) items now, before the first ``next()`` (and the upstream
        stages' too)."""
        if isinstance(self.upstream, StageBuffer):
            self.upstream.prime(limit)
        self._fill(limit)

    def prime_replay(self, n: int) -> None:
        """Submit up to ``n`` items of the first stage now, beyond ``depth``: a resumed lane re-reads the
        ``n`` chunks it had taken since its last sentinel, and with them all in flight at once the workers
        replay every lane in parallel. Later stages are left to pull (filling them would wait here on the
        first stage)."""
        if isinstance(self.upstream, StageBuffer):
            self.upstream.prime_replay(n)
            return
        while not self._exhausted and len(self._pending) < n and self._submit():
            pass

    def next(self) -> Chunk:
        self._fill()
        if not self._pending:
            raise StopIteration
        head, self._state = self._pending.popleft(), self._after.popleft()
        if self.read_ahead.adapts:
            ready = _finished(head)
            if ready is not None:
                self.read_ahead.asked(ready)
        result = head.result()
        self._fill()  # keep the workers busy while the accumulators digest this chunk
        return result

    def get_state(self) -> dict[str, Any]:
        return {self.SOURCE_KEY: self._state}


class EmptySourceWatch:
    """Refuses a source that completes too many units in a row without a single document: all its
    records empty, null or filtered (the lane would otherwise wait for ever)."""

    def __init__(self, name: str, max_empty_units: int) -> None:
        self.name, self.limit, self.run = name, max_empty_units, 0

    def empty_unit(self) -> None:
        self.run += 1
        if self.run > self.limit:
            raise SourceError(f"source '{self.name}' gave no document in {self.run} consecutive units: all its "
                              f"records are empty, null or filtered. Check the fields it reads and your filters.")

    def document(self) -> None:
        self.run = 0


class SourceStream:
    """Documents of one source for one lane, with the reader position after each (see module docstring).

    Per document it does only what the merge needs (the document, its token count, the position); the
    counters (documents, split pieces, tokens) are booked per chunk, vectorised, when the chunk ends or
    when someone reads them (:meth:`settle`), so they stay exact to the document."""

    def __init__(self, index: int, name: str, chunks: BaseNode[Chunk], stages: int, policy: FlushPolicy,
                 watch: EmptySourceWatch, counters: LaneCounters) -> None:
        self.index, self.name, self.chunks, self.stages = index, name, chunks, stages
        self.policy, self.watch, self.counters = policy, watch, counters
        self._chunk: Chunk | None = None
        self._k = self._booked = 0
        self.restart((0, -1, 0))

    def restart(self, position: tuple[int, int, int]) -> None:
        """Read from ``position`` on (its chain of nodes reset there); what was counted so far stands."""
        self.settle()
        self.chunks.reset(position_state(position, self.stages))
        self.position = tuple(position)
        self._chunk = None
        self._k = self._booked = 0  # documents of the open chunk taken, and already in the counters
        self.ended = False  # a source that stops after some passes has given its last document
        self.taken = 0  # chunks taken so far (how many a replay from a sentinel re-reads: a resume hint)
        self.watch.run = 0

    def _open(self, chunk: Chunk) -> None:
        """Per-chunk Python lists: read once per document, where numpy scalar indexing would cost more
        than the rest of the decision."""
        self._chunk, self._k, self._booked = chunk, 0, 0
        self._offs = chunk.offsets.tolist() if chunk.offsets is not None else None
        self._cursors = chunk.resume_cursor.tolist()
        self._skips = chunk.resume_skip.tolist()
        self._tails = chunk.tails.tolist() if chunk.tails is not None else None
        self._ids = chunk.token_fields.get(INPUT_IDS)
        self._more_tokens = [(k, v) for k, v in chunk.token_fields.items() if k != INPUT_IDS]
        self._payloads = list(chunk.columns.items())
        if chunk.token_fields and any(name in chunk.token_fields for name in chunk.columns):
            clash = next(name for name in chunk.columns if name in chunk.token_fields)
            # one name for two values: a record's field would silently replace its token ids (and mixing by
            # tokens would count the field)
            raise SourceError(f"source '{chunk.source_name}' ({chunk.path}): its records have a field '{clash}' "
                              f"beside the token field '{clash}' that tokenizing made. Do not read that column (or "
                              f"rename it in an operator before tokenizing), or tokenize with keep_field=False.")
        self._origins = None if chunk.origin is None else \
            [(chunk.file_id, record, start) for record, start in chunk.origin.tolist()]
        self._unit_seq, self._n = chunk.unit_seq, chunk.n
        self.watch.document()  # the chunk has documents (an empty one is finished without opening)

    def settle(self) -> None:
        """Book the documents taken from the open chunk since the last call into the counters."""
        chunk, a, k = self._chunk, self._booked, self._k
        if chunk is None or k == a:
            return
        self._booked = k
        tokens = self._offs[k] - self._offs[a] if self._offs is not None else 0
        pieces = int(np.count_nonzero(chunk.tails[a:k] != IGNORE)) if chunk.tails is not None else 0
        c = self.counters
        c.docs += k - a - pieces
        c.pieces_split += pieces
        c.doc_tokens += tokens
        c.source_tokens[self.name] = c.source_tokens.get(self.name, 0) + tokens
        c.count_window(self.name, tokens, k - a)

    def _finish(self, chunk: Chunk) -> bool:
        """Book the end of ``chunk``; True when that makes a flush due."""
        self.settle()
        self._chunk = None
        self.counters.skipped_records += chunk.skipped
        self.counters.add_counts(chunk.counts, self.name)
        if not chunk.unit_end:
            self.position = (chunk.unit_seq, chunk.end_cursor, 0)
            return self.policy.chunk_done(False)
        self.position = (chunk.unit_seq + 1, -1, 0)
        self.counters.units += 1
        return self.policy.chunk_done(True)

    def _open_next(self) -> tuple[Chunk | None, bool]:
        """Open the next chunk that holds a document (none is open): ``(chunk, False)``; ``(None, True)`` when a
        unit completed without one and made a flush due; ``(None, False)`` once the source has ended (also when
        asked again after its end: a mixer forgets ended sources at a sentinel)."""
        if self.ended:
            return None, False
        while True:
            try:
                chunk = next(self.chunks)
            except StopIteration:
                self.ended = True
                return None, False
            self.taken += 1
            if chunk.n:
                self._open(chunk)
                return chunk, False
            if chunk.unit_end:
                self.watch.empty_unit()
            if self._finish(chunk):
                return None, True

    def take(self) -> tuple[Doc | None, bool]:
        """The next document and whether a flush is due after it (document None: due before it, when a
        unit completed without giving one; or the source has ended, :attr:`ended`)."""
        chunk = self._chunk
        if chunk is None:
            chunk, due = self._open_next()
            if chunk is None:
                return None, due
        k = self._k
        self._k = k + 1
        doc = new_doc(Doc)  # fields, tail, source and origin are set below
        offs = self._offs
        if offs is not None:
            a, b = offs[k], offs[k + 1]
            doc[INPUT_IDS] = self._ids[a:b]
            for name, flat in self._more_tokens:
                doc[name] = flat[a:b]
        for name, values in self._payloads:
            doc[name] = values[k]
        doc.tail = self._tails[k] if self._tails is not None else IGNORE
        doc.source = self.index
        doc.origin = self._origins[k] if self._origins is not None else None
        if k + 1 == self._n:
            return doc, self._finish(chunk)
        self.position = (self._unit_seq, self._cursors[k], self._skips[k])
        return doc, False

    def text_run(self, limit: int) -> TextRun | None:
        """Up to ``limit`` next documents of the open chunk as plain token ids, for the batched text path
        (:meth:`~zephon.engine.nodes.MergeNode.feed`); nothing is taken until :meth:`advance`. None when no chunk
        is open (:meth:`take` opens the next) or its documents carry more than token ids (they go through
        :meth:`take`)."""
        if self._chunk is None or self._offs is None or self._payloads or self._more_tokens:
            return None
        k = self._k
        return TextRun(self._ids, self._offs, k, min(self._n, k + limit), self._tails, self._origins, self.index)

    @property
    def open_documents(self) -> int:
        """Documents of the open chunk not taken yet (0: no chunk is open)."""
        return self._n - self._k if self._chunk is not None else 0

    def advance(self, n: int) -> bool:
        """``n`` documents of the open chunk were taken (:meth:`text_run`, :meth:`take_span`): the position and
        counts as after ``n`` calls of :meth:`take`; True when a flush is due after the last of them."""
        k = self._k + n
        self._k = k
        if k == self._n:
            return self._finish(self._chunk)
        self.position = (self._unit_seq, self._cursors[k - 1], self._skips[k - 1])
        return False

    def take_span(self, limit: int) -> tuple[RecordSpan | None, bool]:
        """Up to ``limit`` next documents of the open chunk as one :class:`~zephon.ops.batch.RecordSpan`
        (the batched record-rows path): what ``limit`` calls of :meth:`take` would give while the chunk
        lasts, position and counts included; a flush is due after the span only where the chunk ends."""
        if self._chunk is None:
            chunk, due = self._open_next()
            if chunk is None:
                return None, due
        k = self._k
        stop = min(self._n, k + limit)
        span = RecordSpan(self.index, k, stop, self._payloads, self._ids, self._offs, self._more_tokens,
                          self._tails, self._origins)
        return span, self.advance(stop - k)

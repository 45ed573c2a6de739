"""The stateless part of a pipeline as a program that any worker can run.

Per source, the transforms before the merge are grouped into *stages* of consecutive transforms that
share an executor kind (all of them, unless a transform asks for another: e.g. decode on processes,
tokenize on threads). Stage 0 also reads the chunk. ``run(source, stage, item)`` is a pure function
of its arguments: a :class:`~zephon.plan.ChunkTask` (stage 0) or a chunk (later stages) in, a chunk out.
The last stage drops the records a resumed lane already delivered (the position's ``skip``), after
checking that the position really falls between two records made from that cursor.

A program is sent to worker processes once (pickled at pool start-up: transforms, source specs; never
readers, tokenizers or caches, which each process builds for itself on first use).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..ops.base import Transform
from ..ops.fields import Fields, check_chunk, check_source_ids
from ..readers.base import RawChunk
from ..origins import file_id, read_origin, relative_file
from ..records import Chunk, TokenColumn
from .errors import ResumeMismatch

# glibc serves a process's main thread from its main (brk) malloc arena and every other thread from an
# arena of its own; the tokenizers' per-call allocations run ~20% slower on the main arena (BENCHMARKS.md
# section 6). So a chunk with this much text that would be processed on a main thread (inline, pool
# processes) runs on one helper thread, waited for: the same work, one thread busy at a time. Below this
# size the hand-off (waking two threads) costs more than the arena saves.
OFF_MAIN_MIN_CHARS = 16_384
_HELPER: "tuple[int, ThreadPoolExecutor] | None" = None  # (pid, executor): a forked child makes its own
_HELPER_LOCK = threading.Lock()


def run_off_main_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, computed on this process's helper thread if called from the main thread."""
    global _HELPER
    if threading.current_thread() is not threading.main_thread():
        return fn(*args)
    with _HELPER_LOCK:
        if _HELPER is None or _HELPER[0] != os.getpid():
            _HELPER = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="zephon-chunk-inline"))
        executor = _HELPER[1]
    return executor.submit(fn, *args).result()


@dataclass(frozen=True)
class Stage:
    """Consecutive transforms of one source that run on one executor kind (None: the loader's runner)."""

    executor: str | None
    transforms: tuple[Transform, ...]


def _text_chars(chunk: Chunk) -> int:
    total = 0
    for col in chunk.columns.values():
        if isinstance(col, list) and col and isinstance(col[0], (str, type(None))):
            try:
                total += sum(map(len, col))
            except TypeError:  # a null among the texts
                total += sum(len(t) for t in col if isinstance(t, str))
    return total


class StageProgram:
    """Read and transform chunks, source by source and stage by stage (see the module docstring).

    ``readers`` is a list of zero-argument callables, one per source, that build the source's reader in
    the process that needs it (they must be picklable: the plan passes ``functools.partial`` objects).
    ``roots``: each source's root folder when the pipeline records provenance (:mod:`zephon.origins`;
    None: it does not, and chunks carry no origin).
    """

    def __init__(self, names: Sequence[str], readers: Sequence[Callable[[], Any]],
                 stages: Sequence[Sequence[Stage]], coords: Sequence[Callable[[str], str]],
                 roots: Sequence[str] | None = None, rows: Fields | None = None) -> None:
        self.names = list(names)
        self.rows = rows  # a pipeline that packs: its per-token fields, which your operators' output must fit
        self._make_readers = list(readers)
        self.stages = [list(s) for s in stages]
        self._coords = list(coords)
        self.roots = None if roots is None else list(roots)
        self._file_ids: dict[tuple[int, str], int] = {}
        self._readers: list[Any] | None = None
        self._lock = threading.Lock()
        self._ready = False

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_readers", "_lock", "_ready", "_file_ids")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._readers, self._lock, self._ready, self._file_ids = None, threading.Lock(), False, {}

    def transforms(self) -> list[Transform]:
        return [t for per_source in self.stages for stage in per_source for t in stage.transforms]

    def setup(self) -> None:
        """Build readers and load tokenizers once per process (thread-safe, idempotent)."""
        with self._lock:
            if self._ready:
                return
            self._readers = [make() for make in self._make_readers]
            for t in {id(t): t for t in self.transforms()}.values():  # one declared for several sources: once
                t.setup()
            self._ready = True

    def reader(self, source: int) -> Any:
        if not self._ready:
            self.setup()
        assert self._readers is not None
        return self._readers[source]

    def n_stages(self, source: int) -> int:
        return max(1, len(self.stages[source]))

    def reads_only(self, source: int, stage: int) -> bool:
        """Whether stage ``stage`` of ``source`` reads chunks and transforms nothing."""
        return stage == 0 and not (self.stages[source] and self.stages[source][0].transforms)

    # -- the task ----------------------------------------------------------------------------------------
    def run(self, source: int, stage: int, item: Any) -> Chunk:
        chunk = self.read(source, item) if stage == 0 else item
        transforms = self.stages[source][stage].transforms if self.stages[source] else ()
        if transforms:
            if stage == 0 and _text_chars(chunk) >= OFF_MAIN_MIN_CHARS:
                chunk = run_off_main_thread(self._apply, transforms, chunk)
            else:
                chunk = self._apply(transforms, chunk)
        if stage == self.n_stages(source) - 1 and chunk.skip_pending:
            chunk = drop_delivered(chunk, self.names[source])
        return chunk

    def _apply(self, transforms: Sequence[Transform], chunk: Chunk) -> Chunk:
        for t in transforms:
            if not chunk.n:  # an empty unit, or everything filtered: nothing left to transform
                break
            chunk = self.apply_one(t, chunk)
        return chunk

    def apply_one(self, t: Transform, chunk: Chunk) -> Chunk:
        """``t`` on ``chunk``; in a pipeline that packs, what one of your operators made checked against the rows
        (:mod:`zephon.ops.fields`)."""
        chunk = t._apply_chunk(chunk)
        if self.rows is not None and t._rows_checked:
            check_chunk(t, chunk, self.rows)
        return chunk

    def read(self, source: int, task: Any) -> Chunk:
        """A :class:`~zephon.plan.ChunkTask` read into a chunk (an empty one for an empty unit)."""
        empty = np.zeros(0, dtype=np.int64)
        if task.empty:
            return Chunk(source, task.unit_seq, True, task.start, task.end, task.path, {}, empty, empty,
                         skip_pending=task.skip, source_name=self.names[source])
        raw: RawChunk = self.reader(source).read(task.path, task.start, task.end)
        n = len(raw.next_cursors)
        columns = raw_columns(raw, self.reader(source))
        cursors = np.asarray(raw.next_cursors, dtype=np.int64)
        chunk = Chunk(source, task.unit_seq, task.unit_end, task.start, raw.end_cursor, task.path, columns,
                      cursors, np.zeros(n, dtype=np.int64), raw_records=n,
                      coord=self._coords[source](task.path), skip_pending=task.skip,
                      source_name=self.names[source])
        if self.rows is not None:  # a pipeline that packs: token ids read from the file must fit its rows
            check_source_ids(chunk)
        if self.roots is not None:
            first = getattr(raw, "first", None)
            chunk.origin = read_origin(task.start if first is None else first, cursors)
            chunk.file_id = self.file_id(source, task.path)
        return chunk

    def file_id(self, source: int, path: str) -> int:
        """The provenance id of ``path``, a file of ``source`` (:func:`zephon.origins.file_id`), cached."""
        key = (source, path)
        fid = self._file_ids.get(key)
        if fid is None:
            assert self.roots is not None
            fid = self._file_ids[key] = file_id(relative_file(path, self.roots[source]))
        return fid


def raw_columns(raw: RawChunk, reader: Any) -> dict[str, Any]:
    """A reader's chunk as columns: ``raw.columns`` when the reader gives several, else its one field
    (text, or token ids as a :class:`~zephon.records.TokenColumn`)."""
    columns = getattr(raw, "columns", None)
    if columns:
        return {k: TokenColumn(v.values, v.offsets, v.valid) if hasattr(v, "offsets") else v for k, v in columns.items()}
    field = getattr(reader, "text_field", None) or getattr(reader, "field", None) or "text"
    if raw.tokens is not None:
        return {field: TokenColumn(raw.tokens.values, raw.tokens.offsets, raw.tokens.valid)}
    return {field: raw.texts}


def drop_delivered(chunk: Chunk, source_name: str) -> Chunk:
    """Drop the first ``chunk.skip_pending`` records (delivered before the checkpoint), after checking
    that the position is exactly between two records made from the chunk's first input record."""
    s = chunk.skip_pending
    if s > chunk.n or (s and (int(chunk.resume_cursor[s - 1]), int(chunk.resume_skip[s - 1])) != (chunk.start_cursor, s)):
        raise ResumeMismatch(
            f"source '{source_name}': the checkpoint's position (cursor {chunk.start_cursor}, skip {s}) in "
            f"{chunk.path} does not fall between two records the pipeline makes from there: the data or the pipeline "
            f"changed since the checkpoint, or the state was edited. Resume on the same data with the same pipeline.")
    keep = np.arange(s, chunk.n, dtype=np.int64)
    skipped = chunk.skipped
    out = chunk.select(keep, renumber=False)  # delivered records still count in the skips after them
    out.skipped, out.skip_pending = skipped, 0
    return out

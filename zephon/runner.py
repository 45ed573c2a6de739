"""Runners for the stateless work (read + tokenize a chunk): inline, threads or processes.

Runners only change *where* a chunk is computed. Results come back through futures that each lane
consumes in submission order (the reorder buffer in :mod:`zephon.nodes.chunks`), so no runner, worker
count or completion order can change what a lane sees.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

import fsspec
import numpy as np

from .plan import ChunkTask, WorkPlan
from .readers import make_reader
from .recipe import Recipe
from .tokenizer import Tokenizer, load_tokenizer

TextMap = Optional[Callable[[str], str]]
TextFilter = Optional[Callable[[str], bool]]
RUNNERS = ("thread", "process")


@dataclass
class TokenizedChunk:
    """A chunk's documents as one flat token array; the cursor after each kept document."""

    source: int
    unit_seq: int
    unit_end: bool
    start_cursor: int
    tokens: np.ndarray  # int32 [T]
    offsets: np.ndarray  # int64 [n+1]
    next_cursors: np.ndarray  # int64 [n]
    end_cursor: int
    raw_records: int
    skipped: int  # null / blank / empty / filtered records

    @property
    def n_docs(self) -> int:
        return len(self.offsets) - 1


class ChunkWorker:
    """Everything a worker needs to turn a :class:`ChunkTask` into a :class:`TokenizedChunk`."""

    def __init__(self, recipe: Recipe, plan: WorkPlan | None = None, text_map: TextMap = None,
                 text_filter: TextFilter = None) -> None:
        if plan is not None:
            self.readers = [s.reader for s in plan.sources]
        else:  # a worker process: readers only, the plan (file listing) stays in the main process
            self.readers = [make_reader(recipe, s, fsspec.core.url_to_fs(s.path[0])[0]) for s in recipe.sources]
        self.tokenizer: Tokenizer = load_tokenizer(recipe.tokenizer)
        self.text_map = text_map
        self.text_filter = text_filter

    def __call__(self, task: ChunkTask) -> TokenizedChunk:
        if task.empty:
            empty = np.zeros(0, dtype=np.int64)
            return TokenizedChunk(task.source, task.unit_seq, True, task.start, np.zeros(0, np.int32), np.zeros(1, np.int64),
                                  empty, task.end, 0, 0)
        reader = self.readers[task.source]
        raw = reader.read(task.path, task.start, task.end)
        texts = raw.texts
        if self.text_map is not None:
            texts = [None if t is None else self.text_map(t) for t in texts]
        keep = [k for k, t in enumerate(texts) if t and (self.text_filter is None or self.text_filter(t))]
        tokens, offsets = self.tokenizer.encode([texts[k] for k in keep])
        cursors = raw.next_cursors[keep] if keep else np.zeros(0, dtype=np.int64)
        lengths = np.diff(offsets)
        if len(lengths) and not lengths.all():  # documents that tokenize to nothing
            nz = lengths > 0
            tokens = np.concatenate([tokens[a:b] for a, b, k in zip(offsets[:-1], offsets[1:], nz) if k]) \
                if nz.any() else np.zeros(0, np.int32)
            offsets = np.concatenate([[0], np.cumsum(lengths[nz])]).astype(np.int64)
            cursors = cursors[nz]
        return TokenizedChunk(task.source, task.unit_seq, task.unit_end, task.start, tokens, offsets, cursors,
                              raw.end_cursor, len(texts), len(texts) - (len(offsets) - 1))


class _Deferred:
    """An inline "future": computed on first ``result()`` so num_workers=0 does no work ahead."""

    __slots__ = ("_fn", "_arg", "_value")

    def __init__(self, fn: Callable, arg: object) -> None:
        self._fn, self._arg, self._value = fn, arg, None

    def result(self) -> TokenizedChunk:
        if self._fn is not None:
            self._value = self._fn(self._arg)
            self._fn = self._arg = None
        return self._value


_PROCESS_WORKER: ChunkWorker | None = None


def _init_process(recipe: Recipe, text_map: TextMap, text_filter: TextFilter) -> None:
    global _PROCESS_WORKER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _PROCESS_WORKER = ChunkWorker(recipe, None, text_map, text_filter)


def _run_in_process(task: ChunkTask) -> TokenizedChunk:
    assert _PROCESS_WORKER is not None
    return _PROCESS_WORKER(task)


class Runner:
    """Submits chunk tasks to ``num_workers`` threads or processes (0: inline, lazily)."""

    def __init__(self, recipe: Recipe, plan: WorkPlan, num_workers: int = 0, kind: str = "thread",
                 text_map: TextMap = None, text_filter: TextFilter = None) -> None:
        if kind not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {kind!r}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.num_workers = num_workers
        self.kind = kind if num_workers else "inline"
        self._executor: Executor | None = None
        self._worker: ChunkWorker | None = None
        if num_workers == 0 or kind == "thread":
            self._worker = ChunkWorker(recipe, plan, text_map, text_filter)
        if num_workers and kind == "thread":
            self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="zephon-chunk")
        elif num_workers and kind == "process":
            ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")
            self._executor = ProcessPoolExecutor(num_workers, mp_context=ctx, initializer=_init_process,
                                                 initargs=(recipe, text_map, text_filter))

    def submit(self, task: ChunkTask) -> "Future[TokenizedChunk] | _Deferred":
        if self._executor is None:
            return _Deferred(self._worker, task)
        if self._worker is not None:
            return self._executor.submit(self._worker, task)
        return self._executor.submit(_run_in_process, task)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._worker.tokenizer if self._worker else None

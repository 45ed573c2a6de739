"""Runners for the stateless work (read + tokenize a chunk): inline, threads or processes.

Runners only change *where* a chunk is computed. Results come back through futures that each lane
consumes in submission order (the reorder buffer in :mod:`zephon.nodes.chunks`), so no runner, worker
count or completion order can change what a lane sees.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from .plan import ChunkTask, WorkPlan
from .pretokenized import frame_token_rows
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

    def __init__(self, recipe: Recipe, plan: WorkPlan, text_map: TextMap = None,
                 text_filter: TextFilter = None) -> None:
        self.readers = [s.reader for s in plan.sources]
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
        if raw.tokens is not None:  # a pre-tokenized source: frame its ids, no tokenizer call
            tokens, offsets, cursors, n, skipped = frame_token_rows(self.tokenizer, raw, reader.source, task.path)
            return TokenizedChunk(task.source, task.unit_seq, task.unit_end, task.start, tokens, offsets, cursors,
                                  raw.end_cursor, n, skipped)
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


class Runner:
    """Submits chunk tasks to ``num_workers`` threads (0: inline and lazily, on ``result()``).

    Whole lanes on processes are :class:`zephon.lane_hosts.ProcessLanes`; this runner is the
    chunk-level parallelism inside one process (tokenizers release the GIL while they encode).
    """

    def __init__(self, recipe: Recipe, plan: WorkPlan, num_workers: int = 0, kind: str = "thread",
                 text_map: TextMap = None, text_filter: TextFilter = None) -> None:
        if kind != "thread":
            raise ValueError(f"a chunk Runner runs threads; got kind={kind!r} (use runner='process' in "
                             f"build_loader for worker processes)")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.num_workers = num_workers
        self.kind = kind if num_workers else "inline"
        self._worker = ChunkWorker(recipe, plan, text_map, text_filter)
        self._executor: ThreadPoolExecutor | None = None
        if num_workers:
            self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="zephon-chunk")

    def submit(self, task: ChunkTask) -> "Future[TokenizedChunk] | _Deferred":
        if self._executor is None:
            return _Deferred(self._worker, task)
        return self._executor.submit(self._worker, task)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    @property
    def tokenizer(self) -> Tokenizer:
        return self._worker.tokenizer

"""Runners for the stateless work (read + tokenize a chunk): inline, threads or a process pool.

Runners only change *where* a chunk is computed. Results come back through futures that each lane
consumes in submission order (the reorder buffer in :mod:`zephon.nodes.chunks`), so no runner, worker
count or completion order can change what a lane sees.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import pickle
import threading
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from .plan import ChunkTask, WorkPlan
from .pretokenized import frame_token_rows
from .readers.base import RawChunk, is_blank
from .recipe import Recipe
from .tokenizer import Tokenizer, load_tokenizer
from .worker_guard import Trainer, exit_with, this_process

TextMap = Optional[Callable[[str], str]]
TextFilter = Optional[Callable[[str], bool]]
RUNNERS = ("thread", "pool", "process")


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
        if sum(len(t) for t in raw.texts if t) >= OFF_MAIN_MIN_CHARS:
            return run_off_main_thread(self._tokenize, task, raw)  # runs in place off main threads
        return self._tokenize(task, raw)

    def _tokenize(self, task: ChunkTask, raw: RawChunk) -> TokenizedChunk:
        """The text hooks and the tokenizer on one chunk's texts (the part worth a helper thread)."""
        texts = raw.texts
        if self.text_map is not None:
            texts = [None if t is None else self.text_map(t) for t in texts]
        # null, empty and whitespace-only texts are skipped (and counted), never EOS-only documents
        keep = [k for k, t in enumerate(texts) if not is_blank(t) and (self.text_filter is None or self.text_filter(t))]
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


# -- the tokenizer off the main thread ----------------------------------------------------------------
# glibc serves a process's main thread from its main (brk) malloc arena and every other thread from an
# arena of its own. The tokenizers' per-call allocations run ~20% slower on the main arena, on the same
# documents (BENCHMARKS.md section 6: scripts/bench/arena.py, and MALLOC_ARENA_MAX=1 making worker
# threads just as slow). So a chunk that would be tokenized on a main thread (inline runner, pool
# processes) is handed to one helper thread and waited for: the same work, one thread busy at a time, no
# work ahead. The hand-off wakes two threads (~0.1-1 ms on a VM), more than the arena saves on a small
# chunk (fetch-and-batch's 64 short records lost ~30% to it), so chunks under this much text stay put.
OFF_MAIN_MIN_CHARS = 16_384
_HELPER: "tuple[int, ThreadPoolExecutor] | None" = None  # (pid, executor): a forked child makes its own
_HELPER_LOCK = threading.Lock()


def run_off_main_thread(fn: Callable[..., TokenizedChunk], *args: object) -> TokenizedChunk:
    """``fn(*args)``, computed on this process's chunk helper thread if called from the main thread."""
    global _HELPER
    if threading.current_thread() is not threading.main_thread():
        return fn(*args)
    with _HELPER_LOCK:
        if _HELPER is None or _HELPER[0] != os.getpid():
            _HELPER = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="zephon-chunk-inline"))
        executor = _HELPER[1]
    return executor.submit(fn, *args).result()


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


_POOL_WORKER: "ChunkWorker | None" = None  # the ChunkWorker of this pool process


def _pool_init(recipe: Recipe, text_map: TextMap, text_filter: TextFilter, trainer: Trainer) -> None:
    """Pool process start-up: one tokenizer and one set of readers per process, built once; the
    process exits when ``trainer`` (the process that made the pool) dies."""
    global _POOL_WORKER
    exit_with(trainer)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _POOL_WORKER = ChunkWorker(recipe, WorkPlan(recipe), text_map, text_filter)


def _pool_run(task: ChunkTask) -> TokenizedChunk:
    assert _POOL_WORKER is not None, "chunk pool process was not initialised"
    return _POOL_WORKER(task)


def check_picklable(**hooks: object) -> None:
    """Raise a clear error if a per-document hook cannot be sent to worker processes."""
    for name, hook in hooks.items():
        try:
            pickle.dumps(hook)
        except Exception as exc:
            raise ValueError(f"{name}={hook!r} cannot be sent to worker processes ({exc}); with a process "
                             f"runner pass a module-level function, or use runner='thread'.") from None


# Modules the forkserver imports once, before it forks any worker. Without them every worker imports
# zephon (and through torchdata, torch: ~2.5 s here) on its own before its first chunk; with them a
# worker starts as a fork of a process that has them (BENCHMARKS.md section 1d, scripts/bench/startup.py).
# The trainer's own `__main__` is no substitute: until CPython gh-126631 was fixed (3.11 has not) the
# forkserver never preloads it, whatever the preload list says.
WORKER_PRELOAD = ("zephon.runner", "zephon.lane_hosts")


@functools.lru_cache(maxsize=1)
def _server_finds_this_zephon() -> bool:
    """Whether a forkserver would import *this* zephon. Until CPython gh-117378 was fixed (3.11 has
    not) the server ignores the parent's ``sys.path`` and imports from a fresh interpreter's (same executable,
    environment and directory); a program that put another checkout first on ``sys.path`` must not get
    workers forked from a server holding a different zephon. Asked once, of a fresh interpreter
    (``find_spec`` locates the package without importing it)."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent / "__init__.py"
    probe = "import importlib.util as u; s = u.find_spec('zephon'); print(s.origin if s else '')"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        return out.returncode == 0 and bool(out.stdout.strip()) and Path(out.stdout.strip()).resolve() == here
    except (OSError, subprocess.SubprocessError):
        return False


def process_context() -> mp.context.BaseContext:
    """forkserver where the platform has it (no fork of a threaded trainer), else spawn.

    The forkserver is asked to preload :data:`WORKER_PRELOAD` in addition to whatever the program
    already asked for, if it would import this very zephon. That only takes effect if the forkserver
    is not running yet: a program whose forkserver started earlier keeps its own preload. Correctness
    never depends on it: a worker imports what it lacks.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    current = list(getattr(server, "_preload_modules", None) or ["__main__"])
    wanted = current + [m for m in WORKER_PRELOAD if m not in current]
    if wanted != current and _server_finds_this_zephon():
        ctx.set_forkserver_preload(wanted)
    return ctx


def start_worker_server() -> mp.context.BaseContext:
    """:func:`process_context`, with its forkserver started now rather than at the first worker.

    Called when a loader with worker processes is built: the server's imports then overlap whatever the
    trainer does before its first batch (building the model, loading a checkpoint) instead of delaying
    that batch. A no-op for spawn, and for a forkserver already running.
    """
    ctx = process_context()
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()
    return ctx


MAIN_GUARD_HINT = ("Most often the script that builds the loader has no `if __name__ == \"__main__\":` guard: "
                   "worker processes start with forkserver/spawn and import the main module again. Guard the "
                   "script's entry point, or use runner='thread'.")
POOL_DEATH = ("a Zephon chunk-pool process died without reporting an error, at start-up or killed (out of "
              "memory? see dmesg). " + MAIN_GUARD_HINT)


class _PoolFuture:
    """A pool future whose ``result()`` turns a dead pool into an error that says what to do."""

    __slots__ = ("_future",)

    def __init__(self, future: Future) -> None:
        self._future = future

    def result(self) -> TokenizedChunk:
        try:
            return self._future.result()
        except BrokenProcessPool as exc:
            raise RuntimeError(POOL_DEATH) from exc


class Runner:
    """Submits chunk tasks to ``num_workers`` workers (0: inline and lazily, on ``result()``).

    ``kind="thread"``: worker threads of this process (tokenizers release the GIL while they encode).
    ``kind="pool"``: a pool of worker processes that only read and tokenize; every lane's accumulators
    (mix, shuffle, pack) stay in this process, behind the same reorder buffers. Whole lanes on
    processes are :class:`zephon.lane_hosts.ProcessLanes` (``runner="process"`` in ``build_loader``).
    """

    def __init__(self, recipe: Recipe, plan: WorkPlan, num_workers: int = 0, kind: str = "thread",
                 text_map: TextMap = None, text_filter: TextFilter = None) -> None:
        if kind not in ("thread", "pool"):
            raise ValueError(f"a chunk Runner runs 'thread' or 'pool' workers; got kind={kind!r} (use "
                             f"runner='process' in build_loader for whole lanes on worker processes)")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.num_workers = num_workers
        self.kind = kind if num_workers else "inline"
        self._worker = ChunkWorker(recipe, plan, text_map, text_filter)
        self._executor: ThreadPoolExecutor | ProcessPoolExecutor | None = None
        if num_workers and kind == "thread":
            self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="zephon-chunk")
        elif num_workers:
            check_picklable(text_map=text_map, text_filter=text_filter)
            self._executor = ProcessPoolExecutor(num_workers, mp_context=start_worker_server(), initializer=_pool_init,
                                                 initargs=(recipe, text_map, text_filter, this_process()))

    def submit(self, task: ChunkTask) -> "Future[TokenizedChunk] | _Deferred | _PoolFuture":
        if self._executor is None:
            return _Deferred(self._worker, task)
        if self.kind == "pool":
            try:
                return _PoolFuture(self._executor.submit(_pool_run, task))
            except BrokenProcessPool as exc:
                raise RuntimeError(POOL_DEATH) from exc
        return self._executor.submit(self._worker, task)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    @property
    def tokenizer(self) -> Tokenizer:
        return self._worker.tokenizer

"""Executors: where stateless tasks run. One small protocol, one class per backend.

An executor runs tasks of a :class:`~zephon.engine.stages.StageProgram` (``program.run(source, stage,
item)``: read a chunk and apply a stage's transforms) and hands back a handle whose ``result()`` is
the task's output. Order is not its business: each source of each lane keeps its own queue of handles
and takes results in submission order (:class:`~zephon.engine.sources.StageBuffer`), so no backend,
worker count or completion order can change what a lane sees. A new backend is one class with
``submit`` and ``close`` (and ``start`` if it needs the program ahead of the first task).

Backends: ``inline`` (computed lazily on ``result()``, in the caller), ``thread`` (a thread pool; the
tokenizers, pyarrow and codecs release the GIL), ``process`` (a pool of worker processes from a
forkserver; the program is sent once, at start-up, so user functions must be picklable), and ``ray``
(:mod:`zephon.engine.ray_executor`). :func:`zephon.engine.runners.make_executor` makes one by kind.
"""

from __future__ import annotations

import os
import pickle
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Protocol

from .worker_guard import Trainer, exit_with, this_process
from . import tokenizer_pool
from .stages import StageProgram
from .transfer import Outbox, discard, receive, share


class Handle(Protocol):
    """A submitted task. A handle may also have ``done() -> bool`` (whether ``result()`` would return at
    once): the lanes then read further ahead while the trainer waits (:class:`~zephon.engine.sources.ReadAhead`)."""

    def result(self) -> Any: ...


class Executor(Protocol):
    """Runs stateless tasks; see the module docstring."""

    kind: str
    num_workers: int

    def submit(self, source: int, stage: int, item: Any) -> Handle: ...

    def close(self) -> None: ...


class _Deferred:
    """An inline "future": computed on first ``result()``, so that an inline loader does no work ahead."""

    __slots__ = ("_call", "_value")

    def __init__(self, call: tuple) -> None:
        self._call, self._value = call, None

    def result(self) -> Any:
        if self._call is not None:
            fn, *args = self._call
            self._value = fn(*args)
            self._call = None
        return self._value


class InlineExecutor:
    """Tasks run in the calling thread, when their result is asked for."""

    kind = "inline"
    num_workers = 0

    def __init__(self, program: StageProgram) -> None:
        self.program = program
        program.setup()

    def submit(self, source: int, stage: int, item: Any) -> Handle:
        return _Deferred((self.program.run, source, stage, item))

    def close(self) -> None:
        pass


class ThreadExecutor:
    """Tasks on ``num_workers`` threads of this process."""

    kind = "thread"

    def __init__(self, program: StageProgram, num_workers: int, hf_tokenizing: bool = False) -> None:
        if num_workers < 1:
            raise ValueError(f"a thread executor needs num_workers >= 1, got {num_workers}")
        self.program, self.num_workers = program, num_workers
        # its threads run Hugging Face tokenizers: their own thread pool may have to give way to them
        self._serial = hf_tokenizing and tokenizer_pool.acquire(num_workers)
        try:
            program.setup()
        except BaseException:  # a reader or tokenizer that fails to load: no executor holds the setting
            self._release_serial()
            raise
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(num_workers, thread_name_prefix="zephon-chunk")

    def submit(self, source: int, stage: int, item: Any) -> Handle:
        assert self._pool is not None, "executor is closed"
        return self._pool.submit(self.program.run, source, stage, item)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._release_serial()

    def _release_serial(self) -> None:
        if self._serial:
            self._serial = False
            tokenizer_pool.release()


# -- process pool ---------------------------------------------------------------------------------------
MAIN_GUARD_HINT = ("Most often the script that builds the loader has no `if __name__ == \"__main__\":` guard: "
                   "worker processes start with forkserver/spawn and import the main module again. Guard the "
                   "script's entry point, or use runner='thread'.")
POOL_DEATH = ("a Zephon worker process died without reporting an error, at start-up or killed (out of memory? "
              "see dmesg). " + MAIN_GUARD_HINT)

_PROGRAM: StageProgram | None = None  # this pool process's program
_OUTBOX: str | None = None  # where this worker writes its large results (zephon.engine.transfer)


def _pool_init(program: StageProgram, trainer: Trainer, outbox: str | None) -> None:
    """Pool process start-up: exit with the trainer; readers and tokenizers built once per process."""
    global _PROGRAM, _OUTBOX
    exit_with(trainer)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _PROGRAM, _OUTBOX = program, outbox
    program.setup()


def _pool_run(source: int, stage: int, item: Any) -> Any:
    assert _PROGRAM is not None, "worker process was not initialised"
    return share(_PROGRAM.run(source, stage, item), _OUTBOX)  # large values through shared memory


class _PoolHandle:
    """A pool future whose ``result()`` turns a dead pool into an error that says what to do."""

    __slots__ = ("_future", "_taken", "_settle")

    def __init__(self, future: Future, settle: Callable[[], None]) -> None:
        self._future = future
        self._taken = False
        self._settle = settle  # the executor's: wait until its broken pool is shut down

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> Any:
        try:
            out = self._future.result()
        except BrokenProcessPool as exc:
            self._settle()
            raise RuntimeError(POOL_DEATH) from exc
        if self._taken:
            raise RuntimeError("a pool task's result was asked for twice; its shared-memory file is gone")
        self._taken = True
        return receive(out)

    def __del__(self) -> None:  # abandoned (a resume, an intervention, a loader dropped): its file goes now
        if not self._taken:
            self._future.add_done_callback(_discard_result)


def _discard_result(future: Future) -> None:
    if not future.cancelled() and future.exception() is None:
        discard(future.result())


def check_picklable(program: StageProgram) -> None:
    """A clear error naming the operator whose function cannot be sent to worker processes."""
    for op in program.transforms():
        try:
            pickle.dumps(op)
        except Exception as exc:  # noqa: BLE001 - pickling can fail in many ways
            raise ValueError(f"operator '{op.name}' cannot be sent to worker processes ({type(exc).__name__}: "
                             f"{exc}); with a process or Ray executor pass a module-level function (not a lambda "
                             f"or a local function), or use the thread runner.") from None


class ProcessExecutor:
    """Tasks on a pool of ``num_workers`` worker processes (forked from Zephon's forkserver)."""

    kind = "process"

    def __init__(self, program: StageProgram, num_workers: int) -> None:
        from .processes import start_worker_server

        if num_workers < 1:
            raise ValueError(f"a process executor needs num_workers >= 1, got {num_workers}")
        check_picklable(program)
        self.program, self.num_workers = program, num_workers
        self._outbox = Outbox()
        self._pool: ProcessPoolExecutor | None = ProcessPoolExecutor(
            num_workers, mp_context=start_worker_server(), initializer=_pool_init,
            initargs=(program, this_process(), self._outbox.path))

    def submit(self, source: int, stage: int, item: Any) -> Handle:
        assert self._pool is not None, "executor is closed"
        try:
            return _PoolHandle(self._pool.submit(_pool_run, source, stage, item), self._settle_broken)
        except BrokenProcessPool as exc:
            self._settle_broken()
            raise RuntimeError(POOL_DEATH) from exc

    def _settle_broken(self) -> None:
        """Wait until the broken pool's own thread has shut it down. Why: CPython 3.11's exit handler wakes
        every pool's thread without the pool's lock, and a broken pool's thread may be closing that pipe just
        then ("OSError: Bad file descriptor" after the error, at exit); ``shutdown`` wakes it under the lock."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
            self._outbox.close()  # with the results the pool wrote that were never asked for

"""Worker processes that exit when the trainer that started them dies, even by ``kill -9``.

Zephon's worker processes are forked by a forkserver, not by the trainer, so nothing tells them when the
trainer dies: a pool worker waits for its next task for ever (it holds both ends of the task queue's
pipe, so it never sees EOF) and a lane worker keeps retrying its full output queue. Each of them also
holds the write ends of the forkserver's "alive" pipe and of the resource tracker's pipe, so those two
processes, which exit on EOF, live on as well. A worker therefore watches the trainer itself
(:func:`exit_with`) and exits as soon as it is gone; the forkserver and the resource tracker then see
EOF and exit on their own.

The trainer is named by a :class:`Trainer` (pid and start time) taken in the trainer's own process
(:func:`this_process`) and handed to the worker with its start-up arguments.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from typing import Callable, NamedTuple, Optional

POLL_S = 0.5  # how often a worker without pidfds looks for its trainer
EXIT_CODE = 1  # a worker whose trainer is gone; nobody is left to read it


class Trainer(NamedTuple):
    """The process whose death a worker follows. ``start`` (clock ticks after boot, from
    ``/proc/PID/stat``; None where there is no /proc) tells the trainer apart from a later process
    that got its pid."""

    pid: int
    start: Optional[int]


def _proc_stat(pid: int) -> Optional[tuple[str, int]]:
    """Fields 3 and 22 of ``/proc/PID/stat`` (the state letter and the start time), or None where they
    cannot be read (no such process, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count fields after its last ')'
    fields = stat[stat.rindex(b")") + 2:].split()
    return fields[0].decode(), int(fields[19])


def this_process() -> Trainer:
    """The calling process as a :class:`Trainer`, for the workers it is about to start."""
    pid = os.getpid()
    stat = _proc_stat(pid)
    return Trainer(pid, None if stat is None else stat[1])


def exit_with(trainer: Trainer) -> None:
    """Make this worker process exit (``os._exit``) promptly once ``trainer`` has died.

    Called first thing in a worker process. A daemon thread waits for the trainer's death and then ends
    the process: on Linux on a pidfd of the trainer (event-driven, and a pidfd names one process, so a
    recycled pid cannot fool it), on Windows on a handle of it, elsewhere by asking every
    :data:`POLL_S` seconds whether its pid still runs. If the trainer is already gone, that is at once.
    On Linux the worker also asks for SIGKILL when its direct parent (the forkserver) dies.
    """
    _set_parent_death_signal(trainer)
    if sys.platform == "win32":
        wait = _handle_waiter(trainer)
    else:
        wait = _pidfd_waiter(trainer) or _poller(trainer)
    if wait is not None:
        threading.Thread(target=_exit_after, args=(wait,), name="zephon-trainer-watch", daemon=True).start()


def _exit_after(wait: Callable[[], object]) -> None:
    """The watcher thread: block until the trainer is gone, then end this process at once. What the
    worker computes can no longer be delivered, so nothing is flushed or joined (that could block)."""
    wait()
    os._exit(EXIT_CODE)


def _gone() -> None:
    """The wait for a trainer that is already dead."""


def _pidfd_waiter(trainer: Trainer) -> Optional[Callable[[], object]]:
    """Linux: a wait on a pidfd of the trainer, or None where pidfds are unavailable (a kernel before
    5.3, a seccomp profile that refuses them, not Linux)."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        fd = os.pidfd_open(trainer.pid)
    except ProcessLookupError:
        return _gone
    except OSError:
        return None
    # the pidfd names whichever process holds the pid now: if that is not the trainer (another start
    # time), the trainer died and its pid was reused before this worker got here
    stat = _proc_stat(trainer.pid)
    if trainer.start is not None and (stat is None or stat[1] != trainer.start):
        os.close(fd)
        return _gone

    def wait() -> None:
        poller = select.poll()  # poll, not select: select refuses fds >= 1024
        poller.register(fd, select.POLLIN)
        while not poller.poll():  # readable once the whole process has exited
            pass

    return wait


def _handle_waiter(trainer: Trainer) -> Optional[Callable[[], object]]:
    """Windows: a wait on a handle of the trainer process, as CPython's spawn waits for a child's parent
    (``os.kill`` is no liveness test there: it terminates). None if no handle can be had."""
    import _winapi  # type: ignore[import-not-found]

    try:
        handle = _winapi.OpenProcess(_winapi.SYNCHRONIZE, False, trainer.pid)
    except OSError:
        return None
    return lambda: _winapi.WaitForSingleObject(handle, _winapi.INFINITE)


def _alive(trainer: Trainer) -> bool:
    """POSIX: whether the trainer still runs: its pid exists and, where /proc tells, it is not a zombie
    (killed, its parent yet to reap it; ``kill(pid, 0)`` still succeeds then) and started when it did."""
    try:
        os.kill(trainer.pid, 0)
    except (ProcessLookupError, PermissionError):  # no such pid, or one of another user's processes now
        return False
    stat = _proc_stat(trainer.pid) if trainer.start is not None else None
    return stat is None or (stat[0] not in "ZX" and stat[1] == trainer.start)


def _poller(trainer: Trainer) -> Callable[[], object]:
    """POSIX without pidfds: a wait that asks :func:`_alive` every :data:`POLL_S` seconds."""

    def wait() -> None:
        while _alive(trainer):
            time.sleep(POLL_S)

    return wait


def _set_parent_death_signal(trainer: Trainer) -> bool:
    """Linux: SIGKILL this process when its direct parent dies, if that parent is not the trainer.

    Linux sends it when the parent *thread* that forked us exits. The forkserver forks on its only thread,
    but a trainer may start workers from a short-lived thread (a process pool spawns on demand from
    whichever thread submits), so a parent that is the trainer is left to the trainer watch alone.
    Returns whether the signal was set.
    """
    if not sys.platform.startswith("linux") or os.getppid() == trainer.pid:
        return False
    PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False

"""Local files kept open between a reader's reads, each with what was derived from the file it reads.

A lane reads a shard chunk by chunk. Checking the shard's size and version (a ``stat``), opening it,
reading and closing it for every chunk costs four system calls, and each lets go of the GIL: with worker
threads, every one is a chance for another thread to take the GIL, and the reader then waits to get it
back, which on a chunk of light work costs more than the work (BENCHMARKS.md 8a). Kept open, a chunk costs
one ``pread``.

What a descriptor reads is the file it was opened on, even if the path is replaced meanwhile (a new file
renamed over it), so what was derived from that file when it was opened (a shard's index, keyed by the
descriptor's own ``fstat``) stays true of every byte read through it. A path replaced while its file is open
is read as it was when opened; once evicted (least recently used, past ``limit`` files), the next lease opens
the path afresh and derives again. A lease can ask for a file opened no earlier than a :meth:`mark`
(``since``): a reader made after a file was rewritten in place, which an open descriptor would not notice,
then opens it afresh instead of using the descriptor an earlier reader left open. A file rewritten in
place while open is read through its descriptor as it is now: a caller checks what it reads against what
it derived (the WebDataset reader checks tar headers against the index).

Example::

    files = OpenFiles(limit=64)
    with files.lease("/data/shard-000.tar", lambda path, fd, st: st.st_size) as (fd, size):
        head = os.pread(fd, 512, 0)
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class _Open(Generic[T]):
    __slots__ = ("fd", "derived", "serial", "leases", "evicted")

    def __init__(self, fd: int, derived: T, serial: int) -> None:
        self.fd, self.derived, self.serial, self.leases, self.evicted = fd, derived, serial, 0, False


class OpenFiles(Generic[T]):
    """At most ``limit`` local files held open (more while leased), shared by the threads that lease them.

    A descriptor is closed only when no lease holds it: never under a thread that is reading through it.
    Not shared across processes: a copy of the reader (pickled for a worker process) starts with none open.
    """

    def __init__(self, limit: int = 64) -> None:
        if limit < 1:
            raise ValueError(f"OpenFiles needs limit >= 1, got {limit}")
        self.limit = limit
        self._lock = threading.Lock()  # held for bookkeeping only, never across a system call
        self._files: OrderedDict[str, _Open[T]] = OrderedDict()
        self._opened = 0  # files opened so far: each open file's serial number
        self._owners = 0  # live objects attached (:meth:`attach`)
        # its own lock: a finalizer may run inside any allocation, even one made while ``_lock`` is held
        self._owners_lock = threading.Lock()
        weakref.finalize(self, _close_all, self._files, self._lock)

    def attach(self, owner: object) -> None:
        """Keep files open for ``owner`` (a reader): once every attached owner has been garbage-collected,
        every file is closed, so a process holds no descriptor (nor a deleted file's disk space) after the
        last loader that read through this set is gone."""
        with self._owners_lock:
            self._owners += 1
        weakref.finalize(owner, self._detach)

    def _detach(self) -> None:
        with self._owners_lock:
            self._owners -= 1
            last = self._owners == 0
        if last and not _close_all(self._files, self._lock, wait=0):
            # the lock is held, perhaps by this very thread (the collector ran inside a locked block): close
            # from another thread once it is free
            try:
                threading.Thread(target=self.close, name="zephon-open-files-close", daemon=True).start()
            except RuntimeError:  # interpreter shutdown: the OS closes them
                pass

    def mark(self) -> int:
        """A point in time for :meth:`lease`'s ``since``: the count of files opened so far (a file's serial
        number is the count once it is open, so files opened after the mark have larger ones)."""
        with self._lock:
            return self._opened

    @contextmanager
    def lease(self, path: str, derive: Callable[[str, int, os.stat_result], T],
              since: int = 0) -> Iterator[tuple[int, T]]:
        """``(fd, derived)`` for ``path``, opened (and ``derive(path, fd, fstat)`` called) unless it is open
        since the :meth:`mark` ``since``.

        ``FileNotFoundError`` and ``derive``'s errors pass through; nothing stays open after them."""
        entry = self._take(path, since)
        if entry is None:
            entry = self._open(path, derive, since)
        try:
            yield entry.fd, entry.derived
        finally:
            with self._lock:
                entry.leases -= 1
                done = entry.evicted and entry.leases == 0
            if done:
                os.close(entry.fd)

    def _take(self, path: str, since: int) -> _Open[T] | None:
        with self._lock:
            entry = self._files.get(path)
            if entry is None or entry.serial <= since:
                return None
            self._files.move_to_end(path)
            entry.leases += 1
            return entry

    def _open(self, path: str, derive: Callable[[str, int, os.stat_result], T], since: int) -> _Open[T]:
        fd = os.open(path, os.O_RDONLY)
        try:
            derived = derive(path, fd, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        closing: list[int] = []
        with self._lock:
            entry = self._files.get(path)
            if entry is None or entry.serial <= since:  # else another thread opened it meanwhile: theirs is kept
                if entry is not None:  # opened before the mark ``since``: this one replaces it
                    del self._files[path]
                    entry.evicted = True
                    if entry.leases == 0:
                        closing.append(entry.fd)
                self._opened += 1
                entry = self._files[path] = _Open(fd, derived, self._opened)
                while len(self._files) > self.limit:
                    _, old = self._files.popitem(last=False)
                    old.evicted = True
                    if old.leases == 0:
                        closing.append(old.fd)
            else:
                self._files.move_to_end(path)
                closing.append(fd)
            entry.leases += 1
        for stale in closing:
            os.close(stale)
        return entry

    def close(self) -> None:
        """Close every file no lease holds (the others as their leases end)."""
        _close_all(self._files, self._lock)

    def __len__(self) -> int:
        return len(self._files)


def _close_all(files: OrderedDict, lock: threading.Lock, wait: float = 5) -> bool:
    """Close every file no lease holds; False if ``lock`` was not free within ``wait`` seconds."""
    got = lock.acquire(timeout=wait) if wait > 0 else lock.acquire(blocking=False)
    if not got:  # (at interpreter exit, a daemon thread may have stopped holding it: the OS closes them)
        return False
    closing = []
    try:
        for entry in files.values():
            entry.evicted = True
            if entry.leases == 0:
                closing.append(entry.fd)
        files.clear()
    finally:
        lock.release()
    for fd in closing:
        try:
            os.close(fd)
        except OSError:
            pass
    return True


__all__ = ["OpenFiles"]

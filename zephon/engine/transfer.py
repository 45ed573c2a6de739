"""Results from worker processes without copying their large values through a pipe.

A chunk of image-caption records is mostly bytes (~25 kB an image), and a decoded one mostly pixel
arrays. Sent as a plain pickle through a pool's or a queue's pipe, every value is copied four times
(pickled, written, read, unpickled), two of them in the trainer's process. Instead, the worker pickles
the result with its large values *out of band*: numpy arrays as pickle-5 buffers and long ``bytes`` as
persistent references, all written with one ``pwritev`` into a file in shared memory (``/dev/shm``);
only the small pickle goes through the pipe. The trainer's process opens the file, removes it at once
and reads each value with one ``pread`` (one copy; arrays own their memory, so nothing keeps the file's
pages). The result is the same object, value for value: the runner never changes a batch.

Each pool or lane host has an :class:`Outbox`: a private directory (mode 0700) in ``/dev/shm`` that its
workers write into, locked (``flock``) by the trainer's process for as long as it lives. Closing the
owner removes the directory with whatever was never read (a loader closed mid-step, results abandoned at
a resume); so does the owner's garbage collection or the interpreter's exit; and any new outbox removes
the directories whose lock nobody holds (their trainer died). A result that would leave ``/dev/shm``
with less than :data:`HEADROOM` free, or whose write fails, goes through the pipe as before; so does
everything where there is no ``/dev/shm``.
"""

from __future__ import annotations

import fcntl
import glob
import io
import itertools
import os
import pickle
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from typing import Any

SHM_DIR = "/dev/shm"
PREFIX = "zephon-xfer-"
LOCK = ".lock"
MIN_SHARED_BYTES = 256 << 10  # a result with fewer out-of-band bytes goes through the pipe as it is
MIN_VALUE_BYTES = 4096  # bytes values from this size on travel out of band
HEADROOM = (64 << 20, 0.25)  # leave at least this much of /dev/shm free (bytes, fraction): others need it too
ALIGN = 64  # where each out-of-band value starts in the file
STALE_UNLOCKED_S = 60.0  # an outbox without its lock file yet is being created, unless older than this
_counter = itertools.count()


class Outbox:
    """A private, locked directory in ``/dev/shm`` for one pool's or lane host's results (see the module
    docstring). ``path`` is None where there is no ``/dev/shm`` (results then go through the pipe)."""

    def __init__(self) -> None:
        self.path: str | None = None
        if not os.path.isdir(SHM_DIR):
            return
        remove_abandoned()
        path, fd = None, -1
        try:
            path = tempfile.mkdtemp(prefix=PREFIX, dir=SHM_DIR)  # mode 0700: nobody else can name a file in it
            # Locked under another name, then renamed: the lock file is never seen unlocked under its own, so
            # another process's remove_abandoned() (a loader starting on another rank) cannot take it for a
            # dead trainer's between the open and the flock and remove a live outbox.
            fresh = os.path.join(path, LOCK + ".new")
            fd = os.open(fresh, os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)  # held while this process lives (nobody else ever asks for it blocking)
            os.rename(fresh, os.path.join(path, LOCK))
        except OSError:  # no room, or /dev/shm not ours to write: the pipe
            if path is not None:
                _remove_outbox(path, fd)
            return
        self.path = path
        self._finalizer = weakref.finalize(self, _remove_outbox, path, fd)

    def close(self) -> None:
        """Remove the directory and every result in it that was never read."""
        if self.path is not None:
            self._finalizer()
            self.path = None


def _remove_outbox(path: str, lock_fd: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    try:
        os.close(lock_fd)
    except OSError:
        pass


def remove_abandoned() -> int:
    """Remove the outboxes whose lock nobody holds: their trainer is gone. Returns how many."""
    removed = 0
    for path in glob.glob(os.path.join(SHM_DIR, PREFIX + "*")):
        lock = os.path.join(path, LOCK)
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:  # being created, or a crash between mkdtemp and the lock: wait a while
            try:
                if time.time() - os.stat(path).st_mtime > STALE_UNLOCKED_S:
                    shutil.rmtree(path, ignore_errors=True)
                    removed += 1
            except OSError:
                pass
            continue
        except OSError:  # another user's, or not ours to judge
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its trainer is alive
            os.close(fd)
            continue
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)
        removed += 1
    return removed


@dataclass(frozen=True)
class Shared:
    """A result in transit: its pickle, and where its out-of-band values are in ``path``."""

    path: str
    size: int
    pickled: bytes
    buffers: tuple[tuple[int, int], ...]  # pickle-5 buffers (arrays), (offset, length), in pickling order
    values: tuple[tuple[int, int], ...]  # long bytes values, by persistent id


class _Pickler(pickle.Pickler):
    def __init__(self, stream: io.BytesIO, buffers: list) -> None:
        super().__init__(stream, protocol=5, buffer_callback=buffers.append)
        self.values: list[bytes] = []

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is bytes and len(obj) >= MIN_VALUE_BYTES:
            self.values.append(obj)
            return len(self.values) - 1
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, buffers: list, values: list[bytes]) -> None:
        super().__init__(io.BytesIO(data), buffers=buffers)
        self._values = values

    def persistent_load(self, pid: Any) -> bytes:
        if not isinstance(pid, int) or not 0 <= pid < len(self._values):
            raise pickle.UnpicklingError(f"a worker result names out-of-band value {pid!r}, which it does not hold")
        return self._values[pid]


def _room_for(nbytes: int) -> bool:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    return free - nbytes >= max(HEADROOM[0], HEADROOM[1] * total)


def share(obj: Any, outbox: str | None) -> Any:
    """In a worker: ``obj`` as a :class:`Shared` written into the ``outbox`` directory if its large values
    are worth a file and ``/dev/shm`` has room, else ``obj`` itself (the pipe)."""
    if not outbox:
        return obj
    stream, buffers = io.BytesIO(), []
    pickler = _Pickler(stream, buffers)
    pickler.dump(obj)
    views = [b.raw() for b in buffers] + [memoryview(v) for v in pickler.values]
    nbytes = sum(v.nbytes for v in views)
    if nbytes < MIN_SHARED_BYTES or not _room_for(nbytes):
        return obj
    spans, parts, at = [], [], 0
    for v in views:
        pad = -at % ALIGN
        if pad:
            parts.append(bytes(pad))
            at += pad
        spans.append((at, v.nbytes))
        parts.append(v)
        at += v.nbytes
    path = os.path.join(outbox, f"{os.getpid()}-{next(_counter)}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError:  # the outbox is gone (its owner closed) or unusable: the pipe
        return obj
    try:
        written = 0
        for k in range(0, len(parts), 512):  # IOV_MAX is 1024 on Linux
            written += os.pwritev(fd, parts[k:k + 512], written)
        if written != at:
            raise OSError(f"short write: {written} of {at} bytes")
    except OSError:  # /dev/shm full after all: the pipe
        os.close(fd)
        _unlink(path)
        return obj
    os.close(fd)
    n = len(buffers)
    return Shared(path, at, stream.getvalue(), tuple(spans[:n]), tuple(spans[n:]))


def receive(result: Any) -> Any:
    """In the trainer's process: the object a worker :func:`share`\\ d (anything else as it is)."""
    if type(result) is not Shared:
        return result
    try:
        fd = os.open(result.path, os.O_RDONLY)
    except FileNotFoundError:
        raise RuntimeError(f"a worker's result file {result.path} is gone before it was read: its loader was "
                           f"closed, or something removes files from {SHM_DIR}") from None
    try:
        os.unlink(result.path)  # the open file keeps the data while it is read
        size = os.fstat(fd).st_size
        if size < result.size:
            raise RuntimeError(f"a worker's result file {result.path} holds {size} bytes, {result.size} expected")
        arrays = []
        for a, n in result.buffers:  # arrays: their own writable memory, one copy
            buf = bytearray(n)
            if n and os.preadv(fd, [buf], a) != n:
                raise RuntimeError(f"a worker's result file {result.path} is shorter than its index says")
            arrays.append(buf)
        values = [os.pread(fd, n, a) for a, n in result.values]  # bytes: one copy each
        if any(len(v) != n for v, (_, n) in zip(values, result.values)):
            raise RuntimeError(f"a worker's result file {result.path} is shorter than its index says")
    finally:
        os.close(fd)
    return _Unpickler(result.pickled, arrays, values).load()


def discard(result: Any) -> None:
    """A result that will never be received: remove its file."""
    if type(result) is Shared:
        _unlink(result.path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

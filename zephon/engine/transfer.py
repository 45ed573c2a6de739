"""Results from worker processes without copying their large values through a pipe.

A chunk of image-caption records is mostly bytes (~25 kB an image), and a decoded one mostly pixel
arrays. Sent as a plain pickle through a pool's or a queue's pipe, every value is copied four times
(pickled, written, read, unpickled), two of them in the trainer's process. Instead, the worker pickles
the result with its large values *out of band*: numpy arrays as pickle-5 buffers and long ``bytes`` as
persistent references, all written with one ``pwritev`` into a file in shared memory (``/dev/shm``);
only the small pickle goes through the pipe. The trainer's process opens the file and removes its name
at once: arrays are views of a copy-on-write mapping of it (no copy; writable, privately), and each long
``bytes`` value is read from it with one ``pread`` (one copy; operators and batches see the same types as
with threads). The result is the same object, value for value: the runner never changes a batch.

Files are named after the trainer's process and the pool or lane host that wrote them
(``zephon-xfer-<trainer pid>-<owner>-...``, :func:`owner_name`), so that closing one removes what its
workers wrote and the trainer never received (a loader closed mid-step), without touching another
loader's, and starting one removes what trainers no longer running left behind. Without ``/dev/shm``, or for small results, the pickle goes
through the pipe as before.
"""

from __future__ import annotations

import glob
import io
import itertools
import mmap
import os
import pickle
from dataclasses import dataclass
from typing import Any

SHM_DIR = "/dev/shm"
PREFIX = "zephon-xfer-"
MIN_SHARED_BYTES = 256 << 10  # a result with fewer out-of-band bytes goes through the pipe as it is
MIN_VALUE_BYTES = 4096  # bytes values from this size on travel out of band
ALIGN = 64  # where each out-of-band value starts in the file (arrays keep SIMD-friendly alignment)
_counter = itertools.count()


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


def owner_name(trainer_pid: int) -> str:
    """A fresh name for the result files of one pool or lane host working for ``trainer_pid``."""
    return f"{trainer_pid}-{os.urandom(4).hex()}"


def share(obj: Any, owner: str) -> Any:
    """In a worker: ``obj`` as a :class:`Shared` if its large values are worth a file, else ``obj``."""
    if not os.path.isdir(SHM_DIR):
        return obj
    stream, buffers = io.BytesIO(), []
    pickler = _Pickler(stream, buffers)
    pickler.dump(obj)
    views = [b.raw() for b in buffers] + [memoryview(v) for v in pickler.values]
    if sum(v.nbytes for v in views) < MIN_SHARED_BYTES:
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
    path = os.path.join(SHM_DIR, f"{PREFIX}{owner}-{os.getpid()}-{next(_counter)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, max(at, 1))
        written = 0
        for k in range(0, len(parts), 512):  # IOV_MAX is 1024 on Linux
            written += os.pwritev(fd, parts[k:k + 512], written)
        if written != at:
            raise OSError(f"wrote {written} of {at} bytes to {path} (is {SHM_DIR} full?)")
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
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
        raise RuntimeError(f"a worker's result file {result.path} is gone before it was read: something removes "
                           f"files from {SHM_DIR} (a tmpfs cleaner?), or it is full") from None
    try:
        os.unlink(result.path)  # the open file (and the mapping below) keep the data while it is used
        size = os.fstat(fd).st_size
        if size < result.size:
            raise RuntimeError(f"a worker's result file {result.path} holds {size} bytes, {result.size} expected")
        arrays: list = []
        if result.buffers:  # arrays: views of a private mapping, no copy
            whole = memoryview(mmap.mmap(fd, result.size, flags=mmap.MAP_PRIVATE,
                                         prot=mmap.PROT_READ | mmap.PROT_WRITE))
            arrays = [whole[a:a + n] for a, n in result.buffers]
        values = [os.pread(fd, n, a) for a, n in result.values]  # bytes: one copy each, straight from the file
        if any(len(v) != n for v, (_, n) in zip(values, result.values)):
            raise RuntimeError(f"a worker's result file {result.path} is shorter than its index says")
    finally:
        os.close(fd)
    return _Unpickler(result.pickled, arrays, values).load()


def discard(result: Any) -> None:
    """A result that will never be received: remove its file."""
    if type(result) is Shared:
        try:
            os.unlink(result.path)
        except FileNotFoundError:
            pass


def remove_leftovers(owner: str | None = None) -> int:
    """Remove the result files of ``owner`` (its workers wrote them and nobody will read them), or, with
    None, those of trainers no longer running. Returns how many were removed."""
    removed = 0
    for path in glob.glob(os.path.join(SHM_DIR, PREFIX + (f"{owner}-*" if owner else "*"))):
        if owner is None:
            try:
                pid = int(os.path.basename(path)[len(PREFIX):].split("-", 1)[0])
            except ValueError:
                continue
            if _alive(pid):
                continue
        try:
            os.unlink(path)
            removed += 1
        except (FileNotFoundError, PermissionError):
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

"""Memory for a loader's large batch tensors, used again once the trainer has let go of it.

A vision-language batch's pixel tensor is tens of megabytes. Allocated afresh every step, each one is
a new mapping that the kernel faults in and zeroes in the trainer's thread, before a single pixel is
copied. :class:`BatchBuffers` hands a buffer out again as soon as nothing outside it refers to the
buffer, so that steady-state batches are written into memory that is already mapped.

**Why a reference count is enough.** Whatever can read an array's memory holds a reference to that
array: a numpy view (through its ``base``), a tensor made by ``torch.from_numpy`` and every view of that
tensor (its storage keeps the array), ``Tensor.numpy()``, a ``memoryview``, a DLPack capsule. So when the
pool's own reference is the only one left, nobody can see the memory any more, and the next batch
written into it changes nothing that anyone holds. A batch the trainer keeps (a list of batches, a
prefetch queue, the previous step still bound to the loop variable) keeps its buffer, and the pool
hands out another one. Copies do not refer to their source: ``pin_memory()``, and ``.to("cuda")`` from
pageable memory, which has staged the bytes by the time it returns.

The pool keeps at most ``keep`` buffers; past that (a trainer holding many batches) it allocates
without keeping, as if there were no pool. Requests under ``min_bytes`` are plain ``np.empty``: the
C allocator already reuses memory of that size.

Worked example (``min_bytes=0`` so that tiny arrays are pooled too)::

    >>> import numpy as np, torch
    >>> pool = BatchBuffers(keep=2, min_bytes=0)
    >>> first = torch.from_numpy(pool.empty((4, 3), np.uint8))
    >>> second = pool.empty((4, 3), np.uint8)  # ``first`` is still held: another buffer
    >>> np.shares_memory(first.numpy(), second)
    False
    >>> address = first.data_ptr()
    >>> del first
    >>> third = pool.empty((2, 6), np.uint8)  # the first buffer is free again, and is reused
    >>> third.ctypes.data == address
    True
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

_ALIGN = 2 << 20  # capacities are whole 2 MiB pages, and a quarter over the request: batches vary in size


def _references(held: list, i: int) -> int:
    return sys.getrefcount(held[i])


# what _references() counts for a buffer only the pool refers to (its list and the call's argument), on
# this interpreter: measured, not assumed, since interpreters count borrowed references differently
_UNSHARED = _references([np.empty(0, np.uint8)], 0)


class BatchBuffers:
    """Arrays for batch tensors, backed by buffers that are reused once nothing else refers to them.

    One loader owns one pool and makes its batches one at a time (the pool is not locked).
    """

    def __init__(self, keep: int = 4, min_bytes: int = 4 << 20) -> None:
        if keep < 0 or min_bytes < 0:
            raise ValueError(f"BatchBuffers(keep={keep}, min_bytes={min_bytes}): both must be >= 0")
        # the count must see a reference taken elsewhere; on an interpreter whose counts do not (deferred
        # reference counting), nothing is reused rather than anything overwritten
        probe = [np.empty(0, np.uint8)]
        other = probe[0]
        self.keep = keep if _references(probe, 0) == _UNSHARED + 1 else 0
        del other
        self.min_bytes = min_bytes
        self._buffers: list[np.ndarray] = []  # 1-D uint8, each referred to only by this list when free
        self.reused = 0  # requests served from a free buffer (metrics, tests)
        self.allocated = 0  # requests that allocated

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised C-contiguous array of ``shape`` and ``dtype`` (like ``np.empty``)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < max(self.min_bytes, 1) or self.keep == 0:
            return np.empty(shape, dtype)
        free = self._free_index(nbytes)
        if free is None:
            buf = np.empty(-(-(nbytes + nbytes // 4) // _ALIGN) * _ALIGN, np.uint8)
            self.allocated += 1
            if len(self._buffers) < self.keep:
                self._buffers.append(buf)
            else:
                small = self._free_index(0)  # a free buffer too small for this batch makes room for this one
                if small is not None:
                    self._buffers[small] = buf
        else:
            buf = self._buffers[free]
            self.reused += 1
        return buf[:nbytes].view(dtype).reshape(shape)

    def _free_index(self, nbytes: int) -> int | None:
        """The smallest free buffer of at least ``nbytes`` (``0``: the smallest free buffer), or ``None``."""
        best = None
        for i in range(len(self._buffers)):
            if _references(self._buffers, i) == _UNSHARED and self._buffers[i].nbytes >= nbytes and (
                    best is None or self._buffers[i].nbytes < self._buffers[best].nbytes):
                best = i
        return best

    def clear(self) -> None:
        """Drop the pool's buffers (arrays still held elsewhere stay valid: they keep their memory)."""
        self._buffers.clear()


UNPOOLED = BatchBuffers(keep=0)  # plain np.empty: collation called outside a loader

__all__ = ["BatchBuffers", "UNPOOLED"]

"""The trainer's per-batch work, kept off the edges of CPython's frame-stack chunks.

CPython (3.11 and 3.12; 3.13 before its fix for gh-142183) keeps each thread's Python frames in chunks of
16 KiB and gives a chunk back to the OS (``munmap``) as soon as the first frame in it returns. When a frame
that is called many times per batch happens to be the first of a chunk, each call maps a chunk and each
return unmaps it, with page faults on every fresh page. Where that happens depends only on how deep the
caller's stack is: measured in one process with the caller's stack padded by 0-200 frames, the trainer's
CPU per text batch was 2.0 ms at most depths and up to 10 ms in a few windows of them, with up to 469 minor
faults a batch (BENCHMARKS.md 4d).

:func:`call_on_own_chunk` runs a call inside a frame that reserves :data:`RESERVED_SLOTS` stack slots it
never uses. Such a frame never fits in a 16 KiB chunk, so CPython gives it a new 64 KiB one with about
31 KiB to spare, where everything it calls runs: one chunk mapped per call (a few microseconds) instead of
one per call that crosses an edge. On CPython with the fix, the one chunk it caches serves these calls.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, TypeVar

T = TypeVar("T")

# 4096 slots (32 KiB) plus the frame's own: more than a 16 KiB chunk holds, and CPython sizes the new
# chunk for the frame plus 1,000 spare slots, doubling from 16 KiB: 64 KiB.
RESERVED_SLOTS = 4096


def call_on_own_chunk(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, run on a frame-stack chunk of its own (see the module docstring).

    Args:
        fn: the call (e.g. the loader's next batch).
        *args: its arguments.

    Returns:
        What ``fn`` returns; what it raises propagates unchanged.
    """
    return fn(*args)


if sys.implementation.name == "cpython":
    # The interpreter sizes a frame from co_stacksize; a larger value only reserves room (never read).
    _code = call_on_own_chunk.__code__
    call_on_own_chunk.__code__ = _code.replace(co_stacksize=_code.co_stacksize + RESERVED_SLOTS)

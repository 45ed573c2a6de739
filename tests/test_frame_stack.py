"""``call_on_own_chunk``: the trainer's per-batch work does not map and unmap CPython frame-stack chunks
however deep the caller's stack is (zephon/engine/frame_stack.py)."""

from __future__ import annotations

import sys

import pytest

from zephon.engine.frame_stack import RESERVED_SLOTS, call_on_own_chunk

resource = pytest.importorskip("resource")

pytestmark = pytest.mark.skipif(not hasattr(resource, "RUSAGE_THREAD"), reason="needs per-thread rusage (Linux)")

CALLS = 300  # calls of a small function per burst: where a chunk edge falls between them, one chunk each


def _leaf() -> int:
    # Locals make this frame larger than a step of _at_depth's, so that every chunk edge the padding passes
    # leaves some depth at which this frame is the first of a new chunk.
    a = b = c = d = e = f = g = h = i = j = k = m = n = o = p = q = r = s = t = u = v = w = x = y = 0
    return 1 + a + b + c + d + e + f + g + h + i + j + k + m + n + o + p + q + r + s + t + u + v + w + x + y


def _burst(n: int) -> int:
    total = 0
    for _ in range(n):
        total += _leaf()
    return total


def _at_depth(depth: int, fn, *args):
    return _at_depth(depth - 1, fn, *args) if depth else fn(*args)


def _faults(depth: int, fn, *args) -> int:
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    _at_depth(depth, fn, *args)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_reserves_more_than_a_chunk() -> None:
    if sys.implementation.name != "cpython":
        pytest.skip("CPython's frame stack")
    assert call_on_own_chunk.__code__.co_stacksize >= RESERVED_SLOTS
    assert call_on_own_chunk(max, 3, 7) == 7
    with pytest.raises(StopIteration):
        call_on_own_chunk(next, iter(()))


def test_bursts_take_no_faults_at_any_depth() -> None:
    """Over enough caller depths to cross several chunk edges, a burst run through call_on_own_chunk takes
    a handful of page faults (its own chunk), where the same burst called directly takes one or more per
    call at the depths that put the small function first in a chunk (on CPython without gh-142183's fix)."""
    if sys.implementation.name != "cpython":
        pytest.skip("CPython's frame stack")
    depths = range(0, 800)  # more than one chunk edge apart (about 370 frames of _at_depth on 3.11)
    _at_depth(max(depths), call_on_own_chunk, _burst, CALLS)  # pages and code warmed once
    wrapped = {d: min(_faults(d, call_on_own_chunk, _burst, CALLS) for _ in range(2)) for d in depths}
    assert max(wrapped.values()) < CALLS // 10, {d: f for d, f in wrapped.items() if f >= CALLS // 10}
    # Interpreters that free a chunk as soon as its first frame returns: 3.11, 3.12 and 3.13 before its
    # gh-142183 backport (3.13.0 still does); later ones cache a chunk, so there is nothing to show there.
    if sys.version_info < (3, 13):
        direct = {d: min(_faults(d, _burst, CALLS) for _ in range(2)) for d in depths}
        assert max(direct.values()) >= CALLS, "no depth crossed a chunk edge: the test no longer tests anything"

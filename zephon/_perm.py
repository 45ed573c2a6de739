"""Determinism math: stable hashes and keyed permutations as pure functions.

Everything random in Zephon (shard order per pass, routing of units to lanes, shuffle seeds) is
derived here from integers only: the recipe seed, a stable source key, a lane, a pass or a block
number. Nothing reads a global RNG, Python's salted ``hash()`` or the clock, so the same arguments
give the same answer on every machine, rank, worker and Python version.

The central primitive is :func:`permute_index`, a keyed bijection on ``[0, n)`` evaluated in O(1)
for one index (a 4-round Feistel network on the smallest even bit width that covers ``n``, with
cycle walking back into range). It lets a lane compute *its own* unit of a block without building
the permutation of the whole block, which keeps per-rank cost independent of the lane count.

Worked example (``n = 5``, so the Feistel domain is 16 = 2**4 and each half has 2 bits)::

    permute_index(3, 5, key)  # -> 3 is mapped to some x in [0, 16); if x >= 5 we map x again,
                              #    and again, until the walk lands in [0, 5): a bijection of [0, 5)

:func:`permutation` evaluates the same function for all indices at once (numpy) and is used by
tests and tools; it is never needed on the hot path.
"""

from __future__ import annotations

import hashlib

import numpy as np

_MASK64 = (1 << 64) - 1
_ROUNDS = 4


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix64(*values: int) -> int:
    """Stable 64-bit hash of a sequence of non-negative integers (order matters)."""
    h = 0x6A09E667F3BCC909
    for v in values:
        h = _splitmix64(h ^ (v & _MASK64))
    return h


def stable_key(text: str) -> int:
    """A 63-bit integer key for a string (e.g. a source name), identical everywhere."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little") >> 1


def _domain(n: int) -> tuple[int, int]:
    bits = max(2, (n - 1).bit_length())
    bits += bits & 1
    half = bits // 2
    return half, (1 << half) - 1


def permute_index(i: int, n: int, key: int) -> int:
    """Image of ``i`` under the keyed bijection of ``[0, n)`` identified by ``key``."""
    if not 0 <= i < n:
        raise IndexError(f"index {i} is outside [0, {n})")
    if n == 1:
        return 0
    half, mask = _domain(n)
    x = i
    while True:
        left, right = x >> half, x & mask
        for rnd in range(_ROUNDS):
            left, right = right, left ^ (mix64(key, rnd, right) & mask)
        x = (left << half) | right
        if x < n:
            return x


def inverse_index(x: int, n: int, key: int) -> int:
    """The ``i`` with ``permute_index(i, n, key) == x``: the Feistel rounds undone in reverse order, walking
    the cycle backwards until it lands in ``[0, n)`` (where the forward walk started)."""
    if not 0 <= x < n:
        raise IndexError(f"index {x} is outside [0, {n})")
    if n == 1:
        return 0
    half, mask = _domain(n)
    while True:
        left, right = x >> half, x & mask
        for rnd in reversed(range(_ROUNDS)):
            left, right = right ^ (mix64(key, rnd, left) & mask), left
        x = (left << half) | right
        if x < n:
            return x


def permutation(n: int, key: int) -> np.ndarray:
    """The whole permutation ``[permute_index(i, n, key) for i in range(n)]`` as an int64 array."""
    return np.fromiter((permute_index(i, n, key) for i in range(n)), dtype=np.int64, count=n)


def rng_for(*values: int) -> np.random.Generator:
    """A numpy Generator seeded only by the given integers (e.g. seed, lane, epoch, purpose)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([v & _MASK64 for v in values])))

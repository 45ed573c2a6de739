"""Test helpers for your own operators: prove an accumulator honours the contract, as the built-ins do.

:func:`check_accumulator` feeds your accumulator the records you give it, with flush sentinels at points
chosen by hypothesis (and shrunk to the smallest failing case), and asserts the three properties every
checkpoint relies on:

1. **Deterministic**: two fresh instances fed the same records and flushes emit the same records.
2. **Fresh after a flush**: what an instance emits after its ``k``-th flush equals what a fresh instance
   for the segment after that flush (``factory(ctx.after_flush()...)``) emits when fed the same records.
   This is what lets a lane resume at its last sentinel and replay, holding no operator state.
3. **Empty after a flush**: a second flush right after a flush emits nothing.

With ``conserves=True`` it also checks that every record pushed comes out exactly once (a shuffle, a
reorder); leave it off for operators that drop or merge records (a dedup, a filter, a packer).
Records are compared by content (dicts of arrays, strings, numbers), document tails included.

Use it in your own test suite::

    from zephon.testing import check_accumulator

    def test_my_dedup():
        check_accumulator(lambda ctx: DedupWithinWindow(window=8), my_records)
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence

from .batches.packed import _hash_value
from .ops.base import LaneContext, call_factory


def record_digest(record: Any) -> str:
    """A content digest of a record (and of a document's tail label), for comparisons."""
    h = hashlib.sha256()
    _hash_value(h, dict(record) if isinstance(record, dict) else record)
    h.update(str(getattr(record, "tail", None)).encode())
    return h.hexdigest()[:24]


def _run(factory: Callable[..., Any], ctx: LaneContext, records: Sequence[Any], cuts: Sequence[int]
         ) -> list[list[str]]:
    """Digests of what an instance emits in each segment: records pushed, a flush at each cut (indices
    into ``records``), and a final flush."""
    acc = call_factory(factory, ctx)
    segments: list[list[str]] = [[]]
    bounds = list(cuts) + [len(records)]
    start = 0
    for end in bounds:
        for rec in records[start:end]:
            segments[-1] += [record_digest(r) for r in acc.push(rec)]
        segments[-1] += [record_digest(r) for r in acc.flush()]
        segments.append([])
        start = end
    return segments[:-1]


def _context_at(ctx: LaneContext, segments: int) -> LaneContext:
    for _ in range(segments):
        ctx = ctx.after_flush()
    return ctx


def check_one(factory: Callable[..., Any], records: Sequence[Any], cuts: Sequence[int], seed: int = 0,
              lane: int = 0, conserves: bool = False) -> None:
    """The three properties for one placement of flushes (``cuts``: flush after that many records)."""
    cuts = sorted(set(c for c in cuts if 0 <= c <= len(records)))
    ctx = LaneContext(seed, lane)
    full = _run(factory, ctx, records, cuts)
    if _run(factory, ctx, records, cuts) != full:
        raise AssertionError(f"property 1 (deterministic): two fresh instances fed the same records with flushes "
                             f"after records {cuts} emitted different records")
    for k, cut in enumerate(cuts):
        later = [c - cut for c in cuts[k + 1:]]
        fresh = _run(factory, _context_at(ctx, k + 1), records[cut:], later)
        if fresh != full[k + 1:]:
            raise AssertionError(
                f"property 2 (fresh after a flush): after the flush at record {cut} (flush #{k + 1}), the instance "
                f"emitted {sum(map(len, full[k + 1:]))} records, a fresh instance fed the same {len(records) - cut} "
                f"records emitted {sum(map(len, fresh))}" + ("" if sum(map(len, fresh)) != sum(map(len, full[k + 1:]))
                                                           else " (different ones)")
                + ". Something survived the flush: flush() must emit everything held and reset the state (a "
                  "seeded generator: reseed it from ctx.after_flush()).")
    for cut in cuts + [len(records)]:  # property 3, on an instance of its own (each flush is a new segment)
        acc = call_factory(factory, ctx)
        for rec in records[:cut]:
            acc.push(rec)
        acc.flush()
        again = list(acc.flush())
        if again:
            raise AssertionError(f"property 3 (empty after a flush): a flush right after the flush at record {cut} "
                                 f"emitted {len(again)} records")
    if conserves:
        got = sorted(d for seg in full for d in seg)
        want = sorted(record_digest(r) for r in records)
        if got != want:
            raise AssertionError(f"conservation: {len(records)} records pushed, {len(got)} emitted, "
                                 f"{len(set(want) - set(got))} of them never came out")


def check_accumulator(factory: Callable[..., Any], records: Sequence[Any], *, seed: int = 0, lane: int = 0,
                      conserves: bool = False, max_examples: int = 60, max_flushes: int = 4) -> None:
    """Assert the accumulator contract for ``factory`` over ``records`` (see the module docstring).

    Hypothesis chooses where the flushes fall (derandomized: the same cases on every run) and shrinks a
    failure to the smallest. Needs ``hypothesis`` (the test extra).

    Args:
        factory: ``factory(ctx)`` (a :class:`zephon.LaneContext`) or ``factory()`` builds a fresh instance.
        records: the records to push (a few dozen, with the duplicates and edge cases your operator cares
            about).
        seed: the pipeline seed the contexts carry.
        lane: the lane the contexts carry.
        conserves: also check that every record pushed comes out exactly once (a shuffle, a reorder); leave
            it off for operators that drop or merge records.
        max_examples: how many placements of the flushes to try.
        max_flushes: the most flushes in one example (besides the final one).

    Raises:
        AssertionError: the contract does not hold (the smallest failing case, as hypothesis reports it).
        ValueError: no records.
    """
    try:
        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st
    except ImportError as exc:
        raise ModuleNotFoundError(
            "zephon.testing.check_accumulator needs the hypothesis package, which chooses where the flushes fall "
            "(it is in Zephon's test extra): python -m pip install -e '.[test]' from a Zephon checkout, or "
            f"python -m pip install 'hypothesis>=6.100'. To check one placement without it, call "
            f"zephon.testing.check_one(factory, records, cuts). ({exc})", name="hypothesis") from exc

    records = list(records)
    if not records:
        raise ValueError("check_accumulator needs some records to push")

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(st.integers(0, len(records)), max_size=max_flushes))
    def prop(cuts: list[int]) -> None:
        check_one(factory, records, cuts, seed, lane, conserves)

    prop()

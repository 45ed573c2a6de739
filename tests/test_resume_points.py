"""Resume points inside a chunk: every record's ``(resume_cursor, resume_skip)`` must restart the stream
exactly after it, whatever chain of operators made the records.

A chunk's records carry where a reader restarts after each one and how many of the records the stateless
operators make from there to drop (:class:`zephon.records.Chunk`). Operators that make several records from
one (``flat_map``, ``split``) and operators that drop records (``filter``, blank documents) rewrite these
points (:meth:`Chunk.expand`, :meth:`Chunk.select`). The property: for any chain of such operators and every
record ``i``, re-reading from ``resume_cursor[i]``, running the same chain and dropping the first
``resume_skip[i]`` records gives exactly the records after ``i``, and those keep their resume points (so a
checkpoint taken after a resume lands where it would have). A split after a flat_map (pieces of pieces), or
a filter after either, broke it before ``renumber_skips``: a sentinel between two such pieces made a resume
fail.
"""

from __future__ import annotations

import hashlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.engine.stages import drop_delivered
from zephon.records import Chunk, renumber_skips


def _h(label: tuple, salt: int) -> int:
    return int.from_bytes(hashlib.blake2b(repr((label, salt)).encode(), digest_size=4).digest(), "little")


def read(records: int, start: int) -> Chunk:
    """Reader records ``start..records-1``: record ``j`` lies at cursor ``j``, the next one at ``j + 1``."""
    n = records - start
    cursors = np.arange(start + 1, records + 1, dtype=np.int64)
    return Chunk(0, 0, True, start, records, "mem", {"label": [(j,) for j in range(start, records)]},
                 cursors, np.zeros(n, dtype=np.int64))


def apply(chunk: Chunk, ops: list[tuple[str, int]]) -> Chunk:
    """Deterministic operators: a record's fate depends only on its label (pure functions of the record)."""
    for kind, salt in ops:
        labels = chunk.columns["label"]
        if kind == "expand":  # 0-3 records from each (flat_map, split; 0: dropped like a failed flat_map)
            counts = np.array([_h(lab, salt) % 4 for lab in labels], dtype=np.int64)
            cursor, skip = chunk.expand(counts)
            chunk.columns = {"label": [lab + (salt, p) for lab, k in zip(labels, counts.tolist()) for p in range(k)]}
            chunk.resume_cursor, chunk.resume_skip = cursor, skip
        else:  # keep about two thirds (filter)
            chunk = chunk.select(np.array([j for j, lab in enumerate(labels) if _h(lab, salt) % 3], dtype=np.int64))
    return chunk


@settings(max_examples=300, deadline=None)
@given(records=st.integers(1, 12),
       ops=st.lists(st.tuples(st.sampled_from(["expand", "select"]), st.integers(0, 10 ** 6)), max_size=4))
def test_every_resume_point_restarts_exactly_after_its_record(records, ops):
    chunk = apply(read(records, 0), ops)
    labels = chunk.columns["label"]
    points = list(zip(chunk.resume_cursor.tolist(), chunk.resume_skip.tolist()))
    for i in range(chunk.n):
        c, s = points[i]
        assert 0 <= c <= records and s >= 0
        again = apply(read(records, c), ops)
        assert s <= again.n and again.columns["label"][s:] == labels[i + 1:], (i, c, s)
        # as a resumed lane does it: the delivered records dropped after the last operator; the records left
        # must resume where the originals did (a second checkpoint after the resume lands at the same place)
        again.skip_pending = s
        tail = drop_delivered(again, "src")
        assert tail.columns["label"] == labels[i + 1:]
        assert list(zip(tail.resume_cursor.tolist(), tail.resume_skip.tolist())) == points[i + 1:], (i, c, s)


def expand_reference(chunk: Chunk, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Chunk.expand as the rule reads, one record at a time (the library's is vectorised)."""
    cursor, skip, prev_c = [], [], chunk.start_cursor
    for c, s, k in zip(chunk.resume_cursor.tolist(), chunk.resume_skip.tolist(), counts.tolist()):
        if k:
            cursor += [c if s else prev_c] * (k - 1) + [c]
            skip += [1] * (k - 1) + [s]
            prev_c = c
    cursor_a = np.asarray(cursor, dtype=np.int64)
    return cursor_a, renumber_skips(cursor_a, np.asarray(skip, dtype=np.int64))


@settings(max_examples=300, deadline=None)
@given(start=st.integers(-1, 5), points=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3), st.integers(0, 4)),
                                                 max_size=20))
def test_expand_matches_the_rule_record_by_record(start, points):
    cursor = np.asarray(sorted(c for c, _, _ in points), dtype=np.int64)
    skip = np.asarray([s for _, s, _ in points], dtype=np.int64)
    counts = np.asarray([k for _, _, k in points], dtype=np.int64)
    chunk = Chunk(0, 0, True, start, 41, "f", {}, cursor, skip)
    got, want = chunk.expand(counts), expand_reference(chunk, counts)
    assert got[0].dtype == got[1].dtype == np.int64
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


def test_renumber_counts_the_records_made_from_each_cursor():
    cursor = np.array([7, 7, 7, 9, 9, 12, 4], dtype=np.int64)
    skip = np.array([1, 1, 2, 0, 5, 0, 1], dtype=np.int64)
    assert renumber_skips(cursor, skip).tolist() == [1, 2, 3, 0, 1, 0, 1]


@settings(max_examples=300, deadline=None)
@given(start=st.integers(-1, 3), steps=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30)), min_size=1, max_size=20),
       max_tokens=st.integers(1, 12))
def test_split_of_whole_records_resumes_as_the_rule(start, steps, max_tokens):
    """Split right after tokenize (every record a whole input record, every skip 0: Chunk.expand's shortcut)
    gives the resume points of the record-by-record rule (cursors may repeat: a reader record that made
    several whole records)."""
    from zephon.ops.split import Split, piece_bounds

    cursor = np.cumsum([max(start, 0)] + [c for c, _ in steps])[1:].astype(np.int64)
    lengths = np.asarray([n for _, n in steps], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    def chunk() -> Chunk:
        return Chunk(0, 0, True, start, int(cursor[-1]) + 1, "f", {}, cursor.copy(),
                     np.zeros(len(steps), dtype=np.int64), token_fields={"input_ids": np.arange(offsets[-1], dtype=np.int32)},
                     offsets=offsets.copy())

    counts, _ = piece_bounds(offsets, max_tokens)
    want = expand_reference(chunk(), counts)
    got = Split(max_tokens)._apply_chunk(chunk())
    assert got.resume_cursor.tolist() == want[0].tolist() and got.resume_skip.tolist() == want[1].tolist()
    assert got.resume_cursor.dtype == got.resume_skip.dtype == np.int64

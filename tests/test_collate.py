"""The batch dict: checked against a plain per-row reference and against its own semantics."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon import IGNORE, batch_digest, collate, global_digest
from zephon.records import Row


@st.composite
def rows_st(draw):
    seq_len = draw(st.integers(2, 48))
    rows = []
    for _ in range(draw(st.integers(1, 6))):
        row = Row(seq_len)
        for n in draw(st.lists(st.integers(1, seq_len), min_size=0, max_size=6)):  # 0: a row all padding
            if n > row.free:
                break
            tokens = np.asarray(draw(st.lists(st.integers(0, 50_000), min_size=n, max_size=n)), dtype=np.int32)
            row.add({"input_ids": tokens}, 0, n, draw(st.sampled_from([IGNORE, 17])))
        rows.append(row)
    return seq_len, rows


def reference(rows, S, pad):
    """The obvious per-row construction."""
    B = len(rows)
    out = {k: np.zeros((B, S), np.int64) for k in ("input_ids", "labels", "position_ids", "segment_ids")}
    out["input_ids"][:] = pad
    out["labels"][:] = IGNORE
    cu = []  # where each segment and each row's padding starts in the flattened batch, then the end
    for b, row in enumerate(rows):
        at = 0
        cu.append(b * S)
        for k, (n, tail) in enumerate(zip(row.seg_lens, row.tails)):
            seg = row.tokens[at:at + n]
            out["input_ids"][b, at:at + n] = seg
            out["labels"][b, at:at + n - 1] = seg[1:]
            out["labels"][b, at + n - 1] = tail
            out["position_ids"][b, at:at + n] = np.arange(n)
            out["segment_ids"][b, at:at + n] = k + 1
            if at:
                cu.append(b * S + at)
            at += n
        if at < S:
            cu.append(b * S + at)
    out["cu_seqlens"] = np.array(sorted(set(cu)) + [B * S])
    return out


@settings(max_examples=200, deadline=None)
@given(data=rows_st(), pad=st.integers(0, 9))
def test_collate_matches_the_per_row_reference(data, pad):
    S, rows = data
    got = collate(rows, S, pad)
    ref = reference(rows, S, pad)
    for key, want in ref.items():  # cu_seqlens included: every segment's and every padding's start
        assert np.array_equal(got[key].numpy(), want), key
    assert np.array_equal(got["loss_mask"].numpy(), ref["labels"] != IGNORE)
    assert got["input_ids"].dtype == got["labels"].dtype == got["position_ids"].dtype == torch.int64
    assert got["cu_seqlens"].dtype == torch.int32
    # cu_seqlens: strictly increasing boundaries of the flattened batch, consistent with segment_ids
    cu = got["cu_seqlens"].numpy()
    assert cu[0] == 0 and cu[-1] == len(rows) * S and np.all(np.diff(cu) > 0)
    flat_seg = got["segment_ids"].numpy().reshape(-1)
    row_of = np.repeat(np.arange(len(rows)), S)
    for a, b in zip(cu[:-1], cu[1:]):  # one segment (or one row's padding) per interval
        assert len(set(flat_seg[a:b])) == 1 and len(set(row_of[a:b])) == 1


def test_global_digest_equals_digest_of_the_concatenated_batch():
    rows = []
    for k in range(4):
        row = Row(8)
        row.add({"input_ids": np.arange(k, k + 5, dtype=np.int32)}, 0, 5, IGNORE)
        rows.append(row)
    whole = collate(rows, 8, 0)
    parts = [collate(rows[:1], 8, 0), collate(rows[1:3], 8, 0), collate(rows[3:], 8, 0)]
    assert global_digest(parts) == batch_digest(whole)
    assert global_digest(parts[::-1]) != batch_digest(whole)  # rank order matters


def test_a_piece_of_no_tokens_adds_no_boundary():
    """cu_seqlens holds each boundary once, as np.union1d gave it, also around an empty piece (only cu_seqlens is
    checked: position_ids and labels assume pieces of at least one token)."""
    row = Row(8)
    for n in (3, 0, 2):
        row.add({"input_ids": np.arange(n, dtype=np.int32)}, 0, n, IGNORE)
    assert collate([row], 8, 0)["cu_seqlens"].tolist() == [0, 3, 5, 8]


def test_no_rows_give_one_boundary():
    assert collate([], 8, 0)["cu_seqlens"].tolist() == [0]

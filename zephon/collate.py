"""Turn a rank's packed rows into the batch dict: fixed-shape tensors plus document boundaries.

Keys (``B`` rows of ``S`` tokens): ``input_ids`` int64, ``labels`` int64 (next token inside a
document, the piece's tail label at its last position, ``-100`` on padding), ``position_ids`` int64
(0 at every document start), ``segment_ids`` int32 (1.. per document in its row, 0 on padding),
``loss_mask`` float32 (1 where a label counts), and ``cu_seqlens`` int32 (flash-attention style
boundaries over the flattened ``B*S`` tokens, padding as its own segment).
"""

from __future__ import annotations

import hashlib
from itertools import chain
from typing import Mapping, Sequence

import numpy as np
import torch

from .nodes.items import IGNORE, Row

HASHED_KEYS = ("input_ids", "labels", "position_ids", "segment_ids", "loss_mask")


def collate(rows: Sequence[Row], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Build the batch dict for ``rows`` (in lane order), vectorised over the whole batch.

    A row's tokens sit at its start (``tokens[:fill]``), so every key is built from the stacked row
    buffers, one-slice shifts, running sums over the flattened ``[B*S]`` batch and one padding mask,
    with no per-token scatter and no per-row Python loop (fetch-and-batch has 256 short rows a batch).
    """
    B, S = len(rows), seq_len
    fills = np.fromiter((r.fill for r in rows), dtype=np.int64, count=B)
    segs_per_row = np.fromiter((len(r.seg_lens) for r in rows), dtype=np.int64, count=B)
    seg_lens = np.fromiter(chain.from_iterable(r.seg_lens for r in rows), dtype=np.int64,
                           count=int(segs_per_row.sum()))
    tails = np.fromiter(chain.from_iterable(r.tails for r in rows), dtype=np.int64, count=len(seg_lens))

    # every row's buffer holds seq_len tokens, valid up to its fill (the rest is set to padding below)
    input_ids = np.stack([r.tokens for r in rows]).astype(np.int64) if B else np.zeros((0, S), np.int64)
    # every segment's [start, end) in the flattened batch (a row's fill is the sum of its segments)
    seg_end = np.cumsum(seg_lens) - np.repeat(np.cumsum(fills) - fills, segs_per_row)
    seg_end += np.repeat(np.arange(B, dtype=np.int64) * S, segs_per_row)
    seg_start = seg_end - seg_lens

    labels = np.empty((B, S), dtype=np.int64)
    labels[:, :-1] = input_ids[:, 1:]  # the next token; wrong only at segment ends, set next
    labels[:, -1] = IGNORE
    labels.reshape(-1)[seg_end - 1] = tails

    # position in segment: a running count of ones whose step at a segment start drops it back to 0
    steps = np.ones(B * S, dtype=np.int64)
    steps[seg_start[1:]] = seg_start[:-1] + 1 - seg_start[1:]
    if len(seg_start):
        steps[seg_start[0]] = 1 - seg_start[0]
    steps[:1] = 0
    position_ids = steps.cumsum().reshape(B, S)
    starts = np.zeros(B * S, dtype=np.int32)
    starts[seg_start] = 1
    segment_ids = starts.reshape(B, S).cumsum(axis=1, dtype=np.int32)  # 1.. per row

    padded = np.flatnonzero(fills < S)
    if len(padded):  # a part-filled row's rest is padding
        pad = np.arange(S) >= fills[:, None]
        input_ids[pad] = pad_id
        labels[pad] = IGNORE
        position_ids[pad] = 0
        segment_ids[pad] = 0

    # cu_seqlens: every segment start, plus the start of each row's padding, plus the end
    pads = padded * S + fills[padded]
    bounds = np.union1d(np.union1d(seg_start, pads), np.arange(B, dtype=np.int64) * S)
    cu_seqlens = np.append(bounds, B * S).astype(np.int32)
    return {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(position_ids),
        "segment_ids": torch.from_numpy(segment_ids),
        "loss_mask": torch.from_numpy((labels != IGNORE).astype(np.float32)),
        "cu_seqlens": torch.from_numpy(cu_seqlens),
    }


def batch_digest(batch: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of one batch (the fixed-shape keys, in a fixed order)."""
    return global_digest([batch])


def global_digest(rank_batches: Sequence[Mapping[str, torch.Tensor]]) -> str:
    """SHA-256 of the global batch: each key's rank batches concatenated in rank order.

    Equal to hashing the batch that one rank owning every lane would produce, so digests compare
    across world sizes. ``cu_seqlens`` is rank-relative and derived from ``segment_ids``: not hashed.
    """
    h = hashlib.sha256()
    for key in HASHED_KEYS:
        parts = [b[key] for b in rank_batches]
        rows = sum(int(p.shape[0]) for p in parts)
        h.update(f"{key}:{parts[0].dtype}:{rows}x{tuple(parts[0].shape[1:])};".encode())
        for p in parts:
            h.update(p.contiguous().numpy().tobytes())
    return h.hexdigest()

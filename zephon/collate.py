"""Turn a rank's packed rows into the batch dict: fixed-shape tensors plus document boundaries.

Keys (``B`` rows of ``S`` tokens): ``input_ids`` int64, ``labels`` int64 (next token inside a
document, the piece's tail label at its last position, ``-100`` on padding), ``position_ids`` int64
(0 at every document start), ``segment_ids`` int32 (1.. per document in its row, 0 on padding),
``loss_mask`` float32 (1 where a label counts), and ``cu_seqlens`` int32 (flash-attention style
boundaries over the flattened ``B*S`` tokens, padding as its own segment).
"""

from __future__ import annotations

import hashlib
from typing import Mapping, Sequence

import numpy as np
import torch

from .nodes.items import IGNORE, Row

HASHED_KEYS = ("input_ids", "labels", "position_ids", "segment_ids", "loss_mask")


def collate(rows: Sequence[Row], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Build the batch dict for ``rows`` (in lane order)."""
    B, S = len(rows), seq_len
    input_ids = np.full((B, S), pad_id, dtype=np.int64)
    labels = np.full((B, S), IGNORE, dtype=np.int64)
    position_ids = np.zeros((B, S), dtype=np.int64)
    segment_ids = np.zeros((B, S), dtype=np.int32)
    bounds = [np.zeros(1, dtype=np.int64)]
    for b, row in enumerate(rows):
        f = row.fill
        tokens = row.tokens[:f]
        lens = np.asarray(row.seg_lens, dtype=np.int64)
        ends = np.cumsum(lens)
        starts = ends - lens
        input_ids[b, :f] = tokens
        labels[b, :f - 1] = tokens[1:]
        labels[b, ends - 1] = row.tails
        position_ids[b, :f] = np.arange(f) - np.repeat(starts, lens)
        segment_ids[b, :f] = np.repeat(np.arange(1, len(lens) + 1, dtype=np.int32), lens)
        row_bounds = ends if f == S else np.append(ends, S)
        bounds.append(row_bounds + b * S)
    loss_mask = (labels != IGNORE).astype(np.float32)
    return {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(position_ids),
        "segment_ids": torch.from_numpy(segment_ids),
        "loss_mask": torch.from_numpy(loss_mask),
        "cu_seqlens": torch.from_numpy(np.concatenate(bounds).astype(np.int32)),
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

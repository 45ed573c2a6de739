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
    """Build the batch dict for ``rows`` (in lane order), vectorised over the whole batch."""
    B, S = len(rows), seq_len
    fills = np.fromiter((r.fill for r in rows), dtype=np.int64, count=B)
    seg_lens = np.fromiter(chain.from_iterable(r.seg_lens for r in rows), dtype=np.int64)
    tails = np.fromiter(chain.from_iterable(r.tails for r in rows), dtype=np.int64, count=len(seg_lens))
    segs_per_row = np.fromiter((len(r.seg_lens) for r in rows), dtype=np.int64, count=B)
    tokens = np.concatenate([r.tokens[:r.fill] for r in rows]) if B else np.zeros(0, np.int32)

    # flat position (row * S + offset in row) of every real token, and of every segment's first token
    row_of_token = np.repeat(np.arange(B, dtype=np.int64), fills)
    first_token_of_row = np.concatenate([[0], np.cumsum(fills)[:-1]])
    flat = row_of_token * S + np.arange(len(tokens)) - first_token_of_row[row_of_token]
    seg_start = np.concatenate([[0], np.cumsum(seg_lens)[:-1]])  # in the token stream
    seg_rank = np.arange(len(seg_lens)) - np.repeat(np.concatenate([[0], np.cumsum(segs_per_row)[:-1]]), segs_per_row)

    input_ids = np.full(B * S, pad_id, dtype=np.int64)
    labels = np.full(B * S, IGNORE, dtype=np.int64)
    position_ids = np.zeros(B * S, dtype=np.int64)
    segment_ids = np.zeros(B * S, dtype=np.int32)
    input_ids[flat] = tokens
    labels[flat[:-1]] = tokens[1:]  # next token; every segment's last position is overwritten below
    labels[flat[seg_start + seg_lens - 1]] = tails
    position_ids[flat] = np.arange(len(tokens)) - np.repeat(seg_start, seg_lens)
    segment_ids[flat] = np.repeat(seg_rank + 1, seg_lens).astype(np.int32)

    # cu_seqlens: every segment start, plus the start of each row's padding, plus the end
    starts = flat[seg_start] if len(seg_start) else np.zeros(0, np.int64)
    pads = (np.arange(B) * S + fills)[fills < S]
    bounds = np.union1d(np.union1d(starts, pads), np.arange(B) * S)
    cu_seqlens = np.append(bounds, B * S).astype(np.int32)
    labels = labels.reshape(B, S)
    return {
        "input_ids": torch.from_numpy(input_ids.reshape(B, S)),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(position_ids.reshape(B, S)),
        "segment_ids": torch.from_numpy(segment_ids.reshape(B, S)),
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

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

from ..ops.image_layout import PER_IMAGE
from ..records import IGNORE, INPUT_IDS, LOSS_MASK, Row
from .buffers import UNPOOLED, BatchBuffers
from .images import ImageBatch, image_keys

HASHED_KEYS = ("input_ids", "labels", "position_ids", "segment_ids", "loss_mask")
"""The text keys a batch digest hashes first, in this order (:func:`global_digest`; every other key but
``cu_seqlens`` follows, by name)."""
UNHASHED_KEYS = ("cu_seqlens",)  # rank-relative, derived from segment_ids
ROW_INDEX_KEYS = ("image_row",)  # rank-relative row numbers: hashed as rows of the global batch


def collate(rows: Sequence[Row], seq_len: int, pad_id: int,
            pad_values: Mapping[str, object] | None = None, images: "ImageBatch | None" = None,
            buffers: BatchBuffers = UNPOOLED) -> dict[str, object]:
    """Build the batch dict for ``rows`` (in lane order), vectorised over the whole batch.

    A row's tokens sit at its start (``tokens[:fill]``), so every key is built from the stacked row
    buffers, one-slice shifts, running sums over the flattened ``[B*S]`` batch and one padding mask,
    with no per-token scatter and no per-row Python loop (fetch-and-batch has 256 short rows a batch).

    Every other per-token field of the rows becomes a ``[B, S]`` tensor of its own; a ``loss_mask`` field
    (1 where the label at that position counts, e.g. assistant turns) also sets ``labels`` to -100 where it is
    0. Per-document payloads become, per field, a list (rows) of lists (the row's documents, in order).

    Args:
        rows: the rank's packed rows, in lane order.
        seq_len: tokens per row.
        pad_id: the id written on padding positions.
        pad_values: per-token field name -> its value on padding positions (None: 0 for every field).
        images: for a pipeline with images or mrope positions, how its images are batched
            (:mod:`zephon.batches.images`): their payloads become tensors.
        buffers: the pool the large tensors (pixels) are written into (:mod:`zephon.batches.buffers`; a loader
            passes its own; the default allocates).

    Returns:
        The batch: ``input_ids``, ``labels``, ``position_ids``, ``segment_ids``, ``cu_seqlens``, ``loss_mask``
        (``[B, S]`` tensors but ``cu_seqlens``), every other per-token field, the payloads, and the image keys.
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

    # cu_seqlens: every segment start, plus the start of each row's padding (a row starts with one or the
    # other), plus the end; sorted, each once. A sort and a mask: np.union1d's hash table took 0.2 ms a call
    # inside the loader (BENCHMARKS.md 4d)
    bounds = np.concatenate([seg_start, padded * S + fills[padded], np.array([B * S], dtype=np.int64)])
    bounds.sort()
    first = np.ones(len(bounds), dtype=bool)
    np.not_equal(bounds[1:], bounds[:-1], out=first[1:])
    cu_seqlens = bounds[first].astype(np.int32)
    extra: dict[str, object] = {}
    names = [k for k in (getattr(rows[0], "buffers", {}) if B else {}) if k != INPUT_IDS]
    for name in names:
        values = np.stack([r.buffers[name] for r in rows])
        if len(padded):
            values[np.arange(S) >= fills[:, None]] = (pad_values or {}).get(name, 0)
        if name == LOSS_MASK:
            labels[values == 0] = IGNORE
        else:
            extra[name] = torch.from_numpy(values)
    batch: dict[str, object] = {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(position_ids),
        "segment_ids": torch.from_numpy(segment_ids),
        "loss_mask": torch.from_numpy((labels != IGNORE).astype(np.float32)),
        "cu_seqlens": torch.from_numpy(cu_seqlens),
        **extra,
    }
    if any(getattr(r, "payloads", None) for r in rows):
        keys = list(dict.fromkeys(k for r in rows for p in (r.payloads or ()) for k in p))
        if images is not None and images.pixels != "lists":
            keys = [k for k in keys if k not in PER_IMAGE]  # they become the image tensors below
        for key in keys:
            batch[key] = [[p.get(key) for p in (r.payloads or [{}] * len(r.seg_lens))] for r in rows]
    if images is not None:
        batch.update(image_keys(rows, S, images, position_ids, buffers))
    return batch


def batch_digest(batch: Mapping[str, object]) -> str:
    """SHA-256 of one batch (every key but ``cu_seqlens``, in a fixed order).

    Args:
        batch: a batch as a loader delivers it.

    Returns:
        The hex digest: :func:`global_digest` of this one batch.
    """
    return global_digest([batch])


def global_digest(rank_batches: Sequence[Mapping[str, object]]) -> str:
    """SHA-256 of the global batch: each key's rank batches concatenated in rank order.

    Equal to hashing the batch that one rank owning every lane would produce, so digests compare
    across world sizes. The five text keys come first, then every other tensor key (extra per-token
    fields, pixels...) and every payload list, by name. ``cu_seqlens`` is rank-relative and derived from
    ``segment_ids``: not hashed. Image tensors concatenate along their first dimension in rank order (pixels
    of rank 0's rows, then rank 1's...), as the one-rank batch lays them out; ``image_row`` is hashed as
    global row numbers (each rank's plus the rows of the ranks before it), and mrope ``position_ids``
    ``[3, B, S]`` row by row (as ``[B, 3, S]``), so the digest is the one-rank digest at every world size.

    Args:
        rank_batches: one step's batch of every rank, in rank order.

    Returns:
        The hex digest of the global batch.
    """
    h = hashlib.sha256()
    names = {k for b in rank_batches for k in b}
    others = sorted(k for k in names if k not in HASHED_KEYS and k not in UNHASHED_KEYS)
    for key in [*(k for k in HASHED_KEYS if k in names), *others]:  # record batches have no text keys
        parts = [b[key] if key in b else _no_payload(b) for b in rank_batches]
        if key in ROW_INDEX_KEYS and "input_ids" in rank_batches[0]:
            firsts = np.cumsum([0] + [int(b["input_ids"].shape[0]) for b in rank_batches[:-1]])
            parts = [p + int(f) for p, f in zip(parts, firsts)]
        elif key == "position_ids" and isinstance(parts[0], torch.Tensor) and parts[0].dim() == 3:  # mrope [3, B, S]: the batch dimension is 1
            parts = [p.transpose(0, 1) for p in parts]
        if isinstance(parts[0], torch.Tensor):
            if any(not isinstance(p, torch.Tensor) or p.dtype != parts[0].dtype or p.shape[1:] != parts[0].shape[1:]
                   for p in parts):  # the one-rank batch could not hold them: its digest would not exist
                raise ValueError(f"global_digest: the rank batches' {key!r} differ in dtype or shape beyond the "
                                 f"first dimension ({[(str(getattr(p, 'dtype', type(p))), tuple(getattr(p, 'shape', ()))) for p in parts]}); "
                                 f"a batch key must have one dtype and row shape in every lane")
            rows = sum(int(p.shape[0]) for p in parts)
            h.update(f"{key}:{parts[0].dtype}:{rows}x{tuple(parts[0].shape[1:])};".encode())
            for p in parts:
                h.update(p.contiguous().numpy().tobytes())
        else:
            h.update(f"{key}:list;".encode())
            for p in parts:
                for row in p:
                    _hash_value(h, row)
    return h.hexdigest()


def _no_payload(batch: Mapping[str, object]) -> list[list[None]]:
    """What :func:`collate` gives for a payload field none of a rank's documents carry: ``None`` per
    document of each row (a rank whose rows hold only padding, at the end of finite data, has no payload
    field at all, but the one-rank batch holding the same rows has it). A batch of record rows
    (:mod:`zephon.collate_records`): ``None`` per row."""
    if "input_ids" not in batch:  # record rows (a record field may have any name, segment_ids included)
        return [None] * len(batch["valid"])
    docs = batch["segment_ids"].amax(dim=1).tolist() if len(batch["segment_ids"]) else []
    return [[None] * int(n) for n in docs]


def _hash_value(h: "hashlib._Hash", value: object) -> None:
    """Feed a payload value into a hash canonically (type-tagged; arrays by dtype, shape and bytes)."""
    if isinstance(value, (list, tuple)):
        h.update(b"[%d" % len(value))
        for v in value:
            _hash_value(h, v)
        h.update(b"]")
    elif isinstance(value, dict):
        h.update(b"{%d" % len(value))
        for k in sorted(value):
            _hash_value(h, str(k))
            _hash_value(h, value[k])
        h.update(b"}")
    elif isinstance(value, np.ndarray):
        h.update(f"a{value.dtype.str}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, torch.Tensor):
        _hash_value(h, value.numpy())
    elif isinstance(value, (bytes, bytearray, memoryview)):
        h.update(b"b%d:" % len(value))
        h.update(bytes(value))
    else:
        text = repr(value).encode()
        h.update(b"s%d:" % len(text))
        h.update(text)

"""Rows of a batch as a batch of their own: micro-batches, pipeline stages, per-device shards.

A trainer that splits a Zephon step (Megatron's micro-batches, say) needs every key cut consistently, not
only the ``[B, S]`` tensors: ``cu_seqlens`` is over the flattened rows, ``pixel_values`` holds the patches
of every image of the batch, ``image_row`` numbers rows of the whole batch, mrope ``position_ids`` are
``[3, B, S]``. :func:`select_rows` gives the batch a rank owning only those rows would get (its tensors
exactly; see the function for payload lists), so concatenating the selections of consecutive row ranges
in order (``global_digest``) reproduces the batch's digest.

Worked example: a batch of 4 rows whose images sit in rows ``[0, 1, 3, 3]`` with ``2, 1, 1, 4`` patches
(flat pixels). ``select_rows(batch, slice(2, 4))`` keeps the last two images, their 5 patches (rows
3..7 of ``pixel_values``), and renumbers their rows to ``[1, 1]``; ``cu_seqlens`` keeps the boundaries of
rows 2 and 3, shifted to start at 0.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..origins import PROVENANCE_KEY


def select_rows(batch: Mapping[str, Any], rows: slice) -> dict[str, Any]:
    """Some consecutive rows of a batch from :func:`zephon.collate`, every key included (Megatron's
    micro-batches).

    Every tensor key is what a rank owning just those rows gets; a payload list keeps its key even where
    none of the rows carries that field (``None`` per document, as :func:`zephon.global_digest`
    reads a missing payload), while such a rank's own batch would not have the key.

    Per-row tensors (``[B, ...]``) and payload lists are sliced; ``cu_seqlens`` keeps the boundaries
    inside the rows, shifted to 0; mrope ``position_ids`` ``[3, B, S]`` are sliced on their batch
    dimension; flat images (``image_row``) keep the images of those rows with their patches and row numbers
    relative to the first row; fixed images keep the rows' slots (``B * max_images_per_row`` of them);
    ``provenance`` keeps the entries of those rows, with their global row numbers.

    Args:
        batch: a batch of token rows (with ``input_ids``), as a loader delivers it.
        rows: the rows to keep, a contiguous ascending slice (``slice(4, 8)``).

    Returns:
        The batch of those rows.

    Raises:
        ValueError: a batch of record rows (slice its lists directly), or a slice that is not contiguous.
    """
    if "input_ids" not in batch:
        raise ValueError("select_rows: a batch of token rows (with input_ids) is expected; a batch of record "
                         "rows is a dict of per-row lists and tensors: slice it directly")
    B, S = (int(d) for d in batch["input_ids"].shape)
    lo, hi, step = rows.indices(B)
    if step != 1 or hi < lo:
        raise ValueError(f"select_rows: rows must be a contiguous ascending slice, got {rows}")
    images = _image_selection(batch, B, lo, hi)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in images:
            out[key] = images[key]
        elif key == PROVENANCE_KEY:  # entries by global row, every row has one, in order: rows lo:hi's are a run
            first = int(value[0, 0]) if len(value) else 0
            keep = (value[:, 0] >= first + lo) & (value[:, 0] < first + hi)
            out[key] = value[keep]
        elif key == "cu_seqlens":
            keep = (value >= lo * S) & (value <= hi * S)
            out[key] = value[keep] - lo * S
        elif key == "position_ids" and value.dim() == 3:  # mrope [3, B, S]
            out[key] = value[:, lo:hi]
        elif isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != B:
                raise ValueError(f"select_rows: {key!r} has shape {list(value.shape)}, not one entry per row "
                                 f"({B}); it cannot be cut by rows")
            out[key] = value[lo:hi]
        elif isinstance(value, list):
            out[key] = value[lo:hi]
        else:
            raise ValueError(f"select_rows: {key!r} is a {type(value).__name__}; only tensors and per-row lists "
                             f"can be cut by rows")
    return out


def _image_selection(batch: Mapping[str, Any], B: int, lo: int, hi: int) -> dict[str, torch.Tensor]:
    """The image keys of rows ``lo:hi``: flat (indexed by ``image_row``) or fixed (slots per row)."""
    if "image_row" in batch:
        image_row = batch["image_row"]
        bounds = torch.searchsorted(image_row, torch.tensor([lo, hi], dtype=image_row.dtype))  # rows in order
        first, last = int(bounds[0]), int(bounds[1])
        patches = batch["image_grid_thw"].prod(dim=1).cumsum(0)
        p0 = int(patches[first - 1]) if first else 0
        p1 = int(patches[last - 1]) if last else 0
        out = {"pixel_values": batch["pixel_values"][p0:p1], "image_row": image_row[first:last] - lo}
        out.update({k: batch[k][first:last] for k in ("image_grid_thw", "image_token_start")})
        return out
    if "image_mask" in batch:
        per_row = int(batch["image_mask"].shape[0]) // B if B else 0  # max_images_per_row slots each
        s = slice(lo * per_row, hi * per_row)
        return {k: batch[k][s] for k in ("pixel_values", "image_mask", "image_grid_thw", "image_token_start")}
    return {}


__all__ = ["select_rows"]

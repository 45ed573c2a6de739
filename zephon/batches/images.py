"""Images in a batch: pixels as tensors, their grids, where they sit, and 3-D rotary positions.

:func:`zephon.collate.collate` calls :func:`image_keys` for a pipeline with images. The images of a rank's
rows come in row order, each row's documents in order, each document's images in order: the order of
their pad tokens in ``input_ids`` (so ``input_ids == image_pad`` marks, in order, exactly the positions a
model scatters the image features into, as Qwen2-VL's ``masked_scatter`` does).

``pixels="flat"`` (the default; native-resolution models such as Qwen2-VL):

- ``pixel_values`` uint8 ``[total_patches, p*p*3]``: every image's patches, concatenated (a patch is
  row-major, channels last; the ``merge x merge`` patches of one token consecutive);
- ``image_grid_thw`` int64 ``[n_images, 3]``: each image's ``(t, h, w)`` in patches (image ``k`` owns
  rows ``cumsum(t*h*w)[k-1] : cumsum(t*h*w)[k]`` of ``pixel_values``);
- ``image_row`` int64 ``[n_images]``: the row (in this rank's batch) that holds the image;
- ``image_token_start`` int64 ``[n_images]``: the position of its first pad token in that row. Its tokens
  are ``t*h*w // merge**2`` positions from there; in the flattened ``[B*S]`` stream the image starts at
  ``image_row * S + image_token_start``.

``pixels="fixed"`` (fixed-resolution encoders, compiled models): images of one size (``decode_images(size=)``)
as ``pixel_values`` uint8 ``[B * max_images_per_row, 3, H, W]``: row ``r`` owns slots
``r*M .. r*M + M - 1`` (``M = pack(max_images_per_row=)``), its images first, then zero padding;
``image_mask`` bool ``[B*M]`` says which slots hold an image, ``image_grid_thw`` ``[B*M, 3]`` and
``image_token_start`` ``[B*M]`` are 0 in empty slots. The shape depends on ``B`` only, never on the data.

``pixels="lists"``: the per-document payloads as :func:`collate` gives any payload (lists per row and
document).

**uint8 by default**: a batch of pixels is a quarter of its float32 size in host memory, in the queues
between worker processes, in pinned memory and over PCIe; normalising on the GPU is one fused
elementwise operation (:func:`normalize`), while doing it on the host costs CPU time per image in the
loader, which the decode already fills. Nothing about the bytes depends on where they are normalised.

``positions="mrope"``: ``position_ids`` int64 ``[3, B, S]`` (temporal, height, width), Qwen2-VL's
multimodal rotary positions per packed document, equal to ``transformers``' ``Qwen2VLModel.get_rope_index``
run on each document alone (tested): text tokens count up as usual (all three equal); image ``k``'s tokens
get ``start + (t_i, h_i, w_i)`` over its merged grid, ``start`` being the position its first token would
have had; the text after it resumes at ``start + max(h, w) // merge``. Padding is 0, as in 1-D.

Worked example: a row ``[t S P P P P E t]`` (one document; the image a 1 x 4 x 4 grid, merge 2: 4 tokens)::

    position_ids (1d)  0 1 2 3 4 5 6 7
    mrope temporal     0 1 2 2 2 2 4 5      start 2, merged grid 1 x 2 x 2, then 2 + max(2, 2) = 4
          height       0 1 2 2 3 3 4 5
          width        0 1 2 3 2 3 4 5
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..ops.batch import PIXEL_MODES, POSITION_MODES
from ..ops.image_layout import IMAGE_GRID, IMAGE_SPANS, IMAGES
from ..records import Row
from .buffers import UNPOOLED, BatchBuffers

IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_row", "image_token_start", "image_mask")  # any a mode gives


@dataclass(frozen=True)
class ImageBatch:
    """How a pipeline's batches carry images (from ``batch(pixels=, positions=)`` and the image operators)."""

    pixels: str = "flat"
    positions: str = "1d"
    patch_dim: int = 0  # flat: p*p*3 of every patch (an empty batch still has [0, patch_dim] pixels)
    size: tuple[int, int] | None = None  # fixed: (H, W) of every image
    slots: int = 0  # fixed: image slots per row (pack's max_images_per_row)


@dataclass
class _Placed:
    """The images of a rank's rows, in batch order."""

    rows: np.ndarray  # int64 [N]
    pad_start: np.ndarray  # int64 [N]: first pad token's position in its row
    pads: np.ndarray  # int64 [N]: pad tokens
    grids: np.ndarray  # int64 [N, 3]
    arrays: list[np.ndarray]


def _placed(rows: Sequence[Row]) -> _Placed:
    """Every image of ``rows`` with where its tokens are (a loop over documents with images, never pixels)."""
    r_idx: list[np.ndarray] = []
    spans_all: list[np.ndarray] = []
    grids: list[Any] = []
    arrays: list[np.ndarray] = []
    for r, row in enumerate(rows):
        if not row.payloads:
            continue
        off = 0
        for n, p in zip(row.seg_lens, row.payloads):
            spans = p.get(IMAGE_SPANS)
            if spans is not None and len(spans):
                spans_all.append(spans[:, 1:3].astype(np.int64) + off)
                r_idx.append(np.full(len(spans), r, dtype=np.int64))
                grids += p[IMAGE_GRID]
                arrays += p[IMAGES]
            off += n
    if not arrays:
        z = np.zeros(0, dtype=np.int64)
        return _Placed(z, z, z, np.zeros((0, 3), np.int64), [])
    spans = np.concatenate(spans_all)
    return _Placed(np.concatenate(r_idx), spans[:, 0], spans[:, 1] - spans[:, 0],
                   np.asarray(grids, dtype=np.int64).reshape(-1, 3), arrays)


def _merges(placed: _Placed) -> np.ndarray:
    """Each image's merge (patches per token side), from its grid and its pad-token count."""
    per_token = placed.grids.prod(axis=1) // np.maximum(placed.pads, 1)
    return np.sqrt(per_token).round().astype(np.int64)


def image_keys(rows: Sequence[Row], seq_len: int, spec: ImageBatch, position_ids: np.ndarray,
               buffers: BatchBuffers = UNPOOLED) -> dict[str, Any]:
    """The image keys of a batch of ``rows`` (see the module docstring); with mrope, ``position_ids`` too.
    ``pixel_values`` is written into memory from ``buffers``."""
    placed = _placed(rows)
    out: dict[str, Any] = {}
    if spec.pixels == "flat":
        out.update(_flat(placed, spec, buffers))
    elif spec.pixels == "fixed":
        out.update(_fixed(placed, spec, len(rows), buffers))
    if spec.positions == "mrope":
        out["position_ids"] = torch.from_numpy(mrope_positions(position_ids, placed))
    return out


def _flat(placed: _Placed, spec: ImageBatch, buffers: BatchBuffers) -> dict[str, Any]:
    for k, a in enumerate(placed.arrays):
        if a.ndim != 2 or a.shape[1] != spec.patch_dim or a.dtype != np.uint8 or a.shape[0] != placed.grids[k].prod():
            raise ValueError(f"batch(pixels='flat'): an image is {a.dtype} {list(a.shape)}, not uint8 patches "
                             f"[{int(placed.grids[k].prod())}, {spec.patch_dim}] as its grid says: decode every image "
                             f"with decode_images(patchify=True) and one patch_size, or use pixels='fixed'")
    pixels = buffers.empty((sum(a.shape[0] for a in placed.arrays), spec.patch_dim), np.uint8)
    if placed.arrays:
        np.concatenate(placed.arrays, out=pixels)
    return {"pixel_values": torch.from_numpy(pixels), "image_grid_thw": torch.from_numpy(placed.grids),
            "image_row": torch.from_numpy(placed.rows), "image_token_start": torch.from_numpy(placed.pad_start)}


def unpatchify(patches: np.ndarray, grid: Sequence[int], merge: int) -> np.ndarray:
    """The ``[H, W, 3]`` pixels of :func:`zephon.imaging.patchify`'s ``[h*w, p*p*3]`` patches (one reshape and
    transpose: the inverse of its own)."""
    _, gh, gw = (int(v) for v in grid)
    c = 3
    p = math.isqrt(patches.shape[1] // c)
    m = merge
    x = patches.reshape(gh // m, gw // m, m, m, p, p, c).transpose(0, 2, 4, 1, 3, 5, 6)
    return x.reshape(gh * p, gw * p, c)


def _fixed(placed: _Placed, spec: ImageBatch, batch_rows: int, buffers: BatchBuffers) -> dict[str, Any]:
    assert spec.size is not None
    h, w = spec.size
    m = spec.slots
    n = batch_rows * m
    pixels = buffers.empty((n, 3, h, w), np.uint8)
    mask = np.zeros(n, dtype=bool)
    grids = np.zeros((n, 3), dtype=np.int64)
    starts = np.zeros(n, dtype=np.int64)
    if placed.arrays:
        first = np.searchsorted(placed.rows, placed.rows, side="left")  # rows are sorted: rank in its row
        slot = placed.rows * m + (np.arange(len(placed.rows)) - first)
        if (np.arange(len(placed.rows)) - first).max() >= m:
            raise ValueError(f"batch(pixels='fixed'): a row holds more than max_images_per_row = {m} images")
        merges = _merges(placed)
        for k, a in enumerate(placed.arrays):
            hwc = a if a.ndim == 3 else unpatchify(a, placed.grids[k], int(merges[k]))
            if hwc.shape != (h, w, 3):
                raise ValueError(f"batch(pixels='fixed'): an image of {hwc.shape[0]} x {hwc.shape[1]} pixels; every "
                                 f"image must be {h} x {w} (decode_images(size=({h}, {w})))")
            pixels[slot[k]] = hwc.transpose(2, 0, 1)
        mask[slot], grids[slot], starts[slot] = True, placed.grids, placed.pad_start
    pixels[~mask] = 0  # the empty slots: the memory may hold an earlier batch's pixels
    return {"pixel_values": torch.from_numpy(pixels), "image_mask": torch.from_numpy(mask),
            "image_grid_thw": torch.from_numpy(grids), "image_token_start": torch.from_numpy(starts)}


def mrope_positions(position_ids: np.ndarray, placed: _Placed) -> np.ndarray:
    """``[3, B, S]`` multimodal rotary positions from the 1-D ``position_ids`` ``[B, S]`` (0 at every
    document start) and the images' places, vectorised over the batch (see the module docstring)."""
    b, s = position_ids.shape
    pos = position_ids.reshape(-1)
    out = np.broadcast_to(pos, (3, b * s)).copy()
    if not len(placed.rows):
        return out.reshape(3, b, s)
    merges = _merges(placed)
    lh, lw = placed.grids[:, 1] // merges, placed.grids[:, 2] // merges
    n = placed.pads
    base = placed.rows * s + placed.pad_start
    # after an image, its document's text resumes at start + max(lh, lw) instead of start + n: a drop of
    # n - max(lh, lw), summed over the document's earlier images (a running sum reset at document starts)
    after = base + n
    delta = np.zeros(b * s + 1, dtype=np.int64)
    inside = (after < (placed.rows + 1) * s)
    inside[inside] &= pos[after[inside]] > 0  # the next token is in the same document
    np.add.at(delta, after[inside], (np.maximum(lh, lw) - n)[inside])
    cum = np.cumsum(delta[:-1])
    idx = np.arange(b * s)
    shift = cum - cum[idx - pos]  # pos counts from the document start: idx - pos is its first token
    out += shift
    start = out[0, base]  # where each image's first token stands (earlier images applied)
    total = int(n.sum())
    k = np.repeat(np.arange(len(n)), n)
    i = np.arange(total) - np.repeat(np.cumsum(n) - n, n)
    hw = (lh * lw)[k]
    flat = base[k] + i
    st = start[k]
    out[0, flat] = i // hw + st
    out[1, flat] = (i // lw[k]) % lh[k] + st
    out[2, flat] = i % lw[k] + st
    return out.reshape(3, b, s)


def normalize(pixel_values: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 pixels to ``(x / 255 - mean) / std`` per channel, as float32, wherever the tensor is (on the
    GPU, after the copy): flat patches ``[N, p*p*3]`` (channels last) or fixed images ``[N, 3, H, W]``."""
    x = pixel_values.float().div_(255)
    m = torch.tensor(mean, dtype=x.dtype, device=x.device)
    sd = torch.tensor(std, dtype=x.dtype, device=x.device)
    if x.dim() == 2:
        return ((x.view(x.shape[0], -1, 3) - m) / sd).view(x.shape)
    return (x - m.view(1, 3, 1, 1)) / sd.view(1, 3, 1, 1)


__all__ = ["IMAGE_KEYS", "ImageBatch", "PIXEL_MODES", "POSITION_MODES", "image_keys", "mrope_positions", "normalize", "unpatchify"]

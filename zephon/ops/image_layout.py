"""Where a document with images may be cut, and which images each piece carries.

A document made by ``tokenize_images`` carries, per image, its pixels (``images``), its grid
(``image_grid_thw``) and its token span (``image_spans``: an int32 array ``[n_images, 4]`` of
``(span_start, pad_start, pad_end, span_end)`` token offsets in the document: the span is the image's
start token, its pad tokens and its end token; the pads are ``[pad_start, pad_end)``). The splitter and
the packer cut documents only *between* spans, never inside one, and give each piece exactly the images
whose spans it holds (offsets shifted to the piece): an image's pixels are never duplicated or lost, and
its start, pad and end tokens stay together (Qwen2-VL's rope index and ``masked_scatter`` of image
features need them whole).

**Limits per row** (:class:`ImageLimits`): at most ``max_images`` images and ``max_patches`` patches
(``t*h*w`` of each grid) in one packed row. Per row, never per rank: a row is a lane's, so the limit
is the same on every world size (a lane's batch holds at most ``rows_per_lane`` times it, a global batch
``lanes * rows_per_lane`` times it).

Worked example, ``max_tokens = 8``, a document of 14 tokens with two images (``S`` start, ``P`` pad,
``E`` end; spans ``[2, 6)`` and ``[9, 13)``)::

    t t S P P E t t t S P P E t        cuts every 8 tokens would cut at 8: between spans, kept
    [t t S P P E t t] [t S P P E t]    piece 1 holds image 0 (span [2, 6)), piece 2 image 1 (span [1, 5))

    with max_tokens = 10 the cut at 10 falls inside [9, 13): it moves back to 9
    [t t S P P E t t t] [S P P E t]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..records import INPUT_IDS, Doc, doc_origin, doc_source, doc_tail

IMAGES, IMAGE_GRID, IMAGE_SPANS = "images", "image_grid_thw", "image_spans"
PER_IMAGE = (IMAGES, IMAGE_GRID, IMAGE_SPANS)  # payloads with one entry per image, in order


class ImageTooLarge(ValueError):
    """One image does not fit in a row on its own (its tokens, or the per-row image or patch limits)."""


@dataclass(frozen=True)
class ImageLimits:
    """Per packed row: at most ``max_images`` images and ``max_patches`` patches (None: no limit)."""

    max_images: int | None = None
    max_patches: int | None = None

    def describe(self) -> dict[str, int]:
        return {k: v for k, v in (("max_images_per_row", self.max_images),
                                  ("max_patches_per_row", self.max_patches)) if v is not None}


NO_LIMITS = ImageLimits()
BIG = 1 << 62


def spans_of(doc: Mapping[str, Any]) -> np.ndarray | None:
    """The document's image spans, or None when it has no image (a text document)."""
    spans = doc.get(IMAGE_SPANS)
    return spans if spans is not None and len(spans) else None


def patch_counts(doc: Mapping[str, Any]) -> list[int]:
    """Patches of each image of ``doc`` (``t*h*w`` of its grid)."""
    return [int(t) * int(h) * int(w) for t, h, w in doc[IMAGE_GRID]]


def safe_cut(spans: np.ndarray, patches: Sequence[int], lo: int, hi: int, max_images: int = BIG,
             max_patches: int = BIG) -> int:
    """The largest cut ``c`` in ``[lo, hi]`` such that no image span straddles ``c`` and the images inside
    ``[lo, c)`` number at most ``max_images`` with at most ``max_patches`` patches (the room left in a row).
    ``lo`` when not even the first image after ``lo`` fits."""
    images = used = 0
    for k in range(len(spans)):
        start, end = int(spans[k, 0]), int(spans[k, 3])
        if end <= lo:
            continue
        if start >= hi:
            break
        if start < lo:
            raise ValueError(f"a cut at token {lo} falls inside image {k}'s tokens [{start}, {end})")
        if end > hi or images + 1 > max_images or used + patches[k] > max_patches:
            return start
        images += 1
        used += patches[k]
    return hi


def piece(doc: Mapping[str, Any], a: int, b: int, token_fields: Sequence[str]) -> Doc:
    """Tokens ``[a, b)`` of ``doc`` as a document of its own, with only the images whose spans lie in it
    (offsets shifted by ``-a``); every other payload goes with it unchanged. Its tail label is the next
    token when ``b`` is not the document's end. A cut inside a span is an error."""
    ids = doc[INPUT_IDS]
    n = len(ids)
    out = Doc(doc, doc_tail(doc) if b >= n else int(ids[b]), doc_source(doc), doc_origin(doc, a))
    for name in token_fields:
        if name in doc:
            out[name] = doc[name][a:b]
    if spans_of(doc) is not None:
        out.update(images_in(doc, a, b))
    return out


def images_in(doc: Mapping[str, Any], a: int, b: int) -> dict[str, Any]:
    """The per-image payloads of ``doc`` (``images``, ``image_grid_thw``, ``image_spans``) for the images
    whose spans lie in tokens ``[a, b)``, spans shifted by ``-a``. A span that straddles ``a`` or ``b`` is
    an error: pieces are cut between images only."""
    spans = doc[IMAGE_SPANS]
    inside = (spans[:, 0] >= a) & (spans[:, 3] <= b)
    straddle = (spans[:, 0] < b) & (spans[:, 3] > a) & ~inside
    if straddle.any():
        k = int(np.flatnonzero(straddle)[0])
        raise ValueError(f"a piece [{a}, {b}) of a document cuts image {k}'s tokens {spans[k, [0, 3]].tolist()}")
    keep = np.flatnonzero(inside).tolist()
    out: dict[str, Any] = {IMAGE_SPANS: (spans[inside] - a).astype(np.int32)}
    for name in (IMAGES, IMAGE_GRID):
        if name in doc:
            values = doc[name]
            out[name] = [values[k] for k in keep]
    return out


def cut_points(spans: np.ndarray | None, patches: Sequence[int], n: int, max_tokens: int,
               limits: ImageLimits = NO_LIMITS) -> list[int]:
    """Where to cut a document of ``n`` tokens into pieces of at most ``max_tokens`` tokens (and within the
    per-row image limits), never inside an image span: the end of every piece but the last. Without images,
    every ``max_tokens`` tokens from the start (what :func:`zephon.ops.split.piece_bounds` does)."""
    if spans is None:
        return list(range(max_tokens, n, max_tokens))
    cap_i = BIG if limits.max_images is None else limits.max_images
    cap_p = BIG if limits.max_patches is None else limits.max_patches
    cuts: list[int] = []
    s = 0
    while True:
        c = safe_cut(spans, patches, s, min(n, s + max_tokens), cap_i, cap_p)
        if c >= n:
            return cuts
        if c == s:
            k = int(np.searchsorted(spans[:, 0], s))
            raise ImageTooLarge(too_large(spans[k], patches[k], max_tokens, limits))
        cuts.append(c)
        s = c


def too_large(span: np.ndarray, patches: int, max_tokens: int, limits: ImageLimits) -> str:
    tokens = int(span[3] - span[0])
    what = []
    if tokens > max_tokens:
        what.append(f"{tokens} tokens with its delimiters, more than a row of {max_tokens}")
    if limits.max_patches is not None and patches > limits.max_patches:
        what.append(f"{patches} patches, more than max_patches_per_row = {limits.max_patches}")
    if limits.max_images is not None and limits.max_images < 1:
        what.append("max_images_per_row < 1")
    return (f"an image of {'; '.join(what) or 'this size'} cannot be packed into any row. Lower "
            f"decode_images(max_pixels=...) (or size=), or raise pack(seq_len=...) / max_patches_per_row.")


__all__ = ["IMAGES", "IMAGE_GRID", "IMAGE_SPANS", "PER_IMAGE", "ImageLimits", "ImageTooLarge", "cut_points", "images_in",
           "piece",
           "patch_counts", "safe_cut", "spans_of"]

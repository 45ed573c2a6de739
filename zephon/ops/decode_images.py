"""``decode_images``: image bytes to pixels or patches, one operator per chunk (decode, orient, resize, patch).

One combined operator, not three: decoding a JPEG at 1/2, 1/4 or 1/8 of its size (DCT scaling) needs the
target size, and a chain of operators would hand full-size pixel arrays from one to the next. The
pure functions behind it are in :mod:`zephon.imaging`.

**Inputs.** ``field`` holds, per record, one image or a list of them. An image is encoded bytes (a
WebDataset member, a Parquet binary cell), the ``{"bytes": ..., "path": ...}`` struct Hugging Face
``datasets`` writes (its bytes; its path when the bytes are null), or a path string, relative to the
folder of the data file that holds the record (a local dataset; a path that leaves that folder, an
absolute one or one through a symbolic link that leaves it, is refused as ``bad_path``). A list may hold
``None`` entries: the text slots of an interleaved document (below).

**Record layouts** (what :mod:`zephon.ops.tokenize_images` turns into tokens):

- *pairs*: a text field (a caption, with ``<image>`` placeholders or none) and an image field with
  one image or a list;
- *interleaved* (the OBELICS layout): ``texts`` and ``images``, two lists of the same length; at each
  position ``k`` one of them is not None: ``texts[k]`` a paragraph or ``images[k]`` an image. In
  Parquet, ``texts: list<string>`` and ``images: list<binary>`` (or ``list<struct<bytes, path>>``); in
  JSON Lines, ``images`` holds paths relative to the ``.jsonl`` file.

**Bad images** (corrupt, truncated, zero bytes, not an image, more than ``max_image_pixels`` pixels, a
``fit`` aspect ratio over 200, a missing image or a refused path), by ``on_bad_image``:

- ``"skip"`` (default): the image becomes ``None`` in ``images`` (its place is kept: the tokens operator
  drops the image and its placeholder, and keeps the text), counted as ``skipped_images`` and
  ``skipped_images.<reason>`` (reasons: :data:`zephon.imaging.BAD_REASONS`);
- ``"drop_record"``: the whole record is dropped (counted the same, and as a skipped record);
- ``"raise"``: an error naming the operator, the file, the record and the reason.

**Output contract** (after ``decode_images`` and ``tokenize_images``; the multimodal packer and collate
build on it). A document has

- ``input_ids``: int32 per token, every image expanded to its token count (below) between the
  optional image-start and image-end ids;
- ``loss_mask``: uint8 per token, label-aligned like every ``loss_mask`` in Zephon: position ``i`` is 0
  when its label, token ``i+1``, is an image token (start, pad or end), so ``labels`` is -100 there;
- ``images``: a per-document payload, the list of its images in order of appearance, each a uint8
  array ``[n_patches, p*p*3]`` (``patchify=True``: patches row-major, pixels row-major inside a patch,
  channels last, the ``merge x merge`` patches of one token consecutive) or ``[H, W, 3]`` pixels;
- ``image_grid_thw``: a per-document payload, a ``(t, h, w)`` tuple per image, in patches before the
  merge (``t`` = 1 for an image); the image's token count is ``t * h * w // merge**2``;
- ``image_spans``: a per-document payload, int32 ``[n_images, 4]``: each image's ``(span_start, pad_start,
  pad_end, span_end)`` token offsets (the span holds its start, pad and end tokens). The splitter and the
  packer never cut inside a span and give each piece only the images it holds
  (:mod:`zephon.ops.image_layout`); a text piece that spells an image token (``<|image_pad|>``) loses it
  (counted as ``image_ids_in_text``), so the pad tokens are exactly the images' tokens.

Worked example (``tests/test_vision.py`` runs it): ``patch_size=14, merge=2``, ``max_pixels=56*56``
(``fit``), one JPEG of 60 x 100 pixels (height x width) with the caption "a red <image> kite" (its two
pieces tokenize to ``[7, 8]`` and ``[9]``), image ids start 5, pad 4, end 6, EOS 2::

    decode:  60 x 100 -> smart_resize -> 28 x 56 pixels -> grid (1, 2, 4) -> 8 patches of 14*14*3 = 588
    images          = [uint8 [8, 588]]          image_grid_thw = [(1, 2, 4)]
    tokens:  8 patches / 2**2 = 2 image tokens
    input_ids       = [7, 8, 5, 4, 4, 6, 9, 2]
    image_spans     = [[2, 3, 5, 6]]            # start token at 2, pads [3, 5), end token at 5
    loss_mask       = [1, 0, 0, 0, 0, 1, 1, 1]  # labels 8, -100, -100, -100, -100, 9, 2, tail
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from ..imaging import (BAD_REASONS, DEFAULT_MAX_IMAGE_PIXELS, JPEG_DECODERS, RESAMPLE, BadImage, ImageSpec,
                       decode_image, patchify)
from ..errors import PipelineError, SourceError
from ..records import Chunk
from .base import Transform, choice, positive_int

ON_BAD_IMAGE = ("skip", "drop_record", "raise")
IMAGES, IMAGE_GRID = "images", "image_grid_thw"
MAX_IMAGE_FILE_BYTES = 256 << 20  # an image read by path larger than this is refused (oversized)


def default_jpeg_decoder() -> str:
    """simplejpeg when it is installed (libjpeg-turbo with DCT scaling, ~2x Pillow's JPEG decode), else Pillow."""
    try:
        import simplejpeg  # noqa: F401
    except ImportError:
        return "pillow"
    return "simplejpeg"


class DecodeImages(Transform):
    """Decode, orient, resize and (optionally) patchify the images of ``field`` (see the module docstring).

    Exactly one of ``size`` (``crop``: an int or ``(height, width)``) and ``max_pixels`` (``fit``) is given.
    ``jpeg_decoder`` "auto" is resolved when the pipeline is declared (simplejpeg if installed, else
    Pillow) and enters the fingerprint: the two may differ in the last bit, so a resume on a machine
    with the other one is refused rather than silently different.
    """

    _rows_checked = False  # its output fits the packed rows by construction

    op = "decode_images"

    def __init__(self, field: str = "image", *, size: int | Sequence[int] | None = None, max_pixels: int | None = None,
                 min_pixels: int = 56 * 56, patch_size: int = 14, merge: int = 1, patchify: bool = True,
                 resample: str = "bicubic", max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 on_bad_image: str = "skip", jpeg_decoder: str = "auto", reduced_decode: bool = True,
                 keep_field: bool = False, name: str | None = None, sources: Sequence[str] | None = None,
                 executor: str | None = None) -> None:
        super().__init__(name, sources, executor)
        if not isinstance(field, str) or not field:
            raise PipelineError(f"decode_images(field={field!r}): the name of the field that holds the images is "
                                f"needed")
        for what, v in (("patch_size", patch_size), ("merge", merge), ("min_pixels", min_pixels),
                        ("max_image_pixels", max_image_pixels)):
            positive_int(v, f"decode_images({what}=...)")
        if (size is None) == (max_pixels is None):
            raise PipelineError("decode_images: give size= (resize and centre-crop to a fixed size) or max_pixels= "
                                "(keep the aspect ratio, at most that many pixels), exactly one of them")
        factor = patch_size * merge
        crop: tuple[int, int] | None = None
        if size is not None:
            crop = (size, size) if isinstance(size, int) and not isinstance(size, bool) else tuple(size)  # type: ignore
            if len(crop) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in crop):
                raise PipelineError(f"decode_images(size={size!r}): an int or (height, width) of positive ints is "
                                    f"needed")
            if crop[0] % factor or crop[1] % factor:
                raise PipelineError(f"decode_images(size={size!r}): each side must be a multiple of patch_size * "
                                    f"merge = {factor}")
        elif not isinstance(max_pixels, int) or isinstance(max_pixels, bool) or max_pixels < factor * factor:
            raise PipelineError(f"decode_images(max_pixels={max_pixels!r}): an integer of at least (patch_size * "
                                f"merge)**2 = {factor * factor} is needed")
        elif min_pixels > max_pixels:
            raise PipelineError(f"decode_images(min_pixels={min_pixels}) exceeds max_pixels={max_pixels}")
        choice(resample, RESAMPLE, "decode_images(resample)")
        choice(on_bad_image, ON_BAD_IMAGE, "decode_images(on_bad_image)")
        decoder = default_jpeg_decoder() if jpeg_decoder == "auto" else jpeg_decoder
        choice(decoder, JPEG_DECODERS, "decode_images(jpeg_decoder) ('auto' or one of those)")
        self.field, self.size, self.max_pixels = field, crop, max_pixels
        self.min_pixels = None if crop else min_pixels  # a fixed size has no lower bound
        self.patch_size, self.merge, self.patchify, self.resample = patch_size, merge, patchify, resample
        self.max_image_pixels, self.on_bad_image = max_image_pixels, on_bad_image
        self.jpeg_decoder, self.reduced_decode, self.keep_field = decoder, reduced_decode, keep_field
        self._spec = ImageSpec(mode="crop" if crop else "fit", size=crop, min_pixels=min_pixels,
                               max_pixels=max_pixels or 0, patch_size=patch_size, merge=merge, resample=resample,
                               max_image_pixels=max_image_pixels, jpeg_decoder=decoder, reduced_decode=reduced_decode)

    # -- one image ---------------------------------------------------------------------------------------
    def _one(self, item: Any, root: str) -> tuple[np.ndarray, tuple[int, int, int]]:
        data = item
        if isinstance(item, dict):  # Hugging Face's Image feature: {"bytes": ..., "path": ...}
            data = item.get("bytes")
            if data is None and isinstance(item.get("path"), str):
                data = read_image_path(item["path"], root)
        elif isinstance(item, str):
            data = read_image_path(item, root)
        pixels = decode_image(data, self._spec)
        p = self._spec.patch_size
        grid = (1, pixels.shape[0] // p, pixels.shape[1] // p)
        return (patchify(pixels, p, self._spec.merge) if self.patchify else pixels), grid

    def _bad(self, chunk: Chunk, j: int, exc: BadImage) -> None:
        if self.on_bad_image == "raise":
            raise SourceError(f"operator '{self.name}': source '{chunk.source_name}': {chunk.where(j)}: "
                              f"field '{self.field}': "
                              f"bad image ({exc.reason}: {exc.detail}). Fix or remove it, or pass "
                              f"on_bad_image='skip' (keep the record's text) or 'drop_record' to skip and count such "
                              f"images.")
        chunk.count("skipped_images")
        chunk.count(f"skipped_images.{exc.reason}")

    # -- a chunk -----------------------------------------------------------------------------------------
    def _apply_chunk(self, chunk: Chunk) -> Chunk:
        if self.field not in chunk.columns:
            raise SourceError(f"operator '{self.name}': records of source '{chunk.source_name}' ({chunk.path}) "
                              f"have no field '{self.field}' "
                              f"(fields: {', '.join(chunk.columns) or 'none'}). Set decode_images(field=...) to the "
                              f"field that holds the images, or read that column from the source.")
        values = chunk.columns[self.field]
        root = os.path.dirname(chunk.path)
        images: list[list[np.ndarray | None]] = []
        grids: list[list[tuple[int, int, int] | None]] = []
        keep: list[int] = []
        for j, value in enumerate(values):
            items = value if isinstance(value, (list, tuple)) else [value]
            imgs: list[np.ndarray | None] = []
            thw: list[tuple[int, int, int] | None] = []
            bad = False
            for item in items:
                img = grid = None
                if item is not None or items is not value:  # else a text slot of an interleaved document
                    try:
                        img, grid = self._one(item, root)
                    except BadImage as exc:
                        self._bad(chunk, j, exc)
                        bad = True
                imgs.append(img)
                thw.append(grid)
            if bad and self.on_bad_image == "drop_record":
                chunk.count("bad_image_records")
                continue
            keep.append(j)
            images.append(imgs)
            grids.append(thw)
        out = chunk.select(np.asarray(keep, dtype=np.int64))
        columns = {k: v for k, v in out.columns.items() if self.keep_field or k != self.field}
        columns[IMAGES], columns[IMAGE_GRID] = images, grids
        out.columns = columns
        return out


def read_image_path(path: str, root: str) -> bytes:
    """The bytes of an image named by a path inside a local dataset folder ``root`` (untrusted: an absolute
    path, a path that leaves ``root`` or resolves outside it through a link, or a remote dataset, is
    refused as ``bad_path``; a missing file is ``missing``)."""
    if "://" in root:
        raise BadImage("bad_path", f"image path {path!r}: images are read by path from local datasets only; store "
                                   f"the bytes in the dataset for {root}")
    if not path or os.path.isabs(path) or "\x00" in path:
        raise BadImage("bad_path", f"image path {path!r} is not a relative path inside the dataset folder")
    base = os.path.realpath(root or ".")
    full = os.path.realpath(os.path.join(base, path))
    if os.path.commonpath([base, full]) != base:
        raise BadImage("bad_path", f"image path {path!r} leaves the dataset folder {base}")
    try:
        size = os.stat(full).st_size
        if size > MAX_IMAGE_FILE_BYTES:
            raise BadImage("oversized", f"image file {path!r} has {size} bytes (more than {MAX_IMAGE_FILE_BYTES})")
        with open(full, "rb") as f:
            return f.read(MAX_IMAGE_FILE_BYTES + 1)
    except FileNotFoundError:
        raise BadImage("missing", f"image file {path!r} does not exist in {base}") from None
    except IsADirectoryError:
        raise BadImage("bad_path", f"image path {path!r} is a folder") from None
    except OSError as exc:
        raise BadImage("missing", f"image file {path!r} cannot be read ({exc})") from None


__all__ = ["DecodeImages", "IMAGES", "IMAGE_GRID", "ON_BAD_IMAGE", "BAD_REASONS", "read_image_path"]

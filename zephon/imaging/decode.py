"""Image decoding, orientation, resizing and patching as pure functions of (bytes, parameters).

Used by the image operators (:mod:`zephon.ops.decode_images`); everything here is deterministic: the same bytes
and the same :class:`ImageSpec` give the same pixels on every machine that has the same library
versions (pin Pillow and simplejpeg as you pin your tokenizer library: ``.ci/constraints.txt``).

The path of one image::

    bytes --sniff--> JPEG | PNG | WEBP | GIF | BMP      (anything else: "not_an_image", never handed to a codec)
          --header--> (h, w), EXIF orientation          (h * w > max_image_pixels: "oversized", nothing decoded)
          --decode at 1/s--> RGB uint8 [h/s, w/s, 3]     (s in 1, 2, 4, 8: DCT scaling, JPEG only)
          --orient--> [H0, W0, 3]                         (the 8 EXIF orientations)
          --resize--> [H, W, 3]                           (one resampling step, filter pinned)
          --patchify--> [H/p * W/p, p*p*3]                (optional; 2x2 merge groups contiguous)

simplejpeg's array takes these steps as arrays (copied into Pillow to be resized). Pillow's decoder orients
and resizes its image without leaving Pillow, making one array at the end (each trip between Pillow and
numpy is a copy), with the pixels the steps on arrays give (``tests/test_vision.py`` holds it to that).

Untrusted input: only the five formats above ever reach a codec (Pillow is given the one format the
bytes claim, so none of its other plugins, e.g. EPS, which runs Ghostscript, can be reached); the pixel
count is checked from the header before anything is decoded (a decompression bomb costs a header
read); a truncated or corrupt stream is an error of the codec (libjpeg-turbo's warnings are errors here:
``strict=True``), reported as :class:`BadImage` with a reason, never a partial image.
"""

from __future__ import annotations

import io
import struct
from typing import Any

import numpy as np

from .geometry import coverage_size, crop_box, dct_scale, output_size
from .spec import MAX_ASPECT, BadImage, ImageSpec

_ORIENTATION_TAG = 0x0112


# -- what the bytes are -----------------------------------------------------------------------------------
def sniff_format(data: bytes) -> str | None:
    """The image format the leading bytes announce (``"JPEG"``, ``"PNG"``, ``"WEBP"``, ``"GIF"``, ``"BMP"``),
    or None: the allow-list of formats Zephon decodes."""
    if data[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:2] == b"BM" and len(data) >= 26:
        return "BMP"
    return None


def jpeg_orientation(data: bytes) -> int:
    """The EXIF orientation (1..8) of a JPEG, read from its first ``Exif`` APP1 segment (1 when absent
    or unreadable). Walks the marker segments up to the first scan: a few steps, no decoding."""
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return 1
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:  # segments without a length
            i += 2
            continue
        if marker in (0xDA, 0xD9):  # start of scan, end of image: no EXIF before it
            return 1
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if length < 2:
            return 1
        if marker == 0xE1 and data[i + 4:i + 10] == b"Exif\x00\x00":
            return tiff_orientation(data[i + 10:i + 2 + length])
        i += 2 + length
    return 1


def tiff_orientation(tiff: bytes) -> int:
    """The orientation tag of IFD0 of a TIFF structure (an EXIF block), 1 when absent or malformed."""
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 1
    order = "little" if tiff[:2] == b"II" else "big"
    if int.from_bytes(tiff[2:4], order) != 42:
        return 1
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return 1
    for k in range(min(int.from_bytes(tiff[ifd:ifd + 2], order), 1024)):
        entry = ifd + 2 + 12 * k
        if entry + 12 > len(tiff):
            break
        if int.from_bytes(tiff[entry:entry + 2], order) != _ORIENTATION_TAG:
            continue
        kind = int.from_bytes(tiff[entry + 2:entry + 4], order)
        if kind == 3:  # SHORT, left-justified in the value field
            value = int.from_bytes(tiff[entry + 8:entry + 10], order)
        elif kind == 4:  # LONG
            value = int.from_bytes(tiff[entry + 8:entry + 12], order)
        else:
            return 1
        return value if 1 <= value <= 8 else 1
    return 1


# EXIF orientation -> the Pillow transpose that shows the image upright (as ``orient`` does to an array).
_TRANSPOSE = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_270",
              7: "TRANSVERSE", 8: "ROTATE_90"}


# EXIF orientation -> the view of the array that shows the image upright (as the transposes above do).
_ORIENT = {2: lambda p: p[:, ::-1], 3: lambda p: p[::-1, ::-1], 4: lambda p: p[::-1], 5: lambda p: p.transpose(1, 0, 2),
           6: lambda p: np.rot90(p, -1), 7: lambda p: p[::-1, ::-1].transpose(1, 0, 2), 8: lambda p: np.rot90(p, 1)}


def orient(pixels: np.ndarray, orientation: int) -> np.ndarray:
    """``pixels`` [H, W, C] as displayed for an EXIF ``orientation`` (what Pillow's ``exif_transpose`` does)."""
    view = _ORIENT.get(orientation)
    return pixels if view is None else np.ascontiguousarray(view(pixels))


# -- decoding ---------------------------------------------------------------------------------------------
def _resample(name: str) -> Any:
    from PIL import Image

    return Image.Resampling[name.upper()]  # the names of spec.RESAMPLE


def decode_image(data: Any, spec: ImageSpec) -> np.ndarray:
    """Decode, orient, convert to RGB and resize one image: uint8 ``[H, W, 3]`` (see the module docstring).

    Raises :class:`BadImage` for anything that is not a usable image."""
    if data is None:
        raise BadImage("missing", "no image in the record")
    if isinstance(data, (bytearray, memoryview)):
        data = bytes(data)
    if not isinstance(data, bytes):
        raise BadImage("not_an_image", f"a {type(data).__name__}, not image bytes")
    if not data:
        raise BadImage("empty", "zero bytes")
    fmt = sniff_format(data)
    if fmt is None:
        raise BadImage("not_an_image", f"{len(data)} bytes in no image format Zephon decodes (JPEG, PNG, WebP, "
                                       f"GIF, BMP), starting {data[:8]!r}")
    if fmt == "JPEG" and spec.jpeg_decoder == "simplejpeg":
        pixels = _decode_simplejpeg(data, spec)
        if pixels is not None:
            return pixels
    return _decode_pillow(data, fmt, spec)


def _check_pixels(height: int, width: int, spec: ImageSpec) -> None:
    if height <= 0 or width <= 0:
        raise BadImage("corrupt", f"the header says {width} x {height} pixels")
    if height * width > spec.max_image_pixels:
        raise BadImage("oversized", f"{width} x {height} = {height * width} pixels exceeds max_image_pixels = "
                                    f"{spec.max_image_pixels}")
    if spec.mode == "fit" and max(height, width) > MAX_ASPECT * min(height, width):
        raise BadImage("aspect_ratio", f"{width} x {height} pixels: a side ratio over {MAX_ASPECT} cannot be fitted "
                                       f"to the patch grid")


def _needed(height: int, width: int, orientation: int, spec: ImageSpec) -> tuple[int, int]:
    """The least stored-orientation size a reduced decode may give (the display size swaps for 5..8)."""
    shown = (width, height) if orientation >= 5 else (height, width)
    need_h, need_w = coverage_size(shown[0], shown[1], spec)
    return (need_w, need_h) if orientation >= 5 else (need_h, need_w)


def _decode_simplejpeg(data: bytes, spec: ImageSpec) -> np.ndarray | None:
    """libjpeg-turbo through simplejpeg; None for a colour space it cannot convert to RGB (CMYK, YCCK:
    Pillow decodes those; the choice depends on the header only)."""
    import simplejpeg

    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError as exc:
        raise BadImage("corrupt", f"unreadable JPEG header ({exc})") from None
    if colorspace in ("CMYK", "YCCK"):
        return None
    _check_pixels(height, width, spec)
    orientation = jpeg_orientation(data)
    s = 1
    if spec.reduced_decode:
        s = dct_scale(height, width, *_needed(height, width, orientation, spec))
    try:
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=False, fastupsample=False,
                                        min_height=-(-height // s), min_width=-(-width // s), min_factor=s,
                                        strict=True)
    except ValueError as exc:
        raise BadImage("corrupt", f"JPEG decoding failed ({exc})") from None
    if pixels.shape[:2] != (-(-height // s), -(-width // s)):  # libjpeg-turbo chose another scale
        raise AssertionError(f"simplejpeg decoded {pixels.shape} for {height} x {width} at 1/{s}")
    shown = (width, height) if orientation >= 5 else (height, width)
    return resize(orient(pixels, orientation), spec, *shown)


def _decode_pillow(data: bytes, fmt: str, spec: ImageSpec) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    # No ``with``: closing an image frees its pixels, which are used after the block; the bytes are in memory.
    try:
        im = Image.open(io.BytesIO(data), formats=[fmt])
        width, height = im.size
        _check_pixels(height, width, spec)
        orientation = im.getexif().get(_ORIENTATION_TAG, 1)
        orientation = orientation if isinstance(orientation, int) and 1 <= orientation <= 8 else 1
        if fmt == "JPEG" and spec.reduced_decode:
            need_h, need_w = _needed(height, width, orientation, spec)
            if dct_scale(height, width, need_h, need_w) > 1:
                im.draft("RGB", (need_w, need_h))  # the same 1/s: Pillow's rule is dct_scale's
        if im.mode == "RGB":
            im.load()  # convert("RGB") would copy an RGB image
        else:
            im = im.convert("RGB")
    except BadImage:
        raise
    except Image.DecompressionBombError as exc:
        raise BadImage("oversized", str(exc)) from None
    except UnidentifiedImageError:  # the bytes start like a {fmt} file, but its codec cannot open them
        raise BadImage("corrupt", f"a {fmt} signature, but no readable {fmt} header") from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, struct.error) as exc:
        raise BadImage("corrupt", f"{fmt} decoding failed ({type(exc).__name__}: {exc})") from None
    if orientation != 1:
        im = im.transpose(Image.Transpose[_TRANSPOSE[orientation]])
    th, tw = output_size(*((width, height) if orientation >= 5 else (height, width)), spec)
    w, h = im.size
    return np.asarray(im) if _whole(h, w, th, tw, spec) else _resample_to(im, spec, th, tw)


def resize(pixels: np.ndarray, spec: ImageSpec, height: int, width: int) -> np.ndarray:
    """``pixels`` (as displayed, perhaps decoded at 1/s) resized to :func:`output_size` of the image's
    displayed size ``height`` x ``width``: a reduced decode lands on the same size as a full one."""
    th, tw = output_size(height, width, spec)
    h, w = pixels.shape[:2]
    if _whole(h, w, th, tw, spec):
        return np.ascontiguousarray(pixels)
    from PIL import Image

    return _resample_to(Image.fromarray(np.ascontiguousarray(pixels)), spec, th, tw)


def _whole(h: int, w: int, th: int, tw: int, spec: ImageSpec) -> bool:
    """Whether an ``h x w`` image already is its ``th x tw`` output (no resampling, no crop)."""
    return (h, w) == (th, tw) and (spec.mode != "crop" or crop_box(h, w, th, tw) == (0.0, 0.0, float(w), float(h)))


def _resample_to(im: Any, spec: ImageSpec, th: int, tw: int) -> np.ndarray:
    """A Pillow RGB image (as displayed) in one resampling step to ``th x tw`` (centre-cropped in "crop"
    mode), straight to uint8 ``[th, tw, 3]``."""
    w, h = im.size
    box = crop_box(h, w, th, tw) if spec.mode == "crop" else (0.0, 0.0, float(w), float(h))
    return np.asarray(im.resize((tw, th), resample=_resample(spec.resample), box=box))

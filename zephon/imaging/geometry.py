"""Image sizes as pure arithmetic: Qwen2-VL's ``smart_resize``, the crop box, the DCT scale of a reduced decode."""

from __future__ import annotations

import math

from .spec import ImageSpec

_DCT_SCALES = (8, 4, 2, 1)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size: each side a multiple of ``factor``, the area within [min_pixels, max_pixels],
    the aspect ratio kept as closely as that allows (``transformers``' arithmetic, to the last rounding;
    the caller refuses aspect ratios over :data:`MAX_ASPECT` first, as ``transformers`` does)."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def output_size(height: int, width: int, spec: ImageSpec) -> tuple[int, int]:
    """The (height, width) an image of ``height`` x ``width`` (as displayed) is resized to."""
    if spec.mode == "crop":
        assert spec.size is not None
        return spec.size
    return smart_resize(height, width, spec.factor, spec.min_pixels, spec.max_pixels)


def coverage_size(height: int, width: int, spec: ImageSpec) -> tuple[int, int]:
    """The size the whole image is scaled to before any crop: what a reduced decode must not go below."""
    th, tw = output_size(height, width, spec)
    if spec.mode != "crop":
        return th, tw
    r = max(th / height, tw / width)
    return math.ceil(height * r), math.ceil(width * r)


def dct_scale(height: int, width: int, need_h: int, need_w: int) -> int:
    """The largest s in 8, 4, 2, 1 with ``height // s >= need_h`` and ``width // s >= need_w`` (Pillow's
    ``draft`` rule: decoding at 1/s still gives at least the needed size, so only a much smaller target
    is ever decoded reduced)."""
    limit = min(height // max(1, need_h), width // max(1, need_w))
    return next(s for s in _DCT_SCALES if s <= max(1, limit))


def crop_box(height: int, width: int, th: int, tw: int) -> tuple[float, float, float, float]:
    """The centred box of an image of ``height`` x ``width`` with the target's aspect ratio (Pillow's
    ``(left, upper, right, lower)``, sub-pixel)."""
    r = max(th / height, tw / width)
    cw, ch = min(float(width), tw / r), min(float(height), th / r)  # the full side, not one ulp past it
    return (width - cw) / 2, (height - ch) / 2, (width + cw) / 2, (height + ch) / 2

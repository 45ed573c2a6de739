"""What decides a decoded image's pixels (:class:`ImageSpec`), and why an image is refused (:class:`BadImage`)."""

from __future__ import annotations

from dataclasses import dataclass

# Why an image was skipped (the operators count ``skipped_images`` and ``skipped_images.<reason>``).
BAD_REASONS = ("missing", "empty", "not_an_image", "oversized", "aspect_ratio", "corrupt", "bad_path")
MAX_ASPECT = 200  # "fit" refuses longer/shorter side ratios above this (Qwen2-VL's limit)
JPEG_DECODERS = ("simplejpeg", "pillow")
RESAMPLE = ("bicubic", "bilinear", "lanczos", "box", "nearest")
DEFAULT_MAX_IMAGE_PIXELS = 1 << 26  # 67 Mpx (8192 x 8192): below Pillow's own 89 Mpx warning threshold


class BadImage(ValueError):
    """An image that cannot be used: ``reason`` is one of :data:`BAD_REASONS`, ``detail`` says why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class ImageSpec:
    """Everything that decides the pixels of a decoded image.

    ``mode`` "crop": scale so that the image covers ``size`` (height, width), centre crop to it (the
    shortest side to the target, as torchvision's Resize + CenterCrop, in one resampling step).
    ``mode`` "fit": keep the aspect ratio, round each side to a multiple of ``patch_size * merge`` and
    keep ``min_pixels <= H * W <= max_pixels`` (Qwen2-VL's ``smart_resize``, exactly).
    """

    mode: str = "fit"
    size: tuple[int, int] | None = None  # crop: (height, width)
    min_pixels: int = 56 * 56
    max_pixels: int = 448 * 448
    patch_size: int = 14
    merge: int = 1
    resample: str = "bicubic"
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    jpeg_decoder: str = "pillow"
    reduced_decode: bool = True  # DCT-scaled JPEG decoding when the target is at most half the size

    @property
    def factor(self) -> int:
        """Both sides of every output are multiples of this (a merge group, in pixels)."""
        return self.patch_size * self.merge

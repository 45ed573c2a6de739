"""Images as pure functions of (bytes, parameters): what decides the pixels (:mod:`.spec`), their sizes
(:mod:`.geometry`), decoding, orientation and resizing (:mod:`.decode`) and patches (:mod:`.patches`)."""

from .decode import decode_image, jpeg_orientation, orient, resize, sniff_format, tiff_orientation
from .geometry import coverage_size, crop_box, dct_scale, output_size, smart_resize
from .patches import patchify
from .spec import (BAD_REASONS, DEFAULT_MAX_IMAGE_PIXELS, JPEG_DECODERS, MAX_ASPECT, RESAMPLE, BadImage,
                   ImageSpec)

__all__ = ["BAD_REASONS", "DEFAULT_MAX_IMAGE_PIXELS", "JPEG_DECODERS", "MAX_ASPECT", "RESAMPLE", "BadImage",
           "ImageSpec", "coverage_size", "crop_box", "dct_scale", "decode_image", "jpeg_orientation", "orient",
           "output_size", "patchify", "resize", "smart_resize", "sniff_format", "tiff_orientation"]

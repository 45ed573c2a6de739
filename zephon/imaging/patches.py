"""Pixels as patches, in the order a vision encoder with a ``merge x merge`` patch merger reads them."""

from __future__ import annotations

import numpy as np


def patchify(pixels: np.ndarray, patch_size: int, merge: int = 1) -> np.ndarray:
    """``[H, W, C]`` pixels as ``[H/p * W/p, p*p*C]`` patches (each patch row-major, channels last).

    Patches are in row-major order of ``merge x merge`` groups, and row-major inside each group, so that
    the ``merge**2`` patches a model merges into one token are consecutive (Qwen2-VL's order). Both sides
    must be multiples of ``patch_size * merge``."""
    h, w, c = pixels.shape
    p, m = patch_size, merge
    if h % (p * m) or w % (p * m):
        raise ValueError(f"an image of {h} x {w} pixels is not a whole number of {p * m}-pixel merge groups")
    gh, gw = h // p, w // p
    grid = pixels.reshape(gh // m, m, p, gw // m, m, p, c).transpose(0, 3, 1, 4, 2, 5, 6)
    return np.ascontiguousarray(grid).reshape(gh * gw, p * p * c)

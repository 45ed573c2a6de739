#!/usr/bin/env python
"""CPU cost of one image through Zephon's decoders, against the peers' decode code, on one thread.

``zephon.imaging.decode_image`` (decode, EXIF orientation, RGB, one resampling step) with each JPEG
decoder, for the two targets of BENCHMARKS.md 8b and 8d: ``fit`` within 448 x 448 on the 28-pixel grid
and a 224 x 224 centre ``crop``. ``peers`` is the code every peer of ``vl_fetch_batch.py`` and
``vl_pipeline.py`` runs (``vl_common.decode_resize``: simplejpeg for JPEG, Pillow for the rest).
``--compare-src DIR`` also times ``DIR``'s ``zephon.imaging`` (another checkout, e.g. from ``git archive``)
in the same process, interleaved pass by pass, and checks that it gives the same pixels.

CPU seconds of the thread (``time.thread_time``) over ``--images`` images taken evenly from the corpus;
each pass times every path once, in turn; the median pass is reported.

    python scripts/bench/decode_paths.py --data /tmp/vl/full --images 600 --passes 5
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import apply_single_thread_env, fmt_table  # noqa: E402

apply_single_thread_env()

import numpy as np  # noqa: E402

import vl_common as vc  # noqa: E402

TARGETS = {"fit": {"max_pixels": 448 * 448, "merge": 2}, "crop": {"mode": "crop", "size": (224, 224)}}


def load_imaging(src: Path) -> ModuleType:
    """Another checkout's ``zephon.imaging`` as a module of its own, named ``imaging_compared``.

    Older checkouts have one file, ``zephon/imaging.py``; newer ones a package, ``zephon/imaging/``, whose
    modules import one another relatively and nothing else from Zephon, so either loads on its own.
    """
    root = src / "zephon" / "imaging"
    if (root / "__init__.py").is_file():
        spec = importlib.util.spec_from_file_location("imaging_compared", root / "__init__.py",
                                                      submodule_search_locations=[str(root)])
    else:
        spec = importlib.util.spec_from_file_location("imaging_compared", src / "zephon" / "imaging.py")
    if spec is None or spec.loader is None:
        raise SystemExit(f"--compare-src {src}: no zephon/imaging package or zephon/imaging.py there")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["imaging_compared"] = mod  # dataclasses and relative imports look their module up
    spec.loader.exec_module(mod)
    return mod


def paths(imaging: ModuleType, compared: ModuleType | None) -> dict[str, Callable[[bytes], np.ndarray]]:
    out: dict[str, Callable[[bytes], np.ndarray]] = {}
    for target, kw in TARGETS.items():
        peer_kw = {"crop": 224} if target == "crop" else {"max_pixels": 448 * 448}
        out[f"{target}, peers (vl_common.decode_resize)"] = lambda d, k=peer_kw: vc.decode_resize(d, **k)
        for decoder in ("pillow", "simplejpeg"):
            for label, mod in (("this checkout", imaging), ("compared", compared)):
                if mod is not None:
                    spec = mod.ImageSpec(**kw, jpeg_decoder=decoder)
                    out[f"{target}, zephon {decoder}, {label}"] = lambda d, m=mod, s=spec: m.decode_image(d, s)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="bench_data/vl")
    ap.add_argument("--images", type=int, default=600)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--compare-src", default="", help="a checkout whose zephon.imaging to time beside this one")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    from zephon import imaging

    compared = load_imaging(Path(args.compare_src)) if args.compare_src else None
    images = [img for _, img, _ in vc.iter_samples(Path(args.data))]
    images = images[::max(1, len(images) // args.images)][:args.images]
    fns = paths(imaging, compared)
    if compared is not None:  # the same pixels, or the comparison means nothing
        for target in TARGETS:
            for decoder in ("pillow", "simplejpeg"):
                a, b = fns[f"{target}, zephon {decoder}, this checkout"], fns[f"{target}, zephon {decoder}, compared"]
                if not all(np.array_equal(a(d), b(d)) for d in images):
                    raise SystemExit(f"{target}, {decoder}: the compared checkout gives other pixels")
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.passes):
        for name, fn in fns.items():
            t0 = time.thread_time()
            for d in images:
                fn(d)
            times[name].append((time.thread_time() - t0) / len(images) * 1e3)
    rows, result = [], {}
    for name, ms in times.items():
        med = statistics.median(ms)
        result[name] = {"ms_per_image": med, "passes": ms}
        rows.append([name, f"{med:.3f}", f"{min(ms):.3f}-{max(ms):.3f}", f"{1e3 / med:,.0f}"])
    print(f"# {len(images)} images, {args.passes} passes, CPU ms an image on one thread (median pass)"
          + (" - pixels of both checkouts equal" if compared is not None else ""))
    print(fmt_table(["path", "ms / image", "range", "images per CPU-s"], rows, "lrrr"))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

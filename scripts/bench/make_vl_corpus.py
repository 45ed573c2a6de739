#!/usr/bin/env python
"""Build the offline vision-language corpus: 20k+ image-caption pairs cropped from real pictures.

The pictures are those the installed packages ship (scikit-image, scikit-learn and matplotlib sample
pictures) and, when installed, the Debian desktop background packages under ``/usr/share/backgrounds``
(``apt-get install gnome-backgrounds mate-backgrounds lomiri-wallpapers`` gives 80+ photographs and
pictures of up to 5640 x 3172 pixels). Each sample is a crop of one picture, 200-600 pixels on its long
side, JPEG quality 60-95 (one in twenty a PNG), with a caption of real text (see zephon/demo/vl.py).

Written as ``DIR/wds/shard-NNNNNN.tar`` (WebDataset: ``<key>.jpg|png``, ``.txt``, ``.json``) and
``DIR/parquet/part-NNNNNN.parquet`` (the same samples: ``key``, ``image`` as a ``{bytes, path}`` struct,
``caption``, ``source``), ``DIR/interleaved/part-NNNN.parquet`` (documents of standard-library
paragraphs and images, ``texts`` / ``images`` lists) unless ``--docs 0``, and ``DIR/manifest.json``
(counts, sizes, pictures used, the SHA-256 of every file). Same installed packages, same output.
``--native`` also writes, from the same samples, each peer loader's native format into ``DIR/native/``
(Grain's ArrayRecord, LitData's ``optimize`` chunks, Mosaic Streaming's MDS shards) and the benchmark
tokenizers (scripts/bench/vl_common.py); ``--native-only`` does only that, for a corpus already built.

    python scripts/bench/make_vl_corpus.py --out bench_data/vl --samples 20000 --native
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from zephon.demo import vl as demo_vl  # noqa: E402
from zephon.demo.text import stdlib_documents  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--samples", type=int, default=20_000, help="image-caption pairs (default 20000)")
    ap.add_argument("--per-shard", type=int, default=1000, help="samples per WebDataset shard / Parquet file")
    ap.add_argument("--docs", type=int, default=2000, help="interleaved documents (0: none)")
    ap.add_argument("--seed", type=int, default=24)
    ap.add_argument("--max-side", type=int, default=1280, help="pictures are loaded at most this large")
    ap.add_argument("--no-debian", action="store_true", help="only the pip-installed packages' pictures")
    ap.add_argument("--native", action="store_true",
                    help="also write each peer's native format and the benchmark tokenizers into DIR/native/")
    ap.add_argument("--native-only", action="store_true", help="only (re)write DIR/native/ for an existing corpus")
    args = ap.parse_args(argv)
    out = Path(args.out)
    started = time.perf_counter()
    if args.native_only:
        return write_native(out)
    found = demo_vl.package_pictures() + ([] if args.no_debian else demo_vl.debian_pictures())
    loaded = demo_vl.usable_pictures(found, args.max_side)
    if len(loaded) < 2:
        print("no pictures found: install scikit-image (pip) or the Debian background packages", file=sys.stderr)
        return 1
    print(f"{len(loaded)} pictures ({sum(p.name.startswith('debian/') for p, _ in loaded)} from Debian packages), "
          f"loaded in {time.perf_counter() - started:.1f}s", flush=True)
    counts = demo_vl.write_corpus(demo_vl.make_samples(loaded, args.samples, args.seed), out, args.per_shard)
    print(f"{counts['samples']} samples in {counts['shards']} shards, {counts['bytes'] / 1e6:.1f} MB of images, "
          f"{time.perf_counter() - started:.1f}s", flush=True)
    used = 0
    if args.docs:
        paragraphs = [t for kind, _, t in stdlib_documents() if kind == "prose" and 80 <= len(t) <= 1200]
        used = demo_vl.write_interleaved(demo_vl.make_samples(loaded, 4 * args.docs, args.seed, start=1 << 30,
                                                              prefix="d"),
                                         paragraphs, out / "interleaved", args.docs, args.seed, files=8)
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest = {
        "samples": counts["samples"], "shards": counts["shards"], "image_bytes": counts["bytes"],
        "interleaved_documents": args.docs, "interleaved_images": used, "seed": args.seed,
        "pictures": sorted(p.name for p, _ in loaded),
        "files": {str(f.relative_to(out)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    print(f"wrote {out}/ in {time.perf_counter() - started:.1f}s")
    return write_native(out) if args.native else 0


def write_native(out: Path) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vl_common import write_native as write

    started = time.perf_counter()
    print(f"writing {out}/native/ (ArrayRecord, LitData, MDS, tokenizers) ...", flush=True)
    write(out, force=True, log=lambda m: print(m, flush=True))
    print(f"wrote {out}/native/ in {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""A production-shaped corpus: few, large Parquet files (by default 64 files of 256 MB of text each).

Real pre-training corpora are thousands of Parquet files of 0.5-2 GB of text; the benchmark corpus
(scripts/bench/make_corpus.py) is 16 files of ~10 MB, where a unit is a row group of a few MB. Here,
with at least as many files as lanes, a unit is a whole file, which is what makes a sentinel cadence
counted in units expensive to resume from. The documents are the benchmark corpus's own (real prose and
code), drawn with replacement by a seeded generator into each file, so the length distribution is the
benchmark's and the bytes are the same on every run; nothing is downloaded and nothing is committed.

    python scripts/bench/make_production_corpus.py --source bench_data --out prod_data --files 64 --mb 256

``OUT/recipe.toml`` is the benchmark recipe over these files (64 lanes, seq_len 2048, the benchmark's
tokenizer copied to ``OUT/tokenizer.json``); ``OUT/manifest.json`` records the files, rows and sizes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

RECIPE = """\
# Zephon recipe over the production-shaped corpus written by scripts/bench/make_production_corpus.py.
seed = 1234
lanes = {lanes}
seq_len = 2048
batch_per_lane = 1

[tokenizer]
kind = "huggingface"
path = "tokenizer.json"
eos_token = "<|endoftext|>"

[pack]
algorithm = "best_fit"

[[sources]]
name = "text"
path = "parquet"
format = "parquet"
text_field = "text"
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, default=Path("bench_data"), help="a corpus from make_corpus.py")
    ap.add_argument("--out", type=Path, default=Path("prod_data"))
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--mb", type=float, default=256, help="megabytes of text per file (UTF-8)")
    ap.add_argument("--row-group", type=int, default=16384, help="rows per row group")
    ap.add_argument("--lanes", type=int, default=64)
    ap.add_argument("--seed", type=int, default=20261201)
    args = ap.parse_args()
    files = sorted((args.source / "parquet").glob("*.parquet"))
    if not files:
        raise SystemExit(f"{args.source}/parquet holds no Parquet files: run scripts/bench/make_corpus.py first")
    texts = pa.concat_arrays([pq.read_table(f, columns=["text"]).column("text").combine_chunks() for f in files])
    sizes = pc.binary_length(texts).to_numpy(zero_copy_only=False).astype(np.int64)
    out = args.out / "parquet"
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(args.source / "tokenizer.json", args.out / "tokenizer.json")
    (args.out / "recipe.toml").write_text(RECIPE.format(lanes=args.lanes), encoding="utf-8")
    rng = np.random.default_rng(args.seed)
    target = int(args.mb * 1e6)
    manifest, t0 = [], time.perf_counter()
    print(f"{len(texts):,} source documents ({sizes.sum() / 1e6:.0f} MB, mean {sizes.mean():.0f} bytes) -> "
          f"{args.files} files of {args.mb:g} MB of text", flush=True)
    for i in range(args.files):
        path = out / f"part-{i:05d}.parquet"
        # enough draws to pass the target, then cut at the first document that reaches it
        n = int(target / sizes.mean() * 1.1) + 1024
        idx = rng.integers(0, len(texts), n)
        cum = np.cumsum(sizes[idx])
        idx = idx[: int(np.searchsorted(cum, target)) + 1]
        table = pa.table({"text": texts.take(pa.array(idx)), "id": pa.array(np.arange(len(idx)) + i * 10**8)})
        pq.write_table(table, path, row_group_size=args.row_group, compression="zstd")
        manifest.append({"file": path.name, "rows": len(idx), "text_bytes": int(sizes[idx].sum()),
                         "file_bytes": path.stat().st_size})
        print(f"  {path.name}: {len(idx):,} rows, {manifest[-1]['text_bytes'] / 1e6:.0f} MB of text, "
              f"{manifest[-1]['file_bytes'] / 1e6:.0f} MB on disk ({time.perf_counter() - t0:.0f}s)", flush=True)
    (args.out / "manifest.json").write_text(json.dumps({"files": manifest, "seed": args.seed}, indent=1))
    total = sum(m["text_bytes"] for m in manifest)
    print(f"done: {total / 1e9:.1f} GB of text in {args.files} files, {time.perf_counter() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

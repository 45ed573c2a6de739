#!/usr/bin/env python
"""WebDataset shard indexes: what a lane's first visit to a shard costs.

A WebDataset source plans a lane's work by shard; a shard's index (its members' offsets, grouped into
samples) is built the first time a process needs it, from the tar headers alone, unless a sidecar cache
holds it (``read.webdataset(..., index_cache=...)``). With at least as many shards as lanes (every large
corpus) that happens while the run is going, on the trainer's thread, once per shard: in a one-epoch run,
once per sample's shard. Two measurements:

- *scan*: CPU per shard of building the index (``zephon.readers.webdataset.scan_members`` and
  ``group_samples``), against Python's own ``tarfile`` listing the same shard (``getmembers()``);
- *first pass*: the fetch-and-batch pipeline of ``vl_fetch_batch.py`` (image bytes + caption, batches of
  256, inline) with 8 lanes, so that shards are visited while it runs: samples/s over the batches that
  first visit the shards (indexes cold) and over later batches (indexes cached), in a fresh process per
  round.

    python scripts/bench/shard_index.py --data /tmp/vl/full --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vl_common as vc  # noqa: E402

LANES, PER_LANE = 8, 32  # 20 shards >= 8 lanes: whole shards as units, each indexed when a lane reaches it
COLD, WARM = 70, 200  # batches: 70 x 256 samples visit most of a 20-shard corpus; then 200 more after 200


def scan(paths: list[str]) -> dict[str, float]:
    import fsspec

    from zephon.readers.webdataset import group_samples, scan_members

    fs = fsspec.filesystem("file")
    out = {}
    t = time.thread_time()
    for p in paths:
        size = fs.size(p)
        with fs.open(p, "rb") as f:
            group_samples(scan_members(f, size, p), size, p)
    out["zephon_ms_per_shard"] = (time.thread_time() - t) / len(paths) * 1e3
    t = time.thread_time()
    for p in paths:
        with tarfile.open(p) as tf:
            tf.getmembers()
    out["tarfile_ms_per_shard"] = (time.thread_time() - t) / len(paths) * 1e3
    return out


def first_pass(data: Path) -> dict[str, float]:
    import zephon as z

    loader = (z.Pipeline(seed=1234, lanes=LANES)
              .source("pairs", z.read.webdataset(vc.shards(data), columns=["image=jpg;png", "txt"]))
              .batch(rows_per_lane=PER_LANE)).build(rank=0, world_size=1, num_workers=0)
    it = iter(loader)
    try:
        next(it)  # start-up (planning) is not timed
        t = time.perf_counter()
        for _ in range(COLD):
            next(it)
        cold = COLD * LANES * PER_LANE / (time.perf_counter() - t)
        for _ in range(WARM):
            next(it)
        t = time.perf_counter()
        for _ in range(WARM):
            next(it)
        warm = WARM * LANES * PER_LANE / (time.perf_counter() - t)
    finally:
        loader.close()
    return {"cold_samples_per_s": cold, "warm_samples_per_s": warm}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="bench_data/vl")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", choices=("scan", "pass"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    data = Path(args.data)
    if args.child:
        res = scan([str(p) for p in vc.shards(data)]) if args.child == "scan" else first_pass(data)
        print(" ".join(f"{k}={v:.3f}" for k, v in res.items()))
        return 0
    rows: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for child in ("scan", "pass"):  # a fresh process each: no index cached from before
            out = subprocess.run([sys.executable, __file__, "--data", str(data), "--child", child],
                                 capture_output=True, text=True, check=True).stdout.split()
            for kv in out:
                k, v = kv.split("=")
                rows.setdefault(k, []).append(float(v))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:,.1f}" for k, v in rows.items()), flush=True)
    print(f"\n{len(vc.shards(data))} shards; median over {args.rounds} rounds [min-max]:")
    for k, v in rows.items():
        print(f"  {k:24s} {statistics.median(v):>10,.1f} [{min(v):,.1f}-{max(v):,.1f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())

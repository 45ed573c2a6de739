#!/usr/bin/env python
"""How long a trainer whose model is the slower side waits in ``next(loader)``, step by step.

The model's step is simulated by ``time.sleep(step_ms)`` on the trainer's thread, which lets go of the
GIL as a CUDA synchronisation does, so the loader's threads and processes work meanwhile. The pipeline is
BENCHMARKS.md 8b's (decode, resize, patchify, tokenize, best-fit pack into rows of 4096 tokens, 8 lanes);
with 2 workers it delivers ~650 images/s here, and the simulated model takes ~100 images per 400 ms step
(~250 images/s), so on average the loader has time to spare. A packing lane takes its documents in bursts
(after a sentinel it refills every open row), and the question is whether those bursts reach the trainer.

  zephon_2_thread_ahead0   thread runner, 2 workers, steps_ahead=0: the lanes' own work (merge, pack,
                           waiting for the workers) runs when the trainer asks, on its thread
  zephon_2_thread          the default: the lanes run up to 2 steps ahead on a background thread
  zephon_2_thread_ahead4   the same, 4 steps ahead
  zephon_2_process_ahead0  whole lanes on 2 worker processes, 4 steps ahead there (prefetch), steps_ahead=0:
                           the trainer's thread reads each step's rows back and collates them when it asks
  zephon_2_process         the default: the same, with a background thread reading back and collating
                           up to 2 steps ahead

Reported per configuration: the time of each ``next()`` after the warm-up (median, 90th and 99th
percentile, max), their sum as a share of the wall time (what the loader adds to the step), and the
SHA-256 of every batch: all configurations must deliver the same batches.

    python scripts/bench/trainer_stalls.py --data /tmp/vl/full --rounds 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

CONFIGS = {
    "zephon_2_thread_ahead0": {"num_workers": 2, "runner": "thread", "steps_ahead": 0},
    "zephon_2_thread": {"num_workers": 2, "runner": "thread"},
    "zephon_2_thread_ahead4": {"num_workers": 2, "runner": "thread", "steps_ahead": 4},
    "zephon_2_process_ahead0": {"num_workers": 2, "runner": "process", "steps_ahead": 0},
    "zephon_2_process": {"num_workers": 2, "runner": "process"},
}


def one(name: str, data: Path, step_ms: float, warmup: int, steps: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import vl_pipeline

    loader = vl_pipeline.zephon_pipeline(data).build(rank=0, world_size=1, **CONFIGS[name])
    digest = hashlib.sha256()
    waits = []
    try:
        for step in range(warmup + steps):
            t = time.perf_counter()
            batch = next(loader)
            took = time.perf_counter() - t
            for key in sorted(batch):
                value = batch[key]
                digest.update(key.encode())
                digest.update(value.numpy().tobytes() if hasattr(value, "numpy") else repr(value).encode())
            if step == warmup:
                start = t
            if step >= warmup:
                waits.append(took)
            time.sleep(step_ms / 1000)
        wall = time.perf_counter() - start
    finally:
        loader.close()
    w = np.asarray(waits) * 1000
    return {"config": name, "median_ms": float(np.median(w)), "p90_ms": float(np.percentile(w, 90)),
            "p99_ms": float(np.percentile(w, 99)), "max_ms": float(w.max()), "loader_share": float(w.sum() / 1000 / wall),
            "steps": steps, "sha256": digest.hexdigest()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="the corpus of make_vl_corpus.py")
    ap.add_argument("--step-ms", type=float, default=400.0, help="the simulated model's step")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated configuration names")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.data, args.step_ms, args.warmup, args.steps)))
        return
    names = [n for n in CONFIGS if not args.only or n in args.only.split(",")]
    results = []
    for r in range(args.rounds):
        for name in names:  # a fresh process per configuration and round, interleaved
            out = subprocess.run([sys.executable, __file__, "--one", name, "--data", str(args.data), "--step-ms",
                                  str(args.step_ms), "--warmup", str(args.warmup), "--steps", str(args.steps)],
                                 check=True, capture_output=True, text=True).stdout
            res = {**json.loads(out.strip().splitlines()[-1]), "round": r + 1}
            results.append(res)
            print(f"round {r + 1} {name:24s} next(): median {res['median_ms']:7.1f} ms  p90 {res['p90_ms']:7.1f}  "
                  f"p99 {res['p99_ms']:7.1f}  max {res['max_ms']:7.1f}  share of wall {res['loader_share']:.3f}  "
                  f"sha256 {res['sha256'][:12]}", flush=True)
    if len({res["sha256"] for res in results}) != 1:
        raise SystemExit("configurations delivered different batches")
    print(f"every configuration delivered the same {args.warmup + args.steps} batches")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""The trainer thread's cost per batch against how deep the training loop's own stack is.

CPython 3.11-3.12 unmaps a 16 KiB frame-stack chunk as soon as its first frame returns, so a call made many
times per batch that lands first in a chunk maps and unmaps one each time (``zephon/engine/frame_stack.py``).
Whether that happens depends on the caller's depth, which a benchmark never varies. This script does: it
builds the text loader once (``bench_data``, 2 thread workers by default), then, for each padding depth
0, STEP, ..., it calls ``next()`` ``--batches`` times from under that many extra Python frames and reports
the trainer thread's minor page faults and CPU per batch (``/proc/self/task/<tid>/stat``: 10 ms ticks, so
the CPU column is coarse; the faults are exact).

    python scripts/bench/stack_depth.py --data bench_data --depths 0:200:4 --json stack_depth.json
    mkdir -p /tmp/zbefore && git archive 1fbd667 zephon | tar -x -C /tmp/zbefore   # before the fix
    python scripts/bench/stack_depth.py --data bench_data --depths 0:200:4 --zephon-src /tmp/zbefore
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _thread_stat() -> tuple[int, float]:
    """The calling (main) thread's minor faults and CPU seconds."""
    fields = Path(f"/proc/self/task/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _padded(depth: int, fn, *args):
    return _padded(depth - 1, fn, *args) if depth else fn(*args)


def _window(it, batches: int) -> tuple[int, float]:
    faults, cpu = _thread_stat()
    for _ in range(batches):
        next(it)
    faults2, cpu2 = _thread_stat()
    return faults2 - faults, cpu2 - cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="bench_data")
    ap.add_argument("--depths", default="0:200:4", help="START:STOP:STEP extra frames under next()")
    ap.add_argument("--batches", type=int, default=30, help="batches per depth")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--algorithm", default="best_fit")
    ap.add_argument("--flush-by", default="units", choices=("units", "chunks"),
                    help="the sentinel cadence, passed to both sides of a before/after alike (a --zephon-src checkout "
                         "must be one that has flush_by)")
    ap.add_argument("--zephon-src", default="", help="a checkout whose zephon/ to measure instead of this one")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if args.zephon_src:
        sys.path.insert(0, str(Path(args.zephon_src).resolve()))
    sys.path.insert(0, str(HERE))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import _pipelines
    from _common import machine_info, require_data

    data = Path(args.data).resolve()
    require_data(data)
    start, stop, step = (int(x) for x in args.depths.split(":"))
    it, close, _ = _pipelines.BUILDERS["zephon"](data, 32, 2048, workers=args.workers, runner="thread",
                                                 algorithm=args.algorithm, flush_by=args.flush_by)
    rows = []
    try:
        for _ in range(10):  # warm-up: workers started, first row groups read
            next(it)
        t0 = time.perf_counter()
        for depth in range(start, stop, step):
            faults, cpu = _padded(depth, _window, it, args.batches)
            rows.append({"depth": depth, "faults_per_batch": faults / args.batches,
                         "cpu_ms_per_batch": 1e3 * cpu / args.batches})
    finally:
        close()
    worst = max(rows, key=lambda r: r["faults_per_batch"])
    cpus = sorted(r["cpu_ms_per_batch"] for r in rows)
    print(f"# {len(rows)} depths x {args.batches} batches in {time.perf_counter() - t0:.0f} s; "
          f"zephon from {args.zephon_src or 'this checkout'}")
    print(" ".join(f"{r['depth']}:{r['faults_per_batch']:.0f}" for r in rows) + "   (depth:faults per batch)")
    print(f"faults per batch: median {sorted(r['faults_per_batch'] for r in rows)[len(rows) // 2]:.0f}, "
          f"worst {worst['faults_per_batch']:.0f} (depth {worst['depth']}); trainer CPU ms per batch: "
          f"median {cpus[len(cpus) // 2]:.1f}, worst {cpus[-1]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The trainer's share: CPU time per batch on the thread that iterates the loader.

With thread workers, everything stateful (mixing, packing) and the collation into the batch dict runs
on the thread that calls ``next(loader)``: the training loop's own thread. That work competes for the
cores with the tokenizing workers (at 2 workers on 2 cores every millisecond of it is a millisecond
less of tokenization) and with the trainer itself. This script measures it directly: ``time.thread_time``
of the calling thread around ``next()``, per batch, for each configuration. With lane processes the
calling thread only receives the rows and collates them.

  zephon_ALGO_W_RUNNER   Zephon on the benchmark recipe (bench_data/recipe.toml), [32, 2048] batches

Reported per configuration (median of ``--repeats`` windows of ``--steps`` batches, after ``--warmup``):
the calling thread's CPU ms per batch, that as a share of one core (CPU / wall), and tokens/s.
``--zephon-src DIR`` measures the Zephon found in DIR instead (e.g. a ``git worktree`` of an older
commit), for before/after figures with the same script:

    python scripts/bench/trainer_thread.py --data bench_data --json trainer_thread.json
    git worktree add /tmp/zephon-old OLD_COMMIT
    python scripts/bench/trainer_thread.py --data bench_data --zephon-src /tmp/zephon-old

``--flush-by units`` runs this checkout with the sentinel cadence of checkouts from before ``flush_by``
existed, so that both make the same batches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_zephon_bench_args, fmt_table, machine_info, run_task, task_main, zephon_bench_inputs, zephon_src_first,
)

SCRIPT = Path(__file__).resolve()
BATCH, SEQ = 32, 2048


def configs() -> list[dict[str, Any]]:
    out = []
    for alg in ("best_fit", "wrap"):
        out.append({"name": f"zephon_{alg}_0_inline", "algorithm": alg, "workers": 0, "runner": "thread"})
        for w in (1, 2):
            for runner in ("thread", "process"):
                out.append({"name": f"zephon_{alg}_{w}_{runner}", "algorithm": alg, "workers": w, "runner": runner})
    return out


def _measure(task: dict[str, Any]) -> dict[str, Any]:
    zephon_src_first()
    import zephon
    from _pipelines import build_zephon

    c = task["config"]
    it, close, _ = build_zephon(Path(task["data"]), BATCH, SEQ, workers=c["workers"], runner=c["runner"],
                                algorithm=c["algorithm"], flush_by=task.get("flush_by") or None)
    it = iter(it)
    windows = []
    try:
        for _ in range(task["warmup"]):
            next(it)
        for _ in range(task["repeats"]):
            cpu0, wall0 = time.thread_time(), time.perf_counter()
            for _ in range(task["steps"]):
                next(it)
            cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
            windows.append({"cpu_ms_per_batch": 1e3 * cpu / task["steps"], "core_share": cpu / wall,
                            "tokens_per_s": task["steps"] * BATCH * SEQ / wall})
    finally:
        close()
    med = {k: statistics.median(w[k] for w in windows) for k in windows[0]}
    return {**med, "windows": windows, "zephon_file": zephon.__file__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_zephon_bench_args(ap, timeout=600.0)
    ap.add_argument("--steps", type=int, default=60, help="batches per timed window")
    ap.add_argument("--warmup", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--flush-by", default="", choices=["", "units", "chunks"],
                    help="the sentinel cadence (units: the batches of a checkout from before flush_by existed, "
                         "which refuses the option itself: leave it out for such a --zephon-src)")
    args = ap.parse_args(argv)
    cfgs, data, src = zephon_bench_inputs(args, configs())
    print(f"# trainer thread: CPU per [{BATCH}, {SEQ}] batch on the thread calling next(loader); {args.warmup} "
          f"warm-up batches, then median of {args.repeats} windows x {args.steps}; one subprocess per configuration")
    print(f"# machine: {machine_info()}", flush=True)
    results: dict[str, Any] = {}
    for c in cfgs:
        task = {"kind": "measure", "config": c, "data": str(data), "steps": args.steps, "warmup": args.warmup,
                "repeats": args.repeats, "zephon_src": src, "flush_by": args.flush_by}
        print(f"  {c['name']:<26}", end=" ", flush=True)
        r = run_task(SCRIPT, task, timeout=args.timeout)
        results[c["name"]] = {**c, **r}
        print(f"{r['cpu_ms_per_batch']:6.2f} ms/batch  ({r['zephon_file']})" if r.get("ok")
              else f"FAILED: {r.get('error')}", flush=True)
    rows = [[n, r["workers"], r["runner"], f"{r['cpu_ms_per_batch']:.2f}", f"{r['core_share']:.3f}",
             f"{r['tokens_per_s'] / 1e3:,.0f}"] if r.get("ok") else [n, r["workers"], r["runner"], "FAILED", "", ""]
            for n, r in results.items()]
    print()
    print(fmt_table(["config", "workers", "runner", "trainer CPU ms/batch", "share of a core", "k tok/s"], rows,
                    align="lrlrrr"))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    failed = [n for n, r in results.items() if not r.get("ok")]
    return 2 if failed else 0


if __name__ == "__main__":
    code = task_main({"measure": _measure})
    sys.exit(main() if code is None else code)

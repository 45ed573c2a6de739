#!/usr/bin/env python
"""Time to first batch, as a trainer sees it: right after building the loader, after the trainer's own
set-up, and for a second loader in the same process.

A trainer builds its loader, then its model, optimizer and checkpoint, then asks for the first batch;
after a resume or for an evaluation loader it builds another loader in the same process. With worker
processes, what a worker must import before its first chunk (zephon, and through torchdata, torch)
adds to the first batch unless it happened during that set-up or in an earlier loader. This script
measures the three cases, in one subprocess per configuration and round:

  immediate      build_loader, then next() at once (what 1b's "first batch" column measures)
  after setup    build_loader, ``--setup`` seconds of other work (a sleep), then next()
  second loader  after the first loader is closed, a new one built and next() at once

Each figure is seconds from ``build_loader`` to the first batch, not counting the set-up sleep; the
main module imports torch and zephon at its top, as a training script does (the fair baseline for
the old code: where a forkserver preloads the main module, a worker would find those imports). Median over ``--rounds`` interleaved rounds.

    python scripts/bench/startup.py --data bench_data --rounds 3 --json bench_results/startup.json
    python scripts/bench/startup.py --data bench_data --zephon-src /tmp/zephon-old   # another checkout
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

zephon_src_first()  # a measured child: --zephon-src must win before zephon is imported below
# As in a training script, torch and zephon are imported at the top of the main module: where the
# forkserver preloads the main module (not on 3.11, CPython gh-126631), workers would find them there.
import torch  # noqa: E402,F401
import zephon  # noqa: E402

SCRIPT = Path(__file__).resolve()
BATCH, SEQ = 32, 2048
CASES = ("immediate", "after_setup", "second_loader")


def configs() -> list[dict[str, Any]]:
    out = [{"name": "zephon_0_inline", "workers": 0, "runner": "thread"}]
    for w in (1, 2):
        for runner in ("thread", "pool", "process"):
            out.append({"name": f"zephon_{w}_{runner}", "workers": w, "runner": runner})
    return out


def _measure(task: dict[str, Any]) -> dict[str, Any]:
    from _pipelines import build_zephon

    c = task["config"]

    def first_batch(setup: float) -> float:
        t0 = time.perf_counter()
        it, close, _ = build_zephon(Path(task["data"]), BATCH, SEQ, workers=c["workers"], runner=c["runner"])
        time.sleep(setup)
        next(it)
        took = time.perf_counter() - t0 - setup
        close()
        return took

    case = task["case"]
    if case == "immediate":
        return {"s": first_batch(0.0), "zephon_file": zephon.__file__}
    if case == "after_setup":
        return {"s": first_batch(task["setup"]), "zephon_file": zephon.__file__}
    first_batch(0.0)
    return {"s": first_batch(0.0), "zephon_file": zephon.__file__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_zephon_bench_args(ap, timeout=300.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--setup", type=float, default=5.0, help="seconds of trainer set-up between build and next()")
    args = ap.parse_args(argv)
    cfgs, data, src = zephon_bench_inputs(args, configs())
    print(f"# time to first batch ([{BATCH}, {SEQ}]): immediate / after {args.setup:g} s of set-up / second loader; "
          f"median of {args.rounds} rounds, one subprocess per configuration, case and round")
    print(f"# machine: {machine_info()}", flush=True)
    seconds: dict[str, dict[str, list[float]]] = {c["name"]: {k: [] for k in CASES} for c in cfgs}
    failed: list[str] = []
    for r in range(args.rounds):
        for c in cfgs:
            for case in CASES:
                task = {"kind": "measure", "config": c, "case": case, "data": str(data), "setup": args.setup,
                        "zephon_src": src}
                res = run_task(SCRIPT, task, timeout=args.timeout)
                if res.get("ok"):
                    seconds[c["name"]][case].append(res["s"])
                else:
                    failed.append(f"{c['name']} {case} round {r}: {res.get('error')}")
                    print(f"  FAILED {failed[-1]}", flush=True)
        print(f"  round {r + 1}/{args.rounds} done", flush=True)
    rows = []
    for c in cfgs:
        s = seconds[c["name"]]
        rows.append([c["name"], c["workers"], c["runner"]] +
                    [f"{statistics.median(s[k]):.2f} ({min(s[k]):.1f}-{max(s[k]):.1f})" if s[k] else "FAILED"
                     for k in CASES])
    print()
    print(fmt_table(["config", "workers", "runner", "immediate s", f"after {args.setup:g} s set-up s",
                     "second loader s"], rows, align="lrlrrr"))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "machine": machine_info(), "seconds": seconds,
                                               "failed": failed}, indent=1))
    return 2 if failed else 0


if __name__ == "__main__":
    code = task_main({"measure": _measure})
    sys.exit(main() if code is None else code)

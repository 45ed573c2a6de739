#!/usr/bin/env python
"""Sentinel cadence trade-off: flush every K chunks (K = 1..64) against flush every 8 units.

A lane injects a flush sentinel every ``flush_every`` completed chunks (``flush_by = "chunks"``) or units
(``"units"``: files, row groups or byte ranges). A resume replays each lane from its last sentinel, so
the cadence bounds the replay; each sentinel also empties the packer (wrapping its open rows, which cuts
documents) and the shuffle buffer (whose window is one segment). For each cadence, on the benchmark
corpus's recipe (32 lanes x 1 row x 2048 tokens, best_fit, 2 thread workers), this script measures:

  replay rows      rows a lane re-makes and skips on a resume, at every step of the run and every lane
                   (``rows_since_flush`` of the lane states): mean, 95th percentile, max; x 2048 tokens
  flush pad        padding caused by sentinels, share of delivered tokens (``flush_pad_fraction``)
  cut at flushes   documents cut by a sentinel's wrap, per 1,000 documents delivered: a delivered segment
                   whose last label is not -100 continues in another row; the splitter's pieces are whole
                   rows of 2048 tokens, a sentinel's cuts are shorter
  docs/segment     documents between two sentinels of a lane: a shuffle buffer's effective window is
                   min(buffer, this)
  first batch      seconds from build_loader (+ load_state_dict) to the first batch, fresh and resumed
                   from the states at several steps, each in its own subprocess, median over rounds;
                   and the CPU seconds of that process (all its threads) meanwhile

    python scripts/bench/cadence.py --data bench_data --steps 800 --rounds 3 --json bench_results/cadence.json
    python scripts/bench/cadence.py --data prod_data --world-size 8 --steps 400 --json bench_results/cadence_prod.json

``--world-size 8``: rank 0 of 8 is measured (its lanes alone; a rank's plan needs no other rank).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from _common import fmt_table, machine_info, require_data, run_task, task_main  # noqa: E402

SCRIPT = Path(__file__).resolve()
KS = (1, 2, 4, 8, 16, 32, 64)
WORKERS, RUNNER = 2, "thread"


def cadences(ks: list[int]) -> list[dict[str, Any]]:
    return [{"name": "units_8", "flush_by": "units", "flush_every": 8}] + \
        [{"name": f"chunks_{k}", "flush_by": "chunks", "flush_every": k} for k in ks]


def _recipe(data: Path, cfg: dict[str, Any]):
    from _pipelines import zephon_recipe

    return zephon_recipe(data, flush_by=cfg["flush_by"], flush_every=cfg["flush_every"])


def _cuts(batch: dict, seq_len: int) -> tuple[int, int]:
    """(segments cut by a sentinel, documents ended) in one batch (see the module docstring)."""
    seg = batch["segment_ids"].numpy()
    labels = batch["labels"].numpy()
    nxt = np.concatenate([seg[:, 1:], np.zeros((seg.shape[0], 1), seg.dtype)], axis=1)
    end = (seg != 0) & (nxt != seg)  # a segment's last position
    rows, cols = np.nonzero(end)
    lengths = np.array([int((seg[r] == seg[r, c]).sum()) for r, c in zip(rows, cols)], dtype=np.int64)
    continues = labels[rows, cols] != -100
    return int((continues & (lengths < seq_len)).sum()), int((~continues).sum())


def _counts(task: dict[str, Any]) -> dict[str, Any]:
    """Run ``steps`` steps of one cadence; the replay, padding, cut and segment figures, and the states."""
    import zephon

    data, cfg, steps = Path(task["data"]), task["config"], task["steps"]
    recipe = _recipe(data, cfg)
    loader = zephon.build_loader(recipe, rank=0, world_size=task["world_size"], num_workers=WORKERS, runner=RUNNER)
    replay, cut, ended, states = [], 0, 0, {}
    save_at = set(task["save_at"])
    for step, batch in enumerate(loader, 1):
        c, e = _cuts(batch, recipe.seq_len)
        cut, ended = cut + c, ended + e
        state = loader.state_dict()
        replay.extend(lane["rows_since_flush"] for lane in state["lanes"].values())
        if step in save_at:
            states[step] = state
        if step >= steps:
            break
    m = loader.metrics()
    loader.close()
    r = np.array(replay)
    for step, state in states.items():
        Path(task["states"], f"{cfg['name']}_{step}.json").write_text(json.dumps(state))
    return {"replay_mean": float(r.mean()), "replay_p95": float(np.percentile(r, 95)), "replay_max": int(r.max()),
            "flush_pad": m["flush_pad_fraction"], "pad": m["pad_fraction"], "cut": cut, "docs": ended,
            "docs_per_segment": m["docs"] / max(1, m["flushes"]), "flushes": m["flushes"], "units": m["units"],
            "state_bytes": len(json.dumps(states[max(states)]).encode()) if states else None}


def _first_batch(task: dict[str, Any]) -> dict[str, Any]:
    """Seconds from build_loader (and load_state_dict, when resuming) to the first batch."""
    import zephon

    recipe = _recipe(Path(task["data"]), task["config"])
    state = json.loads(Path(task["state"]).read_text()) if task.get("state") else None
    t0, c0 = time.perf_counter(), time.process_time()
    loader = zephon.build_loader(recipe, rank=0, world_size=task["world_size"], num_workers=WORKERS, runner=RUNNER)
    if state is not None:
        loader.load_state_dict(state)
    next(iter(loader))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    loader.close()
    return {"seconds": seconds, "cpu": cpu}


def main() -> int:
    code = task_main({"counts": _counts, "first_batch": _first_batch})
    if code is not None:
        return code
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("bench_data"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--ks", default=",".join(map(str, KS)))
    ap.add_argument("--resume-at", default="50,100,200", help="steps whose states are resumed from")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--world-size", type=int, default=1, help="measure rank 0 of this many ranks")
    ap.add_argument("--first-batch-timeout", type=float, default=600)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    require_data(args.data)
    cfgs = cadences([int(k) for k in args.ks.split(",")])
    resume_at = [int(s) for s in args.resume_at.split(",") if int(s) <= args.steps]
    print(f"# cadence: {args.data}/recipe.toml, rank 0 of {args.world_size}, {args.steps} steps, {WORKERS} {RUNNER} workers; "
          f"resumes from steps {resume_at}, {args.rounds} rounds", flush=True)
    results: dict[str, Any] = {"machine": machine_info(), "data": str(args.data), "world_size": args.world_size,
                               "steps": args.steps, "resume_at": resume_at, "configs": {}}
    with tempfile.TemporaryDirectory(prefix="zephon-cadence-") as states:
        for cfg in cfgs:
            r = run_task(SCRIPT, {"kind": "counts", "data": str(args.data), "config": cfg, "steps": args.steps,
                                  "save_at": resume_at, "states": states, "world_size": args.world_size},
                         timeout=3600)
            if not r.get("ok"):
                raise SystemExit(f"{cfg['name']}: {r.get('error')}")
            results["configs"][cfg["name"]] = {"config": cfg, **{k: r[k] for k in (
                "replay_mean", "replay_p95", "replay_max", "flush_pad", "pad", "cut", "docs", "docs_per_segment",
                "flushes", "units", "state_bytes")}, "fresh": [], "resumed": {str(s): [] for s in resume_at},
                "fresh_cpu": [], "resumed_cpu": {str(s): [] for s in resume_at}}
            print(f"  {cfg['name']}: counted in {r['wall_s']:.0f}s", flush=True)
        for rnd in range(args.rounds):  # interleaved: every configuration once per round
            for cfg in cfgs:
                row = results["configs"][cfg["name"]]
                for step in [None, *resume_at]:
                    task = {"kind": "first_batch", "data": str(args.data), "config": cfg, "world_size": args.world_size,
                            "state": str(Path(states, f"{cfg['name']}_{step}.json")) if step else None}
                    r = run_task(SCRIPT, task, timeout=args.first_batch_timeout)
                    if not r.get("ok") and "timed out" not in str(r.get("error")):
                        raise SystemExit(f"{cfg['name']} first batch (resume at {step}): {r.get('error')}")
                    seconds = r["seconds"] if r.get("ok") else float("inf")  # inf: past the timeout
                    cpu = r["cpu"] if r.get("ok") else float("inf")
                    (row["fresh"] if step is None else row["resumed"][str(step)]).append(seconds)
                    (row["fresh_cpu"] if step is None else row["resumed_cpu"][str(step)]).append(cpu)
            print(f"  round {rnd + 1}/{args.rounds} done", flush=True)
    print(report(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def report(results: dict[str, Any]) -> str:
    seq = 2048
    headers = ["cadence", "replay rows mean / p95 / max", "replay tokens max", "flush pad", "cut / 1k docs",
               "docs / segment", "fresh first batch s", "resumed s (worst step)", "resumed / fresh",
               "CPU s fresh / resumed (worst)"]
    rows = []
    for name, c in results["configs"].items():
        fresh = statistics.median(c["fresh"]) if c["fresh"] else float("nan")
        resumed = {s: statistics.median(v) for s, v in c["resumed"].items() if v}
        worst = max(resumed.items(), key=lambda kv: kv[1]) if resumed else ("-", float("nan"))
        rows.append([name.replace("_", " "), f"{c['replay_mean']:.1f} / {c['replay_p95']:.0f} / {c['replay_max']}",
                     f"{c['replay_max'] * seq:,}", f"{c['flush_pad']:.4%}", f"{1000 * c['cut'] / max(1, c['docs']):.2f}",
                     f"{c['docs_per_segment']:.0f}", f"{fresh:.2f}", f"{worst[1]:.2f} (step {worst[0]})",
                     f"{worst[1] / fresh:.2f}", _cpu(c)])
    return fmt_table(headers, rows)


def _cpu(c: dict[str, Any]) -> str:
    """CPU seconds of the process (every thread) to the first batch: fresh, and resumed at the worst step
    (less sensitive than wall time to other work on the machine)."""
    if not c.get("fresh_cpu"):
        return "-"
    resumed = [statistics.median(v) for v in c.get("resumed_cpu", {}).values() if v]
    return f"{statistics.median(c['fresh_cpu']):.2f} / {max(resumed):.2f}" if resumed else "-"


if __name__ == "__main__":
    sys.exit(main())

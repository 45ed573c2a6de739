#!/usr/bin/env python
"""Zephon scaling: lanes and world size, resume cost vs flush_every, and memory.

Three studies (``all`` runs them in turn), each measurement in its own subprocess (peak RSS of the
process tree, sampled every 0.1 s, as in text_pipeline.py), on the corpus of make_corpus.py:

lanes    time to build the loader, time to its first batch, and steady tokens/s of rank 0, for
         lanes 8, 32, 128, 256, with world size 1 (rank 0 owns every lane) and world size lanes/8 (rank 0
         owns 8 lanes, as in a run on lanes/8 GPUs); plus peak RSS (memory vs lanes). tokens/s counts the
         rank's batch numel; rank 0 of world size W delivers 1/W of the global batch per step.
resume   for flush_every 1, 4, 8, 16: one continuous run saving ``state_dict()`` every --save-every steps;
         then for each saved state a fresh loader, ``load_state_dict``, and the time to its first batch,
         checked against the continuous run's next batch (SHA-256). Also the padding the flush sentinels
         cost (``loader.metrics()['flush_pad_fraction']``). Flushes happen every flush_every *units* per
         lane, and a unit is a whole file when a source has at least as many files as lanes (else a row
         group): with the corpus's 16 files of 1000-row row groups a unit is ~130-1100 rows of a lane, so
         this study uses a copy of the corpus re-written as 4 files with --resume-row-group rows per row
         group (default 64: a unit is ~8 rows of a lane) so that flushes happen within a short run.
memory   peak RSS vs workers (0/1/2, thread/process) and vs seq_len (512, 2048, 8192) at 32 lanes, and a
         run --long-factor (10) times longer than the base run with RSS sampled along it, to check that
         memory stays bounded.

    python scripts/bench/scaling.py all --data bench_data
    python scripts/bench/scaling.py lanes --lanes 8,32 --steps 4 --warmup 2      # quick look
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
    derived_is_current, fmt_table, machine_info, mark_derived, measure_stream, require_data, run_task, task_main,
)

SCRIPT = Path(__file__).resolve()


# -- child -------------------------------------------------------------------------------------------
def _recipe(task: dict[str, Any]):
    import zephon

    recipe = zephon.load_recipe(task["recipe"])
    changes = {k: task[k] for k in ("lanes", "seq_len", "flush_every", "cache_bytes") if task.get(k) is not None}
    return recipe.replace(**changes) if changes else recipe


def child_throughput(task: dict[str, Any]) -> dict[str, Any]:
    """Build time, time to first batch and steady tokens/s of one rank."""
    import zephon

    recipe = _recipe(task)
    ws, workers, runner = task["world_size"], task["workers"], task["runner"]
    build_s: list[float] = []
    holder: dict[str, Any] = {}

    def make():
        t = time.perf_counter()
        loader = zephon.build_loader(recipe, rank=0, world_size=ws, num_workers=workers, runner=runner)
        build_s.append(time.perf_counter() - t)
        holder["loader"] = loader
        return iter(loader), loader.close

    lanes_per_rank = recipe.lanes // ws
    tokens_per_batch = lanes_per_rank * recipe.batch_per_lane * recipe.seq_len

    def after_window(run: int) -> dict:
        m = holder["loader"].metrics()
        return {k: m[k] for k in ("pad_fraction", "flush_pad_fraction") if k in m}

    res = measure_stream(make, task["steps"], task["warmup"], task["repeats"], tokens_per_batch,
                         after_window=after_window)
    res["build_s"] = build_s[0]
    res["lanes_per_rank"] = lanes_per_rank
    res["tokens_per_batch"] = tokens_per_batch
    return res


def child_resume(task: dict[str, Any]) -> dict[str, Any]:
    """Continuous run with periodic state_dict(); then resume from each state and time its first batch."""
    import zephon

    recipe = _recipe(task)
    workers, runner, steps, every = task["workers"], task["runner"], task["steps"], task["save_every"]
    t = time.perf_counter()
    loader = zephon.build_loader(recipe, rank=0, world_size=1, num_workers=workers, runner=runner)
    it = iter(loader)
    digests, states = [], {}
    first_s = None
    for step in range(1, steps + 1):
        b = next(it)
        if first_s is None:
            first_s = time.perf_counter() - t
        digests.append(zephon.batch_digest(b))
        if step % every == 0 and step < steps:
            states[step] = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint would store it
    m = loader.metrics()
    loader.close()
    resumes = []
    for step, state in states.items():
        replay = [v.get("rows_since_flush") for v in state.get("lanes", {}).values() if isinstance(v, dict)]
        t = time.perf_counter()
        lo = zephon.build_loader(recipe, rank=0, world_size=1, num_workers=workers, runner=runner)
        lo.load_state_dict(state)
        b = next(iter(lo))
        dt = time.perf_counter() - t
        ok = zephon.batch_digest(b) == digests[step]  # the continuous run's batch number step+1
        lo.close()
        resumes.append({"step": step, "first_batch_s": dt, "matches": ok,
                        "rows_since_flush_mean": statistics.mean(replay) if replay and None not in replay else None})
    return {"fresh_first_batch_s": first_s, "resumes": resumes,
            "pad_fraction": m.get("pad_fraction"), "flush_pad_fraction": m.get("flush_pad_fraction"),
            "flushes": m.get("flushes"), "units": m.get("units")}


def child_memory(task: dict[str, Any]) -> dict[str, Any]:
    """Run ``steps`` batches (after the first); only the parent's RSS sampling matters."""
    import zephon

    recipe = _recipe(task)
    t = time.perf_counter()
    loader = zephon.build_loader(recipe, rank=0, world_size=task["world_size"], num_workers=task["workers"],
                                 runner=task["runner"])
    import psutil

    me = psutil.Process()

    def tree_mb() -> float:
        total = 0
        for p in [me] + me.children(recursive=True):
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return round(total / 2**20, 1)

    it = iter(loader)
    next(it)
    first = time.perf_counter() - t
    marks = [(0, round(first, 2), tree_mb())]
    for i in range(task["steps"]):
        next(it)
        if (i + 1) % max(1, task["steps"] // 10) == 0:
            marks.append((i + 1, round(time.perf_counter() - t, 2), tree_mb()))
    loader.close()
    return {"first_batch_s": first, "seconds": time.perf_counter() - t, "marks": marks}


# -- parent ------------------------------------------------------------------------------------------
def study_lanes(args, recipe_path: Path) -> list[dict]:
    print(f"\n## lanes and world size: workers={args.workers} runner={args.runner}; {args.warmup} warm-up "
          f"batches then {args.repeats} window(s) x {args.steps} batches (rank 0)", flush=True)
    out = []
    for lanes in [int(x) for x in args.lanes.split(",")]:
        for ws in sorted({1, max(1, lanes // 8)}):
            task = {"kind": "throughput", "recipe": str(recipe_path), "lanes": lanes, "world_size": ws,
                    "workers": args.workers, "runner": args.runner, "steps": args.steps, "warmup": args.warmup,
                    "repeats": args.repeats}
            print(f"  lanes {lanes:>4} world size {ws:>3}:", end=" ", flush=True)
            r = run_task(SCRIPT, task, timeout=args.timeout)
            r.update(lanes=lanes, world_size=ws)
            out.append(r)
            print(f"first batch {r['first_batch_s']:.1f}s, {r['tokens_per_s'] / 1e3:.0f}k tok/s, "
                  f"peak RSS {r['peak_rss_mb']:.0f} MB" if r.get("ok") else f"FAILED: {r.get('error')}", flush=True)
    rows = []
    for r in out:
        if r.get("ok"):
            rows.append([r["lanes"], r["world_size"], r["lanes_per_rank"], f"{r['build_s']:.2f}",
                         f"{r['first_batch_s']:.1f}", f"{r['tokens_per_s'] / 1e3:,.0f}",
                         f"{r['tokens_per_s_incl_startup'] / 1e3:,.0f}", f"{r['peak_rss_mb']:,.0f}", ""])
        else:
            rows.append([r["lanes"], r["world_size"], "", "", "", "", "", f"{r['peak_rss_mb']:,.0f}",
                         (r.get("error") or "")[:90]])
    print()
    print(fmt_table(["lanes", "world size", "lanes/rank", "build s", "1st batch s", "k tok/s (rank 0)",
                     "k tok/s incl. startup", "peak RSS MB", "error"], rows, align="rrrrrrrrl"))
    return out


RESUME_FILES = 4  # fewer files than lanes: Zephon's units are then row groups, not whole files


def resume_corpus(data: Path, rows: int) -> Path:
    """The corpus re-written as 4 files with ``rows`` rows per row group, so that Zephon's units (row
    groups, since there are fewer files than lanes) and hence flushes come every few rows of a lane."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = data / f"resume_rg{rows}"
    if not (out / "recipe.toml").exists() or not derived_is_current(out, data):
        (out / "parquet").mkdir(parents=True, exist_ok=True)
        for old in (out / "parquet").glob("*.parquet"):
            old.unlink()
        files = sorted((data / "parquet").glob("*.parquet"))
        for k in range(RESUME_FILES):
            table = pa.concat_tables([pq.read_table(f, columns=["text"]) for f in files[k::RESUME_FILES]])
            pq.write_table(table, out / "parquet" / f"part-{k:04d}.parquet", row_group_size=rows,
                           compression="zstd")
        text = (data / "recipe.toml").read_text().replace('path = "tokenizer.json"',
                                                         f'path = "{(data / "tokenizer.json").resolve()}"')
        (out / "recipe.toml").write_text(text)
        mark_derived(out, data)
    return out / "recipe.toml"


def study_resume(args, data: Path) -> list[dict]:
    recipe_path = resume_corpus(data, args.resume_row_group)
    print(f"\n## resume cost vs flush_every: corpus re-written with {args.resume_row_group} rows per row group, "
          f"lanes {args.resume_lanes}, world size 1, workers={args.resume_workers}; {args.resume_steps} steps, "
          f"state saved every {args.save_every}", flush=True)
    out = []
    for fe in [int(x) for x in args.flush_every.split(",")]:
        task = {"kind": "resume", "recipe": str(recipe_path), "lanes": args.resume_lanes, "flush_every": fe,
                "workers": args.resume_workers, "runner": args.runner, "steps": args.resume_steps,
                "save_every": args.save_every}
        print(f"  flush_every {fe:>2}:", end=" ", flush=True)
        r = run_task(SCRIPT, task, timeout=args.timeout)
        r["flush_every"] = fe
        out.append(r)
        if r.get("ok"):
            ts = [x["first_batch_s"] for x in r["resumes"]]
            print(f"resume first batch mean {statistics.mean(ts):.2f}s max {max(ts):.2f}s; fresh "
                  f"{r['fresh_first_batch_s']:.2f}s; flush padding {100 * (r['flush_pad_fraction'] or 0):.2f}%",
                  flush=True)
        else:
            print(f"FAILED: {r.get('error')}", flush=True)
    rows = []
    for r in out:
        if not r.get("ok"):
            rows.append([r["flush_every"], "FAILED", "", "", "", "", "", "", (r.get("error") or "")[:80]])
            continue
        ts = [x["first_batch_s"] for x in r["resumes"]]
        rep = [x["rows_since_flush_mean"] for x in r["resumes"] if x["rows_since_flush_mean"] is not None]
        ok = all(x["matches"] for x in r["resumes"])
        rows.append([r["flush_every"], f"{r['fresh_first_batch_s']:.2f}", f"{statistics.mean(ts):.2f}",
                     f"{max(ts):.2f}", f"{statistics.mean(rep):.1f}" if rep else "?",
                     f"{100 * (r['flush_pad_fraction'] or 0):.2f}", f"{100 * (r['pad_fraction'] or 0):.2f}",
                     r.get("flushes"), "yes" if ok else "NO (resumed batch differs)"])
    print()
    print(fmt_table(["flush_every", "fresh 1st batch s", "resume 1st batch s (mean)", "(max)",
                     "rows replayed/lane (mean)", "flush pad %", "pad % (all)", "flushes",
                     "resumed batch = continuous"],
                    rows, align="rrrrrrrrl"))
    return out


def study_memory(args, recipe_path: Path) -> list[dict]:
    print(f"\n## memory: peak RSS of the process tree (lanes 32, world size 1, {args.mem_steps} batches after "
          f"the first unless stated)", flush=True)
    groups = set(args.mem_runs.split(","))
    runs: list[tuple[str, dict]] = []
    for w in (0, 1, 2) if "workers" in groups else ():
        for rn in (("thread",) if w == 0 else ("thread", "process")):
            runs.append((f"workers {w} {rn if w else 'inline'}", {"workers": w, "runner": rn}))
    for sl in (512, 2048, 8192) if "seq_len" in groups else ():
        runs.append((f"seq_len {sl} (workers {args.workers} {args.runner})",
                     {"workers": args.workers, "runner": args.runner, "seq_len": sl}))
    if "long" in groups:
        n_long = args.mem_steps * args.long_factor
        runs.append((f"{args.long_factor}x longer run ({n_long} batches, workers {args.workers} {args.runner})",
                     {"workers": args.workers, "runner": args.runner, "steps": n_long, "long": True}))
    out = []
    for label, p in runs:
        task = {"kind": "memory", "recipe": str(recipe_path), "world_size": 1, "steps": args.mem_steps,
                "cache_bytes": args.cache_bytes, **p}
        print(f"  {label:<48}", end=" ", flush=True)
        r = run_task(SCRIPT, task, timeout=args.timeout)
        r["label"] = label
        r["long"] = p.get("long", False)
        out.append(r)
        print(f"peak RSS {r['peak_rss_mb']:,.0f} MB ({r['max_processes']} processes)" if r.get("ok")
              else f"FAILED: {r.get('error')}", flush=True)
    rows = []
    for r in out:
        tl = [mb for _, mb in r["rss_timeline"]]
        quarters = [max(tl[int(len(tl) * a):max(int(len(tl) * a) + 1, int(len(tl) * b))]) if tl else 0
                    for a, b in ((0, .25), (.25, .5), (.5, .75), (.75, 1))]
        rows.append([r["label"], "ok" if r.get("ok") else "FAILED", f"{r['peak_rss_mb']:,.0f}",
                     f"{r['peak_pss_mb']:,.0f}", f"{r['peak_main_rss_mb']:,.0f}", r["max_processes"],
                     " / ".join(f"{q:,.0f}" for q in quarters), (r.get("error") or "")[:60]])
    print()
    print(fmt_table(["run", "", "peak RSS MB (tree)", "peak PSS MB (tree)", "main process MB", "processes",
                     "max RSS MB per quarter of the run", "error"], rows, align="llrrrrll"))
    long = [r for r in out if r["long"] and r.get("ok")]
    base = [r for r in out if r.get("ok") and r["label"].startswith(f"seq_len {2048} (workers {args.workers} "
                                                                     f"{args.runner})")]
    if long:
        marks = long[0]["marks"]  # (step, seconds, RSS of the process tree in MB) at every tenth of the run
        print("\nlong run, RSS of the process tree (MB) at every tenth of the run: "
              + ", ".join(f"{s}:{mb:,.0f}" for s, _, mb in marks))
        if len(marks) >= 6:
            early = max(mb for _, _, mb in marks[1:len(marks) // 2])
            late = max(mb for _, _, mb in marks[len(marks) // 2:])
            verdict = "bounded" if late <= 1.10 * early else "GROWING"
            print(f"long run: max {early:,.0f} MB over its first half (after the first batch), {late:,.0f} MB over "
                  f"its second half -> {verdict} (over +10% is flagged GROWING)")
        if base:
            print(f"peak RSS: {base[0]['peak_rss_mb']:,.0f} MB for {args.mem_steps} batches, "
                  f"{long[0]['peak_rss_mb']:,.0f} MB for {args.mem_steps * args.long_factor} batches")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("study", choices=["lanes", "resume", "memory", "all"])
    ap.add_argument("--data", default="bench_data")
    ap.add_argument("--workers", type=int, default=2, help="loader workers for the lanes/memory studies")
    ap.add_argument("--runner", default="thread", choices=["thread", "process"])
    ap.add_argument("--lanes", default="8,32,128,256")
    ap.add_argument("--steps", type=int, default=32, help="lanes study: timed batches per window")
    ap.add_argument("--warmup", type=int, default=64,
                    help="lanes study: untimed batches (each lane starts with ~32-64 rows of backlog)")
    ap.add_argument("--repeats", type=int, default=1, help="lanes study: timed windows (median)")
    ap.add_argument("--flush-every", default="1,4,8,16")
    ap.add_argument("--resume-row-group", type=int, default=64)
    ap.add_argument("--resume-lanes", type=int, default=8)
    ap.add_argument("--resume-workers", type=int, default=0)
    ap.add_argument("--resume-steps", type=int, default=160)
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--mem-steps", type=int, default=40, help="memory study: batches per run")
    ap.add_argument("--long-factor", type=int, default=10)
    ap.add_argument("--cache-bytes", type=int, default=None,
                    help="memory study: read.cache_bytes (decoded row groups kept per process; default: the recipe's)")
    ap.add_argument("--mem-runs", default="workers,seq_len,long", help="memory study: which groups to run")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    data = Path(args.data).resolve()
    require_data(data)
    recipe_path = data / "recipe.toml"
    print(f"# zephon scaling on {data}; machine: {machine_info()}", flush=True)
    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    if args.study in ("lanes", "all"):
        results["lanes"] = study_lanes(args, recipe_path)
    if args.study in ("resume", "all"):
        results["resume"] = study_resume(args, data)
    if args.study in ("memory", "all"):
        results["memory"] = study_memory(args, recipe_path)
    print(f"\ntotal {time.perf_counter() - t0:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    failed = [r for rs in results.values() for r in rs if not r.get("ok")]
    bad_resume = [r for r in results.get("resume", []) if r.get("ok") and not all(x["matches"] for x in r["resumes"])]
    return 1 if bad_resume else (2 if failed else 0)


if __name__ == "__main__":
    task_main({"throughput": child_throughput, "resume": child_resume, "memory": child_memory})
    sys.exit(main())

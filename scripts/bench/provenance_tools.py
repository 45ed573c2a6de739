#!/usr/bin/env python
"""What the provenance tools cost: ``zephon.trace``, ``zephon.locate`` and ``zephon.diff`` on the benchmark corpus.

On ``DIR/recipe.toml`` (32 lanes, rows of 2048 tokens, one row per lane and step, best fit):

  trace_S_start       ``trace(pipe, step=S, rows=[0])`` from the start: lane 0 replays S + 1 steps
  trace_S_state       the same from lane 0's state saved at step S - 100 (a checkpoint): 101 steps
  locate              ``locate`` of the first record of that row: the record's chunk operator by operator,
                      then the lane that reads it, run until the record is delivered
  diff_N              ``diff`` of the recipe against itself with another seed, N steps (every lane of both)
  loader_N            the loader itself for N steps (every lane), for scale
  collate             one step's rows collated without and with the provenance tensor (CPU ms of the
                      thread, median of 20 interleaved rounds over 8 steps): what it adds to a batch

Wall seconds (``time.perf_counter``) of one call each, ``--workers`` workers (threads); the per-1,000-step
figure of a trace is its seconds / (steps replayed) * 1000. Every trace is checked against the loader's own
batch at that step (the same rows and tokens).

    python scripts/bench/provenance_tools.py --data bench_data --steps 99,999 --workers 0
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fmt_table, machine_info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="bench_data")
    ap.add_argument("--steps", default="99,999", help="comma-separated steps to trace")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--diff-steps", type=int, default=20)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    import numpy as np

    import zephon as z
    from zephon.loader import ZephonLoader

    pipe = z.load_recipe(Path(args.data) / "recipe.toml").to_pipeline()
    rows, result = [], {}
    for step in (int(s) for s in args.steps.split(",")):
        t0 = time.perf_counter()
        segs = z.trace(pipe, step=step, rows=[0], num_workers=args.workers)
        took = time.perf_counter() - t0
        rows.append([f"trace_{step}_start", step + 1, f"{took:.2f}", f"{took / (step + 1) * 1000:.1f}"])
        result[f"trace_{step}_start"] = {"steps": step + 1, "seconds": took}
        start = max(0, step - 100)
        with ZephonLoader(pipe.replace(provenance=True), 0, 1, lanes=range(1)) as lane0:  # a checkpoint of lane 0
            lane0._advance(start)
            state = json.loads(json.dumps(lane0.state_dict()))
            lane0._advance(step - start)
            check = next(iter(lane0))
        t0 = time.perf_counter()
        again = z.trace(pipe, step=step, rows=[0], state=state, num_workers=args.workers)
        took = time.perf_counter() - t0
        replayed = step - start + 1
        rows.append([f"trace_{step}_state", replayed, f"{took:.2f}", f"{took / replayed * 1000:.1f}"])
        result[f"trace_{step}_state"] = {"steps": replayed, "seconds": took}
        assert [(s.row, s.record, s.tokens) for s in segs] == [(s.row, s.record, s.tokens) for s in again]
        ids = np.concatenate([s.token_ids for s in segs])
        assert np.array_equal(check["input_ids"][0][:len(ids)].numpy(), ids), "trace disagrees with the loader"
    first = segs[0]
    for passes in range(1, 9):  # the traced step may be in a later pass over the source
        t0 = time.perf_counter()
        where = z.locate(pipe, first.source, first.file, first.record, passes=passes, num_workers=args.workers)
        took = time.perf_counter() - t0
        if any(x.step == first.step and x.row == 0 for x in where):
            break
    else:
        raise AssertionError("locate did not find the traced record where trace saw it")
    rows.append([f"locate ({passes} pass(es))", where.landings[-1].step + 1, f"{took:.2f}", f"{took / (where.landings[-1].step + 1) * 1000:.1f}"])
    result["locate"] = {"steps": where.landings[-1].step + 1, "seconds": took}
    n = args.diff_steps
    t0 = time.perf_counter()
    report = z.diff(pipe, pipe.replace(seed=pipe.seed + 1), n, num_workers=args.workers)
    took = time.perf_counter() - t0
    rows.append([f"diff_{n} (2 x 32 lanes)", n, f"{took:.2f}", f"{took / n * 1000:.1f}"])
    result[f"diff_{n}"] = {"steps": n, "seconds": took, "first_step": report.first_step}
    t0 = time.perf_counter()
    with z.build_loader(pipe, 0, 1, num_workers=args.workers) as loader:
        for _ in itertools.islice(loader, n):
            pass
    took = time.perf_counter() - t0
    rows.append([f"loader_{n} (32 lanes)", n, f"{took:.2f}", f"{took / n * 1000:.1f}"])
    result[f"loader_{n}"] = {"steps": n, "seconds": took}
    # the provenance tensor's own cost: the same step's rows collated with and without it, interleaved
    with z.build_loader(pipe.replace(provenance=True), 0, 1) as loader:
        loader._advance(8)
        steps = [loader._prepare_step()[0] for _ in range(8)]
        program = loader.program
        cost = {True: [], False: []}
        for _ in range(20):
            for on in (False, True):
                program.provenance = on
                t0 = time.thread_time()
                for step_rows in steps:
                    loader._collate(step_rows)
                cost[on].append((time.thread_time() - t0) / len(steps))
        program.provenance = True
    segments = sum(len(r.seg_lens) for r in steps[0])
    off, on = (sorted(cost[k])[len(cost[k]) // 2] * 1e3 for k in (False, True))
    rows.append([f"collate without / with provenance ({segments} segments)", 8, f"{off:.2f} / {on:.2f} ms",
                 f"+{on - off:.2f} ms a batch"])
    result["collate_ms"] = {"without": off, "with": on, "segments": segments}
    print(f"# {args.data}: 32 lanes, [32, 2048] batches, {args.workers} workers")
    print(fmt_table(["call", "steps run", "seconds", "s per 1,000 steps"], rows, "lrrr"))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "args": vars(args), "results": result},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The Ray runners against threads and the process pool on the text pipeline, their per-task overhead, and
a scaling model (how many CPU nodes feed how many GPUs) built from the measured costs.

Everything runs on this machine against a real local Ray head (``ray start --head --num-cpus N`` on
127.0.0.1, started and stopped by the script, :class:`zephon.engine.ray_local.LocalRayCluster`), so Ray's
workers share the cores with the trainer exactly as the pool's processes do.

  tokenizer        the whole stateless stage (read, decode, tokenize: ``StageProgram.run`` inline, as a
                   Ray worker runs it) on one thread, in tokens per CPU second and tokens per task; for a
                   text recipe also its tokenizer alone (encode calls of one chunk's documents)
  overhead_K_W     a no-op task (an empty unit: no read, no transform; a ~1 KB result) on executor kind K
                   (thread, process, ray) with W workers: the sequential round trip (latency), the
                   pipelined rate with 64 tasks in flight, the trainer's CPU per task and, for Ray, the
                   CPU per task of the whole local cluster (raylet, GCS, workers)
  actor_rtt        a no-op Ray actor call, sequential: the ``ray-lanes`` runner's per-step message cost
  RUNNER_W         build_loader(recipe, num_workers=W, runner=RUNNER): tokens/s of delivered batches over
                   ``--steps`` batches after ``--warmup``, the trainer process's CPU per batch, and the CPU
                   of everything (trainer tree + the Ray head's tree) per batch
  scaling model    GPUs fed by one CPU node of C cores at 16,900 tokens/s per GPU, from the stage's tokens
                   per CPU second and Ray's CPU per task (see ``scaling``), and the rank's share of a core

Protocol: every measurement runs in its own subprocess (scripts/bench/_common.run_task, single-threaded
tokenizer environment); the loader configurations run in ``--rounds`` interleaved rounds (every
configuration once per round, the order rotated from round to round) and the median round is reported
with the range. Every configuration's warm-up batches are hashed (zephon.batch_digest) and must agree
(exit 1 otherwise). The machine's load average is recorded before and after.

    python scripts/bench/ray_bench.py --rounds 3 --json ray_bench.json     # bench_data/ if built, else the quickstart
    python scripts/bench/ray_bench.py --recipe recipes/quickstart.toml     # after `zephon demo recipes`
    python scripts/bench/ray_bench.py --recipe DEMO/vl_quickstart.toml     # images: a copy next to `zephon demo DEMO`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, fmt_table, machine_info, run_task, task_main

GPU_TOKENS_PER_S = 16_900  # usable tokens/s per GPU of the original system's test model
RUNNERS = ("thread", "pool", "ray", "ray-lanes")
NODE_CORES = (16, 32, 64, 96)


# -- child side ------------------------------------------------------------------------------------------
def _tree_cpu(*pids: int | None) -> dict[int, float]:
    """User + system CPU seconds of each process of the trees rooted at ``pids``, by pid."""
    import psutil

    out: dict[int, float] = {}
    for pid in pids:
        if not pid:
            continue
        try:
            root = psutil.Process(pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except psutil.Error:
                pass
    return out


def _cpu_between(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two :func:`_tree_cpu` samples by the processes alive at the second (a
    process that exited in between is not counted: a slight under-count, never a negative)."""
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())


def _ray_options(task: dict) -> dict:
    return {"address": task["address"]} if task.get("address") else {}


def task_stream(task: dict) -> dict:
    import zephon

    recipe = zephon.load_recipe(task["recipe"])
    t0 = time.perf_counter()
    loader = zephon.build_loader(recipe, rank=0, world_size=1, num_workers=task["workers"], runner=task["runner"],
                                 **_ray_options(task))
    try:
        batch = next(loader)
        first = time.perf_counter() - t0
        tokens_per_batch = int(batch["input_ids"].numel())
        digests = [zephon.batch_digest(batch)]
        digests += [zephon.batch_digest(next(loader)) for _ in range(task["warmup"] - 1)]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        all0 = _tree_cpu(os.getpid(), task.get("head_pid"))
        for _ in range(task["steps"]):
            next(loader)
        wall = time.perf_counter() - wall0
        cpu = time.process_time() - cpu0
        all_cpu = _cpu_between(all0, _tree_cpu(os.getpid(), task.get("head_pid")))
    finally:
        loader.close()
    return {"tokens_per_s": task["steps"] * tokens_per_batch / wall, "first_batch_s": first,
            "tokens_per_batch": tokens_per_batch,
            "trainer_cpu_ms_per_batch": 1e3 * cpu / task["steps"],
            "all_cpu_ms_per_batch": 1e3 * all_cpu / task["steps"], "digests": digests}


def _noop_task(program: Any) -> Any:
    """A task that reads nothing and transforms nothing: an empty unit of source 0."""
    from zephon.plan import ChunkTask

    return ChunkTask(source=0, path="", start=0, end=0, unit_seq=0, unit_end=True, empty=True)


def task_overhead(task: dict) -> dict:
    import zephon
    from zephon.engine.runners import make_executor
    from zephon.recipe import as_pipeline

    program = as_pipeline(zephon.load_recipe(task["recipe"])).compile()
    opts = _ray_options(task) if task["executor"] == "ray" else {}
    executor = make_executor(task["executor"], program.stages, task["workers"], **opts)
    item = _noop_task(program)
    try:
        for _ in range(20):  # warm: workers started, programs set up
            executor.submit(0, 0, item).result()
        lat = []
        for _ in range(task["n_seq"]):
            t = time.perf_counter()
            executor.submit(0, 0, item).result()
            lat.append(time.perf_counter() - t)
        n, window = task["n_tput"], task["in_flight"]
        cluster0 = _tree_cpu(task.get("head_pid")) if task["executor"] == "ray" else {}
        cpu0, t0 = time.process_time(), time.perf_counter()
        pending = [executor.submit(0, 0, item) for _ in range(window)]
        done = 0
        while done < n:
            pending.pop(0).result()
            done += 1
            if done + len(pending) < n:
                pending.append(executor.submit(0, 0, item))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        cluster = _cpu_between(cluster0, _tree_cpu(task.get("head_pid"))) if task["executor"] == "ray" else 0.0
    finally:
        executor.close()
    lat.sort()
    return {"latency_us_median": 1e6 * statistics.median(lat), "latency_us_p90": 1e6 * lat[int(0.9 * len(lat))],
            "tasks_per_s": n / wall, "trainer_cpu_us_per_task": 1e6 * cpu / n,
            "cluster_cpu_us_per_task": 1e6 * cluster / n}


def task_actor_rtt(task: dict) -> dict:
    import ray

    from zephon.engine.ray_executor import RayOptions, connect

    connect(RayOptions.make(task["address"]))

    class Echo:
        def ping(self, x: int) -> int:
            return x

    actor = ray.remote(num_cpus=1)(Echo).remote()
    ray.get(actor.ping.remote(0), timeout=120)
    lat = []
    for i in range(task["n_seq"]):
        t = time.perf_counter()
        ray.get(actor.ping.remote(i), timeout=60)
        lat.append(time.perf_counter() - t)
    ray.kill(actor)
    return {"latency_us_median": 1e6 * statistics.median(lat)}


def task_tokenizer(task: dict) -> dict:
    """Tokens per CPU second on one thread: the whole stateless stage (read, decode, tokenize:
    ``StageProgram.run`` inline, as a Ray worker runs it) and, for a text recipe, its tokenizer alone."""
    import zephon
    from zephon.recipe import as_pipeline

    recipe = zephon.load_recipe(task["recipe"])
    program = as_pipeline(recipe).compile()
    stages = program.stages
    stages.setup()
    tasks = []
    for s, _ in enumerate(program.names):
        it = program.plan.sources[s].chunk_tasks(0, 0, -1, 0)
        tasks += [next(it) for _ in range(task["chunks"])]
    for t in tasks[:2]:  # warm: files opened, caches filled
        stages.run(t.source, 0, t)
    cpu0, n = time.process_time(), 0
    for t in tasks:
        item = t
        for k in range(stages.n_stages(t.source)):
            item = stages.run(t.source, k, item)
        n += len(item.token_fields.get("input_ids", ()))
    out = {"stage_tokens_per_cpu_s": n / (time.process_time() - cpu0), "tokens_per_chunk": n / len(tasks)}
    spec = getattr(recipe, "tokenizer", None)
    if spec is not None and getattr(spec, "path", None):
        from zephon.tokenization import load_tokenizer

        texts = []
        for t in tasks:
            col = stages.read(t.source, t).columns
            texts.append([x for x in next(iter(col.values()), []) if isinstance(x, str)])
        tok = load_tokenizer(spec)
        tok.encode(texts[0])
        cpu0, n = time.process_time(), 0
        for batch in texts:
            n += len(tok.encode(batch)[0])
        out["tokenizer_tokens_per_cpu_s"] = n / (time.process_time() - cpu0)
    return out


# -- parent side -----------------------------------------------------------------------------------------
def default_recipe() -> Path:
    bench = REPO / "bench_data" / "recipe.toml"
    return bench if bench.exists() else REPO / "recipes" / "quickstart.toml"


def run(args: argparse.Namespace) -> int:
    from zephon.engine.ray_local import LocalRayCluster

    recipe = Path(args.recipe or default_recipe()).resolve()
    if not recipe.exists() or (recipe.name == "quickstart.toml" and not (recipe.parent / "data").exists()):
        raise SystemExit(f"no corpus for {recipe}: run `zephon demo recipes` first (or pass --recipe)")
    me = Path(__file__).resolve()
    out: dict[str, Any] = {"recipe": str(recipe), "machine": machine_info(), "load_before": os.getloadavg(),
                           "args": vars(args)}
    print(f"recipe {recipe}; load average {os.getloadavg()}", flush=True)
    with LocalRayCluster(num_cpus=args.ray_cpus, object_store_mb=512) as head:
        out["ray_head_start_s"] = head.started_in_s
        print(f"Ray head at {head.address} (num_cpus={args.ray_cpus}), started in {head.started_in_s:.1f} s", flush=True)
        base = {"recipe": str(recipe), "address": head.address, "head_pid": head.proc.pid}
        time.sleep(5)  # past the head's own start-up work
        before, t0 = _tree_cpu(head.proc.pid), time.perf_counter()
        time.sleep(args.idle_s)
        out["ray_idle_cores"] = _cpu_between(before, _tree_cpu(head.proc.pid)) / (time.perf_counter() - t0)
        print(f"idle Ray head: {100 * out['ray_idle_cores']:.1f}% of a core", flush=True)

        def go(task: dict, timeout: float = 900) -> dict:
            res = run_task(me, {**base, **task}, timeout)
            if not res.get("ok"):
                print(f"  FAILED {task}: {res.get('error')}", flush=True)
            return res

        out["tokenizer"] = go({"kind": "tokenizer", "chunks": args.chunks})
        print("tokenizer:", {k: round(v) for k, v in out["tokenizer"].items() if isinstance(v, float)}, flush=True)
        out["overhead"] = {}
        for kind in ("thread", "process", "ray"):
            for w in (1, 2):
                r = go({"kind": "overhead", "executor": kind, "workers": w, "n_seq": args.n_seq,
                        "n_tput": args.n_tput, "in_flight": 64})
                out["overhead"][f"{kind}_{w}"] = r
                print(f"overhead {kind}_{w}:", {k: round(v, 1) for k, v in r.items() if isinstance(v, float)
                                                 and not k.endswith("_mb") and k != "wall_s"}, flush=True)
        out["actor_rtt"] = go({"kind": "actor_rtt", "n_seq": args.n_seq})
        configs = [(r, w) for w in (1, 2) for r in RUNNERS]
        rounds: dict[str, list[dict]] = {f"{r}_{w}": [] for r, w in configs}
        for k in range(args.rounds):
            order = configs[k % len(configs):] + configs[:k % len(configs)]
            for r, w in order:
                res = go({"kind": "stream", "runner": r, "workers": w, "warmup": args.warmup, "steps": args.steps})
                rounds[f"{r}_{w}"].append(res)
                if res.get("ok"):
                    print(f"round {k} {r}_{w}: {res['tokens_per_s'] / 1e3:.0f}k tokens/s, trainer "
                          f"{res['trainer_cpu_ms_per_batch']:.0f} ms CPU/batch, all {res['all_cpu_ms_per_batch']:.0f}",
                          flush=True)
        out["rounds"] = rounds
    out["tokens_per_batch"] = next((r["tokens_per_batch"] for runs in rounds.values() for r in runs if r.get("ok")),
                                   None)
    out["load_after"] = os.getloadavg()
    digests = {name: runs[0]["digests"] for name, runs in rounds.items() if runs and runs[0].get("ok")}
    same = len({json.dumps(d) for d in digests.values()}) == 1 and len(digests) == len(rounds)
    out["same_batches"] = same
    report(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0 if same else 1


def _med(runs: list[dict], key: str) -> tuple[float, float, float]:
    xs = [r[key] for r in runs if r.get("ok")]
    return (statistics.median(xs), min(xs), max(xs)) if xs else (float("nan"),) * 3


def scaling(out: dict) -> tuple[list[str], list[list[Any]], dict]:
    """GPUs one CPU node of C cores feeds. A task of K tokens costs its worker K / T CPU seconds (T: the
    stage's tokens per CPU second, measured inline) plus Ray's own CPU per task on the cluster, c (raylet,
    worker, object store: measured on no-op tasks); one core per node is left to Ray's daemons and the OS.
    The rank pays r CPU seconds per token (its accumulators, collation and Ray client: the ray runner's
    trainer CPU per batch over the batch's tokens), so one GPU's rank needs 16,900 r of a core."""
    tok = out["tokenizer"]
    t_core, k = tok["stage_tokens_per_cpu_s"], tok["tokens_per_chunk"]
    c_task = out["overhead"]["ray_1"]["cluster_cpu_us_per_task"] / 1e6
    per_core = k / (k / t_core + c_task)
    tokens_per_batch = out.get("tokens_per_batch") or 1
    rank = {name: _med(out["rounds"][name], "trainer_cpu_ms_per_batch")[0] / 1e3 / tokens_per_batch
            for name in ("ray_2", "ray-lanes_2", "thread_2") if name in out["rounds"]}
    rows = [[c, f"{(c - 1) * per_core / 1e6:.2f}M", f"{(c - 1) * per_core / GPU_TOKENS_PER_S:,.0f}"]
            for c in NODE_CORES]
    model = {"stage_tokens_per_cpu_s": t_core, "tokens_per_task": k, "ray_cluster_cpu_s_per_task": c_task,
             "useful_tokens_per_core_s": per_core, "ray_share_of_worker_cpu": c_task / (k / t_core + c_task),
             **{f"rank_cores_per_gpu_{n}": GPU_TOKENS_PER_S * r for n, r in rank.items()}}
    return ["node cores C", "tokens/s (C-1 cores)", f"GPUs fed at {GPU_TOKENS_PER_S:,} tokens/s"], rows, model


def report(out: dict) -> None:
    print("\n## per-task overhead (no-op task)")
    rows = [[name, f"{r['latency_us_median']:.0f}", f"{r['latency_us_p90']:.0f}", f"{r['tasks_per_s']:.0f}",
             f"{r['trainer_cpu_us_per_task']:.0f}", f"{r['cluster_cpu_us_per_task']:.0f}" if "ray" in name else "-"]
            for name, r in out["overhead"].items() if r.get("ok")]
    print(fmt_table(["executor_W", "round trip us (median)", "p90", "tasks/s (64 in flight)",
                     "trainer CPU us/task", "Ray cluster CPU us/task"], rows, "lrrrrr"))
    if out["actor_rtt"].get("ok"):
        print(f"Ray actor call round trip: {out['actor_rtt']['latency_us_median']:.0f} us (median)")
    print("\n## text pipeline throughput (median round [min-max])")
    rows = []
    for name, runs in out["rounds"].items():
        tps, lo, hi = _med(runs, "tokens_per_s")
        rows.append([name, f"{tps / 1e3:.0f}k [{lo / 1e3:.0f}-{hi / 1e3:.0f}k]",
                     f"{_med(runs, 'trainer_cpu_ms_per_batch')[0]:.0f}", f"{_med(runs, 'all_cpu_ms_per_batch')[0]:.0f}",
                     f"{_med(runs, 'first_batch_s')[0]:.1f}"])
    print(fmt_table(["runner_W", "tokens/s", "trainer CPU ms/batch", "all CPU ms/batch", "first batch s"], rows,
                    "lrrrr"))
    print(f"same batches in every configuration: {out['same_batches']}")
    if out["tokenizer"].get("ok") and out["overhead"].get("ray_1", {}).get("ok"):
        headers, rows, model = scaling(out)
        out["scaling_model"] = model
        print("\n## scaling model")
        print(json.dumps({k: round(v, 6) for k, v in model.items()}))
        print(fmt_table(headers, rows, "rrr"))
    print(f"\nidle Ray head (GCS, raylet, agents): {100 * out.get('ray_idle_cores', 0):.1f}% of a core")
    print(f"load average before {out['load_before']}, after {out['load_after']}")


def main() -> int:
    done = task_main({"stream": task_stream, "overhead": task_overhead, "actor_rtt": task_actor_rtt,
                      "tokenizer": task_tokenizer})
    if done is not None:
        return done
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", help="a recipe (default: bench_data/recipe.toml if built, else the quickstart)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=16, help="untimed batches (hashed) per configuration")
    ap.add_argument("--steps", type=int, default=40, help="timed batches per configuration and round")
    ap.add_argument("--ray-cpus", type=int, default=2, help="logical CPUs of the local Ray head")
    ap.add_argument("--chunks", type=int, default=40, help="chunks per source for the tokenizer figures")
    ap.add_argument("--n-seq", type=int, default=300, help="sequential no-op tasks (round trip)")
    ap.add_argument("--n-tput", type=int, default=3000, help="pipelined no-op tasks (rate)")
    ap.add_argument("--idle-s", type=float, default=10.0, help="seconds to measure the idle head's CPU")
    ap.add_argument("--json", help="write every figure here")
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Text pre-training pipeline benchmark: Parquet -> tokenize (+EOS) -> pack -> batch [32, 2048] int64.

All configurations side by side, on the same corpus, tokenizer (``DIR/tokenizer.json``, 32k byte-level
BPE), seq_len and batch (from ``DIR/recipe.toml``):

  tokenizer_alone           HF ``encode_batch_fast`` on the corpus's documents in batches of 256 (+1 EOS
                            per document), one thread: the tokenizer's ceiling on one core
  tokenizer_alone_thread    the same, each call made on one helper thread that the caller waits for (one
                            thread busy at a time): glibc's per-thread malloc arena instead of the main one,
                            as Zephon's inline runner does (BENCHMARKS.md section 6)
  tokenizer_alone_2threads  the same on two threads sharing the tokenizer, four calls in flight: the
                            ceiling of two cores, for the 2-worker configurations
  plain_loop                one process, no framework: pyarrow row group -> encode_batch_fast -> EOS ->
                            numpy concat-then-split -> torch; the best a loader can do on one core
  grain_{concat,firstfit}_W Grain: MapDataset over row groups -> batched encode -> to_iter_dataset ->
                            flat map to documents (pieces <= seq_len) -> ConcatThenSplitIterDataset or
                            FirstFitPackIterDataset(num_packing_bins=32) -> batch(32) -> int64, with
                            mp_prefetch(num_workers=W) for W > 0
  torchdata_nodes_W_M       torchdata.nodes: row-group references -> ParallelMapper(read + encode, W
                            workers, method M, in_order) -> concat-then-split node -> Batcher -> Loader
  zephon_ALGO_W_RUNNER      zephon.build_loader(recipe with pack ALGO, num_workers=W, runner=RUNNER)

Protocol: every configuration runs in its own subprocess (env TOKENIZERS_PARALLELISM=false,
RAYON_NUM_THREADS=1: parallelism comes only from a configuration's workers). It builds its pipeline,
takes ``--warmup`` batches untimed (the first one's time, construction included, is reported as time to
first batch), then times ``--repeats`` consecutive windows of ``--steps`` batches; tokens/s = steps x 32 x
2048 / seconds (padding included), median window. ``--fresh`` rebuilds and re-warms the pipeline for each
repeat instead (independent runs). The warm-up must outlast every pipeline's start-up backlog: Zephon's
32 lanes each fill up to 16 best-fit rows and have one or two 64-row chunks in flight before the first
batch, ~16 batches of work that later batches consume for free; with too short a warm-up the first window looks several times
faster than the pipeline can sustain (the per-batch arrival times are in the --json output as ``trace``;
rows whose windows differ by more than 1.5x are marked noisy).
Peak RSS: the subprocess and all its descendants, summed, sampled every 0.1 s over its whole life.
Zephon: the SHA-256 (zephon.batch_digest) of every batch is recorded (its time is excluded from the
measurement) and all Zephon configurations with the same pack algorithm must agree, batch for batch
(exit 1 otherwise).

    python scripts/bench/text_pipeline.py --data bench_data
    python scripts/bench/text_pipeline.py --data bench_data --steps 8 --warmup 2 --repeats 1 --only 'zephon_*'

Exit status: 0 ok; 1 Zephon hash mismatch; 2 a Zephon configuration failed (peer failures are shown in
the table but do not change the exit status).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _targets  # noqa: E402
from _targets import median_round, zephon_hash_check  # noqa: E402
from _common import (  # noqa: E402
    fmt_table, machine_info, measure_stream, only_patterns, pin_cpus, require_data, run_task, select_configs,
    task_main,
)

SCRIPT = Path(__file__).resolve()


def all_configs() -> list[dict[str, Any]]:
    cfgs: list[dict[str, Any]] = [
        {"name": "tokenizer_alone", "kind": "tokenizer_alone", "workers": 0, "runner": "-"},
        {"name": "tokenizer_alone_thread", "kind": "tokenizer_alone", "workers": 0, "runner": "helper thread",
         "params": {"threads": 1}},
        {"name": "tokenizer_alone_2threads", "kind": "tokenizer_alone", "workers": 2, "runner": "2 threads",
         "params": {"threads": 2}},
        {"name": "plain_loop", "kind": "plain_loop", "workers": 0, "runner": "-"},
    ]
    for packing in ("concat", "firstfit"):
        for w in (0, 1, 2):
            cfgs.append({"name": f"grain_{packing}_{w}", "kind": "grain", "workers": w,
                         "runner": "process" if w else "inline", "params": {"packing": packing, "workers": w}})
    cfgs.append({"name": "torchdata_nodes_0", "kind": "torchdata", "workers": 0, "runner": "inline",
                 "params": {"workers": 0}})
    for method in ("thread", "process"):
        for w in (1, 2):
            cfgs.append({"name": f"torchdata_nodes_{w}_{method}", "kind": "torchdata", "workers": w,
                         "runner": method, "params": {"workers": w, "method": method}})
    for algo in ("best_fit", "wrap"):
        cfgs.append({"name": f"zephon_{algo}_0_inline", "kind": "zephon", "workers": 0, "runner": "inline",
                     "params": {"algorithm": algo, "workers": 0, "runner": "thread"}})
        for runner in ("thread", "pool", "process"):
            for w in (1, 2):
                cfgs.append({"name": f"zephon_{algo}_{w}_{runner}", "kind": "zephon", "workers": w,
                             "runner": runner, "params": {"algorithm": algo, "workers": w, "runner": runner}})
    return cfgs


def extra_configs() -> list[dict[str, Any]]:
    """Not run by default (--extra): the tokenizer alone on one helper thread with a second call queued
    behind the running one, and with 64 documents a call (Zephon's ``chunk_rows``) on one and two
    threads; Grain with read threads instead of processes; Zephon's 2-worker thread and pool runners
    with 4 chunks per source in flight instead of 2; Zephon with ``batch(provenance=True)`` (the tensor built
    and timed, left out of the batch hash); 1-worker configurations pinned to one CPU."""
    return [{"name": "tokenizer_alone_thread_queued", "kind": "tokenizer_alone", "workers": 0,
             "runner": "helper thread, 2 calls queued", "params": {"threads": 1, "in_flight": 2}},
            {"name": "tokenizer_alone_thread_64", "kind": "tokenizer_alone", "workers": 0,
             "runner": "helper thread, 64 documents a call, 2 calls queued",
             "params": {"threads": 1, "in_flight": 2, "per_call": 64}},
            {"name": "tokenizer_alone_2threads_64", "kind": "tokenizer_alone", "workers": 2,
             "runner": "2 threads, 64 documents a call", "params": {"threads": 2, "per_call": 64}}] + \
           [{"name": f"grain_{p}_0_t{t}", "kind": "grain", "workers": 0, "runner": f"{t} threads",
             "params": {"packing": p, "workers": 0, "read_threads": t}} for p in ("concat", "firstfit") for t in (2,)] + \
           [{"name": f"zephon_best_fit_2_{r}_prefetch4", "kind": "zephon", "workers": 2, "runner": r,
             "params": {"algorithm": "best_fit", "workers": 2, "runner": r, "prefetch": 4}} for r in ("thread", "pool")] + \
           [{"name": f"zephon_{a}_{w}_{r}_provenance", "kind": "zephon", "workers": w, "runner": r,
             "params": {"algorithm": a, "workers": w, "runner": r, "provenance": True}}
            for a in ("best_fit", "wrap") for w, r in ((0, "inline"), (2, "thread"))] + \
           one_cpu_configs()


def one_cpu_configs() -> list[dict[str, Any]]:
    """1-worker configurations pinned to one CPU (``cpus``, applied by _common.pin_cpus in the child): the
    one-core baseline of the scaling target. Named ``..._1cpu``; run them with --extra --only '*_1cpu'."""
    out = [{"name": f"zephon_{algo}_1_{runner}_1cpu", "kind": "zephon", "workers": 1, "runner": runner,
            "cpus": [0], "params": {"algorithm": algo, "workers": 1, "runner": runner}}
           for algo in ("best_fit", "wrap") for runner in ("thread", "pool", "process")]
    out += [{"name": f"torchdata_nodes_1_{m}_1cpu", "kind": "torchdata", "workers": 1, "runner": m, "cpus": [0],
             "params": {"workers": 1, "method": m}} for m in ("thread", "process")]
    return out


# -- the child ---------------------------------------------------------------------------------------
def run_config(task: dict[str, Any]) -> dict[str, Any]:
    data, batch, seq_len = Path(task["data"]), task["batch"], task["seq_len"]
    steps, warmup, repeats, fresh = task["steps"], task["warmup"], task["repeats"], task["fresh"]
    cfg = task["config"]
    pin_cpus(cfg)
    if cfg["kind"] == "tokenizer_alone":
        return tokenizer_alone(data, batch * seq_len, steps, min(warmup, 4), repeats, **cfg.get("params", {}))

    import torch

    import _pipelines

    params = dict(cfg.get("params", {}))
    holder: dict[str, Any] = {}
    n_runs = repeats if fresh else 1
    pads: list[list[float]] = [[] for _ in range(n_runs)]
    is_zephon = cfg["kind"] == "zephon"
    if is_zephon:
        import zephon

    def make():
        it, close, _ = _pipelines.BUILDERS[cfg["kind"]](data, batch, seq_len, holder=holder, **params)
        return it, close

    def check(b: dict) -> None:
        x = b["input_ids"]
        if not isinstance(x, torch.Tensor) or x.dtype != torch.int64 or tuple(x.shape) != (batch, seq_len):
            raise AssertionError(f"batch input_ids is {type(x).__name__} {getattr(x, 'dtype', '?')} "
                                 f"{tuple(getattr(x, 'shape', ()))}, expected int64 [{batch}, {seq_len}]")

    def on_batch(run: int, i: int, b: dict) -> None:
        if not is_zephon and "segment_ids" in b:
            pads[run].append(float((b["segment_ids"] == 0).float().mean()))

    def after_window(run: int) -> dict:
        if not is_zephon:
            return {"pad_fraction": sum(pads[run]) / len(pads[run])} if pads[run] else {}
        m = holder["loader"].metrics()
        return {k: m[k] for k in ("pad_fraction", "flush_pad_fraction", "flushes", "docs", "pieces_split")
                if k in m} | {"zephon_metrics_tokens_per_s": m.get("tokens_per_s")}

    res = measure_stream(make, steps, warmup, repeats, batch * seq_len, fresh=fresh, check=check,
                         on_batch=on_batch, after_window=after_window,
                         digest=zephon.batch_digest if is_zephon else None)
    digests = res.pop("digests_by_run")
    if is_zephon:
        res["digests"] = digests[0]
        res["repeats_agree"] = all(d == digests[0] for d in digests)
    return res


def tokenizer_alone(data: Path, tokens_per_batch: int, steps: int, warmup: int, repeats: int,
                    threads: int = 0, in_flight: int | None = None, per_call: int = 256) -> dict:
    """encode_batch_fast on the corpus's documents (file order), ``per_call`` at a time, one thread busy at a
    time (``threads``: 1 a helper thread, 2 two threads in parallel; ``in_flight`` calls queued; see
    :func:`_pipelines.tokenizer_alone_counts`).

    Same windows as the pipelines: ``warmup`` batches' worth of tokens untimed, then ``repeats``
    windows of ``steps`` batches' worth (documents in memory; no reading, packing or tensors).
    """
    import statistics

    import _pipelines

    texts = _pipelines.load_texts(data, min_chars=int((warmup + repeats * steps) * tokens_per_batch * 4.5))
    # + one EOS per document, as the pipelines
    counts = _pipelines.tokenizer_alone_counts(data, texts, threads, per_call, in_flight)

    def run(limit: int) -> int:
        n = 0
        while n < limit:
            n += next(counts)
        return n

    t_start = time.perf_counter()
    run(1)
    first = time.perf_counter() - t_start
    run(max(0, warmup - 1) * tokens_per_batch)
    windows = []
    total_tokens = 0
    for w in range(repeats):
        t = time.perf_counter()
        n = run(steps * tokens_per_batch)
        sec = time.perf_counter() - t
        total_tokens += n
        windows.append({"run": 0, "window": w, "seconds": sec, "tokens": n, "tokens_per_s": n / sec})
    total = time.perf_counter() - t_start
    return {"runs": windows, "tokens_per_s": statistics.median(w["tokens_per_s"] for w in windows),
            "tokens_per_s_all_windows": sum(w["tokens"] for w in windows) / sum(w["seconds"] for w in windows),
            "first_batch_s": first, "tokens_per_s_incl_startup": (total_tokens + warmup * tokens_per_batch) / total,
            "pipelines": [{"first_batch_s": first, "seconds_total": total}]}


# -- the parent --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="bench_data", help="directory written by make_corpus.py")
    ap.add_argument("--steps", type=int, default=32, help="timed batches per window (default 32)")
    ap.add_argument("--warmup", type=int, default=96,
                    help="untimed batches first, the first included (default 96: Zephon's 32 lanes start with "
                         "16 best-fit rows and one or two 64-row chunks each, ~16 batches of backlog); "
                         "tokenizer_alone, which has no backlog, warms up on min(this, 4) batches' worth")
    ap.add_argument("--repeats", type=int, default=3, help="timed windows per configuration; the median is reported")
    ap.add_argument("--fresh", action="store_true",
                    help="rebuild and re-warm the pipeline for every repeat (independent runs; slower)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every configuration this many times, interleaved (round r runs them all, in "
                         "reverse order every other round), and report the median round: a slow spell of the "
                         "machine (CPU steal, another job) then hits every configuration alike")
    ap.add_argument("--only", default="", help="comma-separated names or globs (e.g. 'zephon_*,plain_loop')")
    ap.add_argument("--extra", action="store_true", help="also run the extra configurations (see --list)")
    ap.add_argument("--list", action="store_true", help="list the configurations and exit")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per configuration (default 600)")
    ap.add_argument("--json", default="", help="write all results to this file")
    args = ap.parse_args(argv)

    cfgs = all_configs() + (extra_configs() if args.extra else [])
    if args.only:
        pats = only_patterns(args.only)
        cfgs = select_configs(cfgs, pats)
        cfgs += [c for c in extra_configs() if c["name"] in pats and c not in cfgs]  # extras named exactly
        if not cfgs:
            print(f"no configuration matches --only {args.only!r}; see --list", file=sys.stderr)
            return 2
    if args.list:
        for c in all_configs() + extra_configs():
            print(c["name"])
        return 0

    data = Path(args.data).resolve()
    require_data(data)
    import zephon

    recipe = zephon.load_recipe(data / "recipe.toml")
    batch, seq_len = recipe.global_batch_size, recipe.seq_len
    manifest = json.loads((data / "manifest.json").read_text()) if (data / "manifest.json").exists() else {}
    info = machine_info()
    print(f"# text pipeline: Parquet -> tokenize(+EOS) -> pack -> [{batch}, {seq_len}] int64")
    print(f"# corpus {data}: {manifest.get('stats', {}).get('docs', '?')} docs, "
          f"~{manifest.get('stats', {}).get('estimated_total_tokens', 0) / 1e6:.0f}M tokens, "
          f"vocab {manifest.get('vocab_size', '?')}")
    print(f"# machine: {info}")
    how = (f"{args.repeats} fresh run(s) x ({args.warmup} warm-up + {args.steps} timed batches)" if args.fresh else
           f"1 pipeline: {args.warmup} warm-up batches, then {args.repeats} timed windows x {args.steps} batches")
    print(f"# protocol: {how}; median window tokens/s (= batches x {batch} x {seq_len} / s, padding included); "
          f"each configuration in its own subprocess with TOKENIZERS_PARALLELISM=false RAYON_NUM_THREADS=1; "
          f"Zephon's batch hashing excluded from timings; peak RSS = process tree, summed")
    sys.stdout.flush()

    per_cfg: dict[str, list[dict[str, Any]]] = {c["name"]: [] for c in cfgs}
    t_all = time.perf_counter()
    for rnd in range(max(1, args.rounds)):
        if args.rounds > 1:
            print(f"# round {rnd + 1} of {args.rounds}", flush=True)
        for c in (cfgs if rnd % 2 == 0 else cfgs[::-1]):
            task = {"kind": "text", "config": c, "data": str(data), "batch": batch, "seq_len": seq_len,
                    "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "fresh": args.fresh}
            print(f"[{time.perf_counter() - t_all:6.0f}s] {c['name']:<28}", end=" ", flush=True)
            r = run_task(SCRIPT, task, timeout=args.timeout)
            per_cfg[c["name"]].append(r)
            if r.get("ok"):
                runs_s = ", ".join(f"{x['tokens_per_s'] / 1e3:.1f}k" for x in r["runs"])
                print(f"{r['tokens_per_s'] / 1e3:9.1f} k tok/s  (windows: {runs_s}; first batch "
                      f"{r['first_batch_s']:.1f}s; peak RSS {r['peak_rss_mb']:.0f} MB; {r['wall_s']:.0f}s)", flush=True)
            else:
                print(f"FAILED: {r.get('error')}", flush=True)
    results = {c["name"]: {**c, **median_round(per_cfg[c["name"]])} for c in cfgs}

    print()
    print(render_table(results))
    print("(k tok/s all windows: all timed batches over all timed seconds. noisy: the fastest window is >1.5x the "
          "slowest, the pipeline is not in a steady state at this --warmup/--steps (e.g. Zephon's lanes refilling in "
          "waves): trust 'all windows' over the median, or rerun those rows with larger --warmup and --steps)")
    code = 0
    check_lines, mismatch, zephon_failed = zephon_hash_check(results)
    print()
    for line in check_lines:
        print(line)
    if mismatch:
        code = 1
    elif zephon_failed:
        code = 2
    targets = _targets.target_report(per_cfg)
    if targets:
        print("\n# issue 3 targets, ratios taken inside each round (see scripts/bench/_targets.py)")
        for line in targets:
            print(line)
    print(f"\ntotal {time.perf_counter() - t_all:.0f}s")
    if args.json:
        out = {"machine": info, "args": vars(args), "batch": batch, "seq_len": seq_len, "manifest": manifest,
               "results": results, "targets": targets, "exit_code": code}
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    return code


def render_table(results: dict[str, dict[str, Any]]) -> str:
    def tps(name: str) -> float | None:
        r = results.get(name)
        return r["tokens_per_s"] if r and r.get("ok") else None

    base_tok, base_plain = tps("tokenizer_alone"), tps("plain_loop")
    rows = []
    for name, r in results.items():
        if not r.get("ok"):
            rows.append([name, r["workers"], r["runner"], "FAILED", "", "", f"{r['peak_rss_mb']:.0f}", "", "", "", "",
                         (r.get("error") or "")[:110]])
            continue
        v = r["tokens_per_s"]
        runs = r["runs"]
        spread = r.get("round_tokens_per_s") or [x["tokens_per_s"] for x in runs]  # rounds, else windows
        lo, hi = min(spread), max(spread)
        pad = [x.get("pad_fraction") for x in runs if x.get("pad_fraction") is not None]
        pad_s = f"{100 * pad[-1]:.1f}" if pad else ("0.0" if r["kind"] in ("plain_loop", "torchdata") else "")
        if r["kind"] == "zephon" and runs[-1].get("flush_pad_fraction") is not None:
            pad_s += f" ({100 * runs[-1]['flush_pad_fraction']:.1f})"
        rows.append([name, r["workers"], r["runner"], f"{v / 1e3:,.1f}",
                     f"{v / base_tok:.2f}" if base_tok else "-", f"{v / base_plain:.2f}" if base_plain else "-",
                     f"{r['peak_rss_mb']:,.0f}", pad_s, f"{r['first_batch_s']:.1f}",
                     f"{r['tokens_per_s_all_windows'] / 1e3:,.1f}", f"{r['tokens_per_s_incl_startup'] / 1e3:,.1f}",
                     f"{lo / 1e3:.0f}-{hi / 1e3:.0f}k" + (" (noisy)" if hi > 1.5 * lo else "")])
    return fmt_table(["config", "workers", "runner", "k tok/s (median)", "x tokenizer_alone", "x plain_loop",
                      "peak RSS MB", "pad % (flush)", "1st batch s", "k tok/s all windows", "k tok/s incl. startup",
                      ("rounds" if any(r.get("round_tokens_per_s") for r in results.values()) else "windows")
                      + " min-max / error"], rows, align="lrlrrrrrrrrl")


if __name__ == "__main__":
    task_main({"text": run_config})
    sys.exit(main())

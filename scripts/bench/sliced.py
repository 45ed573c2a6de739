#!/usr/bin/env python
"""The text pipeline benchmark under time-slicing: every configuration sees the same machine.

Why: on this shared VM the same CPU-bound loop (the tokenizer on the same 256 documents) ran anywhere
between 377k and 710k tok/s from one second to the next (``--noise`` shows it). Configurations measured
one after another, even in interleaved rounds, then differ by more than their real difference.

How: every configuration of text_pipeline.py starts in its own process group, warms up alone
(``--warmup`` batches; Zephon hashes these to check that all its configurations agree) and is frozen
with SIGSTOP. Then passes run: in each pass every configuration, in a fresh random order (by default one
in which each 1-worker/2-worker pair runs back to back: ``--order``), is thawed
(SIGCONT) for ``--slice`` seconds while all others stay frozen, and the tokens it delivered in that slice
are read from a shared counter. A slow spell of the machine is thus spread over all configurations
alike. Reported per configuration: tokens over all its slices / its running time, and, for the issue's
targets, the median over passes of per-pass ratios (scripts/bench/_targets.py); for each 1-worker /
2-worker pair also the ratio of the two over all slices (a 3 s slice rounds to whole batches, ~5% of a
1-worker slice; summed over all passes that rounding averages out).

Freezing a configuration freezes its worker processes and threads too (one process group), so its
read-ahead does not grow while others run. All configurations stay in memory at once (about 0.3-1 GB
each); use --only to run fewer.

    python scripts/bench/sliced.py --data bench_data --passes 12 --slice 2
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _targets  # noqa: E402
from _common import (  # noqa: E402
    REPO, child_env, fmt_table, has_flush_by, machine_info, only_patterns, pin_cpus, require_data, select_configs,
)

# counter file layout, int64 each: tokens delivered, ready flag (1 ready, -1 failed), stop flag, CPU
# microseconds its threads spent inside the tokenizer's batch calls (--tokenizer-cpu)
TOKENS, READY, STOP, TOKENIZER_US = range(4)
COUNTER_BYTES = 32


def _counter(path: str | Path):
    """The shared int64 counters in ``path``, as a writable numpy view of an mmap."""
    import numpy as np

    fd = os.open(path, os.O_RDWR)
    return np.frombuffer(mmap.mmap(fd, COUNTER_BYTES), dtype=np.int64)


# -- the child ---------------------------------------------------------------------------------------
def _tokenizer_alone_batches(data: Path, tokens_per_batch: int, threads: int = 0, in_flight: int | None = None,
                             per_call: int = 256):
    """The tokenizer-alone ceiling as a stream of 'batches': encode_batch_fast, ``per_call`` documents a call."""
    import _pipelines

    texts = _pipelines.load_texts(data, min_chars=60_000_000)
    have = 0
    for n in _pipelines.tokenizer_alone_counts(data, texts, threads, per_call, in_flight):
        have += n
        while have >= tokens_per_batch:
            have -= tokens_per_batch
            yield None


def _count_tokenizer_cpu(counter) -> None:
    """Make every Hugging Face tokenizer loaded from a file in this process add the CPU time its calling
    thread spends in ``encode_batch_fast`` (the tokenizer's own work when its thread pool is off) to the
    shared counter: the split of CPU per token between the tokenizer and everything else."""
    import threading

    import tokenizers

    real, lock = tokenizers.Tokenizer, threading.Lock()

    class Counted:
        def __init__(self, tok: Any) -> None:
            self._tok = tok

        @classmethod
        def from_file(cls, path: str) -> "Counted":
            return cls(real.from_file(path))

        def __getattr__(self, name: str) -> Any:
            return getattr(self._tok, name)

        def encode_batch_fast(self, *a: Any, **kw: Any) -> Any:
            t = time.thread_time()
            out = self._tok.encode_batch_fast(*a, **kw)
            used = int((time.thread_time() - t) * 1e6)
            with lock:  # a read-modify-write of shared memory, from several threads
                counter[TOKENIZER_US] += used
            return out

    tokenizers.Tokenizer = Counted


def _prewarm_tokenizers(data: Path, docs: int) -> None:
    """Make every Hugging Face tokenizer loaded from a file in this process encode the same ``docs``
    documents first (taken from row groups spread over the whole corpus), before anyone else uses it.

    Why: its BPE model memoises words in a cache of 10,000 that stops taking new ones once full, so the
    words it meets first decide its hit rate for the rest of the run, and two loaders that send the
    same documents in another order to it tokenize at different speeds (BENCHMARKS.md 4d). With the same
    words first in every configuration, the tokenizer's own speed is no longer a difference between them."""
    import tokenizers

    from _common import RowGroupReader, parquet_row_groups

    items = list(parquet_row_groups(data))
    read, texts = RowGroupReader(), []
    for item in items[::max(1, len(items) // 16)]:
        texts.extend(read(item)[:max(1, docs // 16)])
    texts = texts[:docs]
    real = tokenizers.Tokenizer

    class Prewarmed:
        @staticmethod
        def from_file(path: str) -> Any:
            tok = real.from_file(path)
            tok.encode_batch_fast(texts, add_special_tokens=False)
            return tok

        def __new__(cls, *a: Any, **kw: Any) -> Any:
            return real(*a, **kw)

    tokenizers.Tokenizer = Prewarmed


def child(task: dict[str, Any]) -> None:
    if os.environ.get("ZEPHON_BENCH_SWITCH_INTERVAL"):  # --switch-interval variants
        sys.setswitchinterval(float(os.environ["ZEPHON_BENCH_SWITCH_INTERVAL"]))
    src = task["config"].get("zephon_src")
    if src:  # a "_before" configuration: that checkout's zephon/, imported before anything else imports one
        sys.path.insert(0, src)
    import _pipelines

    data, cfg, batch, seq_len = Path(task["data"]), task["config"], task["batch"], task["seq_len"]
    counter = _counter(task["counter"])
    if task.get("prewarm"):
        _prewarm_tokenizers(data, task["prewarm"])
    if task.get("tokenizer_cpu"):
        _count_tokenizer_cpu(counter)
    pin_cpus(cfg)
    result: dict[str, Any] = {"name": cfg["name"], "digests": []}
    try:
        if cfg["kind"] == "tokenizer_alone":
            it, close = _tokenizer_alone_batches(data, batch * seq_len, **cfg.get("params", {})), (lambda: None)
        else:
            it, close, _ = _pipelines.BUILDERS[cfg["kind"]](data, batch, seq_len, **cfg.get("params", {}))
            it = iter(it)
        digest = None
        if cfg["kind"] == "zephon":
            import zephon
            digest = zephon.batch_digest
        t0 = time.perf_counter()
        for i in range(task["warmup"]):
            b = next(it)
            if i == 0:
                result["first_batch_s"] = time.perf_counter() - t0
            if digest is not None:
                result["digests"].append(digest(b))
        counter[READY] = 1
        tokens = batch * seq_len
        while not counter[STOP]:
            next(it)
            counter[TOKENS] += tokens
        close()
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:600], traceback=traceback.format_exc())
        counter[READY] = -1
    Path(task["out"]).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


# -- the parent --------------------------------------------------------------------------------------
class Slot:
    """One configuration's frozen process group and its shared counter."""

    def __init__(self, cfg: dict[str, Any], task: dict[str, Any], tmp: Path) -> None:
        self.cfg, self.name = cfg, cfg["name"]
        self.counter_path, self.out = tmp / f"{self.name}.counter", tmp / f"{self.name}.json"
        self.counter_path.write_bytes(b"\0" * COUNTER_BYTES)
        self.counter = _counter(self.counter_path)
        env = child_env(cfg.get("env"))
        task = {**task, "config": cfg, "counter": str(self.counter_path), "out": str(self.out)}
        self.log = open(tmp / f"{self.name}.log", "wb")
        self.proc = subprocess.Popen([sys.executable, __file__, "--_slice", json.dumps(task)], env=env,
                                     cwd=str(REPO), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.slices: list[tuple[float, int, float]] = []  # (seconds, tokens, CPU seconds) per slice
        self.tokenizer_cpu = 0.0  # CPU seconds in the tokenizer's calls over all slices (--tokenizer-cpu)
        self.error: str | None = None

    def cpu_seconds(self) -> float:
        """User + system CPU time so far of this configuration's processes (it and its descendants).

        Read while the group is frozen, so no process starts or ends meanwhile. A worker that exited
        during the run takes its time with it; workers here live as long as their configuration."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            return 0.0
        total = 0.0
        for proc in procs:
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def wait_ready(self, timeout: float) -> bool:
        t = time.perf_counter()
        while self.counter[READY] == 0 and self.proc.poll() is None and time.perf_counter() - t < timeout:
            time.sleep(0.05)
        if self.counter[READY] != 1:
            self.error = "failed during warm-up" if self.proc.poll() is not None or self.counter[READY] < 0 else "warm-up timed out"
            return False
        self.freeze()
        return True

    def freeze(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def run_slice(self, seconds: float) -> float:
        before, cpu_before = int(self.counter[TOKENS]), self.cpu_seconds()
        tok_us = int(self.counter[TOKENIZER_US])
        t = time.perf_counter()
        self.thaw()
        time.sleep(seconds)
        self.freeze()
        dt = time.perf_counter() - t
        time.sleep(0.02)  # let the stop land before reading the counter
        self.slices.append((dt, int(self.counter[TOKENS]) - before, self.cpu_seconds() - cpu_before))
        self.tokenizer_cpu += (int(self.counter[TOKENIZER_US]) - tok_us) / 1e6
        return self.slices[-1][1] / dt

    def totals(self) -> tuple[float, int, float]:
        """(seconds, tokens, CPU seconds) over all this configuration's slices."""
        return (sum(d for d, _, _ in self.slices), sum(t for _, t, _ in self.slices),
                sum(c for _, _, c in self.slices))

    def finish(self) -> dict[str, Any]:
        self.counter[STOP] = 1
        if self.proc.poll() is None:
            self.thaw()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.log.close()
        res = json.loads(self.out.read_text()) if self.out.exists() else {"ok": False}
        if self.error:
            res["ok"] = False
            res.setdefault("error", self.error)
        if not res.get("ok") and "error" not in res:
            res["error"] = "no result; see the log"
        return res


def noise(seconds: float) -> list[float]:
    """The same CPU-bound work (tokenize the same 256 documents) per 1 s, for ``seconds``."""
    from tokenizers import Tokenizer

    import _pipelines
    data = Path(os.environ.get("ZEPHON_BENCH_DATA", "bench_data"))
    texts = _pipelines.load_texts(data, min_chars=2_000_000)[:256]
    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    rates, end = [], time.time() + seconds
    while time.time() < end:
        t, n = time.perf_counter(), 0
        while time.perf_counter() - t < 1.0:
            n += sum(len(e.ids) for e in tok.encode_batch_fast(texts, add_special_tokens=False))
        rates.append(n / (time.perf_counter() - t))
    return rates


def main(argv: list[str] | None = None) -> int:
    import text_pipeline

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="bench_data")
    ap.add_argument("--warmup", type=int, default=64, help="batches each configuration runs alone first (hashed)")
    ap.add_argument("--passes", type=int, default=12, help="time slices per configuration")
    ap.add_argument("--slice", type=float, default=2.0, help="seconds per slice")
    ap.add_argument("--only", default="", help="comma-separated names or globs (see text_pipeline.py --list)")
    ap.add_argument("--extra", action="store_true", help="also run the extra configurations, e.g. the 1-CPU ones")
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-pass slice order")
    ap.add_argument("--order", choices=("pairs", "random"), default="pairs",
                    help="pairs: a random order in which each 1-worker/2-worker pair runs back to back "
                         "(default); random: any order")
    ap.add_argument("--noise", type=float, default=0, help="only measure the machine's noise for this many seconds")
    ap.add_argument("--zephon-src", default="",
                    help="before/after: also run every chosen Zephon configuration on this checkout's zephon/, as "
                         "NAME_before, in the same passes")
    ap.add_argument("--flush-by", default="", choices=("", "units", "chunks"),
                    help="the Zephon configurations with this sentinel cadence, a --zephon-src checkout's too where it "
                         "has flush_by (units: the batches of a checkout from before flush_by existed, so "
                         "--zephon-src hashes agree)")
    ap.add_argument("--tokenizer-cpu", action="store_true",
                    help="also split each configuration's CPU per token into the tokenizer's calls and the rest")
    ap.add_argument("--tokenizer-pool", action="store_true",
                    help="also run every chosen Zephon configuration with the tokenizer's thread pool as a user gets it "
                         "(NAME_pool_default: TOKENIZERS_PARALLELISM and RAYON_NUM_THREADS unset; this checkout "
                         "decides, a --zephon-src checkout from before that rule leaves the pool on) and forced "
                         "on (NAME_pool_on: TOKENIZERS_PARALLELISM=true); NAME itself runs with it off, as every "
                         "configuration here does")
    ap.add_argument("--prewarm", type=int, default=0, metavar="DOCS",
                    help="every configuration's Hugging Face tokenizers first encode the same DOCS documents, so "
                         "that their word caches hold the same words whatever order the loader sends documents in")
    ap.add_argument("--switch-interval", type=float, default=0, metavar="S",
                    help="also run every chosen Zephon configuration with sys.setswitchinterval(S) in its process "
                         "(NAME_swS): how long a thread waiting for the GIL lets the holder run")
    ap.add_argument("--preload", default="", metavar="LIB",
                    help="also run every chosen configuration with this allocator preloaded (LD_PRELOAD=LIB, e.g. "
                         "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2) as NAME_preload, in the same passes")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if args.preload and not Path(args.preload).is_file():
        ap.error(f"--preload {args.preload}: no such file (Debian: apt-get install libjemalloc2)")
    data = Path(args.data).resolve()
    require_data(data)
    if args.noise:
        os.environ["ZEPHON_BENCH_DATA"] = str(data)
        rates = noise(args.noise)
        print("tokenizer on the same 256 documents, k tok/s per second: " + " ".join(f"{r / 1e3:.0f}" for r in rates))
        print(f"min {min(rates) / 1e3:.0f}k, median {statistics.median(rates) / 1e3:.0f}k, max {max(rates) / 1e3:.0f}k")
        return 0
    cfgs = text_pipeline.all_configs() + (text_pipeline.extra_configs() if args.extra else [])
    if args.only:
        pats = only_patterns(args.only)
        cfgs = select_configs(cfgs, pats)
        cfgs += [c for c in text_pipeline.extra_configs() if c["name"] in pats and c not in cfgs]  # named exactly
    if args.flush_by:
        cfgs = [{**c, "params": {**c.get("params", {}), "flush_by": args.flush_by}} if c["kind"] == "zephon" else c
                for c in cfgs]
    if args.zephon_src:
        src = str(Path(args.zephon_src).resolve())
        keep_flush_by = has_flush_by(src)  # a checkout from before flush_by existed flushes by units
        before = []
        for c in cfgs:
            if c["kind"] == "zephon":
                params = {k: v for k, v in c.get("params", {}).items() if k != "flush_by" or keep_flush_by}
                before.append({**c, "name": c["name"] + "_before", "params": params, "zephon_src": src})
        cfgs += before
    if args.tokenizer_pool:
        variants = {"_pool_default": {"TOKENIZERS_PARALLELISM": None, "RAYON_NUM_THREADS": None},
                    "_pool_on": {"TOKENIZERS_PARALLELISM": "true", "RAYON_NUM_THREADS": None}}
        cfgs += [{**c, "name": c["name"] + suffix, "env": env} for c in cfgs if c["kind"] == "zephon"
                 for suffix, env in variants.items()]
    if args.switch_interval:
        cfgs += [{**c, "name": f"{c['name']}_sw{args.switch_interval:g}",
                  "env": {**c.get("env", {}), "ZEPHON_BENCH_SWITCH_INTERVAL": str(args.switch_interval)}}
                 for c in cfgs if c["kind"] == "zephon"]
    if args.preload:
        cfgs += [{**c, "name": c["name"] + "_preload", "env": {**c.get("env", {}), "LD_PRELOAD": str(Path(args.preload).resolve())}}
                 for c in cfgs]
    import zephon
    recipe = zephon.load_recipe(data / "recipe.toml")
    batch, seq_len = recipe.global_batch_size, recipe.seq_len
    task = {"data": str(data), "batch": batch, "seq_len": seq_len, "warmup": args.warmup,
            "tokenizer_cpu": args.tokenizer_cpu, "prewarm": args.prewarm}
    print(f"# sliced text pipeline: [{batch}, {seq_len}], {len(cfgs)} configurations, warm-up {args.warmup} "
          f"batches alone, then {args.passes} passes x {args.slice:g} s slices in random order")
    print(f"# machine: {machine_info()}", flush=True)
    t_all = time.perf_counter()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="zephon-sliced-") as tmp:
        slots: list[Slot] = []
        try:
            for cfg in cfgs:
                slot = Slot(cfg, task, Path(tmp))
                ok = slot.wait_ready(timeout=600)
                print(f"[{time.perf_counter() - t_all:5.0f}s] warmed up {slot.name:<28} "
                      f"{'ok' if ok else slot.error}", flush=True)
                slots.append(slot)
            live = [s for s in slots if s.error is None]
            per_pass: list[dict[str, float]] = []
            for p in range(args.passes):
                if args.order == "pairs":
                    by_name = {s.name: s for s in live}
                    order = [by_name[n] for n in _targets.adjacent_pair_order(list(by_name), rng)]
                else:
                    order = live[:]
                    rng.shuffle(order)
                per_pass.append({s.name: s.run_slice(args.slice) for s in order})
                print(f"[{time.perf_counter() - t_all:5.0f}s] pass {p + 1}/{args.passes}", flush=True)
        finally:
            results = {s.name: s.finish() for s in slots}
    return report(cfgs, slots, results, per_pass, args, time.perf_counter() - t_all)


def report(cfgs, slots, results, per_pass, args, total_s) -> int:
    rows, out, split_rows = [], {}, []
    totals = {s.name: s.totals() for s in slots if s.slices}
    ref = {name: tokens / max(1e-9, wall) for name, (wall, tokens, _) in totals.items()}
    base = ref.get("tokenizer_alone")

    def ceiling(cfg: dict[str, Any]) -> float | None:
        """The tokenizer alone on as many threads as the configuration has workers (at least one)."""
        return ref.get("tokenizer_alone_2threads" if cfg.get("workers", 0) >= 2 else "tokenizer_alone_thread")

    for s in slots:
        r = results[s.name]
        if not r.get("ok") or not s.slices:
            rows.append([s.name, "FAILED", "", "", "", "", "", "", (r.get("error") or "")[:100]])
            continue
        rates = [t / d for d, t, _ in s.slices]
        q = statistics.quantiles(rates, n=4) if len(rates) >= 2 else [rates[0]] * 3
        wall, tokens, cpu = totals[s.name]
        ceil = ceiling(s.cfg)
        rows.append([s.name, f"{ref[s.name] / 1e3:,.0f}", f"{ref[s.name] / base:.2f}" if base else "-",
                     f"{ref[s.name] / ceil:.2f}" if ceil else "-", f"{q[0] / 1e3:,.0f}-{q[2] / 1e3:,.0f}", f"{cpu / wall:.2f}",
                     f"{tokens / cpu / 1e3:,.0f}" if cpu else "-", f"{r.get('first_batch_s', 0):.1f}", ""])
        if args.tokenizer_cpu and tokens:
            per_m = 1e6 / tokens
            split_rows.append([s.name, f"{cpu * per_m:.3f}", f"{s.tokenizer_cpu * per_m:.3f}",
                               f"{(cpu - s.tokenizer_cpu) * per_m:.3f}"])
        out[s.name] = {"tokens_per_s": ref[s.name], "slice_tokens_per_s": rates, "cores": cpu / wall,
                       "tokenizer_cpu_s": s.tokenizer_cpu if args.tokenizer_cpu else None,
                       "tokens_per_cpu_s": tokens / cpu if cpu else None, "slice_cpu_s": [c for _, _, c in s.slices],
                       "first_batch_s": r.get("first_batch_s"), "digests": r.get("digests")}
    print()
    print(fmt_table(["config", "k tok/s (all slices)", "x tokenizer_alone", "x ceiling", "slice IQR k tok/s",
                     "cores busy", "k tok/CPU-s", "1st batch s", "error"], rows, align="lrrrrrrrl"))
    print("x ceiling: against the tokenizer alone on as many helper threads as the configuration has workers "
          "(tokenizer_alone_thread for 0-1, tokenizer_alone_2threads for 2)")
    if split_rows:
        print()
        print(fmt_table(["config", "CPU s per M tokens", "in tokenizer calls", "the rest"], split_rows, align="lrrr"))
        print("tokens: the batches' tokens (padding included) for loaders, the ids made for the tokenizer alone; "
              "'in tokenizer calls' is the calling threads' CPU inside encode_batch_fast (the tokenizer's own "
              "thread pool is off in these children, so that is all of its work; not so for _pool_ variants)")
    # determinism: every Zephon configuration of one pack algorithm hashed the same warm-up batches
    lines, mismatch, zephon_failed = _targets.zephon_hash_check({c["name"]: {**c, **results[c["name"]]}
                                                                 for c in cfgs if c["name"] in results})
    print()
    print("\n".join(lines))
    code = 1 if mismatch else 2 if zephon_failed else 0
    per_cfg = {s.name: [{"ok": True, "tokens_per_s": pp[s.name]} for pp in per_pass if s.name in pp] for s in slots}
    targets = _targets.target_report(per_cfg)
    print("\n# issue 3 targets, ratios taken inside each pass (passes play the role of rounds)")
    for line in targets:
        print(line)
    machine = [pp["tokenizer_alone_2threads"] / pp["tokenizer_alone_thread"] for pp in per_pass
               if pp.get("tokenizer_alone_thread") and "tokenizer_alone_2threads" in pp]
    if machine:
        targets.append(f"machine {'tokenizer alone, 2 threads / 1 helper thread':<58} median "
                       f"{statistics.median(machine):5.2f}  rounds {min(machine):.2f}-{max(machine):.2f}")
        print(targets[-1])
    totals_lines = _targets.totals_ratio_lines({n: (wall, tok) for n, (wall, tok, _) in totals.items()})
    if totals_lines:
        print("\n# the 2-worker / 1-worker ratio over all slices together (tokens / seconds of each)")
        for line in totals_lines:
            print(line)
    targets += totals_lines
    print(f"\ntotal {total_s:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "machine": machine_info(), "results": out,
                                               "per_pass": per_pass, "targets": targets, "exit_code": code}, indent=1))
        print(f"wrote {args.json}")
    return code


if __name__ == "__main__":
    if "--_slice" in sys.argv:
        child(json.loads(sys.argv[sys.argv.index("--_slice") + 1]))
    sys.exit(main())

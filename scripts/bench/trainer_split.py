#!/usr/bin/env python
"""The trainer thread's CPU per text batch, split into collation and the rest, for two checkouts in turns.

Item 4 of the "past two cores" issue compares the text pipeline with the chain before the redesign. This
script asks how much of a gap the trainer's thread can explain: it builds the text loader (``bench_data``,
2 thread workers, best fit by default) in a fresh process per run, warms it up, then times ``--batches``
calls of ``next()`` with the trainer thread's own CPU clock (``time.thread_time``). ``collate`` is the
module-level function each checkout's loader calls, wrapped for the run. The rest is the lanes' serial
work on this thread (merge, pack, whatever the host does) plus the per-step bookkeeping. Process CPU
(every thread) is split too: the CPU every thread spends inside the Hugging Face tokenizer's
``encode_batch_fast`` calls (timed per call on the calling thread), and the workers' other work (process
less trainer less tokenizer: reading, the ids' conversion, split, ...). ``--prewarm DOCS`` makes each
tokenizer encode the same documents first, as ``sliced.py --prewarm`` does, so that its word cache holds
the same words on both sides. Runs alternate between this checkout and ``--zephon-src`` (``--pairs``
times), so load drifts hit both. ``tokenizer_waits`` counts the times a tokenizer call's thread blocked inside
the call (voluntary context switches): for the GIL at its end, or for a lock inside, such as a malloc arena's.

``--heap`` asks where the tokenizer's waits come from instead (the timings are then not comparable): each
child runs under ``heap_crossings.c`` (built with ``cc``, preloaded), which counts, per thread over the timed
batches, the frees of blocks made by another glibc arena than the thread's own ("foreign"), the mallocs that
got such a block back from the thread's own cache of freed blocks, and the reallocs of such blocks. When the
tokenizer grows or frees such a block it locks the other arena. Foreign frees are also counted by the library
that called ``free``, and (where the GIL is held) by the Python line running then, with its caller.

``--memo`` times Zephon's own Python instead, without the tokenizer's work: the loader runs with 0 workers,
every stage on the calling thread, and each ``encode_batch_fast`` result is memoised in a first, untimed pass
over the same batches, so that a second, timed pass on a fresh loader costs only what surrounds the tokenizer
(the run fails if that pass misses the memo). The process's CPU per batch is split into the chunks' work
(reading, Arrow's decoding on its own threads included, the ids' conversion, the transforms, and the memo's
lookup, tens of µs a call: the process's CPU inside each checkout's per-chunk entry point, ``StageProgram.run``
or, before the redesign, ``ChunkWorker.__call__``, so the line between the two sides is drawn where each
checkout draws it) and the lanes' (mix, pack, collate, bookkeeping). ``--prewarm`` does not apply.

    mkdir -p /tmp/zephon_e852 && git archive e852c99 zephon | tar -x -C /tmp/zephon_e852   # before the redesign
    python scripts/bench/trainer_split.py --data bench_data --zephon-src /tmp/zephon_e852 --pairs 3
    python scripts/bench/trainer_split.py --data bench_data --zephon-src /tmp/zephon_e852 --pairs 2 --heap
    python scripts/bench/trainer_split.py --data bench_data --zephon-src /tmp/zephon_e852 --pairs 4 --memo
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from statistics import median

HERE = Path(__file__).resolve().parent


def _flush_by(args: argparse.Namespace) -> dict[str, str]:
    """The builder's flush_by: given to both sides, but for a checkout from before it existed (which flushes by units)."""
    from _common import has_flush_by

    if not args.zephon_src or has_flush_by(args.zephon_src):
        return {"flush_by": args.flush_by}
    if args.flush_by != "units":
        raise SystemExit(f"--zephon-src {args.zephon_src} has no flush_by (it flushes by units): use --flush-by units")
    return {}


def _timed(fn, total: list[float], clock=time.thread_time):
    """``fn``, adding the ``clock`` time inside each call to ``total[0]``."""
    def timed(*a, **kw):
        t = clock()
        try:
            return fn(*a, **kw)
        finally:
            total[0] += clock() - t
    return timed


def memo_child(args: argparse.Namespace) -> None:
    """``--memo``: one run in this process, on one thread with the tokenizer's results memoised; one JSON line."""
    import gc
    import importlib

    import tokenizers

    import _pipelines

    memo: dict[tuple[str, tuple[str, ...]], object] = {}
    misses = [0]
    load = tokenizers.Tokenizer.from_file

    class Memoised:
        """A loaded tokenizer whose batch calls give the first call's result for the same texts again."""

        def __init__(self, tok, path):
            self._tok, self._path = tok, str(path)

        def __getattr__(self, name):
            return getattr(self._tok, name)

        def encode_batch_fast(self, texts, *a, **kw):
            key = (self._path, tuple(texts))  # a checkout may load its tokenizer again for the second loader
            if key not in memo:
                misses[0] += 1
                memo[key] = self._tok.encode_batch_fast(texts, *a, **kw)
            return memo[key]

    tokenizers.Tokenizer.from_file = lambda path, **kw: Memoised(load(path, **kw), path)  # type: ignore[method-assign]
    # each checkout's per-chunk entry point, and its helper thread for large chunks bypassed (one thread)
    import zephon

    # asked of the files, not of the import system: an editable install's finder would find this checkout's
    # zephon.engine for a --zephon-src package that has none
    if (Path(zephon.__file__).parent / "engine" / "stages.py").exists():
        module = importlib.import_module("zephon.engine.stages")
        owner, entry = module.StageProgram, "run"
    else:  # a checkout from before the redesign
        module = importlib.import_module("zephon.runner")
        owner, entry = module.ChunkWorker, "__call__"
    module.run_off_main_thread = lambda fn, *a: fn(*a)
    chunk_s = [0.0]
    # the process's clock: Arrow decodes a row group on its own threads while the caller waits
    setattr(owner, entry, _timed(getattr(owner, entry), chunk_s, time.process_time))
    extra = _flush_by(args)

    def build():
        return _pipelines.BUILDERS["zephon"](Path(args.data).resolve(), 32, 2048, workers=0, runner="thread",
                                             algorithm=args.algorithm, **extra)

    for _pass in range(2):  # the first pass fills the memo; the second, on a fresh loader, is timed
        it, close, _ = build()
        try:
            for _ in range(args.warmup):
                next(it)
            gc.collect()  # the first pass's garbage is not the timed pass's work
            chunk_s[0], misses[0], t0 = 0.0, 0, time.process_time()
            for _ in range(args.batches):
                next(it)
            total = time.process_time() - t0
        finally:
            close()
    if misses[0]:
        raise SystemExit(f"--memo: the timed pass made {misses[0]} tokenizer calls the first pass had not made")
    n = args.batches
    print(json.dumps({"total_ms": 1e3 * total / n, "chunks_ms": 1e3 * chunk_s[0] / n,
                      "lanes_ms": 1e3 * (total - chunk_s[0]) / n}), flush=True)


def child(args: argparse.Namespace) -> None:
    """One run in this process: print one JSON line of per-batch figures."""
    if args.zephon_src:
        sys.path.insert(0, str(Path(args.zephon_src).resolve()))
    sys.path.insert(0, str(HERE))
    # the tokenizer's own thread pool off: its work stays on the calling thread, where the per-call clock sees it
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if args.memo:
        memo_child(args)
        return
    import resource

    import tokenizers

    import _pipelines

    if args.prewarm:
        from sliced import _prewarm_tokenizers

        _prewarm_tokenizers(Path(args.data).resolve(), args.prewarm)
    tokenizer_s, waits, lock, load = [0.0], [0], threading.Lock(), tokenizers.Tokenizer.from_file

    class Timed:
        """A loaded tokenizer whose batch calls add their thread's CPU time to ``tokenizer_s``."""

        def __init__(self, tok):
            self._tok = tok

        def __getattr__(self, name):
            return getattr(self._tok, name)

        def encode_batch_fast(self, *a, **kw):
            t, w = time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
            try:
                return self._tok.encode_batch_fast(*a, **kw)
            finally:
                # read before taking the lock: a wait for it is not the tokenizer's
                dt, dw = time.thread_time() - t, resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - w
                with lock:
                    tokenizer_s[0] += dt
                    waits[0] += dw

    tokenizers.Tokenizer.from_file = lambda *a, **kw: Timed(load(*a, **kw))  # type: ignore[method-assign]
    import zephon.loader as loader_module

    collate_s = [0.0]
    loader_module.collate = _timed(loader_module.collate, collate_s)
    # a checkout before the redesign has no flush_by: its cadence is by units, which --flush-by units matches
    extra = _flush_by(args)
    it, close, _ = _pipelines.BUILDERS["zephon"](Path(args.data).resolve(), 32, 2048, workers=args.workers,
                                                 runner="thread", algorithm=args.algorithm, **extra)
    heap = ctypes.CDLL(os.environ["LD_PRELOAD"].split()[0]) if args.heap else None
    try:
        for _ in range(args.warmup):
            next(it)
        collate_s[0] = tokenizer_s[0] = 0.0
        waits[0] = 0
        faults0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        wall0, thread0, proc0 = time.perf_counter(), time.thread_time(), time.process_time()
        if heap:
            heap.heap_counting(1)
        for _ in range(args.batches):
            next(it)
        if heap:
            heap.heap_counting(0)
            print(json.dumps(_heap_counts(heap, args.batches)), flush=True)
            return
        wall, thread, proc = (time.perf_counter() - wall0, time.thread_time() - thread0,
                              time.process_time() - proc0)
        tok = tokenizer_s[0]
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults0
    finally:
        close()
    n = args.batches
    print(json.dumps({"trainer_ms": 1e3 * thread / n, "collate_ms": 1e3 * collate_s[0] / n,
                      "rest_ms": 1e3 * (thread - collate_s[0]) / n, "process_ms": 1e3 * proc / n,
                      "tokenizer_ms": 1e3 * tok / n, "workers_other_ms": 1e3 * (proc - thread - tok) / n,
                      "wall_ms": 1e3 * wall / n, "trainer_faults": faults / n, "tokenizer_waits": waits[0] / n}),
          flush=True)


def _heap_counts(heap, batches: int) -> dict[str, float]:
    """heap_crossings.c's counts per batch, summed by kind of thread (scaling_model.thread_kind: the trainer
    with the inline helper it waits for, the workers, ...); threads Python did not start are left out."""
    from collections import defaultdict

    from scaling_model import thread_kind

    kinds = {t.native_id: thread_kind(t) for t in threading.enumerate()}
    out: defaultdict[str, float] = defaultdict(float)
    with tempfile.NamedTemporaryFile("r", suffix=".txt") as f:
        heap.heap_dump(f.name.encode())
        for line in f:
            fields = line.rstrip("\n").split("\t")
            if fields[0] == "N":
                if int(fields[1]) > 64:
                    raise RuntimeError(f"{fields[1]} threads allocated: heap_crossings.c keeps 64 apart")
                continue
            who = kinds.get(int(fields[1]))
            if who is None:
                continue
            if fields[0] == "T":
                for name, value in zip(("foreign_mallocs", "frees", "foreign_frees", "foreign_reallocs"), fields[2:]):
                    out[f"{who}_{name}"] += int(value) / batches
            elif fields[0] == "L":  # the foreign frees by the library that called free
                out[f"{who}_foreign_frees_in_{Path(fields[2]).name}"] += int(fields[3]) / batches
            else:  # "P": the library and Python line (GIL held) under which a foreign block was freed
                out[f"{who}_foreign_frees_in_{fields[3]}_under {fields[4]}"] += int(fields[2]) / batches
    return dict(out)


def _build_heap_shim(folder: str) -> str:
    if sys.version_info[:3] == (3, 11, 0):
        raise SystemExit("--heap needs Python 3.11.1 or later (heap_crossings.c reads the running frame)")
    so = str(Path(folder) / "heap_crossings.so")
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", "-o", so,
                    str(HERE / "heap_crossings.c")], check=True)
    return so


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="bench_data")
    ap.add_argument("--zephon-src", default="", help="a checkout whose zephon/ to compare with this one")
    ap.add_argument("--pairs", type=int, default=3, help="runs of each side, alternating")
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--algorithm", default="best_fit")
    ap.add_argument("--flush-by", default="units", choices=("units", "chunks"))
    ap.add_argument("--prewarm", type=int, default=0, help="documents each tokenizer encodes first (0: none)")
    ap.add_argument("--heap", action="store_true", help="count blocks freed by another arena's thread, not timing")
    ap.add_argument("--memo", action="store_true",
                    help="time Zephon's own work on one thread, each tokenizer result memoised (not the tokenizer)")
    ap.add_argument("--json", default="")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memo and args.heap:
        ap.error("--memo and --heap are two different runs: pick one")
    if args.memo:
        args.workers, args.prewarm = 0, 0  # what the memo runs use, and what --json records
    if args.child:
        child(args)
        return 0
    sys.path.insert(0, str(HERE))
    from _common import machine_info, require_data

    require_data(Path(args.data).resolve())
    sides = [("this checkout", "")] + ([("--zephon-src", args.zephon_src)] if args.zephon_src else [])
    runs: dict[str, list[dict]] = {name: [] for name, _ in sides}
    base = [sys.executable, __file__, "--child", "--data", args.data, "--batches", str(args.batches), "--warmup",
            str(args.warmup), "--workers", str(args.workers), "--algorithm", args.algorithm,
            "--flush-by", args.flush_by, "--prewarm", str(args.prewarm)] + (["--heap"] if args.heap else []) \
        + (["--memo"] if args.memo else [])
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "LD_PRELOAD": " ".join(filter(None, [_build_heap_shim(folder),
                                                                  os.environ.get("LD_PRELOAD")]))} \
            if args.heap else None
        for _ in range(args.pairs):
            for name, src in sides:
                done = subprocess.run(base + (["--zephon-src", src] if src else []), capture_output=True, text=True,
                                      env=env)
                if done.returncode:
                    raise SystemExit(f"the {name} run failed:\n{done.stderr[-3000:]}")
                runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "args": vars(args), "runs": runs}, indent=1))
    if args.heap:
        keys = tuple(sorted({k for rs in runs.values() for r in rs for k in r}))
        print(f"# {args.pairs} runs a side, {args.batches} batches of [32, 2048] each, {args.algorithm}, "
              f"{args.workers} thread workers, flush_by {args.flush_by}; medians of events per batch (a missing "
              f"one: 0); foreign: a block another arena than the thread's own made")
        print("| count | " + " | ".join(runs) + " |\n|---|" + "---|" * len(runs))
        for k in keys:
            values = [median(r.get(k, 0) for r in rs) for rs in runs.values()]
            if "_under " not in k or max(values) >= 0.1:  # Python lines: only those of 0.1 a batch or more
                print(f"| {k} | " + " | ".join(f"{v:,.1f}" for v in values) + " |")
        return 0
    if args.memo:
        keys: tuple[str, ...] = ("total_ms", "chunks_ms", "lanes_ms")
        print(f"# {args.pairs} runs a side, {args.batches} batches of [32, 2048] each, {args.algorithm}, one thread, "
              f"tokenizer results memoised; medians, CPU ms per batch")
    else:
        keys = ("trainer_ms", "collate_ms", "rest_ms", "process_ms", "tokenizer_ms", "workers_other_ms",
                "trainer_faults", "tokenizer_waits", "wall_ms")
        print(f"# {args.pairs} runs a side, {args.batches} batches of [32, 2048] each, {args.algorithm}, "
              f"{args.workers} thread workers; medians, ms per batch (faults, waits: per batch)")
    print(f"| side | {' | '.join(keys)} |\n|---|{'---|' * len(keys)}")
    for name, rs in runs.items():
        print(f"| {name} | " + " | ".join(f"{median(r[k] for r in rs):.2f}" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

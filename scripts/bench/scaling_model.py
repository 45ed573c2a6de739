#!/usr/bin/env python
"""A scaling model from measurements (issue 46): CPU per unit of work by thread kind, projected to 1-32 workers.

Every other figure of BENCHMARKS.md comes from a 2-core VM; users run 8 ranks on 16-128 cores a node. This
script measures, for three pipelines, where each unit of work spends its CPU time, and projects a rank's
throughput for more workers and more cores with an Amdahl/GIL model:

  text         bench_data's recipe (Parquet -> tokenize + EOS -> best_fit pack -> [32, 2048]), unit 1M tokens
  vl_fetch     vl_fetch_batch.py's Zephon pipeline (WebDataset image bytes + caption, 256 a batch), unit 1k samples
  vl_pipeline  vl_pipeline.py's Zephon pipeline (decode_images + tokenize_images + pack [8, 4096]), unit 1k images

Measured, in one subprocess per run (``_common.run_task``): CPU seconds per unit on each kind of thread
of the rank's process, from each thread's own CPU clock (``pthread_getcpuclockid``) over a timed window
after a warm-up, and the wall-clock rate over that window:

  trainer      the thread calling next(loader): with steps_ahead=0 (text, VL fetch) the lanes' serial work
               (merge, pack / rows) and the collation, plus the loader's and the harness's bookkeeping
  steps_ahead  the thread that runs the lanes and the collation ahead of the trainer (pipelines that pack
               images, with workers: VL pipeline)
  workers      the worker threads (thread runner) split into *released* CPU (time inside the calls that let
               go of the GIL, each timed with ``time.thread_time`` by a wrapper installed at run time: the
               tokenizer's batch call ``encode_batch_fast``, pyarrow's ``read_row_group``, the shard reader's
               ``pread``, simplejpeg's ``decode_jpeg``, Pillow's ``load``/``convert``/``resize``/``fromarray``,
               ``patchify``'s copy) and *held* CPU (the rest of the thread's CPU: Python reading, framing,
               per-record work, Pillow-to-numpy copies); with the pool runner, the worker processes' CPU
               (psutil), whose GIL is their own
  other        any other thread of the process (the pool's result-handling thread, which unpickles results)

The collation's pixel copy (``zephon.batches.images._flat``: one ``np.concatenate``) and the transfer's read of a
worker's arrays (``os.preadv`` in ``transfer.receive``) count as released too. ``--gil-check`` shows which
of these calls let go of the GIL (a thread spinning Python beside each; ``np.asarray`` of a Pillow image
holds it, so it is left in the held part). Per pipeline, three runs of the thread runner (a calibration
run at 1 worker, whose costs feed the model, then 1 and 2 workers to check the model against), and the
same three with the pool runner for the pipelines where it differs (VL fetch's source has no transform,
so its pool reads on threads: the thread runner's run). The calibration run also times the trainer's
parts (loader ``next()``, the lanes' step, the collation, the transfer from worker processes) and, for an
extra window, samples the trainer's thread on its own CPU clock to split the lanes' step further.

The model (assumptions; see also BENCHMARKS.md, "Scaling model"): a rank's throughput with W workers and C
cores is the least of these bounds (units/s), each a resource that cannot do more than one second of
work per second:

  thread runner    trainer thread: 1 / T;  steps-ahead thread: 1 / A;  workers: W / (Wh + Wr);
                   GIL: 1 / (T + Ah + Wh + O) (every GIL-held second of the process is serial);
                   cores: C / (T + A + Wh + Wr + O)
  pool runner      trainer thread: 1 / T;  steps-ahead thread: 1 / A;  workers: W / P (P: the worker
                   processes' CPU per unit, each with its own GIL); GIL of the trainer's process: 1 / (T + Ah
                   + O) (the transfer of each result, ``receive`` and unpickling, is in T, A and O);
                   cores: C / (T + A + O + P)
  (a read-only stage of the pool runner stays on threads: their Wh and Wr join the GIL, workers and cores)

T, A, Wh, Wr, O, P: CPU seconds per unit from the calibration run; Ah the held part of A. CPU per unit is
taken as constant in W (no contention, no GIL hand-over cost, no memory-bandwidth limit, no waits for the
burstiness of a packing lane), the tokenizer on one core per call (RAYON_NUM_THREADS=1, which Zephon
also sets when workers >= cores), and the I/O from the page cache. A pipeline saturates at the W where
the worker bound meets the least of the others; what it meets is what saturates it. The check against
the 1- and 2-worker runs predicts at this machine's cores and at the cores other tenants left during the
run (its cores less the CPU that other processes and the hypervisor took, from psutil.cpu_times).

    python scripts/bench/scaling_model.py --data bench_data --vl-data bench_data/vl \\
        --out results/scaling_model.json --png docs/scaling_model.png
    python scripts/bench/scaling_model.py --data D --vl-data V --quick --out /tmp/s.json --png /tmp/s.png  # smoke

Exit status: 0 ok, 2 a run failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fmt_table, machine_info, measure_stream, require_data, run_task, task_main  # noqa: E402
import vl_common as vc  # noqa: E402

SCRIPT = Path(__file__).resolve()

PIPELINES: dict[str, dict[str, Any]] = {
    # unit: what the per-unit CPU is for; scale: counted things per unit; rate: how throughput is shown
    "text": {"unit": "1M tokens", "scale": 1e6, "rate": "M tokens/s", "rate_scale": 1e6,
             "runners": ("thread", "pool"), "window": (48, 64, 100), "quick": (2, 2, 1)},
    "vl_fetch": {"unit": "1k samples", "scale": 1e3, "rate": "k samples/s", "rate_scale": 1e3,
                 "runners": ("thread",), "window": (300, 1000, 3000), "quick": (2, 4, 2)},
    "vl_pipeline": {"unit": "1k images", "scale": 1e3, "rate": "images/s", "rate_scale": 1.0,
                    "runners": ("thread", "pool"), "window": (40, 40, 0), "quick": (2, 5, 0)},
}  # window: (warm-up batches, timed batches, batches sampled on the trainer's thread after the window; the VL
#   pipeline's trainer only reads a queue: its lanes' parts are timed on the steps-ahead thread instead)
KINDS = ("trainer", "steps_ahead", "workers", "other")
WORKERS = (1, 2, 4, 8, 16, 32)
CORES = (2, 4, 8, 16)


# -- instrumentation (in the measured child) --------------------------------------------------------------
def thread_kind(t: threading.Thread) -> str:
    if t is threading.main_thread():
        return "trainer"
    if t.name.startswith("zephon-steps-ahead"):
        return "steps_ahead"
    if t.name.startswith("zephon-chunk-inline"):
        return "trainer"  # 0 workers only: the trainer waits for this helper (stages.run_off_main_thread)
    if t.name.startswith("zephon-chunk"):
        return "workers"
    return "other"


class Recorder:
    """Thread CPU inside chosen calls, per thread and label. ``nested=False``: only the outermost recorded
    call of a thread counts (a Pillow ``convert`` that calls ``load`` is counted once). Calls still open at a
    snapshot count up to it (the window's edges cut a long call, e.g. a 2 ms image decode, where it is)."""

    def __init__(self, nested: bool) -> None:
        self.nested = nested
        self.by_thread: dict[int, dict[str, float]] = {}
        self.open: dict[tuple[int, str], float] = {}  # (thread, label) -> its thread clock at entry
        self._local = threading.local()

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        setattr(owner, attr, self.timed(getattr(owner, attr), label))

    def timed(self, fn: Callable, label: str) -> Callable:
        rec, clock = self, time.thread_time

        def timed(*args: Any, **kwargs: Any) -> Any:
            loc = rec._local
            if not rec.nested and getattr(loc, "busy", False):
                return fn(*args, **kwargs)
            ident = threading.get_ident()
            loc.busy, t0 = True, clock()
            rec.open[(ident, label)] = t0
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t0
                rec.open.pop((ident, label), None)
                loc.busy = False
                d = rec.by_thread.setdefault(ident, {})
                d[label] = d.get(label, 0.0) + dt

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def snapshot(self, clocks: dict[int, float]) -> dict[int, dict[str, float]]:
        """Recorded CPU per thread and label, open calls included up to ``clocks`` (each thread's CPU clock)."""
        out = {k: dict(v) for k, v in list(self.by_thread.items())}
        for (ident, label), t0 in list(self.open.items()):
            if ident in clocks:
                d = out.setdefault(ident, {})
                d[label] = d.get(label, 0.0) + max(0.0, clocks[ident] - t0)
        return out


class _TimedTokenizer:
    """A Hugging Face tokenizer whose batch call is recorded; everything else is the tokenizer's."""

    def __init__(self, tok: Any, call: Callable) -> None:
        self._tok, self.encode_batch_fast = tok, call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def instrument() -> tuple[Recorder, Recorder]:
    """Install the wrappers (this process only): (released calls, the trainer's parts)."""
    import PIL.Image
    import PIL.ImageFile
    import pyarrow.parquet as pq
    import simplejpeg
    import tokenizers

    import zephon.batches.images as collate_images
    import zephon.engine.executors as executors
    import zephon.ops.decode_images as image_op
    import zephon.readers.webdataset as wds
    import zephon.tokenization as tokenization
    from zephon.engine.hosts import LocalLanes
    from zephon.loader import ZephonLoader

    released, parts = Recorder(nested=False), Recorder(nested=True)
    released.wrap(pq.ParquetFile, "read_row_group", "parquet read")
    released.wrap(wds, "_pread_all", "shard read (pread)")
    released.wrap(simplejpeg, "decode_jpeg", "JPEG decode (simplejpeg)")
    released.wrap(PIL.ImageFile.ImageFile, "load", "Pillow decode (load/convert)")
    released.wrap(PIL.Image.Image, "convert", "Pillow decode (load/convert)")
    released.wrap(PIL.Image.Image, "resize", "Pillow resize")
    released.wrap(PIL.Image, "fromarray", "pixel copies (Image.fromarray, patchify)")
    released.wrap(image_op, "patchify", "pixel copies (Image.fromarray, patchify)")
    released.wrap(collate_images, "_flat", "pixel collation copy")
    released.wrap(os, "preadv", "transfer read (preadv)")  # zephon.engine.transfer.receive: a result's arrays

    # The tokenizer's own lambda calls tok.encode_batch_fast on the object from_file returned: hand it a
    # proxy whose batch call is recorded (only while Zephon loads a Hugging Face tokenizer).
    load_hf = tokenization.Tokenizer._load_huggingface

    def timed_from_file(real: Any) -> Any:
        def from_file(path: str) -> Any:
            tok = real.from_file(path)
            return _TimedTokenizer(tok, released.timed(tok.encode_batch_fast, "tokenizer (encode_batch_fast)"))
        return type("_HF", (), {"from_file": staticmethod(from_file)})

    def _load_huggingface(self: Any, path: Path) -> None:
        real = tokenizers.Tokenizer
        tokenizers.Tokenizer = timed_from_file(real)
        try:
            load_hf(self, path)
        finally:
            tokenizers.Tokenizer = real

    tokenization.Tokenizer._load_huggingface = _load_huggingface
    parts.wrap(ZephonLoader, "_next_batch", "loader next()")
    parts.wrap(LocalLanes, "next_step", "lanes (merge, pack/rows, waits)")
    parts.wrap(ZephonLoader, "_collate", "collation")
    parts.wrap(executors, "receive", "transfer from worker processes (receive)")
    return released, parts


def cpu_snapshot() -> dict[str, Any]:
    """Every live thread's CPU clock, the process's and its children's CPU, and the wall clock."""
    import resource

    import psutil

    threads = {}
    for t in threading.enumerate():
        try:
            threads[t.ident] = (t.name, thread_kind(t), time.clock_gettime(time.pthread_getcpuclockid(t.ident)))
        except (OSError, TypeError):  # a thread that ended meanwhile
            pass
    ct = psutil.cpu_times()  # the whole machine's: what other tenants of a shared VM take
    machine = sum(getattr(ct, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))
    ru = resource.getrusage(resource.RUSAGE_SELF)
    children = 0.0
    for c in psutil.Process().children(recursive=True):
        try:
            ct = c.cpu_times()
            children += ct.user + ct.system
        except psutil.Error:
            pass
    return {"wall": time.perf_counter(), "threads": threads, "process": ru.ru_utime + ru.ru_stime,
            "children": children, "machine": machine}


def window_cpu(a: dict, b: dict, rel_a: dict, rel_b: dict, parts_a: dict, parts_b: dict) -> dict[str, Any]:
    """CPU seconds between two snapshots, by thread kind: total, released (recorded calls), held (the rest),
    the released calls and the trainer's parts by label."""
    kinds = {k: {"total": 0.0, "released": 0.0, "threads": 0, "released_calls": {}, "parts": {}} for k in KINDS}
    for ident, (name, kind, cpu1) in b["threads"].items():
        cpu0 = a["threads"].get(ident, (name, kind, 0.0))[2]  # a thread born in the window counts from 0
        k = kinds[kind]
        k["total"] += cpu1 - cpu0
        k["threads"] += 1
        for before, after, into in ((rel_a, rel_b, "released_calls"), (parts_a, parts_b, "parts")):
            was = before.get(ident, {})
            for label, v in after.get(ident, {}).items():
                k[into][label] = k[into].get(label, 0.0) + v - was.get(label, 0.0)
    for k in kinds.values():
        k["released"] = sum(k["released_calls"].values())
        k["held"] = k["total"] - k["released"]
    wall, own = b["wall"] - a["wall"], b["process"] - a["process"] + b["children"] - a["children"]
    others = max(0.0, (b["machine"] - a["machine"] - own) / wall)  # cores other processes (and steal) took
    return {"kinds": kinds, "wall": wall, "process": b["process"] - a["process"],
            "children": b["children"] - a["children"], "others_cores": others,
            "available_cores": max(0.5, (os.cpu_count() or 1) - others)}


class _ThreadCpuTimer:
    """A POSIX timer on this thread's CPU clock that sends ``signum`` to this thread every ``interval`` s of
    its CPU (``timer_create(CLOCK_THREAD_CPUTIME_ID)`` with ``SIGEV_THREAD_ID``, through ctypes; Linux)."""

    def __init__(self, signum: int, interval: float) -> None:
        import ctypes

        class SigEvent(ctypes.Structure):
            _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                        ("tid", ctypes.c_int), ("pad", ctypes.c_int * 11)]

        class TimeSpec(ctypes.Structure):
            _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]

        class ITimerSpec(ctypes.Structure):
            _fields_ = [("interval", TimeSpec), ("value", TimeSpec)]

        self._libc = ctypes.CDLL(None, use_errno=True)
        ev = SigEvent(None, signum, 4, threading.get_native_id())  # 4: SIGEV_THREAD_ID
        self._timer = ctypes.c_void_p()
        if self._libc.timer_create(3, ctypes.byref(ev), ctypes.byref(self._timer)):  # 3: CLOCK_THREAD_CPUTIME_ID
            raise OSError(ctypes.get_errno(), "timer_create")
        sec, ns = int(interval), int((interval % 1) * 1e9)
        self._spec = ITimerSpec(TimeSpec(sec, ns), TimeSpec(sec, ns))
        self._off = ITimerSpec()

    def start(self) -> None:
        import ctypes

        self._libc.timer_settime(self._timer, 0, ctypes.byref(self._spec), None)

    def stop(self) -> None:
        import ctypes

        self._libc.timer_settime(self._timer, 0, ctypes.byref(self._off), None)
        self._libc.timer_delete(self._timer)


def profile_trainer(it: Any, batches: int, count: Callable[[Any], int], interval: float = 0.004,
                    min_samples: int = 10) -> dict[str, Any]:
    """Where the trainer's thread spends its CPU over ``batches`` more batches (more, up to 50 times as many,
    until ``min_samples`` samples are in: a few fast batches may not cross one interval), by sampling: a signal every
    ``interval`` s of *this thread's* CPU (:class:`_ThreadCpuTimer`, so samples fall while it runs, never
    while it waits for a worker or the GIL; the kernel checks such timers at its scheduler tick, 4 ms here,
    so finer intervals give no more samples); the handler walks the stack from the innermost frame out to the
    first that names a part (``_PROFILE_PARTS``) and counts one sample for it and for the innermost Python
    function. Unlike a deterministic profiler it adds no cost per call, which would inflate the per-sample
    steps (many small calls) against the collation (few large ones)."""
    import signal

    parts: dict[str, int] = {}
    leaves: dict[str, int] = {}
    cache: dict[Any, str] = {}

    def handler(signum: int, frame: Any) -> None:
        f, part = frame, None
        while f is not None and part is None:
            code = f.f_code
            part = cache.get(code)
            if part is None:
                part = cache[code] = profile_category((code.co_filename, 0, code.co_name))
            if part == "other":
                part = None
            f = f.f_back
        part = part or "other"
        parts[part] = parts.get(part, 0) + 1
        leaf = f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_firstlineno}({frame.f_code.co_name})"
        leaves[leaf] = leaves.get(leaf, 0) + 1

    old = signal.signal(signal.SIGPROF, handler)
    timer = _ThreadCpuTimer(signal.SIGPROF, interval)
    units, t0 = 0, time.thread_time()
    timer.start()
    try:
        done = 0
        while done < batches or (sum(parts.values()) < min_samples and done < 50 * batches):
            try:
                batch = next(it)
            except StopIteration:
                if done < batches:
                    raise
                break  # finite data: the samples so far
            units += count(batch)
            done += 1
    finally:
        timer.stop()
        signal.signal(signal.SIGPROF, old)
    n = sum(parts.values()) or 1
    return {"units": units, "thread_cpu_s": time.thread_time() - t0, "samples": n, "interval_s": interval,
            "share_by_part": {c: v / n for c, v in sorted(parts.items(), key=lambda kv: -kv[1])},
            "top": [{"function": k, "share": v / n} for k, v in sorted(leaves.items(), key=lambda kv: -kv[1])[:15]]}


_PROFILE_PARTS: list[tuple[str, str, str]] = [  # (file path fragment, function name or "*", part), first match wins
    ("zephon/collate", "*", "collation"),
    ("zephon/batch_buffers", "*", "collation"),
    ("torch/", "*", "collation"),
    ("scaling_model.py", "timed", "instrumentation (this script's wrappers)"),
    ("zephon/engine/sources.py", "take", "per-sample document dict (SourceStream.take)"),
    ("zephon/records.py", "n", "chunk hand-off (stage buffers, futures)"),
    ("zephon/records.py", "*", "per-sample document dict (SourceStream.take)"),
    ("zephon/engine/nodes.py", "*", "merge and accumulator nodes"),
    ("zephon/ops/", "*", "merge and accumulator nodes"),
    ("zephon/engine/lane.py", "*", "lane rows and state per step"),
    ("zephon/engine/hosts.py", "*", "lane rows and state per step"),
    ("zephon/engine/counters.py", "*", "lane rows and state per step"),
    ("zephon/engine/sources.py", "*", "chunk hand-off (stage buffers, futures)"),
    ("zephon/engine/executors.py", "*", "chunk hand-off (stage buffers, futures)"),
    ("zephon/engine/transfer.py", "*", "chunk hand-off (stage buffers, futures)"),
    ("zephon/plan.py", "*", "chunk hand-off (stage buffers, futures)"),
    ("concurrent/futures", "*", "chunk hand-off (stage buffers, futures)"),
    ("threading.py", "*", "chunk hand-off (stage buffers, futures)"),
    ("queue.py", "*", "steps-ahead queue"),
    ("zephon/engine/steps_ahead.py", "*", "steps-ahead queue"),
    ("torchdata/", "*", "torchdata node plumbing (__next__)"),
    ("zephon/loader.py", "*", "loader next() bookkeeping"),
    ("scaling_model.py", "*", "harness (counting units)"),
    ("_common.py", "*", "harness (counting units)"),
]


def profile_category(func: tuple) -> str:
    path, _, name = func
    for frag, fname, part in _PROFILE_PARTS:
        if frag in path.replace(os.sep, "/") and fname in ("*", name):
            return part
    return "other"


# -- one run (in its own subprocess) ----------------------------------------------------------------------
def build(pipeline: str, text_data: Path, vl_data: Path, workers: int, runner: str):
    """(batch iterator, close, count(batch) -> units counted in that batch)."""
    if pipeline == "text":
        from _pipelines import build_zephon, zephon_recipe

        r = zephon_recipe(text_data)
        it, close, _ = build_zephon(text_data, r.global_batch_size, r.seq_len, workers=workers, runner=runner)
        return it, close, (lambda b: int(b["input_ids"].numel()))
    if pipeline == "vl_fetch":
        import vl_fetch_batch

        loader = vl_fetch_batch.zephon_pipeline(vl_data, "fetch").build(rank=0, world_size=1, num_workers=workers,
                                                                       runner=runner)
        return iter(loader), loader.close, (lambda b: int(b["valid"].sum()))
    import vl_pipeline

    loader = vl_pipeline.zephon_pipeline(vl_data).build(rank=0, world_size=1, num_workers=workers, runner=runner)
    return iter(loader), loader.close, (lambda b: len(b["image_grid_thw"]))


def run_one(task: dict[str, Any]) -> dict[str, Any]:
    released, parts = instrument()
    pipeline, warmup, steps, prof = task["pipeline"], task["warmup"], task["steps"], task["profile"]
    holder: dict[str, Any] = {}
    counts: list[int] = []
    snaps: list[tuple] = []

    def make():
        it, close, count = build(pipeline, Path(task["data"]), Path(task["vl_data"]), task["workers"], task["runner"])
        holder.update(it=it, count=count)
        return it, close

    def mark() -> None:
        snap = cpu_snapshot()
        clocks = {ident: v[2] for ident, v in snap["threads"].items()}
        snaps.append((snap, released.snapshot(clocks), parts.snapshot(clocks)))

    def on_batch(run: int, index: int, b: Any) -> None:
        counts.append(holder["count"](b))
        if index == max(1, warmup) - 1:  # the last warm-up batch: the window starts here
            mark()

    def after_window(run: int) -> dict:
        mark()
        if prof:  # the calibration run: where the trainer's thread spends its time, outside the window
            holder["profile"] = profile_trainer(holder["it"], prof, holder["count"])
        return {}

    load_before = vc.load_now()
    res = measure_stream(make, steps, warmup, 1, 1, on_batch=on_batch, after_window=after_window, tail=0)
    (a, ra, pa), (b, rb, pb) = snaps
    cpu = window_cpu(a, b, ra, rb, pa, pb)
    w0 = max(1, warmup)
    units = sum(counts[w0:w0 + steps])
    seconds = res["runs"][0]["seconds"]
    return {"units": units, "seconds": seconds, "rate": units / seconds, "first_batch_s": res["first_batch_s"],
            "cpu": cpu, "profile": holder.get("profile"), "load_before": load_before, "load_after": vc.load_now()}


def gil_check(task: dict[str, Any]) -> dict[str, Any]:
    """Which calls let go of the GIL (the wrappers count them as released): a helper thread loops each call
    while this thread spins Python for ``seconds``; this thread's progress against spinning alone, and in how
    many of ``reps`` repeats it was nearer the released control (a hash of a large buffer) than the held one
    (a Python loop: ~0.5, the GIL switching every 5 ms). Another tenant's load lowers the released control
    (the helper then competes for a core), so only the verdict is read, not a share."""
    import hashlib
    import io

    import numpy as np
    import pyarrow.parquet as pq
    import simplejpeg
    from PIL import Image
    from tokenizers import Tokenizer

    vl, text = Path(task["vl_data"]), Path(task["data"])
    samples = list(vc.iter_samples(vl, 1))[:64]
    jpeg = next(img for _, img, _ in samples if img[:3] == b"\xff\xd8\xff")
    png = next((img for _, img, _ in samples if img[:4] == b"\x89PNG"), None)
    px = simplejpeg.decode_jpeg(jpeg, colorspace="RGB")
    im, big = Image.fromarray(px), np.ascontiguousarray(np.resize(px, (448, 448, 3)))
    patches = [vc.patchify(big) for _ in range(8)]
    flat = np.empty((sum(len(a) for a in patches), patches[0].shape[1]), np.uint8)
    tok = Tokenizer.from_file(str(vl / "native" / "bpe.json"))
    captions = [c for _, _, c in samples]
    pf = pq.ParquetFile(sorted((text / "parquet").glob("*.parquet"))[0])
    fd = os.open(vc.shards(vl)[0], os.O_RDONLY)
    buf = bytes(8_000_000)
    calls = {"held control (Python loop)": lambda: sum(range(20_000)),
             "released control (sha256 of 8 MB)": lambda: hashlib.sha256(buf).digest(),
             "simplejpeg.decode_jpeg": lambda: simplejpeg.decode_jpeg(jpeg, colorspace="RGB"),
             "Image.resize": lambda: im.resize((448, 448), Image.Resampling.BICUBIC),
             "Image.fromarray": lambda: Image.fromarray(big),
             **({"Pillow PNG load (ImageFile.load)": lambda: Image.open(io.BytesIO(png)).load()} if png else {}),
             "patchify": lambda: vc.patchify(big),
             "np.asarray(Image) (counted held)": lambda: np.asarray(im),
             "np.concatenate(out=) (pixel collation)": lambda: np.concatenate(patches, out=flat),
             "os.pread (1.5 MB, page cache)": lambda: os.pread(fd, 1_500_000, 0),
             "ParquetFile.read_row_group": lambda: pf.read_row_group(0, columns=["text"]),
             "encode_batch_fast (64 captions)": lambda: tok.encode_batch_fast(captions, add_special_tokens=False)}

    def spin(sec: float) -> int:
        n, end = 0, time.perf_counter() + sec
        while time.perf_counter() < end:
            n += 1
        return n

    stop = threading.Event()

    def loop(fn: Callable) -> None:
        while not stop.is_set():
            fn()

    progress: dict[str, list[float]] = {k: [] for k in calls}
    votes = dict.fromkeys(calls, 0)  # repeats in which the call looked released (above the controls' midpoint)
    for _ in range(task["reps"]):
        rep = {}
        for name, fn in calls.items():  # the controls first: each repeat is scaled by its own controls
            alone = spin(task["seconds"])
            stop.clear()
            t = threading.Thread(target=loop, args=(fn,))
            t.start()
            time.sleep(0.02)
            rep[name] = spin(task["seconds"]) / alone
            stop.set()
            t.join()
        held, rel = rep["held control (Python loop)"], rep["released control (sha256 of 8 MB)"]
        for name, v in rep.items():
            progress[name].append(v)
            votes[name] += v > (held + rel) / 2
    os.close(fd)
    return {"progress": progress, "released_votes": votes, "reps": task["reps"], "load": vc.load_now()}


# -- the model ----------------------------------------------------------------------------------------------
def per_unit(run: dict[str, Any], scale: float) -> dict[str, Any]:
    """CPU seconds per unit (``scale`` counted things) by thread kind, from one run's window."""
    n = run["units"] / scale
    cpu = run["cpu"]
    out: dict[str, Any] = {}
    for kind, k in cpu["kinds"].items():
        out[kind] = {"total": k["total"] / n, "held": k["held"] / n, "released": k["released"] / n,
                     "threads": k["threads"],
                     "released_calls": {lb: v / n for lb, v in k["released_calls"].items()},
                     "parts": {lb: v / n for lb, v in k["parts"].items()}}
    out["worker_processes"] = cpu["children"] / n
    out["process"] = cpu["process"] / n
    out["unattributed"] = (cpu["process"] - sum(k["total"] for k in cpu["kinds"].values())) / n
    out["cores_busy"] = (cpu["process"] + cpu["children"]) / cpu["wall"]
    return out


def bounds(u: dict[str, Any], runner: str, workers: int, cores: float) -> dict[str, float]:
    """The model's bounds in units/s (see the module docstring)."""
    t, a, w, o = (u[k]["total"] for k in ("trainer", "steps_ahead", "workers", "other"))
    ah, wh = u["steps_ahead"]["held"], u["workers"]["held"]

    def per(n: float, cpu: float) -> float:  # n seconds of a resource per second / CPU seconds per unit
        return n / cpu if cpu > 0 else math.inf

    b = {"trainer thread": per(1, t), "steps-ahead thread": per(1, a), "GIL": per(1, t + ah + wh + o)}
    if runner == "thread":
        b["workers"] = per(workers, w)
        b["cores"] = per(cores, t + a + w + o)
    else:  # pool: worker processes, each with its own GIL (worker threads of a read-only stage stay in ours)
        p = u["worker_processes"]
        b["workers"] = per(workers, p + w)
        b["cores"] = per(cores, t + a + w + o + p)
    return b


def predict(u: dict[str, Any], runner: str, workers: int, cores: float) -> tuple[float, str]:
    b = bounds(u, runner, workers, cores)
    limit = min(b, key=b.get)
    return b[limit], limit


def saturation(u: dict[str, Any], runner: str, cores: float) -> dict[str, Any]:
    """Where the worker bound meets the least other bound: that W (real-valued), and what it meets."""
    b = bounds(u, runner, 1, cores)
    per_worker = b.pop("workers")
    limit = min(b, key=b.get)
    return {"workers": b[limit] / per_worker, "limit": limit, "plateau": b[limit]}


ASSUMPTIONS = [
    "CPU per unit on each kind of thread is the calibration run's (1 worker), constant in W: no extra cost from "
    "contention, GIL hand-overs, caches or memory bandwidth as workers are added.",
    "Thread runner: every GIL-held second of the process (trainer, steps-ahead thread's held part, workers' held "
    "parts, other threads) is serial; released time (tokenizer batch calls, pyarrow reads, pread, JPEG/Pillow "
    "decode, resize and fromarray, patchify's copy, the pixel collation copy, the transfer's preadv) runs in "
    "parallel on any free core.",
    "Pool runner: each worker process has its own GIL, so the workers' held parts run in parallel; each result "
    "costs the trainer's process its transfer (receive, unpickling on the result thread), which is in the "
    "trainer's, steps-ahead and other threads' measured CPU.",
    "Each of the trainer thread, the steps-ahead thread and each worker does at most one CPU-second per second; "
    "all threads and worker processes of the rank share C cores (cores per rank = cores per node / ranks per "
    "node: 16-128 cores for 8 ranks give 2-16).",
    "No waiting: a lane's bursts (a packing lane refilling its open rows) and empty read-ahead are ignored, so "
    "the model is an upper bound where the workers idle.",
    "The tokenizer runs one core per call (RAYON_NUM_THREADS=1, as Zephon sets it when workers >= cores); "
    "reads come from the page cache (no storage or network bound).",
]


def model(results: dict[str, Any], workers: tuple[int, ...], cores: tuple[float, ...],
          check_cores: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, pr in results.items():
        spec = PIPELINES[name]
        rs = spec["scale"] / spec["rate_scale"]  # units/s -> shown rate
        m: dict[str, Any] = {"cpu_ms_per_unit": {}, "projection": {}, "saturation": {}, "check": []}
        for runner, runs in pr["runs"].items():
            if not all(r.get("ok") for r in runs.values()):
                continue
            u = {k: per_unit(r, spec["scale"]) for k, r in runs.items()}
            m["cpu_ms_per_unit"][runner] = {k: ms(v) for k, v in u.items()}
            base = u["calib_1"]
            proj: dict[str, Any] = {}
            sat: dict[str, Any] = {}
            for c in cores:
                proj[str(c)] = {}
                for w in workers:
                    rate, limit = predict(base, runner, w, c)
                    proj[str(c)][str(w)] = {"rate": rate * rs, "limit": limit}
                s = saturation(base, runner, c)
                sat[str(c)] = {**s, "plateau": s["plateau"] * rs}
            m["projection"][runner], m["saturation"][runner] = proj, sat
            prof = runs["calib_1"].get("profile")
            if prof:  # the sampled shares, in ms per unit of the trainer's CPU in the timed window
                t = m["cpu_ms_per_unit"][runner]["calib_1"]["trainer"]["total"]
                m.setdefault("trainer_profile", {})[runner] = {
                    "samples": prof["samples"], "by_part": {k: v * t for k, v in prof["share_by_part"].items()},
                    "top": [{"function": x["function"], "ms_per_unit": x["share"] * t} for x in prof["top"]]}
            for w in (1, 2):
                r = runs.get(f"check_{w}") or (runs["calib_1"] if w == 1 else None)
                if r:
                    measured = r["rate"] / spec["scale"]
                    p, limit = predict(base, runner, w, check_cores)
                    avail = min(check_cores, r["cpu"]["available_cores"])  # what other tenants left this run
                    pa, limit_a = predict(base, runner, w, avail)
                    m["check"].append({"runner": runner, "workers": w, "cores": check_cores, "predicted": p * rs,
                                       "in_sample": f"check_{w}" not in runs, "limit": limit,
                                       "measured": measured * rs, "error": p / measured - 1,
                                       "available_cores": avail, "predicted_available": pa * rs,
                                       "limit_available": limit_a, "error_available": pa / measured - 1,
                                       "load": [r["load_before"], r["load_after"]]})
        out[name] = m
    return out


def ms(u: dict[str, Any]) -> dict[str, Any]:
    """Seconds per unit -> milliseconds per unit, recursively (counts and ratios left as they are)."""
    def conv(k: str, v: Any) -> Any:
        if isinstance(v, dict):
            return {kk: conv(kk, vv) for kk, vv in v.items()}
        return v if k in ("threads", "cores_busy") else v * 1e3
    return {k: conv(k, v) for k, v in u.items()}


# -- the report -----------------------------------------------------------------------------------------------
def fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:,.1f}" if abs(x) >= 10 else f"{x:.2f}" if abs(x) >= 0.1 \
        else f"{x:.3f}"


def report(doc: dict[str, Any]) -> str:
    lines = []
    for name, m in doc["model"].items():
        spec = PIPELINES[name]
        lines.append(f"\n## {name}: CPU ms per {spec['unit']} by thread kind (runs: calibration, 1 and 2 workers)")
        for runner, per_run in m["cpu_ms_per_unit"].items():
            rows = []
            for run, u in per_run.items():
                rows.append([runner, run, fmt(u["trainer"]["total"]), fmt(u["steps_ahead"]["total"]),
                             fmt(u["workers"]["held"]), fmt(u["workers"]["released"]), fmt(u["other"]["total"]),
                             fmt(u["worker_processes"]), fmt(u["process"] + u["worker_processes"]),
                             f"{u['cores_busy']:.2f}"])
            lines.append(fmt_table(["runner", "run", "trainer", "steps-ahead", "workers held", "workers released",
                                    "other", "worker procs", "all", "cores busy"], rows, align="llrrrrrrrr"))
        calib = {runner: per_run["calib_1"] for runner, per_run in m["cpu_ms_per_unit"].items()}
        for runner, u in calib.items():
            for kind in KINDS:
                if u[kind]["parts"] or u[kind]["released_calls"]:
                    items = {**{f"[released] {k}": v for k, v in u[kind]["released_calls"].items() if v},
                             **{k: v for k, v in u[kind]["parts"].items() if v}}
                    lines.append(f"{runner} calibration, {kind} ms per {spec['unit']}: "
                                 + "; ".join(f"{k} {fmt(v)}" for k, v in items.items()))
        for runner, p in m.get("trainer_profile", {}).items():
            lines.append(f"{runner} calibration, trainer thread sampled ({p['samples']} samples), ms per {spec['unit']}: "
                         + "; ".join(f"{k} {fmt(v)}" for k, v in p["by_part"].items()))
            lines.append("  top functions: " + "; ".join(f"{x['function']} {fmt(x['ms_per_unit'])}" for x in p["top"][:10]))
        rows = []
        for runner, per_c in m["projection"].items():
            for c, per_w in per_c.items():
                rows.append([runner, c] + [f"{fmt(p['rate'])} ({p['limit'].split()[0]})" for p in per_w.values()])
        lines.append(f"\nprojected {spec['rate']} (binding limit) by workers:")
        lines.append(fmt_table(["runner", "cores"] + list(next(iter(next(iter(m["projection"].values())).values()))),
                               rows))
        for runner, per_c in m["saturation"].items():
            lines.append(f"saturation ({runner}): " + "; ".join(
                f"{c} cores: W={s['workers']:.1f} -> {fmt(s['plateau'])} {spec['rate']} ({s['limit']})"
                for c, s in per_c.items()))
        for ch in m["check"]:
            lines.append(f"check {ch['runner']} W={ch['workers']}: measured {fmt(ch['measured'])} {spec['rate']}; predicted "
                         f"{fmt(ch['predicted'])} at {ch['cores']:g} cores, error {100 * ch['error']:+.0f}% ({ch['limit']}); "
                         f"at the {ch['available_cores']:.2f} cores other tenants left, {fmt(ch['predicted_available'])}, "
                         f"error {100 * ch['error_available']:+.0f}% ({ch['limit_available']}); load "
                         f"{ch['load'][0][0]} -> {ch['load'][1][0]}{' (in-sample)' if ch['in_sample'] else ''}")
    return "\n".join(lines)


def plot(doc: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["model"])
    fig, axes = plt.subplots(1, len(names), figsize=(5.4 * len(names), 6.2), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, name in zip(axes[0], names):
        m, spec = doc["model"][name], PIPELINES[name]
        for ri, (runner, per_c) in enumerate(m["projection"].items()):
            for ci, (c, per_w) in enumerate(per_c.items()):
                ws = [int(w) for w in per_w]
                ax.plot(ws, [p["rate"] for p in per_w.values()], ("-" if runner == "thread" else "--"),
                        color=colors[ci % len(colors)], marker=".", label=f"{runner}, {c} cores")
        for ch in m["check"]:
            ax.plot([ch["workers"]], [ch["measured"]], "o" if ch["runner"] == "thread" else "s", color="black",
                    mfc="none" if ch["runner"] == "pool" else "black", ms=6,
                    label=f"measured here, {ch['runner']} (shared {ch['cores']:g}-core VM)")
            ax.plot([ch["workers"]], [ch["predicted_available"]], "x", color="gray", ms=7,
                    label="model at the cores other tenants left")
        for runner, per_c in m["projection"].items():  # what binds each runner's plateau at the most cores
            c, per_w = list(per_c.items())[-1]
            last = list(per_w.values())[-1]
            ax.annotate(f"{runner}, {c} cores: {last['limit']}", (WORKERS[-1], last["rate"]), fontsize=7,
                        xytext=(-4, 4 if runner == "thread" else -10), textcoords="offset points", ha="right")
        ax.set_ylim(bottom=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(WORKERS), [str(w) for w in WORKERS])
        ax.set_xlabel("workers per rank")
        ax.set_ylabel(spec["rate"])
        same = all(len({json.dumps(per_c[c]) for c in per_c}) == 1 for per_c in m["projection"].values())
        ax.set_title(name + (" (the same at every core count)" if same else ""))
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        seen = dict(zip(labels, handles))
        ax.legend(seen.values(), seen.keys(), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    fig.suptitle("Zephon per-rank throughput: model (lines) from measured CPU per unit, and measured points", fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


# -- driver -----------------------------------------------------------------------------------------------------
def ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="bench_data", help="the text corpus (make_corpus.py)")
    ap.add_argument("--vl-data", default="bench_data/vl", help="the VL corpus (make_vl_corpus.py --native)")
    ap.add_argument("--pipelines", default=",".join(PIPELINES))
    ap.add_argument("--runners", default="thread,pool", help="thread and/or pool (where the pipeline has it)")
    ap.add_argument("--workers", default=",".join(map(str, WORKERS)), help="projected worker counts")
    ap.add_argument("--cores", default=",".join(map(str, CORES)), help="projected cores per rank")
    ap.add_argument("--check-cores", type=float, default=float(os.cpu_count() or 2),
                    help="cores of this machine, for the model's check at 1 and 2 workers")
    ap.add_argument("--quick", action="store_true", help="tiny windows (a smoke test, not a measurement)")
    ap.add_argument("--gil-check", action="store_true",
                    help="first check which of the wrapped calls let go of the GIL (about 30 s; needs both corpora)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--out", default="results/scaling_model.json")
    ap.add_argument("--png", default="docs/scaling_model.png")
    args = ap.parse_args(argv)
    names = [p for p in args.pipelines.split(",") if p]
    runners = [r for r in args.runners.split(",") if r]
    text_data, vl_data = Path(args.data).resolve(), Path(args.vl_data).resolve()
    if "text" in names:
        require_data(text_data)
    if {"vl_fetch", "vl_pipeline"} & set(names):
        vc.require_vl(vl_data)
        native = vl_data / "native"
        if not all((native / f).exists() for f in ("bpe.json", "wordlevel.json")):  # the VL benchmark tokenizers
            vc.write_native(vl_data, formats=("arrayrecord",), log=lambda m: print(m, flush=True))
    started = time.time()
    print(f"# scaling model: {', '.join(names)}; runners {', '.join(runners)}; {'QUICK (not a measurement)' if args.quick else ''}")
    print(f"# machine: {machine_info()}", flush=True)
    results: dict[str, Any] = {}
    failed = []
    gil = None
    if args.gil_check:
        gil = run_task(SCRIPT, {"kind": "gil", "data": str(text_data), "vl_data": str(vl_data), "reps": 7,
                                "seconds": 0.25}, timeout=args.timeout)
        gil.pop("rss_timeline", None)
        print("# GIL check: this thread's progress beside each call, against spinning alone (median of 7 repeats, "
              "min-max; ~0.5 when the call holds the GIL), and in how many repeats it was nearer the released control")
        for k, v in (gil.get("released_votes") or {}).items():
            p = sorted(gil["progress"][k])
            print(f"  {k:<40} progress {p[len(p) // 2]:.2f} ({p[0]:.2f}-{p[-1]:.2f}); looked released in {v} of "
                  f"{gil['reps']} repeats")
        if not gil.get("ok"):
            print(f"  FAILED: {gil.get('error')}")
    for name in names:
        spec = PIPELINES[name]
        warmup, steps, prof = spec["quick" if args.quick else "window"]
        env = None
        if name == "vl_pipeline":
            import vl_pipeline
            env = vl_pipeline.MALLOC_ENV["steady"]  # as vl_pipeline.py runs every configuration
        results[name] = {"unit": spec["unit"], "runs": {}}
        for runner in [r for r in runners if r in spec["runners"]]:
            runs = results[name]["runs"].setdefault(runner, {})
            # --quick: the calibration run stands in for the 1-worker check (in-sample: a smoke test only)
            for label, w in (("calib_1", 1),) + ((("check_1", 1),) if not args.quick else ()) + (("check_2", 2),):
                task = {"kind": "run", "pipeline": name, "runner": runner, "workers": w, "data": str(text_data),
                        "vl_data": str(vl_data), "warmup": warmup, "steps": steps,
                        "profile": prof if label == "calib_1" else 0}
                print(f"  {name:<12} {runner:<7} {label:<8}", end=" ", flush=True)
                r = run_task(SCRIPT, task, timeout=args.timeout, extra_env=env)
                r.pop("rss_timeline", None)
                runs[label] = r
                if r.get("ok"):
                    print(f"{r['rate'] / spec['rate_scale']:10.2f} {spec['rate']}  (load {r['load_before'][0]} -> "
                          f"{r['load_after'][0]})", flush=True)
                else:
                    failed.append(f"{name} {runner} {label}")
                    print(f"FAILED: {r.get('error')}", flush=True)
    doc = {"schema": "zephon-scaling-model/1", "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
           "quick": args.quick, "machine": machine_info(), "started": started, "seconds": time.time() - started,
           "workers": list(ints(args.workers)), "cores": list(ints(args.cores)), "check_cores": args.check_cores,
           "assumptions": ASSUMPTIONS, "units": {n: PIPELINES[n]["unit"] for n in names},
           "rates": {n: PIPELINES[n]["rate"] for n in names}, "gil_check": gil, "runs": results,
           "model": model(results, ints(args.workers), ints(args.cores), args.check_cores), "failed": failed}
    print(report(doc))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str))
    plot(doc, Path(args.png))
    print(f"\n# wrote {out} and {args.png}; load at the end {vc.load_now()}")
    return 2 if failed else 0


if __name__ == "__main__":
    code = task_main({"run": run_one, "gil": gil_check})
    sys.exit(main() if code is None else code)

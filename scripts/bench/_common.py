"""Shared machinery of the benchmark scripts: isolated runs, memory sampling, timing, tables.

Every measured configuration runs in its own subprocess (``python SCRIPT --_task JSON``) so that its
environment (tokenizer thread pools), imports and memory are clean, and so that a crash, a hang or a
missing optional library (Grain) is reported as that configuration's failure instead of stopping the
run. The parent samples the child's memory with psutil (resident set size of the child plus all its
descendants, i.e. worker processes; shared pages are counted once per process, so multi-process figures
are an upper bound) and kills it after a timeout.

Only Zephon's public API is used anywhere in scripts/bench/.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

# Every configuration tokenizes on the cores its *workers* give it, never on a hidden Rayon pool:
# HF tokenizers' batch encoders would otherwise use all cores from a single "worker".
SINGLE_THREAD_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "RAYON_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "PYTHONHASHSEED": "0",
}


def has_flush_by(src: str | Path) -> bool:
    """Whether the Zephon checkout at ``src`` (a folder holding ``zephon/``) has the ``flush_by`` setting. One from
    before it existed flushes by units and takes no such setting; a later one defaults to ``"chunks"``, so a
    comparison by units must pass it to both sides."""
    return any("flush_by" in f.read_text() for f in (Path(src) / "zephon").rglob("*.py"))


def apply_single_thread_env() -> None:
    """Call before importing tokenizers/torch in a process that was not started by :func:`run_task`."""
    for k, v in SINGLE_THREAD_ENV.items():
        os.environ.setdefault(k, v)


def pin_cpus(cfg: dict[str, Any]) -> None:
    """Pin this process (and every thread and process it starts later) to ``cfg["cpus"]``, if given.

    A 1-worker configuration left free uses more than one core on a 2-core machine: its worker tokenizes
    on one while the trainer's thread packs on the other. Pinned to one CPU it is what the issue calls
    "the best a loader can do on one core", the baseline of "2 workers on 2 cores >= 1.8x"."""
    cpus = cfg.get("cpus")
    if cpus:
        os.sched_setaffinity(0, set(cpus))


# -- the parent side ---------------------------------------------------------------------------------
def _tree(proc) -> list:
    """proc and all its descendants (empty if proc is gone)."""
    import psutil

    try:
        return [proc] + proc.children(recursive=True)
    except psutil.Error:
        return []


def _tree_rss(proc) -> tuple[int, int]:
    """(RSS of proc + all descendants, number of processes) in bytes; vanished processes are skipped."""
    import psutil

    total, n = 0, 0
    for p in _tree(proc):
        try:
            total += p.memory_info().rss
            n += 1
        except psutil.Error:
            pass
    return total, n


def _tree_pss(proc) -> int:
    """Summed PSS of proc + all descendants, in bytes (``/proc/PID/smaps_rollup``; 0 where unreadable).

    Unlike summed RSS, PSS splits a page shared by k processes k ways: worker processes forked from a
    forkserver that imported torch share its pages, and only PSS counts them once."""
    total = 0
    for p in _tree(proc):
        try:
            with open(f"/proc/{p.pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    return total


def child_env(extra_env: dict[str, str | None] | None = None) -> dict[str, str]:
    """Environment of a measured child: single-threaded tokenizer/BLAS, scripts/bench and the repo importable.
    ``extra_env`` overrides it; a value None unsets that variable (as a user who never set it runs)."""
    env = {**os.environ, **SINGLE_THREAD_ENV}
    for k, v in (extra_env or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), str(REPO), env.get("PYTHONPATH", "")]))
    return env


def run_task(script: Path, task: dict[str, Any], timeout: float, interval: float = 0.1,
             extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``script --_task <json>`` in a subprocess; returns its result dict plus memory figures.

    The result always has ``ok`` (bool); on failure ``error`` holds the last lines of the output.
    ``peak_rss_mb`` is the peak over the whole child lifetime of the summed RSS of the child and its
    descendants; ``peak_main_rss_mb`` the peak of the child alone; ``rss_timeline`` (seconds, MB) samples;
    ``peak_pss_mb`` the peak of the tree's summed PSS, sampled once a second (shared pages counted once).
    """
    import psutil

    env = child_env(extra_env)
    with tempfile.TemporaryDirectory(prefix="zephon-bench-") as tmp:
        out_path = Path(tmp) / "result.json"
        log_path = Path(tmp) / "output.log"
        task = {**task, "_out": str(out_path)}
        cmd = [sys.executable, str(script), "--_task", json.dumps(task)]
        t0 = time.perf_counter()
        peak, peak_main, peak_pss, timeline, max_procs = 0, 0, 0, [], 0
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
                                    start_new_session=True)
            ps = psutil.Process(proc.pid)
            timed_out = False
            last_tl = -1.0
            while proc.poll() is None:
                rss, n = _tree_rss(ps)
                try:
                    main = ps.memory_info().rss
                except psutil.Error:
                    main = 0
                peak, peak_main, max_procs = max(peak, rss), max(peak_main, main), max(max_procs, n)
                now = time.perf_counter() - t0
                if now - last_tl >= 1.0:
                    timeline.append((round(now, 1), round(rss / 2**20, 1)))
                    peak_pss = max(peak_pss, _tree_pss(ps))
                    last_tl = now
                if now > timeout:
                    timed_out = True
                    _kill_tree(ps)
                    break
                time.sleep(interval)
            proc.wait()
            _kill_group(proc.pid)  # worker processes the child left behind (same session / group)
        wall = time.perf_counter() - t0
        output = log_path.read_text(errors="replace")
        result: dict[str, Any]
        if out_path.exists() and not timed_out:
            result = json.loads(out_path.read_text())
        else:
            result = {"ok": False}
        if timed_out:
            result["error"], result["timed_out"] = f"timed out after {timeout:.0f}s", True
        elif not result.get("ok"):
            tail = [line for line in output.strip().splitlines() if line.strip()][-6:]
            result.setdefault("error", f"exit code {proc.returncode}: " + " | ".join(tail)[-600:])
        result.update(peak_rss_mb=peak / 2**20, peak_main_rss_mb=peak_main / 2**20, peak_pss_mb=peak_pss / 2**20,
                      max_processes=max_procs,
                      wall_s=wall, rss_timeline=timeline)
        if os.environ.get("ZEPHON_BENCH_ECHO"):
            sys.stderr.write(output)
        return result


def _kill_group(pgid: int) -> None:
    import signal

    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_tree(ps) -> None:
    import psutil

    try:
        procs = ps.children(recursive=True) + [ps]
    except psutil.Error:
        procs = [ps]
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


# -- the child side ----------------------------------------------------------------------------------
def task_main(handlers: dict[str, Callable[[dict], dict]]) -> int | None:
    """If argv holds ``--_task``, run the handler named by ``task["kind"]`` and write its result."""
    if "--_task" not in sys.argv:
        return None
    task = json.loads(sys.argv[sys.argv.index("--_task") + 1])
    out = Path(task["_out"])
    try:
        result = handlers[task["kind"]](task)
        result["ok"] = True
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, never raised there
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:800], "traceback": traceback.format_exc()}
        sys.stderr.write(result["traceback"])
        code = 1
    out.write_text(json.dumps(result))
    _kill_descendants()
    sys.stdout.flush()
    sys.stderr.flush()
    # Worker pools of some libraries can keep a process alive after main returns: leave now.
    os._exit(code)


def _kill_descendants() -> None:
    """Kill this process's remaining worker processes (some libraries only stop them at exit or GC)."""
    try:
        import psutil

        for p in psutil.Process().children(recursive=True):
            try:
                p.kill()
            except psutil.Error:
                pass
    except Exception:  # noqa: BLE001
        pass


class Timer:
    """Wall time of a region minus the time spent in ``excluded()`` blocks (e.g. hashing)."""

    def __init__(self) -> None:
        self.excluded = 0.0
        self.t0 = time.perf_counter()

    def exclude(self) -> "_Excluded":
        return _Excluded(self)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0 - self.excluded


class _Excluded:
    def __init__(self, timer: Timer) -> None:
        self.timer = timer

    def __enter__(self) -> None:
        self.t = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.timer.excluded += time.perf_counter() - self.t


def measure_stream(make: Callable[[], tuple[Iterable, Callable[[], None]]], steps: int, warmup: int,
                   repeats: int, tokens_per_batch: int, fresh: bool = False,
                   check: Callable[[Any], None] | None = None,
                   on_batch: Callable[[int, int, Any], None] | None = None,
                   after_window: Callable[[int], dict] | None = None,
                   digest: Callable[[Any], str] | None = None, tail: int | None = None) -> dict[str, Any]:
    """Steady-state throughput of a batch stream.

    One pipeline is built (``make()`` returns (iterable of batches, close)); its first batch is timed
    (time to first batch, construction included), ``warmup`` batches in all are taken untimed, then
    ``repeats`` consecutive windows of ``steps`` batches are timed; the result is the median window.
    With ``fresh=True`` every repeat builds a new pipeline and warms it up again (independent runs).

    ``on_batch(run, index, batch)`` runs for every batch (warm-up included) and its time counts, as a
    trainer's own work would, so it must stay cheap. (Excluded, it let worker threads run on while the
    trainer waited to get the GIL back after a torch op, and their work counted as the loader's.)
    ``digest(batch)`` (a hash, not cheap for batches of image bytes) is taken outside the timed windows
    only, its time excluded: of the first half of the warm-up and of ``tail`` batches taken after the
    windows (default: as many as the warm-up), returned per pipeline in ``digests_by_run``. The second
    half of the warm-up runs unhashed at full speed, so that the read-ahead the workers built up while
    batches were hashed drains to its steady level before the windows. ``trace`` holds, per pipeline,
    the time at which each batch arrived (hashing excluded), so that whoever doubts that the warm-up
    reached a steady state can plot it.
    """
    tail = (max(1, warmup) if digest else 0) if tail is None else tail
    digests_by_run: list[list[str]] = []
    windows: list[dict[str, Any]] = []
    pipelines: list[dict[str, Any]] = []
    for run in range(repeats if fresh else 1):
        n_windows = 1 if fresh else repeats
        timer = Timer()
        iterable, close = make()
        trace: list[float] = []
        digests: list[str] = []
        digests_by_run.append(digests)
        try:
            it = iter(iterable)
            index = 0
            hashed_warmup, in_tail = max(1, (warmup + 1) // 2), False  # the warm-up's first half is hashed

            def take(timed: bool = False) -> Any:
                nonlocal index
                b = next(it)
                trace.append(round(timer.elapsed(), 4))
                if on_batch:  # timed: see the docstring
                    on_batch(run, index, b)
                with timer.exclude():
                    if index == 0 and check:
                        check(b)
                    if digest and not timed and (in_tail or index < hashed_warmup):
                        digests.append(digest(b))
                index += 1
                return b

            take()
            first = trace[0]
            for _ in range(1, max(1, warmup)):
                take()
            for w in range(n_windows):
                t0, cpu0 = timer.elapsed(), time.thread_time()
                for _ in range(steps):
                    take(timed=True)
                sec, cpu = timer.elapsed() - t0, time.thread_time() - cpu0
                extra = after_window(run) if after_window else {}
                # thread_cpu_s: CPU time of the thread calling next() (the trainer's) over the window
                windows.append({"run": run, "window": w, "seconds": sec, "tokens": steps * tokens_per_batch,
                                "tokens_per_s": steps * tokens_per_batch / sec, "thread_cpu_s": cpu, **extra})
            total, timed_batches = timer.elapsed(), index
            in_tail = True
            for _ in range(tail):  # for their digests only: outside every figure
                take()
        finally:
            close()
        pipelines.append({"first_batch_s": first, "batches": timed_batches, "seconds_total": total,
                          "tokens_per_s_incl_startup": timed_batches * tokens_per_batch / total,
                          "excluded_s": timer.excluded, "trace": trace})
    return {"runs": windows, "pipelines": pipelines, "digests_by_run": digests_by_run,
            "tokens_per_s": statistics.median(w["tokens_per_s"] for w in windows),
            "tokens_per_s_all_windows": sum(w["tokens"] for w in windows) / sum(w["seconds"] for w in windows),
            "first_batch_s": statistics.median(p["first_batch_s"] for p in pipelines),
            "tokens_per_s_incl_startup": statistics.median(p["tokens_per_s_incl_startup"] for p in pipelines)}


def only_patterns(only: str) -> list[str]:
    """``--only``'s comma-separated names or globs."""
    return [p.strip() for p in only.split(",") if p.strip()]


def select_configs(cfgs: Sequence[dict[str, Any]], patterns: Sequence[str]) -> list[dict[str, Any]]:
    """The configurations whose name matches one of ``patterns`` (``fnmatch`` globs), in their order."""
    import fnmatch

    return [c for c in cfgs if any(fnmatch.fnmatchcase(c["name"], p) for p in patterns)]


def add_zephon_bench_args(ap, timeout: float) -> None:
    """The options every Zephon-only benchmark takes: --data, --only, --zephon-src, --timeout, --json."""
    ap.add_argument("--data", default="bench_data")
    ap.add_argument("--only", default="", help="comma-separated names or globs")
    ap.add_argument("--zephon-src", default="", help="a checkout whose zephon/ to measure instead of this one")
    ap.add_argument("--timeout", type=float, default=timeout)
    ap.add_argument("--json", default="")


def zephon_bench_inputs(args, cfgs: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], Path, str]:
    """From :func:`add_zephon_bench_args`'s options: (the configurations --only selects, the checked
    corpus directory, the --zephon-src checkout as an absolute path or "")."""
    chosen = select_configs(cfgs, only_patterns(args.only)) if args.only else list(cfgs)
    data = Path(args.data).resolve()
    require_data(data)
    return chosen, data, str(Path(args.zephon_src).resolve()) if args.zephon_src else ""


def zephon_src_first() -> None:
    """In a measured child (``--_task``), put the task's ``zephon_src`` checkout first on ``sys.path``;
    call before anything imports zephon."""
    if "--_task" in sys.argv:
        src = json.loads(sys.argv[sys.argv.index("--_task") + 1]).get("zephon_src")
        if src and src not in sys.path:
            sys.path.insert(0, src)


# -- printing ----------------------------------------------------------------------------------------
def fmt_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or "l" * len(headers)
    out = []
    for n, row in enumerate(cells):
        out.append("  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align)))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def machine_info() -> dict[str, Any]:
    import platform

    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "cpus": os.cpu_count()}
    try:
        import psutil
        info["memory_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
        info["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    except Exception:  # noqa: BLE001
        pass
    for mod in ("zephon", "torch", "torchdata", "tokenizers", "pyarrow", "numpy", "grain"):
        try:
            from importlib.metadata import version
            info[mod] = version(mod)
        except Exception:  # noqa: BLE001
            info[mod] = None
    return info


def require_data(data: Path) -> None:
    missing = [p for p in ("recipe.toml", "tokenizer.json", "parquet") if not (data / p).exists()]
    if missing:
        raise SystemExit(f"{data} has no benchmark corpus (missing {', '.join(missing)}); build it with\n"
                         f"  python scripts/bench/make_corpus.py --out {data}")


def corpus_key(data: Path) -> str:
    """Identifies the corpus's bytes (from manifest.json, else file sizes and times): derived caches
    (bench_data/fetch, bench_data/resume_rg*) are rebuilt when it changes."""
    import hashlib

    m = data / "manifest.json"
    if m.exists():
        files = json.loads(m.read_text()).get("files", {})
        return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    parts = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}"
             for p in sorted((data / "parquet").glob("*.parquet"))]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def derived_is_current(derived: Path, data: Path) -> bool:
    key = derived / "corpus.key"
    return key.exists() and key.read_text().strip() == corpus_key(data)


def mark_derived(derived: Path, data: Path) -> None:
    (derived / "corpus.key").write_text(corpus_key(data) + "\n")


def parquet_row_groups(data: Path) -> list[tuple[str, int]]:
    """(file, row group) pairs of the corpus, in file then row-group order."""
    import pyarrow.parquet as pq

    out = []
    for f in sorted((data / "parquet").glob("*.parquet")):
        n = pq.ParquetFile(f).metadata.num_row_groups
        out.extend((str(f), i) for i in range(n))
    return out


class RowGroupReader:
    """Reads the ``text`` column of one row group; keeps each file open per thread (concurrent
    ``read_row_group`` calls on one shared ParquetFile crash pyarrow)."""

    def __init__(self, column: str = "text") -> None:
        self.column = column
        self._files: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __call__(self, item: tuple[str, int]) -> list[str]:
        import pyarrow.parquet as pq

        path, rg = item
        key = (path, threading.get_ident())
        with self._lock:
            pf = self._files.get(key)
            if pf is None:
                pf = self._files[key] = pq.ParquetFile(path)
        return pf.read_row_group(rg, columns=[self.column]).column(0).to_pylist()

    def __getstate__(self) -> dict:
        return {"column": self.column}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["column"])


class EncodeWithEos:
    """Batched HF tokenization with EOS appended to every document: (flat int32 tokens, int64 offsets).

    Picklable (the tokenizer is loaded lazily in each process). The same conversion as a loader would
    do: ``encode_batch_fast`` (no offsets), one ``np.fromiter`` over all ids, EOS written in place.
    """

    def __init__(self, tokenizer_path: str, eos_token: str = "<|endoftext|>") -> None:
        self.tokenizer_path, self.eos_token = tokenizer_path, eos_token
        self._tok = None
        self.eos_id = None

    def _load(self) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(self.tokenizer_path)
        self.eos_id = self._tok.token_to_id(self.eos_token)
        if self.eos_id is None:
            raise ValueError(f"{self.tokenizer_path} has no token {self.eos_token!r}")

    def __call__(self, texts: Sequence[str]):
        import itertools

        import numpy as np

        if self._tok is None:
            self._load()
        ids = [e.ids for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=False)]
        lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        out = np.empty(int(offsets[-1]), dtype=np.int32)
        body = np.ones(len(out), dtype=bool)
        body[offsets[1:] - 1] = False
        out[offsets[1:] - 1] = self.eos_id
        out[body] = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=len(out) - len(ids))
        return out, offsets

    def __getstate__(self) -> dict:
        return {"tokenizer_path": self.tokenizer_path, "eos_token": self.eos_token}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["tokenizer_path"], state["eos_token"])


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))

#!/usr/bin/env python
"""Per-rank cost at scale: start-up, steady CPU and memory of rank 0 vs files, lanes and world size;
and the size of a checkpoint (issue 19, items 4 and 5).

scaling.py measures lanes and world size on the benchmark corpus (16 files); this study makes the
corpus as large as production listings are (1k, 10k and 100k small Parquet files, and 10k objects on an
S3 server on loopback) and goes to 1024 lanes and 1024 ranks. Every point is one fresh subprocess
(``_common.run_task``: peak RSS of the process tree), repeated ``--repeats`` times in interleaved rounds
(round r measures every point once, in order), and reported as the median with the spread (min-max).
Only ratios between sizes matter on a shared machine: flat means the figure does not grow with the
number of files (beyond listing them), lanes or ranks.

What a point measures, in rank 0's process (``world_size`` ranks, rank 0 owns ``lanes / world_size``
lanes; the other ranks are never built: a rank plans on its own):

listing    ``zephon.plan.list_files`` for both sources (the one internal call of this script: listing is
           otherwise not separable from planning), the first listing in the process
plan       ``zephon.WorkPlan(pipeline)``: listing again, cutting units (whole files: no footer read)
build      ``zephon.build_loader(pipeline, rank=0, world_size=W, plan=plan)``: compile, fingerprint (every
           file's relative name hashed), the check that each source has text, executors
first      the first batch (every lane of the rank opens its first unit of each source)
steady     ``--steps`` batches after ``--warmup`` more: CPU seconds of the process (all threads) per step,
           and per step and lane of the rank
state      bytes of ``json.dumps(loader.state_dict())`` after the run (rank 0's lanes); with world size 1
           also of ``zephon.merge_states([state])`` (all lanes: a merged checkpoint, which by elastic
           determinism is the same for every world size at the same step) and of the file
           ``zephon.save_state`` writes; and both for the same lanes with every counter at the size of a
           long production run (``production_magnitudes``: a short run's numbers have few digits)

The parent also checks that rank 0's first lanes hold the same state at every world size (a rank's
lanes do not depend on the others).

The pipeline: two Parquet sources (``web``: 3/4 of the files, ``code``: 1/4; both have at least as many
files as lanes, so units are whole files), a tiny byte-level BPE trained here, seq_len 256 (``--seq-len``),
best-fit packing, one row per lane, 1 thread worker (``--workers``). A file holds 4 rows, ~5 KB of text.

    python scripts/bench/scale_study.py prepare --data scale_data           # ~1 min, 110k files
    python scripts/bench/scale_study.py run --data scale_data --repeats 3 --json docs/scaling.json
    python scripts/bench/scale_study.py plot --json docs/scaling.json --png docs/scaling.png \
        --before docs/scaling_before.json     # redraw; grey: a run of the code before (--zephon-src)
    python scripts/bench/scale_study.py run --data scale_data --repeats 1 --only 'files*' --s3 no   # quick

``run`` prepares what is missing, runs every point (``--only``: point names or globs, see ``--list``),
prints the tables, writes the JSON and, with ``--png``, the plot. ``--zephon-src DIR`` measures
another checkout's ``zephon/`` (before/after).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    fmt_table, machine_info, only_patterns, run_task, select_configs, task_main, zephon_src_first,
)

zephon_src_first()  # a measured child: --zephon-src must win before anything imports zephon
SCRIPT = Path(__file__).resolve()
TEMPLATES = 64  # distinct files; file k is a byte copy of template k % 64 (writing 100k files takes seconds)
ROWS_PER_FILE = 4
WORDS = ("the loader reads every lane from its own units and the packer fills rows of tokens while the mixer "
         "keeps the weights exact over every prefix so that a checkpoint holds positions only and any rank "
         "resumes any lane after a failure on another machine with more or fewer accelerators than before "
         "rivers stones clouds seven quick brown foxes jump over lazy dogs near green hills at dawn").split()


# -- the corpus --------------------------------------------------------------------------------------
def _templates() -> tuple[list[bytes], list[str]]:
    """``TEMPLATES`` small Parquet files (bytes) of ``ROWS_PER_FILE`` rows of text, and all their texts."""
    import io
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(19)
    blobs, texts = [], []
    for _ in range(TEMPLATES):
        rows = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(120, 280))) for _ in range(ROWS_PER_FILE)]
        buf = io.BytesIO()
        pq.write_table(pa.table({"text": rows}), buf, compression="zstd")
        blobs.append(buf.getvalue())
        texts += rows
    return blobs, texts


def corpus_dirs(data: Path, files: int) -> tuple[Path, Path]:
    return data / f"files_{files}" / "web", data / f"files_{files}" / "code"


def split_counts(files: int) -> tuple[int, int]:
    return files - files // 4, files // 4


def prepare(data: Path, sizes: list[int]) -> None:
    """Write the tokenizer and, per size N, N Parquet files (web: 3/4, code: 1/4); skips what exists."""
    data.mkdir(parents=True, exist_ok=True)
    blobs, texts = _templates()
    tok = data / "tokenizer.json"
    if not tok.exists():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        t = Tokenizer(models.BPE())
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        t.decoder = decoders.ByteLevel()
        t.train_from_iterator(texts, trainers.BpeTrainer(
            vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False))
        t.save(str(tok))
    for n in sizes:
        done = data / f"files_{n}" / "complete"
        if done.exists():
            continue
        t0 = time.perf_counter()
        k = 0
        for folder, count in zip(corpus_dirs(data, n), split_counts(n)):
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                (folder / f"part-{i:06d}.parquet").write_bytes(blobs[k % TEMPLATES])
                k += 1
        done.write_text(f"{n}\n")
        print(f"  wrote {n} files under {data / f'files_{n}'} in {time.perf_counter() - t0:.1f}s", flush=True)


# -- S3 on loopback (moto) -----------------------------------------------------------------------------
class Moto:
    """``python -m moto.server`` on 127.0.0.1 (as tests/stores.py starts it), holding one corpus."""

    def __init__(self, log: Path) -> None:
        import socket
        import urllib.request

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._log = open(log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/moto-api/", timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"moto server did not start; its log: {log}")
                time.sleep(0.2)
        self.options = {"endpoint_url": f"http://127.0.0.1:{self.port}", "key": "testing", "secret": "testing"}

    def upload(self, data: Path, files: int, prefix: str = "scale") -> tuple[str, str]:
        """Put the N-file corpus in bucket ``zephon`` (8 threads); returns the two sources' URLs."""
        from concurrent.futures import ThreadPoolExecutor

        import s3fs

        fs = s3fs.S3FileSystem(**self.options, skip_instance_cache=True)
        fs.mkdir("zephon")
        jobs = [(p, f"zephon/{prefix}/{folder.name}/{p.name}") for folder in corpus_dirs(data, files)
                for p in sorted(folder.glob("*.parquet"))]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda j: fs.pipe_file(j[1], j[0].read_bytes()), jobs))
        print(f"  uploaded {len(jobs)} objects to moto in {time.perf_counter() - t0:.0f}s", flush=True)
        return tuple(f"s3://zephon/{prefix}/{folder.name}" for folder in corpus_dirs(data, files))  # type: ignore

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


# -- child -------------------------------------------------------------------------------------------
def _rss_mb() -> float:
    import psutil

    return round(psutil.Process().memory_info().rss / 2**20, 1)


def saved_size(state: dict[str, Any]) -> int:
    """Bytes of the file ``zephon.save_state`` writes."""
    import tempfile

    import zephon

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.json"
        zephon.save_state(state, path)
        return path.stat().st_size


def production_magnitudes(state: dict[str, Any]) -> dict[str, Any]:
    """The same lanes with every counter as large as after a long run (~10^6 steps of 8192-token rows, files
    of ~10^6 rows), sealed again: what the size of a production checkpoint is (the study's runs are short,
    so their numbers have few digits). The same figures as tests/test_scale.py."""
    from zephon.state import seal

    big = json.loads(json.dumps(state))
    for lane in big["lanes"].values():
        lane.update(sentinels=123_456, rows_since_flush=99, carry=8191,
                    clock=[1_234_567, 10_123_456_789, 1_234_500, 10_122_456_789], replay=[99, 99])
        lane["positions"] = {name: [12_345, 1_234_567, 3] for name in lane["positions"]}
    big["step"] = 1_234_666
    return seal(big)


def child_point(task: dict[str, Any]) -> dict[str, Any]:
    t = time.perf_counter()
    import zephon
    from zephon.plan import PlannedSource, list_files  # the one internal call: listing timed apart

    out: dict[str, Any] = {"import_s": time.perf_counter() - t, "rss_import_mb": _rss_mb()}
    lanes, ws = task["lanes"], task["world_size"]
    opts = task.get("storage_options")
    tok = zephon.tokenizer(task["tokenizer"])
    pipe = (zephon.Pipeline(seed=1234, lanes=lanes)
            .source("web", zephon.read.parquet(task["web"], storage_options=opts), weight=0.7)
            .source("code", zephon.read.parquet(task["code"], storage_options=opts), weight=0.3)
            .tokenize(tok)
            .pack(seq_len=task["seq_len"])
            .batch(rows_per_lane=1))

    t = time.perf_counter()
    listed = [len(list_files(PlannedSource(d.name, d.read, d.passes), pipe.origin, pipe.storage)[1])
              for d in pipe.sources]
    out["listing_s"] = time.perf_counter() - t
    out["files_listed"] = sum(listed)

    t = time.perf_counter()
    plan = zephon.WorkPlan(pipe)
    out["plan_s"] = time.perf_counter() - t
    out["units"] = [len(s.units) for s in plan.sources]
    out["rss_plan_mb"] = _rss_mb()

    t = time.perf_counter()
    loader = zephon.build_loader(pipe, rank=0, world_size=ws, num_workers=task["workers"], plan=plan)
    out["build_s"] = time.perf_counter() - t
    out["rss_build_mb"] = _rss_mb()

    t = time.perf_counter()
    it = iter(loader)
    next(it)
    out["first_batch_s"] = time.perf_counter() - t
    out["startup_s"] = out["plan_s"] + out["build_s"] + out["first_batch_s"]  # listing is inside plan
    out["rss_first_mb"] = _rss_mb()

    for _ in range(task["warmup"]):
        next(it)
    c, w = time.process_time(), time.perf_counter()
    for _ in range(task["steps"]):
        next(it)
    cpu = time.process_time() - c
    out["wall_per_step_s"] = (time.perf_counter() - w) / task["steps"]
    out["cpu_per_step_s"] = cpu / task["steps"]
    per_rank = lanes // ws
    out["lanes_on_rank"] = per_rank
    out["cpu_per_step_lane_ms"] = 1e3 * cpu / task["steps"] / per_rank
    out["rss_end_mb"] = _rss_mb()

    state = loader.state_dict()
    text = json.dumps(state)
    out["state_bytes"] = len(text)
    out["state_header_bytes"] = len(json.dumps({k: v for k, v in state.items() if k != "lanes"}))
    out["state_bytes_per_lane"] = (len(text) - out["state_header_bytes"]) / per_rank
    out["first_lanes"] = {k: v for k, v in state["lanes"].items() if int(k) < 4}  # compared across world sizes
    if ws == 1:
        merged = zephon.merge_states([state])
        out["merged_bytes"] = len(json.dumps(merged))
        out["saved_file_bytes"] = saved_size(merged)
        big = production_magnitudes(merged)
        out["production_merged_bytes"] = len(json.dumps(big))
        out["production_file_bytes"] = saved_size(big)
    out["step"] = state["step"]
    loader.close()
    return out


# -- the points ----------------------------------------------------------------------------------------
def points(args) -> list[dict[str, Any]]:
    out = []
    for lanes, ws in ((64, 8), (1024, 1024)):  # files: rank 0 holds 8 lanes of 64, and 1 lane of 1024
        for n in args.files:
            out.append({"name": f"files{n}_l{lanes}_w{ws}", "study": "files", "files": n, "lanes": lanes,
                        "world_size": ws})
    for lanes in args.lanes:  # lanes x world size, on args.grid_files files
        for ws in args.worlds:
            if ws <= lanes:
                out.append({"name": f"grid_l{lanes}_w{ws}", "study": "grid", "files": args.grid_files,
                            "lanes": lanes, "world_size": ws})
    if args.s3 != "no":
        out.append({"name": f"s3_files{args.s3_files}_l64_w8", "study": "s3", "files": args.s3_files, "lanes": 64,
                    "world_size": 8})
    return out


def task_of(p: dict[str, Any], args, data: Path, s3: tuple[str, str, dict] | None) -> dict[str, Any]:
    web, code = (str(x) for x in corpus_dirs(data, p["files"]))
    task = {"kind": "point", "tokenizer": str(data / "tokenizer.json"), "web": web, "code": code,
            "lanes": p["lanes"], "world_size": p["world_size"], "seq_len": args.seq_len, "workers": args.workers,
            "steps": args.steps, "warmup": args.warmup, "zephon_src": args.zephon_src}
    if p["study"] == "s3":
        assert s3 is not None
        task.update(web=s3[0], code=s3[1], storage_options=s3[2])
    return task


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


KEYS = ("listing_s", "plan_s", "build_s", "first_batch_s", "startup_s", "cpu_per_step_s", "cpu_per_step_lane_ms",
        "wall_per_step_s", "peak_rss_mb", "rss_plan_mb", "rss_import_mb", "state_bytes", "state_bytes_per_lane",
        "merged_bytes", "saved_file_bytes", "production_merged_bytes", "production_file_bytes", "import_s")


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and (min, max) of every figure over a point's successful runs."""
    ok = [r for r in runs if r.get("ok")]
    out: dict[str, Any] = {"ok": len(ok), "failed": len(runs) - len(ok),
                           "errors": [r.get("error") for r in runs if not r.get("ok")]}
    for k in KEYS:
        vals = [r[k] for r in ok if r.get(k) is not None]
        if vals:
            out[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    if ok:
        out["units"] = ok[0].get("units")
        out["files_listed"] = ok[0].get("files_listed")
        out["lanes_on_rank"] = ok[0].get("lanes_on_rank")
        out["first_lanes"] = ok[0].get("first_lanes")
        out["step"] = ok[0].get("step")
    return out


def _f(s: dict[str, Any], key: str, fmt: str = "{:.2f}", spread: bool = True) -> str:
    v = s.get(key)
    if not v:
        return ""
    if not spread:
        return fmt.format(v["median"])
    return f"{fmt.format(v['median'])} ({fmt.format(v['min'])}-{fmt.format(v['max'])})"


def tables(results: list[dict[str, Any]]) -> str:
    lines = []
    head = ["files", "lanes", "world size", "lanes on rank 0", "listing s", "WorkPlan s", "build_loader s",
            "first batch s", "start-up s", "CPU s/step", "CPU ms/step/lane", "peak RSS MB", "rank-0 state B"]
    for study, title in (("files", "files (units: whole files)"), ("grid", "lanes x world size"),
                         ("s3", "S3 on loopback (moto)")):
        rows = []
        for r in results:
            if r["study"] != study:
                continue
            s = r["summary"]
            if not s["ok"]:
                rows.append([r["files"], r["lanes"], r["world_size"], "FAILED: " + str(s["errors"][:1])[:80]]
                            + [""] * (len(head) - 4))
                continue
            rows.append([f"{r['files']:,}", r["lanes"], r["world_size"], s["lanes_on_rank"], _f(s, "listing_s"),
                         _f(s, "plan_s"), _f(s, "build_s"), _f(s, "first_batch_s"), _f(s, "startup_s"),
                         _f(s, "cpu_per_step_s", "{:.3f}"), _f(s, "cpu_per_step_lane_ms", "{:.1f}"),
                         _f(s, "peak_rss_mb", "{:.0f}"), _f(s, "state_bytes", "{:.0f}", spread=False)])
        if rows:
            lines.append(f"\n### {title}: median (min-max) of the runs\n")
            lines.append(fmt_table(head, rows, align="rrrrrrrrrrrrr"))
    ckpt = [r for r in results if r["world_size"] == 1 and r["summary"].get("merged_bytes")]
    if ckpt:
        lines.append("\n### checkpoint size (world size 1: the merged state of every lane; two sources)\n")
        rows = []
        for r in sorted(ckpt, key=lambda r: r["lanes"]):
            s = r["summary"]
            per64 = [s[k]["max"] * 64 / r["lanes"] if s.get(k) else None for k in
                     ("merged_bytes", "saved_file_bytes", "production_merged_bytes", "production_file_bytes")]
            rows.append([r["lanes"], s.get("step"), f"{s['merged_bytes']['max']:,.0f}",
                         f"{s['state_bytes_per_lane']['median']:.0f}"]
                        + [f"{v:,.0f}" if v is not None else "" for v in per64])
        lines.append(fmt_table(["lanes", "at step", "json.dumps(merged) B", "B per lane", "per 64 lanes B",
                                "save_state file per 64 lanes B", "long run: json.dumps per 64 lanes B",
                                "long run: file per 64 lanes B"], rows, align="rrrrrrrr"))
    return "\n".join(lines)


def check_world_independence(results: list[dict[str, Any]]) -> list[str]:
    """Rank 0's first lanes must hold the same state at the same step for every world size (per lane count)."""
    problems = []
    by_lanes: dict[int, list] = {}
    for r in results:
        s = r["summary"]
        if r["study"] == "grid" and s["ok"]:
            by_lanes.setdefault(r["lanes"], []).append((r["world_size"], s["step"], s["first_lanes"]))
    for lanes, items in by_lanes.items():
        for ws, step, first in items:
            for ws2, step2, first2 in items:
                if step == step2:
                    common = set(first) & set(first2)
                    bad = [k for k in common if {a: b for a, b in first[k].items() if a != "digest"}
                           != {a: b for a, b in first2[k].items() if a != "digest"}]
                    if bad:
                        problems.append(f"lanes {lanes}: lanes {bad} differ between world size {ws} and {ws2}")
    return problems


# -- plot ----------------------------------------------------------------------------------------------
def plot(doc: dict[str, Any], png: Path, before: dict[str, Any] | None = None) -> None:
    """Top row: start-up seconds; bottom row: peak RSS; columns: vs files, vs lanes at a fixed number of
    lanes per rank, vs world size at a fixed number of lanes. Log axes, medians, bars from min to max.
    ``before``: another run's JSON (e.g. ``--zephon-src`` of the code before a change), drawn grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    def ok(results: list[dict]) -> list[dict]:
        return [r for r in results if r["summary"]["ok"]]

    def line(ax, rs, xkey, key, label, **kw) -> None:
        rs = sorted(rs, key=lambda r: r[xkey])
        if not rs:
            return
        s = [r["summary"][key] for r in rs]
        ax.errorbar([r[xkey] for r in rs], [v["median"] for v in s],
                    yerr=[[v["median"] - v["min"] for v in s], [v["max"] - v["median"] for v in s]],
                    capsize=2, ms=4, label=label, **{"fmt": "o-", **kw})

    results = ok(doc["results"])
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    files = [r for r in results if r["study"] == "files"]
    configs = sorted({(r["lanes"], r["world_size"]) for r in files})
    for (lanes, ws), style in zip(configs, ("-", "--", ":")):
        rs = [r for r in files if (r["lanes"], r["world_size"]) == (lanes, ws)]
        what = f"{lanes} lanes / {ws} ranks"
        line(axes[0][0], rs, "files", "startup_s", f"start-up, {what}", fmt="o" + style)
        line(axes[0][0], rs, "files", "listing_s", f"listing, {what}", fmt="s" + style, alpha=0.6)
        line(axes[1][0], rs, "files", "peak_rss_mb", what, fmt="o" + style)
        if before:
            old = [r for r in ok(before["results"]) if r["study"] == "files" and
                   (r["lanes"], r["world_size"]) == (lanes, ws)]
            line(axes[0][0], old, "files", "startup_s", f"start-up before, {what}", fmt="x" + style, color="grey")
            line(axes[1][0], old, "files", "peak_rss_mb", f"before, {what}", fmt="x" + style, color="grey")
    for r in (r for r in results if r["study"] == "s3"):
        axes[0][0].plot([r["files"]], [r["summary"]["listing_s"]["median"]], "k^", ms=8,
                        label=f"listing {r['files']:,} objects on S3 (moto on loopback)")
    axes[0][0].set(title="start-up vs files (units: whole files)", xlabel="files (both sources)")
    axes[1][0].set(title="memory vs files", xlabel="files (both sources)")

    grid = [r for r in results if r["study"] == "grid"]
    for per_rank in sorted({r["lanes"] // r["world_size"] for r in grid}):
        rs = [r for r in grid if r["lanes"] // r["world_size"] == per_rank]
        if len(rs) > 1:
            line(axes[0][1], rs, "lanes", "startup_s", f"{per_rank} lanes per rank")
            line(axes[1][1], rs, "lanes", "peak_rss_mb", f"{per_rank} lanes per rank")
    axes[0][1].set(title=f"start-up vs lanes, lanes per rank fixed ({doc['args']['grid_files']:,} files)",
                   xlabel="lanes (world size = lanes / lanes per rank)")
    axes[1][1].set(title="memory vs lanes, lanes per rank fixed", xlabel="lanes")
    for lanes in sorted({r["lanes"] for r in grid}):
        rs = [r for r in grid if r["lanes"] == lanes]
        line(axes[0][2], rs, "world_size", "startup_s", f"{lanes} lanes")
        line(axes[1][2], rs, "world_size", "peak_rss_mb", f"{lanes} lanes")
    axes[0][2].set(title="start-up vs world size (rank 0 holds lanes / world size)", xlabel="world size")
    axes[1][2].set(title="memory vs world size", xlabel="world size")
    for i, ax in enumerate(axes.flat):
        ax.set(xscale="log", yscale="log", ylabel="seconds, rank 0" if i < 3 else "peak RSS of rank 0's processes, MB")
        if i >= 3:
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6.5)
    fig.suptitle(f"Zephon rank 0: start-up (plan + build_loader + first batch) and memory vs files, lanes, world "
                 f"size; median of {doc['args']['repeats']} runs, bars min-max; {doc.get('when', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


# -- main ----------------------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["prepare", "run", "plot"])
    ap.add_argument("--data", default="scale_data", help="where the generated corpora go (not committed)")
    ap.add_argument("--files", type=_ints, default=[1000, 10000, 100000])
    ap.add_argument("--lanes", type=_ints, default=[32, 64, 128, 256, 512, 1024])
    ap.add_argument("--worlds", type=_ints, default=[1, 8, 64, 256, 1024])
    ap.add_argument("--grid-files", type=int, default=10000, help="files of the lanes x world size grid")
    ap.add_argument("--s3", default="yes", choices=["yes", "no"], help="the S3 (moto on loopback) listing point")
    ap.add_argument("--s3-files", type=int, default=10000)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16, help="timed steps (CPU per step)")
    ap.add_argument("--warmup", type=int, default=4, help="steps after the first batch before timing")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="point names or globs (--list)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--zephon-src", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--png", default="")
    ap.add_argument("--before", default="", help="plot: another run's JSON to draw in grey (before a change)")
    args = ap.parse_args(argv)
    data = Path(args.data).resolve()
    args.zephon_src = str(Path(args.zephon_src).resolve()) if args.zephon_src else ""
    chosen = points(args)
    if args.only:
        chosen = select_configs(chosen, only_patterns(args.only))
    if args.list:
        print("\n".join(p["name"] for p in chosen))
        return 0
    before = json.loads(Path(args.before).read_text()) if args.before else None
    if args.what == "plot":
        plot(json.loads(Path(args.json).read_text()), Path(args.png), before)
        return 0
    sizes = sorted({p["files"] for p in chosen} | (set(args.files) if args.what == "prepare" else set()))
    prepare(data, sizes)
    if args.what == "prepare":
        return 0

    print(f"# zephon scale study on {data}; machine: {machine_info()}", flush=True)
    loads = [uptime()]
    print(f"uptime before: {loads[0]}", flush=True)
    moto, s3 = None, None
    if any(p["study"] == "s3" for p in chosen):
        moto = Moto(data / "moto.log")
        web, code = moto.upload(data, args.s3_files)
        s3 = (web, code, moto.options)
    t0 = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {p["name"]: [] for p in chosen}
    try:
        for rnd in range(args.repeats):
            print(f"\n## round {rnd + 1} of {args.repeats}", flush=True)
            for p in chosen:
                r = run_task(SCRIPT, task_of(p, args, data, s3), timeout=args.timeout)
                r.pop("rss_timeline", None)
                runs[p["name"]].append(r)
                if r.get("ok"):
                    print(f"  {p['name']:<26} listing {r['listing_s']:.2f}s plan {r['plan_s']:.2f}s build "
                          f"{r['build_s']:.2f}s first {r['first_batch_s']:.2f}s cpu/step {r['cpu_per_step_s']:.3f}s "
                          f"peak RSS {r['peak_rss_mb']:.0f} MB state {r['state_bytes']} B", flush=True)
                else:
                    print(f"  {p['name']:<26} FAILED: {r.get('error')}", flush=True)
            loads.append(uptime())
            print(f"uptime: {loads[-1]}", flush=True)
    finally:
        if moto:
            moto.stop()
    results = [{**p, "summary": summarise(runs[p["name"]]), "runs": runs[p["name"]]} for p in chosen]
    for r in results:  # the summary keeps one run's first lanes (compared across world sizes); tracebacks: the log
        for run in r["runs"]:
            run.pop("first_lanes", None)
            run.pop("traceback", None)
    print(tables(results))
    problems = check_world_independence(results)
    print("\nrank 0's first lanes, same state at every world size: " + ("yes" if not problems else
                                                                       "NO: " + "; ".join(problems)))
    print(f"\ntotal {time.perf_counter() - t0:.0f}s; load during the run (uptime after each round):")
    for line in loads:
        print(f"  {line}")
    doc = {"args": {k: v for k, v in vars(args).items()}, "machine": machine_info(), "uptime": loads,
           "when": time.strftime("%Y-%m-%d"), "results": results, "world_independent": not problems,
           "problems": problems}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    if args.png:
        plot(doc, Path(args.png), before)
    failed = [r for r in results if r["summary"]["failed"]]
    return 1 if problems else (2 if failed else 0)


if __name__ == "__main__":
    task_main({"point": child_point})
    sys.exit(main())

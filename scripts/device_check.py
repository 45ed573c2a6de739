#!/usr/bin/env python
"""The device check: Zephon on a GPU machine, every part time-boxed, one JSON file of results.

Run through scripts/device_check.sh (it puts the repository and both plugins on PYTHONPATH):

  bash scripts/device_check.sh --prepare [--megatron-lm-src DIR]   HERE, with the package index: the wheels
        the GPU machine lacks into .whl/ (cp312, manylinux x86_64), Megatron-LM's files into .megatron-lm/
        (from a git clone DIR), the size of what will travel (64 MiB at most), and the exact `run` call
  bash scripts/device_check.sh                           THERE, after that call installed the wheels: the check
  bash scripts/device_check.sh --cpu --out FILE.json     anywhere (tests/test_device_check.py, CI): the same
        parts on CPU, each shrunk to seconds, the same JSON schema

Parts, in the order they run (each in its own subprocess with a time box; a part that fails or runs out of
time is recorded as such and the next one starts; the whole check stays under --budget, 450 s on a GPU):

  environment    GPU name, driver, torch / CUDA / cuDNN / NCCL versions, CPUs, memory, Python, the versions of
                 the packages the parts use, the git commit (ZEPHON_COMMIT where the copy has no .git)
  h2d            the loader's batches (recipes/quickstart.toml: text [32, 2048]; recipes/vl_quickstart.toml:
                 flat uint8 pixel_values) copied to the device pageable (.to(device)) and pinned
                 (pin_memory() + .to(device, non_blocking=True)): MB/s and ms per step, and the SHA-256 of every
                 tensor copied back equal to the loader's
  torchtitan     Torchtitan's real trainer with zephon_torchtitan (--module zephon_torchtitan --config
                 llama3_debug): run A, data-parallel 2 for 4 steps with a checkpoint at step 2; run B, data-
                 parallel 1, resumed from A's step-2 checkpoint. The loader's row hashes (--dataloader.hash_log)
                 of B's steps 3-4 must equal A's. GPU: A is two ranks sharing cuda:0 over gloo (NCCL refuses two
                 ranks on one GPU; scripts/device_check_titan.py), B one rank on NCCL; should A fail there, A runs
                 on CPU ranks instead (plugins/torchtitan/testing/cpu_train.py) and B resumes it on the GPU. The
                 JSON says which ran. CPU: both on CPU ranks over gloo, as tests/test_torchtitan_e2e.py.
  megatron_core  megatron-core without Megatron-LM: (1) tests/megatron_worker.py under torchrun, 2 ranks over
                 gloo: the plugin's provider under megatron-core's parallel_state, data-parallel 2 saving the
                 data state at iteration 2, then tensor-parallel 2 / data-parallel 1 resuming it; iterations 3-4
                 must be equal; (2) one process on the device (NCCL on a GPU): the provider's micro-batches
                 equal zephon.build_loader's global batches, and feed two training steps of a 2-layer
                 megatron-core GPTModel (local layer spec) with a finite loss (on a GPU only: the model needs CUDA)
  megatron_lm    Megatron-LM's pretrain_gpt through `python -m zephon_megatron.pretrain_gpt`: 4 iterations saving
                 at 2, then a resume from iteration 2; the resume must report Zephon's data state and give the
                 same losses at iterations 3-4. Needs CUDA and the Megatron-LM files below; skipped without them.
  throughput     the benchmarks of scripts/bench/ (their own code, run as they run themselves: one subprocess
                 per configuration), at 1, 2, 4, 8, 16 workers (--cpu: 1, 2): text_pipeline.py (Zephon thread
                 and process runners, Grain, torchdata.nodes), vl_fetch_batch.py (Zephon, Grain,
                 torchdata.nodes) and vl_pipeline.py (Zephon thread and process runners, Grain; the script has
                 no torchdata.nodes peer), on corpora generated there by make_corpus.py and make_vl_corpus.py
                 (built in the background while the first parts run). Zephon's batch hashes must agree across
                 worker counts and runners. A peer's configuration that times out is run once more (its entry
                 says ``retried_after``); Zephon's are not.

Megatron-LM (what the megatron_lm part needs): the tag core_v0.16.1 (the megatron-core version CI tests,
plugins/megatron/README.md), these paths of it under .megatron-lm/: pretrain_gpt.py, gpt_builders.py,
model_provider.py and megatron/ (core, training, legacy, rl, post_training; ~7.6 MB). `--prepare
--megatron-lm-src DIR` extracts exactly these from a git clone DIR (`git archive core_v0.16.1 ...`).

The JSON: {"schema", "mode" ("gpu" | "cpu"), "started", "seconds", "budget_s", "command", "logs", "parts":
{NAME: {"status": "ok" | "failed" | "skipped", "reason": why (null when ok), "seconds", ...the part's
figures}}}. A part is ok only when everything it checks held; "skipped" always says why. Exit status 0 when
no part failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

from _common import run_task, task_main  # noqa: E402  (the benchmarks' isolated, time-boxed subprocess)

SCRIPT = Path(__file__).resolve()
SCHEMA = "zephon-device-check/1"
PARTS = ("environment", "h2d", "torchtitan", "megatron_core", "megatron_lm", "throughput")
OK, FAILED, SKIPPED = "ok", "failed", "skipped"

WHEEL_DIR = REPO / ".whl"
MEGATRON_DIR = REPO / ".megatron-lm"
MEGATRON_TAG = "core_v0.16.1"
MEGATRON_PATHS = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py", "megatron")
CARRY_LIMIT = 64 * 2**20

# What the GPU machine (Python 3.12, torch 2.11+cu130; no network) lacks, for these parts. Found by running
# --cpu with every other package of this machine made unimportable (the GPU machine's package list kept).
WHEELS = (
    "torchdata==0.11.0",        # Zephon's nodes (and Torchtitan's)
    "zstandard==0.25.0",        # Zephon reads .zst sources
    "simplejpeg==1.9.0",        # Zephon's fast JPEG path (the VL benchmarks compare decoders with it)
    "grain==0.2.18", "array-record==0.8.6", "portpicker==1.6.0",  # the Grain peer and its ArrayRecord source
    "torchtitan==0.3.0", "tyro==1.0.17", "docstring-parser==0.18.0", "typeguard==4.6.1",
    "spmd-types==0.2.3", "torch-checkpointing==0.1.1",  # Torchtitan 0.3 and what its trainer imports
    "datasets==4.7.0", "dill==0.4.0", "multiprocess==0.70.18",   # imported by torchtitan's data modules
    "megatron-core==0.16.1",    # the version CI tests the plugin with
    "pydantic==2.13.4", "pydantic-core==2.46.4", "annotated-types==0.7.0", "typing-inspection==0.4.2",  # megatron.rl
)
PIP_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                 "manylinux2014_x86_64", "manylinux1_x86_64")
INSTALL = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
           ".whl/*.whl && export PYTHONPATH=/tmp/site || exit;")

# Per mode: the whole check's budget, each part's time box (cap) and the time kept back for the parts after
# it, and the sizes of the work. GPU sizes fit 8 minutes on one GPU with 16 cores; CPU sizes a few minutes on 2.
PROFILES: dict[str, dict[str, Any]] = {
    "gpu": {
        "budget": 450, "caps": {"h2d": 60, "torchtitan": 200, "megatron_core": 90, "megatron_lm": 120},
        "keep": {"h2d": 10, "torchtitan": 60, "megatron_core": 20, "megatron_lm": 10, "throughput": 150},
        "h2d": {"batches": 6, "rounds": 5, "workers": 4},
        "titan": {"seq_len": None, "steps": 4, "ckpt": 2},
        # the extremes first: should the time box cut a sweep short, it drops the middle
        "workers": (1, 16, 4, 2, 8), "skip": (),
        "text_corpus": ["--packages", "numpy,pyarrow,tokenizers", "--max-docs", "30000", "--files", "16",
                        "--row-group", "250", "--tokenizer-sample-mb", "4", "--vocab-size", "16384"],
        "vl_corpus": ["--samples", "2000", "--per-shard", "250"],
        "windows": {"text": (24, 16, 2), "vl_fetch": (4, 8, 2), "vl_pipeline": (16, 8, 1)},  # warm-up, steps, repeats
        "run_cap": 60, "share": {"text": 0.4, "vl_fetch": 0.25, "vl_pipeline": 0.35},
    },
    "cpu": {
        "budget": 420, "caps": {"h2d": 90, "torchtitan": 180, "megatron_core": 90, "megatron_lm": 30},
        "keep": {"h2d": 10, "torchtitan": 40, "megatron_core": 20, "megatron_lm": 5, "throughput": 60},
        "h2d": {"batches": 2, "rounds": 2, "workers": 1},
        "titan": {"seq_len": 128, "steps": 4, "ckpt": 2},
        # every script and peer once, at 1 worker and at 2 where it is cheap; Zephon's process runner in the
        # text pipeline only (its lane processes start for seconds on 2 cores)
        "workers": (1, 2), "skip": (("vl_pipeline", "zephon_process"), ("text", 2), ("vl_pipeline", 2)),
        "text_corpus": ["--packages", "tokenizers", "--max-docs", "3000", "--files", "8", "--row-group", "100",
                        "--tokenizer-sample-mb", "1", "--vocab-size", "4096"],
        "vl_corpus": ["--samples", "200", "--per-shard", "50"],
        "windows": {"text": (2, 2, 1), "vl_fetch": (1, 2, 1), "vl_pipeline": (1, 1, 1)},
        "run_cap": 40, "share": {"text": 0.4, "vl_fetch": 0.25, "vl_pipeline": 0.35},
    },
}

# The throughput part's peers: (label, benchmark configuration for W workers). The configurations are the
# scripts' own (their names, kinds and parameters); only the worker counts go past the scripts' 0-2.
def text_peers(w: int) -> list[dict[str, Any]]:
    return [{"name": f"zephon_best_fit_{w}_thread", "kind": "zephon", "workers": w, "runner": "thread",
             "params": {"algorithm": "best_fit", "workers": w, "runner": "thread"}},
            {"name": f"zephon_best_fit_{w}_process", "kind": "zephon", "workers": w, "runner": "process",
             "params": {"algorithm": "best_fit", "workers": w, "runner": "process"}},
            {"name": f"grain_firstfit_{w}", "kind": "grain", "workers": w, "runner": "process",
             "params": {"packing": "firstfit", "workers": w}},
            {"name": f"torchdata_nodes_{w}_thread", "kind": "torchdata", "workers": w, "runner": "thread",
             "params": {"workers": w, "method": "thread"}}]


def vl_fetch_peers(w: int) -> list[dict[str, Any]]:
    return [{"name": f"zephon_{w}_thread", "kind": "zephon", "workers": w, "runner": "thread",
             "params": {"algorithm": "records", "runner": "thread"}},
            {"name": f"grain_{w}", "kind": "grain", "workers": w, "runner": "process", "params": {}},
            {"name": f"torchdata_nodes_{w}_thread", "kind": "torchdata", "workers": w, "runner": "thread",
             "params": {"method": "thread"}}]


def vl_pipeline_peers(w: int) -> list[dict[str, Any]]:
    return [{"name": f"zephon_{w}_{r}", "kind": "zephon", "workers": w, "runner": r,
             "params": {"algorithm": "best_fit", "runner": r}} for r in ("thread", "process")] + \
           [{"name": f"grain_{w}", "kind": "grain", "workers": w, "runner": "process", "params": {}}]


# -- small helpers -------------------------------------------------------------------------------------------
def part(status: str, reason: str | None = None, **figures: Any) -> dict[str, Any]:
    return {"status": status, "reason": reason, **figures}


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``cmd`` from the repository root, its output to ``log``; (exit code, last lines). 124 = timed out;
    the whole process group is killed then (torchrun's ranks with it)."""
    import signal

    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as f:
        p = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                             start_new_session=True)
        try:
            rc = p.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = 124
    return rc, tail(log)


def tail(log: Path, n: int = 25) -> str:
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    return "\n".join(lines[-n:])[-3000:]


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def sha256(t: Any) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()).hexdigest()


def plugin_env() -> dict[str, str]:
    paths = [str(REPO), str(REPO / "plugins" / "torchtitan"), str(REPO / "plugins" / "megatron")]
    return {"PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


# -- environment (in the driver's own process: quick, and needed for the rest) ----------------------------------
def part_environment(mode: str) -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    facts: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
    }
    try:
        import psutil
        facts["memory_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                     gpu_memory_gb=round(props.total_memory / 2**30, 1),
                     gpu_capability=list(torch.cuda.get_device_capability(0)),
                     cudnn=torch.backends.cudnn.version(), nccl=".".join(map(str, torch.cuda.nccl.version())))
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        facts["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
        facts["driver"] = q.stdout.split(",")[1].strip() if q.returncode == 0 and "," in q.stdout else None
    except (OSError, subprocess.TimeoutExpired) as e:
        facts["nvidia_smi"] = f"not run: {e}"
    versions = {}
    for name in ("torch", "torchdata", "torchtitan", "megatron-core", "grain", "array-record", "triton", "tokenizers",
                 "sentencepiece", "tiktoken", "pyarrow", "numpy", "pillow", "simplejpeg", "zstandard", "transformers",
                 "datasets", "psutil"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    import zephon
    versions["zephon"] = getattr(zephon, "__version__", None)
    facts["packages"] = versions
    facts["zephon_from"] = str(Path(zephon.__file__).parent)
    facts["wheels_carried"] = sorted(p.name for p in WHEEL_DIR.glob("*.whl"))
    tag = MEGATRON_DIR / "TAG"
    facts["megatron_lm_carried"] = tag.read_text().strip() if tag.exists() else None
    facts["git"] = git_commit()
    status = OK
    reason = None
    if mode == "gpu" and not torch.cuda.is_available():
        status, reason = FAILED, "torch sees no CUDA device: the GPU parts cannot run (use --cpu on a CPU machine)"
    return part(status, reason, **facts)


def git_commit() -> dict[str, Any]:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return {"commit": head.stdout.strip(), "dirty": bool(dirty), "from": "git"}
    except (OSError, subprocess.TimeoutExpired):
        pass
    # the GPU machine gets a copy of the working tree without .git: --prepare's command passes the commit
    return {"commit": os.environ.get("ZEPHON_COMMIT") or None, "dirty": os.environ.get("ZEPHON_DIRTY") == "1",
            "from": "ZEPHON_COMMIT" if os.environ.get("ZEPHON_COMMIT") else "unknown (no .git, no ZEPHON_COMMIT)"}


# -- h2d ---------------------------------------------------------------------------------------------------------
def part_h2d(task: dict[str, Any]) -> dict[str, Any]:
    import torch

    import zephon

    gpu = task["mode"] == "gpu"
    cfg = PROFILES[task["mode"]]["h2d"]
    device = torch.device("cuda:0" if gpu else "cpu")

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    try:  # a CPU-only torch refuses pinned memory (no accelerator to pin it for)
        torch.empty(1).pin_memory()
        pin_why = None
    except RuntimeError as e:
        pin_why = f"pin_memory() refused by this torch ({torch.__version__}): {str(e).splitlines()[0]}"
    out: dict[str, Any] = {"device": str(device), "pinned_available": pin_why is None, "pinned_reason": pin_why}
    all_identical = True
    for kind, recipe in (("text", "recipes/quickstart.toml"), ("vl", "recipes/vl_quickstart.toml")):
        with zephon.build_loader(zephon.load_recipe(REPO / recipe), rank=0, world_size=1, num_workers=cfg["workers"]) as loader:
            it = iter(loader)
            # cloned: a loader may reuse a batch's memory for a later batch (reuse_batch_memory)
            batches = [{k: v.clone() for k, v in next(it).items() if isinstance(v, torch.Tensor)}
                       for _ in range(cfg["batches"])]
        nbytes = sum(v.numel() * v.element_size() for b in batches for v in b.values())
        want = [{k: sha256(v) for k, v in b.items()} for b in batches]
        r: dict[str, Any] = {"recipe": recipe, "steps": len(batches), "mb_per_step": nbytes / len(batches) / 1e6,
                             "keys": sorted(batches[0]), "rounds": cfg["rounds"]}

        def timed(copy: Callable[[dict], dict], source: list[dict]) -> tuple[float, list[dict]]:
            got = [copy(b) for b in source]  # warm-up (allocator, first touch), and the copies to check
            sync()
            t0 = time.perf_counter()
            for _ in range(cfg["rounds"]):
                for b in source:
                    copy(b)
                sync()
            return (time.perf_counter() - t0) / (cfg["rounds"] * len(source)), got

        def check(got: list[dict]) -> bool:  # the bytes that arrived, copied back to the host
            return [{k: sha256(v.cpu()) for k, v in b.items()} for b in got] == want

        def figures(seconds: float, got: list[dict]) -> dict[str, Any]:
            return {"ms_per_step": 1e3 * seconds, "mb_per_s": nbytes / len(batches) / seconds / 1e6,
                    "identical": check(got)}

        # copy=True: on CPU, .to("cpu") would hand back the same tensor and check nothing
        r["pageable"] = figures(*timed(lambda b: {k: v.to(device, copy=True) for k, v in b.items()}, batches))
        ok = r["pageable"]["identical"]
        if pin_why is None:  # what a trainer's loop does: pin (the loader's pin thread), then copy asynchronously
            t0 = time.perf_counter()
            pinned = [{k: v.pin_memory() for k, v in b.items()} for b in batches]
            pin_ms = 1e3 * (time.perf_counter() - t0) / len(batches)
            r["pinned"] = figures(*timed(lambda b: {k: v.to(device, non_blocking=True, copy=True)
                                                    for k, v in b.items()}, pinned))
            r["pinned"]["pin_ms_per_step"] = pin_ms
            ok = ok and r["pinned"]["identical"]
            r["pinned_speedup"] = r["pageable"]["ms_per_step"] / r["pinned"]["ms_per_step"]
        else:
            r["pinned"] = {"skipped": pin_why}
        r["identical"] = ok
        all_identical = all_identical and ok
        out[kind] = r
    if not all_identical:
        return part(FAILED, "bytes copied to the device and back differ from the loader's batch", **out)
    return part(OK, None, **out)


# -- torchtitan --------------------------------------------------------------------------------------------------
TITAN_CPU_LAUNCHER = REPO / "plugins" / "torchtitan" / "testing" / "cpu_train.py"
TITAN_GPU_LAUNCHER = REPO / "scripts" / "device_check_titan.py"


def titan_steps(hash_dir: Path) -> dict[int, list[str]]:
    """The global batch of each step: every rank's row hashes placed by their global row index."""
    rows: dict[int, dict[int, str]] = {}
    for f in sorted(hash_dir.glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            for i, digest in enumerate(rec["rows"]):
                rows.setdefault(rec["step"], {})[rec["first_row"] + i] = digest
    return {s: [r[i] for i in sorted(r)] for s, r in sorted(rows.items())}


def titan_losses(log: Path) -> dict[int, float]:
    """Rank 0's logged losses, from the console (``step: N ... loss: X``)."""
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        m = re.search(r"step:\s*(\d+).*?loss:\s*([-\d.eE+]+)", re.sub(r"\x1b\[[0-9;]*m", "", line))
        if m and "validat" not in line:
            out[int(m.group(1))] = float(m.group(2))
    return out


def part_torchtitan(task: dict[str, Any]) -> dict[str, Any]:
    mode, work, deadline = task["mode"], Path(task["work"]) / "torchtitan", task["deadline"]
    cfg = PROFILES[mode]["titan"]
    try:
        import triton  # noqa: F401  (torchtitan.trainer imports it, whatever the device)
        import torchtitan  # noqa: F401
    except ImportError as e:
        why = f"torchtitan or triton is not importable ({e}); CPU: pip install --no-deps triton (plugin README)"
        if os.environ.get("ZEPHON_REQUIRE_TORCHTITAN") == "1":  # CI: never skip it silently
            return part(FAILED, why + "; ZEPHON_REQUIRE_TORCHTITAN=1")
        return part(SKIPPED, why)
    import torch

    shutil.rmtree(work, ignore_errors=True)  # a dump folder with a checkpoint in it would be resumed from
    work.mkdir(parents=True)
    recipe = REPO / "recipes" / "torchtitan" / "llama3_debug.toml"  # the plugin's own llama3_debug recipe
    if cfg["seq_len"]:  # CPU: the same recipe with shorter rows (paths made absolute: it is written elsewhere)
        text = recipe.read_text().replace('path = "../', f'path = "{recipe.parent.parent}/')
        recipe = work / "llama3_debug_short.toml"
        recipe.write_text(re.sub(r"(?m)^seq_len = \d+", f"seq_len = {cfg['seq_len']}", text))
    common = ["--module", "zephon_torchtitan", "--config", "llama3_debug", "--dataloader.recipe", str(recipe),
              "--training.steps", str(cfg["steps"]), "--checkpoint.enable", "--checkpoint.interval", str(cfg["ckpt"]),
              "--parallelism.data_parallel_shard_degree", "1",  # dp by replication (all-reduce: gloo has it)
              "--metrics.disable_color_printing", "--metrics.log_freq", "1"]
    cpu_args = ["--training.disable_cuda_graphs", "--training.mixed_precision_param", "float32"]
    gpu = mode == "gpu"
    if gpu and not torch.cuda.is_available():
        return part(FAILED, "no CUDA device")

    def launch(name: str, dp: int, on_gpu: bool, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
        dump = work / name
        launcher = TITAN_GPU_LAUNCHER if on_gpu else TITAN_CPU_LAUNCHER
        cmd = torchrun(dp) + [str(launcher), *common, *([] if on_gpu else cpu_args),
                              "--parallelism.data_parallel_replicate_degree", str(dp),
                              "--dataloader.hash_log", str(dump / "hashes"), "--dump_folder", str(dump)]
        env = {**plugin_env(), **(extra_env or {})}
        if not on_gpu:
            env["CUDA_VISIBLE_DEVICES"] = ""
        t0 = time.perf_counter()
        rc, out = run_logged(cmd, dump / "log.txt", deadline - time.time() - 5, env)
        return {"dp": dp, "device": "cuda:0" if on_gpu else "cpu", "backend": env.get("ZEPHON_DC_BACKEND", "nccl")
                if on_gpu else "gloo", "rc": rc, "seconds": round(time.perf_counter() - t0, 1),
                "log": str(dump / "log.txt"), **({"tail": out} if rc else {})}

    runs: dict[str, Any] = {}
    # A: data-parallel 2. On one GPU both ranks share cuda:0 over gloo; should that fail, CPU ranks.
    a = launch("A_dp2", 2, gpu, {"ZEPHON_DC_BACKEND": "gloo"} if gpu else None)
    runs["A"] = a
    a_dir = work / "A_dp2"
    if a["rc"] != 0 and gpu:
        runs["A_failed_on_gpu"] = a
        a = runs["A"] = launch("A_dp2_cpu", 2, False)
        a_dir = work / "A_dp2_cpu"
    how = (f"A: dp 2 on {a['device']} ({a['backend']}); B: dp 1 on {'cuda:0 (nccl)' if gpu else 'cpu (gloo)'}, "
           f"resumed from A's step-{cfg['ckpt']} checkpoint")
    if a["rc"] != 0:
        return part(FAILED, f"run A (dp 2) exited {a['rc']}", how=how, runs=runs)
    b_dir = work / "B_dp1"
    shutil.copytree(a_dir / "checkpoint" / f"step-{cfg['ckpt']}", b_dir / "checkpoint" / f"step-{cfg['ckpt']}")
    b = runs["B"] = launch("B_dp1", 1, gpu)
    if b["rc"] != 0:
        return part(FAILED, f"run B (dp 1, resumed) exited {b['rc']}", how=how, runs=runs)
    sa, sb = titan_steps(a_dir / "hashes"), titan_steps(b_dir / "hashes")
    resumed_log = (b_dir / "log.txt").read_text(errors="replace")
    after = list(range(cfg["ckpt"] + 1, cfg["steps"] + 1))
    checks = {
        "a_steps": sorted(sa), "b_steps": sorted(sb),
        "rows_per_step": sorted({len(r) for r in sa.values()}),
        "a_steps_distinct": len({tuple(r) for r in sa.values()}) == len(sa),
        "b_loaded_checkpoint": f"checkpoint/step-{cfg['ckpt']}" in resumed_log,
        "b_resumed_lanes": "Zephon: resumed lanes" in resumed_log,
        "hash_continuity": bool(sb) and sorted(sb) == after and all(sb[s] == sa.get(s) for s in sb),
        "first_hash_after_resume": sb[after[0]][0][:16] if sb.get(after[0]) else None,
    }
    losses = {"A": titan_losses(a_dir / "log.txt"), "B": titan_losses(b_dir / "log.txt")}
    ok = (checks["a_steps"] == list(range(1, cfg["steps"] + 1)) and checks["a_steps_distinct"]
          and checks["b_loaded_checkpoint"] and checks["b_resumed_lanes"] and checks["hash_continuity"])
    why = None if ok else "after the resume the batches did not continue identically (see checks)"
    return part(OK if ok else FAILED, why, how=how, runs=runs, checks=checks, losses=losses,
                note="losses are information: dp 2 and dp 1 reduce in different orders")


# -- megatron-core (no Megatron-LM checkout) ---------------------------------------------------------------------
MEGATRON_RECIPE = REPO / "recipes" / "megatron" / "gpt_demo.toml"   # 16 lanes x 2 rows x 1024 tokens


def part_megatron_core(task: dict[str, Any]) -> dict[str, Any]:
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        return part(SKIPPED, f"megatron-core is not importable ({e}); --prepare carries megatron-core==0.16.1")
    import torch

    work = Path(task["work"]) / "megatron_core"
    shutil.rmtree(work, ignore_errors=True)  # no data state of an earlier run to resume from
    work.mkdir(parents=True)
    out: dict[str, Any] = {"megatron_core": megatron.core.__version__, "recipe": str(MEGATRON_RECIPE.relative_to(REPO))}
    # (1) the CI worker, two ranks over gloo: dp 2 saving at iteration 2, then tp 2 / dp 1 resuming it
    phases = [{"name": "dp2", "tp": 1, "mbs": 4, "start": 0, "stop": 4, "save_at": [2]},
              {"name": "tp2_dp1_resumed", "tp": 2, "mbs": 8, "start": 2, "stop": 4}]
    res_file = work / "worker.pt"
    worker = [str(REPO / "tests" / "megatron_worker.py"), "--recipe", str(MEGATRON_RECIPE),
              "--ckpt", str(work / "ckpt"), "--out", str(res_file), "--phases", json.dumps(phases)]
    rc, log_tail = run_logged(torchrun(2) + worker,
                              work / "worker.log", task["deadline"] - time.time() - 15,
                              {**plugin_env(), "CUDA_VISIBLE_DEVICES": ""})
    resume: dict[str, Any] = {"rc": rc, "backend": "gloo (CPU)", "phases": [p["name"] for p in phases]}
    if rc == 0:
        res = torch.load(res_file, weights_only=False)
        a, b = res["phases"]
        same = [all(torch.equal(a["global"][i + 2][k], b["global"][i][k]) for k in a["global"][i + 2])
                for i in range(2)]
        resume.update(iterations_3_4_equal=same, dp_sizes=[a["ranks"][0]["dp_size"], b["ranks"][0]["dp_size"]],
                      data_state_files=len([f for f in res["files"] if f.endswith(".json")]))
        resume_ok = all(same)
    else:
        resume["tail"] = log_tail
        resume_ok = False
    out["provider_resume"] = resume
    # (2) one process on the device: the provider's micro-batches = build_loader's; a GPTModel trains on them
    step = model_step(task["mode"] == "gpu", work)
    out["provider_on_device"] = step
    ok = resume_ok and step["batches_equal"] and step.get("model", {}).get("status") in (OK, SKIPPED)
    if task["mode"] == "gpu" and step.get("model", {}).get("status") != OK:
        ok = False
    why = None if ok else "see provider_resume and provider_on_device"
    return part(OK if ok else FAILED, why, **out)


def model_step(gpu: bool, work: Path) -> dict[str, Any]:
    """World size 1 (NCCL on the GPU, gloo on CPU): megatron-core's parallel_state and micro-batch calculator,
    the plugin's provider as Megatron's training loop calls it, two iterations."""
    import socket
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    import zephon
    import zephon_megatron
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.core import parallel_state as mpu

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    device = torch.device("cuda:0" if gpu else "cpu")
    if gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1)
    recipe = zephon.load_recipe(MEGATRON_RECIPE)
    gbs, mbs, iters = recipe.lanes * recipe.batch_per_lane, 8, 2
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    nmc.init_num_microbatches_calculator(0, None, gbs, mbs, 1)
    args = SimpleNamespace(
        zephon_recipe=str(MEGATRON_RECIPE), zephon_valid_recipe=None, zephon_num_workers=2, zephon_runner="thread",
        zephon_prefetch=None, zephon_cu_seqlens=False, zephon_ignore_data_state=False, dataloader_type="external",
        micro_batch_size=mbs, global_batch_size=gbs, seq_length=recipe.seq_len, rampup_batch_size=None, eval_iters=0,
        create_attention_mask_in_dataloader=False, reset_attention_mask=False, reset_position_ids=True, iteration=0,
        load=None, save=str(work / "ckpt1"), non_persistent_ckpt_type=None, non_persistent_global_ckpt_dir=None)
    train, _, _ = zephon_megatron.make_datasets_provider(lambda: args)([gbs * iters, 0, 0])
    got = [[next(train) for _ in range(nmc.get_num_microbatches())] for _ in range(iters)]
    with zephon.build_loader(recipe, rank=0, world_size=1) as loader:
        ref = [b for b, _ in zip(loader, range(iters))]
    equal = all(torch.equal(torch.cat([m["tokens"] for m in mbs_]), r["input_ids"]) for mbs_, r in zip(got, ref))
    out: dict[str, Any] = {"device": str(device), "backend": "nccl" if gpu else "gloo", "iterations": iters,
                           "micro_batches": len(got[0]), "schema": {k: [str(v.dtype), list(v.shape)]
                                                                    for k, v in got[0][0].items()},
                           "batches_equal": equal}
    if not gpu:  # not run on CPU: megatron-core 0.16's GPTModel calls torch.cuda in its forward
        out["model"] = {"status": SKIPPED, "reason": "megatron-core's GPTModel needs CUDA (its rotary embeddings "
                                                     "and DotProductAttention call torch.cuda.current_device())"}
    else:
        out["model"] = gpt_steps(got, recipe)
    zephon_megatron.reset()
    nmc.destroy_num_microbatches_calculator()
    mpu.destroy_model_parallel()
    dist.destroy_process_group()
    return out


def gpt_steps(iterations: list[list[dict]], recipe: Any) -> dict[str, Any]:
    """Two optimizer steps of a 2-layer megatron-core GPTModel (local layer spec, bf16) on the provider's batches."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        model_parallel_cuda_manual_seed(1234)
        config = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=4, use_cpu_initialization=True,
                                   bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
        import zephon_megatron
        # the vocabulary the plugin gives Megatron (the recipe tokenizer's), padded as Megatron pads it (128)
        vocab = -(-zephon_megatron.megatron_args_defaults(str(MEGATRON_RECIPE))["vocab_size"] // 128) * 128
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                         max_sequence_length=recipe.seq_len, position_embedding_type="rope").cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses = []
        t0 = time.perf_counter()
        for micro_batches in iterations:
            opt.zero_grad()
            num, den = 0.0, 0.0
            for mb in micro_batches:
                mb = {k: v.cuda(non_blocking=True) for k, v in mb.items()}
                per_token = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"])  # [b, s]
                loss = (per_token.float() * mb["loss_mask"]).sum()
                loss.backward()
                num, den = num + float(loss), den + float(mb["loss_mask"].sum())
            opt.step()
            losses.append(num / den)
        torch.cuda.synchronize()
        finite = all(l == l and abs(l) < 1e6 for l in losses)
        return {"status": OK if finite else FAILED, "reason": None if finite else "non-finite loss",
                "losses": losses, "seconds": round(time.perf_counter() - t0, 2), "vocab": vocab}
    except Exception as e:  # noqa: BLE001 - recorded, with its type, as this sub-check's failure
        import traceback
        return {"status": FAILED, "reason": f"{type(e).__name__}: {e}"[:500],
                "traceback": traceback.format_exc()[-2000:]}


# -- Megatron-LM's pretrain_gpt ----------------------------------------------------------------------------------
def megatron_files_missing() -> list[str]:
    return [p for p in MEGATRON_PATHS if not (MEGATRON_DIR / p).exists()]


def part_megatron_lm(task: dict[str, Any]) -> dict[str, Any]:
    missing = megatron_files_missing()
    need = (f"Megatron-LM tag {MEGATRON_TAG}: {', '.join(MEGATRON_PATHS)} under .megatron-lm/ "
            f"(bash scripts/device_check.sh --prepare --megatron-lm-src DIR)")
    if missing:
        return part(SKIPPED, f"no Megatron-LM checkout carried (missing {', '.join(missing)}); needs {need}")
    tag = (MEGATRON_DIR / "TAG").read_text().strip() if (MEGATRON_DIR / "TAG").exists() else "unknown"
    if task["mode"] != "gpu":
        return part(SKIPPED, "Megatron-LM's pretrain_gpt needs CUDA (--cpu)", megatron_lm_tag=tag)
    work = Path(task["work"]) / "megatron_lm"
    shutil.rmtree(work, ignore_errors=True)
    gpt = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--max-position-embeddings",
           "1024", "--position-embedding-type", "rope", "--bf16", "--lr", "1e-4", "--min-lr", "1e-5",
           "--lr-decay-style", "constant", "--train-iters", "4", "--log-interval", "1", "--micro-batch-size", "8",
           "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
           "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
           "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1234",
           "--reset-position-ids", "--no-create-attention-mask-in-dataloader", "--eval-iters", "0",
           "--ckpt-format", "torch", "--save", str(work / "ckpt"), "--load", str(work / "ckpt"), "--save-interval", "2"]
    base = torchrun(1) + ["-m", "zephon_megatron.pretrain_gpt", "--megatron-lm", str(MEGATRON_DIR),
                          "--zephon-recipe", str(MEGATRON_RECIPE), *gpt]
    env = {**plugin_env(), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    runs: dict[str, Any] = {}
    for name, extra in (("train", []), ("resume", ["--ckpt-step", "2"])):
        t0 = time.perf_counter()
        rc, out = run_logged(base + extra, work / f"{name}.log", task["deadline"] - time.time() - 5, env)
        runs[name] = {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), **({"tail": out} if rc else {})}
        if rc:
            return part(FAILED, f"pretrain_gpt ({name}) exited {rc}", megatron_lm_tag=tag, runs=runs)

    def losses(log: Path) -> dict[int, float]:
        it = re.compile(r"iteration\s+(\d+)/\s*\d+.*?lm loss:\s*([-\d.eE+]+)")
        lines = log.read_text(errors="replace").splitlines()
        return {int(m.group(1)): float(m.group(2)) for m in map(it.search, lines) if m}

    la, lb = losses(work / "train.log"), losses(work / "resume.log")
    resumed = "train: resumed at step 2" in (work / "resume.log").read_text(errors="replace")
    same = sorted(lb) == [3, 4] and all(abs(lb[i] - la.get(i, float("nan"))) <= 1e-3 * max(1.0, abs(lb[i])) for i in lb)
    ok = resumed and same
    why = None if ok else "the resume did not report Zephon's data state or its losses differ"
    return part(OK if ok else FAILED, why,
                megatron_lm_tag=tag, runs=runs, losses={"train": la, "resume": lb}, zephon_resumed=resumed)


# -- throughput: the benchmark scripts, at more workers ----------------------------------------------------------
def build_data(task: dict[str, Any]) -> dict[str, Any]:
    """The benchmark corpora (started in the background by the driver): make_corpus.py's text corpus, and
    make_vl_corpus.py's image-caption corpus with Grain's ArrayRecord copy and the benchmark tokenizers."""
    prof, work = PROFILES[task["mode"]], Path(task["work"])
    py = [sys.executable]
    procs = {
        "text": subprocess.Popen(py + [str(BENCH / "make_corpus.py"), "--out", str(work / "text"), "--no-share-doc",
                                       "--min-docs", "100", "--force", *prof["text_corpus"]],
                                 cwd=REPO, stdout=open(work / "make_corpus.log", "wb"), stderr=subprocess.STDOUT),
        "vl": subprocess.Popen(py + [str(BENCH / "make_vl_corpus.py"), "--out", str(work / "vl"), "--docs", "0",
                                     "--no-debian", "--max-side", "640", *prof["vl_corpus"]],
                               cwd=REPO, stdout=open(work / "make_vl_corpus.log", "wb"), stderr=subprocess.STDOUT),
    }
    out = {k: {"rc": p.wait()} for k, p in procs.items()}
    if out["vl"]["rc"] == 0:
        try:
            import vl_common
            # Grain's format only: LitData and Mosaic Streaming are not on the GPU machine
            vl_common.write_native(work / "vl", force=True, formats=("arrayrecord",))
        except Exception as e:  # noqa: BLE001
            out["vl"]["rc"], out["vl"]["error"] = 1, f"native formats: {type(e).__name__}: {e}"
    for k, log in (("text", "make_corpus.log"), ("vl", "make_vl_corpus.log")):
        if out[k]["rc"]:
            out[k].setdefault("error", tail(work / log, 8))
    return out


def part_throughput(task: dict[str, Any]) -> dict[str, Any]:
    import _targets
    import text_pipeline
    import vl_fetch_batch
    import vl_pipeline

    prof, work, deadline = PROFILES[task["mode"]], Path(task["work"]), task["deadline"]
    data = task.get("data") or {}
    pipelines = {
        "text": (text_pipeline.SCRIPT, text_peers, "tokens_per_s", work / "text"),
        "vl_fetch": (vl_fetch_batch.SCRIPT, vl_fetch_peers, "samples_per_s", work / "vl"),
        "vl_pipeline": (vl_pipeline.SCRIPT, vl_pipeline_peers, "images_per_s", work / "vl"),
    }
    out: dict[str, Any] = {"workers": list(prof["workers"]), "windows": {}, "cpus": os.cpu_count()}
    problems = []
    start, total = time.time(), deadline - time.time()
    names = list(pipelines)
    for n, name in enumerate(names):
        script, peers, metric, corpus = pipelines[name]
        corpus_key = "text" if name == "text" else "vl"
        if (data.get(corpus_key) or {}).get("rc", 1) != 0:
            out[name] = {"status": SKIPPED, "reason": f"corpus not built: {data.get(corpus_key)}"}
            problems.append(f"{name}: corpus not built")
            continue
        # each pipeline gets its share of the box (what an earlier one left over goes to the later ones)
        share = sum(prof["share"][x] for x in names[:n + 1])
        sub_deadline = start + total * share if n < len(names) - 1 else deadline
        warmup, steps, repeats = prof["windows"][name]
        out["windows"][name] = {"warmup": warmup, "steps": steps, "repeats": repeats}
        extra: dict[str, Any] = {}
        if name == "vl_pipeline":  # the peers' transform gives Zephon's tokens and patches (the script's own check)
            try:
                extra["transform_check"] = vl_pipeline.check_transform(corpus)
            except Exception as e:  # noqa: BLE001
                extra["transform_check"] = f"FAILED: {type(e).__name__}: {e}"
                problems.append(f"{name}: Grain's transform check failed")
        table: dict[str, dict[str, Any]] = {}
        results: dict[str, dict[str, Any]] = {}
        for w in prof["workers"]:
            for cfg in peers(w):
                peer = cfg["name"].replace(f"_{w}", "", 1) if cfg["kind"] != "zephon" else \
                    f"zephon_{cfg['runner']}"
                if (name, peer) in prof["skip"] or (name, w) in prof["skip"]:
                    table.setdefault(peer, {})[str(w)] = {"ok": None, "skipped": f"not run in --{task['mode']} mode"}
                    continue
                left = sub_deadline - time.time()
                if left < 8:
                    table.setdefault(peer, {})[str(w)] = {"ok": False, "skipped": "time box"}
                    problems.append(f"{name}: {cfg['name']} not run (time box)")
                    continue
                t = {"kind": {"text": "text", "vl_fetch": "vl", "vl_pipeline": "vlp"}[name], "config": cfg,
                     "data": str(corpus), "steps": steps, "warmup": warmup, "repeats": repeats}
                if name == "text":
                    import zephon
                    rec = zephon.load_recipe(corpus / "recipe.toml")
                    t.update(batch=rec.global_batch_size, seq_len=rec.seq_len, fresh=False)
                if name == "vl_fetch":
                    t["mode"] = "fetch"
                r = run_task(script, t, timeout=min(prof["run_cap"], left))
                retried = None
                if r.get("timed_out") and cfg["kind"] != "zephon" and sub_deadline - time.time() >= 8:
                    # a peer that hangs once (Grain's processes did, once, on a loaded 2-core CI machine) is run
                    # again and the retry recorded; Zephon's own configurations get no second try
                    retried = r.get("error")
                    r = run_task(script, t, timeout=min(prof["run_cap"], sub_deadline - time.time()))
                results[cfg["name"]] = {**cfg, **r}
                if r.get("ok"):
                    table.setdefault(peer, {})[str(w)] = {
                        "ok": True, metric: r[metric], "first_batch_s": round(r["first_batch_s"], 3),
                        "peak_rss_mb": round(r["peak_rss_mb"]), "wall_s": round(r["wall_s"], 1),
                        **({"usable_tokens_per_s": r["usable_tokens_per_s"]} if "usable_tokens_per_s" in r else {}),
                        **({"retried_after": retried} if retried else {})}
                else:
                    table.setdefault(peer, {})[str(w)] = {"ok": False, "error": (r.get("error") or "")[:400],
                                                         **({"retried_after": retried} if retried else {})}
                    problems.append(f"{name}: {cfg['name']} failed")
        lines, mismatch, _ = _targets.zephon_hash_check(results)
        if mismatch:
            problems.append(f"{name}: Zephon's batch hashes differ between worker counts or runners")
        out[name] = {"metric": metric, "peers": table, "zephon_hashes": lines, **extra}
    if problems:
        return part(FAILED, "; ".join(problems)[:1500], **out)
    return part(OK, None, **out)


# -- the driver --------------------------------------------------------------------------------------------------
HANDLERS: dict[str, Callable[[dict], dict]] = {
    "h2d": part_h2d, "torchtitan": part_torchtitan, "megatron_core": part_megatron_core,
    "megatron_lm": part_megatron_lm, "throughput": part_throughput, "data": build_data,
}


def run_check(args: argparse.Namespace) -> int:
    mode = "cpu" if args.cpu else "gpu"
    prof = PROFILES[mode]
    budget = args.budget or prof["budget"]
    out_path = Path(args.out) if args.out else Path(os.environ["OUT"]) / "device_check.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="zephon-device-check-"))
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    deadline = t_start + budget
    report: dict[str, Any] = {"schema": SCHEMA, "mode": mode, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "budget_s": budget, "command": sys.argv, "workdir": str(work), "parts": {}}

    def save() -> None:
        report["seconds"] = round(time.time() - t_start, 1)
        out_path.write_text(json.dumps(report, indent=1, default=str))

    def record(name: str, result: dict[str, Any], seconds: float) -> None:
        result["seconds"] = round(seconds, 1)
        report["parts"][name] = result
        print(f"[{time.time() - t_start:6.0f}s] {name:<14} {result['status']:<8} {result.get('reason') or ''}"[:300],
              flush=True)
        save()

    # environment first: the rest runs whatever it finds
    t0 = time.time()
    try:
        record("environment", part_environment(mode), time.time() - t0)
    except Exception as e:  # noqa: BLE001
        record("environment", part(FAILED, f"{type(e).__name__}: {e}"), time.time() - t0)

    # the demo corpus and tokenizers (recipes/data, recipes/tok*.model) that h2d, torchtitan and megatron read
    t0 = time.time()
    if not (REPO / "recipes" / "tok.model").exists() or not (REPO / "recipes" / "data" / "vl").exists():
        rc, msg = run_logged([sys.executable, "-m", "zephon", "demo", "recipes"], work / "demo.log", 120, plugin_env())
        report["demo_recipes"] = {"rc": rc, "seconds": round(time.time() - t0, 1), **({"tail": msg} if rc else {})}
    # the benchmark corpora, in the background while the next parts run
    data_out = work / "data.json"
    builder = subprocess.Popen([sys.executable, str(SCRIPT), "--_task",
                                json.dumps({"kind": "data", "mode": mode, "work": str(work), "_out": str(data_out)})],
                               cwd=REPO, stdout=open(work / "data.log", "wb"), stderr=subprocess.STDOUT,
                               env={**os.environ, **plugin_env()})

    for name in PARTS[1:]:
        if args.only and name not in args.only.split(","):
            record(name, part(SKIPPED, f"not in --only {args.only}"), 0.0)
            continue
        later = sum(prof["keep"][p] for p in PARTS[PARTS.index(name) + 1:] if not args.only or p in args.only)
        box = min(prof["caps"].get(name, 1e9), deadline - time.time() - later)
        t0 = time.time()
        if box < 10:
            record(name, part(SKIPPED, f"no time left in the {budget:.0f} s budget"), 0.0)
            continue
        task = {"kind": name, "mode": mode, "work": str(work), "deadline": time.time() + box}
        if name == "throughput":  # wait for the corpora (inside this part's box)
            try:
                builder.wait(timeout=max(1.0, box - 30))
            except subprocess.TimeoutExpired:
                pass
            task["data"] = json.loads(data_out.read_text()) if data_out.exists() else \
                {"text": {"rc": 1, "error": "corpus build not finished in time (see data.log)"},
                 "vl": {"rc": 1, "error": "corpus build not finished in time (see data.log)"}}
            task["deadline"] = deadline
            box = deadline - time.time()
        r = run_task(SCRIPT, task, timeout=box + 15, extra_env=plugin_env())
        if r.get("ok"):
            result = {k: v for k, v in r.items() if k not in ("ok", "rss_timeline", "peak_main_rss_mb", "max_processes",
                                                              "wall_s", "peak_pss_mb")}
        else:  # the part itself crashed or ran past its box
            result = part(FAILED, r.get("error") or "failed", traceback=r.get("traceback", "")[-2000:])
        record(name, result, time.time() - t0)
    if builder.poll() is None:
        builder.kill()
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    report["summary"] = {n: p["status"] for n, p in report["parts"].items()}
    logs = out_path.parent / "device_check_logs.tar.gz"
    try:  # every log of the run, for a failure seen only on the GPU machine
        with tarfile.open(logs, "w:gz") as tar:
            for f in sorted(work.rglob("*.log")) + sorted(work.rglob("log.txt")):
                tar.add(f, arcname=str(f.relative_to(work)))
        report["logs"] = str(logs)
    except OSError as e:
        report["logs"] = f"not written: {e}"
    save()
    print(json.dumps(report["summary"]))
    print(f"wrote {out_path} ({time.time() - t_start:.0f} s)")
    if not args.keep_workdir and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if any(s == FAILED for s in report["summary"].values()) else 0


# -- --prepare (here, with the package index) ---------------------------------------------------------------------
def travelling_bytes(carry: list[Path]) -> tuple[int, dict[str, int]]:
    """What a `run` call sends: tracked and untracked-not-ignored files, plus the carried paths."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    tree = sum((REPO / n).stat().st_size for n in names if n and (REPO / n).is_file())
    sizes = {"working tree": tree}
    for c in carry:
        sizes[c.name] = sum(f.stat().st_size for f in c.rglob("*") if f.is_file())
    return sum(sizes.values()), sizes


def prepare(args: argparse.Namespace) -> int:
    WHEEL_DIR.mkdir(exist_ok=True)
    plat = [a for p in PIP_PLATFORMS for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *plat, "-d", str(WHEEL_DIR), *WHEELS]
    print("$ " + " ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode:
        print("pip download failed", file=sys.stderr)
        return 1
    # one version of each (two stop the whole install there): drop wheels that WHEELS no longer names
    wanted = {re.sub(r"[-_.]+", "_", w.split("==")[0]).lower() + "-" + w.split("==")[1] for w in WHEELS}
    for f in WHEEL_DIR.glob("*.whl"):
        if "-".join(f.name.split("-")[:2]).lower() not in wanted:
            print(f"removing {f.name} (not in the list)")
            f.unlink()
    if args.megatron_lm_src:
        src = Path(args.megatron_lm_src)
        shutil.rmtree(MEGATRON_DIR, ignore_errors=True)
        MEGATRON_DIR.mkdir()
        archive = subprocess.run(["git", "-C", str(src), "archive", MEGATRON_TAG, *MEGATRON_PATHS], capture_output=True)
        if archive.returncode:
            print(f"git archive {MEGATRON_TAG} failed in {src}: {archive.stderr.decode()[-500:]}", file=sys.stderr)
            return 1
        subprocess.run(["tar", "-x", "-C", str(MEGATRON_DIR)], input=archive.stdout, check=True)
        (MEGATRON_DIR / "TAG").write_text(MEGATRON_TAG + "\n")
    carry = [WHEEL_DIR] + ([MEGATRON_DIR] if not megatron_files_missing() else [])
    total, sizes = travelling_bytes(carry)
    print("\nwheels:")
    for f in sorted(WHEEL_DIR.glob("*.whl")):
        print(f"  {f.stat().st_size / 2**20:6.2f} MiB  {f.name}")
    print("\nwhat travels: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items())
          + f"; total {total / 2**20:.1f} MiB of {CARRY_LIMIT / 2**20:.0f} MiB")
    if megatron_files_missing():
        print(f"(no .megatron-lm/: the megatron_lm part will be skipped; --megatron-lm-src DIR extracts "
              f"{', '.join(MEGATRON_PATHS)} of {MEGATRON_TAG} from a git clone DIR)")
    if total > CARRY_LIMIT:
        print("too large to travel", file=sys.stderr)
        return 1
    commit = git_commit()
    env = f"ZEPHON_COMMIT={commit['commit']}" + (" ZEPHON_DIRTY=1" if commit["dirty"] else "")
    command = f"{INSTALL} {env} bash scripts/device_check.sh"
    print("\nthe run call (device tool):")
    print(json.dumps({"command": command, "carry": [c.name for c in carry], "timeout_s": 600}, indent=1))
    if commit["dirty"]:
        print("(the working tree has uncommitted changes: they travel too, and ZEPHON_DIRTY=1 says so)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", action="store_true",
                    help="here: download the wheels, check the size, print the run call")
    ap.add_argument("--megatron-lm-src", default="", metavar="DIR",
                    help=f"with --prepare: a Megatron-LM git clone to extract {MEGATRON_TAG}'s files from")
    ap.add_argument("--cpu", action="store_true", help="the same parts on CPU, shrunk to seconds")
    ap.add_argument("--out", default="", help="the JSON file (default: $OUT/device_check.json)")
    ap.add_argument("--budget", type=float, default=0, help="seconds for the whole check (default: gpu 450, cpu 420)")
    ap.add_argument("--only", default="", help="comma-separated parts to run (the others are recorded as skipped)")
    ap.add_argument("--workdir", default="", help="keep the corpora, checkpoints and logs here (default: a temporary "
                                                  "folder, removed at the end)")
    ap.add_argument("--keep-workdir", action="store_true", help="do not remove the temporary work folder")
    args = ap.parse_args(argv)
    if args.prepare:
        return prepare(args)
    if not args.out and not os.environ.get("OUT"):
        ap.error("give --out FILE.json (or set OUT)")
    return run_check(args)


if __name__ == "__main__":
    task_main(HANDLERS)
    sys.exit(main())

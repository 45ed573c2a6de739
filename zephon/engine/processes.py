"""Worker processes: the forkserver they fork from, started early and preloaded with Zephon.

Worker processes (the process executor's pool, the process runner's lane hosts) start from a
forkserver rather than by forking a trainer that may hold threads and a GPU context. Zephon asks the
forkserver to import Zephon (and torch) once, before it forks any worker, and starts it when a loader
with worker processes is built, so that the import overlaps the trainer's own set-up.
"""

from __future__ import annotations

import functools
import multiprocessing as mp

# Modules the forkserver imports once, before it forks any worker. Without them every worker imports
# zephon (and through torchdata, torch: ~2.5 s here) on its own before its first chunk; with them a
# worker starts as a fork of a process that has them (BENCHMARKS.md section 1d, scripts/bench/startup.py).
# The trainer's own `__main__` is no substitute: until CPython gh-126631 was fixed (3.11 has not) the
# forkserver never preloads it, whatever the preload list says.
WORKER_PRELOAD = ("zephon.engine.executors", "zephon.engine.hosts")


@functools.lru_cache(maxsize=1)
def _server_finds_this_zephon() -> bool:
    """Whether a forkserver would import *this* zephon. Until CPython gh-117378 was fixed (3.11 has
    not) the server ignores the parent's ``sys.path`` and imports from a fresh interpreter's (same executable,
    environment and directory); a program that put another checkout first on ``sys.path`` must not get
    workers forked from a server holding a different zephon. Asked once, of a fresh interpreter
    (``find_spec`` locates the package without importing it)."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parents[1] / "__init__.py"
    probe = "import importlib.util as u; s = u.find_spec('zephon'); print(s.origin if s else '')"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        return out.returncode == 0 and bool(out.stdout.strip()) and Path(out.stdout.strip()).resolve() == here
    except (OSError, subprocess.SubprocessError):
        return False


def process_context() -> mp.context.BaseContext:
    """forkserver where the platform has it (no fork of a threaded trainer), else spawn.

    The forkserver is asked to preload :data:`WORKER_PRELOAD` in addition to whatever the program
    already asked for, if it would import this very zephon. That only takes effect if the forkserver
    is not running yet: a program whose forkserver started earlier keeps its own preload. Correctness
    never depends on it: a worker imports what it lacks.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    current = list(getattr(server, "_preload_modules", None) or ["__main__"])
    wanted = current + [m for m in WORKER_PRELOAD if m not in current]
    if wanted != current and _server_finds_this_zephon():
        ctx.set_forkserver_preload(wanted)
    return ctx


def start_worker_server() -> mp.context.BaseContext:
    """:func:`process_context`, with its forkserver started now rather than at the first worker.

    Called when a loader with worker processes is built: the server's imports then overlap whatever the
    trainer does before its first batch (building the model, loading a checkpoint) instead of delaying
    that batch. A no-op for spawn, and for a forkserver already running.
    """
    ctx = process_context()
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()
    return ctx

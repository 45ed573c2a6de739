"""The Hugging Face tokenizer's own thread pool, under Zephon's worker threads.

``tokenizers`` spreads each ``encode_batch_fast`` call over a Rayon pool with a thread per core, unless
``TOKENIZERS_PARALLELISM`` is false; it reads the variable on every call. Zephon's worker processes set it
to false: the workers are the parallelism. The thread runner's workers live in the trainer's process,
where the variable is the user's. So a thread executor whose workers fill the cores this process may use
*acquires* the serial setting (sets the variable to ``"false"`` when it is unset) and releases it when it
closes (the variable is removed once the last such executor has closed and the value is still Zephon's).
With fewer workers than cores the pool stays on: it is what uses the idle cores (BENCHMARKS.md, 4e).

A value the user set is never changed. The variable is process-wide: while one loader holds the setting,
every tokenizer call in the process runs serially, a loader with fewer workers among them. It is read
and written only when an executor starts or closes, never per chunk.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from ..ops.base import Transform

VARIABLE = "TOKENIZERS_PARALLELISM"
_lock = threading.Lock()
_holders = 0  # open executors that hold the serial setting (the variable's value is then Zephon's)


def cgroup_cpus(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The container's CPU limit, rounded up (cgroup v2 ``cpu.max``, else v1's CFS quota); None: no limit."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 or period_us <= 0 else max(1, math.ceil(quota_us / period_us))
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """The CPUs this process may run on: its affinity mask, capped by a container's CPU limit."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    limit = cgroup_cpus()
    return min(cores, limit) if limit else cores


def uses_hf_tokenizer(transforms: Iterable[Transform]) -> bool:
    """Whether any of ``transforms`` tokenizes with a Hugging Face tokenizer."""
    return any(getattr(getattr(t, "spec", None), "kind", None) == "huggingface" for t in transforms)


def acquire(num_threads: int) -> bool:
    """Turn the pool off for an executor of ``num_threads`` tokenizing threads if they fill the cores and the
    user has not set the variable; True if this executor now holds the setting (call :func:`release`)."""
    global _holders
    with _lock:
        value = os.environ.get(VARIABLE)
        if (value is not None and not (_holders and value == "false")) or num_threads < usable_cores():
            return False
        if value is None:
            os.environ[VARIABLE] = "false"
            logging.getLogger("zephon").info(
                "%s=false: %d tokenize threads fill the %d cores this process may use (set it yourself to "
                "choose)", VARIABLE, num_threads, usable_cores())
        _holders += 1
        return True


def release() -> None:
    """An executor that held the serial setting has closed; the last one removes the variable, if it still
    holds Zephon's value."""
    global _holders
    with _lock:
        _holders = max(0, _holders - 1)
        if not _holders and os.environ.get(VARIABLE) == "false":
            del os.environ[VARIABLE]

"""Runners: where a loader's lanes and their stateless work run, one registry for every name.

=============  ===================================  ==========================================
runner         the lanes (merge, accumulators)       the stateless stages (read, tokenize...)
=============  ===================================  ==========================================
``thread``     this process                          ``num_workers`` threads
``pool``       this process                          ``num_workers`` worker processes
``process``    ``num_workers`` worker processes      a thread in each of them
``ray``        this process                          ``num_workers`` Ray actors
``ray-lanes``  ``num_workers`` Ray actors            a thread in each of them
=============  ===================================  ==========================================

``inline`` (and any runner with ``num_workers=0``) computes everything in the calling thread. An operator
may pick its own stage's executor kind (``executor=``). None of it changes a byte of the batches, only the
speed. This is the one module that brings in the Ray-backed parts (:mod:`.ray_executor`,
:mod:`.ray_lanes`), when a Ray runner is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..ops.base import EXECUTOR_KINDS
from .executors import Executor, InlineExecutor, ProcessExecutor, ThreadExecutor
from .hosts import LocalLanes, ProcessLanes
from .stages import StageProgram


@dataclass(frozen=True)
class Runner:
    """What a runner name means: ``lanes`` run ``"here"`` (this process), in ``"processes"`` or on ``"ray"``
    actors; ``stages``: the executor kind of the stateless stages when the lanes run here."""

    name: str
    lanes: str
    stages: str


RUNNERS: dict[str, Runner] = {r.name: r for r in (
    Runner("thread", "here", "thread"), Runner("pool", "here", "process"), Runner("process", "processes", "thread"),
    Runner("ray", "here", "ray"), Runner("ray-lanes", "ray", "thread"), Runner("inline", "here", "inline"))}


def runner_named(name: str) -> Runner:
    """The runner of this name, or an error listing them."""
    if name not in RUNNERS:
        raise ValueError(f"runner must be one of {tuple(RUNNERS)} (or a zephon executor), got {name!r}")
    return RUNNERS[name]


def make_executor(kind: str, program: StageProgram, num_workers: int, hf_tokenizing: bool = False,
                  **options: Any) -> Executor:
    """The executor of ``kind`` for ``program`` (``num_workers`` 0 always gives the inline one).

    Args:
        kind: ``"inline"``, ``"thread"``, ``"process"`` or ``"ray"``.
        program: the stateless stages it runs.
        num_workers: threads, processes or Ray actors.
        hf_tokenizing: the stages it runs tokenize with Hugging Face tokenizers (see
            :mod:`zephon.engine.tokenizer_pool`).
        options: for ``"ray"``, :class:`~zephon.engine.ray_executor.RayOptions` and ``address``.
    """
    if kind not in EXECUTOR_KINDS:
        raise ValueError(f"executor kind must be one of {EXECUTOR_KINDS}, got {kind!r}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if kind == "inline" or num_workers == 0:
        return InlineExecutor(program)
    if kind == "thread":
        return ThreadExecutor(program, num_workers, hf_tokenizing)
    if kind == "process":
        return ProcessExecutor(program, num_workers)
    from .ray_executor import RayExecutor

    return RayExecutor(program, num_workers, **options)


def make_host(runner: Runner, pipeline: Any, program: Any, lanes: Sequence[int], num_workers: int,
              prefetch: int | None, events: list, executor_for: Callable[[int, int], Executor], depth: Any,
              ray: dict[str, Any]) -> Any:
    """The host of a rank's lanes for ``runner``: lanes in this process (their stages on ``executor_for``'s
    executors, ``depth`` in flight), or whole lanes on worker processes or Ray actors (``prefetch`` steps
    ahead)."""
    if num_workers and runner.lanes == "processes":
        return ProcessLanes(pipeline, program, lanes, num_workers, prefetch or 4, events)
    if num_workers and runner.lanes == "ray":
        from .ray_lanes import RayLanes

        return RayLanes(pipeline, program, lanes, num_workers, prefetch or 4, events, **ray)
    return LocalLanes(program, lanes, executor_for, depth, events)

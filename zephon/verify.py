"""The determinism harness: global-batch hashes across world sizes, workers and resumes.

Every rank of a world size is built in this one process (sharing one work plan and one runner), its
batches are concatenated in rank order and hashed (:func:`zephon.global_digest`). The same functions
back ``zephon verify`` and the test suite.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Sequence

from .batches.packed import global_digest
from .engine.executors import Executor
from .engine.runners import make_executor
from .engine.tokenizer_pool import uses_hf_tokenizer
from .loader import build_loader
from .recipe.references import as_pipeline
from .plan import WorkPlan
from .state import merge_states

_KIND = {"thread": "thread", "pool": "process"}


def _global_step(loaders: list, program: Any) -> list | None:
    """One global step of simulated ranks; with finite sources, the ranks agree on the end as a process group
    would (all full, for partial="drop"; any with data, for "pad"). None once the data has ended."""
    try:
        prepared = [ld._prepare_step() for ld in loaders]
    except StopIteration:
        return None
    oks = [ok for _, ok in prepared]
    ok = all(oks) if program.partial == "drop" else any(oks)
    if not ok:  # every rank ends here (and records it in its state)
        for ld, (rows, _) in zip(loaders, prepared):
            with contextlib.suppress(StopIteration):
                ld._finish_step(rows, False)
        return None
    return [ld._finish_step(rows, True) for ld, (rows, _) in zip(loaders, prepared)]


def _shared_executor(program: Any, num_workers: int, runner: str) -> Executor | None:
    """One executor (inline, threads or a process pool) shared by all ranks of the simulation; whole-lane
    runners (``runner="process"``) belong to each loader."""
    if runner in ("process", "ray-lanes") and num_workers:
        return None
    return make_executor(_KIND.get(runner, runner) if num_workers else "inline", program.stages, num_workers,
                         hf_tokenizing=uses_hf_tokenizer(program.stages.transforms()))


def global_hashes(pipeline: Any, world_size: int, steps: int, num_workers: int = 0, runner: str = "thread",
                  resume_at: int | None = None, resume_world_size: int | None = None,
                  plan: WorkPlan | None = None) -> list[str]:
    """Hashes of global batches 0..steps-1 on ``world_size`` ranks (``pipeline``: a Pipeline or a Recipe).

    With ``resume_at=k``: run k steps, take every rank's state, merge them, rebuild the loaders on
    ``resume_world_size`` ranks (fresh executors too), load the merged state and run the remaining steps.
    """
    pipe = as_pipeline(pipeline)
    program = pipe.compile(plan)
    first = steps if resume_at is None else resume_at
    hashes, state = _run(pipe, program, world_size, first, num_workers, runner, None)
    if resume_at is None:
        return hashes
    more, _ = _run(pipe, program, resume_world_size or world_size, steps - resume_at, num_workers, runner, state)
    return hashes + more


def _run(pipe: Any, program: Any, world_size: int, steps: int, num_workers: int, runner: str,
         state: dict | None) -> tuple[list[str], dict]:
    pool = _shared_executor(program, num_workers, runner)
    loaders = [build_loader(pipe, rank=r, world_size=world_size, runner=pool or runner, num_workers=num_workers,
                            program=program) for r in range(world_size)]
    try:
        if state is not None:
            for ld in loaders:
                ld.load_state_dict(state)
        hashes = []
        for _ in range(steps):
            batch = _global_step(loaders, program)
            if batch is None:  # finite sources: the data ended at this step, on every rank
                break
            hashes.append(global_digest(batch))
        return hashes, merge_states([ld.state_dict() for ld in loaders])
    finally:
        for ld in loaders:
            ld.close()
        if pool is not None:
            pool.close()


REFERENCE = "W=1 workers=0 inline"  # the configuration every other one is compared with


@dataclass
class VerifyReport:
    """Outcome of :func:`verify`: the reference's hashes (:data:`REFERENCE`, steps 0..steps-1) and one row
    per other configuration, compared with them."""

    steps: int
    reference: list[str]
    rows: list[tuple[str, int, bool]] = field(default_factory=list)  # (config, first bad step or -1, ok)
    reference_name: str = REFERENCE

    @property
    def ok(self) -> bool:
        return all(ok for _, _, ok in self.rows)


def verify(recipe: Any, world_sizes: Sequence[int], steps: int, resume_at: int | None = None,
           num_workers: Sequence[int] = (0,), runner: str = "thread") -> VerifyReport:
    """Compare global-batch hashes for every world size, worker count (and resumes between world sizes)
    with world size 1 inline, the reference: that configuration itself is not compared with itself."""
    recipe = as_pipeline(recipe)
    plan = WorkPlan(recipe)
    reference = global_hashes(recipe, 1, steps, plan=plan)
    report = VerifyReport(steps, reference)

    def record(name: str, hashes: list[str]) -> None:
        bad = next((i for i, (a, b) in enumerate(zip(reference, hashes)) if a != b), -1)
        report.rows.append((name, bad, bad < 0 and len(hashes) == len(reference)))

    for w in world_sizes:
        for nw in num_workers:
            if w == 1 and nw == 0:  # the reference itself
                continue
            record(f"W={w} workers={nw} {runner if nw else 'inline'}",
                   global_hashes(recipe, w, steps, nw, runner, plan=plan))
    if resume_at is not None:
        for w in world_sizes:
            w2 = world_sizes[(list(world_sizes).index(w) + 1) % len(world_sizes)]
            record(f"W={w} -> W={w2} at step {resume_at}",
                   global_hashes(recipe, w, steps, resume_at=resume_at, resume_world_size=w2, plan=plan))
    return report

"""The determinism harness: global-batch hashes across world sizes, workers and resumes.

Every rank of a world size is built in this one process (sharing one work plan and one runner), its
batches are concatenated in rank order and hashed (:func:`zephon.global_digest`). The same functions
back ``zephon verify`` and the test suite.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .collate import global_digest
from .loader import build_loader
from .plan import WorkPlan
from .recipe import Recipe
from .runner import Runner
from .state import merge_states


def _loaders(recipe: Recipe, world_size: int, plan: WorkPlan, runner: Runner | str, num_workers: int) -> list:
    return [build_loader(recipe, rank=r, world_size=world_size, runner=runner, num_workers=num_workers, plan=plan)
            for r in range(world_size)]


def _pool(recipe: Recipe, plan: WorkPlan, num_workers: int, runner: str) -> Runner | None:
    """One chunk runner (threads or a process pool) shared by all ranks of the simulation; whole-lane
    process runners (``runner="process"``) belong to each loader."""
    if num_workers == 0 or runner == "thread":
        return Runner(recipe, plan, num_workers)
    return Runner(recipe, plan, num_workers, "pool") if runner == "pool" else None


def global_hashes(recipe: Recipe, world_size: int, steps: int, num_workers: int = 0, runner: str = "thread",
                  resume_at: int | None = None, resume_world_size: int | None = None,
                  plan: WorkPlan | None = None) -> list[str]:
    """Hashes of global batches 0..steps-1 on ``world_size`` ranks.

    With ``resume_at=k``: run k steps, take every rank's state, merge them, rebuild the loaders on
    ``resume_world_size`` ranks (fresh runner too), load the merged state and run the remaining steps.
    """
    plan = plan or WorkPlan(recipe)
    first = steps if resume_at is None else resume_at
    hashes, state = _run(recipe, plan, world_size, first, num_workers, runner, None)
    if resume_at is None:
        return hashes
    more, _ = _run(recipe, plan, resume_world_size or world_size, steps - resume_at, num_workers, runner, state)
    return hashes + more


def _run(recipe: Recipe, plan: WorkPlan, world_size: int, steps: int, num_workers: int, runner: str,
         state: dict | None) -> tuple[list[str], dict]:
    pool = _pool(recipe, plan, num_workers, runner)
    loaders = _loaders(recipe, world_size, plan, pool or runner, num_workers)
    try:
        if state is not None:
            for ld in loaders:
                ld.load_state_dict(state)
        hashes = [global_digest([next(ld) for ld in loaders]) for _ in range(steps)]
        return hashes, merge_states([ld.state_dict() for ld in loaders])
    finally:
        for ld in loaders:
            ld.close()
        if pool is not None:
            pool.close()


@dataclass
class VerifyReport:
    """Outcome of :func:`verify`: one row per configuration, compared to the first."""

    steps: int
    reference: list[str]
    rows: list[tuple[str, int, bool]] = field(default_factory=list)  # (config, first bad step or -1, ok)

    @property
    def ok(self) -> bool:
        return all(ok for _, _, ok in self.rows)


def verify(recipe: Recipe, world_sizes: Sequence[int], steps: int, resume_at: int | None = None,
           num_workers: Sequence[int] = (0,), runner: str = "thread") -> VerifyReport:
    """Compare global-batch hashes for every world size (and resumes between them) to world size 1."""
    plan = WorkPlan(recipe)
    reference = global_hashes(recipe, 1, steps, plan=plan)
    report = VerifyReport(steps, reference)

    def record(name: str, hashes: list[str]) -> None:
        bad = next((i for i, (a, b) in enumerate(zip(reference, hashes)) if a != b), -1)
        report.rows.append((name, bad, bad < 0 and len(hashes) == len(reference)))

    for w in world_sizes:
        for nw in num_workers:
            record(f"W={w} workers={nw} {runner if nw else 'inline'}",
                   global_hashes(recipe, w, steps, nw, runner, plan=plan))
    if resume_at is not None:
        for w in world_sizes:
            w2 = world_sizes[(list(world_sizes).index(w) + 1) % len(world_sizes)]
            record(f"W={w} -> W={w2} at step {resume_at}",
                   global_hashes(recipe, w, steps, resume_at=resume_at, resume_world_size=w2, plan=plan))
    return report

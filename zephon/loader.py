"""The rank-level loader: this rank's lanes, in lane order, as a dict of tensors per step.

``build_loader`` (or ``Pipeline.build``) is the entry point. With ``W`` data-parallel ranks, rank ``r``
owns the contiguous lanes ``[r*L/W, (r+1)*L/W)``; concatenating the ranks' batches in rank order gives
the global batch, which is therefore the same for every ``W``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from torchdata.nodes import BaseNode

from .collate import collate
from .compile import CompiledPipeline
from .engine.counters import LaneCounters
from .engine.executors import EXECUTOR_KINDS, Executor, make_executor
from .engine.hosts import LocalLanes, ProcessLanes
from .engine.lane import lane_depth
from .pipeline import Pipeline
from .recipe import Recipe, load_recipe
from .state.checkpoint import STATE_FORMAT, STATE_VERSION, check_compatible, check_container, seal
from .state.lane import LaneState, StateError

RUNNERS = ("thread", "pool", "process")
_RUNNER_KIND = {"thread": "thread", "pool": "process"}  # the executor kind behind each chunk runner


def lanes_of_rank(lanes: int, rank: int, world_size: int) -> range:
    """The contiguous lanes owned by ``rank``; errors name the numbers when they do not fit."""
    if world_size < 1 or lanes % world_size:
        divisors = [d for d in range(1, lanes + 1) if lanes % d == 0]
        raise ValueError(f"world_size={world_size} does not divide lanes={lanes}: every rank must own the "
                         f"same number of lanes. Use a world size in {divisors}, or a pipeline whose lanes "
                         f"is a multiple of {world_size} (lanes is fixed for the life of a run).")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, world_size={world_size}).")
    per = lanes // world_size
    return range(rank * per, (rank + 1) * per)


def as_pipeline(source: Pipeline | Recipe | str, text_map: Callable | None = None,
                text_filter: Callable | None = None) -> Pipeline:
    """A pipeline from a pipeline, a recipe or a recipe path (``text_map``/``text_filter``: legacy hooks)."""
    if isinstance(source, str):
        source = load_recipe(source)
    if isinstance(source, Recipe):
        from .recipe_steps import recipe_to_pipeline

        return recipe_to_pipeline(source, text_map, text_filter)
    if not isinstance(source, Pipeline):
        raise TypeError(f"build_loader needs a zephon.Pipeline, a Recipe or a recipe path, got {source!r}")
    if text_map is not None or text_filter is not None:
        raise ValueError("text_map/text_filter are for recipes; with a pipeline use .map_field() / .filter_field()")
    return source


class _RankNode(BaseNode[dict]):
    """The torchdata node behind :class:`ZephonLoader`: one batch dict per ``next()``."""

    def __init__(self, loader: "ZephonLoader") -> None:
        super().__init__()
        self._loader = loader

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._loader._reset(initial_state)

    def next(self) -> dict[str, Any]:
        return self._loader._next_batch()

    def get_state(self) -> dict[str, Any]:
        return self._loader._state()


class ZephonLoader:
    """Iterable of this rank's batches, with lane-keyed ``state_dict``/``load_state_dict``.

    Iteration is endless (sources repeat in new pass orders) unless ``max_steps`` is given.
    """

    def __init__(self, pipeline: Pipeline | Recipe, rank: int, world_size: int, num_workers: int = 0,
                 runner: str | Executor = "thread", prefetch: int | None = None, max_steps: int | None = None,
                 program: CompiledPipeline | None = None, text_map: Callable | None = None,
                 text_filter: Callable | None = None, plan: Any = None) -> None:
        self.recipe = pipeline  # what it was built from (a Recipe or a Pipeline): plugins read seq_len etc.
        self.pipeline = as_pipeline(pipeline, text_map, text_filter)
        self.rank, self.world_size = rank, world_size
        self.lanes = lanes_of_rank(self.pipeline.lanes, rank, world_size)
        self.program: CompiledPipeline = program or self.pipeline.compile(plan)
        self.program.plan.check_sources_have_text()  # a source of blank records fails here, not after some steps
        self.fingerprint = self.program.fingerprint
        self.summary = self.program.summary
        self.pad_id = self.program.pad_id
        self.max_steps = max_steps
        self._executors: dict[str, Executor] = {}
        self._own_executors = True
        self.num_workers = num_workers
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if not isinstance(runner, str):  # an executor shared by several loaders (zephon.verify)
            self._default_kind, self._executors[runner.kind] = runner.kind, runner
            self._own_executors = False
            self._host: LocalLanes | ProcessLanes = LocalLanes(self.program, self.lanes, self._executor_for,
                                                               prefetch or lane_depth(runner.num_workers))
        elif runner == "process" and num_workers > 0:
            self._host = ProcessLanes(self.pipeline, self.program, self.lanes, num_workers, prefetch or 4)
        elif runner in RUNNERS or runner in EXECUTOR_KINDS:
            self._default_kind = _RUNNER_KIND.get(runner, runner) if num_workers else "inline"
            self._host = LocalLanes(self.program, self.lanes, self._executor_for,
                                    prefetch or lane_depth(num_workers))
        else:
            raise ValueError(f"runner must be one of {RUNNERS + ('ray',)} (or a zephon executor), got {runner!r}")
        if isinstance(self._host, LocalLanes) and self._own_executors:  # start (and check) them now, not lazily
            for s, kinds in enumerate(self.program.stage_kinds):
                for k in range(len(kinds)):
                    self._executor_for(s, k)
        self.node: BaseNode[dict] = _RankNode(self)
        self.step = 0
        self._started = time.perf_counter()
        self._initialized = False

    @property
    def plan(self) -> Any:
        """The work plan (files, units, routing) this loader reads from."""
        return self.program.plan

    def _executor_for(self, source: int, stage: int) -> Executor:
        kind = self.program.stage_kinds[source][stage] or self._default_kind
        if kind not in self._executors:
            if not self._own_executors:
                kind = next(iter(self._executors))
            else:
                self._executors[kind] = make_executor(kind, self.program.stages, self.num_workers)
        return self._executors[kind]

    # -- iteration ------------------------------------------------------------------------------
    def _reset(self, state: dict | None) -> None:
        lane_states = self._check_state(state) if state is not None else {}
        self._host.reset(lane_states)
        self.step = int(state["step"]) if state is not None else 0
        self._delivered = {"rows": 0, "pad": 0, "flush_pad": 0}  # since this (re)start
        self._initialized = True
        self._started = time.perf_counter()
        self._tokens_at_start = self._delivered_tokens()

    def _next_batch(self) -> dict[str, Any]:
        if not self._initialized:
            self._reset(None)
        if self.max_steps is not None and self.step >= self.max_steps:
            raise StopIteration
        rows = [row for lane_rows in self._host.next_step() for row in lane_rows]
        self.step += 1
        d = self._delivered
        d["rows"] += len(rows)
        for row in rows:
            d["pad"] += row.free
            if row.flushed:
                d["flush_pad"] += row.free
        return collate(rows, self.program.seq_len, self.pad_id, self.program.pad_values)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            try:
                yield self._next_batch()
            except StopIteration:
                return

    def __next__(self) -> dict[str, Any]:
        return self._next_batch()

    # -- state ----------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        if not self._initialized:
            self._reset(None)
        return seal({
            "format": STATE_FORMAT, "version": STATE_VERSION, "fingerprint": self.fingerprint,
            "pipeline": self.summary, "step": self.step, "rank": self.rank, "world_size": self.world_size,
            "lanes": {str(lane): st for lane, st in self._host.states().items()},
        })

    def state_dict(self) -> dict[str, Any]:
        """This rank's lanes' positions after the last delivered batch (JSON-serialisable)."""
        return self._state()

    def _check_state(self, state: Any) -> dict[int, LaneState]:
        check_container(state)
        check_compatible(state, self.fingerprint, self.summary)
        have = {int(k): v for k, v in state["lanes"].items()}
        bad = [lane for lane in have if not 0 <= lane < self.pipeline.lanes]
        if bad:
            raise StateError(f"the state holds lanes {bad[:8]} but the pipeline has {self.pipeline.lanes} lanes.")
        missing = [lane for lane in self.lanes if lane not in have]
        if missing:
            raise StateError(f"rank {self.rank} of {self.world_size} owns lanes {self.lanes.start}.."
                             f"{self.lanes.stop - 1} but the state has no position for lanes {missing[:8]}"
                             f"{'...' if len(missing) > 8 else ''}: it holds only some ranks' lanes. Merge the "
                             f"states of all ranks of the checkpoint with zephon.merge_states([...]) (or "
                             f"loader.gather_state_dict()).")
        return {lane: self.program.parse_state(have[lane], lane) for lane in self.lanes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a (merged) state: any world size that divides the lane count works."""
        if state is None:
            raise StateError("load_state_dict(None): there is no state to load. Pass the dict that state_dict(), "
                             "zephon.merge_states() or zephon.load_state() returned.")
        self._reset(state)

    def gather_state_dict(self, group: Any = None) -> dict[str, Any]:
        """All ranks' states merged (an ``all_gather_object`` over ``group``); every rank gets it."""
        import torch.distributed as dist

        from .state.checkpoint import merge_states
        local = self.state_dict()
        if not (dist.is_available() and dist.is_initialized()):
            return merge_states([local])
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
        return merge_states(gathered)

    # -- metrics --------------------------------------------------------------------------------
    def _delivered_tokens(self) -> int:
        return self.step * len(self.lanes) * self.program.rows_per_lane * self.program.seq_len

    def metrics(self) -> dict[str, Any]:
        """Counters to log: tokens/s, padding fractions, sentinel cost, skips, per-lane progress.

        ``pad_fraction`` / ``flush_pad_fraction`` cover the rows *delivered* since the last (re)start;
        ``docs``, ``flushes``, ``units``, ... count the work the lanes did since the (re)start, which
        runs a little ahead of delivery; after a resume, the replay up to the checkpoint is not counted.
        """
        total = LaneCounters()
        per_lane = self._host.counters()
        states = self._host.states()
        for counters in per_lane.values():
            total.merge(counters)
        d = getattr(self, "_delivered", {"rows": 0, "pad": 0, "flush_pad": 0})
        delivered = d["rows"] * self.program.seq_len
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        return {
            "step": self.step,
            "tokens_per_s": (self._delivered_tokens() - getattr(self, "_tokens_at_start", 0)) / elapsed,
            "rows_delivered": d["rows"],
            "pad_fraction": d["pad"] / delivered if delivered else 0.0,
            "flush_pad_fraction": d["flush_pad"] / delivered if delivered else 0.0,
            "docs": total.docs, "doc_tokens": total.doc_tokens, "rows_packed": total.rows,
            "flushes": total.flushes, "units": total.units, "pieces_split": total.pieces_split,
            "skipped_records": total.skipped_records, "skipped_by_reason": dict(total.skipped_by_reason),
            "source_token_share": {k: v / max(1, total.doc_tokens) for k, v in total.source_tokens.items()},
            "lanes": {lane: {"sentinels": states[lane]["sentinels"], "units": c.units} for lane, c in per_lane.items()},
        }

    def close(self) -> None:
        """Stop worker threads/processes (also done at interpreter exit)."""
        self._host.close()
        if self._own_executors:
            for ex in self._executors.values():
                ex.close()
            self._executors.clear()

    def __enter__(self) -> "ZephonLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def build_loader(pipeline: Pipeline | Recipe | str, rank: int | None = None, world_size: int | None = None,
                 num_workers: int = 0, runner: str | Executor = "thread", prefetch: int | None = None,
                 max_steps: int | None = None, group: Any = None, text_map: Callable | None = None,
                 text_filter: Callable | None = None, plan: Any = None,
                 program: CompiledPipeline | None = None) -> ZephonLoader:
    """Build the loader of data-parallel ``rank`` of ``world_size`` for a pipeline (or a recipe or its path).

    ``rank``/``world_size`` default to the data-parallel process group (``group``, or the default
    group) when ``torch.distributed`` is initialised, else to 0 of 1. ``runner="thread"``: stateless
    work (read, transform, tokenize) on ``num_workers`` threads, accumulators in this process;
    ``runner="pool"``: stateless work on a pool of ``num_workers`` processes; ``runner="process"``:
    whole lanes on ``num_workers`` processes (this process only collates); ``runner="ray"``: stateless
    work on a Ray cluster. None changes the batches, only the speed. A transform may pick its own
    executor kind (``executor=`` of the operator). ``prefetch``: items in flight per (lane, source, stage)
    (thread, pool) or steps ahead (process). ``text_map``/``text_filter``: per-document text hooks of a
    recipe (module-level functions for the pool and process runners).
    """
    if rank is None or world_size is None:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank(group) if rank is None else rank
            world_size = dist.get_world_size(group) if world_size is None else world_size
        else:
            rank = 0 if rank is None else rank
            world_size = 1 if world_size is None else world_size
    return ZephonLoader(pipeline, rank, world_size, num_workers, runner, prefetch, max_steps, program,
                        text_map, text_filter, plan)

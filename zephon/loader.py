"""The rank-level loader: this rank's lanes, in lane order, as a dict of tensors per step.

``build_loader`` is the entry point. With ``W`` data-parallel ranks, rank ``r`` owns the contiguous
lanes ``[r*L/W, (r+1)*L/W)``; concatenating the ranks' batches in rank order gives the global batch,
which is therefore the same for every ``W``.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any, Iterator

import torch
from torchdata.nodes import BaseNode

from .collate import collate
from .nodes.items import LaneCounters
from .lane_hosts import LocalLanes, ProcessLanes
from .nodes.lane import LaneState
from .plan import WorkPlan
from .recipe import Recipe, load_recipe
from .runner import RUNNERS, Runner, TextFilter, TextMap
from .tokenizer import load_tokenizer
from .state import STATE_FORMAT, STATE_VERSION, StateError, check_compatible, fingerprint, recipe_summary


def lanes_of_rank(lanes: int, rank: int, world_size: int) -> range:
    """The contiguous lanes owned by ``rank``; errors name the numbers when they do not fit."""
    if world_size < 1 or lanes % world_size:
        divisors = [d for d in range(1, lanes + 1) if lanes % d == 0]
        raise ValueError(f"world_size={world_size} does not divide lanes={lanes}: every rank must own the "
                         f"same number of lanes. Use a world size in {divisors}, or a recipe whose lanes "
                         f"is a multiple of {world_size} (lanes is fixed for the life of a run).")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, world_size={world_size}).")
    per = lanes // world_size
    return range(rank * per, (rank + 1) * per)


class _RankNode(BaseNode[dict]):
    """The torchdata node behind :class:`ZephonLoader`: one batch dict per ``next()``."""

    def __init__(self, loader: "ZephonLoader") -> None:
        super().__init__()
        self._loader = loader

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._loader._reset(initial_state)

    def next(self) -> dict[str, torch.Tensor]:
        return self._loader._next_batch()

    def get_state(self) -> dict[str, Any]:
        return self._loader._state()


class ZephonLoader:
    """Iterable of this rank's batches, with lane-keyed ``state_dict``/``load_state_dict``.

    Iteration is endless (sources repeat in new pass orders) unless ``max_steps`` is given.
    """

    def __init__(self, recipe: Recipe, rank: int, world_size: int, num_workers: int = 0,
                 runner: str | Runner = "thread", prefetch: int | None = None, max_steps: int | None = None,
                 plan: WorkPlan | None = None, text_map: TextMap = None, text_filter: TextFilter = None) -> None:
        self.recipe = recipe
        self.rank, self.world_size = rank, world_size
        self.lanes = lanes_of_rank(recipe.lanes, rank, world_size)
        # the tokenizer first: a bad tokenizer.path is reported as such, not by the fingerprint's hash of it
        self.pad_id = load_tokenizer(recipe.tokenizer).pad_id
        self.plan = plan or WorkPlan(recipe)
        self.plan.check_sources_have_text()  # a source of blank records fails here, not after some steps
        self.summary = recipe_summary(recipe, self.plan)
        self.fingerprint = fingerprint(self.summary)
        self.max_steps = max_steps
        self._host: LocalLanes | ProcessLanes
        self._own_runner = False
        if isinstance(runner, Runner):
            self._host = LocalLanes(recipe, self.plan, runner, self.lanes, prefetch or (2 if runner.num_workers else 1))
        elif runner == "process" and num_workers > 0:
            self._host = ProcessLanes(recipe, self.lanes, num_workers, prefetch or 4, text_map, text_filter)
        elif runner in RUNNERS:
            self._own_runner = True
            self.runner = Runner(recipe, self.plan, num_workers, "pool" if runner == "pool" else "thread",
                                 text_map, text_filter)
            self._host = LocalLanes(recipe, self.plan, self.runner, self.lanes, prefetch or (2 if num_workers else 1))
        else:
            raise ValueError(f"runner must be one of {RUNNERS} (or a zephon Runner), got {runner!r}")
        self.node: BaseNode[dict] = _RankNode(self)
        self.step = 0
        self._started = time.perf_counter()
        self._initialized = False

    # -- iteration ------------------------------------------------------------------------------
    def _reset(self, state: dict | None) -> None:
        lane_states = self._check_state(state) if state is not None else {}
        self._host.reset(lane_states)
        self.step = int(state["step"]) if state is not None else 0
        self._delivered = {"rows": 0, "pad": 0, "flush_pad": 0}  # since this (re)start
        self._initialized = True
        self._started = time.perf_counter()
        self._tokens_at_start = self._delivered_tokens()

    def _next_batch(self) -> dict[str, torch.Tensor]:
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
        return collate(rows, self.recipe.seq_len, self.pad_id)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            try:
                yield self._next_batch()
            except StopIteration:
                return

    def __next__(self) -> dict[str, torch.Tensor]:
        return self._next_batch()

    # -- state ----------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        if not self._initialized:
            self._reset(None)
        return {
            "format": STATE_FORMAT, "version": STATE_VERSION, "fingerprint": self.fingerprint,
            "recipe": self.summary, "step": self.step, "rank": self.rank, "world_size": self.world_size,
            "lanes": {str(lane): st for lane, st in self._host.states().items()},
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's lanes' positions after the last delivered batch (JSON-serialisable)."""
        return self._state()

    def _check_state(self, state: dict[str, Any]) -> dict[int, dict]:
        check_compatible(state, self.fingerprint, self.summary)
        have = {int(k): v for k, v in state["lanes"].items()}
        missing = [lane for lane in self.lanes if lane not in have]
        if missing:
            raise StateError(f"rank {self.rank} of {self.world_size} owns lanes {self.lanes.start}.."
                             f"{self.lanes.stop - 1} but the state has no position for lanes {missing[:8]}"
                             f"{'...' if len(missing) > 8 else ''}. Merge the states of all ranks of the "
                             f"checkpoint with zephon.merge_states([...]) (or loader.gather_state_dict()).")
        for lane in self.lanes:
            try:
                LaneState.from_dict(have[lane])
            except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
                raise StateError(f"lane {lane} of the state is malformed ({type(exc).__name__}: {exc}); a lane "
                                 f"state is {{epoch, positions: {{source: [unit_seq, cursor, offset]}}, "
                                 f"rows_since_flush, carry}}. Pass the state exactly as state_dict() or "
                                 f"merge_states() returned it.") from None
        return {lane: have[lane] for lane in self.lanes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a (merged) state: any world size that divides the lane count works."""
        self._reset(state)

    def gather_state_dict(self, group: Any = None) -> dict[str, Any]:
        """All ranks' states merged (an ``all_gather_object`` over ``group``); every rank gets it."""
        import torch.distributed as dist

        from .state import merge_states
        local = self.state_dict()
        if not (dist.is_available() and dist.is_initialized()):
            return merge_states([local])
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
        return merge_states(gathered)

    # -- metrics --------------------------------------------------------------------------------
    def _delivered_tokens(self) -> int:
        return self.step * len(self.lanes) * self.recipe.batch_per_lane * self.recipe.seq_len

    def metrics(self) -> dict[str, Any]:
        """Counters to log: tokens/s, padding fractions, sentinel cost, per-lane progress.

        ``pad_fraction`` / ``flush_pad_fraction`` cover the rows *delivered* since the last (re)start;
        ``docs``, ``flushes``, ``units``, ... count the work the lanes did since the (re)start, which
        runs a little ahead of delivery; after a resume, the replay up to the checkpoint is not counted.
        """
        total = LaneCounters()
        per_lane = self._host.counters()
        states = self._host.states()
        for counters in per_lane.values():
            for k, v in asdict(counters).items():
                if k == "source_tokens":
                    for name, n in v.items():
                        total.source_tokens[name] = total.source_tokens.get(name, 0) + n
                else:
                    setattr(total, k, getattr(total, k) + v)
        d = getattr(self, "_delivered", {"rows": 0, "pad": 0, "flush_pad": 0})
        delivered = d["rows"] * self.recipe.seq_len
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        return {
            "step": self.step,
            "tokens_per_s": (self._delivered_tokens() - getattr(self, "_tokens_at_start", 0)) / elapsed,
            "rows_delivered": d["rows"],
            "pad_fraction": d["pad"] / delivered if delivered else 0.0,
            "flush_pad_fraction": d["flush_pad"] / delivered if delivered else 0.0,
            "docs": total.docs, "doc_tokens": total.doc_tokens, "rows_packed": total.rows,
            "flushes": total.flushes, "units": total.units, "pieces_split": total.pieces_split,
            "skipped_records": total.skipped_records,
            "source_token_share": {k: v / max(1, total.doc_tokens) for k, v in total.source_tokens.items()},
            "lanes": {lane: {"epoch": states[lane]["epoch"], "units": c.units} for lane, c in per_lane.items()},
        }

    def close(self) -> None:
        """Stop worker threads/processes (also done at interpreter exit)."""
        self._host.close()
        if self._own_runner:
            self.runner.close()

    def __enter__(self) -> "ZephonLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def build_loader(recipe: Recipe | str, rank: int | None = None, world_size: int | None = None,
                 num_workers: int = 0, runner: str | Runner = "thread", prefetch: int | None = None,
                 max_steps: int | None = None, group: Any = None, text_map: TextMap = None,
                 text_filter: TextFilter = None, plan: WorkPlan | None = None) -> ZephonLoader:
    """Build the loader of data-parallel ``rank`` of ``world_size`` for ``recipe``.

    ``rank``/``world_size`` default to the data-parallel process group (``group``, or the default
    group) when ``torch.distributed`` is initialised, else to 0 of 1. ``runner="thread"``: read and
    tokenize on ``num_workers`` threads (the rest in this process); ``runner="pool"``: read and tokenize
    on a pool of ``num_workers`` processes, every accumulator in this process; ``runner="process"``:
    whole lanes on ``num_workers`` processes (this process only collates). None changes the batches,
    only the speed. ``prefetch``: chunks per source ahead (thread, pool) or steps ahead (process).
    ``text_map`` and ``text_filter`` are per-document hooks run on the workers (module-level functions
    for pool and process).
    """
    if isinstance(recipe, str):
        recipe = load_recipe(recipe)
    if rank is None or world_size is None:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank(group) if rank is None else rank
            world_size = dist.get_world_size(group) if world_size is None else world_size
        else:
            rank = 0 if rank is None else rank
            world_size = 1 if world_size is None else world_size
    return ZephonLoader(recipe, rank, world_size, num_workers, runner, prefetch, max_steps, plan,
                        text_map, text_filter)

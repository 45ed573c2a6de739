"""The rank-level loader: this rank's lanes, in lane order, as a dict of tensors per step.

``build_loader`` (or ``Pipeline.build``) is the entry point. With ``W`` data-parallel ranks, rank ``r``
owns the contiguous lanes ``[r*L/W, (r+1)*L/W)``; concatenating the ranks' batches in rank order gives
the global batch, which is therefore the same for every ``W``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Mapping, Sequence

from torchdata.nodes import BaseNode

from .batches.buffers import UNPOOLED, BatchBuffers
from .batches.packed import collate
from .batches.provenance import provenance_tensor
from .batches.records import collate_records
from .engine.counters import LaneCounters
from .engine.executors import Executor
from .engine.frame_stack import call_on_own_chunk
from .engine.hosts import LocalLanes, ProcessLanes
from .engine.runners import make_executor, make_host, runner_named
from .engine.steps_ahead import StepsAhead
from .engine.lane import lane_depth
from .engine.tokenizer_pool import uses_hf_tokenizer
from .errors import StateError
from .graph.program import CompiledPipeline
from .ops.batch import RecordBlock, RecordSpan, flat_rows
from .origins import PROVENANCE_KEY
from .records import IGNORE
from .state.checkpoint import STATE_FORMAT, STATE_VERSION, check_compatible, check_container, seal, unwrap_state
from .state.lane import LaneState

STEPS_AHEAD = 2  # steps the lanes compute before the trainer asks, where default_steps_ahead() says so


def default_steps_ahead(program: CompiledPipeline, num_workers: int, runner: str | Executor) -> int:
    """``STEPS_AHEAD`` for a pipeline that packs images, with workers; else 0 (see BENCHMARKS.md 8e).

    Packing lanes whose documents are decoded images take them in bursts of seconds of decoding, which a
    trainer whose model is the slower side would otherwise wait out, and a step's collation copies tens of
    megabytes (with lane processes, after reading the rows back from them). A text or fetch-only pipeline's lane work is a few milliseconds of Python a step, which a
    second Python thread would only contend with for the GIL (fetch-and-batch ran 7-18% slower with it).
    An executor passed as ``runner`` is shared by loaders that one caller steps in turn (zephon.verify).
    """
    if not num_workers or not isinstance(runner, str) or program.images is None:
        return 0
    return STEPS_AHEAD


def lanes_of_rank(lanes: int, rank: int, world_size: int) -> range:
    """The contiguous lanes owned by ``rank``: ``[rank * L/W, (rank + 1) * L/W)``.

    Args:
        lanes: the pipeline's lane count ``L``.
        rank: the data-parallel rank, in ``[0, world_size)``.
        world_size: the data-parallel world size ``W``, a divisor of ``lanes``.

    Returns:
        The rank's lanes, as a range.

    Raises:
        TypeError: ``rank`` or ``world_size`` is not an integer (naming it and what to pass).
        ValueError: ``world_size`` does not divide ``lanes``, or ``rank`` is out of range (naming the numbers
            and the world sizes that fit).
    """
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):  # int, numpy integers
            raise TypeError(f"{name}={value!r}: the data-parallel {name.replace('_', ' ')} must be an int, got "
                            f"{type(value).__name__} (e.g. int(os.environ['RANK']), or leave rank and world_size "
                            f"out to take them from torch.distributed)")
    if world_size < 1 or lanes % world_size:
        divisors = [d for d in range(1, lanes + 1) if lanes % d == 0]
        raise ValueError(f"world_size={world_size} does not divide lanes={lanes}: every rank must own the "
                         f"same number of lanes. Use a world size in {divisors}, or a pipeline whose lanes "
                         f"is a multiple of {world_size} (lanes is fixed for the life of a run).")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, world_size={world_size}): pass this process's rank in its "
                         f"data-parallel group, 0 to {world_size - 1} (with tensor or pipeline parallelism, the "
                         f"data-parallel rank, not the global one).")
    per = lanes // world_size
    return range(rank * per, (rank + 1) * per)


def pipeline_of(source: Any, text_map: Callable | None = None, text_filter: Callable | None = None) -> Any:
    """The pipeline a loader is built from: a :class:`~zephon.Pipeline`, or a :class:`~zephon.recipe.Recipe` (it
    converts itself: ``to_pipeline``; ``text_map``/``text_filter``, a classic recipe's text hooks)."""
    if isinstance(source, str):
        raise TypeError(f"build_loader takes a zephon.Pipeline or a Recipe; for a recipe file, pass "
                        f"zephon.load_recipe({source!r})")
    if callable(getattr(source, "to_pipeline", None)):  # a Recipe
        return source.to_pipeline(text_map, text_filter)
    if not callable(getattr(source, "compile", None)):
        raise TypeError(f"build_loader needs a zephon.Pipeline or a Recipe, got {source!r}")
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

    Iteration is endless (sources repeat in new pass orders) unless ``max_steps`` is given or a source stops.
    Build one with :func:`zephon.build_loader` or :meth:`zephon.Pipeline.build`; close it (or use it as a
    context manager) to stop its workers.

    Args:
        pipeline: a :class:`zephon.Pipeline`, or a :class:`zephon.Recipe` (``zephon.load_recipe(path)``).
        rank: this process's data-parallel rank.
        world_size: the data-parallel world size, a divisor of the pipeline's ``lanes``.
        num_workers: workers for the stateless work (0: everything in the calling thread).
        runner: where the work runs: ``"thread"`` (stateless work on ``num_workers`` threads, accumulators in
            this process), ``"pool"`` (stateless work on ``num_workers`` processes), ``"process"`` (whole lanes on
            ``num_workers`` processes; this process only collates), ``"ray"`` (stateless work on a Ray cluster,
            ``num_workers`` tasks at a time) or ``"ray-lanes"`` (whole lanes on ``num_workers`` Ray actors). None
            changes the batches, only the speed; an operator may pick its own executor kind (its ``executor=``).
            Also an executor shared by several loaders (as :mod:`zephon.verify` does).
        prefetch: items in flight per (lane, source, stage) with the thread and pool runners (None: 2, and for
            a pipeline that packs images 2 rising to 8 while the lanes wait for the workers:
            :class:`zephon.engine.sources.ReadAhead`), or steps ahead with the process runner.
        max_steps: stop after this many global steps (None: endless, unless the sources stop).
        text_map: a classic recipe's per-document text hook (a module-level function for the pool and process
            runners); for a pipeline, use ``map_field()``.
        text_filter: a classic recipe's per-document text filter; for a pipeline, use ``filter_field()``.
        plan: a :class:`zephon.WorkPlan` already listed for this pipeline (None: list the files).
        program: the pipeline already compiled (``pipeline.compile()``; None: compile it).
        group: the data-parallel process group (None: the default group): its ranks agree on where finite
            sources end.
        address: the Ray cluster (``"HEAD:6379"``; None: ``RAY_ADDRESS``, else a local one).
        ray_options: :class:`zephon.engine.ray_executor.RayOptions` fields, for the Ray runners.
        reuse_batch_memory: write a batch's large tensors (pixels) into the memory of an earlier batch that
            nothing refers to any more (:mod:`zephon.batches.buffers`); ``False`` allocates every batch afresh,
            for code that keeps a batch's memory without a Python reference to it (a raw ``data_ptr()``).
        steps_ahead: with workers, the lanes' own work (merge, shuffle, pack, waiting for the workers; with the
            process and ray-lanes runners, reading their rows back) and the collation run on a background thread
            up to this many steps before the trainer asks (:mod:`zephon.engine.steps_ahead`); 0: when asked, on
            the trainer's thread. None: 2 for a pipeline that packs images, with workers, else 0. Checkpoints
            hold the delivered steps either way.
        lanes: for debugging tools (:mod:`zephon.provenance`): load these consecutive lanes (a ``range``), whatever
            ``rank`` and ``world_size`` say; None: the rank's own.

    Raises:
        ValueError: ``world_size`` does not divide the lanes, ``rank`` is out of range, or an option is negative.
        PipelineError: the pipeline is not valid.
        SourceError: a source has no files, or gives no text.
    """

    def __init__(self, pipeline: Any, rank: int, world_size: int, num_workers: int = 0,
                 runner: str | Executor = "thread", prefetch: int | None = None, max_steps: int | None = None,
                 program: CompiledPipeline | None = None, text_map: Callable | None = None,
                 text_filter: Callable | None = None, plan: Any = None, group: Any = None,
                 address: str | None = None, ray_options: Mapping[str, Any] | None = None,
                 reuse_batch_memory: bool = True, steps_ahead: int | None = None,
                 lanes: range | None = None) -> None:
        self.group = group
        """The data-parallel process group (finite sources: its ranks agree on the end)."""
        self._ended = False
        self.pipeline = pipeline_of(pipeline, text_map, text_filter)
        """The :class:`zephon.Pipeline` it loads (the plugins read its ``seq_len`` and operators)."""
        self.rank, self.world_size = rank, world_size
        total = self.pipeline.lanes
        if lanes is None:
            lanes = lanes_of_rank(total, rank, world_size)
        elif not isinstance(lanes, range) or lanes.step != 1 or not 0 <= lanes.start < lanes.stop <= total:
            # a debugging tool's choice of lanes (zephon.provenance), whatever the rank
            raise ValueError(f"lanes={lanes!r}: a range of consecutive lanes within [0, {total})")
        self.lanes = lanes
        """The lanes this rank owns, in order."""
        self.program: CompiledPipeline = program or self.pipeline.compile(plan)
        """The compiled pipeline its lanes run."""
        self.program.plan.check_sources_have_text()  # a source of blank records fails here, not after some steps
        self.fingerprint = self.program.fingerprint
        """The pipeline's fingerprint: a state from another pipeline is refused."""
        self.summary = self.program.summary
        """The pipeline's description in its states (shown when a state does not match)."""
        self.pad_id = self.program.pad_id
        """The id written on padding positions."""
        self.max_steps = max_steps
        """The global steps after which iteration stops (None: endless)."""
        self._executors: dict[str, Executor] = {}
        self._own_executors = isinstance(runner, str)
        self.events: list[tuple[int, dict[str, float]]] = []
        """The mixture interventions (``(at_step, weights)``, from :meth:`set_mixture`), shared with every lane."""
        self.num_workers = num_workers
        """Workers for the stateless work (0: in the calling thread)."""
        self._ray = {"address": address, **(ray_options or {})}  # for Ray executors and lane actors
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        bursty = self.program.images is not None  # packing lanes that take decoded images in bursts
        if not isinstance(runner, str):  # an executor shared by several loaders (zephon.verify)
            self._default_kind, self._executors[runner.kind] = runner.kind, runner
            self._host: Any = LocalLanes(self.program, self.lanes, self._executor_for,
                                         prefetch or lane_depth(runner.num_workers, bursty), self.events)
        else:
            spec = runner_named(runner)
            self._default_kind = spec.stages if num_workers else "inline"
            self._host = make_host(spec, self.pipeline, self.program, self.lanes, num_workers, prefetch, self.events,
                                   self._executor_for, prefetch or lane_depth(num_workers, bursty), self._ray)
        if isinstance(self._host, LocalLanes) and self._own_executors:  # start (and check) them now, not lazily
            for s, kinds in enumerate(self.program.stage_kinds):
                for k in range(len(kinds)):
                    self._executor_for(s, k)
        if steps_ahead is not None and steps_ahead < 0:
            raise ValueError(f"steps_ahead must be >= 0, got {steps_ahead}")
        if isinstance(self._host, (LocalLanes, ProcessLanes)):  # ProcessLanes: the lane processes and Ray actors
            ahead = default_steps_ahead(self.program, num_workers, runner) if steps_ahead is None else steps_ahead
            if ahead:  # the thread collates too: the trainer's next() is a queue read
                self._host = StepsAhead(self._host, ahead, collate=self._collate)
        self.node: BaseNode[dict] = _RankNode(self)
        """This loader as a ``torchdata.nodes.BaseNode`` (one batch per ``next()``; its state is the loader's)."""
        # pixel (and other large) batch tensors: memory used again once the trainer holds no reference to it
        # with steps computed ahead, each queued step holds a batch as well
        ahead = self._host.ahead if isinstance(self._host, StepsAhead) else 0
        self._buffers = BatchBuffers(keep=4 + ahead if reuse_batch_memory else 0)
        self.step = 0
        """The next global step to deliver (0-based): how many this loader has delivered since step 0."""
        self._started = time.perf_counter()
        self._initialized = False

    @property
    def plan(self) -> Any:
        """The work plan (files, units, routing) this loader reads from."""
        return self.program.plan

    def _kind_of(self, source: int, stage: int) -> str:
        """The executor kind stage ``stage`` of source ``source`` runs on."""
        kind = self.program.stage_kinds[source][stage] or self._default_kind
        if kind == "process" and not self.program.stage_kinds[source][stage] and \
                self.program.stages.reads_only(source, stage):
            # Nothing to compute, only a read (I/O, the GIL released): a worker process would add a copy of
            # every value on the way back and win nothing, so threads of this process read it.
            kind = "thread"
        return kind

    def _executor_for(self, source: int, stage: int) -> Executor:
        kind = self._kind_of(source, stage)
        if kind not in self._executors:
            if not self._own_executors:
                kind = next(iter(self._executors))
            else:
                stages = self.program.stages.stages
                hf = kind == "thread" and uses_hf_tokenizer(
                    t for s, per_source in enumerate(stages) for k, st in enumerate(per_source)
                    if self._kind_of(s, k) == "thread" for t in st.transforms)
                self._executors[kind] = make_executor(kind, self.program.stages, self.num_workers, hf_tokenizing=hf,
                                                      **(self._ray if kind == "ray" else {}))
        return self._executors[kind]

    # -- iteration ------------------------------------------------------------------------------
    def _reset(self, state: dict | None) -> None:
        lane_states = self._check_state(state) if state is not None else {}
        self._host.reset(lane_states)
        self.step = int(state["step"]) if state is not None else 0
        self._ended = bool(state.get("ended", False)) if state is not None else False
        self._ended_states: dict[int, dict] | None = None
        self._delivered = {"rows": 0, "pad": 0, "flush_pad": 0, "docs": 0}  # since this (re)start
        # tokens (records, without pack()) delivered per source index; the last entry: of no known source (a
        # document an accumulator rebuilt as a plain dict)
        self._delivered_by_source = [0] * (len(self.program.names) + 1)
        self._initialized = True
        self._started = time.perf_counter()
        self._tokens_at_start = self._delivered_tokens()

    def _prepare_step(self) -> tuple[list, bool]:
        """This rank's rows of the next step, and whether they let the step be delivered (finite sources:
        every lane full, for ``partial="drop"``; some lane with data, for ``"pad"``)."""
        if not self._initialized:
            self._reset(None)
        if self._ended or (self.max_steps is not None and self.step >= self.max_steps):
            raise StopIteration
        if not self.program.finite:
            return flat_rows(self._host.next_step()), True
        # the lanes' positions before this step: if it is not delivered, they are the state to keep
        self._before_step = self._host.states()
        rows = flat_rows(self._host.next_step())
        if type(rows) is RecordBlock:
            pad = rows.padding()
            return rows, (pad == 0 if self.program.partial == "drop" else pad < len(rows))
        return rows, (all if self.program.partial == "drop" else any)(r.fill for r in rows)

    def _agree(self, ok: bool) -> bool:
        """The same verdict on every rank: all must be able to deliver (drop), or any (pad)."""
        if not self.program.finite:
            return ok
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return ok
        # on the group's collective device: an NCCL-only group (Torchtitan's and Megatron's default on GPUs)
        # has no backend for CPU tensors
        flag = torch.tensor([1 if ok else 0], device=_collective_device(self.group))
        op = dist.ReduceOp.MIN if self.program.partial == "drop" else dist.ReduceOp.MAX
        dist.all_reduce(flag, op=op, group=self.group)
        return bool(flag.item())

    def _next_batch(self) -> dict[str, Any]:
        # every way of asking for a batch comes here: its work runs on a frame-stack chunk of its own
        return call_on_own_chunk(self._compute_batch)

    def _compute_batch(self) -> dict[str, Any]:
        rows, ok = self._prepare_step()
        return self._finish_step(rows, self._agree(ok))

    def _finish_step(self, rows: list, ok: bool) -> dict[str, Any]:
        if not ok:  # the data has ended here, for every rank: the loader ends (and stays ended)
            self._ended = True
            self._ended_states = self._before_step
            raise StopIteration
        self.step += 1
        d = self._delivered
        d["rows"] += len(rows)
        by_source = self._delivered_by_source
        if type(rows) is RecordBlock:  # the batched record-rows path: per span, not per row
            _count_block(rows, d, by_source)
        for row in (() if type(rows) is RecordBlock else rows):
            d["pad"] += row.free
            if row.flushed:
                d["flush_pad"] += row.free
            d["docs"] += documents_ended(row)
            sources = getattr(row, "sources", None)
            if sources is not None:
                for s, n in zip(sources, row.seg_lens):
                    by_source[s] += n  # -1: unknown, the last entry
            elif row.fill:
                by_source[getattr(row.record, "source", -1)] += 1
        if isinstance(self._host, StepsAhead):
            made = self._host.take_batch(rows)
            # the memory pool belongs to the thread that collates ahead: never collate into it from here
            return made if made is not None else self._collate(rows, UNPOOLED)
        return self._collate(rows)

    def _collate(self, rows: list, buffers: BatchBuffers | None = None) -> dict[str, Any]:
        """The batch of a step's rows (on the trainer's thread, or on the thread that computes steps ahead)."""
        buffers = self._buffers if buffers is None else buffers
        if self.program.records:
            batch = collate_records(rows, self.program.stack, buffers)
        else:
            batch = collate(rows, self.program.seq_len, self.pad_id, self.program.pad_values, self.program.images,
                            buffers)
        if self.program.provenance:
            batch[PROVENANCE_KEY] = provenance_tensor(rows, self.lanes.start * self.program.rows_per_lane,
                                                      self.program.records)
        return batch

    def _advance(self, steps: int) -> None:
        """Go ``steps`` steps on without collating their batches (the debugging tools of
        :mod:`zephon.provenance`: the steps before the one they look at).

        Raises:
            StopIteration: the data ended first (finite sources).
        """
        for _ in range(steps):
            rows, ok = self._prepare_step()
            if not self._agree(ok):
                self._finish_step(rows, False)  # the data has ended: raises StopIteration
            self.step += 1
            if isinstance(self._host, StepsAhead):
                self._host.take_batch(rows)

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
        # the lanes' positions after the last delivered batch (an ended loader's lanes went one step further to
        # learn that the data had ended)
        positions = self._ended_states if self._ended and self._ended_states is not None else self._host.states()
        return seal({
            "format": STATE_FORMAT, "version": STATE_VERSION, "fingerprint": self.fingerprint,
            "pipeline": self.summary, "step": self.step, "rank": self.rank, "world_size": self.world_size,
            "events": [[at, dict(w)] for at, w in self.events], "ended": self._ended,
            "lanes": {str(lane): st for lane, st in positions.items()},
        })

    def state_dict(self) -> dict[str, Any]:
        """This rank's lanes' positions after the last delivered batch (JSON-serialisable).

        Returns:
            The loader state: versioned, fingerprinted, one entry per lane this rank owns. Merge every rank's
            with :func:`zephon.merge_states` (or use :meth:`gather_state_dict`) to resume at another world size.
        """
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
        events = parse_events(state.get("events", []), self.program.names)
        parsed = {lane: self.program.parse_state(have[lane], lane) for lane in self.lanes}
        delivered = int(state["step"]) * self.program.rows_per_lane
        for lane, st in parsed.items():
            if st.clock[0] + st.rows_since_flush != delivered:
                raise StateError(f"lane {lane}: its clock says {st.clock[0]} rows before its last sentinel and "
                                 f"{st.rows_since_flush} since, but at step {state['step']} every lane has delivered "
                                 f"{delivered}. The state was edited or does not belong to this pipeline.")
        self.events[:] = events
        return parsed

    def set_mixture(self, weights: Mapping[str, float], at_step: int, group: Any = None) -> int:
        """Use ``weights`` from global step ``at_step`` on: every batch before it stays as it would have been.

        Exact whatever the prefetch, the runner and the timing: a mixing decision belongs to the step of the
        rows its lane had completed when it was made (the step clock, docs/design.md), so the batches before
        ``at_step`` are byte-identical to the run without the call, and every document a lane's mixer takes
        once it has produced its rows of the steps before ``at_step`` is drawn under the new weights. The
        delivered mixture follows after what the lanes already hold then (the shuffle buffer, the packer's
        open rows). Lanes that computed steps ahead of delivery are rewound to it first. The intervention is
        recorded in the state, so a resume at any world size replays it.

        Args:
            weights: source name -> weight (0: the source is not read meanwhile; only the ratios matter).
            at_step: the first global step (0-based, as :attr:`step` counts) the weights apply to; at least
                :attr:`step`, the next step to be delivered.
            group: the process group whose ranks must all make the same call (compared when
                ``torch.distributed`` is initialised; a mismatch is an error naming the ranks).

        Returns:
            The number of this rank's lanes that were rebuilt and replayed (lanes that had run ahead).

        Raises:
            ValueError: the pipeline has one source, ``at_step`` was already delivered, or the ranks disagree.
            StateError: ``weights`` names unknown sources or has no positive weight.
        """
        if len(self.program.names) < 2:
            raise ValueError(f"set_mixture: this pipeline reads one source ({self.program.names[0]!r}), so there is "
                             f"no mixture to change")
        at_step, weights = parse_event([at_step, dict(weights)], self.program.names, "set_mixture")
        if at_step < self.step:
            raise ValueError(f"set_mixture(at_step={at_step}): that step was already delivered (steps 0 to "
                             f"{self.step - 1} were); the intervention must be for step {self.step} or later")
        _same_on_every_rank((at_step, weights), group)
        if not self._initialized:
            self._reset(None)
        self.events.append((at_step, weights))
        return self._host.apply_event(at_step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a (merged) state: any world size that divides the lane count works.

        Args:
            state: what ``state_dict()``, :func:`zephon.merge_states` or :func:`zephon.load_state` returned (also
                as torchdata's ``Loader`` wraps ``loader.node``'s state).

        Raises:
            StateError: the state is malformed, edited, or from another pipeline (naming what differs).
        """
        if state is None:
            raise StateError("load_state_dict(None): there is no state to load. Pass the dict that state_dict(), "
                             "zephon.merge_states() or zephon.load_state() returned.")
        self._reset(unwrap_state(state))

    def gather_state_dict(self, group: Any = None) -> dict[str, Any]:
        """All ranks' states merged (an ``all_gather_object`` over ``group``); every rank gets it.

        Args:
            group: the process group to gather over (None: the default group). Without ``torch.distributed``
                initialised, this rank's state alone.

        Returns:
            The merged state: every lane's position, loadable at any world size that divides the lanes.
        """
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
        """Counters to log: tokens/s (``records_per_s`` instead for a pipeline without ``pack()``), padding
        fractions, sentinel cost, skips, per-lane progress.

        ``pad_fraction`` / ``flush_pad_fraction`` / ``docs_delivered`` cover the rows *delivered* since the
        last (re)start; ``docs_taken``, ``flushes``, ``units``, ... count the work the lanes did since the
        (re)start, which runs ahead of delivery (open rows, a shuffle buffer, steps computed ahead); after a
        resume, the replay up to the checkpoint is not counted.

        - ``docs_taken``: documents the lanes took from their sources (a split document once, by its last
          piece), delivered or not yet.
        - ``docs_delivered``: documents that ended in the delivered rows (a row's piece whose tail label is
          ``IGNORE``, or one record of a pipeline without ``pack()``); a document cut over two rows counts
          once, in the row that holds its end. Fresh from the start, ``docs_delivered <= docs_taken``
          unless an operator after the mixer makes more documents than it is given.
        - ``mixture_delivered_share``: each source's share of the tokens in the delivered batches (records, for a
          pipeline without ``pack()``): the realised mixture, which follows ``mixture_weights`` with the lag of
          what the lanes hold; ``source_token_share`` is the share of what the lanes *took*.
        - ``docs``: deprecated alias of ``docs_taken`` (kept for readers of the old name, e.g.
          scripts/bench/cadence.py).

        Returns:
            Metric name -> value (numbers, and dicts per source, reason or lane).
        """
        total = LaneCounters()
        per_lane = self._host.counters()
        states = self._host.states()
        for counters in per_lane.values():
            total.merge(counters)
        d = getattr(self, "_delivered", {"rows": 0, "pad": 0, "flush_pad": 0, "docs": 0})
        delivered = d["rows"] * self.program.seq_len
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        rate = (self._delivered_tokens() - getattr(self, "_tokens_at_start", 0)) / elapsed
        return {
            "step": self.step,
            # without pack() a row is one record of seq_len 1: the rate counts records, and tokens are not counted
            **({"records_per_s": rate, "tokens_per_s": None} if self.program.records else {"tokens_per_s": rate}),
            "rows_delivered": d["rows"],
            "pad_fraction": d["pad"] / delivered if delivered else 0.0,
            "flush_pad_fraction": d["flush_pad"] / delivered if delivered else 0.0,
            "docs_taken": total.docs, "docs_delivered": d["docs"],
            "docs": total.docs,  # deprecated: docs_taken
            "doc_tokens": total.doc_tokens, "rows_packed": total.rows,
            "flushes": total.flushes, "units": total.units, "pieces_split": total.pieces_split,
            "skipped_records": total.skipped_records, "skipped_by_reason": dict(total.skipped_by_reason),
            "skipped_by_source": _by_source(total.skipped_by_source),
            "source_token_share": {k: v / max(1, total.doc_tokens) for k, v in total.source_tokens.items()},
            "mixture_weights": self.mixture_weights(self.step),
            "mixture_recent_share": _shares(_recent(per_lane.values())),
            "mixture_delivered_share": self._delivered_share(),
            "lanes": {lane: {"sentinels": states[lane]["sentinels"], "units": c.units} for lane, c in per_lane.items()},
            # large batch tensors written into an earlier batch's released memory, or into new memory (a
            # trainer that keeps batches makes the pool allocate: zephon/batches/buffers.py)
            "batch_memory": {"reused": self._buffers.reused, "allocated": self._buffers.allocated},
        }

    def _delivered_share(self) -> dict[str, float]:
        """Each source's share of the tokens (records, without ``pack()``) in this rank's delivered batches since
        the last (re)start: the realised mixture ("unknown": pieces an accumulator of yours rebuilt as plain
        dicts)."""
        counts = getattr(self, "_delivered_by_source", None)
        if not counts:
            return {}
        named = dict(zip(self.program.names, counts))
        if counts[-1]:
            named["unknown"] = counts[-1]
        return _shares(named)

    def mixture_weights(self, step: int) -> dict[str, float]:
        """The weights in force at ``step`` (schedule, then interventions), normalised.

        Args:
            step: a global step.

        Returns:
            Source name -> share of the mixture (the shares add up to 1).
        """
        from .ops.schedule import weights_in_force

        return _shares(weights_in_force(self.program.schedule, self.program.weights, self.events, step))

    def close(self) -> None:
        """Stop worker threads/processes (also done at interpreter exit)."""
        self._host.close()
        self._buffers.clear()
        if self._own_executors:
            for ex in self._executors.values():
                ex.close()
            self._executors.clear()

    def __enter__(self) -> "ZephonLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _count_block(rows: RecordBlock, d: dict, by_source: Any) -> None:
    """The delivered-rows metrics of a step's :class:`RecordBlock`: what the per-row loop books for each of
    its rows (padding rows, documents ended, records per source)."""
    for part in rows.parts:
        if type(part) is int:
            d["pad"] += part
        elif type(part) is RecordSpan:
            d["docs"] += len(part)
            by_source[part.source] += len(part)
        else:
            d["pad"] += part.free
            d["docs"] += documents_ended(part)
            if part.fill:
                by_source[getattr(part.record, "source", -1)] += 1


def documents_ended(row: Any) -> int:
    """How many documents end in a delivered row: its pieces whose tail label is ``IGNORE`` (a piece cut at
    the row's end carries the next token instead), or 1 for a record row of a pipeline without ``pack()``
    (0 for a row of padding)."""
    tails = getattr(row, "tails", None)
    if tails is None:  # a RecordRow: one record, or none (padding)
        return int(row.fill)
    return tails.count(IGNORE)


def _recent(counters: Any) -> dict[str, int]:
    """Per-source tokens over each lane's last complete window of documents (or its current one)."""
    out: dict[str, int] = {}
    for c in counters:
        for k, v in (c.last_window_tokens or c.window_tokens).items():
            out[k] = out.get(k, 0) + v
    return out


def _by_source(counts: Mapping[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    """``{source: {reason: count}}`` (e.g. ``skipped_images`` of each image source)."""
    out: dict[str, dict[str, int]] = {}
    for (source, reason), n in sorted(counts.items()):
        out.setdefault(source, {})[reason] = n
    return out


def _shares(counts: Mapping[str, float]) -> dict[str, float]:
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()} if total else {}


def parse_event(event: Any, names: Sequence[str], where: str = "events") -> tuple[int, dict[str, float]]:
    """One intervention ``[at_step, {source: weight}]``, checked (states are untrusted input)."""
    from .ops.schedule import _check_weights

    if not isinstance(event, (list, tuple)) or len(event) != 2:
        raise StateError(f"{where}: an intervention is [at_step, {{source: weight}}], got {event!r:.80}")
    at, weights = event
    if isinstance(at, bool) or not isinstance(at, int) or at < 0:
        raise StateError(f"{where}: at_step must be an integer >= 0, got {at!r}")
    try:
        return at, _check_weights(weights, names, where)
    except ValueError as exc:
        raise StateError(str(exc)) from None


def parse_events(events: Any, names: Sequence[str]) -> list[tuple[int, dict[str, float]]]:
    if not isinstance(events, list):
        raise StateError(f"the state's events must be a list of [at_step, weights], got {type(events).__name__}")
    return [parse_event(e, names, f"events[{i}]") for i, e in enumerate(events)]


def _collective_device(group: Any) -> str:
    """The device type whose tensors ``group`` reduces: "cpu" for gloo (or "cuda:nccl,cpu:gloo"), the
    accelerator for an NCCL-only group (torch's choice for object collectives)."""
    try:
        from torch.distributed.distributed_c10d import _get_object_coll_device
    except ImportError:  # an older torch: CPU, as before
        return "cpu"
    return _get_object_coll_device(group)


def _same_on_every_rank(event: tuple[int, dict], group: Any) -> None:
    """In a process group, every rank must issue the same intervention; a mismatch names the ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, event, group=group)
    me = dist.get_rank(group)
    for rank, other in enumerate(gathered):
        if other != event:
            raise ValueError(f"set_mixture: ranks disagree: rank {me} asked for {event}, rank {rank} for {other}. "
                             f"Every data rank must issue the same intervention (e.g. decide on rank 0 and "
                             f"broadcast, then call set_mixture everywhere).")


def build_loader(pipeline: Any, rank: int | None = None, world_size: int | None = None,
                 num_workers: int = 0, runner: str | Executor = "thread", prefetch: int | None = None,
                 max_steps: int | None = None, group: Any = None, text_map: Callable | None = None,
                 text_filter: Callable | None = None, plan: Any = None,
                 program: CompiledPipeline | None = None, address: str | None = None,
                 ray_options: Mapping[str, Any] | None = None, reuse_batch_memory: bool = True,
                 steps_ahead: int | None = None) -> ZephonLoader:
    """Build the loader of data-parallel ``rank`` of ``world_size`` for a pipeline (or a recipe:
    ``zephon.load_recipe(path)``).

    Args:
        pipeline: a :class:`zephon.Pipeline`, or a :class:`zephon.Recipe` (``zephon.load_recipe(path)``).
        rank: this process's data-parallel rank (None: the data-parallel group's, ``group`` or the default one,
            when ``torch.distributed`` is initialised, else 0).
        world_size: the data-parallel world size, a divisor of the pipeline's ``lanes`` (None: the group's, else
            1).
        num_workers: workers for the stateless work (0: everything in the calling thread).
        runner: where the work runs: ``"thread"`` (stateless work on ``num_workers`` threads, accumulators in
            this process), ``"pool"`` (stateless work on ``num_workers`` processes), ``"process"`` (whole lanes on
            ``num_workers`` processes; this process only collates), ``"ray"`` (stateless work on a Ray cluster,
            ``num_workers`` tasks at a time) or ``"ray-lanes"`` (whole lanes on ``num_workers`` Ray actors). None
            changes the batches, only the speed; an operator may pick its own executor kind (its ``executor=``).
        prefetch: items in flight per (lane, source, stage) with the thread and pool runners (None: 2, and for
            a pipeline that packs images 2 rising to 8 while the lanes wait for the workers:
            :class:`zephon.engine.sources.ReadAhead`), or steps ahead with the process runner.
        max_steps: stop after this many global steps (None: endless, unless the sources stop).
        group: the data-parallel process group (None: the default group): its ranks agree on where finite
            sources end, and ``rank``/``world_size`` default to its own.
        text_map: a classic recipe's per-document text hook (a module-level function for the pool and process
            runners); for a pipeline, use ``map_field()``.
        text_filter: a classic recipe's per-document text filter; for a pipeline, use ``filter_field()``.
        plan: a :class:`zephon.WorkPlan` already listed for this pipeline (None: list the files).
        program: the pipeline already compiled (``pipeline.compile()``; None: compile it).
        address: the Ray cluster (``"HEAD:6379"``; None: ``RAY_ADDRESS``, else a local one).
        ray_options: :class:`zephon.engine.ray_executor.RayOptions` fields, for the Ray runners.
        reuse_batch_memory: write a batch's large tensors (pixels) into the memory of an earlier batch that
            nothing refers to any more (:mod:`zephon.batches.buffers`); ``False`` allocates every batch afresh,
            for code that keeps a batch's memory without a Python reference to it (a raw ``data_ptr()``).
        steps_ahead: with workers, the lanes' own work (merge, shuffle, pack, waiting for the workers; with the
            process and ray-lanes runners, reading their rows back) and the collation run on a background thread
            up to this many steps before the trainer asks (:mod:`zephon.engine.steps_ahead`); 0: when asked, on
            the trainer's thread. None: 2 for a pipeline that packs images, with workers, else 0. Checkpoints
            hold the delivered steps either way.

    Returns:
        The rank's :class:`ZephonLoader`.

    Raises:
        ValueError: ``world_size`` does not divide the lanes, ``rank`` is out of range, or an option is negative.
        TypeError: ``pipeline`` is a path (load it with :func:`zephon.load_recipe`) or not a pipeline.
        PipelineError: the pipeline is not valid.
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
                        text_map, text_filter, plan, group, address=address, ray_options=ray_options,
                        reuse_batch_memory=reuse_batch_memory, steps_ahead=steps_ahead)

"""Where a rank's lanes run: in this process, or whole lanes on worker processes.

Because a lane is a closed world (its output is a pure function of the pipeline and the lane), it can
run anywhere. :class:`LocalLanes` runs them in the calling process (stateless stages may still go to
executors). :class:`ProcessLanes` places whole lanes, accumulators included, on ``num_workers``
processes (lane ``i`` of this rank on worker ``i % num_workers``), so that independent lanes' read,
tokenize, mix and pack all run in parallel and the trainer's process only collates rows. Inside a
worker, one thread runs the stateless stages of the next chunks while the main thread runs the
accumulators. Each worker computes ahead into a bounded queue; the host reads the queues in lane order
and keeps, for each lane, the state that goes with the last step it *delivered*, so a checkpoint never
counts rows that were computed ahead but not consumed.
"""

from __future__ import annotations

import copy
import os
import queue
import threading
import time
import traceback
from dataclasses import asdict
from typing import Any, Callable, Mapping, Sequence

from ..records import Row
from ..state.lane import LaneState
from .worker_guard import Trainer, exit_with, this_process
from .counters import LaneCounters
from .errors import HostInterrupted
from .executors import MAIN_GUARD_HINT, Executor, ThreadExecutor, check_picklable
from .lane import Lane, LaneProgram
from .sources import ReadAhead
from .processes import start_worker_server
from .transfer import Outbox, discard, receive, share


def start_lanes(lanes: Sequence[Lane], states: Mapping[int, Any]) -> None:
    """Reset ``lanes`` to their ``states`` (absent: the beginning) and put their first tasks in flight."""
    for lane in lanes:
        lane.reset(states.get(lane.lane))
    for lane in lanes:  # workers start on every lane's first chunk at once, before any second one:
        lane.prime(1)   # the first batch needs every lane, not all the chunks of the first lanes
    for lane in lanes:  # a resume: every lane's replay in flight at once
        lane.prime_replay()
    for lane in lanes:
        lane.prime()


class LocalLanes:
    """Lanes as torchdata nodes in this process."""

    def __init__(self, program: LaneProgram, lanes: Sequence[int], executor_for: Callable[[int, int], Executor],
                 depth: "int | ReadAhead", events: list | None = None) -> None:
        self.events = events if events is not None else []
        self._lanes = [Lane(program, lane, executor_for, depth, self.events) for lane in lanes]

    def reset(self, states: dict[int, LaneState]) -> None:
        start_lanes(self._lanes, states)

    def next_step(self) -> list[list[Row]]:
        return [next(lane) for lane in self._lanes]

    def states(self) -> dict[int, dict]:
        return {lane.lane: lane.get_state() for lane in self._lanes}

    def counters(self) -> dict[int, LaneCounters]:
        return {lane.lane: lane.counters for lane in self._lanes}

    def mark(self) -> tuple[dict[int, dict], None]:
        """What :meth:`rewind` needs to come back to this point: the lanes' states."""
        return self.states(), None

    def rewind(self, states: dict[int, dict], _extra: None = None) -> None:
        """The lanes back at ``states`` (a :meth:`mark` taken after a delivered step): rebuilt at their last
        sentinels and replayed to the delivered rows. The counts go on from where they were: replayed work is
        not new."""
        before = {lane.lane: copy.deepcopy(lane.counters) for lane in self._lanes}
        self.reset(states)
        for lane in self._lanes:
            lane.skip_delivered()
        for lane in self._lanes:
            lane.counters.clear()
            lane.counters.merge(before[lane.lane])

    def apply_event_from(self, mark: tuple, at_step: int, drop_ahead: Callable[[], None]) -> int:
        """:meth:`apply_event` as of ``mark`` (taken after the last step delivered), the lanes having run past
        it: ``drop_ahead()`` stops what steps them (and drops its steps), then they go back to the mark, where
        their next decisions see the intervention. Returns the number of lanes rewound."""
        drop_ahead()
        self.rewind(*mark)
        self.apply_event(at_step)
        return len(self._lanes)

    def apply_event(self, at_step: int) -> int:
        """An intervention (already in ``events``, which the lanes share) from ``at_step``. A lane decides for a
        step only while it makes that step's rows (the step clock), and these lanes have made none past the
        delivered steps, so their next decisions see it and nothing is replayed: returns 0."""
        ahead = [lane.lane for lane in self._lanes if lane.decided_step >= at_step]
        if ahead:  # the loader never steps these lanes past delivery without rewinding them first
            raise RuntimeError(f"lanes {ahead} decided for step {at_step} before it was delivered")
        return 0

    def close(self) -> None:
        pass


def _lane_worker(pipeline: Any, lanes: list[int], states: dict[int, dict], out: Any, stop: Any,
                 trainer: Trainer, events: list | None = None, outbox: str | None = None) -> None:
    """Worker process: run ``lanes`` step after step, putting one message per step on ``out``: for each of
    its lanes, in order, (lane, rows, state, counters). One message per step rather than per lane: the
    trainer's process pays a queue read (lock, pipe read, unpickle) per message. Exits when ``trainer``
    dies."""
    exit_with(trainer)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    executor = None
    try:
        import torch
        torch.set_num_threads(1)
        program = pipeline.compile()
        # one stateless thread per lane process, one chunk ahead per (lane, source, stage): this process's
        # main thread runs the accumulators while the next chunks are read and tokenized
        executor = ThreadExecutor(program.stages, 1)
        shared = list(events or [])
        nodes = [Lane(program, lane, lambda s, k: executor, 1, shared) for lane in lanes]
        start_lanes(nodes, states)
        while not stop.is_set():
            item = ("step", share([(node.lane, next(node), node.get_state(), asdict(node.counters))
                                   for node in nodes], outbox))
            while True:
                try:
                    out.put(item, timeout=0.2)
                    break
                except queue.Full:
                    if stop.is_set():
                        discard(item[1])
                        return
    except BaseException as exc:  # hand the error to the host, which raises it in the trainer
        try:
            out.put(("error", exc, traceback.format_exc()), timeout=5)
        except BaseException:
            out.put(("error", RuntimeError(str(exc)), traceback.format_exc()), timeout=5)
    finally:
        if executor is not None:
            executor.close()


def _drain(q: Any) -> None:
    """Take every message waiting on ``q`` without blocking, releasing the steps' shared buffers."""
    try:
        while True:
            item = q.get_nowait()
            if item[0] == "step":
                discard(item[1])
    except (queue.Empty, OSError, ValueError, EOFError):
        pass


def _worker_death(k: int, pid: int, code: int | None) -> str:
    """Why a lane worker may have died without a word: its own errors are always reported."""
    head = f"Zephon lane worker {k} (pid {pid}) exited with code {code} without reporting an error"
    if code is not None and code < 0:
        return f"{head}: it was killed by signal {-code} (out of memory? see dmesg)."
    if code == 255:  # CPython's status for a forkserver child whose status it could not read: the server died
        return (f"{head}; its exit status was lost, which happens when the forkserver the workers are started from "
                f"has died (killed, or out of memory: see dmesg). Workers exit with their forkserver.")
    return f"{head}, so it failed while starting, before Zephon's code ran (its traceback is on stderr). " \
        + MAIN_GUARD_HINT


class ProcessLanes:
    """Whole lanes on ``num_workers`` worker processes, computing up to ``prefetch`` steps ahead."""

    def __init__(self, pipeline: Any, program: LaneProgram, lanes: Sequence[int], num_workers: int,
                 prefetch: int = 4, events: list | None = None) -> None:
        self._init_host(pipeline, program, lanes, num_workers, prefetch, events)
        check_picklable(program.stages)
        self._ctx = start_worker_server()
        self._outbox: Outbox | None = None

    def _init_host(self, pipeline: Any, program: LaneProgram, lanes: Sequence[int], num_workers: int,
                   prefetch: int, events: list | None) -> None:
        """The host's bookkeeping, whatever its workers are (``RayLanes`` shares it)."""
        self.pipeline, self.program, self.lanes = pipeline, program, list(lanes)
        self.events = events if events is not None else []
        self.num_workers = max(1, min(num_workers, len(self.lanes)))
        self.prefetch = max(1, prefetch)
        self._failed: str | None = None  # why the workers stopped mid-step: the host cannot go on
        self._procs: list[Any] = []  # the workers (processes, or Ray actors)
        self._states: dict[int, dict] = {}
        self._counters: dict[int, LaneCounters] = {lane: LaneCounters() for lane in self.lanes}
        # what workers stopped before a restart within the run had counted (they count afresh when started)
        self._base: dict[int, LaneCounters] = {}
        self._interrupted = threading.Event()  # interrupt()

    def interrupt(self) -> None:
        """Make a :meth:`next_step` that waits on another thread give up (:class:`HostInterrupted`): the
        steps-ahead thread is being stopped, and the host is rewound, reset or closed before the next step."""
        self._interrupted.set()

    def reset(self, states: dict[int, LaneState]) -> None:
        self._failed = None
        self._start({k: v.to_dict() for k, v in states.items()}, keep_counts=False)

    def _start(self, states: dict[int, dict], keep_counts: bool = True) -> None:
        """Start the workers from ``states``. Within a run (``keep_counts``: an intervention, a rewind) the
        counts go on from where they were, as :meth:`LocalLanes.rewind`'s do; a reset (a state loaded)
        counts afresh, as a new :class:`LocalLanes` does."""
        self.close()
        self._interrupted.clear()
        self._states = dict(states)
        self._count_afresh(self.lanes, keep_counts)
        self._stop = self._ctx.Event()
        self._outbox = Outbox()
        self._queues, self._procs = [], []
        for k in range(self.num_workers):
            mine = self.lanes[k::self.num_workers]
            q = self._ctx.Queue(maxsize=self.prefetch)  # steps ahead
            proc = self._ctx.Process(target=_lane_worker, name=f"zephon-lanes-{k}", daemon=True,
                                     args=(self.pipeline, mine, {x: self._states[x] for x in mine if x in self._states},
                                           q, self._stop, this_process(), list(self.events), self._outbox.path))
            proc.start()
            self._queues.append(q)
            self._procs.append(proc)

    def _get(self, k: int) -> tuple:
        while True:
            if self._interrupted.is_set():
                raise HostInterrupted("a step awaited from the lane workers was given up")
            try:
                return self._queues[k].get(timeout=0.25)
            except queue.Empty:
                proc = self._procs[k]
                if not proc.is_alive():
                    raise RuntimeError(_worker_death(k, proc.pid, proc.exitcode)) from None

    def next_step(self) -> list[list[Row]]:
        if self._failed is not None:
            raise RuntimeError(f"the lane workers stopped in the middle of a step ({self._failed}); rebuild the "
                               f"loader, or load a checkpoint state into it") from None
        if not self._procs:  # first use, or after close(): from the states of the steps delivered so far
            self._start(self._states)
        items: list[tuple] = []
        try:
            for k in range(self.num_workers):
                items.append(self._get(k))
            for item in items:
                if item[0] == "error":
                    _, exc, tb = item
                    raise exc from RuntimeError(f"in a Zephon lane worker:\n{tb}")
            steps = [iter(receive(item[1])) for item in items]
        except BaseException as exc:
            if not items:  # nothing of this step was taken yet (e.g. interrupted while waiting): it can still be had
                raise
            # some workers' parts of this step are consumed: this step cannot be had any more
            self._failed = f"{type(exc).__name__}: {exc}"
            for item in items:
                if item[0] == "step":
                    discard(item[1])
            self.close()
            raise
        rows_per_lane = []
        for i, lane in enumerate(self.lanes):  # worker k holds lanes[k::num_workers], in order
            got, rows, state, counters = next(steps[i % self.num_workers])
            assert got == lane, f"lane worker returned lane {got}, expected {lane}"
            self._states[lane] = state
            self._counters[lane] = LaneCounters(**counters)
            rows_per_lane.append(rows)
        return rows_per_lane

    def states(self) -> dict[int, dict]:
        return {lane: self._states.get(lane, LaneState.initial(self.program.names).to_dict()) for lane in self.lanes}

    def counters(self) -> dict[int, LaneCounters]:
        if not self._base:
            return self._counters
        return {lane: self._base[lane].followed_by(c) if lane in self._base else c
                for lane, c in self._counters.items()}

    def _count_afresh(self, lanes: Sequence[int], keep_counts: bool = True) -> None:
        """The workers of ``lanes`` are about to start, and count from zero: keep what their lanes counted so
        far (``keep_counts``), or forget it."""
        now = self.counters()
        for lane in lanes:
            if keep_counts and vars(now[lane]) != vars(LaneCounters()):
                self._base[lane] = now[lane]
            else:
                self._base.pop(lane, None)
            self._counters[lane] = LaneCounters()

    def mark(self) -> tuple[dict[int, dict]]:
        """What :meth:`rewind` needs to come back to this point: the lanes' delivered states."""
        return (self.states(),)

    def rewind(self, states: dict[int, dict]) -> None:
        """Back to a :meth:`mark`: the workers, which ran past it, stop, and the next step starts them again from
        ``states`` (with the events in force then). A failure of a step past the mark is forgotten with it."""
        self.close()
        self._failed = None
        self._states = dict(states)

    def apply_event_from(self, mark: tuple, at_step: int, drop_ahead: Callable[[], None]) -> int:
        """:meth:`apply_event` as of ``mark`` (taken after the last step delivered), the host having read steps
        past it: ``drop_ahead()`` stops what steps the host (and drops its steps), and the workers restart from
        the mark at the next step, with the intervention. Returns the number of lanes rewound."""
        drop_ahead()
        self.rewind(*mark)
        return len(self.lanes)

    def apply_event(self, at_step: int) -> int:
        """An intervention (already in ``events``): the lane workers, which run ahead of delivery, restart from
        the delivered states with it. Returns the number of lanes restarted."""
        if self._procs:
            self._start(self._states)
        return len(self.lanes)

    def close(self) -> None:
        if not self._procs:
            return
        self._stop.set()
        # Keep draining while the workers exit: a worker that put a step after a single drain cannot exit
        # until its queue's feeder thread has written that step into the pipe, which needs a reader. One
        # deadline for all: a worker stopped or hung (not just busy) must not hold close() 5 s per worker;
        # then SIGTERM, and SIGKILL for one that cannot take it (a stopped process keeps a SIGTERM pending).
        deadline = time.monotonic() + 5
        while True:
            for q in self._queues:
                _drain(q)
            alive = [proc for proc in self._procs if proc.is_alive()]
            if not alive or time.monotonic() >= deadline:
                break
            alive[0].join(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(timeout=1)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for q in self._queues:
            q.close()
            q.cancel_join_thread()
        self._procs, self._queues = [], []
        if self._outbox is not None:
            self._outbox.close()  # with the steps the workers wrote that were never read

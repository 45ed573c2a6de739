"""Where a rank's lanes run: in this process, or whole lanes on worker processes.

Because a lane is a closed world (its output is a pure function of recipe and lane), it can run
anywhere. :class:`LocalLanes` runs them in the calling process (stateless chunk work may still go to
worker threads). :class:`ProcessLanes` places whole lanes, accumulators included, on ``num_workers``
processes (lane ``i`` of this rank on worker ``i % num_workers``), so that independent lanes'
read, tokenize, mix and pack all run in parallel and the trainer's process only collates rows.
Inside a worker, one thread reads and tokenizes the next chunks while the main thread mixes and packs.
Each worker computes ahead into a bounded queue; the host reads the queues in lane order and keeps,
for each lane, the state that goes with the last step it *delivered*, so a checkpoint never counts
rows that were computed ahead but not consumed.
"""

from __future__ import annotations

import os
import queue
import traceback
from dataclasses import asdict
from typing import Any, Sequence

from .nodes.items import LaneCounters, Row
from .nodes.lane import Lane
from .plan import WorkPlan
from .recipe import Recipe
from .runner import MAIN_GUARD_HINT, Runner, TextFilter, TextMap, check_picklable, start_worker_server
from .worker_guard import Trainer, exit_with, this_process


class LocalLanes:
    """Lanes as torchdata nodes in this process."""

    def __init__(self, recipe: Recipe, plan: WorkPlan, runner: Runner, lanes: Sequence[int], depth: int) -> None:
        self._lanes = [Lane(recipe, plan, runner, lane, depth) for lane in lanes]

    def reset(self, states: dict[int, dict]) -> None:
        for lane in self._lanes:
            lane.reset(states.get(lane.lane))
        for lane in self._lanes:  # workers start on every lane's first chunks at once
            lane.prime()

    def next_step(self) -> list[list[Row]]:
        return [next(lane) for lane in self._lanes]

    def states(self) -> dict[int, dict]:
        return {lane.lane: lane.get_state() for lane in self._lanes}

    def counters(self) -> dict[int, LaneCounters]:
        return {lane.lane: lane.counters for lane in self._lanes}

    def close(self) -> None:
        pass


def _lane_worker(recipe: Recipe, lanes: list[int], states: dict[int, dict], out: Any, stop: Any,
                 text_map: TextMap, text_filter: TextFilter, trainer: Trainer) -> None:
    """Worker process: run ``lanes`` step after step, putting one message per step on ``out``: for each of
    its lanes, in order, (lane, rows, state, counters). One message per step rather than per lane: the
    trainer's process pays a queue read (lock, pipe read, unpickle) per message. Exits when ``trainer``
    dies."""
    exit_with(trainer)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    runner = None
    try:
        import torch
        torch.set_num_threads(1)
        plan = WorkPlan(recipe)
        # one tokenizer thread per lane process, one chunk ahead per (lane, source): this process's main
        # thread mixes and packs while the next chunks tokenize, as the trainer does with runner="thread"
        runner = Runner(recipe, plan, 1, "thread", text_map, text_filter)
        nodes = [Lane(recipe, plan, runner, lane, 1) for lane in lanes]
        for node in nodes:
            node.reset(states.get(node.lane))
        for node in nodes:
            node.prime()
        while not stop.is_set():
            item = ("step", [(node.lane, next(node), node.get_state(), asdict(node.counters)) for node in nodes])
            while True:
                try:
                    out.put(item, timeout=0.2)
                    break
                except queue.Full:
                    if stop.is_set():
                        return
    except BaseException as exc:  # hand the error to the host, which raises it in the trainer
        try:
            out.put(("error", exc, traceback.format_exc()), timeout=5)
        except BaseException:
            out.put(("error", RuntimeError(str(exc)), traceback.format_exc()), timeout=5)
    finally:
        if runner is not None:
            runner.close()


def _worker_death(k: int, pid: int, code: int | None) -> str:
    """Why a lane worker may have died without a word: its own errors are always reported."""
    head = f"Zephon lane worker {k} (pid {pid}) exited with code {code} without reporting an error"
    if code is not None and code < 0:
        return f"{head}: it was killed by signal {-code} (out of memory? see dmesg)."
    return f"{head}, so it failed while starting, before Zephon's code ran (its traceback is on stderr). " \
        + MAIN_GUARD_HINT


class ProcessLanes:
    """Whole lanes on ``num_workers`` worker processes, computing up to ``prefetch`` steps ahead."""

    def __init__(self, recipe: Recipe, lanes: Sequence[int], num_workers: int, prefetch: int = 4,
                 text_map: TextMap = None, text_filter: TextFilter = None) -> None:
        self.recipe, self.lanes = recipe, list(lanes)
        self.num_workers = max(1, min(num_workers, len(self.lanes)))
        self.prefetch = max(1, prefetch)
        self.text_map, self.text_filter = text_map, text_filter
        check_picklable(text_map=text_map, text_filter=text_filter)
        self._ctx = start_worker_server()
        self._procs: list[Any] = []
        self._states: dict[int, dict] = {}
        self._counters: dict[int, LaneCounters] = {lane: LaneCounters() for lane in self.lanes}

    def reset(self, states: dict[int, dict]) -> None:
        self.close()
        self._states = dict(states)
        self._counters = {lane: LaneCounters() for lane in self.lanes}
        self._stop = self._ctx.Event()
        self._queues, self._procs = [], []
        for k in range(self.num_workers):
            mine = self.lanes[k::self.num_workers]
            q = self._ctx.Queue(maxsize=self.prefetch)  # steps ahead
            proc = self._ctx.Process(target=_lane_worker, name=f"zephon-lanes-{k}", daemon=True,
                                     args=(self.recipe, mine, {x: self._states[x] for x in mine if x in self._states},
                                           q, self._stop, self.text_map, self.text_filter, this_process()))
            proc.start()
            self._queues.append(q)
            self._procs.append(proc)

    def _get(self, k: int) -> tuple:
        while True:
            try:
                return self._queues[k].get(timeout=1.0)
            except queue.Empty:
                proc = self._procs[k]
                if not proc.is_alive():
                    raise RuntimeError(_worker_death(k, proc.pid, proc.exitcode)) from None

    def next_step(self) -> list[list[Row]]:
        if not self._procs:
            self.reset({})
        steps = []
        for k in range(self.num_workers):
            item = self._get(k)
            if item[0] == "error":
                _, exc, tb = item
                self.close()
                raise exc from RuntimeError(f"in a Zephon lane worker:\n{tb}")
            steps.append(iter(item[1]))
        rows_per_lane = []
        for i, lane in enumerate(self.lanes):  # worker k holds lanes[k::num_workers], in order
            got, rows, state, counters = next(steps[i % self.num_workers])
            assert got == lane, f"lane worker returned lane {got}, expected {lane}"
            self._states[lane] = state
            self._counters[lane] = LaneCounters(**counters)
            rows_per_lane.append(rows)
        return rows_per_lane

    def states(self) -> dict[int, dict]:
        from .nodes.lane import LaneState
        names = [s.name for s in self.recipe.sources]
        return {lane: self._states.get(lane, LaneState.initial(names).to_dict()) for lane in self.lanes}

    def counters(self) -> dict[int, LaneCounters]:
        return self._counters

    def close(self) -> None:
        if not self._procs:
            return
        self._stop.set()
        for q in self._queues:  # unblock workers waiting on a full queue
            try:
                while True:
                    q.get_nowait()
            except (queue.Empty, OSError, ValueError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for q in self._queues:
            q.close()
            q.cancel_join_thread()
        self._procs, self._queues = [], []

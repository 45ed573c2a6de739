"""Whole lanes on Ray actors (``runner="ray-lanes"``): the Ray analogue of
:class:`~zephon.engine.hosts.ProcessLanes`.

A rank's lanes, accumulators included, run on ``num_workers`` Ray actors placed anywhere in the cluster
(lane ``i`` of the rank on actor ``i % num_workers``, each actor in a bundle of a placement group that
reserves its CPUs); the rank only collates. Inside an actor, as in a lane process, one thread runs the
stateless stages of the next chunks while the actor's main thread runs the accumulators, and one call
returns one step of all its lanes: for each, in order, ``(lane, rows, state, counters)``.

The host keeps up to ``prefetch`` step calls queued on each actor (a Ray actor runs one caller's calls in
order) and, for each lane, the state that goes with the last step it *delivered*: checkpoints hold
positions exactly as with the other runners. An actor that dies (its process killed, its node lost) is
replaced by a new one built from those states, as a resume would, so the next step is the same one
the dead actor would have computed; ``max_rebuilds`` deaths in a row without a step delivered is an
error. An exception raised by the pipeline itself is not retried: it reaches the trainer as itself.

:class:`RayLanes` is a :class:`~zephon.engine.hosts.ProcessLanes` whose workers are actors: it inherits
the host's bookkeeping (delivered states, counters, the digests that check a mixture intervention, the
restart after one) and replaces only how workers start, answer and stop. :class:`LaneActor` builds its
lanes as ``hosts._lane_worker`` does; a change to one belongs in the other.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import asdict
from typing import Any, Sequence

from .executors import ThreadExecutor, check_picklable
from .hosts import ProcessLanes, start_lanes
from .lane import Lane, LaneProgram
from .ray_executor import ClusterLink, RayOptions, connect, remote_class, require_ray, reserve, stop_actors


CLOSED_WHILE_AWAITED = "the Ray lane actors were closed while a step of theirs was awaited"


class LaneActor:
    """The actor: lanes ``lanes`` of ``pipeline`` from ``states``, one step of all of them per :meth:`step`."""

    def __init__(self, pipeline: Any, lanes: list[int], states: dict[int, dict], events: list,
                 fingerprint: str) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import torch

        torch.set_num_threads(1)
        program = pipeline.compile()
        if fingerprint and program.fingerprint != fingerprint:
            raise RuntimeError(f"the pipeline compiled on this Ray node (fingerprint {program.fingerprint[:12]}) is not "
                               f"the trainer's ({fingerprint[:12]}): the node sees other files or runs other code. "
                               f"Every node must see the same data at the same paths, with the same Zephon.")
        # one stateless thread, one chunk ahead per (lane, source, stage), as in a lane process: the actor's
        # main thread runs the accumulators while the next chunks are read and tokenized
        self.executor = ThreadExecutor(program.stages, 1)
        shared = list(events)
        self.nodes = [Lane(program, lane, lambda s, k: self.executor, 1, shared) for lane in lanes]
        start_lanes(self.nodes, states)  # as hosts._lane_worker: a resume's replay chunks in flight at once

    def pid(self) -> int:
        return os.getpid()

    def step(self) -> tuple[str, list[tuple[int, list, dict, dict]]]:
        """One step of every lane of this actor: ``("step", [(lane, rows, state, counters), ...])``."""
        return "step", [(node.lane, next(node), node.get_state(), asdict(node.counters)) for node in self.nodes]


class RayLanes(ProcessLanes):
    """Whole lanes on ``num_workers`` Ray actors, computing up to ``prefetch`` steps ahead."""

    def __init__(self, pipeline: Any, program: LaneProgram, lanes: Sequence[int], num_workers: int,
                 prefetch: int = 4, events: list | None = None, address: str | None = None, **options: Any) -> None:
        # ProcessLanes.__init__ would start a forkserver for worker processes; actors need none, so only the
        # host's bookkeeping is set up (self._procs: the actors)
        self._init_host(pipeline, program, lanes, num_workers, prefetch, events)
        self.opts = RayOptions.make(address, **options)
        check_picklable(program.stages)
        self.fingerprint = str(getattr(program, "fingerprint", ""))
        self.link: ClusterLink = connect(self.opts)
        self._pipeline_ref: Any = None
        self._pg: Any = None
        self._pids: list[Any] = []
        self._pending: list[deque] = []
        self.rebuilds = 0  # actors replaced after a death, over this host's life

    # -- actors --------------------------------------------------------------------------------------
    def _mine(self, k: int) -> list[int]:
        return self.lanes[k::self.num_workers]

    def _spawn(self, k: int) -> Any:
        """Actor ``k`` for its lanes at their last delivered states, with ``prefetch`` steps queued."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        mine = self._mine(k)
        actor = remote_class(LaneActor).options(
            num_cpus=self.opts.num_cpus, max_restarts=0, max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=k),
        ).remote(self._pipeline_ref, mine, {x: self._states[x] for x in mine if x in self._states},
                 list(self.events), self.fingerprint)
        self._pids[k] = actor.pid.remote()
        self._pending[k] = deque(actor.step.remote() for _ in range(self.prefetch))
        return actor

    def _start(self, states: dict[int, dict], keep_counts: bool = True) -> None:
        self.close()
        self._interrupted.clear()
        ray = require_ray()
        self._states = dict(states)
        self._count_afresh(self.lanes, keep_counts)
        if self._pipeline_ref is None:
            self._pipeline_ref = ray.put(self.pipeline)  # sent once; every actor (and rebuild) reads it there
        self._pg = reserve(self.link, self.num_workers, self.opts.num_cpus, "SPREAD", self.opts.placement_timeout_s,
                           f"{self.num_workers} Ray lane actors")
        n = self.num_workers
        self._procs, self._pids, self._pending = [None] * n, [None] * n, [deque() for _ in range(n)]
        for k in range(n):
            self._procs[k] = self._spawn(k)

    def worker_pids(self) -> list[int]:
        """The process id of each lane actor (on its node), for monitoring and the fault tests."""
        return [self.link.wait(ref, f"lane actor {k}'s start", self.opts.task_timeout_s)
                for k, ref in enumerate(self._pids)]

    def _get(self, k: int) -> tuple:
        """Actor ``k``'s next step; a dead actor is replaced by one built from its lanes' delivered states."""
        ray = require_ray()
        deaths = 0
        while True:
            queue = self._pending[k]
            ref = queue.popleft()
            queue.append(self._procs[k].step.remote())  # keep `prefetch` steps queued
            try:
                return self.link.wait(ref, f"a step of Ray lane actor {k} (lanes {self._mine(k)})",
                                      self.opts.task_timeout_s, given_up=self._interrupted.is_set)
            except ray.exceptions.TaskCancelledError:  # only close() cancels: it ran on another thread meanwhile
                raise RuntimeError(CLOSED_WHILE_AWAITED) from None
            except ray.exceptions.RayActorError as exc:
                if not self._procs:  # killed by close() on another thread meanwhile: no death to rebuild from
                    raise RuntimeError(CLOSED_WHILE_AWAITED) from None
                if exc.actor_init_failed:  # the lanes failed to build there: a new actor would fail the same way
                    self.close()
                    raise
                self.link.check_after_failure()  # the whole cluster lost is not a job for a rebuild
                deaths += 1
                if deaths > self.opts.max_rebuilds:
                    self.close()
                    raise RuntimeError(f"Ray lane actor {k} (lanes {self._mine(k)}) died {deaths} times in a row "
                                       f"without delivering a step (out of memory? see `ray logs` on the cluster at "
                                       f"{self.link.head}): {exc}") from exc
                try:
                    ray.kill(self._procs[k], no_restart=True)
                except Exception:  # noqa: BLE001 - it is dead already
                    pass
                self.rebuilds += 1
                self._count_afresh(self._mine(k))
                self._procs[k] = self._spawn(k)
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        """Kill the actors and give their CPUs back (nothing to do on a lost cluster)."""
        if not self._procs:
            return
        # copies (atomic under the GIL): a next() on another thread may be taking from a queue right now
        calls = [ref for queue in list(self._pending) for ref in list(queue)] + [r for r in self._pids if r is not None]
        actors, self._procs, self._pending, self._pids = self._procs, [], [], []
        # cancelled before the kill, as the stage workers' calls are: a lane actor's calls have no retries, so
        # Ray has nothing to report about them today, and cancelled they stay so whatever the retries
        stop_actors(self.link, actors, calls, self._pg)
        self._pg = None

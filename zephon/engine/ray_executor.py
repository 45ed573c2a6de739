"""Stateless stages on a Ray cluster (``runner="ray"``, or ``executor="ray"`` on an operator).

The rank stays where it is and keeps every stateful decision: it connects to a Ray cluster as a driver,
puts its :class:`~zephon.engine.stages.StageProgram` in the cluster's object store once, and starts
``num_workers`` Ray actors (:class:`StageWorker`) that read it there and set it up once (readers,
tokenizers). Each task (read a chunk, apply a stage's transforms) is a call on the worker with the
fewest tasks queued. Results come back through Ray's object store and the lane's
:class:`~zephon.engine.sources.StageBuffer` takes them in submission order, so the cluster's size,
placement and retries change speed only.

- **Why actors, not plain Ray tasks.** A task carries no state, so every worker process Ray starts for a
  task must import Zephon and set the program up before its first chunk; with more than one task slot
  Ray keeps leasing fresh worker processes as the queue drains and fills (measured: no-op tasks went from
  ~600/s to ~50/s at two slots, each new process paying the import). An actor is started once.
- **Where the work runs.** A placement group reserves ``num_workers`` bundles of ``num_cpus`` CPUs (a
  rank's share of the cluster), one worker per bundle. A cluster that cannot give that many CPUs is a
  clear error after ``placement_timeout_s``.
- **Data.** A :class:`~zephon.records.Chunk` is a dataclass of numpy arrays (token ids, offsets, resume
  points, decoded images); Ray pickles it with protocol 5 and keeps every array's buffer out of band, so
  a large result is read in place from the object store (zero-copy, read-only arrays) rather than
  unpickled (``tests/test_ray.py`` checks it).
- **Backpressure.** Tasks in flight per (lane, source, stage) are bounded by the StageBuffer's depth;
  bytes in flight per executor by ``max_bytes_in_flight``: a submitted task is held back (not sent to the
  cluster) while the results computed and not yet taken would exceed it. Held tasks go out, in order,
  as results are taken. A task whose result the lane asks for goes out at once, so a lane never waits
  on a held task (a blocking ``submit`` would deadlock the one thread that both submits and takes).
- **Faults.** A worker whose process dies is restarted by Ray with the program, and the calls it held
  are run again (``max_retries`` times for one call: a task is pure, so a retry gives the same chunk).
  Every wait is bounded: results are waited for in slices, and between slices the head's GCS port is
  probed; a head that does not answer for ``lost_after_s`` is :class:`RayClusterLost` (the connection is
  closed first, so that the trainer can exit: Ray would otherwise keep retrying and then end the process).
- **Closing** cancels the calls in flight before it kills the workers (:func:`stop_actors`): Ray then neither
  retries them nor prints a line per call on the trainer's console.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Callable

import numpy as np

from .errors import HostInterrupted, RayClusterLost
from .executors import check_picklable
from .stages import StageProgram

WAIT_SLICE_S = 1.0  # how long one ray.get waits before the cluster's health is checked
PROBE_EVERY_S = 1.0  # at most one TCP probe of the head per this many seconds
INSTALL_HINT = ("Ray is not installed: install Zephon's ray extra from your clone of the repository, "
                "`python -m pip install -e '.[ray]'`.")


@dataclass
class RayOptions:
    """Options of both Ray runners (``ray_options=`` of ``build_loader``; ``address=`` is its own argument).

    ``num_cpus``: CPUs reserved per task slot (executor) or per lane actor (``ray-lanes``).
    ``max_bytes_in_flight``: results computed ahead and not yet taken, per executor.
    ``first_guess_bytes``: the size assumed for a (source, stage)'s result before one was measured.
    ``max_retries``: retries of one task whose Ray worker died. ``max_rebuilds``: rebuilds in a row of a
    lane actor that died (``ray-lanes``). The ``*_s`` options bound every wait: connecting, placing the
    reservation, one task or step (``task_timeout_s``), and how long the head may be unreachable
    before the cluster counts as lost (``lost_after_s``).
    """

    address: str | None = None
    num_cpus: float = 1.0
    max_bytes_in_flight: int = 512 << 20
    first_guess_bytes: int = 1 << 20
    max_retries: int = 3
    max_rebuilds: int = 3
    connect_timeout_s: float = 30.0
    placement_timeout_s: float = 60.0
    task_timeout_s: float = 600.0
    lost_after_s: float = 30.0

    @classmethod
    def make(cls, address: str | None = None, **options: Any) -> "RayOptions":
        known = {f.name for f in fields(cls)}
        bad = sorted(set(options) - known)
        if bad:
            raise TypeError(f"unknown Ray option(s) {bad}; the options are {sorted(known - {'address'})}")
        opts = cls(address=address, **options)
        if opts.num_cpus <= 0 or opts.max_bytes_in_flight < 1 or opts.max_retries < 0 or opts.max_rebuilds < 0:
            raise ValueError(f"Ray options out of range: {opts}")
        if min(opts.connect_timeout_s, opts.placement_timeout_s, opts.task_timeout_s, opts.lost_after_s) <= 0:
            raise ValueError(f"Ray timeouts must be > 0 s: {opts}")
        return opts


def require_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return ray


# -- the connection ------------------------------------------------------------------------------------
def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``host:port`` address; None for ``auto``, ``local`` and ``ray://`` ones."""
    if "://" in address or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        return None


def _reachable(host_port: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(host_port, timeout=1.0):
            return True
    except OSError:
        return False


class ClusterLink:
    """This process's connection to a Ray cluster, and the watch on its head (see the module docstring)."""

    def __init__(self, requested: str | None, lost_after_s: float) -> None:
        self.requested, self.lost_after_s = requested, lost_after_s
        self.lost = False
        self._head: tuple[str, int] | None = None
        self._down_since: float | None = None
        self._last_probe = 0.0
        self._lock = threading.Lock()

    def attach(self, ray: Any) -> None:
        gcs = getattr(ray.get_runtime_context(), "gcs_address", None)
        self._head = _host_port(gcs) if gcs else None

    @property
    def head(self) -> str:
        return f"{self._head[0]}:{self._head[1]}" if self._head else (self.requested or "the local cluster")

    def check(self) -> None:
        """Raise :class:`RayClusterLost` once the head has been unreachable for ``lost_after_s``."""
        if self.lost:
            raise RayClusterLost(self._lost_message())
        if self._head is None:
            return
        now = time.monotonic()
        with self._lock:
            if now - self._last_probe < PROBE_EVERY_S:
                return
            self._last_probe = now
        if _reachable(self._head):
            self._down_since = None
            return
        if self._down_since is None:
            self._down_since = now
        if now - self._down_since >= self.lost_after_s:
            self.declare_lost()

    def check_after_failure(self) -> None:
        """After a worker or an object was lost: if the head does not answer either, wait (at most
        ``lost_after_s``) for it and raise :class:`RayClusterLost` if it stays away; return if it answers,
        so that the caller reports the failure as its own."""
        if self._head is None:
            return
        while not _reachable(self._head):
            self._last_probe = 0.0  # probe now, not at the pace of a healthy wait
            self.check()
            time.sleep(PROBE_EVERY_S)

    def _lost_message(self) -> str:
        return (f"lost the Ray cluster at {self.head}: its head (GCS) has not answered for {self.lost_after_s:.0f} s "
                f"(killed, out of memory, or the network is down). The loader's state_dict() still holds the "
                f"positions of the last delivered batch: restart the cluster and resume from your last checkpoint.")

    def declare_lost(self) -> None:
        """Close the connection (bounded: Ray's own shutdown may wait for the head), then raise."""
        global _LINK
        self.lost = True
        if _LINK is self:
            _LINK = None
            ray = require_ray()
            closer = threading.Thread(target=ray.shutdown, name="zephon-ray-shutdown", daemon=True)
            closer.start()
            closer.join(timeout=20)
        raise RayClusterLost(self._lost_message())

    def wait(self, ref: Any, what: str, timeout_s: float, given_up: Callable[[], bool] | None = None) -> Any:
        """``ray.get(ref)``, in slices, checking the head between them; at most ``timeout_s`` in all. Between
        slices, ``given_up()`` true raises :class:`~zephon.engine.hosts.HostInterrupted`."""
        ray = require_ray()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return ray.get(ref, timeout=WAIT_SLICE_S)
            except ray.exceptions.GetTimeoutError:
                if given_up is not None and given_up():
                    raise HostInterrupted(f"{what} was given up") from None
                self.check()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} did not finish within {timeout_s:.0f} s on the Ray cluster at "
                                       f"{self.head} (is the cluster overloaded, or short of the CPUs this run "
                                       f"reserved? `ray status` shows them). Raise ray_options task_timeout_s "
                                       f"if tasks really take this long.") from None


_LINK: ClusterLink | None = None
_LINK_LOCK = threading.Lock()
# How long Ray's own client in this process retries a head that went away before it ends the process. Ray's
# default (60 s) would kill a trainer that is between two batches when the head dies; Zephon declares the
# cluster lost after lost_after_s, closes the connection and raises instead. Set only when Zephon starts
# the connection, and only if you have not set it.
_RAY_RECONNECT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"


def connect(opts: RayOptions) -> ClusterLink:
    """This process's link to the cluster at ``opts.address`` (else ``RAY_ADDRESS``, else a new local
    cluster); one per process, shared by every executor and lane host. A connection you opened yourself
    with ``ray.init(...)`` (e.g. with a ``runtime_env``) is used as it is."""
    global _LINK
    ray = require_ray()
    with _LINK_LOCK:
        if _LINK is not None and ray.is_initialized():
            if opts.address and _LINK.requested and opts.address != _LINK.requested:
                raise ValueError(f"this process is connected to the Ray cluster at {_LINK.requested}; a loader "
                                 f"asks for {opts.address}. One process talks to one Ray cluster.")
            return _LINK
        address = opts.address or os.environ.get("RAY_ADDRESS") or None
        # what this connection was asked for ("local": a cluster of its own), to refuse a second, other one;
        # unknown (None) for a connection the program opened itself
        link = ClusterLink(None if ray.is_initialized() else (address or "local"), opts.lost_after_s)
        if not ray.is_initialized():
            hp = _host_port(address) if address else None
            if hp is not None:  # ray.init waits for ever on an address where no head answers
                deadline = time.monotonic() + opts.connect_timeout_s
                while not _reachable(hp):
                    if time.monotonic() > deadline:
                        raise ConnectionError(
                            f"no Ray cluster answers at {address} (waited {opts.connect_timeout_s:.0f} s). Start "
                            f"its head with `ray start --head --port={hp[1]}` on that machine, or pass the "
                            f"address that `ray start` printed.")
                    time.sleep(0.5)
            os.environ.setdefault(_RAY_RECONNECT_ENV, str(int(max(600.0, 10 * opts.lost_after_s))))
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            extra = {} if address else {"include_dashboard": False}  # a local cluster just for this process
            ray.init(address=address, **extra)
        link.attach(ray)
        _LINK = link
        return link


def disconnect() -> None:
    """Close this process's connection to its Ray cluster (the loaders on it must be closed first)."""
    global _LINK
    ray = require_ray()
    with _LINK_LOCK:
        _LINK = None
        if ray.is_initialized():
            ray.shutdown()


# -- placement -----------------------------------------------------------------------------------------
def reserve(link: ClusterLink, bundles: int, num_cpus: float, strategy: str, timeout_s: float, what: str) -> Any:
    """A placement group of ``bundles`` x ``num_cpus`` CPUs, or a clear error if the cluster cannot give it."""
    ray = require_ray()
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"CPU": num_cpus}] * bundles, strategy=strategy)
    deadline = time.monotonic() + timeout_s
    while not pg.wait(timeout_seconds=min(WAIT_SLICE_S * 5, timeout_s)):
        link.check()
        if time.monotonic() > deadline:
            remove_placement_group(pg)
            total = ray.cluster_resources().get("CPU", 0)
            free = ray.available_resources().get("CPU", 0)
            raise RuntimeError(f"{what} needs {bundles} x {num_cpus:g} CPU on the Ray cluster at {link.head}, and the "
                               f"cluster could not give them within {timeout_s:.0f} s: it has {total:g} CPUs, "
                               f"{free:g} free. Use fewer workers (or a smaller ray_options num_cpus), add nodes, or "
                               f"close the other loaders that hold the cluster's CPUs.")
    return pg


def stop_actors(link: ClusterLink, actors: list, calls: list, pg: Any) -> None:
    """Kill ``actors`` and give their reservation ``pg`` back, without Ray reporting ``calls`` (the refs of
    their calls still in flight; the list is emptied) as failures on this driver's console.

    A call that the kill fails while it still has retries left (a stage worker's ``max_task_retries``) is
    retried, and Ray pushes "Task StageWorker.run failed. There are 3 retries remaining, so the task will be
    retried. Error: The actor is dead because it was killed by `ray.kill`" to the driver, which prints it
    (TaskManager::RetryTaskIfPossible; worker.py's listen_error_messages prints it as ``(raylet)``). A
    cancelled call is never retried: ray.cancel sets its retries to 0 in this process before it returns
    (ActorTaskSubmitter::CancelTask -> TaskManager::MarkTaskCanceled); a call not yet started is dropped, a
    running one is left to the kill. The refs go before the kill, so that no result that comes in after it
    is kept: a cancelled call's or a dead actor's error (TASK_CANCELLED, ACTOR_DIED) is never reported
    as unhandled anyway. Nothing here waits on the cluster beyond what ``ray.kill`` does."""
    ray = require_ray()
    if not link.lost:
        for ref in calls:
            try:
                ray.cancel(ref, recursive=False)  # the calls start no tasks of their own
            except Exception:  # noqa: BLE001 - finished already, or the cluster is gone
                pass
    calls.clear()
    if link.lost:  # nothing to kill or give back: the cluster is gone
        return
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - dead already, or the cluster is gone
            pass
    if pg is not None:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - closing: the cluster may already be gone
            pass


# -- the workers: actors that hold the program ---------------------------------------------------------
class StageWorker:
    """A Ray actor that holds a :class:`StageProgram` (sent once, when the actor starts: readers and
    tokenizers are set up once) and runs its tasks, one at a time, in the order they arrive."""

    def __init__(self, program: StageProgram) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.program = program
        program.setup()

    def run(self, source: int, stage: int, item: Any) -> Any:
        return self.program.run(source, stage, item)

    def pid(self) -> int:
        return os.getpid()


@functools.lru_cache(maxsize=None)
def remote_class(cls: type) -> Any:
    """``ray.remote(cls)``, made once per class (Ray exports the class to the cluster on first use)."""
    return require_ray().remote(cls)


def payload_bytes(obj: Any) -> int:
    """About how many bytes ``obj`` (a chunk, a column, a task) takes in the object store."""
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, (bytes, bytearray, str)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        if obj and isinstance(obj[0], (int, float, type(None))):
            return 8 * len(obj)
        return sum(payload_bytes(v) for v in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(payload_bytes(getattr(obj, f)) for f in obj.__dataclass_fields__)
    return 8


# -- the executor, in the rank -------------------------------------------------------------------------
class _RayHandle:
    """One task: held back (``ref`` None) or sent to worker ``worker``; ``result()`` is the chunk."""

    __slots__ = ("executor", "args", "key", "in_bytes", "cost", "ref", "worker", "value", "done")

    def __init__(self, executor: "RayExecutor", args: tuple, in_bytes: int) -> None:
        self.executor, self.args, self.key, self.in_bytes = executor, args, (args[0], args[1]), in_bytes
        self.cost, self.ref, self.worker, self.value, self.done = 0, None, -1, None, False

    def result(self) -> Any:
        if not self.done:
            self.value = self.executor._result(self)
            self.done = True
        return self.value


class RayExecutor:
    """Tasks on ``num_workers`` Ray actors that hold the program (see the module docstring)."""

    kind = "ray"

    def __init__(self, program: StageProgram, num_workers: int, address: str | None = None, **options: Any) -> None:
        if num_workers < 1:
            raise ValueError(f"a Ray executor needs num_workers >= 1, got {num_workers}")
        self.opts = RayOptions.make(address, **options)
        check_picklable(program)
        self.program, self.num_workers = program, num_workers
        self.link = connect(self.opts)
        ray = require_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._pg = reserve(self.link, num_workers, self.opts.num_cpus, "PACK", self.opts.placement_timeout_s,
                           f"a Ray executor of {num_workers} workers")
        self._program_ref = ray.put(program)  # sent once; every worker (and a restarted one) reads it there
        # A worker whose process dies is restarted by Ray (in its bundle, with the program) and the calls it
        # had are run again: a task is pure. Restarts are unbounded (a long run may lose workers to the
        # odd OOM kill), retries of one call are not: a chunk that kills its worker every time is an error.
        self._workers = [remote_class(StageWorker).options(
            num_cpus=self.opts.num_cpus, max_restarts=-1, max_task_retries=self.opts.max_retries,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=k),
        ).remote(self._program_ref) for k in range(num_workers)]
        self._load = [0] * num_workers  # tasks sent to each worker and not yet taken
        self._lock = threading.Lock()
        self._held: deque[_RayHandle] = deque()
        self._flying: set[_RayHandle] = set()
        self._bytes = 0  # estimated bytes of the tasks sent and not yet taken
        self._estimate: dict[tuple[int, int], int] = {}  # (source, stage) -> result bytes, a decaying max
        self.peak_bytes = 0  # the most bytes in flight at once (for tests and tuning)
        self.peak_tasks = 0  # the most tasks sent and not yet taken at once

    def worker_pids(self) -> list[int]:
        """The process id of each worker actor (on its node), for monitoring and the fault tests."""
        return [self.link.wait(w.pid.remote(), f"Ray stage worker {k}", self.opts.task_timeout_s)
                for k, w in enumerate(self._workers)]

    # -- submission ----------------------------------------------------------------------------------
    def submit(self, source: int, stage: int, item: Any) -> _RayHandle:
        if self._workers is None:
            raise RuntimeError("the Ray executor is closed")
        handle = _RayHandle(self, (source, stage, item), payload_bytes(item) if stage else 0)
        with self._lock:
            self._held.append(handle)
            self._pump()
        return handle

    def _pump(self) -> None:
        """Send held tasks, oldest first, while the budget allows (always one when nothing is in flight)."""
        while self._held:
            head = self._held[0]
            cost = head.in_bytes + self._estimate.get(head.key, self.opts.first_guess_bytes)
            if self._flying and self._bytes + cost > self.opts.max_bytes_in_flight:
                return
            self._held.popleft()
            self._send(head, cost)

    def _send(self, handle: _RayHandle, cost: int) -> None:
        """To the worker with the fewest tasks not yet taken (its queue; a worker runs them in order)."""
        k = min(range(len(self._load)), key=self._load.__getitem__)
        handle.cost, handle.worker = cost, k
        handle.ref = self._workers[k].run.remote(*handle.args)
        handle.args = None  # the input now lives in the object store (or in the call's inline arguments)
        self._load[k] += 1
        self._bytes += cost
        self._flying.add(handle)
        self.peak_bytes = max(self.peak_bytes, self._bytes)
        self.peak_tasks = max(self.peak_tasks, len(self._flying))

    def _result(self, handle: _RayHandle) -> Any:
        if self._workers is None:
            raise RuntimeError("the Ray executor is closed")
        with self._lock:
            if handle.ref is None:  # the lane needs it now: send it whatever the budget says
                self._held.remove(handle)
                self._send(handle, handle.in_bytes + self._estimate.get(handle.key, self.opts.first_guess_bytes))
        ray = require_ray()
        try:
            name = self.program.names[handle.key[0]]
            value = self.link.wait(handle.ref, f"a Ray task (source '{name}', stage {handle.key[1]})",
                                   self.opts.task_timeout_s)
        except ray.exceptions.TaskCancelledError:  # only close() cancels: it ran on another thread meanwhile
            raise RuntimeError("the Ray executor was closed while a task of it was awaited") from None
        except (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError) as exc:
            if isinstance(exc, ray.exceptions.RayActorError) and exc.actor_init_failed:
                raise  # the program could not be set up on the cluster: its own error says why
            self.link.check_after_failure()  # a lost head takes its workers with it: say so
            raise RuntimeError(f"a Ray worker died running the same Zephon task {self.opts.max_retries + 1} times "
                               f"(each death is retried; out of memory? a crash in a codec? see `ray logs` on the "
                               f"cluster at {self.link.head}): {exc}") from exc
        size = payload_bytes(value)
        with self._lock:
            self._flying.discard(handle)
            self._load[handle.worker] -= 1
            self._bytes -= handle.cost
            old = self._estimate.get(handle.key, 0)
            self._estimate[handle.key] = max(size, (old * 7) // 8)  # conservative, forgets an old outlier
            self._pump()
        return value

    def close(self) -> None:
        """Stop the workers and give the reserved CPUs back (nothing to do on a lost cluster)."""
        if self._workers is None:
            return
        with self._lock:
            flying, self._flying = list(self._flying), set()
            self._held.clear()
            workers, self._workers = self._workers, None
        calls = [handle.ref for handle in flying if handle.ref is not None]
        for handle in flying:  # a closed loader's buffers still hold handles: drop their references, or
            handle.ref = None  # Ray would try to rebuild the results it still sees referenced
        stop_actors(self.link, workers, calls, self._pg)  # cancelled first: the kill then fails them quietly
        self._pg, self._program_ref = None, None

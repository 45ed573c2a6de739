"""A rank's lanes computed a few steps ahead of the trainer, on one background thread of its process.

With worker threads or processes the stateless work (read, decode, tokenize) already runs beside the
trainer, but the lanes' serial work does not: the merge, the accumulators (shuffle, pack) and the waits
for workers' results happen when the trainer asks for a step. A packing lane takes its documents in
bursts (after a sentinel it refills every open row before it hands one out), so a trainer whose model
is the slower side would still stall at those steps, for as long as the workers take to decode the
burst. :class:`StepsAhead` runs a host (:class:`~zephon.engine.hosts.LocalLanes`, or the lane workers of
:class:`~zephon.engine.hosts.ProcessLanes`, whose rows must still be read back and collated) on a thread
that keeps up to ``ahead`` steps of rows ready, so that a burst is absorbed while the model computes.

What the trainer sees does not change: the rows are the same lanes' rows in the same order (the thread
only computes them earlier), a checkpoint holds the states of the steps *delivered* (each queued step
carries the host's :meth:`mark` after it), and a mixture intervention stops the thread, drops the steps
computed ahead and rewinds the host to the delivered mark before it applies. Given ``collate``, the
thread also collates each step's batch (tens of megabytes of pixels for a vision-language batch), so
that the trainer's ``next()`` is a queue read.
"""

from __future__ import annotations

import copy
import queue
import threading
import weakref
from typing import Any, Callable

from ..ops.batch import RecordBlock, flat_rows
from ..records import Row
from ..state.lane import LaneState
from .counters import LaneCounters
from .frame_stack import call_on_own_chunk
from .hosts import LocalLanes, ProcessLanes


class StepsAhead:
    """A host (:class:`LocalLanes` or :class:`ProcessLanes`) stepped by a background thread, up to ``ahead``
    steps before the trainer."""

    def __init__(self, lanes: LocalLanes | ProcessLanes, ahead: int, collate: Callable[[list], Any] | None = None) -> None:
        if ahead < 1:
            raise ValueError(f"StepsAhead needs ahead >= 1, got {ahead}")
        self.inner, self.ahead, self.collate = lanes, ahead, collate
        self._batch: tuple[list, Any] | None = None  # the delivered step's rows and their batch
        self.events = lanes.events
        self._lock = threading.Lock()  # held while the thread computes a step: the lanes are not shared
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=ahead)
        self._delivered: tuple = lanes.mark()  # the host's mark (lanes' states, ...) after the last step delivered
        self._counters: dict[int, LaneCounters] = {}  # the lanes' counters after the last step computed
        self._failed: BaseException | None = None

    # -- the thread -----------------------------------------------------------------------------
    def _step(self, stop: threading.Event) -> tuple | None:
        """The next step's rows, the lanes' states after it and (given ``collate``) its batch."""
        with self._lock:
            if stop.is_set():
                return None
            rows = self.inner.next_step()
            mark = self.inner.mark()
            # metrics read this copy: they never wait for a step in progress (a burst can take seconds)
            self._counters = {lane: copy.deepcopy(c) for lane, c in self.inner.counters().items()}
        flat = flat_rows(rows)
        return ("step", rows, mark, (flat, self.collate(flat)) if self.collate else None)

    def _start(self) -> None:
        self._stop = stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.ahead)
        # the thread holds this host only while it computes a step, so a loader dropped without close()
        # is collected, and this stops its thread
        weakref.finalize(self, stop.set)
        self._thread = threading.Thread(target=_run_ahead, args=(weakref.ref(self), stop, self._queue),
                                        name="zephon-steps-ahead", daemon=True)
        self._thread.start()

    def _halt(self) -> None:
        """Stop the thread and drop the steps it computed ahead (the lanes are then past delivery)."""
        if self._thread is None:
            return
        self._stop.set()
        interrupt = getattr(self.inner, "interrupt", None)
        if interrupt is not None:  # lane workers: a step awaited from them is given up (a worker may hang)
            interrupt()
        try:
            while self._thread.is_alive():
                try:  # a thread waiting to put a step gets room
                    self._queue.get_nowait()
                except queue.Empty:
                    pass
                self._thread.join(timeout=0.05)
            while True:  # what it computed ahead is not for anyone now
                self._queue.get_nowait()
        except queue.Empty:
            pass
        finally:  # interrupted (Ctrl-C): the thread is stopping all the same, and the next step starts another
            self._thread = None

    # -- the host interface ---------------------------------------------------------------------
    def reset(self, states: dict[int, LaneState]) -> None:
        self._halt()
        self._failed = None
        self.inner.reset(states)
        self._delivered = self.inner.mark()

    def next_step(self) -> list[list[Row]]:
        if self._failed is not None:
            raise RuntimeError(f"the loader's lanes stopped at an error ({type(self._failed).__name__}: "
                               f"{self._failed}); rebuild the loader, or load a checkpoint state into it") \
                from self._failed
        if self._thread is None:
            self._start()
        while True:
            try:
                kind, rows, mark, batch = self._queue.get(timeout=0.5)
                break
            except queue.Empty:
                thread = self._thread
                if thread is None or not thread.is_alive():  # stopped by close() from elsewhere
                    raise RuntimeError("the loader's steps-ahead thread has stopped (the loader was closed "
                                       "or reset while this step was awaited); rebuild the loader, or load "
                                       "a checkpoint state into it") from None
        if kind == "error":
            self._failed = rows
            self._thread = None
            raise rows
        self._delivered, self._batch = mark, batch
        return rows

    def take_batch(self, rows: list) -> Any:
        """The batch the thread collated for the step just delivered, if ``rows`` are that step's rows
        (``None`` otherwise: the caller collates)."""
        made, self._batch = self._batch, None
        if made is not None and type(rows) is RecordBlock and type(made[0]) is RecordBlock:  # compared by parts
            same = len(made[0].parts) == len(rows.parts) and all(a is b for a, b in zip(made[0].parts, rows.parts))
            return made[1] if same else None
        if made is None or len(made[0]) != len(rows) or any(a is not b for a, b in zip(made[0], rows)):
            return None
        return made[1]

    def states(self) -> dict[int, dict]:
        """The lanes' states after the last step delivered to the trainer (not the ones computed ahead): a
        copy, since interventions rewind the lanes from them."""
        return copy.deepcopy(self._delivered[0])

    def counters(self) -> dict[int, LaneCounters]:
        """What the lanes did, including the steps computed ahead (metrics run a little ahead of delivery)."""
        if self._thread is None:  # nothing runs: the lanes themselves
            return {lane: copy.deepcopy(c) for lane, c in self.inner.counters().items()}
        return dict(self._counters)

    def apply_event(self, at_step: int) -> int:
        """An intervention (already the last of ``events``): the thread stops, drops the steps it computed
        ahead, and the host goes back to the delivered steps (:meth:`LocalLanes.rewind`,
        :meth:`ProcessLanes.rewind`), where the lanes' next decisions see it. Returns the lanes rewound."""
        return self.inner.apply_event_from(self._delivered, at_step, self._halt)

    def close(self) -> None:
        self._halt()
        self.inner.close()


def _run_ahead(ref: "weakref.ref[StepsAhead]", stop: threading.Event, out: queue.Queue) -> None:
    """The thread: steps into ``out`` until ``stop`` is set or its host is gone; an error is handed over."""
    def put(item: tuple) -> None:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return
            except queue.Full:
                if ref() is None:
                    return

    try:
        while not stop.is_set():
            host = ref()
            if host is None:
                return
            item = call_on_own_chunk(host._step, stop)
            del host
            if item is None:
                return
            put(item)
    except BaseException as exc:  # the trainer raises it at the step it belongs to
        put(("error", exc, None, None))


__all__ = ["StepsAhead"]

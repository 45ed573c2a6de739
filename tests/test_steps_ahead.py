"""Lanes computed ahead of the trainer on a background thread (``steps_ahead``; the default for pipelines
that pack images, with workers): the same batches, pixels included, checkpoints of the delivered steps
only, interventions, errors and shutdown, over lanes in this process and over lane processes (whose rows
the thread reads back and collates). The text pipeline here asks for it explicitly."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import zephon as z
import zephon.loader
from zephon import global_digest
from zephon.engine.hosts import ProcessLanes
from zephon.engine.sources import ReadAhead
from zephon.engine.steps_ahead import StepsAhead

from .test_curricula import CODE_HEAVY, pipeline, run_with_intervention
from .test_vision_batches import data, vl_tok  # noqa: F401 - fixtures
from .test_vision_batches import pipeline as vl_pipeline

STEPS = 16


@pytest.fixture(scope="module")
def tok(sp_model):
    return z.tokenizer(str(sp_model))


@pytest.fixture(scope="module")
def pipe(corpus, tok):
    return pipeline(corpus, tok, shuffle=6, flush_every=8)


def run(pipe, steps: int, world: int = 1, **build) -> tuple[list[str], list[dict]]:
    """Global hashes of ``steps`` steps, and the ranks' states after each step."""
    loaders = [pipe.build(rank=r, world_size=world, **build) for r in range(world)]
    hashes, states = [], []
    for _ in range(steps):
        hashes.append(global_digest([next(ld) for ld in loaders]))
        states.append([ld.state_dict() for ld in loaders])
    for ld in loaders:
        ld.close()
    return hashes, states


def read_ahead(lanes) -> ReadAhead:
    return ReadAhead.of(lanes._lanes[0].depth)  # what each of the lanes' stage buffers is given


def ahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "zephon-steps-ahead"]


def test_on_by_default_for_pipelines_that_pack_images_with_workers(pipe, data, vl_tok):  # noqa: F811 - fixtures
    images = vl_pipeline(data, vl_tok, lanes=4)
    for runner in ("thread", "pool"):
        with images.build(num_workers=2, runner=runner) as loader:
            assert isinstance(loader._host, StepsAhead) and loader._host.ahead == 2
            assert read_ahead(loader._host.inner).adapts  # and the read-ahead follows the lanes' bursts
    with images.build(num_workers=2, runner="process") as loader:  # the lane processes' rows: read back ahead
        assert isinstance(loader._host, StepsAhead) and isinstance(loader._host.inner, ProcessLanes)
    with images.build(num_workers=0) as loader:  # inline: nothing runs ahead
        assert not isinstance(loader._host, StepsAhead)
    with pipe.build(num_workers=2, runner="thread") as loader:  # text: off unless asked for
        assert not isinstance(loader._host, StepsAhead)
        assert not read_ahead(loader._host).adapts and read_ahead(loader._host).depth == 2
    with pipe.build(num_workers=2, runner="thread", steps_ahead=3) as loader:
        assert isinstance(loader._host, StepsAhead) and loader._host.ahead == 3
    with images.build(num_workers=2, runner="thread", steps_ahead=0) as loader:
        assert not isinstance(loader._host, StepsAhead)
    with pytest.raises(ValueError, match="steps_ahead must be >= 0"):
        pipe.build(num_workers=2, steps_ahead=-1)


@pytest.mark.parametrize("lanes,steps,split,world,runner,resume_world,resume_runner", [
    (8, 8, 4, 2, "thread", 4, "pool"),
    (4, 6, 3, 2, "process", 1, "process"),  # the lane processes' rows read back ahead
])
def test_image_batches_are_the_same_and_resume_on_another_world_size(data, vl_tok, lanes, steps, split,  # noqa: F811
                                                                     world, runner, resume_world, resume_runner):
    """Pixels, grids and mrope positions included: the digest covers every tensor of the batch."""
    images = vl_pipeline(data, vl_tok, lanes=lanes)
    reference, _ = run(images, steps, num_workers=0)
    loaders = [images.build(rank=r, world_size=world, num_workers=2, runner=runner) for r in range(world)]
    for step in range(split):
        assert global_digest([next(ld) for ld in loaders]) == reference[step]
    state = z.merge_states([ld.state_dict() for ld in loaders])
    for ld in loaders:
        ld.close()
    resumed = [images.build(rank=r, world_size=resume_world, num_workers=2, runner=resume_runner)
               for r in range(resume_world)]
    for ld in resumed:
        assert isinstance(ld._host, StepsAhead)
        ld.load_state_dict(state)
    for step in range(split, steps):
        assert global_digest([next(ld) for ld in resumed]) == reference[step]
    for ld in resumed:
        ld.close()


@pytest.mark.parametrize("runner,ahead", [("thread", 1), ("thread", 3), ("pool", 2), ("process", 2)])
def test_same_batches_and_states_of_the_delivered_steps(pipe, runner, ahead):
    """Every state taken between steps is the one the synchronous loader has at that step, although the
    lanes have computed further: a checkpoint never counts steps that were computed but not delivered."""
    reference = run(pipe, STEPS, world=2, num_workers=0)
    assert run(pipe, STEPS, world=2, num_workers=2, runner=runner, steps_ahead=ahead) == reference


def test_the_thread_computes_ahead_and_a_resume_elsewhere_continues_exactly(pipe):
    hashes, _ = run(pipe, STEPS, num_workers=0)
    loader = pipe.build(rank=0, world_size=2, num_workers=2, runner="thread", steps_ahead=3)
    other = pipe.build(rank=1, world_size=2, num_workers=2, runner="thread", steps_ahead=3)
    for step in range(6):
        assert global_digest([next(loader), next(other)]) == hashes[step]
    deadline = time.monotonic() + 60
    while loader._host._queue.qsize() < 3 and time.monotonic() < deadline:  # it fills its queue meanwhile
        time.sleep(0.01)
    assert loader._host._queue.qsize() == 3
    state = z.merge_states([loader.state_dict(), other.state_dict()])
    assert state["step"] == 6
    loader.close()
    other.close()
    resumed = [pipe.build(rank=r, world_size=4, num_workers=2, runner="thread") for r in range(4)]
    for ld in resumed:
        ld.load_state_dict(state)
    for step in range(6, STEPS):
        assert global_digest([next(ld) for ld in resumed]) == hashes[step]
    for ld in resumed:
        ld.close()


@pytest.mark.parametrize("call_at,runner", [(5, "thread"), (7, "thread"), (7, "process"), (10, "thread")])
def test_an_intervention_with_steps_computed_ahead(pipe, call_at, runner, monkeypatch):
    """The steps computed ahead have decided documents for step 10 and later: the lanes are rewound to the
    delivered steps and replayed, and nothing delivered changes, up to a call for the very next step."""
    reference, _ = run_with_intervention(pipe, 1, 0, 10, CODE_HEAVY)
    built = []
    monkeypatch.setattr(zephon.loader, "default_steps_ahead", lambda *a: built.append(a[1]) or (2 if a[1] else 0))
    hashes, rebuilt = run_with_intervention(pipe, 2, call_at, 10, CODE_HEAVY, runner=runner, workers=2)
    assert hashes == reference and sum(rebuilt) > 0
    assert built and all(n == 2 for n in built)  # every loader of the run had its lanes computed ahead


@pytest.mark.parametrize("runner", ["thread", "process"])
def test_a_refused_intervention_leaves_the_stream_as_it_was(pipe, runner):
    """An intervention for a delivered step is refused before anything is touched: the thread keeps the steps
    it computed ahead (and the lane processes run on), and the stream goes on unchanged."""
    plain, _ = run(pipe, STEPS, num_workers=0)
    loader = pipe.build(num_workers=2, runner=runner, steps_ahead=3)
    got = [global_digest([next(loader)]) for _ in range(6)]
    wait_for_queued(loader, 3)  # the thread has run ahead
    with pytest.raises(ValueError, match="already delivered"):
        loader.set_mixture(CODE_HEAVY, at_step=5)
    assert loader.events == []
    assert loader._host._queue.qsize() == 3
    if runner == "process":
        assert loader._host.inner._procs
    got += [global_digest([next(loader)]) for _ in range(6, STEPS)]
    loader.close()
    assert got == plain


def wait_for_queued(loader, n: int) -> None:
    deadline = time.monotonic() + 60
    while loader._host._queue.qsize() < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loader._host._queue.qsize() == n


def test_an_intervention_over_lane_processes_with_steps_queued(pipe):
    """Applied while the thread holds steps computed with the old mixture: they are dropped, the lane
    workers restart from the delivered states with the intervention in force."""
    reference, _ = run_with_intervention(pipe, 1, 0, 10, CODE_HEAVY, steps=STEPS)
    with pipe.build(num_workers=2, runner="process", steps_ahead=3) as loader:
        got = [global_digest([next(loader)]) for _ in range(7)]
        wait_for_queued(loader, 3)
        assert loader.set_mixture(CODE_HEAVY, at_step=10) == len(loader.lanes)
        got += [global_digest([next(loader)]) for _ in range(7, STEPS)]
    assert got == reference


def test_closing_does_not_wait_for_a_lane_worker_that_hangs(pipe):
    """A step awaited from lane workers is given up when the loader closes (a hung worker would otherwise
    hold close() for ever)."""
    loader = pipe.build(num_workers=2, runner="process", steps_ahead=2)
    next(loader)
    wait_for_queued(loader, 2)
    host = loader._host.inner
    for proc in host._procs:  # stopped: alive, but producing nothing more
        os.kill(proc.pid, signal.SIGSTOP)
    pids = [proc.pid for proc in host._procs]
    taken: list[int] = []

    def consume() -> None:  # takes the steps the workers queued before they stopped, then waits with the thread
        try:
            for _ in range(20):
                next(loader)
                taken.append(1)
        except RuntimeError:  # the halt below stops the thread this one waits on
            pass

    try:
        threading.Thread(target=consume, daemon=True).start()
        count, deadline = -1, time.monotonic() + 60
        while count != len(taken) and time.monotonic() < deadline:  # until it stops getting steps
            count = len(taken)
            time.sleep(1.0)
        assert len(taken) < 20  # it waits: the thread is stuck on the stopped workers
        halting = threading.Thread(target=loader._host._halt, daemon=True)  # (a hang must not hang the suite)
        halting.start()
        halting.join(timeout=10)
        hung = halting.is_alive()
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:  # the halt gave up on it and killed it
                pass
    loader.close()
    assert not hung


def fails_at_record_40(record: dict) -> dict:
    fails_at_record_40.seen += 1
    if fails_at_record_40.seen == 40:
        raise KeyError("no field 'x' here")
    return record


def test_an_error_reaches_the_trainer_and_the_loader_stays_stopped(corpus, tok):
    fails_at_record_40.seen = 0
    pipe = (z.Pipeline(seed=3, lanes=2).source("web", z.read.parquet(str(corpus / "web"), chunk_rows=4))
            .map(fails_at_record_40).tokenize(tok).pack(seq_len=64).batch(rows_per_lane=1))
    loader = pipe.build(num_workers=2, runner="thread", steps_ahead=2)
    with pytest.raises(Exception, match="no field 'x' here") as raised:
        for _ in range(200):
            next(loader)
    assert "fails_at_record_40" in str(raised.value)  # the map's own error, naming the operator
    with pytest.raises(RuntimeError, match="stopped at an error.*rebuild the loader"):
        next(loader)
    loader.close()
    assert not ahead_threads()


def test_close_stops_the_thread_even_with_a_full_queue(pipe):
    before = len(ahead_threads())
    loader = pipe.build(num_workers=2, runner="thread", steps_ahead=2)
    next(loader)
    deadline = time.monotonic() + 60
    while loader._host._queue.qsize() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(ahead_threads()) == before + 1
    loader.close()
    assert len(ahead_threads()) == before


def test_batches_are_collated_on_the_thread(pipe):
    reference, _ = run(pipe, 6, num_workers=0)
    loader = pipe.build(num_workers=2, runner="thread", steps_ahead=2)
    made_on, made, collate = [], [], loader._host.collate

    def recorded(rows):
        made_on.append(threading.current_thread().name)
        made.append(collate(rows))
        return made[-1]

    loader._host.collate = recorded
    batches = [next(loader) for _ in range(6)]
    loader.close()
    assert [global_digest([b]) for b in batches] == reference
    assert len(made_on) >= 6 and set(made_on) == {"zephon-steps-ahead"}
    assert all(b is m for b, m in zip(batches, made))  # delivered as the thread made them, not collated again


def test_metrics_with_steps_ahead(pipe):
    """Counters come from the thread's copy after each step: every counter a synchronous loader fills
    is filled (the realised mixture's window included), and reading them does not wait for the thread."""
    with pipe.build(num_workers=2, runner="thread", steps_ahead=2) as loader:
        for _ in range(8):
            next(loader)
        ahead = loader.metrics()
    with pipe.build(num_workers=2, runner="thread", steps_ahead=0) as loader:
        for _ in range(8):
            next(loader)
        sync = loader.metrics()
    assert sync["mixture_recent_share"] and set(ahead["mixture_recent_share"]) == set(sync["mixture_recent_share"])
    assert ahead["docs"] >= sync["docs"] > 0 and set(ahead["lanes"]) == set(sync["lanes"])  # ahead: a little more
    assert ahead["step"] == sync["step"] == 8 and ahead["rows_delivered"] == sync["rows_delivered"]


def test_a_step_awaited_after_close_raises_instead_of_waiting_for_ever(pipe):
    loader = pipe.build(num_workers=2, runner="thread", steps_ahead=2)
    next(loader)
    host = loader._host
    stopped = host._thread
    loader.close()
    host._thread = stopped  # as if close() ran on another thread while this one awaited the next step
    with pytest.raises(RuntimeError, match="steps-ahead thread has stopped"):
        host.next_step()


def test_a_loader_dropped_without_close_stops_its_thread(pipe):
    import gc

    before = len(ahead_threads())
    loader = pipe.build(num_workers=2, runner="thread", steps_ahead=2)
    next(loader)
    assert len(ahead_threads()) == before + 1
    del loader
    deadline = time.monotonic() + 30
    while len(ahead_threads()) > before and time.monotonic() < deadline:
        gc.collect()  # the loader and its lanes refer to each other; a step in progress holds them a moment
        time.sleep(0.05)
    assert len(ahead_threads()) == before


def test_metrics_and_state_before_the_first_step(pipe):
    with pipe.build(num_workers=2, runner="thread", steps_ahead=2) as loader:
        assert isinstance(loader._host, StepsAhead)
        assert loader.metrics()["step"] == 0 and loader.state_dict()["step"] == 0
        assert set(loader.metrics()["lanes"]) == set(loader.lanes)


def test_an_executor_shared_by_loaders_keeps_them_on_the_callers_thread(pipe):
    from zephon.engine.runners import make_executor

    program = pipe.compile()
    executor = make_executor("thread", program.stages, 2)
    try:
        loaders = [pipe.build(rank=r, world_size=2, runner=executor, program=program) for r in range(2)]
        assert not any(isinstance(ld._host, StepsAhead) for ld in loaders)
        for ld in loaders:
            ld.close()
    finally:
        executor.close()


@pytest.mark.parametrize("partial", ["pad", "drop"])
def test_finite_sources_end_at_the_same_step_with_the_same_state(corpus, tok, partial):
    """The thread computes past the end of finite sources; the trainer still sees the end where a synchronous
    loader does, and the ended state is the one of the last delivered step."""
    from .test_end_of_data import finite

    pipe = finite(corpus, tok, partial=partial)

    def all_of(loader):
        with loader:
            hashes = [global_digest([b]) for b in loader]
            return hashes, loader.state_dict()

    sync = all_of(pipe.build(num_workers=0))
    assert len(sync[0]) > 3 and sync[1]["ended"]
    assert all_of(pipe.build(num_workers=2, runner="thread", steps_ahead=2)) == sync


def test_max_steps_with_steps_ahead(pipe):
    with pipe.build(num_workers=0, max_steps=5) as loader:
        sync = [global_digest([b]) for b in loader], loader.state_dict()
    with pipe.build(num_workers=2, runner="thread", steps_ahead=3, max_steps=5) as loader:
        assert ([global_digest([b]) for b in loader], loader.state_dict()) == sync
    assert len(sync[0]) == 5 and sync[1]["step"] == 5


def test_lane_workers_exit_by_themselves_when_the_loader_closes(corpus, tok):
    """Each lane worker ends on the stop signal, with exit code 0, and close() does not wait for it: close()
    keeps reading what the workers queue after the stop (a worker cannot exit while its queue holds a step
    that no one reads: 16 lanes of 2048 tokens per step here), so none is left to the SIGTERM that ends a
    hung one, 5 s later."""
    wide = (z.Pipeline(seed=3, lanes=32).source("web", z.read.parquet(str(corpus / "web"), chunk_rows=4))
            .tokenize(tok).pack(seq_len=2048).batch(rows_per_lane=1))
    loader = wide.build(num_workers=2, runner="process")
    for _ in range(3):
        next(loader)
    host = loader._host
    procs = list(getattr(host, "inner", host)._procs)
    loader.close()
    assert len(procs) == 2 and [p.exitcode for p in procs] == [0, 0]

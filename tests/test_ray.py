"""The Ray runners against a real local cluster: same global batches as threads, faults, bounded waits.

A module fixture starts a real Ray head on 127.0.0.1 (``ray start --head --num-cpus 2``, its own ports
and temporary directory; not ``local_mode``) and stops it by its process group at the end (never with
``ray stop``, which would stop every Ray cluster of the machine). Its workers import this module's
functions (``PYTHONPATH``), as a user's cluster imports theirs. Every determinism check compares SHA-256
digests of global batches with the thread runner's; the fault tests kill real processes with SIGKILL.

Without Ray installed the module is skipped, except in CI (``CI`` set), where that is a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import zephon as z
from tests.optional import require
from zephon import WorkPlan, build_loader, global_digest, merge_states
from zephon.engine.ray_executor import RayClusterLost, RayExecutor, RayOptions, connect
from zephon.engine.ray_local import PORT_CLASH, LocalRayCluster, free_port, port_open, ray_command
from zephon.recipe import as_pipeline
from zephon.errors import OperatorError
from zephon.records import Chunk
from zephon.verify import global_hashes

ray = require("ray", "Ray is not installed (the `ray` extra); .ci/run installs it")  # zephon imports it lazily

REPO = Path(__file__).resolve().parents[1]
STEPS = 6
# every wait in the Ray code is bounded; this bounds a test that would still hang (generous: a shared 2-core VM)
pytestmark = [pytest.mark.timeout(420), pytest.mark.e2e]  # a real Ray cluster


@pytest.fixture(scope="module")
def cluster():
    """A 2-CPU Ray head for this module; ``RAY_ADDRESS`` points at it (the default of ``address=``)."""
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    head = LocalRayCluster(num_cpus=2, env=env).start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_ADDRESS", head.address)
        try:
            connect(RayOptions.make())  # as a loader would, before any test touches ray itself
            yield head
        finally:
            ray.shutdown()
            head.stop()


def test_the_head_runs_this_interpreters_ray(tmp_path, monkeypatch):
    """A ``ray`` of another Python first on PATH (a venv's python run without activating the venv) is not
    what LocalRayCluster starts: Ray refuses a driver whose Python differs from the head's. The head is this
    interpreter running Ray's command-line module, which answers as the ``ray`` command does."""
    other = tmp_path / "ray"
    other.write_text("#!/bin/sh\nexit 3\n")
    other.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    assert shutil.which("ray") == str(other)
    cmd = ray_command()
    assert cmd[0] == sys.executable
    out = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and ray.__version__ in out.stdout, out.stdout + out.stderr


def test_a_head_refused_for_a_port_clash_starts_again_on_other_ports(monkeypatch):
    """Ray refuses to start when a port it picks itself equals one it was given ("Ray component gcs_server is
    trying to use a port number N that is used by other components"; it happened in a CI run): the head
    starts again on other ports. The first attempt's refusal is Ray's message, raised in its place; the
    head that then answers is a real one."""
    real = LocalRayCluster._start_once
    attempts = []

    def refused_once(self, timeout_s):
        attempts.append(self.port)
        if len(attempts) == 1:
            raise RuntimeError(f"`ray start --head` exited with code 1:\nValueError: Ray component gcs_server "
                               f"{PORT_CLASH} {self.port} that is used by other components.")
        return real(self, timeout_s)

    monkeypatch.setattr(LocalRayCluster, "_start_once", refused_once)
    head = LocalRayCluster(num_cpus=1)
    try:
        head.start()
        assert len(attempts) == 2 and attempts[1] != attempts[0]
        assert head.port == attempts[1] and port_open("127.0.0.1", head.port)
    finally:
        head.stop()
    other = LocalRayCluster(num_cpus=1)  # any other refusal is not retried
    monkeypatch.setattr(LocalRayCluster, "_start_once", lambda self, t: (_ for _ in ()).throw(RuntimeError("no")))
    with pytest.raises(RuntimeError, match="no"):
        other.start()
    other.stop()  # its temporary directory


# -- module-level functions: the cluster's workers import them by name ---------------------------------
def with_length(record: dict) -> dict:
    return {**record, "chars": len(record["text"])}


def slow_identity(record: dict) -> dict:
    time.sleep(0.01)  # a task takes tens of ms: long enough to be caught running and killed
    return record


def fail_on_hash(record: dict) -> dict:
    if "#" in record["text"]:
        raise ValueError("a record with a hash sign")
    return record


# -- helpers -------------------------------------------------------------------------------------------
def text_pipeline(corpus: Path, sp_model: Path, lanes: int = 8, maps: tuple = (), executor: str | None = None
                  ) -> z.Pipeline:
    """Prose (Parquet) and code (JSON Lines), ``maps`` before tokenizing (on ``executor``), packed."""
    pipe = (z.Pipeline(seed=3, lanes=lanes)
            .source("web", z.read.parquet(str(corpus / "web"), chunk_rows=4), weight=0.6)
            .source("code", z.read.jsonl(str(corpus / "code" / "*.jsonl"), chunk_bytes=1024), weight=0.4))
    for fn in maps:
        pipe = pipe.map(fn, executor=executor)
    return pipe.tokenize(z.tokenizer(str(sp_model))).pack(seq_len=64).batch(rows_per_lane=2)


def lanes_hashes(recipe, world_size: int, steps: int, runner: str, num_workers: int, state: dict | None = None,
                 **build) -> tuple[list[str], dict]:
    """Global-batch hashes with every rank's own loader (and so its own executor or lane actors)."""
    loaders = [build_loader(recipe, rank=r, world_size=world_size, num_workers=num_workers, runner=runner, **build)
               for r in range(world_size)]
    try:
        if state is not None:
            for ld in loaders:
                ld.load_state_dict(state)
        hashes = [global_digest([next(ld) for ld in loaders]) for _ in range(steps)]
        return hashes, merge_states([ld.state_dict() for ld in loaders])
    finally:
        for ld in loaders:
            ld.close()


def running_stage_pids() -> list[int]:
    """Processes running a Zephon Ray task right now (Ray titles an actor's process ``ray::Class.method``
    while it runs a call, ``ray::Class`` otherwise)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if cmd.startswith(b"ray::StageWorker.run"):
                pids.append(int(proc.name))
    return pids


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# -- data in the object store --------------------------------------------------------------------------
def test_chunks_travel_out_of_band_as_numpy(cluster, make_recipe):
    """A chunk's arrays are pickled out of band: a large result is read in place from the object store
    (two reads share memory; read-only), and a real task's tokens come back as numpy arrays, not lists."""
    tokens = np.arange(2_000_000, dtype=np.int32)  # 8 MB: far above Ray's inline limit
    chunk = Chunk(0, 0, True, 0, 2, "p", {"id": ["a", "b"]}, np.array([1, 2]), np.zeros(2, np.int64),
                  token_fields={"input_ids": tokens}, offsets=np.array([0, 1_000_000, 2_000_000]))
    ref = ray.put(chunk)
    a, b = ray.get(ref), ray.get(ref)
    assert a.token_fields["input_ids"] is not b.token_fields["input_ids"]  # two deserialisations...
    assert np.shares_memory(a.token_fields["input_ids"], b.token_fields["input_ids"])  # ...of one buffer
    assert not a.token_fields["input_ids"].flags.writeable
    assert np.array_equal(a.token_fields["input_ids"], tokens)

    program = as_pipeline(make_recipe(lanes=4)).compile()
    task = next(program.plan.sources[0].chunk_tasks(0, 0, -1, 0))
    executor = RayExecutor(program.stages, 1)
    try:
        got = executor.submit(0, 0, task).result()
    finally:
        executor.close()
    want = program.stages.run(0, 0, task)
    assert got.n == want.n > 0
    for name, values in want.token_fields.items():
        assert isinstance(got.token_fields[name], np.ndarray) and np.array_equal(got.token_fields[name], values)
    assert not any(isinstance(v, list) and v and isinstance(v[0], int) for v in got.columns.values())


# -- same global batches -------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size,workers", [(1, 1), (2, 2), (4, 2)])
def test_ray_tasks_give_the_thread_runners_batches(cluster, make_recipe, world_size, workers):
    recipe = make_recipe(lanes=16, shuffle={"buffer": 4})
    plan = WorkPlan(recipe.to_pipeline())
    reference = global_hashes(recipe, 1, STEPS, num_workers=2, runner="thread", plan=plan)
    assert len(set(reference)) == STEPS
    assert global_hashes(recipe, world_size, STEPS, num_workers=workers, runner="ray", plan=plan) == reference


def test_each_rank_connects_with_its_own_executor(cluster, make_recipe):
    """Two ranks, each its own loader, executor and reservation, given the address explicitly."""
    recipe = make_recipe(lanes=16)
    reference = global_hashes(recipe, 1, STEPS, plan=WorkPlan(recipe.to_pipeline()))
    got, _ = lanes_hashes(recipe, 2, STEPS, "ray", 1, address=cluster.address)
    assert got == reference


def test_ray_lane_actors_give_the_thread_runners_batches(cluster, make_recipe):
    """One rank on two actors (through zephon.verify, as `zephon verify` runs it); see the next test for more."""
    recipe = make_recipe(lanes=16, shuffle={"buffer": 4})
    plan = WorkPlan(recipe.to_pipeline())
    reference = global_hashes(recipe, 1, STEPS, plan=plan)
    assert global_hashes(recipe, 1, STEPS, num_workers=2, runner="ray-lanes", plan=plan) == reference


@pytest.mark.slow
def test_ray_lane_actors_on_four_ranks(cluster, make_recipe):
    recipe = make_recipe(lanes=16, shuffle={"buffer": 4})
    reference = global_hashes(recipe, 1, STEPS, plan=WorkPlan(recipe.to_pipeline()))
    # 4 ranks x 1 actor share the 2-CPU cluster: each actor reserves half a CPU
    got, _ = lanes_hashes(recipe, 4, STEPS, "ray-lanes", 1, ray_options={"num_cpus": 0.5})
    assert got == reference


@pytest.mark.parametrize("middle", ["ray", "ray-lanes"])
def test_resume_from_threads_to_ray_and_back(cluster, make_recipe, middle):
    """thread (4 ranks) -> checkpoint -> Ray (2 ranks) -> checkpoint -> thread (1 rank): one stream."""
    recipe = make_recipe(lanes=16, flush_every=1)
    reference = global_hashes(recipe, 1, 10, plan=WorkPlan(recipe.to_pipeline()))
    first, state = lanes_hashes(recipe, 4, 3, "thread", 2)
    options = {"ray_options": {"num_cpus": 0.5}} if middle == "ray-lanes" else {}
    second, state = lanes_hashes(recipe, 2, 4, middle, 1, state, **options)
    assert any(s["rows_since_flush"] for s in state["lanes"].values())  # a resume mid-segment, not at a sentinel
    third, _ = lanes_hashes(recipe, 1, 3, "thread", 1, state)
    assert first + second + third == reference


@pytest.mark.slow
def test_a_mixture_intervention_under_the_ray_runners(cluster, corpus, sp_model):
    """set_mixture mid-run (after step 3, for step 6) rebuilds Ray lane actors from their delivered states
    with the intervention in force, exactly as the lanes of the other runners (also with the actors' rows
    read back steps ahead, on a thread that the intervention stops and rewinds)."""
    pipe = text_pipeline(corpus, sp_model)

    def run(runner: str, workers: int, weights: dict | None, steps_ahead: int = 0) -> list[str]:
        loader = pipe.build(num_workers=workers, runner=runner, steps_ahead=steps_ahead)
        try:
            out, counts = [], []
            for step in range(10):
                if step == 3 and weights:
                    loader.set_mixture(weights, at_step=6)
                out.append(global_digest([next(loader)]))
                counts.append((loader.metrics()["docs"], loader.metrics()["rows_packed"]))
            # the actors rebuilt at the intervention count from zero: the loader's counts still only grow
            assert all(a <= b for x, y in zip(counts, counts[1:]) for a, b in zip(x, y)), counts
            return out
        finally:
            loader.close()

    reference = run("thread", 2, {"web": 0.1, "code": 0.9})
    assert reference[7:] != run("thread", 2, None)[7:]  # the intervention changed the data
    assert run("ray", 2, {"web": 0.1, "code": 0.9}) == reference
    assert run("ray-lanes", 2, {"web": 0.1, "code": 0.9}) == reference
    assert run("ray-lanes", 2, {"web": 0.1, "code": 0.9}, steps_ahead=3) == reference


def test_one_stage_on_ray_the_rest_on_threads(cluster, corpus, sp_model):
    reference, _ = lanes_hashes(text_pipeline(corpus, sp_model, maps=(with_length,)), 1, STEPS, "thread", 2)
    pipe = text_pipeline(corpus, sp_model, maps=(with_length,), executor="ray")
    loader = pipe.build(num_workers=2, runner="thread", address=cluster.address)
    try:
        assert set(loader._executors) == {"ray", "thread"}  # the map's stage on Ray, tokenize on threads
        got = [global_digest([next(loader)]) for _ in range(STEPS)]
        assert loader._executors["ray"].peak_tasks > 0
    finally:
        loader.close()
    assert got == reference


@pytest.mark.slow
def test_a_vision_language_pipeline_on_ray(cluster, tmp_path_factory, corpus_texts):
    """Decoded images (uint8 patch arrays) come back from Ray tasks as numpy arrays, and the batches of an
    image-text pipeline are the thread runner's under both Ray runners."""
    require("PIL")
    from tests.vision_data import build_dataset, pictures
    from zephon.demo.vl import train_vl_tokenizer

    root = tmp_path_factory.mktemp("ray_vl")
    data = build_dataset(root / "data", corpus_texts, pictures())
    tok = z.tokenizer(str(train_vl_tokenizer(root / "tok.model", corpus_texts, vocab_size=600)))
    ids = dict(image_start="<|vision_start|>", image_pad="<|image_pad|>", image_end="<|vision_end|>")
    pipe = (z.Pipeline(seed=11, lanes=8, flush_every=2)
            .source("pairs", z.read.webdataset(str(data["wds"]), columns=["image=jpg;png", "txt"], chunk_rows=5),
                    weight=0.6)
            .source("docs", z.read.parquet(str(data["obelics"]), columns=["texts", "images"], chunk_rows=3),
                    weight=0.4)
            .decode_images("image", sources=["pairs"], max_pixels=56 * 84, merge=2, on_bad_image="drop_record")
            .decode_images("images", sources=["docs"], max_pixels=56 * 56, merge=2)
            .tokenize_images(tok, "txt", sources=["pairs"], **ids)
            .tokenize_images(tok, "texts", sources=["docs"], **ids)
            .mix(by="tokens").shuffle(buffer=6).pack(seq_len=256).batch(rows_per_lane=1))
    program = pipe.compile()
    task = next(program.plan.sources[1].chunk_tasks(0, 0, -1, 0))
    executor = RayExecutor(program.stages, 1)
    try:
        got = executor.submit(1, 0, task).result()
    finally:
        executor.close()
    images = [im for doc in got.columns["images"] for im in (doc or []) if im is not None]
    assert images and all(isinstance(im, np.ndarray) and im.dtype == np.uint8 and im.ndim == 2 for im in images)

    reference = global_hashes(pipe, 1, 6, num_workers=2, runner="thread")
    assert global_hashes(pipe, 2, 6, num_workers=2, runner="ray") == reference
    assert global_hashes(pipe, 1, 6, num_workers=2, runner="ray-lanes") == reference


def caption_length(record: dict) -> dict:
    return {**record, "chars": np.int32(len(record["txt"]))}


@pytest.mark.slow
def test_record_batches_on_ray(cluster, tmp_path_factory, corpus_texts):
    """Records batched as they are (no packing): decoded pixels stacked into one uint8 tensor, captions and
    a mapped scalar and the captions; both Ray runners give the thread runner's batches, Ray tasks across a
    resume from two ranks onto four too."""
    require("PIL")
    from tests.vision_data import build_dataset, pictures

    data = build_dataset(tmp_path_factory.mktemp("ray_records"), corpus_texts, pictures())
    pipe = (z.Pipeline(seed=13, lanes=4, flush_every=2)
            .source("pairs", z.read.webdataset(str(data["wds"]), columns=["image=jpg;png", "txt"], chunk_rows=5))
            .decode_images("image", size=28, patchify=False, on_bad_image="drop_record")
            .map(caption_length, version="1")
            .shuffle(buffer=5)
            .batch(rows_per_lane=2, stack=["images", "chars"]))
    reference = global_hashes(pipe, 1, STEPS, num_workers=2, runner="thread")
    assert len(set(reference)) == STEPS
    assert global_hashes(pipe, 2, STEPS, num_workers=2, runner="ray", resume_at=3, resume_world_size=4) == reference
    assert global_hashes(pipe, 1, STEPS, num_workers=2, runner="ray-lanes") == reference


def test_byte_budget_holds_tasks_back(cluster, make_recipe):
    """A budget of one byte lets one task at a time out (plus the one a lane waits for); the default lets
    many; the batches are the same."""
    recipe = make_recipe(lanes=8)
    pipe = as_pipeline(recipe)
    program = pipe.compile()
    reference = global_hashes(recipe, 1, 4, plan=program.plan)
    peaks = {}
    for budget in (1, 512 << 20):
        executor = RayExecutor(program.stages, 2, max_bytes_in_flight=budget)
        loaders = [build_loader(pipe, rank=r, world_size=2, runner=executor, program=program) for r in range(2)]
        try:
            assert [global_digest([next(ld) for ld in loaders]) for _ in range(4)] == reference
        finally:
            for ld in loaders:
                ld.close()
            executor.close()
        peaks[budget] = executor.peak_tasks
    assert peaks[1] <= 2 < peaks[512 << 20]


# -- faults ----------------------------------------------------------------------------------------------
def test_a_killed_ray_worker_is_retried_and_changes_nothing(cluster, corpus, sp_model):
    slow = text_pipeline(corpus, sp_model, maps=(slow_identity,))
    reference, _ = lanes_hashes(slow, 1, STEPS, "thread", 2)
    loader = build_loader(slow, num_workers=2, runner="ray")
    try:
        got = [global_digest([next(loader)]) for _ in range(2)]
        deadline, killed = time.monotonic() + 30, None
        while killed is None and time.monotonic() < deadline:
            pids = running_stage_pids()
            if pids:
                killed = pids[0]
                os.kill(killed, signal.SIGKILL)
            else:  # between tasks: keep the loader busy and look again
                time.sleep(0.005)
        assert killed is not None, "no Ray worker was seen running a Zephon task"
        got += [global_digest([next(loader)]) for _ in range(STEPS - 2)]
        assert not alive(killed)
    finally:
        loader.close()
    assert got == reference


def test_a_killed_lane_actor_is_rebuilt_from_its_delivered_state(cluster, make_recipe):
    recipe = make_recipe(lanes=8, flush_every=1)
    reference = global_hashes(recipe, 1, 8, plan=WorkPlan(recipe.to_pipeline()))
    loader = build_loader(recipe, num_workers=2, runner="ray-lanes")
    try:
        got, docs = [], []  # docs: each lane's count after each step

        def step() -> None:
            got.append(global_digest([next(loader)]))
            docs.append({lane: c.docs for lane, c in loader._host.counters().items()})

        for _ in range(3):
            step()
        victim = loader._host.worker_pids()[1]
        os.kill(victim, signal.SIGKILL)
        for _ in range(5):
            step()
        assert loader._host.rebuilds == 1 and not alive(victim)
        # the rebuilt actor's lanes count on from their counts, step by step (not from zero)
        assert sum(docs[2][lane] for lane in loader._host._mine(1)) > 0
        assert all(a[lane] <= b[lane] for a, b in zip(docs, docs[1:]) for lane in a), docs
    finally:
        loader.close()
    assert got == reference


def test_a_user_error_keeps_its_type_on_ray(cluster, corpus, sp_model):
    """A function that raises on Ray reaches the trainer as the same error as on threads (not retried)."""
    recipe = text_pipeline(corpus, sp_model, lanes=4, maps=(fail_on_hash,))
    with pytest.raises(OperatorError) as on_threads:
        lanes_hashes(recipe, 1, 50, "thread", 1)
    assert "a record with a hash sign" in str(on_threads.value)
    for runner in ("ray", "ray-lanes"):
        with pytest.raises(OperatorError) as on_ray:
            lanes_hashes(recipe, 1, 50, runner, 1)
        assert "a record with a hash sign" in str(on_ray.value) and "fail_on_hash" in str(on_ray.value)


def test_more_workers_than_the_cluster_has_is_a_clear_error(cluster, make_recipe):
    program = as_pipeline(make_recipe(lanes=4)).compile()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"needs 3 x 1 CPU .* it has 2 CPUs"):
        RayExecutor(program.stages, 3, placement_timeout_s=3)
    assert time.monotonic() - t0 < 30
    with pytest.raises(TypeError, match="unknown Ray option"):
        RayExecutor(program.stages, 1, max_bytes=5)
    with pytest.raises(ValueError, match="one Ray cluster"):
        RayExecutor(program.stages, 1, address=f"127.0.0.1:{free_port()}")


DRIVER = textwrap.dedent("""
    import json, sys, time
    import zephon
    from zephon.engine.ray_local import LocalRayCluster
    runner, phase = sys.argv[1], sys.argv[2]
    if phase == "no-cluster":
        from zephon.engine.ray_executor import RayOptions, connect
        t0 = time.monotonic()
        try:
            connect(RayOptions.make(sys.argv[3], connect_timeout_s=2))
            print(json.dumps({"error": None}))
        except Exception as exc:
            print(json.dumps({"error": type(exc).__name__, "message": str(exc), "s": time.monotonic() - t0}))
        sys.exit(0)
    head = LocalRayCluster(num_cpus=2).start()
    corpus, sp_model = sys.argv[3], sys.argv[4]
    pipe = (zephon.Pipeline(seed=3, lanes=8)
            .source("web", zephon.read.parquet(corpus + "/web", chunk_rows=4))
            .tokenize(zephon.tokenizer(sp_model)).pack(seq_len=64).batch(rows_per_lane=2))
    loader = pipe.build(num_workers=1, runner=runner, address=head.address, ray_options={"lost_after_s": 5})
    next(loader)
    head.kill()  # the whole head, SIGKILL: the cluster is gone
    t0 = time.monotonic()
    out = {"error": None}
    try:
        for _ in range(10_000):
            next(loader)
    except Exception as exc:
        out = {"error": type(exc).__name__, "message": str(exc), "s": time.monotonic() - t0}
    print(json.dumps(out), flush=True)
    head.stop()
    raise SystemExit(3)  # a trainer that lets the error end it: the process must exit, not hang
""")


def run_driver(tmp_path: Path, *args: str, timeout: float = 150) -> tuple[dict, int]:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # the driver runs from tmp_path: find this checkout's zephon whether or not it is installed
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1]), proc.returncode


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["ray", "ray-lanes"])
def test_a_lost_cluster_is_a_clear_error_in_bounded_time(tmp_path, corpus, sp_model, runner):
    out, code = run_driver(tmp_path, runner, "lost", str(corpus), str(sp_model))
    assert out["error"] == RayClusterLost.__name__, out
    assert "lost the Ray cluster" in out["message"] and "resume from your last checkpoint" in out["message"]
    assert out["s"] < 60, out
    assert code == 3  # it exited on its own, with the trainer's exit status


def test_no_cluster_at_the_address_is_a_clear_error(tmp_path):
    out, _ = run_driver(tmp_path, "ray", "no-cluster", f"127.0.0.1:{free_port()}", timeout=60)
    assert out["error"] == "ConnectionError" and "no Ray cluster answers" in out["message"], out
    assert out["s"] < 10, out


# -- closing is quiet ----------------------------------------------------------------------------------
# What Ray printed on a driver's console, once per call in flight, when a loader killed its actors on close():
#   (raylet) Task StageWorker.run failed. There are 3 retries remaining, so the task will be retried. Error:
#   The actor is dead because it was killed by `ray.kill`.
# (or "Error: The actor is temporarily unavailable: RpcError: ... Connection reset by peer", or "...:
# UnexpectedSystemExit: ..."), and what it prints for a failed result nobody took ("Unhandled error ...").
CLOSE_NOISE = re.compile(r"Task (StageWorker|LaneActor)\.\w+ failed|retries remaining, so the task will be retried"
                         r"|killed by `ray\.kill`|The actor is (dead|temporarily unavailable)|Unhandled error"
                         r"|Traceback")
# Ray's message for the canary's retry, pushed to the driver the same way as the messages above
CANARY = re.compile(r"Task \S*canary failed\. There are \d+ retries remaining, so the task will be retried")

QUIET_OPS = textwrap.dedent("""
    import time

    def slow_identity(record):
        time.sleep(0.01)  # calls of tens of ms: a close finds some queued and running (the test checks it does)
        return record
""")

QUIET_DRIVER = textwrap.dedent("""
    import os, sys, time
    import ray, zephon
    from zephon.engine.ray_local import LocalRayCluster
    from quiet_ops import slow_identity

    corpus, sp_model, here = sys.argv[1], sys.argv[2], sys.argv[3]
    pipe = (zephon.Pipeline(seed=3, lanes=8)
            .source("web", zephon.read.parquet(corpus + "/web", chunk_rows=4), weight=0.6)
            .source("code", zephon.read.jsonl(corpus + "/code/*.jsonl", chunk_bytes=1024), weight=0.4)
            .map(slow_identity).tokenize(zephon.tokenizer(sp_model)).pack(seq_len=64).batch(rows_per_lane=2))

    def unfinished(loader):
        # the calls of the loader's actors that have not finished: what a kill would fail
        host = getattr(loader._host, "inner", loader._host)
        if "ray" in loader._executors:
            refs = [h.ref for h in loader._executors["ray"]._flying if h.ref is not None]
        else:
            refs = [ref for queue in host._pending for ref in queue]
        return len(ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)[1]) if refs else 0

    head = LocalRayCluster(num_cpus=2, env={"PYTHONPATH": os.environ["PYTHONPATH"]}).start()
    for runner in ("ray", "ray-lanes"):
        # a few batches, then close: the calls computed ahead are in flight
        loader = pipe.build(num_workers=1, runner=runner, address=head.address)
        for _ in range(3):
            next(loader)
        n = unfinished(loader)
        t0 = time.monotonic()
        loader.close()
        print(f"MARK closed after steps: {runner} {n} in flight, {time.monotonic() - t0:.2f} s", flush=True)
        # a close while the steps-ahead thread is in the middle of a step
        loader = pipe.build(num_workers=1, runner=runner, address=head.address, steps_ahead=2)
        next(loader)
        deadline = time.monotonic() + 30
        while not loader._host._lock.locked() and time.monotonic() < deadline:  # held while a step is computed
            time.sleep(0.001)
        mid, n = loader._host._lock.locked(), unfinished(loader)
        t0 = time.monotonic()
        loader.close()
        print(f"MARK closed mid-step: {runner} {mid} {n} in flight, {time.monotonic() - t0:.2f} s", flush=True)

    # A canary: a task whose first attempt ends its worker is retried, and Ray pushes "Task ...canary failed.
    # There are N retries remaining" to this driver as it pushed the kills' messages. Pushed after them and
    # printed by the same thread: once it is printed, so would they have been.
    @ray.remote(max_retries=1)
    def canary(flag):
        if not os.path.exists(flag):
            open(flag, "w").close()
            os._exit(1)
        return "ok"

    assert ray.get(canary.remote(os.path.join(here, "canary.flag")), timeout=120) == "ok"
    time.sleep(3)  # the printing thread polls
    print("MARK canary returned", flush=True)
    head.stop()
    print("MARK done", flush=True)
""")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_closing_a_ray_loader_prints_nothing(tmp_path, corpus, sp_model):
    """A user's script (a fresh interpreter) closes Ray loaders of both kinds with their actors' calls in
    flight, after a few batches and while the steps-ahead thread is in the middle of a step: Ray prints nothing
    about those calls (they are cancelled before the kill, so none is retried, and a cancelled or killed call
    is never an unhandled error), and every close is quick. The canary proves that what Ray pushes to the
    driver had reached the output."""
    (tmp_path / "quiet_ops.py").write_text(QUIET_OPS)
    script = tmp_path / "quiet.py"
    script.write_text(QUIET_DRIVER)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(script), str(corpus), str(sp_model), str(tmp_path)],
                          capture_output=True, text=True, timeout=200, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "MARK done" in proc.stdout, out[-4000:]
    assert CANARY.search(out), out[-4000:]
    noise = [line for line in out.splitlines() if CLOSE_NOISE.search(line) and not CANARY.search(line)]
    assert not noise, "\n".join(noise[:20])
    closes = re.findall(r"MARK closed (after steps|mid-step): (\S+) (?:(True|False) )?(\d+) in flight, ([\d.]+) s",
                        proc.stdout)
    assert [(kind, runner) for kind, runner, *_ in closes] == [
        ("after steps", "ray"), ("mid-step", "ray"), ("after steps", "ray-lanes"), ("mid-step", "ray-lanes")]
    for kind, runner, mid, n, seconds in closes:
        assert int(n) > 0, f"{kind} {runner}: no call was in flight at the close"
        assert kind == "after steps" or mid == "True", f"{runner}: the close did not come in the middle of a step"
        assert float(seconds) < 20, f"{kind} {runner}: close() took {seconds} s"


@pytest.mark.parametrize("runner", ["ray", "ray-lanes"])
def test_a_close_from_another_thread_ends_a_waiting_next(cluster, corpus, sp_model, runner):
    """close() on one thread while next() on another waits on the actors: that next() fails saying that the
    loader was closed (not that a worker died, nor with an attempt to rebuild a lane actor), and the actors
    are gone."""
    loader = build_loader(text_pipeline(corpus, sp_model, maps=(slow_identity,)), num_workers=1, runner=runner)
    next(loader)
    pids = (loader._executors["ray"] if runner == "ray" else loader._host).worker_pids()
    failed: list[BaseException] = []

    def trainer() -> None:
        try:
            while True:
                next(loader)
        except Exception as exc:  # noqa: BLE001 - what the trainer would see
            failed.append(exc)

    thread = threading.Thread(target=trainer)
    thread.start()
    time.sleep(0.5)  # the next() waits on calls of tens of ms
    loader.close()
    thread.join(timeout=60)
    assert not thread.is_alive() and len(failed) == 1
    assert isinstance(failed[0], RuntimeError), repr(failed[0])
    assert re.match(r"the Ray (executor|lane actors) (is|was|were) closed", str(failed[0])), str(failed[0])
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)

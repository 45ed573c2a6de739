"""A trainer killed with SIGKILL leaves no process behind (issue 17, item 3).

A real training script runs in a subprocess with each runner until its first batch is out; every
process below it (forkserver, resource tracker, workers) is noted, the script is killed with SIGKILL,
and each of those processes must be gone within :data:`GRACE_S` seconds; lane workers must also die
with their forkserver. The guard (:mod:`zephon.engine.worker_guard`) is checked on its own too: a worker
whose trainer is already gone exits at once, and the polling fallback sees a killed trainer. Processes
are named by pid *and* start time (``/proc/PID/stat``), so a recycled pid is never mistaken for a
survivor, nor killed by the clean-up.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from zephon.engine import worker_guard
from zephon.engine.worker_guard import Trainer

from .conftest import base_recipe_dict
from .processes import Proc, alive, descendants, proc_stat

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="walks /proc; the pidfd watch is Linux's")

GRACE_S = 10.0  # how long a trainer's descendants may outlive it
FIRST_BATCH_S = 150.0

# Iterates the loader for ever (a lane stream is endless); stops by itself after a few minutes, so that a
# test process killed before its clean-up cannot leave a trainer running on.
SCRIPT = """
import json, sys, time
import zephon

if __name__ == "__main__":
    recipe = zephon.recipe_from_dict(json.loads(sys.argv[1]))
    loader = zephon.build_loader(recipe, rank=0, world_size=1, num_workers=2, runner=sys.argv[2])
    stop = time.monotonic() + 300
    for step, batch in enumerate(loader):
        if step == 0:
            print("first batch", flush=True)
        if time.monotonic() > stop:
            break
"""

def cmdline(pid: int) -> bytes:
    """The command line of ``pid``, its arguments joined by spaces (empty once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def describe(procs: set[Proc]) -> list[str]:
    """Each process's pid and the start of its command line, for failure messages."""
    return [f"{pid}: {cmdline(pid)[:100].decode(errors='replace')}" for pid, _ in sorted(procs)]


def kill(proc: Proc) -> None:
    """SIGKILL that very process, if it still runs (through a pidfd: no pid-reuse race)."""
    try:
        fd = os.pidfd_open(proc[0])
    except ProcessLookupError:
        return
    try:
        if alive(proc):  # the pidfd names whoever has the pid now: it is ours if the start time matches
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        os.close(fd)


def wait_for_line(proc: subprocess.Popen, line: str, timeout: float) -> bool:
    """Read ``proc``'s stdout until ``line``: False if it ends or ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            got = proc.stdout.readline()
            if got.strip() == line:
                return True
            if not got:
                return False  # EOF: the script ended
    return False


@contextlib.contextmanager
def training(recipe: dict, runner: str, folder: Path) -> Iterator[tuple[subprocess.Popen, set[Proc]]]:
    """The training script over ``recipe`` with ``runner``, past its first batch: (its Popen, the set of
    its descendants, to be filled by the caller). On leaving, whatever happened, the script and every
    process in that set or still below the script are killed."""
    script = folder / "train.py"
    script.write_text(SCRIPT)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    # stderr to a file: the workers inherit it, and a pipe nobody reads could fill up and block them
    stderr = folder / "stderr.txt"
    with open(stderr, "wb") as err:
        proc = subprocess.Popen([sys.executable, str(script), json.dumps(recipe), runner], stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env)
    procs: set[Proc] = set()
    try:
        if not wait_for_line(proc, "first batch", FIRST_BATCH_S):
            pytest.fail(f"no first batch from the training script in {FIRST_BATCH_S:.0f} s (exit code "
                        f"{proc.poll()}):\n{stderr.read_text()[-3000:]}")
        yield proc, procs
    finally:  # whatever failed: no process of this test outlives it
        if proc.poll() is None:
            procs |= descendants(proc.pid)
            proc.kill()
        proc.wait(timeout=30)
        for p in procs:
            kill(p)
        proc.stdout.close()


def wait_gone(procs: set[Proc], timeout: float) -> tuple[set[Proc], float]:
    """Poll until none of ``procs`` runs or ``timeout`` passes: (those still running, seconds waited)."""
    start = time.monotonic()
    left = {p for p in procs if alive(p)}
    while left and time.monotonic() - start < timeout:
        time.sleep(0.05)
        left = {p for p in left if alive(p)}
    return left, time.monotonic() - start


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("runner", ["pool", "process", "thread"])
def test_a_killed_trainer_leaves_no_process_behind(corpus, sp_model, tmp_path, runner):
    recipe = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    with training(recipe, runner, tmp_path) as (proc, procs):
        procs |= descendants(proc.pid)
        if runner == "thread":  # no worker process at all, so nothing can be orphaned
            assert procs == set(), describe(procs)
        else:  # the forkserver, its two workers, the resource tracker
            assert len(procs) >= 4, describe(procs)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        left, took = wait_gone(procs, GRACE_S)
        assert not left, f"{len(left)} of the trainer's {len(procs)} descendants still run {took:.1f} s " \
                         f"after it was killed:\n" + "\n".join(describe(left))
        print(f"runner={runner}: {len(procs)} descendants gone {took:.2f} s after the trainer's SIGKILL")


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_lane_workers_die_with_their_forkserver(corpus, sp_model, tmp_path):
    """The trainer counts its workers dead once their forkserver is (it reads their exit status from the
    server), so they do die with it instead of running on unseen (the parent-death signal)."""
    recipe = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    with training(recipe, "process", tmp_path) as (proc, procs):
        procs |= descendants(proc.pid)
        servers = {p for p in procs if proc_stat(p[0])[1] == proc.pid and b"forkserver" in cmdline(p[0])}
        workers = {p for p in procs if any(proc_stat(p[0])[1] == server[0] for server in servers)}
        assert len(servers) == 1 and len(workers) == 2, describe(procs)
        kill(servers.pop())
        left, took = wait_gone(workers, GRACE_S)
        assert not left, f"{len(left)} lane workers still run {took:.1f} s after their forkserver was killed"
        print(f"lane workers gone {took:.2f} s after their forkserver's SIGKILL")


# exit_with on its own, in a real process: the trainer named by pid and start time. The script says
# when it calls exit_with (CLOCK_MONOTONIC is the same in every process), then sleeps.
GUARDED = """
import sys, time
from zephon.engine.worker_guard import Trainer, exit_with
print(time.monotonic(), flush=True)
exit_with(Trainer(int(sys.argv[1]), int(sys.argv[2])))
time.sleep(float(sys.argv[3]))
print("slept", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["alive", "recycled pid", "gone"])
def test_exit_with_exits_at_once_for_a_gone_trainer_and_never_for_a_live_one(case):
    """A worker started after its trainer died exits before doing anything, also when the trainer's pid
    already belongs to another process (the start time differs); a live trainer is left alone."""
    if case == "gone":
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        trainer = Trainer(dead.pid, worker_guard._proc_stat(dead.pid)[1])
        dead.wait()  # reaped: the pid names nothing now
    else:
        me = worker_guard.this_process()  # this test process stands for the trainer
        trainer = me if case == "alive" else Trainer(me.pid, me.start + 1)
    sleep = 2 if case == "alive" else 30
    out = subprocess.run([sys.executable, "-c", GUARDED, str(trainer.pid), str(trainer.start), str(sleep)],
                         capture_output=True, text=True, timeout=90)
    took = time.monotonic() - float(out.stdout.split()[0])  # since exit_with was called
    if case == "alive":
        assert (out.returncode, out.stdout.split()[1:], out.stderr) == (0, ["slept"], ""), out.stderr
    else:
        assert (out.returncode, out.stdout.split()[1:]) == (worker_guard.EXIT_CODE, []), out.stderr
        assert took < 5, f"exited {took:.1f} s after exit_with, not at once"


@pytest.mark.timeout(60)
def test_the_polling_fallback_sees_the_trainer_die_even_unreaped():
    """Where there are no pidfds, the watcher polls the trainer's pid. A killed trainer whose parent has
    not reaped it yet is a zombie, which ``kill(pid, 0)`` still finds: it must count as dead."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        trainer = Trainer(child.pid, worker_guard._proc_stat(child.pid)[1])
        wait = worker_guard._poller(trainer)
        returned = threading.Event()
        threading.Thread(target=lambda: (wait(), returned.set()), daemon=True).start()
        assert not returned.wait(2 * worker_guard.POLL_S + 0.5), "the wait ended while the trainer lives"
        os.kill(child.pid, signal.SIGKILL)
        assert returned.wait(10 * worker_guard.POLL_S), "the wait goes on after the trainer's death"
        assert worker_guard._proc_stat(child.pid)[0] == "Z"  # still unreaped: the zombie case was the one tested
    finally:
        child.kill()
        child.wait()

"""Worker results through shared memory (zephon/engine/transfer.py): the same objects, value for value;
no file left behind by a loader closed mid-step, by results abandoned at a resume or by a dead trainer;
nothing of another live loader's touched; the pipe whenever shared memory is missing, short or gone."""

from __future__ import annotations

import gc
import glob
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import zephon as z
from zephon.engine import transfer
from zephon.engine.transfer import PREFIX, SHM_DIR, Outbox, Shared, receive, remove_abandoned, share

from .processes import descendants

# Without /dev/shm results go through the pipe and there is nothing here to test; under CI=1 (as for the
# optional dependencies, tests/optional.py) these tests run anyway, and fail, rather than skip unseen.
pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR) and not os.environ.get("CI"),
                                reason="no /dev/shm: results go through the pipe")


def results_in(path: str) -> list[str]:
    return [p for p in glob.glob(os.path.join(path, "*"))]


def test_large_values_travel_out_of_band_and_come_back_equal():
    rng = np.random.default_rng(0)
    obj = {"image": [rng.bytes(20_000 + i) for i in range(20)] + [None, b"tiny"],
           "txt": ["caption %d" % i for i in range(22)],
           "pixels": [rng.integers(0, 255, (64, 48, 3), dtype=np.uint8) for _ in range(5)],
           "ids": np.arange(1000, dtype=np.int32)[::3],  # not contiguous: pickled in band
           "nested": ({"k": rng.bytes(5000)}, 7)}
    box = Outbox()
    sent = share(obj, box.path)
    assert isinstance(sent, Shared) and len(results_in(box.path)) == 1
    assert len(sent.pickled) < 10_000  # the values are not in the pickle
    got = receive(sent)
    assert results_in(box.path) == []  # the file is gone as soon as the result is opened
    assert got["image"] == obj["image"] and got["txt"] == obj["txt"] and got["nested"] == obj["nested"]
    assert all(type(b) is bytes for b in got["image"][:20])
    for a, b in zip(got["pixels"], obj["pixels"]):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    got["pixels"][0][0, 0, 0] ^= 1  # writable
    assert np.array_equal(got["ids"], obj["ids"])
    box.close()
    assert not os.path.exists(sent.path.rsplit("/", 1)[0])


def test_the_pipe_when_small_short_of_room_or_without_an_outbox(monkeypatch):
    box = Outbox()
    small = {"txt": ["a"] * 100, "image": [b"x" * 5000] * 3}
    assert share(small, box.path) is small and receive(small) is small
    big = {"v": [os.urandom(300_000)]}
    assert share(big, None) is big
    monkeypatch.setattr(transfer, "HEADROOM", (1 << 62, 0.0))  # /dev/shm would be left too full
    assert share(big, box.path) is big
    monkeypatch.undo()
    box.close()
    assert share(big, box.path or "/dev/shm/zephon-xfer-gone") is big  # the outbox was removed: the pipe


def test_closing_removes_unread_results_and_only_dead_trainers_outboxes_are_reaped():
    mine, other = Outbox(), Outbox()
    big = {"v": [os.urandom(300_000)]}
    a, b = share(big, mine.path), share(big, other.path)
    mine.close()
    assert not os.path.exists(os.path.dirname(a.path)) and os.path.exists(b.path)
    with pytest.raises(RuntimeError, match="gone before it was read"):
        receive(a)
    code = ("from zephon.engine.transfer import Outbox, share; import os; b = Outbox(); "
            "share({'v': [os.urandom(300000)]}, b.path); print(b.path, len(os.listdir(b.path))); "
            "os._exit(0)")  # dies without closing
    dead, entries = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                   check=True).stdout.split()
    assert int(entries) == 2  # its lock and one result (counted by the child: another test process's loader,
    remove_abandoned()        # under pytest -n, may reap the dead outbox first, with this same function)
    assert not os.path.exists(dead) and os.path.exists(b.path)  # a live outbox is locked: kept
    assert receive(b)["v"] == big["v"]
    other.close()


def test_an_outbox_being_made_is_never_taken_for_a_dead_ones(monkeypatch):
    """Between the lock file's creation and its flock, another process's remove_abandoned() (a loader starting
    on another rank) must not see an unlocked lock and remove the live outbox."""
    real_flock, reaped = transfer.fcntl.flock, []
    code = "from zephon.engine.transfer import remove_abandoned; remove_abandoned()"

    def flock_after_a_reaper(fd, op):
        if not reaped:  # the outbox's own flock: another process reaps in the window before it
            reaped.append(subprocess.run([sys.executable, "-c", code], check=True).returncode)
        return real_flock(fd, op)

    monkeypatch.setattr(transfer.fcntl, "flock", flock_after_a_reaper)
    box = Outbox()
    monkeypatch.setattr(transfer.fcntl, "flock", real_flock)
    assert reaped == [0] and box.path is not None and os.path.isdir(box.path)
    assert isinstance(share({"v": [os.urandom(300_000)]}, box.path), Shared)
    box.close()


def test_a_truncated_result_file_is_an_error_not_a_short_value():
    box = Outbox()
    sent = share({"v": [os.urandom(300_000)]}, box.path)
    os.truncate(sent.path, 1000)
    with pytest.raises(RuntimeError, match="holds 1000 bytes"):
        receive(sent)
    box.close()


def _same(record: dict) -> dict:
    return record


def _pipe() -> z.Pipeline:
    """Records of 40 kB each, through a map: a source with no transform would be read on threads by the pool
    runner, without worker processes or their outboxes."""
    recs = [{"blob": bytes([i % 251]) * 40_000, "n": i} for i in range(400)]
    return (z.Pipeline(seed=1, lanes=4, flush_every=2)
            .source("m", z.read.records(recs, columns=["blob", "n"], chunk_rows=16))
            .map(_same, version="1").batch(rows_per_lane=4))


def _outboxes() -> set[str]:
    return set(glob.glob(os.path.join(SHM_DIR, PREFIX + "*")))


def _ours(paths: set[str]) -> set[str]:
    """The outboxes among PATHS whose lock this process or a descendant holds: under ``pytest -n 2`` another
    test process's loaders make outboxes too (held by a process outside this family). Without /proc/locks,
    all of them."""
    if not os.path.exists("/proc/locks"):
        return set(paths)
    holders = {}
    with open("/proc/locks") as f:
        for line in f:  # "1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF"; "->" marks a blocked waiter
            fields = line.split()
            try:
                if fields[1] != "->":
                    major, minor, inode = fields[5].split(":")
                    holders[(os.makedev(int(major, 16), int(minor, 16)), int(inode))] = int(fields[4])
            except (IndexError, ValueError):  # a lock without an inode ("<none>"), or a format not known here
                continue
    family, out = {os.getpid()} | {pid for pid, _ in descendants(os.getpid())}, set()
    for path in paths:
        try:
            st = os.stat(os.path.join(path, transfer.LOCK))
        except OSError:  # gone, still being made, or another user's
            continue
        if holders.get((st.st_dev, st.st_ino)) in family:
            out.add(path)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("runner", ["pool", "process"])
def test_loaders_leave_no_files_closed_mid_step_or_resumed(runner):
    pipe = _pipe()
    ref = [b["blob"] for _, b in zip(range(6), pipe.build(rank=0, world_size=1))]
    before = _outboxes()
    # pool: a fixed read-ahead of 2 (the default rises to 8 while lanes wait), for the bound below
    loader = pipe.build(rank=0, world_size=1, num_workers=2, runner=runner, **({"prefetch": 2} if runner == "pool" else {}))
    it = iter(loader)
    assert [next(it)["blob"] for _ in range(3)] == ref[:3]
    state = loader.state_dict()
    # only this test's: under `pytest -n 2` another test process's loaders make outboxes meanwhile
    (box,) = seen = _ours(_outboxes() - before)
    for _ in range(4):  # each resume abandons the results in flight: their files go when they arrive
        loader.load_state_dict(state)
        assert next(iter(loader))["blob"] == ref[3]
    gc.collect()
    time.sleep(1.0)
    now = _ours(_outboxes() - before)
    seen |= now
    live = max((len(results_in(d)) for d in now), default=0)
    assert live <= 4 * 2 * 2, live  # lanes x chunks in flight x stages, not growing with every resume
    loader.close()
    assert not _ours(_outboxes() - before) and not [d for d in seen if os.path.exists(d)]


@pytest.mark.timeout(300)
def test_lane_workers_that_fail_mid_step_refuse_to_go_on(monkeypatch):
    from zephon.engine import hosts

    pipe = _pipe()
    ref = [b["blob"] for _, b in zip(range(4), pipe.build(rank=0, world_size=1))]
    loader = pipe.build(rank=0, world_size=1, num_workers=2, runner="process")
    assert next(loader)["blob"] == ref[0]
    state = loader.state_dict()
    calls = {"n": 0}
    real = hosts.receive

    def second_fails(result):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated: a result file vanished")
        return real(result)

    monkeypatch.setattr(hosts, "receive", second_fails)
    with pytest.raises(RuntimeError, match="simulated"):
        next(loader)
    with pytest.raises(RuntimeError, match="stopped in the middle of a step"):
        next(loader)  # never a silently shifted step
    monkeypatch.setattr(hosts, "receive", real)
    loader.load_state_dict(state)
    assert [next(loader)["blob"] for _ in range(3)] == ref[1:4]
    loader.close()

"""Worker results through shared memory (zephon/engine/transfer.py): the same objects, value for value,
no file left behind by a loader closed mid-step, and none touched that belongs to another loader."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import numpy as np
import pytest

from zephon.engine import transfer
from zephon.engine.transfer import PREFIX, SHM_DIR, Shared, owner_name, receive, remove_leftovers, share

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm: results go through the pipe")


def files(owner: str) -> list[str]:
    return glob.glob(os.path.join(SHM_DIR, f"{PREFIX}{owner}-*"))


def test_large_values_travel_out_of_band_and_come_back_equal():
    rng = np.random.default_rng(0)
    obj = {"image": [rng.bytes(20_000 + i) for i in range(20)] + [None, b"tiny"],
           "txt": ["caption %d" % i for i in range(22)],
           "pixels": [rng.integers(0, 255, (64, 48, 3), dtype=np.uint8) for _ in range(5)],
           "ids": np.arange(1000, dtype=np.int32)[::3],  # not contiguous: pickled in band
           "nested": ({"k": rng.bytes(5000)}, 7)}
    owner = owner_name(os.getpid())
    sent = share(obj, owner)
    assert isinstance(sent, Shared) and len(files(owner)) == 1
    assert len(sent.pickled) < 10_000  # the values are not in the pickle
    got = receive(sent)
    assert files(owner) == []  # the name is gone as soon as the result is opened
    assert got["image"] == obj["image"] and got["txt"] == obj["txt"] and got["nested"] == obj["nested"]
    assert all(type(b) is bytes for b in got["image"][:20])
    for a, b in zip(got["pixels"], obj["pixels"]):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    got["pixels"][0][0, 0, 0] ^= 1  # writable, privately
    assert np.array_equal(got["ids"], obj["ids"])


def test_small_results_go_through_the_pipe_unchanged():
    obj = {"txt": ["a"] * 100, "image": [b"x" * 5000] * 3}
    assert share(obj, owner_name(os.getpid())) is obj
    assert receive(obj) is obj


def test_leftovers_are_removed_by_owner_and_for_dead_trainers_only():
    mine, other = owner_name(os.getpid()), owner_name(os.getpid())
    big = {"v": [os.urandom(300_000)]}
    a, b = share(big, mine), share(big, other)
    assert remove_leftovers(mine) == 1 and files(mine) == [] and len(files(other)) == 1
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    ghost = owner_name(int(dead.stdout))
    share(big, ghost)
    remove_leftovers()  # trainers no longer running
    assert files(ghost) == [] and len(files(other)) == 1
    assert receive(b)["v"] == big["v"]
    with pytest.raises(RuntimeError, match="gone before it was read"):
        receive(a)


def test_a_truncated_result_file_is_an_error_not_a_short_value(monkeypatch):
    sent = share({"v": [os.urandom(300_000)]}, owner_name(os.getpid()))
    os.truncate(sent.path, 1000)
    with pytest.raises(RuntimeError, match="holds 1000 bytes"):
        receive(sent)
    monkeypatch.setattr(transfer, "SHM_DIR", "/no/such/dir")
    obj = {"v": [os.urandom(300_000)]}
    assert share(obj, "1-x") is obj  # no shared memory: the pipe


@pytest.mark.timeout(300)
@pytest.mark.parametrize("runner", ["pool", "process"])
def test_a_loader_closed_mid_step_leaves_no_files(runner):
    import zephon as z

    recs = [{"blob": bytes([i % 251]) * 40_000, "n": i} for i in range(400)]
    pipe = z.Pipeline(seed=1, lanes=4).source("m", z.read.records(recs, columns=["blob", "n"], chunk_rows=16)).batch(rows_per_lane=4)
    ref = [b["blob"] for _, b in zip(range(3), pipe.build(rank=0, world_size=1))]
    loader = pipe.build(rank=0, world_size=1, num_workers=2, runner=runner)
    it = iter(loader)
    got = [next(it)["blob"] for _ in range(3)]
    assert got == ref
    loader.close()
    assert glob.glob(os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-*")) == []

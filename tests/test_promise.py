"""scripts/promise.py, short: real torchrun/gloo training on 1 and 2 ranks, and a 2 -> 1 rank resume.

Zephon's runs must agree bit for bit (every global batch's SHA-256, every step's loss, the final
weights). The standard loaders' global batches must differ between 1 and 2 ranks: DataLoader +
DistributedSampler deals the pre-packed rows round-robin over the ranks (the same rows, in another
order), the streaming loader packs each rank's own documents (other rows).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS, RESUME_AT = 6, 3


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_promise_short_run(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "scripts" / "promise.py"), "--steps", str(STEPS), "--world-sizes", "1,2",
           "--resume", "2:1", "--resume-at", str(RESUME_AT), "--max-files", "30", "--vocab", "512", "--no-plot",
           "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--log-every", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "out" / "promise.json").read_text())
    runs = result["runs"]
    assert set(runs) == {"sampler-1", "sampler-2", "stream-1", "stream-2", "zephon-1", "zephon-2", "zephon-2to1"}
    for run in runs.values():
        assert run["steps"] == list(range(STEPS)) and len(run["loss"]) == len(run["hash"]) == STEPS

    # Zephon: the same global batches, losses and final weights on 1 rank, 2 ranks and after 2 -> 1
    z1 = runs["zephon-1"]
    assert len(set(z1["hash"])) == STEPS  # the steps hashed distinct batches: the comparison can fail
    assert z1["loss"][-1] < z1["loss"][0]  # and the model trained
    for name in ("zephon-2", "zephon-2to1"):
        assert runs[name]["hash"] == z1["hash"], name
        assert runs[name]["loss"] == z1["loss"], name  # exact float equality, not a tolerance
        assert runs[name]["weights"] == z1["weights"], name
    assert runs["zephon-2to1"]["start"] == RESUME_AT  # its tail really ran from the checkpoint on 1 rank
    assert runs["zephon-2to1"]["world_size"] == "2->1"

    # DistributedSampler: the global batches differ between 1 and 2 ranks at every step, while each
    # holds the same rows (one epoch's permutation, dealt round-robin): only the order changed.
    s1, s2 = runs["sampler-1"], runs["sampler-2"]
    assert all(a != b for a, b in zip(s1["hash"], s2["hash"]))
    assert s1["row_set"] == s2["row_set"]
    # Streaming, packed per rank: other rows in every global batch, and so other losses.
    t1, t2 = runs["stream-1"], runs["stream-2"]
    assert all(a != b for a, b in zip(t1["row_set"], t2["row_set"]))
    assert t1["loss"][1:] != t2["loss"][1:]

    summary = {r["run"]: r for r in result["summary"]}
    assert summary["zephon-2to1"]["losses_bit_identical"] and summary["zephon-2"]["final_weights_equal"]
    assert summary["sampler-2"]["batch_hashes_equal"] == 0 and summary["stream-2"]["row_sets_equal"] == 0
    assert "| zephon-2to1 | 2->1 | 0 | yes | 6/6 |" in proc.stdout

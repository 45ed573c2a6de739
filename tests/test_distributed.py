"""Elastic determinism across real processes: torchrun, gloo, rank/world size from the group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zephon import build_loader, global_digest
from zephon.verify import global_hashes

from .conftest import base_recipe_dict


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_torchrun_two_ranks_match_one_process_and_resume_elsewhere(tmp_path, corpus, sp_model, make_recipe):
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    data.update(lanes=8, flush_every=1)
    (tmp_path / "recipe.json").write_text(json.dumps(data))
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).with_name("dist_worker.py")), "--recipe-json", str(tmp_path / "recipe.json"),
           "--steps", "8", "--checkpoint-at", "3", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["lanes"] == [0, 1, 2, 3]

    recipe = make_recipe(lanes=8, flush_every=1)
    reference = global_hashes(recipe, 1, 8)
    assert result["hashes"] == reference

    # the state gathered across the two processes resumes on 4 ranks (here, in one process)
    state = result["state"]
    assert sorted(map(int, state["lanes"])) == list(range(8)) and state["step"] == 3
    loaders = [build_loader(recipe, rank=r, world_size=4) for r in range(4)]
    for ld in loaders:
        ld.load_state_dict(state)
    assert [global_digest([next(ld) for ld in loaders]) for _ in range(5)] == reference[3:]

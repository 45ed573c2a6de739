"""The device check (scripts/device_check.sh) runs end to end in its --cpu mode and writes its JSON.

Not a measurement: every part shrunk to seconds on CPU (scripts/device_check.py, PROFILES["cpu"]), so that the
script a lent GPU machine runs does not rot between the sessions that are lent one. Checked: the schema, every
part present with a status and a reason when it is not ok, positive text and VL throughput for every peer run,
Torchtitan's batches continuing identically after a resume at another data-parallel size, and the host-to-
device copies arriving bit-identical. ~3 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("environment", "h2d", "torchtitan", "megatron_core", "megatron_lm", "throughput")

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("device_check") / "device_check.json"
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    p = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), "--cpu", "--out", str(out)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    assert out.exists(), f"no JSON written (exit {p.returncode})\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    r = json.loads(out.read_text())
    r["_exit"], r["_output"] = p.returncode, p.stdout[-3000:] + p.stderr[-3000:]
    return r


def test_schema_and_every_part_present(report):
    assert report["schema"] == "zephon-device-check/1" and report["mode"] == "cpu"
    assert tuple(report["parts"]) == PARTS
    for name, p in report["parts"].items():
        assert p["status"] in ("ok", "failed", "skipped"), (name, p)
        assert isinstance(p["seconds"], (int, float))
        if p["status"] != "ok":
            assert p["reason"], f"{name} is {p['status']} without a reason"
    assert report["summary"] == {n: p["status"] for n, p in report["parts"].items()}
    env = report["parts"]["environment"]
    assert env["status"] == "ok" and env["python"] and env["cpu_count"] and env["git"]["commit"]
    assert env["packages"]["torch"]
    # no part failed here: the GPU-only pieces say why they did not run
    assert not [n for n, p in report["parts"].items() if p["status"] == "failed"], report["_output"]
    assert report["_exit"] == 0
    lm = report["parts"]["megatron_lm"]
    assert lm["status"] == "skipped" and ("core_v0.16.1" in lm["reason"] or "CUDA" in lm["reason"])


def test_throughput_entries_positive(report):
    t = report["parts"]["throughput"]
    assert t["status"] == "ok", t["reason"]
    for pipeline, metric in (("text", "tokens_per_s"), ("vl_fetch", "samples_per_s"), ("vl_pipeline", "images_per_s")):
        peers = t[pipeline]["peers"]
        assert {p.split("_")[0] for p in peers} == {"zephon", "grain", "torchdata"} - (
            {"torchdata"} if pipeline == "vl_pipeline" else set()), peers
        ran = [e for by_w in peers.values() for e in by_w.values() if e["ok"] is not None]
        assert ran and all(e["ok"] and e[metric] > 0 for e in ran), (pipeline, peers)
        assert all(e.get("skipped") for by_w in peers.values() for e in by_w.values() if e["ok"] is None)
        assert any("agree" in line for line in t[pipeline]["zephon_hashes"]), t[pipeline]["zephon_hashes"]


def test_torchtitan_resumes_on_another_dp_size_with_the_same_batches(report):
    tt = report["parts"]["torchtitan"]
    assert tt["status"] == "ok", tt["reason"]  # CI sets ZEPHON_REQUIRE_TORCHTITAN=1: never skipped there
    c = tt["checks"]
    assert c["a_steps"] == [1, 2, 3, 4] and c["b_steps"] == [3, 4] and c["hash_continuity"]
    assert c["b_loaded_checkpoint"] and c["b_resumed_lanes"]
    assert [tt["runs"]["A"]["dp"], tt["runs"]["B"]["dp"]] == [2, 1]


def test_host_to_device_copies_arrive_identical(report):
    h = report["parts"]["h2d"]
    assert h["status"] == "ok", h["reason"]
    for kind in ("text", "vl"):
        assert h[kind]["identical"] and h[kind]["pageable"]["identical"] and h[kind]["pageable"]["mb_per_s"] > 0
        pinned = h[kind]["pinned"]
        assert pinned.get("identical") is True or pinned.get("skipped"), pinned  # a CPU-only torch cannot pin
    assert "pixel_values" in h["vl"]["keys"]


def test_megatron_core_provider_resume(report):
    m = report["parts"]["megatron_core"]
    assert m["status"] in ("ok", "skipped"), m["reason"]
    if m["status"] == "ok":
        assert m["provider_resume"]["iterations_3_4_equal"] == [True, True]
        assert m["provider_on_device"]["batches_equal"]

"""scripts/bench/scaling_model.py runs end to end on tiny corpora in --quick mode (so that it does not rot).

Not a measurement: windows of a few batches. Checks the JSON's shape: every pipeline, every thread kind with
positive CPU where it applies, the model's projection for every worker count and core count, its saturation
points and its check against the measured 1- and 2-worker runs; and that the plot was written.
"""

from __future__ import annotations

import json

import pytest

from tests.optional import require
from tests.scripts_run import BENCH, run_script


@pytest.mark.slow
@pytest.mark.e2e
def test_scaling_model_runs_on_tiny_corpora(tmp_path):
    for mod in ("psutil", "matplotlib", "simplejpeg", "array_record"):
        require(mod)
    text, vl = tmp_path / "text", tmp_path / "vl"
    run_script([str(BENCH / "make_corpus.py"), "--out", str(text), "--no-share-doc", "--min-docs", "100", "--packages",
         "tokenizers", "--max-docs", "3000", "--files", "8", "--row-group", "100", "--tokenizer-sample-mb", "1",
         "--vocab-size", "4096"])
    run_script([str(BENCH / "make_vl_corpus.py"), "--out", str(vl), "--samples", "200", "--per-shard", "50", "--docs", "0",
         "--no-debian", "--max-side", "640"])
    out, png = tmp_path / "model.json", tmp_path / "model.png"
    run_script([str(BENCH / "scaling_model.py"), "--quick", "--data", str(text), "--vl-data", str(vl), "--out", str(out),
         "--png", str(png)])
    doc = json.loads(out.read_text())
    assert png.stat().st_size > 10_000 and not doc["failed"] and doc["quick"]
    assert set(doc["model"]) == {"text", "vl_fetch", "vl_pipeline"}
    runners = {"text": {"thread", "pool"}, "vl_fetch": {"thread"}, "vl_pipeline": {"thread", "pool"}}
    for name, m in doc["model"].items():
        assert set(m["cpu_ms_per_unit"]) == set(m["projection"]) == set(m["saturation"]) == runners[name]
        for runner, per_run in m["cpu_ms_per_unit"].items():
            u = per_run["calib_1"]
            assert set(u) >= {"trainer", "steps_ahead", "workers", "other", "worker_processes", "process"}
            assert u["trainer"]["total"] > 0  # next(), collation, bookkeeping
            if runner == "thread":
                assert u["workers"]["held"] > 0 and u["workers"]["released"] > 0, (name, u["workers"])
                assert u["workers"]["released_calls"], name  # tokenizer / pread / image codecs
            else:
                assert u["worker_processes"] > 0, name
            # lanes and collation run ahead of the trainer only where images are packed with workers
            assert (u["steps_ahead"]["total"] > 0) == (name == "vl_pipeline"), (name, u["steps_ahead"])
        for runner, per_c in m["projection"].items():
            assert set(per_c) == {str(c) for c in doc["cores"]}
            for per_w in per_c.values():
                assert set(per_w) == {str(w) for w in doc["workers"]} == {"1", "2", "4", "8", "16", "32"}
                rates = [p["rate"] for p in per_w.values()]
                assert all(r > 0 for r in rates) and rates == sorted(rates)  # more workers never project slower
            assert all(s["workers"] > 0 and s["limit"] for s in m["saturation"][runner].values())
        checks = {(c["runner"], c["workers"]) for c in m["check"]}
        assert checks == {(r, w) for r in runners[name] for w in (1, 2)}
        assert all(c["measured"] > 0 and c["predicted"] > 0 for c in m["check"])
    assert doc["model"]["vl_fetch"]["trainer_profile"]["thread"]["by_part"]  # the trainer's thread, sampled

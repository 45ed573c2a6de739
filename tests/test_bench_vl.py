"""The vision-language benchmark scripts run end to end on a tiny corpus (so that they do not rot).

Not a measurement: one round, one or two batches per configuration, a few configurations each. A corpus of
300 samples from the pip-installed packages' pictures (make_vl_corpus.py --native, which also writes
every peer's native format), then each script with its smallest settings; each must exit 0 (its Zephon
configurations agree on every batch hash, and the peers' image transform equals Zephon's).
"""

from __future__ import annotations

import json

import pytest

from tests.optional import require
from tests.scripts_run import BENCH, REPO, run_script


@pytest.mark.slow
@pytest.mark.e2e
def test_vl_benchmarks_run_on_a_tiny_corpus(tmp_path):
    for mod in ("grain", "litdata", "webdataset", "array_record", "simplejpeg", "skimage"):
        require(mod)
    data = tmp_path / "vl"
    run_script([str(BENCH / "make_vl_corpus.py"), "--out", str(data), "--samples", "300", "--per-shard", "100", "--docs", "0",
         "--no-debian", "--max-side", "640", "--native"])
    assert (data / "native" / "corpus.key").exists()
    small = ["--data", str(data), "--rounds", "1", "--warmup", "1", "--steps", "1", "--repeats", "1"]
    out = tmp_path / "fetch.json"
    run_script([str(BENCH / "vl_fetch_batch.py"), *small, "--only",
         "plain_loop,grain_0,litdata_0,webdataset_0,mosaic_0,torchdata_nodes_1_thread,zephon_0_inline,zephon_1_thread",
         "--json", str(out)])
    res = json.loads(out.read_text())["results"]
    assert all(res[n]["ok"] for n in ("plain_loop", "grain_0", "zephon_0_inline", "zephon_1_thread")), res
    run_script([str(BENCH / "vl_fetch_batch.py"), *small, "--mode", "decode", "--only",
         "plain_loop,zephon_0_inline,zephon_1_thread,zephon_packed_0_inline"])
    out = tmp_path / "pipeline.json"
    run_script([str(BENCH / "vl_pipeline.py"), *small, "--only",
         "decoder_alone_main,decoder_alone_keep_1,grain_0,zephon_0_inline,zephon_1_thread,zephon_1_thread_fresh",
         "--json", str(out)])
    res = json.loads(out.read_text())["results"]
    assert all(res[n]["ok"] for n in ("decoder_alone_main", "decoder_alone_keep_1", "zephon_1_thread",
                                      "zephon_1_thread_fresh")), res
    assert res["zephon_0_inline"]["trainer_cpu_ms_per_image"] > 0  # inline: the trainer's thread decodes
    run_script([str(BENCH / "vl_stages.py"), "--data", str(data), "--images", "40", "--passes", "1", "--batches", "1",
         "--warmup", "1", "--repeats", "1"])
    out = tmp_path / "decode_paths.json"
    run_script([str(BENCH / "decode_paths.py"), "--data", str(data), "--images", "12", "--passes", "1",
         "--compare-src", str(REPO), "--json", str(out)])
    assert len(json.loads(out.read_text())["results"]) == 10  # peers, and both decoders of both checkouts, per target

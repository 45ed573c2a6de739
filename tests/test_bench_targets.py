"""The benchmark's target check (scripts/bench/_targets.py): ratios are taken inside each round."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))

import _targets  # noqa: E402


def rounds(*values):
    return [{"ok": True, "tokens_per_s": v} for v in values]


def line_for(lines, text):
    hits = [line for line in lines if text in line]
    assert len(hits) == 1, (text, lines)
    return hits[0]


def test_ratios_are_paired_by_round_not_taken_between_medians():
    # The machine is twice as fast in round 2: medians alone would compare 200 with 150. Inside each
    # round zephon is 1.2x torchdata, so the target holds in every round.
    per_cfg = {
        "torchdata_nodes_2_thread": rounds(100, 200, 110),
        "zephon_best_fit_2_thread": rounds(120, 240, 132),
    }
    line = line_for(_targets.target_report(per_cfg), "zephon best_fit thread >= torchdata thread")
    assert line.startswith("MET") and "median  1.20" in line and "held in 3/3" in line


def test_a_target_missed_in_most_rounds_is_not_met_and_says_so():
    per_cfg = {
        "plain_loop": rounds(100, 100, 100),
        "zephon_wrap_1_process": rounds(90, 96, 80),
        "zephon_wrap_2_process": rounds(170, 190, 150),
    }
    lines = _targets.target_report(per_cfg)
    one = line_for(lines, "zephon wrap 1 process worker >= 0.95 x plain_loop")
    assert one.startswith("NOT MET") and "held in 1/3" in one
    two = line_for(lines, "zephon wrap 2 process workers >= 1.8 x 1 process worker")
    assert two.startswith("MET") and "held in 3/3" in two  # 1.89, 1.98, 1.875


def test_best_runner_against_the_peers_best_and_failed_rounds_are_skipped():
    per_cfg = {
        "grain_concat_2": rounds(100, 100),
        "grain_firstfit_2": rounds(130, 90),
        "zephon_best_fit_2_thread": rounds(120, 80),
        "zephon_best_fit_2_pool": [{"ok": True, "tokens_per_s": 140}, {"ok": False}],
    }
    line = line_for(_targets.target_report(per_cfg), "2 workers: zephon best_fit (best runner) > grain (best)")
    # round 1: max(120, 140) / max(100, 130) = 1.08; round 2: 80 / 100 = 0.8 (the failed pool round is skipped)
    assert "rounds 0.80-1.08" in line and "held in 1/2" in line and line.startswith("NOT MET")


def test_scaling_is_also_checked_against_one_worker_on_one_cpu_which_never_counts_as_a_contender():
    per_cfg = {
        "torchdata_nodes_1_thread": rounds(100, 100),
        "zephon_wrap_1_thread": rounds(110, 100),
        "zephon_wrap_1_thread_1cpu": rounds(100, 200),  # a noisy pass: faster than every contender
        "zephon_wrap_2_thread": rounds(190, 190),
    }
    lines = _targets.target_report(per_cfg)
    free = line_for(lines, "zephon wrap 2 thread workers >= 1.8 x 1 thread worker")
    assert free.startswith("MET") and "rounds 1.73-1.90" in free and "held in 1/2" in free
    pinned = line_for(lines, "zephon wrap 2 thread workers >= 1.8 x 1 worker on 1 CPU")
    assert "rounds 0.95-1.90" in pinned and "held in 1/2" in pinned
    best = line_for(lines, "1 workers: zephon wrap (best runner) >= torchdata (best)")
    assert "rounds 1.00-1.10" in best  # the pinned 200 of round 2 is not zephon's best runner


def test_fetch_targets_use_records_per_s_and_check_the_one_core_consumer():
    def recs(*values):
        return [{"ok": True, "records_per_s": v} for v in values]

    per_cfg = {
        "grain_1": recs(10_000, 12_000, 11_000),
        "torchdata_nodes_1_thread": recs(20_000, 18_000, 30_000),
        "zephon_wrap_1_thread": recs(25_000, 24_000, 27_000),
        "zephon_wrap_0_inline": recs(17_000, 15_000, 16_500),
    }
    lines = _targets.target_report(per_cfg, pipeline="fetch")
    assert not [line for line in lines if "plain_loop" in line or "1.8 x" in line]  # text-pipeline targets only
    floor = line_for(lines, "zephon wrap on one core (0 workers) >= 16,000 records/s")
    assert floor.startswith("MET") and "median  16,500" in floor and "held in 2/3" in floor
    td = line_for(lines, "1 workers: zephon wrap thread >= torchdata thread")
    assert td.startswith("MET") and "rounds 0.90-1.33" in td and "held in 2/3" in td  # 1.25, 1.33, 0.90
    assert line_for(lines, "1 workers: zephon wrap (best runner) > grain (best)").startswith("MET")


def test_median_round_reports_the_middle_round_and_flags_runs_that_hashed_differently():
    runs = [{"ok": True, "records_per_s": v, "first_batch_s": 1.0, "peak_rss_mb": m, "digests": d}
            for v, m, d in ((30, 100, ["a"]), (10, 300, ["a"]), (20, 200, ["b"]))]
    pick = _targets.median_round(runs, "records_per_s")
    assert pick["records_per_s"] == 20 and pick["round_records_per_s"] == [30, 10, 20]
    assert pick["peak_rss_mb"] == 300 and pick["repeats_agree"] is False
    failed = _targets.median_round(runs[:1] + [{"ok": False, "error": "boom"}])
    assert failed == {"ok": False, "error": "boom"}


def test_hash_check_names_the_first_differing_batch_per_algorithm():
    def z(algo, digests):
        return {"kind": "zephon", "ok": True, "params": {"algorithm": algo}, "digests": digests}

    results = {"zephon_wrap_0_inline": z("wrap", ["a", "b", "c"]), "zephon_wrap_2_pool": z("wrap", ["a", "x", "c"]),
               "zephon_best_fit_0_inline": z("best_fit", ["d", "e"]), "zephon_best_fit_2_thread": z("best_fit", ["d", "e"]),
               "grain_2": {"kind": "grain", "ok": True}}
    lines, mismatch, failed = _targets.zephon_hash_check(results)
    assert mismatch and not failed
    assert "HASH MISMATCH [wrap]: zephon_wrap_2_pool differs from zephon_wrap_0_inline at batch 1" in lines
    assert any(line.startswith("zephon best_fit: 2 configurations agree on all 2 batch SHA-256s") for line in lines)


def test_adjacent_pair_order_keeps_each_one_and_two_worker_pair_back_to_back():
    import random

    names = ["plain_loop", "tokenizer_alone_thread", "tokenizer_alone_2threads", "zephon_wrap_1_thread",
             "zephon_wrap_2_thread", "zephon_best_fit_1_process", "zephon_best_fit_2_process",
             "torchdata_nodes_2_thread"]
    leading, wrap_1_first = set(), set()
    for seed in range(40):
        order = _targets.adjacent_pair_order(names, random.Random(seed))
        assert sorted(order) == sorted(names)
        for a, b in (("tokenizer_alone_thread", "tokenizer_alone_2threads"),
                     ("zephon_wrap_1_thread", "zephon_wrap_2_thread"),
                     ("zephon_best_fit_1_process", "zephon_best_fit_2_process")):
            assert abs(order.index(a) - order.index(b)) == 1, (seed, order)
        leading.add(order[0])
        wrap_1_first.add(order.index("zephon_wrap_1_thread") < order.index("zephon_wrap_2_thread"))
    assert wrap_1_first == {True, False}  # either member of a pair may go first
    assert len(leading) > 2  # and the pairs themselves move around


def test_totals_ratio_pairs_each_runner_with_its_own_one_worker_figure():
    totals = {"tokenizer_alone_thread": (10.0, 4_000_000), "tokenizer_alone_2threads": (10.0, 7_900_000),
              "zephon_wrap_1_thread": (12.0, 5_000_000), "zephon_wrap_2_thread": (6.0, 4_600_000),
              "zephon_best_fit_1_process": (10.0, 4_000_000), "zephon_best_fit_2_process": (10.0, 7_000_000),
              "zephon_best_fit_1_pool": (10.0, 4_000_000), "plain_loop": (10.0, 3_000_000)}
    lines = _targets.totals_ratio_lines(totals)
    assert len(lines) == 3  # the pool has no 2-worker figure; the plain loop is no pair
    machine = line_for(lines, "tokenizer alone, 2 threads / 1 helper thread")
    assert machine.startswith("machine") and machine.endswith("1.98")
    wrap = line_for(lines, "zephon wrap 2 thread workers >= 1.8 x 1 thread worker")
    assert wrap.startswith("MET") and wrap.endswith("1.84")  # (4.6M / 6 s) / (5M / 12 s)
    proc = line_for(lines, "zephon best_fit 2 process workers")
    assert proc.startswith("NOT MET") and proc.endswith("1.75")


def test_measure_stream_times_on_batch_and_hashes_outside_the_windows():
    # on_batch is a trainer's own work: its time counts (excluding it once let worker threads' work during a
    # GIL wait count as theirs). Hashes cover the warm-up's first half and the tail, never a timed batch.
    import time

    import _common

    def make():
        return iter(range(10 ** 6)), (lambda: None)

    def slow_on_batch(run, index, batch):
        time.sleep(0.01)

    res = _common.measure_stream(make, steps=5, warmup=6, repeats=2, tokens_per_batch=1,
                                 on_batch=slow_on_batch, digest=str)
    assert all(w["seconds"] >= 5 * 0.01 for w in res["runs"])
    # batches 0-5 warm up (0-2 hashed), 6-15 are the two timed windows, 16-21 the tail (hashed)
    assert res["digests_by_run"] == [["0", "1", "2"] + [str(i) for i in range(16, 22)]]

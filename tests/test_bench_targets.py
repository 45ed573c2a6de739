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

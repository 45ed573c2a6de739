"""Dynamic curricula: mixture schedules and interventions, byte-identical at every world size and resume.

A schedule changes the weights over training steps; ``loader.set_mixture(weights, at_step=s)`` changes
them from step ``s`` on, whatever the prefetch and timing when it is called. The realised mixture must
follow the schedule (within a tolerance stated here, and after the clock's lag, measured here); the
global batches must be identical at every world size, across resumes, with workers and runners, with an
intervention issued before a checkpoint and applied after it, and with one issued while lanes have
already mixed past its step. Weight-0 and late-joining sources, and ranks that disagree, are covered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import zephon as z
from zephon import global_digest, merge_states
from zephon.verify import global_hashes

STEPS = 24


def web_tag(record: dict) -> dict:
    """A payload naming the record's source, to measure the delivered mixture from the batches."""
    return {**record, "src": "web"}


def code_tag(record: dict) -> dict:
    return {**record, "src": "code"}


def pipeline(corpus: Path, tok, schedule=None, lanes: int = 8, shuffle: int = 0, flush_every: int = 1) -> z.Pipeline:
    pipe = (z.Pipeline(seed=3, lanes=lanes, flush_every=flush_every)
            .source("web", z.read.parquet(str(corpus / "web"), chunk_rows=4), weight=0.5)
            .source("code", z.read.jsonl(str(corpus / "code" / "*.jsonl"), chunk_bytes=1024, unit_bytes=4096),
                    weight=0.5)
            .map(web_tag, sources=["web"]).map(code_tag, sources=["code"])
            .tokenize(tok).split(max_tokens=64)
            .mix(by="tokens", schedule=schedule))
    if shuffle:
        pipe = pipe.shuffle(buffer=shuffle)
    return pipe.pack(seq_len=64, algorithm="best_fit", max_open_bins=4).batch(rows_per_lane=2)


@pytest.fixture(scope="module")
def tok(sp_model):
    return z.tokenizer(str(sp_model))


def test_the_realised_mixture_follows_the_schedule(corpus, tok):
    """Phases 0.1 -> 0.8 of code at step 16. The mixer is exact within two pieces (of at most 64 tokens)
    per lane and window of constant weights, so over the 8 lanes a window of the delivered data is within
    8 * 2 * 64 tokens of its share, plus what the clock's lag moves across the switch: the lag is measured
    (the step at which the delivery crosses half-way) and must be at most 2 steps here."""
    switch, steps = 16, 40
    phases = z.Schedule.phases([(0, {"web": 0.9, "code": 0.1}), (switch, {"web": 0.2, "code": 0.8})])
    loader = pipeline(corpus, tok, phases, flush_every=8).build()
    batches = [next(loader) for _ in range(steps)]
    code, total = delivered_tokens(batches)
    share = code / total
    want = np.where(np.arange(steps) < switch, 0.1, 0.8)
    print("\nstep  scheduled-code  delivered-code  cumulative-in-phase")
    for s in range(steps):
        a = 0 if s < switch else switch
        print(f"{s:4d}  {want[s]:14.2f}  {share[s]:14.3f}  {code[a:s + 1].sum() / total[a:s + 1].sum():19.3f}")
    smooth = np.convolve(share, np.ones(3) / 3, mode="same")
    crossed = int(np.flatnonzero(smooth > 0.45)[0])
    print(f"switch at step {switch}; the delivery crossed half-way at step {crossed} (lag {crossed - switch})")
    assert abs(crossed - switch) <= 2
    bound = 8 * 2 * 64
    for lo, hi, w in ((0, switch - 2, 0.1), (switch + 2, steps, 0.8)):
        got = code[lo:hi].sum() / total[lo:hi].sum()
        assert abs(got - w) <= bound / total[lo:hi].sum() + 0.02, (lo, hi, w, got)
    m = loader.metrics()
    assert m["mixture_weights"] == pytest.approx({"web": 0.2, "code": 0.8})
    assert m["mixture_recent_share"]["code"] > 0.5


def delivered_tokens(batches: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Per global step: the tokens of 'code' documents, and all document tokens delivered."""
    code, total = [], []
    for b in batches:
        seg = b["segment_ids"].numpy()
        c = t = 0
        for r, docs in enumerate(b["src"]):
            for k, src in enumerate(docs):
                n = int((seg[r] == k + 1).sum())
                t += n
                c += n if src == "code" else 0
        code.append(c)
        total.append(t)
    return np.asarray(code, dtype=float), np.asarray(total, dtype=float)


@pytest.fixture(scope="module")
def scheduled(corpus, tok):
    ramp = z.Schedule([(0, {"web": 1.0, "code": 0.0}), (6, {"web": 0.3, "code": 0.7}),
                       (14, {"web": 0.7, "code": 0.3})], interpolate="cosine")
    pipe = pipeline(corpus, tok, ramp, shuffle=3)
    return pipe, global_hashes(pipe, 1, STEPS)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_scheduled_pipeline_is_elastic(scheduled, world):
    pipe, reference = scheduled
    assert len(set(reference)) == STEPS
    assert global_hashes(pipe, world, STEPS) == reference


@pytest.mark.parametrize("world,new_world,at", [(4, 2, 5), (8, 1, 11), (2, 8, 17)])
def test_a_scheduled_pipeline_resumes_on_another_world_size(scheduled, world, new_world, at):
    pipe, reference = scheduled
    assert global_hashes(pipe, world, STEPS, resume_at=at, resume_world_size=new_world) == reference


@pytest.mark.parametrize("runner,workers", [("thread", 2), ("pool", 2), ("process", 2)])
def test_a_scheduled_pipeline_under_every_runner(scheduled, runner, workers):
    pipe, reference = scheduled
    assert global_hashes(pipe, 2, STEPS, num_workers=workers, runner=runner) == reference


def test_weight_zero_and_a_late_joining_source(corpus, tok):
    late = z.Schedule.phases([(0, {"web": 1.0, "code": 0.0}), (10, {"web": 0.5, "code": 0.5})])
    loader = pipeline(corpus, tok, late).build()
    batches = [next(loader) for _ in range(8)]
    assert all(src == "web" for b in batches for docs in b["src"] for src in docs)
    for _ in range(10):
        batches.append(next(loader))
    assert sum(src == "code" for b in batches[12:] for docs in b["src"] for src in docs) > 0
    zero = z.Schedule.phases([(0, {"web": 0.0, "code": 1.0})])
    only_code = pipeline(corpus, tok, zero).build()
    assert all(src == "code" for _ in range(4) for docs in next(only_code)["src"] for src in docs)


# -- interventions ---------------------------------------------------------------------------------------------
def run_with_intervention(pipe, world: int, call_at: int, at_step: int, weights: dict, steps: int = STEPS,
                          resume_at: int | None = None, resume_world: int | None = None, runner: str = "thread",
                          workers: int = 0) -> tuple[list[str], list[int]]:
    """Global hashes of a run whose ranks all call set_mixture after ``call_at`` steps (optionally
    checkpointing after ``resume_at`` steps and resuming on ``resume_world`` ranks)."""
    loaders = [pipe.build(rank=r, world_size=world, num_workers=workers, runner=runner) for r in range(world)]
    hashes, rebuilt = [], []
    for step in range(steps):
        if step == call_at:
            rebuilt = [ld.set_mixture(weights, at_step=at_step) for ld in loaders]
        if resume_at is not None and step == resume_at:
            state = merge_states([ld.state_dict() for ld in loaders])
            for ld in loaders:
                ld.close()
            loaders = [pipe.build(rank=r, world_size=resume_world) for r in range(resume_world)]
            for ld in loaders:
                ld.load_state_dict(state)
        hashes.append(global_digest([next(ld) for ld in loaders]))
    for ld in loaders:
        ld.close()
    return hashes, rebuilt


CODE_HEAVY = {"web": 0.1, "code": 0.9}


@pytest.fixture(scope="module")
def intervened(corpus, tok):
    """The reference: one rank, the intervention known from the start (call at step 0 for step 10)."""
    pipe = pipeline(corpus, tok, shuffle=6, flush_every=8)  # segments long enough for mixers to lead delivery
    hashes, _ = run_with_intervention(pipe, 1, 0, 10, CODE_HEAVY)
    plain = global_hashes(pipe, 1, STEPS)
    assert hashes[:10] == plain[:10]  # "at step 10" is exact: nothing before it changes
    assert hashes[10:] != plain[10:]  # and the data from step 10 on did change
    return pipe, hashes


@pytest.mark.parametrize("world,call_at", [(1, 4), (4, 4), (8, 2)])
def test_an_intervention_is_deterministic_whenever_it_is_issued(intervened, world, call_at):
    pipe, reference = intervened
    assert run_with_intervention(pipe, world, call_at, 10, CODE_HEAVY)[0] == reference


@pytest.mark.parametrize("call_at", [7, 10])
def test_an_intervention_issued_after_lanes_mixed_past_it_rewinds_them(intervened, call_at):
    """Lanes that compute steps ahead of the trainer (steps_ahead) have mixed past step 10 when the call
    comes: they are rewound to the delivered step, rebuilt at their last sentinel and replayed with the
    intervention, and nothing delivered changes. The call may come as late as the step itself (10)."""
    pipe, reference = intervened
    loader = pipe.build(num_workers=1, steps_ahead=4)
    try:
        hashes = []
        for step in range(STEPS):
            if step == call_at:
                rebuilt = loader.set_mixture(CODE_HEAVY, at_step=10)
            hashes.append(global_digest([next(loader)]))
        assert rebuilt > 0 and hashes == reference
    finally:
        loader.close()


@pytest.mark.parametrize("world", [1, 2])
def test_an_intervention_for_the_next_step_is_exact(intervened, world):
    """The latest call: after step 9 was delivered, for step 10. Synchronous lanes have made no decision
    for step 10 yet, so nothing is replayed, and the run equals the one that knew from the start."""
    pipe, reference = intervened
    hashes, rebuilt = run_with_intervention(pipe, world, 10, 10, CODE_HEAVY)
    assert sum(rebuilt) == 0 and hashes == reference


def test_an_intervention_before_a_checkpoint_is_applied_after_the_resume(intervened):
    pipe, reference = intervened
    hashes, _ = run_with_intervention(pipe, 4, 3, 10, CODE_HEAVY, resume_at=6, resume_world=2)
    assert hashes == reference


@pytest.mark.parametrize("runner", ["pool", "process"])
def test_an_intervention_under_worker_runners(intervened, runner):
    pipe, reference = intervened
    assert run_with_intervention(pipe, 2, 5, 10, CODE_HEAVY, runner=runner, workers=2)[0] == reference


@pytest.mark.parametrize("runner,workers,ahead", [("thread", 0, 0), ("process", 2, 0), ("process", 2, 2)])
def test_counts_go_on_over_an_intervention(intervened, runner, workers, ahead):
    """Lane workers restart at an intervention (from the delivered states, or rewound from steps computed
    ahead) and count from zero there: the loader's metrics still only grow, as the inline lanes' do."""
    pipe, _ = intervened
    loader = pipe.build(num_workers=workers, runner=runner, steps_ahead=ahead)
    try:
        seen = []
        for step in range(STEPS):
            if step == 5:
                loader.set_mixture(CODE_HEAVY, at_step=10)
            next(loader)
            m = loader.metrics()
            seen.append((m["docs"], m["rows_packed"], m["doc_tokens"], m["flushes"]))
        for before, after in zip(seen, seen[1:]):
            assert all(a <= b for a, b in zip(before, after)), (before, after)
        assert seen[-1][0] > seen[5][0] > 0
    finally:
        loader.close()


def test_an_intervention_for_a_delivered_step_is_refused(corpus, tok):
    loader = pipeline(corpus, tok, shuffle=64).build()
    for _ in range(6):
        next(loader)
    with pytest.raises(ValueError, match="already delivered"):
        loader.set_mixture(CODE_HEAVY, at_step=5)
    assert loader.events == []
    loader.set_mixture(CODE_HEAVY, at_step=6)  # the next step: not delivered yet
    assert loader.events == [(6, CODE_HEAVY)]
    with pytest.raises(z.StateError, match="unknown sources"):
        loader.set_mixture({"nope": 1.0}, at_step=40)


def test_ranks_that_disagree_cannot_merge_their_states(corpus, tok):
    pipe = pipeline(corpus, tok)
    a, b = pipe.build(rank=0, world_size=2), pipe.build(rank=1, world_size=2)
    next(a), next(b)
    a.set_mixture(CODE_HEAVY, at_step=20)
    b.set_mixture({"web": 0.5, "code": 0.5}, at_step=20)
    with pytest.raises(z.StateError, match=r"rank 1\).*disagree|disagree.*set_mixture"):
        merge_states([a.state_dict(), b.state_dict()])


WORKER = """
import json, os, sys
import torch.distributed as dist
import zephon as z
dist.init_process_group("gloo")
rank = dist.get_rank()
recipe = z.recipe_from_dict(json.loads(sys.argv[1]))
loader = z.build_loader(recipe)
next(loader)
try:
    loader.set_mixture({"web": 0.5 + 0.1 * rank, "code": 0.5}, at_step=30)
    result = "NO ERROR"
except ValueError as exc:
    result = f"ERROR {exc}"
with open(os.path.join(sys.argv[2], f"rank{rank}.txt"), "w") as f:  # the ranks' stdout lines interleave
    f.write(result)
dist.destroy_process_group()
"""


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_ranks_that_disagree_get_an_error_naming_both(make_recipe, tmp_path):
    """Two real ranks (torchrun, gloo) asking for different weights: each gets an error naming the other."""

    recipe = make_recipe(lanes=4)
    data = {"seed": recipe.seed, "lanes": 4, "seq_len": 64, "batch_per_lane": 2, "flush_every": 2,
            "tokenizer": {"kind": "sentencepiece", "path": recipe.tokenizer.path},
            "read": {"chunk_rows": 4, "chunk_bytes": 1024, "unit_bytes": 4096},
            "sources": [{"name": s.name, "path": list(s.path), "format": s.format, "weight": s.weight}
                        for s in recipe.sources]}
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script), json.dumps(data), str(tmp_path)], capture_output=True, text=True, timeout=170,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    errors = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert all(e.startswith("ERROR") and "ranks disagree" in e for e in errors), errors
    assert any("rank 0 asked" in e and "rank 1 for" in e for e in errors)


# -- recipes ------------------------------------------------------------------------------------------------------
def test_a_recipe_schedule_compiles_to_the_builder_schedule_and_round_trips(corpus, sp_model, make_recipe, tmp_path):
    from .conftest import base_recipe_dict

    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    data["mix"] = {"by": "tokens", "schedule": {"interpolate": "linear", "points": [
        {"step": 0, "weights": {"web": 0.9, "code": 0.1}}, {"step": 50, "weights": {"web": 0.3, "code": 0.7}}]}}
    recipe = z.recipe_from_dict(data)
    pipe = recipe.to_pipeline()
    assert pipe.compile().schedule.weights_at(25) == pytest.approx({"web": 0.6, "code": 0.4})
    (tmp_path / "r.toml").write_text(pipe.to_recipe())
    assert z.load_recipe(tmp_path / "r.toml").to_pipeline().fingerprint == pipe.fingerprint
    assert pipe.fingerprint != make_recipe().to_pipeline().fingerprint  # the schedule is in the fingerprint
    data["mix"]["schedule"]["points"][0]["weights"] = {"web": 1.0, "nope": 1.0}
    with pytest.raises(z.PipelineError, match="unknown sources"):
        z.recipe_from_dict(data).to_pipeline().compile()


def test_schedule_interpolations():
    s = z.Schedule([(0, {"a": 1.0, "b": 0.0}), (10, {"a": 0.0, "b": 1.0})], interpolate="cosine")
    assert s.weights_at(0) == {"a": 1.0, "b": 0.0} and s.weights_at(10) == {"a": 0.0, "b": 1.0}
    assert s.weights_at(5) == pytest.approx({"a": 0.5, "b": 0.5})
    assert s.weights_at(2)["b"] < 0.2  # cosine starts slowly
    with pytest.raises(ValueError, match="after the previous"):
        z.Schedule([(5, {"a": 1.0}), (5, {"a": 1.0})])
    with pytest.raises(ValueError, match="at least one weight"):
        z.Schedule([(0, {"a": 0.0})])
    assert np.isclose(sum(z.Schedule.phases([(0, {"a": 3.0, "b": 1.0})]).table(["a", "b"], [0])[0][1].values()), 1)


def test_inspect_prints_the_schedule_and_plots_it(corpus, sp_model, tmp_path, capsys):
    from zephon.cli import main

    from .conftest import base_recipe_dict
    from .test_megatron import _toml

    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    (tmp_path / "r.toml").write_text(_toml(data) + '\n[mix.schedule]\ninterpolate = "linear"\npoints = [\n'
                                     '{ step = 0, weights = { web = 1.0, code = 0.0 } },\n'
                                     '{ step = 100, weights = { web = 0.25, code = 0.75 } }]\n')
    assert main(["inspect", str(tmp_path / "r.toml"), "--plot", str(tmp_path / "s.png")]) == 0
    out = capsys.readouterr().out
    assert "mixture schedule (linear)" in out and "  100   0.250   0.750" in out
    code_row = next(line for line in out.splitlines() if line.strip().startswith("code |"))
    assert code_row.count(" ") > 2 and "█" not in code_row[:12] and "▆" in code_row  # rises from 0 to 0.75
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

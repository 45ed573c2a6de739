"""Elastic determinism of whole recipes: world sizes, resumes on other world sizes, workers, runners.

Every assertion compares SHA-256 digests of global batches (rank batches concatenated in rank order)
against a single-rank reference; nothing is weakened to pass. Each test also checks that the
mechanism it is about actually happened (flushes occurred, documents were split, both sources
were mixed), so that a recipe too small to exercise it cannot pass vacuously.
"""

from __future__ import annotations

import threading

import pytest

from zephon import WorkPlan, build_loader, global_digest, merge_states
from zephon.verify import global_hashes

from .conftest import tiktoken_options

STEPS = 10


def exercised(recipe, steps: int) -> dict:
    """Metrics of a single-rank run: proof that flushes, splits and mixing took place."""
    loader = build_loader(recipe, rank=0, world_size=1)
    for _ in range(steps):
        next(loader)
    return loader.metrics()


@pytest.mark.parametrize("algorithm", ["best_fit", "first_fit", "wrap"])
def test_world_sizes_agree_for_every_pack_algorithm(make_recipe, algorithm):
    recipe = make_recipe(lanes=32, pack={"algorithm": algorithm})
    plan = WorkPlan(recipe.to_pipeline())
    m = exercised(recipe, STEPS)
    assert m["flushes"] > 0 and len(m["source_token_share"]) == 2
    if algorithm != "wrap":
        assert m["pieces_split"] > 0
    reference = global_hashes(recipe, 1, STEPS, plan=plan)
    assert len(set(reference)) == STEPS  # distinct batches: the stream moves on
    for w in (2, 4, 8, 16, 32):
        assert global_hashes(recipe, w, STEPS, plan=plan) == reference, f"world size {w}"


def test_sixty_four_lanes_on_sixty_four_ranks(make_recipe):
    recipe = make_recipe(lanes=64, batch_per_lane=1)
    plan = WorkPlan(recipe.to_pipeline())
    reference = global_hashes(recipe, 1, 6, plan=plan)
    assert global_hashes(recipe, 64, 6, plan=plan) == reference
    assert global_hashes(recipe, 8, 6, plan=plan) == reference


def _lane_states_per_step(recipe, world_size: int, steps: int) -> list[dict]:
    loaders = [build_loader(recipe, rank=r, world_size=world_size) for r in range(world_size)]
    out = []
    for _ in range(steps):
        for ld in loaders:
            next(ld)
        out.append(merge_states([ld.state_dict() for ld in loaders]))
    return out


def _resume_points(recipe, world_size: int, steps: int) -> tuple[int, int]:
    """A step at which many lanes have just crossed a flush sentinel (epoch changed during the step),
    and a later step at which many lanes sit strictly between two sentinels (epoch > 0, unchanged)."""
    states = _lane_states_per_step(recipe, world_size, steps)
    crossed, between = {}, {}
    for k in range(2, steps + 1):
        before, after = states[k - 2]["lanes"], states[k - 1]["lanes"]
        crossed[k] = sum(after[x]["sentinels"] > before[x]["sentinels"] for x in after)
        between[k] = sum(after[x]["sentinels"] == before[x]["sentinels"] > 0 and after[x]["rows_since_flush"] > 0
                         for x in after)
    k_at = max(crossed, key=lambda k: (crossed[k], -k))
    k_between = max(between, key=lambda k: (between[k], -k))
    assert crossed[k_at] >= 8 and between[k_between] >= 8, (crossed, between)
    return k_at, k_between


@pytest.mark.parametrize("new_world", [8, 32, 64, 16])
def test_resume_on_another_world_size(make_recipe, new_world):
    recipe = make_recipe(lanes=64, flush_every=1)
    plan = WorkPlan(recipe.to_pipeline())
    steps = 14
    reference = global_hashes(recipe, 1, steps, plan=plan)
    for k in _resume_points(recipe, 16, steps - 2):
        resumed = global_hashes(recipe, 16, steps, resume_at=k, resume_world_size=new_world, plan=plan)
        assert resumed == reference, f"16 -> {new_world} at step {k}"


def test_resume_twice_across_world_sizes(make_recipe):
    recipe = make_recipe(lanes=16, shuffle={"buffer": 5}, flush_every=3)
    reference = global_hashes(recipe, 1, 12)
    loaders = [build_loader(recipe, rank=r, world_size=4) for r in range(4)]
    got = [global_digest([next(ld) for ld in loaders]) for _ in range(4)]
    state = merge_states([ld.state_dict() for ld in loaders])
    loaders = [build_loader(recipe, rank=r, world_size=2) for r in range(2)]
    for ld in loaders:
        ld.load_state_dict(state)
    got += [global_digest([next(ld) for ld in loaders]) for _ in range(3)]
    state = merge_states([ld.state_dict() for ld in loaders])
    loader = build_loader(recipe, rank=0, world_size=1)
    loader.load_state_dict(state)
    got += [global_digest([next(loader)]) for _ in range(5)]
    assert got == reference


@pytest.mark.parametrize("runner,workers", [("thread", 1), ("thread", 2), ("thread", 4), ("pool", 2), ("process", 2)])
def test_workers_and_runners_change_nothing(make_recipe, runner, workers):
    recipe = make_recipe(lanes=16, shuffle={"buffer": 4})
    plan = WorkPlan(recipe.to_pipeline())
    reference = global_hashes(recipe, 1, 8, num_workers=0, plan=plan)
    assert global_hashes(recipe, 4, 8, num_workers=workers, runner=runner, plan=plan) == reference


@pytest.mark.parametrize("runner", ["pool", "process"])
def test_resume_with_process_workers_on_other_world_size(make_recipe, runner):
    recipe = make_recipe(lanes=16)
    plan = WorkPlan(recipe.to_pipeline())
    reference = global_hashes(recipe, 1, 8, plan=plan)
    assert global_hashes(recipe, 4, 8, num_workers=2, runner=runner, resume_at=4, resume_world_size=2,
                         plan=plan) == reference


@pytest.mark.parametrize("overrides", [
    {"mix": {"by": "documents"}},
    {"shuffle": {"buffer": 8}},
    {"pack": {"algorithm": "wrap"}, "split": {"max_doc_tokens": 40}},
    {"tokenizer": {"add_bos": True}},
    {"sources": "single"},
], ids=["mix-by-documents", "shuffle", "wrap-with-split", "bos", "single-source"])
def test_options_stay_elastic(make_recipe, overrides):
    if overrides.get("sources") == "single":
        base = make_recipe()
        overrides = {"sources": [{"name": "web", "path": list(base.sources[0].path), "format": "parquet"}]}
    recipe = make_recipe(**overrides)
    plan = WorkPlan(recipe.to_pipeline())
    reference = global_hashes(recipe, 1, 8, plan=plan)
    assert global_hashes(recipe, 8, 8, plan=plan) == reference
    assert global_hashes(recipe, 2, 8, resume_at=3, resume_world_size=16, plan=plan) == reference


def test_each_tokenizer_kind_is_elastic(make_recipe, hf_tokenizer, tiktoken_file, sp_model):
    digests = {}
    for tok in ({"kind": "huggingface", "path": str(hf_tokenizer)},
                {"kind": "tiktoken", "path": str(tiktoken_file), **tiktoken_options(tiktoken_file)},
                {"kind": "sentencepiece", "path": str(sp_model)}):
        recipe = make_recipe(tokenizer=tok)
        plan = WorkPlan(recipe.to_pipeline())
        reference = global_hashes(recipe, 1, 6, plan=plan)
        assert global_hashes(recipe, 4, 6, resume_at=2, resume_world_size=16, plan=plan) == reference
        digests[tok["kind"]] = reference[0]
    assert len(set(digests.values())) == 3  # three real, different tokenizations


def test_seed_changes_the_data(make_recipe):
    a = global_hashes(make_recipe(seed=1), 1, 3)
    b = global_hashes(make_recipe(seed=2), 1, 3)
    assert a != b


def test_the_rank_pipeline_is_a_torchdata_node(make_recipe):
    """``loader.node`` works under torchdata's own ``Loader``, including its state_dict/restore."""
    from torchdata.nodes import Loader

    recipe = make_recipe(lanes=8)
    reference = global_hashes(recipe, 1, 6)
    ranks = [build_loader(recipe, rank=r, world_size=2) for r in range(2)]
    wrapped = [iter(Loader(ld.node)) for ld in ranks]
    got = [global_digest([next(w) for w in wrapped]) for _ in range(3)]
    state = merge_states([ld.node.state_dict() for ld in ranks])
    single = build_loader(recipe)
    single.node.reset(state)
    got += [global_digest([next(single.node)]) for _ in range(3)]
    assert got == reference


def _keep_long(text: str) -> bool:
    return len(text) > 80


def test_text_hooks_run_on_workers_and_stay_elastic(make_recipe):
    recipe = make_recipe(lanes=8)
    plan = WorkPlan(recipe.to_pipeline())
    plain = global_hashes(recipe, 1, 4, plan=plan)
    one = build_loader(recipe, text_filter=_keep_long)
    filtered = [global_digest([next(one)]) for _ in range(4)]
    assert filtered != plain and one.metrics()["skipped_records"] > 0
    for runner in ("pool", "process"):
        ranks = [build_loader(recipe, rank=r, world_size=2, num_workers=1, runner=runner, text_filter=_keep_long)
                 for r in range(2)]
        try:
            assert [global_digest([next(ld) for ld in ranks]) for _ in range(4)] == filtered, runner
        finally:
            for ld in ranks:
                ld.close()
        with pytest.raises(ValueError, match="Define it at module level"):  # refused when the pipeline is built
            build_loader(recipe, num_workers=1, runner=runner, text_filter=lambda t: True)


def test_metrics_after_a_resume_count_only_the_new_work(make_recipe):
    """Inline, the work done is a function of the rows requested: a loader resumed at step s and run
    for k steps must count exactly the continuous run's work between steps s and s+k, not the replay."""
    recipe = make_recipe()
    keys = ("docs", "doc_tokens", "rows_packed", "flushes", "units", "pieces_split")
    cont = build_loader(recipe, rank=0, world_size=1)
    it = iter(cont)
    for _ in range(5):
        next(it)
    state, at_s = cont.state_dict(), cont.metrics()
    assert any(v["rows_since_flush"] > 0 for v in state["lanes"].values())  # a real replay happens
    for _ in range(4):
        next(it)
    at_sk = cont.metrics()
    resumed = build_loader(recipe, rank=0, world_size=1)
    resumed.load_state_dict(state)
    rit = iter(resumed)
    for _ in range(4):
        next(rit)
    got = resumed.metrics()
    assert {k: got[k] for k in keys} == {k: at_sk[k] - at_s[k] for k in keys}
    assert got["flushes"] > 0 and got["docs"] > 0


def _refuse_main_thread(text: str) -> bool:
    if threading.current_thread() is threading.main_thread():
        raise RuntimeError("a chunk was tokenized on a main thread")
    return True


@pytest.fixture(scope="module")
def long_doc_recipe(tmp_path_factory, corpus_texts, sp_model):
    """One Parquet source of ~2,000-character documents: every 64-row chunk is far above
    zephon.engine.stages.OFF_MAIN_MIN_CHARS, so every chunk is worth the helper thread."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from zephon import recipe_from_dict

    root = tmp_path_factory.mktemp("long_docs")
    pool = " ".join(corpus_texts)
    docs = [pool[i * 997:i * 997 + 2000] for i in range(192)]
    pq.write_table(pa.table({"text": docs}), root / "long.parquet", row_group_size=64)
    return recipe_from_dict({
        "seed": 3, "lanes": 2, "seq_len": 64, "batch_per_lane": 2, "flush_every": 2,
        "tokenizer": {"kind": "sentencepiece", "path": str(sp_model)},
        "sources": [{"name": "long", "path": str(root / "long.parquet"), "format": "parquet", "text_field": "text"}],
    })


@pytest.mark.parametrize("runner,workers", [("thread", 0), ("thread", 1), ("pool", 1), ("process", 1)])
def test_large_chunks_are_never_tokenized_on_a_main_thread(long_doc_recipe, runner, workers):
    """glibc serves main threads from its slower main malloc arena (zephon.engine.stages.run_off_main_thread),
    so inline, in a pool process or in a lane process, a large chunk's hooks and tokenizer run on a helper
    thread. The hook runs where the tokenizer runs, and refuses a main thread."""
    from zephon.engine.stages import OFF_MAIN_MIN_CHARS

    assert 64 * 2000 > OFF_MAIN_MIN_CHARS
    expected = global_hashes(long_doc_recipe, 1, 3)
    loader = build_loader(long_doc_recipe, num_workers=workers, runner=runner, text_filter=_refuse_main_thread)
    try:
        assert [global_digest([next(loader)]) for _ in range(3)] == expected
    finally:
        loader.close()


_THREADS_SEEN: list[str] = []


def _where_it_runs(text: str) -> bool:
    _THREADS_SEEN.append(threading.current_thread().name)
    return True


def test_small_chunks_stay_on_the_calling_thread(make_recipe, monkeypatch):
    """Below OFF_MAIN_MIN_CHARS the hand-off costs more than it saves: the chunk stays where it is,
    and moving it changes nothing in the output."""
    from zephon.engine import stages as stages_mod

    recipe = make_recipe(lanes=2)
    seen = _THREADS_SEEN
    seen.clear()
    program = recipe.to_pipeline(text_filter=_where_it_runs).compile()
    task = next(program.plan.sources[0].chunk_tasks(0, 0, -1))
    stay = program.stages.run(0, 0, task)
    assert seen and set(seen) == {threading.main_thread().name}
    seen.clear()
    monkeypatch.setattr(stages_mod, "OFF_MAIN_MIN_CHARS", 0)
    moved = program.stages.run(0, 0, task)
    assert seen and all(name.startswith("zephon-chunk-inline") for name in seen)
    assert (stay.token_fields["input_ids"].tobytes(), stay.offsets.tobytes(), stay.resume_cursor.tobytes()) == \
        (moved.token_fields["input_ids"].tobytes(), moved.offsets.tobytes(), moved.resume_cursor.tobytes())

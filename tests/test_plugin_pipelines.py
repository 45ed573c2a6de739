"""The Torchtitan and Megatron-LM plugins take builder pipelines and mixture schedules, and expose the
loss-driven intervention hook (``set_mixture``) to the training loop.

A builder pipeline reaches a plugin as an object (a Python config) or as ``package.module:name`` on its
command line; it must give the same global batches as the recipe that spells the same graph. A recipe
with ``[mix.schedule]`` runs through both plugins, and ``set_mixture`` called from the training loop
changes the mixture from the step it names.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tests.optional import require

import zephon
from zephon.verify import global_hashes

from .conftest import base_recipe_dict
from .test_megatron import _toml

SEQ = 64


def make_pipe(positions: str = "1d") -> zephon.Pipeline:
    """The suite's base recipe as a builder pipeline (paths from the environment the fixture sets)."""
    corpus, tok = os.environ["ZEPHON_TEST_CORPUS"], zephon.tokenizer(os.environ["ZEPHON_TEST_SP"])
    return (zephon.Pipeline(seed=7, lanes=8, flush_every=1)
            .source("web", zephon.read.parquet(f"{corpus}/web", chunk_rows=4), weight=0.7)
            .source("code", zephon.read.jsonl(f"{corpus}/code/*.jsonl", chunk_bytes=1024, unit_bytes=4096), weight=0.3)
            .tokenize(tok).split(max_tokens=SEQ).mix(by="tokens")
            .pack(seq_len=SEQ, algorithm="best_fit", max_open_bins=4).batch(rows_per_lane=2, positions=positions))


def make_mrope_pipe() -> zephon.Pipeline:
    """The same with 3-D (mrope) positions: ``position_ids`` ``[3, B, S]``."""
    return make_pipe(positions="mrope")


@pytest.fixture(scope="module")
def paths(corpus, sp_model, tmp_path_factory):
    os.environ["ZEPHON_TEST_CORPUS"], os.environ["ZEPHON_TEST_SP"] = str(corpus), str(sp_model)
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    data.update(lanes=8, batch_per_lane=2, flush_every=1)
    root = tmp_path_factory.mktemp("plugins")
    (root / "recipe.toml").write_text(_toml(data))
    schedule = ('\n[mix.schedule]\ninterpolate = "step"\npoints = [{ step = 0, weights = { web = 1.0, code = 0.0 } }, '
                '{ step = 3, weights = { web = 0.5, code = 0.5 } }]\n')
    (root / "curriculum.toml").write_text(_toml(data) + schedule)
    return root


def test_the_builder_pipeline_is_the_recipe(paths):
    recipe = zephon.load_recipe(paths / "recipe.toml")
    assert make_pipe().fingerprint == recipe.to_pipeline().fingerprint
    assert zephon.load_pipeline("tests.test_plugin_pipelines:make_pipe").fingerprint == make_pipe().fingerprint


# -- Torchtitan ---------------------------------------------------------------------------------------------
torchtitan = require("zephon_torchtitan.dataloader") if not os.environ.get("ZEPHON_REQUIRE_TORCHTITAN") \
    else __import__("zephon_torchtitan.dataloader").dataloader


def tt_loader(recipe, dp: int = 1, rank: int = 0):
    cfg = torchtitan.ZephonDataLoader.Config(recipe=recipe)
    return cfg.build(dp_world_size=dp, dp_rank=rank, tokenizer=None, seq_len=SEQ, local_batch_size=16 // dp)


def tt_hashes(recipe, steps: int = 4) -> list[str]:
    ld = tt_loader(recipe)
    it = iter(ld)
    out = []
    for _ in range(steps):
        inputs, labels = next(it)
        out.append(zephon.global_digest([{"input_ids": inputs["input"], "labels": labels,
                                          "position_ids": labels, "segment_ids": labels, "loss_mask": labels}]))
    ld.close()
    return out


def test_torchtitan_takes_a_pipeline_object_or_reference(paths):
    by_path = tt_hashes(str(paths / "recipe.toml"))
    assert tt_hashes(make_pipe()) == by_path
    assert tt_hashes("tests.test_plugin_pipelines:make_pipe") == by_path
    cfg = torchtitan.ZephonDataLoader.Config(recipe="tests.test_plugin_pipelines:make_pipe", seed=8)
    assert cfg.load_recipe().seed == 8  # the overrides apply to a pipeline too


def test_torchtitan_runs_a_schedule_and_takes_an_intervention(paths):
    ld = tt_loader(str(paths / "curriculum.toml"))
    it = iter(ld)
    next(it)
    assert ld.metrics()["mixture_weights"] == {"web": 1.0, "code": 0.0}
    ld.set_mixture({"web": 0.2, "code": 0.8}, at_step=6)
    for _ in range(6):
        next(it)
    assert ld.metrics()["mixture_weights"] == pytest.approx({"web": 0.2, "code": 0.8})
    state = ld.state_dict()
    assert '"events"' in state["zephon"]  # the intervention travels in the checkpoint header
    ld.close()


# -- Megatron-LM ----------------------------------------------------------------------------------------------
def _megatron_args(recipe, **kw):
    base = {"zephon_recipe": str(recipe), "zephon_valid_recipe": None, "zephon_num_workers": 0,
            "zephon_runner": "thread", "zephon_prefetch": None, "zephon_cu_seqlens": False,
            "zephon_ignore_data_state": False, "dataloader_type": "external", "micro_batch_size": 4,
            "global_batch_size": 16, "seq_length": SEQ, "rampup_batch_size": None, "eval_iters": 0,
            "create_attention_mask_in_dataloader": False, "reset_attention_mask": False, "reset_position_ids": True,
            "iteration": 0, "load": None, "save": None, "non_persistent_ckpt_type": None,
            "non_persistent_global_ckpt_dir": None}
    base.update(kw)
    return SimpleNamespace(**base)


def test_megatron_takes_a_pipeline_reference_and_the_intervention_hook(paths):
    zm = require("zephon_megatron")
    zm.reset()
    lay = zm.Layout(0, 1, micro_batch_size=4, num_microbatches=4)
    train, _, _ = zm.build_data_iterators(_megatron_args("tests.test_plugin_pipelines:make_pipe"), lay)
    try:
        for _ in range(2 * 4):
            next(train)  # two iterations of four micro-batches
        assert train.loader.fingerprint == make_pipe().fingerprint
        assert zm.set_mixture({"web": 0.1, "code": 0.9}, at_iteration=5) >= 0
        assert train.loader.events == [(5, {"web": 0.1, "code": 0.9})]
        assert train.loader.mixture_weights(5) == pytest.approx({"web": 0.1, "code": 0.9})
    finally:
        train.loader.close()
        zm.reset()


def test_megatron_runs_a_schedule_recipe(paths):
    zm = require("zephon_megatron")
    zm.reset()
    lay = zm.Layout(0, 1, micro_batch_size=4, num_microbatches=4)
    train, _, _ = zm.build_data_iterators(_megatron_args(paths / "curriculum.toml"), lay)
    try:
        for _ in range(4 * 4):
            next(train)
        assert train.loader.metrics()["mixture_weights"] == pytest.approx({"web": 0.5, "code": 0.5})
    finally:
        train.loader.close()
        zm.reset()
    recipe = zephon.load_recipe(paths / "curriculum.toml")
    assert global_hashes(recipe, 4, 6) == global_hashes(recipe, 1, 6)


# -- batches a text trainer cannot take ------------------------------------------------------------------------
def test_torchtitan_refuses_mrope_positions_when_built(paths):
    with pytest.raises(ValueError, match=r"batch\(pixels='lists', positions='mrope'\).*zephon_megatron"):
        tt_loader("tests.test_plugin_pipelines:make_mrope_pipe")


def test_megatron_takes_mrope_positions_with_reset_position_ids_only(paths):
    zm = require("zephon_megatron")
    zm.reset()
    lay = zm.Layout(0, 1, micro_batch_size=4, num_microbatches=4)
    ref = "tests.test_plugin_pipelines:make_mrope_pipe"
    with pytest.raises(zm.ZephonMegatronError, match="--zephon-recipe: .*--reset-position-ids"):
        zm.build_data_iterators(_megatron_args(ref, reset_position_ids=False), lay)
    train, _, _ = zm.build_data_iterators(_megatron_args(ref), lay)
    try:
        step = zephon.build_loader(make_mrope_pipe(), rank=0, world_size=1)
        want = next(step)["position_ids"]
        step.close()
        got = [next(train)["position_ids"] for _ in range(4)]
        assert all(g.shape == (3, 4, SEQ) for g in got)
        assert torch.equal(torch.cat(got, dim=1), want)  # micro-batches cut on the batch dimension
    finally:
        train.loader.close()
        zm.reset()
    from zephon_megatron.pretrain_gpt import main as pretrain_gpt

    with pytest.raises(SystemExit, match="trains a text GPT"):  # before any Megatron-LM checkout is needed
        pretrain_gpt(["--zephon-recipe", ref])

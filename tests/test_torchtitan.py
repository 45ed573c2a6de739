"""Torchtitan plugin, unit level: ``ZephonDataLoader`` built through ``Config.build`` as the trainer does.

- the global batches are identical for dp degrees 1, 2, 4, 8 (and equal to Zephon's own batches);
- state round-trips through ``torch.distributed.checkpoint``: written by two gloo processes (dp 2), read
  back at dp 1, 4 and 8; written at dp 1, read back by two gloo processes; identical continuations;
- trainer settings that do not fit the recipe are refused with the setting to change.

Needs ``torchtitan`` (the ``zephon[torchtitan]`` extra); skipped without it unless
``ZEPHON_REQUIRE_TORCHTITAN=1`` (CI), which turns the skip into a failure.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.optional import require

from .conftest import base_recipe_dict

if os.environ.get("ZEPHON_REQUIRE_TORCHTITAN") == "1":
    import torchtitan  # noqa: F401  (CI: a missing extra is a failure, not a skip)
else:
    require("torchtitan", reason="needs the zephon[torchtitan] extra")

try:
    import zephon_torchtitan  # installed by the zephon[torchtitan] extra
except ImportError:  # a plain checkout: the plugin lives in plugins/torchtitan
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "torchtitan"))
    import zephon_torchtitan  # noqa: F401

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.loss import IGNORE_INDEX  # noqa: E402
from zephon_torchtitan import ZephonDataLoader, ZephonTokenizer  # noqa: E402
from zephon_torchtitan.dataloader import row_digests  # noqa: E402

import zephon  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # no_dist loads

LANES, BPL, SEQ = 8, 2, 64  # global batch: 16 rows of 64 tokens
K, N = 3, 3                 # steps before the checkpoint, steps compared after it
MICRO = {1: 4, 2: 8, 4: 2, 8: 1}  # local_batch_size per dp degree: accumulation 4, 1, 2, 2 micro-batches


# -- helpers -------------------------------------------------------------------------------------------
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(v)


def write_recipe(path: Path, data: dict[str, Any]) -> Path:
    """A recipe dict (the fixtures' structure) as a TOML file."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, (dict, list))]
    for k, v in data.items():
        if isinstance(v, dict):
            lines += [f"[{k}]"] + [f"{kk} = {_toml_value(vv)}" for kk, vv in v.items()]
    for src in data.get("sources", []):
        lines += ["[[sources]]"] + [f"{kk} = {_toml_value(vv)}" for kk, vv in src.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory, corpus, sp_model) -> Path:
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    data.update(lanes=LANES, batch_per_lane=BPL, seq_len=SEQ, flush_every=2)
    return write_recipe(tmp_path_factory.mktemp("tt") / "recipe.toml", data)


def build(recipe: Path, dp: int, rank: int, local_batch_size: int | None = None, **fields: Any) -> ZephonDataLoader:
    """Exactly what Torchtitan's trainer does (plus a keyword it passes that Zephon ignores)."""
    cfg = ZephonDataLoader.Config(recipe=str(recipe), **fields)
    return cfg.build(dp_world_size=dp, dp_rank=rank, tokenizer=None, seq_len=SEQ,
                     local_batch_size=local_batch_size or MICRO[dp], snapshot_every_n_steps=10,
                     some_future_kwarg=object())


def take_steps(loaders: list[ZephonDataLoader], iters: list, steps: int) -> list[list[str]]:
    """``steps`` global batches as the ranks' row digests, concatenated in rank order."""
    out = []
    for _ in range(steps):
        rows: list[str] = []
        for ld, it in zip(loaders, iters):
            for _ in range(ld.micro_batches):
                inputs, labels = next(it)
                rows += row_digests(inputs, labels)
        out.append(rows)
    return out


def run_degree(recipe: Path, dp: int, steps: int) -> list[list[str]]:
    loaders = [build(recipe, dp, r) for r in range(dp)]
    return take_steps(loaders, [iter(ld) for ld in loaders], steps)


@pytest.fixture(scope="module")
def reference(recipe_path) -> list[list[str]]:
    return run_degree(recipe_path, 1, K + N)


# -- batches -------------------------------------------------------------------------------------------
def test_is_a_torchtitan_dataloader_and_yields_what_the_trainer_consumes(recipe_path):
    assert issubclass(ZephonDataLoader, BaseDataLoader)
    assert "__slots__" in ZephonDataLoader.Config.__dict__
    ld = build(recipe_path, 2, 1)
    assert ld.lanes == range(4, 8) and ld.micro_batches == 1
    (inputs, labels), = [next(iter(ld))]
    assert set(inputs) == {"input", "positions"}
    for t in (inputs["input"], inputs["positions"], labels):
        assert t.dtype == torch.int64 and t.shape == (LANES // 2 * BPL, SEQ)

    # the same rows as Zephon's own loader, in Torchtitan's vocabulary
    z = next(zephon.build_loader(zephon.load_recipe(recipe_path), rank=1, world_size=2))
    assert torch.equal(inputs["input"], z["input_ids"])
    assert torch.equal(labels, z["labels"].masked_fill(z["labels"] == zephon.IGNORE, IGNORE_INDEX))
    real = z["segment_ids"] != 0
    assert torch.equal(inputs["positions"][real], z["position_ids"][real])  # restart at every document
    starts = (inputs["positions"] == 0) & real
    seg = z["segment_ids"]
    seg_starts = real & torch.cat([torch.ones_like(real[:, :1]), seg[:, 1:] != seg[:, :-1]], 1)
    assert torch.equal(starts, seg_starts)
    pad = ~real
    assert (labels[pad] == IGNORE_INDEX).all()
    for b in range(pad.shape[0]):  # the padding tail is one segment: 0, 1, 2, ...
        tail = inputs["positions"][b][pad[b]]
        assert torch.equal(tail, torch.arange(len(tail)))


def test_a_batch_with_images_is_refused_not_stripped(recipe_path):
    """Torchtitan's text trainer would drop the pixels (or its pipeline schedule cut them wrongly): refused."""
    from zephon_torchtitan import to_torchtitan

    z = next(zephon.build_loader(zephon.load_recipe(recipe_path), rank=0, world_size=1))
    to_torchtitan(z)  # a text batch is taken
    with_pixels = {**z, "pixel_values": torch.zeros(4, 12, dtype=torch.uint8), "image_row": torch.zeros(1)}
    with pytest.raises(ValueError, match="pixel_values, image_row.*zephon_megatron"):
        to_torchtitan(with_pixels)
    mrope = {**z, "position_ids": z["position_ids"].expand(3, -1, -1)}
    with pytest.raises(ValueError, match=r"mrope position_ids \[3, B, S\]"):
        to_torchtitan(mrope)


def test_global_batches_identical_for_dp_degrees_1_2_4_8(recipe_path, reference):
    assert all(len(rows) == LANES * BPL for rows in reference)
    assert len({tuple(r) for r in reference}) == len(reference)  # the steps differ from each other
    for dp in (2, 4, 8):
        assert run_degree(recipe_path, dp, K + N) == reference, f"dp degree {dp}"


# -- checkpoints through torch.distributed.checkpoint ------------------------------------------------------
def _gloo_worker(rank: int, world: int, pg_file: str, recipe: str, ckpt: str, mode: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=rank, world_size=world)
    try:
        ld = build(Path(recipe), world, rank)
        it = iter(ld)
        if mode == "save":  # train K steps, then the checkpointer's dcp.save({"dataloader": ...})
            take_steps([ld], [it], K)
            dcp.save({"dataloader": ld}, checkpoint_id=ckpt)
        else:  # the checkpointer's dcp.load: each rank asks for its own lanes only
            dcp.load({"dataloader": ld}, checkpoint_id=ckpt)
            assert ld.step == K
            rows = take_steps([ld], [iter(ld)], N)
            Path(out, f"rank{rank}.json").write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _run_gloo(world: int, tmp: Path, recipe: Path, ckpt: Path, mode: str) -> None:
    # forkserver: children fork from one clean server that imported torch/torchtitan once (~10 s),
    # not from this process (its threads) and not a fresh interpreter each (spawn: ~10 s per child).
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "torchtitan.components.dataloader",
                                "zephon", __name__])
    procs = [ctx.Process(target=_gloo_worker, args=(r, world, str(tmp / f"pg-{mode}"), str(recipe), str(ckpt),
                                                    mode, str(tmp))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * world


def _saved_keys(ckpt: Path) -> list[str]:
    return sorted(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)


@pytest.mark.e2e
def test_dcp_saved_by_two_gloo_ranks_resumes_at_dp_1_4_8(tmp_path, recipe_path, reference):
    ckpt = tmp_path / "step-3"
    _run_gloo(2, tmp_path, recipe_path, ckpt, "save")
    # keyed by lane, not by rank: any degree dividing the lanes finds its entries
    assert _saved_keys(ckpt) == [f"dataloader.lane_{i:05d}" for i in range(LANES)] + ["dataloader.zephon"]
    for dp in (1, 4, 8):
        loaders = [build(recipe_path, dp, r) for r in range(dp)]
        for ld in loaders:  # no process group: each simulated rank reads the folder on its own
            dcp.load({"dataloader": ld}, checkpoint_id=str(ckpt), no_dist=True)
            assert ld.step == K
        assert take_steps(loaders, [iter(ld) for ld in loaders], N) == reference[K:], f"dp degree {dp}"


@pytest.mark.e2e
def test_dcp_saved_at_dp_1_resumes_on_two_gloo_ranks(tmp_path, recipe_path, reference):
    ld = build(recipe_path, 1, 0)
    take_steps([ld], [iter(ld)], K)
    ckpt = tmp_path / "step-3"
    dcp.save({"dataloader": ld}, checkpoint_id=str(ckpt), no_dist=True)
    _run_gloo(2, tmp_path, recipe_path, ckpt, "load")
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [a + b for a, b in zip(*per_rank)] == reference[K:]


def test_state_dict_round_trip_in_memory_and_foreign_recipe_refused(tmp_path, recipe_path, reference, corpus, sp_model):
    ld = build(recipe_path, 4, 2)
    take_steps([ld], [iter(ld)], 2)
    sd = ld.state_dict()
    assert sorted(sd) == ["lane_00004", "lane_00005", "zephon"]
    assert all(isinstance(v, str) for v in sd.values())
    ld2 = build(recipe_path, 8, 4)  # lane 4 of 8: a subset of the entries is enough
    ld2.load_state_dict({k: v for k, v in sd.items() if k != "lane_00005"})
    assert ld2.step == 2
    ld2.load_state_dict({})  # Torchtitan's "nothing to load" is a no-op

    other = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    other.update(lanes=LANES, batch_per_lane=BPL, seq_len=SEQ, flush_every=2, seed=99)
    foreign = build(write_recipe(tmp_path / "other.toml", other), 4, 2)
    with pytest.raises(zephon.StateError, match="seed"):
        foreign.load_state_dict(sd)
    with pytest.raises(zephon.StateError, match="no 'zephon' header"):
        foreign.load_state_dict({"dp_rank_0": b"...", "world_size": 4})


def test_overrides_and_max_steps(recipe_path, reference):
    seeded = build(recipe_path, 1, 0, seed=1234)
    assert seeded.recipe.seed == 1234
    assert take_steps([seeded], [iter(seeded)], 1)[0] != reference[0]
    # the validator does dataclasses.replace(config, infinite=...): the field exists and max_steps ends it
    cfg = dataclasses.replace(ZephonDataLoader.Config(recipe=str(recipe_path), max_steps=2), infinite=False)
    ld = cfg.build(dp_world_size=2, dp_rank=0, tokenizer=None, seq_len=SEQ, local_batch_size=4)
    assert len(list(ld)) == 2 * 2  # 2 global batches of 2 micro-batches
    with pytest.raises(ValueError, match="max_steps"):
        dataclasses.replace(cfg, max_steps=0).build(dp_world_size=1, dp_rank=0, seq_len=SEQ, local_batch_size=16)


# -- refusals --------------------------------------------------------------------------------------------
def test_settings_that_do_not_fit_are_refused_with_the_fix(recipe_path):
    cfg = ZephonDataLoader.Config(recipe=str(recipe_path))
    with pytest.raises(ValueError, match=r"--training\.seq_len 64"):
        cfg.build(dp_world_size=1, dp_rank=0, seq_len=2048, local_batch_size=16)
    with pytest.raises(ValueError, match=r"8 rows per global step.*--training\.local_batch_size to 8 or a divisor "
                                         r"of it \(\[1, 2, 4, 8\]\).*--training\.global_batch_size 16"):
        cfg.build(dp_world_size=2, dp_rank=0, seq_len=SEQ, local_batch_size=3)
    with pytest.raises(ValueError, match=r"local_batch_size=16 does not fit"):
        cfg.build(dp_world_size=2, dp_rank=0, seq_len=SEQ, local_batch_size=16)
    with pytest.raises(ValueError, match=r"degree 3 does not divide the recipe's lanes = 8.*\[1, 2, 4, 8\]"):
        cfg.build(dp_world_size=3, dp_rank=0, seq_len=SEQ, local_batch_size=1)
    with pytest.raises(ValueError, match=r"--dataloader\.recipe"):
        ZephonDataLoader.Config().build(dp_world_size=1, dp_rank=0, seq_len=SEQ, local_batch_size=1)

    # a checkpoint in the middle of a global batch means the trainer's step is smaller than the recipe's
    ld = cfg.build(dp_world_size=1, dp_rank=0, seq_len=SEQ, local_batch_size=4)
    next(iter(ld))
    with pytest.raises(RuntimeError, match=r"after 1 of the 4 micro-batches.*--training\.global_batch_size 16"):
        ld.state_dict()


# -- tokenizer ---------------------------------------------------------------------------------------------
def test_recipe_can_use_the_trainers_hugging_face_tokenizer(tmp_path, corpus, hf_tokenizer):
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "tokenizer.json").write_bytes(hf_tokenizer.read_bytes())
    trainer_tok = ZephonTokenizer.Config().build(tokenizer_path=str(assets))  # as the trainer builds it
    assert trainer_tok.hf is not None and trainer_tok.get_vocab_size() == 700

    data = base_recipe_dict(corpus, {"kind": "huggingface", "path": "@hf_assets_path"})
    data.update(lanes=4, batch_per_lane=1, seq_len=SEQ)
    cfg = ZephonDataLoader.Config(recipe=str(write_recipe(tmp_path / "hf.toml", data)))
    ld = cfg.build(dp_world_size=1, dp_rank=0, tokenizer=trainer_tok, seq_len=SEQ, local_batch_size=4)
    direct = dict(data, tokenizer={"kind": "huggingface", "path": str(hf_tokenizer)})
    ld2 = ZephonDataLoader.Config(recipe=str(write_recipe(tmp_path / "direct.toml", direct))).build(
        dp_world_size=1, dp_rank=0, seq_len=SEQ, local_batch_size=4)
    assert ld.recipe.tokenizer.path == str((assets / "tokenizer.json").resolve())
    a, b = next(iter(ld)), next(iter(ld2))
    assert torch.equal(a[0]["input"], b[0]["input"]) and int(a[0]["input"].max()) < 700

    with pytest.raises(Exception, match="hf_assets_path"):  # the recipe asks, the trainer has no tokenizer dir
        cfg.build(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=SEQ, local_batch_size=4)
    empty = ZephonTokenizer.Config().build(tokenizer_path=str(tmp_path / "none"))
    with pytest.raises(RuntimeError, match="recipe's tokenizer"):
        empty.encode("text")


def test_provenance_stays_out_of_the_model_inputs_and_is_kept_for_the_user(recipe_path, tmp_path):
    # Torchtitan's trainer passes every input key on to the model's forward: the provenance is kept aside
    text = recipe_path.read_text().replace("seed =", "provenance = true\nseed =", 1)
    with_prov = tmp_path / "recipe.toml"
    with_prov.write_text(text)
    ld = build(with_prov, 2, 1)
    inputs, _ = next(iter(ld))
    assert set(inputs) == {"input", "positions"}
    z = next(zephon.build_loader(zephon.load_recipe(with_prov), rank=1, world_size=2))
    assert torch.equal(ld.last_provenance, z["provenance"])
    assert set(ld.last_provenance[:, 0].tolist()) == set(range(LANES // 2 * BPL, LANES * BPL))

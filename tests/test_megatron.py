"""zephon_megatron: the Megatron-LM dataset provider, its checks and its elastic data-state save.

The end-to-end test runs the provider under ``torchrun --nproc_per_node=2`` (gloo, CPU) against the
real megatron-core ``parallel_state`` at tensor-parallel sizes 1 and 2 and pipeline size 2, saving at
data-parallel size 2 and resuming at 1, then saving at 1 and resuming at 2. The other tests run in
this process with explicit layouts (no process group). Megatron-LM's ``pretrain_gpt`` itself needs
GPUs and is not run; the launcher's wiring is checked against a stand-in Megatron-LM checkout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import zephon

from .conftest import base_recipe_dict

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "plugins" / "megatron"
if importlib.util.find_spec("zephon_megatron") is None:  # not installed (pip install -e '.[megatron]')
    sys.path.insert(0, str(PLUGIN))

import zephon_megatron
from zephon_megatron import Layout, ZephonMegatronError, build_data_iterators, check_fit
from zephon_megatron.batches import row_cu_seqlens
from zephon_megatron.checkpoint import data_state_dir, read_data_state, write_data_state


def _megatron_core_version() -> str | None:
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "unknown (megatron.core importable, no megatron-core distribution)"


MEGATRON_CORE = _megatron_core_version()
needs_megatron_core = pytest.mark.skipif(
    MEGATRON_CORE is None and not os.environ.get("CI"),
    reason="megatron-core is not installed (pip install -e '.[megatron]'); CI installs it and runs this")


@pytest.fixture(autouse=True)
def _reset_provider():
    yield
    zephon_megatron.reset()


def _toml(data: dict) -> str:
    """A recipe dict as TOML (scalars, tables, and the [[sources]] array of tables)."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v) if isinstance(v, str) else repr(v)

    lines = [f"{k} = {value(v)}" for k, v in data.items() if not isinstance(v, (dict, list))]
    for k, v in data.items():
        if isinstance(v, dict):
            lines += [f"[{k}]"] + [f"{kk} = {value(vv)}" for kk, vv in v.items()]
    for k, v in data.items():
        if isinstance(v, list) and v and isinstance(v[0], dict):
            for item in v:
                lines += [f"[[{k}]]"] + [f"{kk} = {value(vv)}" for kk, vv in item.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture
def recipe_file(tmp_path, corpus, sp_model):
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    data.update(lanes=8, batch_per_lane=2, flush_every=1)
    path = tmp_path / "recipe.toml"
    path.write_text(_toml(data))
    return path, data


def _load(path) -> zephon.Recipe:
    return zephon.load_recipe(str(path))


def _args(recipe_path, **kw):
    base = {"zephon_recipe": str(recipe_path), "zephon_valid_recipe": None, "zephon_num_workers": 0,
            "zephon_runner": "thread", "zephon_prefetch": None, "zephon_cu_seqlens": False,
            "zephon_ignore_data_state": False, "dataloader_type": "external", "micro_batch_size": 4,
            "global_batch_size": 16, "seq_length": 64, "rampup_batch_size": None, "eval_iters": 0,
            "create_attention_mask_in_dataloader": False, "reset_attention_mask": False, "reset_position_ids": True,
            "iteration": 0, "load": None, "save": None, "non_persistent_ckpt_type": None,
            "non_persistent_global_ckpt_dir": None}
    base.update(kw)
    return SimpleNamespace(**base)


# -- configuration checks -----------------------------------------------------------------------------
def test_misfits_name_the_number_to_change(make_recipe):
    r = make_recipe(lanes=8, batch_per_lane=2)  # global batch 16, seq_len 64
    ok = Layout(dp_rank=0, dp_size=2, micro_batch_size=4, num_microbatches=2)
    assert check_fit(r, ok, seq_length=64, global_batch_size=16) == 8

    def err(layout=ok, **kw):
        kw = {"seq_length": 64, "global_batch_size": 16, **kw}
        with pytest.raises(ZephonMegatronError) as e:
            check_fit(r, layout, **kw)
        return str(e.value)

    assert "Set --seq-length 64" in err(seq_length=128)
    assert "Set --global-batch-size 16" in err(global_batch_size=32)
    assert "Remove --rampup-batch-size" in err(rampup_batch_size=[4, 4, 100])
    m = err(Layout(dp_rank=0, dp_size=3, micro_batch_size=1, num_microbatches=5))
    assert "data-parallel size 3" in m and "[1, 2, 4, 8]" in m
    m = err(Layout(dp_rank=0, dp_size=2, micro_batch_size=3, num_microbatches=2))
    assert "--micro-batch-size 3" in m and "one of [1, 2, 4, 8]" in m
    m = err(Layout(dp_rank=0, dp_size=2, micro_batch_size=4, num_microbatches=4))
    assert "4 micro-batches" in m and "--global-batch-size 16" in m

    from zephon_megatron.plan import plan
    p = plan(r, gpus=8, tp=2, micro_batch_size=2)
    assert p["data_parallel_size"] == 4 and p["rows_per_rank"] == 4 and p["num_microbatches"] == 2
    with pytest.raises(ZephonMegatronError, match="data-parallel size 3"):
        plan(r, gpus=6, tp=2)


def test_provider_option_errors(recipe_file):
    path, _ = recipe_file
    lay = Layout(dp_rank=0, dp_size=2, micro_batch_size=4, num_microbatches=2)
    with pytest.raises(ZephonMegatronError, match="--zephon-recipe is required"):
        build_data_iterators(_args(path, zephon_recipe=None), lay)
    with pytest.raises(ZephonMegatronError, match="--dataloader-type external"):
        build_data_iterators(_args(path, dataloader_type="single"), lay)
    with pytest.raises(ZephonMegatronError, match="--eval-iters 0"):
        build_data_iterators(_args(path, eval_iters=10), lay)
    with pytest.raises(ZephonMegatronError, match="--micro-batch-size 1"):
        build_data_iterators(_args(path, zephon_cu_seqlens=True), lay)
    with pytest.raises(ZephonMegatronError, match="--zephon-cu-seqlens"):
        build_data_iterators(_args(path, reset_attention_mask=True), lay)
    # tensor-parallel rank 1 and middle pipeline stages read nothing, after the same checks
    assert build_data_iterators(_args(path), Layout(0, 2, tp_rank=1, micro_batch_size=4, num_microbatches=2)) == \
        (None, None, None)
    assert build_data_iterators(_args(path), Layout(0, 2, pp_first=False, pp_last=False, micro_batch_size=4,
                                                    num_microbatches=2)) == (None, None, None)
    with pytest.raises(ZephonMegatronError, match="Set --global-batch-size 16"):
        build_data_iterators(_args(path, global_batch_size=8), Layout(0, 2, tp_rank=1, micro_batch_size=4,
                                                                      num_microbatches=1))


# -- batch contents -----------------------------------------------------------------------------------
def test_micro_batches_are_the_zephon_step_in_megatron_form(recipe_file):
    path, _ = recipe_file
    recipe = _load(path)
    lay = Layout(dp_rank=1, dp_size=2, micro_batch_size=2, num_microbatches=4)
    train, valid, test = build_data_iterators(_args(path, micro_batch_size=2, create_attention_mask_in_dataloader=True,
                                                    reset_attention_mask=True), lay)
    assert valid is None and test is None
    ref = zephon.build_loader(recipe, rank=1, world_size=2)
    pad = ref.pad_id
    for _ in range(2):
        step = next(ref)
        mbs = [next(train) for _ in range(4)]
        assert train.at_step_boundary
        got = {k: torch.cat([m[k] for m in mbs]) for k in mbs[0]}
        assert torch.equal(got["tokens"], step["input_ids"])
        assert torch.equal(got["position_ids"], step["position_ids"])
        assert torch.equal(got["loss_mask"], step["loss_mask"])
        counted = step["labels"] != zephon.IGNORE
        assert torch.equal(got["labels"][counted], step["labels"][counted])
        assert bool((got["labels"][~counted] == pad).all()) and bool((got["loss_mask"][~counted] == 0).all())
        am = got["attention_mask"]
        assert am.dtype == torch.bool and am.shape == (8, 1, 64, 64)
        seg = step["segment_ids"]
        i, j = torch.meshgrid(torch.arange(64), torch.arange(64), indexing="ij")
        for b in range(8):  # True = masked: the future, and other documents (padding is its own segment)
            allowed = (j <= i) & (seg[b][:, None] == seg[b][None, :])
            assert torch.equal(am[b, 0], ~allowed)
    ref.close()

    # cu_seqlens: one row per micro-batch, boundaries of its documents and of its padding
    seg = torch.tensor([1, 1, 1, 2, 2, 3, 0, 0], dtype=torch.int32)
    assert row_cu_seqlens(seg).tolist() == [0, 3, 5, 6, 8] and row_cu_seqlens(seg).dtype == torch.int32
    zephon_megatron.reset()
    lay1 = Layout(dp_rank=0, dp_size=1, micro_batch_size=1, num_microbatches=16)
    args1 = _args(path, micro_batch_size=1, zephon_cu_seqlens=True, reset_position_ids=False)
    train, _, _ = build_data_iterators(args1, lay1)
    mb = next(train)
    assert mb["cu_seqlens"].dtype == torch.int32 and mb["cu_seqlens"].shape[0] == 1
    cu = mb["cu_seqlens"][0]
    assert cu[0] == 0 and cu[-1] == 64 and bool((cu[1:] > cu[:-1]).all())
    assert torch.equal(mb["position_ids"], torch.arange(64).unsqueeze(0))  # without --reset-position-ids
    assert "attention_mask" not in mb


# -- data state ---------------------------------------------------------------------------------------
def _rank_iterators(path, dp, mbs, **kw):
    out = []
    for r in range(dp):
        lay = Layout(dp_rank=r, dp_size=dp, micro_batch_size=mbs, num_microbatches=16 // dp // mbs)
        zephon_megatron.reset()  # keep each simulated rank's iterator out of the process registry
        train, _, _ = build_data_iterators(_args(path, micro_batch_size=mbs, **kw), lay)
        zephon_megatron.provider._ACTIVE.clear()
        out.append((train, lay))
    return out


def test_data_state_checks(tmp_path, recipe_file, corpus, sp_model):
    path, data = recipe_file
    ckpt = tmp_path / "ckpt"
    ranks = _rank_iterators(path, 2, 4)
    for _ in range(2 * 2):  # two iterations of two micro-batches
        for it, _lay in ranks:
            next(it)
    for it, lay in ranks:
        write_data_state(it, lay, 2, ckpt)
    folder = data_state_dir(ckpt, 2)
    assert sorted(p.name for p in folder.iterdir()) == ["header.json"] + [f"lane_{i:05d}.json" for i in range(8)]
    header = json.loads((folder / "header.json").read_text())
    assert header["iteration"] == 2 and header["step"] == 2 and header["saved_with"]["data_parallel_size"] == 2

    # a rank reads exactly its lanes; the merged result resumes like zephon's own state
    state = read_data_state(folder, range(4, 8), iteration=2)
    assert sorted(map(int, state["lanes"])) == [4, 5, 6, 7] and state["step"] == 2
    with pytest.raises(ZephonMegatronError, match="resumed at iteration 3"):
        read_data_state(folder, range(8), iteration=3)

    # mid-step save, and a save whose iteration does not match the steps consumed
    it0, lay0 = ranks[0]
    next(it0)
    with pytest.raises(RuntimeError, match="after 1 of 2 micro-batches"):
        write_data_state(it0, lay0, 3, ckpt)
    next(it0)
    with pytest.raises(ZephonMegatronError, match="delivered 3 Zephon steps \\(expected 4"):
        write_data_state(it0, lay0, 4, ckpt)
    for it, _ in ranks:
        it.close()

    # Megatron resumed at an iteration with no data state / a lane file lost / another recipe
    lay1 = Layout(dp_rank=0, dp_size=1, micro_batch_size=4, num_microbatches=4)
    with pytest.raises(ZephonMegatronError, match="--zephon-ignore-data-state"):
        build_data_iterators(_args(path, iteration=7, load=str(ckpt)), lay1)
    train, _, _ = build_data_iterators(_args(path, iteration=7, load=str(ckpt), zephon_ignore_data_state=True), lay1)
    assert train.step == 0 and train.resume_iteration == 7
    zephon_megatron.reset()
    (folder / "lane_00005.json").rename(folder / "lane_00005.json.bak")
    with pytest.raises(ZephonMegatronError, match=r"lane 5 is missing.*data-parallel rank 1 of 2"):
        build_data_iterators(_args(path, iteration=2, load=str(ckpt)), lay1)
    (folder / "lane_00005.json.bak").rename(folder / "lane_00005.json")
    (tmp_path / "other.toml").write_text(_toml(dict(data, seed=8)))
    with pytest.raises(zephon.StateError, match="seed"):
        build_data_iterators(_args(tmp_path / "other.toml", iteration=2, load=str(ckpt)), lay1)


def test_save_hook_writes_next_to_megatron_checkpoints(tmp_path, recipe_file):
    path, _ = recipe_file
    calls = []

    def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                        checkpointing_context=None, non_persistent_ckpt=False):
        calls.append((iteration, non_persistent_ckpt))

    hooked = zephon_megatron.wrap_save_checkpoint(save_checkpoint)
    assert zephon_megatron.wrap_save_checkpoint(hooked) is hooked
    lay = Layout(dp_rank=0, dp_size=1, micro_batch_size=8, num_microbatches=2)
    args = _args(path, micro_batch_size=8, save=str(tmp_path / "ckpt"), non_persistent_ckpt_type="global",
                 non_persistent_global_ckpt_dir=str(tmp_path / "np"))
    train, _, _ = build_data_iterators(args, lay)
    for _ in range(2):
        next(train)
    hooked(1, None, None, None, 0)  # positional, as older Megatron-LM calls it
    for _ in range(2):
        next(train)
    hooked(iteration=2, model=None, optimizer=None, opt_param_scheduler=None, num_floating_point_operations_so_far=0,
           checkpointing_context={}, non_persistent_ckpt=True)
    assert calls == [(1, False), (2, True)]
    assert (data_state_dir(tmp_path / "ckpt", 1) / "lane_00007.json").is_file()
    assert (data_state_dir(tmp_path / "np", 2) / "header.json").is_file()
    # a resume finds the global non-persistent checkpoint's data state too
    zephon_megatron.reset()
    args2 = _args(path, micro_batch_size=8, iteration=2, load=str(tmp_path / "ckpt"),
                  non_persistent_global_ckpt_dir=str(tmp_path / "np"))
    train2, _, _ = build_data_iterators(args2, lay)
    assert train2.step == 2


# -- the launcher ---------------------------------------------------------------------------------------
def test_launcher_wires_megatron_pretrain(tmp_path, monkeypatch, recipe_file):
    """``python -m zephon_megatron.pretrain_gpt`` against a stand-in Megatron-LM checkout (the real one
    needs GPUs): the provider, model provider, forward_step, extra arguments, recipe defaults and the
    checkpoint hook reach ``pretrain``."""
    toml, _ = recipe_file
    lm = tmp_path / "Megatron-LM"
    (lm / "megatron" / "training").mkdir(parents=True)
    (lm / "pretrain_gpt.py").write_text(
        "import enum\n"
        "class ModelType(enum.Enum):  # pretrain_gpt.py: from megatron.core.enums import ModelType\n"
        "    encoder_or_decoder = 1\n"
        "def model_provider(pre_process=True, post_process=True):\n    return 'model'\n"
        "def forward_step(data_iterator, model):\n    return None\n")
    (lm / "megatron" / "training" / "__init__.py").write_text(
        "CALLS = []\n"
        "def pretrain(*a, **kw):\n    CALLS.append((a, kw))\n"
        "def get_args():\n    raise AssertionError\n")
    (lm / "megatron" / "training" / "training.py").write_text(
        "SAVED = []\n"
        "def save_checkpoint(iteration, *a, **kw):\n    SAVED.append(iteration)\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt"])
    for name in [m for m in sys.modules if m == "pretrain_gpt" or m.startswith("megatron.training")]:
        monkeypatch.delitem(sys.modules, name)
    had_megatron = "megatron" in sys.modules
    from zephon_megatron.pretrain_gpt import main

    try:
        main(["--megatron-lm", str(lm), "--zephon-recipe", str(toml), "--micro-batch-size", "2", "--bf16"])
        import megatron.training as mt
        from megatron.training import training

        assert sys.argv[1:] == ["--zephon-recipe", str(toml), "--micro-batch-size", "2", "--bf16"]
        (provider, model_provider, model_type, forward_step), kw = mt.CALLS[0]
        assert provider is zephon_megatron.train_valid_test_datasets_provider and provider.is_distributed
        assert model_provider() == "model" and forward_step.__module__ == "pretrain_gpt"
        assert model_type.name == "encoder_or_decoder"
        tok = zephon.load_tokenizer(zephon.load_recipe(str(toml)).tokenizer)
        assert kw["args_defaults"] == {"dataloader_type": "external", "seq_length": 64, "global_batch_size": 16,
                                       "micro_batch_size": 1, "tokenizer_type": "NullTokenizer",
                                       "vocab_size": tok.vocab_size}
        parser = kw["extra_args_provider"](argparse.ArgumentParser(allow_abbrev=False))
        ns = parser.parse_args(["--zephon-recipe", "x.toml", "--zephon-num-workers", "4", "--zephon-cu-seqlens"])
        assert ns.zephon_recipe == "x.toml" and ns.zephon_num_workers == 4 and ns.zephon_cu_seqlens
        assert training.save_checkpoint._zephon_wrapped
        training.save_checkpoint(5, None)
        assert training.SAVED == [5]
    finally:
        for name in [m for m in sys.modules if m == "pretrain_gpt" or m.startswith("megatron.training")
                     or (m == "megatron" and not had_megatron)]:
            del sys.modules[name]


# -- end to end under torchrun with megatron-core ----------------------------------------------------------
@pytest.mark.e2e
@needs_megatron_core
@pytest.mark.timeout(240)
def test_torchrun_megatron_core_tp_pp_and_elastic_resume(tmp_path, recipe_file):
    path, _ = recipe_file
    recipe = _load(path)
    phases = [
        {"name": "A", "tp": 1, "mbs": 4, "start": 0, "stop": 6, "save_at": [3], "attention_mask": True},
        {"name": "B", "tp": 2, "mbs": 1, "start": 3, "stop": 6, "save_at": [5], "cu_seqlens": True},
        {"name": "C", "tp": 1, "mbs": 8, "start": 5, "stop": 8, "reset_position_ids": False},
        {"name": "D", "pp": 2, "mbs": 4, "start": 0, "stop": 2},
    ]
    out = tmp_path / "out.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).with_name("megatron_worker.py")), "--recipe", str(path), "--ckpt", str(tmp_path / "ckpt"),
           "--out", str(out), "--phases", json.dumps(phases)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(PLUGIN), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = torch.load(out, weights_only=False)
    print(f"megatron-core {res['megatron_core']} (parallel_state, micro-batch calculator, RerunDataIterator)")
    A, B, C, D = res["phases"]

    def readers(ph):
        return sorted((r["rank"], r["dp_rank"], r["tp_rank"], r["pp_rank"]) for r in ph["ranks"] if r["has_iterator"])

    # loaders exactly where Megatron reads data (TP rank 0; first and last pipeline stage)
    assert readers(A) == [(0, 0, 0, 0), (1, 1, 0, 0)]  # TP=1: DP=2, both ranks
    assert readers(B) == [(0, 0, 0, 0)]  # TP=2: DP=1, tensor-parallel rank 1 gets None
    assert readers(D) == [(0, 0, 0, 0), (1, 0, 0, 1)] and D["last_stage_equal"] == [True]  # PP=2
    assert [r["num_microbatches"] for r in (A["ranks"][0], B["ranks"][0], C["ranks"][0])] == [2, 16, 1]
    assert not any(r["valid"] or r["test"] for ph in res["phases"] for r in ph["ranks"])

    # the dicts forward_step gets: keys, dtypes, shapes
    S = recipe.seq_len
    common = {"tokens": ["torch.int64"], "labels": ["torch.int64"], "loss_mask": ["torch.float32"],
              "position_ids": ["torch.int64"]}
    assert A["schema"] == {**{k: v + [[4, S]] for k, v in common.items()},
                           "attention_mask": ["torch.bool", [4, 1, S, S]]}
    n_cu = B["schema"]["cu_seqlens"][1][1]
    assert B["schema"] == {**{k: v + [[1, S]] for k, v in common.items()}, "cu_seqlens": ["torch.int32", [1, n_cu]]}
    assert C["schema"] == {k: v + [[8, S]] for k, v in common.items()}
    assert torch.equal(C["first_micro_batch"]["position_ids"], torch.arange(S).expand(8, S))

    # global batches equal zephon.build_loader's for the same recipe, across the saves/resumes
    ref_loader = zephon.build_loader(recipe, rank=0, world_size=1)
    ref = [next(ref_loader) for _ in range(8)]
    ref_loader.close()
    pad = zephon.load_tokenizer(recipe.tokenizer).pad_id

    def check(ph, first_iteration, positions=True):
        for i, got in enumerate(ph["global"]):
            want = ref[first_iteration + i]
            assert torch.equal(got["tokens"], want["input_ids"]), (ph["name"], first_iteration + i)
            assert torch.equal(got["loss_mask"], want["loss_mask"])
            assert torch.equal(got["labels"], torch.where(want["labels"] == zephon.IGNORE, pad, want["labels"]))
            if positions:
                assert torch.equal(got["position_ids"], want["position_ids"])

    check(A, 0)  # fresh, DP=2
    check(B, 3)  # saved at DP=2 (iteration 3), resumed at DP=1: the identical continuation
    check(C, 5, positions=False)  # saved at DP=1 (iteration 5), resumed at DP=2
    check(D, 0)  # fresh, PP=2
    assert len(A["global"]) == 6 and len(B["global"]) == 3 and len(C["global"]) == 3

    # the lane-keyed files next to the checkpoints, one per lane plus a header; hook ran on every rank
    for it in (3, 5):
        assert [f for f in res["files"] if f.startswith(f"iter_{it:07d}/")] == \
            [f"iter_{it:07d}/zephon/train/header.json"] + [f"iter_{it:07d}/zephon/train/lane_{i:05d}.json"
                                                          for i in range(8)]
    assert res["save_calls"] == [3, 5]

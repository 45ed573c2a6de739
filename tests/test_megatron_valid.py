"""zephon_megatron validation with a recipe whose sources stop: every evaluation reads the set exactly once.

A validation recipe with ``passes = 1`` on its sources and ``partial_batch = "pad"`` gives Megatron an
``EvaluationBatches``: one pass is counted when the run starts, ``--eval-iters`` must equal it (or
``--full-validation`` takes it from ``len()``), and every evaluation reads the whole set from its
beginning. The end-to-end test runs the provider under ``torchrun --nproc_per_node=2`` (gloo, CPU) with the
real megatron-core ``parallel_state``, micro-batch calculator and ``RerunDataIterator``, drawing the
validation micro-batches exactly as Megatron-LM 0.16's ``evaluate()`` does (``--eval-iters`` iterations of
``get_num_microbatches()`` micro-batches, the loss reduced as ``[sum(loss * loss_mask), sum(loss_mask)]``
over micro-batches and data-parallel ranks), at data-parallel size 2 and 1, across a checkpoint resume
and with pipeline size 2. Megatron-LM's own ``evaluate`` needs CUDA and a Megatron-LM checkout.

Run as ``python -m torch.distributed.run ... -m tests.test_megatron_valid ...``, this module is the worker.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import zephon

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "plugins" / "megatron"
if importlib.util.find_spec("zephon_megatron") is None:  # not installed (pip install -e '.[megatron]')
    sys.path.insert(0, str(PLUGIN))

import zephon_megatron  # noqa: E402
from zephon_megatron import EvaluationBatches, Layout, ZephonMegatronError, build_data_iterators  # noqa: E402

WEB_DOCS, CODE_DOCS = 48, 40  # the validation set: about 20 global batches of 16 rows x 64 tokens


# -- the recipes ---------------------------------------------------------------------------------------
def _toml(data: dict) -> str:
    from .test_megatron import _toml as toml

    return toml(data)


def _write_valid_set(folder: Path, corpus_texts: list[str]) -> list[str]:
    """A small held-out set: one Parquet file (row groups of 6) and one JSONL file; returns its texts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [t for t in corpus_texts if t and not t.isspace() and len(t) < 4000]
    web, code = texts[:WEB_DOCS], texts[-CODE_DOCS:]
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": web}), folder / "web.parquet", row_group_size=6)
    (folder / "code.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in code))
    return web + code


def _valid_dict(folder: Path, sp_model: Path, **kw) -> dict:
    data = {"seed": 99, "lanes": 8, "seq_len": 64, "batch_per_lane": 2, "flush_every": 2, "partial_batch": "pad",
            "tokenizer": {"kind": "sentencepiece", "path": str(sp_model)},
            "pack": {"algorithm": "best_fit", "max_open_bins": 4},
            "read": {"chunk_rows": 4, "chunk_bytes": 1024, "unit_bytes": 2048},
            "sources": [{"name": "web", "path": str(folder / "web.parquet"), "format": "parquet", "weight": 0.6,
                         "passes": 1},
                        {"name": "code", "path": str(folder / "code.jsonl"), "format": "jsonl", "weight": 0.4,
                         "passes": 1}]}
    data.update(kw)
    return data


@pytest.fixture
def recipes(tmp_path, corpus, corpus_texts, sp_model):
    from .conftest import base_recipe_dict

    train = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    train.update(lanes=8, batch_per_lane=2, flush_every=1)  # global batch 16 rows x 64 tokens, as valid
    (tmp_path / "train.toml").write_text(_toml(train))
    texts = _write_valid_set(tmp_path / "valid_data", corpus_texts)
    valid = _valid_dict(tmp_path / "valid_data", sp_model)
    (tmp_path / "valid.toml").write_text(_toml(valid))
    return SimpleNamespace(train=tmp_path / "train.toml", valid=tmp_path / "valid.toml", valid_dict=valid,
                           texts=texts, folder=tmp_path)


def reference_pass(valid_path: Path) -> list[dict[str, torch.Tensor]]:
    """One pass of the validation recipe on one process, as Megatron sees it (labels: pad_id, not -100)."""
    recipe = zephon.load_recipe(str(valid_path))
    loader = zephon.build_loader(recipe, rank=0, world_size=1)
    out = []
    for b in loader:
        labels = torch.where(b["labels"] == zephon.IGNORE, loader.pad_id, b["labels"])
        out.append({"tokens": b["input_ids"], "labels": labels, "loss_mask": b["loss_mask"].to(torch.float32),
                    "position_ids": b["position_ids"]})
    loader.close()
    return out


def stand_in_loss(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A per-token loss standing in for the cross-entropy (a function of the token and its label)."""
    return ((tokens * 31 + labels) % 97).to(torch.float64) / 10 + 0.1


def megatron_average(batches: list[dict[str, torch.Tensor]]) -> float:
    """pretrain_gpt's loss_func + evaluate(): sum(loss * loss_mask) / sum(loss_mask) over everything."""
    num = sum(float((stand_in_loss(b["tokens"], b["labels"]) * b["loss_mask"]).sum()) for b in batches)
    den = sum(float(b["loss_mask"].sum()) for b in batches)
    return num / den


def _args(train, valid=None, **kw):
    base = {"zephon_recipe": str(train), "zephon_valid_recipe": str(valid) if valid else None,
            "zephon_num_workers": 0, "zephon_runner": "thread", "zephon_prefetch": None, "zephon_cu_seqlens": False,
            "zephon_ignore_data_state": False, "dataloader_type": "external", "micro_batch_size": 4,
            "global_batch_size": 16, "seq_length": 64, "rampup_batch_size": None, "eval_iters": 0,
            "full_validation": False, "create_attention_mask_in_dataloader": False, "reset_attention_mask": False,
            "reset_position_ids": True, "iteration": 0, "load": None, "save": None, "non_persistent_ckpt_type": None,
            "non_persistent_global_ckpt_dir": None}
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.fixture(autouse=True)
def _reset_provider():
    yield
    zephon_megatron.reset()


# -- in this process (data-parallel size 1) --------------------------------------------------------------
def test_the_shipped_valid_recipe_stops_and_pads():
    recipe = zephon.load_recipe(str(ROOT / "recipes" / "megatron" / "gpt_demo_valid.toml"))
    assert recipe.partial_batch == "pad" and all(s.passes == 1 for s in recipe.sources)
    train = zephon.load_recipe(str(ROOT / "recipes" / "megatron" / "gpt_demo.toml"))
    assert (recipe.seq_len, recipe.lanes * recipe.batch_per_lane) == (train.seq_len, train.lanes * train.batch_per_lane)


def test_eval_iters_must_be_one_pass(recipes):
    ref = reference_pass(recipes.valid)
    n = len(ref)
    assert 8 < n < 40
    lay = Layout(dp_rank=0, dp_size=1, micro_batch_size=4, num_microbatches=4)
    with pytest.raises(ZephonMegatronError, match=f"one pass over them is {n} iterations.*set --eval-iters {n},"):
        build_data_iterators(_args(recipes.train, recipes.valid, eval_iters=n - 1), lay)
    zephon_megatron.reset()
    with pytest.raises(ZephonMegatronError, match=f"set --eval-iters {n}"):
        build_data_iterators(_args(recipes.train, recipes.valid, eval_iters=n + 5), lay)
    zephon_megatron.reset()
    # --eval-iters 0: no evaluation, so the validation set is not even read
    _, valid, _ = build_data_iterators(_args(recipes.train, recipes.valid, eval_iters=0), lay)
    assert valid is None
    zephon_megatron.reset()
    _, valid, _ = build_data_iterators(_args(recipes.train, recipes.valid, eval_iters=None, full_validation=True), lay)
    assert isinstance(valid, EvaluationBatches) and len(valid) == n  # what --full-validation makes --eval-iters


def test_valid_recipes_that_cannot_be_read_once_are_refused(recipes, sp_model):
    lay = Layout(dp_rank=0, dp_size=1, micro_batch_size=4, num_microbatches=4)

    def refused(path, **kw):
        with pytest.raises(ZephonMegatronError) as e:
            build_data_iterators(_args(recipes.train, path, **kw), lay)
        zephon_megatron.reset()
        return str(e.value)

    data = recipes.valid_dict
    mixed = recipes.folder / "mixed.toml"
    code_repeats = {k: v for k, v in data["sources"][1].items() if k != "passes"}
    mixed.write_text(_toml({**data, "sources": [data["sources"][0], code_repeats]}))
    assert "['code'] repeat while ['web'] stop" in refused(mixed, eval_iters=5)
    drop = recipes.folder / "drop.toml"
    drop.write_text(_toml({**data, "partial_batch": "drop"}))
    assert 'Set partial_batch = "pad"' in refused(drop, eval_iters=5)
    endless = recipes.folder / "endless.toml"
    endless.write_text(_toml({**data, "sources": [{k: v for k, v in s.items() if k != "passes"}
                                                 for s in data["sources"]]}))
    assert "--full-validation reads the whole validation set" in refused(endless, full_validation=True)
    assert "--full-validation needs validation data" in refused(None, full_validation=True)
    # a rank that reads no data gets, under --full-validation, something Megatron can take len() of
    _, valid, _ = build_data_iterators(_args(recipes.train, recipes.valid, full_validation=True),
                                       Layout(0, 1, tp_rank=1, micro_batch_size=4, num_microbatches=4))
    assert len(valid) == 0
    with pytest.raises(RuntimeError, match="reads no data"):
        next(valid)
    # an endless validation recipe stays one continuing stream across evaluations, as before
    _, valid, _ = build_data_iterators(_args(recipes.train, endless, eval_iters=3), lay)
    assert type(valid) is zephon_megatron.MegatronBatches


def test_every_evaluation_reads_the_set_once_from_its_beginning(recipes, tmp_path):
    ref = reference_pass(recipes.valid)
    n = len(ref)
    lay = Layout(dp_rank=0, dp_size=1, micro_batch_size=4, num_microbatches=4)
    args = _args(recipes.train, recipes.valid, eval_iters=n, save=str(tmp_path / "ckpt"))
    train, valid, _ = build_data_iterators(args, lay)
    for _evaluation in range(3):
        got = [[next(valid) for _ in range(4)] for _ in range(n)]  # Megatron's evaluate(): eval_iters x micro-batches
        for step, (mbs, want) in enumerate(zip(got, ref)):
            for key in want:
                assert torch.equal(torch.cat([m[key] for m in mbs]), want[key]), (step, key)
        for _ in range(4):  # a training iteration between evaluations
            next(train)
    assert valid.evaluations == 3
    # padded rows: pad tokens, loss_mask 0 (Megatron's loss leaves them out)
    padded = ref[-1]["loss_mask"].sum(1) == 0
    assert bool(padded.any()) and bool((ref[-1]["tokens"][padded] == valid.pad_id).all())
    # checkpoints hold the training position only: the validation data has none to keep
    zephon_megatron.save_data_state(3)
    saved = sorted(p.relative_to(tmp_path / "ckpt").as_posix() for p in (tmp_path / "ckpt").rglob("*.json"))
    assert saved and all(p.startswith("iter_0000003/zephon/train/") for p in saved)
    with pytest.raises(RuntimeError, match="no position to save"):
        valid.state_dict()


# -- end to end under torchrun with megatron-core -----------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_torchrun_every_evaluation_covers_the_set_exactly_once(recipes, tmp_path):
    from tests.optional import require

    require("megatron.core")
    ref = reference_pass(recipes.valid)
    n = len(ref)
    # A: dp 2, evaluations after iterations 2 and 4 and at the end, a checkpoint at 3. B: dp 1 (tp 2), resumes
    # iteration 3, --full-validation. C: dp 1 (pp 2: both stages read), --eval-iters from one pass.
    phases = [
        {"name": "A", "tp": 1, "mbs": 4, "start": 0, "stop": 4, "eval_interval": 2, "save_at": [3], "eval_iters": n},
        {"name": "B", "tp": 2, "mbs": 2, "start": 3, "stop": 4, "eval_interval": 2, "full_validation": True},
        {"name": "C", "pp": 2, "mbs": 8, "start": 0, "stop": 1, "eval_interval": 100, "eval_iters": n},
    ]
    out = tmp_path / "out.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "tests.test_megatron_valid", "--train", str(recipes.train), "--valid", str(recipes.valid),
           "--ckpt", str(tmp_path / "ckpt"), "--out", str(out), "--phases", json.dumps(phases)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(PLUGIN), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, check=False, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = torch.load(out, weights_only=False)
    A, B, C = res["phases"]

    # which ranks hold a validation iterator, and its length (Megatron's --full-validation reads it)
    assert [(r["dp_size"], r["valid"], r["len"]) for r in A["ranks"]] == [(2, "EvaluationBatches", n)] * 2
    assert sorted((r["tp_rank"], r["valid"], r["len"]) for r in B["ranks"]) == \
        [(0, "EvaluationBatches", n), (1, "_NoValidationData", 0)]
    assert B["eval_iters"] == [n, n]  # rank 0's len(), broadcast as Megatron does
    assert [(r["pp_rank"], r["valid"], r["len"]) for r in C["ranks"]] == [(0, "EvaluationBatches", n),
                                                                          (1, "EvaluationBatches", n)]
    assert C["last_stage_equal"] == [True]
    assert [len(ph["evaluations"]) for ph in (A, B, C)] == [3, 2, 1]

    from zephon import load_tokenizer
    tok = load_tokenizer(zephon.load_recipe(str(recipes.valid)).tokenizer)
    ids, offsets = tok.encode(recipes.texts)
    every_record_once = Counter(torch.as_tensor(ids).tolist())
    slots = n * 16 * 64
    want_loss = megatron_average(ref)
    for ph in (A, B, C):
        for evaluation in ph["evaluations"]:
            # the global batches of one pass, identical at every data-parallel size, fresh and resumed
            assert len(evaluation["global"]) == n
            for step, (got, want) in enumerate(zip(evaluation["global"], ref)):
                for key in want:
                    assert torch.equal(got[key], want[key]), (ph["name"], step, key)
            # every validation record exactly once: its tokens, plus padding to fill the last global batch
            tokens = Counter(torch.cat([g["tokens"].flatten() for g in evaluation["global"]]).tolist())
            assert tokens == every_record_once + Counter({tok.pad_id: slots - int(offsets[-1])}), ph["name"]
            # Megatron's reduction over micro-batches and ranks: padded rows do not count
            assert evaluation["loss"] == pytest.approx(want_loss, rel=1e-12)
            assert evaluation["loss_tokens"] == int(sum(float(b["loss_mask"].sum()) for b in ref))
    last = A["evaluations"][0]["global"][-1]
    assert bool((last["loss_mask"].sum(1) == 0).any()), "the last global batch should have padded rows"
    # the checkpoint holds the training data state only
    assert res["files"] and all("/zephon/train/" in f for f in res["files"])
    assert res["train_resumed_at"] == 3


# -- the worker (run under torchrun by the test above) ------------------------------------------------------
def _worker() -> None:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    for name in ("--train", "--valid", "--ckpt", "--out", "--phases"):
        ap.add_argument(name, required=True)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.core import parallel_state as mpu
    from megatron.core.rerun_state_machine import RerunDataIterator, RerunMode, initialize_rerun_state_machine

    initialize_rerun_state_machine(mode=RerunMode.DISABLED)
    recipe = zephon.load_recipe(a.train)
    gbs = recipe.lanes * recipe.batch_per_lane
    rank = dist.get_rank()

    def megatron_save_checkpoint(iteration, *args, **kw):
        pass  # stands in for Megatron's model/optimizer save

    save_checkpoint = zephon_megatron.wrap_save_checkpoint(megatron_save_checkpoint)
    results, resumed_at = [], None
    for ph in json.loads(a.phases):
        mpu.initialize_model_parallel(tensor_model_parallel_size=ph.get("tp", 1),
                                      pipeline_model_parallel_size=ph.get("pp", 1))
        dp = mpu.get_data_parallel_world_size()
        nmc.init_num_microbatches_calculator(rank, None, gbs, ph["mbs"], dp)
        args = _args(a.train, a.valid, zephon_num_workers=1, micro_batch_size=ph["mbs"], global_batch_size=gbs,
                     eval_iters=ph.get("eval_iters"), full_validation=ph.get("full_validation", False),
                     iteration=ph["start"], load=a.ckpt if ph["start"] else None, save=a.ckpt)
        provider = zephon_megatron.make_datasets_provider(lambda args=args: args)
        train, valid, _ = provider([gbs * ph["stop"], 0, 0])
        if ph["start"] and train is not None:
            resumed_at = train.step
        if args.full_validation:  # Megatron-LM: eval_iters = len(valid loader) on every rank, rank 0's broadcast
            count = torch.tensor([len(valid)])
            dist.broadcast(count, 0)
            args.eval_iters = int(count.item())
        train_it = RerunDataIterator(train) if train is not None else None
        valid_it = RerunDataIterator(valid) if isinstance(valid, EvaluationBatches) else None
        dp_group = mpu.get_data_parallel_group()
        evaluations = []

        def evaluate(args, valid_it, dp_group, evaluations):  # Megatron-LM's evaluate(), as far as the data goes
            pulled, total = [], torch.zeros(2, dtype=torch.float64)
            for _ in range(args.eval_iters):
                mbs = [next(valid_it) for _ in range(nmc.get_num_microbatches())] if valid_it is not None else []
                pulled.append(mbs)
                if valid_it is not None and mpu.is_pipeline_last_stage(ignore_virtual=True):
                    val = torch.stack([torch.stack([(stand_in_loss(m["tokens"], m["labels"]) * m["loss_mask"]).sum(),
                                                    m["loss_mask"].sum().to(torch.float64)]) for m in mbs]).sum(0)
                    dist.all_reduce(val, group=dp_group)
                    total += val
            evaluations.append({"pulled": pulled, "loss": float(total[0] / total[1]) if total[1] else None,
                                "loss_tokens": int(total[1])})

        for it in range(ph["start"], ph["stop"]):
            if train_it is not None:
                for _ in range(nmc.get_num_microbatches()):
                    next(train_it)
            if (it + 1) % ph["eval_interval"] == 0:
                evaluate(args, valid_it, dp_group, evaluations)
            if it + 1 in ph.get("save_at", []):
                save_checkpoint(iteration=it + 1, model=None, optimizer=None, opt_param_scheduler=None,
                                num_floating_point_operations_so_far=0, checkpointing_context={})
        evaluate(args, valid_it, dp_group, evaluations)  # Megatron evaluates once more after training
        mine = {"rank": rank, "dp_rank": mpu.get_data_parallel_rank(), "dp_size": dp,
                "tp_rank": mpu.get_tensor_model_parallel_rank(), "pp_rank": mpu.get_pipeline_model_parallel_rank(),
                "valid": type(valid).__name__ if valid is not None else None,
                "len": len(valid) if valid is not None else None, "eval_iters": args.eval_iters,
                "evaluations": evaluations}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            readers = sorted((g for g in gathered if g["valid"] == "EvaluationBatches" and g["pp_rank"] == 0),
                             key=lambda g: g["dp_rank"])
            lasts = [g for g in gathered if g["valid"] == "EvaluationBatches" and g["pp_rank"] != 0]
            loss_rank = next(g for g in gathered if g["valid"] == "EvaluationBatches"
                             and g["pp_rank"] == max(r["pp_rank"] for r in gathered))
            evals = []
            for e in range(len(readers[0]["evaluations"])):
                steps = [{k: torch.cat([mb[k] for g in readers for mb in g["evaluations"][e]["pulled"][i]])
                          for k in ("tokens", "labels", "loss_mask", "position_ids")}
                         for i in range(len(readers[0]["evaluations"][e]["pulled"]))]
                evals.append({"global": steps, "loss": loss_rank["evaluations"][e]["loss"],
                              "loss_tokens": loss_rank["evaluations"][e]["loss_tokens"]})
            results.append({
                "name": ph["name"], "evaluations": evals,
                "ranks": [{k: v for k, v in g.items() if k != "evaluations"} for g in gathered],
                "eval_iters": [g["eval_iters"] for g in gathered],
                "last_stage_equal": [all(torch.equal(x[k], y[k]) for ex, ey in zip(g["evaluations"], readers[0]
                                                                                   ["evaluations"])
                                         for xs, ys in zip(ex["pulled"], ey["pulled"]) for x, y in zip(xs, ys)
                                         for k in x) for g in lasts],
            })
        zephon_megatron.reset()
        nmc.destroy_num_microbatches_calculator()
        mpu.destroy_model_parallel()
    if rank == 0:
        files = sorted(os.path.relpath(os.path.join(d, f), a.ckpt) for d, _, fs in os.walk(a.ckpt) for f in fs)
        torch.save({"phases": results, "files": files, "train_resumed_at": resumed_at}, a.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker()

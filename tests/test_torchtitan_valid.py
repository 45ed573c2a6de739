"""Torchtitan plugin, validation: a recipe whose sources stop, read whole at every evaluation.

Torchtitan 0.3's ``Validator`` builds its dataloader afresh at every evaluation, with ``infinite=False``
when ``validator.steps`` is -1, and stops at the first ``StopIteration``. With a validation recipe whose
sources have ``passes = 1`` and ``partial_batch = "pad"``, ``ZephonDataLoader`` ends after one pass, at the
same step on every rank (the ranks agree through torch.distributed), so every evaluation reads the set
exactly once:

- in this process: one pass is Zephon's pass (every record once, the last batch padded with labels -100),
  and a second build reads it again from its beginning; endless or dropping recipes are refused with the fix;
  the registry configs' validators read ``recipes/torchtitan/*_valid.toml`` with ``steps = -1``;
- four gloo processes (dp 4) stop together after the same rows as one process;
- end to end (marker ``torchtitan_e2e``): the real trainer under ``torchrun`` at dp 2 and dp 1 (gradient
  accumulation), ``--validator.enable --validator.steps -1``: each evaluation consumes exactly the rows of
  one pass, and the validation losses of the two runs agree.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import multiprocessing
import os
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.optional import require

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
from zephon_torchtitan import ZephonDataLoader  # noqa: E402
from zephon_torchtitan.dataloader import row_digests, to_torchtitan  # noqa: E402

import zephon  # noqa: E402

from .test_torchtitan import write_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "plugins" / "torchtitan" / "testing" / "cpu_train.py"
LANES, BPL, SEQ = 4, 2, 64  # global batch 8 rows of 64 tokens (as test_torchtitan_e2e's training recipe)
WEB_DOCS, CODE_DOCS = 30, 24  # the validation set: about 20 global batches


# -- the validation set and its reference pass -----------------------------------------------------------
def _write_set(folder: Path, corpus_texts: list[str]) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [t for t in corpus_texts if t and not t.isspace() and len(t) < 4000]
    web, code = texts[:WEB_DOCS], texts[-CODE_DOCS:]
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": web}), folder / "web.parquet", row_group_size=4)
    (folder / "code.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in code))
    return web + code


def valid_dict(folder: Path, sp_model: Path, **kw: Any) -> dict[str, Any]:
    data = {"seed": 99, "lanes": LANES, "seq_len": SEQ, "batch_per_lane": BPL, "flush_every": 2,
            "partial_batch": "pad", "tokenizer": {"kind": "sentencepiece", "path": str(sp_model)},
            "pack": {"algorithm": "best_fit", "max_open_bins": 4},
            "read": {"chunk_rows": 4, "chunk_bytes": 1024, "unit_bytes": 2048},
            "sources": [{"name": "web", "path": str(folder / "web.parquet"), "format": "parquet", "weight": 0.6,
                         "passes": 1},
                        {"name": "code", "path": str(folder / "code.jsonl"), "format": "jsonl", "weight": 0.4,
                         "passes": 1}]}
    data.update(kw)
    return data


@pytest.fixture(scope="module")
def valid_set(tmp_path_factory, corpus_texts, sp_model):
    folder = tmp_path_factory.mktemp("tt_valid")
    texts = _write_set(folder / "data", corpus_texts)
    data = valid_dict(folder / "data", sp_model)
    path = write_recipe(folder / "valid.toml", data)
    # the reference: one pass on one process, as the trainer receives it (rows, and their global order)
    loader = zephon.build_loader(zephon.load_recipe(str(path)), rank=0, world_size=1)
    batches = [to_torchtitan(b) for b in loader]
    loader.close()
    return {"path": path, "data": data, "texts": texts, "folder": folder, "batches": batches,
            "rows": [row_digests(inputs, labels) for inputs, labels in batches]}


def as_validator_builds(recipe: Path | str, dp: int, rank: int, local_batch_size: int, steps: int = -1,
                        **fields: Any) -> ZephonDataLoader:
    """torchtitan.components.validate.Validator: ``replace(config.dataloader, infinite=steps != -1)``,
    built at every ``validate()``."""
    cfg = dataclasses.replace(ZephonDataLoader.Config(recipe=str(recipe), **fields), infinite=steps != -1)
    return cfg.build(dp_world_size=dp, dp_rank=rank, tokenizer=None, seq_len=SEQ, local_batch_size=local_batch_size)


def evaluation_rows(loader: ZephonDataLoader) -> list[list[str]]:
    """What one validate() draws (one micro-batch per validator step, to StopIteration), per global step."""
    steps: list[list[str]] = []
    for i, (inputs, labels) in enumerate(loader):
        if i % loader.micro_batches == 0:
            steps.append([])
        steps[-1] += row_digests(inputs, labels)
    return steps


# -- in this process ---------------------------------------------------------------------------------------
def test_one_evaluation_is_one_pass_every_record_once(valid_set):
    from torchtitan.components.loss import IGNORE_INDEX

    n = len(valid_set["batches"])
    assert 8 < n < 30
    # every record of the set exactly once: the tokens of one pass are theirs, plus the padding
    tok = zephon.load_tokenizer(zephon.load_recipe(str(valid_set["path"])).tokenizer)
    ids, offsets = tok.encode(valid_set["texts"])
    inputs = torch.cat([b[0]["input"].flatten() for b in valid_set["batches"]])
    slots = n * LANES * BPL * SEQ
    assert Counter(inputs.tolist()) == Counter(torch.as_tensor(ids).tolist()) + \
        Counter({tok.pad_id: slots - int(offsets[-1])})
    # the last global batch is padded: rows whose labels are all IGNORE_INDEX (not in the validation loss)
    last_labels = valid_set["batches"][-1][1]
    assert bool((last_labels == IGNORE_INDEX).all(1).any())

    # built as the validator builds it, at every evaluation: the same pass, from its beginning, each time
    for local_batch_size in (8, 2):
        for _evaluation in range(2):
            ld = as_validator_builds(valid_set["path"], 1, 0, local_batch_size)
            assert evaluation_rows(ld) == valid_set["rows"]
            ld.close()
    # validator.steps N > one pass: the validator stops at the end of the data all the same
    ld = as_validator_builds(valid_set["path"], 1, 0, 8, steps=n + 10)
    assert len(list(ld)) == n


def test_validation_recipes_that_cannot_be_read_once_are_refused(valid_set, tmp_path):
    data = valid_set["data"]
    repeating = [{k: v for k, v in s.items() if k != "passes"} for s in data["sources"]]
    endless = write_recipe(tmp_path / "endless.toml", {**data, "sources": repeating})
    with pytest.raises(ValueError, match=r"repeats for ever.*`passes = 1`.*--validator\.steps N"):
        as_validator_builds(endless, 1, 0, 8)
    mixed = write_recipe(tmp_path / "mixed.toml", {**data, "sources": [
        data["sources"][0], {k: v for k, v in data["sources"][1].items() if k != "passes"}]})
    with pytest.raises(ValueError, match="repeats for ever"):
        as_validator_builds(mixed, 1, 0, 8)
    drop = write_recipe(tmp_path / "drop.toml", {**data, "partial_batch": "drop"})
    with pytest.raises(ValueError, match=r'partial_batch = "drop".*Set partial_batch = "pad"'):
        as_validator_builds(drop, 1, 0, 8)
    # with validator.steps N, any recipe does (the validator stops after N steps)
    assert len(list(itertools.islice(as_validator_builds(endless, 1, 0, 8, steps=3), 3))) == 3


def test_registry_validators_read_their_recipes_to_the_end(valid_set, monkeypatch):
    require("triton", reason="importing torchtitan.trainer needs triton (pip install --no-deps triton)")
    from torchtitan.config import ConfigManager
    from zephon_torchtitan import fit_trainer_config

    monkeypatch.chdir(ROOT)
    for name, valid in (("llama3_debug", "recipes/torchtitan/llama3_debug_valid.toml"),
                        ("llama3_debug_hf_tokenizer", "recipes/torchtitan/llama3_debug_hf_tokenizer_valid.toml")):
        config = ConfigManager().parse_args(["--module", "zephon_torchtitan", "--config", name])
        assert config.validator.dataloader.recipe == valid and config.validator.steps == -1
        assert not config.validator.enable  # Torchtitan's default; --validator.enable turns it on
        recipe = zephon.load_recipe(valid)
        assert recipe.partial_batch == "pad" and all(s.passes == 1 for s in recipe.sources)
        train = zephon.load_recipe(config.dataloader.recipe)
        assert (recipe.seq_len, recipe.lanes * recipe.batch_per_lane) == (train.seq_len, train.global_batch_size)

    # --validator.enable checks the validation recipe when the trainer starts, not at the first evaluation
    monkeypatch.setenv("WORLD_SIZE", "2")
    training = write_recipe(valid_set["folder"] / "train.toml",
                            {**valid_set["data"], "sources": [{k: v for k, v in s.items() if k != "passes"}
                                                              for s in valid_set["data"]["sources"]]})

    def parse(*args: str):
        return ConfigManager().parse_args(["--module", "zephon_torchtitan", "--config", "llama3_debug",
                                           "--dataloader.recipe", str(training), "--validator.enable", *args])

    with pytest.raises(ValueError, match=r"seq_len"):  # the shipped validation recipe has seq_len 2048
        fit_trainer_config(parse())
    fit_trainer_config(parse("--validator.dataloader.recipe", str(valid_set["path"])))
    with pytest.raises(ValueError, match="repeats for ever"):
        fit_trainer_config(parse("--validator.dataloader.recipe", ""))  # the training recipe, steps -1
    fit_trainer_config(parse("--validator.dataloader.recipe", "", "--validator.steps", "4"))


# -- four gloo processes (dp 4) ----------------------------------------------------------------------------
def _gloo_rank(rank: int, world: int, pg_file: str, recipe: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=rank, world_size=world)
    try:
        ld = as_validator_builds(recipe, world, rank, 1)  # 2 rows per rank and step: 2 micro-batches of 1
        Path(out, f"rank{rank}.json").write_text(json.dumps(evaluation_rows(ld)))
    finally:
        dist.destroy_process_group()


@pytest.mark.e2e
def test_four_ranks_stop_together_after_one_pass(valid_set, tmp_path):
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torchtitan.components.dataloader", "zephon", __name__])
    procs = [ctx.Process(target=_gloo_rank, args=(r, 4, str(tmp_path / "pg"), str(valid_set["path"]), str(tmp_path)))
             for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * 4
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert {len(r) for r in ranks} == {len(valid_set["rows"])}  # the same number of steps everywhere
    assert [[row for part in parts for row in part] for parts in zip(*ranks)] == valid_set["rows"]


# -- the real trainer under torchrun -------------------------------------------------------------------------
TRAIN_STEPS = 2


def _torchrun(nproc: int, args: list[str], dump: Path) -> str:
    dump.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "ZEPHON_TT_LOSS_LOG": str(dump / "loss.jsonl"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "plugins" / "torchtitan"), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(LAUNCHER), *args, "--dump_folder", str(dump), "--parallelism.data_parallel_replicate_degree",
           str(nproc)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    (dump / "log.txt").write_text(log)
    assert proc.returncode == 0, f"torchrun failed ({' '.join(cmd)}):\n{log[-6000:]}"
    return log


def _evaluations(hash_dir: Path) -> list[list[list[str]]]:
    """The validator's hash logs: per evaluation, per global step, the rows by global index."""
    evals: list[dict[int, dict[int, str]]] = []
    per_rank = [[json.loads(line) for line in f.read_text().splitlines()] for f in sorted(hash_dir.glob("*.jsonl"))]
    for records in per_rank:
        e = -1
        for rec in records:
            if rec["step"] == 1 and rec["micro"] == 0:  # a new validate(): a new loader, from the beginning
                e += 1
                if e == len(evals):
                    evals.append({})
            step = evals[e].setdefault(rec["step"], {})
            for i, digest in enumerate(rec["rows"]):
                assert rec["first_row"] + i not in step, "a row delivered twice in one evaluation"
                step[rec["first_row"] + i] = digest
    return [[[rows[i] for i in sorted(rows)] for _, rows in sorted(ev.items())] for ev in evals]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.torchtitan_e2e
@pytest.mark.timeout(900)
def test_trainer_validates_the_whole_set_once_at_dp_2_and_1(valid_set, tmp_path, corpus, sp_model):
    require("triton", reason="importing torchtitan.trainer needs triton (pip install --no-deps triton)")
    from .conftest import base_recipe_dict

    train = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    train.update(lanes=LANES, batch_per_lane=BPL, seq_len=SEQ, flush_every=2)
    recipe = write_recipe(tmp_path / "train.toml", train)
    runs = {"dp2": (2, []), "dp1": (1, ["--training.local_batch_size", "4"])}  # dp 1: 2 micro-batches per step

    def args(name: str, extra: list[str]) -> list[str]:
        return ["--module", "zephon_torchtitan", "--config", "llama3_debug", "--dataloader.recipe", str(recipe),
                "--training.steps", str(TRAIN_STEPS), "--training.disable_cuda_graphs",
                "--training.mixed_precision_param", "float32", "--parallelism.data_parallel_shard_degree", "1",
                "--metrics.disable_color_printing", "--metrics.log_freq", "1", "--debug.seed", "7",
                "--validator.enable", "--validator.freq", "2", "--validator.steps", "-1",
                "--validator.dataloader.recipe", str(valid_set["path"]),
                "--validator.dataloader.hash_log", str(tmp_path / name / "valid_hashes"), *extra]

    with ThreadPoolExecutor(2) as pool:
        logs = dict(zip(runs, pool.map(lambda kv: _torchrun(kv[1][0], args(kv[0], kv[1][1]), tmp_path / kv[0]),
                                       runs.items())))
    n = len(valid_set["rows"])
    validations: dict[str, dict[int, float]] = {}
    for name in runs:
        assert "validate step:  1" in logs[name] and "validate step:  2" in logs[name]
        # validations after steps 1 and 2 (should_validate: step 1, then every freq): both read one whole pass,
        # from its beginning, the ranks together, with the rows of the one-process reference
        evals = _evaluations(tmp_path / name / "valid_hashes")
        assert len(evals) == 2, name
        for ev in evals:
            assert len(ev) == n and ev == valid_set["rows"], name
        records = [json.loads(line) for line in (tmp_path / name / "loss.jsonl").read_text().splitlines()]
        validations[name] = {r["step"]: r["validation_loss"] for r in records if "validation_loss" in r}
        assert sorted(validations[name]) == [1, 2]
    # the same model and the same validation tokens at dp 2 and dp 1: the same loss (padding left out)
    for step in (1, 2):
        assert validations["dp1"][step] == pytest.approx(validations["dp2"][step], rel=1e-5)

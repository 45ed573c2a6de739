"""Torchtitan plugin, end to end with the real Torchtitan 0.3 trainer (CPU, gloo, Llama 3 debug model).

Four ``torchrun`` runs of 4 steps, data parallel by replication, checkpoint at step 2:

  A  dp 2, ``--module zephon_torchtitan --config llama3_debug``           (no accumulation)
  B  dp 1, the same, resumed from A's step-2 checkpoint                    (2 micro-batches per step)
  C  dp 1, Torchtitan's own ``llama3_debugmodel`` + ``--override.imports`` (2 micro-batches per step)
  D  dp 2, the same, resumed from C's step-2 checkpoint

The loader logs the SHA-256 of every row the trainer consumes; the global batch of every step must be
byte-identical in all four runs (A = C for steps 1-4, B = D = A for steps 3-4), and the loss of each
resumed step must match its uninterrupted run (B vs A, D vs C) to 1e-5. The CPU shims live in
plugins/torchtitan/testing/cpu_train.py. Slow (~2-4 min on 2 cores): marked ``torchtitan_e2e``; CI
runs it as its own step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from .conftest import base_recipe_dict
from .test_torchtitan import write_recipe

pytestmark = [pytest.mark.slow, pytest.mark.torchtitan_e2e]

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "plugins" / "torchtitan" / "testing" / "cpu_train.py"
STEPS, CKPT = 4, 2
REL_TOL = 1e-5

try:  # importing torchtitan.trainer (inside the runs) needs triton installed; say so up front
    import triton  # noqa: F401
except ImportError:
    if os.environ.get("ZEPHON_REQUIRE_TORCHTITAN") == "1":
        raise
    pytest.skip("torchtitan.trainer needs triton importable (pip install --no-deps triton)", allow_module_level=True)

COMMON = [
    "--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", str(CKPT),
    "--training.disable_cuda_graphs",                      # no CUDA
    "--training.mixed_precision_param", "float32",          # fp32 end to end: tight loss comparisons
    "--parallelism.data_parallel_shard_degree", "1",         # dp by replication (DDP-style), not FSDP
    "--parallelism.spmd_backend", "partial_dtensor",         # 0.3's default needs a newer torch for dp > 1
    "--metrics.disable_color_printing", "--metrics.log_freq", "1",
]


def _torchrun(nproc: int, args: list[str], dump: Path) -> str:
    dump.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "ZEPHON_TT_LOSS_LOG": str(dump / "loss.jsonl"),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "plugins" / "torchtitan"), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(LAUNCHER), *args, *COMMON, "--dump_folder", str(dump),
           "--parallelism.data_parallel_replicate_degree", str(nproc)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    (dump / "log.txt").write_text(log)
    assert proc.returncode == 0, f"torchrun failed ({' '.join(cmd)}):\n{log[-6000:]}"
    return log


def _steps(hash_dir: Path) -> dict[int, list[str]]:
    """Global batch per step: every rank's rows, placed by their global row index."""
    rows: dict[int, dict[int, str]] = {}
    for f in sorted(hash_dir.glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            step = rows.setdefault(rec["step"], {})
            for i, digest in enumerate(rec["rows"]):
                assert rec["first_row"] + i not in step, "a row delivered twice"
                step[rec["first_row"] + i] = digest
    return {s: [r[i] for i in sorted(r)] for s, r in sorted(rows.items())}


def _losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (dump / "loss.jsonl").read_text().splitlines())
            if "loss" in r}  # (not the validation losses)


def _resume_from(src: Path, dump: Path) -> None:
    shutil.copytree(src / "checkpoint" / f"step-{CKPT}", dump / "checkpoint" / f"step-{CKPT}")


@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_train_checkpoint_on_2_resume_on_1_and_back_identical_data_and_loss(tmp_path, corpus, sp_model, hf_tokenizer):
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    data.update(lanes=4, batch_per_lane=2, seq_len=64, flush_every=2)  # global batch 8 rows x 64 tokens
    recipe = write_recipe(tmp_path / "recipe.toml", data)
    runs = {name: tmp_path / name for name in "ABCD"}

    def registry(name: str) -> list[str]:  # our config: seq_len and batch sizes come from the recipe
        return ["--module", "zephon_torchtitan", "--config", "llama3_debug", "--dataloader.recipe", str(recipe),
                "--dataloader.hash_log", str(runs[name] / "hashes")]

    assets = tmp_path / "hf_assets"  # the stock config's tokenizer slot wants a Hugging Face tokenizer
    assets.mkdir()
    shutil.copy(hf_tokenizer, assets / "tokenizer.json")

    def override(name: str) -> list[str]:  # Torchtitan's own config; Zephon swapped in by --override.imports
        kwargs = json.dumps({"recipe": str(recipe), "hash_log": str(runs[name] / "hashes")})
        return ["--module", "llama3", "--config", "llama3_debugmodel", "--hf_assets_path", str(assets),
                "--override.imports", f"zephon_torchtitan.overrides.zephon_dataloader={kwargs}",
                "--training.seq_len", "64", "--training.global_batch_size", "8", "--training.local_batch_size", "4"]

    with ThreadPoolExecutor(2) as pool:  # A and C are independent, then B and D
        _, log_c = pool.map(lambda a: _torchrun(*a), [(2, registry("A"), runs["A"]),
                                                          (1, override("C"), runs["C"])])
        _resume_from(runs["A"], runs["B"])
        _resume_from(runs["C"], runs["D"])
        log_b, log_d = pool.map(lambda a: _torchrun(*a), [
            (1, registry("B") + ["--training.local_batch_size", "4"], runs["B"]),  # accumulate 2 micro-batches
            (2, override("D"), runs["D"])])

    for log in (log_b, log_d):
        assert f"Loading the checkpoint from {runs['B'] if log is log_b else runs['D']}/checkpoint/step-{CKPT}" in log
        assert "Zephon: resumed lanes" in log and f"at global batch {CKPT}" in log
    assert "[Override] zephon_torchtitan.overrides.zephon_dataloader: dataloader" in log_c
    assert "gradient accumulation steps 2" in log_b and "gradient accumulation steps 2" in log_c

    # the data: byte-identical global batches at dp 2 and dp 1, fresh and resumed, both config paths
    a, b, c, d = (_steps(runs[n] / "hashes") for n in "ABCD")
    assert sorted(a) == sorted(c) == list(range(1, STEPS + 1))
    assert all(len(rows) == 8 for rows in a.values())
    assert len({tuple(r) for r in a.values()}) == STEPS
    assert a == c
    assert sorted(b) == sorted(d) == list(range(CKPT + 1, STEPS + 1))
    assert b == {s: a[s] for s in b} and d == {s: c[s] for s in d}

    # the training: every resumed step's loss matches the uninterrupted run
    la, lb, lc, ld = (_losses(runs[n]) for n in "ABCD")
    assert sorted(la) == sorted(lc) == list(range(1, STEPS + 1)) and sorted(lb) == sorted(ld) == [3, 4]
    for resumed, full in ((lb, la), (ld, lc)):
        for step, loss in resumed.items():
            assert loss == pytest.approx(full[step], rel=REL_TOL), (step, resumed, full)


def test_registry_configs_fill_from_the_recipe_and_refuse_misfits(tmp_path, corpus, sp_model, monkeypatch):
    """The ``--module zephon_torchtitan`` configs, parsed as Torchtitan parses them (no training)."""
    from torchtitan.config import ConfigManager
    from torchtitan.models.common.decoder import Decoder
    from zephon_torchtitan import ZephonDataLoader, ZephonTokenizer, fit_trainer_config
    from zephon_torchtitan.trainer import ZephonTrainer

    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    data.update(lanes=4, batch_per_lane=2, seq_len=64)
    recipe = write_recipe(tmp_path / "recipe.toml", data)

    def parse(*args: str) -> ZephonTrainer.Config:
        return ConfigManager().parse_args(["--module", "zephon_torchtitan", "--config", "llama3_debug",
                                           "--dataloader.recipe", str(recipe), *args])

    monkeypatch.chdir(ROOT)
    config = parse("--dataloader.seed", "5", "--dataloader.num_workers", "2")
    assert isinstance(config, ZephonTrainer.Config) and config._owner is ZephonTrainer
    assert isinstance(config.dataloader, ZephonDataLoader.Config) and config.dataloader.seed == 5
    assert isinstance(config.validator.dataloader, ZephonDataLoader.Config)
    assert isinstance(config.tokenizer, ZephonTokenizer.Config)
    assert (config.training.seq_len, config.training.global_batch_size, config.training.local_batch_size) == (0, -1, 0)

    monkeypatch.setenv("WORLD_SIZE", "2")
    fit_trainer_config(config)
    t, model = config.training, config.model_spec.model
    assert (t.seq_len, t.global_batch_size, t.local_batch_size) == (64, 8, 4)
    assert isinstance(model, Decoder.Config)
    assert model.vocab_size == model.tok_embeddings.num_embeddings == model.lm_head.out_features == 640
    assert config.loss.loss_fn.global_vocab_size == 640
    # the validator reads its own recipe, whose sources stop, to its end (tests/test_torchtitan_valid.py)
    assert config.validator.dataloader.recipe == "recipes/torchtitan/llama3_debug_valid.toml"
    assert config.validator.steps == -1
    # with no recipe of its own, the validator's loader follows --dataloader.recipe, with its own seed; built
    # as Validator builds it (that recipe repeats for ever: it needs validator.steps N)
    config = parse("--validator.dataloader.recipe", "", "--validator.dataloader.seed", "11", "--validator.steps", "3")
    fit_trainer_config(config)
    val_cfg = dataclasses.replace(config.validator.dataloader, infinite=config.validator.steps != -1)
    assert val_cfg.recipe == str(recipe)
    val = val_cfg.build(dp_world_size=2, dp_rank=1, tokenizer=None, seq_len=t.seq_len, local_batch_size=2)
    assert val.recipe.seed == 11 and val.micro_batches == 2 and next(iter(val))[0]["input"].shape == (2, 64)

    with pytest.raises(ValueError, match=r"--training\.global_batch_size 8 \(or -1\)"):
        fit_trainer_config(parse("--training.global_batch_size", "16"))
    with pytest.raises(ValueError, match=r"--training\.seq_len 64"):
        fit_trainer_config(parse("--training.seq_len", "128"))
    with pytest.raises(ValueError, match=r"--training\.local_batch_size to 4 or a divisor"):
        fit_trainer_config(parse("--training.local_batch_size", "3"))
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"degree 3 does not divide the recipe's lanes = 4"):
        fit_trainer_config(parse())

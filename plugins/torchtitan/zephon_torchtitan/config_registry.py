"""Torchtitan config registry: ``--module zephon_torchtitan --config <name>``.

Each function takes a stock Torchtitan config (the Llama 3 debug model) and swaps in Zephon: the
dataloader (training and validation), the tokenizer slot, and :class:`ZephonTrainer`, which reads
``seq_len``, the global batch and this rank's share of it from the recipe (``0`` / ``-1`` below mean
"from the recipe"), so the same command runs at any data-parallel degree that divides ``lanes``.
The validator (``--validator.enable``) reads a validation recipe whose sources stop after one pass,
with ``--validator.steps -1``: every evaluation covers the validation set exactly once.
Every field stays a normal CLI override (``--dataloader.recipe``, ``--dataloader.seed``, ...).
Recipe paths are relative to the working directory (run from the repository root).
"""

from __future__ import annotations

import dataclasses

from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from .dataloader import ZephonDataLoader
from .tokenizer import ZephonTokenizer
from .trainer import ZephonTrainer

DEBUG_RECIPE = "recipes/torchtitan/llama3_debug.toml"
DEBUG_HF_RECIPE = "recipes/torchtitan/llama3_debug_hf_tokenizer.toml"
#: The validators' recipes: sources that stop after one pass, the last global batch padded; the
#: validator reads each to its end (``steps = -1``) at every evaluation. Point
#: ``--validator.dataloader.recipe`` at your held-out data for a real run.
DEBUG_VALID_RECIPE = "recipes/torchtitan/llama3_debug_valid.toml"
DEBUG_HF_VALID_RECIPE = "recipes/torchtitan/llama3_debug_hf_tokenizer_valid.toml"
#: The seed ``with_zephon(..., valid_recipe="")`` gives a validator that follows the training recipe.
VALIDATION_SEED = 20_250_101


def with_zephon(base: Trainer.Config, recipe: str, hf_tokenizer: bool = False,
                valid_recipe: str = "") -> ZephonTrainer.Config:
    """``base`` with Zephon's dataloader (and the validator's), tokenizer slot and trainer.

    ``valid_recipe``: the validator's recipe, read whole at every evaluation (``validator.steps = -1``);
    empty: the training recipe with another seed (ZephonTrainer fills it in), ``steps`` kept from ``base``.
    """
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    config = ZephonTrainer.Config(**values)
    config.dataloader = ZephonDataLoader.Config(recipe=recipe)
    if valid_recipe:
        config.validator = dataclasses.replace(base.validator, dataloader=ZephonDataLoader.Config(recipe=valid_recipe),
                                               steps=-1)
    else:
        config.validator = dataclasses.replace(
            base.validator, dataloader=ZephonDataLoader.Config(recipe="", seed=VALIDATION_SEED))
    if not hf_tokenizer:
        # The recipe brings its own tokenizer; the trainer's slot must not require HF assets.
        config.tokenizer = ZephonTokenizer.Config()
        config.hf_assets_path = "recipes/torchtitan"
    # Torchtitan 0.3's default SPMD backend ("spmd_types") hands fully_shard SPMD annotations that the
    # torch this project pins (2.13) does not translate: with dp > 1 it stops at "all parameters must be
    # DTensors". The DTensor-for-model-parallel-axes backend works at every dp degree.
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.seq_len = 0            # from the recipe
    config.training.local_batch_size = 0   # lanes / dp * batch_per_lane
    config.training.global_batch_size = -1  # lanes * batch_per_lane
    return config


def llama3_debug() -> ZephonTrainer.Config:
    """Llama 3 debug model on the demo corpus (``zephon demo recipes``), its vocabulary fitted to
    the recipe's SentencePiece tokenizer."""
    return with_zephon(llama3_debugmodel(), DEBUG_RECIPE, valid_recipe=DEBUG_VALID_RECIPE)


def llama3_debug_hf_tokenizer() -> ZephonTrainer.Config:
    """Llama 3 debug model, the demo corpus tokenized by the trainer's Hugging Face tokenizer
    (``tokenizer.json`` in ``--hf_assets_path``; the recipe says ``path = "@hf_assets_path"``)."""
    return with_zephon(llama3_debugmodel(), DEBUG_HF_RECIPE, hf_tokenizer=True, valid_recipe=DEBUG_HF_VALID_RECIPE)

"""``ZephonTrainer``: Torchtitan's ``Trainer`` with its batch settings taken from the Zephon recipe.

It changes nothing in training. Before the stock ``Trainer.__init__`` runs it fills the trainer
settings that a recipe fixes, so that the same command line works at every data-parallel degree:

- ``training.seq_len`` 0 → the recipe's ``seq_len``;
- ``training.global_batch_size`` -1 → the recipe's global batch (``lanes * batch_per_lane``);
- ``training.local_batch_size`` 0 → this rank's share, ``lanes / dp * batch_per_lane`` (no gradient
  accumulation); any divisor of it also works (the loader then yields micro-batches);
- an empty ``validator.dataloader.recipe`` → ``dataloader.recipe``; with ``validator.enable`` the
  validation recipe is checked now (its fit, and with ``validator.steps`` -1 that it ends and pads), not
  at the first evaluation;
- with ``fit_vocab_to_tokenizer`` (the default), the model's vocabulary (embedding, output layer, loss)
  is sized to the recipe tokenizer's, rounded up to a multiple of 64.

Explicit values that do not fit the recipe are refused with a message naming the setting to change.
Importing this module imports ``torchtitan.trainer`` (which needs ``triton`` importable).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from .dataloader import ZephonDataLoader, check_fit, check_reads_once

VOCAB_MULTIPLE = 64
"""The model's vocabulary is rounded up to a multiple of this (:func:`fit_vocab`)."""


def _dp_degree(config: Trainer.Config) -> int:
    """The data-parallel (batch) degree the trainer will use, from WORLD_SIZE and the parallelism config."""
    from torchtitan.distributed import ParallelDims

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dims = ParallelDims.from_config(config.parallelism, world_size)
    return dims.dp_replicate * dims.dp_shard


def _set_vocab(node: Any, old: int, new: int, seen: set[int]) -> None:
    """Set every ``global_vocab_size == old`` found in a (nested) config to ``new``."""
    if id(node) in seen or not is_dataclass(node):
        return
    seen.add(id(node))
    for f in fields(node):
        value = getattr(node, f.name)
        if f.name == "global_vocab_size" and value == old:
            setattr(node, f.name, new)
        elif is_dataclass(value):
            _set_vocab(value, old, new, seen)


def fit_vocab(config: Trainer.Config, vocab_size: int) -> int | None:
    """Size a decoder's vocabulary (embeddings, output layer, loss) to a tokenizer's, rounded up to a multiple
    of :data:`VOCAB_MULTIPLE`.

    Args:
        config: the trainer's config (changed in place).
        vocab_size: the recipe tokenizer's vocabulary size.

    Returns:
        The new vocabulary size, or None when the model is not a decoder (left as it is).
    """
    from torchtitan.models.common.decoder import Decoder

    model = config.model_spec.model if config.model_spec is not None else None
    if not isinstance(model, Decoder.Config):
        return None
    new = -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    old = model.vocab_size
    if new == old:
        return new
    model.vocab_size = new
    if getattr(model.tok_embeddings, "num_embeddings", None) == old:
        model.tok_embeddings.num_embeddings = new
    if getattr(model.lm_head, "out_features", None) == old:
        model.lm_head.out_features = new
    _set_vocab(config.loss, old, new, set())
    logger.info(f"Zephon: model vocabulary {old} -> {new} (the recipe tokenizer has {vocab_size} tokens)")
    return new


def fit_trainer_config(config: Trainer.Config, fit_vocab_to_tokenizer: bool = True) -> None:
    """Fill and check the trainer's batch settings from the Zephon recipe (see the module docstring).

    Does nothing unless ``config.dataloader`` is a :class:`ZephonDataLoader.Config`.

    Args:
        config: the trainer's config (changed in place: ``seq_len``, ``global_batch_size``,
            ``local_batch_size``, the validator's recipe, the vocabulary).
        fit_vocab_to_tokenizer: also size the model's vocabulary to the recipe tokenizer's (:func:`fit_vocab`).

    Raises:
        ValueError: a trainer setting does not fit the recipe (the message says what to change).
    """
    dl = config.dataloader
    if not isinstance(dl, ZephonDataLoader.Config):
        return
    recipe = dl.load_recipe(config.hf_assets_path)
    val = getattr(config.validator, "dataloader", None)
    if isinstance(val, ZephonDataLoader.Config) and not val.recipe:
        val.recipe = dl.recipe  # the validator follows --dataloader.recipe unless given its own
    t = config.training
    global_batch = recipe.lanes * recipe.batch_per_lane
    dp = _dp_degree(config)
    if t.seq_len <= 0:
        t.seq_len = recipe.seq_len
    if t.global_batch_size < 0:
        t.global_batch_size = global_batch
    elif t.global_batch_size != global_batch:
        raise ValueError(f"training.global_batch_size={t.global_batch_size} but the Zephon recipe "
                         f"{recipe.origin} defines a global batch of lanes x batch_per_lane = {recipe.lanes} x "
                         f"{recipe.batch_per_lane} = {global_batch} rows. Set --training.global_batch_size "
                         f"{global_batch} (or -1).")
    if t.local_batch_size <= 0 and recipe.lanes % max(dp, 1) == 0:
        t.local_batch_size = global_batch // dp
    pp = config.parallelism.pipeline_parallel_degree > 1
    check_fit(recipe, dp, t.seq_len,
              config.parallelism.pipeline_parallel_microbatch_size if pp else t.local_batch_size)
    if pp:
        check_fit(recipe, dp, t.seq_len, t.local_batch_size)
    if isinstance(val, ZephonDataLoader.Config) and getattr(config.validator, "enable", False):
        # the validator builds its loader at every evaluation: check it now rather than at the first one
        val_recipe = val.load_recipe(config.hf_assets_path)
        check_fit(val_recipe, dp, t.seq_len,
                  config.parallelism.pipeline_parallel_microbatch_size if pp else t.local_batch_size)
        if getattr(config.validator, "steps", 0) == -1 and val.max_steps <= 0:
            check_reads_once(val_recipe, "validator.dataloader")
    if fit_vocab_to_tokenizer:
        import zephon

        fit_vocab(config, zephon.load_tokenizer(recipe.tokenizer).vocab_size)
    logger.info(f"Zephon: seq_len {t.seq_len}, global batch {t.global_batch_size}, local batch "
                f"{t.local_batch_size} at data-parallel degree {dp}")


class ZephonTrainer(Trainer):
    """Torchtitan's Trainer, with the batch settings and vocabulary fitted to the Zephon recipe.

    Args:
        config: its :class:`ZephonTrainer.Config` (fitted in place by :func:`fit_trainer_config`).

    Raises:
        ValueError: a trainer setting does not fit the recipe.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        """Torchtitan's trainer config, plus Zephon's option."""

        fit_vocab_to_tokenizer: bool = True
        """Size the model's vocabulary to the recipe tokenizer's (rounded up to a multiple of 64)."""

    def __init__(self, config: Config) -> None:
        fit_trainer_config(config, config.fit_vocab_to_tokenizer)
        super().__init__(config)

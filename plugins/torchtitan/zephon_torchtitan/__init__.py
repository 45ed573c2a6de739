"""Zephon for Torchtitan 0.3: an elastic-deterministic dataloader, DCP checkpoints keyed by lane.

- :class:`ZephonDataLoader` — ``torchtitan.components.dataloader.BaseDataLoader`` over a Zephon recipe.
- :class:`ZephonTokenizer` — the trainer's tokenizer slot when the recipe brings its own tokenizer.
- :class:`ZephonTrainer` — ``Trainer`` with seq_len / batch sizes / vocabulary taken from the recipe
  (imported lazily: importing ``torchtitan.trainer`` needs ``triton``).
- ``--module zephon_torchtitan --config llama3_debug`` — see :mod:`zephon_torchtitan.config_registry`.
- ``--override.imports zephon_torchtitan.overrides.zephon_dataloader=...`` — see
  :mod:`zephon_torchtitan.overrides`.
"""

from __future__ import annotations

from typing import Any

from .dataloader import TRAINER_TOKENIZER, ZephonDataLoader, check_fit, resolve_recipe, to_torchtitan
from .tokenizer import ZephonTokenizer

__all__ = ["TRAINER_TOKENIZER", "ZephonDataLoader", "ZephonTokenizer", "ZephonTrainer", "check_fit",
           "fit_trainer_config", "resolve_recipe", "to_torchtitan"]


def __getattr__(name: str) -> Any:
    if name in ("ZephonTrainer", "fit_trainer_config"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'zephon_torchtitan' has no attribute {name!r}")

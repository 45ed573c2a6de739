"""``--override.imports`` entries for users who keep their own Torchtitan config.

Swap the training dataloader (whatever it is) for a Zephon recipe::

    --override.imports \
      'zephon_torchtitan.overrides.zephon_dataloader={"recipe": "recipes/torchtitan/llama3_debug.toml"}'

and, optionally, the validator's (``zephon_validation_dataloader``, same keyword arguments). The keyword
arguments are :class:`ZephonDataLoader.Config` fields (``recipe``, ``seed``, ``num_workers``, ...).
Your config keeps its tokenizer and batch settings: ``--training.seq_len`` must equal the recipe's
``seq_len``, ``--training.local_batch_size`` must divide ``lanes / dp * batch_per_lane``, and
``--training.global_batch_size`` must be ``lanes * batch_per_lane`` (the loader refuses anything else
with the exact value to set). The model's vocabulary must cover the recipe tokenizer's.
"""

from __future__ import annotations

from typing import Any

from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.config import override

from .dataloader import ZephonDataLoader


def _config(recipe: str, fields: dict[str, Any]) -> ZephonDataLoader.Config:
    if not recipe:
        raise ValueError("zephon_torchtitan override: pass the recipe, e.g. --override.imports "
                         "'zephon_torchtitan.overrides.zephon_dataloader={\"recipe\": \"path/to/recipe.toml\"}'")
    return ZephonDataLoader.Config(recipe=recipe, **fields)


@override(target=BaseDataLoader.Config, fqns=["dataloader"],
          description="Zephon elastic-deterministic dataloader (training)")
def zephon_dataloader(cfg: BaseDataLoader.Config, recipe: str = "", **fields: Any) -> ZephonDataLoader.Config:
    return _config(recipe, fields)


@override(target=BaseDataLoader.Config, fqns=["validator.dataloader"],
          description="Zephon elastic-deterministic dataloader (validation)")
def zephon_validation_dataloader(cfg: BaseDataLoader.Config, recipe: str = "",
                                 **fields: Any) -> ZephonDataLoader.Config:
    return _config(recipe, fields)

"""Zephon for Megatron-LM: the dataset provider of ``pretrain_gpt`` with elastic data-parallel resume.

- :func:`train_valid_test_datasets_provider` for ``pretrain(...)`` with ``--dataloader-type external``
  (or :func:`make_datasets_provider` to pass your own ``get_args``);
- :func:`add_zephon_args` as ``extra_args_provider`` (``--zephon-recipe`` ...);
- :func:`install_checkpoint_hook` / :func:`save_data_state`: the lane-keyed data state next to every
  checkpoint, resumable at any data-parallel size that divides the recipe's lanes;
- ``python -m zephon_megatron.pretrain_gpt``: Megatron-LM's ``pretrain_gpt.py`` wired to all of it;
- ``python -m zephon_megatron.plan``: which Megatron numbers fit a recipe;
- :func:`set_mixture`: a loss-driven change of the training mixture from the training loop.

Importing this package does not import Megatron (so the launcher can put a Megatron-LM checkout
on ``sys.path`` first).
"""

from .batches import EvaluationBatches, MegatronBatches, row_cu_seqlens
from .checkpoint import data_state_dir, find_data_state, iteration_dir, read_data_state, write_data_state
from .layout import Layout, ZephonMegatronError, check_fit, layout_from_megatron
from .provider import (
                       active_iterators,
                       add_zephon_args,
                       build_data_iterators,
                       install_checkpoint_hook,
                       make_datasets_provider,
                       megatron_args_defaults,
                       reset,
                       save_data_state,
                       set_mixture,
                       train_valid_test_datasets_provider,
                       wrap_save_checkpoint,
)

__all__ = [
    "EvaluationBatches", "Layout", "MegatronBatches", "ZephonMegatronError", "active_iterators", "add_zephon_args",
    "build_data_iterators", "check_fit", "data_state_dir", "find_data_state", "install_checkpoint_hook",
    "iteration_dir", "layout_from_megatron", "make_datasets_provider", "megatron_args_defaults",
    "read_data_state", "reset", "row_cu_seqlens", "save_data_state", "set_mixture",
    "train_valid_test_datasets_provider",
    "wrap_save_checkpoint", "write_data_state",
]

"""Megatron-LM's ``pretrain_gpt.py`` with Zephon as the dataset provider.

    torchrun --nproc_per_node 8 -m zephon_megatron.pretrain_gpt --megatron-lm /path/to/Megatron-LM \\
        --zephon-recipe recipes/megatron/gpt_demo.toml <the usual pretrain_gpt.py options>

It imports ``pretrain_gpt`` from your Megatron-LM checkout (``--megatron-lm PATH`` or the
``MEGATRON_LM`` environment variable; megatron-core alone ships neither ``megatron.training`` nor
``pretrain_gpt.py``) and calls Megatron's ``pretrain`` with that script's model provider and
``forward_step``, but with Zephon's ``train_valid_test_datasets_provider``, the ``--zephon-*``
options, defaults taken from the recipe (``--dataloader-type external``, ``--seq-length``,
``--global-batch-size``, a ``NullTokenizer`` of the recipe tokenizer's vocabulary size), and a
checkpoint hook that writes the lane-keyed data state next to every checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import zephon

from .provider import (
    add_zephon_args,
    image_layout,
    install_checkpoint_hook,
    megatron_args_defaults,
    train_valid_test_datasets_provider,
)


def _pop_option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """Remove ``name VALUE`` / ``name=VALUE`` from ``argv`` (Megatron's parser would reject it)."""
    out, value, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == name and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
            continue
        if a.startswith(name + "="):
            value = a.split("=", 1)[1]
        else:
            out.append(a)
        i += 1
    return value, out


def _compose(*providers: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    def extra_args_provider(parser: Any) -> Any:
        for p in providers:
            if p is not None:
                parser = p(parser)
        return parser

    return extra_args_provider


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    checkout, argv = _pop_option(argv, "--megatron-lm")
    checkout = checkout or os.environ.get("MEGATRON_LM")
    if checkout:
        checkout = os.path.abspath(checkout)
        if not os.path.isfile(os.path.join(checkout, "pretrain_gpt.py")):
            raise SystemExit(f"--megatron-lm {checkout}: no pretrain_gpt.py there; pass the root of a Megatron-LM "
                             f"checkout.")
        sys.path.insert(0, checkout)  # before anything imports `megatron`

    pre = add_zephon_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    known, _ = pre.parse_known_args(argv)
    if not known.zephon_recipe:
        raise SystemExit("zephon_megatron.pretrain_gpt: --zephon-recipe RECIPE.toml is required.")
    if image_layout(zephon.load_pipeline(known.zephon_recipe)) is not None:
        raise SystemExit(f"zephon_megatron.pretrain_gpt: --zephon-recipe {known.zephon_recipe} gives batches with images "
                         f"or mrope positions, but Megatron-LM's pretrain_gpt.py trains a text GPT: its get_batch "
                         f"hands the model the text keys only and broadcasts [mbs, S] position_ids to the other "
                         f"tensor-parallel ranks. Train such a pipeline from a script with its own get_batch that "
                         f"reads the image keys (see the plugin's README, 'What forward_step receives').")
    defaults = megatron_args_defaults(known.zephon_recipe)
    sys.argv = [sys.argv[0]] + argv  # Megatron parses sys.argv itself

    try:
        import pretrain_gpt as mlm  # the Megatron-LM checkout's script (guarded by __main__)
        from megatron.training import pretrain
        from megatron.training import training as megatron_training
    except ImportError as e:
        raise SystemExit(f"zephon_megatron.pretrain_gpt needs a Megatron-LM checkout ({e}): pass --megatron-lm "
                         f"/path/to/Megatron-LM or set MEGATRON_LM. megatron-core alone ships neither "
                         f"megatron.training nor pretrain_gpt.py.") from None
    ModelType = getattr(mlm, "ModelType", None)  # pretrain_gpt.py imports it from megatron.core.enums
    if ModelType is None:
        from megatron.core.enums import ModelType

    install_checkpoint_hook(megatron_training)
    if hasattr(mlm, "gpt_builder"):  # newer Megatron-LM: model_provider(builder, ...)
        model_provider = partial(mlm.model_provider, mlm.gpt_builder)
    else:
        model_provider = mlm.model_provider
    modelopt_args = getattr(mlm, "add_modelopt_args", None) if getattr(mlm, "has_nvidia_modelopt", False) else None
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, mlm.forward_step,
             extra_args_provider=_compose(add_zephon_args, modelopt_args), args_defaults=defaults)


if __name__ == "__main__":
    main()

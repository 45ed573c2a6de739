"""Zephon: an elastic-deterministic data loader for LLM and multimodal pre-training.

The same global batches, byte for byte, on any number of data-parallel ranks and loader workers,
and after resuming on a different rank count; with decoding, tokenization, splitting, mixing and
packing done online. Pipelines are written with :class:`Pipeline` (a TOML recipe is another spelling);
see README.md and docs/design.md.

The public names below are imported on first use (PEP 562): ``import zephon`` alone loads neither torch
nor the engine, so ``zephon --help`` and tools that only need a name or two start in a fraction of a
second. ``from zephon import X`` and ``zephon.X`` work as before.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

# public name -> the module (relative to this package) that defines it; "" for a submodule itself
_EXPORTS: dict[str, str] = {
    "read": "",
    "select_rows": ".batch_rows",
    "HASHED_KEYS": ".collate", "batch_digest": ".collate", "collate": ".collate", "global_digest": ".collate",
    "ValidationReport": ".compile",
    "ZephonLoader": ".loader", "build_loader": ".loader", "lanes_of_rank": ".loader",
    "Accumulator": ".ops.base", "LaneContext": ".ops.base", "Merge": ".ops.base", "Transform": ".ops.base",
    "Schedule": ".ops.schedule",
    "OperatorError": ".ops.transforms",
    "Pipeline": ".pipeline", "PipelineError": ".pipeline", "tokenizer": ".pipeline",
    "WorkPlan": ".plan",
    "SourceError": ".readers",
    "PackSpec": ".recipe", "Recipe": ".recipe", "RecipeError": ".recipe", "SourceSpec": ".recipe",
    "TokenizerSpec": ".recipe", "load_recipe": ".recipe", "recipe_from_dict": ".recipe",
    "load_pipeline": ".recipe_steps",
    "IGNORE": ".records", "Doc": ".records", "Flush": ".records",
    "LaneState": ".state", "StateError": ".state", "load_state": ".state", "merge_states": ".state",
    "save_state": ".state",
    "Tokenizer": ".tokenization", "load_tokenizer": ".tokenization",
}

__all__ = [
    "Accumulator", "Doc", "Flush", "HASHED_KEYS", "IGNORE", "LaneContext", "LaneState", "Merge", "OperatorError",
    "PackSpec", "Pipeline", "PipelineError", "Recipe", "RecipeError", "Schedule", "SourceError", "SourceSpec",
    "StateError",
    "Tokenizer", "TokenizerSpec", "Transform", "ValidationReport", "WorkPlan", "ZephonLoader", "batch_digest",
    "build_loader", "collate", "global_digest", "lanes_of_rank", "load_pipeline", "load_recipe", "load_state", "load_tokenizer",
    "merge_states", "read", "recipe_from_dict", "save_state", "select_rows", "tokenizer",
]  # the keys of _EXPORTS (tests/test_cli.py checks), spelled out for readers and linters


def __getattr__(name: str) -> Any:
    """Import the module behind a public name on first use, and keep the name (PEP 562)."""
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = importlib.import_module("." + name if where == "" else where, __name__)
    if where != "":
        value = getattr(value, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
    """This package's module type. Importing a submodule binds it on the package under its own name
    (``zephon.collate`` the module): where a public name is also a submodule's name, the public object
    (``zephon.collate`` the function, as before these names were lazy) wins."""

    def __setattr__(self, name: str, value: Any) -> None:
        if (isinstance(value, types.ModuleType) and _EXPORTS.get(name) == f".{name}"
                and value.__name__ == f"{__name__}.{name}"):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

if TYPE_CHECKING:  # the same names, eagerly, for type checkers and IDEs
    from . import read
    from .batch_rows import select_rows
    from .collate import HASHED_KEYS, batch_digest, collate, global_digest
    from .compile import ValidationReport
    from .loader import ZephonLoader, build_loader, lanes_of_rank
    from .ops.base import Accumulator, LaneContext, Merge, Transform
    from .ops.schedule import Schedule
    from .ops.transforms import OperatorError
    from .pipeline import Pipeline, PipelineError, tokenizer
    from .plan import WorkPlan
    from .readers import SourceError
    from .recipe import PackSpec, Recipe, RecipeError, SourceSpec, TokenizerSpec, load_recipe, recipe_from_dict
    from .recipe_steps import load_pipeline
    from .records import IGNORE, Doc, Flush
    from .state import LaneState, StateError, load_state, merge_states, save_state
    from .tokenization import Tokenizer, load_tokenizer

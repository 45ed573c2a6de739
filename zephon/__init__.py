"""Zephon: an elastic-deterministic data loader for LLM and vision-language pre-training.

The same global batches, byte for byte, on any number of data-parallel ranks and loader workers,
and after resuming on a different rank count; with decoding, tokenization, splitting, mixing and
packing done online. Pipelines are written with :class:`Pipeline` (a TOML recipe is another spelling);
see the documentation in docs/ and the design in docs/design.md.

The public names below are imported on first use (PEP 562): ``import zephon`` alone loads neither torch
nor the engine, so ``zephon --help`` and tools that only need a name or two start in a fraction of a
second. ``from zephon import X`` and ``zephon.X`` work as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.3.0"

# public name -> the module (relative to this package) that defines it; "" for a submodule itself
_EXPORTS: dict[str, str] = {
    "read": "",
    "select_rows": ".batches.rows",
    "HASHED_KEYS": ".batches.packed", "batch_digest": ".batches.packed", "collate": ".batches.packed",
    "global_digest": ".batches.packed",
    "OperatorError": ".errors", "PipelineError": ".errors", "RecipeError": ".errors", "SourceError": ".errors",
    "StateError": ".errors",
    "ValidationReport": ".graph.explain",
    "ZephonLoader": ".loader", "build_loader": ".loader", "lanes_of_rank": ".loader",
    "Accumulator": ".ops.base", "LaneContext": ".ops.base", "Merge": ".ops.base", "Transform": ".ops.base",
    "Schedule": ".ops.schedule",
    "Pipeline": ".pipeline", "tokenizer": ".pipeline",
    "WorkPlan": ".plan",
    "PROVENANCE_COLUMNS": ".origins",
    "diff": ".provenance.diff", "DiffReport": ".provenance.diff", "locate": ".provenance.locate",
    "Landing": ".provenance.locate", "Location": ".provenance.locate", "Segment": ".provenance.segments",
    "trace": ".provenance.trace",
    "Recipe": ".recipe.parse", "load_recipe": ".recipe.parse", "recipe_from_dict": ".recipe.parse",
    "load_pipeline": ".recipe.references",
    "IGNORE": ".records", "Doc": ".records", "Flush": ".records",
    "PackSpec": ".specs", "SourceSpec": ".specs", "TokenizerSpec": ".specs",
    "LaneState": ".state", "load_state": ".state", "merge_states": ".state", "save_state": ".state",
    "Tokenizer": ".tokenization", "load_tokenizer": ".tokenization",
}

__all__ = [
    "Accumulator", "DiffReport", "Doc", "Flush", "HASHED_KEYS", "IGNORE", "Landing", "LaneContext", "LaneState",
    "Location", "Merge", "OperatorError", "PROVENANCE_COLUMNS", "PackSpec", "Pipeline", "PipelineError", "Recipe",
    "RecipeError", "Schedule", "Segment", "SourceError", "SourceSpec", "StateError", "Tokenizer", "TokenizerSpec",
    "Transform", "ValidationReport", "WorkPlan", "ZephonLoader", "batch_digest", "build_loader", "collate", "diff",
    "global_digest", "lanes_of_rank", "load_pipeline", "load_recipe", "load_state", "load_tokenizer", "locate",
    "merge_states", "read", "recipe_from_dict", "save_state", "select_rows", "tokenizer", "trace",
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


if TYPE_CHECKING:  # the same names, eagerly, for type checkers and IDEs
    from . import read
    from .batches.packed import HASHED_KEYS, batch_digest, collate, global_digest
    from .batches.rows import select_rows
    from .errors import OperatorError, PipelineError, RecipeError, SourceError, StateError
    from .graph.explain import ValidationReport
    from .loader import ZephonLoader, build_loader, lanes_of_rank
    from .origins import PROVENANCE_COLUMNS
    from .ops.base import Accumulator, LaneContext, Merge, Transform
    from .ops.schedule import Schedule
    from .pipeline import Pipeline, tokenizer
    from .plan import WorkPlan
    from .provenance.diff import DiffReport, diff
    from .provenance.locate import Landing, Location, locate
    from .provenance.segments import Segment
    from .provenance.trace import trace
    from .recipe.parse import Recipe, load_recipe, recipe_from_dict
    from .recipe.references import load_pipeline
    from .records import IGNORE, Doc, Flush
    from .specs import PackSpec, SourceSpec, TokenizerSpec
    from .state import LaneState, load_state, merge_states, save_state
    from .tokenization import Tokenizer, load_tokenizer

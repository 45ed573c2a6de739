"""Zephon: an elastic-deterministic data loader for LLM and multimodal pre-training.

The same global batches, byte for byte, on any number of data-parallel ranks and loader workers,
and after resuming on a different rank count; with decoding, tokenization, splitting, mixing and
packing done online. Pipelines are written with :class:`Pipeline` (a TOML recipe is another spelling);
see README.md and docs/design.md.
"""

from . import read
from .batch_rows import select_rows
from .collate import HASHED_KEYS, batch_digest, collate, global_digest
from .compile import ValidationReport
from .loader import ZephonLoader, build_loader, lanes_of_rank
from .ops.base import Accumulator, LaneContext, Merge, Transform
from .ops.schedule import Schedule
from .errors import OperatorError
from .pipeline import Pipeline, tokenizer
from .errors import PipelineError
from .plan import WorkPlan
from .errors import SourceError
from .recipe import Recipe, load_recipe, recipe_from_dict
from .specs import PackSpec, SourceSpec, TokenizerSpec
from .errors import RecipeError
from .recipe_steps import load_pipeline
from .records import IGNORE, Doc, Flush
from .state import LaneState, load_state, merge_states, save_state
from .errors import StateError
from .tokenization import Tokenizer, load_tokenizer

__version__ = "0.2.0"

__all__ = [
    "Accumulator", "Doc", "Flush", "HASHED_KEYS", "IGNORE", "LaneContext", "LaneState", "Merge", "OperatorError",
    "PackSpec", "Pipeline", "PipelineError", "Recipe", "RecipeError", "Schedule", "SourceError", "SourceSpec",
    "StateError",
    "Tokenizer", "TokenizerSpec", "Transform", "ValidationReport", "WorkPlan", "ZephonLoader", "batch_digest",
    "build_loader", "collate", "global_digest", "lanes_of_rank", "load_pipeline", "load_recipe", "load_state", "load_tokenizer",
    "merge_states", "read", "recipe_from_dict", "save_state", "select_rows", "tokenizer",
]

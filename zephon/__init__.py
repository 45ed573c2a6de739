"""Zephon: an elastic-deterministic data loader for LLM pre-training.

The same global batches, byte for byte, on any number of data-parallel ranks and loader workers,
and after resuming on a different rank count; with tokenization, splitting, mixing and packing done
online. See README.md and DESIGN.md for the contract.
"""

from .collate import HASHED_KEYS, batch_digest, collate, global_digest
from .loader import ZephonLoader, build_loader, lanes_of_rank
from .nodes.items import IGNORE, Flush
from .nodes.lane import LaneState
from .plan import WorkPlan
from .readers import SourceError
from .recipe import PackSpec, Recipe, RecipeError, SourceSpec, TokenizerSpec, load_recipe, recipe_from_dict
from .state import StateError, load_state, merge_states, save_state
from .tokenizer import Tokenizer, load_tokenizer

__version__ = "0.1.0"

__all__ = [
    "IGNORE", "HASHED_KEYS", "Flush", "LaneState", "PackSpec", "Recipe", "RecipeError", "SourceError",
    "SourceSpec", "StateError", "Tokenizer", "TokenizerSpec", "WorkPlan", "ZephonLoader", "batch_digest",
    "build_loader", "collate", "global_digest", "lanes_of_rank", "load_recipe", "load_state",
    "load_tokenizer", "merge_states", "recipe_from_dict", "save_state",
]

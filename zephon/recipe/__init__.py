"""The TOML front end: a recipe is another spelling of a pipeline.

:mod:`.parse` reads a recipe file into a :class:`Recipe` (every key checked, with a suggestion for a typo),
:mod:`.to_pipeline` turns it into the :class:`~zephon.Pipeline` it spells, :mod:`.to_toml` writes a pipeline
as a recipe, and :mod:`.references` takes whatever names a pipeline. The names below are imported on first
use, so that ``Pipeline.to_recipe()`` can use the writer without this package importing the builder first.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Recipe": ".parse", "load_recipe": ".parse", "recipe_from_dict": ".parse",
    "recipe_to_pipeline": ".to_pipeline", "pipeline_to_toml": ".to_toml",
    "as_pipeline": ".references", "load_pipeline": ".references",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'zephon.recipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

"""Whatever names a pipeline, as a pipeline: a :class:`~zephon.Pipeline`, a :class:`~zephon.recipe.Recipe`, a
recipe file, or ``"package.module:name"`` naming a pipeline (how the Torchtitan and Megatron-LM plugins take
one from their command lines)."""

from __future__ import annotations

from typing import Any, Callable

from ..errors import RecipeError
from ..pipeline import Pipeline
from .parse import Recipe, load_recipe
from .to_pipeline import import_ref


def as_pipeline(source: Any, text_map: Callable | None = None, text_filter: Callable | None = None) -> Pipeline:
    """A pipeline from a pipeline, a recipe or a recipe path.

    Args:
        source: a :class:`~zephon.Pipeline`, a :class:`Recipe` or the path of a recipe file.
        text_map, text_filter: per-document text hooks of a classic recipe (module-level functions for the
            process runners), as operators before ``tokenize``.

    Returns:
        The pipeline.

    Raises:
        TypeError: ``source`` is none of those.
        ValueError: text hooks given with a pipeline (add them as ``map_field``/``filter_field`` there).
    """
    if isinstance(source, str):
        source = load_recipe(source)
    if isinstance(source, Recipe):
        return source.to_pipeline(text_map, text_filter)
    if not isinstance(source, Pipeline):
        raise TypeError(f"a zephon.Pipeline, a Recipe or a recipe path is needed, got {source!r}")
    if text_map is not None or text_filter is not None:
        raise ValueError("text_map/text_filter are for recipes; with a pipeline use .map_field() / .filter_field()")
    return source


def load_pipeline(ref: Any) -> Pipeline | Recipe:
    """A pipeline or recipe from a reference: a :class:`Pipeline` or :class:`Recipe` as it is, a recipe file path
    (``.toml``), or ``"package.module:name"`` naming a Pipeline (or a function of no arguments returning one).

    Args:
        ref: the reference (what ``zephon run``, ``zephon verify`` and the plugins take).

    Returns:
        The pipeline or recipe (build either with :func:`zephon.build_loader`).

    Raises:
        RecipeError: a reference that names nothing of the kind, or a bad recipe.
    """
    if isinstance(ref, (Pipeline, Recipe)):
        return ref
    if not isinstance(ref, str) or not ref:
        raise RecipeError(f"a pipeline reference must be a recipe path or 'module:name', got {ref!r}")
    if ":" in ref and not ref.endswith(".toml") and "://" not in ref:
        obj = import_ref(ref, f"pipeline reference {ref!r}")
        if callable(obj) and not isinstance(obj, Pipeline):
            obj = obj()
        if not isinstance(obj, (Pipeline, Recipe)):
            raise RecipeError(f"{ref} is {type(obj).__name__}, not a zephon.Pipeline (or a function returning one)")
        return obj
    return load_recipe(ref)

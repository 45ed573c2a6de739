"""A recipe as the pipeline it spells.

A classic recipe (``[tokenizer]``, ``[pack]``, ``[mix]``...) spells the fixed text chain ``tokenize -> split ->
mix -> shuffle -> pack -> batch``. An ``[[ops]]`` recipe spells any pipeline, one table per operator in order:
``op`` names the builder method and the other keys are its arguments, as in Python::

    [[ops]]
    op = "filter"
    fn = "my_package.filters:long_enough"      # an importable function (recipes are trusted)
    sources = ["web"]

    [[ops]]
    op = "tokenize"
    tokenizer = { kind = "sentencepiece", path = "tok.model" }

    [[ops]]
    op = "pack"
    seq_len = 2048

A few arguments are written as TOML values of their own: ``fn`` and ``factory`` are import paths
(``"module:qualname"``), ``tokenizer`` a path or a ``[tokenizer]``-style table, ``schedule`` a
``[mix.schedule]``-style table. :meth:`zephon.Pipeline.to_recipe` writes this form
(:mod:`zephon.recipe.to_toml`); loading it gives a pipeline with the same fingerprint.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import PipelineError, RecipeError, RecipeFileError
from ..ops.base import Operator
from ..ops.schedule import Schedule
from ..pipeline import Pipeline, tokenizer
from ..read import ReadSpec
from ..specs import READ_KEYS, TokenizerSpec

def recipe_to_pipeline(recipe: Any, text_map: Callable | None = None, text_filter: Callable | None = None) -> Pipeline:
    """The pipeline a :class:`~zephon.recipe.Recipe` spells (``text_map``/``text_filter``: per-document text
    hooks of a classic recipe, as a field map and a field filter before tokenization)."""
    pipe = Pipeline(recipe.seed, recipe.lanes, flush_every=recipe.flush_every, flush_by=recipe.flush_by,
                    storage=recipe.storage, origin=recipe.origin)
    read_defaults = {k: getattr(recipe, k) for k in READ_KEYS}
    for s in recipe.sources:
        spec = ReadSpec(s.format, tuple(s.path), tuple(s.columns) if s.columns else None, s.text_field,
                        s.tokens_field, storage_options=s.storage_options, split=s.split, config=s.config,
                        **{**read_defaults, **(s.read or {})})
        pipe = pipe.source(s.name, spec, s.weight, s.passes)
    if recipe.ops:
        if text_map is not None or text_filter is not None:
            raise RecipeError(f"{recipe.origin}: text_map/text_filter are for classic recipes; in an [[ops]] recipe "
                              f"write them as operators (op = \"map_field\" / \"filter_field\")")
        for i, table in enumerate(recipe.ops):
            pipe = add_op(pipe, table, f"{recipe.origin}: [[ops]] #{i + 1}")
        return pipe
    field_names = {s.tokens_field or s.text_field for s in recipe.sources}
    for field in sorted(field_names):
        names = [s.name for s in recipe.sources if (s.tokens_field or s.text_field) == field]
        srcs = None if len(field_names) == 1 else names
        text_sources = [s.name for s in recipe.sources if not s.tokens_field and s.text_field == field]
        hooks_on = None if srcs is None and len(text_sources) == len(names) else text_sources
        if text_map is not None and text_sources:
            pipe = pipe.map_field(text_map, field, sources=hooks_on, name="text_map")
        if text_filter is not None and text_sources:
            pipe = pipe.filter_field(text_filter, field, sources=hooks_on, name="text_filter")
        pipe = pipe.tokenize(recipe.tokenizer, field, sources=srcs)
    pipe = pipe.split(recipe.split_len).mix(by=recipe.mix_by, schedule=recipe.mix_schedule)
    if recipe.shuffle_buffer > 0:
        pipe = pipe.shuffle(recipe.shuffle_buffer)
    pipe = pipe.pack(recipe.seq_len, recipe.pack.algorithm, recipe.pack.max_open_bins, recipe.tokenizer.pad_id)
    return pipe.batch(recipe.batch_per_lane, recipe.partial_batch, provenance=recipe.provenance)


# -- [[ops]] tables ---------------------------------------------------------------------------------------
def builder_ops() -> dict[str, Callable[..., Pipeline]]:
    """The operators a recipe can name: each built-in operator's ``op``, which is its builder method."""
    found: dict[str, Callable[..., Pipeline]] = {}
    todo = list(Operator.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.op and cls.__module__.startswith("zephon.ops.") and callable(getattr(Pipeline, cls.op, None)):
            found[cls.op] = getattr(Pipeline, cls.op)
    return dict(sorted(found.items()))


def import_ref(ref: Any, where: str) -> Any:
    """``"package.module:qualified.name"`` imported (recipes are trusted: they may name code to run)."""
    if not isinstance(ref, str) or ":" not in ref:
        raise RecipeError(f"{where}: an import path 'module:qualified_name' is needed, got {ref!r}")
    module, qual = ref.split(":", 1)
    try:
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise RecipeError(f"{where}: cannot import {ref} ({type(exc).__name__}: {exc}). Make the module importable "
                          f"(installed, or on PYTHONPATH).") from None
    return obj


def _tokenizer(value: Any, where: str) -> TokenizerSpec:
    """A tokenizer: a path, or a table like ``[tokenizer]`` (its path already resolved by the parser)."""
    if isinstance(value, str):
        value = {"path": value}
    if not isinstance(value, Mapping) or "path" not in value:
        raise RecipeError(f"{where}: 'tokenizer' must be a path or a table {{ kind = ..., path = ... }}")
    opts = {k: v for k, v in value.items() if k not in ("path", "kind")}
    path = Path(str(value["path"]))
    if not path.exists():  # the parser joined a recipe file's relative paths to its folder
        note = "in a recipe file, relative paths resolve against its folder" if path.is_absolute() else \
            f"a relative path resolves against the current directory, {Path.cwd()}"
        raise RecipeFileError(f"{where}: tokenizer file not found: {path} does not exist. Fix the path ({note}).")
    try:
        return tokenizer(str(path), value.get("kind"), **opts)
    except RecipeFileError as exc:
        raise RecipeFileError(f"{where}: {exc}") from None
    except (TypeError, PipelineError, RecipeError) as exc:
        raise RecipeError(f"{where}: {exc}") from None


def _schedule(value: Any, where: str) -> Schedule:
    try:
        return Schedule.from_dict(value, f"{where}: schedule")
    except ValueError as exc:
        raise RecipeError(str(exc)) from None


# arguments written as TOML values of their own (the rest are passed as written)
CONVERT: dict[str, Callable[[Any, str], Any]] = {"fn": import_ref, "factory": import_ref, "tokenizer": _tokenizer,
                                                 "schedule": _schedule}


def add_op(pipe: Pipeline, table: Mapping[str, Any], where: str) -> Pipeline:
    """``pipe`` with the operator an ``[[ops]]`` table spells (errors name the table and the fix)."""
    ops = builder_ops()
    t = dict(table)
    if "op" not in t:
        raise RecipeError(f"{where}: no 'op': each [[ops]] table names its operator, op = \"<name>\" (one of "
                          f"{', '.join(ops)}), and gives its arguments as the other keys (here: "
                          f"{', '.join(map(str, t)) or 'none'}).")
    op = t.pop("op")
    if op not in ops:
        close = difflib.get_close_matches(str(op), ops, n=1)
        raise RecipeError(f"{where}: unknown op {op!r}" + (f"; did you mean '{close[0]}'?" if close else "") +
                          f" (the operators: {', '.join(ops)})")
    where = f"{where} (op = {op!r})"
    params = [p for name, p in inspect.signature(ops[op]).parameters.items() if name != "self"]
    known = {p.name for p in params}
    for key in t:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            raise RecipeError(f"{where}: unknown key '{key}'." + (f" Did you mean '{close[0]}'?" if close else
                                                                 f" Its keys: {', '.join(sorted(known))}."))
    kwargs = {k: CONVERT[k](v, f"{where}: '{k}'") if k in CONVERT else v for k, v in t.items()}
    try:
        return getattr(pipe, op)(**kwargs)
    except (PipelineError, TypeError) as exc:  # TypeError: a required argument missing
        raise RecipeError(f"{where}: {exc}") from None

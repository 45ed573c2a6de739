"""Recipes and pipelines: the two spellings of one graph.

A classic recipe (``[tokenizer]``, ``[pack]``, ``[mix]``...) compiles to the fixed text chain
``tokenize -> split -> mix -> shuffle -> pack -> batch`` (:func:`recipe_to_pipeline`). A recipe with
``[[steps]]`` spells any pipeline, one table per operator in order::

    [[steps]]
    op = "filter"
    fn = "my_package.filters:long_enough"      # an importable function (recipes are trusted)
    sources = ["web"]

    [[steps]]
    op = "tokenize"
    tokenizer = { kind = "sentencepiece", path = "tok.model" }

    [[steps]]
    op = "pack"
    seq_len = 2048

:meth:`Pipeline.to_recipe` writes that form; loading it gives a pipeline with the same fingerprint.
"""

from __future__ import annotations

import importlib
import json
import re
from typing import Any, Callable, Mapping

from .pipeline import AccumulateStep, BatchStep, MixStep, PackStep, Pipeline, ShuffleStep
from .errors import PipelineError
from .read import ReadSpec
from .recipe import Recipe
from .errors import RecipeError
from .specs import TokenizerSpec


# -- classic recipes ------------------------------------------------------------------------------------
def recipe_to_pipeline(recipe: Recipe, text_map: Callable | None = None, text_filter: Callable | None = None
                       ) -> Pipeline:
    """The fixed text chain a classic recipe describes (``text_map``/``text_filter``: the legacy hooks,
    as a field map and a field filter before tokenization)."""
    steps = getattr(recipe, "steps", None)
    if steps:
        return steps_to_pipeline(recipe)
    pipe = Pipeline(recipe.seed, recipe.lanes, flush_every=recipe.flush_every, flush_by=recipe.flush_by,
                    storage=recipe.storage,
                    origin=recipe.origin)
    read_defaults = {k: getattr(recipe, k) for k in ("chunk_rows", "chunk_bytes", "unit_bytes", "cache_bytes",
                                                    "max_doc_bytes", "oversize") if hasattr(recipe, k)}
    for s in recipe.sources:
        spec = ReadSpec(s.format, tuple(s.path), s.columns, s.text_field, s.tokens_field,
                        storage_options=s.storage_options, split=s.split,
                        config=s.config, **{**read_defaults, **(s.read or {})})
        pipe = pipe.source(s.name, spec, s.weight, s.passes)
    field_names = {s.tokens_field or s.text_field for s in recipe.sources}
    for field in sorted(field_names):
        names = [s.name for s in recipe.sources if (s.tokens_field or s.text_field) == field]
        srcs = None if len(field_names) == 1 else names
        text_sources = [s.name for s in recipe.sources if not s.tokens_field and s.text_field == field]
        if text_map is not None and text_sources:
            pipe = pipe.map_field(text_map, field, sources=None if srcs is None and len(text_sources) == len(names)
                                  else text_sources, name="text_map")
        if text_filter is not None and text_sources:
            pipe = pipe.filter_field(text_filter, field, sources=None if srcs is None and len(text_sources) == len(names)
                                     else text_sources, name="text_filter")
        pipe = pipe.tokenize(recipe.tokenizer, field, sources=srcs)
    pipe = pipe.split(recipe.split_len)
    pipe = pipe.mix(by=recipe.mix_by, schedule=recipe.mix_schedule)
    if recipe.shuffle_buffer > 0:
        pipe = pipe.shuffle(recipe.shuffle_buffer)
    pipe = pipe.pack(recipe.seq_len, recipe.pack.algorithm, recipe.pack.max_open_bins, recipe.tokenizer.pad_id)
    return pipe.batch(recipe.batch_per_lane, recipe.partial_batch)


def load_pipeline(ref: Any) -> Any:
    """A pipeline or recipe from a reference: a :class:`Pipeline` or :class:`Recipe` as it is, a recipe
    file path (``.toml``), or ``"package.module:name"`` naming a Pipeline (or a function of no arguments
    that returns one) — how the Torchtitan and Megatron-LM plugins take a builder pipeline from their
    command lines."""
    from .recipe import load_recipe

    if isinstance(ref, (Pipeline, Recipe)):
        return ref
    if not isinstance(ref, str) or not ref:
        raise RecipeError(f"a pipeline reference must be a recipe path or 'module:name', got {ref!r}")
    if ":" in ref and not ref.endswith(".toml") and "://" not in ref:
        obj = _import(ref, f"pipeline reference {ref!r}")
        if callable(obj) and not isinstance(obj, Pipeline):
            obj = obj()
        if not isinstance(obj, (Pipeline, Recipe)):
            raise RecipeError(f"{ref} is {type(obj).__name__}, not a zephon.Pipeline (or a function returning one)")
        return obj
    return load_recipe(ref)


# -- [[steps]] recipes -----------------------------------------------------------------------------------
def _import(ref: str, where: str) -> Any:
    if not isinstance(ref, str) or ":" not in ref:
        raise RecipeError(f"{where}: 'fn' must be 'module:qualified_name' (an importable function), got {ref!r}")
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
    """A step's tokenizer: a path, or a table like [tokenizer] (its path already resolved by the parser)."""
    from .pipeline import tokenizer as make

    if isinstance(value, str):
        value = {"path": value}
    if not isinstance(value, Mapping) or "path" not in value:
        raise RecipeError(f"{where}: 'tokenizer' must be a path or a table {{ kind = ..., path = ... }}")
    path = str(value["path"])
    opts = {k: v for k, v in value.items() if k not in ("path", "kind")}
    return make(path, value.get("kind"), **opts)


def steps_to_pipeline(recipe: Recipe) -> Pipeline:
    """A ``[[steps]]`` recipe (its tables kept on ``recipe.steps``) as a pipeline."""
    pipe = Pipeline(recipe.seed, recipe.lanes, flush_every=recipe.flush_every, flush_by=recipe.flush_by,
                    storage=recipe.storage,
                    origin=recipe.origin)
    read_defaults = {k: getattr(recipe, k) for k in ("chunk_rows", "chunk_bytes", "unit_bytes", "cache_bytes",
                                                    "max_doc_bytes", "oversize") if hasattr(recipe, k)}
    for s in recipe.sources:
        spec = ReadSpec(s.format, tuple(s.path), tuple(s.columns) if s.columns else None, s.text_field,
                        s.tokens_field, storage_options=s.storage_options, split=s.split,
                        config=s.config, **{**read_defaults, **(s.read or {})})
        pipe = pipe.source(s.name, spec, s.weight, s.passes)
    for i, table in enumerate(recipe.steps):
        where = f"{recipe.origin}: [[steps]] #{i + 1}"
        t = dict(table)
        op = t.pop("op", None)
        try:
            pipe = _step(pipe, op, t, where)
        except PipelineError as exc:
            raise RecipeError(f"{where} (op = {op!r}): {exc}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, RecipeError):
                raise
            raise RecipeError(f"{where} (op = {op!r}): {exc}") from None
    return pipe


def _step(pipe: Pipeline, op: Any, t: dict[str, Any], where: str) -> Pipeline:
    if op in ("map", "filter", "flat_map", "map_batch"):
        fn = _import(t.pop("fn", None), where)
        return getattr(pipe, op)(fn, **t)
    if op in ("map_field", "filter_field"):
        fn = _import(t.pop("fn", None), where)
        return getattr(pipe, op)(fn, **t)
    if op == "tokenize":
        return pipe.tokenize(_tokenizer(t.pop("tokenizer", None), where), **t)
    if op == "tokenize_chat":
        tok = _tokenizer(t.pop("tokenizer", None), where)
        return pipe.tokenize_chat(tok, t.pop("template", None), **t)
    if op == "decode_images":  # zephon/ops/image.py
        return pipe.decode_images(**t)
    if op == "tokenize_images":  # zephon/ops/image_tokens.py
        return pipe.tokenize_images(_tokenizer(t.pop("tokenizer", None), where), **t)
    if op == "split":
        return pipe.split(**t)
    if op == "mix":
        if "schedule" in t:
            from .recipe import _schedule

            t["schedule"] = _schedule(t["schedule"], where, "schedule")
        return pipe.mix(**t)
    if op == "shuffle":
        return pipe.shuffle(**t)
    if op == "accumulate":
        factory = _import(t.pop("factory", None), where)
        return pipe.accumulate(factory, **t)
    if op == "pack":
        return pipe.pack(**t)
    if op == "batch":
        return pipe.batch(**t)
    raise RecipeError(f"{where}: unknown op {op!r} (map, filter, flat_map, map_batch, map_field, filter_field, "
                      f"tokenize, tokenize_chat, decode_images, tokenize_images, split, mix, shuffle, accumulate, "
                      f"pack, batch)")


# -- writing TOML --------------------------------------------------------------------------------------
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items() if x is not None) + " }"
    raise TypeError(f"cannot write {v!r} to TOML")


def _toml_key(k: Any) -> str:
    """A TOML key: bare when it may be (``path``), quoted otherwise (a special token ``"<|endoftext|>"``)."""
    k = str(k)
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def _fn_ref(fn: Callable, op_name: str) -> str:
    module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qual or "<" in qual or module == "__main__":
        raise ValueError(f"operator '{op_name}': its function {fn!r} cannot be written to a recipe (a lambda, a local "
                         f"or a __main__ function has no import path); use a function defined in a module")
    return f"{module}:{qual}"


def _tok_table(spec: TokenizerSpec) -> dict[str, Any]:
    table = {k: v for k, v in vars(spec).items() if v is not None}
    if spec.special_tokens is not None:  # stored as ((name, id), ...); written as the table a recipe gives
        table["special_tokens"] = dict(spec.special_tokens)
    return table


def pipeline_to_toml(pipe: Pipeline) -> str:
    from .ops.chat import TokenizeChat
    from .ops.image import DecodeImages
    from .ops.image_tokens import TokenizeImages
    from .ops.split import Split
    from .ops.tokenize import Tokenize
    from .ops.transforms import FieldFilter, FieldMap, _FunctionTransform

    lines = ["# written by zephon Pipeline.to_recipe()", f"seed = {pipe.seed}", f"lanes = {pipe.lanes}",
             f"flush_every = {pipe.flush_every}", f"flush_by = {_toml_value(pipe.flush_by)}", ""]
    for s in pipe.sources:
        r = s.read
        if r.format == "memory":
            raise ValueError(f"source '{s.name}' is an in-memory source (zephon.read.records / read.table), which a "
                             f"recipe cannot hold: write it to a file first (e.g. pyarrow.parquet.write_table) and "
                             f"read that with zephon.read.parquet")
        lines += ["[[sources]]", f"name = {_toml_value(s.name)}", f"format = {_toml_value(r.format)}",
                  f"path = {_toml_value(list(r.path))}", f"weight = {_toml_value(s.weight)}"]
        if r.tokens_field:
            lines.append(f"tokens_field = {_toml_value(r.tokens_field)}")
        else:
            lines.append(f"text_field = {_toml_value(r.text_field)}")
        if r.columns is not None:
            lines.append(f"columns = {_toml_value(list(r.columns))}")
        if s.passes is not None:
            lines.append(f"passes = {s.passes}")
        for key in ("split", "config"):  # format = "hf"
            if getattr(r, key, None) is not None:
                lines.append(f"{key} = {_toml_value(getattr(r, key))}")
        read = {k: getattr(r, k) for k in ("chunk_rows", "chunk_bytes", "unit_bytes", "cache_bytes", "max_doc_bytes",
                                           "oversize")}
        lines.append(f"read = {_toml_value(read)}")
        lines.append("")
    for step in pipe.steps:
        t: dict[str, Any] = {}
        if isinstance(step, (FieldMap, FieldFilter)):
            t = {"op": "map_field" if isinstance(step, FieldMap) else "filter_field",
                 "fn": _fn_ref(step.fn, step.name), "field": step.field}
        elif isinstance(step, _FunctionTransform):
            t = {"op": step.kind, "fn": _fn_ref(step.fn, step.name)}
            if step.on_error != "raise":
                t["on_error"] = step.on_error
            if step.token_fields:
                raise ValueError(f"operator '{step.name}': token_fields cannot be written to a recipe yet")
        elif isinstance(step, DecodeImages):
            t = {"op": "decode_images", **step.to_table()}
        elif isinstance(step, TokenizeImages):
            t = {"op": "tokenize_images", "tokenizer": _tok_table(step.spec), **step.to_table()}
        elif isinstance(step, TokenizeChat):
            t = {"op": "tokenize_chat", "tokenizer": _tok_table(step.spec), "template": step.template_text,
                 "field": step.field, "loss_on": step.loss_on, "add_eos": step.add_eos, "date": step.date}
            if step.add_generation_prompt:
                t["add_generation_prompt"] = True
            if step.on_error != "raise":
                t["on_error"] = step.on_error
        elif isinstance(step, Tokenize):
            t = {"op": "tokenize", "tokenizer": _tok_table(step.spec), "field": step.field}
            if step.keep_field:
                t["keep_field"] = True
        elif isinstance(step, Split):
            t = {"op": "split", "max_tokens": step.max_tokens}
        elif isinstance(step, MixStep):
            t = {"op": "mix", "by": step.by, **({"weights": step.weights} if step.weights else {})}
            if step.schedule is not None:
                t["schedule"] = {"interpolate": step.schedule.interpolate,
                                 "points": [{"step": p, "weights": dict(w)} for p, w in step.schedule.points]}
        elif isinstance(step, ShuffleStep):
            t = {"op": "shuffle", "buffer": step.buffer}
        elif isinstance(step, AccumulateStep):
            t = {"op": "accumulate", "factory": _fn_ref(step.factory, step.name), "name": step.name}
        elif isinstance(step, PackStep):
            t = {"op": "pack", "seq_len": step.seq_len, "algorithm": step.algorithm,
                 "max_open_bins": step.max_open_bins, "pad_id": step.pad_id,
                 "max_images_per_row": step.max_images_per_row, "max_patches_per_row": step.max_patches_per_row}
        elif isinstance(step, BatchStep):
            t = {"op": "batch", "rows_per_lane": step.rows_per_lane, "partial": step.partial}
            if step.stack:
                t["stack"] = list(step.stack)
            if step.pixels != "flat":
                t["pixels"] = step.pixels
            if step.positions != "1d":
                t["positions"] = step.positions
        else:
            raise ValueError(f"operator '{step.name}' ({type(step).__name__}) cannot be written to a recipe")
        if getattr(step, "sources", None) is not None:
            t["sources"] = list(step.sources)
        version = getattr(step, "version", None)
        if version is not None:
            t["version"] = version
        lines.append("[[steps]]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in t.items() if v is not None]
        lines.append("")
    return "\n".join(lines)

"""A pipeline as an ``[[ops]]`` recipe: every operator's table is its ``op`` and its parameters.

The parameters are the operator's own (:meth:`zephon.ops.base.Operator.params`, with its ``name`` and
``executor`` when set), written as TOML values: functions and factories by import path, a tokenizer as a
``[tokenizer]``-style table, a schedule as a ``[mix.schedule]``-style table. Reading the recipe back
(:mod:`zephon.recipe.to_pipeline`) gives a pipeline with the same fingerprint. This module reads pipelines
without importing the builder (it is what ``Pipeline.to_recipe()`` calls).

**Paths.** A recipe's local paths (its sources' files, a tokenizer file) are resolved against
the recipe file's folder when it is loaded (:func:`zephon.load_recipe`), whereas a pipeline's are relative to
the working directory. So the writer writes each local path relative to the folder the recipe is saved in,
when it is told (``base_dir``), and absolute otherwise; URLs (``s3://...``) are written as they are. Either
way the recipe loads back to the same files, wherever it is saved.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping

from ..ops.base import Operator
from ..ops.schedule import Schedule
from ..specs import READ_KEYS, TokenizerSpec


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
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items()
                                if x is not None) + " }"
    raise TypeError(f"cannot write {v!r} to TOML")


def _fn_ref(fn: Callable, where: str) -> str:
    module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qual or "<" in qual or module == "__main__":
        raise ValueError(f"{where}: {fn!r} cannot be written to a recipe (a lambda, a nested or a __main__ function "
                         f"has no import path); use a function defined in a module")
    return f"{module}:{qual}"


def _value(v: Any, where: str) -> Any:
    """A parameter as TOML data."""
    if isinstance(v, TokenizerSpec):
        return {k: x for k, x in vars(v).items() if x is not None and k != "special_tokens"} | \
            ({"special_tokens": dict(v.special_tokens)} if v.special_tokens is not None else {})
    if isinstance(v, Schedule):
        return {"interpolate": v.interpolate, "points": [{"step": p, "weights": dict(w)} for p, w in v.points]}
    if callable(v) and not isinstance(v, (str, bytes)):
        return _fn_ref(v, where)
    if isinstance(v, tuple):
        return [_value(x, where) for x in v]
    if isinstance(v, Mapping):
        return {k: _value(x, where) for k, x in v.items()}
    return v


def _local_path(path: str, base_dir: str | None) -> str:
    """``path`` as a recipe in ``base_dir`` (a resolved folder; None: anywhere) writes it: a URL as it is, a local
    path relative to ``base_dir``, or absolute (the inverse of zephon.recipe.parse's ``_resolve``)."""
    if "://" in path:
        return path
    absolute = os.path.abspath(path)
    if base_dir is None:
        return absolute
    try:
        return os.path.relpath(absolute, base_dir)
    except ValueError:  # another drive (Windows): no relative path exists
        return absolute


def _op_paths(table: dict[str, Any], base_dir: str | None) -> dict[str, Any]:
    """An operator table's tokenizer file as :func:`_local_path` writes it (zephon.recipe.parse's
    ``_resolve_op_paths`` resolves it on loading). A chat template needs nothing: it is written as its text."""
    tok = table.get("tokenizer")
    if isinstance(tok, str):
        table["tokenizer"] = _local_path(tok, base_dir)
    elif isinstance(tok, Mapping) and isinstance(tok.get("path"), str):
        table["tokenizer"] = {**tok, "path": _local_path(tok["path"], base_dir)}
    return table


def op_table(op: Operator) -> dict[str, Any]:
    """An operator's ``[[ops]]`` table (``op`` and its parameters; None values left out, as TOML has none)."""
    where = f"operator '{op.name}'"
    if not op.op or not type(op).__module__.startswith("zephon.ops."):
        raise ValueError(f"{where} ({type(op).__qualname__}) is your own class, which a recipe cannot name; build "
                         f"this pipeline in Python")
    params = dict(op.params())
    for k in sorted(op.NOT_FINGERPRINTED - Operator.NOT_FINGERPRINTED):  # written, though no byte depends on it
        if getattr(op, k, None):
            params[k] = getattr(op, k)
    if getattr(op, "_named", False):
        params["name"] = op.name
    if getattr(op, "executor", None) is not None:
        params["executor"] = op.executor
    if op.version is not None:
        params["version"] = op.version
    return {"op": op.op, **{k: _value(v, f"{where}: '{k}'") for k, v in params.items() if v is not None}}


def pipeline_to_toml(pipe: Any, base_dir: str | os.PathLike[str] | None = None) -> str:
    """``pipe`` as an ``[[ops]]`` recipe (see the module docstring).

    Args:
        pipe: the pipeline (a :class:`zephon.Pipeline`).
        base_dir: the folder the recipe will be saved in: local paths are written relative to it. None: they
            are written absolute.

    Returns:
        The recipe's TOML text.

    Raises:
        ValueError: something a recipe cannot hold (an in-memory source, a lambda, your own operator class).
    """
    base = os.path.realpath(base_dir) if base_dir is not None else None  # as load_recipe resolves its folder
    lines = ["# written by zephon Pipeline.to_recipe()", f"seed = {pipe.seed}", f"lanes = {pipe.lanes}",
             f"flush_every = {pipe.flush_every}", f"flush_by = {_toml_value(pipe.flush_by)}", ""]
    for s in pipe.sources:
        r = s.read
        if r.format == "memory":
            raise ValueError(f"source '{s.name}' is an in-memory source (zephon.read.records / read.table), which a "
                             f"recipe cannot hold: write it to a file first (e.g. pyarrow.parquet.write_table) and "
                             f"read that with zephon.read.parquet")
        table: dict[str, Any] = {"name": s.name, "format": r.format, "path": [_local_path(p, base) for p in r.path],
                                 "weight": s.weight}
        table.update({"tokens_field": r.tokens_field} if r.tokens_field else {"text_field": r.text_field})
        table.update({k: v for k, v in (("columns", list(r.columns) if r.columns is not None else None),
                                        ("passes", s.passes), ("split", r.split), ("config", r.config))
                      if v is not None})
        table["read"] = {k: getattr(r, k) for k in READ_KEYS}
        lines += ["[[sources]]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()] + [""]
    for op in pipe.ops:
        lines += ["[[ops]]"] + [f"{k} = {_toml_value(v)}" for k, v in _op_paths(op_table(op), base).items()] + [""]
    return "\n".join(lines)

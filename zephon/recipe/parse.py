"""Recipes: the TOML file that defines a run, parsed into a frozen :class:`Recipe`.

Two spellings: the classic keys (``[tokenizer]``, ``[pack]``, ``[mix]``...: the fixed text chain) or
``[[ops]]`` tables, one per operator in order (``op = "<builder method>"`` and its arguments; any pipeline).
``[[steps]]``, the spelling before 0.3, is read as ``[[ops]]`` with a warning.

A recipe fixes everything that decides the bytes of the global batches (seed, lanes, seq_len,
batch_per_lane, flush_every, tokenizer, packing, mixing, sources). Runtime knobs that only change
speed (world size, rank, workers, runner) are *not* part of it. Paths resolve relative to the
recipe file. Unknown keys are errors, with a suggestion, because a misspelt key silently falling
back to a default would be a different run than the one the user asked for.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tomllib
import warnings
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Mapping

from ..errors import RecipeError, RecipeFileError
from ..specs import (MIX_BY, OVERSIZE_POLICIES, PACK_ALGORITHMS, SEED_LIMIT, SOURCE_FORMATS, TOKENIZER_KINDS,
                     READ_KEYS, TOKENS_FORMATS, WEIGHT_DENOMINATOR, PackSpec, SourceSpec, StorageSpec, TokenizerSpec, _is_int,
                     _type_note, validate_special_tokens)


@dataclass(frozen=True)
class Recipe:
    """A parsed, validated recipe. Build one with :func:`load_recipe` or :func:`recipe_from_dict`.

    Its fields are the recipe's keys (docs/reference/recipe.md); a classic recipe sets them all, an ``[[ops]]``
    recipe holds its operator tables in ``ops`` and takes ``seq_len``, ``batch_per_lane`` and ``tokenizer``
    from its ``pack``, ``batch`` and first tokenizing operators.
    """

    seed: int
    """Decides all randomness, an integer in ``[0, 2**63)``."""
    lanes: int
    """The number of logical streams, fixed for a run: world sizes must divide it."""
    seq_len: int
    """Tokens per packed row (1 for a pipeline without ``pack``: a row is a record)."""
    batch_per_lane: int
    """Rows each lane adds to every global batch."""
    tokenizer: TokenizerSpec
    """The tokenizer (an ``[[ops]]`` recipe's first tokenizing operator's)."""
    sources: tuple[SourceSpec, ...]
    """The ``[[sources]]`` tables, in order."""
    flush_every: int = 8
    """Completed chunks (or units) per lane between flush sentinels."""
    flush_by: str = "chunks"
    """What ``flush_every`` counts: ``"chunks"`` or ``"units"`` (:mod:`zephon.engine.sentinels`)."""
    partial_batch: str = "drop"
    """Sources that stop: ``"drop"`` the last global batch some lane cannot fill, or ``"pad"`` it."""
    provenance: bool = False
    """Every batch carries a ``provenance`` tensor (:mod:`zephon.origins`; not fingerprinted)."""
    pack: PackSpec = field(default_factory=PackSpec)
    """``[pack]``: the packing algorithm."""
    mix_by: str = "tokens"
    """``[mix] by``: the mixture by ``"tokens"`` or ``"documents"``."""
    mix_schedule: Any = field(default=None, hash=False)
    """``[mix.schedule]``: weights over training steps (a :class:`zephon.Schedule`, or None)."""
    shuffle_buffer: int = 0
    """Documents held by the per-lane shuffle buffer (0: no shuffle)."""
    max_doc_tokens: int | None = None
    """Documents are split into pieces of at most this many tokens (None: ``seq_len``)."""
    chunk_rows: int = 64
    """``[read]``: rows per stateless task (row formats): small keeps start-up and memory low."""
    chunk_bytes: int = 256 << 10
    """``[read]``: bytes per task for plain JSON Lines."""
    unit_bytes: int = 64 << 20
    """``[read]``: plain JSON Lines files are cut into units of at most this many bytes."""
    cache_bytes: int = 1 << 30
    """``[read]``: decoded data kept per process, in bytes (speed only)."""
    max_doc_bytes: int = 16 << 20
    """``[read]``: a larger document (JSON Lines: line) is handled by ``oversize``."""
    oversize: str = "skip"
    """``[read]``: ``"skip"`` (and count), ``"truncate"`` (at a UTF-8 boundary) or ``"error"``."""
    storage: StorageSpec = field(default_factory=StorageSpec)
    """``[storage]``: object-store retries and cache (not fingerprinted)."""
    origin: str = "<dict>"
    """The file it came from, for messages."""
    ops: tuple = field(default=(), repr=False)
    """An ``[[ops]]`` recipe's operator tables, in order (zephon/recipe/to_pipeline.py); empty: the classic chain."""

    @property
    def global_batch_size(self) -> int:
        """Rows in every global batch: ``lanes * batch_per_lane``."""
        return self.lanes * self.batch_per_lane

    @property
    def split_len(self) -> int:
        """The longest piece documents are split into: ``max_doc_tokens``, else ``seq_len``."""
        return self.max_doc_tokens or self.seq_len

    def to_pipeline(self, text_map: Any = None, text_filter: Any = None) -> Any:
        """This recipe as the :class:`~zephon.pipeline.Pipeline` it spells.

        Args:
            text_map: a classic recipe's per-document text hook, ``fn(text) -> text``, run as an operator
                before ``tokenize`` (None: none).
            text_filter: a classic recipe's per-document filter, ``fn(text) -> bool``, likewise (None: none).

        Returns:
            The pipeline, with the same fingerprint as the recipe.

        Raises:
            RecipeError: an operator table is not valid (naming it).
        """
        from .to_pipeline import recipe_to_pipeline

        return recipe_to_pipeline(self, text_map, text_filter)

    def replace(self, **changes: Any) -> "Recipe":
        """A copy with some fields changed (validated again).

        Args:
            **changes: field name -> new value.

        Returns:
            The new recipe; this one is unchanged.

        Raises:
            RecipeError: a value out of range, naming the key.
        """
        return _validate(dataclasses.replace(self, **changes))


_TOP_KEYS = {
    "seed", "lanes", "seq_len", "batch_per_lane", "flush_every", "flush_by", "partial_batch", "provenance",
    "tokenizer", "pack", "sources",
    "mix", "shuffle", "split", "read", "storage",
}
_OPS_TOP_KEYS = {"seed", "lanes", "flush_every", "flush_by", "sources", "read", "storage", "ops"}  # an [[ops]] recipe
_TOKENIZER_KEYS = {f.name for f in dataclasses.fields(TokenizerSpec)}
_PACK_KEYS = {f.name for f in dataclasses.fields(PackSpec)}
_SOURCE_KEYS = {f.name for f in dataclasses.fields(SourceSpec)}
_MIX_KEYS = {"by", "schedule"}
_SHUFFLE_KEYS = {"buffer"}
_SPLIT_KEYS = {"max_doc_tokens"}
_READ_KEYS = set(READ_KEYS)
_STORAGE_KEYS = {f.name for f in dataclasses.fields(StorageSpec)}


def _check_keys(table: Mapping[str, Any], allowed: set[str], where: str, origin: str) -> None:
    for key in table:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else f" Allowed keys: {', '.join(sorted(allowed))}."
            raise RecipeError(f"{origin}: unknown key '{key}' in {where}.{hint}")


def _require(table: Mapping[str, Any], key: str, where: str, origin: str) -> Any:
    if key not in table:
        raise RecipeError(f"{origin}: missing required key '{key}' in {where}.")
    return table[key]


def _table(data: Mapping[str, Any], name: str, origin: str) -> Mapping[str, Any]:
    """The ``[name]`` table of the recipe (empty when absent); anything else in its place is an error."""
    table = data.get(name, {})
    if not isinstance(table, Mapping):
        raise RecipeError(f"{origin}: '{name}' must be a table ([{name}] and its keys), got {table!r}"
                          f"{_type_note(table)}.")
    return table


def _resolve(path: str, base: Path | None) -> str:
    if "://" in path or base is None or os.path.isabs(path):
        return path
    return str((base / path).resolve()) if not any(c in path for c in "*?[") else str(base / path)


def _source_paths(value: Any, where: str, origin: str) -> list[str]:
    """``path`` of a ``[[sources]]`` table: a non-empty string or a non-empty list of them."""
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, (list, tuple)) or not paths or not all(isinstance(p, str) and p for p in paths):
        raise RecipeError(f"{origin}: {where}: 'path' must be a file, folder or glob as a non-empty string, or a "
                          f"non-empty list of them, got {value!r}{_type_note(value)}.")
    return paths


def recipe_from_dict(data: Mapping[str, Any], base_dir: str | os.PathLike | None = None,
                     origin: str = "<dict>") -> Recipe:
    """Build a :class:`Recipe` from the TOML structure (a dict as ``tomllib`` reads it).

    Values are taken as written, never converted: ``lanes = 2.5``, ``lanes = true`` or ``lanes = "8"``
    is an error naming the key, not a run with 2, 1 or 8 lanes.

    Args:
        data: the recipe's tables and keys.
        base_dir: the folder relative paths (sources, tokenizer, cache) resolve against (None: left as they are,
            relative to the working directory).
        origin: where the data came from, for messages.

    Returns:
        The validated recipe.

    Raises:
        RecipeError: an unknown or missing key, or a value of the wrong type or out of range (naming it).
    """
    base = Path(base_dir) if base_dir is not None else None
    if not isinstance(data, Mapping):
        raise RecipeError(f"{origin}: a recipe is a table of keys, got {type(data).__name__}.")
    if "steps" in data and "ops" not in data:  # the spelling before 0.3
        warnings.warn(f"{origin}: [[steps]] is now spelled [[ops]] (one table per operator); [[steps]] is read as "
                      f"[[ops]] for now", DeprecationWarning, stacklevel=3)
        data = {("ops" if k == "steps" else k): v for k, v in data.items()}
    if "ops" in data:
        _check_keys(data, _OPS_TOP_KEYS, "the top level of an [[ops]] recipe (the operators are [[ops]] tables)",
                    origin)
        return _ops_recipe(data, base, origin)
    _check_keys(data, _TOP_KEYS, "the top level", origin)

    tok_table = _require(data, "tokenizer", "the top level", origin)
    if not isinstance(tok_table, Mapping):
        raise RecipeError(f"{origin}: 'tokenizer' must be a table ([tokenizer] with kind and path), got "
                          f"{tok_table!r}{_type_note(tok_table)}.")
    _check_keys(tok_table, _TOKENIZER_KEYS, "[tokenizer]", origin)
    tok_path = _require(tok_table, "path", "[tokenizer]", origin)
    if not isinstance(tok_path, str) or not tok_path:
        raise RecipeError(f"{origin}: 'tokenizer.path' must be the tokenizer file as a non-empty string, got "
                          f"{tok_path!r}{_type_note(tok_path)}.")
    tok = TokenizerSpec(**{**tok_table, "kind": _require(tok_table, "kind", "[tokenizer]", origin),
                           "path": _resolve(tok_path, base)})

    pack_table = _table(data, "pack", origin)
    _check_keys(pack_table, _PACK_KEYS, "[pack]", origin)
    pack = PackSpec(**pack_table)

    sources = _sources(data, base, origin)
    tables = {"mix": _MIX_KEYS, "shuffle": _SHUFFLE_KEYS, "split": _SPLIT_KEYS, "read": _READ_KEYS,
              "storage": _STORAGE_KEYS}
    for name, keys in tables.items():
        _check_keys(_table(data, name, origin), keys, f"[{name}]", origin)
    read = data.get("read", {})
    defaults = Recipe.__dataclass_fields__
    recipe = Recipe(
        seed=_require(data, "seed", "the top level", origin),
        lanes=_require(data, "lanes", "the top level", origin),
        seq_len=_require(data, "seq_len", "the top level", origin),
        batch_per_lane=data.get("batch_per_lane", 1),
        flush_every=data.get("flush_every", 8),
        flush_by=data.get("flush_by", "chunks"),
        partial_batch=data.get("partial_batch", "drop"),
        provenance=data.get("provenance", False),
        tokenizer=tok,
        pack=pack,
        sources=tuple(sources),
        mix_by=data.get("mix", {}).get("by", "tokens"),
        mix_schedule=_schedule(data.get("mix", {}).get("schedule"), origin),
        shuffle_buffer=data.get("shuffle", {}).get("buffer", 0),
        max_doc_tokens=data.get("split", {}).get("max_doc_tokens"),
        **{key: read.get(key, defaults[key].default) for key in sorted(_READ_KEYS)},
        storage=_storage(data.get("storage", {}), base, origin),
        origin=origin,
    )
    return _validate(recipe)


def _schedule(table: Any, origin: str, where: str = "[mix.schedule]") -> Any:
    """``[mix.schedule]`` (or a mix step's ``schedule``) as a :class:`~zephon.ops.schedule.Schedule`."""
    if table is None:
        return None
    from ..ops.schedule import Schedule

    try:
        return Schedule.from_dict(table, where)
    except ValueError as exc:
        raise RecipeError(f"{origin}: {exc}") from None


def _ops_recipe(data: Mapping[str, Any], base: Path | None, origin: str) -> Recipe:
    """An ``[[ops]]`` recipe: sources and operator tables; the pipeline is built to check it now."""
    ops = data["ops"]
    if not isinstance(ops, list) or not ops or not all(isinstance(t, Mapping) for t in ops):
        raise RecipeError(f"{origin}: 'ops' must be a non-empty list of [[ops]] tables (op = ..., its options).")
    for name, keys in {"read": _READ_KEYS, "storage": _STORAGE_KEYS}.items():
        _check_keys(_table(data, name, origin), keys, f"[{name}]", origin)
    read = data.get("read", {})
    defaults = Recipe.__dataclass_fields__
    placeholder = TokenizerSpec("sentencepiece", "<from the ops>")
    draft = Recipe(seed=_require(data, "seed", "the top level", origin),
                   lanes=_require(data, "lanes", "the top level", origin), seq_len=2, batch_per_lane=1,
                   flush_every=data.get("flush_every", 8), flush_by=data.get("flush_by", "chunks"),
                   tokenizer=placeholder,
                   sources=tuple(_sources(data, base, origin)),
                   **{key: read.get(key, defaults[key].default) for key in sorted(_READ_KEYS)},
                   storage=_storage(data.get("storage", {}), base, origin), origin=origin,
                   ops=tuple(_resolve_op_paths(t, base) for t in ops))
    _validate(draft)
    pipe = draft.to_pipeline()  # every operator checked here; errors name the [[ops]] table
    records = pipe.compile().records  # no pack step: a row is one record (seq_len 1), tokens optional
    try:
        seq_len, rows = (1 if records else pipe.seq_len), pipe.batch_per_lane
    except ValueError as exc:
        raise RecipeError(f"{origin}: {exc}") from None
    tok = pipe.tokenizer or (placeholder if records else None)
    if tok is None:
        raise RecipeError(f"{origin}: an [[ops]] recipe with pack() needs a tokenize (or tokenize_chat, tokenize_images) operator.")
    return dataclasses.replace(draft, seq_len=seq_len, batch_per_lane=rows, tokenizer=tok)


def _resolve_op_paths(table: Mapping[str, Any], base: Path | None) -> dict[str, Any]:
    """An operator table's file paths (its tokenizer, a chat template file) resolved against the recipe's folder."""
    t = dict(table)
    tok = t.get("tokenizer")
    if isinstance(tok, str):
        t["tokenizer"] = _resolve(tok, base)
    elif isinstance(tok, Mapping) and isinstance(tok.get("path"), str):
        t["tokenizer"] = {**tok, "path": _resolve(tok["path"], base)}
    template = t.get("template")
    if isinstance(template, str) and "{" not in template:
        t["template"] = _resolve(template, base)
    return t


def _sources(data: Mapping[str, Any], base: Path | None, origin: str) -> list[SourceSpec]:
    raw_sources = _require(data, "sources", "the top level", origin)
    if not isinstance(raw_sources, list) or not raw_sources:
        raise RecipeError(f"{origin}: 'sources' must be a non-empty list of [[sources]] tables.")
    sources = []
    for i, src in enumerate(raw_sources):
        where = f"[[sources]] #{i + 1}"
        if not isinstance(src, Mapping):
            raise RecipeError(f"{origin}: {where} must be a table (name, path, format...), got {src!r}.")
        _check_keys(src, _SOURCE_KEYS, where, origin)
        paths = _source_paths(_require(src, "path", where, origin), where, origin)
        options = src.get("storage_options")  # object stores: see zephon/storage/
        if options is not None and not isinstance(options, Mapping):
            raise RecipeError(f"{origin}: {where}: 'storage_options' must be a table of fsspec options "
                              f"(e.g. storage_options = {{ endpoint_url = \"http://...\", anon = true }}).")
        weight = src.get("weight", 1.0)
        sources.append(SourceSpec(
            name=_require(src, "name", where, origin),
            path=tuple(_resolve(p, base) for p in paths),
            format=_require(src, "format", where, origin),
            text_field=src.get("text_field", "text"),
            # as a float, as before (the fingerprint holds it); a bad value stays as written for _validate
            weight=float(weight) if _is_number(weight) else weight,
            tokens_field=_tokens_field(src, where, origin),
            storage_options=dict(options) if options is not None else None,
            columns=_columns(src, where, origin),
            read=_source_read(src, where, origin),
            split=src.get("split"),
            config=src.get("config"),
            passes=src.get("passes"),
        ))
    return sources


def _source_read(src: Mapping[str, Any], where: str, origin: str) -> dict[str, Any] | None:
    table = src.get("read")
    if table is None:
        return None
    if not isinstance(table, Mapping):
        raise RecipeError(f"{origin}: {where}: 'read' must be a table of [read] options for this source, got "
                          f"{table!r}{_type_note(table)}.")
    _check_keys(table, _READ_KEYS, f"{where} read", origin)
    return dict(table)


def _columns(src: Mapping[str, Any], where: str, origin: str) -> tuple[str, ...] | None:
    value = src.get("columns")
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise RecipeError(f"{origin}: {where}: 'columns' must be a non-empty list of column names, got {value!r}"
                          f"{_type_note(value)}.")
    return tuple(value)


def _storage(table: Mapping[str, Any], base: Path | None, origin: str) -> StorageSpec:
    """``[storage]``; cache_dir may use ~ and $VARS (e.g. a job's node-local scratch) and resolves like paths."""
    cache_dir = table.get("cache_dir")
    if cache_dir is not None:
        if not isinstance(cache_dir, str) or not cache_dir:
            raise RecipeError(f"{origin}: 'storage.cache_dir' must be a folder as a non-empty string, got "
                              f"{cache_dir!r}{_type_note(cache_dir)}.")
        cache_dir = _resolve(os.path.expanduser(os.path.expandvars(cache_dir)), base)
    defaults = StorageSpec()
    return StorageSpec(cache_dir=cache_dir,
                       cache_max_bytes=table.get("cache_max_bytes", defaults.cache_max_bytes),
                       cache_block_bytes=table.get("cache_block_bytes", defaults.cache_block_bytes),
                       retries=table.get("retries", defaults.retries),
                       retry_backoff_s=table.get("retry_backoff_s", defaults.retry_backoff_s))


def load_recipe(path: str | os.PathLike) -> Recipe:
    """Parse and validate a recipe TOML file. Paths inside resolve relative to the file's folder.

    Args:
        path: the ``.toml`` file.

    Returns:
        The validated recipe (``recipe.to_pipeline()``, or pass it to :func:`zephon.build_loader`).

    Raises:
        RecipeFileError: no such file, or a folder.
        RecipeError: not valid TOML, or not a valid recipe (naming the key).
    """
    p = Path(path)
    if p.is_dir():
        inside = sorted(q.name for q in p.glob("*.toml") if q.is_file())
        hint = (f"; it holds {', '.join(inside[:5])}{', ...' if len(inside) > 5 else ''}: pass one of them, e.g. "
                f"{p / inside[0]}" if inside else "; pass the path to a .toml recipe file, not its folder")
        raise RecipeFileError(f"recipe path {p} is a directory, not a recipe file{hint}.")
    if not p.is_file():
        raise RecipeFileError(f"recipe file not found: {p} (pass the path to a .toml recipe)")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{p}: not valid TOML: {exc}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{p}: cannot read the recipe ({type(exc).__name__}: {exc}).") from exc
    return recipe_from_dict(data, base_dir=p.parent.resolve(), origin=str(p))


# -- strict values: a value of the wrong type is an error, never converted ---------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bad(origin: str, where: str, name: str, need: str, value: Any, typed: bool) -> RecipeError:
    """The error for ``name`` (in ``where``, e.g. a source) that is not ``need``; ``typed``: the type was right."""
    return RecipeError(f"{origin}: {where + ': ' if where else ''}'{name}' must be {need}, got {value!r}"
                       f"{'' if typed else _type_note(value)}.")


def _positive(value: Any, name: str, origin: str, where: str = "") -> None:
    if not _is_int(value) or value < 1:
        raise _bad(origin, where, name, "a positive integer", value, _is_int(value))


def _non_negative(value: Any, name: str, origin: str, where: str = "") -> None:
    if not _is_int(value) or value < 0:
        raise _bad(origin, where, name, "an integer >= 0", value, _is_int(value))


def _boolean(value: Any, name: str, origin: str, where: str = "") -> None:
    if not isinstance(value, bool):
        raise _bad(origin, where, name, "true or false", value, False)


def _string(value: Any, name: str, origin: str, where: str = "", optional: bool = False) -> None:
    if not ((value is None and optional) or (isinstance(value, str) and value)):
        raise _bad(origin, where, name, "a non-empty string", value, isinstance(value, str))


def _choice(value: Any, name: str, choices: tuple[str, ...], origin: str, where: str = "") -> None:
    _string(value, name, origin, where)
    if value not in choices:
        raise RecipeError(f"{origin}: {where + ': ' if where else ''}{name} '{value}' is not one of "
                          f"{', '.join(choices)}.")


def _validate(r: Recipe) -> Recipe:
    """Check every value's type and range (also after :meth:`Recipe.replace`)."""
    o = r.origin
    if not _is_int(r.seed) or not 0 <= r.seed < SEED_LIMIT:
        raise _bad(o, "", "seed", "an integer in [0, 2**63)", r.seed, _is_int(r.seed))
    _choice(r.flush_by, "flush_by", ("chunks", "units"), o)
    _choice(r.partial_batch, "partial_batch", ("drop", "pad"), o)
    _boolean(r.provenance, "provenance", o)
    for name in ("lanes", "seq_len", "batch_per_lane", "flush_every"):
        _positive(getattr(r, name), name, o)
    for name in ("chunk_rows", "chunk_bytes", "unit_bytes", "cache_bytes", "max_doc_bytes"):
        _positive(getattr(r, name), f"read.{name}", o)
    _choice(r.oversize, "read.oversize", OVERSIZE_POLICIES, o)
    if r.seq_len < 2:
        raise RecipeError(f"{o}: 'seq_len' must be at least 2, got {r.seq_len}.")
    if r.max_doc_tokens is not None:
        _positive(r.max_doc_tokens, "split.max_doc_tokens", o)
        if r.max_doc_tokens > r.seq_len and r.pack.algorithm != "wrap":
            raise RecipeError(f"{o}: split.max_doc_tokens={r.max_doc_tokens} exceeds seq_len={r.seq_len}; "
                              f"a piece longer than a row cannot be packed. Lower it to at most {r.seq_len}.")
    _non_negative(r.shuffle_buffer, "shuffle.buffer", o)
    _validate_tokenizer(r.tokenizer, o)
    _choice(r.pack.algorithm, "pack.algorithm", PACK_ALGORITHMS, o)
    _positive(r.pack.max_open_bins, "pack.max_open_bins", o)
    _choice(r.mix_by, "mix.by", MIX_BY, o)
    st = r.storage  # [storage]: object stores (zephon/storage/)
    _string(st.cache_dir, "storage.cache_dir", o, optional=True)
    _positive(st.cache_max_bytes, "storage.cache_max_bytes", o)
    _positive(st.cache_block_bytes, "storage.cache_block_bytes", o)
    _non_negative(st.retries, "storage.retries", o)
    if not _is_number(st.retry_backoff_s) or not 0 <= st.retry_backoff_s < math.inf:
        raise _bad(o, "", "storage.retry_backoff_s", "a finite number >= 0", st.retry_backoff_s,
                   _is_number(st.retry_backoff_s))
    if not isinstance(r.sources, tuple) or not r.sources:
        raise RecipeError(f"{o}: 'sources' must be a non-empty list of [[sources]] tables.")
    for i, s in enumerate(r.sources):
        _validate_source(s, f"[[sources]] #{i + 1}", o)
    names = [s.name for s in r.sources]
    if len(set(names)) != len(names):
        raise RecipeError(f"{o}: source names must be unique, got {names}.")
    return r


def _validate_tokenizer(t: TokenizerSpec, o: str) -> None:
    _choice(t.kind, "tokenizer.kind", TOKENIZER_KINDS, o)
    _string(t.path, "tokenizer.path", o)
    _boolean(t.add_eos, "tokenizer.add_eos", o)
    _boolean(t.add_bos, "tokenizer.add_bos", o)
    for name in ("eos_token", "bos_token", "pat_str"):
        _string(getattr(t, name), f"tokenizer.{name}", o, optional=True)
    if t.pad_id is not None:  # and below the vocabulary size: checked when the tokenizer is loaded
        _non_negative(t.pad_id, "tokenizer.pad_id", o)
    validate_special_tokens(t, o)


def _validate_source(s: SourceSpec, where: str, o: str) -> None:
    _string(s.name, "name", o, where)
    where = f"source '{s.name}'"
    if not isinstance(s.path, tuple) or not s.path or not all(isinstance(p, str) and p for p in s.path):
        raise _bad(o, where, "path", "a non-empty string or a non-empty list of them", s.path, True)
    _choice(s.format, "format", SOURCE_FORMATS, o, where)
    _string(s.text_field, "text_field", o, where)
    _string(s.tokens_field, "tokens_field", o, where, optional=True)
    if s.passes is not None:
        _positive(s.passes, "passes", o, where)
    for key in ("split", "config"):  # which part of a Hugging Face datasets folder to read
        _string(getattr(s, key), key, o, where, optional=True)
        if getattr(s, key) is not None and s.format != "hf":
            raise RecipeError(f"{o}: {where}: '{key}' applies to format = \"hf\" (a Hugging Face datasets "
                              f"folder) only; remove it, or set format = \"hf\".")
    w = s.weight
    if not _is_number(w) or not 0 < w < math.inf:
        raise _bad(o, where, "weight", "a finite number > 0", w, _is_number(w))
    if Fraction(w).limit_denominator(WEIGHT_DENOMINATOR) == 0:
        raise RecipeError(f"{o}: {where}: 'weight' = {w!r} is too small: the mixer works with the weights as "
                          f"fractions of denominator at most {WEIGHT_DENOMINATOR}, where it would be 0. Use weights "
                          f"of at least {1 / WEIGHT_DENOMINATOR} (only their ratios matter: scale them all up).")
    if s.tokens_field is not None and s.format not in TOKENS_FORMATS:
        raise RecipeError(f"{o}: {where}: tokens_field is not supported for format '{s.format}' "
                          f"(pre-tokenized sources: {', '.join(TOKENS_FORMATS)}). Use text_field, or store "
                          f"the token ids in one of those formats.")


def _tokens_field(src: Mapping[str, Any], where: str, origin: str) -> str | None:
    """``tokens_field`` of a ``[[sources]]`` table: a non-empty name, never together with ``text_field``."""
    if "tokens_field" not in src:
        return None
    value = src["tokens_field"]
    if "text_field" in src:
        raise RecipeError(f"{origin}: {where}: set either text_field (text, tokenized online) or tokens_field "
                          f"(token ids, pre-tokenized), not both.")
    if not isinstance(value, str) or not value:
        raise RecipeError(f"{origin}: {where}: tokens_field must be the name of a token-id column, got {value!r}.")
    return value

"""Recipes: the TOML file that defines a run, parsed into frozen dataclasses.

A recipe fixes everything that decides the bytes of the global batches (seed, lanes, seq_len,
batch_per_lane, flush_every, tokenizer, packing, mixing, sources). Runtime knobs that only change
speed (world size, rank, workers, runner) are *not* part of it. Paths resolve relative to the
recipe file. Unknown keys are errors, with a suggestion, because a misspelt key silently falling
back to a default would be a different run than the one the user asked for.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

PACK_ALGORITHMS = ("best_fit", "first_fit", "wrap")
TOKENIZER_KINDS = ("sentencepiece", "tiktoken", "huggingface")
SOURCE_FORMATS = ("parquet", "jsonl", "mds", "litdata", "vortex")
TOKENS_FORMATS = ("parquet", "mds", "litdata", "vortex")  # formats that can hold pre-tokenized rows (tokens_field)
MIX_BY = ("tokens", "documents")


class RecipeError(ValueError):
    """A recipe that cannot be run as written; the message names the file, the key and the fix."""


@dataclass(frozen=True)
class TokenizerSpec:
    """Which tokenizer turns text into ids, and which special tokens frame a document."""

    kind: str
    path: str
    add_eos: bool = True
    add_bos: bool = False
    eos_token: str | None = None  # huggingface / tiktoken: name of the EOS token
    bos_token: str | None = None
    pad_id: int | None = None  # id written into padding positions (labels there are ignored); default EOS
    pat_str: str | None = None  # tiktoken: split regex; default is the cl100k pattern


@dataclass(frozen=True)
class PackSpec:
    """How documents are packed into rows of ``seq_len`` tokens (see :mod:`zephon.nodes.pack`)."""

    algorithm: str = "best_fit"
    max_open_bins: int = 16


@dataclass(frozen=True)
class SourceSpec:
    """One corpus: files of one format, one text field, a mixture weight."""

    name: str
    path: tuple[str, ...]
    format: str
    text_field: str = "text"
    weight: float = 1.0
    # Pre-tokenized sources: the list/array column of token ids; the tokenizer is then skipped (its
    # BOS/EOS, pad id and vocabulary still apply). Exclusive with text_field. See zephon/pretokenized.py.
    tokens_field: str | None = None
    # Object stores: keyword arguments for the fsspec filesystem (s3fs / gcsfs / adlfs): endpoint_url,
    # key, secret, anon, account_name, connection_string... Not in the fingerprint (where the bytes come
    # from only changes speed), not in repr (credentials), not hashed (a dict). See zephon/storage.py.
    storage_options: dict[str, Any] | None = field(default=None, repr=False, hash=False)


@dataclass(frozen=True)
class StorageSpec:
    """``[storage]``: retries and the node-local cache of object-store reads (speed only, not fingerprinted)."""

    cache_dir: str | None = None  # node-local cache of remote byte blocks; None: no cache
    cache_max_bytes: int = 10 << 30  # LRU eviction beyond this
    cache_block_bytes: int = 4 << 20  # cached block size (requests are aligned to it when caching)
    retries: int = 5  # retries of a transient error (after the first attempt)
    retry_backoff_s: float = 0.5  # first backoff; doubles per retry, with jitter


@dataclass(frozen=True)
class Recipe:
    """A parsed, validated recipe. Build one with :func:`load_recipe` or :func:`recipe_from_dict`."""

    seed: int
    lanes: int
    seq_len: int
    batch_per_lane: int
    tokenizer: TokenizerSpec
    sources: tuple[SourceSpec, ...]
    flush_every: int = 8
    pack: PackSpec = field(default_factory=PackSpec)
    mix_by: str = "tokens"
    shuffle_buffer: int = 0  # documents held by the per-lane shuffle buffer; 0 disables it
    max_doc_tokens: int | None = None  # documents are split into pieces of at most this; default seq_len
    chunk_rows: int = 64  # rows per stateless read+tokenize task (Parquet): small keeps start-up and memory low
    chunk_bytes: int = 256 << 10  # bytes per task for plain JSONL
    unit_bytes: int = 64 << 20  # plain JSONL files are cut into units of at most this many bytes
    cache_bytes: int = 1 << 30  # decoded Parquet row groups kept per process (speed only)
    storage: StorageSpec = field(default_factory=StorageSpec)  # object-store retries and cache (not fingerprinted)
    origin: str = "<dict>"  # the file it came from, for messages

    @property
    def global_batch_size(self) -> int:
        return self.lanes * self.batch_per_lane

    @property
    def split_len(self) -> int:
        return self.max_doc_tokens or self.seq_len

    def replace(self, **changes: Any) -> "Recipe":
        """A copy with some fields changed (validated again)."""
        return _validate(dataclasses.replace(self, **changes))


_TOP_KEYS = {
    "seed", "lanes", "seq_len", "batch_per_lane", "flush_every", "tokenizer", "pack", "sources",
    "mix", "shuffle", "split", "read", "storage",
}
_TOKENIZER_KEYS = {f.name for f in dataclasses.fields(TokenizerSpec)}
_PACK_KEYS = {f.name for f in dataclasses.fields(PackSpec)}
_SOURCE_KEYS = {f.name for f in dataclasses.fields(SourceSpec)}
_MIX_KEYS = {"by"}
_SHUFFLE_KEYS = {"buffer"}
_SPLIT_KEYS = {"max_doc_tokens"}
_READ_KEYS = {"chunk_rows", "chunk_bytes", "unit_bytes", "cache_bytes"}
_STORAGE_KEYS = {f.name for f in dataclasses.fields(StorageSpec)}


def _check_keys(table: Mapping[str, Any], allowed: set[str], where: str, origin: str) -> None:
    for key in table:
        if key not in allowed:
            close = difflib.get_close_matches(key, sorted(allowed), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else f" Allowed keys: {', '.join(sorted(allowed))}."
            raise RecipeError(f"{origin}: unknown key '{key}' in {where}.{hint}")


def _require(table: Mapping[str, Any], key: str, where: str, origin: str) -> Any:
    if key not in table:
        raise RecipeError(f"{origin}: missing required key '{key}' in {where}.")
    return table[key]


def _resolve(path: str, base: Path | None) -> str:
    if "://" in path or base is None or os.path.isabs(path):
        return path
    return str((base / path).resolve()) if not any(c in path for c in "*?[") else str(base / path)


def recipe_from_dict(data: Mapping[str, Any], base_dir: str | os.PathLike | None = None,
                     origin: str = "<dict>") -> Recipe:
    """Build a :class:`Recipe` from the TOML structure; relative paths resolve against ``base_dir``."""
    base = Path(base_dir) if base_dir is not None else None
    _check_keys(data, _TOP_KEYS, "the top level", origin)

    tok_table = _require(data, "tokenizer", "the top level", origin)
    _check_keys(tok_table, _TOKENIZER_KEYS, "[tokenizer]", origin)
    tok = TokenizerSpec(**{**tok_table, "kind": _require(tok_table, "kind", "[tokenizer]", origin),
                           "path": _resolve(_require(tok_table, "path", "[tokenizer]", origin), base)})

    pack_table = data.get("pack", {})
    _check_keys(pack_table, _PACK_KEYS, "[pack]", origin)
    pack = PackSpec(**pack_table)

    raw_sources = _require(data, "sources", "the top level", origin)
    if not isinstance(raw_sources, list) or not raw_sources:
        raise RecipeError(f"{origin}: 'sources' must be a non-empty list of [[sources]] tables.")
    sources = []
    for i, src in enumerate(raw_sources):
        where = f"[[sources]] #{i + 1}"
        _check_keys(src, _SOURCE_KEYS, where, origin)
        paths = _require(src, "path", where, origin)
        paths = [paths] if isinstance(paths, str) else list(paths)
        options = src.get("storage_options")  # object stores: see zephon/storage.py
        if options is not None and not isinstance(options, Mapping):
            raise RecipeError(f"{origin}: {where}: 'storage_options' must be a table of fsspec options "
                              f"(e.g. storage_options = {{ endpoint_url = \"http://...\", anon = true }}).")
        sources.append(SourceSpec(
            name=str(_require(src, "name", where, origin)),
            path=tuple(_resolve(p, base) for p in paths),
            format=str(_require(src, "format", where, origin)),
            text_field=str(src.get("text_field", "text")),
            weight=float(src.get("weight", 1.0)),
            tokens_field=_tokens_field(src, where, origin),
            storage_options=dict(options) if options is not None else None,
        ))

    sections = {"mix": _MIX_KEYS, "shuffle": _SHUFFLE_KEYS, "split": _SPLIT_KEYS, "read": _READ_KEYS,
                "storage": _STORAGE_KEYS}
    for name, keys in sections.items():
        _check_keys(data.get(name, {}), keys, f"[{name}]", origin)
    recipe = Recipe(
        seed=int(_require(data, "seed", "the top level", origin)),
        lanes=int(_require(data, "lanes", "the top level", origin)),
        seq_len=int(_require(data, "seq_len", "the top level", origin)),
        batch_per_lane=int(data.get("batch_per_lane", 1)),
        flush_every=int(data.get("flush_every", 8)),
        tokenizer=tok,
        pack=pack,
        sources=tuple(sources),
        mix_by=str(data.get("mix", {}).get("by", "tokens")),
        shuffle_buffer=int(data.get("shuffle", {}).get("buffer", 0)),
        max_doc_tokens=data.get("split", {}).get("max_doc_tokens"),
        chunk_rows=int(data.get("read", {}).get("chunk_rows", 64)),
        chunk_bytes=int(data.get("read", {}).get("chunk_bytes", 256 << 10)),
        unit_bytes=int(data.get("read", {}).get("unit_bytes", 64 << 20)),
        cache_bytes=int(data.get("read", {}).get("cache_bytes", 1 << 30)),
        storage=_storage(data.get("storage", {}), base),
        origin=origin,
    )
    return _validate(recipe)


def _storage(table: Mapping[str, Any], base: Path | None) -> StorageSpec:
    """``[storage]``; cache_dir may use ~ and $VARS (e.g. a job's node-local scratch) and resolves like paths."""
    cache_dir = table.get("cache_dir")
    if cache_dir is not None:
        cache_dir = _resolve(os.path.expanduser(os.path.expandvars(str(cache_dir))), base)
    defaults = StorageSpec()
    return StorageSpec(cache_dir=cache_dir,
                       cache_max_bytes=table.get("cache_max_bytes", defaults.cache_max_bytes),
                       cache_block_bytes=table.get("cache_block_bytes", defaults.cache_block_bytes),
                       retries=table.get("retries", defaults.retries),
                       retry_backoff_s=table.get("retry_backoff_s", defaults.retry_backoff_s))


def load_recipe(path: str | os.PathLike) -> Recipe:
    """Parse and validate a recipe TOML file. Paths inside resolve relative to the file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"recipe file not found: {p} (pass the path to a .toml recipe)")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{p}: not valid TOML: {exc}") from exc
    return recipe_from_dict(data, base_dir=p.parent.resolve(), origin=str(p))


def _positive(value: int, name: str, origin: str) -> None:
    if not isinstance(value, int) or value < 1:
        raise RecipeError(f"{origin}: '{name}' must be a positive integer, got {value!r}.")


def _validate(r: Recipe) -> Recipe:
    o = r.origin
    for name in ("lanes", "seq_len", "batch_per_lane", "flush_every", "chunk_rows", "chunk_bytes", "unit_bytes",
                 "cache_bytes"):
        _positive(getattr(r, name), name, o)
    if r.seq_len < 2:
        raise RecipeError(f"{o}: 'seq_len' must be at least 2, got {r.seq_len}.")
    if r.max_doc_tokens is not None:
        _positive(r.max_doc_tokens, "split.max_doc_tokens", o)
        if r.max_doc_tokens > r.seq_len and r.pack.algorithm != "wrap":
            raise RecipeError(f"{o}: split.max_doc_tokens={r.max_doc_tokens} exceeds seq_len={r.seq_len}; "
                              f"a piece longer than a row cannot be packed. Lower it to at most {r.seq_len}.")
    if r.shuffle_buffer < 0:
        raise RecipeError(f"{o}: shuffle.buffer must be >= 0, got {r.shuffle_buffer}.")
    if r.tokenizer.kind not in TOKENIZER_KINDS:
        raise RecipeError(f"{o}: tokenizer.kind '{r.tokenizer.kind}' is not one of {', '.join(TOKENIZER_KINDS)}.")
    if r.pack.algorithm not in PACK_ALGORITHMS:
        raise RecipeError(f"{o}: pack.algorithm '{r.pack.algorithm}' is not one of {', '.join(PACK_ALGORITHMS)}.")
    _positive(r.pack.max_open_bins, "pack.max_open_bins", o)
    if r.mix_by not in MIX_BY:
        raise RecipeError(f"{o}: mix.by '{r.mix_by}' is not one of {', '.join(MIX_BY)}.")
    st = r.storage  # [storage]: object stores (zephon/storage.py)
    _positive(st.cache_max_bytes, "storage.cache_max_bytes", o)
    _positive(st.cache_block_bytes, "storage.cache_block_bytes", o)
    if not isinstance(st.retries, int) or isinstance(st.retries, bool) or st.retries < 0:
        raise RecipeError(f"{o}: 'storage.retries' must be an integer >= 0, got {st.retries!r}.")
    if not isinstance(st.retry_backoff_s, (int, float)) or isinstance(st.retry_backoff_s, bool) \
            or st.retry_backoff_s < 0:
        raise RecipeError(f"{o}: 'storage.retry_backoff_s' must be a number >= 0, got {st.retry_backoff_s!r}.")
    names = [s.name for s in r.sources]
    if len(set(names)) != len(names):
        raise RecipeError(f"{o}: source names must be unique, got {names}.")
    for s in r.sources:
        if s.format not in SOURCE_FORMATS:
            raise RecipeError(f"{o}: source '{s.name}': format '{s.format}' is not one of "
                              f"{', '.join(SOURCE_FORMATS)}.")
        if not s.weight > 0:
            raise RecipeError(f"{o}: source '{s.name}': weight must be > 0, got {s.weight}.")
        if s.tokens_field is not None and s.format not in TOKENS_FORMATS:
            raise RecipeError(f"{o}: source '{s.name}': tokens_field is not supported for format '{s.format}' "
                              f"(pre-tokenized sources: {', '.join(TOKENS_FORMATS)}). Use text_field, or store "
                              f"the token ids in one of those formats.")
    return r


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

"""The declarations every layer shares, as frozen values: which tokenizer, which source files, how to reach
an object store, and the options a recipe may set. A leaf: nothing of Zephon but its errors is imported here, so the
readers, the operators, the work plan and the TOML front end all build on it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import RecipeError, RecipeFileError

PACK_ALGORITHMS = ("best_fit", "first_fit", "wrap")
TOKENIZER_KINDS = ("sentencepiece", "tiktoken", "huggingface")
SOURCE_FORMATS = ("parquet", "jsonl", "mds", "litdata", "vortex", "lance", "arrow", "hf", "webdataset")
# formats that can hold pre-tokenized rows (tokens_field)
TOKENS_FORMATS = ("parquet", "mds", "litdata", "vortex", "lance", "arrow", "hf")
MIX_BY = ("tokens", "documents")
OVERSIZE_POLICIES = ("skip", "truncate", "error")  # [read] oversize: what to do with a document over max_doc_bytes
SEED_LIMIT = 1 << 63  # seeds are non-negative 64-bit integers (zephon/_perm.py hashes them modulo 2**64)
# The mixer turns weights into integers with Fraction.limit_denominator(10_000) (zephon/ops/mix.py,
# integer_weights): a weight that rounds to 0 there would have no share (and divide by zero).
WEIGHT_DENOMINATOR = 10_000
# The [read] options: a recipe's defaults for every source, a source's own in [[sources]] read = {...}
READ_KEYS = ("chunk_rows", "chunk_bytes", "unit_bytes", "cache_bytes", "max_doc_bytes", "oversize")


@dataclass(frozen=True)
class TokenizerSpec:
    """Which tokenizer turns text into ids, and which special tokens frame a document.

    Make one with :func:`zephon.tokenizer` (it checks the file); a recipe's ``[tokenizer]`` table has the same
    keys. tiktoken only: a file that is one of tiktoken's own encodings (recognised by its SHA-256) takes that
    encoding's split regex and special tokens from tiktoken; any other file needs ``pat_str`` and
    ``special_tokens`` (see zephon/tokenization.py). Given for a recognised file, they replace tiktoken's.
    """

    kind: str
    """``"sentencepiece"``, ``"huggingface"`` or ``"tiktoken"``."""
    path: str
    """The tokenizer file (fingerprinted by its content, not its path)."""
    add_eos: bool = True
    """End every document with EOS."""
    add_bos: bool = False
    """Start every document with BOS."""
    eos_token: str | None = None
    """Hugging Face and tiktoken: the EOS token's text (None: detected)."""
    bos_token: str | None = None
    """Hugging Face and tiktoken: the BOS token's text (None: detected)."""
    pad_id: int | None = None
    """The id written on padding positions (labels there are ignored); None: EOS."""
    pat_str: str | None = None
    """tiktoken: the split regex."""
    special_tokens: tuple[tuple[str, int], ...] | None = None
    """tiktoken: the special tokens, ``((name, id), ...)`` sorted by id (so that the spec stays hashable and two
    spellings of one mapping are one spec); a mapping given here is turned into that form."""

    def __post_init__(self) -> None:
        st = self.special_tokens
        if isinstance(st, Mapping):
            pairs = tuple(st.items())
            if all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in pairs):  # else left for the validation to name
                pairs = tuple(sorted(pairs, key=lambda kv: (kv[1], kv[0])))
            object.__setattr__(self, "special_tokens", pairs)

    def describe(self) -> dict[str, Any]:
        """What decides its ids, for the fingerprint (:func:`tokenizer_description`).

        Returns:
            The kind, the file's SHA-256 and the framing options, as plain data.
        """
        return tokenizer_description(self)


@dataclass(frozen=True)
class PackSpec:
    """How documents are packed into rows of ``seq_len`` tokens (see :mod:`zephon.ops.pack`)."""

    algorithm: str = "best_fit"
    """``"best_fit"``, ``"first_fit"`` or ``"wrap"``."""
    max_open_bins: int = 16
    """Open rows kept by best and first fit."""


@dataclass(frozen=True)
class SourceSpec:
    """One corpus of a recipe (a ``[[sources]]`` table): files of one format, its fields, a mixture weight."""

    name: str
    """Unique in the recipe: the key of its positions in checkpoints and of its weight."""
    path: tuple[str, ...]
    """Files, folders or globs (local paths resolved against the recipe's folder, or URLs)."""
    format: str
    """One of ``parquet``, ``jsonl``, ``mds``, ``litdata``, ``vortex``, ``lance``, ``arrow``, ``hf``,
    ``webdataset``."""
    text_field: str = "text"
    """The text column."""
    weight: float = 1.0
    """Its share in the mixture (only the ratios matter)."""
    tokens_field: str | None = None
    """Pre-tokenized sources: the list or array column of token ids; the tokenizer then only frames the
    documents (its BOS/EOS, pad id and vocabulary still apply). Exclusive with ``text_field``. See
    zephon/readers/tokens.py."""
    storage_options: dict[str, Any] | None = field(default=None, repr=False, hash=False)
    """Object stores: keyword arguments for the fsspec filesystem (s3fs, gcsfs, adlfs): ``endpoint_url``,
    ``key``, ``secret``, ``anon``... Not in the fingerprint (where the bytes come from only changes speed), not
    in repr (credentials). See zephon/storage/."""
    columns: tuple[str, ...] | None = None
    """The columns to read, when more than the one text (or token-id) column: an ``[[ops]]`` recipe's operators
    see them as record fields (``["text", "url"]``, ``["messages"]``)."""
    read: dict[str, Any] | None = field(default=None, hash=False)
    """This source's own ``[read]`` options (``chunk_rows``, ``chunk_bytes``...), over the recipe's ``[read]``."""
    passes: int | None = None
    """Stop after this many passes over the source's data (None: repeat for ever, in a new order every pass)."""
    split: str | None = None
    """Format ``hf``: the split to read (None: ``"train"``)."""
    config: str | None = None
    """Format ``hf``: the configuration to read, when the folder holds several (zephon/readers/hf.py)."""


@dataclass(frozen=True)
class StorageSpec:
    """``[storage]``: retries and the node-local cache of object-store reads (speed only, not fingerprinted)."""

    cache_dir: str | None = None
    """A node-local cache of remote byte blocks (None: no cache)."""
    cache_max_bytes: int = 10 << 30
    """The cache's size: least recently used blocks are evicted beyond it."""
    cache_block_bytes: int = 4 << 20
    """The cached block size (requests are aligned to it when caching)."""
    retries: int = 5
    """Retries of a transient error (after the first attempt)."""
    retry_backoff_s: float = 0.5
    """The first backoff, in seconds; it doubles per retry, with jitter."""


def file_digest(path: str) -> str:
    """The first 16 hex digits of a file's SHA-256 (a tokenizer's or a template's identity in fingerprints)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


KIND_FILES = {
    "sentencepiece": "a SentencePiece model (binary protobuf, usually *.model)",
    "huggingface": "a Hugging Face tokenizer.json (a JSON object with a \"model\")",
    "tiktoken": "a tiktoken BPE file (lines of `base64-token rank`, usually *.tiktoken)",
}


def tokenizer_file(spec: TokenizerSpec) -> Path:
    """``tokenizer.path`` if it is a file; else a :class:`RecipeFileError` naming the key and the fix."""
    path = Path(spec.path)
    where = f"tokenizer.path = {spec.path} (tokenizer.kind = '{spec.kind}')"
    what = KIND_FILES.get(spec.kind, "a tokenizer file")
    if path.is_dir():
        inside = sorted(q.name for q in path.iterdir()
                        if q.is_file() and (q.name.endswith((".model", ".tiktoken")) or q.name == "tokenizer.json"))
        hint = f"; it holds {', '.join(inside[:5])}: point tokenizer.path at one of them" if inside else \
            f"; point tokenizer.path at {what}"
        raise RecipeFileError(f"{where} is a directory, not a tokenizer file{hint}.")
    if not path.is_file():
        # a recipe file's parser made its relative paths absolute (joined to its folder); a path still relative
        # came from Python (or a recipe dict without base_dir) and resolves against the current directory
        note = "in a recipe file, relative paths resolve against its folder" if path.is_absolute() else \
            f"a relative path resolves against the current directory, {Path.cwd()}"
        raise RecipeFileError(f"tokenizer file not found: {where} does not exist. Fix tokenizer.path in the recipe "
                              f"or the path given to zephon.tokenizer(...) ({note}).")
    return path


def tokenizer_description(spec: TokenizerSpec) -> dict[str, Any]:
    """What decides a tokenizer's ids: its kind, file digest and framing options (fingerprinted).

    Args:
        spec: the tokenizer.

    Returns:
        Plain data for the fingerprint. A tiktoken file's split regex and special tokens are ``pat_str`` and
        ``special_tokens`` when given; when not, they are tiktoken's own for the file, decided by its digest.
    """
    d = {"kind": spec.kind, "sha256": file_digest(str(tokenizer_file(spec))), "add_eos": spec.add_eos, "add_bos": spec.add_bos,
         "eos_token": spec.eos_token, "bos_token": spec.bos_token, "pad_id": spec.pad_id, "pat_str": spec.pat_str}
    if spec.kind == "tiktoken":
        d["special_tokens"] = dict(spec.special_tokens) if spec.special_tokens is not None else None
    return d

SPECIAL_ID_LIMIT = 1 << 31  # token ids are int32 in every batch


def _type_note(value: Any) -> str:
    """`` (a float)`` etc.: what the value was, for the messages (TOML strings are easy to write by mistake)."""
    if isinstance(value, bool):
        return " (a boolean)"
    if isinstance(value, str):
        return " (a string: write numbers and booleans without quotes)"
    names = {int: "an integer", float: "a float", list: "a list", dict: "a table"}
    return f" ({names.get(type(value), type(value).__name__)})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int in Python, not in a recipe


def validate_special_tokens(t: TokenizerSpec, origin: str) -> None:
    """Check ``tokenizer.special_tokens``: tiktoken only, a table of distinct non-empty names to distinct ids.

    Args:
        t: the tokenizer spec (its ``special_tokens`` as stored: None or ``((name, id), ...)``).
        origin: where the spec comes from (the recipe file), to start the message with.

    Raises:
        RecipeError: naming ``tokenizer.special_tokens``, what is wrong and the fix.
    """
    st = t.special_tokens
    if st is None:
        return
    key = "tokenizer.special_tokens"
    if t.kind != "tiktoken":  # silently ignored, it would be a different run than the one asked for
        raise RecipeError(f"{origin}: {key} is for tiktoken files only; a {t.kind} file names its own special "
                          f"tokens (pick EOS/BOS with tokenizer.eos_token / bos_token). Remove {key}.")
    example = '{ "<|endoftext|>" = 100257 }'
    if not isinstance(st, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in st):
        raise RecipeError(f"{origin}: '{key}' must be a table of token name = id, e.g. [tokenizer] "
                          f"special_tokens = {example}, got {st!r}{_type_note(st)}.")
    for name, tid in st:
        if not isinstance(name, str) or not name:
            raise RecipeError(f"{origin}: {key}: a token name must be a non-empty string, got {name!r}.")
        if not _is_int(tid) or not 0 <= tid < SPECIAL_ID_LIMIT:
            raise RecipeError(f"{origin}: {key}: the id of '{name}' must be an integer in [0, 2**31), got "
                              f"{tid!r}{_type_note(tid)}.")
    ids: dict[int, str] = {}
    for name, tid in st:
        if tid in ids:
            raise RecipeError(f"{origin}: {key}: '{ids[tid]}' and '{name}' have the same id {tid}; give each "
                              f"special token an id of its own.")
        ids[tid] = name

"""``tokenize``: text (or token ids already stored) to documents, one tokenizer call per chunk.

The tokenizer is called once per chunk with all its texts (``Tokenizer.encode``: a batched call into
the backend, BOS/EOS framed with numpy). Null, empty and whitespace-only texts are skipped and counted
(``blank_records``), and so are texts that tokenize to nothing (``empty_records``). A field that holds
token-id lists (a pre-tokenized source: a list column in Parquet or Vortex, an array column in MDS or
LitData) is framed the same way without calling the tokenizer; an id outside the vocabulary is an
error naming the file and the row.

The output is a document: ``input_ids`` (int32) as a per-token field, the other fields kept as
per-document payloads; the text field itself is dropped unless ``keep_field=True``.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from ..errors import PipelineError, SourceError
from ..records import INPUT_IDS, Chunk, Doc, TokenColumn, doc_origin
from ..specs import TokenizerSpec
from ..tokenization import Tokenizer, load_tokenizer
from .base import Transform

_TOKENIZERS: dict[tuple, Tokenizer] = {}
_LOCK = threading.Lock()


def shared_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """One loaded tokenizer per spec and process, shared by every lane and operator that uses it."""
    key = tuple(sorted(vars(spec).items()))
    with _LOCK:
        tok = _TOKENIZERS.get(key)
    if tok is None:
        tok = load_tokenizer(spec)
        with _LOCK:
            tok = _TOKENIZERS.setdefault(key, tok)
    return tok


def _all_text(texts: list) -> bool:
    """Whether every entry is a non-blank ``str``, checked in C loops (the usual chunk); False sends the caller
    record by record (nulls, blanks, other types, ``str`` subclasses)."""
    return set(map(type, texts)) == {str} and all(texts) and not any(map(str.isspace, texts))


class TokenizingTransform(Transform):
    """What ``tokenize`` and ``tokenize_images`` share: their tokenizer (``tokenizer``, ``add_eos``, ``add_bos``),
    loaded once per process, and the refusal of records tokenized already."""

    _rows_checked = False  # its output fits the packed rows by construction

    _tok: Tokenizer | None = None

    @property
    def spec(self) -> TokenizerSpec:
        """The tokenizer with this operator's framing (``add_eos``/``add_bos``)."""
        changes = {k: v for k, v in (("add_eos", self.add_eos), ("add_bos", self.add_bos)) if v is not None}
        return replace(self.tokenizer, **changes) if changes else self.tokenizer

    @property
    def loaded(self) -> Tokenizer:
        """The loaded tokenizer (one per process and spec)."""
        if self._tok is None:
            self._tok = shared_tokenizer(self.spec)
        return self._tok

    def _refuse_tokenized(self, chunk: Chunk) -> None:
        if INPUT_IDS in chunk.token_fields:
            raise SourceError(f"operator '{self.name}': the records of source '{chunk.source_name}' are already "
                              f"tokenized ({chunk.path}); tokenize each source once (use sources=[...] to pick them).")


class Tokenize(TokenizingTransform):
    """Tokenize ``field`` of every record into ``input_ids`` (see the module docstring).

    Args:
        tokenizer: ``zephon.tokenizer(path)``.
        field: the record field holding the text (or token-id lists of a pre-tokenized source).
        add_eos, add_bos: override the tokenizer's framing (None: as the tokenizer says).
        keep_field: keep the text field as a payload of the document.
        name, sources, executor: as for every operator.
    """

    op = "tokenize"

    def __init__(self, tokenizer: TokenizerSpec, field: str = "text", add_eos: bool | None = None,
                 add_bos: bool | None = None, keep_field: bool = False, name: str | None = None,
                 sources: Sequence[str] | None = None, executor: str | None = None) -> None:
        super().__init__(name, sources, executor)
        if not isinstance(tokenizer, TokenizerSpec):
            raise PipelineError(f"{self.op}(tokenizer=...): pass zephon.tokenizer(path), got {tokenizer!r}")
        self.tokenizer, self.field, self.add_eos, self.add_bos = tokenizer, field, add_eos, add_bos
        self.keep_field = keep_field

    def setup(self) -> None:
        self.loaded  # noqa: B018 - load now, not on the first chunk

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tok": None}  # workers load their own

    # -- chunks ----------------------------------------------------------------------------------------
    def _apply_chunk(self, chunk: Chunk) -> Chunk:
        self._refuse_tokenized(chunk)
        column = chunk.columns.get(self.field)
        if column is None and self.field not in chunk.columns:
            raise SourceError(f"operator '{self.name}': records of source '{chunk.source_name}' ({chunk.path}) "
                              f"have no field '{self.field}' "
                              f"(fields: {', '.join(chunk.columns) or 'none'}). Set tokenize(field=...) to the "
                              f"field that holds the text, or read that column from the source.")
        if isinstance(column, TokenColumn):
            tokens, offsets, keep = self._frame(chunk, column)
        else:
            tokens, offsets, keep = self._encode(chunk, column)
        out = chunk.select(keep)
        if not self.keep_field:
            out.columns = {k: v for k, v in out.columns.items() if k != self.field}
        out.token_fields = {INPUT_IDS: tokens}
        out.offsets = offsets
        return out

    def _encode(self, chunk: Chunk, texts: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if _all_text(texts):
            keep = range(len(texts))
        else:
            keep = [k for k, t in enumerate(texts) if isinstance(t, str) and t and not t.isspace()]
        if len(keep) < len(texts):  # blank records (skipped), or a field that is not text (an error)
            for k, t in enumerate(texts):
                if t is not None and not isinstance(t, str):
                    raise SourceError(f"operator '{self.name}': field '{self.field}' of {chunk.where(k)} holds "
                                      f"{type(t).__name__}, not text. Point tokenize(field=...) at a text field.")
        chunk.count("blank_records", len(texts) - len(keep))
        tokens, offsets = self.loaded.encode(texts if len(keep) == len(texts) else [texts[k] for k in keep])
        kept = np.arange(len(texts), dtype=np.int64) if isinstance(keep, range) else np.asarray(keep, dtype=np.int64)
        lengths = np.diff(offsets)
        if len(lengths) and not lengths.all():  # documents that tokenize to nothing
            nz = lengths > 0
            chunk.count("empty_records", int((~nz).sum()))
            tokens = np.concatenate([tokens[a:b] for a, b, k in zip(offsets[:-1], offsets[1:], nz) if k]) \
                if nz.any() else np.zeros(0, np.int32)
            offsets = np.concatenate([[0], np.cumsum(lengths[nz])]).astype(np.int64)
            kept = kept[nz]
        return tokens, offsets, kept

    def _frame(self, chunk: Chunk, rows: TokenColumn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tok = self.loaded
        lengths = np.diff(rows.offsets)
        keep = lengths > 0
        if rows.valid is not None:
            keep &= rows.valid
        chunk.count("blank_records", int((~keep).sum()))
        values = rows.values if keep.all() else rows.values[np.repeat(keep, lengths)]
        kept_lengths = lengths[keep]
        if len(values):
            lo, hi = values.min(), values.max()
            if lo < 0 or hi >= tok.vocab_size:
                bad = int(np.flatnonzero((values < 0) | (values >= tok.vocab_size))[0])
                k = int(np.searchsorted(np.cumsum(kept_lengths), bad, side="right"))
                row = int(np.flatnonzero(keep)[k])
                raise SourceError(f"{chunk.where(row)}: token id {int(values[bad])} in field '{self.field}' is "
                                  f"outside the tokenizer's vocabulary [0, {tok.vocab_size}) ({tok.spec.path}). The "
                                  f"rows were tokenized with another tokenizer: re-tokenize them or point the "
                                  f"pipeline at the tokenizer that made them.")
        tokens, offsets = tok.frame(values.astype(np.int32, copy=False), kept_lengths.astype(np.int64))
        return tokens, offsets, np.flatnonzero(keep)

    # -- records in a lane -----------------------------------------------------------------------------
    def _apply_records(self, records: list[Any]) -> list[Any]:
        texts = [r.get(self.field) for r in records]
        keep = [k for k, t in enumerate(texts) if isinstance(t, str) and t and not t.isspace()]
        tokens, offsets = self.loaded.encode([texts[k] for k in keep])
        out = []
        for j, k in enumerate(keep):
            a, b = int(offsets[j]), int(offsets[j + 1])
            if b > a:
                rec = records[k]
                doc = Doc({n: v for n, v in rec.items() if n != self.field or self.keep_field},
                          getattr(rec, "tail", -100), getattr(rec, "source", -1), doc_origin(rec))
                doc[INPUT_IDS] = tokens[a:b]
                out.append(doc)
        return out

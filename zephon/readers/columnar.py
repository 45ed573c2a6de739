"""The shared part of the readers of Arrow-shaped tables: Arrow IPC files, Hugging Face ``datasets``
folders, Lance datasets and in-memory tables.

Each of them sees a source as "files" made of *groups* of rows (an IPC record batch, a Lance fragment,
a slice of an in-memory table), exactly as Parquet files are made of row groups: units are whole files
when there are at least as many files as lanes, else groups, cut into row ranges when even those are
fewer than the lanes (:func:`~zephon.readers.base.units_of_groups`); chunks never cross a group and are
aligned to multiples of ``chunk_rows`` from its start (:func:`~zephon.readers.base.chunks_in_groups`).
The same rows with the same group layout as a Parquet source therefore make the same work plan and the
same global batches. Coordinates are row numbers within a file.

A subclass says where the groups are (:meth:`ColumnarReader.group_starts`), which columns a file has
(:meth:`ColumnarReader.column_names`) and how to read one column of rows (:meth:`ColumnarReader.rows`);
this class checks the column types and turns them into records: a string column into texts (with the
per-document size guard), a list-of-integers column into token ids, anything else (binary image bytes,
numbers, structs) into Python values. Every column is validated in full (offsets, UTF-8) before a
value is taken from it: the files are untrusted, and a corrupt offset must be an error, not a crash.
"""

from __future__ import annotations

from typing import Any, Sequence

import fsspec
import numpy as np
import pyarrow as pa

from .base import DEFAULT_DOC_LIMIT, DocLimit, GroupedReader, LRU, RawChunk, limit_text_column
from ..errors import SourceError
from .tokens import arrow_token_rows, is_token_list_type

_TEXT_TYPES = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)


def is_text_type(t: pa.DataType) -> bool:
    return any(check(t) for check in _TEXT_TYPES)


def column_values(col: pa.Array, name: str, source: str, where: str, first_row: int, limit: DocLimit) -> Any:
    """One column of a source read with several ``columns``: texts (the size guard applied), token ids
    (:class:`~zephon.readers.base.TokenRows`), or anything else (binary image bytes, numbers, structs) as
    Python values. ``first_row`` is the row number of ``col[0]`` in ``where``."""
    if is_text_type(col.type):
        return limit_text_column(col, limit, source, where, first_row)
    if is_token_list_type(col.type):
        return arrow_token_rows(col, source, where, name, first_row)
    return col.to_pylist()


def missing_column(source: str, where: str, name: str, names: Sequence[str], tokens: bool | None) -> SourceError:
    """The error for column ``name`` missing from ``where`` (whose columns are ``names``): the one column of a
    source (of token ids when ``tokens``, else of text), or one of its several ``columns`` (``tokens=None``)."""
    if tokens is None:
        fix = "Fix the source's columns."
    else:
        key, what = ("tokens_field", "token ids") if tokens else ("text_field", "text")
        fix = f"Set {key} of this source to the column that holds the {what}."
    return SourceError(f"source '{source}': {where} has no column '{name}' (columns: {', '.join(names)}). {fix}")


def checked_type(col: pa.Array, tokens: bool, source: str, path: str, field: str) -> pa.Array:
    """``col``, the one column of a Parquet or Vortex source, once it is a list of integer token ids
    (``tokens``) or a string column (else)."""
    if tokens:
        if not is_token_list_type(col.type):
            raise SourceError(f"source '{source}': column '{field}' of {path} has type {col.type}, not a list of "
                              f"integer token ids. Point tokens_field at a token-id column, or use text_field for a "
                              f"text column.")
    elif not is_text_type(col.type):
        raise SourceError(f"source '{source}': column '{field}' of {path} has type {col.type}, not a string. Point "
                          f"text_field at a text column.")
    return col


def combined(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One contiguous array (a table's column may come in several chunks)."""
    if isinstance(col, pa.ChunkedArray):
        return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return col


class ColumnarReader(GroupedReader):
    """Reads ``text_field`` (or the token-id list column ``tokens_field``, or several ``columns``) of files
    made of row groups. Subclasses implement :meth:`group_starts`, :meth:`column_names` and either
    :meth:`group_column` (a whole group's column, cached per process like a Parquet row group) or
    :meth:`rows` (any row range directly, for formats with cheap random access)."""

    def __init__(self, fs: fsspec.AbstractFileSystem | None, source: str, text_field: str, chunk_rows: int,
                 cache_bytes: int = 1 << 30, tokens_field: str | None = None,
                 doc_limit: DocLimit = DEFAULT_DOC_LIMIT, columns: Sequence[str] | None = None) -> None:
        self.fs = fs
        self.source = source
        self.text_field = tokens_field or text_field  # the one column read (the record field's name too)
        self.tokens_field = tokens_field
        self.columns = tuple(columns) if columns else None
        self.chunk_rows = chunk_rows
        self.doc_limit = doc_limit
        self._starts = LRU(4096)
        # Decoded (and validated) columns of groups, shared by this process's lanes and threads.
        self._groups = LRU(1024, max_size=cache_bytes, size_of=lambda col: col.nbytes)

    # -- what a format provides ------------------------------------------------------------------------
    def _group_starts(self, path: str) -> np.ndarray:
        """Row offsets of the groups of ``path``: [0, n0, n0+n1, ..., rows] (from metadata)."""
        raise NotImplementedError

    def column_names(self, path: str) -> list[str]:
        raise NotImplementedError

    def group_column(self, path: str, group: int, name: str) -> pa.Array:
        """Column ``name`` of group ``group`` of ``path``, whole (the column exists)."""
        raise NotImplementedError

    def where(self, path: str) -> str:
        """How messages name ``path`` (a Lance fragment names its dataset and fragment)."""
        return path

    # -- planning ----------------------------------------------------------------------------------------
    def group_starts(self, path: str) -> np.ndarray:
        return self._starts.get(path, lambda: self._group_starts(path))

    # -- reading (runs on workers) -------------------------------------------------------------------------
    def _checked_group_column(self, path: str, group: int, name: str) -> pa.Array:
        def make() -> pa.Array:
            col = combined(self.group_column(path, group, name))
            self.validate(col, path, name, f"group {group}")
            return col
        return self._groups.get((path, group, name), make)

    def rows(self, path: str, group: int, name: str, start: int, end: int) -> pa.Array:
        """Rows [start, end) of column ``name`` (within group ``group``, which starts at row ``gstart``)."""
        gstart = int(self.group_starts(path)[group])
        return self._checked_group_column(path, group, name).slice(start - gstart, end - start)

    def validate(self, col: pa.Array, path: str, name: str, what: str) -> None:
        """Full validation (offsets inside their buffers, valid UTF-8): corrupt data is an error, never a crash."""
        try:
            col.validate(full=True)
        except pa.ArrowException as exc:
            raise SourceError(f"source '{self.source}': {self.where(path)}: column '{name}' ({what}) is corrupt "
                              f"({exc}). Re-write or remove the file.") from exc

    def _require(self, path: str, name: str, single: bool) -> None:
        names = self.column_names(path)
        if name not in names:
            tokens = bool(self.tokens_field) if single else None
            raise missing_column(self.source, self.where(path), name, names, tokens)

    def read(self, path: str, start: int, end: int) -> RawChunk:
        _, group, end = self.group_of(path, start, end)
        cursors = np.arange(start + 1, end + 1, dtype=np.int64)
        where = self.where(path)
        if self.columns:
            for name in self.columns:  # every column first: a format may read them all at once
                self._require(path, name, single=False)
            return RawChunk([], cursors, end, columns={
                name: column_values(self.rows(path, group, name, start, end), name, self.source, where, start,
                                    self.doc_limit) for name in self.columns})
        self._require(path, self.text_field, single=True)
        col = self.rows(path, group, self.text_field, start, end)
        if self.tokens_field:
            return RawChunk([], cursors, end, tokens=arrow_token_rows(col, self.source, where, self.text_field, start))
        if not is_text_type(col.type):
            hint = " (it holds token ids: use tokens_field)" if is_token_list_type(col.type) else ""
            raise SourceError(f"source '{self.source}': column '{self.text_field}' of {where} has type {col.type}, "
                              f"not a string{hint}. Point text_field at a text column.")
        return RawChunk(limit_text_column(col, self.doc_limit, self.source, where, start), cursors, end)

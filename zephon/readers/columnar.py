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

from .base import DEFAULT_DOC_LIMIT, DocLimit, LRU, RawChunk, Unit, chunks_in_groups, limit_text_column, units_of_groups
from ..errors import SourceError
from .tokens import arrow_token_rows, is_token_list_type

_TEXT_TYPES = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)


def is_text_type(t: pa.DataType) -> bool:
    return any(check(t) for check in _TEXT_TYPES)


def combined(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One contiguous array (a table's column may come in several chunks)."""
    if isinstance(col, pa.ChunkedArray):
        return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return col


class ColumnarReader:
    """Reads ``text_field`` (or the token-id list column ``tokens_field``, or several ``columns``) of files
    made of row groups. Subclasses implement :meth:`group_starts`, :meth:`column_names` and either
    :meth:`group_column` (a whole group's column, cached per process like a Parquet row group) or
    :meth:`rows` (any row range directly, for formats with cheap random access)."""

    kind = "Arrow"  # the format's name in messages

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

    def split_units(self, files: Sequence[str], lanes: int) -> list[Unit]:
        return units_of_groups(files, lanes, self.group_starts)

    def chunk_bounds(self, path: str, unit: Unit, cursor: int) -> list[tuple[int, int]]:
        return chunks_in_groups(self.group_starts(path), unit, cursor, self.chunk_rows)

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
        if name in names:
            return
        if single:
            key, what = ("tokens_field", "token ids") if self.tokens_field else ("text_field", "text")
            fix = f"Set {key} of this source to the column that holds the {what}."
        else:
            fix = "Fix the source's columns."
        raise SourceError(f"source '{self.source}': {self.where(path)} has no column '{name}' (columns: "
                          f"{', '.join(names)}). {fix}")

    def read(self, path: str, start: int, end: int) -> RawChunk:
        starts = self.group_starts(path)
        group = int(np.searchsorted(starts, start, side="right") - 1)
        if end < 0:
            end = int(starts[group + 1])
        if end > starts[group + 1]:
            raise AssertionError(f"chunk [{start}, {end}) crosses a group of {path}")
        cursors = np.arange(start + 1, end + 1, dtype=np.int64)
        where = self.where(path)
        if self.columns:
            out: dict[str, Any] = {}
            for name in self.columns:  # every column first: a format may read them all at once
                self._require(path, name, single=False)
            for name in self.columns:
                col = self.rows(path, group, name, start, end)
                if is_text_type(col.type):
                    out[name] = limit_text_column(col, self.doc_limit, self.source, where, start)
                elif is_token_list_type(col.type):
                    out[name] = arrow_token_rows(col, self.source, where, name, start)
                else:  # binary (image bytes), numbers, structs...: Python values
                    out[name] = col.to_pylist()
            return RawChunk([], cursors, end, columns=out)
        self._require(path, self.text_field, single=True)
        col = self.rows(path, group, self.text_field, start, end)
        if self.tokens_field:
            return RawChunk([], cursors, end, tokens=arrow_token_rows(col, self.source, where, self.text_field, start))
        if not is_text_type(col.type):
            hint = " (it holds token ids: use tokens_field)" if is_token_list_type(col.type) else ""
            raise SourceError(f"source '{self.source}': column '{self.text_field}' of {where} has type {col.type}, "
                              f"not a string{hint}. Point text_field at a text column.")
        return RawChunk(limit_text_column(col, self.doc_limit, self.source, where, start), cursors, end)

"""Parquet reader: only the text column, one row group at a time, through fsspec.

Units: a whole file when a source has at least as many files as there are lanes (no footer is read
to plan); otherwise row groups, and row ranges inside row groups when even those are fewer than the
lanes, so that a one-file source still feeds every lane.

Untrusted input: a file is decoded by pyarrow's C++ reader, one column at a time, and only a string or
integer-list column is used. Nothing in it is unpickled: pyarrow (>= 14.0.1; Zephon needs >= 15) never
loads the pickled ``arrow.py_extension_type`` metadata unless a program opts in, and the pandas schema
metadata is never read (no ``to_pandas``).
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .base import DEFAULT_DOC_LIMIT, DocLimit, LRU, RawChunk, Unit, chunks_in_groups, limit_text_column, units_of_groups
from ..errors import SourceError
from .tokens import arrow_token_rows, is_token_list_type

_TEXT_TYPES = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)


class ParquetReader:
    """Reads ``text_field`` (or, pre-tokenized, the list column ``tokens_field``) of Parquet files;
    coordinates are row numbers within a file."""

    def __init__(self, fs: fsspec.AbstractFileSystem, source: str, text_field: str, chunk_rows: int,
                 cache_bytes: int = 1 << 30, tokens_field: str | None = None,
                 doc_limit: DocLimit = DEFAULT_DOC_LIMIT, columns: Sequence[str] | None = None) -> None:
        self.fs = fs
        self.columns = tuple(columns) if columns else None  # several columns, as record fields
        self.source = source
        self.text_field = tokens_field or text_field  # the one column read
        self.tokens_field = tokens_field
        self.chunk_rows = chunk_rows
        self.doc_limit = doc_limit  # [read] max_doc_bytes / oversize, applied to texts
        self._files = LRU(256)  # (path, thread) -> ParquetFile: every lane's file, per worker thread
        # Decoded text columns of row groups, shared by this process's lanes and threads.
        self._columns = LRU(1024, max_size=cache_bytes, size_of=lambda col: col.nbytes)

    # -- metadata -------------------------------------------------------------------------------
    def _open(self, path: str) -> pq.ParquetFile:
        """A ParquetFile for ``path`` owned by the calling thread: concurrent ``read_row_group``
        calls on one shared handle are not thread-safe in pyarrow (they crash)."""
        def make() -> pq.ParquetFile:
            try:
                handle = path if _is_local(self.fs) else self.fs.open(path, "rb")
                return pq.ParquetFile(handle)
            except FileNotFoundError as exc:
                raise SourceError(f"source '{self.source}': file {path} is missing; it was listed when "
                                  f"the run was planned. Restore it or start a new run.") from exc
            except (pa.ArrowInvalid, OSError) as exc:
                raise SourceError(f"source '{self.source}': {path} is not a readable Parquet file ({exc}). "
                                  f"Re-write or remove the file.") from exc
        return self._files.get((path, threading.get_ident()), make)

    def row_group_starts(self, path: str) -> np.ndarray:
        """Cumulative row offsets of the row groups of ``path``: [0, n0, n0+n1, ..., total]."""
        meta = self._open(path).metadata
        sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        return np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)

    def column_names(self, path: str) -> list[str]:
        """The columns of ``path`` (from its footer)."""
        return list(self._open(path).schema_arrow.names)

    # -- planning -------------------------------------------------------------------------------
    def split_units(self, files: Sequence[str], lanes: int) -> list[Unit]:
        return units_of_groups(files, lanes, self.row_group_starts)

    def chunk_bounds(self, path: str, unit: Unit, cursor: int) -> list[tuple[int, int]]:
        return chunks_in_groups(self.row_group_starts(path), unit, cursor, self.chunk_rows)

    # -- reading (runs on workers) ---------------------------------------------------------------
    def _column(self, path: str, rg: int) -> pa.Array:
        def make() -> pa.Array:
            pf = self._open(path)
            names = pf.schema_arrow.names
            if self.text_field not in names:
                key, what = ("tokens_field", "token ids") if self.tokens_field else ("text_field", "text")
                raise SourceError(f"source '{self.source}': {path} has no column '{self.text_field}' "
                                  f"(columns: {', '.join(names)}). Set {key} of this source to the "
                                  f"column that holds the {what}.")
            try:
                table = pf.read_row_group(rg, columns=[self.text_field])
            except (pa.ArrowInvalid, OSError) as exc:
                raise SourceError(f"source '{self.source}': cannot read row group {rg} of {path} ({exc}). "
                                  f"The file is corrupt or truncated: re-write or remove it.") from exc
            col = table.column(0).combine_chunks()
            if self.tokens_field:
                if not is_token_list_type(col.type):
                    raise SourceError(f"source '{self.source}': column '{self.text_field}' of {path} has type "
                                      f"{col.type}, not a list of integer token ids. Point tokens_field at a "
                                      f"token-id column, or use text_field for a text column.")
                return col
            if not any(check(col.type) for check in _TEXT_TYPES):
                raise SourceError(f"source '{self.source}': column '{self.text_field}' of {path} has type "
                                  f"{col.type}, not a string. Point text_field at a text column.")
            return col
        return self._columns.get((path, rg), make)

    def _named_column(self, path: str, rg: int, name: str) -> pa.Array:
        """One column of a row group (any type), for sources read with ``columns=``."""
        def make() -> pa.Array:
            pf = self._open(path)
            names = pf.schema_arrow.names
            if name not in names:
                raise SourceError(f"source '{self.source}': {path} has no column '{name}' (columns: "
                                  f"{', '.join(names)}). Fix the source's columns.")
            try:
                return pf.read_row_group(rg, columns=[name]).column(0).combine_chunks()
            except (pa.ArrowInvalid, OSError) as exc:
                raise SourceError(f"source '{self.source}': cannot read row group {rg} of {path} ({exc}). "
                                  f"The file is corrupt or truncated: re-write or remove it.") from exc
        return self._columns.get((path, rg, name), make)

    def _read_columns(self, path: str, rg: int, offset: int, start: int, end: int) -> dict[str, Any]:
        """Each requested column of rows [start, end): texts (size guard applied), token ids, other values."""
        out: dict[str, Any] = {}
        for name in self.columns or ():
            col = self._named_column(path, rg, name).slice(offset, end - start)
            if any(check(col.type) for check in _TEXT_TYPES):
                out[name] = limit_text_column(col, self.doc_limit, self.source, path, start)
            elif is_token_list_type(col.type):
                out[name] = arrow_token_rows(col, self.source, path, name, start)
            else:
                out[name] = col.to_pylist()
        return out

    def read(self, path: str, start: int, end: int) -> RawChunk:
        starts = self.row_group_starts(path)
        rg = int(np.searchsorted(starts, start, side="right") - 1)
        if end < 0:
            end = int(starts[rg + 1])
        if end > starts[rg + 1]:
            raise AssertionError(f"chunk [{start}, {end}) crosses a row group of {path}")
        cursors = np.arange(start + 1, end + 1, dtype=np.int64)
        if self.columns:
            return RawChunk([], cursors, end, columns=self._read_columns(path, rg, start - int(starts[rg]), start, end))
        col = self._column(path, rg).slice(start - int(starts[rg]), end - start)
        if self.tokens_field:
            return RawChunk([], cursors, end, tokens=arrow_token_rows(col, self.source, path, self.text_field, start))
        return RawChunk(limit_text_column(col, self.doc_limit, self.source, path, start), cursors, end)


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))

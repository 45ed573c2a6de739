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
from typing import Sequence

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .base import DEFAULT_DOC_LIMIT, DocLimit, GroupedReader, LRU, RawChunk, is_local, limit_text_column, row_starts
from ..errors import SourceError
from .columnar import checked_type, column_values, missing_column
from .tokens import arrow_token_rows


class ParquetReader(GroupedReader):
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
        # Decoded columns of row groups, shared by this process's lanes and threads.
        self._columns = LRU(1024, max_size=cache_bytes, size_of=lambda col: col.nbytes)

    # -- metadata -------------------------------------------------------------------------------
    def _open(self, path: str) -> pq.ParquetFile:
        """A ParquetFile for ``path`` owned by the calling thread: concurrent ``read_row_group``
        calls on one shared handle are not thread-safe in pyarrow (they crash)."""
        def make() -> pq.ParquetFile:
            try:
                handle = path if is_local(self.fs) else self.fs.open(path, "rb")
                return pq.ParquetFile(handle)
            except FileNotFoundError as exc:
                raise SourceError(f"source '{self.source}': file {path} is missing; it was listed when "
                                  f"the run was planned. Restore it or start a new run.") from exc
            except (pa.ArrowInvalid, OSError) as exc:
                raise SourceError(f"source '{self.source}': {path} is not a readable Parquet file ({exc}). "
                                  f"Re-write or remove the file.") from exc
        return self._files.get((path, threading.get_ident()), make)

    def group_starts(self, path: str) -> np.ndarray:
        """Cumulative row offsets of the row groups of ``path``: [0, n0, n0+n1, ..., total]."""
        meta = self._open(path).metadata
        return row_starts([meta.row_group(i).num_rows for i in range(meta.num_row_groups)])

    row_group_starts = group_starts  # Parquet's own name for them

    def column_names(self, path: str) -> list[str]:
        """The columns of ``path`` (from its footer)."""
        return list(self._open(path).schema_arrow.names)

    # -- reading (runs on workers) ---------------------------------------------------------------
    def _column(self, path: str, rg: int, name: str) -> pa.Array:
        """Column ``name`` of row group ``rg``: any type with ``columns=``, else the text or token-id column."""
        def make() -> pa.Array:
            pf = self._open(path)
            names = pf.schema_arrow.names
            if name not in names:
                raise missing_column(self.source, path, name, names, None if self.columns else bool(self.tokens_field))
            try:
                col = pf.read_row_group(rg, columns=[name]).column(0).combine_chunks()
            except (pa.ArrowInvalid, OSError) as exc:
                raise SourceError(f"source '{self.source}': cannot read row group {rg} of {path} ({exc}). "
                                  f"The file is corrupt or truncated: re-write or remove it.") from exc
            return col if self.columns else checked_type(col, bool(self.tokens_field), self.source, path, name)
        return self._columns.get((path, rg, name), make)

    def read(self, path: str, start: int, end: int) -> RawChunk:
        starts, rg, end = self.group_of(path, start, end, "row group")
        cursors = np.arange(start + 1, end + 1, dtype=np.int64)
        offset = start - int(starts[rg])
        if self.columns:
            return RawChunk([], cursors, end, columns={
                name: column_values(self._column(path, rg, name).slice(offset, end - start), name, self.source, path,
                                    start, self.doc_limit) for name in self.columns})
        col = self._column(path, rg, self.text_field).slice(offset, end - start)
        if self.tokens_field:
            return RawChunk([], cursors, end, tokens=arrow_token_rows(col, self.source, path, self.text_field, start))
        return RawChunk(limit_text_column(col, self.doc_limit, self.source, path, start), cursors, end)

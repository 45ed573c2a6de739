"""Vortex files (vortex-data), read with the ``vortex`` library: one column, one split at a time.

Units, like Parquet: whole files when a source has at least as many files as lanes (nothing is opened
to plan); otherwise the file's *splits* (``VortexFile.splits()``, the row ranges of its layout, read
from the footer), and row ranges inside splits when even those are fewer than the lanes. Chunks are
row ranges aligned to multiples of ``chunk_rows`` from the start of each split. A split's column is
decoded once per process (``to_repeated_scan(...).execute(row_range=...)``) and cached like Parquet row
groups. Text comes from a utf8 column; token ids (``tokens_field``) from a list-of-integers column.

Local files open with ``vortex.open`` (native IO); object-store files through the source's fsspec
filesystem with ``vortex.open_readable``. Needs the ``vortex-data`` package (from a Zephon checkout:
``python -m pip install -e '.[formats]'``).

Untrusted input: a Vortex file is decoded by the library's native (Rust) code into Arrow arrays; no
Python object is ever unpickled from it, and only a string or integer-list column is used.
"""

from __future__ import annotations

import threading
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa

from .base import GroupedReader, LRU, RawChunk, first_line, is_local, native_failure, optional_import
from ..errors import SourceError
from .columnar import checked_type, missing_column
from .tokens import arrow_token_rows


class VortexReader(GroupedReader):
    """Reads ``text_field`` (or the token-id list column ``tokens_field``) of Vortex files."""

    def __init__(self, fs: fsspec.AbstractFileSystem, source: str, text_field: str, chunk_rows: int,
                 cache_bytes: int = 1 << 30, tokens_field: str | None = None) -> None:
        self.fs = fs
        self.source = source
        self.field = tokens_field or text_field
        self.tokens = tokens_field is not None
        self.chunk_rows = chunk_rows
        self._files = LRU(64)
        self._starts = LRU(4096)
        self._columns = LRU(1024, max_size=cache_bytes, size_of=lambda col: col.nbytes)

    # -- metadata -------------------------------------------------------------------------------
    def _open(self, path: str) -> Any:
        """A VortexFile for ``path`` owned by the calling thread."""
        def make() -> tuple[Any, Any]:
            vx = optional_import("vortex", self.source, "vortex", "vortex-data", "formats")
            try:
                if is_local(self.fs):
                    if not self.fs.exists(path):
                        raise FileNotFoundError(path)
                    return vx.open(path), None
                handle = self.fs.open(path, "rb")
                return vx.open_readable(handle), handle
            except FileNotFoundError as exc:
                raise SourceError(f"source '{self.source}': file {path} is missing; it was listed when the run "
                                  f"was planned. Restore it or start a new run.") from exc
            except SourceError:
                raise
            except BaseException as exc:
                if not native_failure(exc):
                    raise
                raise SourceError(f"source '{self.source}': {path} is not a readable Vortex file "
                                  f"({first_line(exc)}). The file is corrupt or truncated: re-write or remove "
                                  f"it.") from exc
        return self._files.get((path, threading.get_ident()), make)[0]

    def group_starts(self, path: str) -> np.ndarray:
        """Row offsets of the file's splits: [0, end of split 0, ..., rows]."""
        def make() -> np.ndarray:
            f = self._open(path)
            try:
                rows = len(f)
                splits = sorted((int(a), int(b)) for a, b in f.splits())
            except BaseException as exc:
                if not native_failure(exc):
                    raise
                raise SourceError(f"source '{self.source}': cannot read the layout of Vortex file {path} "
                                  f"({first_line(exc)}). The file is corrupt: re-write or remove it.") from exc
            edges = [0] + [b for _, b in splits]
            if [a for a, _ in splits] != edges[:-1] or edges[-1] != rows:
                edges = [0, rows]  # not a partition of the rows: one split
            return np.asarray(edges, dtype=np.int64)
        return self._starts.get(path, make)

    # -- reading (runs on workers) ---------------------------------------------------------------
    def _column(self, path: str, split: int) -> pa.Array:
        def make() -> pa.Array:
            f = self._open(path)
            names = list(f.dtype.names())
            if self.field not in names:
                raise missing_column(self.source, path, self.field, names, self.tokens)
            starts = self.group_starts(path)
            a, b = int(starts[split]), int(starts[split + 1])
            try:
                arr = f.to_repeated_scan(projection=[self.field]).execute(row_range=(a, b)).read_all()
                col = arr.to_arrow_array()
            except BaseException as exc:
                if not native_failure(exc):
                    raise
                raise SourceError(f"source '{self.source}': cannot read rows {a}..{b} of Vortex file {path} "
                                  f"({first_line(exc)}). The file is corrupt or truncated: re-write or remove "
                                  f"it.") from exc
            if isinstance(col, pa.ChunkedArray):
                col = col.combine_chunks()
            if pa.types.is_struct(col.type):
                col = col.field(0)
            if len(col) != b - a:
                raise SourceError(f"source '{self.source}': Vortex file {path} returned {len(col)} rows for rows "
                                  f"{a}..{b}. The file is corrupt: re-write it.")
            return checked_type(col, self.tokens, self.source, path, self.field)
        return self._columns.get((path, split), make)

    def read(self, path: str, start: int, end: int) -> RawChunk:
        starts, split, end = self.group_of(path, start, end, "split")
        col = self._column(path, split).slice(start - int(starts[split]), end - start)
        cursors = np.arange(start + 1, end + 1, dtype=np.int64)
        if self.tokens:
            return RawChunk([], cursors, end, tokens=arrow_token_rows(col, self.source, path, self.field, start))
        return RawChunk(col.to_pylist(), cursors, end)

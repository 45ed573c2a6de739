"""Arrow IPC files (``format = "arrow"``), in the file format (Feather v2, ``.arrow``, ``.feather``) and
in the stream format (``.arrows``; also what Hugging Face ``datasets`` writes): record batches are the
row groups (:mod:`zephon.readers.columnar`).

Local files are memory-mapped: a record batch's columns are views of the mapped file, so nothing is
copied, and the batch layout (each batch's row count, in its message header) costs no data read. Files
in an object store are opened through the source's fsspec filesystem; an IPC footer holds no row
counts, so finding their layout reads them once per process (a stream, which has no footer, is fetched
whole): prefer Parquet for remote data.

Untrusted input: pyarrow's C++ reader verifies every message header (flatbuffers) and Zephon validates
every column it uses in full (offsets, UTF-8) before reading a value; nothing is unpickled (pyarrow never
loads a pickled ``arrow.py_extension_type`` unless a program opts in).
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from .base import DEFAULT_DOC_LIMIT, DocLimit, LRU, is_local, row_starts
from ..errors import SourceError
from .columnar import ColumnarReader

_FILE_MAGIC = b"ARROW1"


class _Layout:
    """One opened IPC file: its schema, its batches' row offsets and a way to get batch ``i``."""

    def __init__(self, schema: pa.Schema, starts: np.ndarray, batch: Any, nbytes: int = 0) -> None:
        self.schema, self.starts, self.batch = schema, starts, batch
        self.nbytes = nbytes  # memory it holds: a remote stream read whole (a mapped file holds none)


class ArrowReader(ColumnarReader):
    """Reads Arrow IPC files (file or stream format, told apart by the file format's magic bytes)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, source: str, text_field: str, chunk_rows: int,
                 cache_bytes: int = 1 << 30, tokens_field: str | None = None,
                 doc_limit: DocLimit = DEFAULT_DOC_LIMIT, columns: Sequence[str] | None = None) -> None:
        super().__init__(fs, source, text_field, chunk_rows, cache_bytes, tokens_field, doc_limit, columns)
        # File format: one reader per (path, thread) (a reader over one handle is not shared between
        # threads). Stream format: the batches, read once per process and shared by its threads (record
        # batches are immutable; views of the mapped file when local, bounded by cache_bytes when not).
        self._kinds = LRU(4096)  # path -> is it the file format (by its magic bytes)
        self._files = LRU(64)
        self._streams = LRU(64, max_size=cache_bytes, size_of=lambda layout: layout.nbytes)

    def _source(self, path: str) -> Any:
        if is_local(self.fs):
            if not self.fs.exists(path):
                raise FileNotFoundError(path)
            return pa.memory_map(path, "r")
        return self.fs.open(path, "rb")

    def _failed(self, path: str, exc: BaseException) -> SourceError:
        if isinstance(exc, FileNotFoundError):
            return SourceError(f"source '{self.source}': file {path} is missing; it was listed when the run was "
                               f"planned. Restore it or start a new run.")
        return SourceError(f"source '{self.source}': {path} is not a readable Arrow IPC file ({exc}). The file is "
                           f"corrupt or truncated, or not in the Arrow IPC file or stream format: re-write or "
                           f"remove it.")

    def _is_file_format(self, path: str) -> bool:
        def make() -> bool:
            try:
                with self._source(path) as src:
                    return src.read(len(_FILE_MAGIC)) == _FILE_MAGIC
            except (pa.ArrowException, OSError, ValueError) as exc:
                raise self._failed(path, exc) from exc
        return self._kinds.get(path, make)

    def _open(self, path: str) -> _Layout:
        """The layout of ``path``: a file-format reader of this thread's own, or the stream's batches."""
        if not self._is_file_format(path):
            return self._streams.get(path, lambda: self._read_stream(path))

        def make() -> _Layout:
            try:
                reader = ipc.open_file(self._source(path))
                sizes = [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
            except (pa.ArrowException, OSError, ValueError) as exc:
                raise self._failed(path, exc) from exc
            return _Layout(reader.schema, row_starts(sizes), reader.get_batch)
        return self._files.get((path, threading.get_ident()), make)

    def _read_stream(self, path: str) -> _Layout:
        nbytes = 0
        try:
            src = self._source(path)
            if not is_local(self.fs):  # no footer to seek by: fetch it whole
                data = src.read()
                src, nbytes = pa.BufferReader(data), len(data)
            stream = ipc.open_stream(src)
            batches = list(stream)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise self._failed(path, exc) from exc
        return _Layout(stream.schema, row_starts([b.num_rows for b in batches]), batches.__getitem__, nbytes)

    def _group_starts(self, path: str) -> np.ndarray:
        return self._open(path).starts

    def column_names(self, path: str) -> list[str]:
        return list(self._open(path).schema.names)

    def group_column(self, path: str, group: int, name: str) -> pa.Array:
        layout = self._open(path)
        try:
            batch = layout.batch(group)
            return batch.column(layout.schema.get_field_index(name))
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise SourceError(f"source '{self.source}': cannot read record batch {group} of {path} ({exc}). The file "
                              f"is corrupt or truncated: re-write or remove it.") from exc

"""In-memory sources (``z.read.records(list_of_dicts)``, ``z.read.table(pyarrow_table)``) for notebooks and tests.

The data is turned into one Arrow table once, when the source is declared, and kept as the bytes of an
Arrow IPC stream: that is what the source's spec carries to worker processes (pickled as plain bytes,
never the user's objects), and its SHA-256 is the source's content digest, in the fingerprint (changing
the data changes the fingerprint; the same data gives the same one, however the table was chunked).

The table is planned like the same table written with ``pyarrow.parquet.write_table`` (row groups of
:data:`ROW_GROUP_ROWS` rows, its default): one "file" made of row groups, so units are row ranges of the
groups, and the same rows in Parquet give the same global batches. Each process decodes the bytes once
(zero-copy) and reads row ranges of the table.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from .base import DEFAULT_DOC_LIMIT, DocLimit, LRU
from ..errors import SourceError
from .columnar import ColumnarReader

ROW_GROUP_ROWS = 1 << 20  # pyarrow.parquet.write_table's default row group size


def records_table(records: Iterable[Mapping[str, Any]], what: str = "read.records") -> pa.Table:
    """``records`` (dicts of field -> value) as an Arrow table: a column per field, in order of first
    appearance; a record without a field has null there. Each column's type is inferred by pyarrow over all
    its values (so a field must hold one kind of value: strings, numbers, lists of ints, bytes, dicts...)."""
    if isinstance(records, (str, bytes, Mapping)) or not isinstance(records, Iterable):
        raise ValueError(f"{what}(records): a list of dicts (one per record) is needed, got "
                          f"{type(records).__name__}")
    rows = list(records)
    if not rows:
        raise ValueError(f"{what}(records): the list is empty; a source needs at least one record.")
    names: dict[str, None] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"{what}(records): record {i} is a {type(row).__name__}, not a dict of fields.")
        for key in row:
            if not isinstance(key, str) or not key:
                raise ValueError(f"{what}(records): record {i} has the field name {key!r}: field names are "
                                  f"non-empty strings.")
            names.setdefault(key)
    columns = {}
    for name in names:
        try:
            columns[name] = pa.array([row.get(name) for row in rows])
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"{what}(records): field '{name}' cannot be one Arrow column ({exc}). Give it one kind "
                              f"of value in every record (or None), e.g. all strings, or all lists of ints.") from exc
    return pa.table(columns)


def table_payload(table: Any, what: str = "read.table") -> tuple[bytes, str, int]:
    """``table`` as Arrow IPC stream bytes, their SHA-256 and the row count. Chunks are combined first, so
    that the bytes (and the digest) depend on the table's content, not on how it was chunked."""
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    if not isinstance(table, pa.Table):
        raise ValueError(f"{what}(table): a pyarrow.Table is needed, got {type(table).__name__} (for a list of "
                          f"dicts use zephon.read.records; for pandas, pyarrow.Table.from_pandas(df)).")
    if table.num_rows == 0:
        raise ValueError(f"{what}(table): the table has no rows; a source needs at least one record.")
    table = table.combine_chunks()
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    payload = sink.getvalue().to_pybytes()
    return payload, hashlib.sha256(payload).hexdigest(), table.num_rows


def label(digest: str) -> str:
    """The "file" name of an in-memory source (in messages and the fingerprint's file list)."""
    return f"<in-memory table {digest[:16]}>"


def list_table(name: str, read: Any, origin: str) -> list[str]:
    if read.payload is None or read.digest is None:
        raise SourceError(f"{origin}: source '{name}': an in-memory source is made by zephon.read.records(...) or "
                          f"zephon.read.table(...).")
    return [label(read.digest)]


class MemoryReader(ColumnarReader):
    """Reads an in-memory source's table (decoded once per process from its IPC bytes)."""

    def __init__(self, source: str, payload: bytes, text_field: str, chunk_rows: int, cache_bytes: int = 1 << 30,
                 tokens_field: str | None = None, doc_limit: DocLimit = DEFAULT_DOC_LIMIT,
                 columns: Sequence[str] | None = None) -> None:
        super().__init__(None, source, text_field, chunk_rows, cache_bytes, tokens_field, doc_limit, columns)
        self._payload = payload
        self._table = LRU(1)

    def table(self) -> pa.Table:
        return self._table.get(0, lambda: ipc.open_stream(pa.py_buffer(self._payload)).read_all())

    def _group_starts(self, path: str) -> np.ndarray:
        rows = self.table().num_rows
        return np.asarray(list(range(0, rows, ROW_GROUP_ROWS)) + [rows], dtype=np.int64)

    def column_names(self, path: str) -> list[str]:
        return list(self.table().schema.names)

    def group_column(self, path: str, group: int, name: str) -> pa.Array:
        start = group * ROW_GROUP_ROWS
        return self.table().column(name).slice(start, ROW_GROUP_ROWS)

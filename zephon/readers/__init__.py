"""Format readers behind one contract (:mod:`zephon.readers.base`), all through fsspec."""

from __future__ import annotations

from typing import TYPE_CHECKING

import fsspec

from .base import DocLimit, LRU, RawChunk, Reader, Unit
from ..errors import SourceError
from .indexed import IndexedReader
from .jsonl import JsonlReader
from .litdata import LitDataReader
from .mds import MdsReader
from .parquet import ParquetReader
from .vortex import VortexReader
from .arrow import ArrowReader
from .hf import HfReader

# Formats that list their own "files" without fsspec (Lance fragments, an in-memory table), with
# list_own_files below (called by zephon.plan.list_files).
SELF_LISTED = ("lance", "memory")

# Formats whose "files" are the shards named by index.json files (listed by zephon.plan.list_files).
INDEXED_READERS: dict[str, type[IndexedReader]] = {"mds": MdsReader, "litdata": LitDataReader}

if TYPE_CHECKING:
    from ..read import ReadSpec

__all__ = ["RawChunk", "Reader", "SourceError", "Unit", "make_reader", "LRU", "INDEXED_READERS", "SELF_LISTED",
           "list_own_files"]


def make_reader(name: str, read: "ReadSpec", fs: fsspec.AbstractFileSystem) -> Reader:
    """The reader of source ``name`` for its :class:`~zephon.read.ReadSpec` (format, fields, chunk sizes)."""
    tokens = read.tokens_field  # pre-tokenized sources: a token-id column
    limit = DocLimit(read.max_doc_bytes, read.oversize)  # the per-document size guard
    if read.format == "parquet":
        return ParquetReader(fs, name, read.text_field, read.chunk_rows, read.cache_bytes, tokens, limit, read.columns)
    if read.format == "jsonl":
        return JsonlReader(fs, name, read.text_field, read.chunk_bytes, read.unit_bytes, limit, read.columns)
    if read.format in ("arrow", "hf"):  # Arrow IPC files; Hugging Face datasets folders (Arrow or Parquet files)
        cls = ArrowReader if read.format == "arrow" else HfReader
        return cls(fs, name, read.text_field, read.chunk_rows, read.cache_bytes, tokens, limit, read.columns)
    if read.format == "lance":
        from .lance import LanceReader  # pylance is optional: imported when a Lance dataset is opened

        return LanceReader(name, read.text_field, read.chunk_rows, read.cache_bytes, tokens, limit, read.columns,
                           read.storage_options)
    if read.format == "webdataset":  # tar shards indexed by their headers (readers/webdataset.py)
        from .webdataset import WebDatasetReader

        return WebDatasetReader(fs, name, read.columns, read.chunk_rows, limit, read.index_cache)
    if read.format == "memory":
        from .memory import MemoryReader

        if read.payload is None:
            raise SourceError(f"source '{name}': an in-memory source is made by zephon.read.records(...) or "
                              f"zephon.read.table(...).")
        return MemoryReader(name, read.payload, read.text_field, read.chunk_rows, read.cache_bytes, tokens, limit,
                            read.columns)
    if read.format in INDEXED_READERS:  # MDS, LitData: shards listed from index.json (readers/indexed.py)
        several = read.columns if read.columns and read.columns != (tokens or read.text_field,) else None
        return INDEXED_READERS[read.format](fs, name, tokens or read.text_field, tokens is not None,
                                            read.chunk_rows, read.cache_bytes, columns=several)
    if read.columns and read.columns != (tokens or read.text_field,):
        raise SourceError(f"source '{name}': format '{read.format}' reads one field (text_field or tokens_field); "
                          f"columns={list(read.columns)} is supported for parquet, jsonl, lance, arrow, hf, mds, "
                          f"litdata, webdataset and in-memory sources.")
    if read.format == "vortex":
        return VortexReader(fs, name, read.text_field, read.chunk_rows, read.cache_bytes, tokens)
    raise SourceError(f"source '{name}': no reader for format '{read.format}'.")


def list_own_files(name: str, read: "ReadSpec", origin: str) -> list[str]:
    """The "files" of a :data:`SELF_LISTED` source: a Lance source's fragments, an in-memory source's table."""
    if read.format == "lance":
        from .lance import list_fragments

        return list_fragments(name, read, origin)
    from .memory import list_table

    return list_table(name, read, origin)

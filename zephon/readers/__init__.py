"""Format readers behind one contract (:mod:`zephon.readers.base`), all through fsspec."""

from __future__ import annotations

import fsspec

from ..recipe import Recipe, SourceSpec
from .base import LRU, DocLimit, RawChunk, Reader, SourceError, Unit
from .indexed import IndexedReader
from .jsonl import JsonlReader
from .litdata import LitDataReader
from .mds import MdsReader
from .parquet import ParquetReader
from .vortex import VortexReader

# Formats whose "files" are the shards named by index.json files (listed by zephon.plan.list_files).
INDEXED_READERS: dict[str, type[IndexedReader]] = {"mds": MdsReader, "litdata": LitDataReader}

__all__ = ["RawChunk", "Reader", "SourceError", "Unit", "make_reader", "LRU", "INDEXED_READERS"]


def make_reader(recipe: Recipe, source: SourceSpec, fs: fsspec.AbstractFileSystem) -> Reader:
    """The reader for ``source``'s format, configured with the recipe's chunk sizes."""
    tokens = source.tokens_field  # pre-tokenized sources (zephon/pretokenized.py)
    limit = DocLimit(recipe.max_doc_bytes, recipe.oversize)  # the per-document size guard ([read])
    if source.format == "parquet":
        return ParquetReader(fs, source.name, source.text_field, recipe.chunk_rows, recipe.cache_bytes, tokens,
                             limit)
    if source.format == "jsonl":
        return JsonlReader(fs, source.name, source.text_field, recipe.chunk_bytes, recipe.unit_bytes, limit)
    if source.format in INDEXED_READERS:  # MDS, LitData: shards listed from index.json (readers/indexed.py)
        return INDEXED_READERS[source.format](fs, source.name, tokens or source.text_field, tokens is not None,
                                              recipe.chunk_rows, recipe.cache_bytes)
    if source.format == "vortex":
        return VortexReader(fs, source.name, source.text_field, recipe.chunk_rows, recipe.cache_bytes, tokens)
    raise SourceError(f"source '{source.name}': no reader for format '{source.format}'.")

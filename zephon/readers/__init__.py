"""Format readers behind one contract (:mod:`zephon.readers.base`), all through fsspec."""

from __future__ import annotations

import fsspec

from ..recipe import Recipe, SourceSpec
from .base import LRU, RawChunk, Reader, SourceError, Unit
from .jsonl import JsonlReader
from .parquet import ParquetReader

__all__ = ["RawChunk", "Reader", "SourceError", "Unit", "make_reader", "LRU"]


def make_reader(recipe: Recipe, source: SourceSpec, fs: fsspec.AbstractFileSystem) -> Reader:
    """The reader for ``source``'s format, configured with the recipe's chunk sizes."""
    if source.format == "parquet":
        return ParquetReader(fs, source.name, source.text_field, recipe.chunk_rows, recipe.cache_bytes)
    if source.format == "jsonl":
        return JsonlReader(fs, source.name, source.text_field, recipe.chunk_bytes, recipe.unit_bytes)
    raise SourceError(f"source '{source.name}': no reader for format '{source.format}'.")

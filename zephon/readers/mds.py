"""MosaicML MDS datasets (shards + ``index.json``, as mosaicml-streaming's ``MDSWriter`` writes them).

Layout (mosaicml-streaming ``streaming/base/format/mds``): ``index.json`` is
``{"version": 2, "shards": [{"format": "mds", "samples", "column_names", "column_encodings",
"column_sizes", "compression", "raw_data": {"basename", "bytes"}, "zip_data": ...}, ...]}``; a shard is
``uint32 n | uint32 offsets[n+1] | config JSON | samples``, a sample is ``uint32 size of each
variable-size column | each column's bytes, columns in index order``. Text comes from a ``str``
column (UTF-8); token ids from an ``ndarray`` column (``ndarray``, ``ndarray:int32`` or
``ndarray:int32:N``), decoded with numpy over the whole chunk. Compressed shards (``zip_data``:
zstd, gz, bz2, br, snappy) are decompressed whole.

A dataset is untrusted input: the field's encoding is checked from ``index.json`` before a byte of a
shard is read, and only ``str`` and ``ndarray`` (with one of the library's own dtype names) are ever
decoded, by the code below. A field with any other encoding (``pkl``, which the library would unpickle,
``json``, ``jpeg``, ``png``, ``pil``...) is refused with a message naming the index, the field and its
encoding; the other columns of a sample may have any encoding, since their bytes are only skipped.

With several ``columns`` (a caption and an image), an image column of encoding ``bytes``, ``jpeg`` or
``png`` (what ``MDSWriter`` stores for those is the encoded file itself) is read as raw bytes, never
decoded here: ``decode_images`` sniffs and decodes them later. ``pil`` (the writer's own header and raw
pixels) and ``pkl`` stay refused.

The reader decodes this layout itself, with numpy and fsspec, rather than through the library's
``MDSReader`` (one sample per call, local files only) or by importing ``streaming``, whose package
import pulls in torchvision, which cannot be loaded next to the CPU build of torch (see
docs/guides/sources.md, "Installing the readers"). The tests write every MDS dataset with the library's ``MDSWriter``.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from .base import TokenRows
from ..errors import SourceError
from .indexed import IndexedReader, ShardMeta
from .tokens import byte_token_rows

# mosaicml-streaming's NDArray encoding: value dtype codes and shape dtype codes.
_VALUE_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32", 33: "int32",
                 34: "float32", 64: "uint64", 65: "int64", 66: "float64"}
_SHAPE = re.compile(r"[1-9][0-9]*(,[1-9][0-9]*)*")  # a static shape: '2048' or '4,512'
_RAW_BYTES = ("bytes", "jpeg", "png")  # encodings whose stored bytes are the value (an encoded image) as is


class MdsReader(IndexedReader):
    """Reads one ``str`` (text) or ``ndarray`` (token ids) column of MDS shards."""

    label = "MDS"
    exact_end = True

    @classmethod
    def parse_index(cls, data: Any, index_path: str, source: str) -> list[ShardMeta]:
        if isinstance(data, dict) and "chunks" in data and "config" in data:
            raise SourceError(f"source '{source}': {index_path} is a LitData index, not an MDS one: set "
                              f"format = \"litdata\" for this source.")
        if not isinstance(data, dict) or not isinstance(data.get("shards"), list):
            raise SourceError(f"source '{source}': {index_path} is not an MDS index (no 'shards' list). Point "
                              f"sources.path at a dataset written by mosaicml-streaming's MDSWriter.")

        def entry(k: int, shard: Any) -> ShardMeta:
            fmt = shard.get("format")
            if fmt != "mds":
                raise SourceError(f"source '{source}': {index_path}, shard #{k} has format '{fmt}'; zephon "
                                  f"reads MDS shards (format 'mds', written by MDSWriter), not the "
                                  f"JSON/CSV shards of the other streaming writers.")
            raw, zipped = shard["raw_data"], shard.get("zip_data")
            compression = shard.get("compression") if zipped else None
            names, encodings, sizes = shard["column_names"], shard["column_encodings"], shard["column_sizes"]
            if not (len(names) == len(encodings) == len(sizes)):
                raise ValueError("column_names, column_encodings and column_sizes differ in length")
            if not all(isinstance(x, str) for x in [*names, *encodings]):
                raise ValueError("a column name or encoding is not a string")
            sizes = [None if s is None else int(s) for s in sizes]
            if any(s is not None and s < 0 for s in sizes):
                raise ValueError(f"negative column_sizes {sizes}")
            return ShardMeta(
                name=cls.shard_name((zipped or raw)["basename"], index_path, source, k),
                samples=int(shard["samples"]), nbytes=int(raw["bytes"]), compression=compression,
                index=index_path,
                stored_bytes=int(zipped["bytes"]) if zipped and zipped.get("bytes") is not None else None,
                info={"names": list(names), "encodings": list(encodings), "sizes": sizes})
        return cls.entries(data["shards"], index_path, source, entry)

    def column_kind(self, meta: ShardMeta, name: str, path: str) -> str:
        names, encodings = meta.info["names"], meta.info["encodings"]
        if name not in names:
            raise SourceError(f"{self._name(path)} has no field '{name}' (fields: {', '.join(names)}). Fix the "
                              f"source's columns.")
        enc = encodings[names.index(name)]
        if enc in _RAW_BYTES:
            return "bytes"
        return "tokens" if enc.split(":")[0] == "ndarray" else "text"  # anything else: refused by check_field

    def check_field(self, meta: ShardMeta, path: str) -> None:
        names, encodings = meta.info["names"], meta.info["encodings"]
        if self.field not in names:
            raise self.missing_field(path, names)
        enc = encodings[names.index(self.field)]
        where = f"source '{self.source}': field '{self.field}' of MDS shard {path} has encoding '{enc}' " \
                f"(column_encodings in {meta.index})"
        never = "; zephon decodes only 'str' (text) and 'ndarray' (token ids) columns itself, and reads 'bytes', " \
                "'jpeg' and 'png' columns as raw bytes (images, with columns=[...]), never 'pkl', 'json' or 'pil' " \
                "columns (a dataset is untrusted input)"
        if self.raw_bytes:
            if enc not in _RAW_BYTES:
                raise SourceError(f"{where}, not raw bytes{never}.")
            return
        if not self.tokens:
            if enc != "str":
                raise SourceError(f"{where}, not 'str'{never}. Point text_field at a text column (or use "
                                  f"tokens_field for an ndarray column of token ids).")
            return
        parts = enc.split(":")
        if parts[0] != "ndarray" or len(parts) > 3:
            raise SourceError(f"{where}; token ids are read from an 'ndarray' column (e.g. 'ndarray:int32'){never}. "
                              f"Point tokens_field at one, or use text_field for a 'str' column.")
        if len(parts) > 1 and parts[1] and parts[1] not in _VALUE_DTYPES.values() or \
                len(parts) > 2 and not _SHAPE.fullmatch(parts[2]):
            raise SourceError(f"{where}, which is not an ndarray encoding MDSWriter writes (dtypes: "
                              f"{', '.join(_VALUE_DTYPES.values())}; shape: positive integers). The index is "
                              f"corrupt: re-write the dataset.")

    def decode(self, meta: ShardMeta, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, path: str,
               first_row: int) -> list[str | None] | TokenRows:
        self.check_field(meta, path)
        names, encodings, sizes = meta.info["names"], meta.info["encodings"], meta.info["sizes"]
        col = names.index(self.field)
        a, b = self.field_ranges(buf, starts, ends, sizes, col, True, path, first_row, meta.index)
        if self.raw_bytes:
            return self.raw(buf, a, b)  # type: ignore[return-value]
        if not self.tokens:
            return self.texts(buf, a, b, path, first_row)
        return self._token_rows(encodings[col], buf, a, b, path, first_row, meta.index)

    def _token_rows(self, enc: str, buf: np.ndarray, a: np.ndarray, b: np.ndarray, path: str,
                    first_row: int, index: str) -> TokenRows:
        parts = enc.split(":")  # checked by check_field: 'ndarray[:dtype[:shape]]'
        dtype = parts[1] if len(parts) > 1 and parts[1] else None
        static_shape = len(parts) > 2 and parts[2]
        n = len(a)
        if n and np.any(b - a < 1):
            r = int(np.flatnonzero(b - a < 1)[0])
            self._bad_sample(path, first_row + r, index, f"has an empty '{self.field}' field")
        pos = a.copy()
        if dtype is None:  # dynamic dtype: one code byte per sample
            codes = buf[pos].astype(np.int64) if n else np.zeros(0, np.int64)
            unknown = [c for c in np.unique(codes).tolist() if c not in _VALUE_DTYPES]
            if unknown:
                r = int(np.flatnonzero(codes == unknown[0])[0])
                raise SourceError(f"source '{self.source}': MDS shard {path}, sample {first_row + r}: unknown "
                                  f"ndarray dtype code {unknown[0]}. The shard is corrupt: re-write it.")
            dtypes = [np.dtype(_VALUE_DTYPES[c]) for c in codes.tolist()]
            pos = pos + 1
        else:
            dtypes = [np.dtype(dtype)] * n
        if not static_shape and n:  # [ndim << 2 | shape dtype code] [shape]
            head = buf[pos].astype(np.int64)
            pos = pos + 1 + (head >> 2) * (1 << (head & 3))
        if n and np.any(pos > b):
            r = int(np.flatnonzero(pos > b)[0])
            raise SourceError(f"source '{self.source}': MDS shard {path}, sample {first_row + r}: the ndarray "
                              f"header of field '{self.field}' runs past the sample. The shard is corrupt.")
        bad = [d for d in set(dtypes) if d.kind not in "iu"]
        if bad:
            raise SourceError(f"source '{self.source}': field '{self.field}' of MDS shard {path} holds {bad[0]} "
                              f"values, not integer token ids. Point tokens_field at a token-id column.")
        if dtype is not None or len(set(dtypes)) <= 1:
            return byte_token_rows(buf, pos, b, dtypes[0] if dtypes else np.dtype(dtype or "int32"),
                                   self.source, path, self.field, first_row)
        return byte_token_rows(buf, pos, b, dtypes, self.source, path, self.field, first_row)

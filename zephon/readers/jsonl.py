"""JSON Lines reader: plain files by byte ranges, gzip/zstd files by line ranges.

Plain files are split at byte offsets; a chunk owns the lines that *start* inside it, so any byte
range can be read with one seek and nothing is read twice. Compressed files cannot be seeked, so a
compressed file is one chunk (decompressed once by one worker) and its coordinates are line numbers.
"""

from __future__ import annotations

import io
import json
import math
from typing import Sequence

import fsspec
import numpy as np

from .base import LRU, RawChunk, SourceError, Unit, aligned_cuts, split_evenly

_COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}


def compression_of(path: str) -> str | None:
    for ext, kind in _COMPRESSION.items():
        if path.endswith(ext):
            return kind
    return None


def _zstd_decompress(data: bytes) -> bytes:
    """All frames of a zstd stream; a frame cut short raises (fsspec's reader returns what it has)."""
    import zstandard

    out = []
    while data:
        frame = zstandard.ZstdDecompressor().decompressobj()
        out.append(frame.decompress(data))
        if not frame.eof:
            raise EOFError("the zstd stream ends inside a frame")
        data = frame.unused_data
    return b"".join(out)


class JsonlReader:
    """Reads ``text_field`` of JSON Lines files (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, source: str, text_field: str,
                 chunk_bytes: int, unit_bytes: int) -> None:
        self.fs = fs
        self.source = source
        self.text_field = text_field
        self.chunk_bytes = chunk_bytes
        self.unit_bytes = unit_bytes
        self._sizes = LRU(256)
        self._lines = LRU(2)

    def _size(self, path: str) -> int:
        def make() -> int:
            try:
                return int(self.fs.size(path))
            except FileNotFoundError as exc:
                raise SourceError(f"source '{self.source}': file {path} is missing; restore it or start "
                                  f"a new run.") from exc
        return self._sizes.get(path, make)

    def _all_lines(self, path: str) -> list[bytes]:
        def make() -> list[bytes]:
            try:
                kind = compression_of(path)
                with self.fs.open(path, "rb", compression=None if kind == "zstd" else kind) as f:
                    data = f.read()
                return (_zstd_decompress(data) if kind == "zstd" else data).split(b"\n")
            except FileNotFoundError as exc:
                raise SourceError(f"source '{self.source}': file {path} is missing.") from exc
            except SourceError:  # an object-store error (zephon.storage) already names the URL and the cause
                raise
            except Exception as exc:  # zlib.error, zstd.ZstdError, EOFError: corrupt or truncated
                raise SourceError(f"source '{self.source}': cannot decompress {path} ({type(exc).__name__}: "
                                  f"{exc}). The file is corrupt or truncated: re-write or remove it.") from exc
        lines = self._lines.get(path, make)
        return lines[:-1] if lines and lines[-1] == b"" else lines

    # -- planning -------------------------------------------------------------------------------
    def split_units(self, files: Sequence[str], lanes: int) -> list[Unit]:
        """Plain files: byte ranges of at most ``unit_bytes`` (and at least lanes/files per file).
        Compressed files: whole files, or line ranges when there are fewer files than lanes."""
        few = len(files) < lanes
        parts = math.ceil(lanes / len(files)) if few else 1
        units = []
        for i, path in enumerate(files):
            if compression_of(path):
                if not few:
                    units.append(Unit(i, 0, -1))
                    continue
                total = len(self._all_lines(path))
            else:
                total = self._size(path)
                parts_i = max(parts, math.ceil(total / self.unit_bytes))
                units += [Unit(i, a, b) for a, b in split_evenly(0, total, parts_i)]
                continue
            units += [Unit(i, a, b) for a, b in split_evenly(0, total, parts)]
        return units

    def chunk_bounds(self, path: str, unit: Unit, cursor: int) -> list[tuple[int, int]]:
        lo = unit.start if cursor < 0 else cursor
        if compression_of(path):
            return [(lo, unit.end)]
        hi = self._size(path) if unit.end < 0 else unit.end
        return aligned_cuts(lo, hi, 0, self.chunk_bytes)

    # -- reading (runs on workers) ---------------------------------------------------------------
    def read(self, path: str, start: int, end: int) -> RawChunk:
        if compression_of(path):
            lines = self._all_lines(path)
            stop = len(lines) if end < 0 else min(end, len(lines))
            texts = [self._text(lines[k], path, f"line {k + 1}") for k in range(start, stop)]
            return RawChunk(texts, np.arange(start + 1, stop + 1, dtype=np.int64), stop)
        return self._read_bytes(path, start, end)

    def _read_bytes(self, path: str, start: int, end: int) -> RawChunk:
        try:
            f = self.fs.open(path, "rb")
        except FileNotFoundError as exc:
            raise SourceError(f"source '{self.source}': file {path} is missing.") from exc
        with f:
            skip = 1 if start > 0 else 0  # the byte before start tells whether a line starts at start
            f.seek(start - skip)
            buf = io.BytesIO()
            buf.write(f.read(end - start + skip))
            while True:  # finish the last line that starts before end
                tail = buf.getvalue()
                if tail.endswith(b"\n") or len(tail) < end - start + skip:
                    break
                more = f.read(1 << 16)
                if not more:
                    break
                nl = more.find(b"\n")
                buf.write(more if nl < 0 else more[: nl + 1])
                if nl >= 0:
                    break
            data = buf.getvalue()
        first = 0 if start == 0 else data.find(b"\n") + 1  # skip the line that began before start
        texts: list[str | None] = []
        cursors: list[int] = []
        pos = first if (start == 0 or first > 0) else len(data)
        limit = end - start + skip
        while pos < len(data) and pos < limit:
            nl = data.find(b"\n", pos)
            stop = len(data) if nl < 0 else nl + 1
            texts.append(self._text(data[pos:stop], path, f"byte {start - skip + pos}"))
            cursors.append(start - skip + stop)
            pos = stop
        return RawChunk(texts, np.asarray(cursors, dtype=np.int64), end)

    def _text(self, line: bytes, path: str, where: str) -> str | None:
        line = line.strip()
        if not line:
            return None
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise SourceError(f"source '{self.source}': {path}, {where}: not valid JSON ({exc}). "
                              f"Fix or remove that line.") from exc
        if not isinstance(record, dict):
            raise SourceError(f"source '{self.source}': {path}, {where}: a JSON object is expected, got "
                              f"{type(record).__name__}. Each line must be one JSON object: fix or remove "
                              f"that line.")
        if self.text_field not in record:
            raise SourceError(f"source '{self.source}': {path}, {where}: no field '{self.text_field}' "
                              f"(fields: {', '.join(sorted(record))}). Set text_field of this source.")
        value = record[self.text_field]
        if value is not None and not isinstance(value, str):
            raise SourceError(f"source '{self.source}': {path}, {where}: field '{self.text_field}' holds "
                              f"{type(value).__name__}, not text. Point text_field at a text field, or fix "
                              f"that line.")
        return value

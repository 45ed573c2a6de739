"""JSON Lines reader: plain files by byte ranges, gzip/zstd files by line ranges.

Plain files are split at byte offsets; a chunk owns the lines that *start* inside it, so any byte
range can be read with one seek and nothing is read twice. Compressed files cannot be seeked, so a
compressed file is one chunk (decompressed once by one worker) and its coordinates are line numbers.

Reading is linear in the file's size, however long its lines: a chunk reads its own bytes once (and
the byte before them); a chunk in which no line starts owns nothing and reads no further, and the
chunk in which a long line starts reads the rest of it in doubling steps, joined once. A line longer
than ``[read] max_doc_bytes`` is skipped, cut or refused (:class:`~zephon.readers.base.DocLimit`); a
skipped or refused one is not read past the limit.
"""

from __future__ import annotations

import json
import math
from typing import BinaryIO, Sequence

import fsspec
import numpy as np

from .base import DEFAULT_DOC_LIMIT, DocLimit, LRU, RawChunk, Unit, aligned_cuts, split_evenly, utf8_prefix
from ..errors import SourceError

_COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
# Reads of a line that goes on past its chunk: the first this long, each next one twice as long (up to
# the cap), so a line of n bytes costs O(log n) reads and one join, never a copy per read.
_FIRST_READ = 1 << 16
_MAX_READ = 16 << 20


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
                 chunk_bytes: int, unit_bytes: int, doc_limit: DocLimit = DEFAULT_DOC_LIMIT,
                 columns: Sequence[str] | None = None) -> None:
        self.fs = fs
        self.columns = tuple(columns) if columns else None  # several fields of any JSON type, as record fields
        self.source = source
        self.text_field = text_field
        self.chunk_bytes = chunk_bytes
        self.unit_bytes = unit_bytes
        self.doc_limit = doc_limit
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
            if not compression_of(path):
                total = self._size(path)
                parts_i = max(parts, math.ceil(total / self.unit_bytes))
            elif few:
                total, parts_i = len(self._all_lines(path)), parts
            else:
                units.append(Unit(i, 0, -1))
                continue
            units += [Unit(i, a, b) for a, b in split_evenly(0, total, parts_i)]
        return units

    def chunk_bounds(self, path: str, unit: Unit, cursor: int) -> list[tuple[int, int]]:
        lo = unit.start if cursor < 0 else cursor
        if compression_of(path):
            return [(lo, unit.end)]
        hi = self._size(path) if unit.end < 0 else unit.end
        return aligned_cuts(lo, hi, 0, self.chunk_bytes)

    def starts_record(self, path: str, cursor: int) -> bool:
        """Whether ``cursor`` is a position a lane can stand at: a line number of a compressed file always is;
        a byte offset of a plain file must be a chunk boundary (a chunk owns the lines that start in it; a
        unit's start is one too) or follow a newline. Checked for a resumed position: any other byte would
        silently drop a line."""
        if compression_of(path) or cursor <= 0 or cursor % self.chunk_bytes == 0:
            return True
        try:
            with self.fs.open(path, "rb") as f:
                f.seek(cursor - 1)
                return f.read(1) == b"\n"
        except FileNotFoundError as exc:
            raise SourceError(f"source '{self.source}': file {path} is missing; restore it or start a new run.") from exc

    # -- reading (runs on workers) ---------------------------------------------------------------
    def read(self, path: str, start: int, end: int) -> RawChunk:
        if compression_of(path):
            lines = self._all_lines(path)
            stop = len(lines) if end < 0 else min(end, len(lines))
            texts = [self._record(lines[k], path, f"line {k + 1}") for k in range(start, stop)]
            return self._chunk(texts, np.arange(start + 1, stop + 1, dtype=np.int64), stop)
        return self._read_bytes(path, start, self._size(path) if end < 0 else end)

    def _chunk(self, records: list, cursors: np.ndarray, end: int, first: int | None = None) -> RawChunk:
        """Texts, or with ``columns=``, each field's values (a skipped oversize line: None in every field);
        ``first``: where the first record starts (see :class:`RawChunk`)."""
        if not self.columns:
            return RawChunk(records, cursors, end, first=first)
        cols = {c: [None if r is None else r[c] for r in records] for c in self.columns}
        return RawChunk([], cursors, end, columns=cols, first=first)

    def _read_bytes(self, path: str, start: int, end: int) -> RawChunk:
        """The lines that start in ``[start, end)``: the chunk's bytes, plus the rest of its last line."""
        try:
            f = self.fs.open(path, "rb")
        except FileNotFoundError as exc:
            raise SourceError(f"source '{self.source}': file {path} is missing.") from exc
        texts: list[str | None] = []
        cursors: list[int] = []
        with f:
            skip = 1 if start > 0 else 0  # the byte before start tells whether a line starts at start
            base = start - skip  # file offset of data[0]
            f.seek(base)
            data = f.read(end - base)
            if skip:  # the first line starts after the first newline; none in the chunk: it owns nothing
                pos = data.find(b"\n") + 1 or len(data)
            else:
                pos = 0
            first = base + pos
            while pos < len(data):
                nl = data.find(b"\n", pos)
                if nl < 0:  # the last line goes on past the chunk (or ends the file without a newline)
                    text, stop = self._last_line(f, data[pos:], base + pos, end, path)
                    texts.append(text)
                    cursors.append(stop)
                    break
                texts.append(self._record(data[pos:nl], path, f"byte {base + pos}"))
                cursors.append(base + nl + 1)
                pos = nl + 1
        return self._chunk(texts, np.asarray(cursors, dtype=np.int64), end, first)

    def _last_line(self, f: BinaryIO, head: bytes, offset: int, end: int, path: str) -> tuple[str | None, int]:
        """The record of the line at ``offset`` that starts with ``head`` (read so far; ``f`` is just
        past it): read on to its newline in doubling steps, joined once. Returns the text and the cursor
        after the line. A line found longer than the size guard is not read further unless it is to be
        cut: a skipped one reports ``end`` as its cursor, which is where the next chunk starts (and owns
        nothing of this line), so resuming there is the same as resuming after the line."""
        limit = self.doc_limit
        parts, size, step = [head], len(head), _FIRST_READ
        while True:
            if size > limit.max_bytes and limit.policy != "truncate":
                text = self._oversize(b"", f"a line of more than {limit.max_bytes} bytes", path, f"byte {offset}")
                return text, end
            more = f.read(step)
            if not more:  # end of file: its last line has no newline
                break
            nl = more.find(b"\n")
            if nl >= 0:
                parts.append(more[:nl])
                size += nl
                return self._record(b"".join(parts), path, f"byte {offset}"), offset + size + 1
            parts.append(more)
            size += len(more)
            step = min(2 * step, _MAX_READ)
        return self._record(b"".join(parts), path, f"byte {offset}"), offset + size

    def _record(self, line: bytes, path: str, where: str) -> str | None:
        """The text of one line (without its newline), the size guard applied."""
        if len(line) > self.doc_limit.max_bytes:
            return self._oversize(line, f"a line of {len(line)} bytes", path, where)
        return self._text(line, path, where)

    def _oversize(self, line: bytes, what: str, path: str, where: str) -> str | None:
        """A line over ``max_doc_bytes``: skipped (None), refused, or parsed and its text cut to the limit
        (a line is never shorter than its text, so only such lines can hold a text over the limit)."""
        limit = self.doc_limit
        if limit.policy == "error":
            raise limit.refuse(self.source, path, where, what)
        if limit.policy == "skip":
            return None
        text = self._text(line, path, where)
        if text is None or len(text) * 4 <= limit.max_bytes:  # at most 4 bytes a character: cannot be over
            return text
        data = text.encode("utf-8", "surrogatepass")
        return text if len(data) <= limit.max_bytes else utf8_prefix(data, limit.max_bytes)

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
        if self.columns:
            missing = [c for c in self.columns if c not in record]
            if missing:
                raise SourceError(f"source '{self.source}': {path}, {where}: no field {missing[0]!r} (fields: "
                                  f"{', '.join(sorted(record))}). Fix the source's columns, or that line.")
            return {c: record[c] for c in self.columns}  # type: ignore[return-value]
        if self.text_field not in record:
            raise SourceError(f"source '{self.source}': {path}, {where}: no field '{self.text_field}' "
                              f"(fields: {', '.join(sorted(record))}). Set text_field of this source.")
        value = record[self.text_field]
        if value is not None and not isinstance(value, str):
            raise SourceError(f"source '{self.source}': {path}, {where}: field '{self.text_field}' holds "
                              f"{type(value).__name__}, not text. Point text_field at a text field, or fix "
                              f"that line.")
        return value

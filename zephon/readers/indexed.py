"""Datasets of shards described by an ``index.json``: MosaicML MDS and LitData optimized chunks.

Both formats write shards that start with the same header, ``uint32 n`` then ``uint32 offsets[n+1]``
(absolute byte offsets of the ``n`` samples), and an ``index.json`` beside them that names every shard
with its sample count. So:

- **Listing.** A source's "files" are the shards named by the ``index.json`` files at its paths, listed
  from the indexes and sorted: no shard is opened to plan. A path is a dataset folder (its
  ``index.json``, which may be a merged index over sub-folders), a folder of datasets without an index
  of its own (every ``index.json`` below it), an ``index.json``, or a glob of those. A shard named by
  several indexes is listed once.
- **Units.** Whole shards when a source has at least as many shards as lanes; otherwise each shard is
  cut into ``ceil(lanes / shards)`` sample ranges (sample counts come from the index).
- **Chunks.** Sample ranges aligned to multiples of ``chunk_rows`` from the start of the shard, like
  Parquet row groups; coordinates are sample numbers within a shard.
- **Reads.** One ranged read of the shard header (checked against the index: sample count, sizes),
  then one ranged read of the chunk's samples. A compressed shard is decompressed whole, once per
  process (bounded cache).

Any disagreement between an index and its shard (sample count, byte size, offsets, a sample whose
columns do not add up) is a :class:`SourceError` naming the shard and the index; nothing is skipped.

**Several columns** (``columns=[...]``, e.g. a caption and an image): each column is read by its kind,
decided from the index alone (:meth:`IndexedReader.column_kind`): text, token ids, or *raw bytes* (an
encoded image: the bytes as stored, never decoded here; ``decode_images`` sniffs and decodes them later,
on the workers). Encodings that would need a deserializer (pickle, a pixel layout of the writer's own) are
refused as for one field.
"""

from __future__ import annotations

import bz2
import copy
import gzip
import json
import math
import posixpath
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import fsspec
import numpy as np

from .base import LRU, RawChunk, TokenRows, Unit, aligned_cuts, path_not_found, split_evenly
from ..errors import SourceError

INDEX_NAME = "index.json"


@dataclass(frozen=True)
class ShardMeta:
    """One shard as its index describes it."""

    name: str  # path relative to the index's folder ('/'-separated)
    samples: int
    nbytes: int | None  # size of the decoded (decompressed) shard, when the index states it
    compression: str | None  # shard compression ('zstd', 'gz', ...), None: stored raw
    index: str  # the index.json that describes it
    info: dict[str, Any] = field(default_factory=dict, compare=False)  # format-specific
    stored_bytes: int | None = None  # size of the compressed file, when the index states it


@dataclass
class Shard:
    """A shard opened for reading: its validated sample offsets (the bytes of a compressed shard are
    in the reader's bounded cache of decoded shards, fetched again on a miss)."""

    meta: ShardMeta
    offsets: np.ndarray  # int64 [n+1]


class IndexedReader:
    """Shared planning and reading for shard formats with an ``index.json`` (see the module docstring)."""

    label = "?"  # for messages
    shard_word = "shard"  # what the format calls its shards (LitData: chunk)
    exact_end = True  # the last sample ends where the shard ends (LitData may append a footer)

    def __init__(self, fs: fsspec.AbstractFileSystem, source: str, field_name: str, tokens: bool,
                 chunk_rows: int, cache_bytes: int = 1 << 30, columns: Sequence[str] | None = None) -> None:
        self.fs = fs
        self.source = source
        self.field = field_name
        self.tokens = tokens
        self.raw_bytes = False  # a column of raw bytes (encoded images): returned as stored
        self.columns = tuple(columns) if columns else None
        self._subs: dict[tuple[str, str], "IndexedReader"] = {}
        self.chunk_rows = chunk_rows
        self._indexes = LRU(256)
        self._shards = LRU(4096, max_size=max(1, cache_bytes // 8), size_of=lambda sh: sh.offsets.nbytes)
        self._decoded = LRU(64, max_size=max(1, cache_bytes // 4), size_of=len)

    def _name(self, path: str) -> str:
        return f"source '{self.source}': {self.label} {self.shard_word} {path}"

    # -- format hooks ----------------------------------------------------------------------------
    @classmethod
    def parse_index(cls, data: Any, index_path: str, source: str) -> list[ShardMeta]:
        raise NotImplementedError

    def decode(self, meta: ShardMeta, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, path: str,
               first_row: int) -> list[str | None] | TokenRows:
        raise NotImplementedError

    def inflate(self, raw: bytes, meta: ShardMeta, path: str) -> bytes:
        """The decoded bytes of a compressed shard (the uncompressed shard layout)."""
        return _decompress(meta.compression or "", raw)

    def check_field(self, meta: ShardMeta, path: str) -> None:
        """Refuse, from the index alone, a field that this reader does not decode itself (a format that
        would need pickle or a media codec, a missing field): called before any byte of the shard is read."""

    def column_kind(self, meta: ShardMeta, name: str, path: str) -> str:
        """``"text"``, ``"tokens"`` or ``"bytes"``: how column ``name`` is read, from its encoding in the index
        (a column this reader does not decode itself is refused here, before any byte is read)."""
        raise NotImplementedError

    def _column(self, meta: ShardMeta, name: str, path: str) -> "IndexedReader":
        """A reader of column ``name`` alone (sharing this reader's caches), for a source with several columns."""
        key = (meta.index, name)
        if key not in self._subs:
            kind = self.column_kind(meta, name, path)
            sub = copy.copy(self)
            sub.field, sub.tokens, sub.raw_bytes, sub.columns, sub._subs = name, kind == "tokens", kind == "bytes", None, {}
            sub.fresh_column()
            self._subs[key] = sub
        return self._subs[key]

    def fresh_column(self) -> None:
        """Reset per-field caches in a column reader made by :meth:`_column` (format hook)."""

    def raw(self, buf: np.ndarray, a: np.ndarray, b: np.ndarray) -> list[bytes]:
        """The bytes of each sample's field, as stored (an encoded image, decoded later by ``decode_images``)."""
        return [buf[x:y].tobytes() for x, y in zip(a.tolist(), b.tolist())]

    # -- index entries are untrusted too -----------------------------------------------------------
    @classmethod
    def shard_name(cls, name: Any, index_path: str, source: str, k: int) -> str:
        """A shard's file name from an index: a relative path inside the index's folder, never one that
        leaves it (absolute, ``..``, a URL), so that an index cannot make Zephon read other files."""
        parts = name.split("/") if isinstance(name, str) else []
        if not parts or name.startswith("/") or "://" in name or "\\" in name or "\x00" in name or \
                any(p in ("", ".", "..") for p in parts):
            raise SourceError(f"source '{source}': {index_path}, {cls.shard_word} #{k}: file name {name!r} is not "
                              f"a relative path inside the dataset's folder. The index is corrupt or hostile: "
                              f"re-write the dataset.")
        return name

    @classmethod
    def entries(cls, items: list, index_path: str, source: str,
                parse: Callable[[int, Any], ShardMeta]) -> list[ShardMeta]:
        """``parse(k, item)`` of each shard entry of an index, its counts checked (:meth:`checked`); an entry
        that ``parse`` cannot read (a key missing, a value of the wrong type) is an error naming the index."""
        out = []
        for k, item in enumerate(items):
            try:
                meta = parse(k, item)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise SourceError(f"source '{source}': {index_path}, {cls.shard_word} #{k}: not a valid {cls.label} "
                                  f"{cls.shard_word} entry ({type(exc).__name__}: {exc}). The index is corrupt: "
                                  f"re-write the dataset.") from exc
            out.append(cls.checked(meta, source, k))
        return out

    @classmethod
    def checked(cls, meta: ShardMeta, source: str, k: int) -> ShardMeta:
        """``meta`` once its counts are in range: no negative count, and no more samples than the shard's
        header can hold (4 bytes per sample offset), so that a bogus count cannot plan billions of chunks."""
        where = f"source '{source}': {meta.index}, {cls.shard_word} #{k} ({meta.name})"
        for what, value in (("sample count", meta.samples), ("byte size", meta.nbytes),
                            ("stored byte size", meta.stored_bytes)):
            if value is not None and value < 0:
                raise SourceError(f"{where}: negative {what} {value}. The index is corrupt: re-write the dataset.")
        if meta.nbytes is not None and 4 * (meta.samples + 2) > meta.nbytes:
            raise SourceError(f"{where}: {meta.samples} samples cannot fit in {meta.nbytes} bytes. The index is "
                              f"corrupt: re-write the dataset.")
        return meta

    # -- listing (called by the work plan) -------------------------------------------------------
    @classmethod
    def list_shards(cls, fs: fsspec.AbstractFileSystem, root: str, source: str, pattern: str,
                    origin: str) -> list[str]:
        """Shard paths named by the ``index.json`` files at ``root`` (folder, index file or glob)."""
        if any(c in root for c in "*?["):
            hits = fs.glob(root)
            indexes = [p for p in hits if posixpath.basename(p) == INDEX_NAME and fs.isfile(p)]
            for p in hits:
                if fs.isdir(p):
                    indexes += _find_indexes(fs, p)
        elif fs.isdir(root):
            indexes = _find_indexes(fs, root)
        elif fs.isfile(root):
            indexes = [root]
        else:
            raise path_not_found(origin, source, pattern)
        if not indexes:
            raise SourceError(f"{origin}: source '{source}': path '{pattern}' holds no {cls.label} dataset (no "
                              f"{INDEX_NAME} found). Point sources.path at the folder written by the "
                              f"{cls.label} writer.")
        shards: set[str] = set()
        for index in sorted(set(indexes)):
            folder = posixpath.dirname(index)
            for meta in cls.parse_index(_load_json(fs, index, source, cls.label), index, source):
                shards.add(posixpath.join(folder, meta.name))
        return sorted(shards)

    # -- metadata --------------------------------------------------------------------------------
    def _index_at(self, folder: str) -> dict[str, ShardMeta] | None:
        def make() -> dict[str, ShardMeta] | None:
            path = posixpath.join(folder, INDEX_NAME)
            if not self.fs.exists(path):
                return None
            data = _load_json(self.fs, path, self.source, self.label)
            return {m.name: m for m in self.parse_index(data, path, self.source)}
        return self._indexes.get(folder, make)

    def meta(self, path: str) -> ShardMeta:
        """The index entry of shard ``path``: the nearest ``index.json`` above it that names it."""
        folder = posixpath.dirname(path)
        while True:
            entries = self._index_at(folder)
            rel = path[len(folder) + 1:]
            if entries is not None and rel in entries:
                return entries[rel]
            parent = posixpath.dirname(folder)
            if parent == folder or not parent or parent.endswith(":") or parent.endswith(":/"):
                break
            folder = parent
        raise SourceError(f"source '{self.source}': no {INDEX_NAME} names the {self.label} {self.shard_word} {path} "
                          f"any more; it was listed when the run was planned. Restore the index or start a new run.")

    def _shard(self, path: str) -> Shard:
        return self._shards.get(path, lambda: self._open_shard(path))

    def _open_shard(self, path: str) -> Shard:
        meta = self.meta(path)
        n = meta.samples
        head = 4 * (n + 2)
        data = None
        try:
            if meta.compression:
                data = self._decompressed(path, meta)
                header, size = data[:head], len(data)
            else:
                size = int(self.fs.size(path))
                with self.fs.open(path, "rb") as f:
                    header = f.read(head)
        except FileNotFoundError as exc:
            raise SourceError(f"{self._name(path)} is missing (named by "
                              f"{meta.index}). Restore it or start a new run.") from exc
        where = f"{self._name(path)} disagrees with its index {meta.index}"
        fix = "The shard is truncated or corrupt, or the index is stale: re-write the dataset or restore the shard."
        if meta.nbytes is not None and size != meta.nbytes:
            raise SourceError(f"{where}: the index says {meta.nbytes} bytes, the shard has {size}. {fix}")
        if len(header) < head:
            raise SourceError(f"{where}: the shard has {size} bytes, too few for the header of the {n} samples "
                              f"the index names. {fix}")
        count = int(np.frombuffer(header[:4], "<u4")[0])
        if count != n:
            raise SourceError(f"{where}: the index says {n} samples, the shard holds {count}. {fix}")
        offsets = np.frombuffer(header[4:head], "<u4").astype(np.int64)
        if np.any(np.diff(offsets) < 0) or offsets[0] < head or offsets[-1] > size or \
                (self.exact_end and offsets[-1] != size):
            raise SourceError(f"{where}: its sample offsets ({offsets[0]}..{offsets[-1]}) do not fit its {size} "
                              f"bytes. {fix}")
        return Shard(meta, offsets)

    def _decompressed(self, path: str, meta: ShardMeta) -> bytes:
        def make() -> bytes:
            with self.fs.open(path, "rb") as f:
                raw = f.read()
            if meta.stored_bytes is not None and len(raw) != meta.stored_bytes:
                raise SourceError(f"{self._name(path)} disagrees with its index {meta.index}: the index says "
                                  f"{meta.stored_bytes} bytes, the shard has {len(raw)}. The shard is truncated or "
                                  f"corrupt, or the index is stale: re-write the dataset or restore the shard.")
            try:
                return self.inflate(raw, meta, path)
            except SourceError:
                raise
            except Exception as exc:  # zstd / zlib / bz2 errors: corrupt or truncated
                raise SourceError(f"source '{self.source}': cannot decompress {self.label} {self.shard_word} {path} "
                                  f"({meta.compression}: {type(exc).__name__}: {exc}). The shard is corrupt or "
                                  f"truncated: re-write the dataset or restore the shard.") from exc
        return self._decoded.get(path, make)

    # -- planning --------------------------------------------------------------------------------
    def split_units(self, files: Sequence[str], lanes: int) -> list[Unit]:
        if len(files) >= lanes:
            return [Unit(i, 0, -1) for i in range(len(files))]
        parts = math.ceil(lanes / max(1, len(files)))
        return [Unit(i, a, b) for i, path in enumerate(files)
                for a, b in split_evenly(0, self.meta(path).samples, parts)]

    def chunk_bounds(self, path: str, unit: Unit, cursor: int) -> list[tuple[int, int]]:
        lo = unit.start if cursor < 0 else cursor
        hi = self.meta(path).samples if unit.end < 0 else unit.end
        return aligned_cuts(lo, hi, 0, self.chunk_rows)

    # -- reading (runs on workers) ---------------------------------------------------------------
    def read(self, path: str, start: int, end: int) -> RawChunk:
        meta = self.meta(path)
        fields = [self._column(meta, name, path) for name in self.columns] if self.columns else [self]
        for reader in fields:
            reader.check_field(meta, path)  # before a byte of the shard is read
        shard = self._shard(path)
        n = shard.meta.samples
        end = n if end < 0 else min(end, n)
        lo, hi = int(shard.offsets[start]), int(shard.offsets[end])
        if shard.meta.compression:
            buf = np.frombuffer(self._decompressed(path, shard.meta), np.uint8)[lo:hi]
        else:
            try:
                with self.fs.open(path, "rb") as f:
                    f.seek(lo)
                    data = f.read(hi - lo)
            except FileNotFoundError as exc:
                raise SourceError(f"{self._name(path)} is missing.") from exc
            if len(data) != hi - lo:
                inside = start + int(np.searchsorted(shard.offsets[start:], lo + len(data), "right")) - 1
                raise SourceError(f"{self._name(path)} ends at byte {lo + len(data)}, inside sample {inside} (its "
                                  f"header says {hi}). The shard is truncated: re-write or restore it.")
            buf = np.frombuffer(data, np.uint8)
        starts = shard.offsets[start:end] - lo
        ends = shard.offsets[start + 1:end + 1] - lo
        cursors = np.arange(start + 1, end + 1, dtype=np.int64)
        if self.columns:
            return RawChunk([], cursors, end, columns={r.field: r.decode(shard.meta, buf, starts, ends, path, start)
                                                        for r in fields})
        out = self.decode(shard.meta, buf, starts, ends, path, start)
        if isinstance(out, TokenRows):
            return RawChunk([], cursors, end, tokens=out)
        return RawChunk(out, cursors, end)

    # -- helpers for decoders --------------------------------------------------------------------
    def field_ranges(self, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, fixed: Sequence[int | None],
                     col: int, header: bool, path: str, first_row: int, index: str) -> tuple[np.ndarray, np.ndarray]:
        """Byte ranges of column ``col`` in samples laid out as ``[uint32 size per column whose size is
        not fixed (all columns when fixed is all None)][column bytes, in column order]`` (``header``:
        whether the size header is there at all). Checked: the columns must fill each sample exactly."""
        n, ncol = len(starts), len(fixed)
        var = [j for j, s in enumerate(fixed) if s is None] if header else []
        sizes = np.empty((n, ncol), dtype=np.int64)
        k = len(var)
        lengths = ends - starts
        if k:
            short = np.flatnonzero(lengths < 4 * k)
            if len(short):
                self._bad_sample(path, first_row + int(short[0]), index,
                                 f"has {lengths[short[0]]} bytes, fewer than its {k} column sizes")
            idx = starts[:, None] + np.arange(4 * k, dtype=np.int64)[None, :]
            sizes[:, var] = buf[idx].reshape(n, 4 * k).view("<u4").astype(np.int64)
        for j, s in enumerate(fixed):
            if s is not None:
                sizes[:, j] = s
        if not header:  # a single column that is the whole sample (LitData TokensLoader)
            sizes[:, 0] = lengths
        total = 4 * k + sizes.sum(axis=1)
        bad = np.flatnonzero(total != lengths)
        if len(bad):
            r = int(bad[0])
            self._bad_sample(path, first_row + r, index,
                             f"has {lengths[r]} bytes but its columns take {total[r]}")
        col_start = starts + 4 * k + sizes[:, :col].sum(axis=1)
        return col_start, col_start + sizes[:, col]

    def _bad_sample(self, path: str, row: int, index: str, what: str) -> None:
        raise SourceError(f"{self._name(path)}, sample {row} {what}: the shard "
                          f"disagrees with the columns its index {index} declares, or is corrupt. Re-write the "
                          f"dataset.")

    def texts(self, buf: np.ndarray, a: np.ndarray, b: np.ndarray, path: str, first_row: int) -> list[str | None]:
        out: list[str | None] = []
        for k, (x, y) in enumerate(zip(a.tolist(), b.tolist())):
            try:
                out.append(buf[x:y].tobytes().decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise SourceError(f"{self._name(path)}, sample {first_row + k}: field "
                                  f"'{self.field}' is not valid UTF-8 ({exc}). The shard is corrupt: re-write "
                                  f"it.") from exc
        return out

    def missing_field(self, path: str, names: Sequence[str]) -> SourceError:
        key, what = ("tokens_field", "token ids") if self.tokens else ("text_field", "text")
        return SourceError(f"{self._name(path)} has no field '{self.field}' (fields: "
                           f"{', '.join(names)}). Set {key} of this source to the field that holds the {what}.")


def _find_indexes(fs: fsspec.AbstractFileSystem, folder: str) -> list[str]:
    """The folder's own index.json (a dataset, or a merged index over its parts), else every index.json
    below it (a folder of datasets). The first case lists nothing: no shard object is enumerated."""
    direct = posixpath.join(folder.rstrip("/"), INDEX_NAME)
    if fs.isfile(direct):
        return [direct]
    return [p for p in fs.find(folder) if posixpath.basename(p) == INDEX_NAME]


def _load_json(fs: fsspec.AbstractFileSystem, path: str, source: str, label: str) -> Any:
    try:
        with fs.open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError as exc:
        raise SourceError(f"source '{source}': {label} index {path} is missing.") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise SourceError(f"source '{source}': {label} index {path} is not valid JSON ({exc}). The index is "
                          f"corrupt or truncated: re-write the dataset.") from exc


def _decompress(kind: str, raw: bytes) -> bytes:
    algo = kind.split(":", 1)[0]
    if algo == "zstd":
        from .jsonl import _zstd_decompress

        return _zstd_decompress(raw)
    if algo == "gz":
        return gzip.decompress(raw)
    if algo == "bz2":
        return bz2.decompress(raw)
    if algo == "br":
        try:
            import brotli
        except ImportError as exc:
            raise SourceError("a brotli-compressed shard needs the brotli package (pip install brotli).") from exc
        return brotli.decompress(raw)
    if algo == "snappy":
        try:
            import snappy
        except ImportError as exc:
            raise SourceError("a snappy-compressed shard needs python-snappy (pip install python-snappy).") from exc
        return snappy.decompress(raw)
    raise SourceError(f"shard compression '{kind}' is not supported (zstd, gz, bz2, br, snappy).")

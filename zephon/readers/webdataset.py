"""WebDataset tar shards: samples grouped by key, planned from an index of member offsets.

A shard is a tar file whose members are grouped into *samples* exactly as the ``webdataset`` package
groups them: a member ``dir/000123.seg.jpg`` has the key ``dir/000123`` and the extension ``seg.jpg``
(lower-cased); consecutive members with the same key form one sample; non-regular members (folders,
links, devices), names without an extension and ``__meta__``-style names are left out; an extension twice
in one sample is an error.

**The index.** Each shard is indexed once: its 512-byte tar headers are read and every member's data
skipped (GNU long names, pax ``path``/``size`` records and ustar prefixes understood; sparse members
refused), giving per sample its key and per member its extension, data offset and size. The index is
kept per process and, when a cache folder is given (``read.webdataset(..., index_cache=...)``, or the
recipe's ``[storage] cache_dir``), as a JSON sidecar keyed by the shard's URL, size and version (ETag,
generation or mtime). A sidecar is untrusted: it must match the shard's size and version, carry a valid
checksum and describe members that fit the shard (in order, block-aligned, inside the file); otherwise
the shard is scanned again and the sidecar rewritten. Nothing in a shard or a sidecar is executed.

**Units and chunks.** Coordinates are sample numbers in a shard. A unit is a whole shard when a source
has at least as many shards as lanes (planning then reads no index at all), else a range of samples; a
chunk is ``chunk_rows`` samples, aligned to the shard's start, read with one ranged read of the bytes
from its first wanted member to its last (split only around gaps of unwanted bytes over 1 MiB, such as
an oversize member or a column not asked for): never a whole-shard download per lane. A local shard
stays open between chunks (:mod:`zephon.readers.open_files`); a local read starts at its first member's
tar header, and the headers of the read's first and last member must give the sizes the index has, so a
shard rewritten in place while open is refused rather than cut at its old offsets.

**Records.** One field per column: ``columns=["jpg", "txt"]`` reads those extensions; ``"jpg;jpeg;png"``
takes the first of several present and names the field after the first; ``"image=jpg;png"`` names it
``image``; ``"__key__"`` is the sample key; ``"*"`` (the default) reads the key and every member, one field
per extension. (Give every source of a pipeline the same payload fields: a rank's batch has a payload key
only when one of its documents has that field.)
A member absent from a sample is None. Members are bytes, but ``txt`` and ``text`` members, which are
decoded as UTF-8 (invalid UTF-8 is an error naming the shard and the sample). A member larger than
``[read] max_doc_bytes`` is handled by ``[read] oversize``: skipped (None), truncated (text members only;
a binary member is skipped) or an error.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tempfile
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from .base import DEFAULT_DOC_LIMIT, DocLimit, GroupedReader, LRU, RawChunk, utf8_prefix
from ..errors import SourceError
from .open_files import OpenFiles
from .tar_headers import BLOCK, number_field, scan_members

MAX_SIDECAR_BYTES = 256 << 20
READ_GAP = 1 << 20  # unwanted bytes between two wanted members past which a chunk is read in two requests
LOCAL_READ_GAP = 4096  # the same for a local shard, where a request costs a system call, not a round trip
LARGE_MEMBER = 1 << 20  # a local member alone in its read and larger than this is read without its header
OPEN_SHARDS = 128  # local shards this process keeps open between chunks (a lane reads its shard chunk by chunk)
TEXT_EXTENSIONS = ("txt", "text")
INDEX_FORMAT = "zephon-webdataset-index"
INDEX_VERSION = 1
SIDECAR_FOLDER = "zephon-wds-index-v1"
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext
_INDEXES = LRU(4096)  # (path, size, version) -> ShardIndex, shared by this process's readers
# local shards open between chunks, each with the index of the file its descriptor reads: one set for the
# process, like the indexes, so that many loaders in one process (zephon verify) never hold more
_OPEN: OpenFiles[ShardIndex] = OpenFiles(OPEN_SHARDS)
# indexes whose file's headers a read scanned again and found as indexed, with that file's (size, mtime)
_LAYOUT_CHECKED: weakref.WeakKeyDictionary[ShardIndex, tuple[int, int]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True, eq=False)
class ShardIndex:
    """Where each sample's members are in one shard. Sample ``k``'s members are ``first[k]..first[k+1]-1``."""

    size: int  # the shard's size in bytes
    keys: list[str]
    first: np.ndarray  # int64 [n+1]
    exts: list[str]  # per member
    offsets: np.ndarray  # int64 [m]: where each member's data starts
    sizes: np.ndarray  # int64 [m]
    # set by __post_init__: ext_ids (extension -> code) and ext_code (int32 [m], each member's code)

    def __post_init__(self) -> None:
        # Each member's extension as a small integer, so a chunk picks its members with numpy.
        codes: dict[str, int] = {}
        ext_code = np.fromiter((codes.setdefault(e, len(codes)) for e in self.exts), dtype=np.int32,
                               count=len(self.exts))
        object.__setattr__(self, "ext_ids", codes)
        object.__setattr__(self, "ext_code", ext_code)

    def __len__(self) -> int:
        return len(self.keys)

    def same_layout(self, other: "ShardIndex") -> bool:
        """The same samples, members, extensions, offsets and sizes."""
        return (self.size, self.keys, self.exts) == (other.size, other.keys, other.exts) and \
            all(np.array_equal(getattr(self, k), getattr(other, k)) for k in ("first", "offsets", "sizes"))

    def to_json(self, path: str, version: str) -> bytes:
        body = {"path": path, "size": self.size, "version": version, "keys": self.keys,
                "first": self.first.tolist(), "exts": self.exts, "offsets": self.offsets.tolist(),
                "sizes": self.sizes.tolist()}
        return json.dumps({"format": INDEX_FORMAT, "version_of_format": INDEX_VERSION, "index": body,
                           "blake2b": _digest(body)}, separators=(",", ":")).encode()


def _digest(body: dict) -> str:
    return hashlib.blake2b(json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), digest_size=32,
                           person=b"zephon-wds").hexdigest()


def group_samples(members: Sequence[tuple[str, int, int]], size: int, where: str) -> ShardIndex:
    """Members into samples, by webdataset's rules (see the module docstring)."""
    keys: list[str] = []
    first: list[int] = []
    exts: list[str] = []
    offsets: list[int] = []
    sizes: list[int] = []
    seen: set[str] = set()
    for name, offset, msize in members:
        if ("/" not in name and name.startswith("__") and name.endswith("__")) or _META.match(name):
            continue
        match = _KEY_EXT.match(name)
        if not match:
            continue
        key, ext = match.group(1), match.group(2).lower()
        if not keys or key != keys[-1]:
            keys.append(key)
            first.append(len(exts))
            seen = set()
        if ext in seen:
            raise SourceError(f"{where}: member {name!r}: the extension '{ext}' appears twice in sample {key!r}")
        seen.add(ext)
        exts.append(ext)
        offsets.append(offset)
        sizes.append(msize)
    first.append(len(exts))
    return ShardIndex(size, keys, np.asarray(first, dtype=np.int64), exts, np.asarray(offsets, dtype=np.int64),
                      np.asarray(sizes, dtype=np.int64))


# -- sidecars --------------------------------------------------------------------------------------------
def _is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def index_from_json(raw: bytes, path: str, size: int, version: str) -> ShardIndex | None:
    """A sidecar's index, or None when it does not describe this shard's version or is not sound."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT or doc.get("version_of_format") != INDEX_VERSION:
        return None
    body = doc.get("index")
    if not isinstance(body, dict) or doc.get("blake2b") != _digest(body):
        return None
    if body.get("path") != path or body.get("size") != size or body.get("version") != version:
        return None
    keys, first, exts, offs, sizes = (body.get(k) for k in ("keys", "first", "exts", "offsets", "sizes"))
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys) and _is_int_list(first)
            and isinstance(exts, list) and all(isinstance(e, str) and e and "/" not in e for e in exts)
            and _is_int_list(offs) and _is_int_list(sizes)):
        return None
    m = len(exts)
    if len(first) != len(keys) + 1 or len(offs) != m or len(sizes) != m or first[0] != 0 or first[-1] != m:
        return None
    f, o, s = np.asarray(first, np.int64), np.asarray(offs, np.int64), np.asarray(sizes, np.int64)
    if (np.diff(f) <= 0).any() or (s < 0).any() or (o % BLOCK).any() or (o < BLOCK).any():
        return None
    if m and ((o[1:] < o[:-1] + s[:-1] + BLOCK).any() or int(o[-1] + s[-1]) > size):
        return None  # members overlap, are out of order, or run past the end of the shard
    return ShardIndex(size, keys, f, exts, o, s)


def _read_sidecar(folder: str, name: str) -> bytes | None:
    try:
        fd = os.open(os.path.join(folder, name), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size > MAX_SIDECAR_BYTES:
            return None
        with os.fdopen(fd, "rb") as f:
            fd = -1
            return f.read(MAX_SIDECAR_BYTES + 1)
    finally:
        if fd >= 0:
            os.close(fd)


def _write_sidecar(folder: str, name: str, data: bytes) -> None:
    """Written under a temporary name and renamed into place: a reader sees a whole sidecar or none."""
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, os.path.join(folder, name))
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass  # a cache that cannot be written costs a scan next time, nothing else


def _version(info: dict) -> str:
    for key in ("ETag", "etag", "generation", "version_id", "VersionId", "LastModified", "last_modified", "mtime",
                "updated"):
        if info.get(key):
            return str(info[key])
    return ""


class _PreadRaw(io.RawIOBase):
    """A descriptor read with ``os.pread`` from a position of its own: threads reading the same descriptor
    do not move each other's position (a ``dup`` shares it). The descriptor stays open on close."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd, self._pos = fd, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = os.pread(self._fd, len(buffer), self._pos)
        buffer[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos}.get(whence)
        self._pos = (os.fstat(self._fd).st_size if base is None else base) + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


def _pread_file(fd: int) -> io.BufferedReader:
    return io.BufferedReader(_PreadRaw(fd), buffer_size=1 << 16)


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    """``n`` bytes at ``offset``, fewer only at the end of the file: one ``pread`` returns at most ~2 GiB."""
    blob = os.pread(fd, n, offset)
    if len(blob) == n or not blob:
        return blob
    parts, got = [blob], len(blob)
    while got < n:
        more = os.pread(fd, n - got, offset + got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


# -- columns ---------------------------------------------------------------------------------------------
def parse_columns(columns: Sequence[str] | None) -> list[tuple[str, tuple[str, ...]]] | None:
    """``[(field, extensions)]`` for the column specs, or None for ``"*"`` (every member)."""
    if columns is None or tuple(columns) == ("*",):
        return None
    out = []
    for spec in columns:
        name, _, alts = spec.rpartition("=")
        exts = tuple(e.strip().lower() for e in alts.split(";"))
        if spec == "__key__":
            out.append((spec, ()))
            continue
        if spec == "*" or not all(exts) or name == "__key__":
            raise SourceError(f"read.webdataset(columns=...): {spec!r} is not an extension, 'a;b' alternatives, "
                              f"'name=a;b', '__key__', or '*' alone")
        out.append((name or exts[0], exts))
    return out


class WebDatasetReader(GroupedReader):
    """Reads samples of WebDataset tar shards (see the module docstring); coordinates are sample numbers."""

    def __init__(self, fs: fsspec.AbstractFileSystem, source: str, columns: Sequence[str] | None, chunk_rows: int,
                 doc_limit: DocLimit = DEFAULT_DOC_LIMIT, index_cache: str | None = None) -> None:
        self.fs, self.source, self.chunk_rows, self.doc_limit = fs, source, chunk_rows, doc_limit
        self.columns = parse_columns(columns)
        storage = getattr(fs, "storage", None)
        cache = index_cache or getattr(storage, "cache_dir", None)
        self.sidecars = os.path.join(cache, SIDECAR_FOLDER) if cache else None
        self.text_field = "__key__"
        # shards this reader reads through a descriptor opened after it was made: a shard rewritten in place
        # before then (which an open descriptor would not notice) is opened and indexed afresh
        self._since = _OPEN.mark()
        _OPEN.attach(self)  # the process's open shards are closed once no reader is left

    def __setstate__(self, state: dict) -> None:  # a copy in another process: that process's mark
        self.__dict__.update(state)
        self._since = _OPEN.mark()
        _OPEN.attach(self)

    # -- the index -------------------------------------------------------------------------------------
    def index(self, path: str) -> ShardIndex:
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            raise self._missing(path) from None
        size, version = int(info["size"]), _version(info)
        return _INDEXES.get((path, size, version), lambda: self._load(path, size, version))

    def _index_of_open(self, path: str, fd: int, st: os.stat_result) -> ShardIndex:
        """The index of the local shard open as ``fd``: keyed by that file's size and version (as
        :meth:`index` keys it by the path's), scanned from the descriptor itself if not known."""
        size, version = int(st.st_size), _version({"mtime": st.st_mtime})  # what fsspec's info() gives
        return _INDEXES.get((path, size, version), lambda: self._load(path, size, version, fd))

    def _load(self, path: str, size: int, version: str, fd: int = -1) -> ShardIndex:
        name = hashlib.sha256(f"{path}\n{size}\n{version}".encode()).hexdigest()[:40] + ".json"
        if self.sidecars:
            raw = _read_sidecar(self.sidecars, name)
            found = index_from_json(raw, path, size, version) if raw is not None else None
            if found is not None:
                return found
        where = f"source '{self.source}': shard {path}"
        with (_pread_file(fd) if fd >= 0 else self.fs.open(path, "rb")) as f:
            f.seek(0)
            index = group_samples(scan_members(f, size, where), size, where)
        if self.sidecars:
            _write_sidecar(self.sidecars, name, index.to_json(path, version))
        return index

    # -- planning --------------------------------------------------------------------------------------
    def group_starts(self, path: str) -> np.ndarray:
        """A shard is one group of samples: [0, samples]."""
        return np.asarray([0, len(self.index(path))], dtype=np.int64)

    # -- reading (on workers) --------------------------------------------------------------------------
    def _wanted(self, index: ShardIndex, start: int, end: int) -> tuple[list[str], list[np.ndarray]]:
        """The fields of samples [start, end) and, per field, the member each sample gives it (-1: none)."""
        first = index.first[start:end + 1]  # this chunk's samples only
        lo, n = int(first[0]), end - start
        if self.columns is None:
            exts = index.exts
            names: list[str] = list(dict.fromkeys(exts[lo:int(first[-1])]))
            bounds = first.tolist()
            picks = {name: np.full(n, -1, dtype=np.int64) for name in names}
            for i in range(n):
                for m in range(bounds[i], bounds[i + 1]):
                    picks[exts[m]][i] = m
            return names, [picks[name] for name in names]
        codes = index.ext_code[lo:int(first[-1])]
        sample_of = np.repeat(np.arange(n), np.diff(first))  # per member of the chunk
        out = []
        for _, alts in self.columns:
            col = np.full(n, -1, dtype=np.int64)
            for ext in alts:  # the first extension listed that the sample has wins
                code = index.ext_ids.get(ext)
                hits = np.flatnonzero(codes == code) if code is not None else ()
                if len(hits):
                    found = np.full(n, -1, dtype=np.int64)
                    np.maximum.at(found, sample_of[hits], lo + hits)  # a repeated extension: the last
                    col = np.where(col < 0, found, col)
            out.append(col)
        return [name for name, _ in self.columns], out

    def _lengths(self, path: str, index: ShardIndex, picks: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """The members to read (sorted) and how many bytes of each, after the ``[read] oversize`` policy."""
        # a Python sort: numpy's lets go of the GIL, and a worker thread then waits to get it back
        taken = sorted(set(np.concatenate(picks).tolist()) - {-1}) if picks else []
        members = np.asarray(taken, dtype=np.int64)
        sizes = index.sizes[members]
        limit = self.doc_limit
        over = sizes > limit.max_bytes
        if over.any():  # rare: each oversize member by the policy
            keep = np.ones(len(members), dtype=bool)
            for j in np.flatnonzero(over).tolist():
                m = int(members[j])
                if limit.policy == "error":
                    k = int(np.searchsorted(index.first, m, side="right")) - 1
                    raise limit.refuse(self.source, path, f"sample {index.keys[k]!r}",
                                       f"a member '{index.exts[m]}' of {int(sizes[j])} bytes")
                if limit.policy == "skip" or index.exts[m] not in TEXT_EXTENSIONS:
                    keep[j] = False
                else:
                    sizes[j] = limit.max_bytes + 1  # truncated later, at a character boundary
            members, sizes = members[keep], sizes[keep]
        return members, sizes

    def read(self, path: str, start: int, end: int) -> RawChunk:
        """Samples [start, end) of a shard. A local shard stays open between chunks (:data:`_OPEN`,
        :mod:`zephon.readers.open_files`): a chunk is then one ``pread``, no call that hands the GIL over."""
        if type(self.fs) is not LocalFileSystem:  # exactly fsspec's: a subclass may read its own way
            return self._read(path, self.index(path), start, end)
        try:
            with _OPEN.lease(path, self._index_of_open, self._since) as (fd, index):
                return self._read(path, index, start, end, fd)
        except FileNotFoundError as exc:
            if exc.filename != path:  # not the shard itself (e.g. an index sidecar's folder)
                raise
            raise self._missing(path) from None

    def _read(self, path: str, index: ShardIndex, start: int, end: int, fd: int = -1) -> RawChunk:
        end = len(index) if end < 0 else end
        names, picks = self._wanted(index, start, end)
        members, lengths = self._lengths(path, index, picks)
        data = self._fetch(path, index, members, lengths, fd)
        columns: dict[str, Any] = {}
        if self.columns is None:
            columns["__key__"] = index.keys[start:end]
        exts, keys, get = index.exts, index.keys, data.get
        alts = [alt for _, alt in self.columns] if self.columns is not None else [(name,) for name in names]
        for name, col, col_exts in zip(names, picks, alts):
            if name == "__key__" and self.columns is not None:
                columns[name] = keys[start:end]
                continue
            taken = col.tolist()
            values: list[Any] = [get(m) for m in taken]
            if any(e in TEXT_EXTENSIONS for e in col_exts):
                for i, m in enumerate(taken):
                    if values[i] is not None and exts[m] in TEXT_EXTENSIONS:
                        values[i] = self._text(values[i], path, keys[start + i], exts[m])
            columns[name] = values
        cursors = np.arange(start + 1, end + 1, dtype=np.int64)
        return RawChunk([], cursors, end, columns=columns)

    def _text(self, raw: bytes, path: str, key: str, ext: str) -> str:
        if len(raw) > self.doc_limit.max_bytes:
            return utf8_prefix(raw, self.doc_limit.max_bytes)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SourceError(f"source '{self.source}': {path}, sample {key!r}: the '{ext}' member is not UTF-8 "
                              f"text ({exc}). Re-encode it, or read it as bytes under another extension.") from None

    def _fetch(self, path: str, index: ShardIndex, members: np.ndarray, lengths: np.ndarray,
               fd: int = -1) -> dict[int, bytes]:
        """The members' bytes (``members`` sorted), read in as few ranged reads as the gaps allow: one per run
        of members with at most ``READ_GAP`` unwanted bytes between them from an object store (usually one a
        chunk), at most ``LOCAL_READ_GAP`` from a local shard (a tar header, not an unwanted image), through
        ``fd`` when the shard is open already.

        A local read starts at the first member's tar header, and the headers of each run's first and last
        member must give the sizes the index has: a shard rewritten in place while open (which its
        descriptor reads without notice) is an error, not other bytes under the old index."""
        if not len(members):
            return {}
        local = type(self.fs) is LocalFileSystem  # exactly fsspec's: a subclass may read its own way
        starts = index.offsets[members]
        reach = np.maximum.accumulate(starts + lengths)
        gap = LOCAL_READ_GAP if local else READ_GAP
        cuts = (np.flatnonzero(starts[1:] - reach[:-1] > gap) + 1).tolist()  # a new request after a gap
        spans = [(int(starts[a]), int(reach[b - 1]), a, b) for a, b in zip([0] + cuts, cuts + [len(members)])]
        out: dict[int, bytes] = {}
        own = local and fd < 0
        try:
            fd = os.open(path, os.O_RDONLY) if own else fd
        except FileNotFoundError:
            raise self._missing(path) from None
        try:
            for lo, hi, a, b in spans:
                # local: from the first member's header, to check it; but a large member alone in its read
                # is read exactly (its header apart), so that it is handed out without a copy
                alone = local and b - a == 1 and hi - lo > LARGE_MEMBER
                head = lo - BLOCK if local and not alone else lo
                try:  # one call (one GIL release) per span: many small reads would hand the GIL back and forth
                    blob = _pread_all(fd, hi - head, head) if local else self.fs.cat_file(path, start=lo, end=hi)
                except FileNotFoundError:
                    raise self._missing(path) from None
                if len(blob) != hi - head:
                    raise self._short(path, max(0, len(blob) - (lo - head)), lo, hi)
                if local:
                    headers, at = (os.pread(fd, BLOCK, lo - BLOCK), lo - BLOCK) if alone else (blob, head)
                    if not self._headers_agree(index, members[a], members[b - 1], headers, at):
                        self._check_layout(path, index, fd)
                if b - a == 1 and len(blob) == lengths[a]:
                    out[int(members[a])] = blob
                    continue
                for m, o, n in zip(members[a:b].tolist(), starts[a:b].tolist(), lengths[a:b].tolist()):
                    out[m] = blob[o - head:o - head + n]
        finally:
            if own:
                os.close(fd)
        return out

    @staticmethod
    def _headers_agree(index: ShardIndex, first: int, last: int, blob: bytes, head: int) -> bool:
        """Whether the tar headers of members ``first`` and ``last``, in ``blob`` (read from ``head``), give
        the sizes the index has for them."""
        for m in (first, last) if first != last else (first,):
            at = int(index.offsets[m]) - BLOCK - head
            try:
                if number_field(blob[at + 124:at + 136], "") != int(index.sizes[m]):
                    return False
            except SourceError:
                return False
        return True

    def _check_layout(self, path: str, index: ShardIndex, fd: int) -> None:
        """A member's header disagrees with the index: scan the open file's headers again, and refuse it
        unless they give the same samples where the index has them. (They do when a pax ``size`` record,
        which the index follows, differs from the header's own size field; such a shard is scanned once.)"""
        st = os.fstat(fd)
        seen = (st.st_size, st.st_mtime_ns)
        if _LAYOUT_CHECKED.get(index) == seen:  # scanned already, and the file has not changed since
            return
        where = f"source '{self.source}': shard {path}"
        why = "its tar headers no longer match the index made when it was opened"
        try:
            with _pread_file(fd) as f:  # other threads read through ``fd`` meanwhile: no shared position
                now = group_samples(scan_members(f, st.st_size, where), st.st_size, where)
            if now.same_layout(index):
                _LAYOUT_CHECKED[index] = seen
                return
        except SourceError as exc:
            why = f"it no longer reads as a tar file: {exc}"
        raise SourceError(f"{where} changed while it was being read ({why}): it was rewritten in place. A shard "
                          f"must not change during a run: write new shards under new names, or start a new run.")

    def _missing(self, path: str) -> SourceError:
        return SourceError(f"source '{self.source}': shard {path} is missing; it was listed when the run was "
                           f"planned. Restore it or start a new run.")

    def _short(self, path: str, got: int, lo: int, hi: int) -> SourceError:
        return SourceError(f"source '{self.source}': shard {path} is shorter than its index says (read "
                           f"{got} of bytes [{lo}, {hi})): it changed since it was indexed.")

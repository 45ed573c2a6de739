"""The reader contract: how a file format exposes units, chunk boundaries and records.

A *unit* is the thing the work plan routes to a lane (a file, a row group, a row or byte range).
A *chunk* is one stateless read+tokenize task inside a unit. Chunk boundaries are aligned to
absolute coordinates in the file (multiples of a chunk size inside a row group or file), never to
where a reader happened to start: a lane resumed mid-unit therefore sees the same chunk ends as the
uninterrupted lane did, and chunk ends are where positions are recorded.

Coordinates are the reader's own integers: row numbers for Parquet and compressed JSONL, byte
offsets for plain JSONL. A *cursor* is such a coordinate; each record reports the cursor just past
it, so the position after any record is exact.
"""

from __future__ import annotations

import collections.abc
import importlib
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from ..errors import SourceError


@dataclass(frozen=True)
class DocLimit:
    """The per-document size guard (``[read] max_doc_bytes`` and ``[read] oversize``).

    A document larger than ``max_bytes`` (UTF-8 bytes of its text; for JSON Lines, of its line, which
    is never shorter than its text) is skipped and counted with the null and blank records (``"skip"``),
    cut to ``max_bytes`` at a character boundary (``"truncate"``), or refused (``"error"``). It keeps one
    huge record from holding a lane up and from costing gigabytes to parse and tokenize.
    """

    max_bytes: int = 16 << 20
    policy: str = "skip"  # one of zephon.recipe.OVERSIZE_POLICIES

    def refuse(self, source: str, path: str, where: str, what: str) -> SourceError:
        """The error of the ``"error"`` policy; ``where`` says where the record is, ``what`` what is too big
        (``"a text of 70000000 bytes"``)."""
        return SourceError(f"source '{source}': {path}, {where}: {what} exceeds [read] "
                           f"max_doc_bytes = {self.max_bytes}. Raise [read] max_doc_bytes, set [read] oversize "
                           f"= \"skip\" (skip and count such records) or \"truncate\", or remove that record.")


DEFAULT_DOC_LIMIT = DocLimit()  # the recipe's defaults: [read] max_doc_bytes = 16 MiB, oversize = "skip"


def utf8_prefix(data: bytes, limit: int) -> str:
    """The longest prefix of the UTF-8 text ``data`` that has at most ``limit`` bytes and ends on a
    character boundary, decoded. ``data`` may stop after byte ``limit`` (the first byte not kept tells
    whether a character straddles the cut); lone surrogates, which JSON can hold, pass through."""
    cut = min(limit, len(data))
    while 0 < cut < len(data) and data[cut] & 0xC0 == 0x80:  # a continuation byte: the cut splits a character
        cut -= 1
    return bytes(data[:cut]).decode("utf-8", "surrogatepass")


def is_blank(text: str | None) -> bool:
    """Whether a record has no text worth a document: null, empty or whitespace only."""
    return not text or text.isspace()


def limit_text_column(col: Any, limit: DocLimit, source: str, path: str, first_row: int) -> list[str | None]:
    """A string column (pyarrow) as Python texts, with :class:`DocLimit` applied to each row.

    The UTF-8 lengths are measured in one vectorised call; an oversize row (null when skipped) is never
    turned into a Python string, and only such rows are handled one by one. ``first_row`` is the row
    number of ``col[0]`` in ``path``, for the error of the ``"error"`` policy."""
    import pyarrow as pa
    import pyarrow.compute as pc

    # the usual chunk: all its texts together are under the limit. Measured from the offsets, which keeps
    # the GIL: nbytes releases it, and a worker then waits for it (BENCHMARKS.md 4d); string views: nbytes
    width = np.int32 if col.type == pa.string() else np.int64 if col.type == pa.large_string() else None
    if width is None or not len(col):
        size = col.nbytes
    else:
        offsets = np.frombuffer(col.buffers()[1], dtype=width, count=col.offset + len(col) + 1)
        size = int(offsets[col.offset + len(col)] - offsets[col.offset])
    if size <= limit.max_bytes:
        return col.to_pylist()
    measured = col.cast(pa.large_string()) if pa.types.is_string_view(col.type) else col  # no kernel for views
    over = pc.fill_null(pc.greater(pc.binary_length(measured), limit.max_bytes), False)
    if not pc.any(over).as_py():
        return col.to_pylist()
    rows = np.flatnonzero(over.to_numpy(zero_copy_only=False)).tolist()
    if limit.policy == "error":
        row = rows[0]
        raise limit.refuse(source, path, f"row {first_row + row}", f"a text of {len(col[row].as_buffer())} bytes")
    texts: list[str | None] = []
    prev = 0
    for row in rows:
        texts += col.slice(prev, row - prev).to_pylist()
        texts.append(utf8_prefix(col[row].as_buffer().slice(0, limit.max_bytes + 1).to_pybytes(), limit.max_bytes)
                     if limit.policy == "truncate" else None)
        prev = row + 1
    return texts + col.slice(prev).to_pylist()


def path_not_found(origin: str, source: str, pattern: str) -> SourceError:
    """The error for a source path that names nothing (shared by every way of listing). ``origin`` is the
    pipeline's: a recipe file's path, ``"<dict>"`` for a recipe given as a dict, ``"<builder>"`` for a pipeline
    built in Python; what a relative path resolved against depends on it, and the message says which."""
    builder = origin in ("<builder>", "the pipeline")
    fix = "Fix the path given to zephon.read.<format>(...)" if builder else "Fix sources.path"
    if not builder and not origin.startswith("<"):  # a recipe file: its parser joined the path to its folder
        note = f" (relative paths resolve against the recipe's folder, {os.path.dirname(os.path.abspath(origin))})"
    elif "://" not in pattern and not os.path.isabs(pattern):
        note = f" (a relative path resolves against the current directory, {os.getcwd()})"
    else:
        note = ""
    return SourceError(f"{origin}: source '{source}': path '{pattern}' does not exist. {fix}{note}.")


@dataclass(frozen=True)
class Unit:
    """A contiguous part of one file of a source, in the reader's coordinates (``end=-1``: to EOF)."""

    file: int
    start: int
    end: int


class WholeFiles(collections.abc.Sequence):
    """The units ``[Unit(0, 0, -1), Unit(1, 0, -1), ..., Unit(n - 1, 0, -1)]`` (every file whole), made on
    demand: a plan of 100k files holds one integer instead of 100k objects, and a lane builds only the
    units it reads. Equal, element by element and in order, to that list."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [Unit(i, 0, -1) for i in range(*index.indices(self.n))]
        i = index.__index__()
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(f"unit {index} of {self.n}")
        return Unit(i, 0, -1)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, WholeFiles):
            return self.n == other.n
        return isinstance(other, Sequence) and not isinstance(other, (str, bytes)) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # like the list it stands for

    def __repr__(self) -> str:
        return f"WholeFiles({self.n})"

    def __reduce__(self) -> tuple:
        return WholeFiles, (self.n,)


@dataclass
class TokenRows:
    """Pre-tokenized records of a chunk: all rows' token ids as one flat array plus row offsets.

    Row ``k`` holds ``values[offsets[k]:offsets[k+1]]`` (ids as stored, without BOS/EOS). A null row has
    no values and ``valid[k] = False``; null and empty rows are skipped like null or blank texts.
    """

    values: np.ndarray  # integer [T]
    offsets: np.ndarray  # int64 [n+1], offsets[0] == 0
    valid: np.ndarray | None = None  # bool [n]; None: no null rows

    def __len__(self) -> int:
        return len(self.offsets) - 1


@dataclass
class RawChunk:
    """Records of one chunk: texts (None for a null or blank record) and the cursor after each.

    A pre-tokenized source (``tokens_field``) returns its rows in ``tokens`` and leaves ``texts`` empty;
    the worker then skips the tokenizer (see :mod:`zephon.pretokenized`)."""

    texts: list[str | None]
    next_cursors: np.ndarray  # int64 [n]
    end_cursor: int  # cursor just past the chunk (resolves end=-1)
    tokens: TokenRows | None = None  # pre-tokenized sources only
    # A source read with several columns (``columns=``): each column's values, one per record (lists, or
    # TokenRows for token-id columns); ``texts`` and ``tokens`` are then unused.
    columns: dict[str, Any] | None = None
    # where the chunk's first record starts, if not at the chunk's start (plain JSON Lines: a chunk owns the
    # lines that start in it, the first after the first newline); each later one starts where the one before
    # ended. For provenance (zephon.origins).
    first: int | None = None


class Reader(Protocol):
    """What a format must provide to the work plan and to the workers."""

    def split_units(self, files: Sequence[str], lanes: int) -> list[Unit]: ...

    def chunk_bounds(self, path: str, unit: Unit, cursor: int) -> list[tuple[int, int]]: ...

    def read(self, path: str, start: int, end: int) -> RawChunk: ...


class LRU:
    """A tiny thread-safe cache (per process) for file metadata and decoded row groups.

    Bounded by entry count and, when ``size_of`` is given, by total size (``max_size``): lanes read
    a row group chunk by chunk, so the decoded column stays cached while they do, but a working set
    larger than the budget only costs re-reads, never memory. Caching never changes what is read.

    Eviction is least-recently-used, behind a frequency check on admission: the lanes of one process take
    turns, so when their working set (a row group each) is larger than the budget, plain LRU evicts every
    entry just before its next use and nothing is ever a hit. A newcomer therefore replaces the least recently
    used entry only if it has been asked for more often lately (counts halve every ``4 x capacity`` requests,
    so an entry no longer used, e.g. a row group its lane has finished, soon loses to one in use); otherwise
    it is returned uncached. With lanes taking turns the cache then keeps as many of them as fit.
    """

    def __init__(self, capacity: int, max_size: int | None = None,
                 size_of: Callable[[Any], int] | None = None) -> None:
        self._cap = capacity
        self._max_size, self._size_of = max_size, size_of
        self._size = 0
        self._data: OrderedDict[Any, Any] = OrderedDict()
        self._freq: dict[Any, int] = {}  # recent requests per key, cached or not
        self._requests = 0
        self._lock = threading.Lock()

    def _full(self, size: int) -> bool:
        return len(self._data) >= self._cap or (
            self._max_size is not None and self._size + size > self._max_size)

    def _count(self, key: Any) -> None:
        self._freq[key] = self._freq.get(key, 0) + 1
        self._requests += 1
        if self._requests >= 4 * self._cap:  # age the counts: recent use is what matters
            self._requests = 0
            self._freq = {k: n // 2 for k, n in self._freq.items() if n > 1}

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        with self._lock:
            self._count(key)
            if key in self._data:
                self._data.move_to_end(key)
                return self._data[key]
        value = make()
        size = self._size_of(value) if self._size_of else 0
        with self._lock:
            if key in self._data:  # another thread made it meanwhile
                return self._data[key]
            while self._data and self._full(size):
                oldest = next(iter(self._data))
                if self._freq.get(oldest, 0) >= self._freq.get(key, 0):  # the incumbent is in use as much
                    return value
                evicted = self._data.pop(oldest)
                self._size -= self._size_of(evicted) if self._size_of else 0
            self._data[key] = value
            self._size += size
        return value


def aligned_cuts(lo: int, hi: int, origin: int, step: int) -> list[tuple[int, int]]:
    """Split [lo, hi) at origin + k*step (k integer): the chunk ends do not depend on ``lo``."""
    if lo >= hi:
        return []
    first = origin + ((lo - origin) // step + 1) * step  # the first aligned cut after lo
    edges = [lo, *range(first, hi, step), hi]
    return list(zip(edges[:-1], edges[1:]))


def split_evenly(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """Cut [lo, hi) into ``parts`` near-equal non-empty ranges (fewer if the range is shorter)."""
    parts = max(1, min(parts, hi - lo))
    edges = [lo + (hi - lo) * k // parts for k in range(parts + 1)]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def units_of_groups(files: Sequence[str], lanes: int, group_starts: Callable[[str], np.ndarray]) -> list[Unit]:
    """Units for a format whose files are made of row groups (Parquet row groups, Vortex splits).

    Whole files when there are at least as many files as lanes (no metadata read); else the groups,
    cut further into row ranges when even those are fewer than the lanes. ``group_starts(path)``
    returns the cumulative row offsets ``[0, n0, n0+n1, ..., total]``.
    """
    if len(files) >= lanes:
        return WholeFiles(len(files))
    groups = []
    for i, path in enumerate(files):
        starts = group_starts(path)
        groups += [(i, int(a), int(b)) for a, b in zip(starts[:-1], starts[1:]) if b > a]
    parts = max(1, math.ceil(lanes / max(1, len(groups))))
    return [Unit(i, a, b) for i, lo, hi in groups for a, b in split_evenly(lo, hi, parts)]


def chunks_in_groups(starts: np.ndarray, unit: Unit, cursor: int, chunk_rows: int) -> list[tuple[int, int]]:
    """Chunk bounds of ``unit`` from ``cursor``: never across a group, aligned to each group's start."""
    lo = unit.start if cursor < 0 else cursor
    hi = int(starts[-1]) if unit.end < 0 else unit.end
    out: list[tuple[int, int]] = []
    for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
        if b <= lo or a >= hi:
            continue
        out += aligned_cuts(max(lo, a), min(hi, b), a, chunk_rows)
    return out


def row_starts(sizes: Sequence[int]) -> np.ndarray:
    """Cumulative row offsets ``[0, n0, n0+n1, ..., total]`` of groups of ``sizes`` rows."""
    return np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))]).astype(np.int64)


class GroupedReader:
    """Planning for a reader whose files are made of groups of rows (row groups, record batches, splits):
    :meth:`group_starts` gives the units (:func:`units_of_groups`) and the chunks (:func:`chunks_in_groups`)."""

    chunk_rows: int

    def group_starts(self, path: str) -> np.ndarray:
        """Row offsets of the groups of ``path``: [0, n0, n0+n1, ..., rows]."""
        raise NotImplementedError

    def split_units(self, files: Sequence[str], lanes: int) -> list[Unit]:
        return units_of_groups(files, lanes, self.group_starts)

    def chunk_bounds(self, path: str, unit: Unit, cursor: int) -> list[tuple[int, int]]:
        return chunks_in_groups(self.group_starts(path), unit, cursor, self.chunk_rows)

    def group_of(self, path: str, start: int, end: int, word: str = "group") -> tuple[np.ndarray, int, int]:
        """The group starts of ``path``, the group chunk [start, end) is in and its end (``end=-1``: the
        group's end); a chunk never crosses a group (``word``: what the format calls one, for the message)."""
        starts = self.group_starts(path)
        group = int(np.searchsorted(starts, start, side="right") - 1)
        if end < 0:
            end = int(starts[group + 1])
        if end > starts[group + 1]:
            raise AssertionError(f"chunk [{start}, {end}) crosses a {word} of {path}")
        return starts, group, end


def is_local(fs: Any) -> bool:
    """Whether ``fs`` is the local filesystem (its files can be opened by path or memory-mapped)."""
    protocol = getattr(fs, "protocol", "file")
    return "file" in (protocol if isinstance(protocol, tuple) else (protocol,))


def optional_import(module: str, source: str, fmt: str, package: str, extra: str) -> Any:
    """``module``, from the optional ``package`` that format ``fmt`` needs; if it is missing, an error that says
    how to install it (the ``extra`` of a Zephon checkout)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise SourceError(f"source '{source}': format '{fmt}' needs the {package} package (python -m pip install "
                          f"-e '.[{extra}]', run from a Zephon checkout): {exc}") from exc


def native_failure(exc: BaseException) -> bool:
    """Errors of a native reader library: exceptions, and Rust panics (pyo3's PanicException is a
    BaseException), which a corrupt file can raise and which must become a SourceError, not end the process."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"


def first_line(exc: BaseException) -> str:
    """The first line of a native library's error message (Rust errors carry long backtraces)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__

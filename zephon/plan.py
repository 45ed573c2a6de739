"""The work plan: which unit of which source each lane reads, in closed form.

Per source, files are listed and sorted, and the reader cuts them into units (files, row groups or
row/byte ranges; see :mod:`zephon.readers`). The source then behaves like an endless stream of
units made of passes: pass ``p`` visits all ``U`` units in the order of a keyed permutation
``order_p`` (a new order every pass, so repetition is never in lockstep). The stream is dealt to the
``L`` lanes block by block: block ``i`` holds stream positions ``[i*L, (i+1)*L)`` and lane ``l``
receives position ``i*L + route_i(l)``, where ``route_i`` is a keyed permutation of the lanes.
So every lane gets exactly one unit per block, blocks run across pass boundaries, and a lane's
``i``-th unit is a pure function of (seed, source, lane, i) computed in O(1), without enumerating
other lanes' units. Worked example, ``U = 3`` units, ``L = 2`` lanes::

    stream   = order_0[0], order_0[1], order_0[2], order_1[0], order_1[1], ...
    block 0  = stream[0:2] -> lane route_0^-1 ... each lane takes one
    block 1  = stream[2:4] -> spans the end of pass 0 and the start of pass 1
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ._perm import inverse_index, mix64, permute_index, stable_key
from .read import ReadSpec
from .readers import INDEXED_READERS, Reader, SELF_LISTED, Unit, list_own_files, make_reader
from .errors import SourceError
from .origins import pattern_root, relative_file, source_root
from .readers import hf as hf_folders
from .readers.base import RawChunk, is_blank, path_not_found
from .specs import StorageSpec
from .storage import url_to_fs

_ROUTE, _ORDER = 1, 2
# The start-up check that a source holds text (SourcePlan.check_has_text) reads at most this many records
# and units: a source whose first PROBE_RECORDS records are all null, empty or blank is refused.
PROBE_RECORDS = 4096
PROBE_UNITS = 64
_EXTENSIONS = {
    "parquet": (".parquet", ".pq"),
    "jsonl": (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.zstd", ".ndjson"),
    "vortex": (".vortex", ".vtx"),
    "mds": ("index.json",),  # MDS and LitData: the shards named by the index.json files found
    "litdata": ("index.json",),
    "arrow": (".arrow", ".arrows", ".feather", ".ipc"),  # Arrow IPC, file or stream format
    "hf": hf_folders.DATA_EXTENSIONS,  # the data files of a datasets folder (zephon/readers/hf.py)
    "lance": (),  # Lance datasets and in-memory tables list their own "files" (SELF_LISTED)
    "memory": (),
    "webdataset": (".tar",),  # tar shards (zephon/readers/webdataset.py)
}


@dataclass(frozen=True)
class ChunkTask:
    """One stateless read task: rows/bytes [start, end) of one file of one source."""

    source: int
    path: str
    start: int
    end: int
    unit_seq: int  # index of the unit in the lane's sequence for this source
    unit_end: bool  # last chunk of its unit
    empty: bool = False  # a unit with nothing in it (e.g. an empty file)
    skip: int = 0  # records the stateless operators make from ``start`` that a resumed lane already took


@dataclass(frozen=True)
class PlannedSource:
    """A named source as the plan and the readers see it: its name and how to read it."""

    name: str
    read: ReadSpec
    passes: int | None = None  # stop after this many passes (None: repeat)

    @property
    def format(self) -> str:
        return self.read.format

    @property
    def path(self) -> tuple[str, ...]:
        return self.read.path

    @property
    def text_field(self) -> str:
        return self.read.text_field

    @property
    def tokens_field(self) -> str | None:
        return self.read.tokens_field

    @property
    def storage_options(self) -> dict | None:
        return self.read.storage_options


@dataclass(frozen=True)
class ReaderFactory:
    """Builds a source's reader in the process that needs it (a worker), without listing the files:
    picklable, unlike the reader and its caches."""

    source: PlannedSource
    storage: StorageSpec | None

    def __call__(self) -> Reader:
        if self.source.format in SELF_LISTED:  # Lance reads stores with its own client; memory has no files
            return make_reader(self.source.name, self.source.read, fsspec.filesystem("file"))
        fs, _ = url_to_fs(self.source.path[0], self.source, self.storage)
        return make_reader(self.source.name, self.source.read, fs)


def list_files(source: PlannedSource, origin: str = "the pipeline",
               storage: StorageSpec | None = None) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """Expand a source's paths (files, directories, globs) into a sorted, de-duplicated file list.

    Object-store URLs (s3://, gs://, az://...) go through :func:`zephon.storage.url_to_fs`: a retrying
    filesystem built from the source's storage_options, whose listings are full URLs."""
    if source.format in SELF_LISTED:  # Lance fragments, an in-memory table: listed by the format (readers/)
        return fsspec.filesystem("file"), list_own_files(source.name, source.read, origin)
    exts = _EXTENSIONS[source.format]
    fs = None
    found: set[str] = set()
    for pattern in source.path:
        fs_i, root = url_to_fs(pattern, source, storage)  # local: fsspec as is; object stores: zephon.storage
        fs = fs or fs_i
        if source.format in INDEXED_READERS:  # shards listed from index.json (zephon/readers/indexed.py)
            matches = INDEXED_READERS[source.format].list_shards(fs_i, root, source.name, pattern, origin)
        elif source.format == "hf":  # a datasets folder: its split's files (zephon/readers/hf.py)
            matches = hf_folders.list_files(fs_i, root, source.name, pattern, origin, source.read.split,
                                            source.read.config)
        elif any(c in root for c in "*?["):
            matches = [p for p in fs_i.glob(root) if fs_i.isfile(p)]
        elif fs_i.isdir(root):
            matches = [p for p in find_files(fs_i, root) if p.endswith(exts)]
        elif fs_i.isfile(root):
            matches = [root]
        else:
            raise path_not_found(origin, source.name, pattern)
        if not matches:
            raise SourceError(f"{origin}: source '{source.name}': path '{pattern}' matches no "
                              f"{source.format} files (looked for {', '.join(exts)}).")
        found.update(matches)
    assert fs is not None
    return fs, sorted(found)


def find_files(fs: Any, root: str) -> list[str]:
    """``fs.find(root)``: every file below the directory ``root``, sorted, as the filesystem names them.

    On the local filesystem (POSIX) the same list without fsspec's ``stat`` and info dict per file: one
    ``os.scandir`` per directory, whose entries already say whether they are directories, so listing
    100k files costs a few hundred milliseconds instead of seconds. fsspec's rules are kept exactly:
    directories are entered unless they are symbolic links (a link is listed like a file), names are
    ``fs._strip_protocol(entry.path)``, and a directory that cannot be read is skipped. Object stores
    list with one paginated call per prefix already (:meth:`zephon.storage.RetryingFileSystem.find`)."""
    if type(fs) is not LocalFileSystem or os.sep != "/":  # a subclass may list differently
        return fs.find(root)
    found: list[str] = []
    # _strip_protocol makes the root absolute, without a trailing "/" (unless it is "/"); an entry's path is
    # then that folder, "/" and a name without "/": what _strip_protocol(entry.path) would return
    pending = [fs._strip_protocol(root)]
    while pending:
        folder = pending.pop()
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    try:
                        is_dir = entry.is_dir(follow_symlinks=False)
                    except OSError:  # vanished or unreadable: fsspec skips it too
                        continue
                    (pending if is_dir else found).append(entry.path)
        except OSError:  # fsspec's walk omits a directory it cannot list
            continue
    return sorted(found)


def name_some(paths: list[str], most: int = 3) -> str:
    """``"a, b, c and 7 more"``: the first ``most`` of ``paths``, for messages."""
    shown = ", ".join(paths[:most])
    return shown + (f" and {len(paths) - most} more" if len(paths) > most else "")


class SourcePlan:
    """A source's files and units, and the closed-form routing of its units to lanes."""

    def __init__(self, index: int, spec: PlannedSource, lanes: int, seed: int, storage: StorageSpec | None = None,
                 origin: str = "the pipeline") -> None:
        self.index = index
        self.spec = spec
        self.storage = storage
        self.key = stable_key(spec.name)
        self.fs, self.files = list_files(spec, origin, storage)
        self.reader: Reader = make_reader(spec.name, spec.read, self.fs)
        self.units: list[Unit] = self.reader.split_units(self.files, lanes)
        if not self.units:
            files = self.files
            which = f"its only file {files[0]} is" if len(files) == 1 else \
                f"all its {len(files)} files ({name_some(files)}) are"
            raise SourceError(f"{origin}: source '{spec.name}' has no data: {which} empty (no {spec.format} "
                              f"records). Check the source's path or glob (does it match the files you meant?), "
                              f"remove the empty {'file' if len(files) == 1 else 'files'} or put data in, or remove "
                              f"the source.")
        self.seed = seed
        self.lanes = lanes
        self.origin = origin

    def file_columns(self) -> tuple[str, list[str]] | None:
        """``(file, columns)`` of the source's first file (``file`` as messages name it), where its format
        declares them up front (a Parquet footer, an Arrow schema, Lance or Hugging Face metadata, an in-memory
        table), so that a missing field is refused when the pipeline is built rather than at the first batch.

        None where the format has no schema to read: a JSON Lines file's first record says nothing of the
        others (fields may be absent or null record by record), WebDataset samples and MDS/LitData/Vortex
        shards are checked by the lane that reads them. Only the first file is read (one footer, whatever
        the number of files); a later file that lacks a column is still refused by the lane that reads it,
        and so is a file that cannot be opened (not this check's to report)."""
        names = getattr(self.reader, "column_names", None)
        if names is None or not self.files:
            return None
        path = self.files[0]
        where = getattr(self.reader, "where", None)  # a Lance fragment is named by its dataset and number
        try:
            return (where(path) if callable(where) else path), list(names(path))
        except Exception:  # noqa: BLE001 - an unreadable file is the lane's to report (see above)
            return None

    @functools.cached_property
    def root(self) -> str:
        """The folder provenance names this source's files relative to (:func:`zephon.origins.source_root`)."""
        if self.spec.format in SELF_LISTED:
            return source_root([pattern_root(p, True) for p in self.spec.path])
        roots = []
        for pattern in self.spec.path:
            fs_i, path = url_to_fs(pattern, self.spec, self.storage)
            globbed = any(c in path for c in "*?[")
            roots.append(pattern_root(path, not globbed and fs_i.isdir(path)))
        return source_root(roots)

    def relative(self, path: str) -> str:
        """``path`` (one of :attr:`files`) relative to :attr:`root`."""
        return relative_file(path, self.root)

    def check_has_text(self) -> None:
        """Refuse a source without text now, rather than let every lane give up on it after some steps.

        Reads the units in the plan's order (the files' order, the same for every rank, lane and run),
        chunk by chunk, until a record that is not null, empty or whitespace only: one chunk for a usual
        source. Fails when every unit has been read without one, or when the first
        :data:`PROBE_RECORDS` records are all blank; a source that merely starts with blank records
        passes. It reads raw records (before ``text_map``/``text_filter``, which the mixer still checks)
        and changes nothing that a lane reads. A read error is left to the lane that meets it, which
        reports it as it always has."""
        records = units = 0
        for unit in self.units[:PROBE_UNITS]:
            path = self.files[unit.file]
            try:
                for start, end in self.reader.chunk_bounds(path, unit, -1):
                    raw = self.reader.read(path, start, end)
                    if _has_text(raw):
                        return
                    records += len(raw.next_cursors)
                    if records >= PROBE_RECORDS:
                        break
            except Exception:  # noqa: BLE001 - not this check's to report (see the docstring)
                return
            units += 1
            if records >= PROBE_RECORDS:
                break
        blank = "null, empty or whitespace only"
        if records >= PROBE_RECORDS:
            what = (f"its first {records} records (in {units} of its {len(self.units)} units, from "
                    f"{self.files[self.units[0].file]}) are all {blank}")
        elif units < len(self.units):
            return  # PROBE_UNITS units with few records (empty files, say): inconclusive, the lanes will tell
        elif records:
            what = f"all {records} records of its {len(self.units)} units ({len(self.files)} files) are {blank}"
        else:
            what = f"its {len(self.units)} units ({len(self.files)} files) hold no records"
        field = f"tokens_field '{self.spec.tokens_field}'" if self.spec.tokens_field else \
            f"text_field '{self.spec.text_field}'"
        raise SourceError(f"{self.origin}: source '{self.spec.name}' has no text: {what}. Check the source's "
                          f"{field} and path, or remove the source (a source may start with at most "
                          f"{PROBE_RECORDS - 1} blank records: move them later).")

    def relative_files(self) -> list[str]:
        # Object-store files are URLs: drop the scheme, so that the same files under another root (local
        # disk, another bucket or store) have the same relative names, hence the same fingerprint.
        files = self.files
        return relative_names([f.split("://", 1)[-1] for f in files] if "://" in "\0".join(files) else list(files))

    def stream_position(self, lane: int, i: int) -> int:
        """Position in the endless unit stream of the ``i``-th unit of ``lane``."""
        return i * self.lanes + permute_index(lane, self.lanes, mix64(self.seed, self.key, _ROUTE, i))

    def unit_at(self, position: int) -> Unit:
        n = len(self.units)
        pass_no, g = divmod(position, n)
        return self.units[permute_index(g, n, mix64(self.seed, self.key, _ORDER, pass_no))]

    def lane_unit(self, lane: int, i: int) -> Unit:
        """The ``i``-th unit (0-based) that ``lane`` reads from this source."""
        return self.unit_at(self.stream_position(lane, i))

    def where_read(self, unit: int, pass_no: int) -> tuple[int, int]:
        """Which lane reads unit ``self.units[unit]`` in pass ``pass_no`` (0-based), and as its how-manyth unit:
        ``(lane, i)`` with ``lane_unit(lane, i) is self.units[unit]``. Closed form (the inverses of
        :meth:`unit_at` and :meth:`stream_position`), for :func:`zephon.locate`."""
        n = len(self.units)
        position = pass_no * n + inverse_index(unit, n, mix64(self.seed, self.key, _ORDER, pass_no))
        i, slot = divmod(position, self.lanes)
        return inverse_index(slot, self.lanes, mix64(self.seed, self.key, _ROUTE, i)), i

    def unit_of(self, path: str, cursor: int) -> int:
        """The index in :attr:`units` of the unit of file ``path`` that holds reader cursor ``cursor`` (-1: none)."""
        try:
            f = self.files.index(path)
        except ValueError:
            return -1
        for k, unit in enumerate(self.units):
            if unit.file == f and unit.start <= cursor and (unit.end < 0 or cursor < unit.end):
                return k
        return -1

    def lane_units(self, lane: int, passes: int) -> int:
        """How many units ``lane`` reads when the source stops after ``passes`` passes: its units whose
        stream positions fall before ``passes * U`` (every unit of those passes is read by exactly one
        lane, once per pass)."""
        end = passes * len(self.units)
        full = end // self.lanes  # whole blocks: one unit each
        return full + (1 if full * self.lanes < end and self.stream_position(lane, full) < end else 0)

    def chunk_tasks(self, lane: int, unit_seq: int, cursor: int, skip: int = 0) -> Iterator[ChunkTask]:
        """Chunk tasks of ``lane`` from unit ``unit_seq``, starting at ``cursor`` (-1: unit start), the first
        ``skip`` records made from there already taken: endless, or ending after the source's ``passes``."""
        i = unit_seq
        passes = self.spec.passes
        stop = self.lane_units(lane, passes) if passes is not None else None
        while stop is None or i < stop:
            unit = self.lane_unit(lane, i)
            path = self.files[unit.file]
            bounds = self.reader.chunk_bounds(path, unit, cursor)
            if not bounds:
                yield ChunkTask(self.index, path, 0, 0, i, True, empty=True, skip=skip)
            for k, (a, b) in enumerate(bounds):
                yield ChunkTask(self.index, path, a, b, i, k == len(bounds) - 1, skip=skip if k == 0 else 0)
            i += 1
            cursor, skip = -1, 0


class WorkPlan:
    """All sources of a pipeline, planned once per process and shared by the lanes it hosts.

    ``WorkPlan(pipeline)``; the files are listed and the units cut here, once.

    Args:
        pipeline: a :class:`~zephon.Pipeline` (its seed, lanes, storage options and sources).

    Raises:
        TypeError: ``pipeline`` is not a pipeline (a recipe: ``recipe.to_pipeline()``).
        SourceError: a source's files cannot be listed, or it has none.
    """

    def __init__(self, pipeline: Any) -> None:
        pipe = pipeline
        if not hasattr(pipe, "ops") or not hasattr(pipe, "lanes"):
            raise TypeError(f"WorkPlan takes a zephon.Pipeline, got {pipeline!r} (a recipe: recipe.to_pipeline())")
        self.lanes, self.seed = pipe.lanes, pipe.seed
        self.sources: list[SourcePlan] = [
            SourcePlan(i, PlannedSource(d.name, d.read, d.passes), pipe.lanes, pipe.seed, pipe.storage, pipe.origin)
            for i, d in enumerate(pipe.sources)]
        """Each source's plan (its sorted files and units), in declaration order."""
        self._checked = False  # check_sources_have_text done

    def check_sources_have_text(self) -> None:
        """:meth:`SourcePlan.check_has_text` for every source, once per plan (loaders may share one)."""
        if not self._checked:
            for source in self.sources:
                source.check_has_text()
            self._checked = True


# Parts of a path that os.path.commonpath or os.path.relpath would not take as they are: an empty part, "." or
# "..", at the start ("\0" before), inside or at the end ("\0" after) of a path (paths joined by "\0").
_NOT_PLAIN = ("//", "/./", "/../", "\0./", "\0../", "/.\0", "/..\0", "/\0", "\0.\0", "\0..\0", "\0\0")


def relative_names(files: list[str]) -> list[str]:
    """``[os.path.relpath(f, root) for f in files]`` where ``root`` is ``os.path.commonpath(files)`` (the folder
    of a single file): the names the fingerprint hashes, the same under any root.

    Both functions cost microseconds a path (100k files: seconds, on every rank). When every path is made of
    plain parts (no empty, ``.`` or ``..`` part; all absolute or all relative), the common path is the
    longest common string prefix of the smallest and the largest path, cut back to a ``/`` unless every path
    continues there with one or ends, and each name is what follows it: string operations in C. Any other
    list goes through ``os.path`` as before (tests/test_scale.py compares the two on random lists)."""
    if len(files) < 2 or os.sep != "/":
        root = os.path.commonpath(files) if len(files) > 1 else (os.path.dirname(files[0]) or ".")
        return [os.path.relpath(f, root) for f in files]
    joined = "\0" + "\0".join(files) + "\0"
    absolute = joined.count("\0/")
    if "\0" in "".join(files) or absolute not in (0, len(files)) or any(bad in joined for bad in _NOT_PLAIN):
        root = os.path.commonpath(files)
        return [os.path.relpath(f, root) for f in files]
    common = os.path.commonprefix([min(files), max(files)])  # every path starts with it
    n = len(common)
    if not all(len(f) == n or f[n] == "/" for f in files):
        n = max(common.rfind("/"), 0)  # back to the last whole part ("/a/b/c" and "/a/b/d": "/a/b")
    root = common[:n] or ("/" if absolute else "")
    if not root:  # relative paths without a common first part: os.path.relpath refuses them, as before
        return [os.path.relpath(f, root) for f in files]
    cut = len(root) + (root != "/")
    return [f[cut:] or "." for f in files]


def _has_text(raw: RawChunk) -> bool:
    """Whether a chunk holds a record that would make a document (text, or token ids, not blank; with
    several columns: a record with a value that is not null or blank)."""
    if raw.columns:
        return any(not (v is None or (isinstance(v, str) and is_blank(v)))
                   for col in raw.columns.values() for v in (col if isinstance(col, list) else [1]))
    if raw.tokens is None:
        return not all(is_blank(t) for t in raw.texts)
    rows = raw.tokens
    lengths = rows.offsets[1:] - rows.offsets[:-1]
    return bool(((lengths > 0) & rows.valid).any() if rows.valid is not None else (lengths > 0).any())

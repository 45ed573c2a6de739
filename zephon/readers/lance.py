"""Lance datasets (``format = "lance"``), read with ``pylance``: fragments are the files, rows by random access.

A source's ``path`` names Lance datasets (folders with a ``_versions/`` folder): one dataset, a local
folder of datasets, or a local glob of them; an object-store URL (``s3://``, ``gs://``, ``az://``) must
name the dataset itself. Each fragment of each dataset (at its latest version when the run is planned)
is one "file" of the source, named ``<dataset>#fragment=<id>``, in (dataset, fragment id) order; its
row count comes from the manifest (the fragment's physical rows less its deleted rows), so planning
reads no data. A fragment is one group of rows (:mod:`zephon.readers.columnar`): whole fragments are the
units when there are at least as many as lanes, else row ranges of fragments, and chunks are aligned to
multiples of ``chunk_rows`` from a fragment's start, like a Parquet file with one row group. A chunk is
read with one ``LanceFragment.take`` of its rows (Lance's random access; deleted rows are skipped by
Lance, so row numbers count the live rows), all the source's columns at once.

Object stores: Lance reads them with its own client, not fsspec, so ``[storage]`` (retries, the block
cache) does not apply, and a source's ``storage_options`` are handed to Lance. Lance's own option names
pass as they are (``aws_access_key_id``, ``aws_endpoint``, ``aws_region``, ``allow_http``,
``google_service_account``, ``account_name``...); for ``s3://`` the s3fs spellings ``key``, ``secret``,
``token``, ``endpoint_url``, ``anon`` and ``client_kwargs = {region_name, endpoint_url}`` are
translated. Needs the ``pylance`` package (from a Zephon checkout: ``python -m pip install -e '.[lance]'``).

Untrusted input: a dataset is decoded by Lance's native (Rust) code into Arrow arrays, which Zephon
validates in full before reading a value; nothing is ever unpickled from it.
"""

from __future__ import annotations

import glob
import os
import threading
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from .base import DEFAULT_DOC_LIMIT, DocLimit, LRU, first_line, native_failure, optional_import, path_not_found
from ..errors import SourceError
from .columnar import ColumnarReader, combined

_MARK = "#fragment="
# s3fs's option names and Lance's (object_store's) for the same thing.
_S3FS_NAMES = {"key": "aws_access_key_id", "secret": "aws_secret_access_key", "token": "aws_session_token"}


def fragment_path(uri: str, fragment_id: int) -> str:
    return f"{uri}{_MARK}{fragment_id}"


def split_fragment_path(path: str) -> tuple[str, int]:
    uri, _, fid = path.rpartition(_MARK)
    return uri, int(fid)


def storage_options_for_lance(options: Mapping[str, Any] | None, uri: str, source: str) -> dict[str, str] | None:
    """A source's ``storage_options`` as Lance takes them (strings; s3fs spellings translated for ``s3://``)."""
    if not options:
        return None
    from ..storage.filesystem import expand_env  # zephon.storage imports the readers: import it late

    opts = expand_env(dict(options), source)
    s3 = uri.split("://", 1)[0].lower() in ("s3", "s3a") if "://" in uri else False
    out: dict[str, str] = {}

    def endpoint(value: Any) -> None:
        out["aws_endpoint"] = str(value)
        if str(value).startswith("http://"):
            out.setdefault("allow_http", "true")

    for key, value in opts.items():
        if s3 and key == "client_kwargs" and isinstance(value, Mapping):
            for k, v in value.items():
                if k == "region_name":
                    out["aws_region"] = str(v)
                elif k == "endpoint_url":
                    endpoint(v)
                else:
                    raise SourceError(f"source '{source}': storage_options.client_kwargs.{k} has no Lance equivalent "
                                      f"(Lance reads object stores with its own client; it takes region_name and "
                                      f"endpoint_url here). Use Lance's option names for the rest.")
        elif s3 and key in _S3FS_NAMES:
            out[_S3FS_NAMES[key]] = str(value)
        elif s3 and key == "endpoint_url":
            endpoint(value)
        elif s3 and key == "anon":
            if value:
                out["aws_skip_signature"] = "true"
        elif isinstance(value, bool):
            out[key] = "true" if value else "false"
        elif isinstance(value, (str, int, float)):
            out[key] = str(value)
        else:
            raise SourceError(f"source '{source}': storage_options.{key} = {value!r}: Lance takes strings, numbers "
                              f"and booleans (Lance reads object stores with its own client and its own option "
                              f"names: aws_access_key_id, aws_endpoint, google_service_account, account_name...).")
    return out


def _datasets(pattern: str, source: str, origin: str) -> list[str]:
    """The Lance datasets a ``path`` entry names (see the module docstring)."""
    if "://" in pattern:  # an object store: Lance opens it itself; there is no listing to do
        if any(c in pattern for c in "*?["):
            raise SourceError(f"{origin}: source '{source}': path '{pattern}': globs of Lance datasets work on local "
                              f"disk only; in an object store name each dataset (a list of paths).")
        return [pattern.rstrip("/")]

    def is_dataset(p: str) -> bool:
        return os.path.isdir(os.path.join(p, "_versions"))

    if any(c in pattern for c in "*?["):
        found = [p for p in sorted(glob.glob(pattern)) if is_dataset(p)]
    elif not os.path.exists(pattern):
        raise path_not_found(origin, source, pattern)
    elif is_dataset(pattern):
        found = [pattern]
    elif os.path.isdir(pattern):
        found = [p for p in sorted(os.path.join(pattern, n) for n in os.listdir(pattern)) if is_dataset(p)]
    else:
        found = []
    if not found:
        raise SourceError(f"{origin}: source '{source}': path '{pattern}' is not a Lance dataset and holds none (a "
                          f"Lance dataset is a folder with a _versions/ folder, as lance.write_dataset makes it). "
                          f"Fix sources.path.")
    return [os.path.abspath(p) for p in found]


def list_fragments(name: str, read: Any, origin: str) -> list[str]:
    """The "files" of a Lance source: one per fragment of each dataset, in (dataset, fragment id) order."""
    reader = LanceReader(name, read.text_field, read.chunk_rows, read.cache_bytes, read.tokens_field,
                         columns=read.columns, storage_options=read.storage_options)
    files: dict[str, None] = {}
    for pattern in read.path:
        for uri in _datasets(pattern, name, origin):
            ds = reader.dataset(uri)
            ids = sorted(int(f.fragment_id) for f in ds.get_fragments())
            files.update((fragment_path(uri, i), None) for i in ids)
    return sorted(files, key=split_fragment_path)


class LanceReader(ColumnarReader):
    """Reads ``text_field`` (or ``tokens_field``, or ``columns``) of the fragments of Lance datasets."""

    def __init__(self, source: str, text_field: str, chunk_rows: int, cache_bytes: int = 1 << 30,
                 tokens_field: str | None = None, doc_limit: DocLimit = DEFAULT_DOC_LIMIT,
                 columns: Sequence[str] | None = None, storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(None, source, text_field, chunk_rows, cache_bytes, tokens_field, doc_limit, columns)
        self.storage_options = dict(storage_options) if storage_options else None
        self._datasets = LRU(64)  # (uri, thread) -> LanceDataset
        self._chunks = LRU(16)  # (path, start, end, thread) -> the chunk's columns, read with one take

    # -- metadata ------------------------------------------------------------------------------------------
    def dataset(self, uri: str) -> Any:
        def make() -> Any:
            lance = optional_import("lance", self.source, "lance", "pylance", "lance")
            opts = storage_options_for_lance(self.storage_options, uri, self.source)
            try:
                return lance.dataset(uri, storage_options=opts)
            except BaseException as exc:
                if not native_failure(exc):
                    raise
                raise SourceError(f"source '{self.source}': cannot open the Lance dataset {uri} ({first_line(exc)}). "
                                  f"Check the path (a folder with _versions/), the source's storage_options (Lance's "
                                  f"option names), or re-write the dataset if it is damaged.") from exc
        return self._datasets.get((uri, threading.get_ident()), make)

    def _fragment(self, path: str) -> Any:
        uri, fid = split_fragment_path(path)
        fragment = self.dataset(uri).get_fragment(fid)
        if fragment is None:
            raise SourceError(f"source '{self.source}': fragment {fid} of the Lance dataset {uri} is gone; it was "
                              f"listed when the run was planned (the dataset was compacted or overwritten since). "
                              f"Restore that version of the dataset or start a new run.")
        return fragment

    def where(self, path: str) -> str:
        uri, fid = split_fragment_path(path)
        return f"Lance dataset {uri}, fragment {fid}"

    def _group_starts(self, path: str) -> np.ndarray:
        return np.asarray([0, int(self._fragment(path).metadata.num_rows)], dtype=np.int64)

    def column_names(self, path: str) -> list[str]:
        return list(self.dataset(split_fragment_path(path)[0]).schema.names)

    # -- reading -------------------------------------------------------------------------------------------
    def rows(self, path: str, group: int, name: str, start: int, end: int) -> pa.Array:
        table = self._chunks.get((path, start, end, threading.get_ident()), lambda: self._take(path, start, end))
        col = combined(table.column(name))
        self.validate(col, path, name, f"rows {start}..{end}")
        return col

    def _take(self, path: str, start: int, end: int) -> pa.Table:
        fragment = self._fragment(path)
        names = list(self.columns or (self.text_field,))
        try:
            table = fragment.take(np.arange(start, end, dtype=np.int64), columns=names)
        except BaseException as exc:
            if not native_failure(exc):
                raise
            meta = fragment.metadata
            data_files = meta.files if isinstance(getattr(meta, "files", None), list) else meta.data_files()
            files = ", ".join(f"data/{f.path}" for f in data_files)
            uri, fid = split_fragment_path(path)
            raise SourceError(f"source '{self.source}': cannot read rows {start}..{end} of fragment {fid} of the Lance "
                              f"dataset {uri} (data files: {files}) ({first_line(exc)}). The dataset is corrupt or "
                              f"truncated: restore or re-write it.") from exc
        if table.num_rows != end - start:
            raise SourceError(f"source '{self.source}': {self.where(path)} returned {table.num_rows} rows for rows "
                              f"{start}..{end}: the dataset changed since the run was planned, or is corrupt.")
        return table

"""Sources for the builder: ``z.read.parquet(...)``, ``z.read.jsonl(...)``, ... (one function per format).

Each returns a :class:`ReadSpec`, what :meth:`zephon.Pipeline.source` needs to plan and read a source:
its files (paths, folders or globs; local or ``s3://``, ``gs://``, ``az://``...), the columns to read
(by default the one text column), and the read granularity. Nothing is listed or opened until the
pipeline is built. Example::

    z.read.parquet("s3://bucket/web/", columns=["text", "url"], storage_options={"anon": True})
    z.read.jsonl("data/chat/*.jsonl.zst", columns=["messages"])
    z.read.parquet("data/tokens/", tokens_field="input_ids")     # pre-tokenized ids
    z.read.hf("data/wiki_saved", split="train")                    # a datasets folder (save_to_disk, a cache)
    z.read.lance("data/images.lance", columns=["caption", "image"])
    z.read.records([{"text": "hello"}, {"text": "world"}])         # in memory, for notebooks and tests

A column that holds lists of integers is read as token ids (a ``TokenColumn``); text columns as
strings; other columns as Python values (numbers, lists, dicts, bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

FORMATS = ("parquet", "jsonl", "mds", "litdata", "vortex", "lance", "arrow", "hf", "memory", "webdataset")


@dataclass(frozen=True)
class ReadSpec:
    """How to list, plan and read one source (see the module docstring). ``columns`` None: the text
    column ``text_field`` (or the token-id column ``tokens_field``)."""

    format: str
    path: tuple[str, ...]
    columns: tuple[str, ...] | None = None
    text_field: str = "text"
    tokens_field: str | None = None
    chunk_rows: int = 64  # rows per stateless task (row formats)
    chunk_bytes: int = 256 << 10  # bytes per task (plain JSONL)
    unit_bytes: int = 64 << 20  # plain JSONL files are cut into units of at most this many bytes
    cache_bytes: int = 1 << 30  # decoded row groups kept per process (speed only)
    max_doc_bytes: int = 16 << 20  # a larger document is handled by `oversize` (16 MiB: tokenizing one costs ~1 GB)
    oversize: str = "skip"  # "skip" (and count), "truncate" or "error"
    storage_options: dict[str, Any] | None = field(default=None, repr=False, hash=False, compare=False)
    split: str | None = None  # format "hf": the split to read (None: "train")
    config: str | None = None  # format "hf": the config (dataset configuration) to read, when there are several
    # format "memory": the table as Arrow IPC stream bytes (what workers receive) and their SHA-256
    payload: bytes | None = field(default=None, repr=False)
    digest: str | None = None
    # format "webdataset": a folder for the shards' index sidecars (None: [storage] cache_dir, or none); speed only
    index_cache: str | None = field(default=None, compare=False)

    @property
    def fields(self) -> tuple[str, ...]:
        """The columns this source yields, in order."""
        if self.columns is not None:
            return self.columns
        return (self.tokens_field or self.text_field,)

    def describe(self) -> dict[str, Any]:
        """What decides the records this source yields (fingerprinted; where the bytes come from is not)."""
        d: dict[str, Any] = {"format": self.format, "fields": list(self.fields)}
        if self.tokens_field:
            d["tokens_field"] = self.tokens_field
        if self.format == "jsonl":
            d["unit_bytes"] = self.unit_bytes
        if self.format == "hf":
            d["split"], d["config"] = self.split or "train", self.config
        if self.format == "memory":
            d["content_sha256"] = self.digest  # the data itself: the same records, the same fingerprint
        if self.max_doc_bytes != ReadSpec.max_doc_bytes or self.oversize != ReadSpec.oversize:
            d["max_doc_bytes"], d["oversize"] = self.max_doc_bytes, self.oversize
        return d


def _spec(fmt: str, path: str | Sequence[str], columns: Sequence[str] | None, **options: Any) -> ReadSpec:
    paths = (path,) if isinstance(path, str) else tuple(path)
    if not paths or not all(isinstance(p, str) and p for p in paths):
        raise ValueError(f"read.{fmt}(path=...): a non-empty path (file, folder or glob) or list of them is needed, "
                         f"got {path!r}")
    if columns is not None:
        if isinstance(columns, str) or not all(isinstance(c, str) and c for c in columns) or not columns:
            raise ValueError(f"read.{fmt}(columns=...): a non-empty list of column names is needed, got {columns!r}")
        columns = tuple(columns)
    opts = {k: v for k, v in options.items() if v is not None}
    if "storage_options" in opts and not isinstance(opts["storage_options"], Mapping):
        raise ValueError(f"read.{fmt}(storage_options=...): a dict of fsspec options is needed")
    return ReadSpec(fmt, paths, columns, **opts)


def parquet(path: str | Sequence[str], columns: Sequence[str] | None = None, *, text_field: str | None = None,
            tokens_field: str | None = None, chunk_rows: int | None = None, cache_bytes: int | None = None,
            max_doc_bytes: int | None = None, oversize: str | None = None,
            storage_options: Mapping[str, Any] | None = None) -> ReadSpec:
    """Parquet files: whole files as units when there are at least as many files as lanes, else row
    groups (and row ranges of them)."""
    return _spec("parquet", path, columns, text_field=text_field, tokens_field=tokens_field, chunk_rows=chunk_rows,
                 cache_bytes=cache_bytes, max_doc_bytes=max_doc_bytes, oversize=oversize,
                 storage_options=dict(storage_options) if storage_options else None)


def jsonl(path: str | Sequence[str], columns: Sequence[str] | None = None, *, text_field: str | None = None,
          chunk_bytes: int | None = None, unit_bytes: int | None = None, max_doc_bytes: int | None = None,
          oversize: str | None = None, storage_options: Mapping[str, Any] | None = None) -> ReadSpec:
    """JSON Lines (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``): plain files by byte ranges, compressed ones
    whole (or by line ranges when there are fewer files than lanes)."""
    return _spec("jsonl", path, columns, text_field=text_field, chunk_bytes=chunk_bytes, unit_bytes=unit_bytes,
                 max_doc_bytes=max_doc_bytes, oversize=oversize,
                 storage_options=dict(storage_options) if storage_options else None)


def _indexed(fmt: str):
    def read(path: str | Sequence[str], columns: Sequence[str] | None = None, *, text_field: str | None = None,
             tokens_field: str | None = None, chunk_rows: int | None = None, cache_bytes: int | None = None,
             storage_options: Mapping[str, Any] | None = None) -> ReadSpec:
        return _spec(fmt, path, columns, text_field=text_field, tokens_field=tokens_field, chunk_rows=chunk_rows,
                     cache_bytes=cache_bytes, storage_options=dict(storage_options) if storage_options else None)
    read.__name__ = read.__qualname__ = fmt
    return read


def _columnar(fmt: str, what: str):
    def read(path: str | Sequence[str], columns: Sequence[str] | None = None, *, text_field: str | None = None,
             tokens_field: str | None = None, chunk_rows: int | None = None, cache_bytes: int | None = None,
             max_doc_bytes: int | None = None, oversize: str | None = None,
             storage_options: Mapping[str, Any] | None = None) -> ReadSpec:
        return _spec(fmt, path, columns, text_field=text_field, tokens_field=tokens_field, chunk_rows=chunk_rows,
                     cache_bytes=cache_bytes, max_doc_bytes=max_doc_bytes, oversize=oversize,
                     storage_options=dict(storage_options) if storage_options else None)
    read.__name__ = read.__qualname__ = fmt
    read.__doc__ = what
    return read


lance = _columnar("lance", """Lance datasets (pylance): fragments as units (row ranges of fragments when there are
fewer fragments than lanes), planned from the manifest; rows read with Lance's random access. Object stores
are read by Lance itself: ``storage_options`` go to Lance (see zephon/readers/lance.py).""")
arrow = _columnar("arrow", """Arrow IPC files (file format / Feather v2, or stream format): whole files as units, or
record batches (and row ranges of them) when there are fewer files than lanes, like Parquet row groups.""")


def hf(path: str | Sequence[str], split: str = "train", config: str | None = None,
       columns: Sequence[str] | None = None, *, text_field: str | None = None, tokens_field: str | None = None,
       chunk_rows: int | None = None, cache_bytes: int | None = None, max_doc_bytes: int | None = None,
       oversize: str | None = None, storage_options: Mapping[str, Any] | None = None) -> ReadSpec:
    """A Hugging Face ``datasets`` folder on disk: ``save_to_disk`` output (a Dataset or a DatasetDict), a
    ``datasets`` cache folder or a Hub cache folder of a dataset repository; ``split`` and ``config`` pick
    its files. Read with pyarrow alone, never over the network (see zephon/readers/hf.py)."""
    for key, value, optional in (("split", split, False), ("config", config, True)):
        if not ((value is None and optional) or (isinstance(value, str) and value)):
            raise ValueError(f"read.hf({key}=...): a non-empty string is needed, got {value!r}")
    return _spec("hf", path, columns, text_field=text_field, tokens_field=tokens_field, chunk_rows=chunk_rows,
                 cache_bytes=cache_bytes, max_doc_bytes=max_doc_bytes, oversize=oversize,
                 storage_options=dict(storage_options) if storage_options else None, split=split, config=config)


def _memory(payload: tuple[bytes, str, int], columns: Sequence[str] | None, **options: Any) -> ReadSpec:
    from .readers.memory import label

    data, digest, _ = payload
    return _spec("memory", label(digest), columns, payload=data, digest=digest, **options)


def records(records: Any, columns: Sequence[str] | None = None, *, text_field: str | None = None,
            tokens_field: str | None = None, chunk_rows: int | None = None, max_doc_bytes: int | None = None,
            oversize: str | None = None) -> ReadSpec:
    """An in-memory source from a list of dicts (one per record), for notebooks and tests. The records are
    turned into an Arrow table once, here (a column per field; a field must hold one kind of value), planned
    like that table in a Parquet file, and fingerprinted by a digest of their content."""
    from .readers.memory import records_table, table_payload

    return _memory(table_payload(records_table(records)), columns, text_field=text_field,
                   tokens_field=tokens_field, chunk_rows=chunk_rows, max_doc_bytes=max_doc_bytes, oversize=oversize)


def table(table: Any, columns: Sequence[str] | None = None, *, text_field: str | None = None,
          tokens_field: str | None = None, chunk_rows: int | None = None, max_doc_bytes: int | None = None,
          oversize: str | None = None) -> ReadSpec:
    """An in-memory source from a ``pyarrow.Table``: planned like the table written with
    ``pyarrow.parquet.write_table`` (the same rows give the same batches as that Parquet file) and
    fingerprinted by a digest of its content."""
    from .readers.memory import table_payload

    return _memory(table_payload(table, "read.table"), columns, text_field=text_field, tokens_field=tokens_field,
                   chunk_rows=chunk_rows, max_doc_bytes=max_doc_bytes, oversize=oversize)


def webdataset(path: str | Sequence[str], columns: Sequence[str] | None = ("*",), *, chunk_rows: int | None = None,
               max_doc_bytes: int | None = None, oversize: str | None = None, index_cache: str | None = None,
               storage_options: Mapping[str, Any] | None = None) -> ReadSpec:
    """WebDataset tar shards (``.tar``): samples grouped by key, one field per member extension (``columns``:
    ``["jpg", "txt"]``, ``"jpg;png"`` alternatives, ``"image=jpg;png"`` to name a field, ``"*"`` every member),
    plus ``__key__``. Units are shards or sample ranges, planned from an index of member offsets built once
    per shard (``index_cache``: a folder to keep it in). See zephon/readers/webdataset.py."""
    return _spec("webdataset", path, columns or ("*",), chunk_rows=chunk_rows, max_doc_bytes=max_doc_bytes,
                 oversize=oversize, index_cache=index_cache,
                 storage_options=dict(storage_options) if storage_options else None)


mds = _indexed("mds")
mds.__doc__ = "MosaicML Streaming (MDS) datasets: the shards named by their index.json files."
litdata = _indexed("litdata")
litdata.__doc__ = "LitData optimized datasets (litdata.optimize output): chunks named by index.json."
vortex = _indexed("vortex")
vortex.__doc__ = "Vortex files: splits (row ranges) as units, columns by name."


def with_defaults(spec: ReadSpec, **defaults: Any) -> ReadSpec:
    """``spec`` with the given options where it kept the defaults (a recipe's [read] table)."""
    base = ReadSpec(spec.format, spec.path)
    changes = {k: v for k, v in defaults.items() if getattr(spec, k) == getattr(base, k)}
    return replace(spec, **changes) if changes else spec

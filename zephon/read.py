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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

FORMATS = ("parquet", "jsonl", "mds", "litdata", "vortex", "lance", "arrow", "hf", "memory", "webdataset")
"""The formats a source can have: one function of this module each (``memory``: :func:`records` and
:func:`table`)."""


@dataclass(frozen=True)
class ReadSpec:
    """How to list, plan and read one source: what the functions of :mod:`zephon.read` return.

    Build it with one of those functions (they check their arguments), not directly. Only the fields that
    decide the records a source yields are part of the pipeline's fingerprint (:meth:`describe`).
    """

    format: str
    """The format, one of :data:`FORMATS`."""
    path: tuple[str, ...]
    """The files, folders or globs to read (local paths or fsspec URLs)."""
    columns: tuple[str, ...] | None = None
    """The fields each record has, in order; None: the one column ``text_field`` (or ``tokens_field``)."""
    text_field: str = "text"
    """The text column read when ``columns`` is None."""
    tokens_field: str | None = None
    """A column of token ids (lists of integers) read instead of text: a pre-tokenized source."""
    chunk_rows: int = 64
    """Rows per stateless task (row formats)."""
    chunk_bytes: int = 256 << 10
    """Bytes per stateless task (plain JSON Lines files)."""
    unit_bytes: int = 64 << 20
    """Plain JSON Lines files are cut into units of at most this many bytes."""
    cache_bytes: int = 1 << 30
    """Decoded data (row groups, shards) kept per process, in bytes: speed only."""
    max_doc_bytes: int = 16 << 20
    """A larger document is handled by ``oversize`` (16 MiB: tokenizing one costs about 1 GB)."""
    oversize: str = "skip"
    """What to do with a document over ``max_doc_bytes``: ``"skip"`` it (and count), ``"truncate"`` it or
    raise an ``"error"``."""
    storage_options: dict[str, Any] | None = field(default=None, repr=False, hash=False, compare=False)
    """fsspec options for the filesystem of ``path`` (credentials, endpoint, ...); Lance's own for ``lance``."""
    split: str | None = None
    """Format ``hf``: the split to read (None: ``"train"``)."""
    config: str | None = None
    """Format ``hf``: the configuration to read, when the dataset has several."""
    payload: bytes | None = field(default=None, repr=False)
    """Format ``memory``: the table as Arrow IPC stream bytes (what workers receive)."""
    digest: str | None = None
    """Format ``memory``: the SHA-256 of ``payload`` (in the fingerprint)."""
    index_cache: str | None = field(default=None, compare=False)
    """Format ``webdataset``: a folder for the shards' index sidecars (None: ``[storage] cache_dir``, or none);
    speed only."""

    @property
    def fields(self) -> tuple[str, ...]:
        """The columns this source yields, in order."""
        if self.columns is not None:
            return self.columns
        return (self.tokens_field or self.text_field,)

    def describe(self) -> dict[str, Any]:
        """What decides the records this source yields, for the fingerprint (where the bytes come from does not).

        Returns:
            A JSON-serialisable dict: the format and fields, and each option that changes the records.
        """
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
    options["storage_options"] = dict(options["storage_options"]) if options.get("storage_options") else None
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


# The arguments the functions below share are documented the same way in each (the API reference shows every
# function on its own). An argument left None keeps ReadSpec's default.


def parquet(path: str | Sequence[str], columns: Sequence[str] | None = None, *, text_field: str | None = None,
            tokens_field: str | None = None, chunk_rows: int | None = None, cache_bytes: int | None = None,
            max_doc_bytes: int | None = None, oversize: str | None = None,
            storage_options: Mapping[str, Any] | None = None) -> ReadSpec:
    """Parquet files: whole files as units when there are at least as many files as lanes, else row
    groups (and row ranges of them).

    Args:
        path: files, folders or globs (``.parquet``, ``.pq``), local or in an object store (``s3://...``), or a
            list of them.
        columns: the fields to read, in order (None: the one column ``text_field``, or ``tokens_field``). A
            list-of-integers column is read as token ids, a string column as text.
        text_field: the text column read when ``columns`` is None (None: ``"text"``).
        tokens_field: a list-of-integers column of token ids, read instead of text (a pre-tokenized source).
        chunk_rows: rows per stateless task (None: 64).
        cache_bytes: decoded row groups kept per process, in bytes (None: 1 GiB); speed only.
        max_doc_bytes: a larger document is handled by ``oversize`` (None: 16 MiB).
        oversize: ``"skip"`` (the default; counted), ``"truncate"`` or ``"error"``.
        storage_options: fsspec options for the filesystem of ``path`` (credentials, endpoint, ...).

    Returns:
        The source's spec, for :meth:`zephon.Pipeline.source`. Nothing is listed or opened until the pipeline
        is built.

    Raises:
        ValueError: ``path`` is empty, ``columns`` is not a non-empty list of names, or ``storage_options`` is
            not a dict.
    """
    return _spec("parquet", path, columns, text_field=text_field, tokens_field=tokens_field, chunk_rows=chunk_rows,
                 cache_bytes=cache_bytes, max_doc_bytes=max_doc_bytes, oversize=oversize,
                 storage_options=storage_options)


def jsonl(path: str | Sequence[str], columns: Sequence[str] | None = None, *, text_field: str | None = None,
          chunk_bytes: int | None = None, unit_bytes: int | None = None, max_doc_bytes: int | None = None,
          oversize: str | None = None, storage_options: Mapping[str, Any] | None = None) -> ReadSpec:
    """JSON Lines (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``): plain files by byte ranges, compressed ones
    whole (or by line ranges when there are fewer files than lanes).

    Args:
        path: files, folders or globs, local or in an object store (``s3://...``), or a list of them.
        columns: the fields to read, in order (None: the one field ``text_field``); any JSON value.
        text_field: the text field read when ``columns`` is None (None: ``"text"``).
        chunk_bytes: bytes per stateless task in a plain file (None: 256 KiB).
        unit_bytes: plain files are cut into units of at most this many bytes (None: 64 MiB).
        max_doc_bytes: a longer line is handled by ``oversize`` (None: 16 MiB).
        oversize: ``"skip"`` (the default; counted), ``"truncate"`` or ``"error"``.
        storage_options: fsspec options for the filesystem of ``path`` (credentials, endpoint, ...).

    Returns:
        The source's spec, for :meth:`zephon.Pipeline.source`.

    Raises:
        ValueError: ``path`` is empty, ``columns`` is not a non-empty list of names, or ``storage_options`` is
            not a dict.
    """
    return _spec("jsonl", path, columns, text_field=text_field, chunk_bytes=chunk_bytes, unit_bytes=unit_bytes,
                 max_doc_bytes=max_doc_bytes, oversize=oversize, storage_options=storage_options)


def mds(path: str | Sequence[str], columns: Sequence[str] | None = None, *, text_field: str | None = None,
        tokens_field: str | None = None, chunk_rows: int | None = None, cache_bytes: int | None = None,
        storage_options: Mapping[str, Any] | None = None) -> ReadSpec:
    """MosaicML Streaming (MDS) datasets: the shards named by their index.json files.

    Shards are the units (sample ranges of a shard when there are fewer shards than lanes), planned from the
    index alone; Zephon decodes MDS itself (see zephon/readers/mds.py).

    Args:
        path: a dataset folder (or a folder of them, an ``index.json``, a glob), local or in an object store, or
            a list of them.
        columns: the fields to read, in order (None: the one column ``text_field``, or ``tokens_field``): text,
            token-id and image columns (images as the encoded bytes stored).
        text_field: the ``str`` column read when ``columns`` is None (None: ``"text"``).
        tokens_field: an ``ndarray`` column of token ids, read instead of text.
        chunk_rows: samples per stateless task (None: 64).
        cache_bytes: shard indexes and decompressed shards kept per process, in bytes (None: 1 GiB); speed only.
        storage_options: fsspec options for the filesystem of ``path`` (credentials, endpoint, ...).

    Returns:
        The source's spec, for :meth:`zephon.Pipeline.source`.

    Raises:
        ValueError: ``path`` is empty, ``columns`` is not a non-empty list of names, or ``storage_options`` is
            not a dict.
    """
    return _spec("mds", path, columns, text_field=text_field, tokens_field=tokens_field, chunk_rows=chunk_rows,
                 cache_bytes=cache_bytes, storage_options=storage_options)


def litdata(path: str | Sequence[str], columns: Sequence[str] | None = None, *, text_field: str | None = None,
            tokens_field: str | None = None, chunk_rows: int | None = None, cache_bytes: int | None = None,
            storage_options: Mapping[str, Any] | None = None) -> ReadSpec:
    """LitData optimized datasets (litdata.optimize output): chunks named by index.json.

    Chunks are the units (sample ranges of a chunk when there are fewer chunks than lanes), planned from the
    index alone (see zephon/readers/litdata.py).

    Args:
        path: an output folder of ``litdata.optimize`` (or a folder of them, an ``index.json``, a glob), local or
            in an object store, or a list of them.
        columns: the fields to read, in order (None: the one field ``text_field``, or ``tokens_field``): an item's
            dict keys (dotted for nested dicts).
        text_field: the ``str`` field read when ``columns`` is None (None: ``"text"``).
        tokens_field: an array field of token ids, read instead of text.
        chunk_rows: samples per stateless task (None: 64).
        cache_bytes: chunk indexes and decompressed chunks kept per process, in bytes (None: 1 GiB); speed only.
        storage_options: fsspec options for the filesystem of ``path`` (credentials, endpoint, ...).

    Returns:
        The source's spec, for :meth:`zephon.Pipeline.source`.

    Raises:
        ValueError: ``path`` is empty, ``columns`` is not a non-empty list of names, or ``storage_options`` is
            not a dict.
    """
    return _spec("litdata", path, columns, text_field=text_field, tokens_field=tokens_field, chunk_rows=chunk_rows,
                 cache_bytes=cache_bytes, storage_options=storage_options)


def vortex(path: str | Sequence[str], columns: Sequence[str] | None = None, *, text_field: str | None = None,
           tokens_field: str | None = None, chunk_rows: int | None = None, cache_bytes: int | None = None,
           storage_options: Mapping[str, Any] | None = None) -> ReadSpec:
    """Vortex files: splits (row ranges) as units, columns by name.

    Whole files are the units when there are at least as many files as lanes, else the file's splits and row
    ranges of them (see zephon/readers/vortex.py). A Vortex source reads one field.

    Args:
        path: files, folders or globs (``.vortex``, ``.vtx``), local or in an object store, or a list of them.
        columns: None, or the one field read (``[text_field]`` or ``[tokens_field]``); any other list is refused
            when the pipeline is built.
        text_field: the utf8 column read (None: ``"text"``).
        tokens_field: a list-of-integers column of token ids, read instead of text.
        chunk_rows: rows per stateless task (None: 64).
        cache_bytes: decoded columns kept per process, in bytes (None: 1 GiB); speed only.
        storage_options: fsspec options for the filesystem of ``path`` (credentials, endpoint, ...).

    Returns:
        The source's spec, for :meth:`zephon.Pipeline.source`.

    Raises:
        ValueError: ``path`` is empty, ``columns`` is not a non-empty list of names, or ``storage_options`` is
            not a dict.
    """
    return _spec("vortex", path, columns, text_field=text_field, tokens_field=tokens_field, chunk_rows=chunk_rows,
                 cache_bytes=cache_bytes, storage_options=storage_options)


def lance(path: str | Sequence[str], columns: Sequence[str] | None = None, *, text_field: str | None = None,
          tokens_field: str | None = None, chunk_rows: int | None = None, cache_bytes: int | None = None,
          max_doc_bytes: int | None = None, oversize: str | None = None,
          storage_options: Mapping[str, Any] | None = None) -> ReadSpec:
    """Lance datasets (pylance): fragments as units (row ranges of fragments when there are fewer fragments
    than lanes), planned from the manifest; rows read with Lance's random access.

    Object stores are read by Lance itself (see zephon/readers/lance.py).

    Args:
        path: a Lance dataset folder (local or ``s3://``, ``gs://``, ``az://``), or a local folder or glob of
            them, or a list of them.
        columns: the fields to read, in order (None: the one column ``text_field``, or ``tokens_field``).
        text_field: the string column read when ``columns`` is None (None: ``"text"``).
        tokens_field: a list-of-integers column of token ids, read instead of text.
        chunk_rows: rows per stateless task (None: 64).
        cache_bytes: decoded rows kept per process, in bytes (None: 1 GiB); speed only.
        max_doc_bytes: a larger document is handled by ``oversize`` (None: 16 MiB).
        oversize: ``"skip"`` (the default; counted), ``"truncate"`` or ``"error"``.
        storage_options: Lance's storage options (they go to Lance, not to fsspec).

    Returns:
        The source's spec, for :meth:`zephon.Pipeline.source`.

    Raises:
        ValueError: ``path`` is empty, ``columns`` is not a non-empty list of names, or ``storage_options`` is
            not a dict.
    """
    return _spec("lance", path, columns, text_field=text_field, tokens_field=tokens_field, chunk_rows=chunk_rows,
                 cache_bytes=cache_bytes, max_doc_bytes=max_doc_bytes, oversize=oversize,
                 storage_options=storage_options)


def arrow(path: str | Sequence[str], columns: Sequence[str] | None = None, *, text_field: str | None = None,
          tokens_field: str | None = None, chunk_rows: int | None = None, cache_bytes: int | None = None,
          max_doc_bytes: int | None = None, oversize: str | None = None,
          storage_options: Mapping[str, Any] | None = None) -> ReadSpec:
    """Arrow IPC files (file format / Feather v2, or stream format): whole files as units, or record batches
    (and row ranges of them) when there are fewer files than lanes, like Parquet row groups.

    Args:
        path: files, folders or globs (``.arrow``, ``.arrows``, ``.feather``, ``.ipc``), local or in an object
            store, or a list of them.
        columns: the fields to read, in order (None: the one column ``text_field``, or ``tokens_field``).
        text_field: the string column read when ``columns`` is None (None: ``"text"``).
        tokens_field: a list-of-integers column of token ids, read instead of text.
        chunk_rows: rows per stateless task (None: 64).
        cache_bytes: record batches kept per process (for files not mapped from a local disk), in bytes (None:
            1 GiB); speed only.
        max_doc_bytes: a larger document is handled by ``oversize`` (None: 16 MiB).
        oversize: ``"skip"`` (the default; counted), ``"truncate"`` or ``"error"``.
        storage_options: fsspec options for the filesystem of ``path`` (credentials, endpoint, ...).

    Returns:
        The source's spec, for :meth:`zephon.Pipeline.source`.

    Raises:
        ValueError: ``path`` is empty, ``columns`` is not a non-empty list of names, or ``storage_options`` is
            not a dict.
    """
    return _spec("arrow", path, columns, text_field=text_field, tokens_field=tokens_field, chunk_rows=chunk_rows,
                 cache_bytes=cache_bytes, max_doc_bytes=max_doc_bytes, oversize=oversize,
                 storage_options=storage_options)


def hf(path: str | Sequence[str], split: str = "train", config: str | None = None,
       columns: Sequence[str] | None = None, *, text_field: str | None = None, tokens_field: str | None = None,
       chunk_rows: int | None = None, cache_bytes: int | None = None, max_doc_bytes: int | None = None,
       oversize: str | None = None, storage_options: Mapping[str, Any] | None = None) -> ReadSpec:
    """A Hugging Face ``datasets`` folder on disk: ``save_to_disk`` output (a Dataset or a DatasetDict), a
    ``datasets`` cache folder or a Hub cache folder of a dataset repository.

    Read with pyarrow alone, never over the network (see zephon/readers/hf.py): its Arrow or Parquet files are
    planned like ``arrow`` and ``parquet`` sources.

    Args:
        path: the folder (local or in an object store), or a list of them.
        split: the split whose files are read.
        config: the configuration whose files are read, when the dataset has several.
        columns: the fields to read, in order (None: the one column ``text_field``, or ``tokens_field``).
        text_field: the string column read when ``columns`` is None (None: ``"text"``).
        tokens_field: a list-of-integers column of token ids, read instead of text.
        chunk_rows: rows per stateless task (None: 64).
        cache_bytes: decoded data kept per process, in bytes (None: 1 GiB); speed only.
        max_doc_bytes: a larger document is handled by ``oversize`` (None: 16 MiB).
        oversize: ``"skip"`` (the default; counted), ``"truncate"`` or ``"error"``.
        storage_options: fsspec options for the filesystem of ``path`` (credentials, endpoint, ...).

    Returns:
        The source's spec, for :meth:`zephon.Pipeline.source`.

    Raises:
        ValueError: ``split`` or ``config`` is not a non-empty string, ``path`` is empty, ``columns`` is not a
            non-empty list of names, or ``storage_options`` is not a dict.
    """
    for key, value, optional in (("split", split, False), ("config", config, True)):
        if not ((value is None and optional) or (isinstance(value, str) and value)):
            raise ValueError(f"read.hf({key}=...): a non-empty string is needed, got {value!r}")
    return _spec("hf", path, columns, text_field=text_field, tokens_field=tokens_field, chunk_rows=chunk_rows,
                 cache_bytes=cache_bytes, max_doc_bytes=max_doc_bytes, oversize=oversize,
                 storage_options=storage_options, split=split, config=config)


def _memory(payload: tuple[bytes, str, int], columns: Sequence[str] | None, **options: Any) -> ReadSpec:
    from .readers.memory import label

    data, digest, _ = payload
    return _spec("memory", label(digest), columns, payload=data, digest=digest, **options)


def records(records: Iterable[Mapping[str, Any]], columns: Sequence[str] | None = None, *,
            text_field: str | None = None, tokens_field: str | None = None, chunk_rows: int | None = None,
            max_doc_bytes: int | None = None, oversize: str | None = None) -> ReadSpec:
    """An in-memory source from a list of dicts (one per record), for notebooks and tests.

    The records are turned into an Arrow table once, here (a column per field), planned like that table in a
    Parquet file, and fingerprinted by a digest of their content.

    Args:
        records: the records, dicts of field name to value; a field holds one kind of value in every record
            (strings, numbers, lists of integers, bytes, dicts...) or None.
        columns: the fields to read, in order (None: the one field ``text_field``, or ``tokens_field``).
        text_field: the text field read when ``columns`` is None (None: ``"text"``).
        tokens_field: a list-of-integers field of token ids, read instead of text.
        chunk_rows: rows per stateless task (None: 64).
        max_doc_bytes: a larger document is handled by ``oversize`` (None: 16 MiB).
        oversize: ``"skip"`` (the default; counted), ``"truncate"`` or ``"error"``.

    Returns:
        The source's spec, for :meth:`zephon.Pipeline.source`.

    Raises:
        ValueError: ``records`` is not a non-empty list of dicts with string keys, a field cannot be one Arrow
            column, or ``columns`` is not a non-empty list of names.
    """
    from .readers.memory import records_table, table_payload

    return _memory(table_payload(records_table(records)), columns, text_field=text_field,
                   tokens_field=tokens_field, chunk_rows=chunk_rows, max_doc_bytes=max_doc_bytes, oversize=oversize)


def table(table: pa.Table | pa.RecordBatch, columns: Sequence[str] | None = None, *, text_field: str | None = None,
          tokens_field: str | None = None, chunk_rows: int | None = None, max_doc_bytes: int | None = None,
          oversize: str | None = None) -> ReadSpec:
    """An in-memory source from a ``pyarrow.Table``: planned like the table written with
    ``pyarrow.parquet.write_table`` (the same rows give the same batches as that Parquet file) and
    fingerprinted by a digest of its content.

    Args:
        table: the table (or one record batch).
        columns: the fields to read, in order (None: the one column ``text_field``, or ``tokens_field``).
        text_field: the text column read when ``columns`` is None (None: ``"text"``).
        tokens_field: a list-of-integers column of token ids, read instead of text.
        chunk_rows: rows per stateless task (None: 64).
        max_doc_bytes: a larger document is handled by ``oversize`` (None: 16 MiB).
        oversize: ``"skip"`` (the default; counted), ``"truncate"`` or ``"error"``.

    Returns:
        The source's spec, for :meth:`zephon.Pipeline.source`.

    Raises:
        ValueError: ``table`` is not a ``pyarrow.Table`` with rows, or ``columns`` is not a non-empty list of
            names.
    """
    from .readers.memory import table_payload

    return _memory(table_payload(table, "read.table"), columns, text_field=text_field, tokens_field=tokens_field,
                   chunk_rows=chunk_rows, max_doc_bytes=max_doc_bytes, oversize=oversize)


def webdataset(path: str | Sequence[str], columns: Sequence[str] | None = ("*",), *, chunk_rows: int | None = None,
               max_doc_bytes: int | None = None, oversize: str | None = None, index_cache: str | None = None,
               storage_options: Mapping[str, Any] | None = None) -> ReadSpec:
    """WebDataset tar shards (``.tar``): samples grouped by key, one field per member extension, plus
    ``__key__``.

    Units are shards or sample ranges, planned from an index of member offsets built once per shard (see
    zephon/readers/webdataset.py).

    Args:
        path: shards, folders or globs, local or in an object store, or a list of them.
        columns: the fields, by member extension: ``["jpg", "txt"]``, ``"jpg;png"`` for alternatives,
            ``"image=jpg;png"`` to name a field, ``"*"`` (the default; also for None) for every member.
        chunk_rows: samples per stateless task (None: 64).
        max_doc_bytes: a larger sample is handled by ``oversize`` (None: 16 MiB).
        oversize: ``"skip"`` (the default; counted), ``"truncate"`` or ``"error"``.
        index_cache: a folder to keep the shards' indexes in (None: ``[storage] cache_dir``, or none); speed only.
        storage_options: fsspec options for the filesystem of ``path`` (credentials, endpoint, ...).

    Returns:
        The source's spec, for :meth:`zephon.Pipeline.source`.

    Raises:
        ValueError: ``path`` is empty, ``columns`` is not a non-empty list of names, or ``storage_options`` is
            not a dict.
    """
    return _spec("webdataset", path, columns or ("*",), chunk_rows=chunk_rows, max_doc_bytes=max_doc_bytes,
                 oversize=oversize, index_cache=index_cache, storage_options=storage_options)

"""LitData optimized datasets (chunks + ``index.json``, as ``litdata.optimize`` writes them).

Layout (litdata ``streaming/writer.py``): ``index.json`` is ``{"chunks": [{"filename", "chunk_size",
"chunk_bytes", "dim"}, ...], "config": {"data_format", "data_spec", "item_loader", "compression",
"encryption", ...}}``; a chunk is ``uint32 n | uint32 offsets[n+1] | items``. With the default
``PyTreeLoader`` an item is ``uint32 size of each leaf | each leaf's bytes``, leaves in the order of the
flattened ``data_spec`` (so a dict item ``{"text": ..., "input_ids": ...}`` has one leaf per key);
with ``TokensLoader`` an item is one token array's raw bytes. Either way an item is one document.

A dataset is untrusted input, so Zephon decodes every leaf it reads with its own code and never calls
litdata's serializers or its pytree loader (``pickle`` and ``graph`` leaves run ``pickle.loads``; video,
audio, image, PIL, JPEG, TIFF... leaves run media codecs; a ``collections.defaultdict`` node of a
``data_spec`` imports a module the index names). The formats it decodes:

- text (``text_field``): ``str`` and ``text`` leaves (UTF-8), ``json`` leaves that hold a string;
- token ids (``tokens_field``): ``no_header_numpy:<dtype>`` / ``no_header_tensor:<dtype>`` (raw ids,
  decoded with numpy over the whole chunk), ``numpy`` and ``tensor`` (litdata's dtype/shape header, then
  the ids; an array of any shape is read flat) and ``json`` lists of integers, all of integer dtypes.

The field's format is checked from ``index.json`` alone, before a byte of a chunk is read: any other
format (``pickle``, ``graph``, ``image``, ``pil``, ``jpeg``, ``video``, ``tifffile``..., or a known name
with a suffix such as ``json:pickle``) is refused with a message naming the index, the field and its
format. The *other* leaves of an item may have any format: their bytes are skipped by the item's size
header and never decoded, so a dataset with an image or pickled leaf beside its text stays readable.

With several ``columns`` (a caption and an image), an image leaf of format ``bytes``, ``jpeg`` or
``image:<ext>`` (litdata stores the encoded file for those) is read as raw bytes, never decoded here:
``decode_images`` sniffs and decodes them later. ``pil``, ``jpeg_array`` (pixel layouts of litdata's own)
and every other format stay refused.

The field is the item's key (dotted for nested dicts); an item that is a bare array (``TokensLoader``)
is its own field. Compressed chunks (``compression="zstd"``, at every ``compression_level``: ``"batch"``
zstd frames, the default, ``"sample"`` or ``"chunk"``) are decompressed whole with litdata's own codecs,
once per process; encrypted chunks and Arrow-only nested chunks are refused with a message. Token ids
(litdata's dtype tables) and compressed chunks need the ``litdata`` package (from a Zephon checkout:
``python -m pip install -e '.[formats]'``); text from uncompressed chunks needs nothing but numpy.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np

from .base import TokenRows, optional_import
from ..errors import SourceError
from .indexed import IndexedReader, ShardMeta
from .tokens import byte_token_rows

_LOADERS = ("PyTreeLoader", "TokensLoader")
# Leaf formats Zephon decodes itself (module docstring); every other format is refused, never decoded.
_TEXT_FORMATS = ("str", "text", "json")
_RAW_IDS = ("no_header_numpy", "no_header_tensor")  # the name carries the dtype: 'no_header_numpy:2'
_TOKEN_FORMATS = (*_RAW_IDS, "numpy", "tensor", "json")
_PLAIN = ("int", "float", "bool", "bytes")  # harmless, but neither text nor token ids
_RAW_BYTES = ("bytes", "jpeg", "image")  # leaves whose stored bytes are the value (an encoded image) as is
_MAX_DEPTH = 64  # nesting of a data_spec


def _codecs(source: str) -> Any:
    try:
        import litdata.streaming.compression as compression
        import litdata.streaming.framed_zstd as framed
    except ImportError as exc:
        raise SourceError(f"source '{source}': compressed LitData chunks need the litdata package (python -m pip "
                          f"install -e '.[formats]', run from a Zephon checkout): {exc}") from exc
    return compression, framed


class LitDataReader(IndexedReader):
    """Reads one leaf (text or token ids) of the items of LitData chunks."""

    label = "LitData"
    shard_word = "chunk"
    exact_end = False  # chunks of JSON-typed items may end with an Arrow footer after the items

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._layouts: dict[str, tuple[int, int, bool, str]] = {}

    @classmethod
    def parse_index(cls, data: Any, index_path: str, source: str) -> list[ShardMeta]:
        if isinstance(data, dict) and "shards" in data:
            raise SourceError(f"source '{source}': {index_path} is an MDS index, not a LitData one: set "
                              f"format = \"mds\" for this source.")
        if not isinstance(data, dict) or not isinstance(data.get("chunks"), list) or \
                not isinstance(data.get("config"), dict):
            raise SourceError(f"source '{source}': {index_path} is not a LitData index (no 'chunks' and "
                              f"'config'). Point sources.path at the output_dir of litdata.optimize.")
        config = data["config"]
        loader = config.get("item_loader")
        if loader not in _LOADERS:
            raise SourceError(f"source '{source}': {index_path} was written with item_loader {loader}; zephon "
                              f"reads datasets written with {' or '.join(_LOADERS)}.")
        if config.get("encryption"):
            raise SourceError(f"source '{source}': {index_path} describes encrypted chunks, which zephon does not "
                              f"read. Re-optimize without encryption.")
        formats = config.get("data_format")
        if not isinstance(formats, list) or not formats or not all(isinstance(f, str) for f in formats):
            raise SourceError(f"source '{source}': {index_path}: config.data_format is {formats!r}, not a list of "
                              f"format names. The index is corrupt: re-write the dataset.")
        level = config.get("compression_level")
        if config.get("compression") and level not in (None, "chunk", "batch", "sample"):
            raise SourceError(f"source '{source}': {index_path} uses compression_level='{level}', which zephon "
                              f"does not read. Re-optimize with compression_level 'batch', 'sample' or 'chunk'.")
        in_file = bool(config.get("compression")) and level in ("batch", "sample")

        def entry(k: int, chunk: Any) -> ShardMeta:
            size = None if chunk.get("chunk_bytes") is None else int(chunk["chunk_bytes"])
            # chunk_bytes is the decoded size for whole-file compression, the stored size otherwise
            return ShardMeta(name=cls.shard_name(chunk["filename"], index_path, source, k),
                             samples=int(chunk["chunk_size"]), nbytes=None if in_file else size,
                             stored_bytes=size if in_file else None,
                             compression=config.get("compression") or None, index=index_path, info=config)
        return cls.entries(data["chunks"], index_path, source, entry)

    def inflate(self, raw: bytes, meta: ShardMeta, path: str) -> bytes:
        """A compressed chunk back in the plain layout, decoded with litdata's codecs."""
        compression, framed = _codecs(self.source)
        kind = meta.compression or ""
        level = meta.info.get("compression_level")
        if framed.is_framed_chunk(raw):  # "batch": a directory of zstd frames of consecutive items
            header = framed.parse_framed_header(raw)
            codec = framed.make_zstd_codec(kind)
            body = b"".join(bytes(framed.inflate_frame(raw, header, i, codec)) for i in range(len(header.frames)))
            head = 4 + 4 * (header.num_items + 1)
            offsets = np.asarray(header.offsets, dtype=np.int64) + head
            return np.uint32(header.num_items).tobytes() + offsets.astype("<u4").tobytes() + body
        if level == "sample":  # plain layout, each item compressed on its own
            codec = framed.make_zstd_codec(kind)
            n = int(np.frombuffer(raw[:4], "<u4")[0])
            offs = np.frombuffer(raw[4:4 + 4 * (n + 1)], "<u4").astype(np.int64)
            items = [bytes(codec.decompress(raw[a:b])) for a, b in zip(offs[:-1].tolist(), offs[1:].tolist())]
            sizes = np.fromiter((len(x) for x in items), dtype=np.int64, count=n)
            new = 4 + 4 * (n + 1) + np.concatenate([[0], np.cumsum(sizes)])
            return np.uint32(n).tobytes() + new.astype("<u4").tobytes() + b"".join(items)
        name = kind.split(":", 1)[0]
        if name not in compression._COMPRESSORS:
            raise SourceError(f"{self._name(path)}: compression '{kind}' is not available in this litdata "
                              f"({', '.join(sorted(compression._COMPRESSORS)) or 'none installed'}).")
        return compression._COMPRESSORS[name].decompress(raw)

    # -- the item layout, from the index alone -------------------------------------------------------
    def fresh_column(self) -> None:
        self._layouts = {}

    def column_kind(self, meta: ShardMeta, name: str, path: str) -> str:
        config = meta.info
        if config["item_loader"] == "TokensLoader":
            raise SourceError(f"source '{self.source}': {meta.index} holds bare token arrays (TokensLoader): read them "
                              f"with tokens_field, not columns=[...].")
        tree, leaves = _parse_spec(config.get("data_spec"), meta.index, self.source)
        col = _leaf(tree, name)
        if col is None:
            raise SourceError(f"{self._name(path)} has no field '{name}' (fields: {', '.join(_paths(tree))}). Fix "
                              f"the source's columns.")
        formats = config["data_format"]
        fmt = formats[col] if col < len(formats) else ""
        kind = fmt.partition(":")[0]
        if kind in _RAW_BYTES and (kind == "image" or ":" not in fmt):
            return "bytes"
        if kind in _TOKEN_FORMATS and kind != "json":
            return "tokens"
        return "text" if kind in (*_TEXT_FORMATS, *_PLAIN) else "bytes"  # media, pickle...: refused as images

    def check_field(self, meta: ShardMeta, path: str) -> None:
        self._layout(meta, path)

    def _layout(self, meta: ShardMeta, path: str) -> tuple[int, int, bool, str]:
        """(number of leaves, index of the field's leaf, whether items have a size header, its format)."""
        if meta.index not in self._layouts:
            config = meta.info
            formats = config["data_format"]
            if config["item_loader"] == "TokensLoader":
                if not self.tokens:
                    raise SourceError(f"source '{self.source}': {meta.index} holds token chunks (TokensLoader); "
                                      f"read them with tokens_field (any name), not text_field.")
                leaves, col, header = 1, 0, False
            else:
                tree, leaves = _parse_spec(config.get("data_spec"), meta.index, self.source)
                col = _leaf(tree, self.field)
                if col is None:
                    raise self.missing_field(path, _paths(tree))
                header = True
            if len(formats) != leaves:
                raise SourceError(f"source '{self.source}': {meta.index}: config.data_format names {len(formats)} "
                                  f"formats for the {leaves} leaves of config.data_spec. The index is corrupt: "
                                  f"re-write the dataset.")
            self._check_format(formats[col], col, meta.index)
            self._layouts[meta.index] = (leaves, col, header, formats[col])
        return self._layouts[meta.index]

    def _check_format(self, fmt: str, col: int, index: str) -> None:
        """Refuse a field whose format Zephon does not decode itself (this runs before any chunk is read)."""
        name, sep, code = fmt.partition(":")
        where = f"source '{self.source}': field '{self.field}' of {index} (config.data_format[{col}])"
        if self.raw_bytes:
            if name in _RAW_BYTES and (name == "image" or not sep):
                return
            raise SourceError(f"{where} has format '{fmt}', not raw bytes: image columns are read as the bytes "
                              f"litdata stores for 'bytes', 'jpeg' and 'image' leaves (an encoded file), never "
                              f"through litdata's deserializers ('pil', 'jpeg_array', 'pickle'...: a dataset is "
                              f"untrusted input). Store the images as encoded bytes and re-optimize.")
        if name in _RAW_IDS and not code.isdigit():
            raise SourceError(f"{where} has format '{fmt}', which names no dtype. The index is corrupt: re-write "
                              f"the dataset.")
        known = name if (not sep or name in _RAW_IDS) else None  # 'json:pickle' is not 'json'
        accepted = _TOKEN_FORMATS if self.tokens else _TEXT_FORMATS
        if known in accepted:
            return
        if not self.tokens and known in _TOKEN_FORMATS:
            raise SourceError(f"{where} holds '{fmt}' items, not text. Point text_field at a str field, or use "
                              f"tokens_field for token ids.")
        if self.tokens and known in (*_TEXT_FORMATS, *_PLAIN):
            raise SourceError(f"{where} holds '{fmt}' items, not token-id arrays. Point tokens_field at an array "
                              f"field, or use text_field for text.")
        if known in _PLAIN:
            raise SourceError(f"{where} holds '{fmt}' items, not text. Point text_field at a str field, or use "
                              f"tokens_field for token ids.")
        raise SourceError(f"{where} has format '{fmt}', which zephon never decodes: a dataset is untrusted "
                          f"input, and that format would need litdata's own deserializer (pickle, or a media "
                          f"codec). zephon reads text from {', '.join(_TEXT_FORMATS)} leaves and token ids from "
                          f"{', '.join(_TOKEN_FORMATS)} leaves. Store the field in one of those formats and "
                          f"re-optimize, or point {'tokens_field' if self.tokens else 'text_field'} at such a "
                          f"field.")

    # -- decoding (runs on workers) ----------------------------------------------------------------
    def decode(self, meta: ShardMeta, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, path: str,
               first_row: int) -> list[str | None] | TokenRows:
        leaves, col, header, fmt = self._layout(meta, path)
        if header and len(ends) and np.all(ends == starts):
            raise SourceError(f"source '{self.source}': LitData chunk {path} stores its items only as an Arrow "
                              f"footer (nested JSON items), which zephon does not read. Store the text as a str "
                              f"leaf (or the ids as a numpy array) and re-optimize.")
        a, b = self.field_ranges(buf, starts, ends, [None] * leaves, col, header, path, first_row, meta.index)
        if self.raw_bytes:
            return self.raw(buf, a, b)  # type: ignore[return-value]
        name = fmt.split(":", 1)[0]
        if not self.tokens:
            if name in ("str", "text"):
                return self.texts(buf, a, b, path, first_row)
            return self._json_texts(buf, a, b, path, first_row)
        if name in _RAW_IDS:
            dtype = self._int_dtype(name, int(fmt.partition(":")[2]), path)
            return byte_token_rows(buf, a, b, dtype, self.source, path, self.field, first_row)
        if name in ("numpy", "tensor"):
            return self._headed_rows(name, buf, a, b, path, first_row, meta.index)
        return self._json_tokens(buf, a, b, path, first_row)

    def _int_dtype(self, name: str, code: int, path: str, row: int | None = None) -> np.dtype:
        """The numpy dtype of litdata's numpy (``no_header_numpy``, ``numpy``) or torch dtype ``code``;
        only integer dtypes: token ids."""
        # litdata's dtype tables (plain data: index -> numpy / torch dtype)
        constants = optional_import("litdata.constants", self.source, "litdata", "litdata", "formats")
        where = f"{self._name(path)}" + ("" if row is None else f", sample {row}")
        try:
            if name in ("no_header_numpy", "numpy"):
                dtype = np.dtype(constants._NUMPY_DTYPES_MAPPING[code])
            else:
                import torch

                dtype = torch.empty(0, dtype=constants._TORCH_DTYPES_MAPPING[code]).numpy().dtype
        except (KeyError, ValueError, TypeError) as exc:
            raise SourceError(f"{where}: field '{self.field}' names unknown {name} dtype code {code}. The "
                              f"{self.shard_word} or its index is corrupt: re-write the dataset.") from exc
        if dtype.kind not in "iu":
            raise SourceError(f"{where}: field '{self.field}' holds {dtype} values, not integer token ids. Point "
                              f"tokens_field at a token-id array field.")
        return dtype

    def _headed_rows(self, name: str, buf: np.ndarray, a: np.ndarray, b: np.ndarray, path: str, first_row: int,
                     index: str) -> TokenRows:
        """Token ids of ``numpy`` leaves (``uint32 dtype, uint32 ndim, uint32 shape[ndim]``, little-endian)
        or ``tensor`` leaves (the same header big-endian), then the values (little-endian), read flat."""
        order = "<u4" if name == "numpy" else ">u4"
        dtypes, starts = [], np.empty(len(a), dtype=np.int64)
        for k, (x, y) in enumerate(zip(a.tolist(), b.tolist())):
            leaf = f"a {name} field '{self.field}'"
            if y - x < 8:
                self._bad_sample(path, first_row + k, index, f"has {leaf} shorter than its header")
            code, ndim = (int(v) for v in buf[x:x + 8].view(order))
            head = x + 8 + 4 * ndim
            if head > y:
                self._bad_sample(path, first_row + k, index, f"has {leaf} whose header ({ndim} dimensions) runs "
                                                             f"past the field")
            dtype = self._int_dtype(name, code, path, first_row + k)
            count = math.prod(buf[x + 8:head].view(order).tolist())  # Python ints: no overflow
            if count * dtype.itemsize != y - head:
                need = count * dtype.itemsize
                self._bad_sample(path, first_row + k, index, f"has {leaf} whose shape needs {need} bytes of values, "
                                                             f"not {y - head}")
            dtypes.append(dtype)
            starts[k] = head
        one = len(set(dtypes)) <= 1
        return byte_token_rows(buf, starts, b, (dtypes[0] if dtypes else np.dtype(np.int64)) if one else dtypes,
                               self.source, path, self.field, first_row)

    def _json_values(self, buf: np.ndarray, a: np.ndarray, b: np.ndarray, path: str, first_row: int) -> list[Any]:
        out = []
        for k, (x, y) in enumerate(zip(a.tolist(), b.tolist())):
            try:
                out.append(_json_leaf(buf[x:y].tobytes()))
            except (ValueError, struct.error, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
                raise SourceError(f"{self._name(path)}, sample {first_row + k}: json field '{self.field}' cannot "
                                  f"be decoded ({type(exc).__name__}: {exc}). The {self.shard_word} is corrupt: "
                                  f"re-write the dataset.") from exc
        return out

    def _json_texts(self, buf: np.ndarray, a: np.ndarray, b: np.ndarray, path: str, first_row: int) -> list[str | None]:
        values = self._json_values(buf, a, b, path, first_row)
        for k, v in enumerate(values):
            if v is not None and not isinstance(v, str):
                raise SourceError(f"{self._name(path)}, sample {first_row + k}: json field '{self.field}' holds "
                                  f"a {type(v).__name__}, not text. Point text_field at a str field, or use "
                                  f"tokens_field for token ids.")
        return values

    def _json_tokens(self, buf: np.ndarray, a: np.ndarray, b: np.ndarray, path: str, first_row: int) -> TokenRows:
        arrays = []
        for k, v in enumerate(self._json_values(buf, a, b, path, first_row)):
            ok = isinstance(v, (list, np.ndarray))
            arr = np.zeros(0, np.int64)
            if ok and len(v):
                try:
                    arr = np.asarray(v).ravel()
                except ValueError:  # ragged nesting
                    ok = False
                ok = ok and arr.dtype.kind in "iu"
            if not ok:
                raise SourceError(f"{self._name(path)}, sample {first_row + k}: json field '{self.field}' does not "
                                  f"hold a list of integer token ids. Point tokens_field at a token-id array field.")
            arrays.append(arr.astype(np.int64))
        lengths = np.fromiter((x.size for x in arrays), dtype=np.int64, count=len(arrays))
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
        return TokenRows(values, offsets)


# -- litdata's json leaves, decoded by Zephon ----------------------------------------------------------
class _Other:
    """A json leaf of a kind that is neither text nor a list of integers (floats, dicts, records...)."""

    def __init__(self, tag: int) -> None:
        self.tag = tag


def _json_leaf(raw: bytes) -> Any:
    """A ``json`` leaf: JSON text (litdata's legacy form, and its tag 0), or litdata's compact tags for a
    string (7), an integer (8), a list of strings (1) or of int64 (2). Other tags are returned as
    :class:`_Other`, not decoded. Only ``json.loads`` and numpy run on the bytes."""
    if not raw:
        raise ValueError("the leaf is empty")
    tag = raw[0]
    if tag > 0x20:  # legacy: the JSON text itself ('[', '{', '"', digits...)
        return json.loads(raw)
    if tag in (0, 1, 2):
        (n,) = struct.unpack_from("<I", raw, 1)
        body = raw[5:]
        if tag == 0:
            if len(body) != n:
                raise ValueError(f"{len(body)} bytes of JSON, the header says {n}")
            return json.loads(body)
        if tag == 2:
            if len(body) != 8 * n:
                raise ValueError(f"{len(body)} bytes for {n} int64 values")
            return np.frombuffer(body, "<i8").copy()
        out, pos = [], 0
        for _ in range(n):
            (size,) = struct.unpack_from("<I", body, pos)
            out.append(body[pos + 4:pos + 4 + size].decode("utf-8"))
            pos += 4 + size
        if pos != len(body):
            raise ValueError("the list of strings does not fill the leaf")
        return out
    if tag == 7:
        (size,) = struct.unpack_from("<I", raw, 1)
        if len(raw) != 5 + size:
            raise ValueError(f"{len(raw) - 5} bytes of text, the header says {size}")
        return raw[5:].decode("utf-8")
    if tag == 8:
        return struct.unpack("<q", raw[1:])[0]
    return _Other(tag)


# -- data_spec: the item's tree, parsed by Zephon (never by litdata's pytree) ------------------------
def _parse_spec(raw: Any, index: str, source: str) -> tuple[Any, int]:
    """The item structure described by ``config.data_spec`` (litdata's pytree JSON, protocol 1) with its
    leaves numbered in flatten order, and the number of leaves. Dicts become dicts of their keys (as
    strings), sequences lists; a ``collections.defaultdict`` node is a dict (its factory is never
    imported: litdata's own loader imports the module the index names)."""
    def fail(why: str) -> SourceError:
        return SourceError(f"source '{source}': {index}: config.data_spec is not a spec zephon reads ({why}). The "
                           f"index is corrupt or comes from an unknown litdata version: re-write the dataset.")
    try:
        data = json.loads(raw) if isinstance(raw, str) else None
    except (ValueError, RecursionError) as exc:
        raise fail(f"not JSON: {exc}") from exc
    if not (isinstance(data, list) and len(data) == 2 and data[0] == 1 and isinstance(data[1], dict)):
        raise fail("not [1, {type, context, children_spec}]")
    count = 0

    def keys(ctx: Any) -> Any:
        if isinstance(ctx, dict):  # defaultdict: {default_factory_module, default_factory_name, dict_context}
            return ctx.get("dict_context")
        try:
            return json.loads(ctx) if isinstance(ctx, str) else None
        except (ValueError, RecursionError):
            return None

    def node(x: Any, depth: int) -> Any:
        nonlocal count
        if depth > _MAX_DEPTH:
            raise fail(f"nested deeper than {_MAX_DEPTH}")
        if not isinstance(x, dict) or not isinstance(x.get("children_spec"), list):
            raise fail("a node without children_spec")
        typ, kids = x.get("type"), x["children_spec"]
        if typ is None:
            if kids:
                raise fail("a leaf with children")
            count += 1
            return count - 1
        children = [node(kid, depth + 1) for kid in kids]
        if typ in ("builtins.dict", "collections.OrderedDict", "collections.defaultdict"):
            names = keys(x.get("context"))
            if not isinstance(names, list) or len(names) != len(children) or \
                    not all(isinstance(k, (str, int, float, bool)) or k is None for k in names):
                raise fail(f"the keys of a {typ} node do not match its children")
            return {str(k): c for k, c in zip(names, children)}
        if typ in ("builtins.list", "builtins.tuple", "collections.deque", "collections.namedtuple"):
            return children
        raise fail(f"node type {str(typ)[:80]!r}")

    tree = node(data[1], 0)
    return tree, count


def _leaf(tree: Any, field: str) -> int | None:
    """Index of the leaf at ``field`` (dotted path into nested dicts); a bare leaf is every field."""
    if isinstance(tree, int):
        return tree
    node = tree
    for part in field.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, int) else None


def _paths(tree: Any, prefix: str = "") -> list[str]:
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in _paths(v, f"{prefix}{k}.")]
    if isinstance(tree, list):
        return [p for k, v in enumerate(tree) for p in _paths(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".") or "<item>"]

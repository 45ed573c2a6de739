"""LitData optimized datasets (chunks + ``index.json``, as ``litdata.optimize`` writes them).

Layout (litdata ``streaming/writer.py``): ``index.json`` is ``{"chunks": [{"filename", "chunk_size",
"chunk_bytes", "dim"}, ...], "config": {"data_format", "data_spec", "item_loader", "compression",
"encryption", ...}}``; a chunk is ``uint32 n | uint32 offsets[n+1] | items``. With the default
``PyTreeLoader`` an item is ``uint32 size of each leaf | each leaf's bytes``, leaves in the order of the
flattened ``data_spec`` (so a dict item ``{"text": ..., "input_ids": ...}`` has one leaf per key);
with ``TokensLoader`` an item is one token array's raw bytes. Either way an item is one document.

Text comes from a ``str`` leaf; token ids from a ``no_header_numpy`` / ``no_header_tensor`` leaf
(decoded with numpy over the whole chunk) or any other array leaf litdata can deserialize (``numpy``,
``tensor``, ``json`` lists: decoded by litdata's own serializers, one document at a time). The field is
the item's key (dotted for nested dicts); an item that is a bare array (``TokensLoader``) is its own
field. Compressed chunks (``compression="zstd"``, at every ``compression_level``: ``"batch"`` zstd
frames, the default, ``"sample"`` or ``"chunk"``) are decompressed whole with litdata's own codecs,
once per process; encrypted chunks and Arrow-only nested chunks are refused with a message. Needs
the ``litdata`` package (``pip install 'zephon[formats]'``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import SourceError, TokenRows
from .indexed import IndexedReader, ShardMeta
from .tokens import byte_token_rows

_LOADERS = ("PyTreeLoader", "TokensLoader")


def _litdata(source: str) -> Any:
    try:
        import litdata.constants as constants
        import litdata.streaming.serializers as serializers
        import litdata.utilities._pytree as pytree
    except ImportError as exc:
        raise SourceError(f"source '{source}': format 'litdata' needs the litdata package "
                          f"(pip install 'zephon[formats]'): {exc}") from exc
    return constants, serializers, pytree


def _codecs(source: str) -> Any:
    try:
        import litdata.streaming.compression as compression
        import litdata.streaming.framed_zstd as framed
    except ImportError as exc:
        raise SourceError(f"source '{source}': compressed LitData chunks need the litdata package "
                          f"(pip install 'zephon[formats]'): {exc}") from exc
    return compression, framed


class LitDataReader(IndexedReader):
    """Reads one leaf (text or token ids) of the items of LitData chunks."""

    kind = "litdata"
    label = "LitData"
    shard_word = "chunk"
    exact_end = False  # chunks of JSON-typed items may end with an Arrow footer after the items

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._layouts: dict[str, tuple[int, int, bool]] = {}

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
        level = config.get("compression_level")
        if config.get("compression") and level not in (None, "chunk", "batch", "sample"):
            raise SourceError(f"source '{source}': {index_path} uses compression_level='{level}', which zephon "
                              f"does not read. Re-optimize with compression_level 'batch', 'sample' or 'chunk'.")
        in_file = bool(config.get("compression")) and level in ("batch", "sample")
        out = []
        for k, chunk in enumerate(data["chunks"]):
            try:
                size = None if chunk.get("chunk_bytes") is None else int(chunk["chunk_bytes"])
                # chunk_bytes is the decoded size for whole-file compression, the stored size otherwise
                out.append(ShardMeta(name=chunk["filename"], samples=int(chunk["chunk_size"]),
                                     nbytes=None if in_file else size, stored_bytes=size if in_file else None,
                                     compression=config.get("compression") or None, index=index_path,
                                     info=config))
            except (KeyError, TypeError, ValueError) as exc:
                raise SourceError(f"source '{source}': {index_path}, chunk #{k}: not a valid LitData chunk entry "
                                  f"({type(exc).__name__}: {exc}). The index is corrupt: re-write the "
                                  f"dataset.") from exc
        return out

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

    # -- the item layout --------------------------------------------------------------------------
    def _layout(self, meta: ShardMeta, path: str) -> tuple[int, int, bool]:
        """(number of leaves, index of the field's leaf, whether items have a size header)."""
        if meta.index not in self._layouts:
            config = meta.info
            formats = config.get("data_format") or []
            if config["item_loader"] == "TokensLoader":
                if not self.tokens:
                    raise SourceError(f"source '{self.source}': {meta.index} holds token chunks (TokensLoader); "
                                      f"read them with tokens_field (any name), not text_field.")
                self._layouts[meta.index] = (1, 0, False)
            else:
                _, _, pytree = _litdata(self.source)
                try:
                    spec = pytree.treespec_loads(config["data_spec"])
                    tree = pytree.tree_unflatten(list(range(len(formats))), spec)
                except Exception as exc:
                    raise SourceError(f"source '{self.source}': cannot parse the data_spec of {meta.index} "
                                      f"({type(exc).__name__}: {exc}). The index is corrupt.") from exc
                leaf = _leaf(tree, self.field)
                if leaf is None:
                    raise self.missing_field(path, _paths(tree))
                self._layouts[meta.index] = (len(formats), leaf, True)
        return self._layouts[meta.index]

    def decode(self, meta: ShardMeta, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, path: str,
               first_row: int) -> list[str | None] | TokenRows:
        leaves, col, header = self._layout(meta, path)
        fmt = meta.info["data_format"][col]
        if header and len(ends) and np.all(ends == starts):
            raise SourceError(f"source '{self.source}': LitData chunk {path} stores its items only as an Arrow "
                              f"footer (nested JSON items), which zephon does not read. Store the text as a str "
                              f"leaf (or the ids as a numpy array) and re-optimize.")
        a, b = self.field_ranges(buf, starts, ends, [None] * leaves, col, header, path, first_row, meta.index)
        name = fmt.split(":", 1)[0]
        if not self.tokens:
            if name == "str":
                return self.texts(buf, a, b, path, first_row)
            values = self._deserialize(fmt, buf, a, b)
            if not all(isinstance(v, str) for v in values):
                raise SourceError(f"source '{self.source}': field '{self.field}' of LitData chunk {path} holds "
                                  f"'{fmt}' items, not text. Point text_field at a str field, or use tokens_field "
                                  f"for token ids.")
            return values
        if name in ("no_header_numpy", "no_header_tensor"):
            dtype = self._dtype(fmt, path)
            return byte_token_rows(buf, a, b, dtype, self.source, path, self.field, first_row)
        if name in ("str", "text", "int", "float", "bool", "bytes"):
            raise SourceError(f"source '{self.source}': field '{self.field}' of LitData chunk {path} holds '{fmt}' "
                              f"items, not token-id arrays. Point tokens_field at an array field, or use "
                              f"text_field for text.")
        arrays = [np.asarray(v.numpy() if hasattr(v, "numpy") else v).ravel()
                  for v in self._deserialize(fmt, buf, a, b)]
        if any(x.dtype.kind not in "iu" for x in arrays if x.size):
            raise SourceError(f"source '{self.source}': field '{self.field}' of LitData chunk {path} does not hold "
                              f"integer token ids ('{fmt}'). Point tokens_field at a token-id array field.")
        lengths = np.fromiter((x.size for x in arrays), dtype=np.int64, count=len(arrays))
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.concatenate([x.astype(np.int64) for x in arrays]) if arrays else np.zeros(0, np.int64)
        return TokenRows(values, offsets)

    def _dtype(self, fmt: str, path: str) -> np.dtype:
        constants, _, _ = _litdata(self.source)
        name, _, code = fmt.partition(":")
        try:
            if name == "no_header_numpy":
                dtype = np.dtype(constants._NUMPY_DTYPES_MAPPING[int(code)])
            else:
                import torch

                dtype = torch.empty(0, dtype=constants._TORCH_DTYPES_MAPPING[int(code)]).numpy().dtype
        except (KeyError, ValueError, TypeError) as exc:
            raise SourceError(f"source '{self.source}': LitData chunk {path}: unknown data format '{fmt}'.") from exc
        if dtype.kind not in "iu":
            raise SourceError(f"source '{self.source}': field '{self.field}' of LitData chunk {path} holds {dtype} "
                              f"values, not integer token ids. Point tokens_field at a token-id array field.")
        return dtype

    def _deserialize(self, fmt: str, buf: np.ndarray, a: np.ndarray, b: np.ndarray) -> list[Any]:
        """Leaves decoded by litdata's own serializer for ``fmt``, one per document."""
        _, serializers, _ = _litdata(self.source)
        table = serializers._get_serializers(None)
        name, _, sub = fmt.partition(":")
        key = sub if sub in table else name
        if key not in table:
            raise SourceError(f"source '{self.source}': LitData data format '{fmt}' is unknown to litdata "
                              f"{getattr(serializers, '__version__', '')}.")
        ser = table[key]
        if ":" in fmt and hasattr(ser, "setup"):
            ser.setup(fmt)
        return [ser.deserialize(buf[x:y].tobytes()) for x, y in zip(a.tolist(), b.tolist())]


def _leaf(tree: Any, field: str) -> int | None:
    """Index of the leaf at ``field`` (dotted path into nested dicts); a bare leaf is every field."""
    if isinstance(tree, int):
        return tree
    node = tree
    for part in field.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, int) else None


def _paths(tree: Any, prefix: str = "") -> list[str]:
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in _paths(v, f"{prefix}{k}.")]
    if isinstance(tree, (list, tuple)):
        return [p for k, v in enumerate(tree) for p in _paths(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".") or "<item>"]

"""Where each record of a batch comes from: the provenance a pipeline records on request.

``batch(provenance=True)`` adds a ``provenance`` tensor to every batch, one row per packed segment (a
document, or a piece of one) or per record row, with the columns of :data:`PROVENANCE_COLUMNS`:

- ``row``: the segment's row in the *global* batch (lane ``l``'s rows are ``l * rows_per_lane ...``), so
  the ranks' tensors, concatenated in rank order, are the one-rank tensor at every world size;
- ``segment``: its index among its row's segments (the ``segment_ids`` value less one);
- ``source``: the source's index in the pipeline (``pipeline.sources[i].name``);
- ``file``: the id of the file it was read from (:func:`file_id` of its path relative to the source's
  root, :func:`source_root`): the same under any re-listing, on any machine the data is mounted on;
- ``record``: where its record starts in that file, in the reader's coordinate (a row number for Parquet,
  Arrow, Lance and HF, a byte offset for plain JSON Lines, a line for compressed ones, a sample for
  WebDataset, MDS and LitData);
- ``token_start``, ``token_end``: the segment's tokens within its record's document (``[0, n)`` for a
  whole document; a piece cut by ``split`` or by a row's end covers part of it); for a record row of a
  pipeline without tokens, ``0, 0``.

A value of -1 means unknown: a document an accumulator of yours rebuilt as a plain ``dict`` keeps no origin.
A row of padding (the end of finite data, ``partial="pad"``) has one entry of its own, every column but
``row`` -1, so that every row of a batch has an entry and the rows of a slice of the batch can be found
(:func:`zephon.select_rows`).

Inside the engine a record's origin travels as ``(file_id, record, token_start)``: per record in a
:class:`~zephon.records.Chunk` (``origin``, an ``[n, 2]`` array, and the chunk's ``file_id``), per document
(:attr:`~zephon.records.Doc.origin`) and per packed segment (:attr:`~zephon.records.Row.origins`). Nothing
is computed when provenance is off.
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Sequence

import numpy as np

PROVENANCE_KEY = "provenance"
PROVENANCE_COLUMNS = ("row", "segment", "source", "file", "record", "token_start", "token_end")
"""The columns of a batch's ``provenance`` tensor, in order (see the module docstring)."""
UNKNOWN = -1
_GLOB = "*?["


def file_id(relative_path: str) -> int:
    """The id of a file in provenance: the first 63 bits of the SHA-256 of its path relative to its
    source's root (a non-negative int64).

    Args:
        relative_path: the path as :func:`relative_file` gives it (``/``-separated).

    Returns:
        An integer in ``[0, 2**63)``; two files of one source collide with probability about ``n**2 / 2**64``.
    """
    return int.from_bytes(hashlib.sha256(relative_path.encode("utf-8", "surrogatepass")).digest()[:8], "big") >> 1


def _split_protocol(path: str) -> tuple[str, str]:
    if "://" in path:
        proto, rest = path.split("://", 1)
        return proto + "://", rest
    return "", path


def pattern_root(pattern: str, is_dir: bool) -> str:
    """The folder a source path names its files from: the pattern itself for a folder, its parent for a file,
    and for a glob the folder before its first wildcard.

    Args:
        pattern: a source path as listed (absolute, or a URL).
        is_dir: whether ``pattern`` (without wildcards) is a folder.

    Returns:
        The folder, without a trailing ``/`` (a bare ``/`` stays ``/``).
    """
    proto, rest = _split_protocol(pattern)
    cut = min((rest.find(c) for c in _GLOB if c in rest), default=-1)
    if cut >= 0:
        rest = rest[:cut].rsplit("/", 1)[0] if "/" in rest[:cut] else ""
    elif not is_dir:
        rest = posixpath.dirname(rest.rstrip("/"))
    rest = rest.rstrip("/") or ("/" if rest.startswith("/") else "")
    return proto + rest


def source_root(roots: Sequence[str]) -> str:
    """The common folder of a source's paths' roots (:func:`pattern_root` of each): what provenance names
    files relative to. It depends on the declared paths only, so re-listing (files added, removed, listed in
    another order) never changes a file's id."""
    if len(roots) == 1:
        return roots[0]
    protos = {_split_protocol(r)[0] for r in roots}
    if len(protos) != 1:
        return ""
    proto = protos.pop()
    parts = [_split_protocol(r)[1].split("/") for r in roots]
    common: list[str] = []
    for names in zip(*parts):
        if len(set(names)) != 1:
            break
        common.append(names[0])
    return proto + ("/".join(common) or ("/" if parts[0][:1] == [""] else ""))


def relative_file(path: str, root: str) -> str:
    """``path`` relative to ``root`` (``/``-separated); ``path`` itself where it is not below ``root``."""
    if not root:
        return path
    prefix = root if root.endswith("/") else root + "/"
    return path.removeprefix(prefix)


def read_origin(start_cursor: int, next_cursors: np.ndarray) -> np.ndarray:
    """The origin of each record of a chunk as read: ``[n, 2]`` int64 of (where the record starts, token 0).

    A record starts where the one before it ended (the reader reports the cursor after each record, and
    every record of the chunk is reported, null ones included), the first at the chunk's start."""
    n = len(next_cursors)
    out = np.zeros((n, 2), dtype=np.int64)
    if n:
        out[0, 0] = start_cursor
        out[1:, 0] = next_cursors[:-1]
    return out


def coordinate(fmt: str, path: str) -> str:
    """What a record cursor counts in a file of format ``fmt``: ``"row"`` (Parquet, Arrow, Vortex, Lance, HF,
    in-memory tables), ``"byte"`` (plain JSON Lines), ``"line"`` (compressed JSON Lines) or ``"sample"``
    (WebDataset, MDS, LitData)."""
    if fmt == "jsonl":
        from .readers.jsonl import compression_of

        return "line" if compression_of(path) else "byte"
    return "row" if fmt in ("parquet", "vortex", "lance", "arrow", "hf", "memory") else "sample"

"""Pre-tokenized columns: token-id lists as one flat array plus offsets, never a per-token Python loop.

Readers of pre-tokenized sources (``tokens_field``) turn what they read into :class:`TokenRows`:
Arrow list columns (Parquet, Vortex) through :func:`arrow_token_rows`, per-document byte ranges
(MDS, LitData) through :func:`byte_token_rows`. The worker then frames the rows with BOS/EOS and
checks them against the vocabulary (:mod:`zephon.pretokenized`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .base import TokenRows
from ..errors import SourceError

_LIST_TYPES = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list, pa.types.is_list_view,
               pa.types.is_large_list_view)


def is_token_list_type(t: pa.DataType) -> bool:
    """A list of integers (any list flavour Arrow has)."""
    return any(check(t) for check in _LIST_TYPES) and pa.types.is_integer(t.value_type)


def arrow_token_rows(col: pa.Array, source: str, path: str, field: str, first_row: int) -> TokenRows:
    """Rows of an Arrow list-of-integers column (``first_row``: the file row of ``col[0]``, for messages)."""
    if not is_token_list_type(col.type):
        raise SourceError(f"source '{source}': column '{field}' of {path} has type {col.type}, not a list of "
                          f"integer token ids. Point tokens_field at a token-id column (list<int32> or similar), "
                          f"or use text_field for a text column.")
    if pa.types.is_list_view(col.type) or pa.types.is_large_list_view(col.type):
        col = col.cast(pa.large_list(col.type.value_type))
    lengths = pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    values = col.flatten()  # honours slicing; drops values behind null slots
    if values.null_count:
        bad = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        row = int(np.searchsorted(np.cumsum(lengths), bad, side="right"))
        raise SourceError(f"source '{source}': {path}, row {first_row + row}: column '{field}' holds a null token "
                          f"id. Fix or remove that row.")
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    valid = None
    if col.null_count:
        valid = col.is_valid().to_numpy(zero_copy_only=False)
    return TokenRows(values.to_numpy(zero_copy_only=False), offsets, valid)


def byte_token_rows(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, dtypes: Sequence[np.dtype] | np.dtype,
                    source: str, path: str, field: str, first_row: int) -> TokenRows:
    """Rows stored as raw little-endian ids in byte ranges ``[starts[k], ends[k])`` of ``buf`` (uint8).

    One vectorised gather when all rows share a dtype (the usual case); a row whose byte length is not a
    multiple of its dtype's size is an error naming the file and row."""
    n = len(starts)
    if isinstance(dtypes, np.dtype):
        dtypes = [dtypes] * n
    itemsize = np.fromiter((d.itemsize for d in dtypes), dtype=np.int64, count=n)
    nbytes = (ends - starts).astype(np.int64)
    odd = np.flatnonzero(nbytes % np.maximum(itemsize, 1))
    if len(odd):
        k = int(odd[0])
        raise SourceError(f"source '{source}': {path}, row {first_row + k}: field '{field}' holds {nbytes[k]} bytes, "
                          f"not a whole number of {dtypes[k]} token ids. The file is corrupt or the field is not "
                          f"a token-id array.")
    lengths = nbytes // np.maximum(itemsize, 1)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if n == 0:
        return TokenRows(np.zeros(0, np.int64), offsets)
    first = np.dtype(dtypes[0]).newbyteorder("<")
    if all(np.dtype(d) == dtypes[0] for d in dtypes):
        total = int(nbytes.sum())
        # Byte index of every value byte: a run [starts[k], ends[k]) per row, built without a Python loop.
        run_starts = np.repeat(starts.astype(np.int64) - np.concatenate([[0], np.cumsum(nbytes)[:-1]]), nbytes)
        idx = run_starts + np.arange(total, dtype=np.int64)
        values = buf[idx].view(first)
    else:  # dynamic dtypes (MDS "ndarray" without a fixed dtype): one view per row
        values = np.concatenate([buf[a:b].view(np.dtype(d).newbyteorder("<")).astype(np.int64)
                                 for a, b, d in zip(starts.tolist(), ends.tolist(), dtypes)])
    return TokenRows(values, offsets)

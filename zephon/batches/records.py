"""Turn a rank's record rows (a pipeline without ``pack()``) into the batch dict.

Keys: every field the records carry, one value per row in lane order, plus ``valid`` (bool ``[B]``:
False on a row of padding, ``batch(partial="pad")``). A field named in ``batch(stack=[...])`` becomes
one tensor (numpy ``stack`` of its values: every record must carry it, with one shape and dtype); every
other field is a list (``None`` where a record lacks it). Which fields are tensors is the pipeline's
choice, never the data's, so a field hashes the same on every world size
(:func:`zephon.collate.global_digest`).

Example: rows of ``{"image": <uint8 [224, 224, 3]>, "txt": "a cat"}`` and ``stack=["image"]`` give
``{"image": uint8 [B, 224, 224, 3], "txt": ["a cat", ...], "valid": bool [B]}``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ..ops.batch import RecordBlock, RecordRow, RecordSpan
from .buffers import UNPOOLED, BatchBuffers

VALID = "valid"  # the padding mask's key


class CollateError(ValueError):
    """A record that cannot be batched as the pipeline asks (a stacked field missing or of another shape)."""


def collate_records(rows: Sequence[RecordRow], stack: Sequence[str] = (),
                    buffers: BatchBuffers = UNPOOLED) -> dict[str, Any]:
    if type(rows) is RecordBlock:
        return join_rows(rows, stack, buffers)
    records = [row.record for row in rows]
    real = [rec for rec in records if rec is not None]
    keys = list(dict.fromkeys(k for rec in real for k in rec))
    _check_fields(keys, stack, bool(real))
    batch: dict[str, Any] = {}
    for key in keys:
        if key in stack:
            batch[key] = torch.from_numpy(_stacked(key, records, real, buffers))
        else:
            batch[key] = [None if rec is None else rec.get(key) for rec in records]
    batch[VALID] = torch.tensor([rec is not None for rec in records], dtype=torch.bool)
    return batch


def join_rows(block: RecordBlock, stack: Sequence[str] = (), buffers: BatchBuffers = UNPOOLED) -> dict[str, Any]:
    """:func:`collate_records` of a :class:`~zephon.ops.batch.RecordBlock` (the batched record-rows path),
    joined by column: each span's values of a field as one slice of its chunk's column, the padding mask
    with numpy. The same batch, key for key and byte for byte, as the rows one by one."""
    parts = block.parts
    n = len(block)
    keys: dict[str, None] = {}
    real = 0
    for p in parts:
        if type(p) is RecordSpan:
            keys.update(dict.fromkeys(p.fields()))
            real += len(p)
        elif type(p) is not int and p.record is not None:
            keys.update(dict.fromkeys(p.record))
            real += 1
    keys_list = list(keys)
    _check_fields(keys_list, stack, real > 0)
    valid = np.ones(n, dtype=bool)
    at = 0
    for p in parts:
        size = p if type(p) is int else len(p) if type(p) is RecordSpan else 1
        if type(p) is int or (type(p) is not RecordSpan and p.record is None):
            valid[at:at + size] = False
        at += size
    batch: dict[str, Any] = {}
    for key in keys_list:
        column: list[Any] = []
        for p in parts:
            if type(p) is RecordSpan:
                column.extend(p.column(key) if key in p.fields() else [None] * len(p))
            elif type(p) is int:
                column.extend([None] * p)
            else:
                column.append(None if p.record is None else p.record.get(key))
        if key in stack:
            if _lacks(parts, key):
                raise _missing(key)
            values = column if real == n else [v for v, ok in zip(column, valid.tolist()) if ok]
            batch[key] = torch.from_numpy(_filled(key, values, n, None if real == n else valid, buffers))
        else:
            batch[key] = column
    batch[VALID] = torch.from_numpy(valid)
    return batch


def _check_fields(keys: list[str], stack: Sequence[str], any_record: bool) -> None:
    """Refuse a batch's fields: one named like the padding mask, or a stacked field no record of it has."""
    if VALID in keys:
        raise CollateError(f"a record has a field {VALID!r}, which the batch uses for its padding mask; rename it "
                           f"with a map() before batch()")
    for name in stack:
        if name not in keys and any_record:
            raise CollateError(f"batch(stack=[{name!r}]): no record of this batch has a field {name!r} (fields: "
                               f"{keys}); name one of them, or check the operator that should make it")


def _lacks(parts: Sequence[Any], key: str) -> bool:
    """Whether a record of ``parts`` has no field ``key`` (a stacked field every record must carry)."""
    for p in parts:
        if type(p) is RecordSpan:
            if key not in p.fields():
                return True
        elif type(p) is not int and p.record is not None and key not in p.record:
            return True
    return False


def _missing(key: str) -> CollateError:
    return CollateError(f"batch(stack=[{key!r}]): a record has no field {key!r}; every record must carry a "
                       f"stacked field (drop the others with a filter, or leave {key!r} out of stack)")


def _stacked(key: str, records: list, real: list, buffers: BatchBuffers) -> np.ndarray:
    """``np.stack`` of the records' values of ``key`` (zeros on padding rows), each value copied once,
    straight into the batch: a list of arrays (``images``) is not first made an array of its own. Every
    other value goes through ``np.asarray`` (no copy for an array) and the checks below. The batch is
    memory from ``buffers`` (:mod:`zephon.batch_buffers`)."""
    try:
        values = [rec[key] for rec in real]
    except KeyError:
        raise _missing(key) from None
    whole = len(real) == len(records)
    valid = None if whole else np.array([rec is not None for rec in records], dtype=bool)
    return _filled(key, values, len(records), valid, buffers)


def _filled(key: str, values: list, n: int, valid: np.ndarray | None, buffers: BatchBuffers) -> np.ndarray:
    """The ``[n, ...]`` array of ``values`` (one per real row; ``valid`` marks them, None: all are), zeros on
    padding rows, in memory from ``buffers``."""
    first = np.asarray(values[0])
    if first.dtype.kind not in "biufc":
        raise CollateError(f"batch(stack=[{key!r}]): records carry {key!r} as {type(values[0]).__name__} "
                           f"({first.dtype}), not numbers; only numeric arrays and scalars stack into a tensor "
                           f"(leave {key!r} out of stack to get a list)")
    shape, dtype = first.shape, first.dtype
    out = buffers.empty((n, *shape), dtype)
    rows = range(n) if valid is None else np.flatnonzero(valid).tolist()
    if valid is not None:
        out[np.flatnonzero(~valid).tolist()] = 0  # padding rows
    for i, value in zip(rows, values):
        if type(value) in (list, tuple) and len(shape) and len(value) == shape[0] and all(
                type(v) is np.ndarray and v.shape == shape[1:] and v.dtype == dtype for v in value):
            for j, v in enumerate(value):  # a list of arrays: each straight into its place
                out[i, j] = v
        else:  # np.asarray of an array is the array itself: one copy, into the batch
            out[i] = _checked(key, np.asarray(value), first)
    return out


def _checked(key: str, v: np.ndarray, first: np.ndarray) -> np.ndarray:
    if v.shape != first.shape or v.dtype != first.dtype:
        if object in (v.dtype, first.dtype):  # None among the values: a skipped image keeps its record's place
            raise CollateError(f"batch(stack=[{key!r}]): a record's {key!r} holds None (an image that could not "
                               f"be decoded, kept in its place by decode_images(on_bad_image='skip')); drop such "
                               f"records with on_bad_image='drop_record', or leave {key!r} out of stack")
        raise CollateError(f"batch(stack=[{key!r}]): records carry {key!r} as {first.dtype}{list(first.shape)} "
                           f"and {v.dtype}{list(v.shape)}; a stacked field needs one shape and dtype (resize "
                           f"images to one size, e.g. decode_images(size=...), or leave {key!r} out of stack)")
    return v

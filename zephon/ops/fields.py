"""Per-token fields: how a declaration becomes a field of the packed rows, and the check that what your
operators make fits those rows as it is.

A per-token field (``input_ids``, ``loss_mask``, one a ``map`` declares with ``token_fields={name: default}``)
has one value per token and is packed side by side with ``input_ids``. Its default sets its dtype in the rows
(:func:`token_field`). Packing writes values into the rows' buffers, and numpy would cast whatever it is
given: a float id truncated, an id past 2**31 wrapped, 0.5 in an int32 field made 0. So in a pipeline that
packs, the engine checks what each of *your* operators makes (``map``, ``flat_map``, ``map_batch``, your
``Transform`` and accumulator; the built-ins' output fits by construction): ``input_ids`` integers in
``[0, 2**31)``; every other declared field's values representable in its dtype (integers exactly, floats
within its range, rounded to its precision); and, after the merge, one value per token (before it
:func:`zephon.records.columns_from_records` checks that). Without ``pack()`` records become rows as they
are, and nothing is checked here. The engine calls these (:class:`zephon.engine.stages.StageProgram`,
:class:`zephon.engine.nodes.TransformStep`, :meth:`zephon.ops.accumulate.Accumulate.make_checked`); your
operator objects are not changed or copied for it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from ..errors import OperatorError, SourceError
from ..records import INPUT_IDS, Chunk, TokenColumn

MAX_TOKEN_ID = 2 ** 31 - 1
"""The largest id a packed row holds (its ``input_ids`` buffer is int32)."""

Fields = Mapping[str, "tuple[np.dtype, Any]"]
"""The pipeline's per-token fields: name -> (dtype in the rows, default), ``input_ids`` first."""


def token_field(default: Any) -> tuple[np.dtype, Any]:
    """The dtype and default of a declared per-token field.

    Args:
        default: what ``token_fields`` declares: a ``(dtype, default)`` pair, or a default whose kind gives
            the dtype (a bool: uint8; a float: float32; else int32).

    Returns:
        ``(dtype, default)``.
    """
    if isinstance(default, tuple):
        return np.dtype(default[0]), default[1]
    if isinstance(default, (bool, np.bool_)):
        return np.dtype(np.uint8), int(default)
    if isinstance(default, float):
        return np.dtype(np.float32), default
    return np.dtype(np.int32), default


def check_chunk(op: Any, chunk: Chunk, rows: Fields) -> None:
    """Check the per-token fields of a chunk ``op`` made against the rows (before the merge).

    Raises:
        OperatorError: naming the operator, the record (the chunk, for a wrong dtype) and the fix.
    """
    def where(k: int | None) -> str:
        if k is None or chunk.offsets is None:
            return chunk.path
        return chunk.where(int(np.searchsorted(chunk.offsets, k, "right")) - 1)

    for name, values in chunk.token_fields.items():
        if name in rows:
            _check(op, name, values, rows[name][0], where)


def check_source_ids(chunk: Chunk) -> None:
    """Token ids read from a data file (a pre-tokenized source, ``tokens_field="input_ids"``) in a pipeline that
    packs: integers in ``[0, 2**31)``. The file is untrusted: -100 would be packed as a token, 2**33 + 7 as 7.
    (``tokenize`` checks such ids against its vocabulary.)

    Raises:
        SourceError: naming the file, the record, the value and the fix.
    """
    col = chunk.columns.get(INPUT_IDS)
    if not isinstance(col, TokenColumn) or not len(col.values):
        return
    values = col.values
    if values.dtype.kind not in "iu":
        raise SourceError(f"source '{chunk.source_name}': {chunk.path}: the token ids (input_ids) are {values.dtype} "
                          f"values, not integers. Write the tokenizer's integer ids, or read the text and tokenize it.")
    if int(values.min()) >= 0 and int(values.max()) <= MAX_TOKEN_ID:
        return
    k = int(np.flatnonzero((values < 0) | (values > MAX_TOKEN_ID))[0])
    j = int(np.searchsorted(col.offsets, k, "right")) - 1
    raise SourceError(f"source '{chunk.source_name}': {chunk.where(j)}: the token id {int(values[k])} (input_ids) is "
                      f"outside [0, 2**31), which packed rows hold (as int32). Token ids in a data file must be the "
                      f"tokenizer's ids: fix the file, or read its text and tokenize it.")


def check_record(op: Any, record: Any, rows: Fields, where: str) -> None:
    """Check one record ``op`` made in the lane against the rows: one value per token, each representable.

    Raises:
        OperatorError: naming the operator, the field and the fix.
    """
    if not isinstance(record, Mapping):
        return
    ids = record.get(INPUT_IDS)
    for name, (dtype, _) in rows.items():
        values = record.get(name)
        if values is None:
            continue
        if ids is not None and len(values) != len(ids):
            raise OperatorError(f"operator '{op.name}' made {len(values)} values of the per-token field {name!r} for "
                                f"{len(ids)} tokens, on {where}: every per-token field needs one value per token.")
        _check(op, name, values, dtype, lambda k: where)


def _check(op: Any, name: str, values: Any, dtype: np.dtype, where: Callable[[int | None], str]) -> None:
    arr = np.asarray(values)
    if not arr.size:  # nothing to hold (and [] is float64 to numpy)
        return
    if name == INPUT_IDS:
        lo, hi = 0, MAX_TOKEN_ID
        fix = ("Token ids must be integers in [0, 2**31) (rows hold them as int32); return an integer array of the "
               "tokenizer's ids (labels such as -100 belong in a loss_mask, not in input_ids).")
        fits_kind = arr.dtype.kind in "iu"
    else:
        if np.can_cast(arr.dtype, dtype, "safe"):
            return
        fix = (f"Its rows hold {dtype} (the dtype of its declared default); declare the default in the values' "
               f"kind, e.g. token_fields={{{name!r}: 1.0}} for float32, or a (dtype, default) pair such as "
               f"({arr.dtype.name!r}, 0).")
        if dtype.kind == "f" and arr.dtype.kind in "iubf":  # into a float: rounded at most, never out of range
            info = np.finfo(dtype)
            bad = (np.isfinite(arr) & (np.abs(arr) > info.max)) if arr.dtype.kind == "f" else \
                np.abs(arr.astype(np.float64)) > 2.0 ** (info.nmant + 1)  # integers beyond it would change
            if not bad.any():
                return
            k = int(np.flatnonzero(bad)[0])
            raise OperatorError(f"operator '{op.name}' made {name} that packed rows cannot hold as they are, on "
                                f"{where(k)}: the value {arr[k].item()}. {fix}")
        fits_kind = arr.dtype.kind in "iub" and dtype.kind in "iub"
        info_i = np.iinfo(dtype) if fits_kind and dtype.kind != "b" else None
        lo, hi = (info_i.min, info_i.max) if info_i is not None else (0, 1)  # a bool field: 0 and 1
    if not fits_kind:
        got, k = (f"{arr.dtype} values" if arr.dtype != object else "values that are not one numeric array"), None
    else:
        if lo <= int(arr.min()) and int(arr.max()) <= hi:
            return
        k = int(np.flatnonzero((arr < lo) | (arr > hi))[0])
        got = f"the value {int(arr[k])}"
    raise OperatorError(f"operator '{op.name}' made {name} that packed rows cannot hold as they are, on {where(k)}: "
                        f"{got}. {fix}")

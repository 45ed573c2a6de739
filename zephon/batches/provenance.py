"""The ``provenance`` tensor of a batch (``batch(provenance=True)``; the columns: :mod:`zephon.origins`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..origins import PROVENANCE_COLUMNS, UNKNOWN
from ..records import INPUT_IDS


def provenance_tensor(rows: Sequence[Any], first_row: int, records: bool) -> torch.Tensor:
    """Where each segment of a rank's rows comes from: int64 ``[segments, 7]`` (:data:`PROVENANCE_COLUMNS`).

    Args:
        rows: the rank's rows in lane order (packed :class:`~zephon.records.Row` objects, or record rows).
        first_row: the global row number of ``rows[0]`` (its first lane's first row).
        records: the rows are record rows (a pipeline without ``pack()``).

    Returns:
        The tensor, segments in row order; a row of padding has one entry, every column but ``row`` -1.
    """
    if records:
        recs = [row.record for row in rows]
        n_tokens = [len(r[INPUT_IDS]) if r is not None and INPUT_IDS in r else 0 for r in recs]
        return torch.from_numpy(record_table(recs, first_row, n_tokens))
    return torch.from_numpy(segment_table(rows, first_row))


def segment_table(rows: Sequence[Any], first_row: int) -> np.ndarray:
    """The ``provenance`` tensor's values for a rank's packed rows (:data:`PROVENANCE_COLUMNS`).

    Args:
        rows: the rank's rows in lane order (:class:`~zephon.records.Row`, with ``origins`` recorded).
        first_row: the global row number of ``rows[0]``.

    Returns:
        int64 ``[segments, 7]``, segments in row order.
    """
    table: list[tuple[int, ...]] = []
    for r, row in enumerate(rows):
        if not row.seg_lens:  # a row of padding: one entry, so that every row has one (select_rows)
            table.append((first_row + r, UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN))
            continue
        origins = row.origins if row.origins is not None else [None] * len(row.seg_lens)
        for s, (n, src, origin) in enumerate(zip(row.seg_lens, row.sources, origins)):
            if origin is None:
                table.append((first_row + r, s, src, UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN))
            else:
                table.append((first_row + r, s, src, origin[0], origin[1], origin[2], origin[2] + n))
    return np.asarray(table, dtype=np.int64).reshape(-1, len(PROVENANCE_COLUMNS))


def record_table(records: Sequence[Any], first_row: int, n_tokens: Sequence[int]) -> np.ndarray:
    """The ``provenance`` tensor's values for a rank's record rows: one entry per row that holds a record.

    Args:
        records: each row's record (None: a row of padding).
        first_row: the global row number of the first row.
        n_tokens: each record's tokens (0 for a record without ``input_ids``).

    Returns:
        int64 ``[records, 7]``; ``segment`` is 0.
    """
    table: list[tuple[int, ...]] = []
    for r, (rec, n) in enumerate(zip(records, n_tokens)):
        if rec is None:  # a row of padding: one entry of its own, as for packed rows
            table.append((first_row + r, UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN))
            continue
        origin = getattr(rec, "origin", None)
        src = getattr(rec, "source", UNKNOWN)
        if origin is None:
            table.append((first_row + r, 0, src, UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN))
        else:
            table.append((first_row + r, 0, src, origin[0], origin[1], origin[2], origin[2] + n))
    return np.asarray(table, dtype=np.int64).reshape(-1, len(PROVENANCE_COLUMNS))

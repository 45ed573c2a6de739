"""``map_batch(fn)``: ``fn(columns) -> columns`` over a chunk of records at once (a dict of equal-length lists).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..records import Chunk
from ._function import FunctionTransform, keep_doc


class MapBatch(FunctionTransform):
    """``fn(columns) -> columns``: a vectorised map over a chunk's columns (a dict of lists or arrays,
    one entry per record); it must return as many records as it was given."""

    op = "map_batch"

    def _apply_chunk(self, chunk: Chunk) -> Chunk:
        columns = {**chunk.columns, **chunk.token_columns()}
        records = self._records(columns, chunk.n, f"the chunk of source '{chunk.source_name}' at {chunk.where(0)} "
                                                   f"({chunk.n} records)")
        return self._rebuild(chunk, records)

    def _apply_records(self, records: list[Any]) -> list[Any]:
        if not records:
            return []
        keys = list(dict.fromkeys(k for r in records for k in r))
        made = self._records({k: [r.get(k) for r in records] for k in keys}, len(records), "a record in the lane")
        return [keep_doc(old, new) for old, new in zip(records, made)]

    def _records(self, columns: dict[str, Any], n: int, where: str) -> list[dict[str, Any]]:
        """``fn(columns)`` as ``n`` records, checked: a dict of columns of ``n`` entries each (after the merge too,
        where a shorter column silently dropped records)."""
        try:
            new = self.fn(columns)
        except Exception as exc:  # noqa: BLE001 - a user function may raise anything
            raise self._failed(exc, where) from exc
        if not isinstance(new, Mapping):
            raise self._failed(TypeError(f"map_batch must return a dict of columns, got {type(new).__name__}"), where)
        bad = {k: len(v) for k, v in new.items() if len(v) != n}
        if bad:
            raise self._failed(ValueError(f"columns {bad} do not have {n} entries (one per record)"), where)
        return [dict(zip(new, vals)) for vals in zip(*new.values())] if new else [{} for _ in range(n)]

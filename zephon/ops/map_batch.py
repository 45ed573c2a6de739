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
        try:
            new = self.fn(columns)
        except Exception as exc:  # noqa: BLE001
            raise self._failed(exc, f"the chunk of source '{chunk.source_name}' at {chunk.where(0)} "
                                    f"({chunk.n} records)") from exc
        if not isinstance(new, Mapping):
            raise self._failed(TypeError(f"map_batch must return a dict of columns, got {type(new).__name__}"),
                               chunk.where(0))
        bad = {k: len(v) for k, v in new.items() if len(v) != chunk.n}
        if bad:
            raise self._failed(ValueError(f"columns {bad} do not have {chunk.n} entries (one per record)"),
                               chunk.where(0))
        records = [dict(zip(new, vals)) for vals in zip(*new.values())] if new else [{} for _ in range(chunk.n)]
        return self._rebuild(chunk, records)

    def _apply_records(self, records: list[Any]) -> list[Any]:
        if not records:
            return []
        keys = list(dict.fromkeys(k for r in records for k in r))
        new = self.fn({k: [r.get(k) for r in records] for k in keys})
        return [keep_doc(old, dict(zip(new, vals))) for old, vals in zip(records, zip(*new.values()))]

"""``map(fn)``: ``fn(record) -> record`` on every record; ``map_field(fn, field)``: ``fn(value) -> value`` on one
field (None stays None), e.g. a text clean-up.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from ..records import Chunk
from ._function import FunctionTransform, keep_doc


class Map(FunctionTransform):
    """``fn(record) -> record``: change, add or remove fields."""

    op = "map"

    def _apply_chunk(self, chunk: Chunk) -> Chunk:
        out, keep = [], []
        for j, rec in enumerate(chunk.docs() if chunk.tails is not None else chunk.records()):
            ok, new = self._call(rec, lambda: chunk.where(j))
            if ok:
                if not isinstance(new, Mapping):
                    raise self._failed(TypeError(f"a map must return a dict, got {type(new).__name__}"),
                                       chunk.where(j))
                out.append(new)
                keep.append(j)
        if len(keep) < chunk.n:
            chunk.count("failed_records", chunk.n - len(keep))
            chunk = chunk.select(np.asarray(keep, dtype=np.int64))
        return self._rebuild(chunk, out)

    def _apply_records(self, records: list[Any]) -> list[Any]:
        out = []
        for rec in records:
            ok, new = self._call(rec, lambda: "a record in the lane")
            if ok:
                out.append(keep_doc(rec, new))
        return out


class MapField(Map):
    """``fn(value) -> value`` on one field (None stays None): also a recipe's ``text_map`` hook."""

    op = "map_field"

    def __init__(self, fn: Callable[[Any], Any], field: str, **kwargs: Any) -> None:
        super().__init__(fn, **kwargs)
        self.field = field

    def _apply_chunk(self, chunk: Chunk) -> Chunk:
        values = chunk.columns.get(self.field)
        if not isinstance(values, list):  # a per-token field or an array column: record by record, on the field
            records = chunk.docs() if chunk.tails is not None else chunk.records()
            out, keep = [], []
            for j, rec in enumerate(records):
                mapped = self._mapped(rec, lambda: chunk.where(j))
                if mapped is not None:
                    out.append(mapped)
                    keep.append(j)
            if len(keep) < chunk.n:  # skipped failures (on_error='skip'): a per-token field has no None
                chunk.count("failed_records", chunk.n - len(keep))
                chunk = chunk.select(np.asarray(keep, dtype=np.int64))
            return self._rebuild(chunk, out)
        out = []
        for j, v in enumerate(values):
            ok, new = self._call(v, lambda: chunk.where(j)) if v is not None \
                else (True, None)
            out.append(new if ok else None)  # a text that failed: None, which tokenize skips and counts
        chunk.columns = {**chunk.columns, self.field: out}
        return chunk

    def _apply_records(self, records: list[Any]) -> list[Any]:
        out = []
        for rec in records:
            mapped = self._mapped(rec, lambda: "a record in the lane")
            if mapped is None and isinstance(rec.get(self.field), str):
                mapped = {**rec, self.field: None}  # as on the workers: a text that failed is None
            if mapped is not None:
                out.append(keep_doc(rec, mapped))
        return out

    def _mapped(self, record: Mapping[str, Any], where: Callable[[], str]) -> Mapping[str, Any] | None:
        """The record with ``fn`` applied to its field (None stays None); None where it failed and was skipped."""
        value = record.get(self.field)
        if value is None:
            return record
        ok, new = self._call(value, where)
        return {**record, self.field: new} if ok else None

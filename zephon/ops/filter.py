"""``filter(fn)``: keep the records for which ``fn(record)`` is True; ``filter_field(fn, field)``: the same on one
field's value. A filter must return a ``bool``; anything else is an error, because a truthy ``None``-or-list
return is most often a bug. Dropped records are counted (``filtered_records``).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import OperatorError
from ..records import Chunk
from ._function import FunctionTransform
from .base import function_id


class Filter(FunctionTransform):
    """``fn(record) -> bool``: keep the records for which it is True (dropped ones are counted)."""

    _rows_checked = False  # it only selects records: they were checked where they were made

    op = "filter"

    def _check(self, value: Any, where: Callable[[], str]) -> bool:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        raise OperatorError(f"operator '{self.name}' ({function_id(self.fn, self.version)}) returned "
                            f"{type(value).__name__} ({value!r:.60}) on {where()}; a filter must return True or "
                            f"False. Return a bool (e.g. bool(...) or len(...) > 0).")

    def _apply_chunk(self, chunk: Chunk) -> Chunk:
        keep, failed = [], 0
        for j, rec in enumerate(chunk.records()):
            where = lambda: chunk.where(j)  # noqa: E731
            ok, verdict = self._call(rec, where)
            if not ok:
                failed += 1
            elif self._check(verdict, where):
                keep.append(j)
        chunk.count("failed_records", failed)
        chunk.count("filtered_records", chunk.n - len(keep) - failed)
        return chunk.select(np.asarray(keep, dtype=np.int64))

    def _apply_records(self, records: list[Any]) -> list[Any]:
        out = []
        for rec in records:
            where = lambda: "a record in the lane"  # noqa: E731
            ok, verdict = self._call(rec, where)
            if ok and self._check(verdict, where):
                out.append(rec)
        return out


class FilterField(Filter):
    """``fn(value) -> bool`` on one field; empty and null values are left for ``tokenize`` to skip:
    also a recipe's ``text_filter`` hook."""

    op = "filter_field"

    def __init__(self, fn: Callable[[Any], bool], field: str, **kwargs: Any) -> None:
        super().__init__(fn, **kwargs)
        self.field = field

    def _apply_chunk(self, chunk: Chunk) -> Chunk:
        values = chunk.columns.get(self.field)
        if not isinstance(values, list):  # a per-token field or an array column
            values = [rec.get(self.field) for rec in chunk.records()]
        keep, failed = [], 0
        for j, v in enumerate(values):
            verdict = self._kept(v, lambda: chunk.where(j))
            if verdict is None:
                failed += 1
            elif verdict:
                keep.append(j)
        chunk.count("failed_records", failed)
        chunk.count("filtered_records", chunk.n - len(keep) - failed)
        return chunk.select(np.asarray(keep, dtype=np.int64))

    def _apply_records(self, records: list[Any]) -> list[Any]:
        return [rec for rec in records if self._kept(rec.get(self.field), lambda: "a record in the lane")]

    def _kept(self, value: Any, where: Callable[[], str]) -> bool | None:
        """Whether the record stays (None: the function failed and on_error='skip')."""
        if value is None or hasattr(value, "__len__") and len(value) == 0:  # left for tokenize to skip, counted
            return True
        ok, verdict = self._call(value, where)
        return self._check(verdict, where) if ok else None

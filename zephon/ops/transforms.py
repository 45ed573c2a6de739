"""User functions as stateless transforms: ``map``, ``filter``, ``flat_map`` and ``map_batch``.

Each wraps a pure function and runs it on the records of a chunk (before the sources merge, on the
executors) or on single records (after the merge, in the lane). A failing function is reported with
the operator, the function, the source file and the record's row or byte; ``on_error="skip"`` instead
skips the record and counts it (``failed_records`` in the loader's metrics). A filter must return a
``bool``; anything else is an error, because a truthy ``None``-or-list return is most often a bug.

Functions enter the pipeline fingerprint by qualified name (plus ``version=``, which you bump when you
change what the function does under the same name): a checkpoint written with another function is
refused on resume. With process or Ray executors, functions must be picklable (module-level).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ..errors import OperatorError

from ..records import Chunk, Doc, columns_from_records, doc_source, doc_tail
from .base import Transform, function_id

ON_ERROR = ("raise", "skip")




class _FunctionTransform(Transform):
    """Shared plumbing: the function, its identity, error policy and messages."""

    verb = "call"

    def __init__(self, fn: Callable[..., Any], name: str | None = None, sources: Sequence[str] | None = None,
                 executor: str | None = None, version: str | int | None = None, on_error: str = "raise",
                 token_fields: Mapping[str, Any] | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"{self.kind}() needs a function, got {fn!r}")
        if on_error not in ON_ERROR:
            raise ValueError(f"{self.kind}(on_error={on_error!r}): use one of {ON_ERROR}")
        super().__init__(name or f"{self.kind}:{getattr(fn, '__name__', type(fn).__name__)}", sources, executor)
        self.named = name is not None  # a name you chose labels the operator in messages and states
        self.fn, self.version, self.on_error = fn, version, on_error
        self.token_fields = dict(token_fields or {})

    def describe(self) -> dict[str, Any]:
        d = {**super().describe(), "fn": function_id(self.fn, self.version)}
        if self.named:
            d["name"] = self.name
        if self.on_error != "raise":
            d["on_error"] = self.on_error
        if self.token_fields:
            d["token_fields"] = sorted(self.token_fields)
        return d

    def _failed(self, exc: BaseException, where: str) -> OperatorError:
        return OperatorError(f"operator '{self.name}' ({function_id(self.fn, self.version)}) failed on {where}: "
                             f"{type(exc).__name__}: {exc}. Fix the function, or pass on_error='skip' to skip and "
                             f"count such records.")

    def _call(self, record: Any, where: Callable[[], str]) -> tuple[bool, Any]:
        """``(ok, result)``; ``ok`` False when the call failed and on_error='skip'."""
        try:
            return True, self.fn(record)
        except Exception as exc:  # noqa: BLE001 - a user function may raise anything
            if self.on_error == "skip":
                return False, None
            raise self._failed(exc, where()) from exc

    def _rebuild(self, chunk: Chunk, outputs: list[Any], one_to_one: bool = True) -> Chunk:
        """``chunk`` with its records replaced by ``outputs`` (one per record when ``one_to_one``: the
        tail labels stay with their records; otherwise they come from the outputs' ``Doc.tail``)."""
        tf_names = list(chunk.token_fields) + [k for k in self.token_fields if k not in chunk.token_fields]
        columns, tf, offsets = columns_from_records(outputs, tf_names)
        tails = chunk.tails
        if not one_to_one:
            tails = None
            if chunk.tails is not None or any(isinstance(r, Doc) for r in outputs):
                tails = np.fromiter((doc_tail(r) for r in outputs), dtype=np.int64, count=len(outputs))
        chunk.columns, chunk.token_fields, chunk.offsets, chunk.tails = columns, tf, offsets, tails
        return chunk


class Map(_FunctionTransform):
    """``fn(record) -> record``: change, add or remove fields."""

    kind = "map"

    def apply(self, chunk: Chunk) -> Chunk:
        out, keep = [], []
        for j, rec in enumerate(chunk.docs() if chunk.tails is not None else chunk.records()):
            ok, new = self._call(rec, lambda: f"source {chunk.source}: {chunk.where(j)}")
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

    def apply_records(self, records: list[Any]) -> list[Any]:
        out = []
        for rec in records:
            ok, new = self._call(rec, lambda: f"a record of source {doc_source(rec)} in the lane")
            if ok:
                out.append(_keep_doc(rec, new))
        return out


class Filter(_FunctionTransform):
    """``fn(record) -> bool``: keep the records for which it is True (dropped ones are counted)."""

    kind = "filter"

    def _check(self, value: Any, where: Callable[[], str]) -> bool:
        if isinstance(value, (bool, np.bool_)):
            return bool(value)
        raise OperatorError(f"operator '{self.name}' ({function_id(self.fn, self.version)}) returned "
                            f"{type(value).__name__} ({value!r:.60}) on {where()}; a filter must return True or "
                            f"False. Return a bool (e.g. bool(...) or len(...) > 0).")

    def apply(self, chunk: Chunk) -> Chunk:
        keep, failed = [], 0
        for j, rec in enumerate(chunk.records()):
            where = lambda: f"source {chunk.source}: {chunk.where(j)}"  # noqa: E731
            ok, verdict = self._call(rec, where)
            if not ok:
                failed += 1
            elif self._check(verdict, where):
                keep.append(j)
        chunk.count("failed_records", failed)
        chunk.count("filtered_records", chunk.n - len(keep) - failed)
        return chunk.select(np.asarray(keep, dtype=np.int64))

    def apply_records(self, records: list[Any]) -> list[Any]:
        out = []
        for rec in records:
            where = lambda: f"a record of source {doc_source(rec)} in the lane"  # noqa: E731
            ok, verdict = self._call(rec, where)
            if ok and self._check(verdict, where):
                out.append(rec)
        return out


class FlatMap(_FunctionTransform):
    """``fn(record) -> iterable of records``: zero, one or several records per input record.

    A lane can checkpoint between two outputs of one input: it then re-reads the input and drops the
    outputs it already took (so ``fn`` must be a pure function of the record).
    """

    kind = "flat_map"

    def apply(self, chunk: Chunk) -> Chunk:
        outs: list[list[Any]] = []
        for j, rec in enumerate(chunk.docs() if chunk.tails is not None else chunk.records()):
            ok, new = self._call(rec, lambda: f"source {chunk.source}: {chunk.where(j)}")
            outs.append(_records(new, self, chunk.where(j)) if ok else [])
            if not ok:
                chunk.count("failed_records")
        counts = np.fromiter((len(o) for o in outs), dtype=np.int64, count=len(outs))
        cursor, skip = chunk.expand(counts)
        flat = [r for o in outs for r in o]
        chunk.skipped += int((counts == 0).sum())
        chunk.resume_cursor, chunk.resume_skip = cursor, skip
        return self._rebuild(chunk, flat, one_to_one=False)

    def apply_records(self, records: list[Any]) -> list[Any]:
        out = []
        for rec in records:
            ok, new = self._call(rec, lambda: f"a record of source {doc_source(rec)} in the lane")
            if ok:
                out += [_keep_doc(rec, r) for r in _records(new, self, "a record in the lane")]
        return out


class MapBatch(_FunctionTransform):
    """``fn(columns) -> columns``: a vectorised map over a chunk's columns (a dict of lists or arrays,
    one entry per record); it must return as many records as it was given."""

    kind = "map_batch"

    def apply(self, chunk: Chunk) -> Chunk:
        columns = dict(chunk.columns)
        if chunk.token_fields:
            columns.update({k: v for k, v in zip(chunk.token_fields, _split_tokens(chunk))})
        try:
            new = self.fn(columns)
        except Exception as exc:  # noqa: BLE001
            raise self._failed(exc, f"the chunk of source {chunk.source} at {chunk.where(0)} "
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

    def apply_records(self, records: list[Any]) -> list[Any]:
        if not records:
            return []
        keys = list(dict.fromkeys(k for r in records for k in r))
        new = self.fn({k: [r.get(k) for r in records] for k in keys})
        return [_keep_doc(old, dict(zip(new, vals))) for old, vals in zip(records, zip(*new.values()))]


def _split_tokens(chunk: Chunk) -> list[list[np.ndarray]]:
    assert chunk.offsets is not None
    bounds = list(zip(chunk.offsets[:-1].tolist(), chunk.offsets[1:].tolist()))
    return [[flat[a:b] for a, b in bounds] for flat in chunk.token_fields.values()]


def _records(value: Any, op: _FunctionTransform, where: str) -> list[Any]:
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        raise op._failed(TypeError(f"a flat_map must return an iterable of dicts, got {type(value).__name__}"), where)
    out = list(value)
    for r in out:
        if not isinstance(r, Mapping):
            raise op._failed(TypeError(f"a flat_map must return dicts, got a {type(r).__name__}"), where)
    return out


def _keep_doc(old: Any, new: Any) -> Any:
    """A record rebuilt by a function in the lane keeps its document's tail and source."""
    if isinstance(new, Doc) or not isinstance(old, Doc):
        return new
    return Doc(new, old.tail, old.source)


class FieldMap(Map):
    """``fn(value) -> value`` on one field (None stays None): the legacy ``text_map`` hook."""

    kind = "field_map"

    def __init__(self, fn: Callable[[Any], Any], field: str, **kwargs: Any) -> None:
        super().__init__(fn, **kwargs)
        self.field = field

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "field": self.field}

    def apply(self, chunk: Chunk) -> Chunk:
        values = chunk.columns.get(self.field)
        if values is None or not isinstance(values, list):
            return super().apply(chunk)
        out = []
        for j, v in enumerate(values):
            ok, new = self._call(v, lambda: f"source {chunk.source}: {chunk.where(j)}") if v is not None \
                else (True, None)
            out.append(new if ok else None)
        chunk.columns = {**chunk.columns, self.field: out}
        return chunk


class FieldFilter(Filter):
    """``fn(value) -> bool`` on one field; empty and null values are left for ``tokenize`` to skip:
    the legacy ``text_filter`` hook."""

    kind = "field_filter"

    def __init__(self, fn: Callable[[Any], bool], field: str, **kwargs: Any) -> None:
        super().__init__(fn, **kwargs)
        self.field = field

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "field": self.field}

    def apply(self, chunk: Chunk) -> Chunk:
        values = chunk.columns.get(self.field)
        if values is None or not isinstance(values, list):
            return super().apply(chunk)
        keep = []
        for j, v in enumerate(values):
            where = lambda: f"source {chunk.source}: {chunk.where(j)}"  # noqa: E731
            if not v:
                keep.append(j)
                continue
            ok, verdict = self._call(v, where)
            if ok and self._check(verdict, where):
                keep.append(j)
        chunk.count("filtered_records", chunk.n - len(keep))
        return chunk.select(np.asarray(keep, dtype=np.int64))

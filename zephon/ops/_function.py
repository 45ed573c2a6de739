"""User functions as stateless transforms: the shared part of ``map``, ``filter``, ``flat_map``, ``map_batch``.

Each wraps a pure function and runs it on the records of a chunk (before the sources merge, on the
executors) or on single records (after the merge, in the lane). A failing function is reported with the
operator, the function, the source file and the record's row or byte; ``on_error="skip"`` instead skips the
record and counts it (``failed_records`` in the loader's metrics).

Functions enter the pipeline fingerprint by qualified name (plus ``version=``, which you bump when you
change what the function does under the same name): a checkpoint written with another function is refused
on resume. A lambda or a nested function needs a ``version=`` (its name does not tell it apart). With
process or Ray executors, functions must be picklable (module-level).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ..errors import OperatorError, PipelineError
from ..records import Chunk, Doc, TokenFieldError, columns_from_records, doc_origin, doc_tail
from .base import Transform, choice, function_id

ON_ERROR = ("raise", "skip")


class FunctionTransform(Transform):
    """Shared plumbing: the function, its identity, error policy and messages."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None, sources: Sequence[str] | None = None,
                 executor: str | None = None, version: str | int | None = None, on_error: str = "raise",
                 token_fields: Mapping[str, Any] | None = None) -> None:
        if not callable(fn):
            raise PipelineError(f"{self.op}() needs a function, got {fn!r}")
        super().__init__(name, sources, executor)
        if name is None:
            self.name = f"{self.op}:{getattr(fn, '__name__', type(fn).__name__)}"
        self.fn, self.version, self.on_error = fn, version, choice(on_error, ON_ERROR, f"{self.op}(on_error)")
        if token_fields:  # per-token fields it adds (map only): a parameter then
            self.token_fields = dict(token_fields)

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
        try:
            columns, tf, offsets = columns_from_records(outputs, tf_names, self._field_defaults())
        except TokenFieldError as exc:
            where = chunk.where(exc.record) if one_to_one else f"a record it made from {chunk.path}"
            raise OperatorError(f"operator '{self.name}' ({function_id(self.fn, self.version)}) made a record whose "
                                f"per-token fields do not line up, on {where}: {exc}. Fix the function.") from None
        tails = chunk.tails
        if not one_to_one:
            tails = None
            if chunk.tails is not None or any(isinstance(r, Doc) for r in outputs):
                tails = np.fromiter((doc_tail(r) for r in outputs), dtype=np.int64, count=len(outputs))
        chunk.columns, chunk.token_fields, chunk.offsets, chunk.tails = columns, tf, offsets, tails
        return chunk


def records_of(value: Any, op: FunctionTransform, where: str) -> list[Any]:
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        raise op._failed(TypeError(f"a flat_map must return an iterable of dicts, got {type(value).__name__}"), where)
    out = list(value)
    for r in out:
        if not isinstance(r, Mapping):
            raise op._failed(TypeError(f"a flat_map must return dicts, got a {type(r).__name__}"), where)
    return out


def keep_doc(old: Any, new: Any) -> Any:
    """A record rebuilt by a function in the lane keeps its document's tail, source and origin."""
    if isinstance(new, Doc) or not isinstance(old, Doc):
        return new
    return Doc(new, old.tail, old.source, doc_origin(old))

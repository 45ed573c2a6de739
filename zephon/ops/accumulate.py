"""``accumulate(factory)``: your own accumulator, serial per lane, after the sources meet.

``factory(ctx)`` (or ``factory()``) builds one instance per lane and segment, with ``push(record) ->
records`` and ``flush() -> records``; after a flush it must behave exactly like a fresh instance (see
:mod:`zephon.ops.base`, and :func:`zephon.testing.check_accumulator`, which proves it). The factory enters the
fingerprint by its qualified name (a class, a function, a ``functools.partial`` with its arguments) and
``version``, which you bump when it changes under the same name. In a pipeline that packs, what it emits is
checked against the rows as a transform's output is (:mod:`zephon.ops.fields`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from ..errors import PipelineError
from .base import Accumulator, LaneContext, LaneOperator, call_factory
from .fields import Fields, check_record


class Accumulate(LaneOperator):
    """Your accumulator in the lane (see the module docstring).

    Args:
        factory: a class or function building the accumulator from a :class:`~zephon.ops.base.LaneContext`
            (or from nothing).
        name: its name in messages and ``explain()``.
        version: what you bump when the factory changes under the same name.
    """

    op = "accumulate"

    def __init__(self, factory: Callable[..., Any], name: str | None = None, version: str | int | None = None) -> None:
        if not callable(factory):
            raise PipelineError(f"accumulate() takes a factory (a class or function), got {factory!r}")
        if isinstance(factory, Accumulator):
            raise PipelineError("accumulate() takes a factory, not an instance: every lane builds its own (pass the "
                                "class, or a function returning a new instance)")
        super().__init__(name)
        if name is None:
            self.name = f"accumulate:{getattr(factory, '__name__', type(factory).__name__)}"
        self.factory, self.version = factory, version

    def make(self, ctx: LaneContext) -> Any:
        return call_factory(self.factory, ctx)

    def make_checked(self, rows: Fields, ctx: LaneContext) -> Any:
        """:meth:`make` for a pipeline that packs: what the accumulator emits is checked against the rows'
        per-token fields ``rows`` (:mod:`zephon.ops.fields`)."""
        acc = self.make(ctx)
        return (_CheckedWithHook if hasattr(acc, "on_flush") else _Checked)(acc, self, rows)


class _Checked:
    """Your accumulator, what it emits checked against the packed rows (:mod:`zephon.ops.fields`). Only
    ``push``, ``flush`` (and ``on_flush``) are the engine's to call: the batched paths stay off for it."""

    def __init__(self, acc: Any, op: Accumulate, rows: Fields) -> None:
        self._acc, self._op, self._rows = acc, op, rows

    def push(self, record: Any) -> list[Any]:
        return self._checked(self._acc.push(record))

    def flush(self) -> list[Any]:
        return self._checked(self._acc.flush())

    def _checked(self, out: Iterable[Any] | None) -> list[Any]:
        out = list(out) if out else []  # None: nothing, as the engine reads it
        for rec in out:
            check_record(self._op, rec, self._rows, "a record it emitted")
        return out


class _CheckedWithHook(_Checked):
    """:class:`_Checked` for an accumulator with its own ``on_flush`` (a sentinel hook)."""

    def on_flush(self, sentinel: Any) -> list[Any]:
        return self._checked(self._acc.on_flush(sentinel))

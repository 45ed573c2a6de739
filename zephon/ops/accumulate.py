"""``accumulate(factory)``: your own accumulator, serial per lane, after the sources meet.

``factory(ctx)`` (or ``factory()``) builds one instance per lane and segment, with ``push(record) ->
records`` and ``flush() -> records``; after a flush it must behave exactly like a fresh instance (see
:mod:`zephon.ops.base`, and :func:`zephon.testing.check_accumulator`, which proves it). The factory enters the
fingerprint by its qualified name (a class, a function, a ``functools.partial`` with its arguments) and
``version``, which you bump when it changes under the same name. The ``input_ids`` it emits are checked as a
transform's are (:func:`~zephon.ops.base.check_token_ids`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from ..errors import PipelineError
from ..records import INPUT_IDS
from .base import Accumulator, LaneContext, LaneOperator, call_factory, check_token_ids


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
        return _CheckedIds(call_factory(self.factory, ctx), self)


class _CheckedIds:
    """Your accumulator, its output's ``input_ids`` checked (a packed row must be able to hold them); every other
    attribute is the accumulator's own."""

    def __init__(self, acc: Any, op: Accumulate) -> None:
        self._acc, self._op = acc, op
        if hasattr(acc, "on_flush"):  # the node looks the hook up: only where the accumulator has one
            self.on_flush = lambda sentinel: self._checked(acc.on_flush(sentinel))

    def push(self, record: Any) -> list[Any]:
        return self._checked(self._acc.push(record))

    def flush(self) -> list[Any]:
        return self._checked(self._acc.flush())

    def _checked(self, out: Iterable[Any]) -> list[Any]:
        out = list(out)
        for rec in out:
            if isinstance(rec, Mapping) and INPUT_IDS in rec:
                check_token_ids(self._op, rec[INPUT_IDS], lambda k: "a record it emitted")
        return out

    def __getattr__(self, name: str) -> Any:
        if name in ("_acc", "_op"):  # not set yet (a copy or an unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._acc, name)

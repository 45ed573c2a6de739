"""``accumulate(factory)``: your own accumulator, serial per lane, after the sources meet.

``factory(ctx)`` (or ``factory()``) builds one instance per lane and segment, with ``push(record) ->
records`` and ``flush() -> records``; after a flush it must behave exactly like a fresh instance (see
:mod:`zephon.ops.base`, and :func:`zephon.testing.check_accumulator`, which proves it). The factory enters the
fingerprint by its qualified name (a class, a function, a ``functools.partial`` with its arguments) and
``version``, which you bump when it changes under the same name.
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import PipelineError
from .base import Accumulator, LaneContext, LaneOperator, call_factory


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

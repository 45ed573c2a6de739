"""The operator contract: stateless transforms and accumulators (Zephon's built-ins use it too).

**Stateless transforms** (:class:`Transform`: ``map``, ``filter``, ``flat_map``, ``map_batch``,
``tokenize``, ``split``...) are pure functions of a record. Before the sources merge they run on the
pipeline's executors (threads, processes, Ray), a chunk of records per task, and a reorder buffer
restores the order; after the merge they run in the lane, one record at a time. Either way the output
does not depend on where they ran. A transform implements :meth:`Transform.apply` over a
:class:`~zephon.records.Chunk` (columnar, one call per chunk); the per-record user functions are
wrapped by :mod:`zephon.ops.transforms`.

**Accumulators** (:class:`Accumulator`: ``mix``, ``shuffle``, ``pack`` and yours) are serial per lane:
they see the lane's records in order, ``push(record)`` returns what may be emitted now, and at a flush
sentinel ``flush()`` returns everything still held, after which the instance must behave exactly like
a fresh one (``factory(ctx.after_flush())``). That is what makes a checkpoint a position: a lane is
rebuilt fresh at its last sentinel and replays from there. :func:`zephon.testing.check_accumulator`
proves it for your own accumulator.

Two optional extensions, both public and both used by built-ins:

- **Merging** (:class:`Merge`, the ``mix`` operator): the accumulator where the sources meet says which
  source's record it wants next (:meth:`Merge.next_source`) and is pushed that record.
- **Sentinel hooks**: an accumulator may define ``on_flush(sentinel) -> list`` instead of relying on
  ``flush()``: it returns records and, somewhere, the sentinel itself (possibly with ``carry`` set),
  or holds the sentinel and returns it from a later ``push``. The packer does this to top its last
  row up with the first tokens after the sentinel rather than pad it; rebuilt at that sentinel it is
  told ``ctx.carry`` and drops those tokens.

Randomness inside an accumulator comes from ``ctx.rng(purpose)``: seeded by (seed, lane, segment,
purpose) only, so that a lane rebuilt at a sentinel draws the same numbers.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Iterable, Sequence

import numpy as np

from .._perm import rng_for, stable_key
from ..records import Chunk


@dataclass(frozen=True)
class LaneContext:
    """What an accumulator may know about where it runs: the pipeline seed, its lane, the segment (how
    many sentinels the lane has passed), the sources' names, and at a resume the packer's ``carry`` and
    ``release`` (the sentinel's, see :class:`~zephon.records.Flush`)."""

    seed: int
    lane: int
    segment: int = 0
    sources: tuple[str, ...] = ()
    carry: int = 0
    clock: Any = field(default=None, compare=False)  # the lane's step clock (zephon.engine.clock.LaneClock)
    release: int = -1

    def rng(self, purpose: str | int) -> np.random.Generator:
        """A generator seeded by (seed, lane, segment, purpose) only."""
        key = purpose if isinstance(purpose, int) else stable_key(purpose)
        return rng_for(self.seed, self.lane, self.segment, key)

    def after_flush(self) -> "LaneContext":
        """The context of a fresh instance for the segment after the next sentinel."""
        return replace(self, segment=self.segment + 1, carry=0, release=-1)


class Operator:
    """Common base: a name for messages and ``explain()``, and the parameters that enter the
    pipeline fingerprint (:meth:`describe`)."""

    kind: ClassVar[str] = "operator"
    #: where it runs: "workers" (stateless, before the merge), "lane" (serial accumulator)
    stateful: ClassVar[bool] = False

    def __init__(self, name: str | None = None, sources: Sequence[str] | None = None) -> None:
        self.name = name or self.kind
        self.sources = tuple(sources) if sources is not None else None

    def describe(self) -> dict[str, Any]:
        """Everything that decides this operator's output, as plain JSON data (fingerprinted)."""
        return {"op": self.kind, **({"sources": list(self.sources)} if self.sources is not None else {})}

    def applies_to(self, source: str) -> bool:
        return self.sources is None or source in self.sources

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"


class Transform(Operator):
    """A stateless operator: ``apply(chunk) -> chunk``, run wherever the executor puts it.

    The output depends on the chunk alone (nothing is kept between calls). The chunk is handed over:
    ``apply`` may modify and return it rather than copy its columns, since the engine never reads a chunk
    after passing it on. A caller that still needs the input afterwards must copy it first.

    ``executor``: None (the loader's runner) or a kind ("inline", "thread", "process", "ray") for the
    stage this transform runs in. ``token_fields``: per-token fields this transform adds (name -> the
    value a document without the field gets when packed next to one that has it).
    """

    kind = "transform"
    stateful = False
    token_fields: dict[str, Any] = {}

    def __init__(self, name: str | None = None, sources: Sequence[str] | None = None,
                 executor: str | None = None) -> None:
        super().__init__(name, sources)
        self.executor = executor

    def setup(self) -> None:
        """Load heavy state (tokenizers, templates) once per process, before the first chunk."""

    def apply(self, chunk: Chunk) -> Chunk:
        raise NotImplementedError(type(self))

    def apply_records(self, records: list[Any]) -> list[Any]:
        """The same transform on records in a lane (after the merge): by default, through a chunk."""
        raise NotImplementedError(f"{self.name} cannot run after the sources merge; put it before .mix()")


class Accumulator(Operator):
    """A serial, per-lane operator. Subclass it (or write any class with ``push`` and ``flush``).

    ``push(record)`` returns the records that can be emitted now (any number, any order the operator
    decides deterministically); ``flush()`` returns everything still held, at a sentinel; after it the
    instance equals a fresh one built for the next segment.
    """

    kind = "accumulator"
    stateful = True

    def push(self, record: Any) -> Iterable[Any]:
        raise NotImplementedError(type(self))

    def flush(self) -> Iterable[Any]:
        return ()


class Merge(Accumulator):
    """An accumulator fed by several sources: it chooses which source's next record it wants."""

    kind = "merge"

    def next_source(self) -> int:
        """Index of the source whose next record must be pushed next (-1: none is left)."""
        raise NotImplementedError(type(self))

    def push_from(self, record: Any, source: int) -> Iterable[Any]:
        """``record`` is the next record of source ``source`` (the one :meth:`next_source` named)."""
        return self.push(record)

    def source_ended(self, source: int) -> None:
        """Source ``source`` stopped (after its passes): never name it again; :meth:`next_source` returns -1
        once no source is left."""
        raise NotImplementedError(f"{type(self).__name__} does not handle sources that stop")


AccumulatorFactory = Callable[..., Any]


def call_factory(factory: AccumulatorFactory, ctx: LaneContext) -> Any:
    """``factory(ctx)``, or ``factory()`` for a factory (a class, a function) that takes no argument."""
    try:
        params = [p for p in inspect.signature(factory).parameters.values()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):  # builtins without a signature
        params = [None]
    acc = factory(ctx) if params else factory()
    for method in ("push", "flush"):
        if not callable(getattr(acc, method, None)):
            raise TypeError(f"the accumulator factory {factory!r} made {acc!r}, which has no {method}() method; an "
                            f"accumulator needs push(record) -> records and flush() -> records.")
    return acc


def function_id(fn: Callable[..., Any], version: str | int | None = None) -> str:
    """How a user function enters the fingerprint: its qualified name, plus ``version`` if given."""
    target = getattr(fn, "func", fn)  # functools.partial
    module = getattr(target, "__module__", None) or type(target).__module__
    qual = getattr(target, "__qualname__", None) or type(target).__qualname__
    out = f"{module}:{qual}"
    if target is not fn:  # partial: its bound arguments are part of what it does
        out += f"(*{getattr(fn, 'args', ())!r}, **{getattr(fn, 'keywords', {})!r})"
    return out if version is None else f"{out}@{version}"

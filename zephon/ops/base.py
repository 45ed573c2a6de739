"""The operator contract: stateless transforms and accumulators (Zephon's built-ins use it too).

An **operator** is one object: its declaration (the parameters it was given, checked when it is made),
its description for the fingerprint (derived from those parameters: :meth:`Operator.describe`), and its
runtime (:meth:`Transform.apply` for a transform, :meth:`Operator.make` for an accumulator). The
parameters are the operator's public attributes; whatever it derives from them (a loaded tokenizer, a
compiled template) is private (``self._x``), so the description covers every parameter and nothing else.

**Stateless transforms** (:class:`Transform`: ``map``, ``filter``, ``flat_map``, ``tokenize``, ``split``...)
are pure functions of a batch of records. Before the sources merge they run on the pipeline's executors
(threads, processes, Ray), a chunk of records per task, and a reorder buffer restores the order; after the
merge they run in the lane. Either way the output does not depend on where they ran. Your own transform
subclasses :class:`Transform` and implements ``apply(columns)`` (see there).

**Accumulators** (``mix``, ``shuffle``, ``pack`` and yours, through ``accumulate(factory)``) are serial per
lane: they see the lane's records in order, ``push(record)`` returns what may be emitted now, and at a flush
sentinel ``flush()`` returns everything still held, after which the instance must behave exactly like a
fresh one (``factory(ctx.after_flush())``). That is what makes a checkpoint a position: a lane is rebuilt
fresh at its last sentinel and replays from there. :func:`zephon.testing.check_accumulator` proves it.

Two optional extensions, both public and both used by built-ins:

- **Merging** (:class:`Merge`, the ``mix`` operator): the accumulator where the sources meet says which
  source's record it wants next (:meth:`Merge.next_source`) and is pushed that record.
- **Sentinel hooks**: an accumulator may define ``on_flush(sentinel) -> list`` instead of relying on
  ``flush()``: it returns records and, somewhere, the sentinel itself (possibly with ``carry`` set), or
  holds the sentinel and returns it from a later ``push``. The packer does this to top its last row up with
  the first tokens after the sentinel rather than pad it; rebuilt at that sentinel it is told
  ``ctx.carry`` and drops those tokens.

Randomness inside an accumulator comes from ``ctx.rng(purpose)``: seeded by (seed, lane, segment,
purpose) only, so that a lane rebuilt at a sentinel draws the same numbers.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import inspect
import types
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Iterable, Mapping, Sequence

import numpy as np

from .._perm import rng_for, stable_key
from ..errors import PipelineError
from ..records import IGNORE, Chunk, Doc, TokenColumn, TokenFieldError, columns_from_records, doc_origin
from .fields import token_field

EXECUTOR_KINDS = ("inline", "thread", "process", "ray")
LONG_TEXT = 256  # a longer string parameter (a template) enters the fingerprint by its SHA-256


@dataclass(frozen=True)
class LaneContext:
    """What an accumulator may know about where it runs: the pipeline seed, its lane, the segment (how many
    sentinels the lane has passed), the sources' names, and at a resume the packer's ``carry`` and
    ``release`` (the sentinel's, see :class:`~zephon.records.Flush`)."""

    seed: int
    """The pipeline's seed."""
    lane: int
    """The lane this accumulator runs in."""
    segment: int = 0
    """How many flush sentinels the lane has passed: the instance is fresh for this segment."""
    sources: tuple[str, ...] = ()
    """The sources' names, in declaration order."""
    carry: int = 0
    """At a resume: the leading tokens the packer drops (the ``carry`` of the sentinel the lane restarts at)."""
    clock: Any = field(default=None, compare=False)
    """The lane's step clock (:class:`zephon.engine.clock.LaneClock`; None outside a lane)."""
    release: int = -1
    """At a resume: when the packer released its held row after the sentinel (the sentinel's ``release``)."""

    def rng(self, purpose: str | int) -> np.random.Generator:
        """A generator seeded by (seed, lane, segment, purpose) only.

        Args:
            purpose: what the numbers are for (a name or an integer), so that two uses draw apart.

        Returns:
            A numpy generator that a lane rebuilt at the same sentinel gets again, draw for draw.
        """
        key = purpose if isinstance(purpose, int) else stable_key(purpose)
        return rng_for(self.seed, self.lane, self.segment, key)

    def after_flush(self) -> "LaneContext":
        """The context of a fresh instance for the segment after the next sentinel.

        Returns:
            This context with ``segment`` + 1 and no ``carry`` or ``release``.
        """
        return replace(self, segment=self.segment + 1, carry=0, release=-1)


@dataclass(frozen=True)
class BindContext:
    """What the pipeline around an operator decides and the operator needs at run time: the sources' names and
    weights, the per-token fields (name -> (dtype, default)), the packer's per-row image limits and whether
    the batches carry provenance."""

    sources: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    token_fields: Mapping[str, tuple[Any, Any]] = field(default_factory=dict)
    limits: Any = None
    provenance: bool = False  # the batches carry provenance: rows record where each piece comes from


# -- descriptions: every parameter as plain data ------------------------------------------------------------
def function_id(fn: Callable[..., Any], version: str | int | None = None) -> str:
    """How a user function enters the fingerprint: its qualified name, plus ``version`` if given.

    Args:
        fn: a function, a class, a bound method or a ``functools.partial`` (its bound arguments included).
        version: what the user bumps when the function changes under the same name.

    Returns:
        ``"module:qualname"`` (``"...@version"``; a partial's arguments described after it).
    """
    target = getattr(fn, "func", fn) if isinstance(fn, functools.partial) else fn
    module = getattr(target, "__module__", None) or type(target).__module__
    qual = getattr(target, "__qualname__", None) or type(target).__qualname__
    out = f"{module}:{qual}"
    if target is not fn:  # partial: its bound arguments are part of what it does
        args = describe_value(list(fn.args), f"the arguments of {out}")
        keywords = describe_value(dict(fn.keywords), f"the arguments of {out}")
        out += f"(*{args!r}, **{keywords!r})"
    return out if version is None else f"{out}@{version}"


def describe_value(value: Any, where: str, versioned: bool = False) -> Any:
    """``value`` as plain JSON data for the fingerprint, or an error naming ``where`` and the fix.

    Plain data stays as it is (tuples as lists); numpy scalars as numbers; arrays by dtype, shape and SHA-256;
    strings longer than :data:`LONG_TEXT` by SHA-256; an object with ``describe()`` by it; a dataclass by its
    fields; a function or class by its qualified name. A lambda or a nested function has no name that tells it
    apart: refused unless ``versioned`` (its operator has a ``version=``, which the user bumps on a change).
    """
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return value if len(value) <= LONG_TEXT else {"sha256": hashlib.sha256(value.encode()).hexdigest()}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return {"array": value.dtype.str, "shape": list(value.shape),
                "sha256": hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()}
    if isinstance(value, np.dtype):
        return value.str
    if isinstance(value, (list, tuple)):
        return [describe_value(v, f"{where}[{i}]", versioned) for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):  # in a stable order, whatever the hash seed
        return {"set": sorted((describe_value(v, f"{where} item", versioned) for v in value), key=repr)}
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise PipelineError(f"{where}: a mapping with non-string keys {list(value)[:5]} cannot be fingerprinted; "
                                f"use string keys")
        return {k: describe_value(v, f"{where}['{k}']", versioned) for k, v in value.items()}
    if isinstance(value, type):
        return f"{value.__module__}:{value.__qualname__}"
    describe = getattr(value, "describe", None)
    if callable(describe) and not isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
        return describe_value(describe(), where, versioned)
    if dataclasses.is_dataclass(value):
        return {"type": f"{type(value).__module__}:{type(value).__qualname__}",
                **{f.name: describe_value(getattr(value, f.name), f"{where}.{f.name}", versioned)
                   for f in dataclasses.fields(value)}}
    if isinstance(value, _BUILTIN_METHODS):  # str.upper, "-".join, dict.get: implemented in C
        owner = getattr(value, "__self__", None)
        cls = getattr(value, "__objclass__", None) or type(owner)
        name = function_id(value) if isinstance(value, types.BuiltinFunctionType) else \
            f"{cls.__module__}:{value.__qualname__}"  # a descriptor (str.upper) names its class's module
        if owner is None or isinstance(owner, (type, types.ModuleType)):
            return name
        try:  # "-".join is not "+".join; an object without a description (a compiled regex) keeps the old name
            return {"method": name, "of": describe_value(owner, where, versioned)}
        except PipelineError:
            return name
    if isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
        target = value.func if isinstance(value, functools.partial) else value
        if "<" in (getattr(target, "__qualname__", "") or "") and not versioned:  # "<lambda>", "f.<locals>.g"
            raise PipelineError(f"{where}: {target!r} is a lambda or a function defined inside another, whose name "
                                f"does not tell it apart from others, so the fingerprint cannot cover it. Define it "
                                f"at module level, or pass version='...' and change it whenever the function changes.")
        if isinstance(value, types.MethodType) and not isinstance(value.__self__, type):
            return {"method": function_id(value.__func__), "of": describe_value(value.__self__, where, versioned)}
        return function_id(value)
    if callable(value) and hasattr(value, "__dict__"):  # an object with __call__: its class and its attributes
        own = vars(value)
        named = {"__qualname__": f"{own.get('__module__', type(value).__module__)}:{own['__qualname__']}"} \
            if "__qualname__" in own else {}  # a function object (np.char.upper, np.add, a wrapper): which one
        return {"type": f"{type(value).__module__}:{type(value).__qualname__}", **named,
                **{k: describe_value(v, f"{where}.{k}", versioned) for k, v in own.items() if not k.startswith("_")}}
    reduced = value.__reduce__() if callable(value) else None
    if isinstance(reduced, tuple) and len(reduced) == 2 and reduced[0] is type(value):  # operator.itemgetter("text")
        return {"type": f"{type(value).__module__}:{type(value).__qualname__}",
                "args": describe_value(list(reduced[1]), where, versioned)}
    raise PipelineError(f"{where}: a {type(value).__qualname__} ({value!r:.60}) has no stable description for the "
                        f"fingerprint. Pass plain data (numbers, strings, lists, dicts, arrays), give its class a "
                        f"describe() returning plain data, or keep it private (self._name) if the operator derives "
                        f"it from its other parameters.")


_BUILTIN_METHODS = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
                    types.MethodWrapperType, types.ClassMethodDescriptorType)


class Operator:
    """Common base: the declaration, its description (the fingerprint) and where the operator runs.

    ``op`` is the builder method (and the recipe's ``op = "..."``) of a built-in; your own operator's
    identity is its qualified class name. Bump the class attribute ``version`` when you change what it does
    under the same name. Every public attribute is a parameter (see the module docstring).
    """

    op: ClassVar[str] = ""
    stateful: ClassVar[bool] = False
    version: Any = None  # a class attribute, or a parameter of function operators (map(fn, version=...))
    #: attributes that change no byte of the output (how it is labelled, where it runs): not fingerprinted
    NOT_FINGERPRINTED: ClassVar[frozenset[str]] = frozenset({"name", "executor"})

    def __init__(self, name: str | None = None, sources: Sequence[str] | None = None) -> None:
        if name is not None and (not isinstance(name, str) or not name):
            raise PipelineError(f"{self.op or type(self).__name__}(name={name!r}): a non-empty string is needed")
        self.name = name or self.op or type(self).__name__
        self._named = name is not None  # a name you chose is written back to a recipe
        self.sources = tuple(sources) if sources is not None else None

    @property
    def identity(self) -> str:
        """``zephon.<op>`` for a built-in, ``module:QualName`` for yours."""
        cls = type(self)
        return f"zephon.{self.op}" if self.op and cls.__module__.startswith("zephon.") else \
            f"{cls.__module__}:{cls.__qualname__}"

    def params(self) -> dict[str, Any]:
        """The declared parameters: the public attributes, but for those in :attr:`NOT_FINGERPRINTED`."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_") and k not in self.NOT_FINGERPRINTED}

    def describe(self) -> dict[str, Any]:
        """Everything that decides this operator's output, as plain JSON data (fingerprinted).

        Raises:
            PipelineError: a parameter has no stable description (naming it, and the fix).
        """
        where = f"operator '{self.name}'"
        d: dict[str, Any] = {"op": self.identity}
        version = self.version
        if version is not None:
            d["version"] = describe_value(version, f"{where}: version")
        versioned = version is not None
        for k, v in self.params().items():
            if k != "version":
                d[k] = describe_value(v, f"{where}: parameter '{k}'", versioned)
        token_fields = getattr(self, "token_fields", None)
        if token_fields and "token_fields" not in d:
            d["token_fields"] = describe_value(dict(token_fields), f"{where}: token_fields")
        return d

    def bind(self, ctx: BindContext) -> "Operator":
        """The operator ready to run in this pipeline: itself, or a copy given what the pipeline decides
        (never this object changed: a pipeline is a value, and another may share it)."""
        return self

    def _bound(self, **private: Any) -> "Operator":
        """A copy with private run-time attributes set (for :meth:`bind`)."""
        out = copy.copy(self)
        out.__dict__.update(private)
        return out

    def applies_to(self, source: str) -> bool:
        return self.sources is None or source in self.sources

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r:.40}' for k, v in self.params().items())})"


class Transform(Operator):
    """A stateless operator: a pure function of a batch of records. Subclass it and implement :meth:`apply`.

    Its output depends on its input alone, so it may run on any executor, any number of times (a resume
    re-reads from the last sentinel). Every public attribute you set in ``__init__`` is a parameter, in the
    fingerprint; what you derive from them (a loaded model) belongs in private attributes (``self._x``).

    Example, a transform that keeps documents of at least ``n`` tokens and marks them::

        class KeepLong(zephon.Transform):
            def __init__(self, n: int) -> None:
                super().__init__()
                self.n = n                                 # a parameter: fingerprinted

            def apply(self, columns):
                return np.array([len(ids) >= self.n for ids in columns["input_ids"]])   # a keep-mask

    Args:
        name: its name in messages and ``explain()`` (None: the class's name).
        sources: the sources it applies to (None: all; before the merge only).
        executor: None (the loader's runner) or the executor kind of the stage it runs in: ``"inline"``,
            ``"thread"``, ``"process"`` or ``"ray"``.

    Raises:
        PipelineError: an empty ``name`` or an unknown ``executor``.
    """

    stateful = False
    """False: a transform holds no state between batches (accumulators do)."""
    _rows_checked: ClassVar[bool] = True  # the engine checks its output against packed rows (built-ins': False)
    token_fields: Mapping[str, Any] = {}
    """Per-token fields this transform adds: name -> the value a document without the field gets when packed
    next to one that has it (a class attribute, or set in ``__init__``)."""

    def __init__(self, name: str | None = None, sources: Sequence[str] | None = None,
                 executor: str | None = None) -> None:
        super().__init__(name, sources)
        if executor is not None and executor not in EXECUTOR_KINDS:
            raise PipelineError(f"{self.op or type(self).__name__}(executor={executor!r}): use one of {EXECUTOR_KINDS} "
                                f"(or None: the loader's runner)")
        self.executor = executor
        """The executor kind of its stage (None: the loader's runner); not fingerprinted."""

    def setup(self) -> None:
        """Load heavy state (tokenizers, templates) once per process, before the first batch."""

    def _field_defaults(self) -> Mapping[str, tuple[Any, Any]]:
        """Per-token field -> (dtype, default) for the records it makes without one: its own declarations."""
        return {k: token_field(v) for k, v in self.token_fields.items()}

    def apply(self, columns: dict[str, Any]) -> Any:
        """Transform a batch of records, given as columns.

        It returns one of:

        - columns with as many records as given (a map; new fields are added, missing ones dropped);
        - a boolean array, one entry per record: the records to keep (a filter);
        - ``(columns, counts)``: record ``j`` became ``counts[j]`` records (zero or more), given in order
          in ``columns`` (one-to-many; a lane can checkpoint between two of them).

        Args:
            columns: field name -> a list (or array) with one value per record; per-token fields
                (``input_ids``, ``loss_mask``...) as a list of 1-D arrays. The batch is yours to modify.

        Returns:
            Columns, a boolean keep-mask, or ``(columns, counts)``, as listed above. ``input_ids`` must be
            integer ids in ``[0, 2**31)`` in a pipeline that packs (:mod:`zephon.ops.fields`); a document may be
            left with none.
        """
        raise NotImplementedError(f"{type(self).__qualname__} must implement apply(columns)")

    # -- the engine's side: built-ins override these two, which serve apply(columns) for yours --------------
    def _apply_chunk(self, chunk: Chunk) -> Chunk:
        columns = {k: v.to_pylist() if isinstance(v, TokenColumn) else v for k, v in chunk.columns.items()}
        columns.update(chunk.token_columns())
        where = f"operator '{self.name}' on {chunk.where(0) if chunk.n else chunk.path}"
        keep, counts, records = self._outcome(self.apply(columns), chunk.n, where)
        if keep is not None:
            chunk.count("filtered_records", chunk.n - len(keep))
            return chunk.select(keep)
        names = list(chunk.token_fields) + [k for k in self.token_fields if k not in chunk.token_fields]
        try:
            columns, token_fields, offsets = columns_from_records(records, names, self._field_defaults())
        except TokenFieldError as exc:  # name the record it was made from
            j = exc.record if counts is None else int(np.searchsorted(np.cumsum(counts), exc.record, "right"))
            raise PipelineError(f"operator '{self.name}' on {chunk.where(j)}: {exc}") from None
        if counts is not None:
            chunk.skipped += int((counts == 0).sum())
            chunk.resume_cursor, chunk.resume_skip = chunk.expand(counts)
            chunk.expand_origin(counts)
            chunk.tails = None if chunk.tails is None else np.full(len(records), IGNORE, dtype=np.int64)
        chunk.columns, chunk.token_fields, chunk.offsets = columns, token_fields, offsets
        return chunk

    def _apply_records(self, records: list[Any]) -> list[Any]:
        """The same transform on records in a lane (after the merge), a record at a time."""
        out = []
        for rec in records:
            keep, counts, made = self._outcome(self.apply({k: [v] for k, v in rec.items()}), 1,
                                               f"operator '{self.name}' on a record in the lane")
            if keep is not None:
                out += [rec] if len(keep) else []
            elif counts is None:
                out.append(Doc(made[0], getattr(rec, "tail", IGNORE), getattr(rec, "source", -1), doc_origin(rec)))
            else:
                out += [Doc(r, IGNORE, getattr(rec, "source", -1), doc_origin(rec)) for r in made]
        return out

    @staticmethod
    def _outcome(out: Any, n: int, where: str) -> tuple[np.ndarray | None, np.ndarray | None, list[dict]]:
        """What ``apply`` returned, checked: ``(keep, None, [])`` for a keep-mask, else ``(None, counts or None,
        the records made)``."""
        if isinstance(out, np.ndarray) and out.dtype == np.bool_:
            if out.shape != (n,):
                raise PipelineError(f"{where}: a keep-mask needs one entry per record ({n}), got shape {out.shape}")
            return np.flatnonzero(out), None, []
        counts = None
        if isinstance(out, tuple) and len(out) == 2:
            out, counts = out
            counts = np.asarray(counts, dtype=np.int64)
            if counts.shape != (n,) or (counts < 0).any():
                raise PipelineError(f"{where}: counts need one entry >= 0 per record ({n}), got {counts!r:.80}")
        if not isinstance(out, Mapping):
            raise PipelineError(f"{where}: apply() must return columns (a dict), a boolean keep-mask or (columns, "
                                f"counts), got {type(out).__name__}")
        made = n if counts is None else int(counts.sum())
        bad = {k: len(v) for k, v in out.items() if len(v) != made}
        if bad:
            raise PipelineError(f"{where}: columns {bad} do not have {made} entries (one per record made)")
        records = [dict(zip(out, values)) for values in zip(*out.values())] if out else [{} for _ in range(made)]
        return None, counts, records


class Accumulator:
    """A serial, per-lane operator at run time. Subclass it (or write any class with ``push`` and ``flush``).

    ``push(record)`` returns the records that can be emitted now (any number, any order the operator
    decides deterministically); ``flush()`` returns everything still held, at a sentinel; after it the
    instance equals a fresh one built for the next segment. :func:`zephon.testing.check_accumulator` checks
    both for your own.
    """

    def push(self, record: Any) -> Iterable[Any]:
        """Take the lane's next record.

        Args:
            record: the next record (a :class:`zephon.Doc`, or what the operator before emitted), in the lane's
                order.

        Returns:
            The records that may be emitted now, in order (any number, none included). A decision may use
            only the records pushed so far and ``ctx.rng(...)``, never the clock or a global random state.
        """
        raise NotImplementedError(type(self))

    def flush(self) -> Iterable[Any]:
        """Emit everything still held, at a flush sentinel.

        Afterwards the instance must behave exactly like a fresh one built for the next segment
        (``factory(ctx.after_flush())``): that is what lets a lane resume at the sentinel.

        Returns:
            The records still held, in order (none by default).
        """
        return ()


class Merge(Accumulator):
    """An accumulator fed by several sources: it chooses which source's next record it wants."""

    def next_source(self) -> int:
        """Which source's record must be pushed next.

        Returns:
            The index of the source, in declaration order (-1: none is left).
        """
        raise NotImplementedError(type(self))

    def push_from(self, record: Any, source: int) -> Iterable[Any]:
        """Take the next record of a source (the one :meth:`next_source` named).

        Args:
            record: that source's next record.
            source: the index of the source, in declaration order.

        Returns:
            The records that may be emitted now, as :meth:`Accumulator.push` (by default, ``push(record)``).
        """
        return self.push(record)

    def source_ended(self, source: int) -> None:
        """A source stopped (after its passes): never name it again; :meth:`next_source` returns -1 once no
        source is left.

        Args:
            source: the index of the source that stopped, in declaration order.

        Raises:
            NotImplementedError: this merge does not handle sources that stop (the default).
        """
        raise NotImplementedError(f"{type(self).__name__} does not handle sources that stop")


class LaneOperator(Operator):
    """An operator after the merge whose runtime is made per lane and segment: :meth:`make`."""

    stateful = True

    def make(self, ctx: LaneContext) -> Any:
        """The accumulator (``push``/``flush``) for one lane and segment."""
        raise NotImplementedError(type(self))


def call_factory(factory: Callable[..., Any], ctx: LaneContext) -> Any:
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


def positive_int(value: Any, what: str) -> int:
    """``value`` if it is an integer >= 1 (not a bool), else a :class:`PipelineError` naming ``what``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PipelineError(f"{what} must be a positive integer, got {value!r}")
    return value


def choice(value: Any, choices: Sequence[str], what: str) -> str:
    if value not in choices:
        raise PipelineError(f"{what}={value!r}: use one of {tuple(choices)}")
    return value

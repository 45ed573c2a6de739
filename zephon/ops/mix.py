"""``mix``: where the sources meet, an exact deterministic mixture by documents or by tokens.

The mixer decides, by integer arithmetic alone, which source gives the next record: weighted fair
queueing (WF2Q, as in EEVDF schedulers) over the integer weights ``w_s`` (sum ``W``). Each source has a
count ``c_s`` (tokens or documents taken since the last flush, ``t`` their sum) and a stride
``m_s = M / w_s`` (``M`` the lcm of the weights). A source is *eligible* when it is not ahead of its
share (``c_s * W <= t * w_s``); among the eligible ones the next record comes from the one whose next
record would be due first (smallest ``(c_s + 1) * m_s``), lowest index on ties. After any prefix each
source's count is within one document (by documents) or two pieces (by tokens) of its exact share:
the mixture is exact over every window, not a random draw, even with very long documents. Without the
eligibility rule (plain stride scheduling) every source would take a document in the first round,
whatever its weight: weights 1/1/1/7 would drift by more than two documents. Mixing by tokens counts
pieces of at most ``split``'s length, which is why ``split`` comes before ``mix``.

Worked example, weights 0.7/0.3 by documents (integer weights 7 and 3, M = 21, strides 3 and 7)::

    picks: web code web web code web web code web web | web code ... (7 web and 3 code in every 10)

At a flush sentinel the mixer becomes exactly a mixer built at that point: the counts restart from zero
and it forgets which sources have ended. A mixer rebuilt there on resume cannot know it (no operator state
is checkpointed), so the uninterrupted run's mixer must not know it either: after each sentinel an ended
source is named again, found ended by its stream at once (it gives no record), and dropped again, the
counts restarting at that point in both runs.

**Weights that change** (a :class:`~zephon.ops.schedule.Schedule`, or ``loader.set_mixture``): before
each decision the mixer asks the lane's clock (:mod:`zephon.engine.clock`) which step the decision
belongs to and takes the weights in force for that step; when they change, the counts restart (the
mixture is exact within each window of constant weights). A source of weight 0 is never chosen.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Iterable, Mapping, Sequence

from ..errors import PipelineError
from ..records import INPUT_IDS
from ..specs import MIX_BY
from .base import BindContext, LaneContext, LaneOperator, Merge, choice
from .schedule import Schedule, weights_in_force
MAX_DENOMINATOR = 10_000  # weights are read as exact ratios with denominators up to this


def integer_weights(weights: Sequence[float]) -> list[int]:
    """The weights as the smallest exact integers in the same ratios (``0.7, 0.3 -> 7, 3``)."""
    fracs = [Fraction(w).limit_denominator(MAX_DENOMINATOR) for w in weights]
    denom = math.lcm(*(f.denominator for f in fracs))
    ints = [int(f * denom) for f in fracs]
    g = math.gcd(*ints)
    return [i // g for i in ints]


def integer_strides(weights: Sequence[float]) -> list[int]:
    """Strides ``m_s`` with ``m_s * w_s`` equal for all sources, as small exact integers."""
    ints = integer_weights(weights)
    m = math.lcm(*ints)
    return [m // i for i in ints]


class Mix(LaneOperator):
    """Where the sources meet: an exact mixture by ``"tokens"`` or ``"documents"`` (see the module docstring).

    Args:
        by: what the weights count, ``"tokens"`` or ``"documents"``.
        weights: source name -> weight (every source once); None: the sources' own weights.
        schedule: a :class:`~zephon.ops.schedule.Schedule` changing the weights over training steps.
    """

    op = "mix"

    def __init__(self, by: str = "tokens", weights: Mapping[str, float] | None = None,
                 schedule: Schedule | None = None) -> None:
        super().__init__()
        choice(by, MIX_BY, "mix(by)")
        if schedule is not None and not isinstance(schedule, Schedule):
            raise PipelineError(f"mix(schedule=...): pass a zephon.Schedule, got {schedule!r}")
        if weights is not None:
            if not isinstance(weights, Mapping):
                raise PipelineError(f"mix(weights=...): a mapping of source name -> weight is needed, got {weights!r}")
            for k, w in weights.items():
                if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < math.inf:
                    raise PipelineError(f"mix(weights=...): weight of '{k}' must be a finite number > 0, got {w!r}")
        self.by, self.weights, self.schedule = by, dict(weights) if weights is not None else None, schedule
        self._weights: tuple[float, ...] = ()
        self._names: tuple[str, ...] = ()

    def bind(self, ctx: BindContext) -> "Mix":
        """A copy with the weights in source order (the sources' own when ``weights`` is None)."""
        if self.weights is not None and set(self.weights) != set(ctx.sources):
            raise PipelineError(f"mix(weights=...) must name every source once: got {sorted(self.weights)}, "
                                f"sources are {sorted(ctx.sources)}")
        if self.schedule is not None:
            try:
                self.schedule.check_sources(ctx.sources)
            except ValueError as exc:
                raise PipelineError(f"mix(schedule=...): {exc}") from None
        weights = ctx.weights if self.weights is None else tuple(self.weights[n] for n in ctx.sources)
        return self._bound(_weights=tuple(weights), _names=tuple(ctx.sources))

    def make(self, ctx: LaneContext) -> "Mixer":
        return Mixer(self._weights, self.by, self._names, self.schedule, ctx.clock)


class Mixer(Merge):
    """The weighted fair mixer over the pipeline's sources (see the module docstring).

    ``weights`` is one weight per source, in source order; ``schedule`` changes them over steps; ``clock`` is
    the lane's step clock (needed for a schedule or interventions; its ``events`` are the interventions in
    force).
    """

    def __init__(self, weights: Sequence[float], by: str = "tokens", names: Sequence[str] = (),
                 schedule: Schedule | None = None, clock: Any = None) -> None:
        choice(by, MIX_BY, "mix(by)")
        self.by, self.names = by, tuple(names)
        self.raw_weights = [float(w) for w in weights]
        self.by_tokens = by == "tokens"
        self.schedule, self.clock = schedule, clock
        self._step: int | None = None
        self._ended: set[int] = set()
        self._set(self.raw_weights)

    def _set(self, weights: Sequence[float]) -> None:
        """Use ``weights`` (0 for a source never chosen) from now on; the counts restart."""
        self.current = list(weights)
        weights = [0.0 if s in self._ended else w for s, w in enumerate(weights)]
        active = [w for w in weights if w > 0]  # none: nothing is left to choose from
        ints, strides = integer_weights(active), integer_strides(active)
        self.weights, self.strides, self._taken = [0] * len(weights), [0] * len(weights), [0] * len(weights)
        k = 0
        for s, w in enumerate(weights):
            if w > 0:
                self.weights[s], self.strides[s] = ints[k], strides[k]
                k += 1
        self.total_weight = sum(self.weights)

    def _refresh(self) -> None:
        """The weights in force for the step of the next decision (a schedule or interventions)."""
        step = self.clock.step()
        if step == self._step:
            return
        self._step = step
        base = dict(zip(self.names, self.raw_weights))
        w = weights_in_force(self.schedule, base, self.clock.events, step)
        weights = [w[n] for n in self.names]
        if weights != self.current:
            self._set(weights)

    def source_ended(self, source: int) -> None:
        self._ended.add(source)
        self._set(self.current)

    def next_source(self) -> int:
        if self.clock is not None and (self.schedule is not None or self.clock.events):
            self._refresh()
        if len(self.weights) == 1:
            return -1 if self._ended else 0
        return self._pick(self._taken)

    def _pick(self, taken: Sequence[int]) -> int:
        total, big_w = sum(taken), self.total_weight
        best, best_key = -1, 0
        for s, (w, m) in enumerate(zip(self.weights, self.strides)):
            if w and taken[s] * big_w <= total * w:  # eligible: not ahead of its share (one always is)
                key = (taken[s] + 1) * m
                if best < 0 or key < best_key:
                    best, best_key = s, key
        return best

    def take_run(self, limit: int) -> tuple[int, int]:
        """The source of the next record and how many of the next ``limit`` picks go to it in a row, the
        same picks :meth:`next_source` makes one by one (the batched record-rows path): the whole ``limit``
        while one source is left; by tokens, one (the next pick depends on the record's length); by
        documents, as many as the counts give. Changes nothing: :meth:`push_run` books what was taken.

        Returns:
            ``(source, n)``, or ``(-1, 0)`` once no source is left.
        """
        s = self.next_source()
        if s < 0:
            return -1, 0
        if limit <= 1:
            return s, 1
        if len(self.weights) == 1 or sum(1 for w in self.weights if w) == 1:
            return s, limit
        if self.by_tokens:
            return s, 1
        taken = list(self._taken)
        n = 1
        taken[s] += 1
        while n < limit and self._pick(taken) == s:
            taken[s] += 1
            n += 1
        return s, n

    def push_run(self, span: Any, source: int) -> None:
        """Book a run of records of ``source`` (a :class:`~zephon.ops.batch.RecordSpan`) as taken, as
        :meth:`push_from` does for each."""
        self._taken[source] += span.tokens() if self.by_tokens else len(span)

    def book_run(self, source: int, documents: int, tokens: int) -> None:
        """Book ``documents`` records of ``source`` holding ``tokens`` tokens as taken (the batched text path),
        as :meth:`push_from` does for each."""
        self._taken[source] += tokens if self.by_tokens else documents

    def push_from(self, record: Mapping[str, Any], source: int) -> Iterable[Any]:
        self._taken[source] += len(record[INPUT_IDS]) if self.by_tokens else 1
        return (record,)

    def push(self, record: Any) -> Iterable[Any]:
        raise TypeError("mix is fed by the sources (push_from), not by another operator")

    def flush(self) -> Iterable[Any]:
        """Become a fresh mixer for the next segment: counts, weights and ended sources forgotten (a mixer
        rebuilt at this sentinel on resume knows none of them; see the module docstring)."""
        self._step = None
        self._ended.clear()
        self._set(self.raw_weights)
        return ()

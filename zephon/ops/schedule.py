"""Mixture schedules: per-source weights as a function of the training step, and interventions.

A :class:`Schedule` is a list of waypoints ``(step, {source: weight})`` and how to go from one to the
next: ``"step"`` (phases: each waypoint's weights hold until the next waypoint), ``"linear"`` or
``"cosine"`` interpolation. Before the first waypoint its weights hold, after the last the last's. A
weight may be 0 (the source is not read meanwhile); a source that joins later has weight 0 before.
Weights are evaluated once per step (they are constant within a step, so the mixer's exactness holds
within each step's window), and only their ratios matter.

Worked example, warm-up on web text, then more code, then an anneal on the curated source::

    Schedule([(0, {"web": 1.0, "code": 0.0, "curated": 0.0}),
              (2000, {"web": 0.6, "code": 0.4, "curated": 0.0}),
              (9000, {"web": 0.3, "code": 0.3, "curated": 0.4})], interpolate="linear")
    weights_at(1000) -> web 0.8, code 0.2, curated 0.0   (halfway along the first ramp)

An **intervention** (``loader.set_mixture(weights, at_step=s)``) replaces the weights from step ``s`` on:
it is recorded as an event ``(s, weights)`` in every lane's state and applied on top of the schedule (the
latest event at or before the step wins), so a resume replays it.

The clock (which step a mixing decision belongs to) is the lane's own; see :mod:`zephon.ops.mix`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

INTERPOLATIONS = ("step", "linear", "cosine")


def _check_weights(weights: Mapping[str, float], names: Sequence[str] | None, where: str) -> dict[str, float]:
    if not isinstance(weights, Mapping) or not weights:
        raise ValueError(f"{where}: weights must be a table of source name -> weight, got {weights!r}")
    out = {}
    for k, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < math.inf:
            raise ValueError(f"{where}: weight of '{k}' must be a finite number >= 0, got {w!r}")
        out[str(k)] = float(w)
    if names is not None:
        unknown = sorted(set(out) - set(names))
        if unknown:
            raise ValueError(f"{where}: unknown sources {unknown} (the pipeline's sources: {list(names)})")
        out = {n: out.get(n, 0.0) for n in names}
    if not any(out.values()):
        raise ValueError(f"{where}: at least one weight must be > 0")
    return out


@dataclass(frozen=True)
class Schedule:
    """Per-source weights over training steps (see the module docstring).

    Args:
        points: the waypoints, ``[(step, {source: weight}), ...]``, steps increasing from 0 or later; a source
            a waypoint leaves out has weight 0 there.
        interpolate: how the weights go from one waypoint to the next: ``"step"`` (each holds until the next),
            ``"linear"`` or ``"cosine"``.

    Raises:
        ValueError: an unknown ``interpolate``, no waypoint, steps that do not increase, or weights that are
            negative, not finite or all 0.
    """

    points: tuple[tuple[int, tuple[tuple[str, float], ...]], ...]
    """The waypoints as given, normalised: ``((step, ((source, weight), ...)), ...)``, every source at every
    waypoint, sorted by name."""
    interpolate: str = "step"
    """``"step"``, ``"linear"`` or ``"cosine"``."""

    def __init__(self, points: Sequence[tuple[int, Mapping[str, float]]], interpolate: str = "step") -> None:
        if interpolate not in INTERPOLATIONS:
            raise ValueError(f"schedule: interpolate must be one of {INTERPOLATIONS}, got {interpolate!r}")
        if not points:
            raise ValueError("schedule: at least one waypoint (step, weights) is needed")
        norm = []
        last = -1
        for i, point in enumerate(points):
            step, weights = point
            if isinstance(step, bool) or not isinstance(step, int) or step < 0 or step <= last:
                raise ValueError(f"schedule waypoint #{i + 1}: step must be an integer >= 0, after the previous "
                                 f"waypoint's, got {step!r}")
            last = step
            norm.append((step, tuple(sorted(_check_weights(weights, None, f"schedule waypoint #{i + 1}").items()))))
        names = set(k for _, w in norm for k, _ in w)
        filled = tuple((s, tuple(sorted({**dict.fromkeys(names, 0.0), **dict(w)}.items()))) for s, w in norm)
        object.__setattr__(self, "points", filled)
        object.__setattr__(self, "interpolate", interpolate)

    @staticmethod
    def phases(phases: Sequence[tuple[int, Mapping[str, float]]]) -> "Schedule":
        """Piecewise-constant weights: each phase's weights hold from its start step to the next phase's.

        Args:
            phases: ``[(start_step, {source: weight}), ...]``.

        Returns:
            The schedule, with ``interpolate="step"``.
        """
        return Schedule(phases, "step")

    @property
    def sources(self) -> list[str]:
        """The sources the schedule names, sorted."""
        return [k for k, _ in self.points[0][1]]

    def check_sources(self, names: Sequence[str]) -> None:
        """Check that the schedule names only sources of the pipeline.

        Args:
            names: the pipeline's source names.

        Raises:
            ValueError: the schedule names a source the pipeline does not have.
        """
        unknown = sorted(set(self.sources) - set(names))
        if unknown:
            raise ValueError(f"schedule: unknown sources {unknown} (the pipeline's sources: {list(names)})")

    def weights_at(self, step: int) -> dict[str, float]:
        """The weights in force at a step: a waypoint's before the first and after the last, else between two
        waypoints as ``interpolate`` says (rounded to 6 digits: the mixer takes them as exact ratios).

        Args:
            step: a global training step (0-based).

        Returns:
            Source name -> weight (not normalised: only the ratios matter).
        """
        pts = self.points
        if step <= pts[0][0]:
            return dict(pts[0][1])
        for (s0, w0), (s1, w1) in zip(pts, pts[1:]):
            if step < s1:
                if self.interpolate == "step":
                    return dict(w0)
                f = (step - s0) / (s1 - s0)
                if self.interpolate == "cosine":
                    f = (1 - math.cos(math.pi * f)) / 2
                a, b = dict(w0), dict(w1)
                # rounded to 6 digits: the mixer reads weights as exact ratios (denominators up to 10,000)
                return {k: round(a[k] + (b[k] - a[k]) * f, 6) for k in a}
        return dict(pts[-1][1])

    def describe(self) -> dict[str, Any]:
        """The schedule as plain data, for the fingerprint.

        Returns:
            ``{"interpolate": ..., "points": [[step, {source: weight}], ...]}``.
        """
        return {"interpolate": self.interpolate, "points": [[s, dict(w)] for s, w in self.points]}

    @staticmethod
    def from_dict(d: Mapping[str, Any], where: str = "[mix.schedule]") -> "Schedule":
        """A schedule from its recipe table: ``{interpolate, points: [{step, weights}, ...]}``.

        Args:
            d: the table (a ``[mix.schedule]``, or a ``mix`` operator's ``schedule``).
            where: where it comes from, for messages.

        Returns:
            The schedule.

        Raises:
            ValueError: a malformed table or waypoint (naming ``where``).
        """
        if not isinstance(d, Mapping) or not isinstance(d.get("points"), list):
            raise ValueError(f"{where}: a table with points = [{{ step = ..., weights = {{...}} }}, ...] is needed")
        unknown = set(d) - {"interpolate", "points"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)} (interpolate, points)")
        pts = []
        for i, p in enumerate(d["points"]):
            if not isinstance(p, Mapping) or set(p) != {"step", "weights"}:
                raise ValueError(f"{where}: point #{i + 1} must be {{ step = <int>, weights = {{ source = w }} }}")
            pts.append((p["step"], p["weights"]))
        return Schedule(pts, d.get("interpolate", "step"))

    def table(self, names: Sequence[str], steps: Sequence[int]) -> list[tuple[int, dict[str, float]]]:
        """The normalised weights at some steps (for ``zephon inspect``).

        Args:
            names: the sources to give, in order (a source the schedule does not name has weight 0).
            steps: the steps.

        Returns:
            ``[(step, {source: share}), ...]``, the shares of each step adding up to 1.
        """
        out = []
        for s in steps:
            w = {n: self.weights_at(s).get(n, 0.0) for n in names}
            total = sum(w.values()) or 1.0
            out.append((s, {n: v / total for n, v in w.items()}))
        return out


def weights_in_force(schedule: Schedule | None, base: Mapping[str, float], events: Sequence[tuple[int, Any]],
                     step: int) -> dict[str, float]:
    """The weights for decisions of ``step``: the latest intervention at or before it, else the schedule,
    else the static weights."""
    latest = None
    for at, weights in events:
        if at <= step and (latest is None or at >= latest[0]):
            latest = (at, weights)
    if latest is None and schedule is None:
        return dict(base)
    w = latest[1] if latest is not None else schedule.weights_at(step)
    return {k: float(w.get(k, 0.0)) for k in base}


# -- views: a schedule as a table, an ASCII plot and a PNG (``zephon inspect`` prints and draws them) --------
_BLOCKS = " ▁▂▃▄▅▆▇█"


def schedule_steps(schedule: Schedule, last: int | None = None, n: int = 9) -> list[int]:
    """The waypoints, and evenly spaced steps up to a bit past the last one."""
    end = last if last is not None else max(1, int(schedule.points[-1][0] * 1.1) + 1)
    even = [round(end * k / (n - 1)) for k in range(n)]
    return sorted(set(even) | {s for s, _ in schedule.points if s <= end})


def schedule_table(schedule: Schedule, names: Sequence[str], last: int | None = None) -> list[str]:
    """Lines of a table: step, then each source's normalised weight."""
    width = max(6, *(len(n) for n in names))
    lines = ["  " + "step".rjust(8) + "".join(n.rjust(width + 2) for n in names)]
    for step, w in schedule.table(names, schedule_steps(schedule, last)):
        lines.append("  " + str(step).rjust(8) + "".join(f"{w[n]:.3f}".rjust(width + 2) for n in names))
    return lines


def schedule_ascii(schedule: Schedule, names: Sequence[str], last: int | None = None, columns: int = 60) -> list[str]:
    """One row per source: its normalised weight over the run, as block characters."""
    end = last if last is not None else max(1, int(schedule.points[-1][0] * 1.1) + 1)
    steps = [round(end * k / (columns - 1)) for k in range(columns)]
    table = schedule.table(names, steps)
    width = max(len(n) for n in names)
    lines = [f"  {n.rjust(width)} |" + "".join(_BLOCKS[round(w[n] * (len(_BLOCKS) - 1))] for _, w in table) + "|"
             for n in names]
    lines.append(f"  {' ' * width}  0{str(end).rjust(columns - 1)}  (steps)")
    return lines


def schedule_png(schedule: Schedule, names: Sequence[str], path: str, last: int | None = None) -> None:
    """The planned weights over the run, as a stacked area plot (needs matplotlib: the bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = last if last is not None else max(1, int(schedule.points[-1][0] * 1.1) + 1)
    steps = list(range(0, end + 1, max(1, end // 400)))
    table = schedule.table(names, steps)
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.stackplot(steps, [[w[n] for _, w in table] for n in names], labels=list(names), alpha=0.85)
    for s, _ in schedule.points:
        ax.axvline(s, color="k", lw=0.5, ls=":")
    ax.set_xlabel("training step")
    ax.set_ylabel("share of the mixture")
    ax.set_xlim(0, end)
    ax.set_ylim(0, 1)
    ax.set_title(f"mixture schedule ({schedule.interpolate})")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

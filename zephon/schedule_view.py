"""A mixture schedule as a table, an ASCII plot and a PNG (for ``zephon inspect``)."""

from __future__ import annotations

from typing import Sequence

from .ops.schedule import Schedule

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

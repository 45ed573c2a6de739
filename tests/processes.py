"""Processes as /proc shows them, for the tests that check which processes a loader leaves behind and which
resources its processes hold: a process is ``(pid, start time)``, never a later one that reuses its pid."""

from __future__ import annotations

import os
from pathlib import Path

Proc = tuple[int, int]  # (pid, start time in clock ticks): one process, never a later one with its pid


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of ``pid`` from ``/proc/PID/stat``, or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(b")") + 2:].split()  # after the command name, which may hold spaces
    return fields[0].decode(), int(fields[1]), int(fields[19])


def descendants(root: int) -> set[Proc]:
    """Every process below ``root``, by the ppid links of /proc (children, their children, ...)."""
    children: dict[int, list[Proc]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := proc_stat(int(entry))) is not None:
            children.setdefault(stat[1], []).append((int(entry), stat[2]))
    found: set[Proc] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child[0])
    return found


def alive(proc: Proc) -> bool:
    """Whether that very process still runs (a zombie has exited: it only waits to be reaped)."""
    stat = proc_stat(proc[0])
    return stat is not None and stat[2] == proc[1] and stat[0] not in "ZX"

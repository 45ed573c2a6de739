"""Issue 3's throughput targets, checked round by round (used by text_pipeline.py).

This VM's speed drifts by up to 1.5x over minutes, so two configurations' medians can differ by more
than their real difference. Within one round every configuration runs back to back, so a *ratio taken
inside a round* (Zephon / torchdata in round r) cancels the slow drift. Each target below is reported as
the median of its per-round ratios, the min-max over rounds, and in how many rounds it held.

Targets:

* ``1w >= 0.95 plain``: every Zephon 1-worker configuration reaches 95% of the plain single-process loop;
* ``2w >= 1.8 x 1w``: every Zephon (algorithm, runner) with 2 workers reaches 1.8x its 1-worker figure;
  and, where the ``_1cpu`` configurations ran, 1.8x its 1-worker figure pinned to one CPU ("2 workers on
  2 cores" against one worker on one core: a free 1-worker configuration also packs on the second core);
* ``>= torchdata`` and ``> grain``, at every worker count: Zephon's best runner for that count (per
  packing algorithm) against the peer's best configuration for that count, and the same runner kind
  against the same runner kind (thread vs thread, process vs process) where the peer has it.
"""

from __future__ import annotations

import fnmatch
import statistics
from typing import Any


def _per_round(per_cfg: dict[str, list[dict[str, Any]]], pattern: str) -> dict[str, list[float | None]]:
    """Per-round tokens/s of the configurations ``pattern`` matches. Pinned (``_1cpu``) configurations
    match only a pattern that names them: they are baselines, not contenders for "best runner"."""
    out = {}
    for name, rounds in per_cfg.items():
        if name.endswith("_1cpu") and not pattern.endswith("_1cpu"):
            continue
        if fnmatch.fnmatchcase(name, pattern):
            out[name] = [r["tokens_per_s"] if r.get("ok") else None for r in rounds]
    return out


def _best(series: dict[str, list[float | None]], n_rounds: int) -> list[float | None]:
    """Per round, the best of several configurations (None if none ran)."""
    best = []
    for i in range(n_rounds):
        vals = [s[i] for s in series.values() if i < len(s) and s[i] is not None]
        best.append(max(vals) if vals else None)
    return best


def _ratio_line(label: str, num: list[float | None], den: list[float | None], bound: float,
                strict: bool = False) -> str | None:
    ratios = [a / b for a, b in zip(num, den) if a is not None and b]
    if not ratios:
        return None
    held = sum(r > bound if strict else r >= bound for r in ratios)
    med = statistics.median(ratios)
    ok = (med > bound) if strict else (med >= bound)
    return (f"{'MET    ' if ok else 'NOT MET'} {label:<58} median {med:5.2f}  rounds {min(ratios):.2f}-"
            f"{max(ratios):.2f}  held in {held}/{len(ratios)} rounds")


def target_report(per_cfg: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Lines, one per target, from every configuration's list of rounds."""
    n = max((len(v) for v in per_cfg.values()), default=0)
    lines: list[str] = []
    plain = _per_round(per_cfg, "plain_loop").get("plain_loop")
    for algo in ("best_fit", "wrap"):
        for runner in ("thread", "pool", "process"):
            one = _per_round(per_cfg, f"zephon_{algo}_1_{runner}").get(f"zephon_{algo}_1_{runner}")
            two = _per_round(per_cfg, f"zephon_{algo}_2_{runner}").get(f"zephon_{algo}_2_{runner}")
            if one and plain:
                lines.append(_ratio_line(f"zephon {algo} 1 {runner} worker >= 0.95 x plain_loop", one, plain, 0.95))
            if one and two:
                lines.append(_ratio_line(f"zephon {algo} 2 {runner} workers >= 1.8 x 1 {runner} worker", two, one, 1.8))
            one_cpu = _per_round(per_cfg, f"zephon_{algo}_1_{runner}_1cpu").get(f"zephon_{algo}_1_{runner}_1cpu")
            if one_cpu and two:
                lines.append(_ratio_line(f"zephon {algo} 2 {runner} workers >= 1.8 x 1 worker on 1 CPU", two, one_cpu, 1.8))
    for w in (0, 1, 2):
        for algo in ("best_fit", "wrap"):
            zephon_runs = _per_round(per_cfg, f"zephon_{algo}_{w}_*")
            if not zephon_runs:
                continue
            mine = _best(zephon_runs, n)
            for peer, pat, strict in (("torchdata", f"torchdata_nodes_{w}*", False), ("grain", f"grain_*_{w}", True)):
                theirs = _per_round(per_cfg, pat)
                if theirs:
                    word = ">" if strict else ">="
                    lines.append(_ratio_line(f"{w} workers: zephon {algo} (best runner) {word} {peer} (best)",
                                             mine, _best(theirs, n), 1.0, strict))
            if w:  # like for like: the same runner kind on both sides
                for runner, peer_method in (("thread", "thread"), ("pool", "process"), ("process", "process")):
                    z = zephon_runs.get(f"zephon_{algo}_{w}_{runner}")
                    t = _per_round(per_cfg, f"torchdata_nodes_{w}_{peer_method}").get(f"torchdata_nodes_{w}_{peer_method}")
                    if z and t:
                        lines.append(_ratio_line(f"{w} workers: zephon {algo} {runner} >= torchdata {peer_method}",
                                                 z, t, 1.0))
    return [line for line in lines if line]

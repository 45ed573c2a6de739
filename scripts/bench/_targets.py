"""A benchmark's rounds, summarised: the median round, Zephon's hash agreement, and issue 3's throughput
targets checked round by round (used by text_pipeline.py, sliced.py and fetch_batch.py).

This VM's speed drifts by up to 1.5x over minutes, so two configurations' medians can differ by more
than their real difference. Within one round every configuration runs back to back, so a *ratio taken
inside a round* (Zephon / torchdata in round r) cancels the slow drift. Each target below is reported as
the median of its per-round ratios, the min-max over rounds, and in how many rounds it held.

Targets of the text pipeline (``target_report``):

* ``1w >= 0.95 plain``: every Zephon 1-worker configuration reaches 95% of the plain single-process loop;
* ``2w >= 1.8 x 1w``: every Zephon (algorithm, runner) with 2 workers reaches 1.8x its 1-worker figure;
  and, where the ``_1cpu`` configurations ran, 1.8x its 1-worker figure pinned to one CPU ("2 workers on
  2 cores" against one worker on one core: a free 1-worker configuration also packs on the second core);
* ``>= torchdata`` and ``> grain``, at every worker count: Zephon's best runner for that count (per
  packing algorithm) against the peer's best configuration for that count, and the same runner kind
  against the same runner kind (thread vs thread, process vs process) where the peer has it.

Fetch-and-batch (``target_report(..., pipeline="fetch")``, on records/s): the peer comparisons at every
worker count, and Zephon on one core (no workers) at or above a 16,000 records/s consumer.
"""

from __future__ import annotations

import fnmatch
import random
import re
import statistics
from typing import Any, Sequence


CONSUMER_RECORDS_PER_S = 16_000  # the fetch-and-batch consumer the engine must never limit, on one core


def median_round(rounds: list[dict[str, Any]], metric: str = "tokens_per_s") -> dict[str, Any]:
    """One configuration's rounds -> the round with the median ``metric`` (lower middle for an even count),
    with every round's figure in ``round_<metric>``; failed if any round failed; the batch hashes must
    agree between rounds."""
    bad = [r for r in rounds if not r.get("ok")]
    if bad:
        return bad[0]
    ranked = sorted(rounds, key=lambda r: r[metric])
    pick = dict(ranked[(len(ranked) - 1) // 2])
    pick[f"round_{metric}"] = [r[metric] for r in rounds]
    pick["round_first_batch_s"] = [r["first_batch_s"] for r in rounds]
    pick["peak_rss_mb"] = max(r["peak_rss_mb"] for r in rounds)
    if any(r.get("digests") != rounds[0].get("digests") for r in rounds):
        pick["repeats_agree"] = False
    return pick


def zephon_hash_check(results: dict[str, dict[str, Any]]) -> tuple[list[str], bool, bool]:
    """Every Zephon configuration of one pack algorithm must have produced the same batch SHA-256s (and
    the same ones in each of its runs). Returns (report lines, any mismatch, any Zephon failure)."""
    lines, mismatch = [], False
    zr = {n: r for n, r in results.items() if r.get("kind") == "zephon"}
    failed = [n for n, r in zr.items() if not r.get("ok")]
    by_algo: dict[str, list[str]] = {}
    for n, r in zr.items():
        if r.get("ok"):
            by_algo.setdefault(r["params"]["algorithm"], []).append(n)
    for algo, names in by_algo.items():
        ref = results[names[0]]["digests"]
        bad = [n for n in names if results[n]["digests"] != ref]
        rep = [n for n in names if not results[n].get("repeats_agree", True)]
        if bad or rep:
            mismatch = True
            for n in bad:
                d = results[n]["digests"]
                first = next((i for i, (a, b) in enumerate(zip(d, ref)) if a != b), min(len(d), len(ref)))
                lines.append(f"HASH MISMATCH [{algo}]: {n} differs from {names[0]} at batch {first}")
            for n in rep:
                lines.append(f"HASH MISMATCH [{algo}]: {n} gave different batches in different runs")
        else:
            lines.append(f"zephon {algo}: {len(names)} configurations agree on all {len(ref)} batch SHA-256s "
                         f"(first {ref[0][:16]}..., last {ref[-1][:16]}...)")
    for n in failed:
        lines.append(f"zephon configuration FAILED (not hash-checked): {n}: {results[n].get('error')}")
    return lines, mismatch, bool(failed)


VARIANT_MARKS = ("_1cpu", "_pool_default", "_pool_on")


def _per_round(per_cfg: dict[str, list[dict[str, Any]]], pattern: str,
               metric: str = "tokens_per_s") -> dict[str, list[float | None]]:
    """Per-round ``metric`` of the configurations ``pattern`` matches. Pinned (``_1cpu``) configurations and
    the tokenizer-pool variants (``_pool_default``, ``_pool_on``: another environment than the peers')
    match only a pattern that names them: they are baselines, not contenders for "best runner"."""
    out = {}
    for name, rounds in per_cfg.items():
        if any(v in name and v not in pattern for v in VARIANT_MARKS):
            continue
        if fnmatch.fnmatchcase(name, pattern):
            out[name] = [r[metric] if r.get("ok") else None for r in rounds]
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


def _floor_line(label: str, values: list[float | None], floor: float) -> str | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    med = statistics.median(vals)
    return (f"{'MET    ' if med >= floor else 'NOT MET'} {label:<58} median {med:7,.0f}  rounds {min(vals):,.0f}-"
            f"{max(vals):,.0f}  held in {sum(v >= floor for v in vals)}/{len(vals)} rounds")


def target_report(per_cfg: dict[str, list[dict[str, Any]]], pipeline: str = "text") -> list[str]:
    """Lines, one per target, from every configuration's list of rounds. ``pipeline``: ``"text"``
    (text_pipeline.py and sliced.py names, tokens/s) or ``"fetch"`` (fetch_batch.py names, records/s)."""
    if pipeline not in ("text", "fetch"):
        raise ValueError(f"pipeline must be 'text' or 'fetch', got {pipeline!r}")
    text = pipeline == "text"
    metric = "tokens_per_s" if text else "records_per_s"
    n = max((len(v) for v in per_cfg.values()), default=0)
    lines: list[str] = []
    if not text:
        for algo in ("best_fit", "wrap"):
            inline = _per_round(per_cfg, f"zephon_{algo}_0_inline", metric).get(f"zephon_{algo}_0_inline")
            if inline:
                lines.append(_floor_line(f"zephon {algo} on one core (0 workers) >= {CONSUMER_RECORDS_PER_S:,} "
                                         f"records/s", inline, CONSUMER_RECORDS_PER_S))
    plain = _per_round(per_cfg, "plain_loop").get("plain_loop") if text else None
    for algo in ("best_fit", "wrap") if text else ():
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
            zephon_runs = _per_round(per_cfg, f"zephon_{algo}_{w}_*", metric)
            if not zephon_runs:
                continue
            mine = _best(zephon_runs, n)
            grain = f"grain_*_{w}" if text else f"grain_{w}"  # text: one per Grain packer; fetch: no packing
            for peer, pat, strict in (("torchdata", f"torchdata_nodes_{w}*", False), ("grain", grain, True)):
                theirs = _per_round(per_cfg, pat, metric)
                if theirs:
                    word = ">" if strict else ">="
                    lines.append(_ratio_line(f"{w} workers: zephon {algo} (best runner) {word} {peer} (best)",
                                             mine, _best(theirs, n), 1.0, strict))
            if w:  # like for like: the same runner kind on both sides
                for runner, peer_method in (("thread", "thread"), ("pool", "process"), ("process", "process")):
                    z = zephon_runs.get(f"zephon_{algo}_{w}_{runner}")
                    t = _per_round(per_cfg, f"torchdata_nodes_{w}_{peer_method}", metric).get(
                        f"torchdata_nodes_{w}_{peer_method}")
                    if z and t:
                        lines.append(_ratio_line(f"{w} workers: zephon {algo} {runner} >= torchdata {peer_method}",
                                                 z, t, 1.0))
    return [line for line in lines if line]


# -- the 1-worker / 2-worker pairs, for time-sliced runs (sliced.py) ------------------------------------
def pair_family(name: str) -> str:
    """The name with its worker count taken out: a 1-worker configuration and its 2-worker counterpart
    share it (``zephon_wrap_1_thread`` / ``zephon_wrap_2_thread`` -> ``zephon_wrap_N_thread``; the
    tokenizer alone on one helper thread and on two threads -> ``tokenizer_alone_N``)."""
    if name in ("tokenizer_alone_thread", "tokenizer_alone_2threads"):
        return "tokenizer_alone_N"
    return re.sub(r"_[12]_", "_N_", name, count=1)


def adjacent_pair_order(names: Sequence[str], rng: random.Random) -> list[str]:
    """A random order of ``names`` in which every 1-worker/2-worker pair runs back to back (which of the
    two goes first is random too), so that a per-pass ratio compares slices seconds apart, not a pass
    apart: on this VM the speed drifts within a pass."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(pair_family(name), []).append(name)
    families = list(groups)
    rng.shuffle(families)
    order: list[str] = []
    for fam in families:
        members = groups[fam][:]
        rng.shuffle(members)
        order += members
    return order


def totals_ratio_lines(totals: dict[str, tuple[float, int]], bound: float = 1.8) -> list[str]:
    """For every 1-worker/2-worker pair, the ratio of their throughputs over all their slices together
    (``totals[name] = (seconds, tokens)``): interleaved slices share the machine's slow spells, and
    a slice's whole-batch rounding averages out over many slices. The tokenizer alone's pair is the
    machine's own two-core scaling, printed for reference."""
    rate = {n: tok / sec for n, (sec, tok) in totals.items() if sec > 0}
    lines = []
    if "tokenizer_alone_thread" in rate and "tokenizer_alone_2threads" in rate:
        ratio = rate["tokenizer_alone_2threads"] / rate["tokenizer_alone_thread"]
        lines.append(f"machine {'tokenizer alone, 2 threads / 1 helper thread':<58} all slices {ratio:5.2f}")
    for algo in ("best_fit", "wrap"):  # the pairs target_report checks, in its order
        for runner in ("thread", "pool", "process"):
            one, two = rate.get(f"zephon_{algo}_1_{runner}"), rate.get(f"zephon_{algo}_2_{runner}")
            if one and two:
                label = f"zephon {algo} 2 {runner} workers >= {bound:g} x 1 {runner} worker"
                lines.append(f"{'MET    ' if two / one >= bound else 'NOT MET'} {label:<58} all slices {two / one:5.2f}")
    return lines


def fresh_ratio_lines(names: Sequence[str], val: Any, rounds: int, unit: str = "") -> list[str]:
    """Information, not targets: each ``*_fresh`` configuration (``build(reuse_batch_memory=False)``)
    against the same configuration with batch memory reused, as ratios inside each round
    (``val(name, round)``: a throughput, or None where that run failed)."""
    lines = []
    for fresh in [n for n in names if n.endswith("_fresh")]:
        reused = fresh.removesuffix("_fresh")
        ratios = [val(reused, r) / val(fresh, r) for r in range(rounds) if val(reused, r) and val(fresh, r)]
        if ratios:
            lines.append(f"{reused} / {fresh}{unit} = {statistics.median(ratios):.2f} "
                         f"({min(ratios):.2f}-{max(ratios):.2f}; information: batch memory reused or not)")
    return lines

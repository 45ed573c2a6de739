"""Loader checkpoints: lane-keyed, versioned, JSON-serialisable, fingerprinted.

A loader state is ``{"format", "version", "fingerprint", "recipe", "step", "lanes": {lane: LaneState}}``.
Because it is keyed by lane, the states of all ranks of a checkpoint merge into one (see
:func:`merge_states`) from which any rank of any world size dividing the lane count can resume.
The fingerprint covers everything that decides the bytes of the batches (and nothing that only
changes speed), so a state from another recipe is refused with the fields that differ.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

from ..plan import WorkPlan
from ..recipe import Recipe

STATE_FORMAT = "zephon.loader_state"
STATE_VERSION = 2  # 2: lanes carry the packer's post-sentinel top-up (``carry``)


class StateError(ValueError):
    """A checkpoint that cannot be loaded here; the message says why and what to do."""


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def recipe_summary(recipe: Recipe, plan: WorkPlan) -> dict[str, Any]:
    """The determinism-relevant content of a recipe (file lists as hashes), for fingerprints."""
    t = recipe.tokenizer
    sources = []
    for sp in plan.sources:
        files = "\n".join(sp.relative_files())
        sources.append({"name": sp.spec.name, "format": sp.spec.format, "text_field": sp.spec.text_field,
                        "weight": sp.spec.weight, "files": len(sp.files), "units": len(sp.units),
                        "files_sha256": hashlib.sha256(files.encode()).hexdigest()[:16],
                        # only when set, so that text sources keep their existing fingerprints
                        **({"tokens_field": sp.spec.tokens_field} if sp.spec.tokens_field else {})})
    return {
        "seed": recipe.seed, "lanes": recipe.lanes, "seq_len": recipe.seq_len,
        "batch_per_lane": recipe.batch_per_lane, "flush_every": recipe.flush_every,
        "tokenizer": {"kind": t.kind, "sha256": _file_sha256(t.path)[:16], "add_eos": t.add_eos,
                      "add_bos": t.add_bos, "eos_token": t.eos_token, "bos_token": t.bos_token,
                      "pad_id": t.pad_id, "pat_str": t.pat_str},
        "pack": {"algorithm": recipe.pack.algorithm, "max_open_bins": recipe.pack.max_open_bins},
        "mix_by": recipe.mix_by, "shuffle_buffer": recipe.shuffle_buffer, "split_len": recipe.split_len,
        "unit_bytes": recipe.unit_bytes,
        "sources": sources,
    }


def fingerprint(summary: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()[:32]


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: checkpoint has {a!r}, recipe has {b!r}"]


def check_compatible(state: dict[str, Any], fp: str, summary: dict[str, Any]) -> None:
    """Raise :class:`StateError` unless ``state`` was written by this recipe and this format."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise StateError("not a Zephon loader state (missing format marker); pass what "
                         "loader.state_dict() or zephon.merge_states() returned.")
    if state.get("version") != STATE_VERSION:
        raise StateError(f"loader state version {state.get('version')} is not supported by this Zephon "
                         f"(it reads version {STATE_VERSION}; version 1 states padded the row at each flush, so "
                         "the rows after them differ). Resume with the Zephon release that wrote the state, "
                         "or start the run afresh.")
    if state.get("fingerprint") != fp:
        diffs = _diff(state.get("recipe", {}), summary) or ["(no field differs; the file lists differ)"]
        raise StateError("this checkpoint was written by a different recipe (fingerprint "
                         f"{state.get('fingerprint')} != {fp}); resuming it would not continue the same "
                         "run. Differences:\n  " + "\n  ".join(diffs[:20]))


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Merge the per-rank states of one checkpoint into one state holding every lane."""
    if not states:
        raise StateError("merge_states() needs at least one state.")
    first = states[0]
    for i, s in enumerate(states):
        if s.get("format") != STATE_FORMAT:
            raise StateError(f"state #{i} is not a Zephon loader state.")
        for key in ("version", "fingerprint", "step"):
            if s.get(key) != first.get(key):
                raise StateError(f"state #{i} has {key}={s.get(key)!r} but state #0 has {first.get(key)!r}: "
                                 f"these states do not come from the same checkpoint.")
    lanes: dict[str, Any] = {}
    for i, s in enumerate(states):
        for lane, lane_state in s["lanes"].items():
            if lane in lanes and lanes[lane] != lane_state:
                raise StateError(f"lane {lane} appears in two states with different positions.")
            lanes[lane] = lane_state
    merged = {k: v for k, v in first.items() if k not in ("lanes", "rank", "world_size")}
    merged["lanes"] = dict(sorted(lanes.items(), key=lambda kv: int(kv[0])))
    return merged


def save_state(state: dict[str, Any], path: str | Path) -> None:
    """Write a state as JSON (atomically: a crash leaves the old file)."""
    p = Path(path)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(p)


def load_state(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())

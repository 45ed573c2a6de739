"""Loader states: lane-keyed, versioned, JSON-serialisable, fingerprinted and integrity-checked.

A loader state is::

    {"format": "zephon.loader_state", "version": 3, "fingerprint": "...", "pipeline": {...},
     "step": 120, "rank": 0, "world_size": 8, "lanes": {"0": LaneState, ...}, "digest": "..."}

Because it is keyed by lane, the states of all ranks of a checkpoint merge into one
(:func:`merge_states`) from which any rank of any world size dividing the lane count can resume. The
fingerprint covers everything that decides the bytes of the batches (sources and their file lists,
every operator and its parameters, user functions by name and version) and nothing that only changes
speed, so a state from another pipeline is refused with the fields that differ, naming the operator.

A state is untrusted input. Integrity digests (SHA-256 over canonical JSON) are written with it: one
over the header (format, version, fingerprint, step) and one per lane, over the lane's state together
with the header's fingerprint and step and the lane's number. Per lane, so that the lanes of a state can
be stored apart (one checkpoint entry per lane, as the Torchtitan and Megatron-LM plugins do) and merged
in any grouping, and a damaged one is named. An edited or corrupted state is refused before any of it is
used. The digests detect accidents and casual edits, not a forger who recomputes them (they are not
keyed): every field is range-checked besides (:mod:`zephon.state.lane`).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from .lane import MAX_INT
from ..errors import StateError

STATE_FORMAT = "zephon.loader_state"
# 3: pipelines (graph fingerprint); positions [unit_seq, cursor, skip]; sentinels; digest.
# 4: the exact step clock: a lane's clock is [rows, release] (zephon.engine.clock).
STATE_VERSION = 4
_HEADER = ("format", "version", "fingerprint", "step", "events", "ended")
_HOW = "Pass the state exactly as loader.state_dict(), zephon.merge_states() or zephon.load_state() returned it."


def _sha(body: Any) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def state_digest(state: Mapping[str, Any]) -> str:
    """The integrity digest of a state's header (see the module docstring)."""
    return _sha({k: state.get(k) for k in _HEADER})


def _lane_bits(state: Mapping[str, Any], lane: str, lane_state: Any) -> bytes:
    body = {k: v for k, v in lane_state.items() if k != "digest"} if isinstance(lane_state, Mapping) else lane_state
    body = {"fingerprint": state.get("fingerprint"), "step": state.get("step"), "lane": lane, "state": body}
    return bytes.fromhex(_sha(body))[:16]


def lane_digest(state: Mapping[str, Any], lane: str, lane_state: Mapping[str, Any]) -> str:
    """The integrity digest of one lane's state within a state (see the module docstring).

    128 bits per lane (integrity against accidents, and a checkpoint stays small: hundreds of lanes), written
    as 22 base64url characters rather than 32 hex digits: 10 bytes less per lane, the same bits. States
    written with the hex spelling (before issue 19) still pass :func:`check_container`."""
    return base64.urlsafe_b64encode(_lane_bits(state, lane, lane_state)).rstrip(b"=").decode()


def _lane_digest_ok(state: Mapping[str, Any], lane: str, lane_state: Any) -> bool:
    if not isinstance(lane_state, Mapping) or not isinstance(lane_state.get("digest"), str):
        return False
    bits = _lane_bits(state, lane, lane_state)
    return lane_state["digest"] in (base64.urlsafe_b64encode(bits).rstrip(b"=").decode(), bits.hex())


def seal(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its digests set (the header's and each lane's)."""
    lanes = state.get("lanes")
    if isinstance(lanes, Mapping):
        state["lanes"] = {k: ({**{n: x for n, x in v.items() if n != "digest"}, "digest": lane_digest(state, k, v)}
                              if isinstance(v, Mapping) else v) for k, v in lanes.items()}
    state["digest"] = state_digest(state)
    return state


def check_container(state: Any, what: str = "the state") -> None:
    """The outer structure: a dict with the format marker, a supported version, an int step, lanes keyed by
    lane numbers, and a digest that matches."""
    if state is None:
        raise StateError(f"load_state_dict(None): there is no state to load. {_HOW}")
    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        raise StateError(f"{what} is not a Zephon loader state (no format marker '{STATE_FORMAT}'). {_HOW}")
    version = state.get("version")
    if version != STATE_VERSION:
        raise StateError(f"{what} has version {version!r}; this Zephon reads version {STATE_VERSION} (version 3 "
                         f"states came from Zephon 0.2, whose step clock estimated a decision's step from tokens; "
                         f"version 2 ones from the fixed text chain). Resume with the Zephon release that wrote it, "
                         f"or start the run afresh.")
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < MAX_INT:
        raise StateError(f"{what}: 'step' must be an integer >= 0, got {step!r}. {_HOW}")
    lanes = state.get("lanes")
    if not isinstance(lanes, Mapping) or not lanes:
        raise StateError(f"{what}: 'lanes' must map lane numbers to lane states, got {type(lanes).__name__}. {_HOW}")
    for key in lanes:
        if not isinstance(key, str) or not key.isdigit() or str(int(key)) != key:
            raise StateError(f"{what}: lane key {key!r} is not a lane number. {_HOW}")
    if not isinstance(state.get("fingerprint"), str):
        raise StateError(f"{what} has no fingerprint. {_HOW}")
    restore = "it was edited or corrupted after it was written. Restore the checkpoint's original state."
    if state.get("digest") != state_digest(state):
        raise StateError(f"{what} fails its integrity check (header digest mismatch): {restore}")
    for key, lane_state in lanes.items():
        if not _lane_digest_ok(state, key, lane_state):
            raise StateError(f"{what}: lane {key} fails its integrity check (digest mismatch): {restore}")


def _label(summary: Mapping[str, Any], path: list) -> str:
    """A readable name for a summary field: which source, which operator."""
    out, node = [], summary
    for key in path:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            node = None
        if isinstance(key, int):
            name = node.get("name") or node.get("op") if isinstance(node, Mapping) else None
            out.append(f"[{key}]" + (f" ({name})" if name else ""))
        else:
            out.append(("." if out else "") + str(key))
    return "".join(out)


def _diff(a: Any, b: Any, path: list, summary: Mapping[str, Any]) -> list[str]:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), path + [k], summary)]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, path + [i], summary)]
    if a == b:
        return []
    return [f"{_label(summary, path) or '(top level)'}: checkpoint has {json.dumps(a, default=str)[:120]}, "
            f"this pipeline has {json.dumps(b, default=str)[:120]}"]


def check_compatible(state: Mapping[str, Any], fp: str, summary: Mapping[str, Any]) -> None:
    """Raise :class:`StateError` unless ``state`` was written by this pipeline (same fingerprint)."""
    if state.get("fingerprint") != fp:
        diffs = _diff(state.get("pipeline", {}), summary, [], summary) or \
            ["(no field differs; the file lists or their order differ)"]
        raise StateError("this checkpoint was written by a different pipeline (fingerprint "
                         f"{state.get('fingerprint')} != {fp}); resuming it would not continue the same run. "
                         "Differences:\n  " + "\n  ".join(diffs[:20]))


# torchdata wraps a node's state: Loader as {"root": ..., "num_yielded": n}, Batcher (and the like) as {"source": ...}
_WRAPPERS = ("root", "source")


def _unwrap(state: Any) -> tuple[list[tuple[str, dict]], Any]:
    """``state`` without torchdata's wrappers, and the wrappers (key, the other fields), outermost first."""
    wrappers = []
    while isinstance(state, Mapping) and state.get("format") != STATE_FORMAT:
        key = next((k for k in _WRAPPERS if k in state), None)
        if key is None:
            break
        wrappers.append((key, {k: v for k, v in state.items() if k != key}))
        state = state[key]
    return wrappers, state


def unwrap_state(state: Any) -> Any:
    """A loader state without the wrappers torchdata's ``Loader`` and ``Batcher`` put around it."""
    return _unwrap(state)[1]


def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge the per-rank states of one checkpoint into one state holding every lane.

    Args:
        states: each rank's ``loader.state_dict()`` (or ``loader.node``'s state as torchdata's ``Loader`` or
            ``Batcher`` wrap it: ``{"root": ..., "num_yielded": n}``, ``{"source": ...}``; all alike).

    Returns:
        One state any rank of any world size dividing the lane count resumes from, wrapped as the inputs were.

    Raises:
        StateError: a state is not a Zephon loader state, fails its integrity check, or comes from another
            checkpoint (another step, pipeline or set of interventions) than the others.
    """
    if not isinstance(states, Sequence) or isinstance(states, (str, bytes, Mapping)) or not states:
        raise StateError("merge_states() needs a non-empty list of states (one per rank).")
    unwrapped = [_unwrap(s) for s in states]
    wrappers = unwrapped[0][0]
    for i, (w, _) in enumerate(unwrapped):
        if w != wrappers:
            raise StateError(f"state #{i} is wrapped as {[k for k, _ in w]} with {[f for _, f in w]}, state #0 as "
                             f"{[k for k, _ in wrappers]} with {[f for _, f in wrappers]}: the states of one "
                             f"checkpoint come from the same kind of loader at the same step.")
    merged: Any = _merge([s for _, s in unwrapped])
    for key, fields in reversed(wrappers):
        merged = {**fields, key: merged}
    return merged


def _merge(states: Sequence[Any]) -> dict[str, Any]:
    for i, s in enumerate(states):
        check_container(s, f"state #{i}")
    first = states[0]
    for i, s in enumerate(states):
        for key in ("version", "fingerprint", "step", "events"):
            if s.get(key) != first.get(key):
                if key == "events":
                    raise StateError(f"state #{i} (rank {s.get('rank')}) has the mixture interventions "
                                     f"{s.get(key)!r} but state #0 (rank {first.get('rank')}) has {first.get(key)!r}: "
                                     f"the ranks disagree on set_mixture; every rank must issue the same calls.")
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
    return merged  # every part was checked and has the same header: their digests hold as they are


def state_json(state: Mapping[str, Any]) -> str:
    """A state as compact JSON with one lane per line: 64 lanes of two sources in about 15 KB (indented JSON
    took half as much again), and a diff of two checkpoints shows the lanes that moved."""
    compact = functools.partial(json.dumps, separators=(",", ":"))
    lanes = state.get("lanes") if isinstance(state, Mapping) else None
    if not isinstance(lanes, Mapping) or not all(isinstance(k, str) for k in [*state, *lanes]):
        return compact(state) + "\n"
    parts = [compact(k) + ":" + ("{\n" + ",\n".join(compact(lane) + ":" + compact(v) for lane, v in lanes.items())
                                  + "\n}" if k == "lanes" else compact(v)) for k, v in state.items()]
    return "{" + ",\n".join(parts) + "}\n"


def save_state(state: Mapping[str, Any], path: str | Path) -> None:
    """Write a state as JSON atomically and durably: a crash leaves the old file or the new one, whole.

    Args:
        state: a loader state (``loader.state_dict()``, or :func:`merge_states` of every rank's).
        path: the file to write (replaced atomically).

    Raises:
        OSError: the file cannot be written.
    """
    p = Path(path)
    tmp = p.with_suffix(p.suffix + ".tmp")
    data = state_json(state).encode()
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    try:  # the rename itself is durable once the folder is synced
        fd = os.open(p.parent if str(p.parent) else ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def load_state(path: str | Path) -> dict[str, Any]:
    """Read a state written by :func:`save_state` (checked when it is loaded into a loader).

    Args:
        path: the JSON file.

    Returns:
        The state, for ``loader.load_state_dict``.

    Raises:
        StateError: the file is not JSON.
        OSError: the file cannot be read.
    """
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise StateError(f"{path}: not a JSON loader state ({exc}); pass a file written by `zephon run --save-state` "
                         f"or zephon.save_state().") from None

"""A lane's resumable state, and the checks that make an edited or corrupted one a clear error.

:class:`LaneState` is where the lane's last flush sentinel before its last delivered row stood:

- ``sentinels``: how many sentinels the lane had passed there (its segment number);
- ``positions``: per source name, ``[unit_seq, cursor, skip]`` of its reader: the lane's ``unit_seq``-th
  unit of that source, the reader cursor inside it (-1: the unit's start) and how many records the
  stateless operators make from that cursor were already taken (pieces of a split document, outputs
  of a flat_map);
- ``rows_since_flush``: rows of this lane delivered after that sentinel;
- ``carry``: tokens after that sentinel that went into the row before it (the packer's top-up);
- ``clock``: ``[rows, release]``, the lane's step clock at that sentinel: the rows the lane had received
  there, and when the packer released the row it held over the sentinel (the sentinel's ``release``:
  -1 none held, 0 at the next sentinel, ``k`` after the ``k``-th document; :mod:`zephon.engine.clock`), so
  that a rebuilt lane assigns its mixing decisions to the same steps;
- ``replay`` (optional): per source, the chunks the lane had taken since that sentinel: how many chunk
  tasks a resume puts in flight at once to replay the segment. A hint for speed only: any value
  (capped) gives the same rows.

A state is untrusted input: :func:`parse_lane_state` checks every field's type and range, and each
position against the work plan (the unit exists for this lane; the cursor lies inside it). What can only
be checked against the data is checked while the lane replays: the cursor must be a record boundary and
the skip must fall between two records made from it (:mod:`zephon.engine.stages`), ``rows_since_flush``
rows must exist before the next sentinel, and ``carry`` tokens before it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import StateError

MAX_INT = 2 ** 53  # integers in a state stay exact in any JSON reader
MAX_REPLAY_HINT = 2 ** 20  # chunks since a sentinel: far above any cadence (the lane caps what it submits)


@dataclass(frozen=True)
class LaneState:
    """A lane's resumable state: where its last flush sentinel before its last delivered row stood (see the
    module docstring)."""

    sentinels: int
    """How many sentinels the lane had passed there (its segment number)."""
    positions: dict[str, tuple[int, int, int]]
    """Per source name, ``(unit_seq, cursor, skip)`` of its reader at the sentinel."""
    rows_since_flush: int
    """Rows of this lane delivered after the sentinel."""
    carry: int = 0
    """Tokens after the sentinel that went into the row before it (the packer's top-up)."""
    clock: tuple[int, int] = (0, -1)
    """``(rows, release)``: the lane's step clock at the sentinel (:mod:`zephon.engine.clock`)."""
    replay: tuple[int, ...] = ()
    """Per source, the chunks the lane had taken since the sentinel: a replay hint (speed only)."""

    def to_dict(self) -> dict[str, Any]:
        """The state as JSON data, as a loader state holds it per lane.

        Returns:
            ``{"sentinels", "positions": {source: [unit_seq, cursor, skip]}, "rows_since_flush", "carry",
            "clock"}``, and ``"replay"`` when there is a hint.
        """
        d = {"sentinels": self.sentinels, "positions": {k: list(v) for k, v in self.positions.items()},
             "rows_since_flush": self.rows_since_flush, "carry": self.carry, "clock": list(self.clock)}
        if self.replay:
            d["replay"] = list(self.replay)
        return d

    @staticmethod
    def initial(names: Sequence[str]) -> "LaneState":
        """The state of a lane that has not started: no sentinel passed, every source at its first unit.

        Args:
            names: the pipeline's source names.

        Returns:
            The initial state.
        """
        return LaneState(0, {n: (0, -1, 0) for n in names}, 0)


def _int(value: Any, where: str, lo: int, hi: int = MAX_INT) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise StateError(f"{where} must be an integer, got {type(value).__name__} {value!r:.40}")
    if not lo <= value < hi:
        raise StateError(f"{where} = {value} is outside [{lo}, {hi})")
    return value


_KEYS = {"sentinels", "positions", "rows_since_flush", "carry", "clock"}


def parse_lane_state(d: Any, lane: int, names: Sequence[str], max_carry: int, plan: Any = None) -> LaneState:
    """A :class:`LaneState` from its dict, every field type- and range-checked (``plan``: also check each
    position against the lane's units). Raises :class:`StateError` naming the lane and the field."""
    where = f"lane {lane}"
    if not isinstance(d, Mapping):
        raise StateError(f"{where}: a lane state must be an object {{sentinels, positions, rows_since_flush, carry}}, "
                         f"got {type(d).__name__}")
    unknown = set(d) - _KEYS - {"digest", "replay"}
    missing = _KEYS - set(d)
    if unknown or missing:
        raise StateError(f"{where}: the lane state has " + "; ".join(
            ([f"unknown fields {sorted(unknown)}"] if unknown else []) + ([f"no {sorted(missing)}"] if missing else []))
            + ". A lane state is {sentinels, positions: {source: [unit_seq, cursor, skip]}, rows_since_flush, carry, "
              "clock}: pass the state exactly as state_dict() or merge_states() returned it.")
    sentinels = _int(d["sentinels"], f"{where}: sentinels", 0)
    rows = _int(d["rows_since_flush"], f"{where}: rows_since_flush", 0)
    carry = _int(d["carry"], f"{where}: carry", 0, max(1, max_carry))
    positions = d["positions"]
    if not isinstance(positions, Mapping):
        raise StateError(f"{where}: positions must map each source name to [unit_seq, cursor, skip]")
    if set(positions) != set(names):
        raise StateError(f"{where}: positions name sources {sorted(positions)}, the pipeline has {sorted(names)}")
    parsed: dict[str, tuple[int, int, int]] = {}
    for i, name in enumerate(names):
        p = positions[name]
        at = f"{where}: positions['{name}']"
        if not isinstance(p, (list, tuple)) or len(p) != 3:
            raise StateError(f"{at} must be [unit_seq, cursor, skip], got {p!r:.60}")
        unit_seq = _int(p[0], f"{at}[0] (unit_seq)", 0)
        cursor = _int(p[1], f"{at}[1] (cursor)", -1)
        skip = _int(p[2], f"{at}[2] (skip)", 0)
        if cursor == -1 and skip:
            raise StateError(f"{at}: skip {skip} at the start of a unit (cursor -1) cannot happen")
        if plan is not None and cursor >= 0:
            _check_cursor(plan.sources[i], lane, unit_seq, cursor, at)
        parsed[name] = (unit_seq, cursor, skip)
    clock = d["clock"]
    if not isinstance(clock, (list, tuple)) or len(clock) != 2:
        raise StateError(f"{where}: clock must be [rows, release], got {clock!r:.60}")
    rows_at = _int(clock[0], f"{where}: clock[0] (rows)", 0)
    release = _int(clock[1], f"{where}: clock[1] (release)", -1)
    if sentinels == 0 and (rows_at, release, carry) != (0, -1, 0):
        raise StateError(f"{where}: clock {list(clock)} and carry {carry} before the first sentinel must be [0, -1] "
                         f"and 0")
    if (release >= 0 and rows_at == 0) or (release < 0 and carry):
        raise StateError(f"{where}: clock {list(clock)} with carry {carry} cannot happen: a held row (release >= 0) "
                         f"follows a delivered row, and a carry needs a held row")
    replay = d.get("replay", [])
    if not isinstance(replay, (list, tuple)) or len(replay) not in (0, len(names)):
        raise StateError(f"{where}: replay must be a list of one chunk count per source, got {replay!r:.60}")
    counts = tuple(_int(v, f"{where}: replay[{i}]", 0, MAX_REPLAY_HINT) for i, v in enumerate(replay))
    return LaneState(sentinels, parsed, rows, carry, (rows_at, release), counts)


def _check_cursor(source: Any, lane: int, unit_seq: int, cursor: int, at: str) -> None:
    """The cursor must lie inside the lane's ``unit_seq``-th unit (before its end: at the end the position
    would be the next unit's start), at the start of a record."""
    unit = source.lane_unit(lane, unit_seq)
    path = source.files[unit.file]
    bounds = source.reader.chunk_bounds(path, unit, -1)
    lo = unit.start
    hi = bounds[-1][1] if bounds else unit.start
    if not lo <= cursor < hi:
        raise StateError(f"{at}: cursor {cursor} is outside unit {unit_seq} of this lane ({path} [{lo}, {hi})). The "
                         f"state does not belong to this data, or was edited.")
    starts_record = getattr(source.reader, "starts_record", None)
    if starts_record is not None and cursor != lo and not starts_record(path, cursor):  # a unit's start is one
        raise StateError(f"{at}: cursor {cursor} is not a position a lane can stand at in {path} (a JSON Lines "
                         f"cursor is a chunk boundary or the byte after a newline). The state does not belong to "
                         f"this data, or was edited.")

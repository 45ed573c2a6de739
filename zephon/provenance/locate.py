"""``zephon.locate``: every step, row and token range where one record lands.

The work plan is closed-form: the unit that holds the record is read, in pass ``p``, by exactly one lane,
as that lane's ``i``-th unit (:meth:`~zephon.plan.SourcePlan.where_read`, the inverses of its keyed
permutations). So the record is found by running that lane alone until it has delivered every token the
record makes, known in advance by running the record's chunk through the source's stateless operators one
at a time, which also names the operator that dropped a record that makes nothing. The lane stops early
once a flush sentinel after the record's unit has been delivered: past it, a piece the lane has not
delivered never will be (an operator after the merge dropped it).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..origins import PROVENANCE_KEY
from ..plan import ChunkTask
from ._run import every_lane_decides, lanes_loader, last_step, state_of, with_provenance
from .segments import FILE, RECORD, ROW, SEGMENT, SOURCE, TOKEN_END, TOKEN_START


@dataclass(frozen=True)
class Landing:
    """One piece of a record in a global batch.

    Attributes:
        step: the global step.
        row: the row of the global batch.
        segment: the piece's index in its row.
        tokens: its token range ``(start, end)`` within the record's document.
        pass_no: the pass over the source (0-based) in which it was read.
        lane: the lane that delivered it.
    """

    step: int
    row: int
    segment: int
    tokens: tuple[int, int]
    pass_no: int
    lane: int


@dataclass
class Location:
    """Where a record goes: its landings (iterate over them), or why it makes none.

    Attributes:
        source: the source's name.
        file: the file, relative to the source's root.
        record: where the record starts in it.
        coord: what ``record`` counts (``"row"``, ``"byte"``...).
        tokens: the tokens the record's document has after the stateless operators (0 if dropped).
        landings: every landing, pass by pass, in step order.
        dropped_by: the operator that dropped the record (its name), or None.
        reason: why it makes nothing, in words, or None.
    """

    source: str
    file: str
    record: int
    coord: str
    tokens: int
    landings: list[Landing] = field(default_factory=list)
    dropped_by: str | None = None
    reason: str | None = None

    def __iter__(self) -> Iterator[Landing]:
        return iter(self.landings)

    def __len__(self) -> int:
        return len(self.landings)

    def to_dict(self) -> dict[str, Any]:
        """The location as JSON data."""
        return {"source": self.source, "file": self.file, "record": self.record, "coord": self.coord,
                "tokens": self.tokens, "dropped_by": self.dropped_by, "reason": self.reason,
                "landings": [{"step": x.step, "row": x.row, "segment": x.segment, "tokens": list(x.tokens),
                              "pass": x.pass_no, "lane": x.lane} for x in self.landings]}


def locate(pipeline: Any, source: str, file: str, record: int, *, passes: int = 1, state: Any = None,
           num_workers: int = 0, runner: str = "thread") -> Location:
    """Where ``record`` of ``file`` of ``source`` lands: each ``(step, row, tokens)``, in the first ``passes``
    passes over the source.

    Args:
        pipeline: a :class:`~zephon.Pipeline` or a recipe.
        source: the source's name.
        file: the file, relative to the source's root (as :func:`zephon.trace` shows it), or its full path.
        record: where the record starts, in the source's coordinate (a row for Parquet, a byte offset for
            plain JSON Lines, as :func:`zephon.trace` shows it).
        passes: how many passes over the source to follow (a source that repeats is read once per pass).
        state: a loader state (dict or path) to start from instead of the start: landings before it are not
            found.
        num_workers: as for :func:`zephon.build_loader` (workers for the stateless work).
        runner: as for :func:`zephon.build_loader`.

    Returns:
        A :class:`Location`: iterate it for the landings; ``dropped_by`` names the operator that dropped the
        record when it makes nothing.

    Raises:
        ValueError: no such source, file or record (naming what there is), or ``passes`` < 1.
    """
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"locate(passes={passes!r}): how many passes over the source to follow, an integer >= 1")
    pipe = with_provenance(pipeline)
    program = pipe.compile()
    if source not in program.names:
        raise ValueError(f"locate(source={source!r}): the pipeline's sources are {program.names}"
                         + _did_you_mean(source, program.names))
    s = program.names.index(source)
    sp = program.plan.sources[s]
    path = _find_file(sp, file, source)
    rel = sp.relative(path)
    unit = sp.unit_of(path, record)
    coord = program.stages._coords[s](path)
    if unit < 0:
        raise ValueError(f"locate: {coord} {record} is in no unit of {rel} (source '{source}'): past the file's end?")
    made, dropped_by, reason = _made(program, s, sp, path, unit, record, coord, rel)
    fid = program.stages.file_id(s, path)
    total = sum(b - a for a, b in made)
    out = Location(source, rel, record, coord, total, dropped_by=dropped_by, reason=reason)
    if not made:
        return out
    st = state_of(state)
    by_lane: dict[int, list[tuple[int, int]]] = {}  # lane -> its (unit_seq, pass) of the record's unit, in order
    for pass_no in range(passes):
        lane, i = sp.where_read(unit, pass_no)
        by_lane.setdefault(lane, []).append((i, pass_no))
    for lane, reads in sorted(by_lane.items()):
        out.landings += _follow(pipe, program, lane, reads, s, fid, record, total, st, num_workers, runner)
    out.landings.sort(key=lambda x: (x.step, x.row, x.segment))
    if every_lane_decides(program) and out.landings:  # a lane alone goes on past the run's last step
        end = last_step(pipe, program, st, num_workers, runner)
        out.landings = [x for x in out.landings if x.step < end]
    delivered = sum(x.tokens[1] - x.tokens[0] for x in out.landings)
    if delivered < passes * total:
        out.reason = (f"{passes * total - delivered} of its {passes * total} tokens over {passes} pass(es) were not "
                      f"delivered: an operator after the merge dropped them, or the data ended first")
    return out


def _did_you_mean(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _find_file(sp: Any, file: str, source: str) -> str:
    rels = [sp.relative(f) for f in sp.files]
    for f, rel in zip(sp.files, rels):
        if file in (rel, f):
            return f
    ends = [f for f in sp.files if f.endswith("/" + file.lstrip("/"))]
    if len(ends) == 1:
        return ends[0]
    raise ValueError(f"locate(file={file!r}): source '{source}' has no such file (its root is {sp.root}; "
                     f"{len(rels)} files, e.g. {rels[:3]})" + _did_you_mean(file, rels))


def _made(program: Any, s: int, sp: Any, path: str, unit: int, record: int, coord: str,
          rel: str) -> tuple[list[tuple[int, int]], str | None, str | None]:
    """The token ranges the record's document makes after the source's stateless operators, run one at a time
    on the record's chunk; ``(ranges, None, None)``, or ``([], operator name, reason)`` when one drops it."""
    bounds = sp.reader.chunk_bounds(path, sp.units[unit], -1)
    task = next((ChunkTask(s, path, a, b, 0, True) for a, b in bounds if a <= record < b), None)
    if task is None:
        raise ValueError(f"locate: no record of {rel} (source '{sp.spec.name}') starts at {coord} {record}")
    stages = program.stages
    stages.setup()
    chunk = stages.read(s, task)
    starts = chunk.origin[:, 0] if chunk.origin is not None else np.zeros(0, dtype=np.int64)
    if record not in set(starts.tolist()):
        near = starts[np.argsort(np.abs(starts - record))[:3]].tolist()
        raise ValueError(f"locate: no record of {rel} (source '{sp.spec.name}') starts at {coord} {record}; records "
                         f"near it start at {sorted(near)}")
    for stage in stages.stages[s]:
        for t in stage.transforms:
            before, chunk = chunk, t._apply_chunk(chunk) if chunk.n else chunk
            if chunk.origin is None or record not in set(chunk.origin[:, 0].tolist()):
                return [], t.name, _why_dropped(t, before, record, sp)
    mine = chunk.origin[chunk.origin[:, 0] == record]
    lengths = np.diff(chunk.offsets)[chunk.origin[:, 0] == record] if chunk.offsets is not None else \
        np.ones(len(mine), dtype=np.int64)
    return [(int(a), int(a + n)) for (_, a), n in zip(mine.tolist(), lengths.tolist())], None, None


def _why_dropped(t: Any, chunk: Any, record: int, sp: Any) -> str:
    """Why operator ``t`` made nothing of ``record`` (in ``chunk``, the records it was given)."""
    if t.op not in ("tokenize", "tokenize_chat", "tokenize_images"):
        return f"operator '{t.name}' ({t.op or type(t).__name__}) made nothing of it"
    column = chunk.columns.get(getattr(t, "field", None))
    k = np.flatnonzero(chunk.origin[:, 0] == record)
    value = column[int(k[0])] if column is not None and len(k) else None
    if value is not None:
        return f"its field '{t.field}' is empty or whitespace only"
    read = sp.spec.read
    limit, policy = getattr(read, "max_doc_bytes", None), getattr(read, "oversize", None)
    if policy == "skip" and limit is not None:
        return (f"its field '{getattr(t, 'field', '?')}' is null, or the record is larger than [read] max_doc_bytes = "
                f"{limit} (oversize = \"skip\" reads it as null; raise max_doc_bytes or set oversize = \"truncate\" "
                f"to keep it)")
    return f"its field '{getattr(t, 'field', '?')}' is null"


def _follow(pipe: Any, program: Any, lane: int, reads: list[tuple[int, int]], s: int, fid: int, record: int,
            total: int, state: dict | None, num_workers: int, runner: str) -> list[Landing]:
    """Run ``lane`` until it has delivered the record's ``total`` tokens once per read (``reads``: the lane's
    ``(unit_seq, pass)`` of the record's unit, in order), or a sentinel past its last such unit. A pass's
    pieces come out before the next pass's: the lane reads its units in order, and the passes' reads of one
    unit are ``units / lanes`` units apart."""
    name = program.names[s]
    out: list[Landing] = []
    got = 0
    last = reads[-1][0]
    with lanes_loader(pipe, program, range(lane, lane + 1), state, num_workers, runner) as loader:
        for batch in loader:
            step = loader.step - 1
            table = batch[PROVENANCE_KEY].numpy()
            hit = table[(table[:, SOURCE] == s) & (table[:, FILE] == fid) & (table[:, RECORD] == record)]
            for e in hit.tolist():
                pass_no = reads[min(got // total, len(reads) - 1)][1]
                out.append(Landing(step, e[ROW], e[SEGMENT], (e[TOKEN_START], e[TOKEN_END]), pass_no, lane))
                got += e[TOKEN_END] - e[TOKEN_START]
            if got >= total * len(reads) or _past(loader, lane, name, last):
                break
    return out


def _past(loader: Any, lane: int, name: str, unit_seq: int) -> bool:
    """Whether the lane's last sentinel before its last delivered row stands past its ``unit_seq``-th unit of
    source ``name``: every piece read from that unit was delivered before it."""
    position = loader._host.states()[lane]["positions"][name]
    return position[0] > unit_seq

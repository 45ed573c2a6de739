"""``zephon.trace``: the documents in the rows of a global step, computed from the lanes that hold them.

A global batch is lane 0's rows, then lane 1's... (``batch(rows_per_lane=k)``: global row ``r`` is lane
``r // k``'s), and a lane's rows depend on nothing but the lane. So the rows of step ``s`` are found by
running only their lanes, from the start or from a checkpoint at or before ``s``: the cost is those lanes'
replay, never the whole loader's. Their segments come with the provenance every batch can carry
(:mod:`zephon.origins`), each decoded with the tokenizer that made its source's ids.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from ._run import contiguous, decoders, every_lane_decides, lanes_loader, last_step, state_of, with_provenance
from .segments import Namer, Segment, segments_of


def trace(pipeline: Any, step: int, rows: Sequence[int] | None = None, *, state: Any = None, decode: bool = True,
          num_workers: int = 0, runner: str = "thread") -> list[Segment]:
    """The document pieces (or records) in rows ``rows`` of global step ``step``, in row order.

    Args:
        pipeline: a :class:`~zephon.Pipeline` or a recipe (provenance is turned on here; nothing else changes,
            the fingerprint included, so a checkpoint of the run applies).
        step: the global step (0-based, as ``zephon run`` numbers them).
        rows: rows of the global batch (0 .. lanes * rows_per_lane - 1); None: every row (every lane runs).
        state: a loader state (dict, or a state file's path) saved at a step at or before ``step``: the lanes
            replay from there instead of from the start.
        decode: decode each piece's tokens into ``Segment.text`` with the tokenizer of its source (the tokenizing
            operator that applies to it; a pre-tokenized source: the pipeline's one tokenizer, else no text).
        num_workers: as for :func:`zephon.build_loader` (workers for the stateless work).
        runner: as for :func:`zephon.build_loader`.

    Returns:
        One :class:`~zephon.provenance.segments.Segment` per piece, by row and then position in the row. A row of
        padding (the last steps of sources that stop, with ``batch(partial="pad")``) has none.

    Raises:
        ValueError: a row or step out of range, a state saved after ``step``, or data that ends before ``step``.
        StateError: ``state`` is not a loader state, or fails its checks (naming the file).

    Only the lanes holding ``rows`` run, but for sources that stop with ``batch(partial="drop")``: there a step
    exists only if every lane fills it, so every lane runs.
    """
    pipe = with_provenance(pipeline)
    program = pipe.compile()
    rpl = program.rows_per_lane
    total = pipe.lanes * rpl
    try:
        step = operator.index(step)  # an int, or numpy's
    except TypeError:
        step = -1
    if isinstance(step, bool) or step < 0:
        raise ValueError(f"trace(step={step!r}): a step number >= 0 (steps count from 0)")
    wanted = list(range(total)) if rows is None else sorted({int(r) for r in rows})
    bad = [r for r in wanted if not 0 <= r < total]
    if bad:
        raise ValueError(f"trace(rows={bad[:8]}): a global batch of this pipeline has rows 0..{total - 1} "
                         f"({pipe.lanes} lanes x {rpl} rows per lane)")
    st = state_of(state)
    start = int(st["step"]) if st is not None else 0
    if start > step:
        raise ValueError(f"trace(step={step}): the state was saved at step {start}, after it; pass a state saved at "
                         f"or before step {step}, or none (replay from the start)")
    namer = Namer(program)
    decode_fns = decoders(pipe) if decode else None
    out: list[Segment] = []
    runs = contiguous(sorted({r // rpl for r in wanted}))
    if every_lane_decides(program):  # the step exists only if every lane fills it: run them all
        runs = [range(pipe.lanes)]
    for lanes in runs:
        with lanes_loader(pipe, program, lanes, st, num_workers, runner) as loader:
            try:
                loader._advance(step - start)
                batch = next(iter(loader))
            except StopIteration:
                if program.partial == "pad" and last_step(pipe, program, st, num_workers, runner) > step:
                    continue  # these lanes ended, other lanes fill the step: their rows are padding, no segment
                raise ValueError(f"trace(step={step}): the data ends at step {loader.step} (its sources stop after "
                                 f"their passes)") from None
            out += segments_of(batch, step, namer, wanted, lanes.start * rpl, decode_fns)
    return out

"""What the provenance tools share: a pipeline with provenance on, and a loader over chosen lanes."""

from __future__ import annotations

import os
from typing import Any

from ..loader import ZephonLoader, pipeline_of
from ..tokenization import load_tokenizer


def with_provenance(pipeline: Any) -> Any:
    """``pipeline`` (a :class:`~zephon.Pipeline` or a recipe) with ``batch(provenance=True)``: the same batches
    and fingerprint, plus the ``provenance`` key."""
    pipe = pipeline_of(pipeline)
    return pipe.replace(provenance=True)


def state_of(state: Any) -> dict[str, Any] | None:
    """A loader state given as a dict or as the path of a state file (``zephon run --save-state``,
    :func:`zephon.save_state`); None stays None."""
    if state is None or isinstance(state, dict):
        return state
    if isinstance(state, (str, os.PathLike)):
        from ..state import load_state

        return load_state(os.fspath(state))
    raise TypeError(f"state: a loader state dict or the path of a state file, got {type(state).__name__}")


def lanes_loader(pipe: Any, program: Any, lanes: range, state: dict[str, Any] | None, num_workers: int,
                 runner: str) -> ZephonLoader:
    """A loader over ``lanes`` only, resumed from ``state`` if given (the state of any world size)."""
    loader = ZephonLoader(pipe, 0, 1, num_workers=num_workers, runner=runner, program=program, lanes=lanes,
                          reuse_batch_memory=False)
    if state is not None:
        loader.load_state_dict(state)
    return loader


def decoder(pipe: Any) -> Any:
    """``ids -> text`` with the pipeline's (first) tokenizer, or None for a pipeline without one."""
    spec = pipe.tokenizer
    if spec is None:
        return None
    return load_tokenizer(spec).decode


def contiguous(lanes: list[int]) -> list[range]:
    """Sorted lanes as runs of consecutive lanes: ``[0, 1, 2, 5]`` -> ``[range(0, 3), range(5, 6)]``."""
    out: list[range] = []
    for lane in lanes:
        if out and out[-1].stop == lane:
            out[-1] = range(out[-1].start, lane + 1)
        else:
            out.append(range(lane, lane + 1))
    return out


def every_lane_decides(program: Any) -> bool:
    """Whether a step exists only if every lane fills it: sources that stop, with ``partial="drop"``. Then a
    lane run alone would go on past the run's last step, so the tools run every lane (:func:`last_step`)."""
    return bool(program.finite) and program.partial == "drop"


def last_step(pipe: Any, program: Any, state: dict[str, Any] | None, num_workers: int, runner: str) -> int:
    """How many global steps a run of ``pipe`` delivers (from ``state``): every lane runs to the end."""
    with lanes_loader(pipe, program, range(pipe.lanes), state, num_workers, runner) as loader:
        try:
            while True:
                loader._advance(1)
        except StopIteration:
            return loader.step

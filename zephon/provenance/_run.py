"""What the provenance tools share: a pipeline with provenance on, and a loader over chosen lanes."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..errors import StateError
from ..loader import ZephonLoader, pipeline_of
from ..ops.tokenize import shared_tokenizer
from ..pipeline import TOKENIZING_OPS
from ..state.checkpoint import check_container, load_state, unwrap_state


def with_provenance(pipeline: Any) -> Any:
    """``pipeline`` (a :class:`~zephon.Pipeline` or a recipe) with ``batch(provenance=True)``: the same batches
    and fingerprint, plus the ``provenance`` key."""
    return pipeline_of(pipeline).replace(provenance=True)


def state_of(state: Any) -> dict[str, Any] | None:
    """A loader state given as a dict or as the path of a state file (``zephon run --save-state``,
    :func:`zephon.save_state`), checked (format, version, step, lanes, digests; naming the file); None stays
    None.

    Raises:
        StateError: the file is missing or not a loader state, or the state is malformed or edited.
    """
    if state is None:
        return None
    what = "the state"
    if isinstance(state, (str, os.PathLike)):
        what = f"state file {os.fspath(state)}"
        if not os.path.isfile(state):
            raise StateError(f"{what}: no such file. Pass a file written by `zephon run --save-state` or "
                             f"zephon.save_state().")
        state = load_state(os.fspath(state))
    elif not isinstance(state, dict):
        raise TypeError(f"state: a loader state dict or the path of a state file, got {type(state).__name__}")
    state = unwrap_state(state)
    check_container(state, what)
    return state


def lanes_loader(pipe: Any, program: Any, lanes: range, state: dict[str, Any] | None, num_workers: int,
                 runner: str) -> ZephonLoader:
    """A loader over ``lanes`` only, resumed from ``state`` if given (the state of any world size)."""
    loader = ZephonLoader(pipe, 0, 1, num_workers=num_workers, runner=runner, program=program, lanes=lanes,
                          reuse_batch_memory=False)
    if state is not None:
        loader.load_state_dict(state)
    return loader


def decoders(pipe: Any) -> list[Callable[[Any], str] | None]:
    """Per source (by index), ``ids -> text`` with the tokenizer that made its ids: the one tokenizing operator
    that applies to it. A source no tokenizing operator covers (pre-tokenized: ``tokens_field``) decodes with
    the pipeline's tokenizer when it has only one (the sources' ids are packed together, so they share its
    vocabulary); a source with two different tokenizers, or none to go by, gets None (no text)."""
    def decode_key(spec: Any) -> tuple:  # BOS/EOS framing does not change how ids decode
        return tuple(sorted((k, repr(v)) for k, v in vars(spec).items() if k not in ("add_eos", "add_bos")))

    specs = {decode_key(op.spec): op.spec for op in pipe.ops if isinstance(op, TOKENIZING_OPS)}
    loaded: dict[tuple, Callable[[Any], str]] = {}

    def decode_with(key: tuple) -> Callable[[Any], str]:
        if key not in loaded:
            loaded[key] = shared_tokenizer(specs[key]).decode
        return loaded[key]

    out: list[Callable[[Any], str] | None] = []
    for decl in pipe.sources:
        mine = {decode_key(op.spec) for op in pipe.ops if isinstance(op, TOKENIZING_OPS) and op.applies_to(decl.name)}
        if not mine and len(specs) == 1:
            mine = set(specs)
        out.append(decode_with(next(iter(mine))) if len(mine) == 1 else None)
    return out


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

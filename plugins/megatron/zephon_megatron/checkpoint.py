"""The data state next to Megatron's checkpoints: one file per lane, so any data-parallel size resumes.

Layout, inside Megatron's iteration folder (``iter_0000100`` for iteration 100)::

    <save>/iter_0000100/zephon/train/header.json      written by data-parallel rank 0
    <save>/iter_0000100/zephon/train/lane_00012.json  written by the rank that owns lane 12
    <save>/iter_0000100/zephon/valid/...              the same for --zephon-valid-recipe

Every writer (tensor-parallel rank 0, context-parallel rank 0, first pipeline stage of each
data-parallel rank) writes its own lanes' files, atomically (temporary file, then rename); nobody
waits for anybody: no barrier, no polling, no timeout. A resuming rank, at any data-parallel size
that divides the lane count, reads the header and exactly the lane files it now owns, and checks
that they come from the same recipe (fingerprint), the same step and the iteration Megatron
resumed at.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import zephon

from .layout import ZephonMegatronError

FORMAT = "zephon_megatron.data_state"
"""The ``format`` of a data state's header (its lane files: this plus ``.lane``)."""
VERSION = 1
"""The data-state layout's version, in every file."""
DATA_DIR = "zephon"
"""The folder of the data states inside Megatron's iteration folder."""
HEADER = "header.json"
"""The header's file name in a split's folder."""


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    """Megatron-LM's folder for an iteration (``get_checkpoint_name``'s base dir).

    Args:
        root: the checkpoint root (``--save`` or ``--load``).
        iteration: the iteration.

    Returns:
        ``<root>/iter_XXXXXXX``.
    """
    return Path(root) / f"iter_{int(iteration):07d}"


def data_state_dir(root: str | os.PathLike, iteration: int, split: str = "train") -> Path:
    """The folder of one split's data state in an iteration's checkpoint.

    Args:
        root: the checkpoint root (``--save`` or ``--load``).
        iteration: the iteration.
        split: ``"train"`` or ``"valid"``.

    Returns:
        ``<root>/iter_XXXXXXX/zephon/<split>``.
    """
    return iteration_dir(root, iteration) / DATA_DIR / split


def lane_file(lane: int) -> str:
    """The file name of a lane's state in a split's folder.

    Args:
        lane: the lane.

    Returns:
        ``lane_XXXXX.json``.
    """
    return f"lane_{int(lane):05d}.json"


def write_data_state(batches: Any, layout: Any, iteration: int, root: str | os.PathLike,
                     check_iteration: bool = True) -> list[Path]:
    """Write this rank's lanes of an iterator's state for an iteration (and, on data-parallel rank 0, the header).

    Call it on every rank (ranks that do not write return ``[]``).

    Args:
        batches: the split's :class:`MegatronBatches`.
        layout: this rank's :class:`Layout` (which ranks write: ``layout.writes_state``).
        iteration: the iteration Megatron is saving.
        root: the checkpoint root (``--save``).
        check_iteration: check that the Zephon steps delivered since the data started equal the Megatron
            iterations since then (one step per iteration, else the saved position would not be the one
            Megatron's iteration counter claims).

    Returns:
        The files written.

    Raises:
        ZephonMegatronError: ``check_iteration`` and the steps do not match the iterations.
    """
    if not layout.writes_state:
        return []
    iteration = int(iteration)
    state = batches.state_dict()
    step = int(state["step"])
    if check_iteration:
        expected = batches.resume_step + (iteration - batches.resume_iteration)
        if step != expected:
            raise ZephonMegatronError(
                f"Megatron is saving iteration {iteration} but the {batches.data_split} data delivered {step} Zephon "
                f"steps (expected {expected}: step {batches.resume_step} at iteration {batches.resume_iteration}, "
                f"plus one step per iteration). Each iteration must consume exactly one step, i.e. "
                f"--global-batch-size must equal lanes*batch_per_lane and nothing else may read the iterator.")
    folder = data_state_dir(root, iteration, batches.data_split)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    common = {"iteration": iteration, "step": step, "fingerprint": state["fingerprint"]}
    for lane, lane_state in state["lanes"].items():
        path = folder / lane_file(int(lane))
        zephon.save_state({"format": FORMAT + ".lane", "version": VERSION, "lane": int(lane), **common,
                           "state": lane_state}, path)
        written.append(path)
    if layout.dp_rank == 0:
        header = {
            "format": FORMAT, "version": VERSION, "split": batches.data_split, **common,
            "lanes": int(state["pipeline"]["lanes"]),
            "saved_with": {"data_parallel_size": layout.dp_size, "micro_batch_size": layout.micro_batch_size,
                           "num_microbatches": layout.num_microbatches},
            # the loader state without its lanes: format, version, fingerprint, pipeline summary, step, digest
            "zephon": {k: v for k, v in state.items() if k not in ("lanes", "rank", "world_size")},
        }
        zephon.save_state(header, folder / HEADER)
        written.append(folder / HEADER)
    return written


def find_data_state(roots: Iterable[str | os.PathLike | None], iteration: int, split: str = "train") -> Path | None:
    """The first ``<root>/iter_XXXXXXX/zephon/<split>`` among ``roots`` that has a header.

    Args:
        roots: checkpoint roots to look in, in order (None entries are skipped).
        iteration: the iteration.
        split: ``"train"`` or ``"valid"``.

    Returns:
        The folder, or None when no root has one.
    """
    for root in roots:
        if root:
            folder = data_state_dir(root, iteration, split)
            if (folder / HEADER).is_file():
                return folder
    return None


def _read(path: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ZephonMegatronError(f"{what} {path} is missing.") from None
    except json.JSONDecodeError as e:
        raise ZephonMegatronError(f"{what} {path} is not valid JSON ({e}); the file is damaged.") from None


def read_data_state(folder: str | os.PathLike, lanes: Iterable[int], iteration: int | None = None) -> dict[str, Any]:
    """A loader state holding exactly some lanes, read from a folder as :func:`write_data_state` wrote it.

    Args:
        folder: the split's folder (:func:`data_state_dir`, :func:`find_data_state`).
        lanes: the lanes to read (the resuming rank's).
        iteration: the iteration Megatron resumed at, checked against the header (None: not checked).

    Returns:
        The loader state, for ``loader.load_state_dict``.

    Raises:
        ZephonMegatronError: the header or a lane file is missing, damaged, or from another step, iteration or
            recipe (naming the file).
    """
    folder = Path(folder)
    header = _read(folder / HEADER, "the Zephon data-state header")
    if header.get("format") != FORMAT:
        raise ZephonMegatronError(f"{folder / HEADER} is not a zephon_megatron data state.")
    if header.get("version") != VERSION:
        raise ZephonMegatronError(f"{folder / HEADER} has data-state version {header.get('version')}; this "
                                  f"zephon_megatron reads version {VERSION}.")
    if iteration is not None and int(header["iteration"]) != int(iteration):
        raise ZephonMegatronError(f"{folder / HEADER} was saved at iteration {header['iteration']} but Megatron "
                                  f"resumed at iteration {iteration}: the checkpoint folders were mixed up.")
    lanes = list(lanes)
    outside = [lane for lane in lanes if not 0 <= lane < int(header["lanes"])]
    if outside:
        raise ZephonMegatronError(f"{folder} holds lanes 0..{int(header['lanes']) - 1} but lanes {outside[:8]} were "
                                  f"asked for: the recipe's lanes differs from the checkpoint's (lanes is fixed "
                                  f"for the life of a run).")
    lane_states = {}
    saved_dp = header.get("saved_with", {}).get("data_parallel_size")
    for lane in lanes:
        path = folder / lane_file(lane)
        if not path.is_file():
            owner = (f" (data-parallel rank {lane * saved_dp // int(header['lanes'])} of {saved_dp} should have "
                     f"written it)" if saved_dp else "")
            raise ZephonMegatronError(f"the data state of lane {lane} is missing: {path}{owner}. The save was "
                                      f"interrupted; resume from an earlier checkpoint (--ckpt-step).")
        doc = _read(path, f"the data state of lane {lane}")
        for key in ("iteration", "step", "fingerprint"):
            if doc.get(key) != header.get(key):
                raise ZephonMegatronError(f"{path} has {key}={doc.get(key)!r} but {folder / HEADER} has "
                                          f"{header.get(key)!r}: the folder mixes files of different saves.")
        if int(doc.get("lane", -1)) != lane:
            raise ZephonMegatronError(f"{path} holds lane {doc.get('lane')}, not lane {lane}.")
        lane_states[str(lane)] = doc["state"]
    return {**header["zephon"], "lanes": lane_states}


def read_header(folder: str | os.PathLike) -> dict[str, Any]:
    """A split folder's header.

    Args:
        folder: the split's folder.

    Returns:
        The header (format, version, split, iteration, step, fingerprint, lanes, the saving layout).

    Raises:
        ZephonMegatronError: the header is missing or damaged.
    """
    return _read(Path(folder) / HEADER, "the Zephon data-state header")

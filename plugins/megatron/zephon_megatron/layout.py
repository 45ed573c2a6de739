"""Where this rank stands in Megatron's parallel layout, and whether Megatron's numbers fit a recipe.

A Zephon step is one global batch of ``lanes * batch_per_lane`` rows; data-parallel rank ``r`` of
``dp`` receives the rows of lanes ``[r*L/dp, (r+1)*L/dp)``. Megatron consumes a global step as
``num_microbatches`` micro-batches of ``micro_batch_size`` rows on every data-parallel rank, so a
Zephon step maps onto one Megatron iteration exactly when

    micro_batch_size * num_microbatches == lanes / dp * batch_per_lane
    (equivalently --global-batch-size == lanes * batch_per_lane, dp divides lanes),

and Megatron's ``--seq-length`` equals the recipe's ``seq_len``. :func:`check_fit` checks each of
these and says which number to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ZephonMegatronError(ValueError):
    """Megatron's configuration does not fit the Zephon recipe (the message says what to change)."""


@dataclass(frozen=True)
class Layout:
    """This rank's coordinates, as far as data loading is concerned.

    ``dp_rank``/``dp_size`` are Megatron's data-parallel rank and size *without* context
    parallelism: context-parallel peers share one data-parallel rank, read the same rows and slice
    the sequence themselves (``get_batch_on_this_cp_rank``).
    """

    dp_rank: int
    """The data-parallel rank (context-parallel peers share it)."""
    dp_size: int
    """The data-parallel size, a divisor of the recipe's lanes."""
    tp_rank: int = 0
    """The tensor-parallel rank."""
    cp_rank: int = 0
    """The context-parallel rank."""
    pp_first: bool = True
    """Whether this rank is (in) the first pipeline stage."""
    pp_last: bool = True
    """Whether this rank is (in) the last pipeline stage."""
    micro_batch_size: int = 1
    """Rows per micro-batch (``--micro-batch-size``)."""
    num_microbatches: int = 1
    """Micro-batches per iteration on each data-parallel rank."""

    @property
    def consumes_data(self) -> bool:
        """Megatron reads batches on tensor-parallel rank 0 of the first and last pipeline stages
        (``get_batch_on_this_tp_rank`` broadcasts them to the other tensor-parallel ranks)."""
        return self.tp_rank == 0 and (self.pp_first or self.pp_last)

    @property
    def writes_state(self) -> bool:
        """One writer per data-parallel rank: tensor-parallel rank 0, context-parallel rank 0, first
        stage (the last stage holds a second loader over the same lanes, in the same position)."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.pp_first


def layout_from_megatron(micro_batch_size: int, vp_stage: int | None = None) -> Layout:
    """Read the layout from ``megatron.core.parallel_state`` and the micro-batch calculator.

    Both must be initialised (Megatron's ``pretrain`` does it before it asks for datasets).

    Args:
        micro_batch_size: ``--micro-batch-size``.
        vp_stage: the virtual-pipeline chunk the provider is called for (newer Megatron-LM passes it; None:
            no virtual pipeline); only chunk 0 of the first stage and the last chunk of the last stage read
            data.

    Returns:
        This rank's :class:`Layout`.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    ignore_virtual = vp_stage is None
    return Layout(
        dp_rank=mpu.get_data_parallel_rank(),
        dp_size=mpu.get_data_parallel_world_size(),
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        cp_rank=mpu.get_context_parallel_rank(),
        pp_first=mpu.is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage),
        pp_last=mpu.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage),
        micro_batch_size=int(micro_batch_size),
        num_microbatches=int(get_num_microbatches()),
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_fit(recipe: Any, layout: Layout, *, seq_length: int | None, global_batch_size: int | None,
              rampup_batch_size: Any = None, option: str = "--zephon-recipe") -> int:
    """Check that Megatron's numbers fit a recipe: one Megatron iteration must consume one Zephon step.

    Args:
        recipe: the recipe (or pipeline): its ``lanes``, ``batch_per_lane`` and ``seq_len``.
        layout: this rank's layout (data-parallel size, micro-batch size and count).
        seq_length: ``--seq-length`` (None: not checked).
        global_batch_size: ``--global-batch-size`` (None: not checked).
        rampup_batch_size: ``--rampup-batch-size`` (refused when set).
        option: the command-line option that named the recipe, for messages.

    Returns:
        The rows each data-parallel rank receives per step.

    Raises:
        ZephonMegatronError: a number does not fit; the message names the Megatron option (or recipe key) to
            change and the value that works.
    """
    L, b, S = recipe.lanes, recipe.batch_per_lane, recipe.seq_len
    G = L * b
    where = f"the recipe given by {option} (lanes={L}, batch_per_lane={b}, seq_len={S})"
    if seq_length is not None and int(seq_length) != S:
        raise ZephonMegatronError(
            f"--seq-length {seq_length} does not match {where}: every row Zephon packs has seq_len={S} "
            f"tokens. Set --seq-length {S} (a longer context is a different recipe: change its seq_len, "
            f"which starts a new run).")
    if rampup_batch_size:
        raise ZephonMegatronError(
            f"--rampup-batch-size {rampup_batch_size} is not supported with Zephon: a Zephon step is a "
            f"fixed global batch of lanes*batch_per_lane = {G} rows. Remove --rampup-batch-size.")
    dp = layout.dp_size
    if dp < 1 or L % dp:
        good = _divisors(L)
        raise ZephonMegatronError(
            f"data-parallel size {dp} (= GPUs / (tensor x pipeline x context parallel sizes)) does not "
            f"divide lanes={L} of {where}: every data-parallel rank must own the same number of lanes. "
            f"Launch with a data-parallel size in {good} (change the number of GPUs or the "
            f"tensor/pipeline/context-parallel sizes), or use a recipe whose lanes is a multiple of {dp} "
            f"(lanes is fixed for the life of a run).")
    if global_batch_size is not None and int(global_batch_size) != G:
        raise ZephonMegatronError(
            f"--global-batch-size {global_batch_size} does not match {where}: one Megatron iteration "
            f"consumes one Zephon step of lanes*batch_per_lane = {G} rows. Set --global-batch-size {G} "
            f"(or leave it out: the zephon_megatron launcher defaults it from the recipe).")
    rows = L // dp * b
    mbs = layout.micro_batch_size
    if mbs < 1 or rows % mbs:
        good = _divisors(rows)
        raise ZephonMegatronError(
            f"--micro-batch-size {mbs} does not divide the {rows} rows each data-parallel rank receives "
            f"per step (lanes/dp*batch_per_lane = {L}/{dp}*{b}). Set --micro-batch-size to one of {good}.")
    if mbs * layout.num_microbatches != rows:
        raise ZephonMegatronError(
            f"Megatron runs {layout.num_microbatches} micro-batches of {mbs} rows per iteration on each "
            f"data-parallel rank ({mbs * layout.num_microbatches} rows), but a Zephon step gives each "
            f"rank {rows} rows (lanes/dp*batch_per_lane = {L}/{dp}*{b}). Set --global-batch-size {G} "
            f"so that Megatron runs {rows // mbs} micro-batches of --micro-batch-size {mbs}.")
    return rows

"""Zephon steps as Megatron micro-batches.

Megatron's training loop calls ``next(data_iterator)`` once per micro-batch (through
``get_batch_on_this_tp_rank``). :class:`MegatronBatches` fetches one Zephon step (this
data-parallel rank's ``lanes/dp * batch_per_lane`` rows) on the first micro-batch of an iteration
and hands its rows out as ``num_microbatches`` consecutive micro-batches of ``micro_batch_size``
rows, in lane order; so the rows Megatron sees in an iteration, concatenated over micro-batches
and then over data-parallel ranks, are exactly Zephon's global batch.

Each micro-batch is the dict Megatron-LM's ``pretrain_gpt.py`` expects:

``tokens``        int64 ``[mbs, S]``  (Zephon's ``input_ids``)
``labels``        int64 ``[mbs, S]``  next token; positions without a label hold ``pad_id``
                  (Megatron's cross-entropy indexes the vocabulary with every label; ``loss_mask``
                  zeroes them, as Megatron's own ``GPTDataset`` does for padding)
``loss_mask``     float32 ``[mbs, S]``
``position_ids``  int64 ``[mbs, S]``  restarting at every document with ``--reset-position-ids``,
                  else ``0..S-1`` (Megatron's convention)
``attention_mask`` bool ``[mbs, 1, S, S]``, True where attention is *not* allowed (Megatron's
                  convention), only when ``--create-attention-mask-in-dataloader`` is in effect
                  (Megatron's default); causal, and also cut at document boundaries with
                  ``--reset-attention-mask``
``cu_seqlens``    int32 ``[1, n+1]`` document boundaries of the micro-batch's single row (padding
                  is its own segment), only with ``--zephon-cu-seqlens`` (requires
                  ``--micro-batch-size 1``, as Megatron's packed-sequence path does)

A pipeline with images adds the micro-batch's own images, cut by :func:`zephon.select_rows` (the same
tensors a data-parallel rank owning just those rows would get): ``pixel_values``, ``image_grid_thw``,
``image_token_start`` and ``image_row`` (relative to the micro-batch) with flat pixels, or
``pixel_values`` ``[mbs * max_images_per_row, 3, H, W]``, ``image_mask``, ``image_grid_thw`` and
``image_token_start`` with fixed ones. With ``batch(positions="mrope")``, ``position_ids`` is
``[3, mbs, S]``, the layout megatron-core's ``GPTModel(position_embedding_type="mrope")`` takes; its
positions restart at every document, so it needs ``--reset-position-ids`` (refused without it when the
iterator is built, as is ``pixels="lists"``: Python lists are no micro-batch tensors). Megatron-LM's own
``pretrain_gpt.py`` broadcasts only the text keys across tensor-parallel ranks, so
``zephon_megatron.pretrain_gpt`` refuses such pipelines: a vision-language training script reads the
image keys in its own ``get_batch`` (as Megatron's multimodal example does).
"""

from __future__ import annotations

from typing import Any

import torch

IGNORE_INDEX = -100
"""``zephon.IGNORE``, repeated here to keep this module importable on its own."""


class MegatronBatches:
    """Iterator of Megatron micro-batch dicts over a :class:`zephon.ZephonLoader`.

    ``state_dict()`` is the loader's lane-keyed state and may only be taken at an iteration
    boundary (Megatron saves checkpoints between iterations). ``step`` counts whole Zephon steps
    delivered; ``resume_step``/``resume_iteration`` record where this run's data started, so that
    the checkpoint hook can check that one Zephon step was consumed per Megatron iteration.

    Args:
        loader: this data-parallel rank's :class:`zephon.ZephonLoader`.
        micro_batch_size: rows per micro-batch (``--micro-batch-size``).
        num_microbatches: micro-batches per iteration: one Zephon step is ``micro_batch_size *
            num_microbatches`` rows.
        pad_id: the id written on label positions that have no label (``loss_mask`` 0 there).
        reset_position_ids: ``position_ids`` restart at every document (``--reset-position-ids``), else run
            ``0..S-1``.
        attention_mask: add ``attention_mask`` (``--create-attention-mask-in-dataloader``).
        document_mask: the attention mask is also cut at document boundaries (``--reset-attention-mask``).
        cu_seqlens: add ``cu_seqlens`` (``--zephon-cu-seqlens``; needs ``micro_batch_size`` 1).
        split: ``"train"`` or ``"valid"``, for messages and the data state's file names.
        resume_step: the loader's step where this run's data started.
        resume_iteration: Megatron's iteration where this run started.

    Raises:
        ValueError: ``cu_seqlens`` with ``micro_batch_size`` other than 1, or image batches Megatron cannot take
            (``pixels="lists"``, mrope positions without ``reset_position_ids``).
    """

    def __init__(self, loader: Any, micro_batch_size: int, num_microbatches: int, *, pad_id: int,
                 reset_position_ids: bool = True, attention_mask: bool = False, document_mask: bool = False,
                 cu_seqlens: bool = False, split: str = "train", resume_step: int = 0,
                 resume_iteration: int = 0) -> None:
        self.loader = loader
        """The rank's :class:`zephon.ZephonLoader`."""
        self.micro_batch_size = int(micro_batch_size)
        """Rows per micro-batch."""
        self.num_microbatches = int(num_microbatches)
        """Micro-batches per iteration (one Zephon step)."""
        self.pad_id = int(pad_id)
        """The id written on label positions without a label."""
        self.reset_position_ids = reset_position_ids
        """Whether ``position_ids`` restart at every document."""
        self.attention_mask = attention_mask
        """Whether micro-batches carry ``attention_mask``."""
        self.document_mask = document_mask
        """Whether the attention mask is cut at document boundaries."""
        self.cu_seqlens = cu_seqlens
        """Whether micro-batches carry ``cu_seqlens``."""
        if cu_seqlens and self.micro_batch_size != 1:
            raise ValueError(f"cu_seqlens (--zephon-cu-seqlens) needs --micro-batch-size 1 (Megatron's "
                             f"packed-sequence path takes one row per micro-batch), got {self.micro_batch_size}.")
        self.data_split = split
        """``"train"`` or ``"valid"`` (not ``split``: Megatron duck-types ``dataset.split``, a Split enum)."""
        self.resume_step = int(resume_step)
        """The loader's step where this run's data started."""
        self.resume_iteration = int(resume_iteration)
        """Megatron's iteration where this run started."""
        self._micro = 0
        self._batch: dict[str, torch.Tensor] | None = None
        self._seq_len = int(loader.pipeline.seq_len)
        self._causal = torch.ones(self._seq_len, self._seq_len, dtype=torch.bool).tril_()
        found = image_layout(loader.pipeline)
        if found is not None:
            check_image_batches(*found, reset_position_ids)

    # -- iteration ------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Zephon steps delivered so far (a step counts once its first micro-batch is handed out)."""
        return int(self.loader.step)

    @property
    def at_step_boundary(self) -> bool:
        """Whether the next micro-batch starts a Zephon step (no step is part-way handed out)."""
        return self._micro == 0

    def __iter__(self) -> MegatronBatches:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._micro == 0:
            batch = next(self.loader)
            rows = int(batch["input_ids"].shape[0])
            if rows != self.micro_batch_size * self.num_microbatches:
                raise RuntimeError(f"a Zephon step gave {rows} rows, but {self.num_microbatches} micro-batches "
                                   f"of {self.micro_batch_size} rows were expected.")
            self._batch = batch
        assert self._batch is not None
        lo = self._micro * self.micro_batch_size
        out = self.micro_batch(self._batch, slice(lo, lo + self.micro_batch_size))
        self._micro += 1
        if self._micro == self.num_microbatches:
            self._micro, self._batch = 0, None
        return out

    def micro_batch(self, batch: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
        """Megatron's dict for some rows of a Zephon batch (see the module docstring).

        Args:
            batch: a Zephon batch (one step of this rank).
            rows: the micro-batch's rows, a contiguous slice.

        Returns:
            The micro-batch: ``tokens``, ``labels``, ``loss_mask``, ``position_ids``, and as configured
            ``attention_mask``, ``cu_seqlens`` and the image keys.
        """
        from zephon.batches.rows import select_rows
        from zephon.batches.images import IMAGE_KEYS

        part = select_rows(batch, rows)
        labels = part["labels"].clone()
        labels[labels == IGNORE_INDEX] = self.pad_id
        tokens = part["input_ids"].contiguous()
        n = tokens.shape[0]
        if self.reset_position_ids or part["position_ids"].dim() == 3:  # mrope [3, mbs, S]: checked at __init__
            position_ids = part["position_ids"].contiguous()
        else:
            position_ids = torch.arange(self._seq_len, dtype=torch.int64).expand(n, -1).contiguous()
        out = {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": part["loss_mask"].to(torch.float32).contiguous(),
            "position_ids": position_ids,
        }
        segments = part["segment_ids"]
        if self.attention_mask:
            allowed = self._causal.expand(n, -1, -1)
            if self.document_mask:
                allowed = allowed & (segments[:, :, None] == segments[:, None, :])
            out["attention_mask"] = (~allowed).unsqueeze(1).contiguous()
        if self.cu_seqlens:
            out["cu_seqlens"] = row_cu_seqlens(segments[0]).unsqueeze(0)
        out.update({k: part[k].contiguous() for k in IMAGE_KEYS if k in part})
        if "provenance" in part:  # batch(provenance=True): the rows' origins, for a get_batch of yours to read
            out["provenance"] = part["provenance"]
        return out

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The loader's lane-keyed state after the last whole step (JSON-serialisable).

        Returns:
            The state (``loader.state_dict()``).

        Raises:
            RuntimeError: asked for in the middle of a step (the iteration consumed a partial step).
        """
        if self._micro:
            raise RuntimeError(f"the {self.data_split} data state was asked for after {self._micro} of "
                               f"{self.num_microbatches} micro-batches of a step; Megatron saves between "
                               f"iterations, so a save here means the iteration consumed a partial step "
                               f"(check --global-batch-size and --micro-batch-size).")
        return self.loader.state_dict()

    def save_state(self) -> dict[str, Any]:
        """For Megatron-LM's ``--dataloader-save`` hook (``maybe_save_dataloader_state``), which stores
        it per data-parallel rank; the elastic, lane-keyed save is :func:`zephon_megatron.save_data_state`.

        Returns:
            :meth:`state_dict`.
        """
        return self.state_dict()

    def close(self) -> None:
        """Close the loader (stop its workers)."""
        self.loader.close()


class EvaluationBatches(MegatronBatches):
    """The validation iterator of a recipe whose sources stop (``passes = 1``, ``partial_batch = "pad"``):
    every evaluation reads the whole validation set exactly once, from its beginning.

    Megatron's ``evaluate()`` runs ``--eval-iters`` iterations of ``num_microbatches`` micro-batches each
    and keeps no other account of the validation data. One pass of the recipe is ``steps_per_pass``
    Zephon steps (the last one padded: rows with ``loss_mask`` 0, which Megatron's loss leaves out), so
    with ``--eval-iters`` = ``steps_per_pass`` (what ``--full-validation`` sets, from ``len()``) an
    evaluation is exactly one pass; after the pass's last micro-batch the loader restarts at the
    recipe's beginning for the next evaluation. The position is therefore always "at the start of an
    evaluation" between iterations: there is no state to checkpoint, and a resumed run evaluates the
    same set in the same batches.

    Args:
        loader: this data-parallel rank's loader of the validation recipe.
        micro_batch_size: rows per micro-batch.
        num_microbatches: micro-batches per evaluation iteration.
        steps_per_pass: Zephon steps in one pass of the validation set (the last one padded).
        start_state: the loader's state at the recipe's beginning, restored before every evaluation.
        **kw: the other options of :class:`MegatronBatches`.
    """

    def __init__(self, loader: Any, micro_batch_size: int, num_microbatches: int, *, steps_per_pass: int,
                 start_state: dict[str, Any], **kw: Any) -> None:
        super().__init__(loader, micro_batch_size, num_microbatches, **kw)
        self.steps_per_pass = int(steps_per_pass)
        """Zephon steps in one pass of the validation set."""
        self.start_state = start_state
        """The loader's state at the recipe's beginning."""
        self.evaluations = 0
        """Evaluations (passes) begun."""
        self._served = 0  # steps of the current pass handed out (counting a step at its first micro-batch)

    def __len__(self) -> int:
        """Iterations of one evaluation: Megatron's ``--full-validation`` sets ``--eval-iters`` from it."""
        return self.steps_per_pass

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._micro == 0:
            if self._served == self.steps_per_pass:  # the previous evaluation read the whole set
                self.loader.load_state_dict(self.start_state)  # back to the recipe's beginning
                self._served = 0
            if self._served == 0:
                self.evaluations += 1
            self._served += 1
            try:
                return super().__next__()
            except StopIteration:
                raise RuntimeError(f"the validation data ended after {self._served - 1} steps, but a pass was "
                                   f"counted at {self.steps_per_pass} when the run started.") from None
        return super().__next__()

    def state_dict(self) -> dict[str, Any]:
        """Refused: this iterator restarts at every evaluation, so it has no position to save.

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError("this validation iterator restarts at every evaluation: it has no position to save "
                           "(zephon_megatron.save_data_state writes none for it).")


def image_layout(recipe: Any) -> tuple[str, str] | None:
    """``(pixels, positions)`` of a pipeline whose batches carry images or mrope positions (its
    ``batch(pixels=, positions=)``), None for a text pipeline with 1-D positions."""
    from zephon.recipe import as_pipeline

    ops = as_pipeline(recipe).ops
    batch = next((op for op in ops if op.op == "batch"), None)
    pixels, positions = (batch.pixels, batch.positions) if batch is not None else ("flat", "1d")
    if any(op.op in ("decode_images", "tokenize_images") for op in ops):
        return pixels, positions
    return ("flat", positions) if positions == "mrope" else None


def check_image_batches(pixels: str, positions: str, reset_position_ids: bool) -> None:
    """Refuse a batch layout Megatron micro-batches cannot carry (``pixels``/``positions``: the pipeline's
    ``batch(pixels=, positions=)``, for a pipeline with images or mrope positions)."""
    if pixels == "lists":
        raise ValueError("batch(pixels='lists') keeps images as per-document Python lists, which a Megatron "
                         "micro-batch (a dict of tensors) cannot carry: use pixels='flat' (patches "
                         "[total_patches, p*p*3]) or pixels='fixed' ([rows * max_images_per_row, 3, H, W])")
    if positions == "mrope" and not reset_position_ids:
        raise ValueError("batch(positions='mrope') gives position_ids [3, mbs, S] that restart at every packed "
                         "document: run Megatron with --reset-position-ids")


def row_cu_seqlens(segment_ids: torch.Tensor) -> torch.Tensor:
    """The boundaries of the runs of equal ``segment_ids`` in one row (its documents, padding its own run).

    Args:
        segment_ids: one row's segment ids, ``[S]``.

    Returns:
        ``[0, e1, e2, ..., S]``, int32: Megatron's ``cu_seqlens`` of a packed row.
    """
    S = int(segment_ids.shape[0])
    change = torch.nonzero(segment_ids[1:] != segment_ids[:-1]).flatten() + 1
    return torch.cat([torch.zeros(1, dtype=torch.int64), change, torch.tensor([S])]).to(torch.int32)

"""The dataset provider for Megatron-LM's ``pretrain(...)``, its arguments and the checkpoint hook.

With ``--dataloader-type external``, Megatron-LM hands whatever the provider returns straight to the
training loop (wrapped in ``RerunDataIterator``), which calls ``next()`` on it once per
micro-batch. This provider returns a :class:`~zephon_megatron.batches.MegatronBatches` over a Zephon
loader on the ranks where Megatron reads data, and ``None`` elsewhere.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import zephon

from .batches import EvaluationBatches, MegatronBatches, check_image_batches, image_layout
from .checkpoint import data_state_dir, find_data_state, read_data_state, read_header, write_data_state
from .layout import Layout, ZephonMegatronError, check_fit, layout_from_megatron

# What the provider built in this process: split -> (iterator, layout). Read by save_data_state().
_ACTIVE: dict[str, tuple[MegatronBatches, Layout]] = {}
_ARGS: Any = None


# -- arguments ------------------------------------------------------------------------------------
def add_zephon_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``extra_args_provider`` for Megatron-LM: the ``--zephon-*`` options.

    Args:
        parser: Megatron-LM's argument parser.

    Returns:
        The same parser, with a ``zephon`` group of options added.
    """
    g = parser.add_argument_group("zephon", "Zephon data loader (zephon_megatron)")
    g.add_argument("--zephon-recipe", type=str, default=None,
                   help="Zephon recipe (TOML) of the training data, or a builder pipeline as package.module:name "
                        "(a zephon.Pipeline or a function returning one). Fixes --seq-length (seq_len) and "
                        "--global-batch-size (lanes * batch_per_lane); the data-parallel size must divide lanes.")
    g.add_argument("--zephon-valid-recipe", type=str, default=None,
                   help="Zephon recipe of the validation data (same seq_len and lanes*batch_per_lane as the "
                        "training recipe). With passes = 1 on its sources and partial_batch = \"pad\", every "
                        "evaluation reads it whole, exactly once: --eval-iters must be its number of global "
                        "batches (the run says it, and refuses another), or pass --full-validation. Without "
                        "it, pass --eval-iters 0.")
    g.add_argument("--zephon-num-workers", type=int, default=2,
                   help="Zephon read/tokenize workers per data-reading rank (speed only, never the batches).")
    g.add_argument("--zephon-runner", choices=("thread", "pool", "process"), default="thread",
                   help="thread: read+tokenize on threads; pool: read+tokenize on a process pool; "
                        "process: whole lanes on worker processes.")
    g.add_argument("--zephon-prefetch", type=int, default=None,
                   help="Zephon prefetch depth (chunks per source for thread/pool, steps for process).")
    g.add_argument("--zephon-cu-seqlens", action="store_true",
                   help="Add cu_seqlens (int32 [1, n+1] document boundaries) to every micro-batch, for "
                        "Megatron-LM versions whose get_batch reads it (packed sequences, THD). "
                        "Needs --micro-batch-size 1.")
    g.add_argument("--zephon-ignore-data-state", action="store_true",
                   help="Resuming a checkpoint without a Zephon data state (e.g. switching a run to Zephon): "
                        "start the data at the recipe's beginning instead of failing.")
    return parser


def megatron_args_defaults(recipe: Any) -> dict[str, Any]:
    """``args_defaults`` for ``pretrain``: the numbers the recipe fixes (used where the command line
    does not set them; a conflicting command-line value is then reported by :func:`check_fit`).

    Args:
        recipe: the training recipe, or its path.

    Returns:
        ``dataloader_type``, ``seq_length``, ``global_batch_size``, ``micro_batch_size``, ``tokenizer_type``
        and ``vocab_size``.
    """
    if isinstance(recipe, (str, os.PathLike)):
        recipe = zephon.load_recipe(str(recipe))
    tok = zephon.load_tokenizer(recipe.tokenizer)
    return {
        "dataloader_type": "external",
        "seq_length": recipe.seq_len,
        "global_batch_size": recipe.lanes * recipe.batch_per_lane,
        "micro_batch_size": 1,
        # The ids Zephon produces are < the recipe tokenizer's vocab_size: Megatron needs no more to
        # size (and pad) its embedding. Pass --tokenizer-type/--tokenizer-model to use another.
        "tokenizer_type": "NullTokenizer",
        "vocab_size": int(tok.vocab_size),
    }


# -- the provider ---------------------------------------------------------------------------------
def _megatron_get_args() -> Any:
    from megatron.training import get_args  # Megatron-LM (not part of megatron-core)

    return get_args()


def _rank0_print(layout: Layout, msg: str) -> None:
    if layout.dp_rank == 0 and layout.writes_state:
        print(f"[zephon] {msg}", flush=True)


def _resume_folder(args: Any, split: str) -> Any:
    iteration = int(getattr(args, "iteration", 0) or 0)
    if iteration <= 0:
        return None
    roots = [getattr(args, "load", None), getattr(args, "non_persistent_global_ckpt_dir", None)]
    return find_data_state(roots, iteration, split)


def _resume(split: str, loader: Any, args: Any, layout: Layout) -> tuple[int, int]:
    """Restore ``loader`` from the data state of the iteration Megatron resumed at; ``(step, iteration)``."""
    iteration = int(getattr(args, "iteration", 0) or 0)
    resume_step, resume_iteration = 0, iteration
    folder = _resume_folder(args, split)
    if folder is not None:
        header = read_header(folder)
        state = read_data_state(folder, loader.lanes, iteration)
        loader.load_state_dict(state)  # refuses another recipe, naming the fields that differ
        resume_step, resume_iteration = int(state["step"]), iteration
        _rank0_print(layout, f"{split}: resumed at step {resume_step} (iteration {iteration}) from {folder}; saved "
                             f"at data-parallel size {header.get('saved_with', {}).get('data_parallel_size')}, now "
                             f"{layout.dp_size}")
    elif iteration > 0:
        if split == "train" and not getattr(args, "zephon_ignore_data_state", False):
            looked = [str(data_state_dir(r, iteration, split)) for r in
                      (getattr(args, "load", None), getattr(args, "non_persistent_global_ckpt_dir", None)) if r]
            raise ZephonMegatronError(
                f"Megatron resumed at iteration {iteration} but there is no Zephon data state for it (looked in "
                f"{looked}). Either the save stopped between Megatron's files and Zephon's (resume an earlier "
                f"checkpoint with --ckpt-step), or the run did not use Zephon before (pass "
                f"--zephon-ignore-data-state to start the data at the recipe's beginning).")
        _rank0_print(layout, f"{split}: no data state at iteration {iteration}; starting at the recipe's beginning")
    return resume_step, resume_iteration


def _data_parallel_group() -> Any:
    """The process group of this rank's data-parallel peers (all of them read data, in step), over which
    the loaders of a recipe whose sources stop agree on its end: Megatron's Gloo data-parallel group (a
    CPU flag, no device sync), else its data-parallel group; None without Megatron's parallel state."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        from megatron.core import parallel_state as mpu
    except ImportError:  # a process group without Megatron: its default group
        return None
    if not mpu.model_parallel_is_initialized():
        return None
    try:
        return mpu.get_data_parallel_group_gloo()
    except (AssertionError, AttributeError, RuntimeError):  # --disable-gloo-process-groups
        return mpu.get_data_parallel_group()


def _new_loader(recipe: Any, args: Any, layout: Layout) -> Any:
    return zephon.build_loader(recipe, rank=layout.dp_rank, world_size=layout.dp_size,
                               num_workers=int(getattr(args, "zephon_num_workers", 2)),
                               runner=getattr(args, "zephon_runner", "thread"),
                               prefetch=getattr(args, "zephon_prefetch", None), group=_data_parallel_group())


def _batch_options(args: Any) -> dict[str, Any]:
    mask = bool(getattr(args, "create_attention_mask_in_dataloader", False))
    return {"reset_position_ids": bool(getattr(args, "reset_position_ids", False)), "attention_mask": mask,
            "document_mask": mask and bool(getattr(args, "reset_attention_mask", False)),
            "cu_seqlens": bool(getattr(args, "zephon_cu_seqlens", False))}


def _check_image_layout(recipe: Any, args: Any, option: str) -> None:
    found = image_layout(recipe)
    if found is not None:
        try:
            check_image_batches(*found, bool(getattr(args, "reset_position_ids", False)))
        except ValueError as exc:
            raise ZephonMegatronError(f"{option}: {exc}") from None


def _build_split(split: str, recipe: Any, args: Any, layout: Layout) -> MegatronBatches:
    loader = _new_loader(recipe, args, layout)
    try:
        resume_step, resume_iteration = _resume(split, loader, args, layout)
        return MegatronBatches(
            loader, layout.micro_batch_size, layout.num_microbatches, pad_id=loader.pad_id, split=split,
            resume_step=resume_step, resume_iteration=resume_iteration, **_batch_options(args))
    except BaseException:
        loader.close()
        raise


def _reads_whole(recipe: Any, option: str) -> bool:
    """Whether every evaluation reads the validation recipe whole: True when its sources stop (``passes``),
    False when they repeat (one continuing stream across evaluations). A mixture of both never ends, and
    ``partial_batch = "drop"`` would leave the set's last rows out of every evaluation: both are refused."""
    from zephon.recipe import as_pipeline

    pipe = as_pipeline(recipe)
    passes = {s.name: s.passes for s in pipe.sources}
    repeating = sorted(name for name, p in passes.items() if p is None)
    if len(repeating) == len(passes):
        return False
    if repeating:
        raise ZephonMegatronError(
            f"{option}: the sources {repeating} repeat while {sorted(set(passes) - set(repeating))} stop, so the "
            f"validation data never ends and an evaluation cannot cover it once. Give every [[sources]] of the "
            f"validation recipe `passes = 1`.")
    batch = next((op for op in pipe.ops if op.op == "batch"), None)
    if batch is not None and batch.partial != "pad":
        raise ZephonMegatronError(
            f"{option}: partial_batch = \"{batch.partial}\" drops the validation set's last, partial global "
            f"batch from every evaluation. Set partial_batch = \"pad\" (padded rows have loss_mask 0, so "
            f"Megatron's loss leaves them out).")
    return True


def _build_evaluation(recipe: Any, args: Any, layout: Layout) -> EvaluationBatches:
    """The validation iterator of a recipe whose sources stop: one pass is counted now (every data-parallel
    rank reads its lanes once; the ranks agree on the end), then every evaluation reads it whole."""
    loader = _new_loader(recipe, args, layout)
    try:
        start = loader.state_dict()
        steps = sum(1 for _ in loader)  # one pass, to its agreed end
        loader.load_state_dict(start)  # back to the recipe's beginning for the first evaluation
    except BaseException:
        loader.close()
        raise
    full = bool(getattr(args, "full_validation", False))
    eval_iters = getattr(args, "eval_iters", 0) or 0
    G = layout.dp_size * layout.micro_batch_size * layout.num_microbatches
    if steps == 0 or (not full and eval_iters != steps):
        loader.close()
        if steps == 0:
            raise ZephonMegatronError(f"--zephon-valid-recipe {args.zephon_valid_recipe}: the validation data "
                                      f"gives no global batch at all (are its files empty?).")
        raise ZephonMegatronError(
            f"--eval-iters {eval_iters} does not fit --zephon-valid-recipe {args.zephon_valid_recipe}: its "
            f"sources stop, and one pass over them is {steps} iterations of {G} rows (the last one padded). "
            f"Every evaluation reads the validation set exactly once, so set --eval-iters {steps}, or pass "
            f"--full-validation (Megatron then takes the count from the data).")
    _rank0_print(layout, f"valid: one pass over {args.zephon_valid_recipe} is {steps} iterations of {G} rows; "
                         f"every evaluation reads it whole, from its beginning")
    if _resume_folder(args, "valid") is not None:
        _rank0_print(layout, "valid: the validation data state saved with the checkpoint is not used (the data "
                             "restarts at every evaluation)")
    return EvaluationBatches(loader, layout.micro_batch_size, layout.num_microbatches, pad_id=loader.pad_id,
                             split="valid", steps_per_pass=steps, start_state=start, **_batch_options(args))


class _NoValidationData:
    """What a rank that reads no data gets for validation under ``--full-validation``: Megatron-LM takes
    ``len()`` of the validation loader on every rank (``None`` has none) and then broadcasts rank 0's
    count; these ranks never draw from it (the batch reaches them by broadcast, or not at all)."""

    def __len__(self) -> int:
        return 0

    def __iter__(self) -> "_NoValidationData":
        return self

    def __next__(self) -> Any:
        raise RuntimeError("zephon_megatron: this rank reads no data (tensor-parallel rank > 0 or a middle "
                           "pipeline stage), yet something asked it for a validation batch.")


def build_data_iterators(args: Any, layout: Layout | None = None, vp_stage: int | None = None
                         ) -> tuple[MegatronBatches | None, Any, None]:
    """``(train, valid, test)`` iterators for this rank (``None`` where Megatron reads no data).

    The configuration checks run on every rank, so a misfit fails everywhere with the same message.
    ``valid`` is an :class:`EvaluationBatches` when the validation recipe's sources stop (every
    evaluation reads the set whole; its pass is counted here, and ``--eval-iters`` must equal it unless
    ``--full-validation``), else a :class:`MegatronBatches` continuing across evaluations.

    Args:
        args: Megatron's argument namespace (``get_args()``), with the ``--zephon-*`` options.
        layout: this rank's layout (None: :func:`layout_from_megatron`, from ``megatron.core.parallel_state``
            and the micro-batch calculator).
        vp_stage: the virtual-pipeline chunk the provider is called for (None: no virtual pipeline).

    Returns:
        ``(train, valid, test)``: ``test`` is always None.

    Raises:
        ZephonMegatronError: a missing ``--zephon-recipe``, or Megatron's options do not fit the recipes (the
            message says what to change).
    """
    global _ARGS
    if not getattr(args, "zephon_recipe", None):
        raise ZephonMegatronError("--zephon-recipe is required: the Zephon recipe (TOML) of the training data.")
    dl_type = getattr(args, "dataloader_type", "external")
    if dl_type not in (None, "external"):
        raise ZephonMegatronError(f"--dataloader-type {dl_type}: the Zephon provider returns a ready iterator; "
                                  f"use --dataloader-type external.")
    if layout is None:
        layout = layout_from_megatron(args.micro_batch_size, vp_stage)
    recipe = zephon.load_pipeline(args.zephon_recipe)  # a recipe path, or "package.module:name" of a Pipeline
    check_fit(recipe, layout, seq_length=getattr(args, "seq_length", None),
              global_batch_size=getattr(args, "global_batch_size", None),
              rampup_batch_size=getattr(args, "rampup_batch_size", None))
    _check_image_layout(recipe, args, "--zephon-recipe")
    valid_recipe = None
    reads_whole = False
    eval_iters = getattr(args, "eval_iters", 0) or 0
    full_validation = bool(getattr(args, "full_validation", False))
    if getattr(args, "zephon_valid_recipe", None):
        valid_recipe = zephon.load_pipeline(args.zephon_valid_recipe)
        check_fit(valid_recipe, layout, seq_length=getattr(args, "seq_length", None),
                  global_batch_size=getattr(args, "global_batch_size", None), option="--zephon-valid-recipe")
        _check_image_layout(valid_recipe, args, "--zephon-valid-recipe")
        reads_whole = _reads_whole(valid_recipe, f"--zephon-valid-recipe {args.zephon_valid_recipe}")
        if full_validation and not reads_whole:
            raise ZephonMegatronError(
                f"--full-validation reads the whole validation set at every evaluation, but the sources of "
                f"--zephon-valid-recipe {args.zephon_valid_recipe} repeat for ever. Give each of its [[sources]] "
                f"`passes = 1` (and the recipe partial_batch = \"pad\"), or drop --full-validation.")
    elif full_validation or not isinstance(eval_iters, int) or eval_iters > 0:
        what = "--full-validation" if full_validation else f"--eval-iters {eval_iters}"
        raise ZephonMegatronError(f"{what} needs validation data: pass --zephon-valid-recipe, or "
                                  f"--eval-iters 0 to train without evaluation.")
    if getattr(args, "zephon_cu_seqlens", False) and layout.micro_batch_size != 1:
        raise ZephonMegatronError(f"--zephon-cu-seqlens needs --micro-batch-size 1 (Megatron's packed-sequence "
                                  f"path takes one row per micro-batch); got --micro-batch-size "
                                  f"{layout.micro_batch_size}. Use --micro-batch-size 1 (Megatron then runs more "
                                  f"micro-batches per iteration; the batches do not change).")
    if (getattr(args, "reset_attention_mask", False) and not getattr(args, "create_attention_mask_in_dataloader", False)
            and not getattr(args, "zephon_cu_seqlens", False)):
        raise ZephonMegatronError("--reset-attention-mask asks for document masking, which needs the mask in the "
                                  "batch: drop --no-create-attention-mask-in-dataloader (dense [mbs,1,S,S] mask) or "
                                  "pass --zephon-cu-seqlens (boundaries for packed-sequence attention).")
    _ARGS = args
    evaluates = reads_whole and (full_validation or eval_iters != 0)
    if not layout.consumes_data:
        return None, (_NoValidationData() if reads_whole and full_validation else None), None
    train = _build_split("train", recipe, args, layout)
    _register("train", train, layout)
    valid: MegatronBatches | None = None
    if valid_recipe is not None and (evaluates or not reads_whole):
        try:
            valid = (_build_evaluation(valid_recipe, args, layout) if reads_whole
                     else _build_split("valid", valid_recipe, args, layout))
        except BaseException:
            reset()
            raise
        _register("valid", valid, layout)
    _rank0_print(layout, f"data-parallel rank {layout.dp_rank} of {layout.dp_size} reads lanes "
                         f"{train.loader.lanes.start}..{train.loader.lanes.stop - 1} of {recipe.lanes}: "
                         f"{layout.num_microbatches} micro-batches of {layout.micro_batch_size} rows per iteration")
    return train, valid, None


def set_mixture(weights: dict[str, float], at_iteration: int) -> int:
    """A loss-driven intervention from the training loop: the training data's mixture changes from a
    Megatron iteration on (one iteration is one Zephon global batch).

    Call it on every rank that runs the training loop, with the same arguments (decide on one rank, e.g. from
    per-domain losses, and broadcast first): the data-parallel ranks compare their calls and a mismatch is an
    error naming them. Ranks that read no data (later pipeline stages) do nothing.

    Args:
        weights: source name -> weight (only the ratios matter).
        at_iteration: the first iteration the weights apply to (not one already trained on).

    Returns:
        The number of this rank's lanes that were rewound to apply it (lanes that had computed steps ahead).

    Raises:
        ValueError: the iteration was already delivered, or the ranks' calls differ.
        StateError: ``weights`` names unknown sources or has no positive weight.
    """
    active = _ACTIVE.get("train")
    if active is None:
        return 0
    batches, _ = active
    step = batches.resume_step + (int(at_iteration) - batches.resume_iteration)
    group = None
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            group = parallel_state.get_data_parallel_group()
    except ImportError:  # megatron-core missing: a plain process group, or one process
        pass
    return batches.loader.set_mixture(weights, at_step=step, group=group)


def _register(split: str, it: MegatronBatches, layout: Layout) -> None:
    old = _ACTIVE.get(split)
    # With virtual pipelining the provider runs once per model chunk; the chunk that writes wins.
    if old is None or (layout.writes_state and not old[1].writes_state):
        _ACTIVE[split] = (it, layout)


def make_datasets_provider(get_args: Callable[[], Any] | None = None) -> Callable[..., Any]:
    """A ``train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None)`` for ``pretrain``.

    The provider is marked ``is_distributed``: Megatron calls it on every rank, and it returns
    iterators on tensor-parallel rank 0 of the first and last pipeline stages only.

    Args:
        get_args: where Megatron's arguments come from (None: ``megatron.training.get_args``).

    Returns:
        The provider: ``provider(train_val_test_num_samples, vp_stage=None) -> (train, valid, None)``
        (:func:`build_data_iterators`; the sample counts are not used: Zephon's iterators are endless or end
        with their data).
    """

    def train_valid_test_datasets_provider(train_val_test_num_samples: Any = None, vp_stage: int | None = None):
        """Megatron's dataset provider: :func:`build_data_iterators` for this rank (the sample counts are not
        used)."""
        args = (get_args or _megatron_get_args)()
        return build_data_iterators(args, vp_stage=vp_stage)

    train_valid_test_datasets_provider.is_distributed = True  # type: ignore[attr-defined]
    return train_valid_test_datasets_provider


train_valid_test_datasets_provider = make_datasets_provider()
"""The dataset provider for ``pretrain(...)`` with ``--dataloader-type external``: ``(train, valid, None)``
iterators for this rank from Megatron's own ``get_args()`` (:func:`make_datasets_provider` to pass another)."""


# -- checkpoints ----------------------------------------------------------------------------------
def active_iterators() -> dict[str, MegatronBatches]:
    """The iterators the provider built in this process (none on ranks that read no data).

    Returns:
        Split name (``"train"``, ``"valid"``) -> its iterator.
    """
    return {split: it for split, (it, _) in _ACTIVE.items()}


def save_data_state(iteration: int, root: str | os.PathLike | None = None, args: Any = None,
                    non_persistent: bool = False) -> list:
    """Write this rank's lanes of every active split for an iteration; call it on every rank, right
    after Megatron's ``save_checkpoint`` (the launcher's hook does).

    Args:
        iteration: the iteration Megatron saved.
        root: the checkpoint folder (None: ``args.save``, or ``args.non_persistent_global_ckpt_dir`` for a
            global non-persistent save).
        args: Megatron's arguments (None: those the provider was given).
        non_persistent: the checkpoint is a non-persistent one (only ``global`` ones get a data state).

    Returns:
        The files written (none on ranks that read no data).

    Raises:
        ZephonMegatronError: the training data did not deliver one step per iteration.
    """
    if not _ACTIVE:  # this rank reads no data (tensor-parallel rank > 0, middle pipeline stage)
        return []
    args = args if args is not None else _ARGS
    if root is None:
        if non_persistent:
            kind = getattr(args, "non_persistent_ckpt_type", None)
            if kind != "global":
                _warn_once(f"Megatron saved a non-persistent checkpoint of type {kind!r} at iteration {iteration}; "
                           f"Zephon's data state is written for persistent and 'global' non-persistent "
                           f"checkpoints only, so resuming this one will ask for --zephon-ignore-data-state.")
                return []
            root = getattr(args, "non_persistent_global_ckpt_dir", None) or os.path.join(args.save, "non_persistent")
        else:
            root = getattr(args, "save", None)
    if not root:
        return []
    written = []
    for split, (it, layout) in _ACTIVE.items():
        if isinstance(it, EvaluationBatches):  # restarts at every evaluation: no position to keep
            continue
        written += write_data_state(it, layout, iteration, root, check_iteration=(split == "train"))
    return written


_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        print(f"[zephon] warning: {msg}", file=sys.stderr, flush=True)


def wrap_save_checkpoint(save_checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """``save_checkpoint`` followed by :func:`save_data_state` for the same iteration.

    Works with every Megatron-LM signature (``iteration`` first, positional or keyword;
    ``non_persistent_ckpt`` keyword where it exists).

    Args:
        save_checkpoint: Megatron-LM's ``save_checkpoint`` (returned as it is when already wrapped).

    Returns:
        The wrapped function.
    """
    if getattr(save_checkpoint, "_zephon_wrapped", False):
        return save_checkpoint

    @functools.wraps(save_checkpoint)
    def save_checkpoint_with_data_state(*a: Any, **kw: Any) -> Any:
        out = save_checkpoint(*a, **kw)
        iteration = kw["iteration"] if "iteration" in kw else a[0]
        save_data_state(int(iteration), non_persistent=bool(kw.get("non_persistent_ckpt", False)))
        return out

    save_checkpoint_with_data_state._zephon_wrapped = True  # type: ignore[attr-defined]
    return save_checkpoint_with_data_state


def install_checkpoint_hook(training_module: Any = None) -> None:
    """Make Megatron-LM's training loop write Zephon's data state with every checkpoint.

    Replaces ``save_checkpoint`` in ``megatron.training.training`` (the name its training loop
    calls) by :func:`wrap_save_checkpoint` of it. Call once, before ``pretrain``.

    Args:
        training_module: the module whose ``save_checkpoint`` to wrap (None: ``megatron.training.training``).
    """
    if training_module is None:
        from megatron.training import training as training_module  # Megatron-LM
    training_module.save_checkpoint = wrap_save_checkpoint(training_module.save_checkpoint)


def reset() -> None:
    """Close and forget the iterators built in this process (tests, repeated ``pretrain`` calls)."""
    global _ARGS
    for it, _ in list(_ACTIVE.values()):
        it.close()
    _ACTIVE.clear()
    _ARGS = None

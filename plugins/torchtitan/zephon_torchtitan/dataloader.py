"""``ZephonDataLoader``: a Zephon recipe as a Torchtitan 0.3 dataloader.

The trainer builds it with ``config.dataloader.build(dp_world_size=, dp_rank=, tokenizer=, seq_len=,
local_batch_size=, ...)``. Data-parallel rank ``r`` of ``N`` owns the recipe's lanes
``[r*L/N, (r+1)*L/N)`` and receives ``L/N * batch_per_lane`` rows per global step; those rows are
yielded as ``rows / local_batch_size`` consecutive micro-batches (the trainer's gradient accumulation),
each ``({"input": LongTensor[B, S], "positions": LongTensor[B, S]}, labels)``. So the global batch
of every optimizer step is the recipe's ``lanes * batch_per_lane`` rows, identical for every ``N``.

Checkpoints go through Torchtitan's DCP checkpointer. The state is keyed by *lane*, not by rank: one
entry per lane (``lane_00007``) plus a header that every rank writes identically (DCP keeps one copy),
so a checkpoint written at dp degree ``N`` loads at any degree ``M`` that divides the lane count:
each rank asks DCP for its own lanes' entries only. No collective, no side files.
"""

from __future__ import annotations

import hashlib
import json
import os
import tomllib
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger

import zephon
from zephon import Recipe
from zephon.batches.images import IMAGE_KEYS

TRAINER_TOKENIZER = "@hf_assets_path"
"""The ``[tokenizer] path`` value that means "the trainer's Hugging Face tokenizer" (``--hf_assets_path``)."""

HEADER_KEY = "zephon"
"""The DCP entry of a state's header (format, fingerprint, step...; every rank writes it identically)."""
LANE_PREFIX = "lane_"
"""The DCP entries of the lanes' states: ``lane_00007``."""
_HEADER_FIELDS = ("format", "version", "fingerprint", "pipeline", "step", "events", "ended", "digest")


def lane_key(lane: int) -> str:
    """The DCP entry of a lane's state.

    Args:
        lane: the lane.

    Returns:
        ``lane_XXXXX``.
    """
    return f"{LANE_PREFIX}{lane:05d}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def trainer_tokenizer_dir(tokenizer: Any) -> str | None:
    """The directory the trainer's tokenizer was loaded from (``--hf_assets_path``), if it has one.

    Args:
        tokenizer: the trainer's tokenizer (or None).

    Returns:
        Its ``tokenizer_path``, or None.
    """
    return getattr(tokenizer, "tokenizer_path", None)


def resolve_recipe(path: str, hf_assets_path: str | None = None, *, seed: int | None = None,
                   lanes: int | None = None, batch_per_lane: int | None = None,
                   flush_every: int | None = None) -> Recipe:
    """Load a Zephon recipe for a Torchtitan run.

    ``[tokenizer] path = "@hf_assets_path"`` in the recipe means the trainer's Hugging Face tokenizer
    (``tokenizer.json`` in ``--hf_assets_path``); other paths resolve relative to the recipe file as
    usual.

    Args:
        path: the recipe file (relative to the working directory), or a builder pipeline:
            ``"package.module:name"`` or the :class:`zephon.Pipeline` itself.
        hf_assets_path: the trainer's ``--hf_assets_path`` (for ``"@hf_assets_path"``).
        seed: replaces the recipe's seed (None: keep it). Each of these makes a different run: they are part
            of the recipe's fingerprint.
        lanes: replaces the recipe's lanes (None: keep).
        batch_per_lane: replaces the recipe's batch_per_lane (None: keep).
        flush_every: replaces the recipe's flush_every (None: keep).

    Returns:
        The recipe (or the pipeline, for a builder pipeline).

    Raises:
        ValueError: no recipe given.
        FileNotFoundError: no such recipe file, or no ``tokenizer.json`` for ``"@hf_assets_path"``.
        RecipeError: not valid TOML, or not a valid recipe.
    """
    if not path:
        raise ValueError("ZephonDataLoader needs a recipe: set --dataloader.recipe path/to/recipe.toml "
                         "(see recipes/torchtitan/).")
    changes = {k: v for k, v in (("seed", seed), ("lanes", lanes), ("batch_per_lane", batch_per_lane),
                                 ("flush_every", flush_every)) if v is not None}
    if not isinstance(path, str) or (":" in path and not path.endswith(".toml") and not Path(path).is_file()):
        # a builder pipeline: the object itself (a Python config), or "package.module:name"
        pipe = zephon.load_pipeline(path)
        return pipe.replace(**changes) if changes else pipe
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"Zephon recipe not found: {path} (--dataloader.recipe; relative paths "
                                f"resolve against the working directory {os.getcwd()}).")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise zephon.RecipeError(f"{p}: not valid TOML: {exc}") from exc
    tok = data.get("tokenizer")
    if isinstance(tok, dict) and tok.get("path") == TRAINER_TOKENIZER:
        if tok.get("kind", "huggingface") != "huggingface":
            raise zephon.RecipeError(f"{p}: [tokenizer] path = '{TRAINER_TOKENIZER}' (the trainer's Hugging "
                                     f"Face tokenizer) needs kind = 'huggingface', not '{tok.get('kind')}'.")
        if not hf_assets_path:
            raise zephon.RecipeError(f"{p}: [tokenizer] path = '{TRAINER_TOKENIZER}' asks for the trainer's "
                                     f"Hugging Face tokenizer, but the trainer's tokenizer has no directory; "
                                     f"set --hf_assets_path to a folder holding tokenizer.json.")
        tokenizer_json = Path(hf_assets_path) / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise FileNotFoundError(f"{p}: [tokenizer] path = '{TRAINER_TOKENIZER}' but {tokenizer_json} does "
                                    f"not exist; point --hf_assets_path at a folder holding tokenizer.json.")
        data = {**data, "tokenizer": {**tok, "kind": "huggingface", "path": str(tokenizer_json.resolve())}}
    recipe = zephon.recipe_from_dict(data, base_dir=p.parent.resolve(), origin=str(p))
    return recipe.replace(**changes) if changes else recipe


def end_policy(recipe: Any) -> tuple[bool, str]:
    """Whether a recipe's data ends, and what happens to its last, partial global batch.

    Args:
        recipe: a recipe or builder pipeline.

    Returns:
        ``(ends, partial)``: whether every source stops after its ``passes`` (a source that repeats keeps the
        data going for ever), and ``"pad"`` or ``"drop"``.
    """
    from zephon.recipe import as_pipeline

    pipe = as_pipeline(recipe)
    batch = next((op for op in pipe.ops if op.op == "batch"), None)
    ends = bool(pipe.sources) and all(s.passes is not None for s in pipe.sources)
    return ends, getattr(batch, "partial", "drop")


def check_reads_once(recipe: Any, where: str) -> None:
    """Refuse a validation recipe that cannot be read exactly once (``--validator.steps -1``).

    Args:
        recipe: the validation recipe (or pipeline).
        where: what asked, for messages.

    Raises:
        ValueError: a source repeats, or the last partial batch would be dropped.
    """
    ends, partial = end_policy(recipe)
    if not ends:
        raise ValueError(
            f"{where}: --validator.steps -1 reads the validation set to its end, but the recipe "
            f"{getattr(recipe, 'origin', recipe)} repeats for ever. Give every [[sources]] of the validation "
            f"recipe `passes = 1` and the recipe `partial_batch = \"pad\"` (as "
            f"recipes/torchtitan/llama3_debug_valid.toml), or set --validator.steps N (or "
            f"--validator.dataloader.max_steps N).")
    if partial != "pad":
        raise ValueError(
            f"{where}: the validation recipe {getattr(recipe, 'origin', recipe)} has partial_batch = "
            f"\"{partial}\", which leaves the set's last, partial global batch out of every evaluation. Set "
            f"partial_batch = \"pad\" (padded rows have labels -100: the loss leaves them out).")


def check_fit(recipe: Recipe, dp_degree: int, seq_len: int, local_batch_size: int) -> int:
    """Refuse a trainer setting that does not fit the recipe: one optimizer step must consume one global batch.

    Args:
        recipe: the recipe.
        dp_degree: the data-parallel degree (replicate x shard), a divisor of the recipe's lanes.
        seq_len: ``--training.seq_len``, the recipe's ``seq_len``.
        local_batch_size: ``--training.local_batch_size``, a divisor of the rows each rank receives per step.

    Returns:
        The micro-batches per step (each rank's rows divided by ``local_batch_size``).

    Raises:
        ValueError: a number does not fit (the message says which to change, and to what).
    """
    L, b = recipe.lanes, recipe.batch_per_lane
    if seq_len != recipe.seq_len:
        raise ValueError(f"training.seq_len={seq_len} does not match the Zephon recipe {recipe.origin} "
                         f"(seq_len = {recipe.seq_len}). Set --training.seq_len {recipe.seq_len}, or use a "
                         f"recipe with seq_len = {seq_len} (seq_len is part of the recipe's fingerprint).")
    if dp_degree < 1 or L % dp_degree:
        raise ValueError(f"the data-parallel degree {dp_degree} does not divide the recipe's lanes = {L} "
                         f"({recipe.origin}): every data-parallel rank must own the same number of lanes. "
                         f"Use a data-parallel degree (data_parallel_replicate_degree x "
                         f"data_parallel_shard_degree) in {_divisors(L)}, or a recipe whose lanes is a "
                         f"multiple of {dp_degree} (lanes is fixed for the life of a run).")
    rows = L // dp_degree * b
    if local_batch_size < 1 or rows % local_batch_size:
        raise ValueError(f"training.local_batch_size={local_batch_size} does not fit the Zephon recipe "
                         f"{recipe.origin}: at data-parallel degree {dp_degree} each rank receives lanes/dp x "
                         f"batch_per_lane = {L}/{dp_degree} x {b} = {rows} rows per global step. Set "
                         f"--training.local_batch_size to {rows} or a divisor of it ({_divisors(rows)}) "
                         f"(with pipeline parallelism: --parallelism.pipeline_parallel_microbatch_size), and "
                         f"--training.global_batch_size {L * b} (the recipe's global batch, lanes x "
                         f"batch_per_lane) so that one optimizer step consumes one global batch.")
    return rows // local_batch_size


def images_refused(what: str) -> ValueError:
    """The error for a pipeline whose batches carry images, which Torchtitan 0.3's trainer cannot take.

    Args:
        what: the image keys or layout found, for the message.

    Returns:
        The error (to raise).
    """
    return ValueError(f"this pipeline's batches carry images ({what}), but Torchtitan 0.3's trainer feeds text "
                      f"models only ``input`` and ``positions`` (and its pipeline-parallel schedule would cut pixel "
                      f"tensors by their first dimension, not by row): train vision-language pipelines from "
                      f"ZephonLoader batches (scripts/train_tiny_vlm.py) or Megatron (zephon_megatron hands each "
                      f"micro-batch its own images)")


def to_torchtitan(batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A Zephon rank batch as ``({"input", "positions"}, labels)`` for the Torchtitan 0.3 trainer.

    ``positions`` restart at 0 at every packed document (Torchtitan derives its block-causal mask and
    RoPE from them). Zephon writes position 0 on every padding token; here the padding tail of a row
    counts as one more document (0, 1, 2, ...), so a mask sees one padding segment instead of one per
    token. Its labels are ignored either way.

    Args:
        batch: a Zephon batch of this rank.

    Returns:
        ``({"input": input_ids, "positions": positions}, labels)``.

    Raises:
        ValueError: the batch carries images or mrope positions.
    """
    images = [k for k in IMAGE_KEYS if k in batch]
    if images or batch["position_ids"].dim() != 2:
        raise images_refused(", ".join(images) or "mrope position_ids [3, B, S]")
    pad = batch["segment_ids"] == 0
    positions = torch.where(pad, pad.cumsum(1) - 1, batch["position_ids"])
    labels = batch["labels"]
    if zephon.IGNORE != IGNORE_INDEX:  # both are -100 today; keep the contract explicit
        labels = labels.masked_fill(labels == zephon.IGNORE, IGNORE_INDEX)
    return {"input": batch["input_ids"], "positions": positions}, labels


def row_digests(inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> list[str]:
    """SHA-256 of each row as the trainer consumes it (input, positions, labels; int64 bytes).

    Args:
        inputs: a micro-batch's ``{"input", "positions"}``.
        labels: its labels.

    Returns:
        One hex digest per row.
    """
    out = []
    for i in range(labels.shape[0]):
        h = hashlib.sha256()
        for t in (inputs["input"][i], inputs["positions"][i], labels[i]):
            h.update(t.contiguous().numpy().tobytes())
        out.append(h.hexdigest())
    return out


def split_state(state: dict[str, Any]) -> dict[str, str]:
    """A Zephon loader state as DCP entries: one header plus one entry per lane (JSON strings).

    Args:
        state: a loader state (``loader.state_dict()``).

    Returns:
        ``{HEADER_KEY: header, "lane_XXXXX": lane state, ...}``.
    """
    header = {k: state[k] for k in _HEADER_FIELDS}
    out = {HEADER_KEY: json.dumps(header, sort_keys=True)}
    for lane, lane_state in state["lanes"].items():
        out[lane_key(int(lane))] = json.dumps(lane_state, sort_keys=True)
    return out


def merge_entries(entries: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`split_state` over whichever lanes' entries are present.

    Args:
        entries: the header entry and some lanes' entries.

    Returns:
        The loader state holding those lanes.

    Raises:
        StateError: no header entry.
    """
    if HEADER_KEY not in entries:
        raise zephon.StateError(f"this dataloader state has no '{HEADER_KEY}' header entry (keys: "
                                f"{sorted(entries)[:6]}...): it was not written by ZephonDataLoader.")
    state = json.loads(entries[HEADER_KEY])
    state["lanes"] = {str(int(k[len(LANE_PREFIX):])): json.loads(v) for k, v in entries.items()
                      if k.startswith(LANE_PREFIX)}
    return state


class ZephonDataLoader(BaseDataLoader):
    """A Zephon recipe as a Torchtitan dataloader (elastic: resume at any dp degree dividing lanes).

    Built by the trainer with ``config.dataloader.build(...)`` (see the module docstring).

    Args:
        config: its :class:`ZephonDataLoader.Config`.
        dp_world_size: the data-parallel degree, a divisor of the recipe's lanes.
        dp_rank: this rank's data-parallel rank.
        tokenizer: the trainer's tokenizer (its folder, for ``[tokenizer] path = "@hf_assets_path"``).
        seq_len: ``--training.seq_len`` (must be the recipe's).
        local_batch_size: rows per micro-batch (``--training.local_batch_size``).
        **kwargs: what later trainers pass (``snapshot_every_n_steps``...), unused.

    Raises:
        ValueError: the trainer's numbers do not fit the recipe, or its batches carry images.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        """``--dataloader.*``: the recipe and the loader's options (``dataset`` and ``dataset_path``, inherited
        from ``BaseDataLoader.Config``, are ignored)."""

        recipe: str = ""
        """Zephon recipe (TOML), relative to the working directory, or a builder pipeline:
        ``package.module:name`` (a zephon.Pipeline, or a function returning one), or the Pipeline object
        itself in a Python config. (ZephonTrainer gives a validator loader with no recipe the training one.)"""

        seed: int | None = None
        """Replace the recipe's seed (a different run: new shard orders, routing, shuffles)."""

        lanes: int | None = None
        """Replace the recipe's lanes (a different run; the global batch is lanes x batch_per_lane)."""

        batch_per_lane: int | None = None
        """Replace the recipe's batch_per_lane (a different run)."""

        flush_every: int | None = None
        """Replace the recipe's flush_every (a different run)."""

        num_workers: int = 0
        """Zephon read+tokenize workers per rank (speed only: batches are identical for any count)."""

        runner: Literal["thread", "pool", "process"] = "thread"
        """Where the workers run: threads, a process pool for read+tokenize, or processes holding whole
        lanes (speed only)."""

        prefetch: int | None = None
        """Chunks per source ahead (thread, pool) or steps ahead (process); default Zephon's."""

        infinite: bool = True
        """The loader follows the recipe: sources without ``passes`` repeat (in new orders) for ever; with
        ``passes = N`` on every source it ends after N passes, at the same step on every rank. False (the
        validator sets it when ``validator.steps`` is -1: read the set to its end) needs such a recipe
        (e.g. ``recipes/torchtitan/llama3_debug_valid.toml``), or ``max_steps``."""

        max_steps: int = 0
        """Stop after this many global batches (0: never)."""

        hash_log: str = ""
        """Folder to append one JSON line per micro-batch to (``rank<R>.jsonl``): the SHA-256 of every
        row the trainer receives, with its step and global row index. For verifying determinism."""

        def load_recipe(self, hf_assets_path: str | None = None) -> Recipe:
            """The recipe, with this config's replacements (:func:`resolve_recipe`).

            Args:
                hf_assets_path: the trainer's ``--hf_assets_path``.

            Returns:
                The recipe (or builder pipeline).
            """
            return resolve_recipe(self.recipe, hf_assets_path, seed=self.seed, lanes=self.lanes,
                                  batch_per_lane=self.batch_per_lane, flush_every=self.flush_every)

    def __init__(self, config: Config, *, dp_world_size: int = 1, dp_rank: int = 0, tokenizer: Any = None,
                 seq_len: int, local_batch_size: int, **kwargs: Any) -> None:
        # kwargs: snapshot_every_n_steps and anything a later trainer passes; Zephon needs none of them.
        self.config = config
        """Its config."""
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.recipe = config.load_recipe(trainer_tokenizer_dir(tokenizer))
        """The recipe (or builder pipeline) it loads."""
        self.micro_batches = check_fit(self.recipe, dp_world_size, seq_len, local_batch_size)
        """Micro-batches per global step."""
        self.local_batch_size = local_batch_size
        """Rows per micro-batch."""
        if not config.infinite and config.max_steps <= 0:  # the validator's --validator.steps -1
            check_reads_once(self.recipe, "ZephonDataLoader(infinite=False)")
        self.max_steps = config.max_steps if config.max_steps > 0 else None
        """The global batches after which it stops (None: never, unless the recipe's data ends)."""
        # A recipe that ends: the ranks agree on its last step with one all-reduce per step over the default
        # process group (every Torchtitan rank iterates its dataloader in step, tensor/pipeline/context
        # peers with the same rows), so every rank stops at the same validator step.
        self._loader = zephon.build_loader(self.recipe, rank=dp_rank, world_size=dp_world_size,
                                           num_workers=config.num_workers, runner=config.runner,
                                           prefetch=config.prefetch, max_steps=self.max_steps)
        weakref.finalize(self, self._loader.close)
        images = self._loader.program.images  # a pipeline with images (any pixels mode) or mrope positions
        if images is not None:
            self._loader.close()
            raise images_refused(f"batch(pixels={images.pixels!r}, positions={images.positions!r})")
        self.lanes = self._loader.lanes
        """The lanes this rank owns."""
        self._pending: deque[tuple[dict[str, torch.Tensor], torch.Tensor]] = deque()
        self._last_provenance: torch.Tensor | None = None
        self._hash_file = None
        if config.hash_log:
            import torch.distributed as dist
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else dp_rank
            Path(config.hash_log).mkdir(parents=True, exist_ok=True)
            self._hash_file = open(Path(config.hash_log) / f"rank{rank}.jsonl", "a", encoding="utf-8")
            weakref.finalize(self, self._hash_file.close)
        logger.info(f"Zephon: recipe {self.recipe.origin}, lanes {self.lanes.start}..{self.lanes.stop - 1} of "
                    f"{self.recipe.lanes} on dp rank {dp_rank}/{dp_world_size}, "
                    f"{len(self.lanes) * self.recipe.batch_per_lane} rows per step in {self.micro_batches} "
                    f"micro-batch(es) of {local_batch_size}, fingerprint {self._loader.fingerprint}")

    @property
    def step(self) -> int:
        """Global batches fetched so far (all of whose micro-batches are yielded once none is pending)."""
        return self._loader.step

    @property
    def last_provenance(self) -> torch.Tensor | None:
        """The ``provenance`` tensor of this rank's rows of the last global batch fetched (``batch(provenance=True)``;
        rows numbered in the global batch, :mod:`zephon.origins`; the ranks' tensors concatenated in rank order
        are the global batch's), or None. It is not among the inputs the trainer gets:
        Torchtitan's trainer passes every input key on to the model's ``forward``."""
        return self._last_provenance

    def _fetch(self) -> None:
        batch = next(self._loader)
        self._last_provenance = batch.pop("provenance", None)
        inputs, labels = to_torchtitan(batch)
        b = self.local_batch_size
        for j in range(self.micro_batches):
            rows = slice(j * b, (j + 1) * b)
            self._pending.append(({k: v[rows] for k, v in inputs.items()}, labels[rows]))

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            if not self._pending:
                try:
                    self._fetch()
                except StopIteration:  # max_steps reached, or the recipe's data ended (on every rank)
                    return
            micro = self.micro_batches - len(self._pending)
            inputs, labels = self._pending.popleft()
            if self._hash_file is not None:
                self._log_hashes(micro, inputs, labels)
            yield inputs, labels

    def _log_hashes(self, micro: int, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> None:
        first = (self.lanes.start * self.recipe.batch_per_lane) + micro * self.local_batch_size
        record = {"step": self.step, "micro": micro, "dp_rank": self.dp_rank, "dp_degree": self.dp_world_size,
                  "first_row": first, "rows": row_digests(inputs, labels)}
        assert self._hash_file is not None
        self._hash_file.write(json.dumps(record) + "\n")
        self._hash_file.flush()

    # -- checkpointing (torch.distributed.checkpoint.stateful.Stateful) -------------------------------
    def state_dict(self) -> dict[str, Any]:
        """One DCP entry per owned lane plus the shared header; all JSON strings.

        Returns:
            The entries (:func:`split_state`).

        Raises:
            RuntimeError: asked for in the middle of a global batch (the optimizer step is smaller than the
                recipe's global batch).
        """
        if self._pending:
            done = self.micro_batches - len(self._pending)
            raise RuntimeError(
                f"ZephonDataLoader: checkpoint requested after {done} of the {self.micro_batches} micro-batches "
                f"of global batch {self.step}: the trainer's optimizer step is smaller than the recipe's global "
                f"batch ({self.recipe.lanes} lanes x {self.recipe.batch_per_lane} = "
                f"{self.recipe.global_batch_size} rows). Set --training.global_batch_size "
                f"{self.recipe.global_batch_size} so that every step consumes exactly one global batch.")
        return split_state(self._loader.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from the DCP entries of this rank's lanes (written at any dp degree that divides the lanes).

        Args:
            state_dict: the header entry and this rank's lanes' entries, as DCP loaded them (empty: nothing to
                load, the loader starts at the recipe's beginning).

        Raises:
            StateError: no header, or a state from another recipe (naming what differs).
        """
        if not state_dict:  # Torchtitan passes an empty dict when there is nothing to load
            return
        state = merge_entries(state_dict)
        self._pending.clear()
        self._loader.load_state_dict(state)
        logger.info(f"Zephon: resumed lanes {self.lanes.start}..{self.lanes.stop - 1} at global batch "
                    f"{self.step} (dp degree {self.dp_world_size})")

    # -- extras ---------------------------------------------------------------------------------------
    def set_mixture(self, weights: dict[str, float], at_step: int) -> int:
        """A loss-driven intervention: new mixture weights from a global step on (a Torchtitan step is one
        Zephon global batch).

        Call it on every rank with the same arguments (e.g. after an all-reduce of per-domain losses); the
        ranks are compared and a mismatch is an error.

        Args:
            weights: source name -> weight (only the ratios matter).
            at_step: the first global step the weights apply to (not one already delivered).

        Returns:
            The number of this rank's lanes that were rewound to apply it.

        Raises:
            ValueError: the step was already delivered, or the ranks' calls differ.
        """
        return self._loader.set_mixture(weights, at_step)

    def metrics(self) -> dict[str, Any]:
        """Zephon's loader metrics (tokens/s, padding, flush cost, per-lane progress).

        Returns:
            :meth:`zephon.ZephonLoader.metrics`.
        """
        return self._loader.metrics()

    def close(self) -> None:
        """Close the Zephon loader (stop its workers) and the hash log."""
        self._loader.close()
        if self._hash_file is not None:
            self._hash_file.close()

"""Pipelines as code: the builder every Zephon pipeline is made with (a TOML recipe compiles to one).

::

    import zephon as z

    pipe = (
        z.Pipeline(seed=1234, lanes=32)
        .source("web", z.read.parquet("data/web", columns=["text", "url"]), weight=0.7)
        .source("code", z.read.jsonl("data/code/*.jsonl"), weight=0.3)
        .filter(long_enough, sources=["web"])          # stateless: on the executors, before the merge
        .tokenize(z.tokenizer("tok.model"))             # stateless, one tokenizer call per chunk
        .split(max_tokens=2048)
        .mix(by="tokens")                               # the merge: an exact mixture over every prefix
        .shuffle(buffer=1024)                           # accumulator
        .pack(seq_len=2048, algorithm="best_fit")       # accumulator; packs every per-token field
        .batch(rows_per_lane=1)
    )
    print(pipe.explain())
    loader = pipe.build(rank=0, world_size=1, num_workers=2)

Every method returns a new pipeline (a pipeline is a value: reuse a prefix for several variants).
Transforms declared before the merge run per source (``sources=[...]`` picks them); those after it
run in the lane, a record at a time. Accumulators (``shuffle``, ``accumulate``, ``pack``) always run
after the merge: ``mix`` is inserted where the first one is declared when it is not written.
"""

from __future__ import annotations

import copy
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .ops.base import Accumulator, Operator, Transform, function_id
from .ops.mix import MIX_BY
from .ops.pack import PACK_ALGORITHMS
from .ops.split import Split
from .ops.tokenize import Tokenize
from .ops.transforms import FieldFilter, FieldMap, Filter, FlatMap, Map, MapBatch
from .read import FORMATS, ReadSpec
from .recipe import TokenizerSpec


class PipelineError(ValueError):
    """A pipeline that cannot be built as written; the message names the operator and the fix."""


@dataclass(frozen=True)
class SourceDecl:
    """A named source of a pipeline: how to read it and its mixture weight."""

    name: str
    read: ReadSpec
    weight: float = 1.0
    passes: int | None = None  # None: repeat for ever (in a new order every pass); N: stop after N passes


# -- step declarations that are not transforms: made per lane, from the lane's context -----------------
class Step(Operator):
    """A declared accumulator step: ``make(ctx, pipeline info)`` builds it in each lane."""

    stateful = True


class MixStep(Step):
    kind = "mix"

    def __init__(self, by: str = "tokens", weights: Mapping[str, float] | None = None, schedule: Any = None) -> None:
        super().__init__("mix")
        self.by, self.weights, self.schedule = by, dict(weights) if weights is not None else None, schedule

    def describe(self) -> dict[str, Any]:
        return {"op": "mix", "by": self.by, **({"weights": self.weights} if self.weights is not None else {}),
                **({"schedule": self.schedule.describe()} if self.schedule is not None else {})}


class ShuffleStep(Step):
    kind = "shuffle"

    def __init__(self, buffer: int) -> None:
        super().__init__("shuffle")
        self.buffer = buffer

    def describe(self) -> dict[str, Any]:
        return {"op": "shuffle", "buffer": self.buffer}


class AccumulateStep(Step):
    kind = "accumulate"

    def __init__(self, factory: Callable[..., Any], name: str | None, version: str | int | None) -> None:
        super().__init__(name or f"accumulate:{getattr(factory, '__name__', type(factory).__name__)}")
        self.factory, self.version = factory, version

    def describe(self) -> dict[str, Any]:
        return {"op": "accumulate", "name": self.name, "factory": function_id(self.factory, self.version)}


class PackStep(Step):
    kind = "pack"

    def __init__(self, seq_len: int, algorithm: str, max_open_bins: int, pad_id: int | None,
                 max_images_per_row: int | None = None, max_patches_per_row: int | None = None) -> None:
        super().__init__("pack")
        self.seq_len, self.algorithm, self.max_open_bins, self.pad_id = seq_len, algorithm, max_open_bins, pad_id
        self.max_images_per_row, self.max_patches_per_row = max_images_per_row, max_patches_per_row

    @property
    def limits(self) -> Any:
        from .ops.image_layout import ImageLimits

        return ImageLimits(self.max_images_per_row, self.max_patches_per_row)

    def describe(self) -> dict[str, Any]:
        d = {"op": "pack", "seq_len": self.seq_len, "algorithm": self.algorithm,
             "max_open_bins": self.max_open_bins if self.algorithm != "wrap" else None}
        if self.pad_id is not None:
            d["pad_id"] = self.pad_id
        return {**d, **self.limits.describe()}


PARTIAL = ("drop", "pad")


class BatchStep(Step):
    kind = "batch"

    def __init__(self, rows_per_lane: int, partial: str = "drop", pixels: str = "flat", positions: str = "1d",
                 stack: tuple[str, ...] = ()) -> None:
        super().__init__("batch")
        self.rows_per_lane, self.partial, self.pixels, self.positions = rows_per_lane, partial, pixels, positions
        self.stack = stack

    def describe(self) -> dict[str, Any]:
        return {"op": "batch", "rows_per_lane": self.rows_per_lane,
                **({"partial": self.partial} if self.partial != "drop" else {}),
                **({"stack": list(self.stack)} if self.stack else {}),
                **({"pixels": self.pixels} if self.pixels != "flat" else {}),
                **({"positions": self.positions} if self.positions != "1d" else {})}


def _positive_int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PipelineError(f"{what} must be a positive integer, got {value!r}")
    return value


class Pipeline:
    """A data pipeline: sources, stateless transforms, the merge, accumulators, packing, batching.

    ``seed`` decides all randomness; ``lanes`` the number of logical streams (fixed for a run: world
    sizes must divide it); ``flush_every`` and ``flush_by`` the sentinel cadence (completed chunks, or units,
    per lane between flush
    sentinels: a resume replays at most this much).
    """

    def __init__(self, seed: int, lanes: int, *, flush_every: int = 8, flush_by: str = "chunks", storage: Any = None,
                 origin: str = "<builder>") -> None:
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 63:
            raise PipelineError(f"Pipeline(seed={seed!r}): an integer in [0, 2**63) is needed")
        self.seed = seed
        self.lanes = _positive_int(lanes, "Pipeline(lanes=...)")
        self.flush_every = _positive_int(flush_every, "Pipeline(flush_every=...)")
        from .engine.sentinels import FLUSH_BY

        if flush_by not in FLUSH_BY:
            raise PipelineError(f"Pipeline(flush_by={flush_by!r}): use one of {FLUSH_BY}")
        self.flush_by = flush_by
        self.storage = storage
        self.origin = origin
        self._sources: tuple[SourceDecl, ...] = ()
        self._steps: tuple[Operator, ...] = ()
        self._compiled: Any = None

    # -- value semantics ----------------------------------------------------------------------------
    def _with(self, *, source: SourceDecl | None = None, step: Operator | None = None) -> "Pipeline":
        new = copy.copy(self)
        new._compiled = None
        if source is not None:
            new._sources = self._sources + (source,)
        if step is not None:
            if self._steps and isinstance(self._steps[-1], BatchStep):
                raise PipelineError(f"{step.kind}() after batch(): batch() must be the last step")
            new._steps = self._steps + (step,)
        return new

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_compiled": None}

    def replace(self, *, seed: int | None = None, lanes: int | None = None, flush_every: int | None = None,
                batch_per_lane: int | None = None, flush_by: str | None = None, pixels: str | None = None,
                positions: str | None = None) -> "Pipeline":
        """A copy with other top-level settings (each makes a different run: they are fingerprinted)."""
        new = copy.copy(self)
        new._compiled = None
        if seed is not None or lanes is not None or flush_every is not None or flush_by is not None:
            fresh = Pipeline(self.seed if seed is None else seed, self.lanes if lanes is None else lanes,
                             flush_every=self.flush_every if flush_every is None else flush_every,
                             flush_by=self.flush_by if flush_by is None else flush_by)
            new.seed, new.lanes, new.flush_every, new.flush_by = fresh.seed, fresh.lanes, fresh.flush_every, fresh.flush_by
        if batch_per_lane is not None or pixels is not None or positions is not None:
            if not self._steps or not isinstance(self._steps[-1], BatchStep):
                raise PipelineError("replace(batch_per_lane=, pixels=, positions=): the pipeline has no batch() step")
            last = self._steps[-1]
            rows = last.rows_per_lane if batch_per_lane is None else _positive_int(batch_per_lane, "batch_per_lane")
            head = copy.copy(self)
            head._steps = self._steps[:-1]
            again = head.batch(rows, last.partial, pixels=pixels or last.pixels,
                               positions=positions or last.positions)  # checks the values
            new._steps = again._steps
        return new

    @property
    def sources(self) -> tuple[SourceDecl, ...]:
        return self._sources

    @property
    def steps(self) -> tuple[Operator, ...]:
        return self._steps

    # -- sources -------------------------------------------------------------------------------------
    def source(self, name: str, read: ReadSpec, weight: float = 1.0, passes: int | None = None) -> "Pipeline":
        """Add a source: ``read`` is a :mod:`zephon.read` spec; ``weight`` its share in the mixture;
        ``passes``: stop after that many passes over its data (each record read exactly once per pass,
        by one lane), instead of repeating for ever (None, the default). See :meth:`batch` for how the
        loader ends."""
        if not isinstance(name, str) or not name:
            raise PipelineError(f"source(name={name!r}): a non-empty name is needed")
        if any(s.name == name for s in self._sources):
            raise PipelineError(f"source '{name}' is declared twice: source names must be unique")
        if not isinstance(read, ReadSpec) or read.format not in FORMATS:
            raise PipelineError(f"source '{name}': read must be made by zephon.read.<format>(...) "
                                f"({', '.join(FORMATS)}), got {read!r}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
            raise PipelineError(f"source '{name}': weight must be a finite number > 0, got {weight!r}")
        if self._steps:
            raise PipelineError(f"source '{name}' is declared after operators: declare every source first")
        if passes is not None and (isinstance(passes, bool) or not isinstance(passes, int) or passes < 1):
            raise PipelineError(f"source '{name}': passes must be a positive integer (or None: repeat), got {passes!r}")
        return self._with(source=SourceDecl(name, read, float(weight), passes))

    # -- stateless transforms ----------------------------------------------------------------------------
    def _check_sources(self, sources: Sequence[str] | None, what: str) -> Sequence[str] | None:
        if sources is None:
            return None
        if isinstance(sources, str):
            raise PipelineError(f"{what}(sources=...): a list of source names is needed, got the string {sources!r}")
        names = [s.name for s in self._sources]
        unknown = [s for s in sources if s not in names]
        if unknown:
            raise PipelineError(f"{what}(sources={list(sources)}): unknown sources {unknown} (declared: {names})")
        return list(sources)

    def map(self, fn: Callable[[dict], dict], *, sources: Sequence[str] | None = None, executor: str | None = None,
            version: str | int | None = None, on_error: str = "raise", name: str | None = None,
            token_fields: Mapping[str, Any] | None = None) -> "Pipeline":
        """``fn(record) -> record`` on every record (``token_fields``: per-token fields it adds, with the
        value a document without them gets when packed: ``{"modality_ids": 0}``)."""
        return self._with(step=Map(fn, name, self._check_sources(sources, "map"), executor, version, on_error,
                                   token_fields))

    def filter(self, fn: Callable[[dict], bool], *, sources: Sequence[str] | None = None,
               executor: str | None = None, version: str | int | None = None, on_error: str = "raise",
               name: str | None = None) -> "Pipeline":
        """Keep the records for which ``fn(record)`` is True (it must return a bool)."""
        return self._with(step=Filter(fn, name, self._check_sources(sources, "filter"), executor, version, on_error))

    def flat_map(self, fn: Callable[[dict], Any], *, sources: Sequence[str] | None = None,
                 executor: str | None = None, version: str | int | None = None, on_error: str = "raise",
                 name: str | None = None) -> "Pipeline":
        """``fn(record) -> iterable of records``: zero or more records per record."""
        return self._with(step=FlatMap(fn, name, self._check_sources(sources, "flat_map"), executor, version,
                                       on_error))

    def map_batch(self, fn: Callable[[dict], dict], *, sources: Sequence[str] | None = None,
                  executor: str | None = None, version: str | int | None = None, name: str | None = None
                  ) -> "Pipeline":
        """``fn(columns) -> columns`` on a chunk of records at once (a dict of equal-length lists)."""
        return self._with(step=MapBatch(fn, name, self._check_sources(sources, "map_batch"), executor, version))

    def map_field(self, fn: Callable[[Any], Any], field: str = "text", *, sources: Sequence[str] | None = None,
                  executor: str | None = None, version: str | int | None = None, name: str | None = None
                  ) -> "Pipeline":
        """``fn(value) -> value`` on one field (None stays None): e.g. a text clean-up."""
        return self._with(step=FieldMap(fn, field, name=name, sources=self._check_sources(sources, "map_field"),
                                        executor=executor, version=version))

    def filter_field(self, fn: Callable[[Any], bool], field: str = "text", *, sources: Sequence[str] | None = None,
                     executor: str | None = None, version: str | int | None = None, name: str | None = None
                     ) -> "Pipeline":
        """Keep records whose ``fn(record[field])`` is True (empty values are left to ``tokenize``)."""
        return self._with(step=FieldFilter(fn, field, name=name, sources=self._check_sources(sources, "filter_field"),
                                           executor=executor, version=version))

    def tokenize(self, tokenizer: TokenizerSpec, field: str = "text", *, add_eos: bool | None = None,
                 add_bos: bool | None = None, keep_field: bool = False, sources: Sequence[str] | None = None,
                 executor: str | None = None, name: str | None = None) -> "Pipeline":
        """Tokenize ``field`` into ``input_ids`` (text, or token-id lists of a pre-tokenized source)."""
        if not isinstance(tokenizer, TokenizerSpec):
            raise PipelineError(f"tokenize(tokenizer=...): pass zephon.tokenizer(path), got {tokenizer!r}")
        return self._with(step=Tokenize(tokenizer, field, add_eos, add_bos, keep_field, name,
                                        self._check_sources(sources, "tokenize"), executor))

    def tokenize_chat(self, tokenizer: TokenizerSpec, template: str | None = None, field: str = "messages", *,
                      loss_on: str = "assistant", add_eos: bool = False, add_generation_prompt: bool = False,
                      date: Any = None, on_error: str = "raise", sources: Sequence[str] | None = None,
                      executor: str | None = None, name: str | None = None) -> "Pipeline":
        """Render ``field`` (a list of ``{"role", "content"}`` messages) with a chat template and tokenize
        it, with ``loss_mask`` on the assistant turns, as ``transformers``' ``apply_chat_template`` with
        ``return_assistant_tokens_mask`` (docs/guides/chat.md).

        Args:
            tokenizer: ``zephon.tokenizer(path)``.
            template: a Jinja chat template: a ``.jinja`` file or the template text.
            field: the record field holding the messages (a record's ``tools`` and ``documents`` fields, when
                read, are passed to the template too).
            loss_on: "assistant" (every assistant turn), "last_assistant" or "all".
            add_eos: append the tokenizer's EOS (a target when the last turn is); off by default, as in
                ``apply_chat_template``: the template's own end tokens separate conversations.
            add_generation_prompt: the template variable of that name.
            date: the day the template's ``strftime_now`` formats, "YYYY-MM-DD" (default
                ``zephon.ops.chat.DEFAULT_DATE``, a constant: never the clock).
            on_error: "raise" (a record with a malformed message, or that the template refuses, is an error
                naming the file, the row and the field) or "skip" (skipped and counted as
                ``invalid_conversations`` in ``metrics()["skipped_by_reason"]``).
            sources, executor, name: as for every operator.

        Returns:
            The pipeline with the step added.
        """
        from .ops.chat import DEFAULT_DATE, TokenizeChat

        return self._with(step=TokenizeChat(tokenizer, template, field, loss_on, add_eos, name,
                                            self._check_sources(sources, "tokenize_chat"), executor,
                                            add_generation_prompt=add_generation_prompt,
                                            date=DEFAULT_DATE if date is None else date, on_error=on_error))

    def split(self, max_tokens: int, *, sources: Sequence[str] | None = None, executor: str | None = None
              ) -> "Pipeline":
        """Cut documents longer than ``max_tokens`` into pieces (needed before best/first-fit packing of
        documents longer than a row; inserted at ``seq_len`` when absent). A document with images is cut only
        between images, each piece with the images it holds, and within pack's per-row image limits."""
        return self._with(step=Split(_positive_int(max_tokens, "split(max_tokens=...)"),
                                     sources=self._check_sources(sources, "split"), executor=executor))

    def apply(self, transform: Transform) -> "Pipeline":
        """Add a :class:`~zephon.ops.base.Transform` of your own (a subclass with ``apply(chunk)``)."""
        if not isinstance(transform, Transform):
            raise PipelineError(f"apply() takes a zephon.ops.Transform, got {transform!r}")
        return self._with(step=transform)

    def decode_images(self, field: str = "image", *, size: int | Sequence[int] | None = None,
                      max_pixels: int | None = None, min_pixels: int = 56 * 56, patch_size: int = 14, merge: int = 1,
                      patchify: bool = True, resample: str = "bicubic", max_image_pixels: int = 1 << 26,
                      on_bad_image: str = "skip", jpeg_decoder: str = "auto", reduced_decode: bool = True,
                      keep_field: bool = False, sources: Sequence[str] | None = None, executor: str | None = None,
                      name: str | None = None) -> "Pipeline":
        """Decode the images of ``field`` (bytes, ``{bytes, path}`` structs or paths; one or a list per record)
        into ``images`` (patches or pixels) and ``image_grid_thw``: decode, EXIF orientation, RGB, resize to
        ``size=`` (centre crop) or within ``max_pixels=`` (aspect kept, on the patch grid), patchify
        (``patch_size``, ``merge``). Bad images by ``on_bad_image`` ("skip", "drop_record", "raise"). See
        :mod:`zephon.ops.image` for every option and the output contract."""
        from .ops.image import DecodeImages

        try:
            op = DecodeImages(field, size=size, max_pixels=max_pixels, min_pixels=min_pixels, patch_size=patch_size,
                              merge=merge, patchify=patchify, resample=resample, max_image_pixels=max_image_pixels,
                              on_bad_image=on_bad_image, jpeg_decoder=jpeg_decoder, reduced_decode=reduced_decode,
                              keep_field=keep_field, name=name, sources=self._check_sources(sources, "decode_images"),
                              executor=executor)
        except (TypeError, ValueError) as exc:
            raise PipelineError(str(exc)) from None
        return self._with(step=op)

    def tokenize_images(self, tokenizer: TokenizerSpec, field: str = "text", *, image_pad: int | str,
                        image_start: int | str | None = None, image_end: int | str | None = None,
                        merge: int | None = None, placeholder: str = "<image>", unplaced_images: str = "before",
                        loss_on_images: bool = False, add_eos: bool | None = None, add_bos: bool | None = None,
                        keep_field: bool = False, sources: Sequence[str] | None = None, executor: str | None = None,
                        name: str | None = None) -> "Pipeline":
        """Tokenize ``field`` (a caption with ``<image>`` placeholders, or interleaved ``texts``) with each image
        of ``images`` expanded to ``image_start, image_pad * n, image_end`` tokens and ``loss_mask`` 0 where an
        image token is the label. ``merge`` defaults to the ``merge`` of the ``decode_images`` steps before it.
        See :mod:`zephon.ops.image_tokens`."""
        from .ops.image import DecodeImages
        from .ops.image_tokens import TokenizeImages

        if not isinstance(tokenizer, TokenizerSpec):
            raise PipelineError(f"tokenize_images(tokenizer=...): pass zephon.tokenizer(path), got {tokenizer!r}")
        picked = self._check_sources(sources, "tokenize_images")
        if merge is None:
            merges = {s.merge for s in self._steps if isinstance(s, DecodeImages)
                      and (picked is None or s.sources is None or set(picked) & set(s.sources))}
            if len(merges) != 1:
                raise PipelineError("tokenize_images(merge=...): " + (
                    "no decode_images() step comes before it" if not merges else
                    f"the decode_images() steps before it merge differently ({sorted(merges)})") + "; pass merge=")
            merge = merges.pop()
        try:
            op = TokenizeImages(tokenizer, field, image_pad=image_pad, image_start=image_start, image_end=image_end,
                                merge=merge, placeholder=placeholder, unplaced_images=unplaced_images,
                                loss_on_images=loss_on_images, add_eos=add_eos, add_bos=add_bos, keep_field=keep_field,
                                name=name, sources=picked, executor=executor)
        except (TypeError, ValueError) as exc:
            raise PipelineError(str(exc)) from None
        return self._with(step=op)

    # -- the merge and accumulators ----------------------------------------------------------------------
    def mix(self, by: str = "tokens", weights: Mapping[str, float] | None = None, schedule: Any = None) -> "Pipeline":
        """Where the sources meet: an exact mixture by ``"tokens"`` or ``"documents"``; ``weights`` (source
        name -> weight) overrides the sources' own; ``schedule`` (a :class:`zephon.Schedule`) changes them
        over training steps (phases, or waypoints with linear or cosine interpolation)."""
        from .ops.schedule import Schedule

        if schedule is not None and not isinstance(schedule, Schedule):
            raise PipelineError(f"mix(schedule=...): pass a zephon.Schedule, got {schedule!r}")
        if by not in MIX_BY:
            raise PipelineError(f"mix(by={by!r}): use one of {MIX_BY}")
        if any(isinstance(s, MixStep) for s in self._steps):
            raise PipelineError("mix() is declared twice: the sources meet once")
        if weights is not None:
            names = {s.name for s in self._sources}
            if set(weights) != names:
                raise PipelineError(f"mix(weights=...) must name every source once: got {sorted(weights)}, "
                                    f"sources are {sorted(names)}")
            for k, w in weights.items():
                if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < float("inf"):
                    raise PipelineError(f"mix(weights=...): weight of '{k}' must be a finite number > 0, got {w!r}")
        return self._with(step=MixStep(by, weights, schedule))

    def shuffle(self, buffer: int) -> "Pipeline":
        """A seeded shuffle within a window of ``buffer`` records (per lane, drained at each sentinel)."""
        return self._with(step=ShuffleStep(_positive_int(buffer, "shuffle(buffer=...)")))

    def accumulate(self, factory: Callable[..., Any], *, name: str | None = None,
                   version: str | int | None = None) -> "Pipeline":
        """Your own accumulator: ``factory(ctx)`` (or ``factory()``) builds one per lane, with ``push(record)
        -> records`` and ``flush() -> records`` (see "Writing operators" in README)."""
        if not callable(factory):
            raise PipelineError(f"accumulate() takes a factory (a class or function), got {factory!r}")
        if isinstance(factory, Accumulator):
            raise PipelineError("accumulate() takes a factory, not an instance: every lane builds its own "
                                "(pass the class, or a function returning a new instance)")
        return self._with(step=AccumulateStep(factory, name, version))

    def pack(self, seq_len: int, algorithm: str = "best_fit", max_open_bins: int = 16,
             pad_id: int | None = None, *, max_images_per_row: int | None = None,
             max_patches_per_row: int | None = None) -> "Pipeline":
        """Pack documents into rows of ``seq_len`` tokens (``best_fit``, ``first_fit`` or ``wrap``).

        Documents with images (``tokenize_images``): image tokens count like any token, a document is cut
        only between images and each piece carries the images it holds; ``max_images_per_row`` and
        ``max_patches_per_row`` cap one row's images and patches (a document that would exceed them goes
        to another row). Per row, so the same on every world size: a global batch holds at most
        ``lanes * rows_per_lane`` times them. See :mod:`zephon.ops.pack`."""
        seq_len = _positive_int(seq_len, "pack(seq_len=...)")
        for what, v in (("max_images_per_row", max_images_per_row), ("max_patches_per_row", max_patches_per_row)):
            if v is not None:
                _positive_int(v, f"pack({what}=...)")
        if seq_len < 2:
            raise PipelineError(f"pack(seq_len={seq_len}): at least 2 tokens per row")
        if algorithm not in PACK_ALGORITHMS:
            raise PipelineError(f"pack(algorithm={algorithm!r}): use one of {PACK_ALGORITHMS}")
        _positive_int(max_open_bins, "pack(max_open_bins=...)")
        if pad_id is not None and (not isinstance(pad_id, int) or isinstance(pad_id, bool) or pad_id < 0):
            raise PipelineError(f"pack(pad_id={pad_id!r}): a non-negative token id is needed")
        if any(isinstance(s, PackStep) for s in self._steps):
            raise PipelineError("pack() is declared twice")
        return self._with(step=PackStep(seq_len, algorithm, max_open_bins, pad_id, max_images_per_row,
                                        max_patches_per_row))

    def batch(self, rows_per_lane: int = 1, partial: str = "drop", *, pixels: str = "flat",
              positions: str = "1d", stack: Sequence[str] = ()) -> "Pipeline":
        """Each lane adds ``rows_per_lane`` rows to every global batch (global batch = lanes x this).

        Without ``pack()`` a row is one record (image-caption pairs, pre-cut samples): the batch has every
        field of the records, one value per row, as a list, or as one tensor for the fields named in
        ``stack`` (one shape and dtype each), plus ``valid`` (see :mod:`zephon.collate_records`).

        ``partial``: when sources stop (``passes=``), lanes run out at different steps; the first global
        batch that some lane cannot fill ends the loader (``"drop"``), or lanes that ran out deliver rows
        of padding until every lane has (``"pad"``, so an evaluation covers its whole set). Either way the
        loader ends at the same global step on every world size and after any resume.

        Images (:mod:`zephon.collate_images`): ``pixels="flat"`` gives ``pixel_values`` uint8
        ``[total_patches, p*p*3]`` with ``image_grid_thw``, ``image_row`` and ``image_token_start``;
        ``"fixed"`` gives ``[rows * max_images_per_row, 3, H, W]`` with ``image_mask`` (images of one size,
        ``decode_images(size=)``); ``"lists"`` the per-document payloads. Pixels stay uint8 (a quarter of the
        bytes to move; normalise on the GPU: ``zephon.collate_images.normalize``). ``positions="mrope"``:
        ``position_ids`` ``[3, B, S]``, Qwen2-VL's 3-D rotary positions per document."""
        from .collate_images import PIXEL_MODES, POSITION_MODES

        if partial not in PARTIAL:
            raise PipelineError(f"batch(partial={partial!r}): use one of {PARTIAL}")
        if pixels not in PIXEL_MODES:
            raise PipelineError(f"batch(pixels={pixels!r}): use one of {PIXEL_MODES}")
        if positions not in POSITION_MODES:
            raise PipelineError(f"batch(positions={positions!r}): use one of {POSITION_MODES}")
        if isinstance(stack, str) or not all(isinstance(k, str) and k for k in stack):
            raise PipelineError(f"batch(stack={stack!r}): a list of field names, e.g. stack=['image']")
        return self._with(step=BatchStep(_positive_int(rows_per_lane, "batch(rows_per_lane=...)"), partial, pixels,
                                         positions, tuple(stack)))

    # -- what the rest of Zephon reads ------------------------------------------------------------------------
    def _find(self, cls: type) -> Any:
        return next((s for s in self._steps if isinstance(s, cls)), None)

    @property
    def seq_len(self) -> int:
        pack = self._find(PackStep)
        if pack is None:
            raise PipelineError("this pipeline has no pack() step, so no seq_len")
        return pack.seq_len

    @property
    def batch_per_lane(self) -> int:
        step = self._find(BatchStep)
        if step is None:
            raise PipelineError("this pipeline has no batch() step: end it with .batch(rows_per_lane=...)")
        return step.rows_per_lane

    @property
    def global_batch_size(self) -> int:
        return self.lanes * self.batch_per_lane

    @property
    def tokenizer(self) -> TokenizerSpec | None:
        """The tokenizer of the first ``tokenize`` step (its vocabulary and pad id size a model)."""
        kinds = ("tokenize_chat", "tokenize_images")
        tok = next((s for s in self._steps if isinstance(s, Tokenize) or s.kind in kinds), None)
        return None if tok is None else tok.spec

    def compile(self, plan: Any = None) -> Any:
        """The :class:`~zephon.engine.lane.LaneProgram` of this pipeline (lists files once; cached)."""
        if self._compiled is None or plan is not None:
            from .compile import compile_pipeline

            compiled = compile_pipeline(self, plan)
            if plan is not None:
                return compiled
            self._compiled = compiled
        return self._compiled

    @property
    def fingerprint(self) -> str:
        return self.compile().fingerprint

    def explain(self) -> str:
        """The operators in order, where each runs, and the fingerprint."""
        from .compile import explain

        return explain(self)

    def validate(self, records: int = 64) -> Any:
        """Push a few records of every source through every operator, in this process; errors name the
        operator. Returns a report of what each operator made."""
        from .compile import validate

        return validate(self, records)

    def build(self, rank: int | None = None, world_size: int | None = None, num_workers: int = 0,
              runner: str = "thread", **kwargs: Any) -> Any:
        """The loader of data-parallel ``rank`` of ``world_size`` (see :func:`zephon.build_loader`)."""
        from .loader import build_loader

        return build_loader(self, rank=rank, world_size=world_size, num_workers=num_workers, runner=runner, **kwargs)

    def to_recipe(self) -> str:
        """This pipeline as a TOML recipe (``[[steps]]`` form); user functions by import path."""
        from .recipe_steps import pipeline_to_toml

        return pipeline_to_toml(self)

    def __repr__(self) -> str:
        ops = " -> ".join(s.kind for s in self._steps)
        return f"Pipeline(seed={self.seed}, lanes={self.lanes}, sources={[s.name for s in self._sources]}, ops={ops})"


def tokenizer(path: str, kind: str | None = None, *, add_eos: bool = True, add_bos: bool = False,
              eos_token: str | None = None, bos_token: str | None = None, pad_id: int | None = None,
              pat_str: str | None = None, special_tokens: Mapping[str, int] | None = None) -> TokenizerSpec:
    """A tokenizer by file: ``kind`` is guessed from the file when not given (SentencePiece ``.model``,
    Hugging Face ``tokenizer.json``, tiktoken BPE ``.tiktoken``).

    Args:
        path: the tokenizer file.
        kind: ``sentencepiece``, ``huggingface`` or ``tiktoken``; None: guessed from the file's content.
        add_eos, add_bos: frame every document with EOS / BOS.
        eos_token, bos_token: the name of the EOS / BOS token (default: the tokenizer's own, or a usual name).
        pad_id: the id written into padding (default: EOS).
        pat_str: tiktoken: the split regex. A file that is one of tiktoken's own encodings (by its SHA-256)
            takes tiktoken's; any other file needs it.
        special_tokens: tiktoken: special token name -> id, e.g. ``{"<|endoftext|>": 100257}``. Taken from
            tiktoken for one of its own encodings; any other file needs it when EOS or BOS is added.

    Returns:
        The :class:`~zephon.recipe.TokenizerSpec` (loaded, and checked against the file, when first used).
    """
    from .recipe import RecipeError, validate_special_tokens
    from .tokenization import sniff_tokenizer_kind

    if kind is None:
        _check_tokenizer_file(path)  # the kind is read from the file: it must be there
        kind = sniff_tokenizer_kind(Path(path))
        if kind is None:
            raise PipelineError(f"tokenizer({path!r}): cannot tell which kind of tokenizer this file is; pass "
                                f"kind='sentencepiece', 'huggingface' or 'tiktoken'")
    spec = TokenizerSpec(kind, str(path), add_eos, add_bos, eos_token, bos_token, pad_id, pat_str, special_tokens)
    try:
        validate_special_tokens(spec, f"tokenizer({path!r})")
    except RecipeError as exc:
        raise PipelineError(str(exc)) from None
    return spec


def _check_tokenizer_file(path: str | Path) -> None:
    """``tokenizer(path)``'s file must exist and be a file; else a RecipeFileError (also a FileNotFoundError,
    what this raised before) naming the path as given and as resolved, and the fix."""
    from .recipe import RecipeFileError

    p = Path(path)
    where = f"tokenizer({str(path)!r})"
    if p.is_dir():
        inside = sorted(q.name for q in p.iterdir()
                        if q.is_file() and (q.name.endswith((".model", ".tiktoken")) or q.name == "tokenizer.json"))
        hint = f": pass one of the files in it, e.g. {p / inside[0]}" if inside else \
            ": pass a SentencePiece .model, a Hugging Face tokenizer.json or a tiktoken .tiktoken file"
        raise RecipeFileError(f"{where}: {p.resolve()} is a folder, not a tokenizer file{hint}.")
    if not p.is_file():
        demo = p.name in ("tok.model", "tok_vl.model")  # the demo's tokenizers (zephon/demo.py)
        fix = (f"run `zephon demo {p.parent}` to build the demo's tokenizers (tok_vl.model needs the vision extra: "
               "python -m pip install -e '.[vision]')" if demo else
               "pass the path of a SentencePiece .model, a Hugging Face tokenizer.json or a tiktoken .tiktoken "
               "file (relative paths resolve against the current folder)")
        raise RecipeFileError(f"{where}: tokenizer file not found: {p.resolve()} does not exist; {fix}.")


__all__ = ["Pipeline", "PipelineError", "SourceDecl", "tokenizer"]

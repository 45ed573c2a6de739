"""Pipelines as code: the builder every Zephon pipeline is made with (a TOML recipe spells one too).

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

Every method returns a new pipeline (a pipeline is a value: reuse a prefix for several variants). Each
builder method adds one operator, an object of :mod:`zephon.ops` (its declaration, description and runtime
in one file); this module only assembles them. Transforms declared before the merge run per source
(``sources=[...]`` picks them); those after it run in the lane, a record at a time. Accumulators
(``shuffle``, ``accumulate``, ``pack``) always run after the merge: ``mix`` is inserted where the first one is
declared when it is not written.
"""

from __future__ import annotations

import copy
import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .errors import PipelineError, RecipeError, RecipeFileError
from .ops.accumulate import Accumulate
from .ops.base import Operator, Transform, positive_int
from .ops.batch import Batch
from .ops.decode_images import DecodeImages
from .ops.filter import Filter, FilterField
from .ops.flat_map import FlatMap
from .ops.map import Map, MapField
from .ops.map_batch import MapBatch
from .ops.mix import Mix
from .ops.pack import Pack
from .ops.schedule import Schedule
from .ops.shuffle import Shuffle
from .ops.split import Split
from .ops.tokenize import Tokenize
from .ops.tokenize_chat import DEFAULT_DATE, TokenizeChat
from .ops.tokenize_images import TokenizeImages
from .read import FORMATS, ReadSpec
from .specs import KIND_FILES, TokenizerSpec, validate_special_tokens

TOKENIZING_OPS = (Tokenize, TokenizeChat, TokenizeImages)


@dataclass(frozen=True)
class SourceDecl:
    """A named source of a pipeline: how to read it, its mixture weight, and how many passes it makes."""

    name: str
    """The source's name (unique in its pipeline)."""
    read: ReadSpec
    """How to list, plan and read it (made by :mod:`zephon.read`)."""
    weight: float = 1.0
    """Its share in the mixture (only the ratios matter)."""
    passes: int | None = None
    """None: repeat for ever (in a new order every pass); N: stop after N passes."""


class Pipeline:
    """A data pipeline: sources, stateless transforms, the merge, accumulators, packing, batching.

    Args:
        seed: decides all randomness (shard orders, routing, shuffles), an integer in ``[0, 2**63)``.
        lanes: the number of logical streams, fixed for a run: world sizes must divide it.
        flush_every: completed chunks (or units, ``flush_by="units"``) per lane between flush sentinels (a
            resume replays at most this much).
        flush_by: what ``flush_every`` counts: ``"chunks"`` or ``"units"``.
        storage: object-store options (a :class:`~zephon.specs.StorageSpec`; speed only).
        origin: where it was declared, for messages (a recipe's path).

    Raises:
        PipelineError: a value out of range, naming it.
    """

    def __init__(self, seed: int, lanes: int, *, flush_every: int = 8, flush_by: str = "chunks", storage: Any = None,
                 origin: str = "<builder>") -> None:
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 63:
            raise PipelineError(f"Pipeline(seed={seed!r}): an integer in [0, 2**63) is needed")
        self.seed = seed
        """Decides all randomness (fingerprinted)."""
        self.lanes = positive_int(lanes, "Pipeline(lanes=...)")
        """The number of logical streams (fingerprinted): world sizes must divide it."""
        self.flush_every = positive_int(flush_every, "Pipeline(flush_every=...)")
        """Completed chunks (or units) per lane between flush sentinels (fingerprinted)."""
        if flush_by not in ("chunks", "units"):
            raise PipelineError(f"Pipeline(flush_by={flush_by!r}): use 'chunks' or 'units'")
        self.flush_by = flush_by
        """What ``flush_every`` counts: ``"chunks"`` or ``"units"`` (fingerprinted)."""
        self.storage = storage
        """Object-store options (a :class:`~zephon.specs.StorageSpec`, or None; speed only)."""
        self.origin = origin
        """Where it was declared, for messages (a recipe's path, or ``"<builder>"``)."""
        self._sources: tuple[SourceDecl, ...] = ()
        self._ops: tuple[Operator, ...] = ()
        self._compiled: Any = None

    # -- value semantics ----------------------------------------------------------------------------
    def _with(self, *, source: SourceDecl | None = None, op: Operator | None = None) -> "Pipeline":
        new = copy.copy(self)
        new._compiled = None
        if source is not None:
            new._sources = self._sources + (source,)
        if op is not None:
            if self._ops and isinstance(self._ops[-1], Batch):
                raise PipelineError(f"{op.op or op.name}() after batch(): batch() must be the last operator")
            op.describe()  # an operator the fingerprint cannot cover is refused now, naming the fix
            new._ops = self._ops + (op,)
        return new

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_compiled": None}

    def replace(self, *, seed: int | None = None, lanes: int | None = None, flush_every: int | None = None,
                batch_per_lane: int | None = None, flush_by: str | None = None, pixels: str | None = None,
                positions: str | None = None, provenance: bool | None = None) -> "Pipeline":
        """A copy with other top-level settings (each makes a different run, they are fingerprinted; but for
        ``provenance``, which only adds the ``provenance`` key to every batch).

        Args:
            seed: a new seed (None: keep this one's); as :class:`Pipeline`'s.
            lanes: a new lane count (None: keep).
            flush_every: a new sentinel cadence (None: keep).
            batch_per_lane: the ``batch`` operator's new ``rows_per_lane`` (None: keep).
            flush_by: what ``flush_every`` counts, ``"chunks"`` or ``"units"`` (None: keep).
            pixels: the ``batch`` operator's new ``pixels`` (None: keep).
            positions: the ``batch`` operator's new ``positions`` (None: keep).
            provenance: the ``batch`` operator's new ``provenance`` (None: keep).

        Returns:
            The new pipeline; this one is unchanged.

        Raises:
            PipelineError: a value out of range, or ``batch_per_lane``, ``pixels``, ``positions`` or
                ``provenance`` for a pipeline that has no ``batch()``.
        """
        new = self._with()
        fresh = Pipeline(self.seed if seed is None else seed, self.lanes if lanes is None else lanes,
                         flush_every=self.flush_every if flush_every is None else flush_every,
                         flush_by=self.flush_by if flush_by is None else flush_by)
        new.seed, new.lanes, new.flush_every, new.flush_by = fresh.seed, fresh.lanes, fresh.flush_every, fresh.flush_by
        if batch_per_lane is not None or pixels is not None or positions is not None or provenance is not None:
            last = self._ops[-1] if self._ops else None
            if not isinstance(last, Batch):
                raise PipelineError("replace(batch_per_lane=, pixels=, positions=, provenance=): the pipeline has "
                                    "no batch()")
            new._ops = self._ops[:-1] + (Batch(last.rows_per_lane if batch_per_lane is None else batch_per_lane,
                                               last.partial, pixels=pixels or last.pixels,
                                               positions=positions or last.positions, stack=last.stack,
                                               provenance=last.provenance if provenance is None else provenance),)
        return new

    @property
    def sources(self) -> tuple[SourceDecl, ...]:
        """The declared sources, in order."""
        return self._sources

    @property
    def ops(self) -> tuple[Operator, ...]:
        """The declared operators, in order (the implied ``mix`` and ``split`` are added when compiled)."""
        return self._ops

    # -- sources -------------------------------------------------------------------------------------
    def source(self, name: str, read: ReadSpec, weight: float = 1.0, passes: int | None = None) -> "Pipeline":
        """Add a source.

        Args:
            name: unique; the key of its positions in checkpoints and of its weight.
            read: a :mod:`zephon.read` spec (``z.read.parquet(...)``, ...).
            weight: its share in the mixture (only the ratios matter).
            passes: stop after that many passes over its data (each record read exactly once per pass, by one
                lane), instead of repeating for ever (None). See :meth:`batch` for how the loader ends.

        Returns:
            The pipeline with the source added.

        Raises:
            PipelineError: a name declared twice, a bad weight or passes, or a source after operators.
        """
        if not isinstance(name, str) or not name:
            raise PipelineError(f"source(name={name!r}): a non-empty name is needed")
        if any(s.name == name for s in self._sources):
            raise PipelineError(f"source '{name}' is declared twice: source names must be unique")
        if not isinstance(read, ReadSpec) or read.format not in FORMATS:
            raise PipelineError(f"source '{name}': read must be made by zephon.read.<format>(...) "
                                f"({', '.join(FORMATS)}), got {read!r}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
            raise PipelineError(f"source '{name}': weight must be a finite number > 0, got {weight!r}")
        if self._ops:
            raise PipelineError(f"source '{name}' is declared after operators: declare every source first")
        if passes is not None and (isinstance(passes, bool) or not isinstance(passes, int) or passes < 1):
            raise PipelineError(f"source '{name}': passes must be a positive integer (or None: repeat), got {passes!r}")
        return self._with(source=SourceDecl(name, read, float(weight), passes))

    def _pick(self, sources: Sequence[str] | None, what: str) -> Sequence[str] | None:
        if sources is None:
            return None
        if isinstance(sources, str):
            raise PipelineError(f"{what}(sources=...): a list of source names is needed, got the string {sources!r}")
        names = [s.name for s in self._sources]
        unknown = [s for s in sources if s not in names]
        if unknown:
            raise PipelineError(f"{what}(sources={list(sources)}): unknown sources {unknown} (declared: {names})")
        return list(sources)

    # -- stateless transforms ------------------------------------------------------------------------------
    def map(self, fn: Callable[[dict], dict], *, sources: Sequence[str] | None = None, executor: str | None = None,
            version: str | int | None = None, on_error: str = "raise", name: str | None = None,
            token_fields: Mapping[str, Any] | None = None) -> "Pipeline":
        """``fn(record) -> record`` on every record.

        Args:
            fn: a pure function of the record (module-level for the process and Ray runners).
            sources: the sources it applies to (None: all; before the merge only).
            executor: the stage's executor kind (None: the loader's runner).
            version: bump it when ``fn`` changes under the same name (a lambda needs one).
            on_error: ``"raise"`` (an error naming the file and row) or ``"skip"`` (skipped and counted).
            name: its name in messages and ``explain()``.
            token_fields: per-token fields it adds, with the value a document without them gets when packed
                (``{"modality_ids": 0}``).

        Returns:
            The pipeline with the operator added; this one is unchanged.

        Raises:
            PipelineError: ``fn`` is not callable, or cannot be fingerprinted (a lambda without ``version``).
        """
        return self._with(op=Map(fn, name, self._pick(sources, "map"), executor, version, on_error, token_fields))

    def filter(self, fn: Callable[[dict], bool], *, sources: Sequence[str] | None = None,
               executor: str | None = None, version: str | int | None = None, on_error: str = "raise",
               name: str | None = None) -> "Pipeline":
        """Keep the records for which ``fn(record)`` is True (it must return a bool).

        Args:
            fn: a pure function of the record (module-level for the process and Ray runners).
            sources: the sources it applies to (None: all; before the merge only).
            executor: the stage's executor kind, ``"inline"``, ``"thread"``, ``"process"`` or ``"ray"`` (None: the
                loader's runner decides).
            version: bump it when ``fn`` changes under the same name (a lambda needs one).
            on_error: ``"raise"`` (an error naming the file and row) or ``"skip"`` (skipped and counted).
            name: its name in messages and ``explain()`` (None: one derived from ``fn``).

        Returns:
            The pipeline with the operator added; this one is unchanged.
        """
        return self._with(op=Filter(fn, name, self._pick(sources, "filter"), executor, version, on_error))

    def flat_map(self, fn: Callable[[dict], Any], *, sources: Sequence[str] | None = None,
                 executor: str | None = None, version: str | int | None = None, on_error: str = "raise",
                 name: str | None = None) -> "Pipeline":
        """``fn(record) -> iterable of records``: zero or more records per record.

        Args:
            fn: a pure function of the record (module-level for the process and Ray runners).
            sources: the sources it applies to (None: all; before the merge only).
            executor: the stage's executor kind, ``"inline"``, ``"thread"``, ``"process"`` or ``"ray"`` (None: the
                loader's runner decides).
            version: bump it when ``fn`` changes under the same name (a lambda needs one).
            on_error: ``"raise"`` (an error naming the file and row) or ``"skip"`` (skipped and counted).
            name: its name in messages and ``explain()`` (None: one derived from ``fn``).

        Returns:
            The pipeline with the operator added; this one is unchanged.
        """
        return self._with(op=FlatMap(fn, name, self._pick(sources, "flat_map"), executor, version, on_error))

    def map_batch(self, fn: Callable[[dict], dict], *, sources: Sequence[str] | None = None,
                  executor: str | None = None, version: str | int | None = None, name: str | None = None
                  ) -> "Pipeline":
        """``fn(columns) -> columns`` on a chunk of records at once (a dict of equal-length lists).

        Args:
            fn: a pure function of the columns, returning columns of one length (records may be added or
                removed).
            sources: the sources it applies to (None: all; before the merge only).
            executor: the stage's executor kind, ``"inline"``, ``"thread"``, ``"process"`` or ``"ray"`` (None: the
                loader's runner decides).
            version: bump it when ``fn`` changes under the same name (a lambda needs one).
            name: its name in messages and ``explain()`` (None: one derived from ``fn``).

        Returns:
            The pipeline with the operator added; this one is unchanged.
        """
        return self._with(op=MapBatch(fn, name, self._pick(sources, "map_batch"), executor, version))

    def map_field(self, fn: Callable[[Any], Any], field: str = "text", *, sources: Sequence[str] | None = None,
                  executor: str | None = None, version: str | int | None = None, name: str | None = None,
                  on_error: str = "raise"
                  ) -> "Pipeline":
        """``fn(value) -> value`` on one field (None stays None): e.g. a text clean-up.

        Args:
            fn: a pure function of the field's value.
            field: the field it rewrites.
            sources: the sources it applies to (None: all; before the merge only).
            executor: the stage's executor kind, ``"inline"``, ``"thread"``, ``"process"`` or ``"ray"`` (None: the
                loader's runner decides).
            version: bump it when ``fn`` changes under the same name (a lambda needs one).
            name: its name in messages and ``explain()`` (None: one derived from ``fn``).
            on_error: ``"raise"`` (an error naming the operator, the file and the row) or ``"skip"``: a text the
                function fails on becomes None, which ``tokenize`` skips and counts; a record whose other field
                (token ids, an array) it fails on is skipped (counted as ``failed_records`` before the merge).

        Returns:
            The pipeline with the operator added; this one is unchanged.
        """
        return self._with(op=MapField(fn, field, name=name, sources=self._pick(sources, "map_field"),
                                      executor=executor, version=version, on_error=on_error))

    def filter_field(self, fn: Callable[[Any], bool], field: str = "text", *, sources: Sequence[str] | None = None,
                     executor: str | None = None, version: str | int | None = None, name: str | None = None,
                     on_error: str = "raise"
                     ) -> "Pipeline":
        """Keep records whose ``fn(record[field])`` is True (empty values are left to ``tokenize``).

        Args:
            fn: a pure function of the field's value, returning a bool.
            field: the field it reads.
            sources: the sources it applies to (None: all; before the merge only).
            executor: the stage's executor kind, ``"inline"``, ``"thread"``, ``"process"`` or ``"ray"`` (None: the
                loader's runner decides).
            version: bump it when ``fn`` changes under the same name (a lambda needs one).
            name: its name in messages and ``explain()`` (None: one derived from ``fn``).
            on_error: ``"raise"`` (an error naming the operator, the file and the row) or ``"skip"`` (the records
                it fails on are skipped; counted as ``failed_records`` before the merge).

        Returns:
            The pipeline with the operator added; this one is unchanged.
        """
        return self._with(op=FilterField(fn, field, name=name, sources=self._pick(sources, "filter_field"),
                                         executor=executor, version=version, on_error=on_error))

    def apply(self, transform: Transform) -> "Pipeline":
        """Add a stateless operator of your own: a :class:`zephon.Transform` subclass with ``apply(columns)``.

        Args:
            transform: the operator (its ``sources``, ``executor`` and ``name`` are its own).

        Returns:
            The pipeline with the operator added; this one is unchanged.

        Raises:
            PipelineError: not a Transform, or one whose parameters the fingerprint cannot cover.
        """
        if not isinstance(transform, Transform):
            raise PipelineError(f"apply() takes a zephon.Transform, got {transform!r}")
        if transform.sources is not None:
            self._pick(transform.sources, type(transform).__name__)
        return self._with(op=transform)

    def tokenize(self, tokenizer: TokenizerSpec, field: str = "text", *, add_eos: bool | None = None,
                 add_bos: bool | None = None, keep_field: bool = False, sources: Sequence[str] | None = None,
                 executor: str | None = None, name: str | None = None) -> "Pipeline":
        """Tokenize ``field`` into ``input_ids`` (text, or token-id lists of a pre-tokenized source), one
        tokenizer call per chunk; see :mod:`zephon.ops.tokenize`.

        Args:
            tokenizer: ``zephon.tokenizer(path)``.
            field: the record field holding the text (or the token-id lists of a pre-tokenized source).
            add_eos: frame every document with EOS (None: as the tokenizer says).
            add_bos: frame every document with BOS (None: as the tokenizer says).
            keep_field: keep the text field as a payload of the document (dropped by default).
            sources: the sources it applies to (None: all; before the merge only).
            executor: the stage's executor kind, ``"inline"``, ``"thread"``, ``"process"`` or ``"ray"`` (None: the
                loader's runner decides).
            name: its name in messages and ``explain()`` (None: one derived from the operator).

        Returns:
            The pipeline with the operator added; this one is unchanged.
        """
        return self._with(op=Tokenize(tokenizer, field, add_eos, add_bos, keep_field, name,
                                      self._pick(sources, "tokenize"), executor))

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
                ``zephon.ops.tokenize_chat.DEFAULT_DATE``, a constant: never the clock).
            on_error: "raise" (a record with a malformed message, or that the template refuses, is an error
                naming the file, the row and the field) or "skip" (skipped and counted as
                ``invalid_conversations`` in ``metrics()["skipped_by_reason"]``).
            sources: the sources it applies to (None: all; before the merge only).
            executor: the stage's executor kind, ``"inline"``, ``"thread"``, ``"process"`` or ``"ray"`` (None: the
                loader's runner decides).
            name: its name in messages and ``explain()`` (None: ``"tokenize_chat"``).

        Returns:
            The pipeline with the operator added; this one is unchanged.
        """
        return self._with(op=TokenizeChat(tokenizer, template, field, loss_on, add_eos, name,
                                          self._pick(sources, "tokenize_chat"), executor,
                                          add_generation_prompt=add_generation_prompt,
                                          date=DEFAULT_DATE if date is None else date, on_error=on_error))

    def split(self, max_tokens: int, *, sources: Sequence[str] | None = None, executor: str | None = None,
              name: str | None = None) -> "Pipeline":
        """Cut documents longer than ``max_tokens`` into pieces (needed before best/first-fit packing of
        documents longer than a row; inserted at ``seq_len`` when absent).

        A document with images is cut only between images, each piece with the images it holds, and within
        pack's per-row image limits.

        Args:
            max_tokens: the longest piece, in tokens.
            sources: the sources it applies to (None: all; before the merge only).
            executor: the stage's executor kind, ``"inline"``, ``"thread"``, ``"process"`` or ``"ray"`` (None: the
                loader's runner decides).
            name: its name in messages and ``explain()`` (None: one derived from the operator).

        Returns:
            The pipeline with the operator added; this one is unchanged.
        """
        return self._with(op=Split(max_tokens, name, self._pick(sources, "split"), executor))

    def decode_images(self, field: str = "image", *, size: int | Sequence[int] | None = None,
                      max_pixels: int | None = None, min_pixels: int = 56 * 56, patch_size: int = 14, merge: int = 1,
                      patchify: bool = True, resample: str = "bicubic", max_image_pixels: int = 1 << 26,
                      on_bad_image: str = "skip", jpeg_decoder: str = "auto", reduced_decode: bool = True,
                      keep_field: bool = False, sources: Sequence[str] | None = None, executor: str | None = None,
                      name: str | None = None) -> "Pipeline":
        """Decode the images of ``field`` (bytes, ``{bytes, path}`` structs or paths; one or a list per record)
        into ``images`` (patches or pixels) and ``image_grid_thw``.

        Decode, EXIF orientation, RGB, resize to ``size=`` (centre crop) or within ``max_pixels=`` (aspect
        kept, on the patch grid), patchify (``patch_size``, ``merge``). See :mod:`zephon.ops.decode_images` for
        the record layouts and the output contract.

        Args:
            field: the record field holding the images.
            size: resize and centre-crop every image to this size, an int or ``(height, width)``, each side a
                multiple of ``patch_size * merge``. Exactly one of ``size`` and ``max_pixels`` is given.
            max_pixels: resize within this many pixels, keeping the aspect ratio, on the patch grid.
            min_pixels: with ``max_pixels``: enlarge an image below this many pixels.
            patch_size: the side of a patch, in pixels.
            merge: patches per image token along each side (``merge * merge`` patches make one token).
            patchify: return patches (``[n_patches, p*p*3]``) rather than pixels (``[H, W, 3]``).
            resample: the resize filter: ``"bicubic"``, ``"bilinear"``, ``"lanczos"``, ``"box"`` or ``"nearest"``.
            max_image_pixels: an image with more pixels than this is a bad image (decompression bombs).
            on_bad_image: ``"skip"`` (the image becomes None; the text stays), ``"drop_record"`` or ``"raise"``.
            jpeg_decoder: ``"simplejpeg"``, ``"pillow"`` or ``"auto"`` (simplejpeg if installed; fingerprinted).
            reduced_decode: decode a JPEG at 1/2, 1/4 or 1/8 of its size (DCT scaling) when the target is at
                most half of it.
            keep_field: keep ``field`` in the record (dropped by default).
            sources: the sources it applies to (None: all; before the merge only).
            executor: the stage's executor kind, ``"inline"``, ``"thread"``, ``"process"`` or ``"ray"`` (None: the
                loader's runner decides).
            name: its name in messages and ``explain()`` (None: one derived from the operator).

        Returns:
            The pipeline with the operator added; this one is unchanged.

        Raises:
            PipelineError: an option out of range, or neither or both of ``size`` and ``max_pixels``.
        """
        return self._with(op=DecodeImages(
            field, size=size, max_pixels=max_pixels, min_pixels=min_pixels if size is None else 56 * 56,
            patch_size=patch_size, merge=merge, patchify=patchify, resample=resample,
            max_image_pixels=max_image_pixels, on_bad_image=on_bad_image, jpeg_decoder=jpeg_decoder,
            reduced_decode=reduced_decode, keep_field=keep_field, name=name,
            sources=self._pick(sources, "decode_images"), executor=executor))

    def tokenize_images(self, tokenizer: TokenizerSpec, field: str = "text", *, image_pad: int | str,
                        image_start: int | str | None = None, image_end: int | str | None = None,
                        merge: int | None = None, placeholder: str = "<image>", unplaced_images: str = "before",
                        loss_on_images: bool = False, add_eos: bool | None = None, add_bos: bool | None = None,
                        keep_field: bool = False, sources: Sequence[str] | None = None, executor: str | None = None,
                        name: str | None = None) -> "Pipeline":
        """Tokenize ``field`` (a caption with ``<image>`` placeholders, or interleaved ``texts``) with each image
        of ``images`` expanded to ``image_start, image_pad * n, image_end`` tokens and ``loss_mask`` 0 where an
        image token is the label. See :mod:`zephon.ops.tokenize_images`.

        Args:
            tokenizer: ``zephon.tokenizer(path)``.
            field: the record field holding the caption (a string) or the interleaved texts (a list).
            image_pad: the image token, repeated once per token of an image: a token id or its text
                (``"<|image_pad|>"``).
            image_start: the token before each image, an id or its text (None: none).
            image_end: the token after each image, an id or its text (None: none).
            merge: patches per token along each side (None: the ``merge`` of the ``decode_images`` operators
                before it).
            placeholder: the text that stands for the next image in a caption.
            unplaced_images: where images without a placeholder go: ``"before"`` the text or ``"after"`` it.
            loss_on_images: a loss on image tokens too (``loss_mask`` 1 everywhere).
            add_eos: frame every document with EOS (None: as the tokenizer says).
            add_bos: frame every document with BOS (None: as the tokenizer says).
            keep_field: keep the text field as a payload of the document (dropped by default).
            sources: the sources it applies to (None: all; before the merge only).
            executor: the stage's executor kind, ``"inline"``, ``"thread"``, ``"process"`` or ``"ray"`` (None: the
                loader's runner decides).
            name: its name in messages and ``explain()`` (None: one derived from the operator).

        Returns:
            The pipeline with the operator added; this one is unchanged.

        Raises:
            PipelineError: an option out of range, or no ``merge`` and none (or several) from ``decode_images``.
        """
        picked = self._pick(sources, "tokenize_images")
        if merge is None:
            merges = {op.merge for op in self._ops if isinstance(op, DecodeImages)
                      and (picked is None or op.sources is None or set(picked) & set(op.sources))}
            if len(merges) != 1:
                raise PipelineError("tokenize_images(merge=...): " + (
                    "no decode_images() comes before it" if not merges else
                    f"the decode_images() before it merge differently ({sorted(merges)})") + "; pass merge=")
            merge = merges.pop()
        return self._with(op=TokenizeImages(
            tokenizer, field, image_pad=image_pad, image_start=image_start, image_end=image_end, merge=merge,
            placeholder=placeholder, unplaced_images=unplaced_images, loss_on_images=loss_on_images,
            add_eos=add_eos, add_bos=add_bos, keep_field=keep_field, name=name, sources=picked, executor=executor))

    # -- the merge and accumulators ----------------------------------------------------------------------
    def mix(self, by: str = "tokens", weights: Mapping[str, float] | None = None,
            schedule: Schedule | None = None) -> "Pipeline":
        """Where the sources meet: an exact, deterministic mixture (see :mod:`zephon.ops.mix`).

        Args:
            by: what the weights share out: ``"tokens"`` or ``"documents"``.
            weights: source name -> weight, overriding the sources' own (every source named once).
            schedule: weights that change over training steps (a :class:`zephon.Schedule`: phases, or
                waypoints with linear or cosine interpolation).

        Returns:
            The pipeline with the operator added; this one is unchanged.

        Raises:
            PipelineError: ``mix`` declared twice, or ``weights`` that do not name every source.
        """
        if any(isinstance(op, Mix) for op in self._ops):
            raise PipelineError("mix() is declared twice: the sources meet once")
        op = Mix(by, weights, schedule)
        if weights is not None and set(weights) != {s.name for s in self._sources}:
            raise PipelineError(f"mix(weights=...) must name every source once: got {sorted(weights)}, sources are "
                                f"{sorted(s.name for s in self._sources)}")
        return self._with(op=op)

    def shuffle(self, buffer: int) -> "Pipeline":
        """A seeded shuffle within a window of records (per lane, drained at each sentinel).

        Args:
            buffer: the records the window holds (0: no shuffle).

        Returns:
            The pipeline with the operator added; this one is unchanged.
        """
        return self._with(op=Shuffle(buffer))

    def accumulate(self, factory: Callable[..., Any], *, name: str | None = None,
                   version: str | int | None = None) -> "Pipeline":
        """Your own accumulator, serial per lane after the sources meet (see :mod:`zephon.ops.accumulate`).

        Args:
            factory: ``factory(ctx)`` (a :class:`zephon.LaneContext`) or ``factory()`` builds one per lane, with
                ``push(record) -> records`` and ``flush() -> records`` (a :class:`zephon.Accumulator`).
            name: its name in messages and ``explain()`` (None: one derived from ``factory``).
            version: bump it when ``factory`` changes under the same name.

        Returns:
            The pipeline with the operator added; this one is unchanged.
        """
        return self._with(op=Accumulate(factory, name, version))

    def pack(self, seq_len: int, algorithm: str = "best_fit", max_open_bins: int = 16,
             pad_id: int | None = None, *, max_images_per_row: int | None = None,
             max_patches_per_row: int | None = None) -> "Pipeline":
        """Pack documents into rows of ``seq_len`` tokens (``best_fit``, ``first_fit`` or ``wrap``).

        Documents with images (``tokenize_images``): image tokens count like any token, a document is cut
        only between images and each piece carries the images it holds; ``max_images_per_row`` and
        ``max_patches_per_row`` cap one row's images and patches (a document that would exceed them goes
        to another row). Per row, so the same on every world size: a global batch holds at most
        ``lanes * rows_per_lane`` times them. See :mod:`zephon.ops.pack`.

        Args:
            seq_len: tokens per row (at least 2).
            algorithm: ``"best_fit"``, ``"first_fit"`` or ``"wrap"``.
            max_open_bins: open rows kept by best and first fit.
            pad_id: the id written on padding positions (None: the tokenizer's pad id).
            max_images_per_row: the most images one row may hold (None: no limit).
            max_patches_per_row: the most image patches one row may hold (None: no limit).

        Returns:
            The pipeline with the operator added; this one is unchanged.

        Raises:
            PipelineError: ``pack`` declared twice, or an option out of range.
        """
        if any(isinstance(op, Pack) for op in self._ops):
            raise PipelineError("pack() is declared twice")
        return self._with(op=Pack(seq_len, algorithm, max_open_bins, pad_id, max_images_per_row,
                                  max_patches_per_row))

    def batch(self, rows_per_lane: int = 1, partial: str = "drop", *, pixels: str = "flat",
              positions: str = "1d", stack: Sequence[str] = (), provenance: bool = False) -> "Pipeline":
        """Each lane adds ``rows_per_lane`` rows to every global batch (global batch = lanes x this); the
        last operator. See :mod:`zephon.ops.batch`.

        Args:
            rows_per_lane: rows (packed sequences, or records without ``pack()``) each lane gives every step.
            partial: sources that stop (``passes=``) end lanes at different steps: the first global batch some
                lane cannot fill ends the loader (``"drop"``), or lanes that ran out give padding rows until
                every lane has (``"pad"``, so an evaluation covers its whole set).
            pixels: images in packed batches: ``"flat"`` (``pixel_values`` uint8 ``[total_patches, p*p*3]``),
                ``"fixed"`` (``[rows * max_images_per_row, 3, H, W]`` with ``image_mask``) or ``"lists"``.
            positions: ``"1d"``, or ``"mrope"`` for Qwen2-VL's ``[3, B, S]`` rotary positions.
            stack: without ``pack()``, the record fields batched as one tensor each (one shape and dtype).
            provenance: add a ``provenance`` tensor: where each packed segment (or record row) comes from
                (:mod:`zephon.origins`). Not fingerprinted: it changes no other byte.

        Returns:
            The pipeline with the operator added; this one is unchanged.
        """
        return self._with(op=Batch(rows_per_lane, partial, pixels=pixels, positions=positions, stack=tuple(stack),
                                   provenance=provenance))

    # -- what the rest of Zephon reads ------------------------------------------------------------------------
    def _find(self, cls: type | tuple[type, ...]) -> Any:
        return next((op for op in self._ops if isinstance(op, cls)), None)

    @property
    def seq_len(self) -> int:
        """Tokens per row (the ``pack`` operator's)."""
        pack = self._find(Pack)
        if pack is None:
            raise PipelineError("this pipeline has no pack() operator, so no seq_len")
        return pack.seq_len

    @property
    def batch_per_lane(self) -> int:
        """Rows each lane adds to every global batch (the ``batch`` operator's)."""
        op = self._find(Batch)
        if op is None:
            raise PipelineError("this pipeline has no batch(): end it with .batch(rows_per_lane=...)")
        return op.rows_per_lane

    @property
    def global_batch_size(self) -> int:
        """Rows in every global batch: ``lanes * batch_per_lane``."""
        return self.lanes * self.batch_per_lane

    @property
    def tokenizer(self) -> TokenizerSpec | None:
        """The tokenizer of the first tokenizing operator (its vocabulary and pad id size a model)."""
        op = self._find(TOKENIZING_OPS)
        return None if op is None else op.spec

    def compile(self, plan: Any = None) -> Any:
        """This pipeline as its lanes run it: checked, every operator placed, the implied ones added.

        Args:
            plan: a :class:`zephon.WorkPlan` to compile against (None: list the files once and keep the result).

        Returns:
            The :class:`zephon.graph.program.CompiledPipeline`.

        Raises:
            PipelineError: the graph is not valid (naming the operator and the fix).
        """
        from .graph.program import compile_pipeline

        if self._compiled is None or plan is not None:
            compiled = compile_pipeline(self, plan)
            if plan is not None:
                return compiled
            self._compiled = compiled
        return self._compiled

    @property
    def fingerprint(self) -> str:
        """The digest of everything that decides the bytes of the batches (what a checkpoint must match)."""
        return self.compile().fingerprint

    def explain(self) -> str:
        """The operators in order, where each runs, and the fingerprint.

        Returns:
            A text for people (``print(pipe.explain())``).
        """
        from .graph.explain import explain

        return explain(self)

    def validate(self, records: int = 64) -> Any:
        """Push a few records of every source through every operator, in this process.

        Args:
            records: about how many records to read from each source.

        Returns:
            A :class:`zephon.ValidationReport` of what each operator made.

        Raises:
            PipelineError: an operator failed (naming it and the source), or no row came out.
        """
        from .graph.explain import validate

        return validate(self, records)

    def build(self, rank: int | None = None, world_size: int | None = None, num_workers: int = 0,
              runner: str = "thread", **kwargs: Any) -> Any:
        """The loader of data-parallel ``rank`` of ``world_size`` (see :func:`zephon.build_loader`).

        Args:
            rank: this process's data-parallel rank (None: the default process group's when torch.distributed
                is initialised, else 0).
            world_size: the data-parallel world size, a divisor of ``lanes`` (None: the default process group's,
                else 1).
            num_workers: workers for the stateless stages (0: in the calling thread).
            runner: ``"thread"``, ``"pool"``, ``"process"``, ``"ray"`` or ``"ray-lanes"`` (docs/guides/runners.md).
            **kwargs: the other options of :func:`zephon.build_loader`.

        Returns:
            The :class:`zephon.ZephonLoader`.
        """
        from .loader import build_loader

        return build_loader(self, rank=rank, world_size=world_size, num_workers=num_workers, runner=runner, **kwargs)

    def lane_nodes(self, lane: int, num_workers: int = 0) -> Any:
        """Lane ``lane``'s chain of torchdata nodes, to iterate, test or compose on their own.

        Args:
            lane: the lane, in ``[0, lanes)``.
            num_workers: threads for the stateless stages (0: in the calling thread).

        Returns:
            A :class:`~zephon.engine.lane.LaneNodes`: ``sources`` (one ``ChunkSource`` per source), ``stages``
            (their ``StageBuffer`` nodes), ``merge``, ``accumulators`` (the last, ``rows``, makes the lane's rows
            and sentinels), each a ``torchdata.nodes.BaseNode`` with ``state_dict()``/``reset(state)`` mapped to
            flush sentinels. Call its ``close()`` when done (it stops the worker threads).

        Raises:
            PipelineError: the pipeline cannot be built, or ``lane`` is not one of its lanes.
        """
        from .engine.lane import lane_depth, lane_nodes
        from .engine.runners import make_executor

        if isinstance(lane, bool) or not isinstance(lane, int) or not 0 <= lane < self.lanes:
            raise PipelineError(f"lane_nodes(lane={lane!r}): a lane in [0, {self.lanes}) is needed")
        program = self.compile()
        executor = make_executor("thread", program.stages, num_workers)
        nodes = lane_nodes(program, lane, lambda s, k: executor, lane_depth(num_workers))
        nodes.executor = executor
        return nodes

    def to_recipe(self, path: str | os.PathLike[str] | None = None) -> str:
        """This pipeline as a TOML recipe (``[[ops]]`` form); user functions by import path.

        Loading the recipe (:func:`zephon.load_recipe`) gives a pipeline with the same fingerprint. A recipe's
        relative paths resolve against its own folder, so the local paths of the sources and the tokenizer are
        written relative to ``path``'s folder when the recipe is saved there, absolute otherwise; URLs are
        written as they are (a chat template is written as its text).

        Args:
            path: where to save the recipe (its folder must exist). None: the text is only returned.

        Returns:
            The recipe's TOML text (also written to ``path`` when given).

        Raises:
            ValueError: something a recipe cannot hold (an in-memory source, a lambda, your own operator class).
            OSError: ``path`` cannot be written.
        """
        from .recipe.to_toml import pipeline_to_toml

        if path is None:
            return pipeline_to_toml(self)
        text = pipeline_to_toml(self, base_dir=os.path.dirname(os.path.abspath(path)))
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return text

    def __repr__(self) -> str:
        ops = " -> ".join(op.op or type(op).__name__ for op in self._ops)
        return f"Pipeline(seed={self.seed}, lanes={self.lanes}, sources={[s.name for s in self._sources]}, ops={ops})"


def tokenizer(path: str, kind: str | None = None, *, add_eos: bool = True, add_bos: bool = False,
              eos_token: str | None = None, bos_token: str | None = None, pad_id: int | None = None,
              pat_str: str | None = None, special_tokens: Mapping[str, int] | None = None) -> TokenizerSpec:
    """A tokenizer by file.

    Args:
        path: a SentencePiece ``.model``, a Hugging Face ``tokenizer.json`` or a tiktoken BPE ``.tiktoken`` file.
        kind: ``"sentencepiece"``, ``"huggingface"`` or ``"tiktoken"``; guessed from the file's content when None.
        add_eos: end every document with EOS.
        add_bos: start every document with BOS.
        eos_token: the EOS token's text (None: detected from the vocabulary).
        bos_token: the BOS token's text (None: detected from the vocabulary).
        pad_id: the id written on padding positions (default: EOS).
        pat_str: a tiktoken file's split regex; taken from tiktoken's own definitions when the file is one of its
            encodings, needed otherwise.
        special_tokens: a tiktoken file's special tokens (name -> id); as ``pat_str``.

    Returns:
        The :class:`~zephon.specs.TokenizerSpec` (the file is read when a pipeline using it is built).

    Raises:
        RecipeFileError: no file at ``path``.
        PipelineError: ``kind`` is not a kind Zephon reads, the kind cannot be told from the file, or the file
            looks like another kind than ``kind`` (naming the kind it looks like).
    """
    from .tokenization import sniff_tokenizer_kind

    _check_tokenizer_file(path)  # a clear error now, rather than a backend's when the pipeline is built
    if kind is not None and kind not in KIND_FILES:
        close = difflib.get_close_matches(str(kind), list(KIND_FILES), n=1)
        raise PipelineError(f"tokenizer({path!r}, kind={kind!r}): kind must be one of {', '.join(KIND_FILES)}"
                            + (f". Did you mean {close[0]!r}?" if close else " (or None: told from the file)"))
    looks = sniff_tokenizer_kind(Path(path))
    if kind is None:
        kind = looks
        if kind is None:
            raise PipelineError(f"tokenizer({path!r}): the file is none of the kinds Zephon reads (a SentencePiece "
                                f".model, a Hugging Face tokenizer.json, a tiktoken .tiktoken BPE file). Point it at "
                                f"the tokenizer file; if it is one of them, pass kind='sentencepiece', 'huggingface' "
                                f"or 'tiktoken'.")
    elif looks is not None and looks != kind:
        raise PipelineError(f"tokenizer({path!r}, kind={kind!r}): the file looks like {KIND_FILES[looks]}, not "
                            f"{KIND_FILES[kind]}. Pass kind={looks!r} (or leave kind out: it is told from the file), "
                            f"or point it at {KIND_FILES[kind]}.")
    spec = TokenizerSpec(kind, str(path), add_eos, add_bos, eos_token, bos_token, pad_id, pat_str,
                         dict(special_tokens) if special_tokens is not None else None)
    try:
        validate_special_tokens(spec, f"tokenizer({path!r})")
    except RecipeError as exc:
        raise PipelineError(str(exc)) from None
    return spec


def _check_tokenizer_file(path: str | Path) -> None:
    """``tokenizer(path)``'s file must exist and be a file; else a RecipeFileError (also a FileNotFoundError,
    what this raised before) naming the path as given and as resolved, and the fix."""
    p = Path(path)
    where = f"tokenizer({str(path)!r})"
    if p.is_dir():
        inside = sorted(q.name for q in p.iterdir()
                        if q.is_file() and (q.name.endswith((".model", ".tiktoken")) or q.name == "tokenizer.json"))
        hint = f": pass one of the files in it, e.g. {p / inside[0]}" if inside else \
            ": pass a SentencePiece .model, a Hugging Face tokenizer.json or a tiktoken .tiktoken file"
        raise RecipeFileError(f"{where}: {p.resolve()} is a folder, not a tokenizer file{hint}.")
    if not p.is_file():
        demo = p.name in ("tok.model", "tok_vl.model")  # the demo's tokenizers (zephon/demo/)
        fix = (f"run `zephon demo {p.parent}` to build the demo's tokenizers (tok_vl.model needs the vision extra: "
               "python -m pip install -e '.[vision]')" if demo else
               "pass the path of a SentencePiece .model, a Hugging Face tokenizer.json or a tiktoken .tiktoken "
               "file (relative paths resolve against the current folder)")
        raise RecipeFileError(f"{where}: tokenizer file not found: {p.resolve()} does not exist; {fix}.")


__all__ = ["Pipeline", "PipelineError", "SourceDecl", "tokenizer"]

"""From a pipeline to the program its lanes run: the graph checked, every operator placed and bound.

Compiling checks the graph (errors name the operator and the fix), places every operator (per source on
the executors before the merge, serial in the lane after it), adds what a pipeline implies but need not
spell out (``mix`` where the sources meet, ``split`` at ``seq_len`` before best/first-fit packing), collects
the per-token fields every operator adds, binds each operator to what the pipeline decides for it (a copy:
the pipeline's own operators are never changed, another pipeline may share them), lists and plans the
sources, and describes the whole graph for the fingerprint (:mod:`zephon.graph.fingerprint`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import numpy as np

from ..batches.images import ImageBatch
from ..engine.lane import LaneProgram
from ..engine.nodes import TransformStep
from ..engine.stages import Stage, StageProgram
from ..errors import PipelineError, SourceError
from ..ops.accumulate import Accumulate
from ..ops.base import BindContext, LaneContext, Operator, Transform
from ..ops.batch import Batch
from ..ops.decode_images import DecodeImages
from ..ops.fields import token_field
from ..ops.filter import Filter, FilterField
from ..ops.image_layout import NO_LIMITS
from ..ops.map import MapField
from ..ops.mix import Mix
from ..ops.pack import Pack
from ..ops.shuffle import Shuffle
from ..ops.split import Split
from ..ops.tokenize import Tokenize
from ..ops.tokenize_chat import TokenizeChat
from ..ops.tokenize_images import TokenizeImages
from ..origins import coordinate
from ..plan import ReaderFactory, WorkPlan
from ..records import INPUT_IDS
from .fingerprint import fingerprint, summary

TOKENIZING = (Tokenize, TokenizeChat, TokenizeImages)


@dataclass
class CompiledPipeline(LaneProgram):
    """A :class:`LaneProgram` plus what the loader needs around it: collation and the fingerprint."""

    pad_id: int = 0
    pad_values: dict[str, Any] = field(default_factory=dict)  # name -> value in padding positions
    summary: dict[str, Any] = field(default_factory=dict)
    fingerprint: str = ""
    placement: list[tuple[str, str, str]] = field(default_factory=list)  # (operator, where, sources) for explain
    schedule: Any = None  # the mixture schedule, if any
    weights: dict[str, float] = field(default_factory=dict)  # the mixture's own weights, by source name
    images: Any = None  # zephon.batches.images.ImageBatch: how batches carry images (None: no image keys)
    stack: tuple[str, ...] = ()  # a pipeline without pack(): the record fields batched as tensors
    provenance: bool = False  # batches carry a provenance tensor (zephon.origins)


def token_schema(ops: list[Operator]) -> dict[str, tuple[Any, Any]]:
    """The per-token fields of the pipeline's documents, ``input_ids`` first: name -> (dtype, default)."""
    schema: dict[str, tuple[Any, Any]] = {INPUT_IDS: (np.dtype(np.int32), 0)}
    for op in ops:
        for name, default in getattr(op, "token_fields", {}).items():
            if name not in schema:
                schema[name] = token_field(default)
    return schema


def _tokenized(ops: list[Operator]) -> bool:
    return any(isinstance(op, TOKENIZING) for op in ops)


@dataclass
class _Graph:
    """The declared operators cut where the sources meet."""

    names: list[str]
    per_source: list[list[Transform]]  # each source's stateless operators before the merge
    mix: Mix | None  # the declared one (None: implied)
    after: list[Operator]  # the operators after the merge, up to the packer (or the batch)
    placement: list[tuple[str, str, str]]


def _graph(pipe: Any, end: int) -> _Graph:
    ops = pipe.ops
    names = [s.name for s in pipe.sources]
    m = next((i for i, op in enumerate(ops[:end]) if isinstance(op, Mix) or op.stateful), end)
    before, after = list(ops[:m]), list(ops[m:end])
    mix = after.pop(0) if after and isinstance(after[0], Mix) else None
    if any(isinstance(op, Mix) for op in after):
        raise PipelineError("mix() must come before every accumulator (shuffle, accumulate): the sources meet first")
    for op in before:
        if not isinstance(op, Transform):
            raise PipelineError(f"operator '{op.name}' is neither a transform nor an accumulator")
    per_source = [[op for op in before if op.applies_to(n)] for n in names]
    placement = [(op.name, "workers, per source", ",".join(n for n in names if op.applies_to(n))) for op in before]
    return _Graph(names, per_source, mix, after, placement)  # type: ignore[arg-type]


def compile_pipeline(pipe: Any, plan: WorkPlan | None = None) -> CompiledPipeline:
    """The program of ``pipe``'s lanes (see the module docstring).

    Raises:
        PipelineError: the graph cannot run as declared, naming the operator and the fix.
    """
    ops = pipe.ops
    if not pipe.sources:
        raise PipelineError("the pipeline has no source: add one with .source(name, zephon.read.<format>(...))")
    if not ops or not isinstance(ops[-1], Batch):
        raise PipelineError("a pipeline ends with .batch(rows_per_lane=...)")
    batch: Batch = ops[-1]
    pack_at = next((i for i, op in enumerate(ops) if isinstance(op, Pack)), -1)
    if pack_at >= 0 and pack_at != len(ops) - 2:
        raise PipelineError("pack(seq_len=...) must come right before batch(): the rows a lane delivers are packed")
    if pack_at < 0:  # no pack(): a row is one record (zephon.ops.batch.RecordRows)
        return _compile_records(pipe, plan, batch)
    if batch.stack:
        raise PipelineError(f"batch(stack={list(batch.stack)}) is for pipelines without pack(): packed rows are "
                            f"already tensors")
    pack: Pack = ops[pack_at]  # type: ignore[assignment]
    g = _graph(pipe, pack_at)
    check_tokens(pipe, g, pack)
    transforms = [op for op in ops if isinstance(op, Transform)]
    splits = [op for op in transforms if isinstance(op, Split)]
    for sp in splits:
        if sp.max_tokens > pack.seq_len and pack.algorithm != "wrap":
            raise PipelineError(f"split(max_tokens={sp.max_tokens}) exceeds pack(seq_len={pack.seq_len}): a piece longer "
                                f"than a row cannot be packed with {pack.algorithm}. Lower it to at most {pack.seq_len}.")
    if not splits and pack.algorithm != "wrap":  # split at seq_len, implied
        implied = Split(pack.seq_len, name="split (implied by pack)")
        if all(_tokenized(ops) for ops in g.per_source):
            g.per_source = [ops + [implied] for ops in g.per_source]
            g.placement.append((implied.name, "workers, per source", ",".join(g.names)))
        else:
            g.after.append(implied)
    schema = token_schema(transforms)
    images = image_batch(transforms, pack, batch)
    ctx = BindContext(tuple(g.names), tuple(s.weight for s in pipe.sources), schema, pack.limits, batch.provenance)
    mix = _mix(pipe, g, ctx, True)
    lane_ops = _lane_ops(g, ctx, schema) + [("pack", pack.bind(ctx).make)]
    g.placement += [("pack", "lane: accumulator", "-"), ("batch", f"lane: {batch.rows_per_lane} row(s) per step", "-")]
    plan = plan or WorkPlan(pipe)
    check_fields(pipe, plan, g)
    pad_id = pack.pad_id if pack.pad_id is not None else _tokenizer_pad(transforms)
    return _compiled(pipe, plan, g, ctx, mix, lane_ops, batch, [pack, batch], seq_len=pack.seq_len, pad_id=pad_id,
                     token_fields=schema, pad_values={name: (pad_id if name == INPUT_IDS else 0) for name in schema},
                     images=images)


def _compile_records(pipe: Any, plan: WorkPlan | None, batch: Batch) -> CompiledPipeline:
    """A pipeline without ``pack()``: every record after the lane's accumulators is one row."""
    if batch.pixels != "flat" or batch.positions != "1d":
        raise PipelineError("batch(pixels=..., positions=...) place images and positions in packed rows; without "
                            "pack() each record's fields are batched as they are (stack=[...] for tensors)")
    if batch.stack and batch.partial == "pad":
        raise PipelineError(f"batch(stack={list(batch.stack)}, partial='pad'): a rank whose rows are all padding "
                            f"could not give the stacked tensors their shape; use partial='drop', or no stack")
    g = _graph(pipe, len(pipe.ops) - 1)
    check_tokens(pipe, g, None)
    transforms = [op for op in pipe.ops if isinstance(op, Transform)]
    schema = token_schema(transforms)
    ctx = BindContext(tuple(g.names), tuple(s.weight for s in pipe.sources), schema, NO_LIMITS, batch.provenance)
    mix = _mix(pipe, g, ctx, False)
    lane_ops = _lane_ops(g, ctx, None) + [("rows", batch.make_rows)]
    g.placement += [("rows", "lane: one record per row", "-"),
                    ("batch", f"lane: {batch.rows_per_lane} record(s) per step", "-")]
    plan = plan or WorkPlan(pipe)
    check_fields(pipe, plan, g)
    return _compiled(pipe, plan, g, ctx, mix, lane_ops, batch, [batch], seq_len=1, token_fields=schema,
                     records=True, stack=batch.stack)


# -- what the operators need of the records, checked when the pipeline is built ------------------------------
# Built-in operators that add no field: what comes after them sees the fields that came before them. Every
# other operator (map, flat_map, map_batch, decode_images, accumulate, yours) may add or remove any field, so
# the checks below stop at the first of them (they refuse only what cannot work whatever your code does).
_KEEPS_FIELDS = (Filter, FilterField, MapField, Split, Shuffle, Mix)
_READS_FIELD = (Tokenize, TokenizeChat, TokenizeImages, DecodeImages, MapField, FilterField)


def _close(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return f" Did you mean '{close[0]}'?" if close else ""


def check_tokens(pipe: Any, g: _Graph, pack: Pack | None) -> None:
    """Refuse a source whose records reach an operator that needs token ids (``split``, ``pack``) when nothing
    before it makes them: no tokenizing operator applies to the source, the source does not read an
    ``input_ids`` column (a pre-tokenized source: ``tokens_field="input_ids"``), and every operator before it
    is a built-in that adds no field (see :data:`_KEEPS_FIELDS`). Without this the lane fails at its first
    document with ``KeyError: 'input_ids'``."""
    for s, decl in enumerate(pipe.sources):
        if INPUT_IDS in decl.read.fields or "*" in decl.read.fields:
            continue
        chain = [*g.per_source[s], *([g.mix] if g.mix else []), *g.after, *([pack] if pack is not None else [])]
        for op in chain:
            if isinstance(op, TOKENIZING) or type(op) not in (*_KEEPS_FIELDS, Pack):
                break  # ids made here, or maybe (an operator of unknown output): nothing to refuse
            if isinstance(op, (Split, Pack)):
                others = [f"{t.op}(sources={list(t.sources)})" for t in pipe.ops
                          if isinstance(t, TOKENIZING) and t.sources is not None and decl.name not in t.sources]
                left_out = f" ({', '.join(others)} leaves it out)" if others else ""
                what = "packs token ids" if isinstance(op, Pack) else "cuts documents by their token ids"
                raise PipelineError(
                    f"operator '{op.name}' {what} (input_ids), but the records of source '{decl.name}' reach it "
                    f"untokenized{left_out}. Add .tokenize(zephon.tokenizer(path)) before .{op.op}() (or "
                    f".tokenize_chat(...) for conversations), or, if the source holds token ids already, read them "
                    f"as input_ids (tokens_field='input_ids').")


def check_fields(pipe: Any, plan: WorkPlan, g: _Graph) -> None:
    """Refuse, when the pipeline is built, a field that a source reads but its files lack, or that an operator
    before the merge reads but its source does not give; the error names the source, the file, the field, the
    fields there are and the closest one. A file's columns are known up front only for formats with a schema
    (:meth:`~zephon.plan.SourcePlan.file_columns`: not JSON Lines, whose first record is no schema); what a
    source gives is what it reads (its ``columns``, else its text or token-id field), followed through the
    built-in operators that add no field."""
    for s, (decl, sp) in enumerate(zip(pipe.sources, plan.sources)):
        read = decl.read
        if read.format == "webdataset" or "*" in read.fields:
            continue  # fields named by the shards' member extensions: the reader checks them
        found = sp.file_columns()
        if found is not None:
            path, columns = found
            for name in read.fields:
                if name not in columns:
                    fix = "Fix the source's columns." if read.columns is not None else \
                        "Set tokens_field of this source to the column that holds the token ids." if read.tokens_field \
                        else "Set text_field of this source to the column that holds the text."
                    raise SourceError(f"source '{decl.name}': {path} has no column '{name}' (columns: "
                                      f"{', '.join(columns)}).{_close(name, columns)} {fix}")
        fields: set[str] | None = set(read.fields)
        tokenized_by: Operator | None = None
        for op in g.per_source[s]:
            if fields is None:
                break
            if isinstance(op, TOKENIZING):
                if tokenized_by is not None:
                    raise PipelineError(f"operator '{op.name}' tokenizes the records of source '{decl.name}', which "
                                        f"operator '{tokenized_by.name}' tokenized already: tokenize each source "
                                        f"once (pick the sources of each with sources=[...]).")
                tokenized_by = op
            need = getattr(op, "field", None) if isinstance(op, _READS_FIELD) else None
            if need is not None and need not in fields:
                gives = sorted(fields)
                there = f"; {found[0]} has columns {', '.join(found[1])}" if found is not None else ""
                fix = f" Read that column too: add '{need}' to the source's columns=[...]." \
                    if found is not None and need in found[1] else \
                    f" Set {op.op}(field=...) to a field the records have, or read the field from the source " \
                    f"(its columns=[...])."
                ids = decl.read.tokens_field
                if ids is not None and isinstance(op, Tokenize):  # a pre-tokenized source: frame its ids
                    fix = (f" Source '{decl.name}' holds token ids (tokens_field={ids!r}): frame them with "
                           f".tokenize(tok, field={ids!r}).")
                raise PipelineError(f"operator '{op.name}' reads field '{need}', which the records of source "
                                    f"'{decl.name}' do not have (they have {', '.join(gives) or 'no field'}{there})."
                                    f"{_close(need, gives + (found[1] if found else []))}{fix}")
            if isinstance(op, Tokenize):
                kept = fields if op.keep_field else fields - {op.field}
                if INPUT_IDS in kept:  # the record's own field would stand beside (and replace) the token ids
                    raise PipelineError(
                        f"operator '{op.name}' makes the token ids '{INPUT_IDS}' of source '{decl.name}', whose "
                        f"records also keep a field '{INPUT_IDS}' ({'keep_field=True' if op.keep_field and op.field == INPUT_IDS else 'read from its files'}). "
                        f"One name cannot hold both: do not read that column (drop it from the source's "
                        f"columns=[...]), or, for token ids read with tokens_field, tokenize with keep_field=False.")
                fields = kept | {INPUT_IDS}
            elif type(op) not in _KEEPS_FIELDS:
                fields = None


def _mix(pipe: Any, g: _Graph, ctx: BindContext, packs: bool) -> Mix:
    """The merge, bound: the declared ``mix``, or the implied one (the sources' own weights; in a pipeline that
    packs, by tokens where every source has token ids before the merge, else by documents; without ``pack()``,
    by tokens where every source is tokenized before it)."""
    with_ids = all(_tokenized(ops) or INPUT_IDS in decl.read.fields for ops, decl in zip(g.per_source, pipe.sources))
    implied = with_ids if packs else all(_tokenized(ops) for ops in g.per_source)
    mix = g.mix or Mix("tokens" if implied else "documents")
    if mix.by == "tokens" and not with_ids:  # one source too: the merge counts each document's tokens
        raise PipelineError("mix(by='tokens') needs token ids before the sources meet: tokenize every source before "
                            "the merge (.tokenize() before .mix()), or mix(by='documents')")
    g.placement.append(("mix" if g.mix else "mix (implied)", "lane: the merge", ",".join(g.names)))
    return mix.bind(ctx)  # type: ignore[return-value]


def _lane_ops(g: _Graph, ctx: BindContext, rows: dict | None) -> list[tuple[str, Callable[[LaneContext], Any]]]:
    """The operators after the merge as (name, factory of the lane's accumulator); their placement recorded.
    ``rows``: the per-token fields of a pipeline that packs, which your operators' output must fit."""
    out: list[tuple[str, Callable[[LaneContext], Any]]] = []
    for op in g.after:
        bound = op.bind(ctx)
        if isinstance(op, Transform):
            out.append((op.name, partial(_transform_step, bound, rows)))
        elif isinstance(bound, Accumulate) and rows is not None:
            out.append((op.name, partial(bound.make_checked, rows)))
        elif callable(getattr(bound, "make", None)):
            out.append((op.name, bound.make))
        else:
            raise PipelineError(f"operator '{op.name}' ({op.op or type(op).__name__}) cannot come after the merge")
        g.placement.append((op.name, "lane: accumulator" if op.stateful else "lane: per record", "-"))
    return out


def _transform_step(transform: Transform, rows: dict | None, ctx: LaneContext) -> TransformStep:
    return TransformStep(transform, rows)


def _compiled(pipe: Any, plan: WorkPlan, g: _Graph, ctx: BindContext, mix: Mix, lane_ops: list, batch: Batch,
              tail: list[Operator], **fields: Any) -> CompiledPipeline:
    """The compiled pipeline: what every :class:`LaneProgram` holds whatever its rows (the sources' stages, their
    operators bound, the merge, the lane's operators, the cadence and the end of finite data), the mixture, the
    row-specific ``fields``, and the fingerprint of the graph (``tail``: its operators after ``g.after``)."""
    stages = [_stages([op.bind(ctx) for op in ops]) for ops in g.per_source]
    readers = [ReaderFactory(sp.spec, sp.storage) for sp in plan.sources]  # picklable: workers build their own
    coords = [partial(coordinate, sp.spec.format) for sp in plan.sources]
    roots = [sp.root for sp in plan.sources] if batch.provenance else None
    compiled = CompiledPipeline(
        seed=pipe.seed, lanes=pipe.lanes, names=g.names, plan=plan,
        stages=StageProgram(g.names, readers, stages, coords, roots, None if fields.get("records") else fields["token_fields"]),
        provenance=batch.provenance,
        stage_kinds=[[st.executor for st in sts] for sts in stages], merge=mix.make, lane_ops=lane_ops,
        rows_per_lane=batch.rows_per_lane, flush_every=pipe.flush_every, flush_by=pipe.flush_by,
        max_empty_units=[2 * len(sp.units) + pipe.lanes for sp in plan.sources],
        finite=any(d.passes is not None for d in pipe.sources), partial=batch.partial, placement=g.placement,
        schedule=mix.schedule, weights=dict(zip(g.names, mix._weights)), **fields)
    compiled.summary = summary(pipe, plan, g.per_source, [mix, *g.after, *tail])
    compiled.fingerprint = fingerprint(compiled.summary)
    return compiled


def _stages(ops: list[Transform]) -> list[Stage]:
    """Consecutive transforms with the same executor kind form one stage (read included in the first)."""
    out: list[Stage] = []
    for op in ops:
        if out and out[-1].executor == op.executor:
            out[-1] = Stage(op.executor, out[-1].transforms + (op,))
        else:
            out.append(Stage(op.executor, (op,)))
    return out or [Stage(None, ())]


def image_batch(ops: list[Transform], pack: Pack, batch: Batch) -> ImageBatch | None:
    """How batches carry images (:mod:`zephon.batches.images`), checked against the image operators: None for
    a pipeline without images (and 1-D positions), whose batches have no image keys."""
    decoders = [op for op in ops if isinstance(op, DecodeImages)]
    if not decoders:
        if batch.pixels == "fixed" or pack.max_images_per_row or pack.max_patches_per_row:
            raise PipelineError("batch(pixels='fixed') and pack(max_images_per_row=, max_patches_per_row=) are for "
                                "pipelines with images: add .decode_images(...) and .tokenize_images(...)")
        return ImageBatch("lists", "mrope") if batch.positions == "mrope" else None
    for op in decoders:  # an image that can never fit a row is a configuration error: say so now
        most = (op.size[0] // op.patch_size) * (op.size[1] // op.patch_size) if op.size else \
            op.max_pixels // op.patch_size ** 2
        if pack.max_patches_per_row is not None and most > pack.max_patches_per_row:
            raise PipelineError(f"pack(max_patches_per_row={pack.max_patches_per_row}): operator '{op.name}' makes "
                                f"images of up to {most} patches, which no row could hold; raise it, or lower "
                                f"decode_images(max_pixels=...)")
        if most // op.merge ** 2 > pack.seq_len:
            raise PipelineError(f"pack(seq_len={pack.seq_len}): operator '{op.name}' makes images of up to "
                                f"{most // op.merge ** 2} tokens, more than a row; raise seq_len or lower max_pixels")
    if batch.pixels != "lists" and not any(isinstance(op, TokenizeImages) for op in ops):
        raise PipelineError(f"batch(pixels={batch.pixels!r}) places each image at its tokens: tokenize with "
                            f".tokenize_images(...) after .decode_images(...), or keep the images as payloads "
                            f"with batch(pixels='lists')")
    if batch.pixels == "flat":
        dims = {3 * op.patch_size ** 2 for op in decoders}
        if not all(op.patchify for op in decoders) or len(dims) != 1:
            raise PipelineError("batch(pixels='flat') needs every decode_images() to patchify with one patch_size "
                                "(one [patches, p*p*3] tensor); use pixels='fixed' or 'lists' otherwise")
        return ImageBatch("flat", batch.positions, patch_dim=dims.pop())
    if batch.pixels == "fixed":
        sizes = {op.size for op in decoders}
        if None in sizes or len(sizes) != 1:
            raise PipelineError("batch(pixels='fixed') needs every decode_images() to make one size (size=(H, W), "
                                "not max_pixels=); use pixels='flat' for native-resolution images")
        if pack.max_images_per_row is None:
            raise PipelineError("batch(pixels='fixed') needs pack(max_images_per_row=M): each row gets M image "
                                "slots, so the pixel tensor's shape is the same at every step")
        return ImageBatch("fixed", batch.positions, size=tuple(sizes.pop()), slots=pack.max_images_per_row)
    return ImageBatch("lists", batch.positions)


def _tokenizer_pad(ops: list[Operator]) -> int:
    tok = next((op for op in ops if isinstance(op, TOKENIZING)), None)
    return 0 if tok is None else tok.loaded.pad_id

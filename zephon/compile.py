"""From a :class:`~zephon.pipeline.Pipeline` to what lanes run: stages, the merge, accumulators, the
fingerprint; plus ``explain()`` and ``validate()``.

Compiling checks the graph (errors name the operator and the fix), places every operator (per source
on the executors before the merge, serial in the lane after it), inserts what a pipeline implies but
need not spell out (``mix`` where several sources meet, ``split`` at ``seq_len`` before best/first-fit
packing), collects the per-token fields every operator adds, lists and plans the sources, and computes
the fingerprint over all of it: sources and their files, every operator in order with its parameters,
user functions by qualified name and version.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import numpy as np

from .engine.lane import LaneProgram
from .engine.nodes import TransformStep
from .engine.stages import Stage, StageProgram
from .ops.base import LaneContext, Operator, Transform
from .ops.mix import Mix
from .ops.pack import Pack
from .ops.shuffle import Shuffle
from .ops.split import Split
from .plan import ReaderFactory, WorkPlan
from .records import INPUT_IDS
from .pipeline import AccumulateStep, BatchStep, MixStep, PackStep, Pipeline, ShuffleStep
from .errors import PipelineError

PIPELINE_SCHEMA = 1  # bumped when the meaning of a fingerprinted field changes


@dataclass
class CompiledPipeline(LaneProgram):
    """A :class:`LaneProgram` plus what the loader needs around it: collation and the fingerprint."""

    pad_id: int = 0
    pad_values: dict[str, Any] = field(default_factory=dict)  # name -> value in padding positions
    summary: dict[str, Any] = field(default_factory=dict)
    fingerprint: str = ""
    placement: list[tuple[str, str, str]] = field(default_factory=list)  # (operator, where, sources) for explain
    schedule: Any = None  # the mixture schedule, if any
    images: Any = None  # zephon.collate_images.ImageBatch: how batches carry images (None: no image keys)
    stack: tuple[str, ...] = ()  # a pipeline without pack(): the record fields batched as tensors


def _dtype_of(default: Any) -> Any:
    if isinstance(default, tuple):
        return np.dtype(default[0]), default[1]
    if isinstance(default, (bool, np.bool_)):
        return np.dtype(np.uint8), int(default)
    if isinstance(default, float):
        return np.dtype(np.float32), default
    return np.dtype(np.int32), default


def _token_schema(ops: list[Operator]) -> dict[str, tuple[Any, Any]]:
    schema: dict[str, tuple[Any, Any]] = {INPUT_IDS: (np.dtype(np.int32), 0)}
    for op in ops:
        for name, default in getattr(op, "token_fields", {}).items():
            if name not in schema:
                schema[name] = _dtype_of(default)
    return schema


def _merge_index(steps: tuple[Operator, ...]) -> int:
    """Where the sources meet: an explicit mix, else the first stateful step."""
    for i, s in enumerate(steps):
        if isinstance(s, MixStep) or s.stateful:
            return i
    return len(steps)


def _tokenized(ops: list[Transform]) -> bool:
    return any(op.kind in ("tokenize", "tokenize_chat", "tokenize_images") for op in ops)


def compile_pipeline(pipe: Pipeline, plan: WorkPlan | None = None) -> CompiledPipeline:
    steps = pipe.steps
    if not pipe.sources:
        raise PipelineError("the pipeline has no source: add one with .source(name, zephon.read.<format>(...))")
    if not steps or not isinstance(steps[-1], BatchStep):
        raise PipelineError("a pipeline ends with .batch(rows_per_lane=...)")
    pack_at = next((i for i, s in enumerate(steps) if isinstance(s, PackStep)), -1)
    if pack_at >= 0 and pack_at != len(steps) - 2:
        raise PipelineError("pack(seq_len=...) must come right before batch(): the rows a lane delivers are packed")
    batch: BatchStep = steps[-1]  # type: ignore[assignment]
    if pack_at < 0:  # no pack(): a row is one record (zephon.ops.record_rows)
        return _compile_records(pipe, plan, batch)
    if batch.stack:
        raise PipelineError(f"batch(stack={list(batch.stack)}) is for pipelines without pack(): packed rows are "
                            f"already tensors")
    pack: PackStep = steps[pack_at]  # type: ignore[assignment]
    names, after, mix_step, per_source, placement = _graph(pipe, pack_at)

    # split: explicit, or implied at seq_len before best/first-fit packing
    all_ops = [t for t in steps if isinstance(t, Transform)]
    splits = [t for t in all_ops if isinstance(t, Split)]
    for sp in splits:
        if sp.max_tokens > pack.seq_len and pack.algorithm != "wrap":
            raise PipelineError(f"split(max_tokens={sp.max_tokens}) exceeds pack(seq_len={pack.seq_len}): a piece longer "
                                f"than a row cannot be packed with {pack.algorithm}. Lower it to at most {pack.seq_len}.")
    implicit: list[Split] = []
    if not splits and pack.algorithm != "wrap":
        if all(_tokenized(ops) for ops in per_source):
            sp = Split(pack.seq_len, name="split (implied by pack)")
            implicit.append(sp)
            per_source = [ops + [sp] for ops in per_source]
            placement.append((sp.name, "workers, per source", ",".join(names)))
        else:
            sp = Split(pack.seq_len, name="split (implied by pack)")
            implicit.append(sp)
            after.append(sp)
    schema = _token_schema(all_ops)
    for sp in splits + implicit:
        sp.token_names = tuple(schema)
        sp.limits = pack.limits  # pieces that fit a row's image limits, cut between images
    images = image_batch(all_ops, pack, batch)

    # the merge
    by, weights, schedule, merge_factory = _merge(pipe, names, per_source, mix_step, "tokens")
    placement.append(("mix" if mix_step else "mix (implied)", "lane: the merge", ",".join(names)))

    # after the merge: serial, per lane
    lane_steps = _lane_steps(after, placement)
    lane_steps.append(("pack", partial(_make_pack, pack.seq_len, pack.algorithm, pack.max_open_bins, schema,
                                       pack.limits)))
    placement.append(("pack", "lane: accumulator", "-"))
    placement.append(("batch", f"lane: {batch.rows_per_lane} row(s) per step", "-"))

    # sources and stages
    plan = plan or WorkPlan.from_pipeline(pipe)
    pad_id = pack.pad_id if pack.pad_id is not None else _tokenizer_pad(all_ops)
    pad_values = {name: (pad_id if name == INPUT_IDS else 0) for name in schema}

    compiled = CompiledPipeline(
        **_lane_fields(pipe, plan, names, per_source, merge_factory, lane_steps, batch), seq_len=pack.seq_len,
        pad_id=pad_id, token_fields=schema, pad_values=pad_values, placement=placement, schedule=schedule,
        images=images)
    compiled.summary = summary(pipe, plan, per_source, mix_step, weights, by, after, pack, batch)
    compiled.fingerprint = fingerprint(compiled.summary)
    return compiled


def _graph(pipe: Pipeline, end: int) -> tuple[list[str], list[Operator], MixStep | None, list[list[Transform]], list]:
    """The steps before ``end`` cut where the sources meet: (source names, the steps after the merge, the
    explicit mix step, each source's stateless transforms, their placement)."""
    steps = pipe.steps
    names = [s.name for s in pipe.sources]
    m = _merge_index(steps)
    before, after = list(steps[:m]), list(steps[m:end])
    mix_step = after.pop(0) if after and isinstance(after[0], MixStep) else None
    if any(isinstance(s, MixStep) for s in after):
        raise PipelineError("mix() must come before every accumulator (shuffle, accumulate): the sources meet first")
    per_source: list[list[Transform]] = [[t for t in before if t.applies_to(n)] for n in names]  # type: ignore[misc]
    placement = [(t.name, "workers, per source", ",".join(n for n in names if t.applies_to(n))) for t in before]
    return names, after, mix_step, per_source, placement


def _lane_fields(pipe: Pipeline, plan: WorkPlan, names: list[str], per_source: list[list[Transform]],
                 merge_factory: Callable, lane_steps: list, batch: BatchStep) -> dict[str, Any]:
    """What every :class:`LaneProgram` holds whatever its rows: the sources' stages, the merge, the lane
    steps, the cadence and the end of finite data."""
    stages = [_stages(ops) for ops in per_source]
    readers = [ReaderFactory(sp.spec, sp.storage) for sp in plan.sources]  # picklable: workers build their own
    coords = [partial(_coord, sp.spec.format) for sp in plan.sources]
    return dict(seed=pipe.seed, lanes=pipe.lanes, names=names, plan=plan,
                stages=StageProgram(names, readers, stages, coords),
                stage_kinds=[[st.executor for st in sts] for sts in stages], merge=merge_factory, steps=lane_steps,
                rows_per_lane=batch.rows_per_lane, flush_every=pipe.flush_every, flush_by=pipe.flush_by,
                max_empty_units=[2 * len(sp.units) + pipe.lanes for sp in plan.sources],
                finite=any(d.passes is not None for d in pipe.sources), partial=batch.partial)


def _merge(pipe: Pipeline, names: list[str], per_source: list[list[Transform]], mix_step: MixStep | None,
           default_by: str) -> tuple[str, list[float], Any, Callable[[LaneContext], Any]]:
    """Where the sources meet: (by, weights, schedule, the mixer's factory), checked."""
    by = mix_step.by if mix_step else default_by
    if by == "tokens" and not all(_tokenized(ops) for ops in per_source) and len(names) > 1:
        raise PipelineError("mix(by='tokens') needs documents: tokenize every source before the sources meet "
                            "(.tokenize() before .mix()), or mix(by='documents')")
    weights = [mix_step.weights[n] for n in names] if mix_step and mix_step.weights else \
        [s.weight for s in pipe.sources]
    schedule = mix_step.schedule if mix_step else None
    if schedule is not None:
        try:
            schedule.check_sources(names)
        except ValueError as exc:
            raise PipelineError(f"mix(schedule=...): {exc}") from None
    return by, weights, schedule, partial(_make_mix, tuple(weights), by, tuple(names), schedule)


def _lane_steps(after: list[Operator], placement: list) -> list[tuple[str, Callable[[LaneContext], Any]]]:
    """The operators after the merge, as lane steps (name, factory); their placement recorded."""
    lane_steps: list[tuple[str, Callable[[LaneContext], Any]]] = []
    for s in after:
        if isinstance(s, Transform):
            lane_steps.append((s.name, partial(_make_transform_step, s)))
        elif isinstance(s, ShuffleStep):
            lane_steps.append(("shuffle", partial(_make_shuffle, s.buffer)))
        elif isinstance(s, AccumulateStep):
            lane_steps.append((s.name, s.factory))
        else:
            raise PipelineError(f"{s.kind}() cannot come after the merge here")
        placement.append((s.name, "lane: accumulator" if s.stateful else "lane: per record", "-"))
    return lane_steps


def _compile_records(pipe: Pipeline, plan: WorkPlan | None, batch: BatchStep) -> CompiledPipeline:
    """A pipeline without ``pack()``: every record after the lane's accumulators is one row."""
    steps = pipe.steps
    if batch.pixels != "flat" or batch.positions != "1d":
        raise PipelineError("batch(pixels=..., positions=...) place images and positions in packed rows; without "
                            "pack() each record's fields are batched as they are (stack=[...] for tensors)")
    if batch.stack and batch.partial == "pad":
        raise PipelineError(f"batch(stack={list(batch.stack)}, partial='pad'): a rank whose rows are all padding "
                            f"could not give the stacked tensors their shape; use partial='drop', or no stack")
    names, after, mix_step, per_source, placement = _graph(pipe, len(steps) - 1)
    all_ops = [t for t in steps if isinstance(t, Transform)]
    schema = _token_schema(all_ops)
    for sp in all_ops:
        if isinstance(sp, Split):
            sp.token_names = tuple(schema)
    default_by = "tokens" if all(_tokenized(ops) for ops in per_source) else "documents"
    by, weights, schedule, merge_factory = _merge(pipe, names, per_source, mix_step, default_by)
    placement.append(("mix" if mix_step else "mix (implied)", "lane: the merge", ",".join(names)))
    lane_steps = _lane_steps(after, placement)
    lane_steps.append(("rows", _make_record_rows))
    placement.append(("rows", "lane: one record per row", "-"))
    placement.append(("batch", f"lane: {batch.rows_per_lane} record(s) per step", "-"))
    plan = plan or WorkPlan.from_pipeline(pipe)
    compiled = CompiledPipeline(
        **_lane_fields(pipe, plan, names, per_source, merge_factory, lane_steps, batch), seq_len=1,
        token_fields=schema, records=True, stack=batch.stack, placement=placement, schedule=schedule)
    compiled.summary = summary(pipe, plan, per_source, mix_step, weights, by, after, None, batch)
    compiled.fingerprint = fingerprint(compiled.summary)
    return compiled


def _make_record_rows(ctx: LaneContext) -> Any:
    from .ops.record_rows import RecordRows

    return RecordRows()


def _stages(ops: list[Transform]) -> list[Stage]:
    """Consecutive transforms with the same executor kind form one stage (read included in the first)."""
    out: list[Stage] = []
    for op in ops:
        if out and out[-1].executor == op.executor:
            out[-1] = Stage(op.executor, out[-1].transforms + (op,))
        else:
            out.append(Stage(op.executor, (op,)))
    return out or [Stage(None, ())]


def _make_mix(weights: tuple, by: str, names: tuple, schedule: Any, ctx: LaneContext) -> Mix:
    return Mix(weights, by, names, schedule, ctx.clock)


def _make_shuffle(buffer: int, ctx: LaneContext) -> Shuffle:
    return Shuffle(ctx, buffer)


def _make_pack(seq_len: int, algorithm: str, max_open_bins: int, schema: dict, limits: Any, ctx: LaneContext) -> Pack:
    return Pack(ctx, seq_len, algorithm, max_open_bins, schema, limits)


def image_batch(ops: list[Transform], pack: PackStep, batch: BatchStep) -> Any:
    """How batches carry images (:mod:`zephon.collate_images`), checked against the image operators: None for
    a pipeline without images (and 1-D positions), whose batches have no image keys."""
    from .collate_images import ImageBatch
    from .ops.image import DecodeImages

    decoders = [op for op in ops if isinstance(op, DecodeImages)]
    if not decoders:
        if batch.pixels == "fixed" or pack.max_images_per_row or pack.max_patches_per_row:
            raise PipelineError("batch(pixels='fixed') and pack(max_images_per_row=, max_patches_per_row=) are for "
                                "pipelines with images: add .decode_images(...) and .tokenize_images(...)")
        return ImageBatch("lists", "mrope") if batch.positions == "mrope" else None
    for op in decoders:  # an image that can never fit a row is a configuration error: say so now
        s = op.spec
        most = (s.size[0] // s.patch_size) * (s.size[1] // s.patch_size) if s.size else s.max_pixels // s.patch_size ** 2
        if pack.max_patches_per_row is not None and most > pack.max_patches_per_row:
            raise PipelineError(f"pack(max_patches_per_row={pack.max_patches_per_row}): operator '{op.name}' makes "
                                f"images of up to {most} patches, which no row could hold; raise it, or lower "
                                f"decode_images(max_pixels=...)")
        if most // s.merge ** 2 > pack.seq_len:
            raise PipelineError(f"pack(seq_len={pack.seq_len}): operator '{op.name}' makes images of up to "
                                f"{most // s.merge ** 2} tokens, more than a row; raise seq_len or lower max_pixels")
    if batch.pixels != "lists" and not any(op.kind == "tokenize_images" for op in ops):
        raise PipelineError(f"batch(pixels={batch.pixels!r}) places each image at its tokens: tokenize with "
                            f".tokenize_images(...) after .decode_images(...), or keep the images as payloads "
                            f"with batch(pixels='lists')")
    if batch.pixels == "flat":
        dims = {3 * op.spec.patch_size ** 2 for op in decoders}
        if not all(op.patchify for op in decoders) or len(dims) != 1:
            raise PipelineError("batch(pixels='flat') needs every decode_images() step to patchify with one "
                                "patch_size (one [patches, p*p*3] tensor); use pixels='fixed' or 'lists' otherwise")
        return ImageBatch("flat", batch.positions, patch_dim=dims.pop())
    if batch.pixels == "fixed":
        sizes = {op.spec.size for op in decoders}
        if None in sizes or len(sizes) != 1:
            raise PipelineError("batch(pixels='fixed') needs every decode_images() step to make one size "
                                "(size=(H, W), not max_pixels=); use pixels='flat' for native-resolution images")
        if pack.max_images_per_row is None:
            raise PipelineError("batch(pixels='fixed') needs pack(max_images_per_row=M): each row gets M image "
                                "slots, so the pixel tensor's shape is the same at every step")
        return ImageBatch("fixed", batch.positions, size=tuple(sizes.pop()), slots=pack.max_images_per_row)
    return ImageBatch("lists", batch.positions)


def _make_transform_step(transform: Transform, ctx: LaneContext) -> TransformStep:
    return TransformStep(transform)


def _coord(fmt: str, path: str) -> str:
    if fmt == "jsonl":
        from .readers.jsonl import compression_of

        return "line" if compression_of(path) else "byte"
    return "row" if fmt in ("parquet", "vortex", "lance", "arrow", "hf", "memory") else "sample"


def _tokenizer_pad(ops: list[Operator]) -> int:
    tok = next((op for op in ops if op.kind in ("tokenize", "tokenize_chat", "tokenize_images")), None)
    return 0 if tok is None else tok.tokenizer.pad_id


# -- fingerprint ---------------------------------------------------------------------------------------
def summary(pipe: Pipeline, plan: WorkPlan, per_source: list[list[Transform]], mix_step: MixStep | None,
            weights: list[float], by: str, after: list[Operator], pack: PackStep | None, batch: BatchStep) -> dict[str, Any]:
    """Everything that decides the bytes of the batches, as plain data (file lists as digests)."""
    sources = []
    for decl, sp, ops in zip(pipe.sources, plan.sources, per_source):
        files = "\n".join(sp.relative_files())
        entry = {"name": decl.name, **decl.read.describe(), "files": len(sp.files), "units": len(sp.units),
                 "files_sha256": hashlib.sha256(files.encode()).hexdigest()[:16], "ops": [op.describe() for op in ops]}
        if decl.passes is not None:
            entry["passes"] = decl.passes
        if pipe.flush_by == "chunks":  # chunk boundaries decide where sentinels fall
            entry["chunk"] = decl.read.chunk_bytes if decl.read.format == "jsonl" else decl.read.chunk_rows
        sources.append(entry)
    return {
        "schema": PIPELINE_SCHEMA, "seed": pipe.seed, "lanes": pipe.lanes, "flush_every": pipe.flush_every,
        **({"flush_by": pipe.flush_by} if pipe.flush_by != "units" else {}),
        "sources": sources,
        "mix": {"by": by, "weights": dict(zip((s.name for s in pipe.sources), weights)),
                **({"schedule": mix_step.schedule.describe()} if mix_step and mix_step.schedule else {})},
        "lane_ops": [op.describe() for op in after],
        "pack": pack.describe() if pack is not None else None, "rows_per_lane": batch.rows_per_lane,
        **({"stack": list(batch.stack)} if batch.stack else {}),
        **({"partial": batch.partial} if batch.partial != "drop" else {}),
        **({"pixels": batch.pixels} if batch.pixels != "flat" else {}),
        **({"positions": batch.positions} if batch.positions != "1d" else {}),
    }


def fingerprint(summary: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(summary, sort_keys=True, default=str).encode()).hexdigest()[:32]


# -- explain and validate ------------------------------------------------------------------------------
def explain(pipe: Pipeline) -> str:
    c = pipe.compile()
    lines = [f"Pipeline seed={pipe.seed} lanes={pipe.lanes} flush_every={pipe.flush_every} {pipe.flush_by} "
             + (f"global batch {pipe.lanes} x {c.rows_per_lane} rows x {c.seq_len} tokens" if not c.records else
                f"global batch {pipe.lanes} x {c.rows_per_lane} records (no pack: a row is one record)"),
             "sources:"]
    for decl, sp in zip(pipe.sources, c.plan.sources):
        lines.append(f"  {decl.name}: {decl.read.format} {', '.join(decl.read.path)} fields={list(decl.read.fields)} "
                     f"weight={decl.weight:g} ({len(sp.files)} files, {len(sp.units)} units)")
    lines.append("operators:")
    width = max(len(n) for n, _, _ in c.placement)
    for name, where, srcs in c.placement:
        lines.append(f"  {name:<{width}}  {where}" + (f"  [{srcs}]" if srcs not in ("-", "") else ""))
    if c.records:
        lines.append(f"fields batched as tensors: {', '.join(c.stack) or '-'} (every other field: a list per batch)")
    else:
        lines.append(f"per-token fields: {', '.join(c.token_fields)}")
    lines.append(f"fingerprint: {c.fingerprint}")
    return "\n".join(lines)


@dataclass
class ValidationReport:
    """What :meth:`Pipeline.validate` saw: records per source, per stateless operator, per accumulator."""

    records_read: dict[str, int] = field(default_factory=dict)
    after_transforms: dict[str, int] = field(default_factory=dict)
    lane_outputs: dict[str, int] = field(default_factory=dict)
    rows: int = 0

    def __str__(self) -> str:
        return (f"read {self.records_read}; after the stateless operators {self.after_transforms}; "
                f"lane operators {self.lane_outputs}; rows {self.rows}")


def validate(pipe: Pipeline, records: int = 64) -> ValidationReport:
    """Run a few records of every source through every operator in this process; an error names the
    operator that raised it."""
    from .engine.stages import drop_delivered  # noqa: F401 - the same module the workers use

    c = pipe.compile()
    report = ValidationReport()
    docs_by_source = []
    for s, (name, sp) in enumerate(zip(c.names, c.plan.sources)):
        got, docs = 0, []
        for task in sp.chunk_tasks(0, 0, -1):
            if task.empty:
                continue
            chunk = c.stages.read(s, task)
            got += chunk.n
            for stage in c.stages.stages[s]:
                for t in stage.transforms:
                    if not chunk.n:
                        break
                    try:
                        chunk = t.apply(chunk)
                    except Exception as exc:
                        raise PipelineError(f"validate: operator '{t.name}' failed on source '{name}' "
                                            f"({task.path}): {type(exc).__name__}: {exc}") from exc
            docs += list(chunk.docs())
            if got >= records:
                break
        report.records_read[name] = got
        report.after_transforms[name] = len(docs)
        docs_by_source.append(docs)
    ctx = LaneContext(pipe.seed, 0, 0, tuple(c.names))
    from .ops.base import call_factory

    merge = call_factory(c.merge, ctx)
    stream = []
    cursors = [0] * len(docs_by_source)
    while True:
        s = merge.next_source()
        if cursors[s] >= len(docs_by_source[s]):
            break
        stream += list(merge.push_from(docs_by_source[s][cursors[s]], s))
        cursors[s] += 1
    for name, factory in c.steps:
        acc = call_factory(factory, ctx)
        out: list[Any] = []
        try:
            for rec in stream:
                out += list(acc.push(rec))
            out += list(acc.flush())
        except Exception as exc:
            raise PipelineError(f"validate: operator '{name}' failed: {type(exc).__name__}: {exc}") from exc
        report.lane_outputs[name] = len(out)
        stream = out
    report.rows = len(stream)
    if not report.rows:
        raise PipelineError(f"validate: {records} records per source made no packed row; check the filters and "
                            f"fields ({report})")
    return report

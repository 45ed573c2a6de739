"""``explain()`` and ``validate()``: a pipeline's operators in order with where each runs, and a few records
of every source pushed through every operator in this process (an error names the operator)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import PipelineError
from ..ops.base import LaneContext, call_factory


def explain(pipe: Any) -> str:
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
    """Source name -> records read from it."""
    after_transforms: dict[str, int] = field(default_factory=dict)
    """Source name -> its documents after its stateless operators."""
    lane_outputs: dict[str, int] = field(default_factory=dict)
    """Lane operator name (the operators after the merge: accumulators, packing, batching) -> records it gave."""
    rows: int = 0
    """What the lane's last operator gave (rows)."""

    def __str__(self) -> str:
        return (f"read {self.records_read}; after the stateless operators {self.after_transforms}; "
                f"lane operators {self.lane_outputs}; rows {self.rows}")


def validate(pipe: Any, records: int = 64) -> ValidationReport:
    """Run a few records of every source through every operator in this process; an error names the
    operator that raised it."""
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
                        chunk = c.stages.apply_one(t, chunk)
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
    merge = call_factory(c.merge, ctx)
    stream = []
    cursors = [0] * len(docs_by_source)
    while True:
        s = merge.next_source()
        if cursors[s] >= len(docs_by_source[s]):
            break
        stream += list(merge.push_from(docs_by_source[s][cursors[s]], s))
        cursors[s] += 1
    for name, factory in c.lane_ops:
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

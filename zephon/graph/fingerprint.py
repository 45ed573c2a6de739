"""The fingerprint: everything that decides the bytes of the batches, as plain data, and its digest.

It is made of each operator's own description (:meth:`zephon.ops.base.Operator.describe`: its identity, its
version and every parameter), in the order the lanes run them, the implied ones included, plus the sources
(how they are read, their relative file lists as a digest, their unit counts) and the pipeline's settings.
A checkpoint carries it; loading one from another pipeline is refused naming the operator that differs
(:func:`zephon.state.checkpoint.check_compatible`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

SCHEMA = 2  # 2: operators described by construction (identity, version, every parameter)


def summary(pipe: Any, plan: Any, per_source: Sequence[Sequence[Any]], lane_ops: Sequence[Any]) -> dict[str, Any]:
    """The pipeline's description: its settings, its sources (each with its own stateless operators) and the
    operators of the lane (the merge, the accumulators, the packer and the batch).

    Args:
        pipe: the pipeline (seed, lanes, flush cadence, sources).
        plan: its work plan (the files and units of each source).
        per_source: each source's operators before the merge, in order.
        lane_ops: the operators after the merge, in order, the implied ones included.

    Returns:
        Plain JSON data.
    """
    sources = []
    for decl, sp, ops in zip(pipe.sources, plan.sources, per_source):
        files = "\n".join(sp.relative_files())
        entry = {"name": decl.name, "weight": decl.weight, **decl.read.describe(), "files": len(sp.files),
                 "units": len(sp.units), "files_sha256": hashlib.sha256(files.encode()).hexdigest()[:16],
                 "ops": [op.describe() for op in ops]}
        if decl.passes is not None:
            entry["passes"] = decl.passes
        if pipe.flush_by == "chunks":  # chunk boundaries decide where sentinels fall
            entry["chunk"] = decl.read.chunk_bytes if decl.read.format == "jsonl" else decl.read.chunk_rows
        sources.append(entry)
    return {"schema": SCHEMA, "seed": pipe.seed, "lanes": pipe.lanes, "flush_every": pipe.flush_every,
            "flush_by": pipe.flush_by, "sources": sources, "ops": [op.describe() for op in lane_ops]}


def fingerprint(summary: dict[str, Any]) -> str:
    """The digest of a :func:`summary` (the summary holds only plain data: no fallback for other types)."""
    return hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()[:32]

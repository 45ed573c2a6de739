"""``flat_map(fn)``: ``fn(record) -> iterable of records``, zero or more records per record.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..records import Chunk
from ._function import FunctionTransform, keep_doc, records_of


class FlatMap(FunctionTransform):
    """``fn(record) -> iterable of records``: zero, one or several records per input record.

    A lane can checkpoint between two outputs of one input: it then re-reads the input and drops the
    outputs it already took (so ``fn`` must be a pure function of the record).
    """

    op = "flat_map"

    def _apply_chunk(self, chunk: Chunk) -> Chunk:
        outs: list[list[Any]] = []
        for j, rec in enumerate(chunk.docs() if chunk.tails is not None else chunk.records()):
            ok, new = self._call(rec, lambda: chunk.where(j))
            outs.append(records_of(new, self, chunk.where(j)) if ok else [])
            if not ok:
                chunk.count("failed_records")
        counts = np.fromiter((len(o) for o in outs), dtype=np.int64, count=len(outs))
        cursor, skip = chunk.expand(counts)
        flat = [r for o in outs for r in o]
        chunk.skipped += int((counts == 0).sum())
        chunk.resume_cursor, chunk.resume_skip = cursor, skip
        chunk.expand_origin(counts)
        return self._rebuild(chunk, flat, one_to_one=False)

    def _apply_records(self, records: list[Any]) -> list[Any]:
        out = []
        for rec in records:
            ok, new = self._call(rec, lambda: "a record in the lane")
            if ok:
                out += [keep_doc(rec, r) for r in records_of(new, self, "a record in the lane")]
        return out

"""Rows of one record each: what a lane delivers when a pipeline batches records without packing them.

A pipeline that ends in ``batch()`` with no ``pack()`` (image-caption pairs for a contrastive model,
pre-cut fixed-length samples, a classifier's examples) delivers whole records: each lane adds
``rows_per_lane`` records to every global batch, and the batch holds one value per record for every
field (:mod:`zephon.collate_records`). Everything else is as for packed rows:

- the lane's step clock counts these rows as it counts packed ones (:mod:`zephon.engine.clock`);
- flush sentinels carry nothing over (a row is never part-filled) and cost no padding;
- a resume replays the records since the last sentinel and skips the delivered ones.

Worked example, two lanes of ``batch(rows_per_lane=2)`` over records ``r0, r1, ...`` (lane 0 gets
``r0, r2, r4, r6``, lane 1 ``r1, r3, r5, r7`` from the plan): step 0 is ``[r0, r2, r1, r3]``, step 1 is
``[r4, r6, r5, r7]``, on one rank or on two, with any number of workers.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from .base import Accumulator


class RecordRow:
    """One record as a row of the global batch (``record`` None: a row of padding, see ``partial``)."""

    __slots__ = ("record", "fill", "free", "flushed")

    def __init__(self, record: Mapping[str, Any] | None) -> None:
        self.record = record
        self.fill = 0 if record is None else 1  # the loader's "has data" test, as for packed rows
        self.free = 1 - self.fill  # padding, in rows of one (the loader's padding metrics)
        self.flushed = False  # a sentinel never closes a record row early


class RecordRows(Accumulator):
    """The last operator of a pipeline without ``pack()``: each record becomes one row. Holds nothing,
    so a flush emits nothing."""

    kind = "rows"

    def __init__(self) -> None:
        super().__init__("rows")

    def describe(self) -> dict[str, Any]:
        return {"op": "rows", "per_row": "one record"}

    def push(self, record: Mapping[str, Any]) -> Iterable[Any]:
        return (RecordRow(record),)

    def flush(self) -> Iterable[Any]:
        return ()

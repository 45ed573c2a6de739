"""``batch``: the rows each lane adds to every global batch, and how the batch carries them.

Every pipeline ends with ``batch(rows_per_lane)``: global batch ``s`` is lane 0's rows, then lane 1's, ...
With ``pack()`` before it the rows are packed sequences (collated by :mod:`zephon.batches.packed`). Without,
a row is one record:

**Rows of one record each**: what a lane delivers when a pipeline batches records without packing them.

A pipeline that ends in ``batch()`` with no ``pack()`` (image-caption pairs for a contrastive model,
pre-cut fixed-length samples, a classifier's examples) delivers whole records: each lane adds
``rows_per_lane`` records to every global batch, and the batch holds one value per record for every
field (:mod:`zephon.batches.records`). Everything else is as for packed rows:

- the lane's step clock counts these rows as it counts packed ones (:mod:`zephon.engine.clock`);
- flush sentinels carry nothing over (a row is never part-filled) and cost no padding;
- a resume replays the records since the last sentinel and skips the delivered ones.

Worked example, two lanes of ``batch(rows_per_lane=2)`` over records ``r0, r1, ...`` (lane 0 gets
``r0, r2, r4, r6``, lane 1 ``r1, r3, r5, r7`` from the plan): step 0 is ``[r0, r2, r1, r3]``, step 1 is
``[r4, r6, r5, r7]``, on one rank or on two, with any number of workers.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..errors import PipelineError
from .base import Accumulator, Operator, positive_int

PARTIAL = ("drop", "pad")  # the last global batch some lanes cannot fill (sources that stop)
PIXEL_MODES = ("flat", "fixed", "lists")  # how a packed batch carries images (zephon.batches.images)
POSITION_MODES = ("1d", "mrope")  # position_ids: one per token, or Qwen2-VL's 3-D rotary positions


class Batch(Operator):
    """Each lane adds ``rows_per_lane`` rows to every global batch (global batch = lanes x this).

    Args:
        rows_per_lane: rows (packed sequences, or records without ``pack()``) each lane gives every step.
        partial: sources that stop (``passes=``) end lanes at different steps: the first global batch some
            lane cannot fill ends the loader (``"drop"``), or lanes that ran out give padding rows until
            every lane has (``"pad"``, so an evaluation covers its whole set).
        pixels: images in packed batches: ``"flat"`` (``pixel_values`` uint8 ``[total_patches, p*p*3]``),
            ``"fixed"`` (``[rows * max_images_per_row, 3, H, W]`` with ``image_mask``) or ``"lists"``.
        positions: ``"1d"``, or ``"mrope"`` for Qwen2-VL's ``[3, B, S]`` rotary positions.
        stack: without ``pack()``, the record fields batched as one tensor each (one shape and dtype).
        provenance: add a ``provenance`` tensor to every batch: where each packed segment (or record row)
            comes from, its source, file, record and token range (:mod:`zephon.origins`). It adds a key and
            changes no other byte, so it is not fingerprinted: a checkpoint resumes with it on or off.
    """

    op = "batch"
    NOT_FINGERPRINTED = Operator.NOT_FINGERPRINTED | {"provenance"}

    def __init__(self, rows_per_lane: int = 1, partial: str = "drop", *, pixels: str = "flat",
                 positions: str = "1d", stack: tuple[str, ...] | list[str] = (), provenance: bool = False) -> None:
        super().__init__()
        positive_int(rows_per_lane, "batch(rows_per_lane=...)")
        for what, value, choices in (("partial", partial, PARTIAL), ("pixels", pixels, PIXEL_MODES),
                                     ("positions", positions, POSITION_MODES)):
            if value not in choices:
                raise PipelineError(f"batch({what}={value!r}): use one of {choices}")
        if isinstance(stack, str) or not all(isinstance(k, str) and k for k in stack):
            raise PipelineError(f"batch(stack={stack!r}): a list of field names, e.g. stack=['image']")
        self.rows_per_lane, self.partial, self.pixels, self.positions = rows_per_lane, partial, pixels, positions
        self.stack = tuple(stack)
        if not isinstance(provenance, bool):
            raise PipelineError(f"batch(provenance={provenance!r}): True or False")
        self.provenance = provenance

    @staticmethod
    def make_rows(ctx: Any) -> "RecordRows":
        """The lane's last operator when there is no ``pack()``: a row per record."""
        return RecordRows()


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

    def push(self, record: Mapping[str, Any]) -> Iterable[Any]:
        return (RecordRow(record),)

    def flush(self) -> Iterable[Any]:
        return ()

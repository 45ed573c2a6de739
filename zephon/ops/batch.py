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

from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from ..errors import PipelineError
from ..records import IGNORE, INPUT_IDS, Doc
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
    so a flush emits nothing. :meth:`push_span` takes a run of records at once (the batched path)."""

    def push(self, record: Mapping[str, Any]) -> Iterable[Any]:
        return (RecordRow(record),)

    def push_span(self, span: RecordSpan) -> RecordSpan:
        """A span of records as that many rows (the rows are the span itself: nothing is built per record)."""
        return span

    def flush(self) -> Iterable[Any]:
        return ()


_new_doc = dict.__new__  # an empty Doc without Doc.__init__'s defaults (once per record materialised)


class RecordSpan:
    """Records ``[start, stop)`` of one chunk of one source, as a view: the batched record-rows path.

    Where nothing per record sits between the sources and ``batch()`` (no ``pack()``, no transform or
    accumulator after the merge), a lane passes the consecutive records the mixer takes from one source as
    one span instead of a ``Doc`` and a :class:`RecordRow` each, and the batch joins the spans' columns
    (:func:`zephon.batches.records.join_rows`). :meth:`record` gives the ``Doc`` the per-record path makes,
    field for field, so both paths deliver the same bytes. Pickled (a lane worker's rows), a span carries
    only its own slice of the chunk.

    Args:
        source: the source's index.
        start, stop: the records of the chunk this span holds.
        payloads: ``(name, values)`` per payload column of the chunk (one value per record).
        ids: the chunk's flat ``input_ids`` (None: no token fields); ``offs`` the records' offsets into it.
        more_tokens: ``(name, flat)`` per other per-token field.
        tails: per record, the label after its last token (None: all ``IGNORE``).
        origins: per record, its origin tuple (None: provenance off).
    """

    __slots__ = ("ids", "more_tokens", "offs", "origins", "payloads", "source", "start", "stop", "tails")

    def __init__(self, source: int, start: int, stop: int, payloads: Sequence[tuple[str, Any]],
                 ids: Any = None, offs: Sequence[int] | None = None, more_tokens: Sequence[tuple[str, Any]] = (),
                 tails: Sequence[int] | None = None, origins: Sequence[Any] | None = None) -> None:
        self.source, self.start, self.stop = source, start, stop
        self.payloads, self.ids, self.offs, self.more_tokens = payloads, ids, offs, more_tokens
        self.tails, self.origins = tails, origins

    def __len__(self) -> int:
        return self.stop - self.start

    def fields(self) -> list[str]:
        """The fields of its records, in the order a record has them."""
        tokens = [INPUT_IDS, *(name for name, _ in self.more_tokens)] if self.offs is not None else []
        return tokens + [name for name, _ in self.payloads]

    def tokens(self) -> int:
        """Its records' ``input_ids`` tokens in all (what a mixer by tokens counts)."""
        if self.offs is None:
            raise KeyError(INPUT_IDS)
        return self.offs[self.stop] - self.offs[self.start]

    def column(self, name: str) -> list[Any]:
        """The values of field ``name``, one per record (the values the records themselves hold)."""
        a, b = self.start, self.stop
        for key, values in self.payloads:
            if key == name:
                return _values(values, a, b)
        flat = self.ids if name == INPUT_IDS else dict(self.more_tokens)[name]
        offs = self.offs
        return [flat[offs[k]:offs[k + 1]] for k in range(a, b)]

    def record(self, i: int) -> Doc:
        """Its ``i``-th record, as the per-record path gives it."""
        k = self.start + i
        doc = _new_doc(Doc)
        offs = self.offs
        if offs is not None:
            lo, hi = offs[k], offs[k + 1]
            doc[INPUT_IDS] = self.ids[lo:hi]
            for name, flat in self.more_tokens:
                doc[name] = flat[lo:hi]
        for name, values in self.payloads:
            doc[name] = values[k]
        doc.tail = self.tails[k] if self.tails is not None else IGNORE
        doc.source = self.source
        doc.origin = self.origins[k] if self.origins is not None else None
        return doc

    def rows(self) -> list[RecordRow]:
        return [RecordRow(self.record(i)) for i in range(len(self))]

    def __reduce__(self) -> tuple:
        a, b = self.start, self.stop
        payloads = [(name, _values(values, a, b)) for name, values in self.payloads]
        ids = offs = None
        more: list = []
        if self.offs is not None:
            lo, hi = self.offs[a], self.offs[b]
            ids, offs = self.ids[lo:hi], [o - lo for o in self.offs[a:b + 1]]
            more = [(name, flat[lo:hi]) for name, flat in self.more_tokens]
        tails = None if self.tails is None else self.tails[a:b]
        origins = None if self.origins is None else self.origins[a:b]
        return RecordSpan, (self.source, 0, b - a, payloads, ids, offs, more, tails, origins)


def _values(values: Any, a: int, b: int) -> list[Any]:
    """``[values[k] for k in range(a, b)]``, by one slice where the column is a list or an array."""
    if type(values) is list:
        return values[a:b]
    if type(values) is np.ndarray:
        return list(values[a:b])
    return [values[k] for k in range(a, b)]


class RecordBlock(Sequence):
    """Record rows in lane order, as spans (:class:`RecordSpan`), single :class:`RecordRow` s and runs of
    padding (an int: that many rows of padding): the rows of a lane's step, or of a rank's, on the batched
    record-rows path. As a sequence it is the list of :class:`RecordRow` s the per-record path gives (built
    when indexed); the loader and the collation read :attr:`parts` instead."""

    __slots__ = ("_len", "_rows", "parts")

    def __init__(self, parts: Sequence[Any] = ()) -> None:
        self.parts = list(parts)
        self._len = sum(p if type(p) is int else len(p) if type(p) is RecordSpan else 1 for p in self.parts)
        self._rows: list[RecordRow] | None = None

    @classmethod
    def join(cls, blocks: Iterable[RecordBlock]) -> RecordBlock:
        return cls([p for b in blocks for p in b.parts])

    def __len__(self) -> int:
        return self._len

    def _all(self) -> list[RecordRow]:
        if self._rows is None:
            rows: list[RecordRow] = []
            for p in self.parts:
                if type(p) is int:
                    rows.extend(RecordRow(None) for _ in range(p))
                elif type(p) is RecordSpan:
                    rows.extend(p.rows())
                else:
                    rows.append(p)
            self._rows = rows
        return self._rows

    def __getitem__(self, i: Any) -> Any:
        return self._all()[i]

    def __iter__(self) -> Iterator[RecordRow]:
        return iter(self._all())

    def padding(self) -> int:
        """How many of its rows are padding."""
        return sum(p if type(p) is int else 0 if type(p) is RecordSpan else 1 - p.fill for p in self.parts)

    def __reduce__(self) -> tuple:
        return RecordBlock, (self.parts,)


def flat_rows(lane_rows: Sequence[Sequence[Any]]) -> Sequence[Any]:
    """The rows of several lanes' steps in lane order: one :class:`RecordBlock` when every lane gave one
    (the batched record-rows path), else a list."""
    if lane_rows and all(type(r) is RecordBlock for r in lane_rows):
        return RecordBlock.join(lane_rows)  # type: ignore[arg-type]
    return [row for rows in lane_rows for row in rows]

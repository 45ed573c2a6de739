"""A batch's ``provenance`` tensor read back as people read it: source names, file paths, decoded text.

:class:`Segment` is one row of the tensor (:mod:`zephon.origins`) with its tokens and text; :class:`Namer`
turns a pipeline's file ids back into paths relative to each source's root, from the work plan's listing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..origins import PROVENANCE_COLUMNS, PROVENANCE_KEY, UNKNOWN, coordinate, file_id

ROW, SEGMENT, SOURCE, FILE, RECORD, TOKEN_START, TOKEN_END = range(len(PROVENANCE_COLUMNS))


@dataclass(frozen=True)
class Segment:
    """One document piece (or record row) of a global batch, and where it comes from.

    Attributes:
        step: the global step.
        row: its row in the global batch.
        segment: its index among the row's segments (0 for a record row).
        source: the source's name.
        file: the file, relative to the source's root ("?" when unknown).
        record: where its record starts in that file, in ``coord`` units (-1: unknown).
        coord: what ``record`` counts: ``"row"``, ``"byte"``, ``"line"`` or ``"sample"``.
        tokens: its token range ``(start, end)`` within its record's document.
        token_ids: its token ids as delivered (empty for a record row without tokens).
        text: the decoded tokens (a record row without tokens: its first text field), or None.
        images: the images it holds: ``{"grid_thw": [t, h, w]}`` (patches) or ``{"field", "shape"}``.
    """

    step: int
    row: int
    segment: int
    source: str
    file: str
    record: int
    coord: str
    tokens: tuple[int, int]
    token_ids: np.ndarray = field(repr=False, compare=False)
    text: str | None = None
    images: tuple[dict[str, Any], ...] = ()

    def to_dict(self, token_ids: bool = False) -> dict[str, Any]:
        """The segment as JSON data.

        Args:
            token_ids: include the token ids.

        Returns:
            A dict of plain values (``tokens`` as a two-item list).
        """
        d: dict[str, Any] = {"step": self.step, "row": self.row, "segment": self.segment, "source": self.source,
                             "file": self.file, "record": self.record, "coord": self.coord,
                             "tokens": list(self.tokens), "text": self.text, "images": list(self.images)}
        if token_ids:
            d["token_ids"] = [int(t) for t in self.token_ids]
        return d


class Namer:
    """File ids back to file names, and each source's coordinate, for one compiled pipeline."""

    def __init__(self, program: Any) -> None:
        self.program = program
        self._files: dict[int, dict[int, tuple[str, str]]] = {}

    def source_name(self, index: int) -> str:
        names = self.program.names
        return names[index] if 0 <= index < len(names) else "?"

    def file(self, source: int, fid: int) -> tuple[str, str]:
        """``(relative path, full path)`` of file ``fid`` of ``source`` (``("?", "")`` unknown)."""
        if not 0 <= source < len(self.program.plan.sources):
            return "?", ""
        if source not in self._files:
            sp = self.program.plan.sources[source]
            self._files[source] = {file_id(sp.relative(f)): (sp.relative(f), f) for f in sp.files}
        return self._files[source].get(fid, ("?", ""))

    def coord(self, source: int, path: str) -> str:
        if not 0 <= source < len(self.program.plan.sources) or not path:
            return "?"
        return coordinate(self.program.plan.sources[source].spec.format, path)


def segments_of(batch: Mapping[str, Any], step: int, namer: Namer, rows: Sequence[int] | None,
                first_row: int, decoders: Sequence[Callable[[Any], str] | None] | None = None) -> list[Segment]:
    """The segments of ``batch`` (a rank's batch whose first row is global row ``first_row``) in the global rows
    ``rows`` (None: all), in row order.

    Args:
        batch: a batch with a ``provenance`` tensor.
        step: its global step.
        namer: the pipeline's :class:`Namer`.
        rows: global rows to keep.
        first_row: the global row of the batch's row 0.
        decoders: per source index, ``ids -> text`` with the tokenizer that made its ids (None, or a source's
            None: no text).

    Returns:
        The segments.
    """
    table = batch[PROVENANCE_KEY].numpy()
    wanted = None if rows is None else {int(r) for r in rows}
    packed = "segment_ids" in batch
    out = []
    for entry in table.tolist():
        g_row, seg, src, fid, record, t0, t1 = entry
        if seg == UNKNOWN or wanted is not None and g_row not in wanted:  # a row of padding, or not asked for
            continue
        local = g_row - first_row
        decode = decoders[src] if decoders is not None and 0 <= src < len(decoders) else None
        rel, full = namer.file(src, fid) if fid != UNKNOWN else ("?", "")
        if packed:
            positions = np.flatnonzero(batch["segment_ids"][local].numpy() == seg + 1)
            ids = batch["input_ids"][local].numpy()[positions[0]:positions[-1] + 1] if len(positions) else \
                np.zeros(0, dtype=np.int64)
            text = decode(ids) if decode is not None and len(ids) else None
            images = _packed_images(batch, local, positions)
        else:
            ids, text, images = _record_row(batch, local, decode)
        out.append(Segment(step, g_row, seg, namer.source_name(src), rel, record, namer.coord(src, full),
                           (t0, t1), ids, text, images))
    return out


def _packed_images(batch: Mapping[str, Any], row: int, positions: np.ndarray) -> tuple[dict[str, Any], ...]:
    if not len(positions) or "image_token_start" not in batch:
        return ()
    starts = batch["image_token_start"].numpy()
    grids = batch["image_grid_thw"].numpy()
    if "image_row" in batch:  # pixels="flat": one entry per image
        rows_of = batch["image_row"].numpy()
        picked = np.flatnonzero(rows_of == row)
    elif "image_mask" in batch:  # pixels="fixed": M slots per row
        mask = batch["image_mask"].numpy()
        per_row = len(mask) // max(1, batch["input_ids"].shape[0])
        picked = np.array([k for k in range(row * per_row, (row + 1) * per_row) if mask[k]], dtype=np.int64)
    else:
        return ()
    lo, hi = int(positions[0]), int(positions[-1])
    return tuple({"grid_thw": [int(x) for x in grids[k]]} for k in picked.tolist() if lo <= int(starts[k]) <= hi)


def _record_row(batch: Mapping[str, Any], row: int, decode: Any) -> tuple[np.ndarray, str | None, tuple]:
    ids = np.zeros(0, dtype=np.int64)
    text = None
    images: list[dict[str, Any]] = []
    for key, value in batch.items():
        if key in (PROVENANCE_KEY, "valid"):
            continue
        v = value[row]
        if key == "input_ids" and v is not None:
            ids = np.asarray(v)
            if decode is not None:
                text = decode(ids)
        elif isinstance(v, str) and text is None:
            text = v
        elif hasattr(v, "shape") and len(getattr(v, "shape", ())) >= 2:
            images.append({"field": key, "shape": [int(x) for x in v.shape]})
    return ids, text, tuple(images)

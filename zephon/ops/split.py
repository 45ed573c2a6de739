"""``split``: cut documents longer than ``max_tokens`` into pieces, vectorised over a chunk.

Pieces are cut from the document's start every ``max_tokens`` tokens; every per-token field is cut at
the same places and every payload goes with every piece. A piece that is not its document's last
carries the next token as its tail label (the loss at its last position is the true next token); the
last piece keeps the document's own tail. Each piece has its own resume point (re-read the document,
skip the pieces already taken), so a lane can checkpoint between two pieces of one document.

Worked example, ``max_tokens = 4``, one document ``[1 2 3 4 5 6 7 8 9 2]`` (EOS 2)::

    pieces [1 2 3 4] tail 5,  [5 6 7 8] tail 9,  [9 2] tail -100

A document with images (``image_spans``, from ``tokenize_images``) is never cut inside an image's tokens:
a cut that would fall inside moves back to the image's start, and a piece also closes before an image that
would take it over the packer's per-row image or patch limits (``limits``, set by the pipeline). Each piece
carries only the images it holds (:mod:`zephon.ops.image_layout`, which has a worked example); an image
that cannot fit in a row on its own is an error that names the fix.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..records import IGNORE, INPUT_IDS, Chunk, cut_doc, doc_length
from ..errors import SourceError
from .base import BindContext, Transform, positive_int
from .image_layout import (IMAGE_GRID, IMAGE_SPANS, NO_LIMITS, PER_IMAGE, ImageLimits, ImageTooLarge, cut_points,
                           images_in, patch_counts, piece, spans_of)


def piece_bounds(offsets: np.ndarray, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, new_offsets)``: pieces per document and the offsets of all pieces, cut every
    ``max_tokens`` tokens from each document's start (pure numpy; no per-document loop)."""
    lengths = np.diff(offsets)
    counts = np.maximum(1, -(-lengths // max_tokens))
    total = int(counts.sum())
    doc_of_piece = np.repeat(np.arange(len(lengths)), counts)
    first_piece = np.cumsum(counts) - counts
    within = np.arange(total) - first_piece[doc_of_piece]
    starts = offsets[:-1][doc_of_piece] + within * max_tokens
    new_offsets = np.empty(total + 1, dtype=np.int64)
    new_offsets[:-1] = starts
    new_offsets[-1] = offsets[-1]
    return counts, new_offsets


class Split(Transform):
    """Cut documents into pieces of at most ``max_tokens`` tokens (see the module docstring).

    Args:
        max_tokens: the longest piece.
        name, sources, executor: as for every operator.
    """

    _rows_checked = False  # its output fits the packed rows by construction

    op = "split"

    def __init__(self, max_tokens: int, name: str | None = None, sources: Sequence[str] | None = None,
                 executor: str | None = None) -> None:
        super().__init__(name, sources, executor)
        self.max_tokens = positive_int(max_tokens, "split(max_tokens=...)")
        self._token_names: tuple[str, ...] = (INPUT_IDS,)  # bound by the pipeline: every per-token field
        self._limits: ImageLimits = NO_LIMITS  # bound by the pipeline: the packer's per-row image limits

    def bind(self, ctx: BindContext) -> "Split":
        """A copy that cuts every per-token field of the pipeline, within the packer's image limits."""
        return self._bound(_token_names=tuple(ctx.token_fields) or (INPUT_IDS,), _limits=ctx.limits or NO_LIMITS)

    def _apply_chunk(self, chunk: Chunk) -> Chunk:
        if not chunk.token_fields:
            raise ValueError(f"operator '{self.name}' needs documents: put .tokenize() before .split()")
        assert chunk.offsets is not None
        spans = chunk.columns.get(IMAGE_SPANS)
        with_images = spans is not None and any(len(x) for x in spans if x is not None)
        if with_images:
            counts, new_offsets = self._image_bounds(chunk)
        else:
            if chunk.n and int(np.diff(chunk.offsets).max()) <= self.max_tokens:
                return chunk  # nothing to cut
            counts, new_offsets = piece_bounds(chunk.offsets, self.max_tokens)
        if len(new_offsets) - 1 == chunk.n:
            return chunk
        n_pieces = len(new_offsets) - 1
        is_last = np.zeros(n_pieces, dtype=bool)
        is_last[np.cumsum(counts) - 1] = True
        tails = np.empty(n_pieces, dtype=np.int64)
        old_tails = chunk.tails if chunk.tails is not None else np.full(chunk.n, IGNORE, dtype=np.int64)
        tails[is_last] = old_tails
        ids = chunk.token_fields[INPUT_IDS]
        tails[~is_last] = ids[new_offsets[1:][~is_last]]
        cursor, skip = chunk.expand(counts)
        index = np.repeat(np.arange(chunk.n), counts)
        chunk.columns = {k: (v[index] if isinstance(v, np.ndarray) else [v[i] for i in index.tolist()])
                         for k, v in chunk.columns.items()}
        if with_images:
            self._image_payloads(chunk, new_offsets[:-1] - chunk.offsets[:-1][index], np.diff(new_offsets))
        chunk.resume_cursor, chunk.resume_skip = cursor, skip
        chunk.expand_origin(counts, new_offsets[:-1] - chunk.offsets[:-1][index])
        chunk.offsets, chunk.tails = new_offsets, tails
        return chunk

    def _cuts(self, spans: np.ndarray | None, patches: list[int], n: int, where: Any) -> list[int]:
        try:
            return cut_points(spans, patches, n, self.max_tokens, self._limits)
        except ImageTooLarge as exc:
            raise SourceError(f"operator '{self.name}': {where()}: {exc}") from None

    def _image_bounds(self, chunk: Chunk) -> tuple[np.ndarray, np.ndarray]:
        """Like :func:`piece_bounds`, with cuts placed between images (one document at a time: only chunks
        with images come here, and a few cuts per document are cheap next to decoding its images)."""
        offsets = chunk.offsets
        assert offsets is not None
        spans_col, grids_col = chunk.columns[IMAGE_SPANS], chunk.columns[IMAGE_GRID]
        counts = np.empty(chunk.n, dtype=np.int64)
        starts: list[int] = []
        for j, (a, b) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
            spans = spans_col[j] if spans_col[j] is not None and len(spans_col[j]) else None
            patches = patch_counts({IMAGE_GRID: grids_col[j]}) if spans is not None else []
            cuts = self._cuts(spans, patches, b - a, lambda: chunk.where(j))
            counts[j] = len(cuts) + 1
            starts += [a] + [a + c for c in cuts]
        return counts, np.asarray(starts + [int(offsets[-1])], dtype=np.int64)

    def _image_payloads(self, chunk: Chunk, starts: np.ndarray, lengths: np.ndarray) -> None:
        """Each piece's own images (piece ``i`` is tokens ``[starts[i], starts[i] + lengths[i])`` of its
        document): those whose spans lie in it, offsets shifted to the piece."""
        cols = {k: chunk.columns[k] for k in PER_IMAGE if k in chunk.columns}
        for i, (a, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
            spans = cols[IMAGE_SPANS][i]
            if spans is None or not len(spans):
                continue
            part = images_in({k: v[i] for k, v in cols.items()}, a, a + n)
            for k in cols:
                cols[k][i] = part[k]

    def _apply_records(self, records: list[Any]) -> list[Any]:
        out = []
        for rec in records:
            spans = spans_of(rec)
            if spans is not None:
                n = doc_length(rec)
                bounds = [0, *self._cuts(spans, patch_counts(rec), n, lambda: "a document"), n]
                out += [piece(rec, a, b, self._token_names) for a, b in zip(bounds[:-1], bounds[1:])]
                continue
            while doc_length(rec) > self.max_tokens:
                head, rec = cut_doc(rec, self.max_tokens, self._token_names)
                out.append(head)
            out.append(rec)
        return out

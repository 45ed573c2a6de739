"""Packing documents into rows of ``seq_len`` tokens: best fit, first fit, or wrap.

All three are online and serial (an accumulator): they see the lane's documents in order and keep a
few open rows ("bins"). Ties are broken by the order in which bins were opened, never by chance.

``best_fit``  a document goes to the open bin with the *least* free space that still holds it.
``first_fit`` a document goes to the *oldest* open bin that holds it.
              For both: a bin that becomes exactly full is emitted at once; when no bin holds the
              document and ``max_open_bins`` are open, the fullest bin (oldest on ties) is emitted,
              padded, and a new bin is opened. Documents never straddle rows (the splitter has cut
              anything longer than a row).
``wrap``      documents are concatenated and the stream is cut every ``seq_len`` tokens; a
              document cut at a row end continues at the start of the next row, and the piece's tail
              label is the next token. No padding (a flush tops its last row up, see below).

Every per-token field of a document (``input_ids``, ``loss_mask``, ...) is packed side by side, so the
fields of a row stay aligned; a document's payloads (metadata, images) go with it into its row (each
piece of a cut document carries them; its images, only those whose tokens it holds: below). A document without one of the pipeline's per-token fields gets
that field's default (e.g. ``loss_mask`` 1: every label counts). A document of no tokens (a user's ``map``
can make one; ``tokenize`` drops them) has nothing to put in a row: it goes into none, with its payloads.

At a :class:`Flush` sentinel the packer must empty itself, so that after it it is as if new. Padding
every open bin would cost up to ``max_open_bins`` part-empty rows per flush; instead the pieces in the
open bins are taken in opening order and *wrapped* into rows (a piece cut at a row end keeps the next
token as its tail label). That leaves at most one part-filled row, and it is not padded either: it is
held, with the sentinel, and *topped up* with the first tokens that arrive after the sentinel (the
piece that overflows is cut; its head's tail label is the next token). Then the row is emitted and the
sentinel forwarded with ``carry`` = the number of post-sentinel tokens the row took. A packer rebuilt
at that sentinel (a resume) is given ``skip=carry`` and drops exactly those tokens, so it continues as
the original did. A flush therefore costs no padding at all, unless the segment after it holds fewer
tokens than the held row lacks: then the row is padded (``flush_pad_fraction`` in metrics) when the next sentinel
arrives, and ``carry`` is that whole segment.

Worked example, ``seq_len = 8``, ``max_open_bins = 2``, documents of lengths 5, 4, 3, 2, 6::

    best_fit:  5 -> A[5]        4 -> B[4]         3 -> A[5,3] full, emit A
               2 -> B[4,2]      6 -> no fit, 1 bin open -> C[6]
               flush
               -> B, C hold 4+2+6 = 12 tokens: wrapped, [4,2,2'] emitted, [4''] held with 4 free
               next segment starts with 3, 7 -> [4'',3,1'] emitted, flush forwarded with carry 4,
               then the rest of the 7, 6'', enters the fresh packer as a document
    flush cost, max_open_bins = 3, open bins [5] [5] [5]: padding each costs 9 tokens in three rows;
               wrapping their pieces gives [5,3'] [2'',5] + 1 held slot, topped up by the next
               segment: 0 padding
               (x' = first part of a cut piece, x'' = the rest)
    first_fit: same here; it differs when several bins fit (oldest wins, not tightest)
    wrap:      [5,3'] [1'',3,2,2'] [4''...] (the 4- and 6-token documents continue on the next row)

**Documents with images** (``image_spans``, from ``tokenize_images``; :mod:`zephon.ops.image_layout`). Image
tokens are tokens: they count against ``seq_len`` like any other. A document is never cut inside an
image's tokens (start, pads, end), and every piece carries exactly the images whose tokens it holds, so
an image's pixels are in exactly one row. ``limits`` caps the images and patches of one row
(``max_images_per_row``, ``max_patches_per_row``): a document that would take a row over them goes to
another bin (best/first fit) or closes the row (wrap). Where a cut would fall inside an image (``wrap``,
the wrap-up of the open bins at a flush, the top-up of the held row), the row is closed there and the
image starts the next one: the row is padded by at most the image's span less one token (or by what the
limits leave unused). So a flush costs no padding for rows of text, and for rows with images at most one
image span per row the wrap-up makes, plus one for the held row (``flush_pad_fraction`` in metrics; measured in
``tests/test_multimodal_pack.py``). The replay state is unchanged: ``carry`` tokens, at a cut that is
never inside an image.

Worked example with images, ``seq_len = 10``, best fit, ``max_images_per_row = 1``: a caption document
``[S P P E t t]`` (6 tokens, 1 image), then another ``[S P E t]`` (4 tokens, 1 image), then text
``[t t t t]``::

    doc 1 -> A[6, 1 image]     doc 2: A has room for its 4 tokens, not for a second image -> B[4, 1 image]
    text  -> A[6, 4] full, emit A (10 tokens, 1 image); B stays open
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any, Iterable, Mapping

import numpy as np

from ..errors import PipelineError, StateError
from ..records import IGNORE, INPUT_IDS, Doc, Flush, Row, TextRun, doc_tail, shifted_origin
from ..specs import PACK_ALGORITHMS
from .base import Accumulator, BindContext, LaneContext, LaneOperator, choice, positive_int
from .image_layout import (BIG, IMAGE_SPANS, NO_LIMITS, ImageLimits, ImageTooLarge, cut_points, patch_counts, piece,
                           safe_cut, spans_of, too_large)

class Pack(LaneOperator):
    """Pack documents into rows of ``seq_len`` tokens: ``best_fit``, ``first_fit`` or ``wrap`` (see the module
    docstring). The lane's last operator before ``batch``: its rows are the lane's rows.

    Args:
        seq_len: tokens per row (at least 2).
        algorithm: ``"best_fit"``, ``"first_fit"`` or ``"wrap"``.
        max_open_bins: open rows kept by best and first fit.
        pad_id: the id written on padding positions (None: the tokenizer's pad id).
        max_images_per_row, max_patches_per_row: what one row may give the vision encoder (None: no limit).
    """

    op = "pack"

    def __init__(self, seq_len: int, algorithm: str = "best_fit", max_open_bins: int = 16,
                 pad_id: int | None = None, max_images_per_row: int | None = None,
                 max_patches_per_row: int | None = None) -> None:
        super().__init__()
        positive_int(seq_len, "pack(seq_len=...)")
        if seq_len < 2:
            raise PipelineError(f"pack(seq_len={seq_len}): at least 2 tokens per row")
        for what, v in (("max_images_per_row", max_images_per_row), ("max_patches_per_row", max_patches_per_row)):
            if v is not None:
                positive_int(v, f"pack({what}=...)")
        choice(algorithm, PACK_ALGORITHMS, "pack(algorithm)")
        positive_int(max_open_bins, "pack(max_open_bins=...)")
        if pad_id is not None and (not isinstance(pad_id, int) or isinstance(pad_id, bool) or pad_id < 0):
            raise PipelineError(f"pack(pad_id={pad_id!r}): a non-negative token id is needed")
        self.seq_len, self.algorithm, self.pad_id = seq_len, algorithm, pad_id
        self.max_open_bins = max_open_bins if algorithm != "wrap" else None  # wrap keeps one open row
        self.max_images_per_row, self.max_patches_per_row = max_images_per_row, max_patches_per_row
        self._fields: Mapping[str, tuple[Any, Any]] = {INPUT_IDS: (np.int32, 0)}

    @property
    def limits(self) -> ImageLimits:
        """The per-row image limits."""
        return ImageLimits(self.max_images_per_row, self.max_patches_per_row)

    def bind(self, ctx: BindContext) -> "Pack":
        """A copy that packs every per-token field of the pipeline."""
        return self._bound(_fields=dict(ctx.token_fields) or {INPUT_IDS: (np.int32, 0)}, _provenance=ctx.provenance)

    def make(self, ctx: LaneContext) -> "Packer":
        return Packer(ctx, self.seq_len, self.algorithm, self.max_open_bins or 1, self._fields, self.limits,
                      getattr(self, "_provenance", False))


class Packer(Accumulator):
    """Turns documents into rows of ``seq_len`` tokens (see the module docstring).

    ``fields``: the per-token fields to pack, ``{name: (dtype, default)}`` with ``input_ids`` first (the
    pipeline collects them from what its operators produce); every other field of a document is a payload
    that travels with it. ``ctx.carry``: leading tokens to drop, the ``carry`` of the sentinel a
    resumed lane restarts at. ``limits``: the images and patches one row may hold (documents with images).
    ``provenance``: rows record each piece's origin (:mod:`zephon.origins`).
    """

    def __init__(self, ctx: LaneContext, seq_len: int, algorithm: str = "best_fit", max_open_bins: int = 16,
                 fields: Mapping[str, tuple[Any, Any]] | None = None, limits: ImageLimits | None = None,
                 provenance: bool = False) -> None:
        choice(algorithm, PACK_ALGORITHMS, "pack(algorithm)")
        if ctx.carry < 0:
            raise ValueError(f"carry must be >= 0, got {ctx.carry}")
        self.seq_len, self.algorithm = seq_len, algorithm
        self.max_open = 1 if algorithm == "wrap" else max_open_bins
        self.fields = dict(fields or {INPUT_IDS: (np.int32, 0)})
        self._names = tuple(self.fields)
        assert self._names[0] == INPUT_IDS
        self._defaults = {k: d for k, (_, d) in self.fields.items()}
        self._fieldset = frozenset(self.fields)
        self._place = self._wrap if algorithm == "wrap" else self._fit  # _bin_for tells best from first fit
        self._bins: list[Row] = []  # in opening order
        self._out: deque = deque()
        self._skip = ctx.carry
        self._held: Row | None = None  # part-filled last row of the segment before a sentinel
        self._held_flush: Flush | None = None
        self._taken = 0  # tokens of the new segment already put into the held row
        self._held_pushes = 0  # documents pushed since the row was held (the sentinel's ``release``)
        # a resumed packer completes, for the step clock, the row the original held over its sentinel where the
        # original released it: at the ``release``-th document, or at the next sentinel (0); -1: none was held
        self._clock, self._replay_release, self._pushes, self._carry = ctx.clock, ctx.release, 0, ctx.carry
        self.limits = limits or NO_LIMITS
        self._cap_images = BIG if self.limits.max_images is None else self.limits.max_images
        self._cap_patches = BIG if self.limits.max_patches is None else self.limits.max_patches
        self._flushing = False  # a row closed early while the open bins are wrapped up: a sentinel's cost
        self._provenance = provenance
        # the lane's batched text path (push_text_run) writes input_ids alone: only for a packer of nothing else
        self.takes_text_runs = len(self._names) == 1

    # -- emission -------------------------------------------------------------------------------
    def _new_bin(self) -> Row:
        if len(self._names) == 1:
            row = Row(self.seq_len, None, self._provenance)
        else:
            row = Row(self.seq_len, {k: np.empty(self.seq_len, dtype=dt) for k, (dt, _) in self.fields.items()},
                      self._provenance)
        self._bins.append(row)
        return row

    def _emit(self, row: Row, flushed: bool = False) -> None:
        row.flushed = flushed
        self._out.append(row)

    def _evict_fullest(self) -> None:
        frees = [row.free for row in self._bins]
        self._emit(self._bins.pop(frees.index(min(frees))))  # the first of the fullest, as min(key=) picks

    def _put(self, j: int, doc: Mapping[str, Any], a: int, b: int, tail: int) -> None:
        row = self._bins[j]
        row.add(doc, a, b, tail, self._names, self._defaults, self._fieldset)
        if row.free == 0:
            self._emit(self._bins.pop(j))

    # -- algorithms: place tokens [a, b) of a document whose last label is ``tail`` -----------------
    def _fit(self, doc: Mapping[str, Any], a: int, b: int, tail: int) -> None:
        if b > a:  # a document of no tokens has nothing to put in a row (wrap places none either)
            self._put(self._bin_for(b - a), doc, a, b, tail)

    def _bin_for(self, n: int) -> int:
        """The open bin that takes ``n`` tokens (best fit: the tightest; first fit: the oldest), or a new one
        when none has room (the fullest bin emitted first if ``max_open_bins`` are open)."""
        best, best_free = -1, self.seq_len + 1
        if self.algorithm == "best_fit":
            for j, row in enumerate(self._bins):
                free = row.free
                if n <= free < best_free:
                    best, best_free = j, free
                    if free == n:  # an exact fit: no bin is tighter, and later ties lose to this one
                        break
        else:
            best = next((j for j, row in enumerate(self._bins) if row.free >= n), -1)
        if best < 0:
            if len(self._bins) >= self.max_open:
                self._evict_fullest()
            self._new_bin()
            best = len(self._bins) - 1
        return best

    def _wrap(self, doc: Mapping[str, Any], a: int, n: int, tail: int) -> None:
        tokens = doc[INPUT_IDS]
        while a < n:
            row = self._bins[0] if self._bins else self._new_bin()
            b = min(n, a + row.free)
            self._put(0, doc, a, b, int(tokens[b]) if b < n else tail)
            a = b

    # -- documents with images (see the module docstring) ------------------------------------------------
    def _room(self, row: Row) -> tuple[int, int]:
        return self._cap_images - row.n_images, self._cap_patches - row.n_patches

    def _add_images(self, row: Row, doc: Mapping[str, Any], n: int, tail: int) -> None:
        """Put a whole document (or piece) with images into ``row``, counting its images and patches."""
        row.add(doc, 0, n, tail, self._names, self._defaults, self._fieldset)
        patches = patch_counts(doc)
        row.n_images += len(patches)
        row.n_patches += sum(patches)

    def _place_images(self, doc: Mapping[str, Any]) -> None:
        """Best or first fit of a document with images among the bins that have room for its tokens,
        images and patches (wrap: :meth:`_wrap_images`)."""
        if self.algorithm == "wrap":
            self._wrap_images(doc)
            return
        n, tail = len(doc[INPUT_IDS]), doc_tail(doc)
        patches = patch_counts(doc)
        k, p = len(patches), sum(patches)
        if n > self.seq_len or k > self._cap_images or p > self._cap_patches:  # not split to fit (no split)
            bounds = [0, *cut_points(doc[IMAGE_SPANS], patches, n, self.seq_len, self.limits), n]
            for a, b in zip(bounds[:-1], bounds[1:]):
                self._place_images(piece(doc, a, b, self._names))
            return
        best, best_free = -1, self.seq_len + 1
        for j, row in enumerate(self._bins):
            free = row.free
            if n <= free < best_free and row.n_images + k <= self._cap_images and row.n_patches + p <= self._cap_patches:
                best, best_free = j, free
                if self.algorithm == "first_fit" or free == n:
                    break
        if best < 0:
            if len(self._bins) >= self.max_open:
                self._evict_fullest()
            self._new_bin()
            best = len(self._bins) - 1
        row = self._bins[best]
        self._add_images(row, doc, n, tail)
        if row.free == 0:
            self._emit(self._bins.pop(best))

    def _wrap_images(self, doc: Mapping[str, Any]) -> None:
        """Wrap a document with images into the open row and new ones, cutting only between images; a row
        an image does not fit in (its tokens, or the row's image limits) is closed, padded."""
        ids, tail = doc[INPUT_IDS], doc_tail(doc)
        n, spans, patches = len(ids), doc[IMAGE_SPANS], patch_counts(doc)
        a = 0
        while a < n:
            row = self._bins[0] if self._bins else self._new_bin()
            b = safe_cut(spans, patches, a, min(n, a + row.free), *self._room(row))
            if b == a:
                if row.fill == 0:
                    k = int(np.searchsorted(spans[:, 0], a))
                    raise ImageTooLarge(too_large(spans[k], patches[k], self.seq_len, self.limits))
                self._emit(self._bins.pop(0), flushed=self._flushing)
                continue
            part = doc if (a, b) == (0, n) else piece(doc, a, b, self._names)
            self._add_images(row, part, b - a, int(ids[b]) if b < n else tail)
            if row.free == 0:
                self._emit(self._bins.pop(0))
            a = b

    def _top_up_images(self, doc: Mapping[str, Any], spans: np.ndarray) -> None:
        """:meth:`_top_up` for a document with images: the held row takes its tokens up to the last cut
        between images that fits; if that is not the whole document, the row is released (padded by what
        the image left) and the rest is placed as usual."""
        row, ids, tail = self._held, doc[INPUT_IDS], doc_tail(doc)
        assert row is not None
        n = len(ids)
        k = safe_cut(spans, patch_counts(doc), 0, min(n, row.free), *self._room(row))
        if k:
            self._add_images(row, doc if k == n else piece(doc, 0, k, self._names), k, int(ids[k]) if k < n else tail)
            self._taken += k
        if row.free == 0 or k < n:
            self._release()
            if k < n:
                self._place_images(doc if k == 0 else piece(doc, k, n, self._names))

    def _flush_bins(self) -> Row | None:
        """At a segment's end, wrap the open bins' pieces into rows; emit the full ones, return the part-filled one."""
        self._replay_at_sentinel()
        if self._held is not None:  # the segment ended before the held row filled: pad it now
            self._release(at_push=False)
        bins, self._bins = self._bins, []
        if self.algorithm == "wrap" or len(bins) <= 1:
            self._bins = bins
        else:
            self._flushing = True
            for seg in (seg for row in bins for seg in row.segments()):
                if spans_of(seg) is not None:
                    self._wrap_images(seg)
                else:
                    self._wrap(seg, 0, len(seg[INPUT_IDS]), seg.tail)
            self._flushing = False
        last = self._bins.pop() if self._bins else None
        assert not self._bins
        return last

    def _release(self, at_push: bool = True) -> None:
        """Emit the held row (padded if still part-filled) and forward its sentinel with the carry, and with
        when the row was released (``at_push``: by the document being pushed; else by the next sentinel)."""
        self._emit(self._held, flushed=True)
        self._out.append(replace(self._held_flush, carry=self._taken, release=self._held_pushes if at_push else 0))
        self._held, self._held_flush, self._taken, self._held_pushes = None, None, 0, 0

    def _replayed(self, n: int, skip_before: int) -> None:
        """A resumed packer's ``self._pushes``-th document (``n`` tokens, ``skip_before`` still to drop before it)
        against when the original released the row it held over the lane's last sentinel (``release``): there
        that row is complete for the step clock. The carry must agree with it: the original row took every token
        of the segment (release 0), or its last ones came from that document (release k), so the carry ends
        there; a carry that does not is refused, since the rebuilt lane would not continue as the original."""
        k = self._replay_release
        if k == 0 and n > skip_before or k > 0 and (self._pushes == k and self._skip or
                                                    self._pushes < k - 1 and not self._skip):
            raise self._carry_mismatch("the row held over it took every token of the segment after it" if k == 0 else
                                       f"the row held over it was released at document {k} after it")
        if self._pushes == k:
            self._complete_replayed_row()

    def _complete_replayed_row(self) -> None:
        self._replay_release = -1
        if self._clock is not None:
            self._clock.rows += 1

    def _carry_mismatch(self, why: str) -> StateError:
        return StateError(
            f"the checkpoint's carry ({self._carry} tokens after its last sentinel) does not agree with the data: "
            f"{why}, but the carry ends elsewhere. The sources now hold different data than when the checkpoint "
            f"was written (files changed or re-tokenized), or the state was edited. Resume on the same data, from "
            f"the state as it was written.")

    def _top_up(self, doc: Mapping[str, Any], tail: int) -> None:
        spans = spans_of(doc)
        if spans is not None:
            self._top_up_images(doc, spans)
            return
        row, n = self._held, len(doc[INPUT_IDS])
        if not n:
            return
        k = min(n, row.free)
        row.add(doc, 0, k, int(doc[INPUT_IDS][k]) if k < n else tail, self._names, self._defaults, self._fieldset)
        self._taken += k
        if row.free == 0:
            self._release()
            if k < n:
                self._place(doc, k, n, tail)

    # -- the accumulator contract ---------------------------------------------------------------------
    def push(self, doc: Mapping[str, Any]) -> Iterable[Any]:
        tail = getattr(doc, "tail", IGNORE)
        replaying, skip_before = self._replay_release >= 0, self._skip
        if not self._skip and self._held is None and IMAGE_SPANS not in doc:  # a text document, mid-segment
            self._place(doc, 0, len(doc[INPUT_IDS]), tail)
        elif self._skip:
            n = len(doc[INPUT_IDS])
            if n <= self._skip:
                self._skip -= n
            else:
                a, self._skip = self._skip, 0
                if spans_of(doc) is not None:
                    self._place_images(self._skipped_piece(doc, a, n))
                else:
                    self._place(doc, a, n, tail)
        elif self._held is not None:
            self._held_pushes += 1
            self._top_up(doc, tail)
        elif spans_of(doc) is not None:
            self._place_images(doc)
        else:
            self._place(doc, 0, len(doc[INPUT_IDS]), tail)
        if replaying:
            self._pushes += 1
            self._replayed(len(doc[INPUT_IDS]), skip_before)
        out = self._out
        if not out:
            return ()
        self._out = deque()
        return out

    def push_text_run(self, run: TextRun) -> tuple[int, Iterable[Any]]:
        """The lane's batched text path (:meth:`zephon.engine.nodes.MergeNode.feed`): the run's documents
        pushed one by one as :meth:`push` would, without a document object each, stopping after the first one
        that makes the packer emit (a completed row, or a bin closed to make room: the lane's step clock advances
        there, and the documents after it belong to the next decision) or that needs :meth:`push`'s whole logic
        (a skip or replay after a resume, a held row's top-up: a replay can complete a row for the clock without
        output). Only for a packer that :attr:`takes_text_runs` (its rows would lack the other fields).

        Args:
            run: documents of one source's chunk of plain token ids; the packer packs ``input_ids`` alone
                (:attr:`takes_text_runs`).

        Returns:
            ``(documents pushed, the rows and sentinels they released)``.
        """
        assert self.takes_text_runs, "push_text_run: this packer packs more fields than input_ids"
        ids, offs, k, stop, tails, origins, source = run
        for j in range(k, stop):
            a, b = offs[j], offs[j + 1]
            tail = IGNORE if tails is None else tails[j]
            origin = None if origins is None else origins[j]
            if not self._skip and self._held is None and self._replay_release < 0:
                self._place_text(ids[a:b], tail, source, origin)
                out = self._out
                if out:
                    self._out = deque()
            else:  # a resumed packer's skip or replay, a held row's top-up: the whole logic of push(), and the run
                # ends here: a replay may complete the held row for the step clock without any output
                return j + 1 - k, self.push(Doc({INPUT_IDS: ids[a:b]}, tail, source, origin))
            if out:
                return j + 1 - k, out
        return stop - k, ()

    def _place_text(self, ids: np.ndarray, tail: int, source: int, origin: tuple[int, int, int] | None) -> None:
        """:meth:`_place` for plain token ids (:meth:`push_text_run`): the same bins, rows and pieces."""
        bins = self._bins
        if self.algorithm != "wrap":
            if not len(ids):
                return
            j = self._bin_for(len(ids))
            row = bins[j]
            row.put(ids, tail, source, origin)
            if not row.free:
                self._emit(bins.pop(j))
            return
        a, n = 0, len(ids)
        while a < n:  # as _wrap
            row = bins[0] if bins else self._new_bin()
            b = min(n, a + row.free)
            row.put(ids[a:b], int(ids[b]) if b < n else tail, source, shifted_origin(origin, a))
            if not row.free:
                self._emit(bins.pop(0))
            a = b

    def _replay_at_sentinel(self) -> None:
        """The segment after the lane's last sentinel ends (a sentinel, or the end of finite data): a row the
        original held over that sentinel and released only now is complete; one it released at a document
        that never came means the data differ."""
        if self._replay_release == 0:
            self._complete_replayed_row()
        elif self._replay_release > 0:
            raise self._carry_mismatch(f"the row held over it was released at document {self._replay_release} "
                                       f"after it, and the segment holds {self._pushes}")

    def _skipped_piece(self, doc: Mapping[str, Any], a: int, n: int) -> Mapping[str, Any]:
        try:
            return piece(doc, a, n, self._names)
        except ValueError:
            raise StateError(
                f"the {a} tokens carried over from the checkpoint's last sentinel end inside an image of the first "
                "document after it, where the packer never cuts: the sources now hold different data than when the "
                "checkpoint was written, or the state's carry was edited. Resume on the same data, from the state as "
                "it was written.") from None

    def on_flush(self, flush: Flush) -> Iterable[Any]:
        """Emit what the bins hold, wrapped; hold the part-filled last row (and the sentinel) for the
        next segment's first tokens."""
        if self._skip:
            raise StateError(
                f"a flush sentinel (#{flush.index}) arrived while {self._skip} tokens carried over from the "
                "checkpoint's last sentinel were still to be skipped: the sources now hold different data than when "
                "the checkpoint was written (files changed or re-tokenized), or the state's carry was edited. "
                "Resume on the same data, from the state as it was written.")
        last = self._flush_bins()
        if last is None:
            self._out.append(flush)
        else:
            self._held, self._held_flush, self._taken, self._held_pushes = last, flush, 0, 0
        out, self._out = self._out, deque()
        return out

    def flush(self) -> Iterable[Any]:
        """Everything held, the last row padded: the end of a finite stream, where no next segment can
        top it up. A sentinel held with its row comes out after that row, as at a flush."""
        last = self._flush_bins()
        if last is not None:
            self._emit(last, flushed=True)
        out, self._out = self._out, deque()
        return out

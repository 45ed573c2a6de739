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

At a :class:`Flush` sentinel the packer must empty itself, so that after it it is as if new. Padding
every open bin would cost up to ``max_open_bins`` part-empty rows per flush; instead the pieces in the
open bins are taken in opening order and *wrapped* into rows (a piece cut at a row end keeps the next
token as its tail label). That leaves at most one part-filled row, and it is not padded either: it is
held, with the sentinel, and *topped up* with the first tokens that arrive after the sentinel (the
piece that overflows is cut; its head's tail label is the next token). Then the row is emitted and the
sentinel forwarded with ``carry`` = the number of post-sentinel tokens the row took. A packer rebuilt
at that sentinel (a resume) is given ``skip=carry`` and drops exactly those tokens, so it continues as
the original did. A flush therefore costs no padding at all, unless the segment after it holds fewer
tokens than the held row lacks: then the row is padded (``flush_pad_tokens``) when the next sentinel
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
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any

from torchdata.nodes import BaseNode

from .items import Flush, LaneCounters, Row


class Packer(BaseNode):
    """Turns a document stream (with sentinels) into a row stream (with sentinels)."""

    def __init__(self, upstream: BaseNode, seq_len: int, algorithm: str, max_open_bins: int,
                 counters: LaneCounters, skip: int = 0) -> None:
        """``skip``: leading input tokens to drop, the ``carry`` of the sentinel this packer resumes at."""
        super().__init__()
        if skip < 0:
            raise ValueError(f"skip must be >= 0, got {skip}")
        self.upstream, self.seq_len, self.algorithm, self.skip = upstream, seq_len, algorithm, skip
        self.max_open = 1 if algorithm == "wrap" else max_open_bins
        self.counters = counters
        self._place = {"best_fit": self._best_fit, "first_fit": self._first_fit, "wrap": self._wrap}[algorithm]

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._bins: list[Row] = []  # in opening order
        self._out: deque = deque()
        self._skip = self.skip
        self._held: Row | None = None  # part-filled last row of the segment before a sentinel
        self._held_flush: Flush | None = None
        self._taken = 0  # tokens of the new segment already put into the held row

    def get_state(self) -> dict[str, Any]:
        return {}

    # -- emission -------------------------------------------------------------------------------
    def _emit(self, row: Row, flushed: bool = False) -> None:
        row.flushed = flushed
        c = self.counters
        c.rows += 1
        c.pad_tokens += row.free
        if flushed:
            c.flush_pad_tokens += row.free
        self._out.append(row)

    def _new_bin(self) -> Row:
        row = Row(self.seq_len)
        self._bins.append(row)
        return row

    def _evict_fullest(self) -> None:
        j = min(range(len(self._bins)), key=lambda k: self._bins[k].free)
        self._emit(self._bins.pop(j))

    def _put(self, j: int, tokens, tail: int) -> None:
        row = self._bins[j]
        row.add(tokens, tail)
        if row.free == 0:
            self._emit(self._bins.pop(j))

    # -- algorithms -----------------------------------------------------------------------------
    def _best_fit(self, tokens, tail: int) -> None:
        n, best, best_free = len(tokens), -1, self.seq_len + 1
        for j, row in enumerate(self._bins):
            free = row.free
            if n <= free < best_free:
                best, best_free = j, free
                if free == n:  # an exact fit: no bin is tighter, and later ties lose to this one
                    break
        if best >= 0:  # straight to _put: this runs once per document
            self._put(best, tokens, tail)
        else:
            self._place_or_open(best, tokens, tail)

    def _first_fit(self, tokens, tail: int) -> None:
        n = len(tokens)
        first = next((j for j, row in enumerate(self._bins) if row.free >= n), -1)
        self._place_or_open(first, tokens, tail)

    def _place_or_open(self, j: int, tokens, tail: int) -> None:
        if j < 0:
            if len(self._bins) >= self.max_open:
                self._evict_fullest()
            self._new_bin()
            j = len(self._bins) - 1
        self._put(j, tokens, tail)

    def _wrap(self, tokens, tail: int) -> None:
        a, n = 0, len(tokens)
        while a < n:
            row = self._bins[0] if self._bins else self._new_bin()
            b = min(n, a + row.free)
            self._put(0, tokens[a:b], int(tokens[b]) if b < n else tail)
            a = b

    def _flush_bins(self) -> Row | None:
        """Wrap the open bins' pieces into rows; emit the full ones, return the part-filled last one."""
        bins, self._bins = self._bins, []
        if self.algorithm == "wrap" or len(bins) <= 1:
            self._bins = bins
        else:
            for tokens, tail in (seg for row in bins for seg in row.segments()):
                self._wrap(tokens, tail)
        last = self._bins.pop() if self._bins else None
        assert not self._bins
        return last

    def _release(self) -> None:
        """Emit the held row (padded if still part-filled) and forward its sentinel with the carry."""
        self._emit(self._held, flushed=True)
        self._out.append(replace(self._held_flush, carry=self._taken))
        self._held, self._held_flush, self._taken = None, None, 0

    def _on_flush(self, flush: Flush) -> None:
        if self._skip:
            raise RuntimeError(
                f"a flush sentinel (epoch {flush.epoch}) arrived while {self._skip} tokens carried over from "
                "the checkpoint's last sentinel were still to be skipped: the sources now hold different data "
                "than when the checkpoint was written (files changed or re-tokenized). Resume on the same data.")
        if self._held is not None:  # the segment ended before the held row filled: pad it now
            self._release()
        last = self._flush_bins()
        if last is None:
            self._out.append(flush)
        else:
            self._held, self._held_flush, self._taken = last, flush, 0

    def _top_up(self, tokens, tail: int) -> None:
        row, n = self._held, len(tokens)
        k = min(n, row.free)
        row.add(tokens[:k], int(tokens[k]) if k < n else tail)
        self._taken += k
        if row.free == 0:
            self._release()
            if k < n:
                self._place(tokens[k:], tail)

    def _skip_head(self, tokens, tail: int) -> None:
        n = len(tokens)
        if n <= self._skip:
            self._skip -= n
            return
        tokens, self._skip = tokens[self._skip:], 0
        self._place(tokens, tail)

    # -- node -----------------------------------------------------------------------------------
    def next(self) -> Any:
        while not self._out:
            try:
                item = next(self.upstream)
            except StopIteration:  # a finite input: release a held row rather than lose it
                if self._held is None:
                    raise
                self._release()
                break
            if isinstance(item, Flush):
                self._on_flush(item)
            elif self._skip:
                self._skip_head(*item)
            elif self._held is not None:
                self._top_up(*item)
            else:
                self._place(*item)
        return self._out.popleft()

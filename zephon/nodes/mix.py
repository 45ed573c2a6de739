"""Deterministic per-lane mixing, document splitting, and the origin of flush sentinels.

The mixer is the lane's first accumulator. It takes *pieces* (documents, cut into runs of at most
``piece_len`` tokens) from each source's chunk stream in order and decides, by integer arithmetic
alone, which source gives the next piece: weighted fair queueing (WF2Q, as in EEVDF schedulers) over
the integer weights ``w_s`` (sum ``W``). Each source has a counter ``c_s`` (tokens or documents taken
since the last flush, ``t`` their sum) and a stride ``m_s = M / w_s`` (``M`` the lcm of the weights).
A source is *eligible* when it is not ahead of its share (``c_s * W <= t * w_s``); among the eligible
ones the next piece comes from the one whose next piece would be due first (smallest
``(c_s + 1) * m_s``), lowest index on ties. After any prefix each source's count is within one
document (by documents) or two pieces (by tokens) of its exact share: the mixture is exact over every
window, not a random draw, even with very long documents. Without the eligibility rule (plain stride
scheduling) every source would take a document in the first round, whatever its weight: weights
1/1/1/7 would drift by more than two documents. A piece that is not its document's last carries the
next token as its tail label.

Worked example, weights 0.7/0.3 by documents (integer weights 7 and 3, M = 21, strides 3 and 7)::

    picks: web code web web code web web code web web | web code ... (7 web and 3 code in every 10)

The mixer also tracks where each source's reader stands, ``(unit_seq, cursor, offset)`` (the
cursor at the current document, and tokens of it already taken), and counts
completed units. Every ``flush_every`` completed units it emits a :class:`Flush` sentinel carrying
those positions, resets its counters, and starts choosing afresh, exactly as a mixer built from the
positions would. A choice interrupted by a flush (an empty unit completed while looking for a
document) is dropped and made again after the flush, for the same reason.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Sequence

import numpy as np
from torchdata.nodes import BaseNode

from ..readers import SourceError
from ..runner import TokenizedChunk
from .items import IGNORE, Flush, LaneCounters


def integer_weights(weights: Sequence[float]) -> list[int]:
    """The weights as the smallest exact integers in the same ratios (``0.7, 0.3 -> 7, 3``)."""
    fracs = [Fraction(w).limit_denominator(10_000) for w in weights]
    denom = math.lcm(*(f.denominator for f in fracs))
    ints = [int(f * denom) for f in fracs]
    g = math.gcd(*ints)
    return [i // g for i in ints]


def integer_strides(weights: Sequence[float]) -> list[int]:
    """Strides ``m_s`` with ``m_s * w_s`` equal for all sources, as small exact integers."""
    ints = integer_weights(weights)
    m = math.lcm(*ints)
    return [m // i for i in ints]


class Mixer(BaseNode):
    """Interleaves per-source chunk streams into one document stream with flush sentinels."""

    def __init__(self, streams: Sequence[BaseNode[TokenizedChunk]], weights: Sequence[float], by: str,
                 flush_every: int, epoch: int, positions: Sequence[tuple[int, int]],
                 counters: LaneCounters, names: Sequence[str], max_empty_units: Sequence[int],
                 piece_len: int) -> None:
        super().__init__()
        self.piece_len = piece_len
        self.streams = list(streams)
        self.weights = integer_weights(weights)
        self.strides = integer_strides(weights)
        self.total_weight = sum(self.weights)
        self.by_tokens = by == "tokens"
        self.flush_every = flush_every
        self.names = list(names)
        self.max_empty_units = list(max_empty_units)
        self.counters = counters
        self._epoch = epoch
        self._positions = [tuple(p) for p in positions]

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self._epoch = int(initial_state["epoch"])
            self._positions = [tuple(p) for p in initial_state["positions"]]
        n = len(self.streams)
        for s, stream in enumerate(self.streams):
            stream.reset({"unit_seq": self._positions[s][0], "cursor": self._positions[s][1]})
        self._cur: list[TokenizedChunk | None] = [None] * n
        # the current chunk's offsets and cursors as Python lists: read once per document, and numpy
        # scalar indexing per document would cost more than the rest of the decision
        self._offs: list[list[int]] = [[] for _ in range(n)]
        self._cursors: list[list[int]] = [[] for _ in range(n)]
        self._idx = [0] * n
        self._offset = [p[2] for p in self._positions]  # tokens of the current document already taken
        self._taken = [0] * n
        self._units_done = 0
        self._empty_run = [0] * n  # consecutive units of a source that gave no document
        self._queued: list[Any] = []

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "positions": [list(p) for p in self._positions]}

    # -- decisions ------------------------------------------------------------------------------
    def _choose(self) -> int:
        taken, total, big_w = self._taken, sum(self._taken), self.total_weight
        best, best_key = -1, 0
        for s, (w, m) in enumerate(zip(self.weights, self.strides)):
            if taken[s] * big_w <= total * w:  # eligible: not ahead of its share (one always is)
                key = (taken[s] + 1) * m
                if best < 0 or key < best_key:
                    best, best_key = s, key
        return best

    def _finish_chunk(self, s: int, chunk: TokenizedChunk) -> bool:
        """Book the end of ``chunk``; True when it completes the unit that makes a flush due."""
        self._cur[s] = None
        self.counters.skipped_records += chunk.skipped
        if not chunk.unit_end:
            self._positions[s] = (chunk.unit_seq, chunk.end_cursor, 0)
            return False
        self._positions[s] = (chunk.unit_seq + 1, -1, 0)
        self.counters.units += 1
        self._units_done += 1
        return self._units_done % self.flush_every == 0

    def _take(self, s: int) -> tuple[np.ndarray | None, int, bool]:
        """Next piece of source ``s``, its tail label, and whether a flush is due after it
        (piece None: due before it)."""
        while True:
            chunk = self._cur[s]
            if chunk is None:
                chunk = self._cur[s] = next(self.streams[s])
                self._idx[s] = 0
                if chunk.n_docs == 0:
                    self._empty_run[s] += int(chunk.unit_end)
                    if self._empty_run[s] > self.max_empty_units[s]:
                        raise SourceError(f"source '{self.names[s]}' gave no document in "
                                          f"{self._empty_run[s]} consecutive units: all its records are "
                                          f"empty, null or filtered. Check text_field and your filters.")
                    if self._finish_chunk(s, chunk):
                        return None, IGNORE, True
                    continue
                self._offs[s] = chunk.offsets.tolist()
                self._cursors[s] = chunk.next_cursors.tolist()
            self._empty_run[s] = 0
            k, offs = self._idx[s], self._offs[s]
            hi = offs[k + 1]
            a = offs[k] + self._offset[s]
            b = min(hi, a + self.piece_len)
            piece = chunk.tokens[a:b]
            if b < hi:  # the document goes on: stay on it, label the cut with the true next token
                self._offset[s] += b - a
                start = self._cursors[s][k - 1] if k else chunk.start_cursor
                self._positions[s] = (chunk.unit_seq, start, self._offset[s])
                self.counters.pieces_split += 1
                return piece, int(chunk.tokens[b]), False
            self._offset[s] = 0
            self._idx[s] = k + 1
            if k + 2 == len(offs):  # the chunk's last document
                return piece, IGNORE, self._finish_chunk(s, chunk)
            self._positions[s] = (chunk.unit_seq, self._cursors[s][k], 0)
            return piece, IGNORE, False

    def _flush(self) -> Flush:
        self._epoch += 1
        self._taken = [0] * len(self._taken)
        self._units_done = 0
        self.counters.flushes += 1
        return Flush(self._epoch, tuple(self._positions))

    def next(self) -> Any:
        if self._queued:
            return self._queued.pop()
        s = self._choose() if len(self.streams) > 1 else 0  # one source is always eligible
        doc, tail, flush_due = self._take(s)
        if doc is None:
            return self._flush()
        n = len(doc)
        self._taken[s] += n if self.by_tokens else 1
        c = self.counters
        c.docs += tail == IGNORE
        c.doc_tokens += n
        c.source_tokens[self.names[s]] = c.source_tokens.get(self.names[s], 0) + n
        if flush_due:
            self._queued.append(self._flush())
        return (doc, tail)

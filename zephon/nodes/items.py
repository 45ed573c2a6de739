"""What flows between a lane's operators: documents, packed rows and flush sentinels.

A document is a plain tuple ``(tokens, tail)``: ``tokens`` an int32 view, ``tail`` the label of its
last position (``IGNORE`` at a document end; the next token when a long document was split and its
continuation lives in another row). Plain tuples keep per-document overhead off the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

IGNORE = -100  # label value where no loss is due (PyTorch's cross-entropy ignore_index)

Doc = tuple  # (np.ndarray[int32], int)


@dataclass(frozen=True)
class Flush:
    """Sentinel: every operator emits what it holds for the lane, then forwards it.

    ``epoch`` numbers the segment that starts after this sentinel; ``positions`` is where each
    source's reader stands at that point, as ``(unit_seq, cursor, offset)`` per source index.
    ``carry`` is set by the packer: how many tokens from after the sentinel it put into the last row
    before it (so that row needs no padding). A lane rebuilt from ``(epoch, positions, carry)``
    produces exactly what the original lane produced after the sentinel.
    """

    epoch: int
    positions: tuple[tuple[int, ...], ...]
    carry: int = 0


class Row:
    """One packed row of at most ``seq_len`` tokens: its documents' lengths and tail labels."""

    __slots__ = ("tokens", "fill", "free", "seg_lens", "tails", "flushed")

    def __init__(self, seq_len: int) -> None:
        self.tokens = np.empty(seq_len, dtype=np.int32)
        self.fill = 0
        self.free = seq_len
        self.seg_lens: list[int] = []
        self.tails: list[int] = []
        self.flushed = False  # closed by a flush sentinel (its padding is a sentinel cost)

    def add(self, tokens: np.ndarray, tail: int) -> None:
        n = len(tokens)
        self.tokens[self.fill:self.fill + n] = tokens
        self.fill += n
        self.free -= n
        self.seg_lens.append(n)
        self.tails.append(tail)

    def segments(self) -> list[tuple[np.ndarray, int]]:
        """The row's pieces as ``(tokens, tail)`` documents, in row order."""
        out, a = [], 0
        for n, tail in zip(self.seg_lens, self.tails):
            out.append((self.tokens[a:a + n], tail))
            a += n
        return out


@dataclass
class LaneCounters:
    """Running totals of one lane, for metrics (not part of the checkpoint)."""

    docs: int = 0
    doc_tokens: int = 0
    pieces_split: int = 0
    rows: int = 0
    pad_tokens: int = 0
    flush_pad_tokens: int = 0
    flushes: int = 0
    units: int = 0
    skipped_records: int = 0
    source_tokens: dict = field(default_factory=dict)

    def clear(self) -> None:
        """Zero every counter in place (the operators of the lane hold this same object)."""
        for name, value in vars(LaneCounters()).items():
            setattr(self, name, value)

"""Running totals of one lane, for metrics (never part of a checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass
class LaneCounters:
    """What one lane did since it was (re)built: documents, tokens, rows, sentinels, units, skips."""

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
    skipped_by_reason: dict = field(default_factory=dict)  # blank_records, filtered_records, failed_records...

    def add_counts(self, counts: Mapping[str, int]) -> None:
        for k, v in counts.items():
            self.skipped_by_reason[k] = self.skipped_by_reason.get(k, 0) + v

    def clear(self) -> None:
        """Zero every counter in place (the lane's nodes hold this same object)."""
        for name, value in vars(LaneCounters()).items():
            setattr(self, name, value)

    def merge(self, other: "LaneCounters") -> None:
        """Add ``other``'s totals to these."""
        for k, v in vars(other).items():
            if isinstance(v, dict):
                mine = getattr(self, k)
                for name, n in v.items():
                    mine[name] = mine.get(name, 0) + n
            else:
                setattr(self, k, getattr(self, k) + v)

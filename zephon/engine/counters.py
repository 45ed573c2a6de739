"""Running totals of one lane, for metrics (never part of a checkpoint)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Mapping

WINDOW_DOCS = 1024  # documents per lane in a window of the realised mixture (metrics)


@dataclass
class LaneCounters:
    """What one lane did since it was (re)built: documents, tokens, rows, sentinels, units, skips."""

    docs: int = 0
    doc_tokens: int = 0
    pieces_split: int = 0
    rows: int = 0
    flushes: int = 0
    units: int = 0
    skipped_records: int = 0
    source_tokens: dict = field(default_factory=dict)
    skipped_by_reason: dict = field(default_factory=dict)  # blank_records, filtered_records, failed_records...
    skipped_by_source: dict = field(default_factory=dict)  # (source name, reason) -> count: the same, per source
    window_docs: int = 0  # documents taken in the current window of WINDOW_DOCS
    window_tokens: dict = field(default_factory=dict)  # per source, in the current window
    last_window_tokens: dict = field(default_factory=dict)  # per source, in the last complete window

    def count_window(self, source: str, tokens: int, docs: int = 1) -> None:
        """Per-source tokens over windows of about WINDOW_DOCS documents: the realised mixture lately
        (booked a few documents at a time, so a window ends at the first booking that reaches it)."""
        self.window_tokens[source] = self.window_tokens.get(source, 0) + tokens
        self.window_docs += docs
        if self.window_docs >= WINDOW_DOCS:
            self.last_window_tokens, self.window_tokens, self.window_docs = self.window_tokens, {}, 0

    def add_counts(self, counts: Mapping[str, int], source: str | None = None) -> None:
        for k, v in counts.items():
            self.skipped_by_reason[k] = self.skipped_by_reason.get(k, 0) + v
            if source is not None:
                key = (source, k)
                self.skipped_by_source[key] = self.skipped_by_source.get(key, 0) + v

    def clear(self) -> None:
        """Zero every counter in place (the lane's nodes hold this same object)."""
        for name, value in vars(LaneCounters()).items():
            setattr(self, name, value)

    def followed_by(self, later: "LaneCounters") -> "LaneCounters":
        """These counts, then ``later``'s (a lane's workers restarted and counting from zero): the totals
        added; the windows of documents (the realised mixture lately) ``later``'s once it has any."""
        out = copy.deepcopy(self)
        out.merge(later)
        out.window_docs, out.window_tokens = later.window_docs, dict(later.window_tokens)
        recent = later if later.last_window_tokens or later.window_tokens else self
        out.last_window_tokens = dict(recent.last_window_tokens)
        return out

    def merge(self, other: "LaneCounters") -> None:
        """Add ``other``'s totals to these."""
        for k, v in vars(other).items():
            if k in ("window_docs", "window_tokens"):
                continue
            if isinstance(v, dict):
                mine = getattr(self, k)
                for name, n in v.items():
                    mine[name] = mine.get(name, 0) + n
            else:
                setattr(self, k, getattr(self, k) + v)

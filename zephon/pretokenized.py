"""Pre-tokenized sources on the workers: token rows in, framed documents out, no tokenizer call.

A source with ``tokens_field`` holds token ids already (a list column in Parquet or Vortex, an ndarray
column in MDS, a numpy/tensor leaf in LitData chunks). Its reader returns :class:`TokenRows`; here the
rows become exactly what :meth:`Tokenizer.encode` makes of text: each kept document's ids, framed with
the recipe's BOS/EOS (:meth:`Tokenizer.frame`), as one flat int32 array plus offsets. Everything is
vectorised with numpy. The tokenizer is still loaded, for its special ids, pad id and vocabulary size:
an id outside ``[0, vocab_size)`` is an error naming the file and the row.

Null and empty rows are skipped and counted, like null and blank texts. ``text_map`` / ``text_filter``
are text hooks: they apply to text sources only.
"""

from __future__ import annotations

import numpy as np

from .readers.base import RawChunk, SourceError
from .tokenizer import Tokenizer


def frame_token_rows(tokenizer: Tokenizer, raw: RawChunk, source: str, path: str
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """``(tokens int32, offsets int64 [k+1], next_cursors int64 [k], raw_records, skipped)`` of a chunk."""
    rows = raw.tokens
    assert rows is not None
    n = len(rows)
    lengths = np.diff(rows.offsets)
    keep = lengths > 0
    if rows.valid is not None:
        keep &= rows.valid
    values = rows.values
    if not keep.all():
        values = values[np.repeat(keep, lengths)]
    kept_lengths = lengths[keep]
    if len(values):
        lo, hi = values.min(), values.max()
        if lo < 0 or hi >= tokenizer.vocab_size:
            bad = int(np.flatnonzero((values < 0) | (values >= tokenizer.vocab_size))[0])
            k = int(np.searchsorted(np.cumsum(kept_lengths), bad, side="right"))
            row = int(raw.next_cursors[np.flatnonzero(keep)[k]]) - 1
            raise SourceError(f"source '{source}': {path}, row {row}: token id {int(values[bad])} is outside the "
                              f"tokenizer's vocabulary [0, {tokenizer.vocab_size}) ({tokenizer.spec.path}). The "
                              f"rows were tokenized with another tokenizer: re-tokenize them or point the recipe "
                              f"at the tokenizer that made them.")
    tokens, offsets = tokenizer.frame(values.astype(np.int32, copy=False), kept_lengths.astype(np.int64))
    cursors = raw.next_cursors[keep]
    kept = int(keep.sum())
    return tokens, offsets, cursors, n, n - kept

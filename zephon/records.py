"""What flows through a pipeline: records, documents, chunks of records, packed rows, sentinels.

- A **record** is a dict of named fields: ``str``, ``bytes``, numpy arrays, scalars, lists, nested
  dicts. Readers yield the columns a source asks for; stateless transforms map records to records.
- A **document** (:class:`Doc`) is a record after tokenization: a dict whose *per-token* fields
  (``input_ids`` and any others the pipeline declares, e.g. ``loss_mask``) are 1-D arrays of one
  common length, and whose other fields are per-document payloads (a URL, images...). It also knows
  the label of its last position (``tail``: ``IGNORE`` at a document's end, the next token when a
  long document was split and goes on in the next piece) and which source it came from.
- A **chunk** (:class:`Chunk`) is the unit of stateless work: the records of one read task, kept
  columnar (one list or array per field; per-token fields flat with shared offsets), so that a
  tokenizer, a codec or numpy is called once per chunk, not once per record. Each record carries its
  *resume point*, the reader position to restart from just after it (see :class:`Chunk`).
- A **row** (:class:`Row`) is one packed sequence: every per-token field of its documents side by
  side, their lengths and tail labels, and their payloads.
- A **sentinel** (:class:`Flush`) marks a point of a lane's stream after which every operator is as
  if freshly built; it carries the reader positions there.

Worked example: a chunk of two JSONL lines ``{"text": "a b c", "url": "u1"}`` and
``{"text": "d", "url": "u2"}`` read from bytes ``[0, 40)``, after ``tokenize`` (EOS id 2)::

    columns      = {"url": ["u1", "u2"]}
    token_fields = {"input_ids": [5, 6, 7, 2, 8, 2]}, offsets = [0, 4, 6]
    resume       = cursors [29, 40], skips [0, 0]        # restart after line 1 at byte 29
    tails        = [-100, -100]

``split(max_tokens=3)`` then makes three documents: ``[5, 6, 7]`` (tail 2, resume ``(0, 1)``: re-read
from byte 0 and skip one output), ``[2]`` (resume ``(29, 0)``) and ``[8, 2]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

IGNORE = -100
"""The label where no loss is due: padding, document ends, masked positions (PyTorch's cross-entropy
``ignore_index``)."""
INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"


class Doc(dict):
    """A document in a lane: a dict of fields, plus its last label (``tail``), its source index and, when
    the pipeline records provenance, its ``origin``.

    ``Doc`` is a plain ``dict`` to every operator; ``copy()`` keeps ``tail``, ``source`` and ``origin``. A
    record rebuilt as a new ``dict`` (``{**doc, ...}``) is still accepted downstream, with ``tail`` taken as
    ``IGNORE`` (a document end), no source and no origin.

    Args:
        fields: the document's fields (``input_ids``, other per-token fields, payloads).
        tail: the label after its last token: ``IGNORE`` at a document's end, else the next token (a piece
            cut from a longer document).
        source: the index of the source it came from (-1: unknown).
        origin: where it comes from (:mod:`zephon.origins`): ``(file_id, record, token_start)``, the file it
            was read from, where its record starts there, and where its tokens start within the record's
            document (0 unless it is a piece of a longer one); None when provenance is off or unknown.
    """

    __slots__ = ("tail", "source", "origin")

    def __init__(self, fields: Mapping[str, Any] = (), tail: int = IGNORE, source: int = -1,
                 origin: tuple[int, int, int] | None = None) -> None:
        super().__init__(fields)
        self.tail = tail
        """The label after its last token (``IGNORE`` at a document's end)."""
        self.source = source
        """The index of the source it came from (-1: unknown)."""
        self.origin = origin
        """``(file_id, record, token_start)`` when the pipeline records provenance, else None."""

    def copy(self) -> "Doc":
        """A shallow copy that keeps ``tail``, ``source`` and ``origin`` (``dict.copy`` would return a plain dict).

        Returns:
            The copy (its values are the same objects).
        """
        return Doc(self, self.tail, self.source, doc_origin(self))

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={_short(v)}" for k, v in self.items())
        return f"Doc({inner}, tail={self.tail}, source={self.source})"


def _short(v: Any) -> str:
    if isinstance(v, np.ndarray):
        return f"array({v.dtype}[{len(v)}])" if v.ndim == 1 else f"array({v.dtype}{list(v.shape)})"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def doc_tail(record: Any) -> int:
    return getattr(record, "tail", IGNORE)


def doc_source(record: Any) -> int:
    return getattr(record, "source", -1)


def doc_origin(record: Any, shift: int = 0) -> tuple[int, int, int] | None:
    """A document's ``origin`` (None for a plain dict or when provenance is off), its token start moved
    ``shift`` tokens on: the origin of the piece of it that starts at token ``shift``."""
    return shifted_origin(getattr(record, "origin", None), shift)


def shifted_origin(origin: tuple[int, int, int] | None, shift: int) -> tuple[int, int, int] | None:
    """The origin of the piece that starts ``shift`` tokens into a document of origin ``origin`` (None: none)."""
    if origin is None or not shift:
        return origin
    return origin[0], origin[1], origin[2] + shift


def doc_length(record: Mapping[str, Any]) -> int:
    """Tokens of a document (the length of its ``input_ids``)."""
    return len(record[INPUT_IDS])


def cut_doc(doc: Mapping[str, Any], k: int, token_fields: Sequence[str]) -> tuple[Doc, Doc]:
    """Split a document after its ``k``-th token: the head's tail label is the next token (the
    document goes on), the rest keeps the original tail. Payloads go with both pieces."""
    source = doc_source(doc)
    head = Doc(doc, int(doc[INPUT_IDS][k]), source, doc_origin(doc))
    rest = Doc(doc, doc_tail(doc), source, doc_origin(doc, k))
    for name in token_fields:
        if name in doc:
            values = doc[name]
            head[name], rest[name] = values[:k], values[k:]
    return head, rest


@dataclass
class TokenColumn:
    """A column of token-id lists as one flat array plus offsets (pre-tokenized sources).

    Row ``k`` holds ``values[offsets[k]:offsets[k+1]]``; a null row has ``valid[k] = False``.
    """

    values: np.ndarray  # integer [T]
    offsets: np.ndarray  # int64 [n+1], offsets[0] == 0
    valid: np.ndarray | None = None  # bool [n]; None: no null rows

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, k: int) -> np.ndarray | None:
        if self.valid is not None and not self.valid[k]:
            return None
        return self.values[int(self.offsets[k]):int(self.offsets[k + 1])]

    def take(self, keep: np.ndarray) -> "TokenColumn":
        """The rows at the (sorted) indices ``keep``."""
        lengths = np.diff(self.offsets)
        mask = np.zeros(len(lengths), dtype=bool)
        mask[keep] = True
        values = self.values[np.repeat(mask, lengths)]
        offsets = np.zeros(len(keep) + 1, dtype=np.int64)
        np.cumsum(lengths[keep], out=offsets[1:])
        return TokenColumn(values, offsets, None if self.valid is None else self.valid[keep])

    def to_pylist(self) -> list[np.ndarray | None]:
        return [None if self.valid is not None and not self.valid[k] else self.values[a:b]
                for k, (a, b) in enumerate(zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist()))]


def _take(column: Any, keep: np.ndarray) -> Any:
    if isinstance(column, np.ndarray):
        return column[keep]
    if isinstance(column, TokenColumn):
        return column.take(keep)
    return [column[i] for i in keep.tolist()]


def renumber_skips(cursor: np.ndarray, skip: np.ndarray) -> np.ndarray:
    """Resume skips recounted over the records as they now are: a record with skip > 0 is the ``s``-th record
    made from its cursor, where ``s`` counts it and the records with the same cursor (and skip > 0) right
    before it. Operators that drop records (``filter``, blank documents) or cut them again (``split``
    after ``flat_map``) keep the rule of :class:`Chunk` with this; a record with skip 0 resumes after
    itself and keeps it. Example: cursors ``[7, 7, 7, 9]``, skips ``[1, 1, 2, 0]`` (a piece cut again)
    become ``[1, 2, 3, 0]``."""
    n = len(skip)
    if not n:
        return skip
    piece = skip > 0
    same = np.zeros(n, dtype=bool)
    same[1:] = piece[:-1] & (cursor[1:] == cursor[:-1])
    index = np.arange(n, dtype=np.int64)
    run_start = np.maximum.accumulate(np.where(piece & ~same, index, 0))
    return np.where(piece, index - run_start + 1, 0).astype(np.int64)


@dataclass
class Chunk:
    """The records of one read task of one source, columnar, with what the lane needs to track them.

    ``columns`` holds per-record fields (lists, arrays or :class:`TokenColumn`), ``token_fields`` the
    per-token fields of documents (flat, sharing ``offsets``; empty before tokenization).

    Resume points: after record ``j`` the reader restarts at ``resume_cursor[j]`` and drops the first
    ``resume_skip[j]`` records that the stateless operators make from there. A record that is a whole
    input record (or its last piece) resumes at the reader's cursor after it with skip 0; the ``i``-th
    of several pieces made from one input record resumes where its predecessor did, skipping one more.
    Operators that turn one record into several (``flat_map``, ``split``) keep this rule
    (:meth:`expand`), which is what lets a lane checkpoint between two pieces of one document.
    """

    source: int
    unit_seq: int
    unit_end: bool
    start_cursor: int
    end_cursor: int
    path: str
    columns: dict[str, Any]
    resume_cursor: np.ndarray  # int64 [n]
    resume_skip: np.ndarray  # int64 [n]
    raw_records: int = 0
    skipped: int = 0  # records dropped by the stateless operators (blank, filtered, failed, empty)
    token_fields: dict[str, np.ndarray] = field(default_factory=dict)
    offsets: np.ndarray | None = None  # int64 [n+1] when token_fields is not empty
    tails: np.ndarray | None = None  # int64 [n]; None: all IGNORE
    counts: dict[str, int] = field(default_factory=dict)  # named counters of the stateless work
    coord: str = "record"  # what a cursor counts in this source ("row", "byte", "line"), for messages
    skip_pending: int = 0  # records a resumed lane already delivered: dropped after the last stage
    source_name: str = ""  # the source's name (``source`` is its index), for messages
    # provenance (zephon.origins), only when the pipeline records it: each record's (record start cursor,
    # token start within its document), int64 [n, 2], and the id of the chunk's file
    origin: np.ndarray | None = None
    file_id: int = -1

    @property
    def n(self) -> int:
        return len(self.resume_cursor)

    def count(self, name: str, k: int = 1) -> None:
        if k:
            self.counts[name] = self.counts.get(name, 0) + k

    def where(self, j: int) -> str:
        """``"<path>, row 12"``: where record ``j`` comes from (the reader cursor where it starts), for error
        messages."""
        return f"{self.path}, {self.coord} {int(self.resume_cursor[j - 1]) if j else self.start_cursor}"

    # -- selection and expansion ------------------------------------------------------------------
    def select(self, keep: np.ndarray, renumber: bool = True) -> "Chunk":
        """Only the records at the sorted indices ``keep`` (dropped ones are counted as skipped).

        The kept records' resume skips are recounted (:func:`renumber_skips`): a record an operator drops is
        not made again on a resume. ``renumber=False`` keeps them: for records dropped because they were
        delivered before a checkpoint, which the skips still count."""
        keep = np.asarray(keep, dtype=np.int64)
        if len(keep) == self.n:
            return self
        tf, offsets = self.token_fields, self.offsets
        if tf:
            assert offsets is not None
            lengths = np.diff(offsets)
            mask = np.zeros(self.n, dtype=bool)
            mask[keep] = True
            per_token = np.repeat(mask, lengths)
            tf = {k: v[per_token] for k, v in tf.items()}
            offsets = np.zeros(len(keep) + 1, dtype=np.int64)
            np.cumsum(lengths[keep], out=offsets[1:])
        cursor, skip = self.resume_cursor[keep], self.resume_skip[keep]
        if renumber:
            skip = renumber_skips(cursor, skip)
        return replace(self, columns={k: _take(v, keep) for k, v in self.columns.items()},
                       resume_cursor=cursor, resume_skip=skip,
                       skipped=self.skipped + self.n - len(keep), token_fields=tf, offsets=offsets,
                       tails=None if self.tails is None else self.tails[keep],
                       origin=None if self.origin is None else self.origin[keep])

    def expand_origin(self, counts: np.ndarray, token_starts: np.ndarray | None = None) -> None:
        """Provenance of the records made when record ``j`` becomes ``counts[j]`` records (as :meth:`expand`):
        each keeps its input record's origin; ``token_starts`` (split): where each new record's tokens start
        within the input record's, added to its token start. A no-op when provenance is off."""
        if self.origin is None:
            return
        origin = np.repeat(self.origin, np.asarray(counts, dtype=np.int64), axis=0)
        if token_starts is not None:
            origin[:, 1] += token_starts
        self.origin = origin

    def expand(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Resume points of the records made when record ``j`` becomes ``counts[j]`` records.

        Returns ``(resume_cursor, resume_skip)`` for the new records, in order. A record that makes no
        output is dropped (its successors then resume from the cursor before it, which re-reads it and
        finds it makes nothing, so the rule still holds).
        """
        counts = np.asarray(counts, dtype=np.int64)
        rc, rs = self.resume_cursor, self.resume_skip
        made = counts > 0
        # the pieces before a record's last are made from the reader record it comes from: its own cursor if
        # it is itself a piece (skip > 0), else where the last record before it that made output resumes
        prev_c = np.empty_like(rc)
        prev_c[:1] = self.start_cursor
        if made.all():  # split: every record makes at least one piece
            prev_c[1:] = rc[:-1]
        else:
            last_made = np.maximum.accumulate(np.where(made, np.arange(len(counts), dtype=np.int64), -1))
            prev_c[1:] = np.where(last_made[:-1] >= 0, rc[np.maximum(last_made[:-1], 0)], self.start_cursor)
        cursor = np.repeat(np.where(rs != 0, rc, prev_c), counts)
        csum = np.cumsum(counts)
        ends = csum[made] - 1  # each record's last piece resumes where the record did
        if rs.any():
            skip = np.ones(len(cursor), dtype=np.int64)
            cursor[ends], skip[ends] = rc[made], rs[made]
            return cursor, renumber_skips(cursor, skip)
        # whole input records (every skip 0, e.g. split right after tokenize): a record's pieces before its
        # last count 1, 2, ... from their cursor, and a record's last piece (skip 0) ends every such run
        skip = np.arange(len(cursor), dtype=np.int64) - np.repeat(csum - counts, counts) + 1
        cursor[ends], skip[ends] = rc[made], 0
        return cursor, skip

    # -- records view (for per-record operators) ---------------------------------------------------
    def records(self) -> list[dict[str, Any]]:
        """The chunk as a list of record dicts (per-token fields as array views)."""
        names = list(self.columns)
        cols = [self.columns[k].to_pylist() if isinstance(self.columns[k], TokenColumn) else self.columns[k]
                for k in names]
        out = [dict(zip(names, values)) for values in zip(*cols)] if names else [{} for _ in range(self.n)]
        for name, values in self.token_columns().items():
            for rec, value in zip(out, values):
                rec[name] = value
        return out

    def token_columns(self) -> dict[str, list[np.ndarray]]:
        """The per-token fields as columns: one array view per record."""
        if not self.token_fields:
            return {}
        assert self.offsets is not None
        bounds = list(zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist()))
        return {name: [flat[a:b] for a, b in bounds] for name, flat in self.token_fields.items()}

    def docs(self) -> Iterator[Doc]:
        """The chunk's documents as :class:`Doc` objects (tail labels, source index and origin attached)."""
        tails = self.tails.tolist() if self.tails is not None else None
        origin = self.origin.tolist() if self.origin is not None else None
        for j, rec in enumerate(self.records()):
            yield Doc(rec, IGNORE if tails is None else tails[j], self.source,
                      None if origin is None else (self.file_id, *origin[j]))


class TokenFieldError(ValueError):
    """A record whose per-token fields do not line up (:func:`columns_from_records`): ``record`` is its index."""

    def __init__(self, record: int, message: str) -> None:
        super().__init__(message)
        self.record = record


def columns_from_records(records: Sequence[Mapping[str, Any]], token_fields: Sequence[str] = (),
                         defaults: Mapping[str, tuple[Any, Any]] | None = None
                         ) -> tuple[dict[str, Any], dict[str, np.ndarray], np.ndarray | None]:
    """Records back to columns: ``(columns, token_fields, offsets)``. Keys are the union in order of
    first appearance (a record without a key gets ``None``); ``token_fields`` present in the records
    are concatenated with shared offsets, so each must have one value per token of its record's ``input_ids``.
    A record without one of them (or with None) gets the default of ``defaults[name]`` (``(dtype, default)``)
    at every token.

    Raises:
        TokenFieldError: a record's per-token field has another length than its ``input_ids``, or is missing
            where ``defaults`` has none for it.
    """
    keys = dict.fromkeys(k for rec in records for k in rec)
    tnames = [k for k in keys if k in token_fields]
    columns = {k: [rec.get(k) for rec in records] for k in keys if k not in token_fields}
    if not tnames:
        return columns, {}, None
    first = INPUT_IDS if INPUT_IDS in tnames else tnames[0]
    defaults = defaults or {}
    tf, lengths = {}, None
    for name in [first] + [k for k in tnames if k != first]:
        arrays = []
        for j, rec in enumerate(records):
            value = rec.get(name)
            if value is None:
                if lengths is None or name not in defaults:
                    raise TokenFieldError(j, f"the record has no {name!r}, which other records have: give every record "
                                             f"one" + ("" if name == first else
                                                       f" (or declare its default: token_fields={{{name!r}: ...}})"))
                dtype, default = defaults[name]
                value = np.full(int(lengths[j]), default, dtype=dtype)
            arrays.append(np.asarray(value))
        got = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
        if lengths is None:
            lengths = got
        elif (got != lengths).any():
            j = int(np.flatnonzero(got != lengths)[0])
            raise TokenFieldError(j, f"its per-token field {name!r} has {int(got[j])} values for {int(lengths[j])} "
                                     f"tokens of {first}: every per-token field needs one value per token")
        # an empty field ([] is float64 to numpy) adds no values and must not decide the dtype of the others; nor
        # may integers of several dtypes become floats (numpy's type for uint64 with int32)
        parts = [a for a in arrays if a.size]
        dtype = np.result_type(*parts) if parts else np.dtype(np.int32)
        if dtype.kind == "f" and all(a.dtype.kind in "iub" for a in parts):
            dtype = np.dtype(np.int64)
        tf[name] = np.concatenate(parts, dtype=dtype, casting="unsafe") if parts else np.zeros(0, dtype=np.int32)
    assert lengths is not None
    offsets = np.zeros(len(records) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return columns, {k: tf[k] for k in tnames}, offsets


@dataclass(frozen=True)
class Flush:
    """Sentinel: every operator emits what it holds for the lane, then forwards it.

    ``index`` counts the lane's sentinels (the segment that starts after this one); ``positions`` is
    where each source's reader stands there, ``(unit_seq, cursor, skip)`` per source index. ``carry`` is
    set by an accumulator that tops up its last output with the first tokens after the sentinel (the
    packer): how many it took; ``release`` says when that held output was released: after that many
    documents had reached the packer past the sentinel (``k >= 1``), at the next sentinel (0), or no
    output was held (-1), for the step clock (:mod:`zephon.engine.clock`). A lane rebuilt from
    ``(index, positions, carry, release)`` produces exactly what the original lane produced after it.
    """

    index: int
    """How many sentinels the lane has passed with this one: the segment that starts after it."""
    positions: tuple[tuple[int, int, int], ...]
    """Where each source's reader stands: ``(unit_seq, cursor, skip)`` per source index."""
    carry: int = 0
    """How many of the first tokens after the sentinel topped up the packer's last row."""
    release: int = -1
    """When the held row was released: after that many documents past the sentinel, at the next sentinel
    (0), or no row was held (-1)."""
    taken: tuple[int, ...] = field(default=(), compare=False)
    """The chunks each source had given the lane: a replay hint (speed only)."""


class TextRun(NamedTuple):
    """Documents ``first`` to ``stop - 1`` of a source's open chunk of plain token ids (no other field): the
    lane's batched text path (:meth:`zephon.engine.nodes.MergeNode.feed`, :meth:`zephon.ops.pack.Packer.push_text_run`).
    Document ``j`` is ``ids[offsets[j]:offsets[j + 1]]``, with its last label ``tails[j]`` (None: all ``IGNORE``)
    and its origin ``origins[j]`` (None: provenance off)."""

    ids: np.ndarray
    offsets: list[int]
    first: int
    stop: int
    tails: list[int] | None
    origins: list[tuple[int, int, int]] | None
    source: int


class Row:
    """One packed row of at most ``seq_len`` tokens: every per-token field side by side, the lengths,
    tail labels, sources and payloads of its documents (pieces), and their origins when ``provenance``."""

    __slots__ = ("buffers", "tokens", "fill", "free", "seg_lens", "tails", "sources", "origins", "payloads",
                 "flushed", "n_images", "n_patches")

    def __init__(self, seq_len: int, buffers: dict[str, np.ndarray] | None = None, provenance: bool = False) -> None:
        self.buffers = buffers if buffers is not None else {INPUT_IDS: np.empty(seq_len, dtype=np.int32)}
        self.tokens = self.buffers[INPUT_IDS]
        self.fill = 0
        self.free = seq_len
        self.seg_lens: list[int] = []
        self.tails: list[int] = []
        self.sources: list[int] = []  # each piece's source index (-1: unknown), for the realised mixture
        # each piece's (file_id, record, token_start) or None (zephon.origins): only when the pipeline records it
        self.origins: list[tuple[int, int, int] | None] | None = [] if provenance else None
        self.payloads: list[dict[str, Any]] | None = None
        self.flushed = False  # closed by a flush sentinel (its padding is a sentinel cost)
        self.n_images = self.n_patches = 0  # the images its documents carry (kept by the packer, for its limits)

    def put(self, ids: np.ndarray, tail: int, source: int = -1, origin: tuple[int, int, int] | None = None,
            payload: dict[str, Any] | None = None) -> None:
        """Append a piece's ``input_ids`` at ``fill`` (its other per-token fields are already written there),
        with its length, tail label, source, origin (kept when the row records provenance) and payload (None
        or empty: none). A piece of plain token ids comes straight here (the packer's batched text path)."""
        n = len(ids)
        f = self.fill
        self.tokens[f:f + n] = ids
        self.fill = f + n
        self.free -= n
        self.seg_lens.append(n)
        self.tails.append(tail)
        self.sources.append(source)
        if self.origins is not None:
            self.origins.append(origin)
        if payload:
            if self.payloads is None:
                self.payloads = [{} for _ in range(len(self.seg_lens) - 1)]
            self.payloads.append(payload)
        elif self.payloads is not None:
            self.payloads.append({})

    def add(self, doc: Mapping[str, Any], a: int, b: int, tail: int, fields: Sequence[str] = (INPUT_IDS,),
            defaults: Mapping[str, Any] | None = None, fieldset: frozenset = frozenset((INPUT_IDS,))) -> None:
        """Append tokens ``[a, b)`` of a document (a piece of it, or all): every per-token field in
        ``fields`` (``input_ids`` first) at ``fill``; its other fields (``fieldset``: the per-token
        ones) are its payload, kept aside; ``tail`` is the label of its last position."""
        if len(fields) > 1:
            f, n = self.fill, b - a
            for name in fields[1:]:
                buf = self.buffers[name]
                values = doc.get(name)
                if values is not None:  # its length and dtype checked where it was made (zephon.ops.fields)
                    buf[f:f + n] = values[a:b]
                else:
                    buf[f:f + n] = defaults[name]  # type: ignore[index]
        # a text document has input_ids alone: no payload
        payload = {k: v for k, v in doc.items() if k not in fieldset} if len(doc) > 1 else None
        self.put(doc[INPUT_IDS][a:b], tail, getattr(doc, "source", -1),
                 doc_origin(doc, a) if self.origins is not None else None, payload)

    def segments(self) -> list[Doc]:
        """The row's pieces as documents (views of its buffers), in row order, with their sources and
        origins."""
        out, a = [], 0
        for i, (n, tail) in enumerate(zip(self.seg_lens, self.tails)):
            doc = Doc(self.payloads[i] if self.payloads else (), tail, self.sources[i],
                      self.origins[i] if self.origins is not None else None)
            for name, buf in self.buffers.items():
                doc[name] = buf[a:a + n]
            out.append(doc)
            a += n
        return out

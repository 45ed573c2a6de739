"""Multimodal packing: documents with images split and packed by tokens, images never cut, limits per row.

Synthetic documents (no codec needed): every token id is unique in a stream, and every image's pixels
name the token its span starts with, so a row that holds an image's pixels must hold exactly that image's
tokens. Hypothesis places the documents, images and flush sentinels; the packer is driven as a lane drives
it (:class:`zephon.engine.nodes.AccumulatorNode`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchdata.nodes import IterableWrapper

from zephon import SourceError
from zephon.engine.nodes import AccumulatorNode
from zephon.ops.base import LaneContext
from zephon.ops.image_layout import ImageLimits, ImageTooLarge, cut_points, piece, safe_cut
from zephon.ops.pack import Packer
from zephon.errors import StateError
from zephon.ops.split import Split
from zephon.records import IGNORE, Chunk, Doc, Flush, Row, columns_from_records
from zephon.testing import check_accumulator

FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FIELDS = {"input_ids": (np.int32, 0), "loss_mask": (np.uint8, 1)}
DIM = 6  # bytes per synthetic patch


class Stream:
    """Builds documents of text runs and images; token ids count up through the whole stream."""

    def __init__(self) -> None:
        self.next_id = 10

    def doc(self, parts: list[Any], delimiters: bool = True) -> Doc:
        """``parts``: ints (a run of text tokens) and ``(a, b)`` (an image of grid (1, 2a, 2b), merge 2: a*b
        pad tokens, 4ab patches)."""
        ids: list[int] = []
        images, grids, spans = [], [], []
        for part in parts:
            if isinstance(part, int):
                ids += range(self.next_id, self.next_id + part)
                self.next_id += part
                continue
            a, b = part
            start = len(ids)
            n = a * b + 2 * delimiters
            ids += range(self.next_id, self.next_id + n)
            self.next_id += n
            first = start + delimiters
            spans.append((start, first, first + a * b, start + n))
            grids.append((1, 2 * a, 2 * b))
            img = np.zeros((4 * a * b, DIM), dtype=np.uint8)
            img[:, :4] = np.frombuffer(np.int32(ids[start]).tobytes(), np.uint8)  # names its first token
            images.append(img)
        doc = Doc({"input_ids": np.asarray(ids, dtype=np.int32),
                   "loss_mask": np.ones(len(ids), dtype=np.uint8), "id": int(ids[0]) if ids else -1})
        if images:
            doc.update({"images": images, "image_grid_thw": grids,
                        "image_spans": np.asarray(spans, dtype=np.int32).reshape(-1, 4)})
        return doc


def owner(img: np.ndarray) -> int:
    return int(np.frombuffer(img[0, :4].tobytes(), np.int32)[0])


part_st = st.one_of(st.integers(1, 12), st.tuples(st.integers(1, 3), st.integers(1, 3)))
doc_st = st.lists(part_st, min_size=1, max_size=6)
segments_st = st.lists(st.lists(doc_st, max_size=8), min_size=1, max_size=4)


def build(segments: list[list[list[Any]]]) -> tuple[list[Any], list[Doc]]:
    s = Stream()
    items, docs = [], []
    for e, seg in enumerate(segments):
        for parts in seg:
            docs.append(s.doc(parts))
            items.append(docs[-1])
        items.append(Flush(e + 1, ()))
    return items, docs


def split_items(items: list[Any], max_tokens: int, limits: ImageLimits) -> list[Any]:
    sp = Split(max_tokens)
    sp._token_names, sp._limits = tuple(FIELDS), limits
    return [x for item in items for x in ([item] if isinstance(item, Flush) else sp._apply_records([item]))]


def run(acc: Any, items: list[Any]) -> list[Any]:
    node = AccumulatorNode(IterableWrapper(items), lambda ctx: acc, "pack", LaneContext(0, 0))
    out = []
    while True:
        try:
            out.append(next(node))
        except StopIteration:
            return out


def canon(item: Any) -> Any:
    if isinstance(item, Flush):
        return ("flush", item.index, item.carry)
    h = hashlib.sha256()
    for p in item.payloads or ():
        for img in p.get("images", ()):
            h.update(img.tobytes())
        h.update(np.asarray(p.get("image_spans", np.zeros((0, 4)))).astype(np.int64).tobytes())
    return (item.tokens[:item.fill].tolist(), list(item.seg_lens), list(item.tails), item.flushed, h.hexdigest())


def check_rows(rows: list[Row], docs: list[Doc], limits: ImageLimits, seq_len: int) -> None:
    """Every token and every image exactly once, each image in the row and piece that hold its tokens,
    whole, with the limits respected."""
    tokens = np.concatenate([r.tokens[:r.fill] for r in rows]) if rows else np.zeros(0, np.int32)
    expected = np.concatenate([d["input_ids"] for d in docs]) if docs else np.zeros(0, np.int32)
    assert np.array_equal(np.sort(tokens), np.sort(expected))
    spans_of_first = {int(d["input_ids"][s[0]]): (int(d["input_ids"][s[0]]), int(s[3] - s[0]))
                      for d in docs for s in d.get("image_spans", ())}
    seen: list[int] = []
    for r in rows:
        assert 0 < r.fill <= seq_len and sum(r.seg_lens) == r.fill
        images = patches = 0
        at = 0
        for n, tail, p in zip(r.seg_lens, r.tails, r.payloads or [{}] * len(r.seg_lens)):
            seg = r.tokens[at:at + n]
            assert np.all(np.diff(seg) == 1)  # a contiguous run of one document
            assert tail == IGNORE or tail == seg[-1] + 1
            for img, grid, span in zip(p.get("images", ()), p.get("image_grid_thw", ()), p.get("image_spans", ())):
                first, length = spans_of_first[owner(img)]
                assert int(seg[span[0]]) == first and span[3] - span[0] == length  # its whole span, here
                assert span[0] >= 0 and span[3] <= n
                assert img.shape[0] == grid[0] * grid[1] * grid[2]
                seen.append(owner(img))
                images += 1
                patches += img.shape[0]
            # no image token of this piece without its image: every pad run here has its payload
            at += n
        assert limits.max_images is None or images <= limits.max_images
        assert limits.max_patches is None or patches <= limits.max_patches
    assert sorted(seen) == sorted(spans_of_first)  # every image once: none lost, none duplicated


limits_st = st.builds(ImageLimits, st.one_of(st.none(), st.integers(1, 4)), st.one_of(st.none(), st.integers(36, 80)))


@FAST
@given(segments=segments_st, seq_len=st.integers(16, 48), algorithm=st.sampled_from(["best_fit", "first_fit", "wrap"]),
       max_bins=st.integers(1, 4), limits=limits_st)
def test_packing_loses_and_duplicates_no_token_or_image_and_respects_limits(segments, seq_len, algorithm, max_bins,
                                                                           limits):
    items, docs = build(segments)
    fed = items if algorithm == "wrap" else split_items(items, seq_len, limits)
    out = run(Packer(LaneContext(0, 0), seq_len, algorithm, max_bins, FIELDS, limits), fed)
    check_rows([x for x in out if isinstance(x, Row)], docs, limits, seq_len)


@FAST
@given(segments=segments_st, seq_len=st.integers(16, 48), algorithm=st.sampled_from(["best_fit", "first_fit", "wrap"]),
       max_bins=st.integers(1, 4), limits=limits_st, lane=st.integers(0, 7))
def test_packer_with_images_after_a_flush_equals_a_fresh_packer_given_the_carry(segments, seq_len, algorithm, max_bins,
                                                                              limits, lane):
    """The replay state: a packer rebuilt at any sentinel with that sentinel's ``carry`` emits the same rows,
    pixels included, as the packer that ran through it."""
    items, _ = build(segments)
    fed = items if algorithm == "wrap" else split_items(items, seq_len, limits)

    def make(segment: int, carry: int) -> Pack:
        return Packer(LaneContext(3, lane, segment, carry=carry), seq_len, algorithm, max_bins, FIELDS, limits)

    whole = run(make(0, 0), fed)
    outs = [(i, x) for i, x in enumerate(whole) if isinstance(x, Flush)]
    ins = [(i, x) for i, x in enumerate(fed) if isinstance(x, Flush)]
    assert [f.index for _, f in outs] == [f.index for _, f in ins]
    for (i_out, f_out), (i_in, f_in) in zip(outs, ins):
        fresh = run(make(f_in.index, f_out.carry), fed[i_in + 1:])
        assert [canon(x) for x in fresh] == [canon(x) for x in whole[i_out + 1:]], f"after sentinel {f_in.index}"


@FAST
@given(segments=segments_st, seq_len=st.integers(16, 48), algorithm=st.sampled_from(["best_fit", "first_fit", "wrap"]),
       max_bins=st.integers(1, 4))
def test_a_flush_pads_a_row_only_where_an_image_would_be_cut(segments, seq_len, algorithm, max_bins):
    """Without per-row limits, a row closed by a flush (the wrap-up of the open bins, the held row) is
    padded by less than the span of the image that did not fit. Each segment ends with a row's worth of
    text, so that the held row never waits for tokens a short segment lacks (that padding, the same as for
    text, is not the images' cost)."""
    items, docs = build([seg + [[seq_len]] for seg in segments])
    fed = items if algorithm == "wrap" else split_items(items, seq_len, ImageLimits())
    out = run(Packer(LaneContext(0, 0), seq_len, algorithm, max_bins, FIELDS), fed)
    rows = [x for x in out if isinstance(x, Row)]
    longest = max([int(s[3] - s[0]) for d in docs for s in d.get("image_spans", ())] + [1])
    for k, r in enumerate(rows):
        if r.flushed and k < len(rows) - 1:  # the last row is padded at the end of the (finite) input
            assert r.free < longest, (r.free, longest)


def test_text_only_rows_keep_a_free_flush():
    """Documents without images behave exactly as before: wrapping the open bins at a flush and topping
    the held row up costs no padding."""
    s = Stream()
    items = [s.doc([5]), s.doc([7]), s.doc([6]), Flush(1, ()), s.doc([9]), s.doc([9]), Flush(2, ())]
    out = run(Packer(LaneContext(0, 0), 8, "best_fit", 3, FIELDS), split_items(items, 8, ImageLimits()))
    rows = [x for x in out if isinstance(x, Row)]
    assert sum(r.free for r in rows[:-1]) == 0 and [x.carry for x in out if isinstance(x, Flush)][0] > 0


def test_worked_example_of_the_packer_docstring():
    s = Stream()
    d1, d2, text = s.doc([(1, 2), 2]), s.doc([(1, 1), 1]), s.doc([4])
    assert [len(d["input_ids"]) for d in (d1, d2, text)] == [6, 4, 4]
    pack = Packer(LaneContext(0, 0), 10, "best_fit", 4, FIELDS, ImageLimits(max_images=1))
    assert list(pack.push(d1)) == [] and list(pack.push(d2)) == []
    assert len(pack._bins) == 2  # doc 2 fits A's tokens, not its image limit  # noqa: SLF001
    (row,) = pack.push(text)
    assert row.fill == 10 and row.n_images == 1 and row.seg_lens == [6, 4]
    (rest,) = pack.flush()
    assert rest.seg_lens == [4] and rest.n_images == 1


def test_worked_example_of_the_layout_docstring():
    s = Stream()
    doc = s.doc([2, (1, 2), 3, (1, 2), 1])
    spans = doc["image_spans"]
    assert spans[:, [0, 3]].tolist() == [[2, 6], [9, 13]] and len(doc["input_ids"]) == 14
    assert cut_points(spans, [8, 8], 14, 8) == [8]
    assert cut_points(spans, [8, 8], 14, 10) == [9]
    assert cut_points(spans, [8, 8], 14, 14, ImageLimits(max_images=1)) == [9]
    assert cut_points(spans, [8, 8], 14, 14, ImageLimits(max_patches=12)) == [9]
    second = piece(doc, 9, 14, tuple(FIELDS))
    assert second["image_spans"].tolist() == [[0, 1, 3, 4]] and owner(second["images"][0]) == doc["input_ids"][9]
    assert second.tail == IGNORE and piece(doc, 0, 9, ("input_ids",)).tail == doc["input_ids"][9]
    with pytest.raises(ValueError, match="cuts image"):
        piece(doc, 0, 4, ("input_ids",))
    assert safe_cut(spans, [8, 8], 0, 14, max_images=0) == 2
    with pytest.raises(ImageTooLarge, match="max_pixels"):
        cut_points(spans, [8, 8], 14, 3)


@FAST
@given(docs=st.lists(doc_st, min_size=1, max_size=8), max_tokens=st.integers(6, 30), limits=limits_st)
def test_split_of_a_chunk_equals_split_of_its_records(docs, max_tokens, limits):
    """The vectorised split (a chunk on the workers) and the per-record one (after the merge) cut the same
    pieces with the same images and the same resume points."""
    s = Stream()
    records = [s.doc(p) for p in docs]
    sp = Split(max_tokens)
    sp._token_names, sp._limits = tuple(FIELDS), limits
    try:
        per_record = [sp._apply_records([r.copy()]) for r in records]
    except SourceError:
        return
    by_record = [x for pieces in per_record for x in pieces]
    columns, tf, offsets = columns_from_records(records, tuple(FIELDS))
    n = len(records)
    chunk = Chunk(0, 0, True, 0, n, "mem", columns, np.arange(1, n + 1, dtype=np.int64), np.zeros(n, np.int64),
                  token_fields=tf, offsets=offsets)
    out = sp._apply_chunk(chunk)
    pieces = list(out.docs())
    assert len(pieces) == len(by_record)
    for a, b in zip(pieces, by_record):
        assert a["input_ids"].tolist() == b["input_ids"].tolist() and a.tail == b.tail
        assert [owner(x) for x in a.get("images") or []] == [owner(x) for x in b.get("images") or []]
        sa, sb = a.get("image_spans"), b.get("image_spans")
        assert (sa is None or not len(sa)) == (sb is None or not len(sb))
        if sa is not None and len(sa):
            assert np.array_equal(sa, sb)
    counts = np.asarray([len(p) for p in per_record])
    plain = Chunk(0, 0, True, 0, n, "mem", {}, np.arange(1, n + 1, dtype=np.int64), np.zeros(n, np.int64))
    cursor, skip = plain.expand(counts)  # what split promises: the rule of Chunk.expand
    assert out.resume_cursor.tolist() == cursor.tolist() and out.resume_skip.tolist() == skip.tolist()


def test_an_image_larger_than_a_row_is_an_error_that_names_the_fix():
    s = Stream()
    doc = s.doc([2, (3, 3), 2])  # 11 tokens with its delimiters
    sp = Split(8)
    sp._token_names = tuple(FIELDS)
    with pytest.raises(SourceError, match="lower decode_images|Lower decode_images"):
        sp._apply_records([doc])
    with pytest.raises(ImageTooLarge):
        run(Packer(LaneContext(0, 0), 8, "wrap", 1, FIELDS), [doc])
    with pytest.raises(ImageTooLarge, match="max_patches_per_row"):
        run(Packer(LaneContext(0, 0), 64, "best_fit", 2, FIELDS, ImageLimits(max_patches=20)), [doc])


def test_a_carry_that_ends_inside_an_image_is_refused():
    s = Stream()
    doc = s.doc([2, (2, 2), 3])
    with pytest.raises(StateError, match="inside an image"):
        run(Packer(LaneContext(0, 0, carry=4), 16, "best_fit", 2, FIELDS), [doc])


class RowsAsRecords:
    """The packer, its rows given as plain records (check_accumulator compares records by content)."""

    def __init__(self, pack: Pack) -> None:
        self.pack = pack

    @staticmethod
    def _plain(rows: Any) -> list[dict]:
        return [{"tokens": r.tokens[:r.fill].copy(), "seg_lens": list(r.seg_lens), "tails": list(r.tails),
                 "payloads": [{k: v for k, v in p.items()} for p in (r.payloads or [])]} for r in rows]

    def push(self, record: Any) -> list[dict]:
        return self._plain(self.pack.push(record))

    def flush(self) -> list[dict]:
        return self._plain(self.pack.flush())


@pytest.mark.parametrize("algorithm", ["best_fit", "wrap"])
def test_the_packer_with_images_passes_the_public_accumulator_check(algorithm):
    s = Stream()
    records = split_items([s.doc([3, (1, 2), 2]), s.doc([(2, 2)]), s.doc([5]), s.doc([(1, 1), 4, (1, 3)]),
                           s.doc([9]), s.doc([(2, 1), 1])] * 2, 16, ImageLimits(2, 40))
    check_accumulator(lambda ctx: RowsAsRecords(Packer(ctx, 16, algorithm, 3, FIELDS, ImageLimits(2, 40))), records,
                      max_examples=30)

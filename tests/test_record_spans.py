"""The batched record-rows path (zephon/ops/batch.py: RecordSpan, RecordBlock; Mixer.take_run; join_rows):
where nothing per record sits between the sources and ``batch()``, a lane passes runs of records as spans
of their chunk and the batch joins them by column. It must deliver the per-record path's batches byte for
byte: the reference here is the same pipeline with an identity accumulator before ``batch()``, which keeps
the per-record path (a ``Doc`` and a ``RecordRow`` per record), compared by SHA-256 of every global batch
across world sizes 1/2/4, thread and process runners, finite sources with padding, and resumes on another
world size.
"""

from __future__ import annotations

import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import zephon as z
from tests.optional import require
from zephon.batches.records import collate_records
from zephon.ops.batch import RecordBlock, RecordRow, RecordSpan
from zephon.ops.mix import Mixer
from zephon.verify import global_hashes

from .vision_data import build_dataset, pictures

PIL = require("PIL")
STEPS = 14


@pytest.fixture(scope="module")
def data(tmp_path_factory, corpus_texts):
    return build_dataset(tmp_path_factory.mktemp("spans"), corpus_texts, pictures())


class Identity:
    """Passes every record on as it is: keeps a pipeline on the per-record path."""

    def push(self, record):
        return (record,)

    def flush(self):
        return ()


def pairs(data, lanes: int = 8, rows: int = 3, passes: int | None = None, partial: str = "drop",
          tok=None, per_record: bool = False, stack: bool = False) -> z.Pipeline:
    """Image-caption pairs from two sources (WebDataset and Parquet), mixed by documents (by tokens, their
    captions tokenized with ``tok``), batched as records."""
    pipe = (z.Pipeline(seed=7, lanes=lanes, flush_every=2)
            .source("wds", z.read.webdataset(str(data["wds"]), columns=["image=jpg;png", "txt"], chunk_rows=5),
                    weight=2, passes=passes)
            .source("hf", z.read.parquet(str(data["hf"]), columns=["image", "caption"], chunk_rows=4), passes=passes)
            .map(_caption_as_txt, version="1")
            .filter(_has_image_bytes))
    if stack:
        pipe = pipe.decode_images("image", size=28, patchify=False, on_bad_image="drop_record")
    if tok is not None:
        pipe = pipe.tokenize(tok, field="txt")
    pipe = pipe.mix(by="documents" if tok is None else "tokens")
    if per_record:
        pipe = pipe.accumulate(Identity, version="1")
    return pipe.batch(rows_per_lane=rows, partial=partial, stack=["images"] if stack else ())


def _caption_as_txt(r: dict) -> dict:
    if "caption" in r:
        image = r["image"]
        return {"image": image.get("bytes") if isinstance(image, dict) else image, "txt": r["caption"]}
    return r


def _has_image_bytes(r: dict) -> bool:
    return bool(r.get("image"))


def test_the_span_path_is_taken_and_the_per_record_path_kept_where_an_operator_needs_records(data):
    """A step's rows come as one RecordBlock of spans; with an accumulator before batch(), as rows."""
    loader = pairs(data).build()
    blocks = [loader._prepare_step()[0] for _ in range(4)]
    assert all(type(rows) is RecordBlock for rows in blocks)
    spans = [p for rows in blocks for p in rows.parts]
    assert all(type(p) is RecordSpan for p in spans) and max(len(p) for p in spans) > 1
    loader.close()
    loader = pairs(data, per_record=True).build()
    rows, _ = loader._prepare_step()
    assert type(rows) is list and all(type(r) is RecordRow for r in rows)
    loader.close()


@pytest.fixture(scope="module")
def reference(data):
    return global_hashes(pairs(data, per_record=True), 1, STEPS)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_spans_equal_the_per_record_path_on_every_world_size(data, reference, world):
    assert global_hashes(pairs(data), world, STEPS) == reference


@pytest.mark.parametrize("world,workers,runner", [(2, 2, "thread"), (4, 1, "process"), (1, 2, "pool")])
def test_spans_equal_the_per_record_path_on_every_runner(data, reference, world, workers, runner):
    assert global_hashes(pairs(data), world, STEPS, num_workers=workers, runner=runner) == reference


@pytest.mark.parametrize("world,new_world,at,workers,runner", [(1, 4, 5, 0, "thread"), (4, 2, 9, 0, "thread"),
                                                               (2, 1, 7, 1, "process")])
def test_spans_resume_on_another_world_size(data, reference, world, new_world, at, workers, runner):
    assert global_hashes(pairs(data), world, STEPS, num_workers=workers, runner=runner, resume_at=at,
                         resume_world_size=new_world) == reference


def test_finite_sources_padding_rows_and_their_resume(data):
    """Sources that stop: lanes end at different steps and give padding rows (partial="pad")."""
    ref = global_hashes(pairs(data, passes=1, partial="pad", per_record=True), 1, 400)
    assert 3 < len(ref) < 400
    assert global_hashes(pairs(data, passes=1, partial="pad"), 2, 400) == ref
    assert global_hashes(pairs(data, passes=1, partial="pad"), 4, 400, resume_at=len(ref) - 2,
                         resume_world_size=1) == ref
    drop = global_hashes(pairs(data, passes=1, partial="drop", per_record=True), 1, 400)
    assert global_hashes(pairs(data, passes=1, partial="drop"), 4, 400) == drop


def test_stacked_pixels_equal_the_per_record_path(data):
    ref = global_hashes(pairs(data, stack=True, per_record=True), 1, 6)
    assert global_hashes(pairs(data, stack=True), 2, 6) == ref
    assert global_hashes(pairs(data, stack=True), 1, 6, num_workers=1, runner="process", resume_at=3,
                         resume_world_size=4) == ref


def test_token_fields_and_a_mixture_by_tokens(data, hf_tokenizer):
    tok = z.tokenizer(str(hf_tokenizer))
    ref = global_hashes(pairs(data, tok=tok, per_record=True), 1, 8)
    assert global_hashes(pairs(data, tok=tok), 4, 8) == ref
    assert global_hashes(pairs(data, tok=tok), 2, 8, resume_at=4, resume_world_size=1) == ref


def test_rows_of_a_block_are_the_rows_of_its_records():
    """A block indexed is the per-record rows; its collation by column equals theirs, padding included."""
    payloads = [("image", [b"a", b"bb", b"ccc", b"dddd"]), ("n", np.arange(4, dtype=np.int64))]
    span = RecordSpan(1, 1, 4, payloads, origins=[(9, k, 0) for k in range(4)])
    single = RecordRow({"image": b"e", "n": np.int64(7), "extra": "x"})
    block = RecordBlock([span, single, 2])
    assert len(block) == 6 and block.padding() == 2
    rows = list(block)
    assert [r.record for r in rows[:3]] == [{"image": v, "n": k} for v, k in ((b"bb", 1), (b"ccc", 2), (b"dddd", 3))]
    assert rows[0].record.source == 1 and rows[2].record.origin == (9, 3, 0)
    assert [r.record for r in rows[4:]] == [None, None]
    for stack in ((), ("n",)):
        got, want = collate_records(block, stack), collate_records(list(block), stack)
        assert list(got) == list(want)
        for k in want:
            if hasattr(want[k], "numpy"):
                assert got[k].dtype == want[k].dtype and np.array_equal(got[k].numpy(), want[k].numpy())
            else:
                assert got[k] == want[k]
    again = pickle.loads(pickle.dumps(span))  # a lane worker's rows carry their own slice only
    assert len(again.payloads[0][1]) == 3 and [r.record for r in again.rows()] == [r.record for r in span.rows()]
    assert [r.record.origin for r in again.rows()] == [r.record.origin for r in span.rows()]


@pytest.mark.parametrize("weights", [(1, 1), (7, 3), (1, 1, 1, 7), (5, 3, 2)])
@pytest.mark.parametrize("limit", [1, 3, 8, 50])
def test_take_run_makes_the_picks_next_source_makes(weights, limit):
    """Runs of picks, booked at once, give the same pick sequence as one pick at a time."""
    one, runs = Mixer(weights, by="documents"), Mixer(weights, by="documents")
    picks = []
    for _ in range(200):
        s = one.next_source()
        one.push_from({}, s)
        picks.append(s)
    got: list[int] = []
    while len(got) < 200:
        s, n = runs.take_run(limit)
        assert 1 <= n <= limit
        runs.push_run(RecordSpan(s, 0, n, ()), s)
        got.extend([s] * n)
    assert got[:200] == picks


def _with_ids(k: int) -> dict:
    return {"text": f"doc {k} " + "word " * (k % 11), "input_ids": [7] * (k % 3 + 1)}


def _add_ids(record: dict) -> dict:
    return {**record, "input_ids": [7] * (len(record["text"]) % 3 + 1)}


def test_a_record_field_named_like_the_token_ids_is_refused(hf_tokenizer, tmp_path):
    """A record's own ``input_ids`` beside the ids tokenizing makes would replace them in the batch and be what a
    mixer by tokens counts (so the batched and per-record paths would pick differently): refused, when the
    pipeline is built where the fields are known, else at the first chunk, naming the source and the fix."""
    tok = z.tokenizer(str(hf_tokenizer))
    records = [_with_ids(k) for k in range(60)]
    both = z.read.records(records, columns=["text", "input_ids"], chunk_rows=7)
    pipe = z.Pipeline(seed=3, lanes=2).source("s", both).tokenize(tok, field="text").mix(by="tokens").batch(4)
    with pytest.raises(z.PipelineError, match=r"source 's', whose records also keep a field 'input_ids' \(read "
                                              r"from its files\)"):
        pipe.compile()
    ids = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"input_ids": [[5, 6, 7]] * 20}), ids)
    pre = z.read.parquet(str(ids), tokens_field="input_ids")
    with pytest.raises(z.PipelineError, match=r"keep_field=True"):
        (z.Pipeline(seed=3, lanes=2).source("p", pre).tokenize(tok, field="input_ids", keep_field=True)
         .pack(seq_len=16).batch()).compile()
    text = z.read.records([{"text": r["text"]} for r in records], columns=["text"], chunk_rows=7)
    added = (z.Pipeline(seed=3, lanes=2).source("s", text).map(_add_ids, version="1")  # fields unknown when built
             .tokenize(tok, field="text").mix(by="tokens"))
    for p in (added.batch(4), added.accumulate(Identity, version="1").batch(4)):  # batched path, per-record path
        with p.build(0, 1) as loader, pytest.raises(z.SourceError, match=r"source 's' .*a field 'input_ids' beside "
                                                                          r"the token field"):
            next(iter(loader))

"""Pipelines without ``pack()``: a row is one record (zephon/ops/batch.py, zephon/batches/records.py).

Image-caption pairs from real pictures in WebDataset shards (with a zero-byte, a truncated and a
not-an-image member among them) and Hugging Face-style Parquet, batched as the records are: every
record delivered once per pass, fields as lists or stacked tensors, and the global batches equal byte
for byte (image bytes and pixels in the hash) across world sizes, resumes on another world size,
worker counts and runners.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.optional import require

import zephon as z
from zephon.batches.packed import global_digest
from zephon.batches.records import CollateError, collate_records
from zephon.ops.batch import RecordRow
from zephon.errors import PipelineError
from zephon.verify import global_hashes

from .vision_data import build_dataset, pictures

PIL = require("PIL")


@pytest.fixture(scope="module")
def data(tmp_path_factory, corpus_texts):
    return build_dataset(tmp_path_factory.mktemp("recrows"), corpus_texts, pictures())


def pairs(data, lanes: int = 8, rows: int = 3, passes: int | None = None, partial: str = "drop") -> z.Pipeline:
    """Two sources of pairs meet, are mapped, filtered and shuffled, and batched as records."""
    return (z.Pipeline(seed=7, lanes=lanes, flush_every=2)
            .source("wds", z.read.webdataset(str(data["wds"]), columns=["image=jpg;png", "txt"], chunk_rows=5),
                    weight=2, passes=passes)
            .source("hf", z.read.parquet(str(data["hf"]), columns=["image", "caption"], chunk_rows=4), passes=passes)
            .map(_caption_as_txt, version="1")
            .filter(_has_image_bytes)
            .mix(by="documents")
            .shuffle(buffer=6)
            .batch(rows_per_lane=rows, partial=partial))


def _caption_as_txt(r: dict) -> dict:
    if "caption" in r:
        image = r["image"]
        return {"image": image.get("bytes") if isinstance(image, dict) else image, "txt": r["caption"]}
    return r


def _has_image_bytes(r: dict) -> bool:
    return bool(r.get("image"))


def test_a_batch_is_the_records_fields_one_value_per_row(data):
    pipe = pairs(data)
    assert "a row is one record" in pipe.explain()
    batch = next(iter(pipe.build(rank=0, world_size=1)))
    assert sorted(batch) == ["image", "txt", "valid"]
    assert len(batch["image"]) == len(batch["txt"]) == 8 * 3
    assert all(isinstance(b, bytes) and b for b in batch["image"])
    assert all(isinstance(t, str) and t for t in batch["txt"])
    assert batch["valid"].dtype == torch.bool and bool(batch["valid"].all())


def test_one_pass_delivers_every_record_once_padded_at_the_end(data):
    """Every image with bytes, once, over a pass (the filter drops the zero-byte one only); the lanes that
    ran out deliver padding rows (valid False, None fields) until every lane has."""
    pipe = pairs(data, lanes=4, rows=2, passes=1, partial="pad")
    got: Counter = Counter()
    per_lane: list[list[bool]] = [[] for _ in range(4)]
    for batch in pipe.build(rank=0, world_size=1):
        valid = batch["valid"].tolist()
        assert any(valid)  # the loader ends at the first step no lane can fill
        for i, (img, txt, ok) in enumerate(zip(batch["image"], batch["txt"], valid)):
            per_lane[i // 2].append(ok)
            if ok:
                got[(img, txt)] += 1
            else:
                assert img is None and txt is None
    expected = 3 * 24 - 1 + 2 * 20 - 10  # wds (one zero-byte image), hf (its path-only rows have no bytes)
    assert sum(got.values()) == expected and max(got.values()) == 1
    for seq in per_lane:  # a lane pads only once its data has ended, and then until the end
        assert seq == sorted(seq, reverse=True)
    assert sum(not ok for seq in per_lane for ok in seq) > 0


def test_record_batches_are_elastic_across_world_sizes_resumes_and_workers(data):
    pipe = pairs(data)
    ref = global_hashes(pipe, 1, 8)
    assert len(set(ref)) == 8
    for w in (2, 4, 8):
        assert global_hashes(pipe, w, 8) == ref, w
    assert global_hashes(pipe, 8, 8, resume_at=3, resume_world_size=2) == ref
    assert global_hashes(pipe, 1, 8, resume_at=5, resume_world_size=4) == ref
    assert global_hashes(pipe, 2, 8, num_workers=2, runner="thread") == ref


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_record_batches_are_elastic_on_the_process_runners(data):
    pipe = pairs(data)
    ref = global_hashes(pipe, 1, 6)
    assert global_hashes(pipe, 2, 6, num_workers=2, runner="pool") == ref
    assert global_hashes(pipe, 4, 6, num_workers=2, runner="process", resume_at=2, resume_world_size=8) == ref
    loader = pipe.build(rank=0, world_size=1, num_workers=2, runner="pool")
    try:
        assert set(loader._executors) == {"process"}  # the map and filter run on the pool, the read with them
    finally:
        loader.close()


def test_a_fetch_only_pipeline_on_the_pool_runner_is_read_on_threads(data):
    """A source with no transform has nothing for a process to compute: the pool runner reads it on threads
    (no process started, no copy of each value between processes), with the same batches."""
    pipe = (z.Pipeline(seed=5, lanes=4)
            .source("wds", z.read.webdataset(str(data["wds"]), columns=["image=jpg;png", "txt"], chunk_rows=5))
            .batch(rows_per_lane=2))
    ref = global_hashes(pipe, 1, 6)
    assert global_hashes(pipe, 2, 6, num_workers=2, runner="pool", resume_at=3, resume_world_size=4) == ref
    loader = pipe.build(rank=0, world_size=1, num_workers=2, runner="pool")
    try:
        assert set(loader._executors) == {"thread"}
    finally:
        loader.close()


def test_finite_records_end_at_the_same_step_on_every_world_size(data):
    pipe = pairs(data, lanes=4, rows=2, passes=1, partial="pad")
    ref = global_hashes(pipe, 1, 400)
    assert 0 < len(ref) < 400
    assert global_hashes(pipe, 4, 400) == ref
    assert global_hashes(pipe, 2, 400, resume_at=len(ref) // 2, resume_world_size=4) == ref


def decoded(data, stack=("images",), partial: str = "drop") -> z.Pipeline:
    return (z.Pipeline(seed=3, lanes=4)
            .source("wds", z.read.webdataset(str(data["wds"]), columns=["image=jpg;png", "txt"], chunk_rows=6))
            .decode_images("image", size=28, patchify=False, on_bad_image="drop_record")
            .batch(rows_per_lane=2, stack=stack, partial=partial))


def test_stacked_pixels_are_one_uint8_tensor_and_in_the_hash(data):
    batch = next(iter(decoded(data).build(rank=0, world_size=1)))
    pixels = batch["images"]
    assert isinstance(pixels, torch.Tensor) and pixels.dtype == torch.uint8
    assert tuple(pixels.shape) == (8, 1, 28, 28, 3)  # one image per record, size x size RGB
    assert isinstance(batch["txt"], list)
    changed = dict(batch, images=pixels.clone())
    changed["images"][3, 0, 5, 5, 0] ^= 1
    assert global_digest([changed]) != global_digest([batch])
    ref = global_hashes(decoded(data), 1, 4)
    assert global_hashes(decoded(data), 4, 4) == ref
    assert global_hashes(decoded(data), 2, 4, resume_at=2, resume_world_size=1, num_workers=1) == ref


def test_stack_errors_name_the_field_and_the_fix(data, hf_tokenizer):
    varied = (z.Pipeline(seed=3, lanes=2)
              .source("wds", z.read.webdataset(str(data["wds"]), columns=["image=jpg;png", "txt"], chunk_rows=6))
              .decode_images("image", max_pixels=28 * 28 * 4, patchify=False, on_bad_image="drop_record")
              .batch(rows_per_lane=4, stack=["images"]))
    with pytest.raises(CollateError, match="one shape and dtype"):
        for _ in zip(range(4), varied.build(rank=0, world_size=1)):
            pass
    with pytest.raises(CollateError, match="no record of this batch has a field 'pixels'"):
        collate_records([RecordRow({"image": b"x"})], stack=("pixels",))
    with pytest.raises(PipelineError, match="partial='drop'"):
        decoded(data, partial="pad").compile()
    with pytest.raises(PipelineError, match="without pack"):
        tok_pipe = (z.Pipeline(seed=1, lanes=2).source("m", z.read.records([{"text": "a b"}]))
                    .tokenize(z.tokenizer(str(hf_tokenizer))).pack(seq_len=8).batch(rows_per_lane=1, stack=["input_ids"]))
        tok_pipe.compile()
    with pytest.raises(PipelineError, match="pack"):
        (z.Pipeline(seed=1, lanes=2).source("m", z.read.records([{"text": "a"}]))
         .batch(rows_per_lane=1, pixels="fixed")).compile()


def test_batches_that_no_one_rank_batch_could_hold_are_refused():
    """A field named like the padding mask, non-numbers to stack, and lanes whose stacked shapes differ (one
    rank's batch could hold them, the one-rank batch could not: the digest refuses rather than differ)."""
    with pytest.raises(CollateError, match="padding mask"):
        collate_records([RecordRow({"valid": 1})])
    with pytest.raises(CollateError, match="not numbers"):
        collate_records([RecordRow({"s": "a"}), RecordRow({"s": "b"})], stack=("s",))
    r0 = collate_records([RecordRow({"x": np.zeros(3, np.int16)})], stack=("x",))
    r1 = collate_records([RecordRow({"x": np.zeros(4, np.int16)})], stack=("x",))
    with pytest.raises(ValueError, match="one dtype and row shape in every lane"):
        global_digest([r0, r1])
    assert global_digest([collate_records([RecordRow({"segment_ids": 1})]), {"valid": torch.ones(1, dtype=torch.bool)}])


def test_padding_rows_stack_as_zeros_and_lists_as_none():
    rows = [RecordRow({"x": np.arange(3, dtype=np.int16), "s": "a"}), RecordRow(None),
            RecordRow({"x": np.arange(3, 6, dtype=np.int16), "s": "b"})]
    b = collate_records(rows, stack=("x",))
    assert b["x"].tolist() == [[0, 1, 2], [0, 0, 0], [3, 4, 5]] and b["x"].dtype == torch.int16
    assert b["s"] == ["a", None, "b"] and b["valid"].tolist() == [True, False, True]


_SHAPES = st.sampled_from([(), (3,), (2, 2)])
_DTYPES = st.sampled_from([np.uint8, np.int32, np.float32])


@st.composite
def _stack_values(draw):
    """Values of one stacked field: arrays, lists of arrays (``images``), Python scalars and lists, of one
    shape and dtype or (sometimes) not, some non-contiguous, some rows of padding."""
    shape, dtype = draw(_SHAPES), draw(_DTYPES)
    n = draw(st.integers(1, 6))
    out = []
    for i in range(n):
        if draw(st.integers(0, 5)) == 0:
            out.append(None)  # a row of padding
            continue
        kind = draw(st.sampled_from(["array", "list", "python", "strided", "other"]))
        a = np.arange(int(np.prod(shape)) + i, dtype=dtype)[i:].reshape(shape)
        if kind == "list" and shape:
            out.append([np.array(x) for x in a])
        elif kind == "python":
            out.append(a.tolist())
        elif kind == "strided":
            out.append(np.repeat(a[..., None], 2, axis=-1)[..., 0])
        elif kind == "other":  # another shape or dtype: refused, as np.stack would
            out.append(draw(st.sampled_from([np.zeros(4, np.uint8), np.zeros(shape, np.int64), [None]])))
        else:
            out.append(a)
    if all(v is None for v in out):
        out[0] = np.zeros(shape, dtype)
    return out


@settings(max_examples=200, deadline=None)
@given(values=_stack_values())
def test_stacking_copies_each_value_once_and_equals_numpy_stack_property(values):
    """The batch's stacked field is exactly ``np.stack`` of ``np.asarray`` of every value (zeros on padding
    rows), or refused where that would not give one shape and dtype: written straight into the batch."""
    rows = [RecordRow(None if v is None else {"x": v}) for v in values]
    real = [np.asarray(v) for v in values if v is not None]
    first = real[0]
    if first.dtype.kind not in "biufc" or any(a.shape != first.shape or a.dtype != first.dtype for a in real):
        with pytest.raises(CollateError):
            collate_records(rows, stack=("x",))
        return
    want = np.zeros((len(values), *first.shape), dtype=first.dtype)
    want[[i for i, v in enumerate(values) if v is not None]] = np.stack(real)
    got = collate_records(rows, stack=("x",))["x"].numpy()
    assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


def test_recipe_round_trip_and_a_changed_stack_is_refused_on_resume(data, tmp_path):
    pipe = decoded(data)
    path = tmp_path / "records.toml"
    path.write_text(pipe.to_recipe())
    again = z.load_recipe(str(path)).to_pipeline()
    assert again.fingerprint == pipe.fingerprint
    assert global_hashes(again, 2, 3) == global_hashes(pipe, 1, 3)
    loader = pipe.build(rank=0, world_size=1)
    next(iter(loader))
    state = loader.state_dict()
    other = decoded(data, stack=())
    assert other.fingerprint != pipe.fingerprint
    with pytest.raises(ValueError, match=r'stack: checkpoint has \["images"\]'):
        other.build(rank=0, world_size=1).load_state_dict(state)


def test_zephon_run_reports_records_per_second(data, tmp_path, capsys):
    from zephon.cli import main

    path = tmp_path / "records.toml"
    path.write_text(pairs(data).to_recipe())
    assert main(["run", str(path), "--steps", "3", "--hash-every", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "24 records per batch" in out and "rec/s last" in out and "3 records" not in out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(n=st.integers(5, 60), lanes=st.sampled_from([2, 4]), rows=st.integers(1, 3), chunk=st.integers(1, 7),
       flush_every=st.integers(1, 3), buffer=st.integers(0, 5), world=st.sampled_from([2, 4]),
       resume_at=st.integers(1, 5))
def test_record_rows_are_elastic_for_any_shape_property(n, lanes, rows, chunk, flush_every, buffer, world, resume_at):
    recs = [{"text": f"record {i}", "n": i, "v": np.full(2, i, dtype=np.int32)} for i in range(n)]
    source = z.read.records(recs, columns=["text", "n", "v"], chunk_rows=chunk)
    pipe = z.Pipeline(seed=n, lanes=lanes, flush_every=flush_every).source("m", source)
    if buffer:
        pipe = pipe.shuffle(buffer=buffer)
    pipe = pipe.batch(rows_per_lane=rows)
    world = min(world, lanes)
    ref = global_hashes(pipe, 1, 6)
    assert global_hashes(pipe, world, 6) == ref
    assert global_hashes(pipe, world, 6, resume_at=resume_at, resume_world_size=lanes // world) == ref

"""Image-text data in MDS and LitData (image columns read as raw bytes, decoded later by ``decode_images``),
and WebDataset shards read from an S3 server (moto, on loopback).

Every dataset is written by its own library (mosaicml-streaming's ``MDSWriter``, ``litdata.optimize``,
Python's ``tarfile``); the pictures are real photographs encoded by Pillow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.optional import require

import zephon as z
from zephon import SourceError
from zephon.readers import make_reader
from zephon.verify import global_hashes

from .test_formats import mds_writer
from .vision_data import build_dataset, crop, encode, pictures

PIL = require("PIL")
IDS = dict(image_start="<|vision_start|>", image_pad="<|image_pad|>", image_end="<|vision_end|>")


@pytest.fixture(scope="module")
def vl_tok(tmp_path_factory, corpus_texts):
    from zephon.demo.vl import train_vl_tokenizer

    return z.tokenizer(str(train_vl_tokenizer(tmp_path_factory.mktemp("vltok") / "tok.model", corpus_texts, 600)))


@pytest.fixture(scope="module")
def samples(corpus_texts):
    """24 (caption, JPEG bytes, PIL image) triples."""
    loaded = pictures()
    texts = [t.strip().replace("\n", " ")[:120] for t in corpus_texts if len(t.strip()) > 40]
    out = []
    for k in range(24):
        im = crop(loaded, k, 40 + (k * 11) % 50, 48 + (k * 7) % 60)
        out.append((texts[k % len(texts)], encode(im, quality=80), im))
    return out


def image_pipeline(read: z.read.ReadSpec, tok, lanes: int = 4) -> z.Pipeline:
    return (z.Pipeline(seed=3, lanes=lanes, flush_every=1).source("s", read)
            .decode_images("image", max_pixels=56 * 56, merge=2)
            .tokenize_images(tok, "caption", **IDS)
            .pack(seq_len=64).batch(rows_per_lane=1))


def read_all(read: z.read.ReadSpec) -> dict[str, list]:
    """Every record of a source, read by Zephon's reader (its files from the plan)."""
    import fsspec

    from zephon.plan import WorkPlan

    src = WorkPlan(z.Pipeline(seed=0, lanes=1).source("s", read)).sources[0]
    reader = make_reader("s", read, fsspec.filesystem("file"))
    out: dict[str, list] = {}
    for path in src.files:
        raw = reader.read(path, 0, -1)
        for k, v in raw.columns.items():
            out.setdefault(k, []).extend(v)
    return out


# -- MDS -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mds(tmp_path_factory, samples):
    writer = mds_writer()
    root = tmp_path_factory.mktemp("mds")
    for s in range(3):  # three shards, written as a dataset each (index.json per folder)
        cols = {"caption": "str", "image": "bytes", "photo": "jpeg", "scan": "png", "pixels": "pil", "obj": "pkl"}
        with writer(out=str(root / f"part{s}"), columns=cols, size_limit=None) as w:
            for cap, data, im in samples[s * 8:(s + 1) * 8]:
                w.write({"caption": cap, "image": data, "photo": im, "scan": im, "pixels": im, "obj": {"k": 1}})
    return root


def test_mds_image_columns_are_the_stored_bytes(mds, samples):
    from streaming.base.format.mds.encodings import JPEG, PNG

    got = read_all(z.read.mds(str(mds), columns=["caption", "image", "photo", "scan"]))
    assert got["caption"] == [c for c, _, _ in samples]
    assert got["image"] == [d for _, d, _ in samples]  # raw bytes: byte for byte
    assert got["photo"] == [JPEG().encode(im) for _, _, im in samples]  # what MDSWriter stored for "jpeg"
    assert got["scan"] == [PNG().encode(im) for _, _, im in samples]
    assert all(isinstance(v, bytes) for v in got["photo"])


@pytest.mark.parametrize("column,encoding", [("pixels", "pil"), ("obj", "pkl")])
def test_mds_columns_that_would_need_a_deserializer_are_refused(mds, column, encoding):
    with pytest.raises(SourceError, match=f"encoding '{encoding}'"):
        read_all(z.read.mds(str(mds), columns=["caption", column]))


def test_an_mds_image_text_source_is_elastic(mds, vl_tok):
    pipe = image_pipeline(z.read.mds(str(mds), columns=["caption", "image"], chunk_rows=3), vl_tok)
    loader = pipe.build()
    try:
        batch = next(loader)
    finally:
        loader.close()
    assert batch["pixel_values"].shape[0] > 0
    ref = global_hashes(pipe, 1, 4)
    assert global_hashes(pipe, 4, 4) == ref and global_hashes(pipe, 2, 4, resume_at=2, resume_world_size=4) == ref


# -- LitData --------------------------------------------------------------------------------------------
_LITDATA = textwrap.dedent("""
    import json, sys
    from PIL import Image
    import litdata

    rows = json.load(open(sys.argv[1]))

    def item(i):
        cap, path = rows[i]
        photo = Image.open(path)  # a JpegImageFile: litdata stores its file's bytes ('jpeg')
        return {"caption": cap, "image": open(path, "rb").read(), "photo": photo, "pixels": photo.convert("RGB")}

    if __name__ == "__main__":
        litdata.optimize(fn=item, inputs=list(range(len(rows))), output_dir=sys.argv[2], chunk_size=6, num_workers=1,
                         mode="overwrite", start_method="fork", keep_data_ordered=True)
""")


@pytest.fixture(scope="module")
def litdata_ds(tmp_path_factory, samples):
    require("litdata")
    work = tmp_path_factory.mktemp("litdata")
    rows = []
    for k, (cap, data, _) in enumerate(samples):
        (work / f"{k}.jpg").write_bytes(data)
        rows.append([cap, str(work / f"{k}.jpg")])
    (work / "rows.json").write_text(json.dumps(rows))
    (work / "write.py").write_text(_LITDATA)
    run = subprocess.run([sys.executable, str(work / "write.py"), str(work / "rows.json"), str(work / "out")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 0, run.stderr[-3000:]
    formats = json.loads((work / "out" / "index.json").read_text())["config"]["data_format"]
    assert formats == ["str", "bytes", "jpeg", "pil"]  # the formats this test is about
    return work / "out"


def test_litdata_image_leaves_are_the_stored_bytes(litdata_ds, samples):
    got = read_all(z.read.litdata(str(litdata_ds), columns=["caption", "image", "photo"]))
    assert got["caption"] == [c for c, _, _ in samples]
    assert got["image"] == got["photo"] == [d for _, d, _ in samples]  # 'bytes' and 'jpeg' (the file's bytes)


def test_litdata_pil_leaves_are_refused(litdata_ds):
    with pytest.raises(SourceError, match="format 'pil', not raw bytes"):
        read_all(z.read.litdata(str(litdata_ds), columns=["caption", "pixels"]))


def test_a_litdata_image_text_source_is_elastic(litdata_ds, vl_tok):
    pipe = image_pipeline(z.read.litdata(str(litdata_ds), columns=["caption", "image"], chunk_rows=2), vl_tok)
    ref = global_hashes(pipe, 1, 4)
    assert global_hashes(pipe, 4, 4) == ref and global_hashes(pipe, 4, 4, resume_at=1, resume_world_size=1) == ref


# -- WebDataset in S3 --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3_shards(tmp_path_factory, corpus_texts):
    from .stores import STARTERS

    local = build_dataset(tmp_path_factory.mktemp("vl_s3"), corpus_texts, pictures())["wds"]
    server, store = STARTERS["s3"](tmp_path_factory.mktemp("moto"))
    store.upload_dir(local, "vl/wds")
    yield local, store
    server.stop()


def wds_pipeline(path: str, tok, storage_options: dict | None = None) -> z.Pipeline:
    read = z.read.webdataset(path, columns=["image=jpg;png", "txt"], chunk_rows=5, storage_options=storage_options)
    return (z.Pipeline(seed=9, lanes=8, flush_every=2).source("wds", read)
            .decode_images("image", max_pixels=56 * 84, merge=2, on_bad_image="drop_record")
            .tokenize_images(tok, "txt", **IDS)
            .pack(seq_len=128, max_images_per_row=4).batch(rows_per_lane=1, positions="mrope"))


def test_webdataset_shards_in_s3_give_the_local_batches(s3_shards, vl_tok):
    local, store = s3_shards
    on_disk = wds_pipeline(str(local), vl_tok)
    in_s3 = wds_pipeline(store.url("vl/wds"), vl_tok, dict(store.storage_options))
    assert in_s3.fingerprint == on_disk.fingerprint  # where the bytes come from is not part of a run
    ref = global_hashes(on_disk, 1, 6)
    assert global_hashes(in_s3, 4, 6) == ref
    assert global_hashes(in_s3, 8, 6, resume_at=3, resume_world_size=2) == ref
    loader = in_s3.build(world_size=1)
    try:
        next(loader)
        skipped = loader.metrics()["skipped_by_source"]["wds"]
    finally:
        loader.close()
    assert skipped["skipped_images"] >= 1  # the bad members of the shards, counted under the source's name

"""The real-image corpus builder (zephon/demo/vl.py) on a small sample, and the vision-language quickstart.

Samples must be distinct crops of real pictures at the promised sizes, with captions from real text,
made deterministically; the WebDataset shards and the Parquet files must hold the same samples (read
back by the ``webdataset`` package and by pyarrow); interleaved documents must have the OBELICS layout;
and ``recipes/vl_quickstart.toml`` over a small quickstart build must run and verify like any recipe.
"""

from __future__ import annotations

import hashlib
import io
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.optional import require

import zephon as z
from zephon.demo import vl as demo_vl
from zephon.verify import verify

from .vision_data import pictures

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def loaded():
    return pictures(max_side=768)


def test_samples_are_distinct_real_crops_at_realistic_sizes(loaded):
    from PIL import Image

    samples = list(demo_vl.make_samples(loaded, 48, seed=5))
    assert len({hashlib.sha256(s.image).digest() for s in samples}) == 48
    assert len({s.key for s in samples}) == 48
    titles = {p.name: p.title for p, _ in loaded}
    for s in samples:
        with Image.open(io.BytesIO(s.image)) as im:
            assert im.format == ("PNG" if s.ext == "png" else "JPEG")
            assert im.size == (s.meta["width"], s.meta["height"])
            assert 200 <= max(im.size) <= 600 and min(im.size) >= 64
            pixels = np.asarray(im.convert("RGB"), dtype=np.float32)
        assert pixels.std() > 2  # a picture, not a flat fill
        assert s.caption.startswith(titles[s.meta["source"]])
        assert f"{im.size[0]} by {im.size[1]} pixel crop" in s.caption
        assert s.meta["quality"] is None or 60 <= s.meta["quality"] <= 95
    assert len({s.meta["source"] for s in samples}) == min(48, len(loaded))  # every picture is used
    again = list(demo_vl.make_samples(loaded, 48, seed=5))
    assert [s.image for s in again] == [s.image for s in samples]  # a pure function of (pictures, seed, index)
    other = list(demo_vl.make_samples(loaded, 8, seed=6))
    assert not {s.image for s in other} & {s.image for s in samples}


def test_webdataset_and_parquet_hold_the_same_samples(loaded, tmp_path):
    webdataset = require("webdataset")
    samples = list(demo_vl.make_samples(loaded, 30, seed=9))
    counts = demo_vl.write_corpus(samples, tmp_path / "a", per_shard=12)
    assert counts == {"samples": 30, "shards": 3, "bytes": sum(len(s.image) for s in samples)}
    shards = sorted(str(p) for p in (tmp_path / "a" / "wds").glob("*.tar"))
    read = list(webdataset.WebDataset(shards, shardshuffle=False))
    rows = [r for f in sorted((tmp_path / "a" / "parquet").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert [r["__key__"] for r in read] == [r["key"] for r in rows] == [s.key for s in samples]
    for w, r, s in zip(read, rows, samples):
        assert w[s.ext] == r["image"]["bytes"] == s.image and r["image"]["path"] == f"{s.key}.{s.ext}"
        assert w["txt"].decode() == r["caption"] == s.caption
        assert r["source"] == s.meta["source"]
    demo_vl.write_corpus(samples, tmp_path / "b", per_shard=12)  # the same samples, the same files
    for f in sorted((tmp_path / "a").rglob("*.*")):
        assert f.read_bytes() == (tmp_path / "b" / f.relative_to(tmp_path / "a")).read_bytes(), f.name


def test_interleaved_documents_have_the_obelics_layout(loaded, tmp_path):
    paragraphs = [f"Paragraph {i} of real prose, as the docstrings give it." for i in range(20)]
    used = demo_vl.write_interleaved(demo_vl.make_samples(loaded, 100, seed=2), paragraphs, tmp_path, 10, seed=2)
    rows = [r for f in sorted(tmp_path.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert len(rows) == 10 and sum(sum(i is not None for i in r["images"]) for r in rows) == used
    for r in rows:
        assert len(r["texts"]) == len(r["images"])
        assert all((t is None) != (i is None) for t, i in zip(r["texts"], r["images"]))
        assert 1 <= sum(i is not None for i in r["images"]) <= 3


def test_debian_pictures_are_found_with_their_names(tmp_path):
    from PIL import Image

    root = tmp_path / "backgrounds"
    (root / "mate" / "nature").mkdir(parents=True)
    Image.new("RGB", (300, 240), (10, 120, 30)).save(root / "Bridge_by_Sander_Klootwijk.jpg")
    Image.new("RGB", (300, 240), (200, 20, 30)).save(root / "mate" / "nature" / "Aqua.png")
    (root / "notes.svg").write_text("<svg/>")
    found = {p.name: p for p in demo_vl.debian_pictures([str(root)])}
    assert set(found) == {"debian/Bridge_by_Sander_Klootwijk", "debian/mate/nature/Aqua"}
    assert found["debian/Bridge_by_Sander_Klootwijk"].title == "Bridge"
    assert "Sander Klootwijk" in found["debian/Bridge_by_Sander_Klootwijk"].description
    assert demo_vl.debian_pictures([str(tmp_path / "none")]) == []


@pytest.mark.timeout(600)
def test_quickstart_builds_runs_and_verifies(tmp_path, corpus_texts):
    require("PIL")
    require("skimage", demo_vl.unavailable())
    documents = [("prose", f"doc{i}", t) for i, t in enumerate(corpus_texts)]
    counts = demo_vl.build_quickstart(tmp_path, documents, pairs=64, docs=12)
    assert counts["vl_pairs"] == 64 and counts["vl_docs"] == 12
    assert len(list((tmp_path / "data" / "vl" / "pairs").glob("*.tar"))) == 4
    shutil.copy(REPO / "recipes" / "vl_quickstart.toml", tmp_path)
    recipe = z.load_recipe(str(tmp_path / "vl_quickstart.toml"))
    pipe = recipe.to_pipeline()
    loader = pipe.build(rank=0, world_size=1)
    try:
        batch = next(loader)
        assert batch["input_ids"].shape == (8, 1024) and batch["position_ids"].shape == (3, 8, 1024)  # mrope
        assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(1).sum()) > 0
        tok = z.load_tokenizer(pipe.tokenizer)
        pads = int((batch["input_ids"] == tok.token_id("<|image_pad|>")).sum())
        assert pads == int(batch["image_grid_thw"].prod(1).sum()) // 4  # every image's tokens, no other
    finally:
        loader.close()
    report = verify(recipe, [1, 2, 4], steps=3, resume_at=1)
    assert report.ok, report.rows

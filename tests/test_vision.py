"""Image operators: decoding, orientation, resizing, patches, bad images, image tokens, and elastic determinism.

Every image is a real picture (scikit-image's sample photographs) encoded by a real codec; bad images are
real failures (a JPEG cut in half, a PNG with a broken checksum, zero bytes, text, a PNG header claiming
400 million pixels). The pipelines read WebDataset shards, Hugging Face-style Parquet and interleaved
documents, and must give byte-identical global batches at world sizes 1 to 8, after a resume on another
world size, and with worker threads and processes.
"""

from __future__ import annotations

import io
import struct
import zlib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.optional import require

import zephon as z
from zephon import SourceError
from zephon.imaging import (BadImage, ImageSpec, crop_box, decode_image, jpeg_orientation, orient, patchify,
                            smart_resize)
from zephon.ops.decode_images import DecodeImages
from zephon.ops.tokenize_images import TokenizeImages
from zephon.records import Chunk
from zephon.verify import global_hashes

from .vision_data import build_dataset, crop, encode, pictures, unpatchify

PIL = require("PIL")
DECODERS = ["pillow", "simplejpeg"]


@pytest.fixture(scope="module")
def loaded():
    return pictures()


@pytest.fixture(scope="module")
def photo(loaded):
    """A real photograph, 300 x 451 (height x width) or so, as a PIL image."""
    return crop(loaded, 4, 300, 451)


@pytest.fixture(scope="module")
def vl_tok(tmp_path_factory, corpus_texts):
    from zephon.demo.vl import train_vl_tokenizer

    path = train_vl_tokenizer(tmp_path_factory.mktemp("vltok") / "tok.model", corpus_texts, vocab_size=600)
    return z.tokenizer(str(path))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, corpus_texts, loaded):
    return build_dataset(tmp_path_factory.mktemp("vl"), corpus_texts, loaded)


def spec(decoder: str = "pillow", **kw) -> ImageSpec:
    kw.setdefault("max_pixels", 112 * 112)
    return ImageSpec(jpeg_decoder=decoder, **kw)


def chunk_of(values: dict, path: str = "/data/x.parquet") -> Chunk:
    n = len(next(iter(values.values())))
    return Chunk(0, 0, True, 0, n, path, dict(values), np.arange(1, n + 1, dtype=np.int64), np.zeros(n, np.int64))


# -- decoding --------------------------------------------------------------------------------------------
def _decode(args):  # module level: runs in a worker process
    data, s = args
    return decode_image(data, s)


@pytest.mark.parametrize("decoder", DECODERS)
def test_decode_is_a_pure_function_of_bytes_and_parameters(photo, decoder):
    if decoder == "simplejpeg":
        require("simplejpeg")
    cases = [(encode(photo, quality=q, progressive=q > 80), spec(decoder, mode=m, size=(112, 84) if m == "crop"
                                                                 else None, reduced_decode=r))
             for q in (70, 90) for m in ("crop", "fit") for r in (True, False)]
    cases.append((encode(photo, "PNG"), spec(decoder)))
    here = [decode_image(d, s) for d, s in cases]
    again = [decode_image(d, s) for d, s in cases]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        threads = list(pool.map(_decode, cases))
    import multiprocessing

    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        processes = list(pool.map(_decode, cases))
    for a, b, c, d in zip(here, again, threads, processes):
        assert a.dtype == np.uint8 and a.ndim == 3 and a.shape[2] == 3
        assert a.tobytes() == b.tobytes() == c.tobytes() == d.tobytes()


@pytest.mark.parametrize("decoder", DECODERS)
def test_reduced_decode_lands_on_the_same_size_close_to_the_full_one(photo, decoder):
    if decoder == "simplejpeg":
        require("simplejpeg")
    data = encode(photo.resize((1200, 800)), quality=92)
    for s in (spec(decoder, max_pixels=112 * 112), spec(decoder, mode="crop", size=(112, 112))):
        full = decode_image(data, ImageSpec(**{**s.__dict__, "reduced_decode": False}))
        small = decode_image(data, s)
        assert small.shape == full.shape
        assert np.abs(small.astype(int) - full).mean() < 6  # DCT scaling is a (good) box filter, not the same


def test_the_two_jpeg_decoders_agree(photo):
    require("simplejpeg")
    data = encode(photo, quality=88)
    for reduced in (False, True):
        a = decode_image(data, spec("pillow", reduced_decode=reduced))
        b = decode_image(data, spec("simplejpeg", reduced_decode=reduced))
        assert a.shape == b.shape and np.abs(a.astype(int) - b).max() <= 2


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_as_pillow_applies_it(photo, orientation):
    from PIL import Image, ImageOps

    im = photo.resize((150, 100))
    data = encode(im, quality=95, orientation=orientation)
    assert jpeg_orientation(data) == orientation
    with Image.open(io.BytesIO(data)) as opened:
        assert opened.getexif().get(0x0112) == orientation
        expected = np.asarray(ImageOps.exif_transpose(opened.convert("RGB")))
    assert np.array_equal(orient(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")), orientation), expected)
    big = spec("pillow", max_pixels=10 ** 6, patch_size=2, reduced_decode=False)  # 150 x 100 stays 150 x 100
    for decoder in ("pillow", "simplejpeg") if _has_simplejpeg() else ("pillow",):
        out = decode_image(data, ImageSpec(**{**big.__dict__, "jpeg_decoder": decoder}))
        assert out.shape == expected.shape
        assert np.abs(out.astype(int) - expected).max() <= 2


def _has_simplejpeg() -> bool:
    import importlib.util

    return importlib.util.find_spec("simplejpeg") is not None


def _array_route(data: bytes, spec_: ImageSpec) -> np.ndarray:
    """The module docstring's steps one by one on arrays: decode (at 1/s) to RGB, ``orient`` the array,
    ``resize`` the array. The Pillow decoder keeps the image in Pillow until the end; this is its reference."""
    from PIL import Image

    from zephon.imaging import dct_scale, resize
    from zephon.imaging.decode import _needed

    with Image.open(io.BytesIO(data)) as im:
        width, height = im.size
        orientation = im.getexif().get(0x0112, 1)
        if im.format == "JPEG" and spec_.reduced_decode:
            need_h, need_w = _needed(height, width, orientation, spec_)
            if dct_scale(height, width, need_h, need_w) > 1:
                im.draft("RGB", (need_w, need_h))
        pixels = np.asarray(im.convert("RGB"))
    shown = (width, height) if orientation >= 5 else (height, width)
    return resize(orient(pixels, orientation), spec_, *shown)


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK", "RGBA", "P"])
@pytest.mark.parametrize("orientation", range(1, 9))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(h=st.integers(9, 400), w=st.integers(9, 400), reduced=st.booleans(),
       target=st.sampled_from([dict(mode="crop", size=(64, 96)), dict(mode="crop", size=(56, 56), resample="box"),
                               dict(max_pixels=112 * 112, merge=2), dict(min_pixels=300 * 300, max_pixels=600 * 600),
                               dict(max_pixels=10 ** 6, patch_size=1)]))
def test_pillow_decoder_equals_the_array_route_property(loaded, orientation, mode, h, w, reduced, target):
    """Pixel for pixel, whatever the image's mode, size and orientation and whatever the target: the Pillow
    decoder, which orients and resizes without leaving Pillow, gives what the steps on arrays give."""
    fmt = "PNG" if mode in ("RGBA", "P") else "JPEG"
    im = crop(loaded, (h * w) % len(loaded), h, w).convert(mode)
    data = encode(im, fmt=fmt, orientation=orientation)
    s = spec("pillow", reduced_decode=reduced, **target)
    expected, got = _array_route(data, s), decode_image(data, s)
    assert got.dtype == np.uint8 and got.shape == expected.shape and np.array_equal(got, expected)


# -- sizes and patches -----------------------------------------------------------------------------------
def test_fit_is_qwen2_vl_smart_resize(photo):
    qwen = require("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    sizes = [(h, w) for h in (17, 60, 223, 224, 300, 451, 1000, 4032) for w in (28, 99, 224, 451, 3024, 5000)
             if max(h, w) <= 200 * min(h, w)]
    for h, w in sizes:
        for factor, lo, hi in ((28, 56 * 56, 448 * 448), (14, 14 * 14, 224 * 224), (32, 32 * 32, 1024 * 1024)):
            assert smart_resize(h, w, factor, lo, hi) == qwen.smart_resize(h, w, factor, lo, hi), (h, w, factor)
    data = encode(photo.resize((451, 300)))
    out = decode_image(data, spec(max_pixels=112 * 112, patch_size=14, merge=2))
    assert out.shape[:2] == smart_resize(300, 451, 28, 56 * 56, 112 * 112)
    assert out.shape[0] % 28 == 0 and out.shape[1] % 28 == 0 and out.shape[0] * out.shape[1] <= 112 * 112


@pytest.mark.parametrize("hw", [(300, 451), (451, 300), (64, 64), (20, 400), (900, 40)])
def test_crop_gives_the_exact_size_from_the_centre(photo, hw):
    from PIL import Image

    h, w = hw
    src = photo.resize((w, h))
    out = decode_image(encode(src, "PNG"), spec(mode="crop", size=(56, 84), max_pixels=0))
    assert out.shape == (56, 84, 3)
    x0, y0, x1, y1 = crop_box(h, w, 56, 84)
    assert abs((x0 + x1) / 2 - w / 2) < 1e-9 and abs((y0 + y1) / 2 - h / 2) < 1e-9  # centred
    assert abs((x1 - x0) / (y1 - y0) - 84 / 56) < 1e-9 and (x1 - x0 == w or y1 - y0 == h)  # shortest side fills
    ref = np.asarray(src.resize((84, 56), Image.Resampling.BICUBIC, box=(x0, y0, x1, y1)))
    assert np.array_equal(out, ref)  # the pinned filter, one resampling step


def test_crop_box_stays_inside_every_image():
    for h in range(1, 700, 7):
        for w in range(1, 700, 11):
            for th, tw in ((224, 224), (56, 84), (336, 112)):
                x0, y0, x1, y1 = crop_box(h, w, th, tw)
                assert 0 <= x0 <= x1 <= w and 0 <= y0 <= y1 <= h, (h, w, th, tw)
                assert x1 - x0 == w or y1 - y0 == h


def test_patchify_and_merge_exact_values():
    img = np.arange(4 * 6 * 2, dtype=np.uint8).reshape(4, 6, 2)  # H=4, W=6, C=2
    p1 = patchify(img, 2, 1)
    assert p1.shape == (6, 8)
    assert p1[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]  # rows 0-1, cols 0-1, channels last
    assert p1[1].tolist() == img[0:2, 2:4].reshape(-1).tolist()
    assert p1[3].tolist() == img[2:4, 0:2].reshape(-1).tolist()  # row-major over the 2 x 3 grid
    img = np.arange(4 * 4 * 1, dtype=np.uint8).reshape(4, 4, 1)
    merged = patchify(img, 1, 2)  # 1-pixel patches, 2 x 2 groups consecutive
    assert merged[:, 0].tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
    rng = np.random.default_rng(0)
    for p, m, gh, gw in ((14, 2, 4, 6), (16, 1, 3, 5), (7, 3, 6, 3)):
        pix = rng.integers(0, 256, (gh * p, gw * p, 3), dtype=np.uint8)
        patches = patchify(pix, p, m)
        assert patches.shape == (gh * gw, p * p * 3) and patches.flags.c_contiguous
        assert np.array_equal(unpatchify(patches, (1, gh, gw), p, m), pix)
    with pytest.raises(ValueError, match="merge groups"):
        patchify(np.zeros((28, 42, 3), np.uint8), 14, 2)


# -- bad images ------------------------------------------------------------------------------------------
def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bad_images(photo) -> dict[str, tuple[object, str]]:
    """name -> (field value, the reason it must be counted under)."""
    jpeg, png = encode(photo, quality=85), encode(photo, "PNG")
    broken = bytearray(png)
    broken[60] ^= 0xFF  # inside IDAT: its CRC no longer matches
    bomb = b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)) + \
        _png_chunk(b"IDAT", zlib.compress(b"\x00" * 1000)) + _png_chunk(b"IEND", b"")
    sof = jpeg.index(b"\xff\xc0") if b"\xff\xc0" in jpeg else jpeg.index(b"\xff\xc2")
    huge_jpeg = jpeg[:sof + 5] + struct.pack(">HH", 30000, 30000) + jpeg[sof + 9:]
    return {
        "truncated jpeg": (jpeg[:len(jpeg) // 2], "corrupt"),
        "truncated png": (png[:len(png) // 3], "corrupt"),
        "corrupt png": (bytes(broken), "corrupt"),
        "corrupt jpeg": (jpeg[:20] + bytes(range(256)) * 4, "corrupt"),
        "zero bytes": (b"", "empty"),
        "not an image": (b"Call me Ishmael. Some years ago, never mind how long precisely", "not_an_image"),
        "postscript": (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n", "not_an_image"),
        "png bomb": (bomb, "oversized"),
        "jpeg bomb": (huge_jpeg, "oversized"),
        "missing": (None, "missing"),
        "a number": (7, "not_an_image"),
        "escaping path": ("../../etc/passwd", "bad_path"),
        "absolute path": ("/etc/hostname", "bad_path"),
        "absent file": ({"bytes": None, "path": "nowhere.jpg"}, "missing"),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("decoder", DECODERS)
def test_every_bad_image_under_every_policy(photo, decoder, tmp_path):
    if decoder == "simplejpeg":
        require("simplejpeg")
    good = encode(photo.resize((90, 60)))
    for name, (value, reason) in bad_images(photo).items():
        with pytest.raises(BadImage) as info:
            decode_image(value, spec(decoder)) if not isinstance(value, (str, dict)) else \
                DecodeImages("image", max_pixels=112 * 112, jpeg_decoder=decoder)._one(value, str(tmp_path))
        assert info.value.reason == reason, (name, info.value)
        for policy in ("skip", "drop_record", "raise"):
            op = DecodeImages("image", max_pixels=112 * 112, jpeg_decoder=decoder, on_bad_image=policy,
                              max_image_pixels=10 ** 8)
            chunk = chunk_of({"image": [good, value, good], "caption": ["a", "b", "c"]}, str(tmp_path / "x.tar"))
            if policy == "raise":
                with pytest.raises(SourceError, match=f"bad image \\({reason}") as err:
                    op._apply_chunk(chunk)
                assert "x.tar" in str(err.value) and "record 1" in str(err.value)
                continue
            out = op._apply_chunk(chunk)
            assert out.counts["skipped_images"] == 1 and out.counts[f"skipped_images.{reason}"] == 1, name
            if policy == "skip":  # the record keeps its place and its text, without the image
                assert out.columns["caption"] == ["a", "b", "c"]
                assert [x[0] is None for x in out.columns["images"]] == [False, True, False]
                assert out.columns["image_grid_thw"][1] == [None]
            else:
                assert out.columns["caption"] == ["a", "c"] and out.skipped == 1
                assert out.resume_cursor.tolist() == [1, 3]  # positions stay exact


def test_small_pixel_limit_and_paths(photo, tmp_path):
    data = encode(photo.resize((200, 100)))
    with pytest.raises(BadImage, match="max_image_pixels"):
        decode_image(data, spec(max_image_pixels=200 * 100 - 1))
    assert decode_image(data, spec(max_image_pixels=200 * 100)).shape[2] == 3
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.jpg").write_bytes(data)
    (tmp_path / "link.jpg").symlink_to("/etc/hostname")
    op = DecodeImages("image", max_pixels=112 * 112)
    assert op._one("imgs/a.jpg", str(tmp_path))[0].shape[1] == 14 * 14 * 3
    assert op._one({"bytes": None, "path": "imgs/a.jpg"}, str(tmp_path))[1][0] == 1
    with pytest.raises(BadImage, match="leaves the dataset folder"):
        op._one("link.jpg", str(tmp_path))
    with pytest.raises(BadImage, match="local datasets only"):
        op._one("a.jpg", "s3://bucket/data")


# -- image tokens ----------------------------------------------------------------------------------------
def test_worked_example_of_the_contract(vl_tok, photo):
    """The example in zephon/ops/decode_images.py, with this tokenizer's ids for the text pieces."""
    tok = z.load_tokenizer(vl_tok)
    dec = DecodeImages("image", max_pixels=56 * 56, patch_size=14, merge=2)
    ti = TokenizeImages(vl_tok, "caption", image_start="<|vision_start|>", image_pad="<|image_pad|>",
                        image_end="<|vision_end|>", merge=2)
    chunk = chunk_of({"image": [encode(photo.resize((100, 60)))], "caption": ["a red <image> kite"]})
    out = ti._apply_chunk(dec._apply_chunk(chunk))
    (imgs,), (grids,) = out.columns["images"], out.columns["image_grid_thw"]
    assert grids == [(1, 2, 4)] and imgs[0].shape == (8, 588) and imgs[0].dtype == np.uint8
    start, pad, end = (tok.token_id(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))
    flat, lengths = tok.encode_plain(["a red ", " kite"])
    red, kite = flat[:lengths[0]].tolist(), flat[lengths[0]:].tolist()
    assert out.token_fields["input_ids"].tolist() == red + [start, pad, pad, end] + kite + [tok.eos_id]
    assert out.token_fields["loss_mask"].tolist() == [1] * (len(red) - 1) + [0, 0, 0, 0, 1] + [1] * len(kite) + [1]
    assert out.columns.keys() == {"images", "image_grid_thw", "image_spans"}  # the caption is consumed
    start_at = len(red)
    assert out.columns["image_spans"][0].tolist() == [[start_at, start_at + 1, start_at + 3, start_at + 4]]


def test_image_token_counts_and_layouts(vl_tok, photo):
    tok = z.load_tokenizer(vl_tok)
    pad = tok.token_id("<|image_pad|>")
    a, b = encode(photo.resize((100, 60))), encode(photo.resize((120, 120)))
    for merge in (1, 2):
        dec = DecodeImages("image", max_pixels=84 * 84, patch_size=14, merge=merge)
        ti = TokenizeImages(vl_tok, "text", image_pad=pad, merge=merge)
        chunk = chunk_of({"image": [[a, b], [a], [a, b], [b"broken", b], [a], [None]],
                          "text": ["x <image> y <image> z", "caption only", "<image> one <image> two <image>",
                                   "bad <image> good <image>", None, ""]})
        out = ti._apply_chunk(dec._apply_chunk(chunk))
        assert out.counts["unmatched_placeholders"] == 1 and out.counts["skipped_images"] == 1
        assert out.counts["blank_records"] == 1  # the last record: no text, and no image (None: none there)
        ids, offs = out.token_fields["input_ids"], out.offsets
        for j, grids in enumerate(out.columns["image_grid_thw"]):
            doc = ids[offs[j]:offs[j + 1]]
            expected = sum(t * h * w // merge ** 2 for t, h, w in grids)
            assert int((doc == pad).sum()) == expected
            assert len(out.columns["images"][j]) == len(grids)
            for img, (t, h, w) in zip(out.columns["images"][j], grids):
                assert img.shape[0] == t * h * w
        assert [len(g) for g in out.columns["image_grid_thw"]] == [2, 1, 2, 1, 1]
        first = ids[offs[1]:offs[2]].tolist()  # "caption only": the image goes before the text
        n = first.count(pad)
        assert first[:n] == [pad] * n and pad not in first[n:]
    after = TokenizeImages(vl_tok, "text", image_pad=pad, unplaced_images="after")
    decoded = DecodeImages("image", max_pixels=84 * 84)._apply_chunk(chunk_of({"image": [a], "text": ["cap"]}))
    out = after._apply_chunk(decoded)
    doc = out.token_fields["input_ids"].tolist()
    assert doc[-2] == pad and doc[0] != pad  # EOS last, the image just before it
    assert TokenizeImages(vl_tok, "text", image_pad=pad, loss_on_images=True)._apply_chunk(
        DecodeImages("image", max_pixels=84 * 84)._apply_chunk(chunk_of({"image": [a], "text": ["c"]}))
    ).token_fields["loss_mask"].all()


def test_interleaved_documents_keep_their_order(vl_tok, photo):
    tok = z.load_tokenizer(vl_tok)
    s, p, e = (tok.token_id(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))
    a = encode(photo.resize((60, 60)))
    dec = DecodeImages("images", max_pixels=56 * 56, merge=2)
    ti = TokenizeImages(vl_tok, "texts", image_start=s, image_pad=p, image_end=e, merge=2)
    chunk = chunk_of({"texts": [["one", None, "two", None]], "images": [[None, a, None, b"broken"]]})
    out = ti._apply_chunk(dec._apply_chunk(chunk))
    flat, lengths = tok.encode_plain(["one", "two"])
    one, two = flat[:lengths[0]].tolist(), flat[lengths[0]:].tolist()
    assert out.token_fields["input_ids"].tolist() == one + [s, p, p, p, p, e] + two + [tok.eos_id]
    assert out.counts["skipped_images"] == 1 and len(out.columns["images"][0]) == 1


def test_operator_errors_name_the_fix(vl_tok):
    with pytest.raises(z.PipelineError, match="exactly one"):
        z.Pipeline(1, 2).source("a", z.read.webdataset("x")).decode_images("jpg")
    with pytest.raises(z.PipelineError, match="multiple of"):
        z.Pipeline(1, 2).source("a", z.read.webdataset("x")).decode_images("jpg", size=100, merge=2)
    with pytest.raises(z.PipelineError, match="no decode_images"):
        z.Pipeline(1, 2).source("a", z.read.webdataset("x")).tokenize_images(vl_tok, image_pad=3)
    ti = TokenizeImages(vl_tok, image_pad="<no such token>")
    with pytest.raises(SourceError, match="not a token"):
        ti.image_ids  # noqa: B018 - the property resolves the ids
    with pytest.raises(SourceError, match="put .decode_images"):
        TokenizeImages(vl_tok, image_pad=3)._apply_chunk(chunk_of({"text": ["x"]}))


# -- pipelines -------------------------------------------------------------------------------------------
def vl_pipeline(dataset: dict[str, Path], tok, lanes: int = 8, resample: str = "bicubic", pixels: str = "flat"
                ) -> z.Pipeline:
    ids = dict(image_start="<|vision_start|>", image_pad="<|image_pad|>", image_end="<|vision_end|>")
    return (z.Pipeline(seed=11, lanes=lanes, flush_every=2)
            .source("wds", z.read.webdataset(str(dataset["wds"]), columns=["image=jpg;png", "txt"], chunk_rows=5),
                    weight=0.4)
            .source("hf", z.read.parquet(str(dataset["hf"]), columns=["image", "caption"], chunk_rows=4), weight=0.2)
            .source("obelics", z.read.parquet(str(dataset["obelics"]), columns=["texts", "images"], chunk_rows=3),
                    weight=0.2)
            .source("jsonl", z.read.jsonl(str(dataset["jsonl"] / "docs.jsonl"), columns=["texts", "images"],
                                          chunk_bytes=600, unit_bytes=1500), weight=0.2)
            .decode_images("image", sources=["wds", "hf"], max_pixels=56 * 84, merge=2, on_bad_image="drop_record",
                           resample=resample)
            .decode_images("images", sources=["obelics", "jsonl"], max_pixels=56 * 56, merge=2)
            .tokenize_images(tok, "txt", sources=["wds"], **ids)
            .tokenize_images(tok, "caption", sources=["hf"], **ids)
            .tokenize_images(tok, "texts", sources=["obelics", "jsonl"], **ids)
            .mix(by="tokens")
            .shuffle(buffer=6)
            .pack(seq_len=256)
            .batch(rows_per_lane=1, pixels=pixels))


@pytest.mark.timeout(600)
def test_vision_pipeline_is_elastic_across_world_sizes_and_resumes(dataset, vl_tok):
    pipe = vl_pipeline(dataset, vl_tok)
    ref = global_hashes(pipe, 1, 8)
    assert len(set(ref)) == 8
    for w in (2, 4, 8):
        assert global_hashes(pipe, w, 8) == ref, w
    assert global_hashes(pipe, 2, 8, resume_at=3, resume_world_size=4) == ref
    assert global_hashes(pipe, 8, 8, resume_at=5, resume_world_size=1) == ref
    assert global_hashes(pipe, 4, 8, num_workers=2, runner="thread") == ref
    assert global_hashes(pipe, 2, 8, num_workers=2, runner="pool") == ref


@pytest.mark.timeout(300)
def test_vision_batches_carry_images_with_their_documents(dataset, vl_tok):
    pipe = vl_pipeline(dataset, vl_tok, lanes=2, pixels="lists")  # the per-document payloads, as lists
    tok = z.load_tokenizer(vl_tok)
    pad = tok.token_id("<|image_pad|>")
    image_ids = [tok.token_id(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")]
    loader = pipe.build(rank=0, world_size=1)
    try:
        images = 0
        for _ in range(12):
            batch = next(loader)
            ids, seg = batch["input_ids"], batch["segment_ids"]
            for r in range(ids.shape[0]):
                for d, grids in enumerate(batch["image_grid_thw"][r]):
                    doc = ids[r][seg[r] == d + 1]
                    tokens = sum(t * h * w // 4 for t, h, w in grids)
                    assert int((doc == pad).sum()) == tokens  # a split piece holds its own images' tokens, all
                    for img, (t, h, w) in zip(batch["images"][r][d], grids):
                        assert img.shape == (t * h * w, 14 * 14 * 3) and img.dtype == np.uint8
                        images += 1
            targets = np.isin(batch["labels"].numpy(), image_ids)
            assert not (targets & (batch["loss_mask"].numpy() > 0)).any()  # no loss where an image token is next
            assert ((batch["labels"] == -100) & (batch["segment_ids"] > 0)).any()
        assert images > 20
        skipped = loader.metrics()["skipped_by_reason"]
        assert skipped.get("skipped_images", 0) >= 1 and skipped.get("bad_image_records", 0) >= 1
        by_source = loader.metrics()["skipped_by_source"]  # the bad images are all in the WebDataset shards
        assert by_source["wds"]["skipped_images"] == skipped["skipped_images"]
        assert all("skipped_images" not in by_source.get(s, {}) for s in ("hf", "obelics", "jsonl"))
    finally:
        loader.close()


@pytest.mark.timeout(300)
def test_a_payload_field_only_some_sources_have_is_hashed_at_every_world_size(dataset, vl_tok):
    """``__key__`` comes from the WebDataset source only: a rank whose rows hold no such document has no
    ``__key__`` in its batch, and the global digest must still equal the one-rank digest."""
    ids = dict(image_start="<|vision_start|>", image_pad="<|image_pad|>", image_end="<|vision_end|>")
    pipe = (z.Pipeline(seed=5, lanes=8, flush_every=2)
            .source("wds", z.read.webdataset(str(dataset["wds"]), columns=["__key__", "jpg;png", "txt"],
                                             chunk_rows=5), weight=0.1)
            .source("hf", z.read.parquet(str(dataset["hf"]), columns=["image", "caption"], chunk_rows=4), weight=0.9)
            .decode_images("jpg", sources=["wds"], max_pixels=56 * 84, merge=2)
            .decode_images("image", sources=["hf"], max_pixels=56 * 84, merge=2)
            .tokenize_images(vl_tok, "txt", sources=["wds"], **ids)
            .tokenize_images(vl_tok, "caption", sources=["hf"], **ids)
            .pack(seq_len=64).batch(rows_per_lane=1))
    loaders = [pipe.build(rank=r, world_size=8) for r in range(8)]
    try:
        lacking = sum("__key__" not in next(ld) for _ in range(6) for ld in loaders)
    finally:
        for ld in loaders:
            ld.close()
    assert lacking > 0  # the case this test is about happens
    assert global_hashes(pipe, 8, 6) == global_hashes(pipe, 1, 6)


def test_recipe_round_trip_keeps_the_fingerprint(dataset, vl_tok, tmp_path):
    pipe = vl_pipeline(dataset, vl_tok)
    path = tmp_path / "vl.toml"
    path.write_text(pipe.to_recipe())
    again = z.load_recipe(str(path)).to_pipeline()
    assert again.fingerprint == pipe.fingerprint
    assert vl_pipeline(dataset, vl_tok, resample="bilinear").fingerprint != pipe.fingerprint  # pixels differ

"""Shared pieces of the vision-language benchmarks (vl_fetch_batch.py, vl_pipeline.py, vl_stages.py).

* The corpus: ``make_vl_corpus.py``'s output (``DIR/wds/*.tar``, ``DIR/parquet/*.parquet`` with an image
  ``{bytes, path}`` struct and a ``caption``), and each peer's native format written from the same samples
  into ``DIR/native/`` (:func:`write_native`, also ``make_vl_corpus.py --native``): Grain's ArrayRecord,
  LitData's ``optimize`` chunks, Mosaic Streaming's MDS shards. Zephon and WebDataset read the tar shards,
  torchdata.nodes and the plain loop the Parquet files.
* Two tokenizers trained on the captions into ``DIR/native/``: a WordLevel model (whitespace words, 4096
  of them: cheap, for fetch- and decode-and-batch, where the loader is measured, not the tokenizer) and a
  byte-level BPE of 8192 tokens (the full pipeline), both with ``<|endoftext|>`` and the three image tokens.
* The image transforms the *peers* run, written with the libraries Zephon's ``decode_images`` calls and in
  the same steps (simplejpeg with DCT scaling for JPEG, Pillow otherwise; one bicubic resampling step;
  patches in Qwen2-VL's 2 x 2-merge order), so that every loader does the same work per image; the
  scripts check that the peers' pixels equal Zephon's on the first batch. (The corpus's pictures carry no
  EXIF orientation, so the peers' transform leaves orientation out; Zephon's operator reads it.)

Only Zephon's public API is used here (``zephon.Pipeline``, ``zephon.read``, ``zephon.tokenizer``).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

EOS = "<|endoftext|>"
IMAGE_START, IMAGE_PAD, IMAGE_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
SPECIALS = ["[UNK]", EOS, IMAGE_START, IMAGE_PAD, IMAGE_END]
PATCH, MERGE = 14, 2


# -- the corpus ------------------------------------------------------------------------------------------
def require_vl(data: Path) -> None:
    missing = [p for p in ("wds", "parquet", "manifest.json") if not (data / p).exists()]
    if missing:
        raise SystemExit(f"{data} has no vision-language corpus (missing {', '.join(missing)}); build it with\n"
                         f"  python scripts/bench/make_vl_corpus.py --out {data} --samples 20000")


def corpus_key(data: Path) -> str:
    m = json.loads((data / "manifest.json").read_text())
    files = {k: v for k, v in m.get("files", {}).items() if k.startswith(("wds/", "parquet/"))}
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]


def shards(data: Path, n: int | None = None) -> list[str]:
    """The WebDataset shards (the first ``n``: a subset of the corpus)."""
    return [str(p) for p in sorted((data / "wds").glob("*.tar"))][:n]


def parquet_files(data: Path, n: int | None = None) -> list[str]:
    return [str(p) for p in sorted((data / "parquet").glob("*.parquet"))][:n]


def iter_samples(data: Path, n_files: int | None = None) -> Iterator[tuple[str, bytes, str]]:
    """(key, encoded image, caption) of every sample, in corpus order (from the Parquet copy)."""
    import pyarrow.parquet as pq

    for f in parquet_files(data, n_files):
        pf = pq.ParquetFile(f)
        for rg in range(pf.metadata.num_row_groups):
            t = pf.read_row_group(rg, columns=["key", "image", "caption"])
            images = t.column("image").combine_chunks().field("bytes").to_pylist()
            yield from zip(t.column("key").to_pylist(), images, t.column("caption").to_pylist())


def pack_record(image: bytes, caption: str) -> bytes:
    """One ArrayRecord record: uint32 caption length, the caption (UTF-8), the image bytes."""
    c = caption.encode()
    return struct.pack("<I", len(c)) + c + image


def unpack_record(rec: bytes) -> dict:
    n = struct.unpack_from("<I", rec)[0]
    return {"image": rec[4 + n:], "caption": rec[4:4 + n].decode()}


def _litdata_items(path: str) -> Iterator[dict]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    for rg in range(pf.metadata.num_row_groups):
        t = pf.read_row_group(rg, columns=["image", "caption"])
        images = t.column("image").combine_chunks().field("bytes").to_pylist()
        for img, cap in zip(images, t.column("caption").to_pylist()):
            yield {"image": img, "caption": cap}


NATIVE_FORMATS = ("arrayrecord", "mds", "litdata")


def write_native(data: Path, force: bool = False, log=print, formats: tuple[str, ...] = NATIVE_FORMATS) -> Path:
    """Each peer's native format from the corpus's samples, into ``DIR/native/`` (kept while the corpus's
    manifest is unchanged), and the two tokenizers. Returns ``DIR/native``. ``formats``: only these (and
    the tokenizers), for a machine that has only some peers installed (scripts/device_check.py: Grain's
    ArrayRecord); such a partial folder is not stamped, so a later call for every format rewrites it."""
    out = data / "native"
    key = corpus_key(data)
    stamp = out / "corpus.key"
    if not force and stamp.exists() and stamp.read_text().strip() == key:
        return out
    unknown = set(formats) - set(NATIVE_FORMATS)
    if unknown:
        raise ValueError(f"write_native: unknown formats {sorted(unknown)}; known: {NATIVE_FORMATS}")
    import shutil

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    # ArrayRecord (Grain's recommended source): one file per Parquet file, group_size 1 (random access)
    from array_record.python.array_record_module import ArrayRecordWriter

    (out / "arrayrecord").mkdir()
    captions: list[str] = []
    for f in parquet_files(data):
        w = ArrayRecordWriter(str(out / "arrayrecord" / (Path(f).stem + ".array_record")), "group_size:1")
        for img, cap in ((s["image"], s["caption"]) for s in _litdata_items(f)):
            w.write(pack_record(img, cap))
            captions.append(cap)
        w.close()
    log(f"  arrayrecord: {time.perf_counter() - t0:.0f}s")
    if "mds" in formats:  # Mosaic Streaming MDS (uncompressed: the JPEGs are compressed already)
        mosaic_stub()
        from streaming import MDSWriter

        with MDSWriter(out=str(out / "mds"), columns={"image": "bytes", "caption": "str"}, size_limit="64mb") as w:
            for f in parquet_files(data):
                for s in _litdata_items(f):
                    w.write(s)
        log(f"  mds: {time.perf_counter() - t0:.0f}s")
    if "litdata" in formats:  # LitData optimize (uncompressed chunks of 64 MB; 'bytes' leaves hold the encoded images)
        import litdata

        litdata.optimize(fn=_litdata_items, inputs=parquet_files(data), output_dir=str(out / "litdata"),
                         chunk_bytes="64MB", num_workers=1, keep_data_ordered=True, verbose=False)
        log(f"  litdata: {time.perf_counter() - t0:.0f}s")
    train_tokenizers(captions, out)
    log(f"  tokenizers: {time.perf_counter() - t0:.0f}s")
    if set(formats) == set(NATIVE_FORMATS):
        stamp.write_text(key + "\n")
    return out


def train_tokenizers(captions: list[str], out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(captions, trainer=trainers.WordLevelTrainer(vocab_size=4096, special_tokens=SPECIALS,
                                                                       show_progress=False))
    tok.save(str(out / "wordlevel.json"))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(captions, trainer=trainers.BpeTrainer(
        vocab_size=8192, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    bpe.save(str(out / "bpe.json"))


def mosaic_stub() -> None:
    """Mosaic Streaming 0.13 imports ``streaming.vision`` (its torchvision datasets: CIFAR10, ...) from its
    package ``__init__``, and torchvision is not installed next to the CPU torch here. The benchmark uses
    none of those classes: an empty ``streaming.vision`` module stands in for it, in this process only."""
    import importlib.machinery
    import types

    if "streaming.vision" not in sys.modules:
        try:
            import torchvision  # noqa: F401
            return
        except ImportError:
            pass
        m = types.ModuleType("streaming.vision")
        m.__spec__ = importlib.machinery.ModuleSpec("streaming.vision", None)
        sys.modules["streaming.vision"] = m


# -- the peers' image transforms (the same steps as zephon's decode_images) -----------------------------------
def _dct_scale(h: int, w: int, need_h: int, need_w: int) -> int:
    limit = min(h // max(1, need_h), w // max(1, need_w))
    return next(s for s in (8, 4, 2, 1) if s <= max(1, limit))


def smart_resize(h: int, w: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size (transformers' arithmetic)."""
    hb, wb = round(h / factor) * factor, round(w / factor) * factor
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb, wb = max(factor, math.floor(h / beta / factor) * factor), max(factor, math.floor(w / beta / factor) * factor)
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return hb, wb


def decode_resize(data: bytes, crop: int | None = None, max_pixels: int | None = None,
                  min_pixels: int = 56 * 56) -> np.ndarray:
    """Decode (JPEG reduced by DCT scaling when the target is much smaller), convert to RGB and resize in
    one bicubic step: ``crop`` = shortest side to ``crop`` and centre crop to ``crop x crop``; ``max_pixels``
    = Qwen2-VL's smart_resize on the ``PATCH * MERGE`` grid. uint8 ``[H, W, 3]``."""
    from PIL import Image

    def target(h: int, w: int) -> tuple[int, int, tuple[int, int]]:
        if crop:
            r = max(crop / h, crop / w)
            return crop, crop, (math.ceil(h * r), math.ceil(w * r))
        th, tw = smart_resize(h, w, PATCH * MERGE, min_pixels, max_pixels or 0)
        return th, tw, (th, tw)

    if data[:3] == b"\xff\xd8\xff":
        import simplejpeg

        h, w, _, _ = simplejpeg.decode_jpeg_header(data)
        th, tw, need = target(h, w)
        s = _dct_scale(h, w, *need)
        px = simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=False, fastupsample=False,
                                    min_height=-(-h // s), min_width=-(-w // s), min_factor=s, strict=True)
    else:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            th, tw, need = target(h, w)
            px = np.asarray(im.convert("RGB"))
    ph, pw = px.shape[:2]
    if crop:
        r = max(th / ph, tw / pw)
        cw, ch = min(float(pw), tw / r), min(float(ph), th / r)
        box = ((pw - cw) / 2, (ph - ch) / 2, (pw + cw) / 2, (ph + ch) / 2)
    else:
        box = (0.0, 0.0, float(pw), float(ph))
    if (ph, pw) == (th, tw) and box == (0.0, 0.0, float(pw), float(ph)):
        return np.ascontiguousarray(px)
    return np.asarray(Image.fromarray(np.ascontiguousarray(px)).resize((tw, th), resample=Image.Resampling.BICUBIC,
                                                                       box=box))


def patchify(px: np.ndarray, p: int = PATCH, m: int = MERGE) -> np.ndarray:
    """``[H, W, 3]`` -> ``[H/p * W/p, p*p*3]``, the ``m x m`` patches of one token consecutive."""
    h, w, c = px.shape
    gh, gw = h // p, w // p
    grid = px.reshape(gh // m, m, p, gw // m, m, p, c).transpose(0, 3, 1, 4, 2, 5, 6)
    return np.ascontiguousarray(grid).reshape(gh * gw, p * p * c)


# -- reporting ---------------------------------------------------------------------------------------------
def load_now() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def vl_machine_info() -> dict[str, Any]:
    from _common import machine_info

    info = machine_info()
    from importlib.metadata import version

    for mod in ("zephon-loader", "litdata", "webdataset", "mosaicml-streaming", "simplejpeg", "pillow", "array-record"):
        try:
            info[mod] = version(mod)
        except Exception:  # noqa: BLE001
            info[mod] = None
    info.pop("zephon", None)
    try:  # read-only: the commit this run's Zephon code is based on, and whether the work tree differs
        import subprocess

        repo = Path(__file__).resolve().parents[2]
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "zephon"], cwd=repo, capture_output=True,
                               text=True)
        info["commit"] = head.stdout.strip() + (" + uncommitted changes under zephon/" if dirty.stdout.strip() else "")
    except Exception:  # noqa: BLE001
        pass
    return info


def profile(iterator, batches: int, warmup: int, top: int = 30) -> str:
    """cProfile of ``batches`` batches of ``iterator`` after ``warmup`` (this process only: worker
    processes are not seen), by internal time: where an inline configuration's time goes."""
    import cProfile
    import pstats

    for _ in range(warmup):
        next(iterator)
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for _ in range(batches):
        next(iterator)
    pr.disable()
    wall = time.perf_counter() - t0
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    return f"{batches} batches in {wall:.2f}s (profiled)\n" + buf.getvalue()


def spread(xs: list[float]) -> str:
    return f"{min(xs) / 1e3:.1f}-{max(xs) / 1e3:.1f}k" if xs else ""

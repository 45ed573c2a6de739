"""Real images and image-text datasets for the vision tests, built here from pictures pip packages ship.

The pictures are scikit-image's sample photographs (and scikit-learn's, matplotlib's when installed),
through :mod:`zephon.demo.vl` (the corpus builder under test elsewhere); every file is written with the
real codecs (Pillow) and real containers (Python's ``tarfile``, pyarrow), never mocked.
"""

from __future__ import annotations

import os

import io
import json
import tarfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # Hugging Face's Image feature


def pictures(max_side: int = 512) -> list[Any]:
    """``[(Picture, PIL.Image)]``: the sample photographs installed packages ship (skipped when none is)."""
    from zephon.demo.vl import package_pictures, usable_pictures

    loaded = usable_pictures([p for p in package_pictures() if not p.name.startswith("matplotlib/")], max_side)
    if len(loaded) < 4:
        why = "needs scikit-image's (or scikit-learn's) sample pictures: pip install scikit-image"
        if os.environ.get("CI"):  # .ci/run installs the vision extra: missing pictures are a failure there
            pytest.fail(why + "; CI must run every test", pytrace=False)
        pytest.skip(why)
    return loaded


def encode(im: Any, fmt: str = "JPEG", quality: int = 85, orientation: int | None = None,
           progressive: bool = False) -> bytes:
    """``im`` (a PIL image) encoded by Pillow; ``orientation``: an EXIF orientation tag to write."""
    from PIL import Image

    buf = io.BytesIO()
    kwargs: dict[str, Any] = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kwargs["exif"] = exif.tobytes()
    if fmt == "JPEG":
        kwargs.update(quality=quality, progressive=progressive)
    im.save(buf, fmt, **kwargs)
    return buf.getvalue()


def crop(loaded: Sequence[Any], k: int, h: int, w: int) -> Any:
    """A ``w`` x ``h`` crop-and-scale of picture ``k % len(loaded)`` (deterministic)."""
    from PIL import Image

    _, im = loaded[k % len(loaded)]
    x = (k * 37) % max(1, im.width // 3)
    y = (k * 53) % max(1, im.height // 3)
    return im.resize((w, h), Image.Resampling.BILINEAR, box=(x, y, x + im.width * 2 // 3, y + im.height * 2 // 3))


def add_member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), 1_700_000_000
    tf.addfile(info, io.BytesIO(data))


def write_shard(path: Path, members: Sequence[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT,
                extra: Sequence[tarfile.TarInfo] = ()) -> Path:
    """A tar file of ``members`` (name, bytes) written by Python's tarfile in ``fmt``; ``extra``: non-file
    entries (folders, links) added first."""
    with tarfile.open(path, "w", format=fmt) as tf:
        for info in extra:
            tf.addfile(info)
        for name, data in members:
            add_member(tf, name, data)
    return path


def captions(texts: Sequence[str], n: int) -> list[str]:
    """``n`` captions of real text (first sentences of the corpus's docstrings), some with placeholders."""
    firsts = [t.strip().split("\n")[0][:160] for t in texts if len(t.strip()) > 30]
    out = []
    for k in range(n):
        c = firsts[(k * 7) % len(firsts)]
        out.append(f"{c} <image> {firsts[(k * 7 + 3) % len(firsts)][:60]}" if k % 5 == 0 else c)
    return out


def build_dataset(root: Path, texts: Sequence[str], loaded: Sequence[Any]) -> dict[str, Path]:
    """Four sources of the same kind of data, each in its own layout:

    - ``wds/``: 3 WebDataset shards of 24 samples (``.jpg`` or ``.png``, ``.txt``, ``.json``), with a
      zero-byte, a truncated and a not-an-image ``.jpg`` among them;
    - ``hf/``: 2 Parquet files, ``image`` a ``{bytes, path}`` struct (some rows path-only, the file in
      ``hf/images/``) and ``caption``;
    - ``obelics/``: 2 Parquet files of interleaved documents (``texts``, ``images`` lists of binary);
    - ``jsonl/``: interleaved documents whose images are paths relative to the ``.jsonl`` file.
    """
    caps = captions(texts, 200)
    out = {k: root / k for k in ("wds", "hf", "obelics", "jsonl")}
    for p in out.values():
        p.mkdir(parents=True, exist_ok=True)
    k = 0
    for s in range(3):
        members = []
        for i in range(24):
            key = f"{s:02d}/{i:05d}"
            h, w = 48 + (k * 13) % 100, 56 + (k * 29) % 120
            im = crop(loaded, k, h, w)
            if (s, i) == (0, 5):
                img, ext = b"", "jpg"
            elif (s, i) == (1, 7):
                data = encode(im)
                img, ext = data[:len(data) // 2], "jpg"
            elif (s, i) == (2, 11):
                img, ext = b"this is not an image, it is text", "jpg"
            else:
                img, ext = (encode(im, "PNG"), "png") if k % 6 == 1 else (encode(im, quality=60 + k % 35), "jpg")
            members += [(f"{key}.{ext}", img), (f"{key}.txt", caps[k].encode()),
                        (f"{key}.json", json.dumps({"k": k}).encode())]
            k += 1
        write_shard(out["wds"] / f"shard-{s:04d}.tar", members)
    (out["hf"] / "images").mkdir(exist_ok=True)
    for f in range(2):
        rows = []
        for i in range(20):
            im = crop(loaded, k, 40 + (k * 17) % 90, 64 + (k * 11) % 100)
            data = encode(im, quality=70 + k % 25)
            if i % 4 == 3:  # path only: the image file sits next to the data
                name = f"images/{f}-{i}.jpg"
                (out["hf"] / name).write_bytes(data)
                rows.append({"image": {"bytes": None, "path": name}, "caption": caps[k]})
            else:
                rows.append({"image": {"bytes": data, "path": f"{f}-{i}.jpg"}, "caption": caps[k]})
            k += 1
        table = pa.table({"image": pa.array([r["image"] for r in rows], type=IMAGE_STRUCT),
                          "caption": [r["caption"] for r in rows]})
        pq.write_table(table, out["hf"] / f"part-{f}.parquet", row_group_size=7)
    for f in range(2):
        docs_texts, docs_images = [], []
        for d in range(12):
            texts_d: list[str | None] = []
            images_d: list[bytes | None] = []
            for j in range(2 + d % 3):
                texts_d.append(caps[(k + j) % len(caps)])
                images_d.append(None)
                if (d + j) % 2 == 0:
                    texts_d.append(None)
                    images_d.append(encode(crop(loaded, k + j, 50 + (k * 7) % 60, 50 + (k * 5) % 80)))
            k += 5
            docs_texts.append(texts_d)
            docs_images.append(images_d)
        table = pa.table({"texts": pa.array(docs_texts, type=pa.list_(pa.string())),
                          "images": pa.array(docs_images, type=pa.list_(pa.binary()))})
        pq.write_table(table, out["obelics"] / f"part-{f}.parquet", row_group_size=5)
    (out["jsonl"] / "img").mkdir(exist_ok=True)
    with open(out["jsonl"] / "docs.jsonl", "w", encoding="utf-8") as fh:
        for d in range(16):
            name = f"img/{d}.png" if d % 3 else f"img/{d}.jpg"
            (out["jsonl"] / name).write_bytes(encode(crop(loaded, k, 60, 60 + d), "PNG" if d % 3 else "JPEG"))
            k += 1
            fh.write(json.dumps({"texts": [caps[d], None, caps[d + 1]], "images": [None, name, None]}) + "\n")
    return out


def unpatchify(patches: np.ndarray, grid: tuple[int, int, int], patch_size: int, merge: int) -> np.ndarray:
    """The inverse of :func:`zephon.imaging.patchify`, written independently (index arithmetic, no reshape)."""
    _, gh, gw = grid
    p, m = patch_size, merge
    c = patches.shape[1] // (p * p)
    out = np.zeros((gh * p, gw * p, c), dtype=patches.dtype)
    k = 0
    for gy in range(gh // m):
        for gx in range(gw // m):
            for dy in range(m):
                for dx in range(m):
                    y, x = (gy * m + dy) * p, (gx * m + dx) * p
                    out[y:y + p, x:x + p] = patches[k].reshape(p, p, c)
                    k += 1
    return out

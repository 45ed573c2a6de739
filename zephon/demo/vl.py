"""A real-image corpus made offline: crops of the pictures that installed packages ship, with captions.

No network. The pictures are real photographs and pictures that Python packages ship (scikit-image's
sample data, scikit-learn's two sample photographs, matplotlib's sample data) and, when installed, the
Debian desktop background packages under ``/usr/share/backgrounds`` (``gnome-backgrounds``,
``mate-backgrounds``, ``lomiri-wallpapers``...). Each sample is a crop of one picture (a random region of
a random aspect ratio, sometimes mirrored), scaled to 200-600 pixels on its long side and re-encoded as a
JPEG of quality 60-95 (one in twenty as a PNG). Its caption is real text: the picture's own description
(the docstring of the scikit-image function that loads it, a package's README, a wallpaper's name and
author) followed by a description of the crop (region, size, quality). Everything is a pure function of
(pictures, seed, sample number): the same packages give the same bytes.

Written as WebDataset shards (``<key>.jpg`` / ``.png``, ``.txt``, ``.json``), as Parquet with the same
samples (``key``, ``image`` as Hugging Face's ``{bytes, path}`` struct, ``caption``, ``source``), and as
interleaved documents in Parquet (OBELICS layout: ``texts`` and ``images`` lists, one non-null per
position) whose paragraphs are standard-library docstrings (:mod:`zephon.demo.text`).

:func:`build_quickstart` makes the small set ``recipes/vl_quickstart.toml`` reads (seconds);
``scripts/bench/make_vl_corpus.py`` the full one (20k+ samples).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import io
import json
import math
import re
import tarfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .text import _train_bpe

DEBIAN_BACKGROUNDS = ("/usr/share/backgrounds",)
IMAGE_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")  # user-defined pieces of tok_vl.model
_PICTURE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".gif")
# scikit-image sample files that are pictures of something (not synthetic patterns or volumes)
_SKIMAGE_SKIP = {"chessboard_GRAY", "chessboard_RGB", "phantom", "horse", "logo", "color", "multipage",
                 "multipage_rgb"}
_MIN_PICTURE_SIDE = 200


@dataclass(frozen=True)
class Picture:
    """One source picture: a stable name, its file, and real text about it."""

    name: str
    path: Path
    title: str
    description: str


@dataclass(frozen=True)
class Sample:
    key: str
    image: bytes
    ext: str  # "jpg" or "png"
    caption: str
    meta: dict[str, Any]


# -- finding pictures ---------------------------------------------------------------------------------------
def _package_dir(name: str) -> Path | None:
    """A package's folder, without importing it (scikit-image's import alone takes seconds)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _first_paragraphs(doc: str, limit: int = 400) -> str:
    """The prose of a docstring before its numpydoc sections, URLs and markup dropped, whole sentences."""
    prose = re.split(r"\n\s*(Returns|Parameters|Notes|References|Examples)\n\s*-{3,}", doc)[0]
    text = re.sub(r"<?https?://\S+>?`?_*", "", prose)
    text = re.sub(r"`+|\s+", lambda m: " " if m.group(0).strip() == "" else "", text).strip()
    sentences = re.split(r"(?<=[.!?])\s+", text)
    out = ""
    for s in sentences:
        if out and len(out) + len(s) > limit:
            break
        out = f"{out} {s}".strip()
    return out if out.endswith((".", "!", "?")) else out + "."


def _skimage_docs(folder: Path) -> dict[str, str]:
    """file stem -> the docstring of the scikit-image function that loads it (read with ``ast``)."""
    out: dict[str, str] = {}
    source = folder / "data" / "_fetchers.py"
    if not source.is_file():
        return out
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if not isinstance(node, ast.FunctionDef) or not ast.get_docstring(node):
            continue
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.Constant) and \
                    isinstance(call.args[0].value, str) and call.args[0].value.startswith("data/"):
                out.setdefault(Path(call.args[0].value).stem, ast.get_docstring(node) or "")
    return out


def package_pictures() -> list[Picture]:
    """The pictures pip-installed packages ship (scikit-image, scikit-learn, matplotlib: any installed)."""
    pictures: list[Picture] = []
    skimage = _package_dir("skimage")
    if skimage is not None:
        docs = _skimage_docs(skimage)
        for path in sorted((skimage / "data").glob("*")):
            if path.suffix.lower() in _PICTURE_EXTS and path.stem not in _SKIMAGE_SKIP:
                doc = docs.get(path.stem, "")
                title = doc.strip().splitlines()[0].rstrip(".") if doc else path.stem.replace("_", " ")
                pictures.append(Picture(f"skimage/{path.stem}", path, title,
                                        _first_paragraphs(doc) if doc else f"The {path.stem} sample of scikit-image."))
    sklearn = _package_dir("sklearn")
    if sklearn is not None:
        readme = (sklearn / "datasets" / "images" / "README.txt")
        credit = readme.read_text(encoding="utf-8").split("\n\n")[0] if readme.is_file() else ""
        for path in sorted((sklearn / "datasets" / "images").glob("*.jpg")):
            pictures.append(Picture(f"sklearn/{path.stem}", path, f"A photograph of {path.stem}",
                                    _first_paragraphs(credit.replace("china.jpg", path.name)) if credit else
                                    "A sample photograph of scikit-learn."))
    mpl = _package_dir("matplotlib")
    if mpl is not None:
        for name, title in (("grace_hopper.jpg", "Grace Hopper, computer scientist and US Navy rear admiral"),
                            ("Minduka_Present_Blue_Pack.png", "A blue gift pack")):
            path = mpl / "mpl-data" / "sample_data" / name
            if path.is_file():
                pictures.append(Picture(f"matplotlib/{path.stem}", path, title,
                                        "Sample data needed for some of matplotlib's examples and docs."))
    return pictures


def _wallpaper_names(root: Path) -> dict[str, str]:
    """file path -> the <name> the desktop's background XML files give it."""
    names: dict[str, str] = {}
    for xml in sorted(Path("/usr/share").glob("*-background-properties/*.xml")):
        text = xml.read_text(encoding="utf-8", errors="replace")
        for block in re.findall(r"<wallpaper[^>]*>(.*?)</wallpaper>", text, re.DOTALL):
            name = re.search(r"<name>(.*?)</name>", block, re.DOTALL)
            for f in re.findall(r"<filename[^>]*>(.*?)</filename[^>]*>", block, re.DOTALL):
                if name:
                    names[f.strip()] = name.group(1).strip()
    return names


def debian_pictures(roots: Sequence[str] = DEBIAN_BACKGROUNDS) -> list[Picture]:
    """The raster pictures of the installed desktop background packages (none when none is installed)."""
    pictures: list[Picture] = []
    for root in map(Path, roots):
        if not root.is_dir():
            continue
        names = _wallpaper_names(root)
        for path in sorted(p for p in root.rglob("*") if p.suffix.lower() in _PICTURE_EXTS and p.is_file()):
            stem = path.stem
            by = re.match(r"(.+?)_by_+(.+)", stem)
            title = names.get(str(path)) or (f"{by.group(1).replace('_', ' ').replace('-', ' ')}" if by else
                                             stem.replace("_", " ").replace("-", " "))
            credit = f"A desktop background by {by.group(2).replace('_', ' ')}." if by else \
                f"A desktop background shipped in the {path.parent.name} collection."
            pictures.append(Picture(f"debian/{path.relative_to(root).with_suffix('')}", path, title, credit))
    return pictures


def load_picture(picture: Picture, max_side: int = 1280) -> Any:
    """The picture as an RGB ``PIL.Image`` with its long side at most ``max_side`` (JPEGs decoded reduced)."""
    from PIL import Image, ImageOps

    with Image.open(picture.path) as im:
        im.draft("RGB", (max_side, max_side))
        im = ImageOps.exif_transpose(im.convert("RGB"))
        if max(im.size) > max_side:
            scale = max_side / max(im.size)
            im = im.resize((max(1, round(im.width * scale)), max(1, round(im.height * scale))),
                           Image.Resampling.LANCZOS)
        return im.copy()


def usable_pictures(pictures: Iterable[Picture], max_side: int = 1280) -> list[tuple[Picture, Any]]:
    """The pictures that load and are at least 200 pixels on both sides, loaded."""
    out = []
    for p in pictures:
        try:
            im = load_picture(p, max_side)
        except (OSError, ValueError):
            continue
        if min(im.size) >= _MIN_PICTURE_SIDE:
            out.append((p, im))
    return out


# -- samples ------------------------------------------------------------------------------------------------
def _region(cx: float, cy: float) -> str:
    v = ("upper", "middle", "lower")[min(2, int(cy * 3))]
    h = ("left", "centre", "right")[min(2, int(cx * 3))]
    return "centre" if (v, h) == ("middle", "centre") else f"{v} {h}" if v != "middle" else f"middle {h}"


def make_sample(index: int, loaded: Sequence[tuple[Picture, Any]], seed: int, min_side: int = 200,
                max_side: int = 600, prefix: str = "") -> Sample:
    """Sample ``index``: a crop of picture ``index % len(loaded)`` drawn from (seed, index) alone."""
    from PIL import Image

    picture, im = loaded[index % len(loaded)]
    rng = np.random.default_rng([seed, index])
    long_side = int(rng.integers(min_side, max_side + 1))
    aspect = float(np.exp(rng.uniform(math.log(0.6), math.log(1 / 0.6))))  # width / height
    w, h = (long_side, max(64, round(long_side / aspect))) if aspect >= 1 else (max(64, round(long_side * aspect)),
                                                                                long_side)
    full = min(im.width / w, im.height / h)  # the largest box of this aspect ratio inside the picture
    frac = float(rng.uniform(0.3, 1.0))
    cw, ch = w * full * frac, h * full * frac
    x0, y0 = float(rng.uniform(0, im.width - cw)), float(rng.uniform(0, im.height - ch))
    crop = im.resize((w, h), Image.Resampling.LANCZOS, box=(x0, y0, x0 + cw, y0 + ch))
    mirrored = bool(rng.random() < 0.25)
    if mirrored:
        crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    quality = int(rng.integers(60, 96))
    png = bool(rng.random() < 0.05)
    buf = io.BytesIO()
    if png:
        crop.save(buf, "PNG")
    else:
        crop.save(buf, "JPEG", quality=quality, progressive=bool(rng.random() < 0.2))
    region = _region((x0 + cw / 2) / im.width, (y0 + ch / 2) / im.height)
    share = round(100 * cw / im.width)
    coding = "a PNG" if png else f"a JPEG of quality {quality}"
    caption = (f"{picture.title}. {picture.description} This is a {w} by {h} pixel crop of the {region} of the "
               f"picture, {share}% of its width{', mirrored' if mirrored else ''}, stored as {coding}.")
    meta = {"source": picture.name, "box": [round(x0, 2), round(y0, 2), round(cw, 2), round(ch, 2)],
            "width": w, "height": h, "mirrored": mirrored, "format": "png" if png else "jpeg",
            "quality": None if png else quality}
    return Sample(f"{prefix}{index:07d}", buf.getvalue(), "png" if png else "jpg", caption, meta)


def make_samples(loaded: Sequence[tuple[Picture, Any]], count: int, seed: int, start: int = 0, prefix: str = "",
                 min_side: int = 200, max_side: int = 600) -> Iterator[Sample]:
    """``count`` distinct samples (a crop whose bytes repeat an earlier one is drawn again under the next index)."""
    seen: set[bytes] = set()
    index, made = start, 0
    while made < count:
        s = make_sample(index, loaded, seed, min_side, max_side, prefix)
        index += 1
        digest = hashlib.sha256(s.image).digest()
        if digest in seen:
            continue
        seen.add(digest)
        made += 1
        yield s


# -- writers ------------------------------------------------------------------------------------------------
def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644  # fixed metadata: the same samples, the same bytes
    tf.addfile(info, io.BytesIO(data))


def write_corpus(samples: Iterable[Sample], out_dir: str | Path, per_shard: int = 1000,
                 parquet: bool = True) -> dict[str, int]:
    """WebDataset shards ``out_dir/wds/shard-NNNNNN.tar`` and, with ``parquet``, the same samples in
    ``out_dir/parquet/part-NNNNNN.parquet`` (one file per shard). Returns counts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    (out / "wds").mkdir(parents=True, exist_ok=True)
    if parquet:
        (out / "parquet").mkdir(parents=True, exist_ok=True)
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    shard: list[Sample] = []
    counts = {"samples": 0, "shards": 0, "bytes": 0}

    def flush() -> None:
        n = counts["shards"]
        with tarfile.open(out / "wds" / f"shard-{n:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
            for s in shard:
                _add(tf, f"{s.key}.{s.ext}", s.image)
                _add(tf, f"{s.key}.txt", s.caption.encode())
                _add(tf, f"{s.key}.json", json.dumps(s.meta, sort_keys=True).encode())
        if parquet:
            table = pa.table({"key": [s.key for s in shard],
                              "image": pa.array([{"bytes": s.image, "path": f"{s.key}.{s.ext}"} for s in shard],
                                                type=image_type),
                              "caption": [s.caption for s in shard], "source": [s.meta["source"] for s in shard]})
            pq.write_table(table, out / "parquet" / f"part-{n:06d}.parquet", row_group_size=256)
        counts["shards"] += 1
        shard.clear()

    for s in samples:
        shard.append(s)
        counts["samples"] += 1
        counts["bytes"] += len(s.image)
        if len(shard) == per_shard:
            flush()
    if shard:
        flush()
    return counts


def write_interleaved(samples: Iterator[Sample], paragraphs: Sequence[str], out_dir: str | Path, documents: int,
                      seed: int, files: int = 2) -> int:
    """``documents`` interleaved documents in ``out_dir/part-NNNN.parquet`` (``texts``, ``images``: one
    non-null per position; 2-4 paragraphs and 1-3 images each). Returns the number of images used."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 1 << 20])
    rows: list[dict[str, Any]] = []
    used = 0
    for d in range(documents):
        texts = [paragraphs[int(rng.integers(len(paragraphs)))] for _ in range(int(rng.integers(2, 5)))]
        images = [next(samples) for _ in range(int(rng.integers(1, 4)))]
        used += len(images)
        slots: list[tuple[str | None, bytes | None]] = [(t, None) for t in texts]
        for s in images:  # each image at a random place among the paragraphs
            at = int(rng.integers(0, len(slots) + 1))
            slots.insert(at, (None, s.image))
        rows.append({"id": d, "texts": [t for t, _ in slots], "images": [i for _, i in slots]})
    for i in range(files):
        part = rows[i::files]
        table = pa.table({"id": [r["id"] for r in part],
                          "texts": pa.array([r["texts"] for r in part], type=pa.list_(pa.string())),
                          "images": pa.array([r["images"] for r in part], type=pa.list_(pa.binary()))})
        pq.write_table(table, out / f"part-{i:04d}.parquet", row_group_size=32)
    return used


def train_vl_tokenizer(out_model: str | Path, texts: list[str], vocab_size: int = 4000) -> Path:
    """A SentencePiece BPE model with the image tokens :data:`IMAGE_TOKENS` as pieces of their own."""
    return _train_bpe(out_model, texts, vocab_size, user_defined_symbols=list(IMAGE_TOKENS))


# -- the quickstart ------------------------------------------------------------------------------------------
def unavailable() -> str | None:
    """Why the vision-language demo cannot be built here, or None when it can."""
    if importlib.util.find_spec("PIL") is None:
        return "Pillow is not installed (python -m pip install -e '.[vision]')"
    if len(quickstart_pictures()) < 2:
        return "scikit-image's sample pictures are not installed (python -m pip install -e '.[vision]')"
    return None


def quickstart_pictures() -> list[Picture]:
    """scikit-image's pictures only: the quickstart's bytes then depend on one package of the ``vision``
    extra, not on which other packages happen to be installed."""
    return [p for p in package_pictures() if p.name.startswith("skimage/")]


def build_quickstart(out_dir: str | Path, documents: Sequence[tuple[str, str, str]], pairs: int = 600,
                     docs: int = 120, seed: int = 20240) -> dict[str, int]:
    """``out_dir/data/vl/pairs/*.tar`` (image-caption pairs), ``out_dir/data/vl/docs/*.parquet``
    (interleaved documents) and ``out_dir/tok_vl.model``, from scikit-image's pictures only (so that the
    quickstart's batches are the same wherever the same scikit-image is installed)."""
    out = Path(out_dir)
    loaded = usable_pictures(quickstart_pictures(), max_side=768)
    samples = list(make_samples(loaded, pairs, seed))
    counts = write_corpus(samples, out / "data" / "vl" / "pairs", per_shard=-(-pairs // 4), parquet=False)
    for p in (out / "data" / "vl" / "pairs" / "wds").glob("*.tar"):  # the recipe reads data/vl/pairs/*.tar
        p.replace(out / "data" / "vl" / "pairs" / p.name)
    (out / "data" / "vl" / "pairs" / "wds").rmdir()
    # paragraphs short enough that a document (2-4 of them and 1-3 images) fits a 1024-token row whole
    paragraphs = [t for kind, _, t in documents if kind == "prose" and 80 <= len(t) <= 600]
    images = write_interleaved(make_samples(loaded, 10 * docs, seed, start=1 << 30, prefix="d"), paragraphs,
                               out / "data" / "vl" / "docs", docs, seed)
    train_vl_tokenizer(out / "tok_vl.model", paragraphs + [s.caption for s in samples])
    return {"vl_pairs": counts["samples"], "vl_docs": docs, "vl_doc_images": images, "vl_pictures": len(loaded)}

"""Golden hashes of vision-language pipelines: pixels, tokens and image grids of the first global batches.

The text golden test (``test_golden.py``) pins the text engine; this one pins what the image operators
and the multimodal packer and collator deliver, so that a change to decoding, resizing, patching,
image tokens, packing with images or pixel collation cannot alter a byte unnoticed. The hashes were
recorded on commit c417fe2 (before the Pillow decoder stopped round-tripping through numpy) and change
only on purpose, in a commit that says why (``python -m tests.test_golden_vl`` rewrites them).

The inputs are the vision tests' dataset (:func:`tests.vision_data.build_dataset`: the sample pictures
installed packages ship, encoded by Pillow) and a SentencePiece model trained on the test corpus.
Both depend on library versions (Pillow's JPEG encoder, scikit-image's pictures, the Python that
builds the corpus): ``inputs`` pins their digests and the codec versions, so that other inputs are
reported as such instead of as a change of the engine. CI pins those versions (``.ci/constraints.txt``).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.optional import require, require_recorded_inputs

import zephon as z
from zephon.verify import global_hashes

from .vision_data import build_dataset, pictures

GOLDEN = Path(__file__).with_name("golden_vl_hashes.json")
STEPS = 12
DATA_SUFFIXES = (".tar", ".parquet", ".jsonl", ".jpg", ".png")
IDS = dict(image_start="<|vision_start|>", image_pad="<|image_pad|>", image_end="<|vision_end|>")

require("PIL")


def pipelines(data: dict[str, Path], tok: Any) -> dict[str, z.Pipeline]:
    """name -> pipeline: each image path (Pillow and simplejpeg decoders, fit and crop, flat / fixed /
    stacked pixels, captions and interleaved documents, bad images skipped)."""
    fit = dict(max_pixels=56 * 84, merge=2)
    return {
        "wds_fit_flat_pillow": (
            z.Pipeline(seed=11, lanes=4, flush_every=1)
            .source("wds", z.read.webdataset(str(data["wds"]), columns=["image=jpg;png", "txt"], chunk_rows=5))
            .decode_images("image", jpeg_decoder="pillow", on_bad_image="skip", **fit)
            .tokenize_images(tok, "txt", **IDS)
            .pack(seq_len=96, algorithm="best_fit", max_images_per_row=3)
            .batch(rows_per_lane=1, pixels="flat", positions="mrope")),
        "hf_crop_fixed_simplejpeg": (
            z.Pipeline(seed=12, lanes=4)
            .source("hf", z.read.parquet(str(data["hf"]), columns=["image", "caption"], chunk_rows=4))
            .decode_images("image", size=56, merge=2, jpeg_decoder="simplejpeg")
            .tokenize_images(tok, "caption", **IDS)
            .pack(seq_len=96, algorithm="first_fit", max_images_per_row=2)
            .batch(rows_per_lane=1, pixels="fixed")),
        "interleaved_mixed_pillow": (
            z.Pipeline(seed=13, lanes=4, flush_every=2)
            .source("obelics", z.read.parquet(str(data["obelics"]), columns=["texts", "images"], chunk_rows=3),
                    weight=0.6)
            .source("jsonl", z.read.jsonl(str(data["jsonl"] / "docs.jsonl"), columns=["texts", "images"]),
                    weight=0.4)
            .decode_images("images", jpeg_decoder="pillow", **fit)
            .tokenize_images(tok, "texts", **IDS)
            .mix(by="tokens")
            .shuffle(buffer=3)
            .pack(seq_len=128, algorithm="best_fit", max_patches_per_row=200)
            .batch(rows_per_lane=1, pixels="flat", positions="mrope")),
        "wds_decode_and_batch_pillow": (
            z.Pipeline(seed=14, lanes=4)
            .source("wds", z.read.webdataset(str(data["wds"]), columns=["image=jpg;png", "txt"], chunk_rows=4))
            .decode_images("image", size=(42, 56), patchify=False, jpeg_decoder="pillow", on_bad_image="drop_record")
            .batch(rows_per_lane=2, stack=["images"])),
    }


def compute(data: dict[str, Path], tok: Any) -> dict[str, list[str]]:
    return {name: global_hashes(pipe, 1, STEPS, num_workers=2) for name, pipe in pipelines(data, tok).items()}


def inputs(data: dict[str, Path], tok_path: Path) -> dict[str, str]:
    import PIL
    import simplejpeg

    root, h = data["wds"].parent, hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.suffix in DATA_SUFFIXES):  # not an index cache a run wrote
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return {"vl_dataset": h.hexdigest()[:16], "vl_tokenizer": hashlib.sha256(tok_path.read_bytes()).hexdigest()[:16],
            "pillow": PIL.__version__, "simplejpeg": simplejpeg.__version__}


def build_inputs(root: Path, texts: list[str]) -> tuple[dict[str, Path], Path]:
    from zephon.demo.vl import train_vl_tokenizer

    data = build_dataset(root / "vl", texts, pictures())
    (root / "tok").mkdir(exist_ok=True)
    return data, train_vl_tokenizer(root / "tok" / "tok.model", texts, vocab_size=600)


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def vl_inputs(tmp_path_factory, corpus_texts) -> tuple[dict[str, Path], Path]:
    require("simplejpeg")
    return build_inputs(tmp_path_factory.mktemp("golden_vl"), corpus_texts)


@pytest.fixture(scope="module")
def recorded_vl_inputs(golden, vl_inputs) -> None:
    """Not the engine: the images, tokenizer and codecs these hashes were recorded on (captions from this
    interpreter's standard library, pictures encoded by the installed Pillow: see ``require_recorded_inputs``)."""
    got, want = inputs(*vl_inputs), golden["inputs"]
    codecs = ("pillow", "simplejpeg")
    require_recorded_inputs(got, want, {"Python": golden["python"], **{k: want[k] for k in codecs}},
                            {"Python": sys.version.split()[0], **{k: got[k] for k in codecs}},
                            "vision-language golden hashes")


@pytest.mark.parametrize("name", ["wds_fit_flat_pillow", "hf_crop_fixed_simplejpeg", "interleaved_mixed_pillow",
                                  "wds_decode_and_batch_pillow"])
def test_vl_pipelines_keep_their_batches(golden, vl_inputs, recorded_vl_inputs, name):
    data, tok_path = vl_inputs
    got = global_hashes(pipelines(data, z.tokenizer(str(tok_path)))[name], 1, STEPS, num_workers=2)
    want = golden["hashes"][name]
    assert len(got) == len(want) == STEPS
    first_bad = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert first_bad is None, f"{name}: global batch {first_bad} differs from its golden hash"


def write_golden(tmp: Path) -> None:
    """Regenerate golden_vl_hashes.json (by hand, on purpose: ``python -m tests.test_golden_vl``)."""
    from .conftest import build_corpus, read_corpus_texts

    texts = read_corpus_texts(build_corpus(tmp / "corpus"))
    data, tok_path = build_inputs(tmp, texts)
    record = {"python": sys.version.split()[0], "steps": STEPS,
              "inputs": inputs(data, tok_path), "hashes": compute(data, z.tokenizer(str(tok_path)))}
    GOLDEN.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        write_golden(Path(d))
    print(f"wrote {GOLDEN}")

"""scripts/train_tiny_vlm.py: a few training steps of the tiny vision-language model on Zephon's batches."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

from tests.optional import require

from .test_vision_batches import data, pipeline, vl_tok  # noqa: F401 - the fixtures and the pipeline

REPO = Path(__file__).resolve().parents[1]
require("PIL")


def script():
    spec = importlib.util.spec_from_file_location("train_tiny_vlm", REPO / "scripts" / "train_tiny_vlm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tiny_vlm_consumes_the_batch_and_learns(data, vl_tok):  # noqa: F811
    train = script()
    pipe = pipeline(data, vl_tok, lanes=2, positions="1d", max_images=None, max_patches=None, seq_len=128)
    batch = next(iter(pipe.build()))
    model = train.model_for(pipe, batch)
    slots = model.image_slots(batch)  # every image token, from the image-to-row index, in pixel order
    pad = z_pad(vl_tok)
    assert torch.equal(slots, torch.nonzero(batch["input_ids"].reshape(-1) == pad).flatten())
    assert model(batch).shape == batch["input_ids"].shape + (model.head.out_features,)
    losses = train.train(pipe, steps=8, lr=3e-3, log=False)
    assert all(math.isfinite(x) for x in losses) and len(losses) == 8
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5  # it learns something from these batches
    mrope = train.train(pipe.replace(positions="mrope"), steps=2, log=False)
    assert all(math.isfinite(x) for x in mrope)


def z_pad(tok) -> int:
    import zephon as z

    return z.load_tokenizer(tok).token_id("<|image_pad|>")

#!/usr/bin/env python
"""Train a tiny vision-language model on Zephon's image batches, on CPU: how a batch is consumed.

The model (pure torch, about 1M parameters) is the usual native-resolution VLM in miniature:

- a **patch encoder**: the uint8 patches of ``pixel_values [total_patches, p*p*3]`` are normalised here
  (on the model's device, :func:`zephon.batches.images.normalize`), embedded by a linear layer, and each
  ``merge x merge`` group of consecutive patches (Zephon's patch order, Qwen2-VL's) is merged into one
  feature, as Qwen2-VL's patch merger does: one feature per image token;
- a **causal LM** over ``input_ids`` whose image-token embeddings are replaced by those features. Where they
  go is read from the batch: image ``k`` (row ``image_row[k]``) owns the ``t*h*w // merge**2`` positions
  from ``image_token_start[k]`` of its row, in ``pixel_values`` order. (Equivalently: the positions where
  ``input_ids == image_pad``, in order, as ``masked_scatter`` does in ``transformers``.)
- attention stays inside each packed document (``segment_ids``), positions restart per document
  (``position_ids``; with ``--mrope``, ``position_ids`` is ``[3, B, S]`` and the model adds a temporal, a
  height and a width embedding), and the loss is next-token cross-entropy on ``labels`` (-100: padding,
  image tokens as targets, document ends).

::

    zephon demo recipes                               # once: the vision-language quickstart's data
    python scripts/train_tiny_vlm.py --steps 30       # recipes/vl_quickstart.toml, ~1 s a step on 2 cores
    python scripts/train_tiny_vlm.py --recipe my_vl.toml --mrope

``tests/test_train_tiny_vlm.py`` runs a few steps of it.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a clone without installing
    sys.path.insert(0, str(REPO))

import zephon as z  # noqa: E402
from zephon.batches.images import normalize  # noqa: E402

MEAN, STD = (0.481, 0.458, 0.408), (0.269, 0.261, 0.276)  # CLIP's, as Qwen2-VL's processor uses


class PatchEncoder(nn.Module):
    """uint8 patches -> one feature per image token (a merge group of ``merge**2`` consecutive patches)."""

    def __init__(self, patch_dim: int, width: int, d_model: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.embed = nn.Linear(patch_dim, width)
        self.merger = nn.Sequential(nn.Linear(width * merge * merge, d_model), nn.GELU(), nn.Linear(d_model, d_model))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.embed(normalize(pixel_values, MEAN, STD)))  # uint8 to the device, normalised there
        return self.merger(x.reshape(-1, self.merge * self.merge * x.shape[-1]))


class TinyVLM(nn.Module):
    def __init__(self, vocab: int, seq_len: int, patch_dim: int, merge: int, d_model: int = 96, layers: int = 2,
                 heads: int = 4) -> None:
        super().__init__()
        self.vision = PatchEncoder(patch_dim, 64, d_model, merge)
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.ModuleList([nn.Embedding(seq_len, d_model) for _ in range(3)])
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)
        self.merge = merge

    def image_slots(self, batch: dict[str, Any]) -> torch.Tensor:
        """Flat ``[B*S]`` indices of every image token, in ``pixel_values`` order (from the image-to-row index)."""
        s = batch["input_ids"].shape[1]
        n = batch["image_grid_thw"].prod(dim=1) // self.merge ** 2
        first = batch["image_row"] * s + batch["image_token_start"]
        within = torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        return torch.repeat_interleave(first, n) + within

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        ids, seg = batch["input_ids"], batch["segment_ids"]
        b, s = ids.shape
        x = self.tokens(ids)
        if batch["pixel_values"].shape[0]:
            features = self.vision(batch["pixel_values"])
            slots = self.image_slots(batch)
            assert features.shape[0] == slots.shape[0], "one feature per image token"
            x = x.reshape(b * s, -1).index_copy(0, slots, features.to(x.dtype)).reshape(b, s, -1)
        pos = batch["position_ids"]
        if pos.dim() == 3:  # mrope: temporal, height, width
            x = x + sum(emb(pos[k]) for k, emb in enumerate(self.positions))
        else:
            x = x + self.positions[0](pos)
        # causal attention inside each packed document (segment); padding attends to itself only
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        same = (seg[:, :, None] == seg[:, None, :]) & causal
        same |= torch.eye(s, dtype=torch.bool)
        mask = torch.zeros(b, s, s).masked_fill(~same, float("-inf"))
        heads = self.blocks.layers[0].self_attn.num_heads
        h = self.blocks(x, mask=mask.repeat_interleave(heads, dim=0))
        return self.head(h)


def loss_of(model: TinyVLM, batch: dict[str, Any]) -> torch.Tensor:
    logits = model(batch)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), ignore_index=-100)


def model_for(pipe: z.Pipeline, batch: dict[str, Any], seed: int = 0) -> TinyVLM:
    """A model sized from the pipeline: its tokenizer's vocabulary, its rows, its patches and merge."""
    from zephon.ops.decode_images import DecodeImages

    merge = next(op.merge for op in pipe.ops if isinstance(op, DecodeImages))
    vocab = z.load_tokenizer(pipe.tokenizer).vocab_size
    torch.manual_seed(seed)
    return TinyVLM(vocab, pipe.seq_len, batch["pixel_values"].shape[1], merge)


def train(pipe: z.Pipeline, steps: int, lr: float = 3e-3, seed: int = 0, num_workers: int = 0,
          log: bool = True) -> list[float]:
    """Train for ``steps`` batches of ``pipe`` (flat pixels); returns the losses."""
    loader = pipe.build(rank=0, world_size=1, num_workers=num_workers)
    losses: list[float] = []
    try:
        batch = next(loader)
        model = model_for(pipe, batch, seed)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        for step in range(steps):
            if step:
                batch = next(loader)
            loss = loss_of(model, batch)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if log:
                print(f"step {step:3d}  loss {losses[-1]:.4f}  images {batch['image_grid_thw'].shape[0]:3d}  "
                      f"patches {batch['pixel_values'].shape[0]:5d}  tokens {int((batch['segment_ids'] > 0).sum())}")
            if not math.isfinite(losses[-1]):
                raise FloatingPointError(f"the loss is {losses[-1]} at step {step}")
    finally:
        loader.close()
    return losses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=str(REPO / "recipes" / "vl_quickstart.toml"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--mrope", action="store_true", help="Qwen2-VL's 3-D positions: position_ids [3, B, S]")
    args = ap.parse_args(argv)
    pipe = z.load_recipe(args.recipe).to_pipeline().replace(pixels="flat", positions="mrope" if args.mrope else None)
    losses = train(pipe, args.steps, args.lr, num_workers=args.workers)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

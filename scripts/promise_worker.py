#!/usr/bin/env python
"""One training run of ``scripts/promise.py``, started by ``torchrun --nproc_per_node=W`` (gloo, CPU).

Every rank trains the same tiny causal LM on its share of each global batch and writes nothing but
its progress; rank 0 writes the run's record (per-step loss, global batch SHA-256, digest of the
batch's rows as a set, digest of the final weights) as JSON. See ``promise.py`` for the experiment
and why the losses are bit-identical across world sizes.

Data (``--loader``):

- ``zephon``: ``zephon.build_loader(recipe)``, rank and world size taken from the process group.
- ``sampler``: the map-style recipe: rows pre-packed once by ``promise.py`` (``rows.npz``) through
  ``torch.utils.data.DataLoader`` + ``DistributedSampler(shuffle=True, seed=...)``, per-rank batch =
  global batch / world size, ``set_epoch`` every epoch, ``drop_last=True`` in the DataLoader.
- ``stream``: the online recipe (as in torchtitan's Hugging Face dataset path): the documents shuffled
  with a seed, split over the ranks round-robin (what ``datasets.distributed.split_dataset_by_node``
  does to a stream), tokenized on the fly, EOS-terminated, concatenated and cut into rows, through a
  ``DataLoader`` over an ``IterableDataset``; per-rank batch = global batch / world size.

Gradient reduction (``--reduction``):

- ``groups`` (default): the local batch is cut into groups of ``--group-rows`` rows (a Zephon lane's
  rows); each group's gradient of its summed token loss is computed on its own, the groups of all
  ranks are all-gathered and summed one after another in global order on every rank, then divided by
  the global number of loss tokens. Nothing in this depends on the world size.
- ``allreduce``: the usual DDP recipe: one backward per rank over its local batch, then an all-reduce
  (sum) of the gradients, whose floating-point order depends on the world size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

import zephon

# The hashed keys of a batch (zephon.HASHED_KEYS), in the order rows are digested for the row sets.
ROW_KEYS = ("input_ids", "labels", "position_ids", "segment_ids", "loss_mask")
IGNORE = -100


# -- model ------------------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, D))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A GPT-style causal LM: token + learned position embeddings (positions restart at each packed
    document, from ``position_ids``), ``layers`` blocks, tied output projection."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.t()


# -- data -------------------------------------------------------------------------------------------
def source_texts(demo: Path) -> dict[str, list[str]]:
    """Every document of the demo corpus by source: the Parquet prose, the JSON Lines code, files sorted."""
    import pyarrow.parquet as pq

    web = [t for f in sorted((demo / "data" / "web").glob("*.parquet"))
           for t in pq.read_table(f, columns=["text"]).column(0).to_pylist()]
    code = [json.loads(line)["text"] for f in sorted((demo / "data" / "code").glob("*.jsonl"))
            for line in f.read_text(encoding="utf-8").splitlines()]
    return {"web": web, "code": code}


def pack_rows(windows: np.ndarray, eos: int) -> dict[str, np.ndarray]:
    """Rows of the standard loaders from token windows ``[n, S+1]`` of the EOS-joined document stream.

    The same kind of rows as Zephon's: ``input_ids`` the first ``S`` tokens, ``labels`` the next token
    (so the last label is the stream's next token), no label at an EOS (no prediction across a document
    boundary), ``position_ids`` restarting and ``segment_ids`` counting up after every EOS.
    """
    input_ids, labels = windows[:, :-1].astype(np.int64), windows[:, 1:].astype(np.int64)
    n, S = input_ids.shape
    at_eos = input_ids == eos
    labels[at_eos] = IGNORE
    starts = np.zeros_like(at_eos)
    starts[:, 0] = True
    starts[:, 1:] = at_eos[:, :-1]
    col = np.broadcast_to(np.arange(S), (n, S))
    return {"input_ids": input_ids, "labels": labels,
            "position_ids": (col - np.maximum.accumulate(np.where(starts, col, 0), axis=1)).astype(np.int64),
            "segment_ids": np.cumsum(starts, axis=1).astype(np.int32),
            "loss_mask": (labels != IGNORE).astype(np.float32)}


class PackedRows(Dataset):
    """The pre-packed rows (``rows.npz`` from promise.py) as a map-style dataset of batch-dict rows."""

    def __init__(self, path: str) -> None:
        with np.load(path, allow_pickle=False) as z:  # no pickle: plain arrays only
            self.arrays = {k: torch.from_numpy(z[k]) for k in ROW_KEYS}

    def __len__(self) -> int:
        return int(self.arrays["input_ids"].shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.arrays.items()}


def sampler_batches(rows: str, rank: int, world: int, global_batch: int, seed: int) -> Iterator[dict]:
    """Endless local batches of the map-style recipe: DistributedSampler + DataLoader, epoch after epoch."""
    ds = PackedRows(rows)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    loader = DataLoader(ds, batch_size=global_batch // world, sampler=sampler, drop_last=True, num_workers=0)
    for epoch in count():
        sampler.set_epoch(epoch)
        yield from loader


class StreamingRows(IterableDataset):
    """The online recipe: this rank's share of the shuffled documents, tokenized and packed on the fly.

    Each epoch the documents are shuffled with ``seed + epoch`` (the same order on every rank), rank
    ``r`` of ``W`` keeps documents ``r, r+W, r+2W, ...`` of that order, and a token buffer is cut into
    rows of ``seq_len`` (wrap packing, the next row starting with the previous row's last label).
    """

    def __init__(self, demo: Path, seq_len: int, rank: int, world: int, seed: int) -> None:
        self.demo, self.seq_len, self.rank, self.world, self.seed = demo, seq_len, rank, world, seed

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(self.demo / "tok.model"))
        texts = [t for docs in source_texts(self.demo).values() for t in docs]
        S, buf = self.seq_len, []
        for epoch in count():
            order = np.random.default_rng(self.seed + epoch).permutation(len(texts))
            for i in order[self.rank::self.world]:
                buf += sp.encode(texts[i]) + [sp.eos_id()]
                while len(buf) > S:
                    row = pack_rows(np.asarray(buf[:S + 1])[None], sp.eos_id())
                    yield {k: torch.from_numpy(v[0]) for k, v in row.items()}
                    del buf[:S]


def stream_batches(demo: str, seq_len: int, rank: int, world: int, global_batch: int, seed: int) -> Iterator[dict]:
    """Endless local batches of the online recipe: a DataLoader over this rank's StreamingRows."""
    yield from DataLoader(StreamingRows(Path(demo), seq_len, rank, world, seed), batch_size=global_batch // world,
                          num_workers=0)


# -- training ---------------------------------------------------------------------------------------
def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10% of ``peak``: a function of the global step only, so a
    resumed run continues the same schedule."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def flat_grad(params: list[nn.Parameter]) -> torch.Tensor:
    """All parameter gradients as one flat float32 vector (zeros for a parameter without gradient)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def weights_digest(model: nn.Module) -> str:
    """SHA-256 of every parameter's bytes in ``state_dict`` order: equal iff the weights are bit-identical."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def row_set_digest(batches: list[dict[str, torch.Tensor]]) -> str:
    """SHA-256 of the sorted per-row digests: equal iff two global batches hold the same rows, in any order."""
    rows = []
    for b in batches:
        for i in range(int(b["input_ids"].shape[0])):
            h = hashlib.sha256()
            for k in ROW_KEYS:
                h.update(b[k][i].contiguous().numpy().tobytes())
            rows.append(h.hexdigest())
    return hashlib.sha256("".join(sorted(rows)).encode()).hexdigest()


def reduce_groups(model: TinyLM, params: list[nn.Parameter], batch: dict[str, torch.Tensor], group_rows: int,
                  world: int) -> tuple[float, int]:
    """World-size-independent gradient: per-group gradients, gathered and summed in global group order.

    Each group of ``group_rows`` rows (in a Zephon run: one lane's rows) gets its own forward and
    backward on the same shapes on every world size (one thread), so its gradient is the same bits
    wherever it is computed; all-gather copies bits; the sum runs over the groups in global order on
    every rank. Returns the global mean token loss and the global number of loss tokens.
    """
    ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    n_groups = ids.shape[0] // group_rows
    grads = torch.empty(n_groups, sum(p.numel() for p in params))
    stats = torch.empty(n_groups, 2, dtype=torch.float64)  # (summed loss, loss tokens) per group
    for g in range(n_groups):
        rows = slice(g * group_rows, (g + 1) * group_rows)
        logits = model(ids[rows], pos[rows])
        loss = F.cross_entropy(logits.flatten(0, 1), labels[rows].flatten(), ignore_index=IGNORE, reduction="sum")
        model.zero_grad(set_to_none=True)
        loss.backward()
        grads[g] = flat_grad(params)
        stats[g, 0], stats[g, 1] = loss.item(), int((labels[rows] != IGNORE).sum())
    if world > 1:
        all_grads = [torch.empty_like(grads) for _ in range(world)]
        all_stats = [torch.empty_like(stats) for _ in range(world)]
        dist.all_gather(all_grads, grads)
        dist.all_gather(all_stats, stats)
        grads, stats = torch.cat(all_grads), torch.cat(all_stats)
    total = grads[0].clone()
    for g in range(1, grads.shape[0]):  # one fixed order, the same for every world size
        total += grads[g]
    loss_sum, tokens = 0.0, 0
    for g in range(stats.shape[0]):
        loss_sum += float(stats[g, 0])
        tokens += int(stats[g, 1])
    total /= tokens
    offset = 0
    for p in params:
        p.grad = total[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    return loss_sum / tokens, tokens


def reduce_allreduce(model: TinyLM, params: list[nn.Parameter], batch: dict[str, torch.Tensor],
                     world: int) -> tuple[float, int]:
    """The usual DDP gradient: one backward over the local batch, all-reduce (sum), divide by tokens."""
    logits = model(batch["input_ids"], batch["position_ids"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE, reduction="sum")
    model.zero_grad(set_to_none=True)
    loss.backward()
    grad = flat_grad(params)
    stats = torch.tensor([loss.item(), float((batch["labels"] != IGNORE).sum())], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(grad)
        dist.all_reduce(stats)
    tokens = int(stats[1])
    grad /= tokens
    offset = 0
    for p in params:
        p.grad = grad[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    return float(stats[0]) / tokens, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", required=True, help="run name, for the progress lines")
    ap.add_argument("--loader", choices=("zephon", "sampler", "stream"), required=True)
    ap.add_argument("--recipe-json", required=True, help="the Zephon recipe (its lanes/batch_per_lane fix G)")
    ap.add_argument("--rows", help="rows.npz of the sampler loader")
    ap.add_argument("--demo", help="the demo folder (data/, tok.model) the stream loader reads")
    ap.add_argument("--steps", type=int, required=True, help="the run's length (and the schedule's)")
    ap.add_argument("--stop-after", type=int, help="stop after this many steps (default: --steps)")
    ap.add_argument("--reduction", choices=("groups", "allreduce"), default="groups")
    ap.add_argument("--checkpoint-at", type=int, default=0, help="after this many steps, save a checkpoint")
    ap.add_argument("--checkpoint-dir")
    ap.add_argument("--resume-from", help="a checkpoint folder written by --checkpoint-at")
    ap.add_argument("--vocab", type=int, required=True, help="the tokenizer's vocabulary size")
    ap.add_argument("--dim", type=int, default=96)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--model-seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--out", required=True, help="rank 0 writes the run's record here (JSON)")
    args = ap.parse_args()

    # One intra-op thread on every rank, whatever the world size: a kernel's summation order may depend
    # on how many threads split it, and the per-group gradients must be the same bits everywhere.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    recipe = zephon.recipe_from_dict(json.loads(Path(args.recipe_json).read_text()))
    lanes, per_lane = recipe.lanes, recipe.batch_per_lane
    global_batch = lanes * per_lane
    if global_batch % world:
        raise SystemExit(f"the global batch ({global_batch} rows) must divide among {world} ranks")

    torch.manual_seed(args.model_seed)  # the same initial weights on every rank and world size
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, recipe.seq_len)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    start = 0
    loader = None
    if args.loader == "zephon":
        loader = zephon.build_loader(recipe)  # rank and world size from the process group
        batches: Iterator[dict] = iter(loader)
    elif args.resume_from:
        raise SystemExit("--resume-from is for --loader zephon: the standard loaders have no such state")
    elif args.loader == "sampler":
        batches = sampler_batches(args.rows, rank, world, global_batch, recipe.seed)
    else:
        batches = stream_batches(args.demo, recipe.seq_len, rank, world, global_batch, recipe.seed)
    if args.resume_from:
        ckpt = Path(args.resume_from)
        model.load_state_dict(torch.load(ckpt / "model.pt", weights_only=True))
        opt.load_state_dict(torch.load(ckpt / "optim.pt", weights_only=True))
        state = json.loads((ckpt / "loader.json").read_text())  # the merged state of every lane
        loader.load_state_dict(state)
        start = int(state["step"])
        batches = iter(loader)

    record: dict[str, Any] = {"name": args.name, "loader": args.loader, "world_size": world, "start": start,
                              "steps": [], "loss": [], "tokens": [], "hash": [], "row_set": []}
    t0 = time.perf_counter()
    for step in range(start, args.stop_after or args.steps):
        batch = next(batches)
        batch = {k: batch[k] for k in ROW_KEYS}
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        if args.reduction == "groups":
            loss, tokens = reduce_groups(model, params, batch, per_lane, world)
        else:
            loss, tokens = reduce_allreduce(model, params, batch, world)
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # on identical gradients: identical on every rank
        opt.step()

        # The global batch: every rank's local batch, concatenated in rank order, hashed on rank 0.
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(batch, gathered, dst=0)
        if rank == 0:
            record["steps"].append(step)
            record["loss"].append(loss)
            record["tokens"].append(tokens)
            record["hash"].append(zephon.global_digest(gathered))
            record["row_set"].append(row_set_digest(gathered)[:16])  # 64 bits: enough to tell sets apart
            if (step + 1) % args.log_every == 0 or step == start or step + 1 == (args.stop_after or args.steps):
                print(f"[{args.name}] step {step + 1:4d}/{args.steps}  loss {loss:.4f}  "
                      f"({time.perf_counter() - t0:.0f}s)", flush=True)

        if args.checkpoint_at and step + 1 == args.checkpoint_at:
            state = loader.gather_state_dict()  # every lane's position, merged across the ranks
            if rank == 0:
                ckpt = Path(args.checkpoint_dir)
                ckpt.mkdir(parents=True, exist_ok=True)
                torch.save(model.state_dict(), ckpt / "model.pt")
                torch.save(opt.state_dict(), ckpt / "optim.pt")
                (ckpt / "loader.json").write_text(json.dumps(state))
                print(f"[{args.name}] checkpoint after step {step + 1} -> {ckpt}", flush=True)
            dist.barrier()

    if rank == 0:
        record["weights"] = weights_digest(model)
        record["seconds"] = time.perf_counter() - t0
        Path(args.out).write_text(json.dumps(record))
    if loader is not None:
        loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

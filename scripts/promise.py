#!/usr/bin/env python
"""Show the promise: a tiny LM trained on 1, 2 and 4 ranks gives bit-identical losses with Zephon.

What it does (CPU only, ``torchrun`` + gloo, about 10 minutes on 2 cores with the defaults):

1. Builds the demo corpus with ``zephon.demo.make_demo`` (docstrings and function source of Python's
   standard library; Parquet + JSON Lines) and its SentencePiece tokenizer, in ``--work``.
2. Writes a small Zephon recipe: ``--lanes`` lanes, ``--batch-per-lane`` rows each (global batch
   ``G = lanes * batch_per_lane`` rows of ``--seq-len`` tokens), best-fit packing, a shuffle buffer,
   and the two sources mixed by tokens in the corpus's own proportions.
3. Trains the same model from the same initial weights (``scripts/promise_worker.py``) for
   ``--steps`` steps under ``torchrun --nproc_per_node=W`` for every ``W`` in ``--world-sizes``, with
   the global batch held at ``G`` rows (``G / W`` per rank) and three loaders (``--loaders``):
   - ``sampler-W``, the map-style standard recipe: the corpus pre-packed once (every document
     tokenized, EOS appended, all concatenated and cut into rows of ``seq_len``: the same kind of rows
     as Zephon's, no label at an EOS, positions restarting after it), then ``DataLoader`` +
     ``DistributedSampler(shuffle=True, seed)``;
   - ``stream-W``, the online standard recipe (as in torchtitan's Hugging Face dataset path, which
     splits the documents over the ranks with ``split_dataset_by_node`` and packs a token buffer per
     rank): the shuffled documents dealt to the ranks round-robin, tokenized and packed into the same
     kind of rows on the fly by each rank, through a ``DataLoader`` over an ``IterableDataset``;
   - ``zephon-W``: ``zephon.build_loader(recipe)``, rank and world size from the process group;
   - ``zephon-AtoB`` (``--resume A:B``): the ``A``-rank Zephon run saves model, optimizer and the merged
     loader state (``loader.gather_state_dict()``) after ``--resume-at`` steps; a fresh ``torchrun`` with
     ``B`` ranks loads them and trains on to ``--steps`` (its first steps are the ``A``-rank run's).
   Every step, rank 0 gathers the ranks' local batches and records the global batch's SHA-256
   (``zephon.global_digest`` of the rank batches in rank order), a digest of its rows as a set, and
   the loss; at the end, a digest of the final weights.
4. Writes ``OUT/promise.json`` (settings, per-step losses and hashes of every run, the summary) and
   ``OUT/promise.png`` (loss against step, one line per run; below, each run's loss minus the 1-rank
   run's of the same loader), and prints the summary table.

Why Zephon's losses are *bit-identical*, not just equal up to floating-point reduction order.
Zephon makes global batch ``s`` the same bytes on every world size: lane ``l``'s rows, in lane order,
wherever lane ``l`` is hosted. The usual DDP step would still change the losses in the last bits: each
rank sums its rows' gradients, then an all-reduce adds the ranks' sums, so the order of the
floating-point additions depends on the world size (and, once they differ, the runs drift apart).
Here the gradient reduction does not depend on the world size either (``--reduction groups``, the
default): each rank computes the gradient of every lane's rows (``batch_per_lane`` rows, the same
shapes everywhere) separately, with one intra-op thread (``torch.set_num_threads(1)``, so a kernel's
own summation order is fixed too), the per-lane gradients are all-gathered (a copy of bits) and every
rank adds them in global lane order, then divides by the global number of loss tokens. The same model,
the same batches and the same arithmetic in the same order give the same bits: the 1-, 2- and 4-rank
Zephon runs and the resumed run have equal losses at every step and equal final weights.
``--reduction allreduce`` runs the usual DDP reduction instead, to see the last-bit differences it adds.

The standard loaders get the same reduction (groups of ``batch_per_lane`` rows in global order), so
what differs between their runs is the data alone. What differs is not the same for the two:

- ``stream``: a rank's rows come from its own share of the documents, packed by itself, so the global
  batch holds other rows on every world size (and a resume on another one has no defined position).
- ``sampler``: ``DistributedSampler`` deals one seeded permutation of the pre-packed rows round-robin
  over the ranks, so with ``G / W`` rows per rank a global batch holds *the same rows* on every world
  size, in a rank-interleaved order. The order changes which rows share a group and so the last bits of
  the sums: its runs differ by rounding only (at most about 2e-5 in the loss over 300 steps here),
  not by data. Its batches also change rows where ``ceil(rows / W)`` padding and ``drop_last`` give an epoch
  another number of steps on another world size. It is elastic in content because the corpus was
  tokenized and packed offline into a fixed, indexable list: what Zephon gives to online pipelines.

    python scripts/promise.py                       # the full run: docs/promise.png, docs/promise.json
    python scripts/promise.py --steps 6 --world-sizes 1,2 --resume 2:1 --resume-at 3 --no-plot --out /tmp/p
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
WORKER = HERE / "promise_worker.py"
sys.path.insert(0, str(HERE))
from promise_worker import pack_rows, source_texts  # the same rows and corpus as the runs


# -- corpus and data --------------------------------------------------------------------------------
def build_demo(work: Path, max_files: int, vocab: int) -> Path:
    """The demo corpus (``work/demo/data``) and tokenizer (``work/demo/tok.model``); reused if built
    before with the same sizes."""
    from zephon.demo import make_demo

    demo = work / "demo"
    stamp = demo / "stamp.json"
    want = {"max_files": max_files, "vocab": vocab}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return demo
    counts = make_demo(demo, max_files=max_files, vocab_size=vocab)
    print(f"demo corpus: {counts['prose']} prose documents (Parquet), {counts['code']} code documents "
          f"(JSON Lines), tokenizer vocab {vocab}", flush=True)
    stamp.write_text(json.dumps(want))
    return demo


def prepack(demo: Path, seq_len: int, out: Path) -> dict[str, Any]:
    """The sampler loader's dataset: the whole corpus tokenized, EOS-terminated, concatenated and cut
    into rows of ``seq_len`` tokens, written as ``rows.npz`` (plain arrays, the batch keys of Zephon)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(demo / "tok.model"))
    texts = source_texts(demo)
    stream: list[int] = []
    tokens = {}
    for name, docs in texts.items():
        before = len(stream)
        for ids in sp.encode(docs):
            stream += ids + [sp.eos_id()]
        tokens[name] = len(stream) - before
    data = np.asarray(stream, dtype=np.int64)
    n = (len(data) - 1) // seq_len
    # row i: tokens [i*S, (i+1)*S] (S+1 of them: the last is the last position's label)
    windows = data[np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]]
    np.savez(out, **pack_rows(windows, sp.eos_id()))
    return {"rows": int(n), "tokens": tokens, "documents": {k: len(v) for k, v in texts.items()},
            "vocab": int(sp.vocab_size())}


def write_recipe(demo: Path, args: argparse.Namespace, tokens: dict[str, int], out: Path) -> dict[str, Any]:
    """The Zephon recipe (JSON, for ``zephon.recipe_from_dict``): the corpus's own token mixture."""
    total = sum(tokens.values())
    recipe = {
        "seed": args.seed, "lanes": args.lanes, "seq_len": args.seq_len, "batch_per_lane": args.batch_per_lane,
        "flush_every": 2,
        "tokenizer": {"kind": "sentencepiece", "path": str(demo / "tok.model")},
        "pack": {"algorithm": "best_fit"},
        "shuffle": {"buffer": 64},
        "read": {"unit_bytes": 64 * 1024},  # several JSONL units per file: flushes every few units
        "sources": [
            {"name": "web", "path": str(demo / "data" / "web"), "format": "parquet", "text_field": "text",
             "weight": round(tokens["web"] / total, 4)},
            {"name": "code", "path": str(demo / "data" / "code" / "*.jsonl"), "format": "jsonl",
             "text_field": "text", "weight": round(tokens["code"] / total, 4)},
        ],
    }
    out.write_text(json.dumps(recipe, indent=1))
    return recipe


# -- runs -------------------------------------------------------------------------------------------
def torchrun(world: int, worker_args: list[str], log_prefix: str) -> None:
    """``torchrun --standalone --nproc_per_node=world promise_worker.py ...``, its output streamed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(WORKER), *worker_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    print(f"=== {log_prefix}: torchrun with {world} rank{'s' if world > 1 else ''}", flush=True)
    tail: deque[str] = deque(maxlen=60)
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line)
            if line.startswith("["):  # the worker's progress lines; torchrun's own chatter stays in the tail
                print("    " + line, end="", flush=True)
    if proc.returncode:
        raise SystemExit(f"{log_prefix} failed (exit {proc.returncode}):\n{''.join(tail)}\ncommand: "
                         f"{shlex.join(cmd)}")


def run_all(args: argparse.Namespace, work: Path, demo: Path, vocab: int) -> dict[str, dict]:
    """Every configuration; returns the runs' records by name (the resumed run's record spliced)."""
    common = ["--recipe-json", str(work / "recipe.json"), "--rows", str(work / "rows.npz"), "--demo", str(demo),
              "--steps", str(args.steps), "--vocab", str(vocab),
              "--reduction", args.reduction, "--log-every", str(args.log_every), "--dim", str(args.dim),
              "--layers", str(args.layers), "--heads", str(args.heads), "--lr", str(args.lr), "--warmup", str(args.warmup)]
    runs: dict[str, dict] = {}
    src, dst = args.resume or (0, 0)
    ckpt = work / f"ckpt-{src}"
    shutil.rmtree(ckpt, ignore_errors=True)  # a resume must never pick up an earlier invocation's checkpoint

    def one(name: str, loader: str, world: int, extra: list[str]) -> dict:
        out = work / f"{name}.json"
        torchrun(world, ["--name", name, "--loader", loader, "--out", str(out), *common, *extra], name)
        return json.loads(out.read_text())

    for loader in args.loaders:
        for world in args.world_sizes:
            extra = []
            if loader == "zephon" and world == src:
                extra = ["--checkpoint-at", str(args.resume_at), "--checkpoint-dir", str(ckpt)]
            runs[f"{loader}-{world}"] = one(f"{loader}-{world}", loader, world, extra)
    if args.resume:
        name = f"zephon-{src}to{dst}"
        if src not in args.world_sizes:  # the checkpoint comes from a run of its own, up to the checkpoint
            head = one(f"zephon-{src}", "zephon", src, ["--checkpoint-at", str(args.resume_at), "--checkpoint-dir",
                                                        str(ckpt), "--stop-after", str(args.resume_at)])
        else:
            head = runs[f"zephon-{src}"]
        tail = one(name, "zephon", dst, ["--resume-from", str(ckpt)])
        k = args.resume_at
        runs[name] = {**tail, "world_size": f"{src}->{dst}", "resumed_at": k,
                      **{key: head[key][:k] + tail[key] for key in ("steps", "loss", "tokens", "hash", "row_set")}}
    return runs


# -- summary ----------------------------------------------------------------------------------------
def summarize(runs: dict[str, dict], ref_world: int) -> list[dict[str, Any]]:
    """Per run: max |loss - reference loss|, and how many global batches / row sets / weights match the
    reference (the ``ref_world``-rank run of the same loader)."""
    rows = []
    for name, run in runs.items():
        ref = runs[f"{run['loader']}-{ref_world}"]
        n = min(len(ref["loss"]), len(run["loss"]))
        diffs = [abs(a - b) for a, b in zip(run["loss"][:n], ref["loss"][:n])]
        rows.append({
            "run": name, "loader": run["loader"], "ranks": str(run["world_size"]), "steps": n,
            "max_abs_loss_diff": max(diffs) if diffs else 0.0,
            "losses_bit_identical": all(a == b for a, b in zip(run["loss"][:n], ref["loss"][:n])),
            "batch_hashes_equal": sum(a == b for a, b in zip(run["hash"][:n], ref["hash"][:n])),
            "row_sets_equal": sum(a == b for a, b in zip(run["row_set"][:n], ref["row_set"][:n])),
            "first_hash_mismatch": next((s for s, (a, b) in enumerate(zip(run["hash"], ref["hash"])) if a != b), None),
            "first_row_set_mismatch": next((s for s, (a, b) in enumerate(zip(run["row_set"], ref["row_set"]))
                                            if a != b), None),
            "final_weights_equal": run["weights"] == ref["weights"],
        })
    return rows


def table(summary: list[dict[str, Any]], ref_world: int) -> str:
    """The summary as a Markdown table."""
    head = (f"| run | ranks | max abs loss diff vs {ref_world} rank | losses bit-identical | global batch SHA-256 "
            f"equal | same rows (as a set) | final weights equal |")
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in summary:
        lines.append(f"| {r['run']} | {r['ranks']} | {r['max_abs_loss_diff']:.3g} | "
                     f"{'yes' if r['losses_bit_identical'] else 'no'} | {r['batch_hashes_equal']}/{r['steps']} | "
                     f"{r['row_sets_equal']}/{r['steps']} | {'yes' if r['final_weights_equal'] else 'no'} |")
    return "\n".join(lines)


STYLE = {"sampler": ("Oranges", "--", "DataLoader + DistributedSampler\n(pre-packed rows, shuffled)"),
         "stream": ("Greens", "-.", "DataLoader over a stream\n(documents split over ranks, packed per rank)"),
         "zephon": ("Blues", "-", "Zephon\n({lanes} lanes, packed online)")}
NOTE = {"sampler": "same rows in every global batch,\nrank-interleaved order: rounding only",
        "stream": "other rows in every global batch",
        "zephon": "|Δ| = 0 at every step: bit-identical"}


def plot(runs: dict[str, dict], settings: dict[str, Any], path: Path) -> None:
    """One column per loader: its runs' loss against step (top) and each run's |loss − the same loader's
    1-rank loss| per step (bottom, symmetric log scale, so that exactly 0 has a place)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds, loaders = settings["world_sizes"], [ld for ld in STYLE if ld in settings["loaders"]]
    ref_world = worlds[0]
    fig, axes = plt.subplots(2, len(loaders), figsize=(4.8 * len(loaders), 7.2), sharex=True, sharey="row",
                             height_ratios=(3, 2), squeeze=False)
    for col, loader in enumerate(loaders):
        top, bottom = axes[0, col], axes[1, col]
        cmap, style, title = STYLE[loader]
        title = title.format(lanes=settings["lanes"])
        ref = runs[f"{loader}-{ref_world}"]
        for run in runs.values():
            if run["loader"] != loader:
                continue
            if "resumed_at" in run:
                color, ls, width = "black", (0, (1, 2)), 1.8
                label = f"{run['world_size'].replace('->', ' → ')} ranks, resumed after step {run['resumed_at']}"
                for ax in (top, bottom):
                    ax.axvline(run["resumed_at"] + 0.5, color="grey", lw=0.8, ls=":")
            else:
                i = worlds.index(run["world_size"])
                color = plt.get_cmap(cmap)(0.9 - 0.45 * i / max(1, len(worlds) - 1))
                ls, width = style, 3.2 if run["world_size"] == ref_world else 1.2  # the reference wide: lines on it show
                label = f"{run['world_size']} rank{'s' if run['world_size'] != 1 else ''}"
            steps = np.asarray(run["steps"]) + 1
            top.plot(steps, run["loss"], color=color, ls=ls, lw=width, label=label, alpha=0.9)
            if run is not ref:
                diff = np.abs(np.asarray(run["loss"]) - np.asarray(ref["loss"][:len(run["loss"])]))
                bottom.plot(steps, diff, ".", color=color, ms=2.5, alpha=0.8, label=label)
        top.set_title(title, fontsize=10)
        top.legend(fontsize=8, loc="upper right")
        bottom.text(0.5, 0.96, NOTE[loader], transform=bottom.transAxes, ha="center", va="top", fontsize=8.5,
                    bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
        bottom.set_xlabel("step")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("training loss (nats/token)")
    axes[1, 0].set_yscale("symlog", linthresh=1e-8)
    axes[1, 0].set_ylim(-1e-9, 10)
    axes[1, 0].set_ylabel(f"|loss − same loader's loss on {ref_world} rank|\n(symmetric log scale)")
    fig.suptitle(f"The same tiny causal LM trained on {', '.join(map(str, worlds))} CPU ranks (torchrun, gloo): "
                 f"{settings['steps']} steps, global batch {settings['lanes'] * settings['batch_per_lane']} × "
                 f"{settings['seq_len']} tokens", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def dump_json(result: dict[str, Any]) -> str:
    """``result`` as JSON, readable: one line per key, per summary row and per run (runs hold long lists)."""
    parts = []
    for key, value in result.items():
        if key in ("runs", "summary"):
            items = value.items() if key == "runs" else enumerate(value)
            inner = ",\n".join((f"  {json.dumps(k)}: " if key == "runs" else "  ") + json.dumps(v) for k, v in items)
            body = ("{\n" + inner + "\n }") if key == "runs" else ("[\n" + inner + "\n ]")
        else:
            body = json.dumps(value)
        parts.append(f" {json.dumps(key)}: {body}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE.parent / "docs"), help="folder for promise.json and promise.png")
    ap.add_argument("--work", help="folder for the corpus, recipe, checkpoints and run records (default: a "
                                   "temporary folder, removed at the end)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--world-sizes", default="1,2,4", help="comma-separated; the first is the reference")
    ap.add_argument("--resume", default="4:2", help="A:B: checkpoint the A-rank Zephon run, resume on B ranks "
                                                    "('' for none)")
    ap.add_argument("--resume-at", type=int, help="checkpoint after this many steps (default: steps / 2)")
    ap.add_argument("--reduction", choices=("groups", "allreduce"), default="groups",
                    help="groups: world-size-independent (bit-identical); allreduce: the usual DDP sum")
    ap.add_argument("--loaders", default="sampler,stream,zephon", help="comma-separated, of sampler, stream, zephon")
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-per-lane", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234, help="data seed (Zephon recipe and DistributedSampler)")
    ap.add_argument("--max-files", type=int, default=60, help="standard-library files mined for the corpus")
    ap.add_argument("--vocab", type=int, default=1024, help="SentencePiece vocabulary size")
    ap.add_argument("--dim", type=int, default=96, help="model width")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=20, help="warm-up steps")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    ap.add_argument("--replot", action="store_true", help="only redraw OUT/promise.png from OUT/promise.json")
    args = ap.parse_args(argv)
    args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    args.loaders = args.loaders.split(",")
    if set(args.loaders) - {"sampler", "stream", "zephon"}:
        ap.error(f"--loaders: unknown {sorted(set(args.loaders) - {'sampler', 'stream', 'zephon'})}")
    if args.resume and "zephon" not in args.loaders:
        ap.error("--resume needs the zephon loader in --loaders")
    args.resume = tuple(int(w) for w in args.resume.split(":")) if args.resume else None
    if args.resume_at is None:
        args.resume_at = args.steps // 2
    if args.resume and not 0 < args.resume_at < args.steps:
        ap.error(f"--resume-at must be between 1 and --steps - 1 (got {args.resume_at})")
    for w in args.world_sizes + list(args.resume or ()):
        if args.lanes % w:
            ap.error(f"world size {w} does not divide --lanes {args.lanes}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    out = Path(args.out)
    if args.replot:
        result = json.loads((out / "promise.json").read_text())
        plot(result["runs"], result["settings"], out / "promise.png")
        print(f"wrote {out / 'promise.png'}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    tmp = None if args.work else tempfile.TemporaryDirectory(prefix="zephon-promise-")
    work = Path(args.work or tmp.name)  # type: ignore[union-attr]
    work.mkdir(parents=True, exist_ok=True)
    try:
        demo = build_demo(work, args.max_files, args.vocab)
        corpus = prepack(demo, args.seq_len, work / "rows.npz")
        recipe = write_recipe(demo, args, corpus["tokens"], work / "recipe.json")
        G = args.lanes * args.batch_per_lane
        print(f"corpus: {sum(corpus['tokens'].values())} tokens ({corpus['tokens']}), {corpus['rows']} pre-packed "
              f"rows for the sampler loader = {corpus['rows'] / G:.1f} global batches of {G} rows per epoch",
              flush=True)
        runs = run_all(args, work, demo, corpus["vocab"])
    finally:
        if tmp is not None:
            tmp.cleanup()

    ref = args.world_sizes[0]
    summary = summarize(runs, ref)
    result = {
        "command": "python " + shlex.join([os.path.relpath(__file__)] + (sys.argv[1:] if argv is None else argv)),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "work", "replot", "no_plot")},
        "corpus": corpus, "recipe": {k: v for k, v in recipe.items() if k not in ("tokenizer", "sources")},
        "mixture": {s["name"]: s["weight"] for s in recipe["sources"]},
        "model": {"dim": args.dim, "layers": args.layers, "heads": args.heads, "vocab": corpus["vocab"],
                  "optimizer": "AdamW(betas=(0.9, 0.95), weight_decay=0.1), grad clip 1.0", "lr": args.lr,
                  "warmup": args.warmup, "schedule": "linear warm-up, cosine to 10%"},
        "summary": summary, "runs": runs, "wall_seconds": round(time.perf_counter() - t0, 1),
    }
    (out / "promise.json").write_text(dump_json(result))
    if not args.no_plot:
        plot(runs, result["settings"], out / "promise.png")
    print()
    print(table(summary, ref))
    zephon = [r for r in summary if r["loader"] == "zephon"]
    batches_ok = all(r["batch_hashes_equal"] == r["steps"] for r in zephon)
    zephon_ok = batches_ok and all(r["losses_bit_identical"] and r["final_weights_equal"] for r in zephon)
    print(f"\nZephon: every global batch SHA-256 equal across runs: {'yes' if batches_ok else 'NO'}; losses and final "
          f"weights bit-identical: {'yes' if zephon_ok else 'no'}"
          f"{' (--reduction allreduce: the DDP sum is ordered by rank)' if args.reduction == 'allreduce' else ''}. "
          f"Wrote {out / 'promise.json'}{'' if args.no_plot else ' and ' + str(out / 'promise.png')} in "
          f"{time.perf_counter() - t0:.0f}s")
    # with the world-size-independent reduction anything but bit-identity is a bug worth a non-zero exit
    return 0 if zephon_ok or (batches_ok and args.reduction == "allreduce") else 1


if __name__ == "__main__":
    sys.exit(main())

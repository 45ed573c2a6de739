#!/usr/bin/env python
"""The full vision-language pipeline: decode, resize, patchify, tokenize captions, pack rows of 4096 tokens.

Every image is decoded (JPEG at 1/2, 1/4 or 1/8 by DCT scaling where the target is that much smaller),
resized in one bicubic step to Qwen2-VL's ``smart_resize`` size within 448 x 448 pixels on the 28-pixel
grid, cut into 14 x 14 patches (2 x 2 merged per image token: up to 256 tokens an image); its caption is
tokenized (byte-level BPE, 8192 tokens) after ``<|vision_start|>``, one ``<|image_pad|>`` per image token
and ``<|vision_end|>``, then EOS; ``loss_mask`` 0 where the label is an image token. Samples are packed
into rows of 4096 tokens with their patches (at most 16,384 patches a row: four per token, never binding),
8 rows a batch.

  decoder_alone_T      the ceiling: decode + resize + patchify of the same images, held in memory, on T
                       threads (T = 1: the calling thread), 16 images per task, 2 T tasks in flight
  decoder_alone_keep_T the same, but its last KEPT_IMAGES outputs stay alive, as a loader's rows and read-ahead
                       hold theirs (the ceiling proper frees each output at once, so its working set stays in
                       the caches): information only, the targets use decoder_alone_T
  grain_W              Grain: ArrayRecordDataSource -> MapDataset.source().repeat().map(parse).map(decode,
                       resize, patchify, tokenize: one sample) -> to_iter_dataset(ReadOptions()) ->
                       FirstFitPackIterDataset(length_struct={input_ids: 4096, loss_mask: 4096,
                       pixel_values: 16384 x 588}, num_packing_bins=8, shuffle_bins=False) -> batch(8)
                       (+ mp_prefetch(W)); the same transform code as the peers of vl_fetch_batch.py
  zephon_W_RUNNER      Zephon: webdataset(tar shards) -> decode_images(max_pixels=448*448, patch_size=14,
                       merge=2) -> tokenize_images(bpe) -> pack(4096, best_fit, max_patches_per_row=16384)
                       -> batch(rows_per_lane=1), 8 lanes; pixel_values flat uint8 [total_patches, 588]
  zephon_W_*_fresh     the same with build(reuse_batch_memory=False): every batch's pixel tensor in fresh
                       memory (information only: what reusing batch memory is worth; no target)
  zephon_W_thread_prefetch8  a fixed read-ahead of 8 tasks per lane (build(prefetch=8))
  zephon_W_thread_sync2      the defaults before adaptive read-ahead and steps ahead (prefetch=2,
                       steps_ahead=0: the lanes' work on the trainer's thread); information only
  zephon_W_process_ahead0    lane processes with steps_ahead=0: the trainer's thread reads their rows back
                       and collates them when it asks (the default before steps ahead covered them)

Reported: usable (non-padding) tokens/s, images/s, padding share, each over all timed windows together
(what they delivered over the seconds they took; ``images_per_s_windows`` keeps each window's rate), and
the CPU time per image of the trainer's thread (the one that calls next(); with workers Zephon's lanes,
packing and collation run on its steps-ahead thread instead, with ``steps_ahead=0`` on this one). A
packing pipeline delivers in bursts: a lane decodes a task of 16 images, then hands out rows it packed for
several batches, so windows of 8 batches ranged over 2x (300-615 images/s) and their median overstated
Zephon inline by a quarter against its long-run rate (BENCHMARKS.md 8b). The targets as ratios inside each round:
Zephon's images/s >= 0.9 x the decoder alone on as many threads as workers (one for 0 workers), and
Zephon ahead of Grain at every worker count. Zephon's batch SHA-256s must agree between configurations.

Every configuration runs with glibc's heap kept (``--malloc steady``, the default: ``MALLOC_TRIM_THRESHOLD_``
and ``MALLOC_MMAP_THRESHOLD_`` raised). Without that, the decoder alone, which frees every image before
the next, hands its pages back to the kernel and faults them in again for each image (~75 minor faults
an image here), while a loader that holds decoded images in its rows reuses its heap (~2): the ceiling
then pays a cost that only its tiny working set creates (BENCHMARKS.md 8b). ``--malloc glibc`` keeps
glibc's defaults.
The same protocol as vl_fetch_batch.py (one subprocess per configuration and round, interleaved rounds,
load averages recorded).

    python scripts/bench/vl_pipeline.py --data bench_data/vl --rounds 3 --json bench_results/vl_pipeline.json
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from _common import fmt_table, measure_stream, only_patterns, run_task, select_configs, task_main  # noqa: E402
from _targets import fresh_ratio_lines, median_round, zephon_hash_check  # noqa: E402
import vl_common as vc  # noqa: E402

SCRIPT = Path(__file__).resolve()
SEQ = 4096
ROWS = 8
MAX_PIXELS = 448 * 448
MAX_PATCHES = 4 * SEQ
PATCH_DIM = vc.PATCH * vc.PATCH * 3
CHUNK = 16


class Transform:
    """One sample -> {input_ids, loss_mask, pixel_values}: the same steps and tokens as Zephon's
    decode_images + tokenize_images (image first, then the caption, then EOS). Picklable."""

    def __init__(self, tokenizer_path: str) -> None:
        self.path = tokenizer_path
        self._tok = None

    def _load(self) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(self.path)
        self.ids = [self._tok.token_to_id(t) for t in (vc.IMAGE_START, vc.IMAGE_PAD, vc.IMAGE_END, vc.EOS)]

    def __call__(self, s: dict) -> dict:
        if self._tok is None:
            self._load()
        start, pad, end, eos = self.ids
        patches = vc.patchify(vc.decode_resize(s["image"], max_pixels=MAX_PIXELS))
        n = len(patches) // (vc.MERGE * vc.MERGE)
        text = self._tok.encode(s["caption"], add_special_tokens=False).ids
        ids = np.empty(n + 3 + len(text), dtype=np.int32)
        ids[0], ids[1:n + 1], ids[n + 1] = start, pad, end
        ids[n + 2:-1], ids[-1] = text, eos
        mask = np.ones(len(ids), dtype=np.int32)
        mask[:n + 1] = 0  # the label of positions 0..n is an image token (start's label is the first pad, ...)
        return {"input_ids": ids, "loss_mask": mask, "pixel_values": patches}

    def __getstate__(self) -> dict:
        return {"tokenizer_path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["tokenizer_path"])


def parse_record(rec: bytes) -> dict:
    return vc.unpack_record(rec)


def zephon_pipeline(data: Path):
    import zephon as z

    tok = z.tokenizer(str(data / "native" / "bpe.json"), eos_token=vc.EOS)
    return (z.Pipeline(seed=1234, lanes=ROWS)
            .source("pairs", z.read.webdataset(vc.shards(data), columns=["image=jpg;png", "txt"], chunk_rows=CHUNK))
            .decode_images("image", max_pixels=MAX_PIXELS, patch_size=vc.PATCH, merge=vc.MERGE,
                           on_bad_image="drop_record")
            .tokenize_images(tok, "txt", image_start=vc.IMAGE_START, image_pad=vc.IMAGE_PAD, image_end=vc.IMAGE_END,
                             merge=vc.MERGE)
            .pack(seq_len=SEQ, algorithm="best_fit", max_patches_per_row=MAX_PATCHES)
            .batch(rows_per_lane=1))


def load_images(data: Path, n: int = 4000) -> list[bytes]:
    """``n`` images taken evenly from the whole corpus, the population Zephon's lanes read. (The first
    files' images alone decode about 10% slower than the corpus' average, which made the ceiling too low.)"""
    images = [img for _, img, _ in vc.iter_samples(data)]
    return images[::max(1, len(images) // n)][:n]


KEPT_IMAGES = 512  # decoder_alone_keep_T; Zephon's 8 lanes hold more than this in open rows and read-ahead


def decode_chunk(images: list[bytes]) -> int:
    n = 0
    for img in images:
        n += len(vc.patchify(vc.decode_resize(img, max_pixels=MAX_PIXELS)))
    return len(images)


def decode_chunk_kept(images: list[bytes]) -> list[np.ndarray]:
    return [vc.patchify(vc.decode_resize(img, max_pixels=MAX_PIXELS)) for img in images]


def build(kind: str, data: Path, workers: int, params: dict):
    native = data / "native"
    if kind == "decoder_alone":
        from concurrent.futures import ThreadPoolExecutor

        images = load_images(data)
        chunks = itertools.cycle([images[i:i + CHUNK] for i in range(0, len(images) - CHUNK + 1, CHUNK)])
        threads = params["threads"]
        kept: collections.deque = collections.deque(maxlen=KEPT_IMAGES // CHUNK)
        decode = decode_chunk_kept if params.get("keep") else decode_chunk

        def gen() -> Iterator[dict]:
            if threads == 1 and params.get("main_thread"):
                for c in chunks:
                    yield {"images": decode_chunk(c)}
            with ThreadPoolExecutor(threads) as ex:
                pending = [ex.submit(decode, next(chunks)) for _ in range(2 * threads)]
                while True:
                    out = pending.pop(0).result()
                    pending.append(ex.submit(decode, next(chunks)))
                    if isinstance(out, list):
                        kept.append(out)
                        out = len(out)
                    yield {"images": out}

        return gen(), lambda: None
    if kind == "grain":
        import grain

        src = grain.sources.ArrayRecordDataSource(sorted(str(p) for p in (native / "arrayrecord").glob("*.array_record")))
        ds = grain.MapDataset.source(src).repeat().map(parse_record).map(Transform(str(native / "bpe.json")))
        it_ds = grain.experimental.FirstFitPackIterDataset(
            ds.to_iter_dataset(grain.ReadOptions()),
            length_struct={"input_ids": SEQ, "loss_mask": SEQ, "pixel_values": MAX_PATCHES},
            num_packing_bins=ROWS, shuffle_bins=False).batch(ROWS)
        if workers:
            it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
        it = iter(it_ds)
        return it, (lambda: getattr(it, "close", lambda: None)())
    if kind == "zephon":
        loader = zephon_pipeline(data).build(rank=0, world_size=1, num_workers=workers, runner=params["runner"],
                                             reuse_batch_memory=params.get("reuse_batch_memory", True),
                                             prefetch=params.get("prefetch"), steps_ahead=params.get("steps_ahead"))
        return iter(loader), loader.close
    raise ValueError(kind)


def configs() -> list[dict[str, Any]]:
    c: list[dict[str, Any]] = [
        {"name": "decoder_alone_main", "kind": "decoder_alone", "workers": 0, "runner": "-",
         "params": {"threads": 1, "main_thread": True}},
        {"name": "decoder_alone_1", "kind": "decoder_alone", "workers": 1, "runner": "thread", "params": {"threads": 1}},
        {"name": "decoder_alone_2", "kind": "decoder_alone", "workers": 2, "runner": "thread", "params": {"threads": 2}},
    ]
    for t in (1, 2):
        c.append({"name": f"decoder_alone_keep_{t}", "kind": "decoder_alone", "workers": t, "runner": "thread",
                  "params": {"threads": t, "keep": True}})
    for w in (0, 1, 2):
        c.append({"name": f"grain_{w}", "kind": "grain", "workers": w, "runner": "process" if w else "inline",
                  "params": {}})
    c.append({"name": "zephon_0_inline", "kind": "zephon", "workers": 0, "runner": "inline",
              "params": {"algorithm": "best_fit", "runner": "thread"}})
    c.append({"name": "zephon_0_inline_fresh", "kind": "zephon", "workers": 0, "runner": "inline",
              "params": {"algorithm": "best_fit", "runner": "thread", "reuse_batch_memory": False}})
    for w in (1, 2):
        for r in ("thread", "pool", "process"):
            c.append({"name": f"zephon_{w}_{r}", "kind": "zephon", "workers": w, "runner": r,
                      "params": {"algorithm": "best_fit", "runner": r}})
        c.append({"name": f"zephon_{w}_thread_fresh", "kind": "zephon", "workers": w, "runner": "thread",
                  "params": {"algorithm": "best_fit", "runner": "thread", "reuse_batch_memory": False}})
        # a fixed read-ahead of 8 tasks per lane, instead of the default's 2 rising to 8 while lanes wait
        c.append({"name": f"zephon_{w}_thread_prefetch8", "kind": "zephon", "workers": w, "runner": "thread",
                  "params": {"algorithm": "best_fit", "runner": "thread", "prefetch": 8}})
        # the defaults before ReadAhead and StepsAhead: 2 tasks per lane, lanes on the trainer's thread
        c.append({"name": f"zephon_{w}_thread_sync2", "kind": "zephon", "workers": w, "runner": "thread",
                  "params": {"algorithm": "best_fit", "runner": "thread", "prefetch": 2, "steps_ahead": 0}})
        c.append({"name": f"zephon_{w}_process_ahead0", "kind": "zephon", "workers": w, "runner": "process",
                  "params": {"algorithm": "best_fit", "runner": "process", "steps_ahead": 0}})
    return c


def counts(kind: str, b: dict) -> tuple[int, int]:
    """(images, usable tokens) of one batch."""
    if kind == "decoder_alone":
        return b["images"], 0
    if kind == "zephon":
        return len(b["image_grid_thw"]), int((b["segment_ids"] != 0).sum())
    seg = np.asarray(b["input_ids_segment_ids"])
    return int(seg.max(axis=1).sum()), int((seg != 0).sum())  # one image per packed sample


def run_config(task: dict[str, Any]) -> dict[str, Any]:

    data, cfg = Path(task["data"]), task["config"]
    load_before = vc.load_now()
    imgs: list[int] = []
    toks: list[int] = []
    shapes: dict[str, Any] = {}
    cpu: list[float] = []
    if cfg["kind"] == "zephon":
        import zephon

    def make():
        return build(cfg["kind"], data, cfg["workers"], cfg["params"])

    def check(b: dict) -> None:
        if cfg["kind"] != "decoder_alone":
            shapes.update({k: list(np.asarray(v).shape) for k, v in b.items() if hasattr(v, "shape")})
            if tuple(np.asarray(b["input_ids"]).shape) != (ROWS, SEQ):
                raise AssertionError(f"input_ids {tuple(np.asarray(b['input_ids']).shape)}, expected {(ROWS, SEQ)}")

    def on_batch(run: int, i: int, b: dict) -> None:
        n, t = counts(cfg["kind"], b)
        imgs.append(n)
        toks.append(t)
        cpu.append(time.thread_time())  # the trainer's thread: it calls next() (and collates, inline)

    res = measure_stream(make, task["steps"] * (4 if cfg["kind"] == "decoder_alone" else 1),
                         task["warmup"], task["repeats"], 1, check=check, on_batch=on_batch,
                         digest=zephon.batch_digest if cfg["kind"] == "zephon" else None)
    digests = res.pop("digests_by_run")[0]
    w0 = max(1, task["warmup"])
    s = task["steps"] * (4 if cfg["kind"] == "decoder_alone" else 1)
    ips = [sum(imgs[w0 + k * s:w0 + (k + 1) * s]) / w["seconds"] for k, w in enumerate(res["runs"])]
    timed = slice(w0, w0 + s * len(res["runs"]))
    seconds = sum(w["seconds"] for w in res["runs"])  # all windows together: see the module docstring
    # from the last untimed batch (not hashed: the second half of the warm-up) to the last timed one
    trainer_cpu = 1e3 * (cpu[timed.stop - 1] - cpu[w0 - 1]) / max(1, sum(imgs[timed]))
    res.update(images_per_s=sum(imgs[timed]) / seconds, images_per_s_windows=ips,
               usable_tokens_per_s=sum(toks[timed]) / seconds,
               usable_fraction=sum(toks) / max(1, len(toks) * ROWS * SEQ), images_per_batch=sum(imgs) / len(imgs),
               trainer_cpu_ms_per_image=trainer_cpu,
               load_before=load_before, load_after=vc.load_now(), shapes=shapes)
    for k in ("runs", "pipelines"):
        res.pop(k, None)
    if digests:
        res["digests"] = digests
    return res


def check_transform(data: Path, n: int = 24) -> str:
    """Grain's per-sample transform gives Zephon's tokens and patches (first ``n`` samples of a shard)."""
    import hashlib

    import zephon as z

    samples = list(itertools.islice(vc.iter_samples(data, 1), n))
    t = Transform(str(data / "native" / "bpe.json"))
    want = set()
    for _, img, cap in samples:
        o = t({"image": img, "caption": cap})
        want.add(hashlib.sha256(o["input_ids"].astype(np.int64).tobytes() + o["pixel_values"].tobytes()).hexdigest())
    tok = z.tokenizer(str(data / "native" / "bpe.json"), eos_token=vc.EOS)
    pipe = (z.Pipeline(seed=1, lanes=1)
            .source("s", z.read.records([{"image": img, "txt": cap} for _, img, cap in samples], columns=["image", "txt"]))
            .decode_images("image", max_pixels=MAX_PIXELS, patch_size=vc.PATCH, merge=vc.MERGE)
            .tokenize_images(tok, "txt", image_start=vc.IMAGE_START, image_pad=vc.IMAGE_PAD, image_end=vc.IMAGE_END,
                             merge=vc.MERGE)
            .pack(seq_len=SEQ, max_patches_per_row=MAX_PATCHES)
            .batch(rows_per_lane=1, pixels="lists"))
    loader = pipe.build(rank=0, world_size=1)
    b = next(loader)
    loader.close()
    got = []
    seg, ids = b["segment_ids"][0].numpy(), b["input_ids"][0].numpy().astype(np.int64)
    for k, (images, ) in enumerate(zip(b["images"][0])):
        doc = ids[seg == k + 1]
        got.append(hashlib.sha256(doc.tobytes() + images[0].tobytes()).hexdigest())
    same = sum(g in want for g in got)
    if not got or same != len(got):
        raise SystemExit(f"Grain's transform differs from Zephon's decode_images + tokenize_images on {len(got) - same} "
                         f"of {len(got)} samples: the comparison would not be like for like")
    return f"Grain's transform == Zephon's decode_images + tokenize_images on {same}/{len(got)} samples (tokens + patches)"


def round_targets(per_cfg: dict[str, list[dict]], rounds: int) -> list[str]:
    def val(name: str, r: int, metric: str = "images_per_s") -> float | None:
        rr = per_cfg.get(name, [])
        return rr[r][metric] if r < len(rr) and rr[r].get("ok") else None

    lines = []
    ceiling = {0: "decoder_alone_main", 1: "decoder_alone_1", 2: "decoder_alone_2"}
    for w in (0, 1, 2):
        zephon = [n for n in per_cfg if n.startswith("zephon_") and per_cfg[n][0]["_workers"] == w]
        lines += fresh_ratio_lines(zephon, val, rounds, " (images_per_s)")
        for name in [n for n in zephon if not n.endswith("_fresh")]:
            for ref, bound, metric in ((ceiling[w], 0.9, "images_per_s"), (f"grain_{w}", 1.0, "usable_tokens_per_s")):
                ratios = [val(name, r, metric) / val(ref, r, metric) for r in range(rounds)
                          if val(name, r, metric) and val(ref, r, metric)]
                if ratios:
                    med = statistics.median(ratios)
                    lines.append(f"{name} / {ref} ({metric}) = {med:.2f} ({min(ratios):.2f}-{max(ratios):.2f}, "
                                 f"{sum(x >= bound for x in ratios)}/{len(ratios)} >= {bound})"
                                 + ("" if med >= bound else " NOT MET"))
            ref = f"decoder_alone_keep_{w}"
            ratios = [val(name, r) / val(ref, r) for r in range(rounds) if val(name, r) and val(ref, r)]
            if ratios:
                lines.append(f"{name} / {ref} (images_per_s) = {statistics.median(ratios):.2f} "
                             f"({min(ratios):.2f}-{max(ratios):.2f}; information, not a target)")
    return lines


# 32 MiB is the largest mmap threshold glibc accepts on 64-bit; a trim threshold alone would turn its
# dynamic mmap threshold off, and every decoded image would then be mmapped and faulted in afresh.
MALLOC_ENV: dict[str, dict[str, str]] = {
    "steady": {"MALLOC_TRIM_THRESHOLD_": str(256 << 20), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)},
    "glibc": {},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="bench_data/vl")
    ap.add_argument("--steps", type=int, default=20, help="timed batches per window (decoder alone: 4x as many chunks)")
    ap.add_argument("--warmup", type=int, default=40,
                    help="untimed batches first (Zephon's best-fit packer holds up to 16 open rows per lane)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=float, default=400.0)
    ap.add_argument("--json", default="")
    ap.add_argument("--malloc", choices=tuple(MALLOC_ENV), default="steady",
                    help="steady: every configuration keeps its heap (glibc's trim and mmap thresholds raised); "
                         "glibc: glibc's defaults (see the module docstring)")
    ap.add_argument("--profile", default="", metavar="CONFIG",
                    help="run one configuration in this process under cProfile and print where its time goes")
    args = ap.parse_args(argv)
    cfgs = configs()
    if args.profile:
        from _common import apply_single_thread_env

        apply_single_thread_env()
        c = next(c for c in cfgs if c["name"] == args.profile)
        it, close = build(c["kind"], Path(args.data).resolve(), c["workers"], c["params"])
        try:
            print(vc.profile(iter(it), args.steps, args.warmup))
        finally:
            close()
        return 0
    if args.list:
        print("\n".join(c["name"] for c in cfgs))
        return 0
    if args.only:
        cfgs = select_configs(cfgs, only_patterns(args.only))
    data = Path(args.data).resolve()
    vc.require_vl(data)
    vc.write_native(data, log=lambda m: print(m, flush=True))
    print(f"# VL full pipeline: decode + resize (<= {MAX_PIXELS} px, 28-px grid) + patchify (14 px, 2x2 merge) + "
          f"tokenize (BPE 8192) + pack [{ROWS}, {SEQ}] (<= {MAX_PATCHES} patches a row)")
    print(f"# protocol: {args.rounds} interleaved round(s); {args.warmup} warm-up batches, then {args.repeats} windows x "
          f"{args.steps} batches (rates over all windows together); median round reported; malloc {args.malloc}")
    print(f"# machine: {vc.vl_machine_info()}", flush=True)
    if any(c["kind"] == "grain" for c in cfgs):
        print(f"# {check_transform(data)}", flush=True)
    per_cfg: dict[str, list[dict[str, Any]]] = {c["name"]: [] for c in cfgs}
    for rnd in range(max(1, args.rounds)):
        print(f"# round {rnd + 1} of {args.rounds} (load {vc.load_now()})", flush=True)
        for c in (cfgs if rnd % 2 == 0 else cfgs[::-1]):
            task = {"kind": "vlp", "config": c, "data": str(data), "steps": args.steps, "warmup": args.warmup,
                    "repeats": args.repeats}
            print(f"  {c['name']:<20}", end=" ", flush=True)
            r = run_task(SCRIPT, task, timeout=args.timeout, extra_env=MALLOC_ENV[args.malloc])
            r["_workers"] = c["workers"]
            per_cfg[c["name"]].append(r)
            if r.get("ok"):
                print(f"{r['images_per_s']:8.1f} images/s {r['usable_tokens_per_s'] / 1e3:8.1f} k usable tok/s "
                      f"trainer's thread {r['trainer_cpu_ms_per_image']:.3f} ms CPU/image "
                      f"(load {r['load_before']} -> {r['load_after']})", flush=True)
            else:
                print(f"FAILED: {r.get('error')}", flush=True)
    results = {c["name"]: {**c, **median_round(per_cfg[c["name"]], "images_per_s")} for c in cfgs}
    rows = []
    for n, r in results.items():
        if not r.get("ok"):
            rows.append([n, r["workers"], r["runner"], "FAILED", "", "", "", "", "", "", (r.get("error") or "")[:160]])
            continue
        sp = r.get("round_images_per_s") or [r["images_per_s"]]
        tok = "-" if r["kind"] == "decoder_alone" else f"{r['usable_tokens_per_s'] / 1e3:,.1f}"
        pad = "-" if r["kind"] == "decoder_alone" else f"{100 * (1 - r['usable_fraction']):.1f}"
        rows.append([n, r["workers"], r["runner"], f"{r['images_per_s']:,.0f}", f"{min(sp):.0f}-{max(sp):.0f}", tok, pad,
                     f"{statistics.median(x['trainer_cpu_ms_per_image'] for x in per_cfg[n] if x.get('ok')):.3f}",
                     f"{r['first_batch_s']:.1f}", f"{r['peak_rss_mb']:,.0f}", ""])
    print()
    print(fmt_table(["config", "workers", "runner", "images/s", "rounds", "k usable tok/s", "pad %",
                     "trainer ms CPU/img", "1st batch s", "peak RSS MB", "error"], rows, align="lrlrlrrrrrl"))
    check_lines, mismatch, zephon_failed = zephon_hash_check(results)
    print()
    print("\n".join(check_lines))
    targets = round_targets(per_cfg, max(1, args.rounds))
    print("\n# targets, ratios inside each round: median (min-max, rounds held)")
    print("\n".join(targets))
    print(f"# load at the end: {vc.load_now()}")
    code = 1 if mismatch else 2 if zephon_failed else 0
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "machine": vc.vl_machine_info(), "results": results,
                                               "per_round": per_cfg, "targets": targets, "hash_check": check_lines,
                                               "exit_code": code}, indent=1, default=str))
    return code


if __name__ == "__main__":
    task_main({"vlp": run_config})
    sys.exit(main())

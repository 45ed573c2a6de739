#!/usr/bin/env python
"""CPU cost per image of each stage of the vision-language pipeline, to size loader workers per GPU.

Each stage is timed with ``time.thread_time()`` (CPU seconds of the measuring thread, so time another
process takes from this shared VM is not counted) over the same ``--images`` samples of the corpus
(the first shards), one thread, ``--passes`` passes (the median pass is reported):

  read (tar)         the samples' bytes from the WebDataset shards as Zephon's reader takes them: one
                     ranged read per chunk of 16 samples (offsets from the tar headers, indexed untimed),
                     members sliced out, the caption decoded
  read (Parquet)     pyarrow: a row group's image bytes and captions as Python objects
  decode             full size (simplejpeg for JPEG, Pillow for PNG), and *reduced* (JPEG decoded at 1/2,
                     1/4 or 1/8 by DCT scaling where the target allows), for the two targets below
  resize             one bicubic Pillow step from the reduced decode to the target: ``fit`` = Qwen2-VL's
                     smart_resize within 448 x 448 on the 28-pixel grid; ``crop`` = 224 x 224 centre crop
  patchify           14 x 14 patches, 2 x 2 merge order, of the ``fit`` image
  tokenize           the caption with the BPE tokenizer (one encode_batch_fast per 16 captions) and the image
                     expanded to its tokens (start, pads, end, EOS)
  pack + collate     Zephon's trainer thread per image (runner="thread", 1 worker: the worker thread reads,
                     decodes and tokenizes; the thread calling next() mixes, packs and collates): the full
                     pipeline of vl_pipeline.py with ``pixels="lists"`` (tokens collated, pixels left as
                     lists) and ``pixels="flat"`` (also every patch copied into one uint8 tensor); the
                     difference is the pixel collation
  Zephon inline      the whole pipeline on one thread (no workers), CPU seconds of the process per image:
                     what the stages add up to in practice

    python scripts/bench/vl_stages.py --data bench_data/vl --json bench_results/vl_stages.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import apply_single_thread_env, fmt_table  # noqa: E402

apply_single_thread_env()

import numpy as np  # noqa: E402

import vl_common as vc  # noqa: E402

CHUNK = 16


def tar_index(path: str) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """[(key, {ext: (offset, size)})] in member order (untimed: Zephon builds it once per shard and caches it)."""
    out: list[tuple[str, dict]] = []
    with tarfile.open(path) as tf:
        for m in tf:
            if not m.isfile():
                continue
            key, ext = m.name.split(".", 1)
            if not out or out[-1][0] != key:
                out.append((key, {}))
            out[-1][1][ext] = (m.offset_data, m.size)
    return out


def stage_read_tar(shards: list[str], n: int) -> tuple[float, list[tuple[bytes, str]]]:
    idx = [(s, tar_index(s)) for s in shards]
    samples: list[tuple[bytes, str]] = []
    t0 = time.thread_time()
    for path, members in idx:
        fd = os.open(path, os.O_RDONLY)
        try:
            for i in range(0, len(members), CHUNK):
                group = members[i:i + CHUNK]
                lo = min(o for _, m in group for o, _ in m.values())
                hi = max(o + s for _, m in group for o, s in m.values())
                buf = os.pread(fd, hi - lo, lo)
                for _, m in group:
                    ext = "jpg" if "jpg" in m else "png"
                    o, s = m[ext]
                    to, ts = m["txt"]
                    samples.append((buf[o - lo:o - lo + s], buf[to - lo:to - lo + ts].decode()))
                if len(samples) >= n:
                    break
        finally:
            os.close(fd)
        if len(samples) >= n:
            break
    return time.thread_time() - t0, samples[:n]


def stage_read_parquet(data: Path, n: int) -> float:
    import pyarrow.parquet as pq

    got = 0
    t0 = time.thread_time()
    for f in vc.parquet_files(data):
        pf = pq.ParquetFile(f)
        for rg in range(pf.metadata.num_row_groups):
            t = pf.read_row_group(rg, columns=["image", "caption"])
            got += len(t.column("image").combine_chunks().field("bytes").to_pylist())
            t.column("caption").to_pylist()
            if got >= n:
                return time.thread_time() - t0
    return time.thread_time() - t0


def decode_full(data: bytes) -> np.ndarray:
    from PIL import Image

    if data[:3] == b"\xff\xd8\xff":
        import simplejpeg

        return simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=False, fastupsample=False, strict=True)
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def decode_reduced(data: bytes, crop: int | None, max_pixels: int | None) -> tuple[np.ndarray, tuple[int, int]]:
    """The reduced decode alone, and the target size (what vc.decode_resize does before its resize)."""
    import math

    from PIL import Image

    def target(h: int, w: int):
        if crop:
            r = max(crop / h, crop / w)
            return (crop, crop), (math.ceil(h * r), math.ceil(w * r))
        th, tw = vc.smart_resize(h, w, vc.PATCH * vc.MERGE, 56 * 56, max_pixels or 0)
        return (th, tw), (th, tw)

    if data[:3] == b"\xff\xd8\xff":
        import simplejpeg

        h, w, _, _ = simplejpeg.decode_jpeg_header(data)
        tgt, need = target(h, w)
        s = vc._dct_scale(h, w, *need)
        px = simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=False, fastupsample=False,
                                    min_height=-(-h // s), min_width=-(-w // s), min_factor=s, strict=True)
        return px, tgt
    with Image.open(io.BytesIO(data)) as im:
        w, h = im.size
        tgt, _ = target(h, w)
        return np.asarray(im.convert("RGB")), tgt


def resize(px: np.ndarray, tgt: tuple[int, int], crop: bool) -> np.ndarray:
    from PIL import Image

    ph, pw = px.shape[:2]
    th, tw = tgt
    if crop:
        r = max(th / ph, tw / pw)
        cw, ch = min(float(pw), tw / r), min(float(ph), th / r)
        box = ((pw - cw) / 2, (ph - ch) / 2, (pw + cw) / 2, (ph + ch) / 2)
    else:
        box = (0.0, 0.0, float(pw), float(ph))
    if (ph, pw) == (th, tw) and box == (0.0, 0.0, float(pw), float(ph)):
        return np.ascontiguousarray(px)
    return np.asarray(Image.fromarray(px).resize((tw, th), resample=Image.Resampling.BICUBIC, box=box))


def one_pass(data: Path, n: int) -> dict[str, float]:
    """CPU seconds of each stage over ``n`` images, one thread."""
    from tokenizers import Tokenizer

    out: dict[str, float] = {}
    out["read (tar, ranged reads of 16 samples)"], samples = stage_read_tar(vc.shards(data), n)
    out["read (Parquet row groups, pyarrow)"] = stage_read_parquet(data, n)
    images = [img for img, _ in samples]
    t0 = time.thread_time()
    for img in images:
        decode_full(img)
    out["decode, full size"] = time.thread_time() - t0
    for label, crop, mp in (("fit <= 448x448", None, 448 * 448), ("crop 224x224", 224, None)):
        t0 = time.thread_time()
        dec = [decode_reduced(img, crop, mp) for img in images]
        out[f"decode, reduced for {label}"] = time.thread_time() - t0
        t0 = time.thread_time()
        res = [resize(px, tgt, crop is not None) for px, tgt in dec]
        out[f"resize to {label}"] = time.thread_time() - t0
        if crop is None:
            t0 = time.thread_time()
            patches = [vc.patchify(px) for px in res]
            out["patchify (14 px, 2x2 merge), fit image"] = time.thread_time() - t0
            n_tokens = [len(p) // 4 for p in patches]
        del dec, res
    tok = Tokenizer.from_file(str(data / "native" / "bpe.json"))
    ids = [tok.token_to_id(t) for t in (vc.IMAGE_START, vc.IMAGE_PAD, vc.IMAGE_END, vc.EOS)]
    caps = [c for _, c in samples]
    t0 = time.thread_time()
    for i in range(0, len(caps), CHUNK):
        encs = tok.encode_batch_fast(caps[i:i + CHUNK], add_special_tokens=False)
        for e, k in zip(encs, n_tokens[i:i + CHUNK]):
            a = np.empty(k + 3 + len(e.ids), dtype=np.int32)
            a[0], a[1:k + 1], a[k + 1], a[k + 2:-1], a[-1] = ids[0], ids[1], ids[2], e.ids, ids[3]
    out["tokenize caption (BPE) + image tokens"] = time.thread_time() - t0
    out["_tokens_per_image"] = statistics.mean(k + 3 + len(e.ids) for k, e in
                                               zip(n_tokens, tok.encode_batch_fast(caps, add_special_tokens=False)))
    out["_image_tokens_per_image"] = statistics.mean(n_tokens)
    return out


def zephon_trainer_thread(data: Path, pixels: str, batches: int, warmup: int) -> dict[str, float]:
    """CPU of the thread calling next() per image, Zephon full pipeline, thread runner with 1 worker."""
    import vl_pipeline

    pipe = vl_pipeline.zephon_pipeline(data)
    if pixels != "flat":
        pipe = pipe.replace(pixels=pixels)
    loader = pipe.build(rank=0, world_size=1, num_workers=1, runner="thread")
    try:
        for _ in range(warmup):
            next(loader)
        cpu, n = 0.0, 0
        for _ in range(batches):
            t0 = time.thread_time()
            b = next(loader)
            cpu += time.thread_time() - t0
            n += len(b["image_grid_thw"]) if pixels == "flat" else sum(len(d) for r in b["images"] for d in r)
    finally:
        loader.close()
    return {"cpu_s": cpu, "images": n}


def zephon_inline(data: Path, batches: int, warmup: int) -> dict[str, float]:
    import vl_pipeline

    loader = vl_pipeline.zephon_pipeline(data).build(rank=0, world_size=1, num_workers=0)
    try:
        for _ in range(warmup):
            next(loader)
        t0, n = time.process_time(), 0
        tok = 0
        for _ in range(batches):
            b = next(loader)
            n += len(b["image_grid_thw"])
            tok += int((b["segment_ids"] != 0).sum())
        return {"cpu_s": time.process_time() - t0, "images": n, "usable_tokens": tok}
    finally:
        loader.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="bench_data/vl")
    ap.add_argument("--images", type=int, default=1000, help="images per pass (the first shards)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--batches", type=int, default=12, help="Zephon batches ([8, 4096]) measured per run")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each Zephon configuration, interleaved")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    data = Path(args.data).resolve()
    vc.require_vl(data)
    vc.write_native(data, log=lambda m: print(m, flush=True))
    print(f"# CPU per image of each stage, one thread, {args.images} images x {args.passes} passes (median pass)")
    print(f"# machine: {vc.vl_machine_info()}", flush=True)
    passes = []
    for p in range(args.passes):
        passes.append(one_pass(data, args.images))
        print(f"  pass {p + 1}: load {vc.load_now()}", flush=True)
    stages = {k: statistics.median(ps[k] for ps in passes) / args.images * 1e3 for k in passes[0] if not k.startswith("_")}
    tokens_per_image = passes[0]["_tokens_per_image"]
    image_tokens = passes[0]["_image_tokens_per_image"]
    zt = {}
    for pixels in ("lists", "flat") * args.repeats:  # interleaved
        r = zephon_trainer_thread(data, pixels, args.batches, args.warmup)
        zt.setdefault(pixels, []).append(r["cpu_s"] / r["images"] * 1e3)
        print(f"  zephon trainer thread, pixels={pixels}: {zt[pixels][-1]:.3f} CPU ms/image (load {vc.load_now()})",
              flush=True)
    inline = [zephon_inline(data, args.batches, args.warmup) for _ in range(args.repeats)]
    inline_ms = [r["cpu_s"] / r["images"] * 1e3 for r in inline]
    stages["pack + collate tokens (Zephon trainer thread, pixels='lists')"] = statistics.median(zt["lists"])
    stages["collate pixels (flat uint8 tensor; 'flat' minus 'lists')"] = (statistics.median(zt["flat"])
                                                                          - statistics.median(zt["lists"]))
    usable_per_image = inline[0]["usable_tokens"] / inline[0]["images"]
    rows = [[k, f"{v:.3f}", f"{1e3 / v:,.0f}" if v > 0 else "-"] for k, v in stages.items()]
    print()
    print(fmt_table(["stage (one thread)", "CPU ms / image", "images / CPU-s"], rows, align="lrr"))
    path = ["read (tar, ranged reads of 16 samples)", "decode, reduced for fit <= 448x448", "resize to fit <= 448x448",
            "patchify (14 px, 2x2 merge), fit image", "tokenize caption (BPE) + image tokens",
            "pack + collate tokens (Zephon trainer thread, pixels='lists')",
            "collate pixels (flat uint8 tensor; 'flat' minus 'lists')"]
    total = sum(stages[k] for k in path)
    print(f"\nsum of the full pipeline's stages: {total:.3f} CPU ms / image; Zephon inline, whole process: "
          f"{statistics.median(inline_ms):.3f} ({', '.join(f'{x:.3f}' for x in inline_ms)})")
    print(f"tokens per image: {tokens_per_image:.0f} ({image_tokens:.0f} image tokens); usable tokens per image in "
          f"Zephon's rows: {usable_per_image:.0f}; so one core gives ~{1e3 / statistics.median(inline_ms):,.0f} images/s "
          f"= ~{usable_per_image * 1e3 / statistics.median(inline_ms) / 1e3:,.1f}k usable tokens/s")
    print(f"# load at the end: {vc.load_now()}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "machine": vc.vl_machine_info(), "stages_ms": stages,
                                               "passes": passes, "trainer_thread_ms": zt, "inline_ms": inline_ms,
                                               "tokens_per_image": tokens_per_image, "image_tokens": image_tokens,
                                               "usable_tokens_per_image": usable_per_image, "sum_ms": total},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

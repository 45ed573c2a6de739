#!/usr/bin/env python
"""Vision-language fetch-and-batch and decode-and-batch: every loader, each reading its native format.

``--mode fetch`` (default): read image-text records (the encoded image bytes + the caption) and yield
batches of 256 samples, nothing decoded. ``--mode decode``: the same, with every image decoded, resized
(shortest side to 224) and centre-cropped to 224 x 224, batched as uint8 pixels.

  plain_loop            pyarrow: a Parquet row group -> its image bytes and captions as lists -> batches of 256
  grain_W               Grain: ArrayRecordDataSource (its recommended source; records written from the same
                        samples) -> MapDataset.source().repeat().map(parse[, decode]) -> to_iter_dataset(
                        ReadOptions()) (defaults: 16 read threads, 500 prefetched) -> batch(256)
                        (+ mp_prefetch(MultiprocessingOptions(num_workers=W)) for W > 0)
  torchdata_nodes_W_M   torchdata.nodes over the Parquet files: IterableWrapper(row groups) -> ParallelMapper(
                        read a row group[, decode]; W workers, method M) (Mapper for W = 0) -> Unbatcher ->
                        Batcher(256) -> Mapper(collate) -> Loader
  litdata_W             LitData: StreamingDataset(litdata.optimize output) -> StreamingDataLoader(batch_size=256,
                        num_workers=W[, collate_fn that decodes, in the workers])
  webdataset_W          webdataset: WebDataset(shards).to_tuple("jpg;png", "txt")[.map_tuple(decode)]
                        .batched(256) -> WebLoader(batch_size=None, num_workers=W)
  mosaic_W              Mosaic Streaming: StreamingDataset(MDS shards, batch_size=256) -> torch DataLoader(
                        batch_size=256, num_workers=W[, collate_fn that decodes])
  zephon_W_RUNNER       Zephon over the same tar shards (32 lanes x 8 rows, each row one sample): fetch: the
                        image bytes and caption as they are (batch() without pack()); decode:
                        decode_images(size=224, patchify=False) + batch(stack=["images"]), 16 samples a task: uint8
                        [256, 1, 224, 224, 3] and the captions
  zephon_rowsN_W_R      the zephon_W_R pipeline with larger read tasks: fetch, 256 samples per task
                        (chunk_rows=256, ~6 MB) instead of the default 64; decode, 64 instead of 16: fewer
                        per-task reads, opens and hand-overs, more memory in flight
  zephon_W_R_fresh      decode: zephon_W_R with build(reuse_batch_memory=False), every batch's pixels in
                        fresh memory (information only, left out of the targets)
  zephon_packed_W_R     more work than the peers do (left out of the targets): fetch: each caption tokenized
                        (a 4096-word WordLevel model) and packed best-fit into rows of 128 tokens with its
                        image bytes as the document's payload (~2.6 samples per row); decode: the captions
                        tokenized with their image tokens (tokenize_images) and packed one image a row
                        (pack(seq_len=256, max_images_per_row=1), batch(pixels="fixed")): pixel_values
                        uint8 [256, 3, 224, 224]
  zephon_*_before       with --zephon-src DIR: the same configuration run from DIR's zephon/ (the code before a
                        change), interleaved with the others in every round

Reported: samples/s (image-caption pairs delivered in batches per second: the comparable figure), and the
CPU time of the thread that calls ``next()`` (the trainer's) per sample over the timed windows. Protocol
as fetch_batch.py: one subprocess per configuration and round; warm-up batches, then timed windows, the
rate over all of them together (samples over seconds: a packing pipeline delivers in bursts, and the
median of short windows picks the fast ones; each window's rate is kept in the JSON). Read-ahead drains
in short windows: with tasks of many samples, take long ones (BENCHMARKS.md, 8d). ``--rounds``
interleaved rounds (every other round reversed), the median round reported with the min-max over rounds;
the targets are checked as ratios *inside* each round. ``uptime``'s load average is recorded before and
after every configuration (the machine is shared). The batch SHA-256s of every Zephon configuration of
one pipeline must agree (exit 1 otherwise, 2 if a Zephon configuration failed). In decode mode the peers'
transform (scripts/bench/vl_common.py: decode_resize) is first checked to give Zephon's pixels.

    python scripts/bench/vl_fetch_batch.py --data bench_data/vl --rounds 3 --json bench_results/vl_fetch.json
    python scripts/bench/vl_fetch_batch.py --data bench_data/vl --mode decode --rounds 2 --json bench_results/vl_decode.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from _common import fmt_table, measure_stream, only_patterns, run_task, select_configs, task_main  # noqa: E402
from _common import zephon_src_first  # noqa: E402
from _targets import fresh_ratio_lines, median_round, zephon_hash_check  # noqa: E402
import vl_common as vc  # noqa: E402

zephon_src_first()  # a measured child of --zephon-src: that checkout's zephon/ before anything imports one
SCRIPT = Path(__file__).resolve()
BATCH = 256
LANES, PER_LANE = 32, 8
SEQ_FETCH, SEQ_DECODE = 128, 256
SIZE = 224
TASK = {"fetch": 64, "decode": 16}  # samples per read task (chunk_rows): the library's default; 16 where workers decode
BIG_TASK = {"fetch": 256, "decode": 64}  # the zephon_rowsN_* configurations
DEFAULTS = {"fetch": {"warmup": 10, "steps": 20, "repeats": 3},
            "decode": {"warmup": 8, "steps": 6, "repeats": 3}}


# -- per-batch functions (module level: picklable for worker processes) -----------------------------------
def parse_record(rec: bytes) -> dict:
    return vc.unpack_record(rec)


def decode224(data: bytes) -> np.ndarray:
    return vc.decode_resize(data, crop=SIZE)


def decode_sample(s: dict) -> dict:
    return {"image": decode224(s["image"]), "caption": s["caption"]}


def collate_fetch(samples: list[dict]) -> dict:
    return {"image": [s["image"] for s in samples], "caption": [s["caption"] for s in samples]}


def collate_decoded(samples: list[dict]) -> dict:
    import torch

    return {"image": torch.from_numpy(np.stack([s["image"] for s in samples])),
            "caption": [s["caption"] for s in samples]}


def collate_decode_in_worker(samples: list[dict]) -> dict:
    """LitData / Mosaic: the collate function runs in the loader's workers, so the decode does too."""
    return collate_decoded([decode_sample(s) for s in samples])


def collate_tuples(samples: list[tuple]) -> dict:
    return collate_fetch([{"image": a, "caption": b} for a, b in samples])


def collate_tuples_decoded(samples: list[tuple]) -> dict:
    return collate_decoded([{"image": a, "caption": b} for a, b in samples])


class RowGroups:
    """A Parquet row group -> its samples (image bytes, caption), optionally decoded. Picklable; each
    process and thread opens its own files."""

    def __init__(self, decode: bool) -> None:
        self.decode = decode
        self._files: dict = {}

    def __call__(self, item: tuple[str, int]) -> list[dict]:
        import threading

        import pyarrow.parquet as pq

        key = (item[0], threading.get_ident())
        pf = self._files.get(key)
        if pf is None:
            pf = self._files[key] = pq.ParquetFile(item[0])
        t = pf.read_row_group(item[1], columns=["image", "caption"])
        images = t.column("image").combine_chunks().field("bytes").to_pylist()
        out = [{"image": i, "caption": c} for i, c in zip(images, t.column("caption").to_pylist())]
        return [decode_sample(s) for s in out] if self.decode else out

    def __getstate__(self) -> dict:
        return {"decode": self.decode}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["decode"])


def row_groups(data: Path) -> list[tuple[str, int]]:
    import pyarrow.parquet as pq

    return [(f, rg) for f in vc.parquet_files(data) for rg in range(pq.ParquetFile(f).metadata.num_row_groups)]


def epochs(make_iter) -> Iterator:
    """Iterate a finite loader again and again (a new epoch: a new iterator, as a training loop does)."""
    while True:
        n = 0
        for b in make_iter():
            n += 1
            yield b
        if n == 0:
            raise RuntimeError("the loader yielded nothing")


# -- Zephon ------------------------------------------------------------------------------------------------
def zephon_pipeline(data: Path, mode: str, packed: bool = False, chunk_rows: int | None = None):
    import zephon as z

    native = data / "native"
    tok = z.tokenizer(str(native / "wordlevel.json"), eos_token=vc.EOS)
    if mode == "fetch" and not packed:  # the peers' work: each sample a row, its bytes and caption as they are
        rows = {"chunk_rows": chunk_rows} if chunk_rows else {}
        return (z.Pipeline(seed=1234, lanes=LANES)
                .source("pairs", z.read.webdataset(vc.shards(data), columns=["image=jpg;png", "txt"], **rows))
                .batch(rows_per_lane=PER_LANE))
    if mode == "fetch":
        return (z.Pipeline(seed=1234, lanes=LANES)
                .source("pairs", z.read.webdataset(vc.shards(data), columns=["image=jpg;png", "txt"]))
                .tokenize(tok, field="txt")
                .pack(seq_len=SEQ_FETCH, algorithm="best_fit")
                .batch(rows_per_lane=PER_LANE))
    if not packed:  # the peers' work: each sample a row, its image decoded to 224 x 224 uint8 and its caption
        return (z.Pipeline(seed=1234, lanes=LANES)
                .source("pairs", z.read.webdataset(vc.shards(data), columns=["image=jpg;png", "txt"],
                                                   chunk_rows=chunk_rows or TASK[mode]))
                .decode_images("image", size=SIZE, patchify=False, on_bad_image="drop_record")
                .batch(rows_per_lane=PER_LANE, stack=["images"]))
    return (z.Pipeline(seed=1234, lanes=LANES)
            .source("pairs", z.read.webdataset(vc.shards(data), columns=["image=jpg;png", "txt"], chunk_rows=16))
            .decode_images("image", size=SIZE, patchify=False, patch_size=vc.PATCH, merge=vc.MERGE,
                           on_bad_image="drop_record")
            .tokenize_images(tok, "txt", image_start=vc.IMAGE_START, image_pad=vc.IMAGE_PAD, image_end=vc.IMAGE_END,
                             merge=vc.MERGE)
            .pack(seq_len=SEQ_DECODE, algorithm="best_fit", max_images_per_row=1)
            .batch(rows_per_lane=PER_LANE, pixels="fixed"))


# -- pipelines ---------------------------------------------------------------------------------------------
def build(kind: str, data: Path, mode: str, workers: int, params: dict, holder: dict):
    native = data / "native"
    decode = mode == "decode"
    if kind == "plain_loop":
        read = RowGroups(decode)
        items = row_groups(data)

        def gen() -> Iterator[dict]:
            pending: list[dict] = []
            for item in itertools.cycle(items):
                pending.extend(read(item))
                while len(pending) >= BATCH:
                    yield (collate_decoded if decode else collate_fetch)(pending[:BATCH])
                    pending = pending[BATCH:]

        return gen(), lambda: None
    if kind == "grain":
        import grain

        src = grain.sources.ArrayRecordDataSource(sorted(str(p) for p in (native / "arrayrecord").glob("*.array_record")))
        ds = grain.MapDataset.source(src).repeat().map(parse_record)
        if decode:
            ds = ds.map(decode_sample)
        it_ds = ds.to_iter_dataset(grain.ReadOptions()).batch(BATCH, batch_fn=collate_decoded if decode else collate_fetch)
        if workers:
            it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
        it = iter(it_ds)
        return it, (lambda: getattr(it, "close", lambda: None)())
    if kind == "torchdata":
        from torchdata.nodes import Batcher, IterableWrapper, Loader, Mapper, ParallelMapper, Unbatcher

        from _pipelines import shutdown_parallel_mapper

        node = IterableWrapper(itertools.cycle(row_groups(data)))
        mapper = None
        if workers:
            mapper = node = ParallelMapper(node, map_fn=RowGroups(decode), num_workers=workers,
                                           method=params["method"], in_order=True)
        else:
            node = Mapper(node, RowGroups(decode))
        node = Mapper(Batcher(Unbatcher(node), batch_size=BATCH, drop_last=True),
                      collate_decoded if decode else collate_fetch)
        loader = Loader(node)
        return loader, (lambda: shutdown_parallel_mapper(mapper) if mapper is not None else None)
    if kind == "litdata":
        import litdata

        ds = litdata.StreamingDataset(str(native / "litdata"), shuffle=False, drop_last=True)
        dl = litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers, drop_last=True,
                                         collate_fn=collate_decode_in_worker if decode else collate_fetch)
        return epochs(lambda: iter(dl)), lambda: None
    if kind == "webdataset":
        import webdataset as wds

        ds = wds.WebDataset(vc.shards(data), shardshuffle=False, empty_check=False).to_tuple("jpg;png", "txt")
        if decode:
            ds = ds.map_tuple(decode224, None)
        ds = ds.batched(BATCH, collation_fn=collate_tuples_decoded if decode else collate_tuples, partial=False)
        loader = wds.WebLoader(ds, batch_size=None, num_workers=workers)
        return epochs(lambda: iter(loader)), lambda: None
    if kind == "mosaic":
        vc.mosaic_stub()
        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory
        from torch.utils.data import DataLoader

        clean_stale_shared_memory()
        ds = StreamingDataset(local=str(native / "mds"), batch_size=BATCH, shuffle=False)
        dl = DataLoader(ds, batch_size=BATCH, num_workers=workers, drop_last=True,
                        collate_fn=collate_decode_in_worker if decode else collate_fetch)
        return epochs(lambda: iter(dl)), lambda: None
    if kind == "zephon":
        loader = zephon_pipeline(data, mode, params.get("packed", False), params.get("chunk_rows")).build(
            rank=0, world_size=1, num_workers=workers, runner=params["runner"],
            reuse_batch_memory=params.get("reuse_batch_memory", True))
        holder["loader"] = loader
        return iter(loader), loader.close
    raise ValueError(kind)


def configs(mode: str = "fetch") -> list[dict[str, Any]]:
    c: list[dict[str, Any]] = [{"name": "plain_loop", "kind": "plain_loop", "workers": 0, "runner": "-", "params": {}}]
    for kind, runner in (("grain", "process"), ("litdata", "process"), ("webdataset", "process"), ("mosaic", "process")):
        for w in (0, 1, 2):
            c.append({"name": f"{kind}_{w}", "kind": kind, "workers": w, "runner": runner if w else "inline",
                      "params": {}})
    c.append({"name": "torchdata_nodes_0", "kind": "torchdata", "workers": 0, "runner": "inline", "params": {}})
    for w in (1, 2):
        for m in ("thread", "process"):
            c.append({"name": f"torchdata_nodes_{w}_{m}", "kind": "torchdata", "workers": w, "runner": m,
                      "params": {"method": m}})
    algo = "records"
    c.append({"name": "zephon_0_inline", "kind": "zephon", "workers": 0, "runner": "inline",
              "params": {"algorithm": algo, "runner": "thread"}})
    for w in (1, 2):
        for r in ("thread", "pool", "process"):
            c.append({"name": f"zephon_{w}_{r}", "kind": "zephon", "workers": w, "runner": r,
                      "params": {"algorithm": algo, "runner": r}})
    # the same pipeline with larger tasks: fetch, 256 samples (~6 MB) instead of 64; decode, 64 instead of 16
    big = BIG_TASK[mode]
    for w, r in ((0, "inline"), (1, "thread"), (2, "thread"), (1, "pool"), (2, "pool")):
        c.append({"name": f"zephon_rows{big}_{w}_{r}", "kind": "zephon", "workers": w, "runner": r,
                  "params": {"algorithm": algo, "runner": "thread" if w == 0 else r, "chunk_rows": big}})
    # fetch: the captions tokenized and packed best-fit, their image bytes as payloads; decode: the captions
    # tokenized with their image tokens, packed one image a row, pixels as [256, 3, 224, 224]
    for w, r in ((0, "inline"), (1, "thread"), (2, "thread")):
        c.append({"name": f"zephon_packed_{w}_{r}", "kind": "zephon", "workers": w, "runner": r,
                  "params": {"algorithm": "best_fit", "runner": "thread" if w == 0 else r, "packed": True}})
    if mode == "decode":  # information only (not in the targets): every batch's pixels in fresh memory
        for w, r in ((0, "inline"), (2, "thread")):
            c.append({"name": f"zephon_{w}_{r}_fresh", "kind": "zephon", "workers": w, "runner": r,
                      "params": {"algorithm": algo, "runner": "thread", "reuse_batch_memory": False}})
    return c


def samples_in(kind: str, mode: str, b: dict) -> int:
    if kind == "zephon":
        if "valid" in b:  # a row per sample
            return int(b["valid"].sum())
        if mode == "fetch":
            return sum(len(docs) for docs in b["image"])
        return int(b["image_mask"].sum())
    return len(b["caption"])


def run_config(task: dict[str, Any]) -> dict[str, Any]:
    import os

    data, mode, cfg = Path(task["data"]), task["mode"], task["config"]
    load_before = vc.load_now()
    holder: dict[str, Any] = {}
    counts: list[int] = []
    nbytes: list[int] = []
    if cfg["kind"] == "zephon":
        import zephon

    def make():
        return build(cfg["kind"], data, mode, cfg["workers"], cfg["params"], holder)

    def check(b: dict) -> None:
        if mode == "decode":
            x = b["image"] if cfg["kind"] != "zephon" else b["images"] if "valid" in b else b["pixel_values"]
            want = (BATCH, SIZE, SIZE, 3) if cfg["kind"] != "zephon" else \
                (BATCH, 1, SIZE, SIZE, 3) if "valid" in b else (BATCH, 3, SIZE, SIZE)
            if str(x.dtype) != "torch.uint8" or tuple(x.shape) != want:
                raise AssertionError(f"pixels are {x.dtype} {tuple(x.shape)}, expected uint8 {want}")
        elif cfg["kind"] != "zephon" or "valid" in b:
            if len(b["image"]) != BATCH or not isinstance(b["image"][0], (bytes, bytearray, memoryview)):
                raise AssertionError(f"batch of {len(b['image'])} {type(b['image'][0]).__name__}, expected {BATCH} bytes")

    def on_batch(run: int, i: int, b: dict) -> None:
        counts.append(samples_in(cfg["kind"], mode, b))
        if i < 3 and mode == "fetch":
            imgs = b["image"] if cfg["kind"] != "zephon" or "valid" in b else [x for docs in b["image"] for x in docs]
            nbytes.append(sum(len(x) for x in imgs))

    res = measure_stream(make, task["steps"], task["warmup"], task["repeats"], 1, check=check, on_batch=on_batch,
                         digest=zephon.batch_digest if cfg["kind"] == "zephon" else None)
    digests = res.pop("digests_by_run")[0]
    w0, s = max(1, task["warmup"]), task["steps"]
    per_s = [sum(counts[w0 + k * s:w0 + (k + 1) * s]) / w["seconds"] for k, w in enumerate(res["runs"])]
    pooled = sum(counts[w0:w0 + len(res["runs"]) * s]) / sum(w["seconds"] for w in res["runs"])
    timed = sum(counts[w0:w0 + len(res["runs"]) * s])
    res["trainer_cpu_us_per_sample"] = 1e6 * sum(w["thread_cpu_s"] for w in res["runs"]) / max(1, timed)
    res.update(samples_per_s=pooled, samples_per_s_windows=per_s,
               samples_per_batch=sum(counts) / len(counts), load_before=load_before, load_after=vc.load_now(),
               cpu_s=sum(os.times()[:4]))
    if nbytes:
        res["image_mb_per_batch"] = sum(nbytes) / len(nbytes) / 1e6
    for k in ("runs", "pipelines"):
        res.pop(k, None)
    if digests:
        res["digests"] = digests
    if cfg["kind"] == "zephon":
        res["zephon_from"] = str(Path(zephon.__file__).parent)  # this checkout's, or --zephon-src's
    return res


# -- the peers' transform equals Zephon's ------------------------------------------------------------------
def check_transform(data: Path, n: int = 48) -> str:
    """Zephon's decode_images(size=224) pixels of the first ``n`` samples of a shard == decode224's."""
    import hashlib

    import zephon as z

    samples = list(itertools.islice(vc.iter_samples(data, 1), n))
    want = {hashlib.sha256(decode224(img).tobytes()).hexdigest() for _, img, _ in samples}
    tok = z.tokenizer(str(data / "native" / "wordlevel.json"), eos_token=vc.EOS)
    pipe = (z.Pipeline(seed=1, lanes=1)
            .source("s", z.read.records([{"image": img, "txt": cap} for _, img, cap in samples], columns=["image", "txt"]))
            .decode_images("image", size=SIZE, patchify=False, patch_size=vc.PATCH, merge=vc.MERGE)
            .tokenize_images(tok, "txt", image_start=vc.IMAGE_START, image_pad=vc.IMAGE_PAD, image_end=vc.IMAGE_END,
                             merge=vc.MERGE)
            .pack(seq_len=SEQ_DECODE, max_images_per_row=1)
            .batch(rows_per_lane=16, pixels="fixed"))
    loader = pipe.build(rank=0, world_size=1)
    b = next(loader)
    loader.close()
    px = b["pixel_values"].permute(0, 2, 3, 1).contiguous().numpy()
    got = [hashlib.sha256(px[i].tobytes()).hexdigest() for i in range(len(px)) if bool(b["image_mask"][i])]
    same = sum(h in want for h in got)
    if same != len(got):
        raise SystemExit(f"the peers' decode224 differs from Zephon's decode_images on {len(got) - same} of {len(got)} "
                         f"images: the comparison would not be like for like")
    return f"peers' transform == Zephon's decode_images on {same}/{len(got)} images (SHA-256 of the pixels)"


# -- the report --------------------------------------------------------------------------------------------
def round_ratios(per_cfg: dict[str, list[dict]], rounds: int, mode: str = "fetch") -> list[str]:
    """The targets, each as per-round ratios: Zephon's best runner at each worker count vs each peer's
    best configuration at that count; vs Grain (>= 2.5x when fetching, the original system's ratio; ahead
    when decoding); more workers never slower."""
    def val(name: str, r: int) -> float | None:
        rr = per_cfg.get(name, [])
        return rr[r]["samples_per_s"] if r < len(rr) and rr[r].get("ok") else None

    def best(prefix: str, w: int, r: int) -> float | None:
        vals = [val(n, r) for n in per_cfg if n.startswith(prefix) and per_cfg[n][0]["_workers"] == w
                and not n.startswith("zephon_packed_") and not n.endswith("_fresh")]  # the same work, defaults
        vals = [v for v in vals if v]
        return max(vals) if vals else None

    lines = []
    peers = ["plain_loop", "grain_", "torchdata_nodes_", "litdata_", "webdataset_", "mosaic_"]
    for w in (0, 1, 2):
        parts = []
        for p in peers:
            ratios = []
            for r in range(rounds):
                z_, q = best("zephon_", w, r), (val("plain_loop", r) if p == "plain_loop" else best(p, w, r))
                if z_ and q:
                    ratios.append(z_ / q)
            if ratios:
                bound = 2.5 if p == "grain_" and mode == "fetch" else 1.0
                held = sum(x >= bound for x in ratios)
                mark = "" if statistics.median(ratios) >= bound else " NOT MET"
                parts.append(f"{p.rstrip('_')} {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}, "
                             f"{held}/{len(ratios)}){mark}")
        lines.append(f"{w} workers: Zephon best / peer best (>= 1{'; Grain >= 2.5' if mode == 'fetch' else ''}): "
                     + "; ".join(parts))
    pairs = [(f"{pre}0_inline", f"{pre}1_{runner}", f"{pre}2_{runner}") for pre, runners in
             (("zephon_", ("thread", "pool", "process")), (f"zephon_rows{BIG_TASK[mode]}_", ("thread", "pool")))
             for runner in runners]
    lines += fresh_ratio_lines(list(per_cfg), val, rounds)
    for zero, one, two in pairs:
        for a, b in ((zero, one), (one, two)):
            ratios = [val(b, r) / val(a, r) for r in range(rounds) if val(a, r) and val(b, r)]
            if ratios:
                held = sum(x >= 1 for x in ratios)
                mark = "" if statistics.median(ratios) >= 1 else " NOT MET"
                lines.append(f"more workers never slower: {b} / {a} = {statistics.median(ratios):.2f} "
                             f"({min(ratios):.2f}-{max(ratios):.2f}, {held}/{len(ratios)}){mark}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="bench_data/vl")
    ap.add_argument("--mode", choices=("fetch", "decode"), default="fetch")
    ap.add_argument("--steps", type=int, default=None, help="timed batches per window (fetch 20, decode 6)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed batches first (fetch 10, decode 8: Zephon buffers ~4 batches of images at start)")
    ap.add_argument("--repeats", type=int, default=None, help="timed windows per run (3)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated names or globs")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", default="")
    ap.add_argument("--zephon-src", default="",
                    help="a checkout whose zephon/ to measure as well: every chosen zephon_* configuration runs a "
                         "second time from it, as <name>_before, interleaved in the same rounds")
    ap.add_argument("--profile", default="", metavar="CONFIG",
                    help="run one configuration in this process under cProfile (--warmup, then --steps batches) and "
                         "print where its time goes (worker processes are not profiled)")
    args = ap.parse_args(argv)
    for k, v in DEFAULTS[args.mode].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    cfgs = configs(args.mode)
    if args.profile:
        from _common import apply_single_thread_env

        apply_single_thread_env()
        c = next(c for c in cfgs if c["name"] == args.profile)
        it, close = build(c["kind"], Path(args.data).resolve(), args.mode, c["workers"], c["params"], {})
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
    if args.zephon_src:
        src = str(Path(args.zephon_src).resolve())
        cfgs = [v for c in cfgs for v in ([c, {**c, "name": f"{c['name']}_before", "zephon_src": src}]
                                          if c["kind"] == "zephon" else [c])]
    data = Path(args.data).resolve()
    vc.require_vl(data)
    print(f"# native formats: {vc.write_native(data, log=lambda m: print(m, flush=True))}", flush=True)
    manifest = json.loads((data / "manifest.json").read_text())
    what = ("image bytes + caption, no decode" if args.mode == "fetch"
            else f"decoded, resized and centre-cropped to {SIZE} x {SIZE} uint8")
    print(f"# VL {args.mode}-and-batch: {manifest['samples']} samples ({manifest['image_bytes'] / manifest['samples'] / 1e3:.1f} "
          f"kB per image on average), batches of {BATCH} samples, {what}")
    print(f"# protocol: {args.rounds} interleaved round(s), a fresh subprocess per configuration and round: "
          f"{args.warmup} warm-up batches, then {args.repeats} windows x {args.steps} batches (all windows pooled); "
          f"median round reported; Zephon's batch hashing excluded from timings")
    print(f"# machine: {vc.vl_machine_info()}", flush=True)
    if args.mode == "decode" and any(c["kind"] == "zephon" for c in cfgs):
        print(f"# {check_transform(data)}", flush=True)
    per_cfg: dict[str, list[dict[str, Any]]] = {c["name"]: [] for c in cfgs}
    for rnd in range(max(1, args.rounds)):
        print(f"# round {rnd + 1} of {args.rounds} (load {vc.load_now()})", flush=True)
        for c in (cfgs if rnd % 2 == 0 else cfgs[::-1]):
            task = {"kind": "vl", "config": c, "data": str(data), "mode": args.mode, "steps": args.steps,
                    "warmup": args.warmup, "repeats": args.repeats, "zephon_src": c.get("zephon_src", "")}
            print(f"  {c['name']:<24}", end=" ", flush=True)
            r = run_task(SCRIPT, task, timeout=args.timeout)
            r["_workers"] = c["workers"]
            per_cfg[c["name"]].append(r)
            if r.get("ok"):
                print(f"{r['samples_per_s'] / 1e3:8.2f} k samples/s, trainer {r['trainer_cpu_us_per_sample']:.2f} us "
                      f"CPU/sample  (load {r['load_before']} -> {r['load_after']})", flush=True)
            else:
                print(f"FAILED: {r.get('error')}", flush=True)
    results = {c["name"]: {**c, **median_round(per_cfg[c["name"]], "samples_per_s")} for c in cfgs}
    base = results.get("plain_loop", {})
    base_v = base.get("samples_per_s") if base.get("ok") else None
    rows = []
    for n, r in results.items():
        if not r.get("ok"):
            rows.append([n, r["workers"], r["runner"], "FAILED", "", "", "", "", "", (r.get("error") or "")[:160]])
            continue
        sp = r.get("round_samples_per_s") or [r["samples_per_s"]]
        rows.append([n, r["workers"], r["runner"], f"{r['samples_per_s'] / 1e3:,.2f}", vc.spread(sp),
                     f"{r['samples_per_s'] / base_v:.2f}" if base_v else "-",
                     f"{r['trainer_cpu_us_per_sample']:.2f}", f"{r['samples_per_batch']:.0f}",
                     f"{r['first_batch_s']:.2f}", f"{r['peak_rss_mb']:,.0f}"])
    print()
    print(fmt_table(["config", "workers", "runner", "k samples/s", "rounds", "x plain", "trainer us CPU/sample",
                     "samples/batch", "1st batch s", "peak RSS MB / error"], rows, align="lrlrlrrrrl"))
    check_lines, mismatch, zephon_failed = zephon_hash_check(results)
    print()
    print("\n".join(check_lines))
    targets = round_ratios(per_cfg, max(1, args.rounds), args.mode)
    print("\n# targets, ratios inside each round: median (min-max, rounds held)")
    print("\n".join(targets))
    print(f"# load at the end: {vc.load_now()}")
    code = 1 if mismatch else 2 if zephon_failed else 0
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "machine": vc.vl_machine_info(),
                                               "results": results, "per_round": per_cfg, "targets": targets,
                                               "hash_check": check_lines, "exit_code": code}, indent=1, default=str))
    return code


if __name__ == "__main__":
    task_main({"vl": run_config})
    sys.exit(main())

#!/usr/bin/env python
"""Fetch-and-batch benchmark: short raw records -> trivially tokenized -> batch, no heavy transform.

What is measured: the per-record overhead of each loader when the transform costs almost nothing.
The records are short documents (the first paragraph of each docstring of the benchmark corpus, at most
60 words), written once to ``DIR/fetch/short-*.parquet``; the "tokenizer" is a tiny Hugging Face
WordLevel model (whitespace split, 1024 words, trained on the fly into ``DIR/fetch/wordlevel.json``),
because Zephon only reads raw text (it has no pre-tokenized input) and needs a tokenizer file.
Batches are [256, 128] int64.

  plain_loop            pyarrow row group -> encode_batch_fast -> one record per row, padded/truncated
                        to 128 -> [256, 128]; no framework
  grain_W               Grain: MapDataset.source(records in memory) -> map(encode one record, pad to 128)
                        -> to_iter_dataset -> batch(256) (+ mp_prefetch(W) for W > 0)
  torchdata_nodes_W_M   torchdata.nodes: IterableWrapper(records in memory) -> ParallelMapper(encode one
                        record, pad to 128; W workers, method M) -> Batcher(256) -> Mapper(stack) -> Loader
  zephon_ALGO_W_RUNNER  Zephon, recipe DIR/fetch/recipe.toml (32 lanes x 8 rows, seq_len 128, the
                        WordLevel tokenizer) read from the Parquet files; rows are *packed*, so one row
                        holds several records, and batches carry labels/positions/segments as well

Reported: records/s (documents fetched, tokenized and placed in a batch per second: the comparable
figure), rows/s (= samples of 128 tokens; for the padded pipelines one record per row) and the share of
non-padding tokens. A record counts when its EOS lands in a batch (for Zephon: EOS tokens outside padding,
``segment_ids != 0``).
Protocol as in text_pipeline.py: one subprocess per configuration and round, warm-up, then the median of
timed windows; ``--rounds`` interleaved rounds, the median round reported. Every Zephon configuration's
batch SHA-256s must agree (exit status 1 otherwise, 2 if a Zephon configuration failed), and issue 3's
fetch-and-batch targets are checked inside each round (scripts/bench/_targets.py).

    python scripts/bench/fetch_batch.py --data bench_data --rounds 3 --json bench_results/fetch_batch3.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from _common import (  # noqa: E402
    RowGroupReader, derived_is_current, fmt_table, machine_info, mark_derived, measure_stream, require_data,
    only_patterns, run_task, select_configs, task_main,
)
from _targets import median_round, target_report, zephon_hash_check  # noqa: E402

SCRIPT = Path(__file__).resolve()
SEQ = 128
LANES, PER_LANE = 32, 8
BATCH = LANES * PER_LANE
EOS = "<|endoftext|>"

RECIPE = f"""\
# Zephon recipe for scripts/bench/fetch_batch.py: short records, a tiny WordLevel tokenizer.
seed = 1234
lanes = {LANES}
seq_len = {SEQ}
batch_per_lane = {PER_LANE}

[tokenizer]
kind = "huggingface"
path = "wordlevel.json"
eos_token = "{EOS}"

[pack]
algorithm = "wrap"

[[sources]]
name = "short"
path = "short-*.parquet"
format = "parquet"
text_field = "text"
"""


# -- data --------------------------------------------------------------------------------------------
def build_fetch_data(data: Path, out: Path, max_words: int = 60) -> None:
    """Short records from the corpus's docstrings + a WordLevel tokenizer + a recipe, into ``out``."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    out.mkdir(parents=True, exist_ok=True)
    records: list[str] = []
    for f in sorted((data / "parquet").glob("*.parquet")):
        t = pq.read_table(f, columns=["text", "kind"])
        for text, kind in zip(t.column("text").to_pylist(), t.column("kind").to_pylist()):
            if kind != "docstring":
                continue
            words = text.split("\n\n", 1)[0].split()
            if len(words) >= 5:
                records.append(" ".join(words[:max_words]))
    for i in range(4):
        part = records[i::4]
        pq.write_table(pa.table({"text": part}), out / f"short-{i:04d}.parquet", row_group_size=1000)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=1024, special_tokens=["[UNK]", EOS], show_progress=False)
    tok.train_from_iterator(records[::4], trainer=trainer)
    tok.save(str(out / "wordlevel.json"))
    (out / "recipe.toml").write_text(RECIPE, encoding="utf-8")
    (out / "info.json").write_text(json.dumps({"records": len(records),
                                               "mean_words": sum(len(r.split()) for r in records) / len(records)}))


def load_records(fetch: Path) -> list[str]:
    read = RowGroupReader()
    import pyarrow.parquet as pq

    out: list[str] = []
    for f in sorted(fetch.glob("short-*.parquet")):
        for rg in range(pq.ParquetFile(f).metadata.num_row_groups):
            out.extend(read((str(f), rg)))
    return out


# -- per-record transform (picklable) -----------------------------------------------------------------
class EncodePad:
    """One record -> int64 [SEQ]: WordLevel ids + EOS, truncated / padded with EOS."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._tok = None

    def _load(self) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(self.path)
        self.eos = self._tok.token_to_id(EOS)

    def __call__(self, text: str) -> np.ndarray:
        if self._tok is None:
            self._load()
        ids = self._tok.encode(text, add_special_tokens=False).ids[:SEQ - 1]
        row = np.full(SEQ, self.eos, dtype=np.int64)
        row[:len(ids)] = ids
        row[len(ids)] = self.eos
        return row

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])


class RecordSource:
    """Grain random-access source over the records (in memory)."""

    def __init__(self, records: list[str]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> str:
        return self.records[i % len(self.records)]


def stack(rows: list[np.ndarray]) -> dict:
    import torch

    return {"input_ids": torch.from_numpy(np.stack(rows))}


# -- pipelines ---------------------------------------------------------------------------------------
def build(kind: str, fetch: Path, params: dict, holder: dict):
    import torch

    tok_path = str(fetch / "wordlevel.json")
    if kind == "plain_loop":
        import pyarrow.parquet as pq
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tok_path)
        eos = tok.token_to_id(EOS)
        items = [(str(f), rg) for f in sorted(fetch.glob("short-*.parquet"))
                 for rg in range(pq.ParquetFile(f).metadata.num_row_groups)]
        read = RowGroupReader()

        def gen() -> Iterator[dict]:
            pending: list[np.ndarray] = []
            for item in itertools.cycle(items):
                encs = tok.encode_batch_fast(read(item), add_special_tokens=False)
                rows = np.full((len(encs), SEQ), eos, dtype=np.int64)
                for i, e in enumerate(encs):
                    ids = e.ids[:SEQ - 1]
                    rows[i, :len(ids)] = ids
                pending.append(rows)
                while sum(len(p) for p in pending) >= BATCH:
                    cat = np.concatenate(pending)
                    pending = [cat[BATCH:]]
                    yield {"input_ids": torch.from_numpy(cat[:BATCH])}

        return gen(), lambda: None
    if kind == "grain":
        import grain

        ds = grain.MapDataset.source(RecordSource(load_records(fetch))).repeat().map(EncodePad(tok_path))
        it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=1)).batch(BATCH)
        if params["workers"]:
            it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=params["workers"]))
        it = iter(it_ds)

        def gen_g() -> Iterator[dict]:
            for b in it:
                yield {"input_ids": torch.from_numpy(b)}

        return gen_g(), (lambda: getattr(it, "close", lambda: None)())
    if kind == "torchdata":
        from torchdata.nodes import Batcher, IterableWrapper, Loader, Mapper, ParallelMapper

        from _pipelines import shutdown_parallel_mapper

        records = load_records(fetch)
        node = IterableWrapper(itertools.cycle(records))
        mapper = node = ParallelMapper(node, map_fn=EncodePad(tok_path), num_workers=params["workers"],
                                       method=params.get("method", "thread"), in_order=True)
        node = Mapper(Batcher(node, batch_size=BATCH, drop_last=True), stack)
        loader = Loader(node)
        return loader, (lambda: shutdown_parallel_mapper(mapper))
    if kind == "zephon":
        import zephon

        recipe = zephon.load_recipe(fetch / "recipe.toml")
        if params["algorithm"] != recipe.pack.algorithm:
            recipe = recipe.replace(pack=zephon.PackSpec(algorithm=params["algorithm"]))
        loader = zephon.build_loader(recipe, rank=0, world_size=1, num_workers=params["workers"],
                                     runner=params["runner"])
        holder["loader"] = loader
        return iter(loader), loader.close
    raise ValueError(kind)


def configs() -> list[dict[str, Any]]:
    """Every loader at 0, 1 and 2 workers, with each runner it has."""
    c: list[dict[str, Any]] = [{"name": "plain_loop", "kind": "plain_loop", "workers": 0, "runner": "-", "params": {}}]
    for w in (0, 1, 2):
        c.append({"name": f"grain_{w}", "kind": "grain", "workers": w, "runner": "process" if w else "inline",
                  "params": {"workers": w}})
    c.append({"name": "torchdata_nodes_0", "kind": "torchdata", "workers": 0, "runner": "inline",
              "params": {"workers": 0}})
    for w in (1, 2):
        for m in ("thread", "process"):
            c.append({"name": f"torchdata_nodes_{w}_{m}", "kind": "torchdata", "workers": w, "runner": m,
                      "params": {"workers": w, "method": m}})
    for algo in ("wrap", "best_fit"):
        c.append({"name": f"zephon_{algo}_0_inline", "kind": "zephon", "workers": 0, "runner": "inline",
                  "params": {"algorithm": algo, "workers": 0, "runner": "thread"}})
        for w in (1, 2):
            for r in ("thread", "pool", "process"):
                c.append({"name": f"zephon_{algo}_{w}_{r}", "kind": "zephon", "workers": w, "runner": r,
                          "params": {"algorithm": algo, "workers": w, "runner": r}})
    return c


def run_config(task: dict[str, Any]) -> dict[str, Any]:
    import torch

    fetch = Path(task["fetch"])
    cfg = task["config"]
    holder: dict[str, Any] = {}
    eos = json.loads((fetch / "wordlevel.json").read_text())["model"]["vocab"][EOS]
    nonpad: list[float] = []
    records: list[int] = []  # documents that end (their EOS) in each batch, warm-up included
    if cfg["kind"] == "zephon":
        import zephon

    def make():
        return build(cfg["kind"], fetch, cfg["params"], holder)

    def check(b: dict) -> None:
        x = b["input_ids"]
        if x.dtype != torch.int64 or tuple(x.shape) != (BATCH, SEQ):
            raise AssertionError(f"batch is {x.dtype} {tuple(x.shape)}, expected int64 [{BATCH}, {SEQ}]")

    def on_batch(run: int, i: int, b: dict) -> None:
        x = b["input_ids"]
        if cfg["kind"] == "zephon":  # packed rows; a record is delivered where its EOS is (not padding)
            real = b["segment_ids"] != 0
            nonpad.append(float(real.float().mean()))
            records.append(int(((x == eos) & real).sum()))
        else:  # one record per row, padded with EOS after its own EOS
            first_eos = (x == eos).int().argmax(dim=1)
            nonpad.append(float((first_eos + 1).sum()) / x.numel())
            records.append(x.shape[0])

    res = measure_stream(make, task["steps"], task["warmup"], task["repeats"], BATCH * SEQ, check=check,
                         on_batch=on_batch, digest=zephon.batch_digest if cfg["kind"] == "zephon" else None)
    digests = res.pop("digests_by_run")[0]
    import statistics

    w0, S = max(1, task["warmup"]), task["steps"]
    recs_s = [sum(records[w0 + k * S:w0 + (k + 1) * S]) / w["seconds"] for k, w in enumerate(res["runs"])]
    rows_s = [w["tokens_per_s"] / SEQ for w in res["runs"]]
    res.update(rows_per_s=statistics.median(rows_s), records_per_s=statistics.median(recs_s),
               records_per_s_windows=recs_s, records_per_row=sum(records) / (len(records) * BATCH),
               nonpad_fraction=sum(nonpad) / max(1, len(nonpad)))
    if digests:
        res["digests"] = digests
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="bench_data")
    ap.add_argument("--steps", type=int, default=40, help="timed batches per window")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3, help="timed windows per run; a run's figure is their median")
    ap.add_argument("--rounds", type=int, default=3,
                    help="run every configuration this many times, interleaved (every other round in reverse "
                         "order), in a fresh subprocess each time, and report the median round")
    ap.add_argument("--only", default="", help="comma-separated names or globs")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--rebuild", action="store_true", help="rebuild DIR/fetch (records, tokenizer, recipe)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    cfgs = configs()
    if args.list:
        print("\n".join(c["name"] for c in cfgs))
        return 0
    if args.only:
        cfgs = select_configs(cfgs, only_patterns(args.only))
    data = Path(args.data).resolve()
    require_data(data)
    fetch = data / "fetch"
    if args.rebuild or not (fetch / "recipe.toml").exists() or not derived_is_current(fetch, data):
        print(f"building {fetch} (short records + WordLevel tokenizer) ...", flush=True)
        for old in fetch.glob("short-*.parquet"):
            old.unlink()
        build_fetch_data(data, fetch)
        mark_derived(fetch, data)
    info = json.loads((fetch / "info.json").read_text())
    print(f"# fetch-and-batch: {info['records']} short records (mean {info['mean_words']:.0f} words), WordLevel "
          f"tokenizer (1024 words), batches [{BATCH}, {SEQ}] int64")
    print(f"# measured: records/s = documents fetched + tokenized + placed in a batch per second; rows/s = "
          f"[{SEQ}] samples per second (padded loaders: one record per row; Zephon packs several)")
    print(f"# protocol: {args.rounds} interleaved round(s), a fresh subprocess per configuration and round: "
          f"{args.warmup} warm-up batches, then {args.repeats} windows x {args.steps} batches (median window); "
          f"the median round is reported; Zephon's batch hashing excluded from timings")
    print(f"# machine: {machine_info()}", flush=True)
    per_cfg: dict[str, list[dict[str, Any]]] = {c["name"]: [] for c in cfgs}
    for rnd in range(max(1, args.rounds)):
        if args.rounds > 1:
            print(f"# round {rnd + 1} of {args.rounds}", flush=True)
        for c in (cfgs if rnd % 2 == 0 else cfgs[::-1]):
            task = {"kind": "fetch", "config": c, "fetch": str(fetch), "steps": args.steps, "warmup": args.warmup,
                    "repeats": args.repeats}
            print(f"  {c['name']:<26}", end=" ", flush=True)
            r = run_task(SCRIPT, task, timeout=args.timeout)
            per_cfg[c["name"]].append(r)
            print(f"{r['records_per_s'] / 1e3:8.1f} k records/s" if r.get("ok") else f"FAILED: {r.get('error')}",
                  flush=True)
    results = {c["name"]: {**c, **median_round(per_cfg[c["name"]], "records_per_s")} for c in cfgs}
    base = results.get("plain_loop", {}).get("records_per_s") if results.get("plain_loop", {}).get("ok") else None
    rows = []
    for n, r in results.items():
        if not r.get("ok"):
            rows.append([n, r["workers"], r["runner"], "FAILED", "", "", "", "", "", f"{r['peak_rss_mb']:.0f}",
                         (r.get("error") or "")[:100]])
            continue
        spread = r.get("round_records_per_s") or [r["records_per_s"]]
        rows.append([n, r["workers"], r["runner"], f"{r['records_per_s'] / 1e3:,.1f}",
                     f"{r['records_per_s'] / base:.2f}" if base else "-", f"{r['rows_per_s'] / 1e3:,.1f}",
                     f"{r['records_per_row']:.2f}",
                     f"{100 * r['nonpad_fraction']:.0f}", f"{r['first_batch_s']:.2f}", f"{r['peak_rss_mb']:,.0f}",
                     f"{min(spread) / 1e3:.1f}-{max(spread) / 1e3:.1f}k"])
    print()
    print(fmt_table(["config", "workers", "runner", "k records/s", "x plain_loop", "k rows/s", "records/row",
                     "non-pad %", "1st batch s", "peak RSS MB", "rounds min-max / error"], rows, align="lrlrrrrrrrl"))
    check_lines, mismatch, zephon_failed = zephon_hash_check(results)
    print()
    print("\n".join(check_lines))
    targets = target_report(per_cfg, pipeline="fetch")
    if targets:
        print("\n# issue 3 targets, ratios taken inside each round (see scripts/bench/_targets.py)")
        print("\n".join(targets))
    code = 1 if mismatch else 2 if zephon_failed else 0
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "per_round": per_cfg,
                                               "targets": targets, "exit_code": code}, indent=1))
    return code


if __name__ == "__main__":
    task_main({"fetch": run_config})
    sys.exit(main())

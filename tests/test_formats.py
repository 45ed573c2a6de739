"""Formats beyond Parquet and JSON Lines, and pre-tokenized sources.

Every dataset here is written by its format's own writer: pyarrow (Parquet), mosaicml-streaming's
``MDSWriter`` (MDS), ``litdata.optimize`` (LitData) and ``vortex.io.write`` (Vortex). Each holds the
same documents in the same number of shards with the same rows per shard as a Parquet reference (one
file per shard, one row group per file, as many shards as lanes, so that units are whole shards in
every format and the work plans are the same); a recipe over it must then give the Parquet
reference's global batches, byte for byte, at every world size and across a resume on another world
size. The same datasets carry a token-id column made with the recipe's tokenizer: read with
``tokens_field`` (the tokenizer skipped), they must give the text reference's batches too.
Bad input (truncated or corrupt shards, a missing field, an index that disagrees with its shard,
token ids outside the vocabulary) must be a SourceError naming the object.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.optional import require

from zephon import RecipeError, SourceError, WorkPlan, build_loader, load_tokenizer, recipe_from_dict
from zephon.verify import global_hashes

from .conftest import base_recipe_dict

SHARDS = 16  # = lanes: every format's units are whole shards, so its plan is the Parquet reference's
ROWS = 4  # documents per shard: lanes finish units (flushes, passes) within a few steps
STEPS = 8


def shard_name(k: int) -> str:
    """Shards are listed sorted by path; litdata.optimize names its chunks ``chunk-0-{k}.bin`` (so
    ``chunk-0-10`` sorts before ``chunk-0-2``): the other formats use the same stems, so that shard ``k``
    is at the same place of the sorted listing in every format."""
    return f"chunk-0-{k}"
FORMATS = ["mds", "litdata", "vortex"]
# The writers come from .ci/run, the LitData / Vortex readers' libraries from the litdata / formats extras;
# without one, its tests skip with this reason (shown by pytest -ra) rather than fail.
_LIBRARY = {"mds": "streaming", "litdata": "litdata", "vortex": "vortex"}
MISSING = {fmt: f"{fmt}: {mod} is not installed (.ci/run installs every library the tests use)"
           for fmt, mod in _LIBRARY.items() if importlib.util.find_spec(mod) is None}


def _missing(reason: str) -> None:
    """A missing optional library skips locally but fails in CI (.ci/run installs every extra)."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must test every format")
    pytest.skip(reason)


def need(fmt: str) -> None:
    if fmt in MISSING:
        _missing(MISSING[fmt])


def ds(datasets: dict[str, Path], key: str) -> Path:
    """The dataset ``key`` (a format, or ``litdata_zstd``), or a skip when its library is missing."""
    need(key.split("_")[0])
    return datasets[key]


# -- writers: each format's own library -------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def mds_writer():
    """mosaicml-streaming's MDSWriter. ``import streaming`` also imports ``streaming.vision``, hence
    torchvision, whose PyPI wheels need the CUDA build of torch; the writer needs neither, so when the
    package import fails its format modules are loaded without the package ``__init__`` files."""
    try:
        from streaming import MDSWriter
        return MDSWriter
    except (ImportError, RuntimeError, AttributeError):
        pass
    spec = importlib.util.find_spec("streaming")
    if spec is None or not spec.submodule_search_locations:
        _missing("mosaicml-streaming is not installed (.ci/run installs every library the tests use)")
    for name in [m for m in sys.modules if m == "streaming" or m.startswith("streaming.")]:
        del sys.modules[name]
    root = list(spec.submodule_search_locations)[0]
    for name, folder in (("streaming", root), ("streaming.base", os.path.join(root, "base"))):
        stub = types.ModuleType(name)
        stub.__path__ = [folder]
        sys.modules[name] = stub
    from streaming.base.format.mds.writer import MDSWriter
    return MDSWriter


_LITDATA_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import litdata

    shards = json.load(open(sys.argv[1]))
    outputs = json.load(open(sys.argv[2]))  # {output_dir: extra optimize() arguments}
    items = [(t, ids) for shard in shards for t, ids in shard]

    def item(i):
        text, ids = items[i]
        return {"text": text, "input_ids": np.asarray(ids, dtype=np.int32)}

    if __name__ == "__main__":
        for out, extra in outputs.items():
            litdata.optimize(fn=item, inputs=list(range(len(items))), output_dir=out, chunk_size=len(shards[0]),
                             num_workers=1, mode="overwrite", start_method="fork", keep_data_ordered=True, **extra)
""")


def write_litdata(outputs: dict[Path, dict], shards: list[list[tuple[str, list[int]]]]) -> None:
    """``litdata.optimize`` (once per output folder, with these extra arguments) in one child process:
    it sets the multiprocessing start method globally, and starting it once costs seconds."""
    require("litdata")
    work = next(iter(outputs)).parent
    work.mkdir(parents=True, exist_ok=True)
    (work / "litdata_shards.json").write_text(json.dumps(shards))
    (work / "litdata_outputs.json").write_text(json.dumps({str(k): v for k, v in outputs.items()}))
    (work / "litdata_write.py").write_text(_LITDATA_SCRIPT)
    run = subprocess.run([sys.executable, str(work / "litdata_write.py"), str(work / "litdata_shards.json"),
                          str(work / "litdata_outputs.json")], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 0, run.stderr[-3000:]


def write_dataset(fmt: str, out: Path, shards: list[list[tuple[str, list[int]]]]) -> None:
    """``shards``: per shard, its (text, token ids) rows. Columns ``text`` and ``input_ids``."""
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        for k, rows in enumerate(shards):
            pq.write_table(_table(rows), out / f"{shard_name(k)}.parquet", row_group_size=len(rows))
    elif fmt == "vortex":
        import vortex

        for k, rows in enumerate(shards):
            vortex.io.write(_table(rows), str(out / f"{shard_name(k)}.vortex"))
    elif fmt == "mds":
        writer = mds_writer()
        for k, rows in enumerate(shards):  # one writer per shard: exactly len(rows) samples per shard
            with writer(out=str(out / shard_name(k)), columns={"text": "str", "input_ids": "ndarray:int32"},
                        size_limit=None) as w:
                for text, ids in rows:
                    w.write({"text": text, "input_ids": np.asarray(ids, dtype=np.int32)})
    elif fmt == "litdata":
        write_litdata({out: {}}, shards)
    else:
        raise AssertionError(fmt)


def _table(rows: list[tuple[str, list[int]]]) -> pa.Table:
    return pa.table({"text": [t for t, _ in rows],
                     "input_ids": pa.array([ids for _, ids in rows], pa.list_(pa.int32()))})


# -- fixtures ---------------------------------------------------------------------------------------

def raw_tokenizer(sp_model):
    """The recipe's tokenizer without BOS/EOS: what a pre-tokenized dataset stores."""
    spec = recipe_from_dict(base_recipe_dict(Path("."), {"kind": "sentencepiece", "path": str(sp_model)})).tokenizer
    return load_tokenizer(dataclasses.replace(spec, add_eos=False, add_bos=False))


@pytest.fixture(scope="module")
def shards(corpus_texts, sp_model) -> list[list[tuple[str, list[int]]]]:
    texts = corpus_texts[: SHARDS * ROWS]
    tok = raw_tokenizer(sp_model)
    flat, offsets = tok.encode(texts)
    rows = [(t, flat[a:b].tolist()) for t, a, b in zip(texts, offsets[:-1], offsets[1:])]
    assert all(len(ids) for _, ids in rows)
    return [rows[k * ROWS:(k + 1) * ROWS] for k in range(SHARDS)]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory, shards) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("formats")
    out = {}
    for fmt in ["parquet", "mds", "vortex"]:
        if fmt not in MISSING:
            out[fmt] = root / fmt
            write_dataset(fmt, out[fmt], shards)
    if "litdata" not in MISSING:  # plain, and compressed with its default (zstd frames inside each chunk)
        out["litdata"], out["litdata_zstd"] = root / "litdata", root / "litdata_zstd"
        write_litdata({out["litdata"]: {}, out["litdata_zstd"]: {"compression": "zstd"}}, shards)
    return out


def recipe_over(sp_model, path: Path, fmt: str, tokens: bool = False, **top):
    source = {"name": "docs", "path": str(path), "format": fmt}
    source.update({"tokens_field": "input_ids"} if tokens else {"text_field": "text"})
    data = base_recipe_dict(Path("."), {"kind": "sentencepiece", "path": str(sp_model)})
    data["sources"] = [source]
    data["flush_every"] = 1
    data.update(top)
    return recipe_from_dict(data)


@pytest.fixture(scope="module")
def reference(sp_model, datasets) -> list[str]:
    recipe = recipe_over(sp_model, datasets["parquet"], "parquet")
    loader = build_loader(recipe, rank=0, world_size=1)
    for _ in range(STEPS):
        next(loader)
    m = loader.metrics()
    assert m["flushes"] > 0 and m["pieces_split"] > 0  # the recipe exercises flushes and splits
    hashes = global_hashes(recipe, 1, STEPS)
    assert len(set(hashes)) == STEPS
    return hashes


# -- same global batches as Parquet -----------------------------------------------------------------

@pytest.mark.timeout(240)
@pytest.mark.parametrize("fmt", FORMATS)
def test_format_gives_the_parquet_batches_at_every_world_size(sp_model, datasets, reference, fmt):
    recipe = recipe_over(sp_model, ds(datasets, fmt), fmt)
    plan = WorkPlan(recipe.to_pipeline())
    files = plan.sources[0].files
    assert len(files) == SHARDS and len(plan.sources[0].units) == SHARDS
    assert global_hashes(recipe, 1, STEPS, plan=plan) == reference
    for w in (4, 16):
        assert global_hashes(recipe, w, STEPS, plan=plan) == reference, f"world size {w}"
    resumed = global_hashes(recipe, 4, STEPS, plan=plan, resume_at=3, resume_world_size=16)
    assert resumed == reference


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fmt", FORMATS)
def test_fewer_shards_than_lanes_split_like_parquet_row_groups(sp_model, datasets, fmt):
    """32 lanes, 16 shards: each shard (Parquet: its one row group; Vortex: its one split) is cut into
    two row ranges planned from metadata, the same ranges in every format."""
    recipe = recipe_over(sp_model, ds(datasets, fmt), fmt, lanes=32)
    plan = WorkPlan(recipe.to_pipeline())
    reference = recipe_over(sp_model, datasets["parquet"], "parquet", lanes=32)
    assert [(u.file, u.start, u.end) for u in plan.sources[0].units] == \
        [(u.file, u.start, u.end) for u in WorkPlan(reference.to_pipeline()).sources[0].units]
    assert len(plan.sources[0].units) == 2 * SHARDS
    expected = global_hashes(reference, 1, 4)
    assert global_hashes(recipe, 1, 4, plan=plan) == expected
    assert global_hashes(recipe, 8, 4, plan=plan) == expected


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fmt", ["parquet", *FORMATS])
def test_pretokenized_format_gives_the_text_batches(sp_model, datasets, reference, fmt):
    recipe = recipe_over(sp_model, ds(datasets, fmt), fmt, tokens=True)
    plan = WorkPlan(recipe.to_pipeline())
    assert global_hashes(recipe, 1, STEPS, plan=plan) == reference
    assert global_hashes(recipe, 4, STEPS, plan=plan) == reference


@pytest.mark.timeout(240)
def test_pretokenized_parquet_in_a_mixed_recipe(corpus, sp_model, tmp_path, make_recipe):
    """The base recipe's web source, pre-tokenized (same files, row groups of 6, an ids column), mixed
    with the JSONL text source: byte-identical global batches at world sizes 1 and 4."""
    tok = raw_tokenizer(sp_model)
    (tmp_path / "web").mkdir()
    for f in sorted((corpus / "web").glob("*.parquet")):
        table = pq.read_table(f)
        flat, offsets = tok.encode(table.column("text").to_pylist())
        ids = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat, pa.int32()))
        pq.write_table(pa.table({"id": table.column("id"), "input_ids": ids}), tmp_path / "web" / f.name,
                       row_group_size=6)
    text = make_recipe()
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    data["sources"][0] = {"name": "web", "path": str(tmp_path / "web"), "format": "parquet",
                          "tokens_field": "input_ids", "weight": 0.7}
    tokens = recipe_from_dict(data)
    reference = global_hashes(text, 1, STEPS)
    assert global_hashes(tokens, 1, STEPS) == reference
    assert global_hashes(tokens, 4, STEPS) == reference


# -- recipes ----------------------------------------------------------------------------------------

def test_tokens_field_and_text_field_are_exclusive(sp_model, datasets):
    data = base_recipe_dict(Path("."), {"kind": "sentencepiece", "path": str(sp_model)})
    data["sources"] = [{"name": "d", "path": str(datasets["parquet"]), "format": "parquet",
                        "text_field": "text", "tokens_field": "input_ids"}]
    with pytest.raises(RecipeError, match="either text_field .* or tokens_field"):
        recipe_from_dict(data)
    data["sources"] = [{"name": "d", "path": "x.jsonl", "format": "jsonl", "tokens_field": "input_ids"}]
    with pytest.raises(RecipeError, match="tokens_field is not supported for format 'jsonl'"):
        recipe_from_dict(data)


def test_wrong_index_kind_names_the_right_format(sp_model, datasets):
    with pytest.raises(SourceError, match="LitData index, not an MDS one: set format = \"litdata\""):
        WorkPlan(recipe_over(sp_model, ds(datasets, "litdata"), "mds").to_pipeline())
    with pytest.raises(SourceError, match="MDS index, not a LitData one"):
        WorkPlan(recipe_over(sp_model, ds(datasets, "mds"), "litdata").to_pipeline())


# -- bad input --------------------------------------------------------------------------------------

def first_error(recipe, steps: int = 12) -> BaseException | None:
    try:
        loader = build_loader(recipe, rank=0, world_size=1)
        for _ in range(steps):
            next(loader)
    except Exception as exc:  # noqa: BLE001 - checked by the caller
        return exc
    return None


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _shard_files(fmt: str, root: Path) -> list[Path]:
    pattern = {"mds": "chunk-*/*.mds", "litdata": "*.bin", "vortex": "*.vortex"}[fmt]
    return sorted(root.glob(pattern))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("how", ["truncated", "garbage", "middle"])
def test_corrupt_or_truncated_shard(sp_model, datasets, tmp_path, fmt, how):
    root = _copy(ds(datasets, fmt), tmp_path / fmt)
    bad = _shard_files(fmt, root)[5]
    raw = bad.read_bytes()
    if how == "truncated":
        bad.write_bytes(raw[: len(raw) // 2])
    elif how == "garbage":  # same size, random bytes
        bad.write_bytes(np.random.default_rng(3).bytes(len(raw)))
    else:  # header (and Vortex footer) intact, the data between overwritten
        a, b = len(raw) // 5, len(raw) * 3 // 5
        bad.write_bytes(raw[:a] + np.random.default_rng(4).bytes(b - a) + raw[b:])
    exc = first_error(recipe_over(sp_model, root, fmt))
    assert isinstance(exc, SourceError), exc
    assert str(bad) in str(exc), exc


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", [False, True])
def test_missing_field_names_the_shard_and_the_fields(sp_model, datasets, fmt, tokens):
    source = {"name": "docs", "path": str(ds(datasets, fmt)), "format": fmt}
    source["tokens_field" if tokens else "text_field"] = "body"
    data = base_recipe_dict(Path("."), {"kind": "sentencepiece", "path": str(sp_model)})
    data["sources"] = [source]
    exc = first_error(recipe_from_dict(data))
    assert isinstance(exc, SourceError), exc
    msg = str(exc)
    assert "'body'" in msg and "input_ids" in msg and "text" in msg
    assert ("Set tokens_field" if tokens else "Set text_field") in msg
    assert any(str(p) in msg for p in _shard_files(fmt, ds(datasets, fmt))), msg


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", FORMATS)
def test_text_field_that_holds_token_ids_and_the_reverse(sp_model, datasets, fmt):
    for field, tokens, expect in (("input_ids", False, "text"), ("text", True, "token")):
        source = {"name": "docs", "path": str(ds(datasets, fmt)), "format": fmt,
                  ("tokens_field" if tokens else "text_field"): field}
        data = base_recipe_dict(Path("."), {"kind": "sentencepiece", "path": str(sp_model)})
        data["sources"] = [source]
        exc = first_error(recipe_from_dict(data))
        assert isinstance(exc, SourceError) and expect in str(exc), exc


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", ["samples", "bytes", "encodings"])
def test_mds_shard_whose_index_disagrees_with_its_data(sp_model, datasets, tmp_path, change):
    root = _copy(ds(datasets, "mds"), tmp_path / "mds")
    index = root / shard_name(7) / "index.json"
    data = json.loads(index.read_text())
    shard = data["shards"][0]
    if change == "samples":
        shard["samples"] += 1
    elif change == "bytes":
        shard["raw_data"]["bytes"] += 10
    else:  # the index declares a fixed-size column the data does not have
        shard["column_encodings"] = ["int64" if n == "input_ids" else e
                                     for n, e in zip(shard["column_names"], shard["column_encodings"])]
        shard["column_sizes"] = [8 if n == "input_ids" else s for n, s in zip(shard["column_names"],
                                                                              shard["column_sizes"])]
    index.write_text(json.dumps(data))
    exc = first_error(recipe_over(sp_model, root, "mds"))
    assert isinstance(exc, SourceError), exc
    msg = str(exc)
    assert str(root / shard_name(7) / "shard.00000.mds") in msg and "disagrees" in msg and str(index) in msg


@pytest.mark.timeout(120)
def test_litdata_chunk_whose_index_disagrees_with_its_data(sp_model, datasets, tmp_path):
    root = _copy(ds(datasets, "litdata"), tmp_path / "litdata")
    index = root / "index.json"
    data = json.loads(index.read_text())
    data["chunks"][3]["chunk_size"] += 2
    index.write_text(json.dumps(data))
    exc = first_error(recipe_over(sp_model, root, "litdata"))
    assert isinstance(exc, SourceError), exc
    assert str(root / data["chunks"][3]["filename"]) in str(exc) and "disagrees" in str(exc)


@pytest.mark.timeout(120)
def test_token_ids_outside_the_vocabulary_name_the_file_and_row(sp_model, shards, tmp_path):
    rows = [list(s) for s in shards]
    text, ids = rows[2][3]
    rows[2][3] = (text, ids[:3] + [10 ** 6] + ids[3:])
    write_dataset("parquet", tmp_path / "bad", rows)
    exc = first_error(recipe_over(sp_model, tmp_path / "bad", "parquet", tokens=True), steps=STEPS)
    assert isinstance(exc, SourceError), exc
    msg = str(exc)
    assert str(tmp_path / "bad" / f"{shard_name(2)}.parquet") in msg and "row 3" in msg and "1000000" in msg
    assert "vocabulary" in msg


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fmt,tokens,runner", [("mds", False, "thread"), ("litdata", True, "thread"),
                                               ("vortex", True, "thread"), ("litdata", False, "process")])
def test_workers_and_runners_do_not_change_the_batches(sp_model, datasets, reference, fmt, tokens, runner):
    recipe = recipe_over(sp_model, ds(datasets, fmt), fmt, tokens=tokens)
    world = 1 if runner == "process" else 4  # process runner: one process per worker, each imports torch
    assert global_hashes(recipe, world, STEPS, num_workers=2, runner=runner) == reference


@pytest.mark.timeout(120)
def test_compressed_litdata_chunks(sp_model, datasets, reference):
    """litdata.optimize(compression="zstd"): zstd frames inside each chunk, decoded with litdata's codecs."""
    index = json.loads((ds(datasets, "litdata_zstd") / "index.json").read_text())
    assert index["config"]["compression"] == "zstd"
    assert global_hashes(recipe_over(sp_model, ds(datasets, "litdata_zstd"), "litdata"), 4, STEPS) == reference
    tokens = recipe_over(sp_model, ds(datasets, "litdata_zstd"), "litdata", tokens=True)
    assert global_hashes(tokens, 1, STEPS) == reference


@pytest.mark.timeout(120)
def test_compressed_mds_shards(sp_model, shards, tmp_path, reference):
    """MDSWriter(compression="zstd") keeps only the compressed shards; they are decompressed whole."""
    writer = mds_writer()
    for k, rows in enumerate(shards):
        with writer(out=str(tmp_path / shard_name(k)), columns={"text": "str", "input_ids": "ndarray:int32"},
                    compression="zstd", size_limit=None) as w:
            for text, ids in rows:
                w.write({"text": text, "input_ids": np.asarray(ids, dtype=np.int32)})
    assert sorted(p.name for p in (tmp_path / shard_name(0)).iterdir()) == ["index.json", "shard.00000.mds.zstd"]
    assert global_hashes(recipe_over(sp_model, tmp_path, "mds"), 4, STEPS) == reference
    assert global_hashes(recipe_over(sp_model, tmp_path, "mds", tokens=True), 1, STEPS) == reference


@pytest.mark.timeout(120)
def test_merged_mds_index_lists_the_same_shards(sp_model, datasets, tmp_path, reference):
    """streaming's merge_index writes a root index.json over the parts: the source then lists the shards
    from it alone (no folder walk), the same shards, the same batches."""
    root = _copy(ds(datasets, "mds"), tmp_path / "mds")
    mds_writer()  # loads streaming's modules (without its package __init__ where that fails)
    from streaming.base.util import merge_index

    merge_index([str(p) for p in sorted(root.glob("chunk-*/index.json"))], str(root), keep_local=True)
    merged = json.loads((root / "index.json").read_text())
    assert len(merged["shards"]) == SHARDS and "/" in merged["shards"][0]["raw_data"]["basename"]
    recipe = recipe_over(sp_model, root, "mds")
    plan = WorkPlan(recipe.to_pipeline())
    assert [os.path.relpath(f, root) for f in plan.sources[0].files] == \
        [os.path.relpath(str(p), root) for p in sorted(root.glob("chunk-*/shard.00000.mds"))]
    assert global_hashes(recipe, 4, STEPS, plan=plan) == reference

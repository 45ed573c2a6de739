"""Lance datasets, Arrow IPC files and Hugging Face ``datasets`` folders as sources.

Every dataset is written by its own library (``lance.write_dataset``, ``pyarrow.ipc``, ``datasets``'
``save_to_disk`` and ``load_dataset`` over local files, offline) with the same documents in the same
number of shards and rows per shard as a Parquet reference (one file per shard, one row group each, the
files in shard order), so every format plans the same units; a pipeline over it must give the Parquet
reference's global batches, byte for byte, at every world size and across a resume on another world
size. The same datasets carry a token-id column (made with the pipeline's tokenizer) and an image-bytes
column. A wrong split or config must be an error listing what exists. Bad input (missing columns, wrong
types, corrupt files) is tested in tests/test_sources_errors.py, in-memory sources in
tests/test_sources_memory.py.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

import zephon as z
from zephon import WorkPlan, recipe_from_dict
from zephon.verify import global_hashes

from .conftest import base_recipe_dict
from .test_formats import _missing, raw_tokenizer

def _library(module: str):
    """An optional library, or None: the tests that need it then skip locally and fail in CI (need_libraries)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


lance = _library("lance")
datasets = _library("datasets")


def need_libraries() -> None:
    for module, lib in (("lance", lance), ("datasets", datasets)):
        if lib is None:
            _missing(f"{module} is not installed (python -m pip install -e '.[lance,torchtitan]': pylance; datasets "
                     f"comes with torchtitan)")

SHARDS, ROWS, STEPS = 16, 4, 8  # 16 lanes: units are whole shards in every format


def shard_file(k: int, ext: str) -> str:
    return f"shard-{k:02d}.{ext}"  # sorted listing = shard order (fragments of a Lance dataset are in id order)


def image_bytes(text: str) -> bytes:
    """A stand-in image: a PNG signature (not UTF-8) and bytes that depend on the document."""
    return b"\x89PNG\r\n\x1a\n" + hashlib.sha256(text.encode()).digest()


def shard_table(rows: list[tuple[str, list[int]]]) -> pa.Table:
    return pa.table({"text": [t for t, _ in rows],
                     "input_ids": pa.array([ids for _, ids in rows], pa.list_(pa.int32())),
                     "image": pa.array([image_bytes(t) for t, _ in rows], pa.binary())})


def pipeline(spec: z.read.ReadSpec, tok: z.TokenizerSpec, lanes: int = 16, field: str = "text") -> z.Pipeline:
    """The classic chain of tests/test_formats.py's recipes (flush_every 1), as a builder pipeline."""
    return (z.Pipeline(seed=7, lanes=lanes, flush_every=1).source("docs", spec).tokenize(tok, field)
            .split(max_tokens=64).mix(by="tokens").pack(seq_len=64, algorithm="best_fit", max_open_bins=4)
            .batch(rows_per_lane=2))


def units(pipe: z.Pipeline) -> list[tuple[int, int, int]]:
    return [(u.file, u.start, u.end) for u in WorkPlan(pipe).sources[0].units]


# -- fixtures ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok(sp_model) -> z.TokenizerSpec:
    return z.tokenizer(str(sp_model))


@pytest.fixture(scope="module")
def shards(corpus_texts, sp_model) -> list[list[tuple[str, list[int]]]]:
    texts = corpus_texts[: SHARDS * ROWS]
    flat, offsets = raw_tokenizer(sp_model).encode(texts)
    rows = [(t, flat[a:b].tolist()) for t, a, b in zip(texts, offsets[:-1], offsets[1:])]
    return [rows[k * ROWS:(k + 1) * ROWS] for k in range(SHARDS)]


@pytest.fixture(scope="module")
def data(tmp_path_factory, shards) -> dict[str, Path]:
    """The same shards as Parquet, Lance, Arrow IPC (file and stream format) and a save_to_disk folder."""
    need_libraries()
    root = tmp_path_factory.mktemp("sources")
    tables = [shard_table(rows) for rows in shards]
    out = {fmt: root / fmt for fmt in ("parquet", "arrow", "arrows")}
    for folder in out.values():
        folder.mkdir()
    for k, t in enumerate(tables):
        pq.write_table(t, out["parquet"] / shard_file(k, "parquet"), row_group_size=ROWS)
        with ipc.new_file(out["arrow"] / shard_file(k, "arrow"), t.schema) as w:
            w.write_table(t)
        with ipc.new_stream(out["arrows"] / shard_file(k, "arrows"), t.schema) as w:
            w.write_table(t)
    out["lance"] = root / "docs.lance"
    lance.write_dataset(pa.concat_tables(tables), str(out["lance"]), max_rows_per_file=ROWS)
    fragments = sorted(lance.dataset(str(out["lance"])).get_fragments(), key=lambda f: f.fragment_id)
    assert [f.to_table(columns=["text"]).column(0).to_pylist() for f in fragments] == \
        [[t for t, _ in rows] for rows in shards]  # fragment k holds shard k
    datasets.disable_progress_bars()
    out["hf"] = root / "hf"
    datasets.DatasetDict({"train": datasets.Dataset(pa.concat_tables(tables)),
                          "test": datasets.Dataset(tables[0])}).save_to_disk(str(out["hf"]),
                                                                             num_shards={"train": SHARDS, "test": 1})
    return out


@pytest.fixture(scope="module")
def reference(data, tok) -> list[str]:
    hashes = global_hashes(pipeline(z.read.parquet(str(data["parquet"]), chunk_rows=4), tok), 1, STEPS)
    assert len(set(hashes)) == STEPS
    return hashes


# -- same global batches as Parquet -----------------------------------------------------------------

def spec_of(fmt: str, data: dict[str, Path], **kw) -> z.read.ReadSpec:
    path = str(data[fmt])
    if fmt == "arrows":
        return z.read.arrow(path, chunk_rows=4, **kw)
    return getattr(z.read, fmt)(path, chunk_rows=4, **kw)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["lance", "arrow", "arrows", "hf"])
def test_format_gives_the_parquet_batches_at_every_world_size(data, tok, reference, fmt):
    pipe = pipeline(spec_of(fmt, data), tok)
    plan = pipe.compile().plan
    assert len(plan.sources[0].files) == SHARDS and units(pipe) == [(k, 0, -1) for k in range(SHARDS)]
    assert global_hashes(pipe, 1, STEPS, plan=plan) == reference
    assert global_hashes(pipe, 4, STEPS, plan=plan) == reference
    assert global_hashes(pipe, 4, STEPS, plan=plan, resume_at=3, resume_world_size=16) == reference


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["lance", "arrow", "hf"])
def test_fewer_shards_than_lanes_split_like_parquet_row_groups(data, tok, fmt):
    """32 lanes, 16 shards: each fragment / record batch is cut into the same two row ranges as each
    Parquet file's row group, from metadata."""
    pipe = pipeline(spec_of(fmt, data), tok, lanes=32)
    ref = pipeline(z.read.parquet(str(data["parquet"]), chunk_rows=4), tok, lanes=32)
    assert units(pipe) == units(ref) and len(units(pipe)) == 2 * SHARDS
    expected = global_hashes(ref, 1, 4)
    assert global_hashes(pipe, 1, 4) == expected
    assert global_hashes(pipe, 8, 4) == expected


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["lance", "arrow", "hf"])
def test_pretokenized_columns_give_the_text_batches(data, tok, reference, fmt):
    pipe = pipeline(spec_of(fmt, data, tokens_field="input_ids"), tok, field="input_ids")
    assert global_hashes(pipe, 1, STEPS) == reference
    assert global_hashes(pipe, 4, STEPS) == reference


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt,runner", [("lance", "pool"), ("hf", "pool"), ("lance", "process")])
def test_workers_and_runners_do_not_change_the_batches(data, tok, reference, fmt, runner):
    """Readers rebuilt in worker processes (Lance's native runtime after the fork included)."""
    assert global_hashes(pipeline(spec_of(fmt, data), tok), 1, STEPS, num_workers=2, runner=runner) == reference


def test_columns_by_name_text_token_ids_and_image_bytes(data, shards):
    """columns=[...]: text as strings, a list<int32> column as token ids, a binary column as bytes."""
    for fmt in ("lance", "arrow", "hf"):
        spec = spec_of(fmt, data, columns=["text", "input_ids", "image"])
        source = WorkPlan(z.Pipeline(seed=1, lanes=16).source("docs", spec)).sources[0]
        for k in (0, 9):
            path = source.files[k]
            raw = source.reader.read(path, 1, 3)
            assert raw.columns["text"] == [t for t, _ in shards[k][1:3]], fmt
            ids = raw.columns["input_ids"]
            assert [ids.values[a:b].tolist() for a, b in zip(ids.offsets[:-1], ids.offsets[1:])] == \
                [i for _, i in shards[k][1:3]], fmt
            assert raw.columns["image"] == [image_bytes(t) for t, _ in shards[k][1:3]], fmt
            assert raw.next_cursors.tolist() == [2, 3] and raw.end_cursor == 3


def test_image_bytes_travel_with_their_documents(data, tok):
    pipe = (z.Pipeline(seed=7, lanes=4, flush_every=1)
            .source("docs", z.read.lance(str(data["lance"]), columns=["text", "image"], chunk_rows=4))
            .tokenize(tok).split(max_tokens=64).pack(seq_len=64).batch(rows_per_lane=1))
    loader = pipe.build(rank=0, world_size=1)
    try:
        batch = next(loader)
    finally:
        loader.close()
    images = [img for row in batch["image"] for img in row]
    assert images and all(isinstance(img, bytes) and img.startswith(b"\x89PNG") for img in images)


# -- Lance specifics ---------------------------------------------------------------------------------

def test_lance_planned_from_the_manifest_and_deleted_rows_skipped(data, shards, tmp_path, tok):
    """Rows deleted from a fragment are not planned or read (the manifest's counts); with every data file
    overwritten, planning still works (it reads no data), and reading names the damaged data file."""
    root = tmp_path / "docs.lance"
    shutil.copytree(data["lance"], root)
    ds = lance.dataset(str(root))
    gone = shards[3][1][0]
    ds.delete(f"text = '{gone.replace(chr(39), chr(39) * 2)}'")
    pipe = pipeline(z.read.lance(str(root), chunk_rows=4), tok, lanes=32)
    source = pipe.compile().plan.sources[0]
    sizes = {(u.file, u.start, u.end) for u in source.units if u.file == 3}
    assert sizes == {(3, 0, 1), (3, 1, 3)}  # 3 live rows, cut in two
    path = source.files[3]
    assert path.endswith("#fragment=3")
    assert source.reader.read(path, 0, 3).texts == [shards[3][0][0], shards[3][2][0], shards[3][3][0]]
    for f in (root / "data").iterdir():
        f.write_bytes(b"\0" * 64)
    damaged = pipeline(z.read.lance(str(root), chunk_rows=4), tok, lanes=32)
    plan = damaged.compile().plan  # planning opens the manifest only
    assert units(damaged) == units(pipe)
    with pytest.raises(z.SourceError) as err:
        plan.sources[0].reader.read(plan.sources[0].files[5], 0, 2)
    data_file = lance.dataset(str(root)).get_fragment(5).metadata.files[0].path
    assert data_file in str(err.value) and "fragment 5" in str(err.value) and str(root) in str(err.value)


@pytest.mark.timeout(300)
def test_lance_and_arrow_in_an_object_store(data, tok, reference, tmp_path):
    """The datasets in S3 (moto's server): Lance opens its dataset with its own client, given the source's
    s3fs-style storage_options; Arrow IPC files (file and stream format) are read through fsspec."""
    from .stores import start_moto

    server, store = start_moto(tmp_path)
    try:
        store.upload_dir(data["lance"], "lance/docs.lance")
        spec = z.read.lance(store.url("lance/docs.lance"), chunk_rows=4,
                            storage_options={**store.storage_options, "client_kwargs": {"region_name": "us-east-1"}})
        pipe = pipeline(spec, tok)
        assert pipe.compile().plan.sources[0].files[0] == store.url("lance/docs.lance") + "#fragment=0"
        assert global_hashes(pipe, 4, STEPS) == reference
        for fmt in ("arrow", "arrows"):
            store.upload_dir(data[fmt], fmt)
            remote = pipeline(z.read.arrow(store.url(fmt), chunk_rows=4, storage_options=store.storage_options), tok)
            assert global_hashes(remote, 4, STEPS) == reference, fmt
    finally:
        server.stop()


# -- Hugging Face datasets folders ------------------------------------------------------------------

def test_hf_save_to_disk_splits(data, shards):
    train = WorkPlan(z.Pipeline(seed=1, lanes=16).source("d", z.read.hf(str(data["hf"])))).sources[0]
    assert [os.path.basename(f) for f in train.files] == [f"data-{k:05d}-of-00016.arrow" for k in range(SHARDS)]
    test = WorkPlan(z.Pipeline(seed=1, lanes=1).source("d", z.read.hf(str(data["hf"]), split="test"))).sources[0]
    assert test.files == [str(data["hf"] / "test" / "data-00000-of-00001.arrow")]
    assert test.reader.read(test.files[0], 0, -1).texts == [t for t, _ in shards[0]]
    single = WorkPlan(z.Pipeline(seed=1, lanes=1).source("d", z.read.hf(str(data["hf"] / "test"), split="test")))
    assert single.sources[0].files == test.files


def _write_datasets_cache(parquet_dir: Path, cache: Path) -> None:
    """``datasets.load_dataset("parquet", ...)`` over local files, offline, in a child process."""
    script = textwrap.dedent("""
        import sys, datasets
        datasets.disable_progress_bars()
        files = sorted(sys.argv[1:-1])
        datasets.load_dataset("parquet", data_files={"train": files[1:], "test": files[:1]}, cache_dir=sys.argv[-1])
    """)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache.parent / "home")}
    run = subprocess.run([sys.executable, "-c", script, *map(str, sorted(parquet_dir.glob("*.parquet"))), str(cache)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]


def parquet_like(arrow_files: list[str], out: Path) -> None:
    """Parquet files holding the same rows as ``arrow_files`` with one row group per record batch."""
    out.mkdir()
    for i, path in enumerate(arrow_files):
        with ipc.open_stream(pa.memory_map(path)) as reader:
            batches = list(reader)
        with pq.ParquetWriter(out / f"{i:03d}.parquet", batches[0].schema) as writer:
            for b in batches:
                writer.write_batch(b)


@pytest.mark.timeout(300)
def test_hf_datasets_cache_folder(data, tok, tmp_path):
    cache = tmp_path / "cache"
    _write_datasets_cache(data["parquet"], cache)
    spec = z.read.hf(str(cache), config="default", chunk_rows=4)
    pipe = pipeline(spec, tok)
    files = pipe.compile().plan.sources[0].files
    assert files and all(os.path.basename(f).startswith("parquet-train") and f.endswith(".arrow") for f in files)
    parquet_like(files, tmp_path / "same")
    ref = pipeline(z.read.parquet(str(tmp_path / "same"), chunk_rows=4), tok)
    assert units(pipe) == units(ref)
    expected = global_hashes(ref, 1, 4)
    assert global_hashes(pipe, 1, 4) == expected and global_hashes(pipe, 4, 4) == expected
    test = WorkPlan(z.Pipeline(seed=1, lanes=1).source("d", z.read.hf(str(cache), split="test"))).sources[0]
    assert len(test.files) == 1 and "parquet-test" in test.files[0]
    with pytest.raises(z.SourceError, match=r"no config 'en' .*default.*Set config"):
        WorkPlan(z.Pipeline(seed=1, lanes=1).source("d", z.read.hf(str(cache), config="en")))
    with pytest.raises(z.SourceError, match=r"no files of split 'validation'.*test, train.*Set split"):
        WorkPlan(z.Pipeline(seed=1, lanes=1).source("d", z.read.hf(str(cache), split="validation")))


def _hub_repo(root: Path, files: dict[str, bytes]) -> Path:
    """A Hub cache folder as huggingface_hub lays one out: blobs by hash, a snapshot of symlinks, refs/main."""
    repo = root / "datasets--acme--docs"
    revision = hashlib.sha1("\n".join(sorted(files)).encode()).hexdigest()
    for name, content in files.items():
        blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        link = repo / "snapshots" / revision / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return repo


@pytest.mark.timeout(300)
def test_hf_hub_cache_folder(data, tok, reference, tmp_path):
    from huggingface_hub import scan_cache_dir

    shards_bytes = {f"data/train-{k:05d}-of-00016.parquet": (data["parquet"] / shard_file(k, "parquet")).read_bytes()
                    for k in range(SHARDS)}
    shards_bytes["data/test-00000-of-00001.parquet"] = shards_bytes["data/train-00003-of-00016.parquet"]
    repo = _hub_repo(tmp_path / "hub", shards_bytes)
    info = scan_cache_dir(tmp_path / "hub")  # huggingface_hub itself recognises the layout
    assert [r.repo_id for r in info.repos] == ["acme/docs"] and not info.warnings
    pipe = pipeline(z.read.hf(str(repo), chunk_rows=4), tok)
    assert len(pipe.compile().plan.sources[0].files) == SHARDS
    assert global_hashes(pipe, 4, STEPS) == reference
    test = WorkPlan(z.Pipeline(seed=1, lanes=1).source("d", z.read.hf(str(repo), split="test"))).sources[0]
    assert [os.path.basename(f) for f in test.files] == ["test-00000-of-00001.parquet"]


_OFFLINE = textwrap.dedent("""
    import socket, sys

    def refuse(*args, **kwargs):
        raise RuntimeError("zephon tried to use the network")

    socket.socket.connect = socket.socket.connect_ex = socket.create_connection = refuse

    class Blocked:  # the loading libraries that could fetch: never imported to read a folder
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("datasets", "huggingface_hub"):
                raise ImportError(f"{name} must not be imported")

    sys.meta_path.insert(0, Blocked())
    import zephon as z

    tok = z.tokenizer(sys.argv[1])
    for path in sys.argv[2:]:
        pipe = (z.Pipeline(seed=1, lanes=4).source("d", z.read.hf(path)).tokenize(tok).pack(seq_len=64)
                .batch(rows_per_lane=1))
        loader = pipe.build()
        assert next(loader)["input_ids"].shape == (4, 64)
        loader.close()
    print("read offline")
""")


def test_hf_folders_are_read_without_network_or_datasets(data, sp_model, tmp_path):
    repo = _hub_repo(tmp_path / "hub", {"data/train-00000-of-00001.parquet":
                                        (data["parquet"] / shard_file(0, "parquet")).read_bytes()})
    run = subprocess.run([sys.executable, "-c", _OFFLINE, str(sp_model), str(data["hf"]), str(repo)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0 and "read offline" in run.stdout, run.stderr[-3000:]


def test_hf_hub_cache_configs(data, tmp_path):
    """Files of a split under several config folders (the Hub's parquet layout): config picks one."""
    one = (data["parquet"] / shard_file(0, "parquet")).read_bytes()
    two = (data["parquet"] / shard_file(1, "parquet")).read_bytes()
    repo = _hub_repo(tmp_path / "hub", {"en/train/0000.parquet": one, "fr/train/0000.parquet": two,
                                        "fr/test/0000.parquet": one})
    snapshot = next((repo / "snapshots").iterdir())

    def files(**kw) -> list[str]:
        plan = WorkPlan(z.Pipeline(seed=1, lanes=1).source("d", z.read.hf(**kw)))
        return [os.path.relpath(f, snapshot) for f in plan.sources[0].files]

    assert files(path=str(repo), config="fr") == ["fr/train/0000.parquet"]
    assert files(path=str(snapshot), config="en") == ["en/train/0000.parquet"]
    assert files(path=str(repo), config="fr", split="test") == ["fr/test/0000.parquet"]
    with pytest.raises(z.SourceError, match=r"several folders \(en, fr\): set config"):
        files(path=str(repo))
    with pytest.raises(z.SourceError, match=r"no folder for config 'de' .*en, fr"):
        files(path=str(repo), config="de")


# -- recipes -------------------------------------------------------------------------------------------

def recipe_dict(sp_model, source: dict) -> dict:
    data = base_recipe_dict(Path("."), {"kind": "sentencepiece", "path": str(sp_model)})
    data["sources"] = [{"name": "docs", **source}]
    data["flush_every"] = 1
    return data


def test_recipes_name_the_new_formats_split_and_config(data, sp_model, tok, tmp_path):
    recipe = recipe_from_dict(recipe_dict(sp_model, {"path": str(data["hf"]), "format": "hf", "split": "test"}))
    assert recipe.sources[0].split == "test"
    plan = WorkPlan(recipe.to_pipeline())
    assert plan.sources[0].files == [str(data["hf"] / "test" / "data-00000-of-00001.arrow")]
    # the builder's spelling is the same graph (split "train" written or not)
    train = recipe_from_dict(recipe_dict(sp_model, {"path": str(data["hf"]), "format": "hf"}))
    assert train.to_pipeline().fingerprint == pipeline(z.read.hf(str(data["hf"]), chunk_rows=4), tok).fingerprint
    assert train.to_pipeline().fingerprint != recipe.to_pipeline().fingerprint
    lance_recipe = recipe_from_dict(recipe_dict(sp_model, {"path": str(data["lance"]), "format": "lance",
                                                           "tokens_field": "input_ids"}))
    assert len(WorkPlan(lance_recipe.to_pipeline()).sources[0].units) == SHARDS
    text = pipeline(z.read.hf(str(data["hf"]), split="test", chunk_rows=4), tok).to_recipe()
    assert 'split = "test"' in text and 'format = "hf"' in text
    (tmp_path / "r.toml").write_text(text)
    assert z.load_recipe(tmp_path / "r.toml").to_pipeline().fingerprint == \
        pipeline(z.read.hf(str(data["hf"]), split="test", chunk_rows=4), tok).fingerprint


@pytest.mark.parametrize("source,message", [
    ({"format": "hf", "split": 3}, r"'split' must be a non-empty string, got 3 \(an integer\)"),
    ({"format": "hf", "config": ""}, r"'config' must be a non-empty string"),
    ({"format": "parquet", "split": "train"}, r"'split' applies to format = \"hf\""),
    ({"format": "lance", "config": "en"}, r"'config' applies to format = \"hf\""),
    ({"format": "feather"}, r"format 'feather' is not one of .*lance, arrow, hf"),
])
def test_recipe_keys_are_checked(sp_model, source, message):
    with pytest.raises(z.RecipeError, match=message):
        recipe_from_dict(recipe_dict(sp_model, {"path": "x", **source}))


def test_inspect_names_rows(data, sp_model, tmp_path):
    from zephon.cli import inspect_plan

    (tmp_path / "r.toml").write_text(textwrap.dedent(f"""
        seed = 1
        lanes = 4
        seq_len = 64
        [tokenizer]
        kind = "sentencepiece"
        path = "{sp_model}"
        [[sources]]
        name = "docs"
        path = "{data['lance']}"
        format = "lance"
    """))
    info = inspect_plan(str(tmp_path / "r.toml"), lanes_shown=1, units_shown=2)
    first = info["lanes_shown"][0]["units"]["docs"]
    assert [u["unit"] for u in first] == ["rows", "rows"] and first[0]["file"].startswith("docs.lance#fragment=")
    assert np.isclose(info["sources"][0]["units_per_lane"], SHARDS / 4)

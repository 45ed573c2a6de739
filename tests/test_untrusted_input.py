"""Untrusted input: data files, index files and the node-local block cache.

A dataset is written by someone else and a shared cache folder may be written by anyone on the node, so:

- nothing in a LitData or MDS dataset is ever unpickled or handed to a codec: a field stored as ``pickle``
  (LitData) or ``pkl`` (MDS) is refused from ``index.json`` alone, before a byte of a chunk is read, and
  its payload (which creates a marker file when unpickled; the libraries' own readers do run it) never
  runs; a LitData ``data_spec`` never makes Zephon import a module; the other leaves of an item may hold
  such payloads without making the dataset unreadable;
- the array layouts Zephon decodes itself (LitData ``numpy``, ``tensor``, ``json``) give the ids that were
  written, and a header that disagrees with its bytes is a SourceError naming the chunk and sample;
- index entries cannot point outside the dataset's folder or claim impossible counts;
- eviction never follows a symbolic link out of the cache, and a tampered or swapped cache block is
  detected by its checksum, counted, fetched again from the store (a real S3 server, moto) and never used.

Every dataset is written by its format's own writer (``litdata.optimize``, mosaicml-streaming's
``MDSWriter``), then edited where a test needs a hostile index.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import fsspec
import numpy as np
import pytest

from zephon import SourceError, WorkPlan, build_loader, global_digest, recipe_from_dict, storage
from zephon.readers.litdata import LitDataReader
from zephon.specs import SourceSpec, StorageSpec

from .conftest import base_recipe_dict
from .stores import start_moto
from .test_formats import mds_writer, need

ROWS, CHUNK = 8, 4  # documents, and documents per LitData chunk / MDS shard


def ids_of(i: int) -> list[int]:
    """The token ids stored for document ``i`` (small: inside any test vocabulary)."""
    return [(i * 7 + j) % 50 + 3 for j in range(3 + i % 4)]


def text_of(i: int) -> str:
    return f"document number {i} says hello to the untrusted world"


class _Boom:
    """A pickle payload: unpickling it creates the file ``path`` (and nothing worse)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


# -- LitData ------------------------------------------------------------------------------------------

_LITDATA_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np, torch
    import litdata
    from litdata.streaming.serializers import JsonLeaf

    OUT, MARKER, ROWS, CHUNK = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

    class Boom:
        def __reduce__(self):
            return (open, (MARKER, "w"))

    def ids_of(i):
        return [(i * 7 + j) % 50 + 3 for j in range(3 + i % 4)]

    def item(i):
        ids = ids_of(i)
        return {"text": f"document number {i} says hello to the untrusted world",
                "raw": np.asarray(ids, np.int32), "grid": np.asarray([ids, ids[::-1]], np.int64),
                "traw": torch.tensor(ids, dtype=torch.int32), "tgrid": torch.tensor([ids, ids], dtype=torch.int16),
                "js": JsonLeaf(ids), "payload": Boom()}

    if __name__ == "__main__":
        litdata.optimize(fn=item, inputs=list(range(ROWS)), output_dir=OUT, chunk_size=CHUNK, num_workers=1,
                         mode="overwrite", start_method="fork", keep_data_ordered=True)
        assert not os.path.exists(MARKER)
        # The control: litdata's own reader runs the payload.
        litdata.StreamingDataset(OUT)[0]
        assert os.path.exists(MARKER), "the payload did not run under litdata's own reader"
        os.remove(MARKER)
""")

FORMATS = {"text": "str", "raw": "no_header_numpy:2", "grid": "numpy", "traw": "no_header_tensor:16",
           "tgrid": "tensor", "js": "json", "payload": "pickle"}


@pytest.fixture(scope="module")
def litdata_ds(tmp_path_factory) -> tuple[Path, Path]:
    """(dataset folder, marker file): a LitData dataset with a leaf of every layout and a pickle payload."""
    need("litdata")
    work = tmp_path_factory.mktemp("litdata")
    out, marker = work / "ds", work / "marker"
    (work / "write.py").write_text(_LITDATA_SCRIPT)
    run = subprocess.run([sys.executable, str(work / "write.py"), str(out), str(marker), str(ROWS), str(CHUNK)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 0, run.stderr[-3000:]
    config = json.loads((out / "index.json").read_text())["config"]
    assert config["data_format"] == list(FORMATS.values()) and config["item_loader"] == "PyTreeLoader"
    return out, marker


def recipe_for(sp_model, path: Path, fmt: str, field: str, tokens: bool = False):
    source = {"name": "docs", "path": str(path), "format": fmt, ("tokens_field" if tokens else "text_field"): field}
    data = base_recipe_dict(Path("."), {"kind": "sentencepiece", "path": str(sp_model)})
    data["sources"] = [source]
    data["flush_every"] = 1
    return recipe_from_dict(data)


def first_error(recipe, steps: int = 6) -> BaseException | None:
    """The error of building rank 0 of 1 and taking ``steps`` batches, or None."""
    try:
        loader = build_loader(recipe, rank=0, world_size=1)
    except Exception as exc:  # noqa: BLE001 - checked by the caller
        return exc
    try:
        for _ in range(steps):
            next(loader)
    except Exception as exc:  # noqa: BLE001
        return exc
    finally:
        loader.close()
    return None


def litdata_rows(path: Path, field: str, tokens: bool):
    """Every document of field ``field``, read by Zephon's LitData reader (texts, or lists of ids)."""
    fs = fsspec.filesystem("file")
    reader = LitDataReader(fs, "docs", field, tokens, chunk_rows=64)
    out = []
    for shard in LitDataReader.list_shards(fs, str(path), "docs", str(path), "test"):
        chunk = reader.read(shard, 0, -1)
        if not tokens:
            out += chunk.texts
            continue
        t = chunk.tokens
        out += [t.values[a:b].tolist() for a, b in zip(t.offsets[:-1], t.offsets[1:])]
    return out


def edit_index(root: Path, change) -> Path:
    index = root / "index.json"
    data = json.loads(index.read_text())
    change(data)
    index.write_text(json.dumps(data))
    return index


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tokens", [False, True])
def test_litdata_pickle_field_is_refused_from_the_index_and_never_unpickled(sp_model, litdata_ds, tmp_path, tokens):
    ds, marker = litdata_ds
    exc = first_error(recipe_for(sp_model, ds, "litdata", "payload", tokens))
    assert not marker.exists()
    assert isinstance(exc, SourceError), exc
    msg = str(exc)
    assert str(ds / "index.json") in msg and "'payload'" in msg and "'pickle'" in msg, msg
    assert "str, text, json" in msg and "no_header_numpy" in msg, msg  # what zephon accepts
    # From the index alone: without a single chunk file, the refusal is the same (not "missing").
    bare = shutil.copytree(ds, tmp_path / "bare")
    for chunk in bare.glob("*.bin"):
        chunk.unlink()
    exc = first_error(recipe_for(sp_model, bare, "litdata", "payload", tokens))
    assert isinstance(exc, SourceError) and "'pickle'" in str(exc) and "missing" not in str(exc), exc
    # The payload beside another field is skipped, never decoded: the dataset stays readable.
    assert first_error(recipe_for(sp_model, ds, "litdata", "raw" if tokens else "text", tokens)) is None
    assert litdata_rows(ds, "text", False) == [text_of(i) for i in range(ROWS)]
    assert not marker.exists()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fmt", ["json:pickle", "numpy:pickle", "graph:pickle", "graph", "image:jpg", "pil"])
def test_litdata_format_with_a_suffix_or_a_codec_is_refused(sp_model, litdata_ds, tmp_path, fmt):
    """litdata's serializer table is looked up by the suffix too ('json:pickle' reaches the pickle one)."""
    ds, marker = litdata_ds
    root = shutil.copytree(ds, tmp_path / "ds")
    index = edit_index(root, lambda d: d["config"]["data_format"].__setitem__(6, fmt))
    for tokens in (False, True):
        exc = first_error(recipe_for(sp_model, root, "litdata", "payload", tokens))
        assert not marker.exists()
        assert isinstance(exc, SourceError) and str(index) in str(exc) and f"'{fmt}'" in str(exc), exc


@pytest.mark.timeout(240)
def test_litdata_data_spec_never_imports_a_module(sp_model, litdata_ds, tmp_path, monkeypatch):
    """litdata's pytree loader imports the module a 'collections.defaultdict' node names; zephon parses
    the spec itself, so a module planted on the path is never imported."""
    ds, _ = litdata_ds
    root = shutil.copytree(ds, tmp_path / "ds")
    module, probe = f"zephon_probe_{os.getpid()}", tmp_path / "imported"
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / f"{module}.py").write_text(f"open({str(probe)!r}, 'w').close()\nfactory = dict\n")
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    monkeypatch.delitem(sys.modules, module, raising=False)

    def to_defaultdict(data: dict) -> None:
        version, spec = json.loads(data["config"]["data_spec"])
        spec["type"] = "collections.defaultdict"
        spec["context"] = {"default_factory_module": module, "default_factory_name": "factory",
                           "dict_context": json.loads(spec["context"])}
        data["config"]["data_spec"] = json.dumps([version, spec])
    edit_index(root, to_defaultdict)
    assert litdata_rows(root, "text", False) == [text_of(i) for i in range(ROWS)]
    assert first_error(recipe_for(sp_model, root, "litdata", "text")) is None
    assert not probe.exists() and module not in sys.modules


def _leaf_range(chunk: bytes, sample: int, leaf: int, leaves: int) -> tuple[int, int]:
    """Byte range of one leaf of one item of a PyTreeLoader chunk (uint32 n | offsets | items)."""
    offsets = np.frombuffer(chunk[4:4 + 4 * (int(np.frombuffer(chunk[:4], "<u4")[0]) + 1)], "<u4")
    start = int(offsets[sample])
    sizes = np.frombuffer(chunk[start:start + 4 * leaves], "<u4").astype(int)
    a = start + 4 * leaves + int(sizes[:leaf].sum())
    return a, a + int(sizes[leaf])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("field,corrupt", [
    ("grid", "shape"), ("grid", "dtype"), ("tgrid", "shape"), ("js", "count")])
def test_litdata_array_layouts_decoded_by_zephon_and_checked(litdata_ds, tmp_path, field, corrupt):
    """numpy / tensor / json leaves give the ids written (read flat); a header that disagrees with its
    bytes is a SourceError naming the chunk and the sample, never an exception from a deserializer or a
    silently shorter row."""
    ds, marker = litdata_ds
    expect = {"raw": ids_of, "traw": ids_of, "js": ids_of, "grid": lambda i: ids_of(i) + ids_of(i)[::-1],
              "tgrid": lambda i: ids_of(i) * 2}
    for name, want in expect.items():
        assert litdata_rows(ds, name, True) == [want(i) for i in range(ROWS)], name
    root = shutil.copytree(ds, tmp_path / "ds")
    chunk_path = sorted(root.glob("*.bin"))[1]
    chunk = bytearray(chunk_path.read_bytes())
    a, _ = _leaf_range(bytes(chunk), 2, list(FORMATS).index(field), len(FORMATS))
    if corrupt == "shape":  # first dimension + 1 (numpy: little-endian header, tensor: big-endian)
        order = "<u4" if field == "grid" else ">u4"
        dim = int(np.frombuffer(bytes(chunk[a + 8:a + 12]), order)[0])
        chunk[a + 8:a + 12] = np.asarray([dim + 1], order).tobytes()
    elif corrupt == "dtype":  # litdata's numpy dtype 14 is 'object'
        chunk[a:a + 4] = np.asarray([14], "<u4").tobytes()
    else:  # litdata's compact int64 list: tag 2 | uint32 count | values
        assert chunk[a] == 2
        count = int(np.frombuffer(bytes(chunk[a + 1:a + 5]), "<u4")[0])
        chunk[a + 1:a + 5] = np.asarray([count - 1], "<u4").tobytes()
    chunk_path.write_bytes(bytes(chunk))
    with pytest.raises(SourceError) as info:
        litdata_rows(root, field, True)
    msg = str(info.value)  # samples are numbered within their chunk
    assert str(chunk_path) in msg and "sample 2" in msg and f"'{field}'" in msg, msg
    assert not marker.exists()


# -- MDS ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mds_ds(tmp_path_factory) -> tuple[Path, Path]:
    """(dataset folder, marker file): MDS shards with a 'pkl' column whose payload creates the marker."""
    writer = mds_writer()
    work = tmp_path_factory.mktemp("mds")
    out, marker = work / "ds", work / "marker"
    with writer(out=str(out), columns={"text": "str", "input_ids": "ndarray:int32", "payload": "pkl"},
                size_limit=None) as w:
        for i in range(ROWS):
            w.write({"text": text_of(i), "input_ids": np.asarray(ids_of(i), np.int32), "payload": _Boom(str(marker))})
    # The control: the library's own decoder runs the payload.
    from streaming.base.format.mds.encodings import mds_decode

    shard = (out / "shard.00000.mds").read_bytes()
    names = json.loads((out / "index.json").read_text())["shards"][0]["column_names"]
    a, b = _mds_column(shard, 0, names.index("payload"))
    mds_decode("pkl", shard[a:b])
    assert marker.exists()
    marker.unlink()
    return out, marker


def _mds_column(shard: bytes, sample: int, col: int) -> tuple[int, int]:
    """Byte range of column ``col`` of a sample of an MDS shard whose three columns are all variable-size
    (str, pkl, and ndarray:int32 without a fixed shape)."""
    n = int(np.frombuffer(shard[:4], "<u4")[0])
    start = int(np.frombuffer(shard[4:4 + 4 * (n + 1)], "<u4")[sample])
    sizes = np.frombuffer(shard[start:start + 12], "<u4").astype(int)
    a = start + 12 + int(sizes[:col].sum())
    return a, a + int(sizes[col])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tokens", [False, True])
def test_mds_pkl_field_is_refused_from_the_index_and_never_unpickled(sp_model, mds_ds, tmp_path, tokens):
    ds, marker = mds_ds
    bare = shutil.copytree(ds, tmp_path / "bare")
    (bare / "shard.00000.mds").unlink()  # the refusal needs only the index
    for root in (ds, bare):
        exc = first_error(recipe_for(sp_model, root, "mds", "payload", tokens))
        assert isinstance(exc, SourceError), exc
        msg = str(exc)
        assert str(root / "index.json") in msg and "'payload'" in msg and "'pkl'" in msg, msg
        assert "missing" not in msg, msg
    assert first_error(recipe_for(sp_model, ds, "mds", "text")) is None
    assert first_error(recipe_for(sp_model, ds, "mds", "input_ids", tokens=True)) is None
    assert not marker.exists()


@pytest.mark.timeout(240)
def test_mds_ndarray_dtype_is_one_the_writer_knows(sp_model, mds_ds, tmp_path):
    ds, _ = mds_ds
    root = shutil.copytree(ds, tmp_path / "ds")
    def change(d: dict) -> None:
        shard = d["shards"][0]
        shard["column_encodings"][shard["column_names"].index("input_ids")] = "ndarray:not-a-dtype"
    index = edit_index(root, change)
    exc = first_error(recipe_for(sp_model, root, "mds", "input_ids", tokens=True))
    assert isinstance(exc, SourceError), exc
    assert str(index) in str(exc) and "'input_ids'" in str(exc) and "int32" in str(exc), exc


def _mds_edit(what: str):
    def change(d: dict) -> None:
        shard = d["shards"][0]
        if what == "outside":
            shard["raw_data"]["basename"] = "../outside/shard.00000.mds"
        elif what == "absolute":
            shard["raw_data"]["basename"] = "/etc/hostname"
        elif what == "samples":
            shard["samples"] = 10 ** 12
        else:
            shard["column_sizes"][shard["column_names"].index("text")] = -8
    return change


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt,what", [("mds", "outside"), ("mds", "absolute"), ("mds", "samples"),
                                      ("mds", "sizes"), ("litdata", "outside"), ("litdata", "samples")])
def test_hostile_index_entries_are_refused_when_planning(sp_model, mds_ds, litdata_ds, tmp_path, fmt, what):
    """A shard name cannot leave the dataset's folder (a copy of a real shard waits outside it), and a
    count that no shard can hold is refused before a lane would plan its chunks."""
    ds = (mds_ds if fmt == "mds" else litdata_ds)[0]
    root = shutil.copytree(ds, tmp_path / "ds")
    (tmp_path / "outside").mkdir()
    for f in [*root.glob("*.mds"), *root.glob("*.bin")]:
        shutil.copy(f, tmp_path / "outside" / f.name)
    if fmt == "mds":
        index = edit_index(root, _mds_edit(what))
    else:
        key, value = ("filename", "../outside/chunk-0-0.bin") if what == "outside" else ("chunk_size", 10 ** 12)
        index = edit_index(root, lambda d: d["chunks"][0].__setitem__(key, value))
    with pytest.raises(SourceError) as info:
        WorkPlan(recipe_for(sp_model, root, fmt, "text").to_pipeline())
    assert str(index) in str(info.value), info.value


# -- the node-local block cache -----------------------------------------------------------------------

def _outside(tmp_path: Path) -> dict[Path, bytes]:
    """A folder outside the cache with files named like blocks, and their contents."""
    folder = tmp_path / "precious"
    folder.mkdir()
    files = {folder / f"{'ab' * 20}.{k}": bytes([k]) * 5000 for k in range(3)}
    files[folder / "thesis.tex"] = b"\\documentclass{article}" * 300
    for path, data in files.items():
        path.write_bytes(data)
    return files


def test_eviction_never_follows_a_symlink_out_of_the_cache(tmp_path):
    files = _outside(tmp_path)
    cache = storage.BlockCache(str(tmp_path / "cache"), max_bytes=1 << 20)
    key = "cd" * 20
    for b in range(4):
        cache.put(key, b, bytes([b]) * 4000)
    (cache.root / "ab").symlink_to(tmp_path / "precious", target_is_directory=True)  # a linked block folder
    os.symlink(tmp_path / "precious" / "thesis.tex", cache.root / "cd" / f"{key}.9")  # a linked block file
    before = storage.stats()["cache_evictions"]
    cache.max_bytes = 0
    assert cache.evict() == 0
    assert storage.stats()["cache_evictions"] - before == 4  # the four real blocks, nothing else
    assert all(cache.get(key, b, 4000) is None for b in range(4))
    assert {p: p.read_bytes() for p in files} == files
    assert cache.get(key, 9, 5000) is None  # a linked file is never read as a block either
    # The cache folder itself swapped for a link to the outside folder: nothing there is touched.
    shutil.rmtree(cache.root)
    (tmp_path / "precious" / "ab").mkdir()
    shutil.copy(tmp_path / "precious" / "thesis.tex", tmp_path / "precious" / "ab" / f"{'ab' * 20}.7")
    cache.root.symlink_to(tmp_path / "precious", target_is_directory=True)
    cache.evict()
    assert {p: p.read_bytes() for p in files} == files and (tmp_path / "precious" / "ab" / f"{'ab' * 20}.7").exists()


@pytest.fixture(scope="module")
def s3(tmp_path_factory, corpus):
    server, store = start_moto(tmp_path_factory.mktemp("moto"))
    store.upload_dir(corpus / "web", "corpus/web")
    store.upload_dir(corpus / "code", "corpus/code")
    yield store
    server.stop()


def _store_recipe(corpus, sp_model, store, cache_dir: Path | None):
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    if store is not None:
        web, code = data["sources"]
        web["path"], code["path"] = store.url("corpus/web"), store.url("corpus/code/*.jsonl")
        for s in data["sources"]:
            s["storage_options"] = dict(store.storage_options)
        data["storage"] = {"retries": 4, "retry_backoff_s": 0.001, "cache_dir": str(cache_dir),
                           "cache_block_bytes": 16 << 10}
    return recipe_from_dict(data)


def _digests(recipe, world: int, steps: int) -> list[str]:
    plan = WorkPlan(recipe.to_pipeline())
    loaders = [build_loader(recipe, rank=r, world_size=world, plan=plan) for r in range(world)]
    try:
        return [global_digest([next(ld) for ld in loaders]) for _ in range(steps)]
    finally:
        for ld in loaders:
            ld.close()


def _blocks(cache_dir: Path) -> list[Path]:
    """The block files of a cache folder (any layout version)."""
    return sorted(p for p in cache_dir.glob("zephon-blocks-*/*/*") if p.is_file() and ".tmp-" not in p.name)


@pytest.mark.timeout(240)
def test_tampered_cache_blocks_are_refetched_and_never_used(s3, corpus, sp_model, tmp_path):
    steps = 5
    reference = _digests(_store_recipe(corpus, sp_model, None, None), 1, steps)
    recipe = _store_recipe(corpus, sp_model, s3, tmp_path / "cache")
    assert _digests(recipe, 2, steps) == reference  # cold: fills the cache
    blocks = _blocks(tmp_path / "cache")
    assert len(blocks) > 4
    tampered = {}
    for path in blocks:  # the same size, one byte of the data flipped
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        tampered[path] = bytes(raw)
        path.write_bytes(tampered[path])
    before = storage.stats()
    assert _digests(recipe, 1, steps) == reference
    mid = storage.stats()
    # How far lanes read ahead varies with timing: count the blocks this run read (and so replaced).
    repaired = [p for p, raw in tampered.items() if p.read_bytes() != raw]
    assert repaired
    assert mid["cache_corrupt"] - before["cache_corrupt"] >= len(repaired)
    header = 40  # each block file: 8 bytes of magic, a 32-byte checksum, the data
    assert mid["bytes_fetched"] - before["bytes_fetched"] >= sum(len(tampered[p]) - header for p in repaired)
    assert _digests(recipe, 4, steps) == reference
    after = storage.stats()
    assert after["cache_corrupt"] - mid["cache_corrupt"] <= len(blocks) - len(repaired)
    assert after["cache_hits"] > mid["cache_hits"]


@pytest.mark.timeout(120)
def test_swapped_truncated_or_flipped_block_is_detected_by_its_checksum(s3, tmp_path):
    """Bytes read through the cache are the object's bytes, whatever was done to the block files: a valid
    block copied under another block's name, a truncated block and a flipped byte are each counted once."""
    block = 16 << 10
    data = np.random.default_rng(5).bytes(5 * block + 123)
    url = s3.put_bytes("blobs/one.bin", data)
    spec = SourceSpec(name="blobs", path=(url,), format="parquet", storage_options=dict(s3.storage_options))
    fs, _ = storage.url_to_fs(url, spec, StorageSpec(cache_dir=str(tmp_path / "c"), cache_block_bytes=block,
                                                     retries=2, retry_backoff_s=0.001))
    assert fs.cat_file(url) == data
    files = {int(p.name.rsplit(".", 1)[1]): p for p in _blocks(tmp_path / "c")}
    assert sorted(files) == list(range(6))
    shutil.copy(files[0], files[1])  # a good block under another name
    files[3].write_bytes(files[3].read_bytes()[:-10])
    raw = bytearray(files[4].read_bytes())
    raw[100] ^= 1
    files[4].write_bytes(bytes(raw))
    before = storage.stats()
    assert fs.cat_file(url) == data
    assert fs.cat_file(url, start=block - 5, end=4 * block + 7) == data[block - 5:4 * block + 7]
    after = storage.stats()
    assert after["cache_corrupt"] - before["cache_corrupt"] == 3
    assert after["bytes_fetched"] - before["bytes_fetched"] == 3 * block

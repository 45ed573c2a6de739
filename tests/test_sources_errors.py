"""Bad input for Lance, Arrow IPC, Hugging Face and in-memory sources: every error names the file (or the
dataset and fragment, or the JSON file of a datasets folder), the field and the fix, and a corrupt file is
an error, never a crash or wrong data. The datasets are tests/test_sources.py's (written by each format's
own library)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

import zephon as z
from zephon import WorkPlan

from .optional import require
from .test_sources import ROWS, data, pipeline, shards, spec_of, tok  # noqa: F401 - fixtures

FORMATS = ["lance", "arrow", "arrows", "hf", "memory"]


def first_error(pipe: z.Pipeline, steps: int = 12) -> BaseException | None:
    try:
        loader = pipe.build(rank=0, world_size=1)
        try:
            for _ in range(steps):
                next(loader)
        finally:
            loader.close()
    except Exception as exc:  # noqa: BLE001 - checked by the caller
        return exc
    return None


def any_spec(fmt: str, data: dict[str, Path], shards, **kw) -> z.read.ReadSpec:
    if fmt == "memory":
        rows = [r for s in shards for r in s]
        table = pa.table({"text": [t for t, _ in rows],
                          "input_ids": pa.array([i for _, i in rows], pa.list_(pa.int32()))})
        return z.read.table(table, chunk_rows=4, **kw)
    return spec_of(fmt, data, **kw)


def names_a_file(fmt: str, msg: str, data: dict[str, Path]) -> bool:
    if fmt == "lance":
        return f"Lance dataset {data['lance']}, fragment " in msg
    if fmt == "memory":
        return "<in-memory table " in msg
    folder = data[fmt]
    return any(str(p) in msg for p in folder.rglob("*.arrow*"))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", [False, True])
def test_missing_column_names_the_file_the_columns_and_the_fix(data, shards, tok, fmt, tokens):
    spec = any_spec(fmt, data, shards, **({"tokens_field": "body"} if tokens else {"text_field": "body"}))
    exc = first_error(pipeline(spec, tok, field="body"))
    assert isinstance(exc, z.SourceError), exc
    msg = str(exc)
    assert "no column 'body'" in msg and "input_ids" in msg and "text" in msg, msg
    assert ("Set tokens_field" if tokens else "Set text_field") in msg and names_a_file(fmt, msg, data), msg


@pytest.mark.parametrize("fmt", FORMATS)
def test_wrong_column_types_name_the_fix(data, shards, tok, fmt):
    exc = first_error(pipeline(any_spec(fmt, data, shards, text_field="input_ids"), tok, field="input_ids"))
    assert isinstance(exc, z.SourceError) and "not a string" in str(exc) and "use tokens_field" in str(exc), exc
    assert names_a_file(fmt, str(exc), data), exc
    exc = first_error(pipeline(any_spec(fmt, data, shards, tokens_field="text"), tok, field="text"))
    assert isinstance(exc, z.SourceError) and "not a list of integer token ids" in str(exc), exc
    exc = first_error(pipeline(any_spec(fmt, data, shards, columns=["text", "nope"]), tok))
    assert isinstance(exc, z.SourceError) and "no column 'nope'" in str(exc) and "Fix the source's columns" in str(exc)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["arrow", "arrows", "hf"])
@pytest.mark.parametrize("how", ["truncated", "garbage", "middle"])
def test_corrupt_or_truncated_arrow_file(data, tok, tmp_path, fmt, how):
    root = tmp_path / fmt
    shutil.copytree(data[fmt], root)
    bad = sorted(root.rglob("*.arrow*"))[5]
    raw = bad.read_bytes()
    if how == "truncated":
        bad.write_bytes(raw[: len(raw) // 2])
    elif how == "garbage":
        bad.write_bytes(np.random.default_rng(3).bytes(len(raw)))
    else:  # the schema message (and a file's footer) intact, the batch between overwritten
        a, b = len(raw) // 3, len(raw) * 2 // 3
        bad.write_bytes(raw[:a] + np.random.default_rng(4).bytes(b - a) + raw[b:])
    exc = first_error(pipeline(z.read.arrow(str(root), chunk_rows=4) if fmt != "hf" else
                               z.read.hf(str(root), chunk_rows=4), tok))
    assert isinstance(exc, z.SourceError), exc
    assert str(bad) in str(exc) and ("re-write" in str(exc) or "Re-write" in str(exc)), exc


def test_lance_paths_that_are_not_datasets(tmp_path, tok):
    with pytest.raises(z.SourceError, match="does not exist"):
        WorkPlan(pipeline(z.read.lance(str(tmp_path / "nope.lance")), tok))
    (tmp_path / "empty").mkdir()
    with pytest.raises(z.SourceError, match=r"is not a Lance dataset and holds none .*_versions"):
        WorkPlan(pipeline(z.read.lance(str(tmp_path / "empty")), tok))
    require("lance")  # the checks above come before pylance is imported; opening a dataset needs it
    (tmp_path / "broken.lance" / "_versions").mkdir(parents=True)
    (tmp_path / "broken.lance" / "_versions" / "1.manifest").write_bytes(b"not a manifest")
    with pytest.raises(z.SourceError, match=r"cannot open the Lance dataset .*broken.lance"):
        WorkPlan(pipeline(z.read.lance(str(tmp_path / "broken.lance")), tok))
    with pytest.raises(z.SourceError, match=r"storage_options.retry = \[1\]: Lance takes strings"):
        WorkPlan(pipeline(z.read.lance(str(tmp_path / "broken.lance"), storage_options={"retry": [1]}), tok))


def test_lance_folder_of_datasets(data, tok, tmp_path):
    for name in ("b.lance", "a.lance"):
        shutil.copytree(data["lance"], tmp_path / name)
    files = WorkPlan(pipeline(z.read.lance(str(tmp_path)), tok)).sources[0].files
    assert files[0] == f"{tmp_path / 'a.lance'}#fragment=0" and len(files) == 32
    assert files[15].endswith("a.lance#fragment=15") and files[16].endswith("b.lance#fragment=0")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("damage,message", [
    (lambda r: (r / "train" / "state.json").write_text("{not json"), r"train/state.json is not valid JSON"),
    (lambda r: (r / "train" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "../x.arrow"}]})),
     r"train/state.json: '_data_files' must list the folder's .arrow files by name"),
    (lambda r: (r / "train" / "data-00003-of-00016.arrow").unlink(),
     r"data-00003-of-00016.arrow is listed in .*state.json but missing"),
    (lambda r: (r / "dataset_dict.json").write_text(json.dumps({"splits": "train"})),
     r"dataset_dict.json: 'splits' must be a list"),
])
def test_damaged_save_to_disk_folder(data, tok, tmp_path, damage, message):
    root = _copy(data["hf"], tmp_path / "hf")
    damage(root)
    with pytest.raises(z.SourceError, match=message):
        WorkPlan(pipeline(z.read.hf(str(root)), tok))


def test_hf_split_and_config_mistakes_say_what_exists(data, tok, tmp_path):
    with pytest.raises(z.SourceError, match=r"has no split 'validation' .*lists test, train\)\. Set split"):
        WorkPlan(pipeline(z.read.hf(str(data["hf"]), split="validation"), tok))
    with pytest.raises(z.SourceError, match=r"has no configs: remove config = \"en\""):
        WorkPlan(pipeline(z.read.hf(str(data["hf"]), config="en"), tok))
    import datasets

    datasets.Dataset.from_dict({"text": ["only a test"]}, split="test").save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(z.SourceError, match=r"holds split 'test' \(state.json\), not 'train': set split = \"test\""):
        WorkPlan(pipeline(z.read.hf(str(tmp_path / "saved")), tok))
    assert len(WorkPlan(pipeline(z.read.hf(str(tmp_path / "saved"), split="test"), tok)).sources[0].files) == 1
    with pytest.raises(z.SourceError, match=r"is not a Hugging Face dataset folder"):
        WorkPlan(pipeline(z.read.hf(str(data["parquet"])), tok))
    with pytest.raises(z.SourceError, match=r"is a file: point path at the dataset folder"):
        WorkPlan(pipeline(z.read.hf(str(next(data["arrow"].iterdir()))), tok))
    with pytest.raises(z.SourceError, match="does not exist"):
        WorkPlan(pipeline(z.read.hf(str(tmp_path / "nothing")), tok))
    with pytest.raises(ValueError, match=r"read.hf\(split=...\): a non-empty string"):
        z.read.hf(str(data["hf"]), split="")


def test_a_stream_file_named_like_a_file_format_one_is_read(data, tok, shards, tmp_path):
    """The IPC flavour is told by the file's magic bytes, not its name."""
    src = sorted(data["arrows"].iterdir())[2]
    shutil.copy(src, tmp_path / "x.arrow")
    source = WorkPlan(z.Pipeline(seed=1, lanes=1).source("d", z.read.arrow(str(tmp_path / "x.arrow")))).sources[0]
    assert source.reader.read(source.files[0], 0, -1).texts == [t for t, _ in shards[2]]
    with ipc.open_stream(pa.memory_map(str(src))) as reader:
        assert reader.read_all().num_rows == ROWS

"""Per-rank cost stays flat in files, lanes and ranks; a checkpoint stays small (issue 19, items 4 and 5).

Speed is measured by scripts/bench/scale_study.py (BENCHMARKS.md), never here. These tests pin what keeps
it flat, by counting instead of timing:

- a rank plans without the others: building rank r of a 1024-lane, 1024-rank pipeline over 2048 Parquet
  files (whole-file units) opens no file to plan, only the first file of each source to check that it
  holds text, and then only files of its own lane's units; it never computes another lane's units;
- listing a folder and naming its files for the fingerprint give exactly what fsspec and os.path gave
  (the fast paths are checked against them on random trees and lists);
- a checkpoint of 64 lanes with two sources is at most 16 KB, as ``json.dumps`` gives it and as the file
  ``zephon.save_state`` writes, also with every counter at the size of a long production run.
"""

from __future__ import annotations

import io
import json
import os
import random

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import zephon
from zephon.plan import SourcePlan, WorkPlan, find_files, relative_names
from zephon.readers.base import Unit, WholeFiles
from zephon.state import seal

FILES = 1024  # per source: as many as lanes, so units are whole files
WORDS = "lanes read their own units while the packer fills rows and the mixer keeps exact weights".split()


@pytest.fixture(scope="module")
def many_files(tmp_path_factory):
    """Two folders of 1024 small Parquet files each (8 distinct contents, copied)."""
    rng = random.Random(5)
    blobs = []
    for _ in range(8):
        buf = io.BytesIO()
        pq.write_table(pa.table({"text": [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
                                          for _ in range(3)]}), buf)
        blobs.append(buf.getvalue())
    root = tmp_path_factory.mktemp("many")
    for name in ("web", "code"):
        (root / name).mkdir()
        for i in range(FILES):
            (root / name / f"part-{i:05d}.parquet").write_bytes(blobs[i % 8])
    return root


def pipeline(root, hf_tokenizer, lanes: int) -> zephon.Pipeline:
    return (zephon.Pipeline(seed=11, lanes=lanes)
            .source("web", zephon.read.parquet(str(root / "web")), weight=0.7)
            .source("code", zephon.read.parquet(str(root / "code")), weight=0.3)
            .tokenize(zephon.tokenizer(str(hf_tokenizer)))
            .pack(seq_len=64)
            .batch(rows_per_lane=1))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size,rank", [(1024, 517), (8, 3)])
def test_a_rank_opens_only_files_of_its_own_lanes(many_files, hf_tokenizer, monkeypatch, world_size, rank):
    opened: list[str] = []
    real = pq.ParquetFile

    def counting(source, *args, **kwargs):
        opened.append(str(getattr(source, "path", source)))
        return real(source, *args, **kwargs)

    asked: set[int] = set()
    lane_unit = SourcePlan.lane_unit

    def recording(self, lane, i):
        asked.add(lane)
        return lane_unit(self, lane, i)

    monkeypatch.setattr(pq, "ParquetFile", counting)
    monkeypatch.setattr(SourcePlan, "lane_unit", recording)
    pipe = pipeline(many_files, hf_tokenizer, lanes=1024)
    mine = set(zephon.lanes_of_rank(1024, rank, world_size))

    plan = WorkPlan(pipe)
    assert [len(s.files) for s in plan.sources] == [FILES, FILES]
    assert all(isinstance(s.units, WholeFiles) for s in plan.sources)
    assert opened == [], "planning whole-file units must not open a file"

    loader = zephon.build_loader(pipe, rank=rank, world_size=world_size, plan=plan)
    probe = {s.files[0] for s in plan.sources}  # check_has_text: the first unit of each source, in file order
    assert set(opened) <= probe, f"building rank {rank} opened {sorted(set(opened) - probe)[:4]}"

    for _ in range(3):
        next(loader)
    loader.close()
    own = {s.files[s.lane_unit(lane, i).file] for s in plan.sources for lane in mine for i in range(16)}
    others = set(opened) - own - probe
    assert not others, f"rank {rank} opened files of other ranks' lanes: {sorted(others)[:4]}"
    assert asked <= mine, f"rank {rank} computed units of lanes {sorted(asked - mine)[:8]}"
    assert len(set(opened)) <= 2 + 4 * len(mine)  # its lanes' first units and the probe: not the 2048 files


def test_whole_file_units_are_the_list_they_stand_for():
    ref = [Unit(i, 0, -1) for i in range(7)]
    units = WholeFiles(7)
    assert list(units) == ref and units == ref and len(units) == 7
    assert units[2] == ref[2] and units[-1] == ref[-1] and units[1:5] == ref[1:5] and units[::3] == ref[::3]
    with pytest.raises(IndexError):
        units[7]


def test_listing_a_folder_gives_what_fsspec_gives(tmp_path):
    fs = fsspec.filesystem("file")
    rng = random.Random(2)
    for k in range(60):
        folder = tmp_path.joinpath(*[rng.choice("abc") for _ in range(rng.randint(0, 3))])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{rng.choice(['', '.', ' x'])}f{k}.{rng.choice(['parquet', 'txt'])}").write_text("1")
    os.symlink(tmp_path / "a", tmp_path / "link_to_dir")  # not entered, listed as an entry (as fsspec does)
    os.symlink(tmp_path / "missing", tmp_path / "broken.parquet")
    for root in (str(tmp_path), str(tmp_path) + "/", str(tmp_path / "a"), "file://" + str(tmp_path)):
        path = fs._strip_protocol(root)
        assert find_files(fs, path) == fs.find(path)


def test_relative_names_are_what_os_path_gives():
    def reference(files):
        root = os.path.commonpath(files) if len(files) > 1 else (os.path.dirname(files[0]) or ".")
        return [os.path.relpath(f, root) for f in files]

    rng = random.Random(3)
    parts = ["a", "b", "ab", "a-b", "c.parquet", "x y", "é", ".", "..", "", "...", ".a"]
    for _ in range(20000):
        prefix = rng.choice(["", "/", "/data/", "data/", "bucket/", "//", "./", "../"])
        files = sorted({prefix + "/".join(rng.choice(parts) for _ in range(rng.randint(1, 4)))
                        for _ in range(rng.randint(1, 6))})
        try:
            expected = reference(files)
        except ValueError as exc:
            expected = type(exc)
        try:
            got = relative_names(files)
        except ValueError as exc:
            got = type(exc)
        assert got == expected, files


# -- checkpoint size ----------------------------------------------------------------------------------------
LIMIT = 16 * 1024


@pytest.mark.timeout(120)
def test_a_checkpoint_of_64_lanes_and_two_sources_is_at_most_16_kb(make_recipe, tmp_path):
    loader = zephon.build_loader(make_recipe(lanes=64))  # two sources: Parquet and JSON Lines
    for _ in range(40):
        next(loader)
    state = zephon.merge_states([loader.state_dict()])
    loader.close()
    lanes = state["lanes"]
    assert len(lanes) == 64 and sum(v["sentinels"] > 0 for v in lanes.values()) >= 48  # real positions
    assert len(json.dumps(state)) <= LIMIT
    zephon.save_state(state, tmp_path / "state.json")
    assert (tmp_path / "state.json").stat().st_size <= LIMIT
    assert zephon.load_state(tmp_path / "state.json") == state

    # the same lanes after a long run (every counter as large as in a run of ~10^6 steps of 8192 tokens):
    # the file zephon.save_state writes still fits
    big = json.loads(json.dumps(state))
    for lane in big["lanes"].values():
        lane.update(sentinels=123_456, rows_since_flush=99, carry=8191,
                    clock=[1_234_567, 12_345], replay=[99, 99])
        lane["positions"] = {name: [12_345, 1_234_567, 3] for name in lane["positions"]}
    big["step"] = 1_234_666
    seal(big)
    zephon.save_state(big, tmp_path / "big.json")
    assert (tmp_path / "big.json").stat().st_size <= LIMIT
    assert zephon.load_state(tmp_path / "big.json") == big

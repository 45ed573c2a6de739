"""The WebDataset reader: its index against the ``webdataset`` package's own reader, its reads, its sidecars.

Shards are written by Python's ``tarfile`` in each of its formats (ustar, GNU long names, pax) with the
members that real shards hold and that trip readers up (folders, links, ``__meta__`` files, upper-case and
multi-dot extensions, keys in sub-folders, names without an extension); ``webdataset.WebDataset`` reads
them back, and Zephon's reader must give the same samples, the same fields and the same bytes, however
the shards are cut into units and chunks. The index is built from headers alone and each chunk is one
ranged read; an index sidecar is untrusted and a tampered one is never used.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import fsspec
import numpy as np
import pytest

from tests.optional import require

from zephon import SourceError
from zephon.readers import Unit
from zephon.readers import webdataset as wdsr
from zephon.readers.base import DocLimit

from .vision_data import add_member, write_shard

webdataset = require("webdataset")


def members_of(k: int) -> list[tuple[str, bytes]]:
    """A shard's members, with every naming case the grouping rules cover."""
    out: list[tuple[str, bytes]] = []
    for i in range(11):
        key = f"part{k}/sub.dir/{i:04d}" if i % 4 == 0 else f"s{k}_{i:04d}"
        blob = bytes(np.random.default_rng([k, i]).integers(0, 256, 700 + 97 * i, dtype=np.uint8))
        out.append((f"{key}.jpg", blob))
        out.append((f"{key}.TXT", f"caption {k} {i} – ünïcode".encode()))
        if i % 3 == 0:
            out.append((f"{key}.seg.png", blob[::-1]))
        if i == 5:
            out.append(("__meta__", b"skipped"))
            out.append(("noext", b"no extension: skipped"))
        if i == 7:
            out.append((f"{key}.json", b"x" * 200))  # a long key below, too
            out.append((("d" * 120) + f"/{key}.cls", b"3"))
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("wds")
    folder = tarfile.TarInfo("part0")
    folder.type = tarfile.DIRTYPE
    link = tarfile.TarInfo("link.jpg")
    link.type, link.linkname = tarfile.SYMTYPE, "s0_0001.jpg"
    fmts = [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]
    out = []
    for k, fmt in enumerate(fmts):
        members = members_of(k)
        if fmt == tarfile.USTAR_FORMAT:  # ustar cannot hold the 120-character folder name
            members = [(n, d) for n, d in members if not n.startswith("ddd")]
        out.append(write_shard(root / f"shard-{k}.tar", members, fmt, extra=[folder, link]))
    return out


def reference(paths: list[Path]) -> list[dict]:
    """The samples as the webdataset package reads them (its own tar reader and grouping)."""
    ds = webdataset.WebDataset([str(p) for p in paths], shardshuffle=False)
    return [{k: v for k, v in s.items() if not k.startswith("__") or k == "__key__"} for s in ds]


def read_all(reader: wdsr.WebDatasetReader, paths: list[Path], lanes: int) -> list[dict]:
    """Every record of every unit the plan makes for ``lanes``, unit by unit, chunk by chunk."""
    files = [str(p) for p in paths]
    records = []
    for unit in reader.split_units(files, lanes):
        for a, b in reader.chunk_bounds(files[unit.file], unit, -1):
            raw = reader.read(files[unit.file], a, b)
            assert raw.next_cursors.tolist() == list(range(a + 1, b + 1))
            records += [{k: v[i] for k, v in raw.columns.items() if v[i] is not None} for i in range(b - a)]
    return records


def local() -> fsspec.AbstractFileSystem:
    return fsspec.filesystem("file")


@pytest.mark.parametrize("lanes,chunk_rows", [(1, 64), (2, 3), (16, 2)])
def test_same_samples_fields_and_bytes_as_webdataset(shards, lanes, chunk_rows):
    ref = reference(shards)
    got = read_all(wdsr.WebDatasetReader(local(), "w", None, chunk_rows), shards, lanes)
    assert len(got) == len(ref) == 3 * 11 + 2  # + the two long-folder samples (GNU and pax shards)
    for r, g in zip(ref, got):
        assert g["__key__"] == r["__key__"]
        assert set(g) == set(r), (g["__key__"], sorted(g), sorted(r))
        for ext, value in r.items():
            if ext == "__key__":
                continue
            assert g[ext] == (value.decode() if ext in ("txt", "text") else value), (g["__key__"], ext)


def test_columns_pick_alternatives_and_name_fields(shards):
    reader = wdsr.WebDatasetReader(local(), "w", ["image=seg.png;jpg", "txt", "cls"], 4)
    ref = reference(shards)
    got = read_all(reader, shards, 1)
    for r, g in zip(ref, got):
        assert g.get("image") == r.get("seg.png", r.get("jpg"))
        assert g.get("txt") == (r["txt"].decode() if "txt" in r else None)
        assert g.get("cls") == r.get("cls")
        assert set(g) <= {"image", "txt", "cls"}  # the key only when asked for (or with "*")


def test_index_reads_headers_only(shards):
    class Counting(io.FileIO):
        read_bytes = 0

        def read(self, n=-1):  # type: ignore[override]
            data = super().read(n)
            Counting.read_bytes += len(data)
            return data

    path = shards[2]
    size = path.stat().st_size
    with Counting(str(path), "rb") as f:
        members = wdsr.scan_members(f, size, str(path))
    with tarfile.open(path) as tf:
        names = [(m.name, m.offset_data, m.size) for m in tf.getmembers() if m.isreg()]
    assert members == names  # tarfile's own parse of the same headers
    data = sum(s for _, _, s in members)
    assert Counting.read_bytes < size - data + 4096  # headers (and long names) only, no member data


def test_a_chunk_is_one_ranged_read(shards, tmp_path):
    calls: list[tuple[int, int]] = []

    class Fs(fsspec.implementations.local.LocalFileSystem):
        def cat_file(self, path, start=None, end=None, **kw):
            calls.append((start, end))
            return super().cat_file(path, start=start, end=end, **kw)

    reader = wdsr.WebDatasetReader(Fs(), "w", ["__key__", "jpg", "txt"], 4)
    path = str(shards[0])
    index = reader.index(path)
    raw = reader.read(path, 4, 8)
    assert len(calls) == 1
    lo, hi = calls[0]
    wanted = [m for m in range(int(index.first[4]), int(index.first[8])) if index.exts[m] in ("jpg", "txt")]
    assert lo == index.offsets[wanted[0]] and hi == max(index.offsets[m] + index.sizes[m] for m in wanted)
    assert hi - lo < shards[0].stat().st_size / 2
    assert raw.columns["__key__"] == index.keys[4:8]


def test_oversize_members_are_not_read(shards):
    calls: list[tuple[int, int]] = []

    class Fs(fsspec.implementations.local.LocalFileSystem):
        def cat_file(self, path, start=None, end=None, **kw):
            calls.append((start, end))
            return super().cat_file(path, start=start, end=end, **kw)

    ref = reference(shards[:1])
    reader = wdsr.WebDatasetReader(Fs(), "w", ["jpg", "txt"], 64, DocLimit(1000, "skip"))
    expect = [r["jpg"] if len(r["jpg"]) <= 1000 else None for r in ref]
    assert [g.get("jpg") for g in read_all(reader, shards[:1], 1)] == expect  # ranged reads (object stores)
    assert calls
    reader = wdsr.WebDatasetReader(local(), "w", ["jpg", "txt"], 64, DocLimit(1000, "skip"))
    assert [g.get("jpg") for g in read_all(reader, shards[:1], 1)] == expect  # local: pread in spans
    with pytest.raises(SourceError, match="max_doc_bytes"):
        read_all(wdsr.WebDatasetReader(local(), "w", ["jpg"], 64, DocLimit(1000, "error")), shards[:1], 1)
    short = read_all(wdsr.WebDatasetReader(local(), "w", ["txt"], 64, DocLimit(12, "truncate")), shards[:1], 1)
    assert all(len(g["txt"].encode()) <= 12 and r["txt"].decode().startswith(g["txt"]) for g, r in zip(short, ref))


def test_sidecar_is_written_reused_and_never_trusted(shards, tmp_path):
    cache = tmp_path / "cache"
    path = str(shards[1])
    reader = wdsr.WebDatasetReader(local(), "w", None, 64, index_cache=str(cache))
    size, version = os.path.getsize(path), wdsr._version(local().info(path))
    scanned = reader._load(path, size, version)
    (sidecar,) = (cache / wdsr.SIDECAR_FOLDER).glob("*.json")
    again = wdsr.index_from_json(sidecar.read_bytes(), path, size, version)
    assert again is not None and again.keys == scanned.keys and (again.offsets == scanned.offsets).all()
    assert wdsr.index_from_json(sidecar.read_bytes(), path, size + 1, version) is None  # another version
    doc = json.loads(sidecar.read_bytes())

    def tampered(change) -> bytes:
        d = json.loads(json.dumps(doc))
        change(d)
        return json.dumps(d).encode()

    def reseal(d: dict) -> None:
        d["blake2b"] = wdsr._digest(d["index"])

    cases = {
        "offset, digest kept": lambda d: d["index"]["offsets"].__setitem__(0, d["index"]["offsets"][0] + 512),
        "offset, resealed": lambda d: (d["index"]["offsets"].__setitem__(1, d["index"]["offsets"][0]), reseal(d)),
        "past the end": lambda d: (d["index"]["sizes"].__setitem__(-1, size), reseal(d)),
        "unaligned": lambda d: (d["index"]["offsets"].__setitem__(0, 513), reseal(d)),
        "counts": lambda d: (d["index"]["first"].pop(), reseal(d)),
        "types": lambda d: (d["index"]["keys"].__setitem__(0, 7), reseal(d)),
        "format": lambda d: d.__setitem__("version_of_format", 99),
    }
    for name, change in cases.items():
        assert wdsr.index_from_json(tampered(change), path, size, version) is None, name
    assert wdsr.index_from_json(b"\x00garbage", path, size, version) is None
    # a tampered sidecar on disk: the reader scans again, reads what webdataset reads, and rewrites it
    sidecar.write_bytes(tampered(cases["offset, resealed"]))
    fresh = wdsr.WebDatasetReader(local(), "w", None, 64, index_cache=str(cache))
    assert fresh._load(path, size, version).offsets.tolist() == scanned.offsets.tolist()
    assert wdsr.index_from_json(sidecar.read_bytes(), path, size, version) is not None
    # a link in the cache folder is not followed
    sidecar.unlink()
    target = tmp_path / "elsewhere.json"
    target.write_bytes(scanned.to_json(path, version))
    sidecar.symlink_to(target)
    assert wdsr._read_sidecar(str(sidecar.parent), sidecar.name) is None


def test_header_checksums_unsigned_and_signed(tmp_path):
    """A header's checksum is the sum of its bytes read unsigned (tar writers today) or signed (some old
    ones): both are accepted; any other value is refused. (A name with bytes >= 0x80 makes them differ.)"""
    path = write_shard(tmp_path / "s.tar", [("caf\u00e9.jpg", b"1"), ("caf\u00e9.txt", b"x")], fmt=tarfile.GNU_FORMAT)
    raw = bytearray(path.read_bytes())
    header = raw[:512]
    unsigned = sum(header[:148]) + sum(header[156:]) + 8 * 32
    signed = sum(b - 256 if b >= 128 else b for b in header[:148] + header[156:]) + 8 * 32
    assert unsigned != signed
    for value, ok in ((unsigned, True), (signed, True), (unsigned + 1, False)):
        raw[148:156] = b"%06o\x00 " % value
        (tmp_path / "t.tar").write_bytes(bytes(raw))
        with open(tmp_path / "t.tar", "rb") as f:
            if ok:
                assert [m[0] for m in wdsr.scan_members(f, len(raw), "t.tar")] == ["caf\u00e9.jpg", "caf\u00e9.txt"]
            else:
                with pytest.raises(SourceError, match="bad tar header checksum"):
                    wdsr.scan_members(f, len(raw), "t.tar")
    # a bad checksum is reported before what the header's other fields say (here a size that is no number)
    raw[124:136] = b"not a number"
    (tmp_path / "t.tar").write_bytes(bytes(raw))
    with open(tmp_path / "t.tar", "rb") as f, pytest.raises(SourceError, match="at byte 0: bad tar header checksum"):
        wdsr.scan_members(f, len(raw), "t.tar")
    # a checksum field that is no number is refused as such
    raw[148:156] = b"zzzzzzz\x00"
    with pytest.raises(SourceError, match="where a number belongs"):
        wdsr.scan_members(io.BytesIO(bytes(raw)), len(raw), "t.tar")


def test_a_bad_checksum_comes_first_whatever_follows(tmp_path):
    """Checksums are verified 4,096 headers at a time: a bad one is found wherever it is, and reported
    before a later header's error (here a pax size that is not a plain number)."""
    info = tarfile.TarInfo("a.txt")
    info.size, info.pax_headers = 1, {"size": "\u00b9"}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        tf.addfile(info, io.BytesIO(b"x"))
    raw = bytearray(buf.getvalue())
    with pytest.raises(SourceError, match="at byte 1024: a pax size of"):
        wdsr.scan_members(io.BytesIO(bytes(raw)), len(raw), "t.tar")
    raw[148:156] = b"0000001\x00"  # the pax header's own checksum, before it
    with pytest.raises(SourceError, match="at byte 0: bad tar header checksum"):
        wdsr.scan_members(io.BytesIO(bytes(raw)), len(raw), "t.tar")
    many = bytearray(write_shard(tmp_path / "many.tar", [(f"{i:05d}.txt", b"x") for i in range(4100)],
                                 fmt=tarfile.GNU_FORMAT).read_bytes())
    assert len(wdsr.scan_members(io.BytesIO(bytes(many)), len(many), "many.tar")) == 4100
    for k in (0, 4095, 4096, 4099):  # the first, the last of a batch, the first of the next, the last
        bad = bytearray(many)
        bad[k * 1024 + 148:k * 1024 + 156] = b"0000001\x00"
        with pytest.raises(SourceError, match=f"at byte {k * 1024}: bad tar header checksum"):
            wdsr.scan_members(io.BytesIO(bytes(bad)), len(bad), "many.tar")


def test_bad_shards_are_clear_errors(shards, tmp_path):
    data = shards[0].read_bytes()
    cases = {
        "truncated": data[:len(data) // 2 + 100],
        "partial header": data[:1024 + 300],
        "not a tar file": b"<html>" + bytes(2000),
        "bad checksum": data[:148] + b"0000000\x00" + data[156:],
    }
    for name, blob in cases.items():
        bad = tmp_path / f"{name}.tar"
        bad.write_bytes(blob)
        reader = wdsr.WebDatasetReader(local(), "w", None, 64)
        with pytest.raises(SourceError, match=f"{bad.name}|truncated|checksum|number") as info:
            read_all(reader, [bad], 1)
        assert str(bad) in str(info.value), name
    dup = write_shard(tmp_path / "dup.tar", [("a.jpg", b"1"), ("a.txt", b"x"), ("a.JPG", b"2")])
    with pytest.raises(SourceError, match="appears twice"):
        wdsr.WebDatasetReader(local(), "w", None, 64).index(str(dup))
    not_utf8 = write_shard(tmp_path / "latin.tar", [("a.txt", "café".encode("latin-1"))])
    with pytest.raises(SourceError, match="not UTF-8"):
        read_all(wdsr.WebDatasetReader(local(), "w", None, 64), [not_utf8], 1)
    sparse = tmp_path / "sparse.tar"
    with tarfile.open(sparse, "w", format=tarfile.GNU_FORMAT) as tf:
        add_member(tf, "a.jpg", b"x")
    raw = bytearray(sparse.read_bytes())
    raw[156:157] = b"S"
    raw[148:156] = b"%06o\x00 " % (sum(raw[:148]) + 256 + sum(raw[156:512]))
    sparse.write_bytes(bytes(raw))
    with pytest.raises(SourceError, match="sparse"):
        wdsr.WebDatasetReader(local(), "w", None, 64).index(str(sparse))


def test_empty_shard_and_bad_columns(tmp_path):
    empty = write_shard(tmp_path / "empty.tar", [])
    reader = wdsr.WebDatasetReader(local(), "w", None, 64)
    assert len(reader.index(str(empty))) == 0
    assert reader.chunk_bounds(str(empty), Unit(0, 0, -1), -1) == []
    for bad in (["jpg;", "txt"], ["__key__=jpg"], ["*", "txt"]):
        with pytest.raises(SourceError, match="columns"):
            wdsr.parse_columns(bad)


def test_a_shard_shorter_than_its_index_is_an_error_naming_it(shards, tmp_path):
    """A shard cut short after it was indexed (read between the index and the bytes): a clear error, locally
    and through ranged reads, never a short member passed on."""
    path = tmp_path / "cut.tar"
    shutil.copy(shards[0], path)

    class Ranged(fsspec.implementations.local.LocalFileSystem):  # reads as an object store does
        pass

    for fs in (local(), Ranged()):
        reader = wdsr.WebDatasetReader(fs, "w", ["jpg", "txt"], 64)
        index = reader.index(str(path))
        _, picks = reader._wanted(index, 0, len(index))
        members, lengths = reader._lengths(str(path), index, picks)
        with open(path, "r+b") as f:
            f.truncate(int(index.offsets[members[-1]]) + 1)
        with pytest.raises(SourceError, match="shorter than its index says"):
            reader._fetch(str(path), index, members, lengths)
        shutil.copy(shards[0], path)


def test_local_reads_complete_spans_that_one_pread_returns_short(shards, monkeypatch):
    """Linux returns at most ~2 GiB from one pread: a larger span must be read on, not called short. Here
    pread is capped at 1,000 bytes a call (the same short returns, without 2 GiB of test data)."""
    real = os.pread
    calls = {"n": 0}

    def capped(fd, n, offset):
        calls["n"] += 1
        return real(fd, min(n, 1000), offset)

    expect = read_all(wdsr.WebDatasetReader(local(), "w", ["jpg", "txt"], 64), shards[:1], 1)
    monkeypatch.setattr(wdsr.os, "pread", capped)
    assert read_all(wdsr.WebDatasetReader(local(), "w", ["jpg", "txt"], 64), shards[:1], 1) == expect
    assert calls["n"] > len(expect)  # spans were read in many calls

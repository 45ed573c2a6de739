"""Hardening of what a run reads: long and oversize records, blank records, recipe values, tokenizer files.

Issue 17, items 5 to 10. Every input here is a real file (JSON Lines, Parquet, TOML, tokenizers trained
by ``conftest.py``); the JSON Lines reads are counted through a real local file, never timed. Expected
values are computed from what the test wrote, not by the code under test.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem

from zephon import RecipeError, SourceError, TokenizerSpec, WorkPlan, build_loader, load_recipe, load_tokenizer
from zephon import recipe_from_dict
from zephon.plan import PROBE_RECORDS
from zephon.readers.base import DocLimit
from zephon.readers.jsonl import JsonlReader

try:
    from tests.conftest import base_recipe_dict, tiktoken_options
except ImportError:  # tests/ is not a package
    from conftest import base_recipe_dict, tiktoken_options

ROOT = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()


def doc(k: int, words: int = 30) -> str:
    return " ".join(WORDS[(k * 7 + i) % len(WORDS)] for i in range(words)) + f" {k}"


def repeat_to(line: str, size: int) -> str:
    """``line`` repeated to at least ``size`` characters (bytes, for ASCII)."""
    return line * -(-size // len(line))


def write_jsonl(path: Path, texts: list[Any], ensure_ascii: bool = True) -> bytes:
    raw = b"".join(json.dumps({"id": k, "text": t}, ensure_ascii=ensure_ascii).encode() + b"\n"
                   for k, t in enumerate(texts))
    path.write_bytes(raw)
    return raw


def recipe(sp_model: Path, sources: list[dict], origin: str = "<dict>", **top: Any):
    data: dict[str, Any] = {"seed": 3, "lanes": 2, "seq_len": 64, "batch_per_lane": 2,
                            "tokenizer": {"kind": "sentencepiece", "path": str(sp_model)}, "sources": sources}
    data.update(top)
    return recipe_from_dict(data, origin=origin)


def utf8_cut(text: str, limit: int) -> str:
    """The longest prefix of ``text`` whose UTF-8 encoding has at most ``limit`` bytes, character by character."""
    out, size = [], 0
    for ch in text:
        size += len(ch.encode("utf-8"))
        if size > limit:
            break
        out.append(ch)
    return "".join(out)


def all_records(reader, path: str) -> list[str | None]:
    texts: list[str | None] = []
    for unit in reader.split_units([path], 1):
        for a, b in reader.chunk_bounds(path, unit, -1):
            texts += reader.read(path, a, b).texts
    return texts


# -- 5. long lines are read in linear time; oversize documents --------------------------------------

class _CountedFile:
    """A real open file whose ``read`` calls are recorded (their sizes, in ``reads``)."""

    def __init__(self, f: Any, reads: list[int]) -> None:
        self._f, self._reads = f, reads

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._reads.append(len(data))
        return data

    def seek(self, *args: int) -> int:
        return self._f.seek(*args)

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "_CountedFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class CountingFileSystem(LocalFileSystem):
    """fsspec's local filesystem, recording every read of the files it opens."""

    cachable = False  # a fresh instance (and counter) per test

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reads: list[int] = []

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> _CountedFile:
        return _CountedFile(super()._open(path, mode, **kwargs), self.reads)


def test_a_16_mb_line_is_read_in_linear_bytes_and_few_calls(tmp_path):
    """Before: every 256 KiB chunk inside the line read on to the line's end (~500 MB read for a 16 MB
    line) and its owner read it 64 KiB at a time, copying the buffer each time (256 reads)."""
    long_text = repeat_to(doc(0, 10) + "\n", 16 << 20)
    texts = [doc(k) for k in range(1, 101)] + [long_text] + [doc(k) for k in range(101, 201)]
    path = tmp_path / "long.jsonl"
    size = len(write_jsonl(path, texts))
    assert size > 16 << 20
    fs = CountingFileSystem()
    reader = JsonlReader(fs, "src", "text", 256 << 10, 1 << 40, DocLimit(64 << 20))  # default chunk size; one unit
    got, calls = [], []
    for unit in reader.split_units([str(path)], 1):
        for a, b in reader.chunk_bounds(str(path), unit, -1):
            before = len(fs.reads)
            got += reader.read(str(path), a, b).texts
            calls.append(len(fs.reads) - before)
    assert got == texts  # every record once, the long one whole (under this reader's max_doc_bytes)
    assert len(calls) >= 64
    # Each byte is read at most twice: by the chunk it lies in, and by the chunk its line starts in.
    assert sum(fs.reads) <= 2 * size
    assert max(calls) <= 16  # the owner of the long line reads it in doubling steps, not 64 KiB at a time


RSS_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import zephon

    recipe = zephon.recipe_from_dict(json.loads(sys.argv[1]))
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    loader = zephon.build_loader(recipe, rank=0, world_size=1, num_workers=2, runner="thread")
    units = len(loader.plan.sources[0].units)
    steps = 0
    while loader.metrics()["units"] < units:  # one whole pass over the file
        next(loader)
        steps += 1
    m = loader.metrics()
    loader.close()
    print(json.dumps({"steps": steps, "skipped": m["skipped_records"], "docs": m["docs"], "base_kb": base_kb,
                      "peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
""")


@pytest.mark.timeout(600)
def test_a_50_mb_document_is_skipped_without_stalling_or_memory(tmp_path, sp_model):
    """One 50 MB line between normal ones: the loader finishes its pass, skips and counts the line, and
    its peak RSS stays far from the 2+ GB that tokenizing such a document costs."""
    path = tmp_path / "huge.jsonl"
    huge = repeat_to(doc(0, 12) + "\n", 50_000_000)
    assert len(huge) >= 50_000_000
    write_jsonl(path, [doc(k) for k in range(1, 101)] + [huge] + [doc(k) for k in range(101, 201)])
    del huge
    data = {"seed": 1, "lanes": 2, "seq_len": 64, "batch_per_lane": 2,
            "tokenizer": {"kind": "sentencepiece", "path": str(sp_model)},
            "read": {},  # the defaults: max_doc_bytes = 16 MiB, oversize = "skip"
            "sources": [{"name": "d", "path": str(path), "format": "jsonl"}]}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", RSS_SCRIPT, json.dumps(data)], capture_output=True, text=True,
                          timeout=540, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["skipped"] == 1 and out["docs"] >= 200, out
    assert out["peak_kb"] - out["base_kb"] < 512 << 10, out  # KiB: under 512 MiB above the imports


MULTIBYTE = "é€😀a" * 700  # 2+3+4+1 bytes a group: a cut at a byte count may fall inside a character


@pytest.mark.parametrize("chunk_bytes", [1024, 1 << 16])  # the long line spans chunks / lies inside one
@pytest.mark.parametrize("policy", ["skip", "truncate", "error"])
def test_jsonl_oversize_policies(tmp_path, chunk_bytes, policy):
    limit = 4096
    fits_but_line_does_not = "é" * 1500  # 3000 bytes of text, but 9000 of JSON (\\u00e9 escapes)
    texts = [doc(k) for k in range(20)] + [MULTIBYTE] + [doc(k) for k in range(20, 30)] + \
        [fits_but_line_does_not] + [doc(k) for k in range(30, 40)]
    lines = [json.dumps({"id": k, "text": t}, ensure_ascii=k != 20).encode() for k, t in enumerate(texts)]
    raw = b"".join(line + b"\n" for line in lines)
    path = tmp_path / "docs.jsonl"
    path.write_bytes(raw)
    assert len(lines[20]) > limit and len(lines[31]) > limit >= len(fits_but_line_does_not.encode())
    reader = JsonlReader(LocalFileSystem(), "src", "text", chunk_bytes, 1 << 40, DocLimit(limit, policy))
    if policy == "error":
        with pytest.raises(SourceError) as info:
            all_records(reader, str(path))
        msg = str(info.value)
        offset = raw.index(b'{"id": 20,')
        assert str(path) in msg and f"byte {offset}:" in msg and "max_doc_bytes = 4096" in msg
        assert 'oversize = "skip"' in msg and "source 'src'" in msg
        return
    got = all_records(reader, str(path))
    expected = list(texts)
    if policy == "skip":  # judged on the line: both long lines go
        expected[20] = expected[31] = None
    else:  # judged on the text: the first is cut at a character boundary, the second fits
        expected[20] = utf8_cut(MULTIBYTE, limit)
        assert len(expected[20].encode()) > limit - 4
    assert got == expected


@pytest.mark.parametrize("text_type", [pa.string(), pa.large_string()])
@pytest.mark.parametrize("policy", ["skip", "truncate", "error"])
def test_parquet_oversize_policies_through_the_recipe(tmp_path, sp_model, text_type, policy):
    limit = 4096
    texts = [doc(k) for k in range(5)] + [MULTIBYTE] + [doc(5), None, "x" * limit, "y" * (limit + 1), doc(6)]
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": pa.array(texts, text_type)}), path, row_group_size=4)
    r = recipe(sp_model, [{"name": "web", "path": str(path), "format": "parquet"}],
               read={"max_doc_bytes": limit, "oversize": policy, "chunk_rows": 3})
    reader = WorkPlan(r.to_pipeline()).sources[0].reader
    if policy == "error":
        with pytest.raises(SourceError) as info:
            all_records(reader, str(path))
        msg = str(info.value)
        assert str(path) in msg and "row 5:" in msg and "max_doc_bytes = 4096" in msg and "oversize" in msg
        return
    expected = list(texts)
    if policy == "skip":
        expected[5] = expected[9] = None
    else:
        expected[5], expected[9] = utf8_cut(MULTIBYTE, limit), "y" * limit
    assert all_records(reader, str(path)) == expected


# -- 6. blank records -------------------------------------------------------------------------------

BLANKS = ["   ", "\n\t", " \r\n ", "\u3000\u00a0"]  # whitespace only (ASCII and Unicode)


def test_whitespace_only_records_are_skipped_and_counted_not_eos_documents(tmp_path, sp_model):
    texts = ["alpha beta", BLANKS[0], "gamma", BLANKS[1], BLANKS[2], "delta epsilon", BLANKS[3]]
    raw = write_jsonl(tmp_path / "d.jsonl", texts)
    r = recipe(sp_model, [{"name": "d", "path": str(tmp_path / "d.jsonl"), "format": "jsonl"}], lanes=1)
    plan = WorkPlan(r.to_pipeline())
    task = next(plan.sources[0].chunk_tasks(0, 0, -1))
    assert (task.start, task.end) == (0, len(raw))
    out = r.to_pipeline().compile(plan).stages.run(0, 0, task)  # the stateless work of one chunk
    assert out.raw_records == 7 and out.n == 3 and out.skipped == 4 and out.counts == {"blank_records": 4}
    lengths = (out.offsets[1:] - out.offsets[:-1]).tolist()
    assert min(lengths) > 1  # no EOS-only document
    ends = [raw.index(b"\n", raw.index(json.dumps({"id": k, "text": t}).encode())) + 1
            for k, t in enumerate(texts)]
    assert out.resume_cursor.tolist() == [ends[0], ends[2], ends[5]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["jsonl_whitespace", "parquet_null_and_blank", "second_source"])
def test_an_all_blank_source_fails_when_the_loader_is_built(tmp_path, sp_model, corpus_texts, layout):
    """Before: whitespace-only records ran as EOS-only documents, and all-null sources failed only after
    some steps (when the mixer gave up)."""
    blank = tmp_path / "blank"
    blank.mkdir()
    if layout == "parquet_null_and_blank":
        for f in range(3):
            pq.write_table(pa.table({"text": pa.array([None, "", *BLANKS] * 10, pa.string())}),
                           blank / f"{f}.parquet", row_group_size=7)
        sources = [{"name": "blank", "path": str(blank), "format": "parquet"}]
    else:
        for f in range(3):
            write_jsonl(blank / f"{f}.jsonl", BLANKS * 25)
        sources = [{"name": "blank", "path": str(blank), "format": "jsonl"}]
    if layout == "second_source":
        pq.write_table(pa.table({"text": corpus_texts[:80]}), tmp_path / "good.parquet")
        sources = [{"name": "good", "path": str(tmp_path / "good.parquet"), "format": "parquet"}, *sources]
    r = recipe(sp_model, sources, origin="blank.toml", lanes=4, read={"chunk_bytes": 512, "chunk_rows": 4})
    with pytest.raises(SourceError) as info:
        build_loader(r, rank=0, world_size=1)
    msg = str(info.value)
    assert msg.startswith("blank.toml: source 'blank' has no text: all ") and "are null, empty or whitespace" in msg
    assert "text_field 'text'" in msg


class Text(str):
    """A str subclass: tokenized like a str, but checked record by record."""


@pytest.mark.parametrize("values,expect", [
    (["alpha beta", "gamma"], None),  # the C-loop check: all plain, non-blank str
    (["alpha beta", Text("gamma delta"), Text("  ")], None),
    (["alpha", np.array([1, 2])], "holds ndarray, not text"),  # truthiness of an array is no answer
    (["alpha", np.array([])], "holds ndarray, not text"),
    (["alpha", b"bytes"], "holds bytes, not text"),
])
def test_tokenize_checks_every_field_value_whatever_its_type(sp_model, values, expect):
    """A text field a user's map filled with something else: the operator's error names the record and
    the type, whichever check (the chunk-wide C loops or the per-record one) sees it first."""
    from zephon.ops.tokenize import Tokenize
    from zephon.records import Chunk

    n = len(values)
    chunk = Chunk(0, 0, True, 0, n, "mem.jsonl", {"text": list(values)}, np.arange(1, n + 1), np.zeros(n, np.int64),
                  raw_records=n)
    op = Tokenize(TokenizerSpec(kind="sentencepiece", path=str(sp_model)))
    if expect is None:
        out = op._apply_chunk(chunk)
        kept = [v for v in values if v.strip()]
        assert out.n == len(kept) and out.counts.get("blank_records", 0) == n - len(kept)
        return
    with pytest.raises(SourceError, match=expect) as exc:
        op._apply_chunk(chunk)
    assert "mem.jsonl" in str(exc.value)


@pytest.mark.timeout(120)
def test_a_source_that_starts_with_blank_records_still_runs_and_counts_them(tmp_path, sp_model):
    """Its first file (first unit in the plan's order) holds only whitespace; the rest is text."""
    folder = tmp_path / "src"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", BLANKS * 50)
    write_jsonl(folder / "b.jsonl", [doc(k) for k in range(300)])
    r = recipe(sp_model, [{"name": "d", "path": str(folder), "format": "jsonl"}], lanes=2, flush_every=1,
               read={"chunk_bytes": 1024, "unit_bytes": 1 << 20})
    plan = WorkPlan(r.to_pipeline())
    assert plan.sources[0].files[plan.sources[0].units[0].file].endswith("a.jsonl")
    loader = build_loader(r, rank=0, world_size=1, plan=plan)
    for _ in range(400):  # until the whitespace file and the text file have both been read once
        m = loader.metrics()
        if m["skipped_records"] >= 200 and m["docs"] >= 300:
            break
        next(loader)
    m = loader.metrics()
    assert m["skipped_records"] >= 200 and m["docs"] >= 300, m


def test_a_source_that_starts_with_too_many_blank_records_is_refused(tmp_path, sp_model):
    write_jsonl(tmp_path / "d.jsonl", [" "] * (PROBE_RECORDS + 100) + [doc(k) for k in range(50)])
    r = recipe(sp_model, [{"name": "d", "path": str(tmp_path / "d.jsonl"), "format": "jsonl"}], lanes=1,
               read={"chunk_bytes": 4096})
    with pytest.raises(SourceError) as info:
        build_loader(r, rank=0, world_size=1)
    msg = str(info.value)
    assert "source 'd' has no text: its first" in msg and str(tmp_path / "d.jsonl") in msg
    assert f"at most {PROBE_RECORDS - 1} blank records" in msg


# -- 7, 8. strict recipe values ----------------------------------------------------------------------

def _set(data: dict, where: str, key: str, value: Any) -> None:
    """Set ``key`` in the table ``where`` ("" top level, "sources" the first source, else a table name)."""
    if where == "":
        data[key] = value
    elif where == "sources":
        data["sources"][0][key] = value
    else:
        data.setdefault(where, {})[key] = value


# (table, key, value, the name the message must give). Values that were refused before issue 17 are left
# out (storage.retries was checked strictly already: tests/test_object_stores.py).
BAD_VALUES = [
    ("", "seed", "abc", "'seed'"), ("", "seed", 1.5, "'seed'"), ("", "seed", True, "'seed'"),
    ("", "seed", -1, "'seed'"), ("", "lanes", 2.5, "'lanes'"), ("", "lanes", True, "'lanes'"),
    ("", "lanes", "8", "'lanes'"), ("", "seq_len", 64.0, "'seq_len'"), ("", "batch_per_lane", 1.5, "'batch_per_lane'"),
    ("", "flush_every", False, "'flush_every'"),
    ("", "pack", 3, "'pack'"), ("", "read", "fast", "'read'"), ("", "mix", [], "'mix'"),
    ("", "storage", 1, "'storage'"),
    ("", "tokenizer", "sp", "'tokenizer'"),
    ("tokenizer", "kind", 3, "'tokenizer.kind'"), ("tokenizer", "path", 5, "'tokenizer.path'"),
    ("tokenizer", "path", "", "'tokenizer.path'"),
    ("tokenizer", "add_eos", "no", "'tokenizer.add_eos'"), ("tokenizer", "add_eos", 1, "'tokenizer.add_eos'"),
    ("tokenizer", "add_bos", 0, "'tokenizer.add_bos'"), ("tokenizer", "eos_token", 5, "'tokenizer.eos_token'"),
    ("tokenizer", "bos_token", "", "'tokenizer.bos_token'"), ("tokenizer", "pat_str", 3, "'tokenizer.pat_str'"),
    ("tokenizer", "pad_id", -1, "'tokenizer.pad_id'"), ("tokenizer", "pad_id", 1.0, "'tokenizer.pad_id'"),
    ("tokenizer", "pad_id", True, "'tokenizer.pad_id'"), ("tokenizer", "pad_id", "0", "'tokenizer.pad_id'"),
    ("pack", "algorithm", 3, "'pack.algorithm'"), ("pack", "max_open_bins", True, "'pack.max_open_bins'"),
    ("mix", "by", 1, "'mix.by'"),
    ("shuffle", "buffer", -1, "'shuffle.buffer'"), ("shuffle", "buffer", 1.5, "'shuffle.buffer'"),
    ("shuffle", "buffer", True, "'shuffle.buffer'"),
    ("split", "max_doc_tokens", True, "'split.max_doc_tokens'"),
    ("read", "chunk_rows", 1.5, "'read.chunk_rows'"), ("read", "chunk_bytes", "1024", "'read.chunk_bytes'"),
    ("read", "unit_bytes", True, "'read.unit_bytes'"), ("read", "cache_bytes", 1e9, "'read.cache_bytes'"),
    ("read", "max_doc_bytes", 0, "'read.max_doc_bytes'"), ("read", "max_doc_bytes", "64MB", "'read.max_doc_bytes'"),
    ("read", "oversize", 1, "'read.oversize'"),
    ("storage", "cache_dir", 5, "'storage.cache_dir'"),
    ("storage", "cache_max_bytes", True, "'storage.cache_max_bytes'"),
    ("storage", "cache_block_bytes", True, "'storage.cache_block_bytes'"),
    ("storage", "retry_backoff_s", math.inf, "'storage.retry_backoff_s'"),
    ("sources", "name", 5, "'name'"), ("sources", "name", "", "'name'"), ("sources", "format", 5, "'format'"),
    ("sources", "text_field", 5, "'text_field'"), ("sources", "text_field", "", "'text_field'"),
    ("sources", "weight", math.inf, "'weight'"), ("sources", "weight", math.nan, "'weight'"),
    ("sources", "weight", 1e-300, "'weight'"), ("sources", "weight", "x", "'weight'"),
    ("sources", "weight", True, "'weight'"), ("sources", "weight", 0, "'weight'"),
    ("sources", "path", [], "'path'"), ("sources", "path", 5, "'path'"), ("sources", "path", "", "'path'"),
    ("sources", "path", ["a.jsonl", 3], "'path'"), ("sources", "path", [""], "'path'"),
]


@pytest.mark.parametrize("where,key,value,name", BAD_VALUES,
                         ids=[f"{w or 'top'}.{k}={v!r}" for w, k, v, _ in BAD_VALUES])
def test_every_recipe_value_is_type_checked(corpus, sp_model, where, key, value, name):
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    _set(data, where, key, value)
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(data, origin="/runs/r.toml")
    msg = str(info.value)
    assert msg.startswith("/runs/r.toml: ") and name in msg and repr(value) in msg, msg


def test_valid_values_at_the_edges_are_accepted(corpus, sp_model):
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model), "add_eos": True, "pad_id": 0})
    data["seed"] = 2**63 - 1
    data["sources"][0]["weight"] = 3  # an integer weight is a number like any other
    data["sources"][1]["weight"] = 1e-4  # the smallest the mixer's integer ratios keep
    data["read"] = {"max_doc_bytes": 1, "oversize": "truncate"}
    data["storage"] = {"retry_backoff_s": 0}
    r = recipe_from_dict(data)
    assert r.sources[0].weight == 3.0 and isinstance(r.sources[0].weight, float)
    assert (r.max_doc_bytes, r.oversize, r.seed) == (1, "truncate", 2**63 - 1)
    with pytest.raises(RecipeError, match=r"'seed' must be an integer in \[0, 2\*\*63\), got 9223372036854775808"):
        r.replace(seed=2**63)  # replace() validates too
    with pytest.raises(RecipeError, match=r"'lanes' must be a positive integer, got 2\.5 \(a float\)"):
        r.replace(lanes=2.5)
    with pytest.raises(RecipeError, match=r"read\.oversize 'drop' is not one of skip, truncate, error"):
        r.replace(oversize="drop")


ISSUE_EXAMPLES = [  # the recipe lines of issue 17, items 7 and 8, as written in a TOML file
    ("lanes = 2.5", "'lanes' must be a positive integer, got 2.5 (a float)"),
    ("lanes = true", "'lanes' must be a positive integer, got True (a boolean)"),
    ('lanes = "8"', "'lanes' must be a positive integer, got '8' (a string"),
    ("batch_per_lane = 1.5", "'batch_per_lane' must be a positive integer, got 1.5"),
    ('seed = "abc"', "'seed' must be an integer in [0, 2**63), got 'abc'"),
    ("weight = inf", "source 'web': 'weight' must be a finite number > 0, got inf"),
    ("weight = 1e-300", "source 'web': 'weight' = 1e-300 is too small"),
    ('weight = "x"', "source 'web': 'weight' must be a finite number > 0, got 'x'"),
    ("path = []", ("[[sources]] #1: 'path' must be a file, folder or glob as a non-empty string, or a non-empty "
                   "list of them, got []")),
    ("path = 5", "[[sources]] #1: 'path' must be a file, folder or glob"),
    ("pack = 3", "'pack' must be a table ([pack] and its keys), got 3"),
    ('add_eos = "no"', "'tokenizer.add_eos' must be true or false, got 'no'"),
]


@pytest.mark.parametrize("line,expect", ISSUE_EXAMPLES, ids=[line for line, _ in ISSUE_EXAMPLES])
def test_the_issues_bad_values_in_a_toml_file(tmp_path, sp_model, line, expect):
    top = {"seed": "seed = 7", "lanes": "lanes = 4", "batch_per_lane": "batch_per_lane = 2"}
    tok = {"add_eos": "add_eos = true"}
    src = {"weight": "weight = 1.0", "path": 'path = "data.jsonl"'}
    key = line.split(" =")[0]
    for table in (top, tok, src):
        if key in table:
            table[key] = line
    pack = line + "\n" if key == "pack" else ""
    text = "\n".join([*top.values(), "seq_len = 64", pack,
                      "[tokenizer]", 'kind = "sentencepiece"', f'path = "{sp_model}"', *tok.values(), "",
                      "[[sources]]", 'name = "web"', 'format = "jsonl"', *src.values(), ""])
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and expect in msg, msg


def test_weights_too_small_for_the_mixer_say_what_works(corpus, sp_model):
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    data["sources"][1]["weight"] = 4e-5  # Fraction(4e-5).limit_denominator(10_000) == 0
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(data)
    msg = str(info.value)
    assert "source 'code': 'weight' = 4e-05 is too small" in msg and "at least 0.0001" in msg
    assert "only their ratios matter" in msg


# -- 9. tokenizer files -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer_files(sp_model, hf_tokenizer, tiktoken_file) -> dict[str, Path]:
    return {"sentencepiece": sp_model, "huggingface": hf_tokenizer, "tiktoken": tiktoken_file}


MISMATCHES = [(k, f) for k in ("sentencepiece", "huggingface", "tiktoken")
              for f in ("sentencepiece", "huggingface", "tiktoken") if k != f]


@pytest.mark.parametrize("kind,file_kind", MISMATCHES)
def test_a_tokenizer_file_of_another_kind_is_named(tokenizer_files, kind, file_kind):
    path = tokenizer_files[file_kind]
    with pytest.raises(RecipeError) as info:
        load_tokenizer(TokenizerSpec(kind=kind, path=str(path)))
    msg = str(info.value)
    assert f"tokenizer.path = {path}" in msg and f"tokenizer.kind = '{kind}'" in msg
    assert f"Set tokenizer.kind = '{file_kind}'" in msg  # which kind the file looks like


@pytest.mark.parametrize("kind", ["sentencepiece", "huggingface", "tiktoken"])
@pytest.mark.parametrize("content", [bytes(range(256)) * 8, b"just some text\nnot a tokenizer\n", b"{\"a\": 1}"],
                         ids=["binary", "text", "json"])
def test_a_file_that_is_no_tokenizer_is_a_recipe_error(tmp_path, kind, content):
    path = tmp_path / "tok.bin"
    path.write_bytes(content)
    with pytest.raises(RecipeError) as info:
        load_tokenizer(TokenizerSpec(kind=kind, path=str(path)))
    msg = str(info.value)
    assert f"tokenizer.path = {path}" in msg and f"tokenizer.kind = '{kind}'" in msg
    assert "looks like none of the kinds" in msg


def test_a_missing_or_folder_tokenizer_path_fails_the_build_with_the_key(tmp_path, corpus, sp_model, hf_tokenizer):
    """Before: the recipe fingerprint hashed the file first, giving a bare '[Errno 2] No such file'."""
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(tmp_path / "nope.model")})
    with pytest.raises(RecipeError) as info:
        build_loader(recipe_from_dict(data), rank=0, world_size=1)
    assert isinstance(info.value, FileNotFoundError)  # what callers caught before
    assert f"tokenizer.path = {tmp_path / 'nope.model'}" in str(info.value) and "does not exist" in str(info.value)
    data["tokenizer"] = {"kind": "huggingface", "path": str(hf_tokenizer.parent)}
    with pytest.raises(RecipeError) as info:
        build_loader(recipe_from_dict(data), rank=0, world_size=1)
    msg = str(info.value)
    assert "is a directory" in msg and "tokenizer.json" in msg and "tokenizer.path" in msg


@pytest.mark.parametrize("kind", ["sentencepiece", "huggingface", "tiktoken"])
def test_pad_id_outside_the_vocabulary_is_refused(tokenizer_files, kind):
    path = str(tokenizer_files[kind])
    extra = tiktoken_options(tokenizer_files[kind]) if kind == "tiktoken" else {}
    vocab = load_tokenizer(TokenizerSpec(kind=kind, path=path, **extra)).vocab_size
    assert load_tokenizer(TokenizerSpec(kind=kind, path=path, pad_id=vocab - 1, **extra)).pad_id == vocab - 1
    with pytest.raises(RecipeError) as info:
        load_tokenizer(TokenizerSpec(kind=kind, path=path, pad_id=vocab, **extra))
    assert f"tokenizer.pad_id = {vocab} is outside [0, {vocab})" in str(info.value)


# -- 10. a recipe path that is a folder ----------------------------------------------------------------

def test_a_recipe_path_that_is_a_directory_says_so(tmp_path):
    folder = tmp_path / "recipes"
    folder.mkdir()
    with pytest.raises(RecipeError) as info:
        load_recipe(folder)
    assert isinstance(info.value, FileNotFoundError)
    assert f"recipe path {folder} is a directory" in str(info.value) and "not its folder" in str(info.value)
    (folder / "quickstart.toml").write_text("seed = 1\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(folder)
    assert "is a directory" in str(info.value) and str(folder / "quickstart.toml") in str(info.value)

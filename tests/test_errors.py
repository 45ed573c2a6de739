"""Bad input gets a clear, early error: it names the file, field, key or numbers and says what to do.

Each test builds a small corpus in ``tmp_path`` (real Parquet / JSON Lines / gzip / zstd files) and
checks the exception type and the content of its message. Errors in source files must surface as
:class:`zephon.SourceError` while planning or iterating, never as a hang (tests that could loop carry
a timeout), and nulls/empty records must be skipped, counted, and leave the batches elastic.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

import zephon as z
from zephon import RecipeError, SourceError, StateError, build_loader, load_recipe, merge_states, recipe_from_dict
from zephon.errors import OperatorError, PipelineError, RecipeFileError
from zephon.state import seal

from .conftest import base_recipe_dict
from zephon.verify import global_hashes

try:
    from tests.conftest import base_recipe_dict
except ImportError:  # tests/ is not a package
    from conftest import base_recipe_dict


# -- helpers ----------------------------------------------------------------------------------------

@pytest.fixture
def recipe_with(corpus, sp_model):
    """``recipe_with(sources, lanes=2, ...)``: the base recipe with these sources and top-level overrides."""

    def make(sources: list[dict], **top):
        data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
        data["sources"] = sources
        data.update(top)
        return recipe_from_dict(data)

    return make


def src(name: str, path, fmt: str, **kw) -> dict:
    return {"name": name, "path": str(path), "format": fmt, **kw}


def first_error(recipe, steps: int = 30, **kw) -> tuple[str, BaseException | None]:
    """Build rank 0 of 1 and iterate; return where it failed ("build" / "iterate") and the exception."""
    try:
        loader = build_loader(recipe, rank=0, world_size=1, **kw)
    except Exception as exc:  # noqa: BLE001 - returned to the test, which checks it
        return "build", exc
    try:
        for _ in range(steps):
            next(loader)
    except Exception as exc:  # noqa: BLE001
        return "iterate", exc
    finally:
        loader.close()
    return "none", None


def write_jsonl(path: Path, records: list, compress: str | None = None) -> bytes:
    raw = b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)
    data = gzip.compress(raw) if compress == "gz" else zstandard.ZstdCompressor().compress(raw) \
        if compress == "zst" else raw
    path.write_bytes(data)
    return raw


def good_records(corpus_texts: list[str], n: int, start: int = 0) -> list[dict]:
    return [{"id": k, "text": corpus_texts[(start + k) % len(corpus_texts)]} for k in range(n)]


def write_parquet(path: Path, columns: dict, row_group_size: int = 8) -> None:
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)


# -- world size, state ------------------------------------------------------------------------------

def test_world_size_that_does_not_divide_lanes(make_recipe):
    with pytest.raises(ValueError) as info:
        build_loader(make_recipe(), rank=0, world_size=3)
    msg = str(info.value)
    assert "world_size=3" in msg and "lanes=16" in msg
    assert "[1, 2, 4, 8, 16]" in msg  # the world sizes that would work


@pytest.mark.parametrize("field,value,old", [("seed", 8, 7), ("seq_len", 128, 64)])
def test_state_from_another_recipe(make_recipe, field, value, old):
    writer = build_loader(make_recipe(), rank=0, world_size=1)
    next(writer)
    state = json.loads(json.dumps(writer.state_dict()))
    reader = build_loader(make_recipe(**{field: value}), rank=0, world_size=1)
    with pytest.raises(StateError) as info:
        reader.load_state_dict(state)
    msg = str(info.value)
    label = {"seed": "seed", "seq_len": "(zephon.pack).seq_len"}[field]  # the operator, named, and its parameter
    assert f"{label}: checkpoint has {old}, this pipeline has {value}" in msg
    assert "different pipeline" in msg
    build_loader(make_recipe(), rank=0, world_size=1).load_state_dict(state)  # the right recipe loads it


def test_unmerged_state_on_another_world_size(make_recipe):
    recipe = make_recipe()
    ranks = [build_loader(recipe, rank=r, world_size=4) for r in range(4)]
    for ld in ranks:
        next(ld)
    target = build_loader(recipe, rank=0, world_size=1)
    with pytest.raises(StateError) as info:
        target.load_state_dict(ranks[0].state_dict())
    msg = str(info.value)
    assert "merge_states" in msg and "[4, 5, 6, 7, 8, 9, 10, 11]" in msg
    target.load_state_dict(merge_states([ld.state_dict() for ld in ranks]))  # merged: fine


# -- recipe ----------------------------------------------------------------------------------------

def test_missing_source_path(recipe_with, tmp_path):
    missing = tmp_path / "nope" / "data.jsonl"
    where, exc = first_error(recipe_with([src("docs", missing, "jsonl")]))
    assert where == "build" and isinstance(exc, SourceError)
    assert str(missing) in str(exc) and "does not exist" in str(exc) and "sources.path" in str(exc)
    assert "'docs'" in str(exc)


def test_source_glob_that_matches_nothing(recipe_with, tmp_path):
    (tmp_path / "data.parquet").write_bytes(b"")  # wrong extension for the glob
    pattern = tmp_path / "*.jsonl"
    where, exc = first_error(recipe_with([src("docs", pattern, "jsonl")]))
    assert where == "build" and isinstance(exc, SourceError)
    assert str(pattern) in str(exc) and "matches no jsonl files" in str(exc)
    # A directory holding no file of the source's format is the same mistake.
    where, exc = first_error(recipe_with([src("docs", tmp_path, "jsonl")]))
    assert where == "build" and isinstance(exc, SourceError) and ".jsonl" in str(exc)


def test_unknown_recipe_key_gets_a_suggestion(corpus, sp_model):
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    with pytest.raises(RecipeError, match=r"unknown key 'sead' in the top level\. Did you mean 'seed'\?"):
        recipe_from_dict({**data, "sead": 3})
    with pytest.raises(RecipeError, match=r"unknown key 'frobnicate'.*Allowed keys: .*lanes"):
        recipe_from_dict({**data, "frobnicate": 3})


def test_unknown_key_inside_pack(corpus, sp_model):
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    data["pack"] = {"algoritm": "wrap"}
    with pytest.raises(RecipeError, match=r"unknown key 'algoritm' in \[pack\]\. Did you mean 'algorithm'\?"):
        recipe_from_dict(data)


def test_bad_pack_algorithm(corpus, sp_model):
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    data["pack"] = {"algorithm": "greedy"}
    with pytest.raises(RecipeError, match=r"pack\.algorithm 'greedy' is not one of best_fit, first_fit, wrap"):
        recipe_from_dict(data)


@pytest.mark.parametrize("lanes", [0, -4])
def test_lanes_must_be_positive(corpus, sp_model, lanes):
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    with pytest.raises(RecipeError, match=rf"'lanes' must be a positive integer, got {lanes}"):
        recipe_from_dict({**data, "lanes": lanes})


def test_recipe_file_that_is_not_toml(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text('seed = 7\nlanes = 16\nseq_len = = 64\n[tokenizer\nkind = "sentencepiece"\n')
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    msg = str(info.value)
    assert str(path) in msg and "not valid TOML" in msg and "line 3" in msg


def test_recipe_file_errors_name_the_file(tmp_path, sp_model):
    path = tmp_path / "typo.toml"
    path.write_text(f'seed = 7\nlanes = 4\nseq_len = 64\n[tokenizer]\nkind = "sentencepiece"\n'
                    f'path = "{sp_model}"\n[pack]\nmax_open_bin = 4\n'
                    f'[[sources]]\nname = "a"\npath = "a.jsonl"\nformat = "jsonl"\n')
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert str(path) in str(info.value) and "Did you mean 'max_open_bins'?" in str(info.value)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "absent.toml"))):
        load_recipe(tmp_path / "absent.toml")


# -- Parquet ---------------------------------------------------------------------------------------

def test_parquet_without_the_text_column(recipe_with, tmp_path, corpus_texts):
    path = tmp_path / "notext.parquet"
    write_parquet(path, {"id": list(range(40)), "body": corpus_texts[:40]})
    where, exc = first_error(recipe_with([src("web", path, "parquet")]))
    # the footer says which columns there are: refused when the loader is built (graph/program.py, check_fields)
    assert where == "build" and isinstance(exc, SourceError), exc
    msg = str(exc)
    assert str(path) in msg and "no column 'text'" in msg and "columns: id, body" in msg
    assert "Set text_field" in msg


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers,runner", [(0, "thread"), (2, "thread"), (2, "pool"), (2, "process")])
def test_a_later_parquet_file_without_the_text_column(recipe_with, tmp_path, corpus_texts, num_workers, runner):
    """The build reads the first file's footer only; a later file without the column is refused by the lane that
    reads it, on whichever runner."""
    write_parquet(tmp_path / "a-good.parquet", {"text": corpus_texts[:40]})
    path = tmp_path / "b-notext.parquet"
    write_parquet(path, {"id": list(range(40)), "body": corpus_texts[40:80]})
    recipe = recipe_with([src("web", tmp_path, "parquet")])
    where, exc = first_error(recipe, num_workers=num_workers, runner=runner)
    assert where == "iterate" and isinstance(exc, SourceError), exc
    msg = str(exc)
    assert str(path) in msg and "no column 'text'" in msg and "columns: id, body" in msg
    assert "Set text_field" in msg


def test_parquet_text_column_that_is_not_text(recipe_with, tmp_path, corpus_texts):
    path = tmp_path / "ints.parquet"
    write_parquet(path, {"text": list(range(40)), "body": corpus_texts[:40]})
    where, exc = first_error(recipe_with([src("web", path, "parquet")]))
    assert where == "iterate" and isinstance(exc, SourceError), exc
    msg = str(exc)
    assert str(path) in msg and "'text'" in msg and "int64" in msg and "not a string" in msg
    # The fix it suggests works: point text_field at the text column.
    assert first_error(recipe_with([src("web", path, "parquet", text_field="body")]), steps=3) == ("none", None)


def _damage(path: Path, how: str) -> None:
    raw = path.read_bytes()
    if how == "garbage":
        path.write_bytes(np.random.default_rng(1).bytes(len(raw)))
    elif how == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    else:  # "pages": valid footer, every data page of the text column overwritten
        data = bytearray(raw)
        meta = pq.ParquetFile(path).metadata
        for g in range(meta.num_row_groups):
            cc = meta.row_group(g).column(0)
            first = cc.dictionary_page_offset or cc.data_page_offset
            data[first:first + cc.total_compressed_size] = np.random.default_rng(g).bytes(cc.total_compressed_size)
        path.write_bytes(bytes(data))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["garbage", "truncated", "pages"])
@pytest.mark.parametrize("lanes", [2, 16])
def test_corrupt_parquet_is_a_source_error(recipe_with, tmp_path, corpus_texts, how, lanes):
    good, bad = tmp_path / "a-good.parquet", tmp_path / "b-bad.parquet"
    write_parquet(good, {"text": corpus_texts[:60]})
    write_parquet(bad, {"text": corpus_texts[60:200]})
    _damage(bad, how)
    where, exc = first_error(recipe_with([src("web", tmp_path, "parquet")], lanes=lanes))
    assert isinstance(exc, SourceError), exc
    assert str(bad) in str(exc) and "re-write or remove" in str(exc).lower()
    if lanes == 2 or how == "pages":  # whole-file units (or a readable footer): found while reading
        assert where == "iterate"
    # with fewer files than lanes the planner reads the footers, so a broken footer fails the build


# -- JSON Lines -------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad,expect", [
    (b'{"id": 3, "text": "unterminated', "not valid JSON"),
    (b'["a", "list", "not", "an", "object"]', "a JSON object is expected, got list"),
    (b'{"id": 3, "body": "no text field here"}', "no field 'text' (fields: body, id)"),
    (b'{"id": 3, "text": 12345}', "field 'text' holds int, not text"),
])
def test_bad_jsonl_line_names_file_and_byte_offset(recipe_with, tmp_path, corpus_texts, bad, expect):
    path = tmp_path / "docs.jsonl"
    records = good_records(corpus_texts, 40)
    raw = write_jsonl(path, records[:25] + [bad] + records[25:])
    offset = raw.index(bad)
    where, exc = first_error(recipe_with([src("code", path, "jsonl")]))
    assert where == "iterate" and isinstance(exc, SourceError), exc
    msg = str(exc)
    assert str(path) in msg and f"byte {offset}:" in msg and expect in msg
    assert any(fix in msg for fix in ("Fix or remove", "fix or remove", "Set text_field", "Point text_field")), msg


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["gz", "zst"])
@pytest.mark.parametrize("lanes", [2, 16])
def test_truncated_compressed_jsonl(recipe_with, tmp_path, corpus_texts, kind, lanes):
    good, bad = tmp_path / f"a.jsonl.{kind}", tmp_path / f"b.jsonl.{kind}"
    write_jsonl(good, good_records(corpus_texts, 50), compress=kind)
    write_jsonl(bad, good_records(corpus_texts, 400, start=50), compress=kind)
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    where, exc = first_error(recipe_with([src("code", tmp_path, "jsonl")], lanes=lanes))
    assert isinstance(exc, SourceError), exc
    assert str(bad) in str(exc) and "corrupt or truncated" in str(exc)
    assert where == ("iterate" if lanes == 2 else "build")  # few files: lines are counted to plan


# -- empty records ----------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_nulls_and_empty_strings_are_skipped_counted_and_elastic(recipe_with, tmp_path, corpus_texts):
    (tmp_path / "web").mkdir()
    (tmp_path / "code").mkdir()
    for f in range(4):
        texts = corpus_texts[f * 50:(f + 1) * 50]
        texts = [None if k % 3 == 0 else "" if k % 4 == 1 else t for k, t in enumerate(texts)]
        write_parquet(tmp_path / "web" / f"{f}.parquet", {"text": pa.array(texts, pa.string())}, row_group_size=6)
    for f in range(2):
        records = []
        for k, r in enumerate(good_records(corpus_texts, 60, start=400 + 60 * f)):
            records.append(r)
            records.append([{"text": None}, {"text": ""}, b"", b"   "][k % 4])
        write_jsonl(tmp_path / "code" / f"{f}.jsonl", records)
    recipe = recipe_with([src("web", tmp_path / "web", "parquet", weight=0.6),
                          src("code", tmp_path / "code", "jsonl", weight=0.4)])
    steps = 6
    loader = build_loader(recipe, rank=0, world_size=1)
    for _ in range(steps):
        next(loader)
    m = loader.metrics()
    assert m["skipped_records"] > 0 and m["docs"] > 0 and len(m["source_token_share"]) == 2
    ranks = [build_loader(recipe, rank=r, world_size=4) for r in range(4)]
    for _ in range(steps):
        for ld in ranks:
            next(ld)
    assert sum(ld.metrics()["skipped_records"] for ld in ranks) == m["skipped_records"]  # lane-determined
    reference = global_hashes(recipe, 1, steps)
    assert len(set(reference)) == steps
    assert global_hashes(recipe, 4, steps) == reference


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", ["only_source", "second_source"])
def test_source_with_only_empty_records_is_an_error_not_a_loop(recipe_with, tmp_path, corpus_texts, layout):
    empty = tmp_path / "empty"
    empty.mkdir()
    for f in range(3):
        write_jsonl(empty / f"{f}.jsonl", [{"text": ""}, {"text": None}, b"", b"  "] * 30)
    sources = [src("blank", empty, "jsonl")]
    if layout == "second_source":
        write_parquet(tmp_path / "good.parquet", {"text": corpus_texts[:80]})
        sources = [src("good", tmp_path / "good.parquet", "parquet"), *sources]
    where, exc = first_error(recipe_with(sources))
    # found when the loader is built (zephon/plan.py, SourcePlan.check_has_text), before the first batch
    assert where == "build" and isinstance(exc, SourceError), exc
    assert "source 'blank' has no text: all 360 records" in str(exc) and "text_field" in str(exc)


def _reject(text: str) -> bool:
    return False


@pytest.mark.timeout(60)
def test_filter_that_rejects_everything_is_an_error_not_a_loop(make_recipe):
    where, exc = first_error(make_recipe(), text_filter=_reject)
    assert where == "iterate" and isinstance(exc, SourceError), exc
    assert "gave no document" in str(exc) and "filters" in str(exc)


def test_state_of_an_older_format_is_refused_with_the_fix(make_recipe):
    loader = build_loader(make_recipe(), rank=0, world_size=1)
    next(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    state["version"] = 1
    for lane in state["lanes"].values():
        del lane["carry"]
    with pytest.raises(StateError) as info:
        build_loader(make_recipe(), rank=0, world_size=1).load_state_dict(state)
    msg = str(info.value)
    assert "version 1" in msg and "reads version 4" in msg and "start the run afresh" in msg


@pytest.mark.e2e
@pytest.mark.parametrize("runner", ["pool", "process"])
def test_process_runner_in_a_script_without_main_guard(corpus, sp_model, tmp_path, runner):
    """forkserver/spawn workers import the main module again; an unguarded script must get the fix,
    not a bare 'exited with code 1' or BrokenProcessPool."""
    import subprocess
    import sys

    recipe = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    script = tmp_path / "train.py"
    script.write_text("import json\nimport zephon\n"
                      f"recipe = zephon.recipe_from_dict(json.loads({json.dumps(json.dumps(recipe))}))\n"
                      f"loader = zephon.build_loader(recipe, rank=0, world_size=1, num_workers=1, runner={runner!r})\n"
                      "next(iter(loader))\n")
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-3:]
    assert any("if __name__ == \"__main__\":" in line and "runner='thread'" in line for line in last), proc.stderr[-2000:]


def test_malformed_lane_state_names_the_lane_and_the_shape(make_recipe):
    loader = build_loader(make_recipe(), rank=0, world_size=1)
    next(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    del state["lanes"]["3"]["carry"]
    with pytest.raises(StateError, match="integrity check"):  # an edited state fails its digest first
        build_loader(make_recipe(), rank=0, world_size=1).load_state_dict(state)
    with pytest.raises(StateError) as info:  # and, digest recomputed (a tool that rewrites states), its shape
        build_loader(make_recipe(), rank=0, world_size=1).load_state_dict(seal(state))
    msg = str(info.value)
    assert "lane 3" in msg and "'carry'" in msg and "rows_since_flush, carry" in msg


# -- messages name sources by their name ------------------------------------------------------------

def _explode(columns: dict) -> dict:
    raise RuntimeError("boom")


def test_a_failing_map_batch_names_the_source(sp_model, corpus_texts):
    tok = z.tokenizer(str(sp_model))
    pipe = (z.Pipeline(seed=1, lanes=2)
            .source("notes", z.read.records([{"text": t} for t in corpus_texts[:20]]))
            .source("web", z.read.records([{"text": t} for t in corpus_texts[20:40]]))
            .map_batch(_explode, sources=["web"]).tokenize(tok).pack(seq_len=64).batch())
    with pytest.raises(OperatorError) as info:
        for _ in pipe.build(rank=0, world_size=1):
            pass
    msg = str(info.value)
    assert "the chunk of source 'web' at " in msg and "RuntimeError: boom" in msg and "on_error='skip'" in msg
    assert "source 1" not in msg


def test_a_bad_image_names_the_source(sp_model, corpus_texts):
    pytest.importorskip("PIL")
    records = [{"image": b"not an image at all", "text": t} for t in corpus_texts[:8]]
    pipe = (z.Pipeline(seed=1, lanes=1)
            .source("pics", z.read.records(records, columns=["image", "text"]))
            .decode_images("image", max_pixels=56 * 56, on_bad_image="raise")
            .tokenize(z.tokenizer(str(sp_model))).pack(seq_len=64).batch(pixels="lists"))
    with pytest.raises(SourceError) as info:
        next(pipe.build(rank=0, world_size=1))
    msg = str(info.value)
    assert "operator 'decode_images': source 'pics': " in msg and "field 'image': bad image" in msg, msg
    assert "on_bad_image='skip'" in msg and "source 0" not in msg


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' %}{% generation %}"
                 "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}")


def test_a_bad_conversation_in_the_lane_names_its_source(sp_model, tmp_path):
    good = [{"messages": [{"role": "user", "content": f"Question {k}?"},
                          {"role": "assistant", "content": f"Answer {k}."}]} for k in range(8)]
    write_jsonl(tmp_path / "chat.jsonl", good + [{"messages": "hello"}] + good)
    pipe = (z.Pipeline(seed=1, lanes=1)
            .source("chat", z.read.jsonl(str(tmp_path / "chat.jsonl"), columns=["messages"]))
            .mix(by="documents")  # tokenize_chat after the merge: it runs in the lane, a record at a time
            .tokenize_chat(z.tokenizer(str(sp_model)), CHAT_TEMPLATE).pack(seq_len=64).batch())
    with pytest.raises(SourceError) as info:
        for _ in pipe.build(rank=0, world_size=1):
            pass
    msg = str(info.value)
    assert "a record of source 'chat' in the lane" in msg and "must be a list of {role, content}" in msg, msg
    assert "on_error='skip'" in msg


def test_a_bad_stage_state_names_the_source(make_recipe):
    nodes = make_recipe().to_pipeline().lane_nodes(0)
    try:
        with pytest.raises(StateError, match=r"source 'code', stage 0: a stage buffer's state is \{'source'"):
            nodes.stages[1][0].reset({"upstream": 3})
    finally:
        nodes.close()


# -- pack without tokenize, missing fields: refused when the pipeline is built -----------------------

def test_pack_without_tokenize_is_refused_when_built(corpus, sp_model):
    pipe = z.Pipeline(seed=1, lanes=2).source("web", z.read.parquet(str(corpus / "web"))).pack(seq_len=64).batch()
    for check in (pipe.build, pipe.validate, pipe.compile):
        with pytest.raises(PipelineError) as info:
            check()
        msg = str(info.value)
        assert "operator 'pack' packs token ids (input_ids), but the records of source 'web' reach it untokenized" \
            in msg and "Add .tokenize(zephon.tokenizer(path)) before .pack()" in msg, msg
        assert "tokens_field='input_ids'" in msg
    # one source left out of a tokenize with sources=[...]: that source is named, and why
    two = (z.Pipeline(seed=1, lanes=2).source("web", z.read.parquet(str(corpus / "web")))
           .source("code", z.read.jsonl(str(corpus / "code" / "*.jsonl")))
           .tokenize(z.tokenizer(str(sp_model)), sources=["code"]).pack(seq_len=64, algorithm="wrap").batch())
    with pytest.raises(PipelineError, match=r"records of source 'web' reach it untokenized \(tokenize\(sources="
                                            r"\['code'\]\) leaves it out\)"):
        two.build()
    # split needs token ids too
    with pytest.raises(PipelineError, match=r"operator 'split' cuts documents by their token ids \(input_ids\), but "
                                            r"the records of source 'web' reach it untokenized.*before \.split\(\)"):
        z.Pipeline(seed=1, lanes=2).source("web", z.read.parquet(str(corpus / "web"))).split(32).pack(64).batch()\
            .build()


def test_a_pre_tokenized_source_needs_no_tokenize(tmp_path):
    write_parquet(tmp_path / "ids.parquet", {"input_ids": [[5, 6, 7, 8, 9]] * 40})
    pipe = (z.Pipeline(seed=1, lanes=2)
            .source("ids", z.read.parquet(str(tmp_path / "ids.parquet"), tokens_field="input_ids"))
            .pack(seq_len=8, algorithm="wrap").batch())
    batch = next(pipe.build(rank=0, world_size=1))
    assert batch["input_ids"][0].tolist() == [5, 6, 7, 8, 9, 5, 6, 7]


@pytest.mark.parametrize("bad,shown", [(-100, "-100"), (2 ** 33 + 7, str(2 ** 33 + 7))])
def test_token_ids_a_file_holds_outside_the_rows_range_are_an_error_naming_it(tmp_path, bad, shown):
    """A pre-tokenized file is untrusted: -100 was packed as a token, and 2**33 + 7 as 7."""
    write_parquet(tmp_path / "ids.parquet", {"input_ids": [[5, 6, 7]] * 5 + [[5, bad, 7]] + [[1, 2]] * 5})
    pipe = (z.Pipeline(seed=1, lanes=2)
            .source("ids", z.read.parquet(str(tmp_path / "ids.parquet"), tokens_field="input_ids"))
            .pack(seq_len=8, algorithm="wrap").batch())
    with pytest.raises(z.SourceError, match=rf"source 'ids': .*ids.parquet, row 5: the token id {shown} \(input_ids\) "
                                            rf"is outside \[0, 2\*\*31\).*fix the file, or read its text and tokenize it"):
        next(pipe.build(rank=0, world_size=1))


def test_pre_tokenized_sources_mix_by_tokens(tmp_path):
    """Token ids read from the files are token ids before the merge: the implied mix goes by tokens (as it did for
    one such source), an explicit mix(by='tokens') is accepted, and two such sources are no longer refused."""
    write_parquet(tmp_path / "a.parquet", {"input_ids": [[5, 6, 7, 8, 9]] * 40})
    write_parquet(tmp_path / "b.parquet", {"input_ids": [[1, 2]] * 40})

    def pipe(sources, mix=None):
        p = z.Pipeline(seed=1, lanes=2)
        for name in sources:
            p = p.source(name, z.read.parquet(str(tmp_path / f"{name}.parquet"), tokens_field="input_ids"))
        return (p.mix(by=mix) if mix else p).pack(seq_len=8, algorithm="wrap").batch()

    for sources in (["a"], ["a", "b"]):
        implied, tokens, documents = pipe(sources), pipe(sources, "tokens"), pipe(sources, "documents")
        assert implied.fingerprint == tokens.fingerprint != documents.fingerprint
        assert next(implied.build(rank=0, world_size=1))["input_ids"].shape == (2, 8)


def test_tokenizing_a_source_twice_is_refused_when_built(corpus, sp_model):
    tok = z.tokenizer(str(sp_model))
    pipe = (z.Pipeline(seed=1, lanes=2).source("web", z.read.parquet(str(corpus / "web")))
            .tokenize(tok, keep_field=True).tokenize(tok, name="again").pack(seq_len=64).batch())
    with pytest.raises(PipelineError, match=r"operator 'again' tokenizes the records of source 'web', which operator "
                                            r"'tokenize' tokenized already: tokenize each source once"):
        pipe.build()


def test_an_operator_field_the_source_lacks_is_refused_when_built(corpus, sp_model, tmp_path):
    tok = z.tokenizer(str(sp_model))
    first = min((corpus / "web").glob("*.parquet"))
    pipe = z.Pipeline(seed=1, lanes=2).source("web", z.read.parquet(str(corpus / "web"))).tokenize(tok, field="txt")
    for check in (pipe.pack(seq_len=64).batch().build, pipe.pack(seq_len=64).batch().validate):
        with pytest.raises(PipelineError) as info:
            check()
        msg = str(info.value)
        assert "operator 'tokenize' reads field 'txt', which the records of source 'web' do not have (they have " \
               f"text; {first} has columns " in msg and "Did you mean 'text'?" in msg, msg
        assert "Set tokenize(field=...)" in msg
    # a column the file has but the source does not read: the fix is to read it
    write_parquet(tmp_path / "two.parquet", {"text": ["a b c"] * 8, "body": ["d e f"] * 8})
    pipe = (z.Pipeline(seed=1, lanes=2).source("web", z.read.parquet(str(tmp_path / "two.parquet")))
            .tokenize(tok, field="body").pack(seq_len=64).batch())
    with pytest.raises(PipelineError, match=r"has columns text, body\)\. Did you mean 'body'\? Read that column too: "
                                            r"add 'body' to the source's columns=\[\.\.\.\]"):
        pipe.build()
    # JSON Lines has no schema, but what a source reads is declared: the same mistake is refused when built
    pipe = (z.Pipeline(seed=1, lanes=2).source("code", z.read.jsonl(str(corpus / "code" / "*.jsonl")))
            .filter_field(_keep, "txt").tokenize(tok).pack(seq_len=64).batch())
    with pytest.raises(PipelineError, match=r"operator 'filter_field:_keep' reads field 'txt', which the records of "
                                            r"source 'code' do not have \(they have text\)\. Did you mean 'text'\?"):
        pipe.build()


def _keep(value) -> bool:
    return True


@pytest.mark.parametrize("key", ["text_field", "columns"])
def test_a_source_column_the_file_lacks_is_refused_when_built(recipe_with, corpus, tmp_path, key):
    path = tmp_path / "docs.parquet"
    write_parquet(path, {"id": list(range(8)), "text": ["a b c"] * 8})
    value = "txt" if key == "text_field" else ["id", "txt"]
    where, exc = first_error(recipe_with([src("web", path, "parquet", **{key: value})]))
    assert where == "build" and isinstance(exc, SourceError), exc
    msg = str(exc)
    assert f"source 'web': {path} has no column 'txt' (columns: id, text). Did you mean 'text'?" in msg, msg
    assert ("Set text_field of this source" if key == "text_field" else "Fix the source's columns") in msg


def test_a_jsonl_field_the_records_lack_is_found_when_read(recipe_with, tmp_path, corpus_texts):
    """A JSON Lines file has no schema (its first record says nothing of the others): the field a source reads is
    looked for in each record, and a record without it is refused where it is, naming the line."""
    path = tmp_path / "docs.jsonl"
    write_jsonl(path, [{"body": t} for t in corpus_texts[:20]])
    where, exc = first_error(recipe_with([src("code", path, "jsonl")]))
    assert where == "iterate" and isinstance(exc, SourceError), exc
    assert re.search(rf"source 'code': {re.escape(str(path))}, byte \d+: no field 'text' \(fields: body\)\. Set "
                     rf"text_field of this source\.", str(exc)), exc


# -- empty sources, paths that name nothing --------------------------------------------------------

@pytest.mark.parametrize("files", [1, 5])
def test_a_source_of_empty_files_names_them_and_the_fix(tmp_path, sp_model, files):
    folder = tmp_path / "js"
    folder.mkdir()
    for k in range(files):
        (folder / f"{k}.jsonl").write_bytes(b"")
    pipe = (z.Pipeline(seed=1, lanes=2).source("js", z.read.jsonl(str(folder if files > 1 else folder / "0.jsonl")))
            .tokenize(z.tokenizer(str(sp_model))).pack(seq_len=64).batch())
    with pytest.raises(SourceError) as info:
        pipe.build()
    msg = str(info.value)
    if files == 1:
        assert f"source 'js' has no data: its only file {folder / '0.jsonl'} is empty (no jsonl records)" in msg, msg
        assert "remove the empty file or put data in" in msg
    else:
        listed = ", ".join(str(folder / f"{k}.jsonl") for k in range(3))
        assert f"source 'js' has no data: all its 5 files ({listed} and 2 more) are empty" in msg, msg
        assert "remove the empty files" in msg
    assert "Check the source's path or glob" in msg


def test_a_missing_path_says_what_it_is_relative_to(tmp_path, sp_model, monkeypatch, recipe_with):
    monkeypatch.chdir(tmp_path)
    pipe = (z.Pipeline(seed=1, lanes=2).source("web", z.read.parquet("data/web"))
            .tokenize(z.tokenizer(str(sp_model))).pack(seq_len=64).batch())
    with pytest.raises(SourceError) as info:
        pipe.build()
    msg = str(info.value)
    assert "source 'web': path 'data/web' does not exist. Fix the path given to zephon.read.<format>(...) " \
           f"(a relative path resolves against the current directory, {tmp_path})" in msg, msg
    assert "recipe" not in msg
    # in a recipe file, relative paths are joined to the recipe's folder, and the message says so
    folder = tmp_path / "recipes"
    folder.mkdir()
    recipe = folder / "r.toml"
    recipe.write_text(f'seed = 7\nlanes = 2\nseq_len = 64\n[tokenizer]\nkind = "sentencepiece"\npath = "{sp_model}"\n'
                      f'[[sources]]\nname = "web"\npath = "data/web"\nformat = "parquet"\n')
    where, exc = first_error(load_recipe(recipe))
    assert where == "build" and isinstance(exc, SourceError), exc
    assert f"Fix sources.path (relative paths resolve against the recipe's folder, {folder})" in str(exc), exc


# -- the accumulator checker without hypothesis ------------------------------------------------------

def test_check_accumulator_without_hypothesis_says_what_to_install(monkeypatch):
    from zephon.testing import check_accumulator

    monkeypatch.setitem(sys.modules, "hypothesis", None)  # `import hypothesis` now raises ImportError
    with pytest.raises(ModuleNotFoundError) as info:
        check_accumulator(lambda ctx: None, [{"x": 1}])
    msg = str(info.value)
    assert "check_accumulator needs the hypothesis package" in msg and "python -m pip install -e '.[test]'" in msg
    assert "check_one(factory, records, cuts)" in msg and info.value.name == "hypothesis"


# -- recipe keys: a typo gets a suggestion ----------------------------------------------------------

def _ops_recipe(sp_model, corpus, **change) -> dict:
    data = {"seed": 1, "lanes": 2,
            "sources": [{"name": "web", "path": str(corpus / "web"), "format": "parquet"}],
            "ops": [{"op": "tokenize", "tokenizer": str(sp_model)}, {"op": "pack", "seq_len": 64},
                    {"op": "batch", "rows_per_lane": 1}]}
    data.update(change)
    return data


@pytest.mark.parametrize("change,expect", [
    ({"ops": [{"op": "tokenise"}]}, r"\[\[ops\]\] #1: unknown op 'tokenise'; did you mean 'tokenize'\?"),
    ({"ops": [{"op": "pack", "seq_lne": 64}]}, (r"\[\[ops\]\] #1 \(op = 'pack'\): unknown key 'seq_lne'\. "
                                                r"Did you mean 'seq_len'\?")),
    ({"ops": [{"seq_len": 64}]}, (r"\[\[ops\]\] #1: no 'op': each \[\[ops\]\] table names its operator, "
                                  r"op = \"<name>\" \(one of .*pack.*\), and gives its arguments as the other keys "
                                  r"\(here: seq_len\)")),
    ({"laness": 2}, r"unknown key 'laness' in the top level of an \[\[ops\]\] recipe.*Did you mean 'lanes'\?"),
    ({"sources": [{"name": "web", "path": "x", "fromat": "parquet"}]},
     r"unknown key 'fromat' in \[\[sources\]\] #1\. Did you mean 'format'\?"),
])
def test_ops_recipe_typos_get_a_suggestion(sp_model, corpus, change, expect):
    with pytest.raises(RecipeError, match=expect):
        recipe_from_dict(_ops_recipe(sp_model, corpus, **change))


def test_classic_recipe_source_key_typo_gets_a_suggestion(corpus, sp_model):
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    data["sources"][1]["text_feild"] = "text"
    with pytest.raises(RecipeError, match=r"unknown key 'text_feild' in \[\[sources\]\] #2\. Did you mean "
                                          r"'text_field'\?"):
        recipe_from_dict(data)


def test_ops_recipe_tokenizer_errors_name_the_table(sp_model, corpus, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'seed = 1\nlanes = 2\n[[sources]]\nname = "web"\npath = "{corpus / "web"}"\n'
                      f'format = "parquet"\n[[ops]]\nop = "tokenize"\ntokenizer = "tok/absent.model"\n'
                      f'[[ops]]\nop = "pack"\nseq_len = 64\n[[ops]]\nop = "batch"\n')
    with pytest.raises(RecipeFileError) as info:
        load_recipe(recipe)
    msg = str(info.value)
    assert f"{recipe}: [[ops]] #1 (op = 'tokenize'): 'tokenizer': tokenizer file not found: " \
           f"{tmp_path / 'tok' / 'absent.model'} does not exist. Fix the path (in a recipe file, relative paths " \
           f"resolve against its folder)." in msg, msg
    recipe.write_text(recipe.read_text().replace('"tok/absent.model"', f'{{ kind = "tiktoken", path = "{sp_model}" }}'))
    with pytest.raises(RecipeError, match=r"\[\[ops\]\] #1 \(op = 'tokenize'\): 'tokenizer': .*the file looks like "
                                          r"a SentencePiece model .*, not a tiktoken BPE file.*Pass "
                                          r"kind='sentencepiece'"):
        load_recipe(recipe)


# -- the first hour: tokenizers, ranks, batch arguments ---------------------------------------------

def test_a_tokenizer_of_the_wrong_kind_is_refused_when_declared(sp_model, corpus):
    with pytest.raises(PipelineError, match=r"kind='huggingface'\): the file looks like a SentencePiece model .*not a "
                                            r"Hugging Face tokenizer\.json.*Pass kind='sentencepiece' \(or leave kind "
                                            r"out: it is told from the file\)"):
        z.tokenizer(str(sp_model), kind="huggingface")
    with pytest.raises(PipelineError, match=r"kind='sentencepeice'\): kind must be one of sentencepiece, huggingface, "
                                            r"tiktoken\. Did you mean 'sentencepiece'\?"):
        z.tokenizer(str(sp_model), kind="sentencepeice")
    data = min((corpus / "web").glob("*.parquet"))
    with pytest.raises(PipelineError, match=r"the file is none of the kinds Zephon reads \(a SentencePiece \.model, "
                                            r"a Hugging Face tokenizer\.json, a tiktoken \.tiktoken BPE file\)\. Point "
                                            r"it at the tokenizer file"):
        z.tokenizer(str(data))


@pytest.mark.parametrize("rank,world_size,error,expect", [
    ("0", 1, TypeError, r"rank='0': the data-parallel rank must be an int, got str \(e\.g\. int\(os\.environ"),
    (0, 2.0, TypeError, r"world_size=2\.0: the data-parallel world size must be an int, got float"),
    (5, 2, ValueError, (r"rank=5 is outside \[0, world_size=2\): pass this process's rank in its data-parallel "
                        r"group, 0 to 1")),
])
def test_rank_and_world_size_errors_say_what_is_needed(make_recipe, rank, world_size, error, expect):
    with pytest.raises(error, match=expect):
        build_loader(make_recipe(), rank=rank, world_size=world_size)


@pytest.mark.parametrize("call,expect", [
    (lambda p: p.batch("2"), r"batch\(rows_per_lane=\.\.\.\) must be a positive integer, got '2'"),
    (lambda p: p.batch(0), r"batch\(rows_per_lane=\.\.\.\) must be a positive integer, got 0"),
    (lambda p: p.batch(1, partial="keep"), r"batch\(partial='keep'\): use one of \('drop', 'pad'\)"),
    (lambda p: p.pack(seq_len="64"), r"pack\(seq_len=\.\.\.\) must be a positive integer, got '64'"),
])
def test_builder_arguments_of_the_wrong_type_name_the_argument(corpus, sp_model, call, expect):
    pipe = (z.Pipeline(seed=1, lanes=2).source("web", z.read.parquet(str(corpus / "web")))
            .tokenize(z.tokenizer(str(sp_model))))
    if "batch" in expect:
        pipe = pipe.pack(seq_len=64)
    with pytest.raises(PipelineError, match=expect):
        call(pipe)

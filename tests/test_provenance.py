"""Provenance: ``batch(provenance=True)``, ``zephon.trace``, ``zephon.locate`` and ``zephon.diff``.

The corpus is built so that every record names itself: record ``r`` of file ``f`` has the text
``"<f r> ..."``. A segment's provenance is checked against the truth by reading its record back from its
file (Parquet row, or JSON Lines byte offset), tokenizing it with the pipeline's tokenizer and comparing
the token range with the ids the batch delivered; and by the name the record's text carries.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zephon as z
from zephon._perm import inverse_index, permute_index
from zephon.batches.rows import select_rows
from zephon.cli import main as cli
from zephon.origins import PROVENANCE_COLUMNS, file_id, pattern_root, relative_file, source_root
from zephon.provenance.segments import Namer
from zephon.tokenization import load_tokenizer
from zephon.verify import global_hashes

WORLD_SIZES = [1, 2, 4, 8, 16, 32]
FILLER = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "a", "careful", "reader", "counts", "every", "word", "of", "it", "and", "wonders", "where", "each", "sentence", "came", "from"]


def _text(tag: str, k: int) -> str:
    return f"<{tag}> " + " ".join(FILLER[(k + i) % len(FILLER)] for i in range(3 + (k * 7) % 40))


@pytest.fixture(scope="module")
def identity(tmp_path_factory) -> Path:
    """``web/part-{f}.parquet`` (4 files x 30 rows, row groups of 8) and ``code/part-{f}.jsonl`` (3 files x 25
    lines); a record's text starts with ``<w{f} {row}>`` or ``<c{f} {line}>``."""
    root = tmp_path_factory.mktemp("identity")
    (root / "web").mkdir()
    (root / "code").mkdir()
    for f in range(4):
        texts = [_text(f"w{f} {r}", 13 * f + r) for r in range(30)]
        pq.write_table(pa.table({"text": texts}), root / "web" / f"part-{f}.parquet", row_group_size=8)
    for f in range(3):
        lines = [json.dumps({"text": _text(f"c{f} {k}", 7 * f + k)}) for k in range(25)]
        (root / "code" / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def pipeline(root: Path, sp_model: Path, algorithm: str = "wrap", passes: int | None = None,
             partial: str = "drop") -> z.Pipeline:
    tok = z.tokenizer(str(sp_model))
    return (z.Pipeline(seed=5, lanes=32, flush_every=2)
            .source("web", z.read.parquet(str(root / "web"), chunk_rows=8), weight=0.6, passes=passes)
            .source("code", z.read.jsonl(str(root / "code" / "*.jsonl"), chunk_bytes=600), weight=0.4, passes=passes)
            .tokenize(tok).split(max_tokens=24).mix(by="tokens")
            .pack(seq_len=40, algorithm=algorithm).batch(rows_per_lane=1, partial=partial, provenance=True))


class Truth:
    """Records read back from the identity corpus, tokenized as the pipeline does."""

    def __init__(self, root: Path, sp_model: Path) -> None:
        self.root = root
        self.tok = load_tokenizer(z.tokenizer(str(sp_model)))
        self._tables: dict[str, list[str]] = {}

    def text(self, source: str, file: str, record: int) -> str:
        path = self.root / source / file
        if source == "web":
            if file not in self._tables:
                self._tables[file] = pq.read_table(path).column("text").to_pylist()
            return self._tables[file][record]
        data = path.read_bytes()
        return json.loads(data[record:data.index(b"\n", record)])["text"]

    def tag(self, source: str, file: str, record: int) -> str:
        f = file.split("-")[1].split(".")[0]
        if source == "web":
            return f"<w{f} {record}>"
        line = (self.root / source / file).read_bytes()[:record].count(b"\n")
        return f"<c{f} {line}>"

    def check(self, seg: z.Segment) -> None:
        text = self.text(seg.source, seg.file, seg.record)
        assert text.startswith(self.tag(seg.source, seg.file, seg.record))
        ids, _ = self.tok.encode([text])
        a, b = seg.tokens
        assert np.array_equal(ids[a:b], seg.token_ids), (seg, ids[a:b], seg.token_ids)


@pytest.fixture(scope="module")
def truth(identity, sp_model) -> Truth:
    return Truth(identity, sp_model)


def test_origins_helpers():
    assert pattern_root("/d/web/*.parquet", False) == "/d/web"
    assert pattern_root("/d/web", True) == "/d/web"
    assert pattern_root("/d/web/a.parquet", False) == "/d/web"
    assert pattern_root("s3://b/x/**/*.jsonl", False) == "s3://b/x"
    assert source_root(["/d/web", "/d/code"]) == "/d"
    assert source_root(["/d/web"]) == "/d/web"
    assert relative_file("/d/web/a/b.parquet", "/d/web") == "a/b.parquet"
    assert relative_file("/elsewhere/b.parquet", "/d/web") == "/elsewhere/b.parquet"
    assert 0 <= file_id("a/b.parquet") < 2 ** 63 and file_id("a/b.parquet") != file_id("a/c.parquet")


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.integers(0, 2 ** 63 - 1), st.data())
def test_inverse_index_undoes_permute_index(n, key, data):
    i = data.draw(st.integers(0, n - 1))
    assert inverse_index(permute_index(i, n, key), n, key) == i


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 60), st.integers(0, 2 ** 32), st.integers(0, 3))
def test_where_read_is_the_inverse_of_the_lane_routing(lanes, units, seed, pass_no):
    from zephon.plan import SourcePlan

    sp = SourcePlan.__new__(SourcePlan)  # the routing math only: no files
    sp.lanes, sp.seed, sp.key, sp.units = lanes, seed, 77, list(range(units))
    for u in range(units):
        lane, i = sp.where_read(u, pass_no)
        assert sp.lane_unit(lane, i) == u
        assert pass_no * units <= sp.stream_position(lane, i) < (pass_no + 1) * units


def test_provenance_is_the_truth_and_changes_no_other_byte(identity, sp_model, truth):
    pipe = pipeline(identity, sp_model)
    plain = pipe.replace(provenance=False)
    assert pipe.fingerprint == plain.fingerprint  # a checkpoint resumes with it on or off
    with pipe.build(0, 1) as with_prov, plain.build(0, 1) as without:
        for step, (a, b) in enumerate(zip(with_prov, without)):
            assert set(a) - set(b) == {"provenance"}
            assert all(torch.equal(a[k], b[k]) for k in b if isinstance(b[k], torch.Tensor))
            table = a["provenance"]
            assert table.dtype == torch.int64 and table.shape[1] == len(PROVENANCE_COLUMNS)
            # one entry per segment, in row order, with the segment's length
            counts = a["segment_ids"].amax(dim=1)
            assert torch.equal(torch.bincount(table[:, 0], minlength=32), counts)
            lengths = torch.stack([(a["segment_ids"][r] == s + 1).sum() for r, s, *_ in table.tolist()])
            assert torch.equal(lengths, table[:, 6] - table[:, 5])
            if step == 3:
                break
    segments = z.trace(pipe, step=2)
    assert len(segments) > 60 and {s.source for s in segments} == {"web", "code"}
    assert any(s.tokens[0] > 0 for s in segments), "the corpus should make pieces (split, row ends)"
    for seg in segments:
        truth.check(seg)


@pytest.mark.parametrize("algorithm", ["wrap", "best_fit"])
def test_provenance_is_the_same_on_every_world_size_and_resume(identity, sp_model, algorithm):
    pipe = pipeline(identity, sp_model, algorithm)
    reference = global_hashes(pipe, 1, 6)  # global_digest hashes the provenance tensor like any other key
    for w in WORLD_SIZES[1:]:
        assert global_hashes(pipe, w, 6) == reference, w
    assert global_hashes(pipe, 4, 6, resume_at=3, resume_world_size=8) == reference
    assert global_hashes(pipe, 32, 6, resume_at=2, resume_world_size=2, num_workers=2) == reference
    # and with the provenance left out, the hashes are the pipeline's usual ones (a different tensor set)
    assert global_hashes(pipe.replace(provenance=False), 1, 6) != reference


def test_trace_agrees_with_the_loader_at_random_steps(identity, sp_model, truth):
    pipe = pipeline(identity, sp_model, "best_fit")
    with pipe.build(0, 1) as loader:
        batches = [b for b, _ in zip(loader, range(12))]
        state_at_6 = None
    with pipe.build(0, 1) as loader:
        it = iter(loader)
        for _ in range(6):
            next(it)
        state_at_6 = json.loads(json.dumps(loader.state_dict()))
    rng = random.Random(3)
    for step in rng.sample(range(12), 4):
        rows = sorted(rng.sample(range(32), 3))
        got = z.trace(pipe, step=step, rows=rows, state=state_at_6 if step >= 6 else None)
        table = batches[step]["provenance"]
        want = [e for e in table.tolist() if e[0] in rows]
        assert [(s.row, s.segment, s.record, *s.tokens) for s in got] == [(e[0], e[1], e[4], e[5], e[6]) for e in want]
        for seg in got:
            positions = batches[step]["segment_ids"][seg.row] == seg.segment + 1
            assert np.array_equal(batches[step]["input_ids"][seg.row][positions].numpy(), seg.token_ids)
            truth.check(seg)
    with pytest.raises(ValueError, match="saved at step 6, after it"):
        z.trace(pipe, step=3, rows=[0], state=state_at_6)
    with pytest.raises(ValueError, match=r"rows 0\.\.31"):
        z.trace(pipe, step=0, rows=[32])


def test_locate_finds_every_record_of_a_one_pass_source_exactly_once(identity, sp_model):
    pipe = pipeline(identity, sp_model, "best_fit", passes=1, partial="pad")  # pad: every record is delivered
    landings: dict[tuple[str, str, int], list[tuple[int, int, int, int]]] = {}
    names = pipe.compile().names
    with pipe.build(0, 1) as loader:  # the truth: every landing of every record, from the whole loader
        namer = Namer(loader.program)
        for step, batch in enumerate(loader):
            for row, seg, src, fid, record, a, b in batch["provenance"].tolist():
                if seg >= 0:
                    key = (names[src], namer.file(src, fid)[0], record)
                    landings.setdefault(key, []).append((step, row, a, b))
    every = [("web", f"part-{f}.parquet", r) for f in range(4) for r in range(30)]
    for f in range(3):
        data = (identity / "code" / f"part-{f}.jsonl").read_bytes()
        every += [("code", f"part-{f}.jsonl", k) for k in [0] + [i + 1 for i, c in enumerate(data[:-1]) if c == 10]]
    assert sorted(landings) == sorted(every)
    # one pass: a record's pieces tile its tokens exactly once (best fit may deliver a later piece first)
    for key, found in landings.items():
        spans = sorted((a, b) for *_, a, b in found)
        assert spans[0][0] == 0 and all(p[1] == q[0] for p, q in itertools.pairwise(spans)), (key, spans)
    for key in random.Random(7).sample(every, 24):
        loc = z.locate(pipe, *key)
        assert [(x.step, x.row, *x.tokens) for x in loc] == landings[key], key
        assert loc.tokens == sum(b - a for *_, a, b in landings[key]) and loc.dropped_by is None and not loc.reason


def test_locate_says_when_the_data_ended_first(identity, sp_model):
    pipe = pipeline(identity, sp_model, "best_fit", passes=1)  # drop: the last, partial global batch is not delivered
    with pipe.build(0, 1) as loader:
        steps = sum(1 for _ in loader)
    late = [x for x in (z.locate(pipe, "web", f"part-{f}.parquet", r) for f in range(4) for r in (6, 14, 22, 29))
            if x.reason]
    assert late, "some record should fall in the dropped batch"
    for loc in late:
        assert "data ended" in loc.reason and all(x.step < steps for x in loc)


def test_locate_names_the_operator_that_dropped_a_record(identity, sp_model):
    pipe = pipeline(identity, sp_model)
    dropping = (z.Pipeline(seed=5, lanes=32, flush_every=2)
                .source("web", z.read.parquet(str(identity / "web"), chunk_rows=8))
                .filter_field(_not_row_7, "text", name="no row 7")
                .tokenize(z.tokenizer(str(sp_model))).pack(seq_len=40).batch(provenance=True))
    loc = z.locate(dropping, "web", "part-2.parquet", 7)
    assert list(loc) == [] and loc.dropped_by == "no row 7" and "made nothing" in loc.reason
    assert len(z.locate(dropping, "web", "part-2.parquet", 8)) >= 1
    with pytest.raises(ValueError, match="did you mean 'web'"):
        z.locate(pipe, "wbe", "part-2.parquet", 7)
    with pytest.raises(ValueError, match="no such file"):
        z.locate(pipe, "web", "part-9.parquet", 7)
    with pytest.raises(ValueError, match="records near it start at"):
        z.locate(pipe, "code", "part-0.jsonl", 3)  # a byte inside the first line


def _not_row_7(text: str) -> bool:
    return not text.startswith("<w2 7>")


def test_diff_finds_the_step_of_a_mid_run_set_mixture(identity, sp_model):
    pipe = pipeline(identity, sp_model, "best_fit")
    with pipe.build(0, 1) as loader:
        it = iter(loader)
        for _ in range(4):
            next(it)
        before = json.loads(json.dumps(loader.state_dict()))
        loader.set_mixture({"web": 0.1, "code": 0.9}, at_step=9)
        after = json.loads(json.dumps(loader.state_dict()))
    report = z.diff(pipe, pipe, 12, state_a=before, state_b=after)
    # the truth, from both runs' global batches and each lane's rows, step by step
    digests, lane_rows = {}, {}
    for name, state in (("a", before), ("b", after)):
        with pipe.build(0, 1) as loader:
            loader.load_state_dict(state)
            batches = list(itertools.islice(loader, 12))
        digests[name] = [z.batch_digest(b) for b in batches]
        lane_rows[name] = [[b["input_ids"][lane].numpy().tobytes() + b["provenance"][b["provenance"][:, 0] == lane]
                            .numpy().tobytes() for lane in range(32)] for b in batches]
    first = next(k for k in range(12) if digests["a"][k] != digests["b"][k]) + 4
    assert report.first_step == first >= 9, report.summary()  # never before the change: the step clock
    assert report.lanes == [lane for lane in range(32) if lane_rows["a"][first - 4][lane] != lane_rows["b"][first - 4][lane]]
    assert report.steps == 12 and report.lanes and min(report.first_step_of_lane.values()) == first
    for name in ("web", "code"):  # identical up to the change, by source and step
        assert np.array_equal(report.tokens_a[name][:5], report.tokens_b[name][:5])
    after_change = slice(5, 12)  # steps 9.. (the report starts at step 4)
    share = lambda t: t["code"][after_change].sum() / (t["code"][after_change].sum() + t["web"][after_change].sum())
    assert share(report.tokens_b) > share(report.tokens_a)
    same = z.diff(pipe, pipe, 5)
    assert same.first_step is None and same.lanes == []
    seeded = z.diff(pipe, pipe.replace(seed=6), 3)
    assert seeded.first_step == 0


def test_metrics_report_the_delivered_mixture(identity, sp_model):
    pipe = pipeline(identity, sp_model).replace(provenance=False)
    with pipe.build(0, 1) as loader:
        batches = list(itertools.islice(loader, 5))
        share = loader.metrics()["mixture_delivered_share"]
    tokens = z.diff(pipe, pipe, 5).tokens_a
    total = sum(int(v.sum()) for v in tokens.values())
    assert share == pytest.approx({k: int(v.sum()) / total for k, v in tokens.items()})
    assert len(batches) == 5


def test_record_rows_carry_their_records_provenance(identity):
    pipe = (z.Pipeline(seed=2, lanes=8)
            .source("web", z.read.parquet(str(identity / "web"), chunk_rows=8))
            .batch(rows_per_lane=2, provenance=True))
    with pipe.build(0, 1) as loader:
        batch = next(iter(loader))
    table = batch["provenance"]
    assert table[:, 0].tolist() == list(range(16)) and (table[:, 1] == 0).all()
    for (row, _, _, fid, record, a, b), text in zip(table.tolist(), batch["text"]):
        f = text.split()[0][2:]
        assert text.startswith(f"<w{f} {record}>") and fid == file_id(f"part-{f}.parquet") and (a, b) == (0, 0)
    assert global_hashes(pipe, 1, 3) == global_hashes(pipe, 4, 3) == global_hashes(pipe, 8, 3, resume_at=1,
                                                                                     resume_world_size=2)
    segments = z.trace(pipe, step=0, rows=[3])
    assert len(segments) == 1 and segments[0].text == batch["text"][3] and segments[0].coord == "row"


def test_select_rows_keeps_each_micro_batchs_provenance(identity, sp_model):
    pipe = pipeline(identity, sp_model)
    with pipe.build(1, 4) as loader:  # lanes 8..15
        batch = next(iter(loader))
    parts = [select_rows(batch, slice(k, k + 2)) for k in range(0, 8, 2)]
    assert torch.equal(torch.cat([p["provenance"] for p in parts]), batch["provenance"])
    assert parts[1]["provenance"][:, 0].unique().tolist() == [10, 11]  # global rows


def test_chat_segments_name_their_conversation(tmp_path, sp_model):
    from .test_chat import CHATML

    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"<q {k}> what is {FILLER[k % 10]}"},
                          {"role": "assistant", "content": " ".join(FILLER[:3 + k % 9])}]} for k in range(40)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    offsets = [0]
    for line in path.read_bytes().split(b"\n")[:-2]:
        offsets.append(offsets[-1] + len(line) + 1)
    pipe = (z.Pipeline(seed=1, lanes=4)
            .source("chat", z.read.jsonl(str(path), columns=["messages"]))
            .tokenize_chat(z.tokenizer(str(sp_model)), CHATML).split(max_tokens=30)
            .pack(seq_len=48, algorithm="wrap").batch(rows_per_lane=1, provenance=True))
    chat = pipe.ops[0]
    chat.setup()
    segments = z.trace(pipe, step=1)
    assert segments and any(seg.tokens[0] > 0 for seg in segments)
    for seg in segments:  # each piece is the token range of its own conversation, as tokenize_chat encodes it
        k = offsets.index(seg.record)
        ids, _ = chat.encode(rows[k]["messages"])
        a, b = seg.tokens
        assert np.array_equal(ids[a:b], seg.token_ids), k
    assert global_hashes(pipe, 1, 4) == global_hashes(pipe, 4, 4) == global_hashes(pipe, 2, 4, resume_at=2,
                                                                                     resume_world_size=4)


def test_image_segments_name_their_record_and_images(tmp_path, corpus_texts):
    pytest.importorskip("PIL")
    from zephon.demo.vl import train_vl_tokenizer
    from zephon.imaging import decode_image

    from .vision_data import crop, encode, pictures

    pics = pictures()
    table = {"image": [encode(crop(pics, k, 56 + 8 * (k % 3), 64)) for k in range(24)],
             "caption": [f"<i {k}> a picture of {FILLER[k % 12]}" for k in range(24)]}
    pq.write_table(pa.table(table), tmp_path / "pairs.parquet", row_group_size=6)
    tok = z.tokenizer(str(train_vl_tokenizer(tmp_path / "tok.model", corpus_texts, vocab_size=600)))
    pipe = (z.Pipeline(seed=3, lanes=4)
            .source("pairs", z.read.parquet(str(tmp_path / "pairs.parquet"), columns=["image", "caption"],
                                            chunk_rows=4))
            .decode_images("image", max_pixels=28 * 28 * 4, merge=2)
            .tokenize_images(tok, "caption", image_start="<|vision_start|>", image_pad="<|image_pad|>",
                             image_end="<|vision_end|>")
            .pack(seq_len=64, max_images_per_row=2).batch(rows_per_lane=1, provenance=True))
    decode = pipe.ops[0]
    segments = z.trace(pipe, step=0)
    assert segments and all(len(s.images) == 1 for s in segments)
    for seg in segments:  # the caption names the record; the image's grid is the record's own image's
        assert seg.file == "pairs.parquet" and f"<i {seg.record}>" in seg.text
        h, w, _ = decode_image(table["image"][seg.record], decode._spec).shape
        assert seg.images[0]["grid_thw"] == [1, h // decode.patch_size, w // decode.patch_size]
    assert global_hashes(pipe, 1, 3) == global_hashes(pipe, 4, 3) == global_hashes(pipe, 2, 3, resume_at=1,
                                                                                     resume_world_size=4)


def test_the_command_line_traces_locates_and_diffs(identity, sp_model, tmp_path, capsys):
    recipe = tmp_path / "id.toml"
    recipe.write_text(pipeline(identity, sp_model, "best_fit").to_recipe())
    assert cli(["trace", str(recipe), "--step", "2", "--row", "3,4", "--json"]) == 0
    segments = json.loads(capsys.readouterr().out)
    assert {s["row"] for s in segments} == {3, 4} and all(s["text"] for s in segments)
    first = segments[0]
    assert cli(["locate", str(recipe), "--source", first["source"], "--file", first["file"], "--record",
                str(first["record"]), "--json"]) == 0
    loc = json.loads(capsys.readouterr().out)
    assert any(x["step"] == 2 and x["row"] == first["row"] for x in loc["landings"])
    other = tmp_path / "other.toml"
    other.write_text(recipe.read_text().replace("seed = 5", "seed = 6"))
    assert cli(["diff", str(recipe), str(recipe), "--steps", "3"]) == 0
    assert "identical for all 3 steps" in capsys.readouterr().out
    png = tmp_path / "d.png"
    assert cli(["diff", str(recipe), str(other), "--steps", "3", "--plot", str(png)]) == 1
    assert "first differing step: 0" in capsys.readouterr().out and png.stat().st_size > 1000


def test_a_recipe_key_turns_provenance_on(identity, sp_model, tmp_path):
    recipe = z.recipe_from_dict({
        "seed": 1, "lanes": 4, "seq_len": 32, "provenance": True,
        "tokenizer": {"kind": "sentencepiece", "path": str(sp_model)},
        "sources": [{"name": "web", "path": str(identity / "web"), "format": "parquet", "text_field": "text"}]})
    with z.build_loader(recipe, 0, 1) as loader:
        assert "provenance" in next(iter(loader))
    with pytest.raises(z.RecipeError, match="'provenance' must be true or false"):
        z.recipe_from_dict({**recipe_dict_of(recipe), "provenance": "yes"})


def recipe_dict_of(recipe: Any) -> dict[str, Any]:
    return {"seed": 1, "lanes": 4, "seq_len": 32, "tokenizer": {"kind": "sentencepiece", "path": recipe.tokenizer.path},
            "sources": [{"name": "web", "path": list(recipe.sources[0].path), "format": "parquet",
                         "text_field": "text"}]}


def test_the_plugins_hand_the_provenance_to_the_user(identity, sp_model):
    zephon_megatron = pytest.importorskip("zephon_megatron")
    pipe = pipeline(identity, sp_model)
    with pipe.build(1, 2) as reference:  # lanes 16..31
        want = next(iter(reference))["provenance"]
    with pipe.build(1, 2) as loader:
        micro = zephon_megatron.MegatronBatches(loader, 4, 4, pad_id=0)
        parts = [next(micro) for _ in range(4)]
    assert all(set(p["provenance"][:, 0].tolist()) == set(range(16 + 4 * k, 20 + 4 * k)) for k, p in enumerate(parts))
    assert torch.equal(torch.cat([p["provenance"] for p in parts]), want)


def test_trace_decodes_each_source_with_its_own_tokenizer(identity, sp_model, hf_tokenizer):
    sp, hf = z.tokenizer(str(sp_model)), z.tokenizer(str(hf_tokenizer))
    pipe = (z.Pipeline(seed=5, lanes=8)
            .source("web", z.read.parquet(str(identity / "web"), chunk_rows=8), weight=0.5)
            .source("code", z.read.jsonl(str(identity / "code" / "*.jsonl"), chunk_bytes=600), weight=0.5)
            .tokenize(sp, sources=["web"]).tokenize(hf, sources=["code"]).split(max_tokens=24).mix(by="tokens")
            .pack(seq_len=40, algorithm="wrap").batch(rows_per_lane=1, provenance=True))
    decode = {"web": load_tokenizer(sp).decode, "code": load_tokenizer(hf).decode}
    segments = z.trace(pipe, step=1)
    distinguished = set()
    for seg in segments:
        other = "code" if seg.source == "web" else "web"
        assert seg.text == decode[seg.source](seg.token_ids), seg
        try:
            wrong = decode[other](seg.token_ids)
        except IndexError:  # an id outside the other's vocabulary (what decoding with the first tokenizer did)
            wrong = None
        if seg.text != wrong:
            distinguished.add(seg.source)
    assert distinguished == {"web", "code"}  # the other tokenizer decodes these ids differently: the check can fail


def test_trace_of_a_padding_row_has_no_segments(identity, sp_model):
    pipe = pipeline(identity, sp_model, "best_fit", passes=1, partial="pad")
    with pipe.build(0, 1) as loader:
        batches = list(loader)
    last = len(batches) - 1
    table = batches[last]["provenance"]
    padding = sorted({r for r, seg, *_ in table.tolist() if seg < 0})
    filled = sorted({r for r, seg, *_ in table.tolist() if seg >= 0})
    assert padding and filled, "the last padded step should hold both"
    assert z.trace(pipe, step=np.int64(last), rows=padding[:2]) == []
    got = z.trace(pipe, step=last, rows=filled[:1] + padding[:1])
    assert got and {s.row for s in got} == {filled[0]}
    with pytest.raises(ValueError, match="the data ends at step"):
        z.trace(pipe, step=last + 1, rows=[0])


def test_trace_refuses_a_malformed_state_file_by_name(identity, sp_model, tmp_path):
    pipe = pipeline(identity, sp_model)
    with pipe.build(0, 1) as loader:
        for _, _ in zip(loader, range(2)):
            pass
        state = loader.state_dict()
    good = tmp_path / "state.json"
    z.save_state(state, good)
    assert z.trace(pipe, step=3, rows=[0], state=str(good)) == z.trace(pipe, step=3, rows=[0])
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps({**json.loads(good.read_text()), "step": 1}))
    with pytest.raises(z.StateError, match=r"state file .*edited\.json.*integrity"):
        z.trace(pipe, step=3, rows=[0], state=str(edited))
    junk = tmp_path / "junk.json"
    junk.write_text('{"step": "x"}')
    with pytest.raises(z.StateError, match=r"state file .*junk\.json.*not a Zephon loader state"):
        z.trace(pipe, step=3, rows=[0], state=junk)
    with pytest.raises(z.StateError, match=r"missing\.json: no such file"):
        z.trace(pipe, step=3, rows=[0], state=tmp_path / "missing.json")


def test_diff_reports_a_stream_that_ends_first(identity, sp_model):
    short = pipeline(identity, sp_model, "best_fit", passes=1)  # drops the last steps that some lane cannot fill
    longer = pipeline(identity, sp_model, "best_fit", passes=1, partial="pad")  # pads them: the same, and more
    with short.build(0, 1) as loader:
        n = sum(1 for _ in loader)
    report = z.diff(short, longer, n + 5)
    assert report.steps == n and report.first_step == n and report.ended == "a", report.summary()
    assert "a's data ends there" in report.summary()
    assert z.diff(longer, short, n + 5).ended == "b"
    same = z.diff(short, short, n + 5)
    assert same.first_step is None and same.ended is None and same.steps == n
    with pipeline(identity, sp_model).build(0, 1) as loader:
        s0 = loader.state_dict()
        next(iter(loader))
        s1 = loader.state_dict()
    with pytest.raises(ValueError, match="state_a was saved at step 0 and state_b at step 1"):
        z.diff(pipeline(identity, sp_model), pipeline(identity, sp_model), 2, state_a=s0, state_b=s1)


def test_locate_says_a_record_was_skipped_for_its_size(identity, sp_model):
    texts = pq.read_table(identity / "web" / "part-1.parquet").column("text").to_pylist()
    big = next(k for k, t in enumerate(texts) if len(t.encode()) > 150)
    small = next(k for k, t in enumerate(texts) if len(t.encode()) <= 150)
    pipe = (z.Pipeline(seed=5, lanes=8)
            .source("web", z.read.parquet(str(identity / "web"), chunk_rows=8, max_doc_bytes=150))
            .tokenize(z.tokenizer(str(sp_model))).pack(seq_len=40).batch(provenance=True))
    loc = z.locate(pipe, "web", "part-1.parquet", big)
    assert list(loc) == [] and loc.dropped_by == "tokenize" and "max_doc_bytes = 150" in loc.reason, loc.reason
    assert len(z.locate(pipe, "web", "part-1.parquet", small)) >= 1
    with pytest.raises(ValueError, match=r"passes=0"):
        z.locate(pipe, "web", "part-1.parquet", small, passes=0)


def test_a_pre_tokenized_source_is_told_to_frame_its_ids(tmp_path, sp_model):
    pq.write_table(pa.table({"input_ids": [[5, 6, 7, 8] * 10, [9, 10, 11] * 7]}), tmp_path / "ids.parquet")
    tok = z.tokenizer(str(sp_model))
    source = z.read.parquet(str(tmp_path / "ids.parquet"), tokens_field="input_ids")
    with pytest.raises(z.PipelineError, match=r"holds token ids \(tokens_field='input_ids'\): frame them with "
                                               r"\.tokenize\(tok, field='input_ids'\)"):
        z.Pipeline(seed=1, lanes=2).source("t", source).tokenize(tok).pack(seq_len=16).batch().compile()
    pipe = z.Pipeline(seed=1, lanes=2).source("t", source).tokenize(tok, field="input_ids").pack(seq_len=16).batch()
    with pipe.build(0, 1) as loader:
        row = next(iter(loader))["input_ids"][0].tolist()
    assert row[:8] in ([5, 6, 7, 8] * 2, [9, 10, 11, 9, 10, 11, 9, 10])

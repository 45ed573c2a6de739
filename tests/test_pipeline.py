"""Pipelines as code: the builder, its two spellings, custom operators, and the determinism of it all.

A builder pipeline with user functions (a map that keeps a field, a filter, a flat_map that cuts records
in two) and a custom accumulator (dedup within a window) must give byte-identical global batches at
every world size, after a resume on another world size, and with every worker count and runner; the
builder spelling of a recipe must hash like the recipe; a pipeline must round-trip through TOML; the
fingerprint must cover every operator, and errors must name the operator, the file and the row.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

import zephon as z
from zephon import build_loader
from zephon.verify import global_hashes


STEPS = 8


# -- user functions (module level: the process runners pickle them) ------------------------------------
def long_enough(record: dict) -> bool:
    return len(record["text"]) >= 60


def short_only(record: dict) -> bool:
    return len(record["text"]) < 400


def add_length(record: dict) -> dict:
    return {**record, "chars": len(record["text"])}


def halves(record: dict) -> list[dict]:
    """Two records from one (a record a lane can checkpoint between)."""
    text = record["text"]
    k = len(text) // 2
    return [{**record, "text": text[:k]}, {**record, "text": text[k:]}]


def bad_map(record: dict) -> dict:
    if "import" in record["text"]:
        raise ValueError("no imports please")
    return record


def not_a_bool(record: dict) -> int:
    return len(record["text"])


class DedupWithinWindow:
    """The README's example accumulator: drop a document whose first 8 tokens were seen among the last
    ``window`` documents of this segment."""

    def __init__(self, window: int = 16) -> None:
        self.window = window
        self.recent: list[bytes] = []

    def push(self, doc: dict) -> list[dict]:
        key = doc["input_ids"][:8].tobytes()
        if key in self.recent:
            return []
        self.recent = (self.recent + [key])[-self.window:]
        return [doc]

    def flush(self) -> list[dict]:
        self.recent = []
        return []


def dedup_factory() -> DedupWithinWindow:
    return DedupWithinWindow(16)


@pytest.fixture(scope="module")
def tok(sp_model):
    return z.tokenizer(str(sp_model))


def builder(corpus: Path, tok, lanes: int = 16, seq_len: int = 64, **kw) -> z.Pipeline:
    return (z.Pipeline(seed=7, lanes=lanes, flush_every=2)
            .source("web", z.read.parquet(str(corpus / "web"), chunk_rows=4), weight=0.7)
            .source("code", z.read.jsonl(str(corpus / "code" / "*.jsonl"), chunk_bytes=1024, unit_bytes=4096),
                    weight=0.3))


def custom_pipeline(corpus: Path, tok, lanes: int = 16) -> z.Pipeline:
    return (builder(corpus, tok, lanes)
            .filter(long_enough, sources=["web"])
            .map(add_length)
            .flat_map(halves, sources=["code"])
            .tokenize(tok)
            .split(max_tokens=64)
            .mix(by="tokens")
            .accumulate(dedup_factory, name="dedup")
            .shuffle(buffer=4)
            .pack(seq_len=64, algorithm="best_fit", max_open_bins=4)
            .batch(rows_per_lane=2))


# -- one graph, two spellings ---------------------------------------------------------------------------
def test_builder_spelling_of_a_recipe_hashes_like_the_recipe(corpus, sp_model, make_recipe, tok):
    recipe = make_recipe()
    pipe = (builder(corpus, tok).tokenize(tok).split(max_tokens=64).mix(by="tokens")
            .pack(seq_len=64, algorithm="best_fit", max_open_bins=4).batch(rows_per_lane=2))
    assert pipe.fingerprint == recipe.to_pipeline().fingerprint
    assert global_hashes(pipe, 1, STEPS) == global_hashes(recipe, 1, STEPS)


def test_a_pipeline_round_trips_through_toml(corpus, tok, tmp_path):
    pipe = custom_pipeline(corpus, tok)
    text = pipe.to_recipe()
    (tmp_path / "recipe.toml").write_text(text)
    again = z.load_recipe(tmp_path / "recipe.toml").to_pipeline()
    assert again.fingerprint == pipe.fingerprint
    assert global_hashes(again, 2, 4) == global_hashes(pipe, 1, 4)


def test_a_lambda_cannot_be_written_to_a_recipe(corpus, tok):
    with pytest.raises(z.PipelineError, match="lambda.*Define it at module level, or pass version="):
        builder(corpus, tok).filter(lambda r: True)  # without a version, not even in a pipeline
    pipe = builder(corpus, tok).filter(lambda r: True, version=1).tokenize(tok).pack(seq_len=64).batch()
    with pytest.raises(ValueError, match="lambda.*cannot be written to a recipe"):
        pipe.to_recipe()


# -- determinism of a pipeline with custom operators ---------------------------------------------------------
@pytest.fixture(scope="module")
def custom(corpus, tok):
    pipe = custom_pipeline(corpus, tok)
    return pipe, global_hashes(pipe, 1, STEPS)


def test_custom_operators_actually_act(custom):
    pipe, reference = custom
    loader = pipe.build()
    batches = [next(loader) for _ in range(STEPS)]
    m = loader.metrics()
    assert m["flushes"] > 0 and m["pieces_split"] > 0 and len(set(reference)) == STEPS
    assert m["skipped_by_reason"].get("filtered_records", 0) > 0  # the filter dropped records
    chars = [c for b in batches for row in b["chars"] for c in row]  # the map's field, a payload per document
    assert chars and all(isinstance(c, int) and c > 0 for c in chars)


@pytest.mark.parametrize("world", [2, 4, 8, 16])
def test_custom_pipeline_is_elastic(custom, world):
    pipe, reference = custom
    assert global_hashes(pipe, world, STEPS) == reference


@pytest.mark.parametrize("world,new_world,at", [(4, 2, 3), (16, 8, 5), (2, 16, 1)])
def test_custom_pipeline_resumes_on_another_world_size(custom, world, new_world, at):
    pipe, reference = custom
    assert global_hashes(pipe, world, STEPS, resume_at=at, resume_world_size=new_world) == reference


@pytest.mark.parametrize("runner,workers", [("thread", 2), ("pool", 2), ("process", 2)])
def test_custom_pipeline_under_every_runner(custom, runner, workers):
    pipe, reference = custom
    assert global_hashes(pipe, 4, STEPS, num_workers=workers, runner=runner) == reference


def test_stages_on_different_executors(corpus, tok, custom):
    """The map on worker processes, the rest on threads: the same batches."""
    pipe = (builder(corpus, tok).filter(long_enough, sources=["web"]).map(add_length, executor="process")
            .flat_map(halves, sources=["code"]).tokenize(tok, executor="thread").split(max_tokens=64)
            .mix(by="tokens").accumulate(dedup_factory, name="dedup").shuffle(buffer=4)
            .pack(seq_len=64, algorithm="best_fit", max_open_bins=4).batch(rows_per_lane=2))
    _, reference = custom
    assert pipe.compile().stage_kinds[0] == [None, "process", "thread", None]
    assert global_hashes(pipe, 2, STEPS, num_workers=2) == reference


def test_a_lane_node_under_torchdata_loader_resumes_exactly(custom):
    """One lane's node, alone under torchdata's Loader, with its state_dict/load_state_dict."""
    from torchdata.nodes import Loader

    from zephon.engine.executors import InlineExecutor
    from zephon.engine.lane import Lane

    pipe, _ = custom
    program = pipe.compile()
    ex = InlineExecutor(program.stages)

    def rows(lane_rows):
        return [r.tokens[:r.fill].tobytes() for r in lane_rows]

    whole = Loader(Lane(program, 3, lambda s, k: ex, 1))
    it = iter(whole)
    expected = [rows(next(it)) for _ in range(12)]
    first = Loader(Lane(program, 3, lambda s, k: ex, 1))
    it = iter(first)
    got = [rows(next(it)) for _ in range(5)]
    state = first.state_dict()
    second = Loader(Lane(program, 3, lambda s, k: ex, 1))
    second.load_state_dict(state)
    it = iter(second)
    got += [rows(next(it)) for _ in range(7)]
    assert got == expected


# -- the fingerprint covers the graph --------------------------------------------------------------------
def test_a_resume_with_another_filter_is_refused_naming_the_operator(corpus, tok):
    a = builder(corpus, tok).filter(long_enough).tokenize(tok).pack(seq_len=64).batch(rows_per_lane=2)
    b = builder(corpus, tok).filter(short_only).tokenize(tok).pack(seq_len=64).batch(rows_per_lane=2)
    loader = a.build()
    next(loader)
    state = loader.state_dict()
    other = b.build()
    with pytest.raises(z.StateError, match=r"filter:short_only.*fn|fn.*short_only"):
        other.load_state_dict(state)
    bumped = builder(corpus, tok).filter(long_enough, version=2).tokenize(tok).pack(seq_len=64).batch(rows_per_lane=2)
    assert bumped.fingerprint != a.fingerprint


def test_recipe_text_hooks_are_fingerprinted(make_recipe):
    recipe = make_recipe(lanes=8)
    loader = build_loader(recipe, text_filter=long_enough_text)
    next(loader)
    state = loader.state_dict()
    with pytest.raises(z.StateError, match=r"\(zephon.filter_field\).fn: checkpoint has .*long_enough_text.*short_text"):
        build_loader(recipe, text_filter=short_text).load_state_dict(state)
    with pytest.raises(z.StateError, match="different pipeline"):
        build_loader(recipe).load_state_dict(state)


def long_enough_text(text: str) -> bool:
    return len(text) > 80


def short_text(text: str) -> bool:
    return len(text) < 400


# -- explain, validate, errors ------------------------------------------------------------------------------
def test_explain_names_every_operator_where_it_runs_and_the_fingerprint(custom):
    pipe, _ = custom
    text = pipe.explain()
    for name in ("filter:long_enough", "map:add_length", "flat_map:halves", "tokenize", "split", "mix", "dedup",
                 "shuffle", "pack", "batch"):
        assert name in text, name
    assert "workers, per source" in text and "lane: accumulator" in text and pipe.fingerprint in text


def test_validate_runs_records_through_every_operator(custom):
    pipe, _ = custom
    report = pipe.validate(records=32)
    assert report.rows > 0 and set(report.records_read) == {"web", "code"}
    assert report.lane_outputs["dedup"] > 0


def test_validate_names_the_failing_operator(corpus, tok):
    pipe = builder(corpus, tok).map(bad_map, name="no-imports").tokenize(tok).pack(seq_len=64).batch()
    with pytest.raises(z.PipelineError, match="no-imports"):
        pipe.validate(records=400)


def test_a_failing_map_names_operator_file_and_row_or_is_skipped_and_counted(corpus, tok):
    pipe = builder(corpus, tok).map(bad_map).tokenize(tok).pack(seq_len=64).batch(rows_per_lane=2)
    with pytest.raises(z.OperatorError, match=r"map:bad_map.*(part-\d+\.(parquet|jsonl)), (row|byte) \d+.*no imports"):
        loader = pipe.build()
        for _ in range(20):
            next(loader)
    skipping = builder(corpus, tok).map(bad_map, on_error="skip").tokenize(tok).pack(seq_len=64).batch(rows_per_lane=2)
    loader = skipping.build()
    for _ in range(20):
        next(loader)
    assert loader.metrics()["skipped_by_reason"]["failed_records"] > 0


def test_a_filter_that_returns_a_non_bool_is_an_error(corpus, tok):
    pipe = builder(corpus, tok).filter(not_a_bool).tokenize(tok).pack(seq_len=64).batch()
    with pytest.raises(z.OperatorError, match="must return True or False"):
        next(pipe.build())


def test_a_missing_field_names_it(corpus, tok):
    pipe = builder(corpus, tok).tokenize(tok, field="body").pack(seq_len=64).batch()
    with pytest.raises(z.PipelineError, match="operator 'tokenize' reads field 'body', which the records of source "
                                              "'web' do not have \\(they have text; "):
        pipe.build()  # refused when built, not at the first batch


def test_an_unpicklable_function_with_a_process_runner_names_the_operator(corpus, tok):
    pipe = builder(corpus, tok).filter(lambda r: True, name="my-lambda", version=1).tokenize(tok).pack(seq_len=64).batch()
    for runner in ("pool", "process"):
        with pytest.raises(ValueError, match="my-lambda.*module-level"):
            pipe.build(num_workers=1, runner=runner)


def test_builder_errors_name_the_step(corpus, tok):
    base = builder(corpus, tok)
    with pytest.raises(z.PipelineError, match="unknown sources"):
        base.filter(long_enough, sources=["nope"])
    with pytest.raises(z.PipelineError, match="end.*batch"):
        base.tokenize(tok).pack(seq_len=64).compile()
    with pytest.raises(z.PipelineError, match="mix\\(by='tokens'\\) needs token ids before the sources meet"):
        base.mix().tokenize(tok).pack(seq_len=64).batch().compile()
    with pytest.raises(z.PipelineError, match="exceeds pack"):
        base.tokenize(tok).split(max_tokens=128).pack(seq_len=64).batch().compile()


@pytest.mark.parametrize("sources", [1, 2])
def test_tokenizing_after_the_merge_mixes_by_documents_when_the_mix_is_implied(corpus, tok, sources):
    """The implied mix went by tokens, which the merge cannot count before tokenize: one source crashed with a
    KeyError on input_ids, two were refused for a mix(by='tokens') nobody wrote."""
    base = builder(corpus, tok) if sources == 2 else (
        z.Pipeline(seed=7, lanes=16, flush_every=2).source("web", z.read.parquet(str(corpus / "web"), chunk_rows=4)))

    def finish(p):
        return p.shuffle(buffer=4).tokenize(tok).pack(seq_len=64).batch()

    implied, documents = finish(base), finish(base.mix(by="documents"))
    assert "mix (implied)" in implied.explain()
    assert global_hashes(implied, 1, 4) == global_hashes(documents, 1, 4) == global_hashes(implied, 4, 4)
    with pytest.raises(z.PipelineError, match="mix\\(by='tokens'\\) needs token ids before the sources meet"):
        finish(base.mix(by="tokens")).compile()


def test_a_pipeline_is_a_value(corpus, tok):
    base = builder(corpus, tok).tokenize(tok)
    a = base.pack(seq_len=64).batch()
    b = base.pack(seq_len=32).batch()
    assert a.seq_len == 64 and b.seq_len == 32 and a.fingerprint != b.fingerprint
    assert pickle.loads(pickle.dumps(a)).fingerprint == a.fingerprint

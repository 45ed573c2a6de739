"""The batched text path (MergeNode.feed, SourceStream.text_run/advance, Mixer.book_run,
Packer.push_text_run): where the packer follows the mixer directly, a lane hands it runs of one source's
documents as slices of the chunk's token ids, with no document object each, and the packer stops a run
at the first row it completes (the step clock moves there). It must deliver the per-document path's batches
byte for byte. The reference is the same pipeline with an identity accumulator between ``mix()`` and
``pack()``, which keeps every document on the per-document path; compared by SHA-256 of every global batch
over the packing algorithms, mixtures by tokens and by documents, mixture schedules and interventions,
short flush cadences (held rows topped up after a sentinel), split documents, provenance, world sizes 1/2/4,
the thread runner with workers, and resumes on another world size.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zephon as z
from zephon.ops.pack import Packer
from zephon.verify import global_hashes

from .test_step_clock import corpus_records, make_pipeline, run


class Identity:
    """Passes every document on as it is: keeps a pipeline on the per-document path."""

    def push(self, record):
        return (record,)

    def flush(self):
        return ()


@pytest.fixture(scope="module")
def tok(sp_model):
    return z.tokenizer(str(sp_model))


def text_pipeline(texts, tok, *, lanes=4, rows=2, seq_len=40, flush_every=2, algorithm="best_fit", by="documents",
                  split=None, schedule=None, provenance=False, start=0, per_document=False) -> z.Pipeline:
    """tests/test_step_clock.py's two sources of real text, without a shuffle buffer (the packer follows the
    mixer); ``per_document``: with the identity accumulator before ``pack()``."""
    return make_pipeline(texts, tok, lanes=lanes, rows=rows, seq_len=seq_len, shuffle=0, flush_every=flush_every,
                         algorithm=algorithm, by=by, split=split, start=start, schedule=schedule,
                         per_document=Identity if per_document else None, provenance=provenance)


def documents_in_runs(monkeypatch) -> list[int]:
    """Record how many documents each call of the batched text path took."""
    runs: list[int] = []
    real = Packer.push_text_run

    def push_text_run(self, run):
        taken, out = real(self, run)
        runs.append(taken)
        return taken, out

    monkeypatch.setattr(Packer, "push_text_run", push_text_run)
    return runs


def test_the_batched_text_path_is_taken_only_where_the_packer_follows_the_mixer(corpus_texts, tok, monkeypatch):
    runs = documents_in_runs(monkeypatch)
    global_hashes(text_pipeline(corpus_texts, tok), 1, 6)
    assert sum(runs) > 50 and max(runs) > 1  # runs of several documents, picked by the mixer's counts
    runs.clear()
    global_hashes(text_pipeline(corpus_texts, tok, per_document=True), 1, 6)
    assert runs == []


configs = st.fixed_dictionaries({
    "lanes": st.sampled_from([2, 4]), "rows": st.integers(1, 3), "seq_len": st.sampled_from([16, 40, 96]),
    "flush_every": st.integers(1, 4), "algorithm": st.sampled_from(["best_fit", "first_fit", "wrap"]),
    "by": st.sampled_from(["tokens", "documents"]), "split": st.sampled_from([None, 12]),
    "provenance": st.booleans(), "start": st.integers(0, 2000)})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, world=st.sampled_from([1, 2]))
def test_runs_deliver_the_per_document_batches(corpus_texts, tok, config, world):
    want = global_hashes(text_pipeline(corpus_texts, tok, per_document=True, **config), 1, 8)
    assert global_hashes(text_pipeline(corpus_texts, tok, **config), world, 8) == want


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, resume_at=st.integers(1, 7), worlds=st.sampled_from([(1, 2), (2, 1), (2, 2)]))
def test_a_resume_on_another_world_size_replays_the_runs(corpus_texts, tok, config, resume_at, worlds):
    """A resume replays from the lane's last sentinel: a held row's carry, and the release at which the
    original completed it, must come out the same through runs; a schedule that changes the weights at every
    step makes any decision replayed at another step change the bytes."""
    ramp = z.Schedule([(0, {"web": 0.9, "code": 0.1}), (9, {"web": 0.1, "code": 0.9})], interpolate="linear")
    want = global_hashes(text_pipeline(corpus_texts, tok, per_document=True, schedule=ramp, **config), 1, 9)
    got = global_hashes(text_pipeline(corpus_texts, tok, schedule=ramp, **config), worlds[0], 9, resume_at=resume_at,
                        resume_world_size=worlds[1])
    assert got == want


@pytest.mark.parametrize("algorithm,by", [("best_fit", "documents"), ("wrap", "tokens"), ("first_fit", "documents")])
def test_schedules_and_interventions_decide_at_the_same_steps(corpus_texts, tok, algorithm, by):
    """A run stops at the first completed row, so every decision in it is for the same step as on the
    per-document path: a linear schedule (new weights every step) and an intervention at step 5 give the
    same bytes, resumed on another world size too."""
    ramp = z.Schedule([(0, {"web": 0.9, "code": 0.1}), (10, {"web": 0.1, "code": 0.9})], interpolate="linear")
    config = dict(lanes=4, rows=2, seq_len=64, flush_every=3, algorithm=algorithm, by=by, schedule=ramp)
    per_document = text_pipeline(corpus_texts, tok, per_document=True, **config)
    batched = text_pipeline(corpus_texts, tok, **config)
    change = dict(call_at=2, at_step=5, weights={"web": 0.1, "code": 0.9})
    want = run(per_document, 10, **change)
    assert run(batched, 10, world=2, **change) == want
    assert run(batched, 10, world=2, resume_at=4, resume_world=4, **change) == want


def test_the_thread_runner_with_workers_gives_the_same_batches(corpus_texts, tok):
    config = dict(lanes=4, rows=2, seq_len=40, flush_every=1, algorithm="best_fit", by="documents", split=12)
    want = global_hashes(text_pipeline(corpus_texts, tok, per_document=True, **config), 1, 8)
    assert global_hashes(text_pipeline(corpus_texts, tok, **config), 4, 8, num_workers=2) == want


def token_records(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(5, 500) for _ in range(rng.randrange(1, 30))]} for _ in range(n)]


def replay_pipeline(tok, seed: int, algorithm: str, per_document: bool = False) -> z.Pipeline:
    """One lane, one row per step, a sentinel after every chunk of five documents and a schedule that changes
    the weights at every step: a row the packer held over a sentinel and completes on the replay at document
    ``release`` moves the clock with no output, and the next pick already sees the next step's weights."""
    ramp = z.Schedule([(0, {"web": 0.9, "code": 0.1}), (12, {"web": 0.1, "code": 0.9})], interpolate="linear")
    pipe = (z.Pipeline(seed=5, lanes=1, flush_every=1)
            .source("web", z.read.records(token_records(seed, 300), tokens_field="input_ids", chunk_rows=5), weight=0.6)
            .source("code", z.read.records(token_records(seed + 1, 300), tokens_field="input_ids", chunk_rows=5),
                    weight=0.4)
            .tokenize(tok, field="input_ids")
            .mix(by="documents", schedule=ramp))
    if per_document:
        pipe = pipe.accumulate(Identity, version="1")
    return pipe.pack(seq_len=48, algorithm=algorithm, max_open_bins=3).batch(rows_per_lane=1)


@pytest.mark.parametrize("algorithm", ["best_fit", "wrap"])
def test_a_run_ends_where_a_replay_completes_the_held_row(tok, algorithm):
    """Resumed at every step, the batched path replays each decision at its step (review finding: a run went
    on past the document that completed the held row on the replay, picked at the clock before it)."""
    steps = 24
    want = global_hashes(replay_pipeline(tok, 0, algorithm, per_document=True), 1, steps)
    pipe = replay_pipeline(tok, 0, algorithm)
    assert global_hashes(pipe, 1, steps) == want
    diverged = [r for r in range(1, steps) if global_hashes(pipe, 1, steps, resume_at=r) != want]
    assert diverged == []


def test_documents_with_payloads_leave_the_batched_path(corpus_texts, tok):
    """A source whose documents keep their text as a payload has chunks of more than token ids: the lane
    stops trying runs (each attempt would decide the pick twice) and the batches stay the per-document path's."""
    def pipeline(per_document: bool) -> z.Pipeline:
        pipe = (z.Pipeline(seed=2, lanes=2, flush_every=2)
                .source("web", z.read.records(corpus_records(corpus_texts, 0, 60, 2), chunk_rows=4), weight=0.5)
                .source("code", z.read.records(corpus_records(corpus_texts, 900, 60, 1), chunk_rows=4), weight=0.5)
                .tokenize(tok, sources=["web"], keep_field=True)
                .tokenize(tok, sources=["code"], name="tokenize_code")
                .mix(by="documents"))
        if per_document:
            pipe = pipe.accumulate(Identity, version="1")
        return pipe.pack(seq_len=48, algorithm="best_fit", max_open_bins=3).batch(rows_per_lane=2)

    want = global_hashes(pipeline(True), 1, 8)
    assert global_hashes(pipeline(False), 2, 8) == want
    loader = pipeline(False).build()
    try:
        for _ in range(3):
            next(loader)
        assert [lane.nodes.merge._runs for lane in loader._host._lanes] == [False, False]
    finally:
        loader.close()

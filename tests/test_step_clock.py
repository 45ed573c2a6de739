""""At step s" is exact: a mixture change for step ``s`` leaves every global batch before ``s`` byte-identical.

The step clock (zephon/engine/clock.py) assigns a mixing decision to the step of the rows its lane had
completed when it was made. Properties, over corpora, ``at_step``, rows per lane, ``seq_len``, the shuffle
buffer, the packing algorithm and the flush cadence:

- the batches before ``s`` equal the run without the change, whenever the call is made (before the first
  step, or as late as step ``s`` itself);
- every document a lane's mixer takes once the lane has received its rows of the steps before ``s`` is
  drawn under the new weights (a weight of 0 makes it visible: no document of that source is taken);
- a resume on another world size, at any step, replays every decision at the same step (a schedule that
  changes the weights at every step makes any slip of the clock change the bytes).

The delay until the delivered mixture follows is what the lane holds when the change comes: with ``wrap``
packing and no shuffle buffer that is one part-filled row, so no row after it holds the old mixture.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zephon as z
from zephon import global_digest, merge_states
from zephon.ops.mix import Mixer

from .test_vision_batches import IDS, data as vl_data, vl_tok  # noqa: F401 - the vision tests' fixtures

WEB_OFF = {"web": 0.0, "code": 1.0}


def corpus_records(texts: list[str], start: int, n: int, nulls: int) -> list[dict]:
    """``n`` records of real text from ``start`` (long documents included), ``nulls`` of them null."""
    picked = [texts[(start + k) % len(texts)] for k in range(n)]
    for k in range(nulls):
        picked[(k * 7) % n] = None
    return [{"text": t} for t in picked]


def make_pipeline(texts, tok, *, lanes, rows, seq_len, shuffle, flush_every, algorithm, by, split, start, schedule=None,
                  per_document=None, provenance=False):
    """Two sources of real text, mixed and packed. ``per_document``: an accumulator class placed before
    ``pack()`` (tests/test_text_runs.py keeps the per-document path with an identity one)."""
    pipe = (z.Pipeline(seed=11, lanes=lanes, flush_every=flush_every)
            .source("web", z.read.records(corpus_records(texts, start, 60, 3), chunk_rows=3), weight=0.6)
            .source("code", z.read.records(corpus_records(texts, start + 500, 60, 2), chunk_rows=4), weight=0.4)
            .tokenize(tok))
    if split:
        pipe = pipe.split(max_tokens=split)
    pipe = pipe.mix(by=by, schedule=schedule)
    if shuffle:
        pipe = pipe.shuffle(buffer=shuffle)
    if per_document is not None:
        pipe = pipe.accumulate(per_document, version="1")
    return pipe.pack(seq_len=seq_len, algorithm=algorithm, max_open_bins=3).batch(rows_per_lane=rows,
                                                                                  provenance=provenance)


@contextlib.contextmanager
def recorded_decisions():
    """Every document a mixer takes: (id of its lane's clock, rows the lane had completed, source index)."""
    taken: list[tuple[int, int, int]] = []
    real, real_run = Mixer.push_from, Mixer.book_run

    def push_from(self, record, source):
        taken.append((id(self.clock), self.clock.rows, source))
        return real(self, record, source)

    def book_run(self, source, documents, tokens):  # the batched text path: booked after the packer took the run,
        # which may have moved the clock; the run was decided at the rows the merge recorded before picking it
        taken.extend([(id(self.clock), self.clock.decision_rows, source)] * documents)
        return real_run(self, source, documents, tokens)

    Mixer.push_from, Mixer.book_run = push_from, book_run
    try:
        yield taken
    finally:
        Mixer.push_from, Mixer.book_run = real, real_run


def run(pipe, steps: int, world: int = 1, call_at: int | None = None, at_step: int = 0, weights=WEB_OFF,
        resume_at: int | None = None, resume_world: int = 1) -> list[str]:
    loaders = [pipe.build(rank=r, world_size=world) for r in range(world)]
    hashes = []
    try:
        for step in range(steps):
            if step == call_at:
                for ld in loaders:
                    ld.set_mixture(weights, at_step=at_step)
            if step == resume_at:
                state = merge_states([ld.state_dict() for ld in loaders])
                for ld in loaders:
                    ld.close()
                loaders = [pipe.build(rank=r, world_size=resume_world) for r in range(resume_world)]
                for ld in loaders:
                    ld.load_state_dict(state)
            hashes.append(global_digest([next(ld) for ld in loaders]))
    finally:
        for ld in loaders:
            ld.close()
    return hashes


@pytest.fixture(scope="module")
def tok(sp_model):
    return z.tokenizer(str(sp_model))


pipelines = st.fixed_dictionaries({
    "lanes": st.sampled_from([1, 2, 4]), "rows": st.integers(1, 3), "seq_len": st.sampled_from([16, 40, 64]),
    "shuffle": st.sampled_from([0, 3, 9]), "flush_every": st.integers(1, 4),
    "algorithm": st.sampled_from(["best_fit", "first_fit", "wrap"]), "by": st.sampled_from(["tokens", "documents"]),
    "split": st.sampled_from([None, 8]), "start": st.integers(0, 2000)})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=pipelines, at_step=st.integers(1, 9), when=st.floats(0, 1))
def test_batches_before_the_step_are_unchanged_and_later_decisions_follow(corpus_texts, tok, config, at_step, when):
    pipe = make_pipeline(corpus_texts, tok, **config)
    steps = at_step + 3
    reference = run(pipe, steps)
    call_at = int(round(when * at_step))  # from before the first step to the step itself
    with recorded_decisions() as taken:
        changed = run(pipe, steps, call_at=call_at, at_step=at_step)
    assert changed[:at_step] == reference[:at_step]
    boundary = at_step * config["rows"]
    after = [source for _, rows, source in taken if rows >= boundary]
    assert 0 not in after  # web has weight 0 from step at_step: once the lane made its rows before it, never taken


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=pipelines, resume_at=st.integers(1, 10), worlds=st.sampled_from([(1, 2), (2, 1), (4, 2), (2, 4)]))
def test_a_resume_replays_every_decision_at_the_same_step(corpus_texts, tok, config, resume_at, worlds):
    """A linear schedule changes the weights at every step, so a decision replayed at another step than in
    the first run would change the bytes after the resume."""
    world, resume_world = worlds
    if config["lanes"] % world or config["lanes"] % resume_world:
        config = {**config, "lanes": 4}
    ramp = z.Schedule([(0, {"web": 0.95, "code": 0.05}), (12, {"web": 0.05, "code": 0.95})], interpolate="linear")
    pipe = make_pipeline(corpus_texts, tok, schedule=ramp, **config)
    reference = run(pipe, 12)
    assert run(pipe, 12, world=world, resume_at=resume_at, resume_world=resume_world) == reference


def test_a_schedule_point_is_exact_too(corpus_texts, tok):
    """A schedule's waypoint at step s is the same clock: the batches before it equal the unscheduled run's."""
    config = dict(lanes=4, rows=2, seq_len=40, shuffle=9, flush_every=2, algorithm="best_fit", by="tokens", split=8,
                  start=10)
    plain = run(make_pipeline(corpus_texts, tok, **config), 14)
    late = z.Schedule.phases([(0, {"web": 0.6, "code": 0.4}), (7, WEB_OFF)])
    with recorded_decisions() as taken:
        scheduled = run(make_pipeline(corpus_texts, tok, schedule=late, **config), 14)
    assert scheduled[:7] == plain[:7] and scheduled[7:] != plain[7:]
    assert {source for _, rows, source in taken if rows >= 7 * 2} == {1}


def _web_per_step(pipe, steps: int, call_at: int, at_step: int) -> tuple[list[int], list[int]]:
    """Per step: the tokens and the pieces (packed segments) of web documents delivered."""
    loader = pipe.build()
    tokens, pieces = [], []
    try:
        for step in range(steps):
            if step == call_at:
                loader.set_mixture(WEB_OFF, at_step=at_step)
            batch = next(loader)
            segs = [(r, k) for r, docs in enumerate(batch["src"]) for k, src in enumerate(docs) if src == "web"]
            tokens.append(int(sum((batch["segment_ids"][r] == k + 1).sum() for r, k in segs)))
            pieces.append(len(segs))
    finally:
        loader.close()
    return tokens, pieces


def web(record: dict) -> dict:
    return {**record, "src": "web"}


def code(record: dict) -> dict:
    return {**record, "src": "code"}


def test_the_delay_is_what_the_lane_holds(corpus_texts, tok):
    """Once a lane has made its rows of the steps before s, the old mixture is only what it holds then. With
    wrap packing and no shuffle buffer that is the part-filled row of step s: no step after it holds an old
    document. A shuffle buffer of n documents holds n more, each leaving at random as new ones arrive (on
    average after n + 1 documents), all of them at the lane's next sentinel: the pieces of old documents
    delivered after step s are at most those n per lane (a document of at most one row's tokens is packed
    in at most two pieces). Measured here, printed with -s."""
    def tagged(shuffle: int):
        pipe = (z.Pipeline(seed=5, lanes=4, flush_every=3)
                .source("web", z.read.records(corpus_records(corpus_texts, 0, 200, 0), chunk_rows=4), weight=0.5)
                .source("code", z.read.records(corpus_records(corpus_texts, 900, 200, 0), chunk_rows=4), weight=0.5)
                .map(web, sources=["web"]).map(code, sources=["code"]).tokenize(tok).split(max_tokens=32)
                .mix(by="tokens"))
        if shuffle:
            pipe = pipe.shuffle(buffer=shuffle)
        return pipe.pack(seq_len=32, algorithm="wrap").batch(rows_per_lane=1)

    at = 6
    tokens, _ = _web_per_step(tagged(0), 14, call_at=0, at_step=at)
    assert all(n > 0 for n in tokens[:at]) and all(n == 0 for n in tokens[at + 1:]), tokens
    buffered, pieces = _web_per_step(tagged(8), 30, call_at=0, at_step=at)
    last_old = max(s for s, n in enumerate(buffered) if n)
    print(f"\nweb tokens per step, change at step {at}: no buffer {tokens}; shuffle buffer of 8: {buffered}; the "
          f"last old piece delivered at step {last_old}; old pieces after step {at}: {sum(pieces[at + 1:])}")
    assert last_old >= at and sum(pieces[at + 1:]) <= 4 * 8 * 2


@pytest.mark.parametrize("world", [1, 2])
def test_record_batches_are_exact_too(corpus_texts, world):
    """Without pack(): a row is one record, and the clock counts record rows the same way."""
    def pipe():
        return (z.Pipeline(seed=2, lanes=2, flush_every=2)
                .source("web", z.read.records([{"text": t, "src": "web"} for t in corpus_texts[:90]], chunk_rows=5))
                .source("code", z.read.records([{"text": t, "src": "code"} for t in corpus_texts[300:390]],
                                               chunk_rows=5))
                .shuffle(buffer=4).batch(rows_per_lane=3))
    plain = run(pipe(), 10)
    with recorded_decisions() as taken:
        changed = run(pipe(), 10, world=world, call_at=2, at_step=5)
    assert changed[:5] == plain[:5] and changed[5:] != plain[5:]
    assert 0 not in [source for _, rows, source in taken if rows >= 5 * 3]


def test_images_packed_with_text_are_exact_too(vl_data, vl_tok):  # noqa: F811
    """Multimodal packing (documents cut only between images, the held row topped up at a sentinel)."""
    def pipe(schedule=None):
        return (z.Pipeline(seed=4, lanes=4, flush_every=2)
                .source("pairs", z.read.parquet(str(vl_data["caps"]), columns=["image", "caption"], chunk_rows=4))
                .source("docs", z.read.parquet(str(vl_data["docs"]), columns=["texts", "images"], chunk_rows=4))
                .decode_images("image", sources=["pairs"], max_pixels=56 * 56, patch_size=14, merge=2)
                .decode_images("images", sources=["docs"], max_pixels=56 * 56, patch_size=14, merge=2)
                .tokenize_images(vl_tok, "caption", sources=["pairs"], **IDS)
                .tokenize_images(vl_tok, "texts", sources=["docs"], **IDS)
                .mix(by="tokens", schedule=schedule).shuffle(buffer=3)
                .pack(seq_len=96, max_images_per_row=3).batch(rows_per_lane=2))

    plain = run(pipe(), 8)
    late = z.Schedule.phases([(0, {"pairs": 0.5, "docs": 0.5}), (4, {"pairs": 0.0, "docs": 1.0})])
    scheduled = run(pipe(late), 8)
    assert scheduled[:4] == plain[:4] and scheduled[4:] != plain[4:]
    ramp = z.Schedule([(0, {"pairs": 0.9, "docs": 0.1}), (8, {"pairs": 0.1, "docs": 0.9})], interpolate="linear")
    reference = run(pipe(ramp), 8)
    for at, worlds in zip((2, 3, 5), itertools.cycle([(2, 1), (1, 4)])):
        assert run(pipe(ramp), 8, world=worlds[0], resume_at=at, resume_world=worlds[1]) == reference

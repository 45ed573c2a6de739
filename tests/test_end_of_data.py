"""Sources that stop: ``passes=N`` reads every record exactly once per pass, and the loader ends cleanly, at
the same global step on every world size and after any resume, the last partial global batch dropped or
padded by option, identically everywhere (also across two real processes agreeing through gloo).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import zephon as z
from zephon import merge_states
from zephon.verify import _global_step, global_hashes

MANY = 400  # more steps than any finite pipeline here lasts


def text_key(record: dict) -> dict:
    """A payload that identifies the record (a digest of its text), to count what was delivered."""
    return {**record, "key": hashlib.sha256(record["text"].encode()).hexdigest()[:12]}


def finite(corpus: Path, tok, lanes: int = 8, partial: str = "pad", web_passes: int | None = 1,
           code_passes: int | None = 1, seq_len: int = 256) -> z.Pipeline:
    return (z.Pipeline(seed=5, lanes=lanes, flush_every=2, flush_by="chunks")
            .source("web", z.read.parquet(str(corpus / "web"), chunk_rows=8), weight=0.7, passes=web_passes)
            .source("code", z.read.jsonl(str(corpus / "code" / "*.jsonl"), chunk_bytes=4096, unit_bytes=16384),
                    weight=0.3, passes=code_passes)
            .map(text_key)
            .tokenize(tok).split(max_tokens=seq_len)
            .mix(by="tokens")
            .pack(seq_len=seq_len, algorithm="best_fit", max_open_bins=4)
            .batch(rows_per_lane=2, partial=partial))


@pytest.fixture(scope="module")
def tok(sp_model):
    return z.tokenizer(str(sp_model))


@pytest.fixture(scope="module")
def padded(corpus, tok):
    pipe = finite(corpus, tok)
    return pipe, global_hashes(pipe, 1, MANY)


def test_one_pass_delivers_every_record_exactly_once(corpus, tok, corpus_texts):
    """With partial="pad" nothing is lost: every non-blank record's tokens are delivered once."""
    loader = finite(corpus, tok).build()
    delivered, tokens, slots = Counter(), 0, 0
    for batch in loader:
        seg = batch["segment_ids"].numpy()
        tokens += int((seg != 0).sum())
        slots += seg.size
        for docs in batch["key"]:
            delivered.update(set(docs))  # the pieces of a document in one row share its key
    records = [t for t in corpus_texts if t and not t.isspace()]
    keys = Counter(hashlib.sha256(t.encode()).hexdigest()[:12] for t in records)
    assert set(delivered) == set(keys)
    lengths = tok_lengths(tok, records)
    assert tokens == lengths  # every token of every document, once (EOS included)
    # the metric counts exactly the padding the batches carried, the padded last batch included
    assert loader.metrics()["pad_fraction"] == pytest.approx((slots - tokens) / slots, abs=1e-12)


def tok_lengths(spec, texts: list[str]) -> int:
    from zephon import load_tokenizer

    _, offsets = load_tokenizer(spec).encode(texts)
    return int(offsets[-1])


@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_loader_ends_at_the_same_step_on_every_world_size(padded, world):
    pipe, reference = padded
    assert 5 < len(reference) < MANY
    assert global_hashes(pipe, world, MANY) == reference


@pytest.mark.parametrize("world,new_world,frac", [(4, 2, 0.3), (8, 1, 0.7), (2, 8, 0.95)])
def test_the_end_survives_a_resume_on_another_world_size(padded, world, new_world, frac):
    pipe, reference = padded
    at = int(len(reference) * frac)
    assert global_hashes(pipe, world, MANY, resume_at=at, resume_world_size=new_world) == reference


def test_drop_ends_at_the_first_batch_a_lane_cannot_fill(corpus, tok, padded):
    pipe, padded_hashes = padded
    dropped = global_hashes(finite(corpus, tok, partial="drop"), 1, MANY)
    assert 0 < len(dropped) < len(padded_hashes)
    assert dropped == padded_hashes[:len(dropped)]  # the same data, cut where the first lane ran out
    assert global_hashes(finite(corpus, tok, partial="drop"), 4, MANY) == dropped


def test_a_source_that_repeats_keeps_the_loader_going(corpus, tok):
    """Only when every source has stopped does the loader end: a repeating source fills the mixture."""
    pipe = finite(corpus, tok, code_passes=None)
    loader = pipe.build()
    for _ in range(120):
        next(loader)
    assert loader.metrics()["source_token_share"].get("code", 0) > 0.5  # web stopped; code goes on


def test_two_passes_read_everything_twice(corpus, tok):
    one = global_hashes(finite(corpus, tok), 1, MANY)
    two = global_hashes(finite(corpus, tok, web_passes=2, code_passes=2), 1, MANY)
    assert 1.8 * len(one) < len(two) < 2.2 * len(one)


def test_an_ended_loader_stays_ended_after_a_resume(corpus, tok):
    pipe = finite(corpus, tok)
    loader = pipe.build(rank=0, world_size=2)
    other = pipe.build(rank=1, world_size=2)
    n = 0
    while _global_step([loader, other], loader.program) is not None:  # two simulated ranks agreeing on the end
        n += 1
    state = merge_states([loader.state_dict(), other.state_dict()])
    assert state["ended"] and state["step"] == n
    again = pipe.build()
    again.load_state_dict(state)
    with pytest.raises(StopIteration):
        next(again)


WORKER = """
import json, sys
import torch.distributed as dist
import zephon as z
dist.init_process_group("gloo")
recipe = z.recipe_from_dict(json.loads(sys.argv[1]))
loader = z.build_loader(recipe)
hashes = [z.batch_digest(b) for b in loader]
with open(f"{sys.argv[2]}/rank{dist.get_rank()}.json", "w") as f:  # the ranks' stdout lines interleave
    json.dump({"rank": dist.get_rank(), "steps": len(hashes), "hashes": hashes}, f)
dist.destroy_process_group()
"""


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_two_real_ranks_agree_on_the_end(corpus, sp_model, tmp_path):
    """torchrun, gloo: each rank's lanes run out at their own steps; the ranks end together, at the step a
    one-process run ends, with the same rank batches."""
    data = {"seed": 5, "lanes": 4, "seq_len": 256, "batch_per_lane": 2, "flush_every": 2, "partial_batch": "pad",
            "tokenizer": {"kind": "sentencepiece", "path": str(sp_model)},
            "read": {"chunk_rows": 8, "chunk_bytes": 4096, "unit_bytes": 16384},
            "sources": [{"name": "web", "path": str(corpus / "web"), "format": "parquet", "passes": 1},
                        {"name": "code", "path": str(corpus / "code" / "*.jsonl"), "format": "jsonl", "passes": 1}]}
    recipe = z.recipe_from_dict(data)
    ranks = [z.build_loader(recipe, rank=r, world_size=2) for r in range(2)]
    expected = []
    program = ranks[0].program
    while (batch := _global_step(ranks, program)) is not None:
        expected.append([z.batch_digest(b) for b in batch])
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script), json.dumps(data), str(tmp_path)], capture_output=True, text=True, timeout=230,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)}
    assert results[0]["steps"] == results[1]["steps"] == len(expected) > 3
    assert [[results[0]["hashes"][s], results[1]["hashes"][s]] for s in range(len(expected))] == expected


def test_passes_are_checked_and_fingerprinted(corpus, tok):
    with pytest.raises(z.PipelineError, match="passes must be a positive integer"):
        z.Pipeline(seed=1, lanes=2).source("web", z.read.parquet(str(corpus / "web")), passes=0)
    assert finite(corpus, tok).fingerprint != finite(corpus, tok, web_passes=2).fingerprint
    assert finite(corpus, tok).fingerprint != finite(corpus, tok, partial="drop").fingerprint
    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in (corpus / "web").glob("*.parquet"))
    plan = finite(corpus, tok, lanes=8).compile().plan.sources[0]
    assert sum(plan.lane_units(lane, 1) for lane in range(8)) == len(plan.units) and rows > 0


def test_reset_none_starts_a_used_loader_from_the_beginning(corpus, tok):
    """torchdata's contract: ``node.reset(None)`` on a loader that has run starts it over, lanes and step
    together (a plugin restarting an evaluation relies on it)."""
    loader = finite(corpus, tok).build()
    first = [z.batch_digest(next(loader)) for _ in range(3)]
    next(loader)
    loader.node.reset(None)
    assert loader.step == 0
    assert [z.batch_digest(next(loader)) for _ in range(3)] == first


def three_sources(corpus: Path, tok, lanes: int = 4) -> z.Pipeline:
    """Two sources that repeat and a short one that stops early (one pass over one file): after it stops,
    the mixer chooses between the other two for the rest of the run, across many sentinels."""
    short = min((corpus / "web").glob("*.parquet"))
    return (z.Pipeline(seed=11, lanes=lanes, flush_every=2, flush_by="chunks")
            .source("web", z.read.parquet(str(corpus / "web"), chunk_rows=8), weight=0.5)
            .source("code", z.read.jsonl(str(corpus / "code" / "*.jsonl"), chunk_bytes=4096, unit_bytes=16384),
                    weight=0.3)
            .source("short", z.read.parquet(str(short), chunk_rows=4), weight=0.2, passes=1)
            .tokenize(tok).split(max_tokens=256)
            .mix(by="documents")
            .pack(seq_len=256, algorithm="best_fit", max_open_bins=4)
            .batch(rows_per_lane=4))


@pytest.fixture(scope="module")
def short_ends(corpus, tok):
    pipe = three_sources(corpus, tok)
    return pipe, global_hashes(pipe, 1, 45)


def short_tokens(loader) -> float:
    m = loader.metrics()
    return m["source_token_share"].get("short", 0) * m["doc_tokens"]


def test_the_short_source_ends_early(corpus, tok):
    """The premise of the resumes below: the short source has stopped before step 30 (the others go on)."""
    loader = three_sources(corpus, tok).build()
    for _ in range(30):
        next(loader)
    at_30 = short_tokens(loader)
    for _ in range(15):
        next(loader)
    assert at_30 > 0 and short_tokens(loader) == pytest.approx(at_30, rel=1e-12)
    assert loader.metrics()["flushes"] > 100  # many sentinels since it stopped


@pytest.mark.parametrize("world,new_world,at", [(1, 1, 30), (2, 2, 35), (4, 1, 30), (1, 4, 38), (2, 4, 41)])
def test_a_resume_after_a_finite_source_ended_equals_the_uninterrupted_run(short_ends, world, new_world, at):
    """A mixer rebuilt at a sentinel does not know which sources have ended (no operator state is stored):
    the uninterrupted run's mixer forgets them at each sentinel too, so both make the same choices."""
    pipe, reference = short_ends
    assert len(reference) == 45
    assert global_hashes(pipe, world, 45) == reference
    assert global_hashes(pipe, world, 45, resume_at=at, resume_world_size=new_world) == reference

"""The lane's per-document bookkeeping, done lazily: what it reports must equal the eager computation.

The merge does not ask the step clock for every document, nor count documents one by one: the clock
works out the latest decided step when an intervention asks (:attr:`LaneClock.decided`), and the source
streams book documents, pieces and tokens per chunk (:meth:`SourceStream.settle`). Both must give
exactly what the per-document computation gave, at any point of a run and across sentinels, whether the
documents came one by one (``Mixer.push_from``) or in runs (the batched text path, ``Packer.push_text_run``).
"""

from __future__ import annotations

import pytest

from zephon import build_loader
from zephon.ops.mix import Mixer
from zephon.ops.pack import Packer
from zephon.records import IGNORE, INPUT_IDS


@pytest.mark.parametrize("flush_every,by", [(1, "tokens"), (3, "tokens"), (2, "documents")])
def test_decided_step_and_counters_equal_the_per_document_computation(make_recipe, monkeypatch, flush_every, by):
    eager_steps: dict[int, int] = {}  # id(clock) -> max step over its decisions, computed per decision
    eager_counts: dict[int, dict[str, int]] = {}  # id(counters) -> docs, pieces, tokens of pushed documents
    real_next, real_push = Mixer.next_source, Mixer.push_from

    def next_source(self):
        if self.clock is not None:
            key = id(self.clock)
            eager_steps[key] = max(eager_steps.get(key, -1), self.clock.step())
        return real_next(self)

    def push_from(self, record, source):
        c = eager_counts.setdefault(id(self.clock), {"docs": 0, "pieces": 0, "tokens": 0})
        c["docs" if record.tail == IGNORE else "pieces"] += 1
        c["tokens"] += len(record[INPUT_IDS])
        return real_push(self, record, source)

    real_run = Packer.push_text_run

    def push_text_run(self, run):  # the batched text path
        taken, out = real_run(self, run)
        c = eager_counts.setdefault(id(self._clock), {"docs": 0, "pieces": 0, "tokens": 0})
        for j in range(run.first, run.first + taken):
            c["docs" if run.tails is None or run.tails[j] == IGNORE else "pieces"] += 1
        c["tokens"] += run.offsets[run.first + taken] - run.offsets[run.first]
        runs.append(taken)
        return taken, out

    runs: list[int] = []
    monkeypatch.setattr(Mixer, "next_source", next_source)
    monkeypatch.setattr(Mixer, "push_from", push_from)
    monkeypatch.setattr(Packer, "push_text_run", push_text_run)
    recipe = make_recipe(lanes=4, flush_every=flush_every, flush_by="chunks", split={"max_doc_tokens": 24},
                         mix={"by": by})
    loader = build_loader(recipe, rank=0, world_size=1)
    it = iter(loader)
    sentinels_seen = False
    for step in range(30):
        next(it)
        for lane in loader._host._lanes:
            key = id(lane.clock)
            assert lane.decided_step == eager_steps[key] <= step, (step, lane.lane)  # never ahead of delivery
            c = lane.counters
            want = eager_counts[key]
            assert (c.docs, c.pieces_split, c.doc_tokens) == (want["docs"], want["pieces"], want["tokens"])
            assert sum(c.source_tokens.values()) == want["tokens"]
            sentinels_seen |= c.flushes > 1
    assert sentinels_seen and any(v["pieces"] for v in eager_counts.values())
    # documents went through the batched text path (by tokens a run is one document: the next pick depends on
    # its length; by documents the mixer's counts give longer runs)
    assert runs and (by == "tokens" or max(runs) > 1)
    loader.close()

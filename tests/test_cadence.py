"""Sentinels by data volume: a flush every K chunks, in the middle of units, still resumes exactly.

With ``flush_by = "chunks"`` a lane's sentinels fall every K completed chunks (a few dozen records each),
wherever they are in a unit, so a resume replays at most K chunks per lane however large the files.
Hypothesis draws K, the recipe's shape, the world sizes and the step of the checkpoint; the resumed run
must continue byte for byte, and the test checks that the cases it draws really put sentinels inside
units and cut documents at them (else it would prove nothing about them).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon import WorkPlan, batch_digest, build_loader
from zephon.verify import global_hashes


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_chunk_cadence_resumes_at_every_position(make_recipe, data):
    lanes = data.draw(st.sampled_from([4, 8, 16]), "lanes")
    k = data.draw(st.integers(1, 6), "flush_every")
    recipe = make_recipe(lanes=lanes, flush_every=k, flush_by="chunks",
                         seq_len=data.draw(st.sampled_from([32, 64, 96]), "seq_len"),
                         pack={"algorithm": data.draw(st.sampled_from(["best_fit", "first_fit", "wrap"]), "alg")},
                         shuffle={"buffer": data.draw(st.integers(0, 4), "shuffle")},
                         split={"max_doc_tokens": data.draw(st.sampled_from([16, 32]), "split")})
    steps = 8
    plan = WorkPlan(recipe.to_pipeline())
    reference = global_hashes(recipe, 1, steps, plan=plan)
    at = data.draw(st.integers(1, steps - 1), "resume_at")
    w, w2 = data.draw(st.sampled_from(divisors(lanes)), "world"), data.draw(st.sampled_from(divisors(lanes)), "world2")
    assert global_hashes(recipe, w, steps, resume_at=at, resume_world_size=w2, plan=plan) == reference


@pytest.mark.parametrize("k", [1, 2, 4])
def test_chunk_sentinels_fall_inside_units_and_resume_there(make_recipe, k):
    """The cases above are not vacuous: with K chunks, sentinels stand inside units (a cursor >= 0) of
    both sources, documents are split at them, and resuming at such a state continues exactly."""
    recipe = make_recipe(lanes=8, flush_every=k, flush_by="chunks", split={"max_doc_tokens": 16})
    loader = build_loader(recipe)
    inside = 0
    for step in range(10):
        next(loader)
        state = loader.state_dict()
        inside += sum(pos[1] >= 0 for lane in state["lanes"].values() if lane["sentinels"]
                      for pos in lane["positions"].values())
    m = loader.metrics()
    assert inside > 0 and m["flushes"] >= 8 // k and m["pieces_split"] > 0
    reference = global_hashes(recipe, 1, 12)
    for at in (3, 6, 9):
        assert global_hashes(recipe, 4, 12, resume_at=at, resume_world_size=2) == reference


def test_chunk_cadence_is_in_the_fingerprint(make_recipe):
    by_units = make_recipe(flush_every=2, flush_by="units").to_pipeline().fingerprint
    by_chunks = make_recipe(flush_every=2).to_pipeline().fingerprint  # chunks: the default
    other_chunks = make_recipe(flush_every=2, flush_by="chunks", read={"chunk_rows": 8}).to_pipeline().fingerprint
    assert len({by_units, by_chunks, other_chunks}) == 3  # chunk sizes decide where chunk sentinels fall


def test_the_replay_hint_changes_speed_never_rows(make_recipe):
    """A lane state's ``replay`` (chunks taken since its sentinel, per source) only says how many chunk
    tasks a resume puts in flight: the real count, none, or absurd values give the same batches."""
    import copy

    from zephon.state import seal

    recipe = make_recipe(lanes=4, flush_every=4, flush_by="chunks", split={"max_doc_tokens": 16})
    loader = build_loader(recipe)
    for _ in range(7):
        next(loader)
    state = loader.state_dict()
    expected = [batch_digest(next(loader)) for _ in range(4)]
    loader.close()
    hints = [lane.get("replay") for lane in state["lanes"].values()]
    assert any(h and sum(h) > 0 for h in hints), hints  # the run really took chunks after its sentinels
    for change in (None, [0, 0], [2**20 - 1, 2**20 - 1], [1, 0]):
        edited = copy.deepcopy(state)
        for lane in edited["lanes"].values():
            lane.pop("replay", None)
            if change is not None and lane["rows_since_flush"]:
                lane["replay"] = change
        resumed = build_loader(recipe, num_workers=2)
        resumed.load_state_dict(seal(edited))
        assert [batch_digest(next(resumed)) for _ in range(4)] == expected, change
        resumed.close()


def test_a_resume_puts_every_lanes_replay_in_flight_before_the_first_row(make_recipe):
    """Replay runs on all workers at once: before the first row is pulled, each lane that must replay has
    submitted the chunks its state names (not one chunk per lane, which would replay lane after lane)."""
    from zephon.engine.executors import ThreadExecutor
    from zephon.engine.hosts import LocalLanes

    recipe = make_recipe(lanes=4, flush_every=6, flush_by="chunks")
    loader = build_loader(recipe)
    for _ in range(5):
        next(loader)
    state = loader.state_dict()
    loader.close()
    program = loader.program
    submitted: list[int] = []

    class Counting(ThreadExecutor):
        def submit(self, source, stage, item):
            submitted.append(source)
            return super().submit(source, stage, item)

    pool = Counting(program.stages, 2)
    host = LocalLanes(program, range(4), lambda s, k: pool, depth=1)
    host.reset({lane: program.parse_state(state["lanes"][str(lane)], lane) for lane in range(4)})
    hinted = sum(sum(v.get("replay", [])) for v in state["lanes"].values())
    pool.close()
    assert hinted > 4 and len(submitted) >= hinted  # depth 1 alone would have put 4 + 4 in flight

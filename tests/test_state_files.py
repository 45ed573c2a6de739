"""Loader states are untrusted input: edited, corrupted or malformed ones are refused, never run.

Before: ``rows_since_flush = -1`` or ``10**5`` hung the loader; ``unit_seq +- 1``, a negative or huge
offset, a cursor past the end of a unit or inside a JSON Lines line silently changed the stream;
``load_state_dict(None)`` and malformed containers gave raw exceptions. Each case here is a state a
user could hand to ``load_state_dict``; each must be a :class:`zephon.StateError` (or the SourceError
of a replay that cannot match) naming the lane and the field, within a bounded time. The edits are made
twice: as they are (the integrity digest refuses them) and with the digest recomputed (as a tool that
rewrites states would), which the field checks and the replay must refuse on their own.
"""

from __future__ import annotations

import copy
import json
import os

import pytest

from zephon import SourceError, StateError, build_loader, merge_states, save_state
from zephon.state import seal, state_digest


@pytest.fixture(scope="module")
def recipe(make_recipe):
    return make_recipe(lanes=16, flush_every=1)


@pytest.fixture(scope="module")
def state(recipe):
    """A state mid-segment: lanes have passed sentinels and delivered rows since, and the JSONL source
    ('code') of some lanes stands inside a unit."""
    loader = build_loader(recipe)
    for _ in range(10):
        next(loader)
    st = json.loads(json.dumps(loader.state_dict()))
    assert sum(lane["rows_since_flush"] > 0 and lane["sentinels"] > 0 for lane in st["lanes"].values()) >= 8
    assert any(lane["positions"]["code"][1] > 0 for lane in st["lanes"].values())
    assert any(lane["clock"][1] >= 1 and lane["rows_since_flush"] for lane in st["lanes"].values())  # a held row
    return st


def lane_with_release(state: dict) -> str:
    """A lane whose packer held a row over its last sentinel and released it at a document after it."""
    return next(k for k, v in state["lanes"].items() if v["clock"][1] >= 1)


def lane_with_cursor(state: dict) -> str:
    return next(k for k, v in state["lanes"].items() if v["positions"]["code"][1] > 0)


def load(recipe, state) -> None:
    loader = build_loader(recipe)
    loader.load_state_dict(state)
    for _ in range(3):
        next(loader)


def edited(state: dict, edit) -> dict:
    st = copy.deepcopy(state)
    edit(st)
    return st


EDITS = {
    "rows_since_flush -1": (lambda s: s["lanes"]["1"].update(rows_since_flush=-1), r"lane 1: rows_since_flush = -1"),
    "rows_since_flush 10**5": (lambda s: s["lanes"]["1"].update(rows_since_flush=10**5),
                               r"lane 1: its clock says \d+ rows before its last sentinel and 100000 since"),
    "rows_since_flush and step both raised": (  # every lane's total adds up: only the replay can tell
        lambda s: (s.update(step=s["step"] + 5000),
                   [lane.update(rows_since_flush=lane["rows_since_flush"] + 10000) for lane in s["lanes"].values()]),
        r"lane \d+: the state says \d+ rows were delivered after its last sentinel"),
    "clock release as a float": (lambda s: s["lanes"]["1"]["clock"].__setitem__(1, 1.5),
                                 r"lane 1: clock\[1\] \(release\) must be an integer"),
    "clock release below -1": (lambda s: s["lanes"]["1"]["clock"].__setitem__(1, -2),
                               r"lane 1: clock\[1\] \(release\) = -2 is outside"),
    "a carry without a held row": (lambda s: (s["lanes"]["1"]["clock"].__setitem__(1, -1),
                                              s["lanes"]["1"].update(carry=5)), r"lane 1: clock .* cannot happen"),
    "release moved later than the carry ends": (
        lambda s: s["lanes"][lane_with_release(s)]["clock"].__setitem__(1, s["lanes"][lane_with_release(s)]["clock"][1] + 3),
        r"does not agree with the data"),
    "release at the next sentinel though the carry ends earlier": (
        lambda s: s["lanes"][lane_with_release(s)]["clock"].__setitem__(1, 0), r"does not agree with the data"),
    "clock of three numbers": (lambda s: s["lanes"]["1"]["clock"].append(0), r"lane 1: clock must be \[rows, release\]"),
    "unit_seq + 1": (lambda s: s["lanes"]["2"]["positions"]["web"].__setitem__(0, s["lanes"]["2"]["positions"]["web"][0] + 1),
                     None),
    "negative skip": (lambda s: s["lanes"]["0"]["positions"]["web"].__setitem__(2, -3), r"lane 0: .*skip\) = -3"),
    "huge skip": (lambda s: s["lanes"][lane_with_cursor(s)]["positions"]["code"].__setitem__(2, 10**6),
                  r"does not fall between two records"),
    "cursor past the unit": (lambda s: s["lanes"][lane_with_cursor(s)]["positions"]["code"].__setitem__(1, 10**9),
                             r"cursor 1000000000 is outside unit"),
    "cursor inside a line": (lambda s: s["lanes"][lane_with_cursor(s)]["positions"]["code"].__setitem__(
        1, s["lanes"][lane_with_cursor(s)]["positions"]["code"][1] + 3), r"is not a position a lane can stand at"),
    "carry as a string": (lambda s: s["lanes"]["3"].update(carry="12"), r"lane 3: carry must be an integer"),
    "sentinels as a bool": (lambda s: s["lanes"]["3"].update(sentinels=True), r"lane 3: sentinels must be an integer"),
    "position of 2 numbers": (lambda s: s["lanes"]["0"]["positions"].__setitem__("web", [1, 2]),
                              r"lane 0: positions\['web'\] must be \[unit_seq, cursor, skip\]"),
    "unknown source": (lambda s: s["lanes"]["0"]["positions"].update(extra=[0, -1, 0]), r"positions name sources"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(EDITS))
def test_an_edited_state_is_refused_by_its_digest(recipe, state, name):
    with pytest.raises(StateError, match=r"lane \d+ fails its integrity check|header digest mismatch"):
        load(recipe, edited(state, EDITS[name][0]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(k for k, (_, m) in EDITS.items() if m))
def test_a_resealed_bad_state_is_refused_by_its_field_checks(recipe, state, name):
    edit, match = EDITS[name]
    with pytest.raises((StateError, SourceError), match=match):
        load(recipe, seal(edited(state, edit)))


def test_the_untouched_state_loads_and_a_resealed_copy_is_identical(recipe, state):
    assert seal(copy.deepcopy(state)) == state
    load(recipe, state)


@pytest.mark.parametrize("bad,match", [
    (None, r"load_state_dict\(None\)"),
    ([1, 2], "not a Zephon loader state"),
    ("{}", "not a Zephon loader state"),
])
def test_not_a_state_at_all(recipe, bad, match):
    with pytest.raises(StateError, match=match):
        build_loader(recipe).load_state_dict(bad)


@pytest.mark.parametrize("edit,match", [
    (lambda s: s.update(lanes=[s["lanes"]["0"]]), "'lanes' must map lane numbers"),
    (lambda s: s["lanes"].update({"x1": s["lanes"]["0"]}), "lane key 'x1' is not a lane number"),
    (lambda s: s["lanes"].update({"07": s["lanes"]["0"]}), "lane key '07' is not a lane number"),
    (lambda s: s.pop("step"), "'step' must be an integer"),
    (lambda s: s.update(step=-1), "'step' must be an integer >= 0"),
    (lambda s: s.pop("digest"), "header digest mismatch"),
], ids=["lanes-as-list", "non-numeric-key", "leading-zero-key", "no-step", "negative-step", "no-digest"])
def test_malformed_containers_get_clear_errors(recipe, state, edit, match):
    st = edited(state, edit)
    with pytest.raises(StateError, match=match):
        build_loader(recipe).load_state_dict(st)
    if "digest" in st:  # the same, digest recomputed: the container checks refuse it on their own
        with pytest.raises(StateError, match=match):
            build_loader(recipe).load_state_dict(seal(st))


def test_a_subset_of_lanes_keeps_its_digests(recipe, state):
    """Plugins store each lane apart and reassemble a rank's lanes: a subset must still check out."""
    part = {**state, "lanes": {k: v for k, v in state["lanes"].items() if int(k) < 8}}
    build_loader(recipe, rank=0, world_size=2).load_state_dict(part)


def test_lanes_outside_the_pipeline_are_refused(recipe, state):
    st = edited(state, lambda s: s["lanes"].update({"99": s["lanes"]["0"]}))
    with pytest.raises(StateError, match=r"holds lanes \[99\] but the pipeline has 16 lanes"):
        build_loader(recipe).load_state_dict(seal(st))


def test_merged_states_carry_a_valid_digest_and_merging_checks_each(recipe):
    ranks = [build_loader(recipe, rank=r, world_size=2) for r in range(2)]
    for ld in ranks:
        next(ld)
    parts = [ld.state_dict() for ld in ranks]
    merged = merge_states(parts)
    assert merged["digest"] == state_digest(merged) and seal(copy.deepcopy(merged)) == merged
    build_loader(recipe).load_state_dict(merged)
    parts[1]["lanes"]["9"]["rows_since_flush"] += 1
    with pytest.raises(StateError, match="state #1: lane 9 fails its integrity check"):
        merge_states(parts)


def test_save_state_syncs_the_file_before_the_rename(tmp_path, state, monkeypatch):
    """A crash right after save_state returns must leave the new state on disk, not an empty file: the
    data is fsynced before the rename (and the folder after it)."""
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b))[1])
    save_state(state, tmp_path / "s.json")
    assert calls[:2] == ["fsync", "replace"] and json.loads((tmp_path / "s.json").read_text()) == state
    assert not list(tmp_path.glob("*.tmp"))

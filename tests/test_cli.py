"""The ``zephon`` command line, run in-process through ``zephon.cli.main``.

Hashes printed by the CLI are compared with digests computed here from ``build_loader`` (actual values,
not counts), so a CLI that printed plausible but wrong hashes, or resumed at the wrong place, fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import zephon as z
from zephon import WorkPlan, batch_digest, build_loader, global_digest, load_recipe, load_state
from zephon.cli import main

try:
    from tests.conftest import base_recipe_dict
except ImportError:  # pragma: no cover - tests/ collected as a rootdir-less folder
    from conftest import base_recipe_dict

REPO = Path(__file__).resolve().parents[1]
STEP_LINE = re.compile(r"^step\s+(\d+)\s+sha256 ([0-9a-f]{64})\s+tok/s last\s+(\d+) steps?\s+(\S+)\s+avg\s+(\S+)"
                       r"\s+non-pad ([0-9.]+)$", re.M)


# -- helpers ----------------------------------------------------------------------------------------
def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def to_toml(data: dict[str, Any]) -> str:
    """A recipe dict as TOML: scalars, then [tables], then [[arrays of tables]]."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items()
             if not isinstance(v, dict) and not (isinstance(v, list) and v and isinstance(v[0], dict))]
    for key, value in data.items():
        if isinstance(value, dict):
            lines += ["", f"[{key}]"] + [f"{k} = {_toml_value(v)}" for k, v in value.items()]
    for key, value in data.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            for table in value:
                lines += ["", f"[[{key}]]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def write_recipe(path: Path, corpus: Path, sp_model: Path, **overrides: Any) -> Path:
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    data.update(overrides)
    path.write_text(to_toml(data))
    return path


def step_lines(text: str) -> list[tuple[int, str]]:
    return [(int(step), digest) for step, digest, *_ in STEP_LINE.findall(text)]


def reference_digests(recipe_path: Path, rank: int, world_size: int, steps: int) -> list[str]:
    with build_loader(load_recipe(recipe_path), rank=rank, world_size=world_size) as loader:
        return [batch_digest(next(loader)) for _ in range(steps)]


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory, corpus, sp_model) -> Path:
    return write_recipe(tmp_path_factory.mktemp("cli") / "recipe.toml", corpus, sp_model)


# -- run --------------------------------------------------------------------------------------------
def test_written_recipe_matches_the_fixture_recipe(recipe_path, make_recipe):
    """The hand-written TOML is the same recipe as the fixture's (so its data is as exercised)."""
    loaded, expected = load_recipe(recipe_path), make_recipe()
    assert loaded.replace(origin="x") == expected.replace(origin="x")


def test_run_prints_the_digests_of_the_rank_batches(recipe_path, capsys):
    assert main(["run", str(recipe_path), "--world-size", "2", "--rank", "1", "--steps", "5", "--quiet"]) == 0
    out = capsys.readouterr().out
    lines = step_lines(out)
    assert [s for s, _ in lines] == [0, 1, 2, 3, 4]  # global steps count from 0
    assert [d for _, d in lines] == reference_digests(recipe_path, 1, 2, 5)
    assert len({d for _, d in lines}) == 5
    fractions = [float(f) for *_, f in STEP_LINE.findall(out)]
    assert all(0.5 < f <= 1.0 for f in fractions)
    for word in ("summary:", "pad_fraction", "flush_pad_fraction", "flushes", "docs_delivered", "docs_taken",
                 "source_token_share", "web", "code"):
        assert word in out


@pytest.mark.e2e
def test_run_with_thread_workers_and_hash_every(recipe_path):
    """Workers change speed only. Run as a subprocess so that a crash in a worker fails this test alone."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "zephon", "run", str(recipe_path), "--steps", "8", "--num-workers", "2",
            "--runner", "thread", "--hash-every", "3", "--quiet"]
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, f"exit status {result.returncode}; stderr:\n{result.stderr[-3000:]}"
    ref = reference_digests(recipe_path, 0, 1, 8)
    assert step_lines(result.stdout) == [(2, ref[2]), (5, ref[5]), (7, ref[7])]  # every 3rd step, and the last


def test_run_labels_the_recent_and_the_average_rate(recipe_path, capsys):
    """Each step line shows the rate over the last 10 steps (fewer at the start), then the average since the
    start; the legend and the summary say which figure covers which window."""
    assert main(["run", str(recipe_path), "--steps", "12", "--quiet"]) == 0
    out = capsys.readouterr().out
    found = STEP_LINE.findall(out)
    assert [int(step) for step, *_ in found] == list(range(12))
    assert [int(window) for _, _, window, *_ in found] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 10, 10]
    _, _, _, recent, average, _ = found[0]
    assert recent == average  # one step: both windows are that step
    assert "over the last 10 steps (fewer at the start) and on average since the first batch" in out
    summary = out[out.index("summary:"):]
    assert re.search(r"^summary: 12 steps, \d+ tokens \(padding included\) in [0-9.]+s$", summary, re.M)
    assert re.search(r"first batch after [0-9.]+s;  tok/s: \S+ average over all 12 steps \(first batch included\), "
                     r"\S+ average after the first batch \(11 steps\), \S+ over the last 10 steps$", summary, re.M)
    assert "tok/s here" not in out and "tok/s loader" not in out  # the two unlabelled figures of old


def test_throughput_windows():
    """The arithmetic behind those figures, on made-up step times: a slow first batch (10 s) then one
    step a second; 100 tokens a step."""
    from zephon.cli import _Throughput

    rate = _Throughput(started=0.0, window=3)
    assert rate.after_first() is None
    rate.add(10.0, 100)
    assert (rate.window_steps, rate.recent(), rate.average(), rate.after_first()) == (1, 10.0, 10.0, None)
    for t in (11.0, 12.0, 13.0, 14.0):
        rate.add(t, 100)
    assert rate.window_steps == 3 and rate.tokens == 500
    assert rate.recent() == 100.0            # steps ending at 12, 13, 14: 300 tokens in 3 s (from 11 s)
    assert rate.average() == 500 / 14        # since the start, the first batch's 10 s included
    assert rate.after_first() == 400 / 4     # from the end of the first step
    assert rate.first_batch_at == (10.0, 100)


def test_run_save_then_resume_on_other_world_sizes(recipe_path, tmp_path, capsys):
    single = tmp_path / "w1.json"
    assert main(["run", str(recipe_path), "--steps", "3", "--save-state", str(single), "--quiet"]) == 0
    capsys.readouterr()
    state = load_state(single)
    assert state["step"] == 3 and sorted(map(int, state["lanes"])) == list(range(16))

    # A single-rank checkpoint resumed on rank 1 of 2: continues exactly where W=2 would be.
    assert main(["run", str(recipe_path), "--world-size", "2", "--rank", "1", "--steps", "3",
                 "--resume", str(single), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "resumed at step 3" in out and "steps 0..2 were delivered before the checkpoint" in out
    ref = reference_digests(recipe_path, 1, 2, 6)
    assert step_lines(out) == [(3, ref[3]), (4, ref[4]), (5, ref[5])]

    # Both ranks of a W=2 checkpoint, merged, resumed on rank 2 of 4.
    parts = [tmp_path / f"w2-r{r}.json" for r in range(2)]
    for r, part in enumerate(parts):
        assert main(["run", str(recipe_path), "--world-size", "2", "--rank", str(r), "--steps", "3",
                     "--save-state", str(part), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["run", str(recipe_path), "--world-size", "4", "--rank", "2", "--steps", "2", "--quiet",
                 "--resume", str(parts[0]), "--resume", str(parts[1])]) == 0
    ref = reference_digests(recipe_path, 2, 4, 5)
    assert step_lines(capsys.readouterr().out) == [(3, ref[3]), (4, ref[4])]


def test_resume_errors_are_one_line(recipe_path, tmp_path, corpus, sp_model, capsys):
    # Lanes missing from the state: rank 1 of 2 saved lanes 8..15, rank 0 needs 0..7.
    part = tmp_path / "r1.json"
    assert main(["run", str(recipe_path), "--world-size", "2", "--rank", "1", "--steps", "1",
                 "--save-state", str(part), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["run", str(recipe_path), "--steps", "1", "--resume", str(part), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zephon: error: ") and "Traceback" not in err and err.count("\n") == 1
    # The command line's fix (repeat --resume with every rank's file), not the Python API's (merge_states).
    assert f"{part} (rank 1 of 2: lanes 8..15)" in err and "lanes 0..7 are in none of them" in err
    assert "the state files of all 2 ranks" in err and "repeating the flag" in err and "--resume" in err
    assert "merge_states" not in err
    # Rank 0 of 2 needs exactly the lanes the file lacks; rank 1 of 2 needs no other file.
    assert main(["run", str(recipe_path), "--world-size", "2", "--rank", "0", "--steps", "1", "--resume",
                 str(part), "--quiet"]) == 2
    assert "lanes 0..7 are in none of them" in capsys.readouterr().err
    assert main(["run", str(recipe_path), "--world-size", "2", "--rank", "1", "--steps", "1", "--resume",
                 str(part), "--quiet"]) == 0
    capsys.readouterr()

    # A state from another recipe (different seed).
    other = write_recipe(tmp_path / "other.toml", corpus, sp_model, seed=8)
    assert main(["run", str(other), "--steps", "1", "--resume", str(part), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zephon: error: ") and "seed" in err

    # Not a state at all, and a missing file.
    junk = tmp_path / "junk.json"
    junk.write_text("not json")
    assert main(["run", str(recipe_path), "--resume", str(junk), "--quiet"]) == 2
    assert capsys.readouterr().err.startswith(f"zephon: error: {junk}")
    assert main(["run", str(recipe_path), "--resume", str(tmp_path / "nope.json"), "--quiet"]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_run_world_size_not_dividing_lanes(recipe_path, capsys):
    assert main(["run", str(recipe_path), "--world-size", "3", "--steps", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zephon: error: ") and "world_size=3" in err and "lanes=16" in err
    assert "Traceback" not in err and err.count("\n") == 1


def _document_ends(batch: dict) -> int:
    """Documents that end in a packed batch, read from its tensors alone: segments (``segment_ids`` 1, 2, ...
    per row) whose last position's label is -100 (a piece cut at the row's end has the next token there)."""
    ends = 0
    for seg_row, label_row in zip(batch["segment_ids"].tolist(), batch["labels"].tolist()):
        last = {seg: i for i, seg in enumerate(seg_row) if seg}  # each segment's last position
        ends += sum(1 for i in last.values() if label_row[i] == -100)
    return ends


def test_documents_taken_and_delivered_are_counted_apart(recipe_path, make_recipe, corpus, capsys):
    """``docs_delivered`` is the number of documents that end in the delivered batches (counted here from the
    tensors); ``docs_taken``, what the lanes took in, runs ahead of it; ``docs`` is the old name of the latter.
    `zephon run` prints both, each labelled."""
    steps = 4
    with build_loader(make_recipe(), rank=0, world_size=1) as loader:
        ends = [_document_ends(next(loader)) for _ in range(steps)]
        m = loader.metrics()
        ends += [_document_ends(next(loader)) for _ in range(3)]
    assert m["docs_delivered"] == sum(ends[:steps]) > 0
    assert m["docs_taken"] >= m["docs_delivered"] and m["docs"] == m["docs_taken"]
    assert m["pieces_split"] > 0  # documents cut over rows occur, and count once (at their end)
    # A function of the delivered batches alone: resumed after `steps` steps on two ranks, with workers, the
    # ranks count the rest of the continuous run's document ends, no replayed one.
    with build_loader(make_recipe(), rank=0, world_size=1) as loader:
        for _ in range(steps):
            next(loader)
        state = loader.state_dict()
    counted = 0
    for rank in (0, 1):
        with build_loader(make_recipe(), rank=rank, world_size=2, num_workers=1) as loader:
            loader.load_state_dict(state)
            for _ in range(3):
                next(loader)
            counted += loader.metrics()["docs_delivered"]
    assert counted == sum(ends[steps:])

    assert main(["run", str(recipe_path), "--steps", str(steps), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"docs_delivered {sum(ends[:steps])} \(documents that end in this rank's delivered batches\)  "
                     rf"docs_taken {m['docs_taken']} \(documents its lanes took in;", out), out
    assert not re.search(r"\bdocs \d", out)  # the unlabelled count of old

    # Without pack(), a row is one record: every delivered record is a delivered document.
    pipe = (z.Pipeline(seed=1, lanes=4).source("code", z.read.jsonl(str(corpus / "code" / "*.jsonl"), columns=["text"]))
            .shuffle(buffer=8).batch(rows_per_lane=3))
    with pipe.build(rank=0, world_size=1) as loader:
        valid = sum(int(next(loader)["valid"].sum()) for _ in range(3))
        m = loader.metrics()
    assert m["docs_delivered"] == valid == 36 and m["docs_taken"] >= valid


# -- verify -----------------------------------------------------------------------------------------
def test_verify_agrees_across_world_sizes_and_resumes(recipe_path, capsys):
    steps = 4
    code = main(["verify", str(recipe_path), "--world-sizes", "1,2,4", "--steps", str(steps), "--resume-at", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [line for line in out.splitlines() if line.startswith("W=")]
    # W=1 inline is the reference, shown once as such; the others are compared with it
    assert re.fullmatch(r"W=1 workers=0 inline\s*\|\s*4\s*\|\s*\(reference\)\s*\|\s*-\s*", rows[0]), rows
    compared = rows[1:]
    assert [r.split("|")[0].strip() for r in compared] == [
        "W=2 workers=0 inline", "W=4 workers=0 inline",
        "W=1 -> W=2 at step 2", "W=2 -> W=4 at step 2", "W=4 -> W=1 at step 2"]
    assert all(re.search(r"\|\s*4\s*\|\s*yes\s*\|\s*-\s*$", row) for row in compared), compared
    assert "NO" not in out and "OK: all 5 configurations agree with the reference" in out
    with build_loader(load_recipe(recipe_path), rank=0, world_size=1) as loader:
        last = [global_digest([next(loader)]) for _ in range(steps)][-1]
    assert f"reference sha256 of step {steps - 1} (the last global batch): {last}" in out


def test_verify_never_compares_the_reference_with_itself(recipe_path, capsys, monkeypatch):
    """W=1 inline runs once, as the reference; W=1 with workers, or resumed from W=1, is still compared."""
    import zephon.verify as zv

    real, runs = zv.global_hashes, []

    def counted(recipe, world_size, steps, num_workers=0, runner="thread", resume_at=None, **kwargs):
        runs.append((world_size, num_workers, resume_at))
        return real(recipe, world_size, steps, num_workers, runner, resume_at=resume_at, **kwargs)

    monkeypatch.setattr(zv, "global_hashes", counted)
    assert main(["verify", str(recipe_path), "--world-sizes", "1,2", "--num-workers", "0,1", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert runs.count((1, 0, None)) == 1  # the reference, and no comparison of it with itself
    assert sorted(runs) == [(1, 0, None), (1, 1, None), (2, 0, None), (2, 1, None)]
    reference_rows = [line for line in out.splitlines() if line.startswith("W=1 workers=0 inline")]
    assert len(reference_rows) == 1 and "(reference)" in reference_rows[0]
    assert re.search(r"^W=1 workers=1 thread\s*\|\s*2\s*\|\s*yes", out, re.MULTILINE)
    assert "OK: all 3 configurations agree with the reference" in out

    # Only the reference: nothing is compared, and the output says so (not "all 1 configurations agree").
    runs.clear()
    assert main(["verify", str(recipe_path), "--world-sizes", "1", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert runs == [(1, 0, None)] and "nothing compared" in out and "configurations agree" not in out


def test_verify_reports_a_mismatch_with_exit_code_1(recipe_path, capsys, monkeypatch):
    """A rank-dependent loader (simulated) must be caught: exit 1 and the first differing step."""
    import zephon.verify as zv

    real = zv.global_hashes

    def broken(recipe, world_size, steps, *args, **kwargs):
        hashes = real(recipe, world_size, steps, *args, **kwargs)
        return hashes if world_size == 1 else hashes[:2] + ["0" * 64] * (steps - 2)

    monkeypatch.setattr(zv, "global_hashes", broken)
    assert main(["verify", str(recipe_path), "--world-sizes", "1,2", "--steps", "3"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"W=2 workers=0 inline\s*\|\s*3\s*\|\s*NO\s*\|\s*2\s*$", out, re.M), out
    assert "MISMATCH in 1 of 1" in out


def test_verify_world_size_not_dividing_lanes(recipe_path, capsys):
    assert main(["verify", str(recipe_path), "--world-sizes", "1,3", "--steps", "2"]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("zephon: error: ") and "world_size=3" in err and "lanes=16" in err
    assert "Traceback" not in err and err.count("\n") == 1
    assert captured.out == ""  # rejected before any batch is built


def test_verify_rejects_a_resume_step_outside_the_run(recipe_path, capsys):
    assert main(["verify", str(recipe_path), "--world-sizes", "1,2", "--steps", "2", "--resume-at", "2"]) == 2
    assert "--resume-at 2" in capsys.readouterr().err


def test_run_and_verify_number_steps_alike(recipe_path, tmp_path, capsys):
    """Step k is the (k+1)-th global batch in every command: the hash `run` prints at step k (one rank: the
    global batch) is the one `verify` reports for step k, and a checkpoint saved after step k resumes at k+1."""
    assert main(["run", str(recipe_path), "--steps", "6", "--quiet"]) == 0
    by_step = dict(step_lines(capsys.readouterr().out))
    assert sorted(by_step) == [0, 1, 2, 3, 4, 5] and len(set(by_step.values())) == 6
    for k in (0, 3, 5):
        assert main(["verify", str(recipe_path), "--world-sizes", "1", "--steps", str(k + 1)]) == 0
        out = capsys.readouterr().out
        assert f"steps 0..{k}," in out
        assert f"reference sha256 of step {k} (the last global batch): {by_step[k]}" in out

    state = tmp_path / "s.json"
    assert main(["run", str(recipe_path), "--steps", "3", "--save-state", str(state), "--quiet"]) == 0
    assert f"saved loader state after step 2 to {state} (a resume continues at step 3)" in capsys.readouterr().out
    assert load_state(state)["step"] == 3  # as loader.step counts: batches delivered, the next step's number
    assert main(["run", str(recipe_path), "--steps", "3", "--resume", str(state), "--quiet"]) == 0
    assert step_lines(capsys.readouterr().out) == [(k, by_step[k]) for k in (3, 4, 5)]


def test_help_texts_number_steps_from_0(capsys):
    """`zephon --help` says once how steps are numbered; the options that take a step say it in the same terms."""
    assert main(["--help"]) == 0
    assert "Global steps are numbered from 0" in " ".join(capsys.readouterr().out.split())
    assert main(["run", "--help"]) == 0
    assert "steps 0..N-1" in " ".join(capsys.readouterr().out.split())
    assert main(["verify", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "steps 0..N-1" in text and "checkpoint after steps 0..K-1" in text and "resume at step K" in text


# -- inspect ----------------------------------------------------------------------------------------
def test_inspect_lists_sources_and_lane_units(recipe_path, capsys):
    assert main(["inspect", str(recipe_path), "--lanes-shown", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\s+web: parquet .*web$", out, re.M)
    assert re.search(r"^\s+code: jsonl .*code/\*\.jsonl$", out, re.M)
    assert re.search(r"^\s+8 files, \d+ units, [0-9.]+ units/lane, weight 0.7 \(share 0.700\)$", out, re.M)
    assert re.search(r"^\s+4 files, \d+ units, [0-9.]+ units/lane, weight 0.3 \(share 0.300\)$", out, re.M)
    for word in ("seed 7", "lanes 16", "seq_len 64", "global batch 32", "flush_every 2", "sentencepiece",
                 "best_fit", "mix_by tokens", "lane 0:", "lane 1:"):
        assert word in out
    assert "lane 2:" not in out

    assert main(["inspect", str(recipe_path), "--lanes-shown", "3", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    plan = WorkPlan(load_recipe(recipe_path).to_pipeline())
    assert [(s["name"], s["files"], s["units"]) for s in info["sources"]] == \
        [("web", 8, len(plan.sources[0].units)), ("code", 4, len(plan.sources[1].units))]
    assert info["sources"][0]["units_per_lane"] == len(plan.sources[0].units) / 16
    assert [e["lane"] for e in info["lanes_shown"]] == [0, 1, 2]
    for entry in info["lanes_shown"]:
        for sp in plan.sources:
            shown = entry["units"][sp.spec.name]
            expected = [sp.lane_unit(entry["lane"], i) for i in range(3)]
            assert [(u["file"], u["start"], -1 if u["end"] is None else u["end"]) for u in shown] == \
                [(os.path.basename(sp.files[u.file]), u.start, u.end) for u in expected]


def test_inspect_tidies_paths_for_display(tmp_path, corpus, sp_model, capsys):
    """A glob relative to the recipe is joined to the recipe's folder as written (``recipes/../data/*.jsonl``):
    `inspect` shows it normalised; URLs are never normalised (in an object store ``..`` is part of a key)."""
    from zephon.cli import _display_path

    folder = tmp_path / "recipes" / "sub"
    folder.mkdir(parents=True)
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    data["sources"][1]["path"] = os.path.relpath(corpus / "code", folder) + "/*.jsonl"
    assert ".." in data["sources"][1]["path"]
    (folder / "r.toml").write_text(to_toml(data))
    assert main(["inspect", str(folder / "r.toml"), "--lanes-shown", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^  code: jsonl {re.escape(str(corpus / 'code' / '*.jsonl'))}$", out, re.MULTILINE), out
    assert "/../" not in out
    assert _display_path("recipes/../data/code/*.jsonl") == "data/code/*.jsonl"
    for url in ("s3://bucket/a/../b/*.jsonl", "gs://b/./x//y.parquet", "az://c/a/../b"):
        assert _display_path(url) == url


# -- errors, demo, entry points ---------------------------------------------------------------------
@pytest.mark.parametrize("command", ["run", "verify", "inspect"])
def test_unknown_recipe_key_is_a_one_line_error(tmp_path, corpus, sp_model, capsys, command):
    bad = write_recipe(tmp_path / "bad.toml", corpus, sp_model, flush_evry=2)
    assert main([command, str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("zephon: error: ") and "flush_evry" in captured.err
    assert "flush_every" in captured.err  # the suggestion
    assert "Traceback" not in captured.err and captured.err.count("\n") == 1


def test_missing_recipe_and_missing_source(tmp_path, corpus, sp_model, capsys):
    assert main(["inspect", str(tmp_path / "absent.toml")]) == 2
    assert "absent.toml" in capsys.readouterr().err
    data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    data["sources"][1]["path"] = str(tmp_path / "nowhere")
    (tmp_path / "nosrc.toml").write_text(to_toml(data))
    assert main(["inspect", str(tmp_path / "nosrc.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zephon: error: ") and "nowhere" in err and "'code'" in err


def test_tokenizer_by_a_missing_path_is_a_clear_error(tmp_path, monkeypatch):
    """``z.tokenizer(path)`` reads the kind from the file: a missing file is a RecipeFileError (still a
    FileNotFoundError) naming the path and the fix, not a raw traceback from open(); the demo's tokenizers
    say which command builds them."""
    from zephon.errors import RecipeFileError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeFileError) as info:
        z.tokenizer("missing.model")
    msg = str(info.value)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, z.RecipeError)
    assert "tokenizer('missing.model')" in msg and str(tmp_path / "missing.model") in msg
    assert "pass the path of a SentencePiece .model, a Hugging Face tokenizer.json or a tiktoken" in msg
    with pytest.raises(RecipeFileError, match=r"run `zephon demo recipes` to build the demo's tokenizers"):
        z.tokenizer("recipes/tok_vl.model")  # the README's Images snippet before `zephon demo recipes`
    (tmp_path / "toks").mkdir()
    (tmp_path / "toks" / "tok.model").write_bytes(b"x")
    with pytest.raises(RecipeFileError, match=r"is a folder, not a tokenizer file: pass one of the files in it, "
                                              r"e\.g\. toks/tok\.model"):
        z.tokenizer("toks")


def test_usage_errors_and_help(capsys):
    assert main([]) == 2
    assert "usage: zephon" in capsys.readouterr().err
    assert main(["verify", "x.toml", "--world-sizes", "1,two"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(cmd in out for cmd in ("demo", "run", "verify", "inspect"))


def test_demo_force_rebuilds_every_part(tmp_path, capsys, monkeypatch):
    """With every part present, `demo` has nothing to do; --force passes every part (and the options) on."""
    import zephon.demo

    for pattern in zephon.demo.PARTS["text"] + zephon.demo.PARTS["tokenizer"] + zephon.demo.PARTS["vl"]:
        path = tmp_path / pattern.replace("*", "part-0000")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    monkeypatch.setattr(zephon.demo, "make_demo", lambda *a, **k: pytest.fail("regenerated"))
    assert main(["demo", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "already present" in out and "nothing to do" in out and "--force rebuilds everything" in out

    calls = []
    monkeypatch.setattr(zephon.demo, "make_demo",
                        lambda *a, **k: calls.append((a, k)) or {"prose": 1, "code": 2, "built": ["text"]})
    assert main(["demo", str(tmp_path), "--force", "--max-files", "5", "--vocab-size", "300"]) == 0
    assert calls == [((tmp_path, 5, 300), {"parts": ["text", "tokenizer", "vl"]})]
    assert "1 prose documents" in capsys.readouterr().out


def test_demo_tokenizer_training_errors_are_one_line(tmp_path, capsys, monkeypatch):
    import zephon.demo

    def fail(*args, **kwargs):
        raise RuntimeError("INTERNAL: src/trainer_interface.cc(638) [(required_chars_.size()) <= (vocab_size())] "
                           "Vocabulary size is smaller than required_chars. 300 vs 353.")

    monkeypatch.setattr(zephon.demo, "make_demo", fail)
    assert main(["demo", str(tmp_path), "--vocab-size", "300"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zephon: error: training the demo tokenizer failed: Vocabulary size is smaller")
    assert "--vocab-size" in err and err.count("\n") == 1


def _tree(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root``: its bytes and its modification time (ns)."""
    return {str(f.relative_to(root)): (f.read_bytes(), f.stat().st_mtime_ns) for f in sorted(root.rglob("*"))
            if f.is_file()}


@pytest.mark.timeout(600)
def test_demo_builds_each_missing_part(tmp_path, capsys):
    """`zephon demo` builds whatever part is missing and keeps the others, so running it again after the
    vision extra is installed adds the vision-language data. Real files, nothing mocked: Pillow and
    scikit-image are installed here (and in CI)."""
    from tests.optional import require

    require("PIL")
    require("skimage")
    out_dir = tmp_path / "recipes"  # a copy of recipes/ as a clone has it, before `zephon demo recipes`
    shutil.copytree(REPO / "recipes", out_dir,
                    ignore=shutil.ignore_patterns("data", "tok.model", "tok_vl.model", "tok.vocab", "__pycache__"))
    argv = ["demo", str(out_dir), "--max-files", "25", "--vocab-size", "400"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "text corpus" in printed and "tokenizer (tok.model)" in printed and "image-caption pairs" in printed
    text = {k: v for k, v in _tree(out_dir).items() if k.startswith(("data/web", "data/code", "data/chat"))}
    vl = {k: v for k, v in _tree(out_dir).items() if k.startswith("data/vl/") or k == "tok_vl.model"}
    assert len(text) == 16 and any(k.endswith(".tar") for k in vl) and "tok_vl.model" in vl
    assert main(["run", str(out_dir / "quickstart.toml"), "--world-size", "8", "--rank", "7", "--steps", "1",
                 "--quiet"]) == 0
    assert [s for s, _ in step_lines(capsys.readouterr().out)] == [0]

    # Everything present: nothing to do, nothing rewritten.
    before = _tree(out_dir)
    assert main(argv) == 0
    assert "nothing to do" in capsys.readouterr().out and _tree(out_dir) == before

    # The vision-language part missing (as on a machine without the extra): the next run adds it, the
    # same bytes as before, and leaves the text corpus and tok.model untouched.
    shutil.rmtree(out_dir / "data" / "vl")
    (out_dir / "tok_vl.model").unlink()
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "wrote the demo's vision-language data and tokenizer (data/vl, tok_vl.model)" in printed
    assert "kept: text corpus" in printed and "kept: tokenizer (tok.model)" in printed
    after = _tree(out_dir)
    assert {k: after[k][0] for k in vl} == {k: v[0] for k, v in vl.items()}  # rebuilt byte for byte
    assert {k: v for k, v in after.items() if k not in vl} == {k: v for k, v in before.items() if k not in vl}
    assert main(["inspect", str(out_dir / "vl_quickstart.toml"), "--lanes-shown", "1"]) == 0
    assert re.search(r"^\s+pairs: webdataset .*data/vl/pairs$", capsys.readouterr().out, re.MULTILINE)


def test_demo_says_how_to_get_the_vision_language_part(tmp_path, capsys, monkeypatch):
    """Where Pillow or scikit-image is missing (simulated: both are installed here), the text part is built
    and the output names the missing package and the command that installs it."""
    import zephon.demo.vl

    reason = "Pillow is not installed (python -m pip install -e '.[vision]')"
    monkeypatch.setattr(zephon.demo.vl, "unavailable", lambda: reason)
    argv = ["demo", str(tmp_path), "--max-files", "25", "--vocab-size", "400"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"no vision-language data: {reason}; then run this command again to add it." in out
    assert (tmp_path / "tok.model").is_file() and not (tmp_path / "data" / "vl").exists()
    assert main(argv) == 0  # the text part present: nothing to do, and the same advice
    out = capsys.readouterr().out
    assert "nothing to do" in out and f"no vision-language data: {reason}" in out


@pytest.mark.e2e
def test_python_dash_m_zephon_help():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "zephon", "--help"], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage: zephon" in result.stdout and "verify" in result.stdout


def test_import_zephon_loads_neither_torch_nor_the_engine():
    """`import zephon` is lazy (PEP 562): a fresh interpreter imports no torch and no engine module until a
    name is used; then every public name resolves, to the object its module defines."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    code = ("import json, sys, zephon\n"
            "before = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'zephon.')))\n"
            "import zephon.loader  # binds the submodule zephon.collate on the package: the function must win\n"
            "from zephon import *\n"
            "names = {n: getattr(zephon, n) for n in zephon.__all__}\n"
            "print(json.dumps({'before': before, 'all': sorted(zephon.__all__), 'dir': sorted(dir(zephon)),\n"
            "                  'collate': type(zephon.collate).__name__, 'star': all(n in globals() for n in names)}))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout)
    assert got["before"] == []  # not torch, not zephon.engine, nor any other zephon module
    assert got["collate"] == "function" and got["star"]
    assert set(got["all"]) <= set(got["dir"])

    import importlib

    import zephon

    assert len(zephon.__all__) == len(set(zephon.__all__)) == 47 and set(zephon.__all__) == set(zephon._EXPORTS)
    for name in zephon.__all__:
        where = zephon._EXPORTS[name]
        expected = importlib.import_module(f"zephon.{name}" if where == "" else "zephon" + where)
        assert getattr(zephon, name) is (expected if where == "" else getattr(expected, name)), name
    assert callable(zephon.read.parquet)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = zephon.nope

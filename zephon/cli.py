"""The ``zephon`` command line: make the demo corpus, stream a recipe, verify determinism, inspect a plan.

    zephon demo recipes                      # corpus + tokenizer next to recipes/quickstart.toml
    zephon inspect recipes/quickstart.toml   # what the work plan will read, lane by lane
    zephon run recipes/quickstart.toml --world-size 8 --rank 3 --steps 50 --save-state s.json
    zephon run recipes/quickstart.toml --world-size 4 --rank 1 --steps 50 --resume s.json
    zephon verify recipes/quickstart.toml --world-sizes 1,8,16,32 --steps 20 --resume-at 9
    zephon trace recipes/quickstart.toml --step 12 --row 5   # the documents in row 5 of step 12
    zephon locate recipes/quickstart.toml --source web --file part-0003.parquet --record 31
    zephon diff recipes/quickstart.toml other.toml --steps 200 --plot diff.png

Global steps are numbered from 0 everywhere, as ``loader.step`` counts delivered batches and
``set_mixture(at_step=)`` and mixture schedules use them: step ``s`` is the ``(s+1)``-th global batch.
``run`` labels each batch with its step, ``verify`` names the first differing step, ``inspect`` tables the
schedule by step, and a checkpoint taken after steps ``0..k-1`` resumes at step ``k``.

Errors in the user's input (recipe, sources, checkpoints, world sizes) are reported as one line,
``zephon: error: <message>``, with exit status 2; ``verify`` exits 1 when batches disagree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Sequence

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE = 0, 1, 2
PROG = "zephon"
RATE_WINDOW = 10  # steps behind the "last K steps" rate of `zephon run`'s step lines
STEPS_NOTE = ("Global steps are numbered from 0 in every command, as loader.step, set_mixture(at_step=) and "
              "mixture schedules number them: step s is the (s+1)-th global batch, and a checkpoint taken after "
              "steps 0..k-1 resumes at step k.")


class CliError(Exception):
    """A usage problem found by the CLI itself (reported like the library's errors, exit 2)."""


# -- helpers ----------------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    """``"1,8,16"`` -> ``[1, 8, 16]`` (argparse type; a clear message on bad input)."""
    try:
        values = [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return values


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    value = _non_negative(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _human(n: float) -> str:
    for unit in ("", "k", "M", "G"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}" if unit else f"{n:.0f}"
        n /= 1000
    return f"{n:.1f}T"


def _out(text: str = "") -> None:
    print(text, file=sys.stdout, flush=True)


def _load_states(paths: Sequence[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Read one or more loader-state files (e.g. every rank's); returns them merged, and as read."""
    from .state import load_state, merge_states
    from .errors import StateError

    states = []
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"state file not found: {path}")
        try:
            states.append(load_state(path))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise StateError(f"{path}: not a JSON loader state ({exc}); pass a file written by "
                             f"`zephon run --save-state` or zephon.save_state().") from None
    for path, state in zip(paths, states):
        if not isinstance(state, dict) or "lanes" not in state:
            raise StateError(f"{path}: not a Zephon loader state; pass a file written by "
                             f"`zephon run --save-state` or zephon.save_state().")
    return merge_states(states), states


def _display_path(path: str) -> str:
    """A source path tidied for people: ``recipes/../data/*.jsonl`` -> ``data/*.jsonl``. A glob is kept as the
    recipe wrote it, joined to the recipe's folder (zephon/recipe/parse.py resolves only plain paths), hence the
    ``..``. URLs (``s3://b/a/../c``) are left alone: in an object store ``..`` is part of a key."""
    return path if "://" in path else os.path.normpath(path)


def _lane_ranges(lanes: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0..2, 5, 7..8"``."""
    spans: list[list[int]] = []
    for lane in sorted(lanes):
        if spans and lane == spans[-1][1] + 1:
            spans[-1][1] = lane
        else:
            spans.append([lane, lane])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in spans)


def _check_resume_covers(paths: Sequence[str], states: Sequence[dict[str, Any]], rank: int, world_size: int,
                         lanes: range) -> None:
    """Every lane this rank owns must be in one of the ``--resume`` files, or a :class:`CliError` says to
    pass every rank's file. A rank's file holds only its own lanes; the loader's own message for the missing
    lanes gives the Python API's fix (``merge_states``), where the command line's is to repeat the flag."""
    held: list[set[int]] = []
    for state in states:
        try:
            held.append({int(lane) for lane in state["lanes"]})
        except (TypeError, ValueError, AttributeError):
            return  # malformed lane keys: the loader's validation names the problem
    missing = [lane for lane in lanes if not any(lane in h for h in held)]
    if not missing:
        return
    files = []
    saved_by: set[int] = set()
    for path, state, have in zip(paths, states, held):
        r, w = state.get("rank"), state.get("world_size")
        if isinstance(r, int) and isinstance(w, int):
            files.append(f"{path} (rank {r} of {w}: lanes {_lane_ranges(have)})")
            saved_by.add(w)
        else:
            files.append(f"{path} (lanes {_lane_ranges(have)})")
    count = f"the state files of all {saved_by.pop()} ranks" if len(saved_by) == 1 else "every rank's state file"
    raise CliError(f"rank {rank} of {world_size} owns lanes {_lane_ranges(lanes)}, but --resume gave "
                   f"{'; '.join(files)}: lanes {_lane_ranges(missing)} are in none of them. A state file holds "
                   f"the lanes of the rank that saved it only: pass {count} of that checkpoint, repeating the "
                   f"flag (--resume RANK0.json --resume RANK1.json ...); they are merged, so any world size "
                   f"that divides the lanes can resume.")


class _Throughput:
    """Tokens per second of the streamed batches: over the last ``window`` steps, and on average since
    ``started`` (the loop's start, so the first batch's latency counts in the average)."""

    def __init__(self, started: float, window: int = RATE_WINDOW) -> None:
        self.started = started
        self.tokens = 0
        self.first_batch_at: tuple[float, int] | None = None  # (time, tokens) when the first step ended
        self._marks: deque[tuple[float, int]] = deque([(started, 0)], maxlen=window + 1)

    def add(self, now: float, tokens: int) -> None:
        """One step of ``tokens`` tokens ended at ``now`` (a ``time.perf_counter()`` reading)."""
        self.tokens += tokens
        self._marks.append((now, self.tokens))
        if self.first_batch_at is None:
            self.first_batch_at = (now, self.tokens)

    @property
    def window_steps(self) -> int:
        """How many steps :meth:`recent` spans (fewer than ``window`` at the start)."""
        return len(self._marks) - 1

    def recent(self) -> float:
        """Tokens per second over the last :attr:`window_steps` steps."""
        (t0, n0), (t1, n1) = self._marks[0], self._marks[-1]
        return (n1 - n0) / max(t1 - t0, 1e-9)

    def average(self) -> float:
        """Tokens per second from ``started`` to the end of the last step."""
        t1, n1 = self._marks[-1]
        return n1 / max(t1 - self.started, 1e-9)

    def after_first(self) -> float | None:
        """Tokens per second from the end of the first step to the end of the last (None before step 2)."""
        if self.first_batch_at is None or self._marks[-1][0] == self.first_batch_at[0]:
            return None
        (t0, n0), (t1, n1) = self.first_batch_at, self._marks[-1]
        return (n1 - n0) / max(t1 - t0, 1e-9)


# -- demo -------------------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    """Build the parts of the demo that are missing (all of them with --force), each checked on its own."""
    from .demo import PART_NAMES, PARTS, make_demo, missing_parts

    out = Path(args.out_dir)
    model, data = out / "tok.model", out / "data"
    todo = list(PARTS) if args.force else missing_parts(out)
    if "vl" in todo:
        from .demo.vl import unavailable

        vl_skipped = unavailable()  # asked here too, so that "nothing to do" can say why the VL part is absent
    else:
        vl_skipped = None
    present = [p for p in PARTS if p not in todo]
    buildable = [p for p in todo if not (p == "vl" and vl_skipped is not None)]
    if not buildable:
        _out(f"demo data already present in {out}/: {'; '.join(PART_NAMES[p] for p in present)}; nothing to do "
             f"(--force rebuilds everything).")
        if vl_skipped is not None:
            _out(f"  no vision-language data: {vl_skipped}; then run this command again to add it.")
        return EXIT_OK

    started = time.perf_counter()
    try:
        counts = make_demo(out, args.max_files, args.vocab_size, parts=todo)
    except RuntimeError as exc:  # SentencePiece reports bad training settings as RuntimeError("INTERNAL: ...")
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        reason = reason.split("] ", 1)[-1].strip()
        if "input_sentence_size" in reason:
            reason = "SentencePiece needs more than 100 training sentences (the demo uses every third document)"
        raise CliError(f"training the demo tokenizer failed: {reason} (adjust --vocab-size, or mine more "
                       f"documents with a larger --max-files)") from None
    elapsed = time.perf_counter() - started
    built = counts.get("built", [])
    _out(f"wrote the demo's {', '.join(PART_NAMES[p] for p in built)} to {out}/ in {elapsed:.1f}s:")
    if "text" in built:
        for sub, kind, what in (("web", "prose", "documents"), ("code", "code", "documents"),
                                ("chat", "chat", "conversations")):
            files = sorted((data / sub).glob("*"))
            size = sum(f.stat().st_size for f in files)
            _out(f"  {data / sub}/  {len(files)} files, {size / 1e6:.1f} MB, {counts.get(kind, 0)} {kind} {what}")
    if "tokenizer" in built:
        _out(f"  {model}  SentencePiece BPE, vocab {args.vocab_size}, {model.stat().st_size / 1e3:.0f} kB")
    if "vl" in built:  # the vision-language quickstart (zephon/demo/vl.py)
        _out(f"  {data / 'vl'}/  {counts['vl_pairs']} image-caption pairs (WebDataset), {counts['vl_docs']} interleaved "
             f"documents with {counts['vl_doc_images']} images (Parquet), from {counts['vl_pictures']} pictures; "
             f"{out / 'tok_vl.model'}")
    for part in present:
        _out(f"  kept: {PART_NAMES[part]}, already present (--force rebuilds it)")
    if "vl_skipped" in counts:
        _out(f"  no vision-language data: {counts['vl_skipped']}; then run this command again to add it.")
    recipes = sorted(out.glob("*.toml"), key=lambda p: (p.name != "quickstart.toml", p.name))
    hint = recipes[0] if recipes else f"<a recipe in {out}/, e.g. a copy of recipes/quickstart.toml>"
    _out(f"next: zephon run {hint} --steps 20")
    return EXIT_OK


# -- run --------------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .batches.packed import batch_digest
    from .loader import build_loader, lanes_of_rank
    from .recipe.parse import load_recipe
    from .state import save_state

    recipe = load_recipe(args.recipe)
    lanes_of_rank(recipe.lanes, 0, args.world_size)  # raises ValueError naming both numbers
    state, files = _load_states(args.resume) if args.resume else (None, [])
    with build_loader(recipe, rank=args.rank, world_size=args.world_size, num_workers=args.num_workers,
                      runner=args.runner) as loader:
        lanes = loader.lanes
        if state is not None:
            fp = getattr(loader, "fingerprint", None)
            if fp is None or state.get("fingerprint") == fp:  # another run's state: the loader names the fields
                _check_resume_covers(args.resume, files, args.rank, args.world_size, lanes)
            loader.load_state_dict(state)
        rows = len(lanes) * recipe.batch_per_lane
        records = bool(getattr(loader.program, "records", False))  # no pack(): a row is one record
        unit, per_row = ("rec", 1) if records else ("tok", recipe.seq_len)
        _out(f"recipe {args.recipe}: rank {args.rank} of {args.world_size} owns lanes "
             f"{lanes.start}..{lanes.stop - 1} ("
             + (f"{rows} records per batch); " if records else f"{rows} x {recipe.seq_len} tokens per batch); ")
             + (f"{args.num_workers} {args.runner} workers" if args.num_workers else "inline (no workers)")
             + (f"; resumed at step {loader.step} from {', '.join(args.resume)} (steps 0..{loader.step - 1} "
                f"were delivered before the checkpoint)" if state is not None else ""))
        if args.hash_every and args.steps:
            _out(f"{unit}/s: {'records' if records else 'tokens'} of this rank's batches (padding included) per "
                 f"second, over the last {RATE_WINDOW} steps (fewer at the start) and on average since the first "
                 f"batch was asked for")
        bar = tqdm(total=args.steps * rows * per_row, unit=unit, unit_scale=True, file=sys.stderr,
                   disable=True if args.quiet else None, desc="zephon run", dynamic_ncols=True, leave=False)
        real = 0
        rate = _Throughput(time.perf_counter())
        try:
            for i in range(args.steps):
                batch = next(loader)
                n = batch["valid"].numel() if records else batch["input_ids"].numel()
                rate.add(time.perf_counter(), n)
                real += int(batch["valid"].sum()) if records else int((batch["segment_ids"] != 0).sum())
                bar.update(n)
                if args.hash_every and ((i + 1) % args.hash_every == 0 or i + 1 == args.steps):
                    k = rate.window_steps
                    # loader.step counts the batches delivered: this batch is step loader.step - 1
                    line = (f"step {loader.step - 1:6d}  sha256 {batch_digest(batch)}  "
                            f"{unit}/s last {k:>2} step{'s' if k > 1 else ' '} {_human(rate.recent()):>7}  "
                            f"avg {_human(rate.average()):>7}  non-pad {real / rate.tokens:.4f}")
                    if bar.disable:
                        _out(line)
                    else:
                        bar.write(line, file=sys.stdout)
        finally:
            bar.close()
        elapsed = time.perf_counter() - rate.started
        m = loader.metrics()
        _out(f"summary: {args.steps} steps, {rate.tokens} {'records' if records else 'tokens'} (padding included) "
             f"in {elapsed:.2f}s")
        if rate.first_batch_at is not None:
            first_s = rate.first_batch_at[0] - rate.started
            steady = rate.after_first()
            k = rate.window_steps
            _out(f"  first batch after {first_s:.2f}s;  {unit}/s: {_human(rate.average())} average over all "
                 f"{args.steps} steps (first batch included)"
                 + (f", {_human(steady)} average after the first batch ({args.steps - 1} steps), "
                    f"{_human(rate.recent())} over the last {k} steps" if steady is not None else ""))
        _out(f"  pad_fraction {m['pad_fraction']:.4%}  flush_pad_fraction {m['flush_pad_fraction']:.4%}  "
             f"flushes {m['flushes']}  pieces_split {m['pieces_split']}  skipped_records {m['skipped_records']}")
        # two different counts, each labelled: what the batches hold, and what the lanes have read ahead
        _out(f"  docs_delivered {m['docs_delivered']} (documents that end in this rank's delivered batches)  "
             f"docs_taken {m['docs_taken']} (documents its lanes took in; the others are still held in open rows, "
             f"shuffle buffers and steps computed ahead)")
        share = "  ".join(f"{k} {v:.3f}" for k, v in sorted(m["source_token_share"].items()))
        weights = sum(s.weight for s in recipe.sources)
        target = "  ".join(f"{s.name} {s.weight / weights:.3f}" for s in recipe.sources)
        _out(f"  source_token_share {share or '-'}  (target {target}, by {recipe.mix_by})")
        if args.save_state:
            save_state(loader.state_dict(), args.save_state)
            note = "" if args.world_size == 1 else (
                f" (lanes {lanes.start}..{lanes.stop - 1} only: to resume on another world size, pass every "
                f"rank's file to --resume)")
            done = f"after step {loader.step - 1}" if loader.step else "before step 0"
            _out(f"saved loader state {done} to {args.save_state} (a resume continues at step {loader.step}){note}")
    return EXIT_OK


# -- verify -----------------------------------------------------------------------------------------
def cmd_verify(args: argparse.Namespace) -> int:
    from .loader import lanes_of_rank
    from .recipe.parse import load_recipe
    from .verify import verify

    recipe = load_recipe(args.recipe)
    for w in args.world_sizes:
        lanes_of_rank(recipe.lanes, 0, w)  # raises ValueError naming both numbers
    if args.resume_at is not None and not 0 <= args.resume_at < args.steps:
        raise CliError(f"--resume-at {args.resume_at} must be in [0, --steps={args.steps}), steps 0..{args.steps - 1} "
                       f"being verified: K is the step a resumed run starts at (the checkpoint is taken after "
                       f"steps 0..K-1).")
    started = time.perf_counter()
    report = verify(recipe, args.world_sizes, args.steps, args.resume_at, args.num_workers, args.runner)
    elapsed = time.perf_counter() - started
    header = ("config", "steps", "agree?", "first differing step")
    # W=1 inline is the reference the others are compared with: one row saying so, not a comparison
    table = [(report.reference_name, str(len(report.reference)), "(reference)", "-")]
    table += [(name, str(report.steps), "yes" if ok else "NO",
               "-" if ok else (str(bad) if bad >= 0 else "(run ended early)"))
              for name, bad, ok in report.rows]
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    _out(f"recipe {args.recipe}: {recipe.lanes} lanes, global batch {recipe.global_batch_size} x "
         f"{recipe.seq_len}; steps 0..{args.steps - 1}, each configuration compared with the reference, "
         f"{report.reference_name}")
    _out(fmt.format(*header))
    _out("-+-".join("-" * w for w in widths))
    for row in table:
        _out(fmt.format(*row))
    if report.reference:
        _out(f"reference sha256 of step {len(report.reference) - 1} (the last global batch): {report.reference[-1]}")
    else:
        _out("the reference delivered no global batch (its sources hold no data for one)")
    if not report.rows:
        _out(f"nothing compared: {report.reference_name} is the reference itself; add world sizes "
             f"(--world-sizes 1,2,4), worker counts (--num-workers 0,2) or a resume (--resume-at K)")
        return EXIT_OK
    bad_rows = [name for name, _, ok in report.rows if not ok]
    if bad_rows:
        _out(f"MISMATCH in {len(bad_rows)} of {len(report.rows)} configurations ({elapsed:.1f}s)")
        return EXIT_MISMATCH
    _out(f"OK: all {len(report.rows)} configurations agree with the reference ({elapsed:.1f}s)")
    return EXIT_OK


# -- inspect ----------------------------------------------------------------------------------------
def _pipeline_of(path: str) -> Any:
    from .recipe.parse import load_recipe

    if not Path(path).is_file():
        raise CliError(f"recipe not found: {path}")
    return load_recipe(path).to_pipeline()


def _short(text: str | None, width: int) -> str:
    if text is None:
        return ""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[:width - 3] + "..."


def cmd_trace(args: argparse.Namespace) -> int:
    from .provenance.trace import trace

    pipe = _pipeline_of(args.recipe)
    state = _load_states(args.state)[0] if args.state else None
    t0 = time.perf_counter()
    segments = trace(pipe, args.step, args.row, state=state, num_workers=args.num_workers)
    took = time.perf_counter() - t0
    if args.json:
        _out(json.dumps([seg.to_dict(args.token_ids) for seg in segments], indent=1))
        return EXIT_OK
    _out(f"step {args.step}, rows {_lane_ranges({seg.row for seg in segments}) or '-'}: {len(segments)} segments "
         f"({took:.2f} s, from {'the state at step ' + str(state['step']) if state else 'the start'})")
    for seg in segments:
        images = f" [{len(seg.images)} image(s): {', '.join(str(i.get('grid_thw') or i.get('shape')) for i in seg.images)}]" \
            if seg.images else ""
        _out(f"  row {seg.row:>4} seg {seg.segment:>3}  {seg.source}  {seg.file}  {seg.coord} {seg.record}  "
             f"tokens {seg.tokens[0]}..{seg.tokens[1]}{images}  {_short(seg.text, args.width)!r}")
    return EXIT_OK


def cmd_locate(args: argparse.Namespace) -> int:
    from .provenance.locate import locate

    pipe = _pipeline_of(args.recipe)
    state = _load_states(args.state)[0] if args.state else None
    t0 = time.perf_counter()
    loc = locate(pipe, args.source, args.file, args.record, passes=args.passes, state=state,
                 num_workers=args.num_workers)
    took = time.perf_counter() - t0
    if args.json:
        _out(json.dumps(loc.to_dict(), indent=1))
        return EXIT_OK
    _out(f"source {loc.source}, {loc.file}, {loc.coord} {loc.record}: {loc.tokens} tokens after the stateless "
         f"operators ({took:.2f} s)")
    if loc.dropped_by is not None:
        _out(f"  dropped by operator '{loc.dropped_by}': {loc.reason}")
    for x in loc:
        _out(f"  pass {x.pass_no}  step {x.step:>6}  row {x.row:>4}  segment {x.segment:>3}  tokens "
             f"{x.tokens[0]}..{x.tokens[1]}  (lane {x.lane})")
    if loc.dropped_by is None and loc.reason:
        _out(f"  {loc.reason}")
    return EXIT_OK


def cmd_diff(args: argparse.Namespace) -> int:
    from .provenance.diff import diff

    a, b = _pipeline_of(args.recipe_a), _pipeline_of(args.recipe_b)
    t0 = time.perf_counter()
    report = diff(a, b, args.steps, state_a=_load_states(args.state_a)[0] if args.state_a else None,
                  state_b=_load_states(args.state_b)[0] if args.state_b else None, num_workers=args.num_workers)
    took = time.perf_counter() - t0
    if args.json:
        _out(json.dumps(report.to_dict(), indent=1))
    else:
        _out(f"{args.recipe_a} vs {args.recipe_b}, {report.steps} steps ({took:.1f} s)")
        _out(report.summary())
    if args.plot:
        report.plot(args.plot)
        if not args.json:
            _out(f"wrote {args.plot}")
    return EXIT_OK if report.first_step is None else EXIT_MISMATCH


def inspect_plan(recipe_path: str, lanes_shown: int = 4, units_shown: int = 3) -> dict[str, Any]:
    """The recipe, its sources' plans and the first units of the first lanes, as plain data."""
    from .origins import coordinate
    from .recipe.parse import load_recipe

    recipe = load_recipe(recipe_path)
    pipe = recipe.to_pipeline()
    program = pipe.compile()
    weights = {s.name: s.weight for s in pipe.sources}
    total_weight = sum(weights.values())
    info: dict[str, Any] = {
        "recipe": str(recipe_path), "seed": recipe.seed, "lanes": recipe.lanes, "seq_len": recipe.seq_len,
        "batch_per_lane": recipe.batch_per_lane, "global_batch_size": recipe.global_batch_size,
        "flush_every": recipe.flush_every,
        "tokenizer": {"kind": recipe.tokenizer.kind, "path": recipe.tokenizer.path},
        "pack": {"algorithm": recipe.pack.algorithm, "max_open_bins": recipe.pack.max_open_bins},
        "mix_by": recipe.mix_by, "shuffle_buffer": recipe.shuffle_buffer, "split_len": recipe.split_len,
        "sources": [], "lanes_shown": [],
        "operators": [{"operator": name, "runs": where, "sources": srcs} for name, where, srcs in program.placement],
        "fingerprint": program.fingerprint,
        "rows": "one record per row (no pack)" if program.records else "packed",
        "schedule": program.schedule.describe() if program.schedule is not None else None,
    }
    if program.records:  # nothing is packed, and a tokenizer is optional: the operators say what runs
        info.update(pack=None, tokenizer=None, split_len=None)
    for sp in program.plan.sources:
        info["sources"].append({
            "name": sp.spec.name, "format": sp.spec.format, "paths": list(sp.spec.path),
            "text_field": sp.spec.text_field, "files": len(sp.files), "units": len(sp.units),
            "units_per_lane": len(sp.units) / recipe.lanes, "weight": weights[sp.spec.name],
            "share": weights[sp.spec.name] / total_weight,
        })
    for lane in range(min(lanes_shown, recipe.lanes)):
        per_source = {}
        for sp in program.plan.sources:
            units = []
            # MDS / LitData shards share basenames across parts (shard.00000.mds): show them from the root
            names = sp.relative_files() if sp.spec.format in ("mds", "litdata") else None
            for i in range(units_shown):
                u = sp.lane_unit(lane, i)
                path = sp.files[u.file]
                units.append({"file": names[u.file] if names else os.path.basename(path), "start": u.start,
                              "end": None if u.end < 0 else u.end, "unit": coordinate(sp.spec.format, path) + "s"})
            per_source[sp.spec.name] = units
        info["lanes_shown"].append({"lane": lane, "units": per_source})
    return info


def cmd_inspect(args: argparse.Namespace) -> int:
    from .recipe.parse import load_recipe

    info = inspect_plan(args.recipe, args.lanes_shown)
    if args.json:
        _out(json.dumps(info, indent=2))
        return EXIT_OK
    _out(f"recipe {info['recipe']}")
    _out(f"  seed {info['seed']}  lanes {info['lanes']}  seq_len {info['seq_len']}  "
         f"batch_per_lane {info['batch_per_lane']}  global batch {info['global_batch_size']}  "
         f"flush_every {info['flush_every']}")
    if info["rows"] == "packed":
        _out(f"  tokenizer {info['tokenizer']['kind']} {_display_path(info['tokenizer']['path'])}")
        _out(f"  pack {info['pack']['algorithm']} (max_open_bins {info['pack']['max_open_bins']})  "
             f"mix_by {info['mix_by']}  shuffle_buffer {info['shuffle_buffer']}  split_len {info['split_len']}")
    else:
        _out(f"  rows: {info['rows']}; the operators below")
    _out(f"sources ({len(info['sources'])}):")
    for s in info["sources"]:
        _out(f"  {s['name']}: {s['format']} {', '.join(_display_path(p) for p in s['paths'])}")
        _out(f"    {s['files']} files, {s['units']} units, {s['units_per_lane']:.2f} units/lane, "
             f"weight {s['weight']:g} (share {s['share']:.3f})")
    _out(f"first units of lanes 0..{len(info['lanes_shown']) - 1}:")
    for entry in info["lanes_shown"]:
        _out(f"  lane {entry['lane']}:")
        for name, units in entry["units"].items():
            shown = ", ".join(f"{u['file']}[{u['start']}:{'' if u['end'] is None else u['end']}) {u['unit']}"
                              for u in units)
            _out(f"    {name}: {shown}")
    _out("operators (in order; where each runs):")
    width = max(len(o["operator"]) for o in info["operators"])
    for o in info["operators"]:
        _out(f"  {o['operator']:<{width}}  {o['runs']}" + (f"  [{o['sources']}]" if o["sources"] not in ("-", "") else ""))
    _out(f"fingerprint {info['fingerprint']}")
    schedule = load_recipe(args.recipe).to_pipeline().compile().schedule
    if schedule is not None:
        from .ops.schedule import schedule_ascii, schedule_png, schedule_table

        names = [s["name"] for s in info["sources"]]
        _out(f"mixture schedule ({schedule.interpolate}), normalised weights by global step (from 0, as run "
             f"and verify number them):")
        for line in schedule_table(schedule, names, args.schedule_steps):
            _out(line)
        for line in schedule_ascii(schedule, names, args.schedule_steps):
            _out(line)
        if args.plot:
            schedule_png(schedule, names, args.plot, args.schedule_steps)
            _out(f"wrote {args.plot}")
    elif args.plot:
        raise CliError(f"--plot: {args.recipe} has no mixture schedule to plot")
    return EXIT_OK


# -- parser -----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Zephon: an elastic-deterministic data loader for LLM pre-training. The same global "
                    "batches, byte for byte, on any number of data-parallel ranks and workers, and after "
                    "resuming on a different rank count.",
        epilog=f"{textwrap.fill(STEPS_NOTE, 100)}\n\nexamples:\n"
               "  zephon demo recipes\n"
               "  zephon inspect recipes/quickstart.toml\n"
               "  zephon run recipes/quickstart.toml --world-size 8 --rank 0 --steps 20\n"
               "  zephon verify recipes/quickstart.toml --world-sizes 1,8,16,32 --steps 10 --resume-at 5")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("demo", help="write the demo corpora and tokenizers (made locally, no network)",
                       description="Write into OUT_DIR whichever of the demo's three parts is missing, each "
                                   "checked on its own: the text corpus OUT_DIR/data/{web,code,chat} (prose as "
                                   "Parquet, code and conversations as JSON Lines, mined from Python's standard "
                                   "library); the SentencePiece tokenizer OUT_DIR/tok.model (both for "
                                   "recipes/quickstart.toml); and, when Pillow and scikit-image are installed "
                                   "(the vision extra: python -m pip install -e '.[vision]'), the "
                                   "vision-language data OUT_DIR/data/vl and tokenizer OUT_DIR/tok_vl.model (for "
                                   "recipes/vl_quickstart.toml), made from scikit-image's sample pictures. Run it "
                                   "again after installing the extra to add the vision-language part.")
    p.add_argument("out_dir", metavar="OUT_DIR", help="folder to write the demo into (e.g. recipes)")
    p.add_argument("--max-files", type=_positive, default=None, metavar="N",
                   help="mine only the first N standard-library files (default: all)")
    p.add_argument("--vocab-size", type=_positive, default=8000, metavar="V",
                   help="SentencePiece vocabulary size of tok.model (default: 8000)")
    p.add_argument("--force", action="store_true", help="rebuild every part, even those already present")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("run", help="stream a recipe's batches for one rank, with hashes and throughput",
                       description="Build the loader of rank R of W for RECIPE and stream N batches, printing "
                                   "each batch's SHA-256 (comparable with `zephon verify` and "
                                   f"zephon.batch_digest), the throughput (over the last {RATE_WINDOW} steps and "
                                   "on average since the start) and the non-padding fraction; then a summary of "
                                   "the throughput and of the loader's metrics.")
    p.add_argument("recipe", metavar="RECIPE", help="recipe TOML file")
    p.add_argument("--world-size", type=_positive, default=1, metavar="W",
                   help="data-parallel world size; must divide the recipe's lanes (default: 1)")
    p.add_argument("--rank", type=_non_negative, default=0, metavar="R", help="data-parallel rank (default: 0)")
    p.add_argument("--steps", type=_non_negative, default=100, metavar="N",
                   help="batches to stream: steps 0..N-1, or with --resume, N steps from the resumed step "
                        "(default: 100)")
    p.add_argument("--num-workers", type=_non_negative, default=0, metavar="K",
                   help="read/tokenize workers; 0 runs inline (default: 0). Changes speed, never the batches")
    p.add_argument("--runner", choices=("thread", "pool", "process"), default="thread",
                   help="worker kind when --num-workers > 0: thread (read+tokenize on threads), pool (read+tokenize "
                        "on a process pool) or process (whole lanes on processes); default: thread")
    p.add_argument("--save-state", metavar="PATH", help="write the loader state (JSON) here at the end")
    p.add_argument("--resume", metavar="PATH", action="append",
                   help="resume from a loader state file; repeat it to pass every rank's file of a "
                        "checkpoint (they are merged), so any world size can resume")
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    p.add_argument("--hash-every", type=_non_negative, default=1, metavar="K",
                   help="print a step line (hash, throughput) every K steps and at the last; 0: summary only "
                        "(default: 1)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("verify", help="check that world sizes, workers and resumes give identical batches",
                       description="Hash every global batch (SHA-256 of the rank batches in rank order) for each "
                                   "world size, simulated in this process, and compare with a single-rank "
                                   "reference; with --resume-at K also checkpoint at step K on each world size "
                                   "and resume on the next one in the list. Exit status 1 on any mismatch.")
    p.add_argument("recipe", metavar="RECIPE", help="recipe TOML file")
    p.add_argument("--world-sizes", type=_int_list, default=[1, 2, 4, 8], metavar="W1,W2,...",
                   help="world sizes to compare, each dividing the lanes (default: 1,2,4,8)")
    p.add_argument("--steps", type=_positive, default=10, metavar="N",
                   help="global batches per run: steps 0..N-1 (default: 10)")
    p.add_argument("--resume-at", type=_non_negative, default=None, metavar="K",
                   help="also checkpoint after steps 0..K-1 on each world size and resume at step K on the next "
                        "world size of the list")
    p.add_argument("--num-workers", type=_int_list, default=[0], metavar="K1,K2,...",
                   help="worker counts to try for each world size (default: 0)")
    p.add_argument("--runner", choices=("thread", "pool", "process"), default="thread",
                   help="worker kind for worker counts > 0 (default: thread)")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("inspect", help="show a recipe's sources, units and which units the first lanes read",
                       description="Load RECIPE and its work plan; print the recipe header, each source's files, "
                                   "units and mixture share, and the first units the first lanes read.")
    p.add_argument("recipe", metavar="RECIPE", help="recipe TOML file")
    p.add_argument("--lanes-shown", type=_non_negative, default=4, metavar="N",
                   help="lanes whose first units are listed (default: 4)")
    p.add_argument("--json", action="store_true", help="print the same information as JSON")
    p.add_argument("--schedule-steps", type=_positive, default=None, metavar="N",
                   help="show the mixture schedule for steps 0..N (default: a bit past its last waypoint)")
    p.add_argument("--plot", metavar="PNG", help="also draw the mixture schedule into this PNG (needs matplotlib)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("trace", help="the documents in rows of a global step: source, file, record, tokens, text",
                       description="Run only the lanes that hold the rows asked for (from the start, or from a "
                                   "checkpoint at or before the step) and print each document piece in them: its "
                                   "source, file (relative to the source's root), record (row or byte offset), "
                                   "token range within its document, and decoded text.")
    p.add_argument("recipe", metavar="RECIPE", help="recipe TOML file")
    p.add_argument("--step", type=_non_negative, required=True, metavar="S", help="global step (from 0)")
    p.add_argument("--row", type=_int_list, default=None, metavar="R1,R2,...",
                   help="rows of the global batch (default: every row, which runs every lane)")
    p.add_argument("--state", metavar="PATH", action="append",
                   help="a loader state saved at or before the step (repeat for every rank's file)")
    p.add_argument("--num-workers", type=_non_negative, default=0, metavar="K", help="workers (default: 0)")
    p.add_argument("--json", action="store_true", help="print the segments as JSON")
    p.add_argument("--token-ids", action="store_true", help="with --json, include the token ids")
    p.add_argument("--width", type=_positive, default=60, metavar="N", help="characters of text shown (default: 60)")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("locate", help="every step, row and token range where one record lands",
                       description="Find which lane reads the record's unit in each pass (closed form), run that "
                                   "lane only until the record has been delivered, and print each landing; or the "
                                   "operator that dropped the record.")
    p.add_argument("recipe", metavar="RECIPE", help="recipe TOML file")
    p.add_argument("--source", required=True, metavar="NAME", help="the source's name")
    p.add_argument("--file", required=True, metavar="PATH", help="the file, relative to the source's root")
    p.add_argument("--record", type=_non_negative, required=True, metavar="N",
                   help="where the record starts: its row (Parquet, Arrow...) or byte offset (plain JSON Lines), "
                        "as `zephon trace` shows it")
    p.add_argument("--passes", type=_positive, default=1, metavar="P", help="passes over the source (default: 1)")
    p.add_argument("--state", metavar="PATH", action="append", help="start from this loader state")
    p.add_argument("--num-workers", type=_non_negative, default=0, metavar="K", help="workers (default: 0)")
    p.add_argument("--json", action="store_true", help="print the location as JSON")
    p.set_defaults(func=cmd_locate)

    p = sub.add_parser("diff", help="where two recipes' streams part, and each one's delivered tokens per source",
                       description="Run both recipes side by side and report the first global step whose batches "
                                   "differ, the lanes that differ there, and each source's delivered tokens per "
                                   "step in both. Exit status 1 when they differ.")
    p.add_argument("recipe_a", metavar="A", help="recipe TOML file")
    p.add_argument("recipe_b", metavar="B", help="recipe TOML file")
    p.add_argument("--steps", type=_positive, default=100, metavar="N", help="global steps to compare (default: 100)")
    p.add_argument("--state-a", metavar="PATH", action="append", help="start A from this loader state")
    p.add_argument("--state-b", metavar="PATH", action="append", help="start B from this loader state")
    p.add_argument("--num-workers", type=_non_negative, default=0, metavar="K", help="workers (default: 0)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="PNG", help="draw the delivered tokens per source of both into this PNG")
    p.set_defaults(func=cmd_diff)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``zephon`` command (and ``python -m zephon``); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors: argparse already printed
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    from .errors import SourceError

    try:
        return args.func(args)
    except (CliError, ValueError, SourceError, OSError) as exc:
        # RecipeError and StateError are ValueErrors; FileNotFoundError is an OSError.
        message = str(exc).strip() or type(exc).__name__
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())

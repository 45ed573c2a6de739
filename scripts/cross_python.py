"""The same batches from the same data on another Python: the golden pipelines, inputs built once.

The golden tests (``tests/test_golden.py``, ``tests/test_golden_vl.py``) generate their inputs from the
running interpreter's standard library, so on another Python they see other data and skip. This script
separates the two: ``--build DIR`` writes the golden tests' inputs (text corpus, the three tokenizers,
the demo corpus, the vision-language dataset and tokenizer) and the global-batch hashes this interpreter
computes on them, and the loader states of every pipeline part-way (text after step 20 of 50,
vision-language after step 6 of 12) on 4 or 2 ranks; ``--check DIR``,
run by any other interpreter with Zephon installed, recomputes the hashes on those same files, and
resumes each saved state on one rank, comparing recipe by recipe and batch by batch::

    python scripts/cross_python.py --build /tmp/xpy                     # Python 3.11 (CI's)
    /path/to/python3.12 scripts/cross_python.py --check /tmp/xpy        # exit status 1 on any difference

The library versions that decide bytes (tokenizers, sentencepiece, numpy, Pillow, simplejpeg, ...)
should be the same in both environments (``-c .ci/constraints.txt``); the check prints both sides'.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import test_golden as tg  # noqa: E402
from tests import test_golden_vl as tv  # noqa: E402

VERSIONED = ("numpy", "pyarrow", "tokenizers", "sentencepiece", "tiktoken", "PIL", "simplejpeg", "torch")


def versions() -> dict[str, str]:
    import importlib

    out = {"python": sys.version.split()[0]}
    for name in VERSIONED:
        out[name] = getattr(importlib.import_module(name), "__version__", "?")
    return out


RESUME_AT = 20


def hashes(root: Path, manifest: dict) -> dict[str, list[str]]:
    import zephon as z

    p = {k: root / v for k, v in manifest["paths"].items()}
    out = tg.compute(tg.suite_variants(p["corpus"], p["sp_model"], p["hf"], p["tiktoken"]))
    out.update(tg.compute(tg.shipped_variants(p["demo"])))
    vl_data = {k: root / v for k, v in manifest["vl_data"].items()}
    vl = tv.compute(vl_data, z.tokenizer(str(p["vl_tokenizer"])))
    out.update({f"vl/{name}": h for name, h in vl.items()})
    return out


def pipelines(root: Path, manifest: dict) -> dict:
    """name -> pipeline, for the pipelines that run on the whole-run path (no loader keyword arguments)."""
    import zephon as z
    from zephon.recipe import as_pipeline

    p = {k: root / v for k, v in manifest["paths"].items()}
    variants = {**tg.suite_variants(p["corpus"], p["sp_model"], p["hf"], p["tiktoken"]), **tg.shipped_variants(p["demo"])}
    out = {name: as_pipeline(recipe) for name, (recipe, kwargs) in variants.items() if not kwargs}
    vl_data = {k: root / v for k, v in manifest["vl_data"].items()}
    out.update({f"vl/{n}": pipe for n, pipe in tv.pipelines(vl_data, z.tokenizer(str(p["vl_tokenizer"]))).items()})
    return out


def run_steps(pipe, world_size: int, steps: int, state: dict | None) -> tuple[list[str], dict]:
    from zephon.verify import _run  # the simulated ranks of `zephon verify`

    return _run(pipe, pipe.compile(), world_size, steps, 2, "thread", state)


def save_resumes(root: Path, manifest: dict) -> dict[str, dict]:
    """Each pipeline whose data lasts its whole run (50 text batches, 12 vision-language ones), run to
    RESUME_AT (20; 6 for vision-language) on 4 (or 2) ranks, and its state saved."""
    from zephon import save_state

    (root / "states").mkdir(exist_ok=True)
    out = {}
    for name, pipe in pipelines(root, manifest).items():
        steps, at = (tv.STEPS, tv.STEPS // 2) if name.startswith("vl/") else (tg.STEPS, RESUME_AT)
        if len(manifest["hashes"][name]) < steps or pipe.lanes % 2:
            continue
        world = 4 if pipe.lanes % 4 == 0 else 2
        got, state = run_steps(pipe, world, at, None)
        assert got == manifest["hashes"][name][:at], f"{name}: {world} ranks differ from 1"
        path = root / "states" / (name.replace("/", "_") + ".json")
        save_state(state, path)
        out[name] = {"state": str(path.relative_to(root)), "world_size": world, "resume_at": at}
    return out


def build(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    text = tg.build_text_inputs(root)
    vl_data, vl_tok = tv.build_inputs(root / "vl_inputs", text["texts"])
    rel = lambda q: str(Path(q).relative_to(root))  # noqa: E731
    manifest = {"paths": {**{k: rel(text[k]) for k in ("corpus", "sp_model", "hf", "tiktoken", "demo")},
                          "vl_tokenizer": rel(vl_tok)},
                "vl_data": {k: rel(v) for k, v in vl_data.items()}}
    manifest["versions"] = versions()
    manifest["hashes"] = hashes(root, manifest)
    manifest["resumes"] = save_resumes(root, manifest)
    (root / "cross_python.json").write_text(json.dumps(manifest, indent=1) + "\n")
    n = sum(len(h) for h in manifest["hashes"].values())
    print(f"built {root}: {len(manifest['hashes'])} pipelines, {n} global batches, {len(manifest['resumes'])} "
          f"states saved part-way, on {manifest['versions']}")


def check(root: Path) -> int:
    manifest = json.loads((root / "cross_python.json").read_text())
    mine = versions()
    print("built on:  ", manifest["versions"])
    print("checked on:", mine)
    got = hashes(root, manifest)
    bad = 0
    for name, want in manifest["hashes"].items():
        have = got.get(name, [])
        first = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), None)
        if first is not None or len(have) != len(want):
            bad += 1
            print(f"DIFFERENT {name}: batch {first if first is not None else min(len(have), len(want))}")
    total = sum(len(h) for h in manifest["hashes"].values())
    print(f"{len(manifest['hashes']) - bad} of {len(manifest['hashes'])} pipelines equal ({total} global batches)")
    from zephon import load_state

    pipes, bad_resumes = pipelines(root, manifest), 0
    if not manifest["resumes"]:
        print("no saved state to resume: rebuild DIR with --build")
        return 1
    for name, saved in manifest["resumes"].items():
        at = saved["resume_at"]
        want = manifest["hashes"][name][at:]
        have, _ = run_steps(pipes[name], 1, len(want), load_state(root / saved["state"]))
        if have != want:
            bad_resumes += 1
            first = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want)))
            print(f"DIFFERENT {name} resumed on 1 rank from {saved['world_size']}: batch {at + first}")
    n_vl = sum(name.startswith("vl/") for name in manifest["resumes"])
    print(f"{len(manifest['resumes']) - bad_resumes} of {len(manifest['resumes'])} states saved on "
          f"{manifest['versions']['python']} ({len(manifest['resumes']) - n_vl} text after step {RESUME_AT}, "
          f"{n_vl} vision-language after step {tv.STEPS // 2}, on 4 or 2 ranks) resumed here on 1 rank with "
          f"the same batches")
    return 1 if bad or bad_resumes else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--build", type=Path, metavar="DIR", help="write the inputs and this interpreter's hashes")
    g.add_argument("--check", type=Path, metavar="DIR", help="recompute the hashes on DIR's inputs and compare")
    args = ap.parse_args()
    if args.build:
        build(args.build)
        return 0
    return check(args.check)


if __name__ == "__main__":
    sys.exit(main())

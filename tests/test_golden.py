"""Golden hashes: the first 50 global batches of every shipped recipe and of the test suite's recipes
(all of them, and where the data ends, for a recipe whose sources stop before 50: ``ends`` records the count).

These SHA-256 digests were recorded on the code *before* the pipeline redesign (commit 6316710, the
fixed text chain) and pin its output: a refactor may not change a single byte of any batch. They change
only on purpose, in a commit that says why (and regenerates them with ``python -m tests.test_golden``).

The data are built here, as in the rest of the suite, from this interpreter's standard library (the
demo corpus for the shipped recipes, the small test corpus for the others) with tokenizers trained
locally; ``corpus`` below pins the digest of those inputs, so that a different corpus (another Python)
is reported as such instead of as a change of the engine.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from zephon import load_recipe, recipe_from_dict
from zephon.verify import global_hashes

from .conftest import base_recipe_dict, tiktoken_options
from .optional import require_recorded_inputs

GOLDEN = Path(__file__).with_name("golden_hashes.json")
REPO = Path(__file__).resolve().parents[1]
STEPS = 50
# Shipped recipes that run on the demo corpus (recipes/torchtitan/llama3_debug_hf_tokenizer.toml needs the
# trainer's own Llama tokenizer, which cannot be downloaded here).
SHIPPED = ["quickstart.toml", "torchtitan/llama3_debug.toml", "torchtitan/llama3_debug_valid.toml",
           "megatron/gpt_demo.toml", "megatron/gpt_demo_valid.toml", "megatron/gpt_2k_64lanes.toml"]


def _digest_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _keep_long(text: str) -> bool:
    return len(text) > 80


def _upper(text: str) -> str:
    return text.upper()


def suite_variants(corpus: Path, sp_model: Path, hf_tokenizer: Path, tiktoken_file: Path
                   ) -> dict[str, tuple[Any, dict[str, Any]]]:
    """name -> (recipe, build_loader keyword arguments) for the test suite's recipes."""
    def make(**overrides: Any):
        data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        return recipe_from_dict(data)

    base = make()
    single = [{"name": "web", "path": list(base.sources[0].path), "format": "parquet"}]
    out: dict[str, tuple[Any, dict[str, Any]]] = {
        "base": (base, {}),
        "best_fit_32": (make(lanes=32, pack={"algorithm": "best_fit"}), {}),
        "first_fit_32": (make(lanes=32, pack={"algorithm": "first_fit"}), {}),
        "wrap_32": (make(lanes=32, pack={"algorithm": "wrap"}), {}),
        "lanes64_flush1": (make(lanes=64, flush_every=1), {}),
        "lanes64_bpl1": (make(lanes=64, batch_per_lane=1), {}),
        "shuffle5_flush3": (make(lanes=16, shuffle={"buffer": 5}, flush_every=3), {}),
        "mix_by_documents": (make(mix={"by": "documents"}), {}),
        "shuffle8": (make(shuffle={"buffer": 8}), {}),
        "wrap_split40": (make(pack={"algorithm": "wrap"}, split={"max_doc_tokens": 40}), {}),
        "bos": (make(tokenizer={"add_bos": True}), {}),
        "single_source": (make(sources=single), {}),
        "huggingface": (make(tokenizer={"kind": "huggingface", "path": str(hf_tokenizer)}), {}),
        # Not one of tiktoken's encodings: it names its EOS and split regex (as Zephon used to guess them).
        "tiktoken": (make(tokenizer={"kind": "tiktoken", "path": str(tiktoken_file),
                                     **tiktoken_options(tiktoken_file)}), {}),
        "seed1": (make(seed=1), {}),
        "text_filter": (make(lanes=8), {"text_filter": _keep_long}),
        "text_map": (make(lanes=8), {"text_map": _upper}),
    }
    pretok = dict(base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)}))
    pretok["sources"] = [{"name": "web", "path": str(_pretokenized_web(corpus, sp_model)), "format": "parquet",
                          "tokens_field": "input_ids", "weight": 0.7}, pretok["sources"][1]]
    out["pretokenized_parquet"] = (recipe_from_dict(pretok), {})
    return out


def _pretokenized_web(corpus: Path, sp_model: Path) -> Path:
    """The test corpus's web source with a token-id column (SentencePiece ids, no BOS/EOS)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentencepiece as spm

    out = corpus.parent / f"{corpus.name}-pretokenized-web"
    if out.exists():
        return out
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(exist_ok=True)
    for f in sorted((corpus / "web").glob("*.parquet")):
        table = pq.read_table(f)
        ids = sp.encode(table.column("text").to_pylist(), out_type=int)
        pq.write_table(pa.table({"id": table.column("id"), "input_ids": pa.array(ids, pa.list_(pa.int32()))}),
                       tmp / f.name, row_group_size=6)
    tmp.rename(out)
    return out


def shipped_variants(demo: Path) -> dict[str, tuple[Any, dict[str, Any]]]:
    return {f"recipes/{name}": (load_recipe(demo / name), {}) for name in SHIPPED}


def build_demo(root: Path) -> Path:
    """The demo corpus and tokenizer, with copies of the shipped recipes beside them (their relative
    paths then resolve to this corpus)."""
    from zephon.demo import make_demo

    make_demo(root)
    for name in SHIPPED:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "recipes" / name, root / name)
    return root


def compute(variants: dict[str, tuple[Any, dict[str, Any]]], names: list[str] | None = None
            ) -> dict[str, list[str]]:
    from zephon import build_loader, global_digest

    out = {}
    for name in names or list(variants):
        recipe, kwargs = variants[name]
        if not kwargs:  # (fewer than STEPS where the sources stop: every global batch until the data ends)
            out[name] = global_hashes(recipe, 1, STEPS, num_workers=2)
            continue
        loader = build_loader(recipe, rank=0, world_size=1, **kwargs)
        try:
            out[name] = [global_digest([batch]) for batch in itertools.islice(loader, STEPS)]
        finally:
            loader.close()
    return out


def ends(hashes: dict[str, list[str]]) -> dict[str, int]:
    """The recipes whose data ends before STEPS global batches, and after how many."""
    return {name: len(h) for name, h in hashes.items() if len(h) < STEPS}


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return build_demo(tmp_path_factory.mktemp("golden_demo"))


def _check(name: str, got: list[str], want: list[str], golden: dict[str, Any]) -> None:
    first_bad = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert first_bad is None, \
        f"{name}: global batch {first_bad} differs from the golden hash recorded before the redesign"
    recorded = golden.get("ends", {}).get(name, golden["steps"])
    assert len(want) == recorded and len(got) == recorded, (
        f"{name}: {len(got)} global batches, but {len(want)} hashes are recorded and the data "
        f"{'ends after ' + str(recorded) if recorded < golden['steps'] else 'does not end before ' + str(recorded)}")


@pytest.fixture(scope="module")
def recorded_inputs(golden, corpus, sp_model, demo) -> None:
    """Not the engine: the corpus and tokenizers these hashes were recorded on (built from this
    interpreter's standard library, so another Python builds others: see ``require_recorded_inputs``)."""
    require_recorded_inputs(_inputs(corpus, sp_model, demo), golden["inputs"], {"Python": golden["python"]},
                            {"Python": sys.version.split()[0]}, "text golden hashes")


def test_other_inputs_skip_only_in_another_environment(monkeypatch):
    """The rule the golden tests apply to their inputs: the recorded inputs pass; other inputs fail in the
    recording's environment (the generator changed) and under CI, and skip elsewhere."""
    rec, env, other = {"Python": "3.11.7"}, {"Python": "3.11.7"}, {"Python": "3.12.1"}
    monkeypatch.delenv("CI", raising=False)
    require_recorded_inputs({"corpus": "a"}, {"corpus": "a"}, rec, other, "t")  # same inputs: nothing raised
    with pytest.raises(pytest.fail.Exception, match="the input generator changed"):
        require_recorded_inputs({"corpus": "b"}, {"corpus": "a"}, rec, env, "t")
    with pytest.raises(pytest.skip.Exception, match="recorded with Python 3.11.7, this is 3.12.1"):
        require_recorded_inputs({"corpus": "b"}, {"corpus": "a"}, rec, other, "t")
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="CI must run the recording's Python"):
        require_recorded_inputs({"corpus": "b"}, {"corpus": "a"}, rec, other, "t")


@pytest.mark.slow
@pytest.mark.parametrize("name", [f"recipes/{n}" for n in SHIPPED])
def test_shipped_recipes_keep_their_batches(golden, demo, recorded_inputs, name):
    _check(name, compute(shipped_variants(demo), [name])[name], golden["hashes"][name], golden)


def test_suite_recipes_keep_their_batches(golden, corpus, sp_model, hf_tokenizer, tiktoken_file, recorded_inputs):
    variants = suite_variants(corpus, sp_model, hf_tokenizer, tiktoken_file)
    assert set(variants) <= set(golden["hashes"])
    got = compute(variants)
    for name in variants:
        _check(name, got[name], golden["hashes"][name], golden)


def test_the_tiktoken_recipe_keeps_its_batches(golden, corpus, sp_model, hf_tokenizer, tiktoken_file,
                                               recorded_inputs):
    """The tiktoken variant alone (``-k tiktoken``): its file, none of tiktoken's encodings, now names its special
    tokens and split regex (those Zephon used to guess for every file), and its batches are unchanged."""
    variants = suite_variants(corpus, sp_model, hf_tokenizer, tiktoken_file)
    _check("tiktoken", compute(variants, ["tiktoken"])["tiktoken"], golden["hashes"]["tiktoken"], golden)


def _inputs(corpus: Path, sp_model: Path, demo: Path) -> dict[str, str]:
    return {"test_corpus": _digest_files(list(corpus.rglob("*.*"))), "test_sp_model": _digest_files([sp_model]),
            "demo_corpus": _digest_files(list((demo / "data" / "web").rglob("*.*")) +
                                         list((demo / "data" / "code").rglob("*.*")) + [demo / "tok.model"])}


def build_text_inputs(tmp: Path) -> dict[str, Any]:
    """The inputs these hashes are recorded on, built under ``tmp``: the test corpus (and its texts), the
    SentencePiece, Hugging Face and tiktoken tokenizers trained on it, and the demo corpus."""
    from zephon.demo.text import train_sentencepiece

    from .conftest import build_corpus, build_hf_tokenizer, build_tiktoken_file, read_corpus_texts

    corpus = build_corpus(tmp / "corpus")
    texts = read_corpus_texts(corpus)
    (tmp / "sp").mkdir()
    sp_model = train_sentencepiece(tmp / "sp" / "tok.model", texts, vocab_size=600)
    (tmp / "hf").mkdir()
    hf = build_hf_tokenizer(tmp / "hf", texts)
    (tmp / "tt").mkdir()
    return {"corpus": corpus, "texts": texts, "sp_model": sp_model, "hf": hf,
            "tiktoken": build_tiktoken_file(tmp / "tt", hf), "demo": build_demo(tmp / "demo")}


def write_golden(tmp: Path) -> None:
    """Regenerate golden_hashes.json (by hand, on purpose: ``python -m tests.test_golden``)."""
    built = build_text_inputs(tmp)
    corpus, sp_model, hf, tt, demo = (built[k] for k in ("corpus", "sp_model", "hf", "tiktoken", "demo"))
    hashes = compute(suite_variants(corpus, sp_model, hf, tt))
    hashes.update(compute(shipped_variants(demo)))
    GOLDEN.write_text(json.dumps({"python": sys.version.split()[0], "inputs": _inputs(corpus, sp_model, demo),
                                  "steps": STEPS, "ends": ends(hashes), "hashes": hashes}, indent=1) + "\n")
    print(f"wrote {GOLDEN}: {len(hashes)} recipes x {STEPS} global batches")


if __name__ == "__main__":  # pragma: no cover
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        write_golden(Path(d))

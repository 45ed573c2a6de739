"""Recipes as files: a pipeline saved with ``to_recipe(path)`` loads back from wherever it was saved.

A recipe's relative paths resolve against the recipe file's folder (:func:`zephon.load_recipe`), a pipeline's
against the working directory; so ``to_recipe`` writes local paths relative to the folder it saves the recipe
in (absolute when it only returns the text), and URLs as they are. The ``[[steps]]`` spelling of ``[[ops]]``
(before 0.3) still loads, with a DeprecationWarning.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

import zephon as z

REPO = Path(__file__).resolve().parents[1]


def first_batch(pipe: z.Pipeline) -> str:
    with pipe.build(rank=0, world_size=1) as loader:
        return z.batch_digest(next(iter(loader)))


@pytest.fixture
def workdir(tmp_path, corpus, sp_model, corpus_texts, monkeypatch) -> Path:
    """A working directory with a corpus, a tokenizer, conversations and a chat template, named relatively."""
    work = tmp_path / "work"
    shutil.copytree(corpus, work / "data")
    shutil.copy(sp_model, work / "tok.model")
    shutil.copy(REPO / "recipes" / "chatml.jinja", work / "chatml.jinja")
    (work / "chat").mkdir()
    with open(work / "chat" / "part-0000.jsonl", "w", encoding="utf-8") as f:
        for i, text in enumerate(corpus_texts[:200]):
            messages = [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": text[:400]}]
            f.write(json.dumps({"messages": messages}) + "\n")
    monkeypatch.chdir(work)
    return work


def relative_pipeline() -> z.Pipeline:
    tok = z.tokenizer("tok.model")
    return (z.Pipeline(seed=7, lanes=4)
            .source("web", z.read.parquet("data/web", chunk_rows=8), weight=0.5)
            .source("code", z.read.jsonl("data/code/*.jsonl"), weight=0.3)
            .source("chat", z.read.jsonl("chat", columns=["messages"]), weight=0.2)
            .tokenize_chat(tok, "chatml.jinja", sources=["chat"])
            .tokenize(tok, sources=["web", "code"])
            .split(max_tokens=64).mix(by="tokens").pack(seq_len=64).batch(rows_per_lane=2))


def test_a_recipe_saved_in_another_folder_loads_back_the_same_pipeline(workdir, tmp_path, monkeypatch):
    pipe = relative_pipeline()
    want = first_batch(pipe)  # built here, where its relative paths start
    dest = tmp_path / "elsewhere" / "deep" / "recipe.toml"
    dest.parent.mkdir(parents=True)
    text = pipe.to_recipe(dest)
    assert dest.read_text(encoding="utf-8") == text
    # every local path relative to the recipe's folder: sources (a folder, a glob) and the tokenizer (the chat
    # template is written as its text)
    for path in ("../../work/data/web", "../../work/data/code/*.jsonl", "../../work/chat", "../../work/tok.model"):
        assert f'"{path}"' in text, path
    monkeypatch.chdir(tmp_path / "elsewhere")  # and loaded from another working directory
    again = z.load_recipe(dest).to_pipeline()
    assert again.fingerprint == pipe.fingerprint
    assert first_batch(again) == want


def test_the_text_alone_holds_absolute_paths_and_urls_as_they_are(workdir, tmp_path):
    pipe = relative_pipeline()
    text = pipe.to_recipe()
    assert f'"{workdir / "data" / "web"}"' in text and f'"{workdir / "tok.model"}"' in text
    saved = tmp_path / "anywhere" / "r.toml"
    saved.parent.mkdir()
    saved.write_text(text, encoding="utf-8")
    assert z.load_recipe(saved).to_pipeline().fingerprint == pipe.fingerprint
    remote = z.Pipeline(seed=1, lanes=2).source("web", z.read.parquet(["s3://bucket/web/", "gs://b/x.parquet"]))
    text = remote.to_recipe(tmp_path / "remote.toml")
    assert 'path = ["s3://bucket/web/", "gs://b/x.parquet"]' in text


def test_the_steps_spelling_still_loads_with_a_deprecation_warning(corpus, sp_model):
    ops = [{"op": "tokenize", "tokenizer": str(sp_model)}, {"op": "pack", "seq_len": 64}, {"op": "batch"}]
    data = {"seed": 1, "lanes": 2, "sources": [{"name": "web", "path": str(corpus / "web"), "format": "parquet"}]}
    with pytest.warns(DeprecationWarning, match=r"\[\[steps\]\] is now spelled \[\[ops\]\]"):
        old = z.recipe_from_dict({**data, "steps": ops})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = z.recipe_from_dict({**data, "ops": ops})
    assert old.to_pipeline().fingerprint == new.to_pipeline().fingerprint

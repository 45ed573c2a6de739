"""The batched tokenizer call against each backend's own per-document encoding.

``zephon.load_tokenizer(spec).encode(texts)`` must give, for every document, exactly what the
backend library gives for that document alone, framed by BOS/EOS as the spec asks, with offsets
that locate each document in the flat array. The reference encoders below are built with the
backends' own loaders (``SentencePieceProcessor``, ``tokenizers.Tokenizer.from_file``,
``tiktoken.load.load_tiktoken_bpe``), not through Zephon.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tokenizers import Tokenizer as HFTokenizer

from zephon import RecipeError, TokenizerSpec, load_tokenizer, recipe_from_dict

from .conftest import TIKTOKEN_TEST_PATTERN, base_recipe_dict, tiktoken_options

KINDS = ("sentencepiece", "huggingface", "tiktoken")
EXTRA = ["", "héllo wörld — naïve café", "日本語のテキストです。", "emoji 😀🎉 and\ttabs\r\nCRLF", "x",
         "  leading and trailing  ", "\n\n\n", "a" * 3000, "def f(x):\n    return x ** 2\n"]


class Reference:
    """A backend's own encoder of one document, and its special ids."""

    def __init__(self, kind: str, path: Path) -> None:
        self.kind = kind
        if kind == "sentencepiece":
            sp = spm.SentencePieceProcessor(model_file=str(path))
            self.encode = lambda t: sp.encode(t, out_type=int)
            self.decode = None  # SentencePiece normalises whitespace: no exact round trip to check
            self.eos, self.bos = sp.piece_to_id("</s>"), sp.piece_to_id("<s>")
            assert sp.id_to_piece(self.eos) == "</s>"
        elif kind == "huggingface":
            tok = HFTokenizer.from_file(str(path))
            self.encode = lambda t: tok.encode(t, add_special_tokens=False).ids
            self.decode = lambda ids: tok.decode(ids)
            self.eos, self.bos = tok.token_to_id("<|endoftext|>"), None
        else:
            ranks = load_tiktoken_bpe(str(path))
            special = {"<|endoftext|>": len(ranks), "<|startoftext|>": len(ranks) + 1}
            enc = tiktoken.Encoding("ref", pat_str=TIKTOKEN_TEST_PATTERN, mergeable_ranks=ranks,
                                    special_tokens=special)
            self.encode = enc.encode_ordinary
            self.decode = enc.decode
            self.eos, self.bos = special["<|endoftext|>"], special["<|startoftext|>"]


@pytest.fixture(scope="module")
def paths(sp_model, hf_tokenizer, tiktoken_file) -> dict[str, Path]:
    return {"sentencepiece": sp_model, "huggingface": hf_tokenizer, "tiktoken": tiktoken_file}


@pytest.fixture(scope="module")
def texts(corpus_texts) -> list[str]:
    return corpus_texts[::37][:60] + EXTRA


def spec(kind: str, paths, **kw) -> TokenizerSpec:
    if kind == "tiktoken":  # not one of tiktoken's encodings: it names its special tokens and split regex
        kw = {**tiktoken_options(paths[kind], bos=bool(kw.get("add_bos"))), **kw}
        if kw.get("add_bos"):
            kw.setdefault("bos_token", "<|startoftext|>")
    if kind == "huggingface" and kw.get("add_bos"):
        kw.setdefault("bos_token", "<|endoftext|>")  # the test tokenizer has no BOS of its own
    return TokenizerSpec(kind=kind, path=str(paths[kind]), **kw)


def check_framing(tokens: np.ndarray, offsets: np.ndarray, expected: list[list[int]]) -> None:
    assert tokens.dtype == np.int32 and offsets.dtype == np.int64
    assert offsets.shape == (len(expected) + 1,)
    assert offsets[0] == 0 and offsets[-1] == len(tokens)
    assert np.diff(offsets).tolist() == [len(e) for e in expected]
    for k, e in enumerate(expected):
        assert tokens[offsets[k]:offsets[k + 1]].tolist() == e, f"document {k}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("add_bos,add_eos", [(False, True), (True, True), (False, False), (True, False)])
def test_encode_equals_backend_per_document(kind, paths, texts, add_bos, add_eos):
    ref = Reference(kind, paths[kind])
    tok = load_tokenizer(spec(kind, paths, add_bos=add_bos, add_eos=add_eos))
    bos = ref.eos if kind == "huggingface" else ref.bos
    expected = [([bos] if add_bos else []) + ref.encode(t) + ([ref.eos] if add_eos else []) for t in texts]
    assert sum(len(e) for e in expected) > 5 * len(texts)  # real text, not trivially short
    tokens, offsets = tok.encode(texts)
    check_framing(tokens, offsets, expected)
    if ref.decode is not None:  # byte-level BPEs are lossless: the body decodes to the document
        body = slice(int(add_bos), -1 if add_eos else None)
        for k, t in enumerate(texts):
            assert ref.decode(tokens[offsets[k]:offsets[k + 1]][body].tolist()) == t


@pytest.mark.parametrize("kind", KINDS)
def test_encode_does_not_depend_on_how_documents_are_batched(kind, paths, texts):
    """Chunk sizes must not change tokens: encoding a split list gives the same flat array."""
    tok = load_tokenizer(spec(kind, paths))
    whole, whole_off = tok.encode(texts)
    cut = len(texts) // 3
    a, a_off = tok.encode(texts[:cut])
    b, b_off = tok.encode(texts[cut:])
    assert np.array_equal(whole, np.concatenate([a, b]))
    assert np.array_equal(whole_off, np.concatenate([a_off, b_off[1:] + a_off[-1]]))
    singles = [tok.encode([t])[0] for t in texts]
    assert np.array_equal(whole, np.concatenate(singles))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("add_bos,add_eos", [(False, True), (True, True), (False, False)])
def test_empty_list_and_empty_documents(kind, paths, add_bos, add_eos):
    ref = Reference(kind, paths[kind])
    tok = load_tokenizer(spec(kind, paths, add_bos=add_bos, add_eos=add_eos))
    tokens, offsets = tok.encode([])
    assert tokens.dtype == np.int32 and tokens.shape == (0,)
    assert offsets.dtype == np.int64 and offsets.tolist() == [0]

    nothing = ["", " ", "\n\t "] if kind == "sentencepiece" else [""]  # documents with no tokens at all
    for t in nothing:
        assert ref.encode(t) == []
    docs = nothing + ["a b"] + nothing + ["c"] + nothing
    framing = int(add_bos) + int(add_eos)
    tokens, offsets = tok.encode(docs)
    lengths = np.diff(offsets).tolist()
    assert lengths == [framing if t.strip() == "" else framing + len(ref.encode(t)) for t in docs]
    if add_eos:
        assert tokens[offsets[1:] - 1].tolist() == [tok.eos_id] * len(docs)
    # All documents empty: a valid, empty (or specials-only) result, not an error.
    tokens, offsets = tok.encode(nothing)
    assert len(tokens) == framing * len(nothing) and offsets.tolist() == [framing * k for k in range(len(nothing) + 1)]


def test_documents_that_tokenize_to_nothing_are_dropped_with_their_cursors(tmp_path, sp_model):
    """Without EOS a whitespace-only document has no tokens: the worker drops it, counts it as skipped,
    and keeps the cursors of the documents it keeps aligned with them."""
    lines = ["alpha beta", " ", "gamma", "\t\n", "", None, "delta epsilon"]
    raw = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in lines)
    (tmp_path / "d.jsonl").write_bytes(raw)
    recipe = recipe_from_dict({
        "seed": 1, "lanes": 1, "seq_len": 16,
        "tokenizer": {"kind": "sentencepiece", "path": str(sp_model), "add_eos": False},
        "sources": [{"name": "d", "path": str(tmp_path / "d.jsonl"), "format": "jsonl"}],
    })
    program = recipe.to_pipeline().compile()
    task = next(program.plan.sources[0].chunk_tasks(0, 0, -1))
    assert (task.start, task.end) == (0, len(raw))
    out = program.stages.run(0, 0, task)  # the stateless work of one chunk: read, tokenize
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    kept = ["alpha beta", "gamma", "delta epsilon"]
    ends = np.cumsum([len(json.dumps({"text": t}).encode()) + 1 for t in lines]).tolist()
    assert out.n == 3 and out.raw_records == len(lines) and out.skipped == len(lines) - 3
    assert out.resume_cursor.tolist() == [ends[0], ends[2], ends[6]]
    tokens = out.token_fields["input_ids"]
    assert [tokens[a:b].tolist() for a, b in zip(out.offsets[:-1], out.offsets[1:])] == \
        [sp.encode(t, out_type=int) for t in kept]
    assert out.end_cursor == len(raw)


@pytest.mark.parametrize("kind", KINDS)
def test_special_ids_are_detected(kind, paths):
    ref = Reference(kind, paths[kind])
    tok = load_tokenizer(spec(kind, paths))
    assert tok.eos_id == ref.eos is not None
    assert tok.pad_id == tok.eos_id  # default padding id
    assert tok.vocab_size > max(ref.encode("some text to tokenise 123"))
    assert load_tokenizer(spec(kind, paths, pad_id=0)).pad_id == 0
    if kind == "tiktoken":
        assert tok.vocab_size == ref.eos + 1
    if kind == "sentencepiece":
        assert tok.bos_id == ref.bos == 1 and tok.eos_id == 2
        assert load_tokenizer(spec(kind, paths, eos_token="<s>")).eos_id == ref.bos  # a named EOS


@pytest.mark.parametrize("kind", ["sentencepiece", "huggingface"])
def test_unknown_special_token_name_is_an_error(kind, paths):
    """A misspelt eos_token must not silently become <unk> (or anything else)."""
    with pytest.raises(RecipeError, match="<\\|no_such_token\\|>"):
        load_tokenizer(spec(kind, paths, eos_token="<|no_such_token|>"))


def test_huggingface_without_bos_asks_for_bos_token(paths):
    with pytest.raises(RecipeError, match="BOS.*bos_token"):
        load_tokenizer(TokenizerSpec(kind="huggingface", path=str(paths["huggingface"]), add_bos=True))


@pytest.mark.parametrize("kind", KINDS)
def test_missing_tokenizer_file_names_the_path(kind, tmp_path):
    missing = tmp_path / "nowhere" / "tok.file"
    with pytest.raises(FileNotFoundError) as info:
        load_tokenizer(TokenizerSpec(kind=kind, path=str(missing)))
    assert str(missing) in str(info.value) and "tokenizer.path" in str(info.value)


# -- the tokenizers' own thread pool under Zephon's threads ---------------------------------------------
def _hf_loader(corpus: Path, hf_tokenizer: Path, workers: int, runner: str = "thread"):
    from zephon import build_loader

    return build_loader(recipe_from_dict(base_recipe_dict(corpus, {"kind": "huggingface", "path": str(hf_tokenizer)})),
                        num_workers=workers, runner=runner)


def _digests(loader, steps: int = 6) -> list[str]:
    from zephon import batch_digest

    try:
        return [batch_digest(next(loader)) for _ in range(steps)]
    finally:
        loader.close()


@pytest.fixture
def two_cores_no_setting(monkeypatch):
    """TOKENIZERS_PARALLELISM unset and two usable cores for the test; the variable is restored after it."""
    from zephon.engine import tokenizer_pool

    monkeypatch.setenv(tokenizer_pool.VARIABLE, "placeholder")  # records the original value for the undo
    monkeypatch.delenv(tokenizer_pool.VARIABLE)
    monkeypatch.setattr(tokenizer_pool, "usable_cores", lambda: 2)
    yield monkeypatch


def test_thread_workers_that_fill_the_cores_turn_the_tokenizers_pool_off(corpus, hf_tokenizer, two_cores_no_setting,
                                                                          caplog):
    """As many tokenize threads as cores: the Hugging Face pool is off while the loader is open, and back
    on (the variable removed) once it closes; fewer threads: left on. The batches are the same."""
    import logging
    import os

    fewer = _digests(_hf_loader(corpus, hf_tokenizer, 1))
    assert "TOKENIZERS_PARALLELISM" not in os.environ
    with caplog.at_level(logging.INFO, logger="zephon"):
        loader = _hf_loader(corpus, hf_tokenizer, 2)
    assert os.environ.get("TOKENIZERS_PARALLELISM") == "false"
    assert "2 tokenize threads fill the 2 cores" in caplog.text
    other = _hf_loader(corpus, hf_tokenizer, 1)  # process-wide: it runs serially too while the first is open
    assert _digests(loader) == fewer
    assert "TOKENIZERS_PARALLELISM" not in os.environ  # the holder closed: `other`, with fewer threads, has the pool
    assert _digests(other) == fewer


def test_the_setting_lasts_until_the_last_loader_holding_it_closes(corpus, hf_tokenizer, two_cores_no_setting):
    import os

    first, second = _hf_loader(corpus, hf_tokenizer, 2), _hf_loader(corpus, hf_tokenizer, 2)
    _digests(first, steps=1)
    assert os.environ.get("TOKENIZERS_PARALLELISM") == "false"  # Zephon's own value, not mistaken for the user's
    _digests(second, steps=1)
    assert "TOKENIZERS_PARALLELISM" not in os.environ


def test_an_executor_that_fails_to_start_holds_nothing(two_cores_no_setting):
    """A reader or tokenizer that fails to load in the executor's start-up leaves the variable as it was."""
    import os

    from zephon.engine.executors import ThreadExecutor

    class Failing:
        def setup(self):
            assert os.environ.get("TOKENIZERS_PARALLELISM") == "false"  # taken before the start-up ran
            raise OSError("tokenizer file is gone")

    with pytest.raises(OSError, match="gone"):
        ThreadExecutor(Failing(), 2, hf_tokenizing=True)  # type: ignore[arg-type]
    assert "TOKENIZERS_PARALLELISM" not in os.environ


def test_a_value_the_user_set_is_never_changed(corpus, hf_tokenizer, two_cores_no_setting):
    import os

    for value in ("true", "false"):
        two_cores_no_setting.setenv("TOKENIZERS_PARALLELISM", value)
        _digests(_hf_loader(corpus, hf_tokenizer, 3), steps=1)
        assert os.environ["TOKENIZERS_PARALLELISM"] == value  # a user's "false" is not removed at close either


def test_the_pool_is_left_alone_where_no_thread_tokenizes(make_recipe, corpus, hf_tokenizer, two_cores_no_setting):
    """A pipeline whose tokenizer is not a Hugging Face one, and the pool runner (the tokenizer runs in worker
    processes, which set the variable themselves), leave the trainer's variable alone."""
    import os

    from zephon import build_loader

    build_loader(make_recipe(), num_workers=2, runner="thread").close()
    assert "TOKENIZERS_PARALLELISM" not in os.environ
    loader = _hf_loader(corpus, hf_tokenizer, 2, runner="pool")
    assert "TOKENIZERS_PARALLELISM" not in os.environ
    _digests(loader, steps=1)


def test_a_containers_cpu_limit_counts_as_its_cores(tmp_path):
    from zephon.engine.tokenizer_pool import cgroup_cpus

    assert cgroup_cpus(tmp_path) is None  # no cgroup files: no limit
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpus(tmp_path) is None
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cgroup_cpus(tmp_path) == 3  # 2.5 CPUs of time: three threads can all be busy part of it
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpus(tmp_path) == 4
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpus(tmp_path) is None

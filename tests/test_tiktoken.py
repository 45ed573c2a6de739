"""tiktoken files: tiktoken's own encodings get tiktoken's own special tokens and split regex.

The references are the real tiktoken library: ``tiktoken.Encoding(**constructor())`` with the constructors of
``tiktoken_ext.openai_public`` (cl100k_base, o200k_base), exactly what ``tiktoken.get_encoding`` builds. There
is no network here, so the test's ``.tiktoken`` file (made by ``build_tiktoken_file``) stands in for the
encoding's file: tiktoken's loader returns its ranks to the constructor, and Zephon is told that its SHA-256
is the one that constructor expects. Everything else (pattern, special tokens, vocabulary size, the BPE) is
tiktoken's.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import tiktoken.load
from tiktoken.load import load_tiktoken_bpe
from tiktoken_ext import openai_public

import zephon
import zephon.ops.tokenize as tokenize_module
import zephon.tokenization as tokenization
from zephon import RecipeError, TokenizerSpec, load_tokenizer, recipe_from_dict
from zephon.ops.tokenize import Tokenize
from zephon.specs import tokenizer_description
from zephon.records import INPUT_IDS, Chunk

from .conftest import TIKTOKEN_TEST_PATTERN, base_recipe_dict, tiktoken_options

ENCODINGS = ("cl100k_base", "o200k_base")
# Texts the split regexes disagree on (cl100k_base's `\s++$` takes trailing whitespace after a newline whole).
CRAFTED = ["if x:\n    return y\n    ", "getElementById and XMLHttpRequest", "l'ÉTAT c'est moi\n\n  ", "x" * 500]


@pytest.fixture
def no_downloads(monkeypatch):
    """tiktoken asked to read a URL (to download it, or from its download cache) fails the test."""
    def guard(real):
        def read(blobpath, *args, **kwargs):
            assert "://" not in blobpath, f"tiktoken was asked to read {blobpath}"
            return real(blobpath, *args, **kwargs)
        return read

    monkeypatch.setattr(tiktoken.load, "read_file", guard(tiktoken.load.read_file))
    monkeypatch.setattr(tiktoken.load, "read_file_cached", guard(tiktoken.load.read_file_cached))


@pytest.fixture
def as_encoding(monkeypatch, tiktoken_file):
    """``as_encoding(name)``: tiktoken's own Encoding ``name`` built on the test file's ranks, and Zephon made
    to see the test file as that encoding's file (its SHA-256 reported as the one the constructor expects)."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken reads the local file and keeps no copy of it
    monkeypatch.setattr(tokenize_module, "_TOKENIZERS", {})  # no tokenizer loaded under the pretence outlives it
    local_ranks = load_tiktoken_bpe(str(tiktoken_file))
    content = tiktoken_file.read_bytes()

    def make(name: str) -> tiktoken.Encoding:
        asked = []

        def loader(blobpath, expected_hash=None):
            asked.append(expected_hash)
            return local_ranks

        with monkeypatch.context() as m:
            m.setattr(openai_public, "load_tiktoken_bpe", loader)
            ref = tiktoken.Encoding(**openai_public.ENCODING_CONSTRUCTORS[name]())
        (expected,) = asked
        real = tokenization._content_sha256
        monkeypatch.setattr(tokenization, "_content_sha256",
                            lambda data: expected if data == content else real(data))
        return ref

    return make


def special_texts(texts: list[str], names: list[str]) -> list[str]:
    """Real texts with special-token strings written into them (at the start, inside, at the end)."""
    out = []
    for k, t in enumerate(texts):
        a, b = names[k % len(names)], names[(k + 1) % len(names)]
        cut = len(t) // 2
        out.append(f"{a}{t[:cut]} {b}{t[cut:]}{a}")
    return out


@pytest.fixture(scope="module")
def real_texts(corpus_texts) -> list[str]:
    texts = [t for t in corpus_texts if t and not t.isspace()]
    return texts[::5][:300]


@pytest.mark.parametrize("name", ENCODINGS)
def test_a_tiktoken_encoding_file_gets_tiktokens_own_definition(name, as_encoding, tiktoken_file, real_texts,
                                                                 no_downloads):
    ref = as_encoding(name)
    tok = load_tokenizer(TokenizerSpec("tiktoken", str(tiktoken_file)))
    assert tok.tiktoken_encoding == name
    assert tok.vocab_size == ref.n_vocab and ref.n_vocab > ref.max_token_value - 1 > len(load_tiktoken_bpe(
        str(tiktoken_file)))  # the special tokens' ids, far above the test file's ranks
    assert tok.eos_id == ref.eot_token == ref.encode_single_token("<|endoftext|>")
    assert tok.bos_id is None  # neither encoding has a BOS token
    for special in ref.special_tokens_set:
        assert tok.token_id(special) == ref.encode_single_token(special)

    names = sorted(ref.special_tokens_set)
    laden = special_texts(real_texts[:60], names)
    texts = real_texts + laden + CRAFTED
    assert len(texts) >= 300
    # The split regex matters on these texts: the one Zephon used to give every file splits some otherwise.
    old = tiktoken.Encoding("old", pat_str=TIKTOKEN_TEST_PATTERN, mergeable_ranks=ref._mergeable_ranks,
                            special_tokens={})
    assert any(old.encode_ordinary(t) != ref.encode_ordinary(t) for t in texts)
    tokens, offsets = tok.encode(texts)
    for k, t in enumerate(texts):
        doc = tokens[offsets[k]:offsets[k + 1]].tolist()
        assert doc == ref.encode_ordinary(t) + [ref.eot_token], f"text {k}"
        assert ref.decode(doc[:-1]) == t
    # The special-token strings are ordinary text: not one special id inside a document, unlike tiktoken's
    # encode with the specials allowed.
    special_ids = {ref.encode_single_token(s) for s in names}
    body = np.delete(tokens, offsets[1:] - 1)
    assert not special_ids & set(body.tolist())
    assert all(set(ref.encode(t, allowed_special="all")) & special_ids for t in laden)

    # The tokenize operator (the batched call of a run) gives the same ids.
    n = len(texts)
    chunk = Chunk(0, 0, True, 0, n, "mem", {"text": list(texts)}, np.arange(1, n + 1), np.zeros(n, np.int64))
    out = Tokenize(TokenizerSpec("tiktoken", str(tiktoken_file)))._apply_chunk(chunk)
    assert np.array_equal(out.token_fields[INPUT_IDS], tokens) and np.array_equal(out.offsets, offsets)


def test_names_pick_among_tiktokens_special_tokens(as_encoding, tiktoken_file, no_downloads):
    ref = as_encoding("cl100k_base")
    path = str(tiktoken_file)
    tok = load_tokenizer(TokenizerSpec("tiktoken", path, add_bos=True, bos_token="<|fim_prefix|>",
                                       eos_token="<|endofprompt|>"))
    assert (tok.bos_id, tok.eos_id) == (ref.encode_single_token("<|fim_prefix|>"),
                                        ref.encode_single_token("<|endofprompt|>"))
    tokens, offsets = tok.encode(["hello world"])
    assert tokens.tolist() == [tok.bos_id, *ref.encode_ordinary("hello world"), tok.eos_id]
    with pytest.raises(RecipeError) as info:
        load_tokenizer(TokenizerSpec("tiktoken", path, add_bos=True))
    assert "has no BOS token" in str(info.value)
    with pytest.raises(RecipeError) as info:
        load_tokenizer(TokenizerSpec("tiktoken", path, eos_token="</s>"))
    msg = str(info.value)
    assert "no special token '</s>' (tokenizer.eos_token)" in msg and "<|endoftext|>" in msg and path in msg


def test_given_special_tokens_and_pattern_replace_tiktokens(as_encoding, tiktoken_file, real_texts, no_downloads):
    """For one of tiktoken's encodings too, what the user names wins (e.g. a chat format's own tokens)."""
    ref = as_encoding("cl100k_base")
    special = {"<|endoftext|>": 100257, "<|im_start|>": 100264, "<|im_end|>": 100265}
    tok = load_tokenizer(TokenizerSpec("tiktoken", str(tiktoken_file), special_tokens=special,
                                       eos_token="<|im_end|>", pat_str=TIKTOKEN_TEST_PATTERN))
    mine = tiktoken.Encoding("mine", pat_str=TIKTOKEN_TEST_PATTERN, mergeable_ranks=ref._mergeable_ranks,
                             special_tokens=special)
    assert tok.eos_id == 100265 and tok.vocab_size == mine.n_vocab == 100266
    assert tok.token_id("<|fim_prefix|>") is None  # tiktoken's own are replaced, not merged in
    tokens, offsets = tok.encode(real_texts[:50])
    assert [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])] == \
        [mine.encode_ordinary(t) + [100265] for t in real_texts[:50]]


def test_an_unknown_file_is_refused_without_its_special_tokens_and_pattern(tiktoken_file, no_downloads):
    path = str(tiktoken_file)
    digest = hashlib.sha256(tiktoken_file.read_bytes()).hexdigest()
    n_ranks = len(load_tiktoken_bpe(path))
    with pytest.raises(RecipeError) as info:
        load_tokenizer(TokenizerSpec("tiktoken", path))
    msg = str(info.value)
    assert f"tokenizer.path = {path}" in msg and "not one of tiktoken's encodings" in msg and digest in msg
    assert f'special_tokens = {{ "<|endoftext|>" = {n_ranks} }}' in msg and "pat_str = " in msg
    # Only what is missing is asked for.
    with pytest.raises(RecipeError) as info:
        load_tokenizer(TokenizerSpec("tiktoken", path, special_tokens={"<|endoftext|>": n_ranks}))
    assert "pat_str = " in str(info.value) and "special_tokens = " not in str(info.value)
    with pytest.raises(RecipeError) as info:
        load_tokenizer(TokenizerSpec("tiktoken", path, pat_str=TIKTOKEN_TEST_PATTERN))
    assert "special_tokens = " in str(info.value) and "pat_str = " not in str(info.value)
    # No special token written (no EOS, no BOS): the pattern is enough; the vocabulary is the file's ranks.
    tok = load_tokenizer(TokenizerSpec("tiktoken", path, add_eos=False, pat_str=TIKTOKEN_TEST_PATTERN))
    assert tok.vocab_size == n_ranks and tok.eos_id is None and tok.tiktoken_encoding is None
    # Both given: loaded, the EOS where the user put it.
    tok = load_tokenizer(TokenizerSpec("tiktoken", path, **tiktoken_options(tiktoken_file)))
    assert tok.eos_id == n_ranks and tok.vocab_size == n_ranks + 1


def test_given_special_tokens_are_checked_against_the_file(tiktoken_file):
    path = str(tiktoken_file)
    with pytest.raises(RecipeError) as info:  # tiktoken would accept it, and decode id 5 as two tokens
        load_tokenizer(TokenizerSpec("tiktoken", path, special_tokens={"<|endoftext|>": 5},
                                     pat_str=TIKTOKEN_TEST_PATTERN))
    assert "'<|endoftext|>' = 5 is also the id of the file's token" in str(info.value)
    with pytest.raises(RecipeError) as info:
        load_tokenizer(TokenizerSpec("tiktoken", path, pat_str="(unclosed", special_tokens={"<|endoftext|>": 10**6}))
    assert "tokenizer.pat_str" in str(info.value) and "regular expression" in str(info.value)
    with pytest.raises(RecipeError) as info:  # a Python spec is checked as a recipe's is
        load_tokenizer(TokenizerSpec("tiktoken", path, special_tokens={"<|a|>": 10**6, "<|b|>": 10**6},
                                     pat_str=TIKTOKEN_TEST_PATTERN))
    assert "'<|a|>' and '<|b|>' have the same id 1000000" in str(info.value)


# -- the recipe key ----------------------------------------------------------------------------------------
def _toml_recipe(tmp_path: Path, corpus: Path, tokenizer_lines: str) -> Path:
    recipe = tmp_path / "r.toml"
    recipe.write_text(f"""seed = 1
lanes = 2
seq_len = 32

[tokenizer]
{tokenizer_lines}

[[sources]]
name = "web"
path = "{corpus / 'web'}"
format = "parquet"
""")
    return recipe


def test_the_recipe_key_special_tokens(tmp_path, corpus, tiktoken_file):
    n = len(load_tiktoken_bpe(str(tiktoken_file)))
    lines = (f'kind = "tiktoken"\npath = "{tiktoken_file}"\n'
             f'special_tokens = {{ "<|endoftext|>" = {n}, "<|startoftext|>" = {n + 1} }}\n'
             f"pat_str = '''{TIKTOKEN_TEST_PATTERN}'''")
    recipe = zephon.load_recipe(_toml_recipe(tmp_path, corpus, lines))
    assert recipe.tokenizer.special_tokens == (("<|endoftext|>", n), ("<|startoftext|>", n + 1))
    assert recipe.tokenizer.pat_str == TIKTOKEN_TEST_PATTERN
    hash(recipe.tokenizer)  # the spec stays hashable (it keys the shared tokenizers)
    tok = load_tokenizer(recipe.tokenizer)
    assert tok.eos_id == n and tok.vocab_size == n + 2
    report = recipe.to_pipeline().validate(records=8)  # records go through the tokenizer of the recipe
    assert report.rows > 0


@pytest.mark.parametrize("value,expected", [
    ('"<|endoftext|>"', "must be a table of token name = id"),
    ("[100257]", "must be a table of token name = id"),
    ('{ "<|endoftext|>" = -1 }', "the id of '<|endoftext|>' must be an integer in [0, 2**31), got -1"),
    ('{ "<|endoftext|>" = 1.5 }', "got 1.5 (a float)"),
    ('{ "<|endoftext|>" = "100257" }', "(a string"),
    ('{ "<|endoftext|>" = true }', "(a boolean)"),
    ('{ "<|endoftext|>" = 4294967296 }', "must be an integer in [0, 2**31)"),
    ('{ "" = 100257 }', "a token name must be a non-empty string"),
    ('{ "<|a|>" = 100257, "<|b|>" = 100257 }', "'<|a|>' and '<|b|>' have the same id 100257"),
])
def test_the_recipe_key_is_validated(tmp_path, corpus, tiktoken_file, value, expected):
    lines = f'kind = "tiktoken"\npath = "{tiktoken_file}"\nspecial_tokens = {value}'
    path = _toml_recipe(tmp_path, corpus, lines)
    with pytest.raises(RecipeError) as info:
        zephon.load_recipe(path)
    msg = str(info.value)
    assert str(path) in msg and "tokenizer.special_tokens" in msg and expected in msg


def test_special_tokens_on_another_kind_is_refused(tmp_path, corpus, sp_model):
    path = _toml_recipe(tmp_path, corpus, f'kind = "sentencepiece"\npath = "{sp_model}"\n'
                                          f'special_tokens = {{ "</s>" = 2 }}')
    with pytest.raises(RecipeError, match="tokenizer.special_tokens is for tiktoken files only"):
        zephon.load_recipe(path)
    with pytest.raises(zephon.PipelineError, match="tokenizer.special_tokens is for tiktoken files only"):
        zephon.tokenizer(str(sp_model), special_tokens={"</s>": 2})


def test_a_misspelt_key_is_named(tmp_path, corpus, tiktoken_file):
    path = _toml_recipe(tmp_path, corpus, f'kind = "tiktoken"\npath = "{tiktoken_file}"\n'
                                          f'special_token = {{ "<|endoftext|>" = 5 }}')
    with pytest.raises(RecipeError, match="special_token.*special_tokens"):
        zephon.load_recipe(path)


# -- the fingerprint -----------------------------------------------------------------------------------------
def test_special_tokens_and_pattern_are_fingerprinted(corpus, tiktoken_file):
    n = len(load_tiktoken_bpe(str(tiktoken_file)))

    def fingerprint(**tok):
        data = base_recipe_dict(corpus, {"kind": "tiktoken", "path": str(tiktoken_file),
                                         "pat_str": TIKTOKEN_TEST_PATTERN, **tok})
        return recipe_from_dict(data).to_pipeline().fingerprint

    a = fingerprint(special_tokens={"<|endoftext|>": n})
    assert fingerprint(special_tokens={"<|endoftext|>": n + 1}) != a  # another id
    assert fingerprint(special_tokens={"<|eot|>": n}, eos_token="<|eot|>") != a  # another name
    assert fingerprint(special_tokens={"<|endoftext|>": n, "<|x|>": n + 1}) != a  # one more
    assert fingerprint(special_tokens={"<|endoftext|>": n}, pat_str=r"\s+|\S+") != a
    two = fingerprint(special_tokens={"<|endoftext|>": n, "<|x|>": n + 1})
    assert fingerprint(special_tokens={"<|x|>": n + 1, "<|endoftext|>": n}) == two  # one mapping, any order
    desc = tokenizer_description(TokenizerSpec("tiktoken", str(tiktoken_file), special_tokens={"<|x|>": n}))
    assert desc["special_tokens"] == {"<|x|>": n}


def test_other_kinds_descriptions_are_unchanged(sp_model):
    """special_tokens is described for tiktoken only: the fingerprints of other runs (and their checkpoints)
    stay what they were."""
    desc = tokenizer_description(TokenizerSpec("sentencepiece", str(sp_model)))
    assert set(desc) == {"kind", "sha256", "add_eos", "add_bos", "eos_token", "bos_token", "pad_id", "pat_str"}


# -- the Python API and the [[ops]] form ---------------------------------------------------------------------
def test_zephon_tokenizer_takes_special_tokens_and_the_recipe_round_trips(tmp_path, corpus, tiktoken_file):
    n = len(load_tiktoken_bpe(str(tiktoken_file)))
    spec = zephon.tokenizer(str(tiktoken_file), special_tokens={"<|endoftext|>": n}, pat_str=TIKTOKEN_TEST_PATTERN)
    assert spec.kind == "tiktoken" and spec.special_tokens == (("<|endoftext|>", n),)
    assert load_tokenizer(spec).eos_id == n
    with pytest.raises(zephon.PipelineError, match="must be an integer"):
        zephon.tokenizer(str(tiktoken_file), special_tokens={"<|endoftext|>": "x"})
    data = base_recipe_dict(corpus, {"kind": "tiktoken", "path": str(tiktoken_file),
                                     "special_tokens": {"<|endoftext|>": n}, "pat_str": TIKTOKEN_TEST_PATTERN})
    pipe = recipe_from_dict(data).to_pipeline()
    text = pipe.to_recipe()
    assert '"<|endoftext|>" = ' in text
    (tmp_path / "steps.toml").write_text(text)
    again = zephon.load_recipe(tmp_path / "steps.toml")
    assert again.tokenizer.special_tokens == spec.special_tokens and again.tokenizer.pat_str == spec.pat_str
    assert again.to_pipeline().fingerprint == pipe.fingerprint


def test_the_own_encodings_are_found_from_tiktokens_code(no_downloads):
    """Each .tiktoken-file constructor is found by the hash it passes, and only its base encoding is kept where
    several load one file (p50k_edit, o200k_harmony); gpt2 (data_gym files) is not asked for."""
    hashes = {}
    for name in ("r50k_base", "p50k_base", "cl100k_base", "o200k_base"):
        def record(blobpath, expected_hash=None):
            hashes[name] = expected_hash
            return {}
        with pytest.MonkeyPatch.context() as m:
            m.setattr(openai_public, "load_tiktoken_bpe", record)
            openai_public.ENCODING_CONSTRUCTORS[name]()
    ranks = {bytes([b]): b for b in range(256)}
    for name, digest in hashes.items():
        (found,) = tokenization.tiktoken_own_encodings(digest, ranks)
        assert found["name"] == name and found["mergeable_ranks"] is ranks
    assert tokenization.tiktoken_own_encodings("0" * 64, ranks) == []
    with pytest.raises(AssertionError, match="was asked to read https://"):  # the guard does guard
        openai_public.ENCODING_CONSTRUCTORS["cl100k_base"]()

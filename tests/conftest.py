"""Shared fixtures: a small real-text corpus and tokenizers trained on it, all built locally."""

from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import pyarrow.parquet as pq
import pytest

from zephon import Recipe, recipe_from_dict
from zephon.demo.text import train_sentencepiece, write_corpus

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# .ci/run installs litdata, mosaicml-streaming and triton without their dependencies into .ci/site, outside
# the environment (their unmet requirements would fail `pip check` there). The tests import them from it,
# and so do the processes they start (torchrun, Ray, the benchmarks' children), through PYTHONPATH.
CI_SITE = Path(__file__).resolve().parents[1] / ".ci" / "site"
if CI_SITE.is_dir():
    if str(CI_SITE) not in sys.path:
        sys.path.insert(0, str(CI_SITE))
    _paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(CI_SITE) not in _paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(CI_SITE), *_paths])

CORPUS_FILES = 70  # standard-library files mined for documents: ~2.5k documents, seconds to build


def build_corpus(root: Path) -> Path:
    """``web/*.parquet`` (8 files, row groups of 6) and ``code/*.jsonl`` (4 files) of real text."""
    write_corpus(root, max_files=CORPUS_FILES, prose_files=8, code_files=4, row_group_size=6)
    return root


def read_corpus_texts(corpus: Path) -> list[str]:
    texts = []
    for f in sorted((corpus / "web").glob("*.parquet")):
        texts += pq.read_table(f, columns=["text"]).column(0).to_pylist()
    for f in sorted((corpus / "code").glob("*.jsonl")):
        texts += [json.loads(line)["text"] for line in f.read_text().splitlines()]
    return texts


def build_hf_tokenizer(folder: Path, corpus_texts: list[str]) -> Path:
    """A byte-level BPE ``tokenizer.json`` trained with Hugging Face ``tokenizers``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_texts, trainer)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def build_tiktoken_file(folder: Path, hf_tokenizer: Path) -> Path:
    """A ``.tiktoken`` BPE file: the byte-level BPE above, its tokens mapped back to raw bytes."""
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # GPT-2's byte <-> unicode table, rebuilt (printable bytes map to themselves, others shift up).
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    assert set(table) == set(alphabet)
    vocab = json.loads(hf_tokenizer.read_text())["model"]["vocab"]
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    for token, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        if token.startswith("<|"):
            continue
        raw = bytes(table[c] for c in token)
        ranks.setdefault(raw, len(ranks))
    path = folder / "tok.tiktoken"
    path.write_text("".join(f"{base64.b64encode(k).decode()} {v}\n" for k, v in ranks.items()))
    return path


# The cl100k split regex as Zephon wrote it for every .tiktoken file before it took tiktoken's own definitions
# (an older spelling of tiktoken's cl100k_base pattern). The test files made by build_tiktoken_file are none of
# tiktoken's encodings, so they must name their pattern and special tokens: these, with EOS at the first id
# after the ranks as before, keep their ids (and the golden hashes) as they were.
TIKTOKEN_TEST_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|"""
    r"""\s+(?!\S)|\s+"""
)


def tiktoken_options(path: Path, bos: bool = False) -> dict[str, Any]:
    """``special_tokens`` and ``pat_str`` for a test ``.tiktoken`` file: ``<|endoftext|>`` at the number of
    ranks (and ``<|startoftext|>`` next, with ``bos``) and :data:`TIKTOKEN_TEST_PATTERN`."""
    n = sum(1 for line in path.read_bytes().splitlines() if line)
    special = {"<|endoftext|>": n, **({"<|startoftext|>": n + 1} if bos else {})}
    return {"special_tokens": special, "pat_str": TIKTOKEN_TEST_PATTERN}


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return build_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def corpus_texts(corpus) -> list[str]:
    return read_corpus_texts(corpus)


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory, corpus_texts) -> Path:
    return train_sentencepiece(tmp_path_factory.mktemp("sp") / "tok.model", corpus_texts, vocab_size=600)


@pytest.fixture(scope="session")
def hf_tokenizer(tmp_path_factory, corpus_texts) -> Path:
    return build_hf_tokenizer(tmp_path_factory.mktemp("hf"), corpus_texts)


@pytest.fixture(scope="session")
def tiktoken_file(tmp_path_factory, hf_tokenizer) -> Path:
    return build_tiktoken_file(tmp_path_factory.mktemp("tt"), hf_tokenizer)


def base_recipe_dict(corpus: Path, tokenizer: dict[str, Any]) -> dict[str, Any]:
    """A small two-source recipe that exercises every mechanism in a few steps."""
    return {
        "seed": 7, "lanes": 16, "seq_len": 64, "batch_per_lane": 2, "flush_every": 2,
        "tokenizer": tokenizer,
        "pack": {"algorithm": "best_fit", "max_open_bins": 4},
        "read": {"chunk_rows": 4, "chunk_bytes": 1024, "unit_bytes": 4096},
        "sources": [
            {"name": "web", "path": str(corpus / "web"), "format": "parquet", "text_field": "text",
             "weight": 0.7},
            {"name": "code", "path": str(corpus / "code" / "*.jsonl"), "format": "jsonl",
             "text_field": "text", "weight": 0.3},
        ],
    }


@pytest.fixture(scope="session")
def make_recipe(corpus, sp_model) -> Callable[..., Recipe]:
    """``make_recipe(lanes=32, pack={"algorithm": "wrap"}, ...)``: the base recipe with overrides."""

    def make(**overrides: Any) -> Recipe:
        data = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        return recipe_from_dict(data)

    return make


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the files with long tests first.

    Under README's test command (``-n 2``, with pyproject's ``--dist loadfile --no-loadscope-reorder``) each
    file goes whole to one of two processes, in this order, each process taking the next file when it is
    done: the long files started first end while the many short ones fill in behind them, so the two
    processes finish together instead of one waiting on a long file picked up last (xdist's own order, by
    test count, ran scripts/promise.py's file last). The order of the tests within a file is kept, and tests
    do not depend on each other's order.
    """
    def rank(item: pytest.Item) -> int:
        return 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("e2e") else 2

    def file_of(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    by_file: dict[str, int] = {}
    for item in items:
        by_file[file_of(item)] = min(by_file.get(file_of(item), 2), rank(item))
    items.sort(key=lambda item: by_file[file_of(item)])  # stable: collection order within a rank

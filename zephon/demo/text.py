"""The demo's text corpus: real English text and real code from Python's standard library.

No network: documents are the docstrings of the standard library's modules (prose, Parquet) and its
functions' source (code, JSON Lines), read with ``ast`` from the interpreter's own files, never
imported; conversations for chat fine-tuning are made from the docstrings too (JSON Lines with a
``messages`` field). A SentencePiece tokenizer is trained on the documents. Used by the quickstart
recipes (through :func:`zephon.demo.make_demo`) and the tests.
"""

from __future__ import annotations

import ast
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def stdlib_files() -> list[Path]:
    """The standard library's .py files (tests and site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__")
    return sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))


def stdlib_documents(max_files: int | None = None) -> Iterator[tuple[str, str, str]]:
    """Yields ``(kind, name, text)``: kind "prose" (docstrings) or "code" (function source)."""
    for path in stdlib_files()[:max_files]:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        module_doc = ast.get_docstring(tree)
        if module_doc:
            yield "prose", str(path), module_doc
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    yield "prose", f"{path}:{node.name}", doc
                if isinstance(node, ast.FunctionDef):
                    segment = "".join(lines[node.lineno - 1:node.end_lineno])
                    if segment:
                        yield "code", f"{path}:{node.name}", segment


def write_corpus(out_dir: str | Path, max_files: int | None = None, prose_files: int = 8,
                 code_files: int = 4, row_group_size: int = 500,
                 documents: list[tuple[str, str, str]] | None = None) -> dict[str, int]:
    """Write ``out_dir/web/*.parquet`` (prose) and ``out_dir/code/*.jsonl`` (code); return counts."""
    import pyarrow as pa  # here, not at the top: checking which demo parts exist needs no pyarrow
    import pyarrow.parquet as pq

    out = Path(out_dir)
    (out / "web").mkdir(parents=True, exist_ok=True)
    (out / "code").mkdir(parents=True, exist_ok=True)
    prose: list[str] = []
    code: list[str] = []
    for kind, _, text in documents if documents is not None else stdlib_documents(max_files):
        (prose if kind == "prose" else code).append(text)
    for i in range(prose_files):
        part = prose[i::prose_files]
        pq.write_table(pa.table({"id": list(range(len(part))), "text": part}),
                       out / "web" / f"part-{i:04d}.parquet", row_group_size=row_group_size)
    for i in range(code_files):
        with open(out / "code" / f"part-{i:04d}.jsonl", "w", encoding="utf-8") as f:
            for j, text in enumerate(code[i::code_files]):
                f.write(json.dumps({"id": j, "text": text}) + "\n")
    return {"prose": len(prose), "code": len(code)}


def write_chat(out_dir: str | Path, documents: list[tuple[str, str, str]], files: int = 4) -> int:
    """``out_dir/part-*.jsonl``: conversations made from the docstrings of functions and classes (a user
    asks what ``name`` does, the assistant answers with its docstring; every third one goes on with a
    follow-up question answered by the docstring's last paragraph). Returns the number of conversations."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    conversations = []
    for kind, name, text in documents:
        if kind != "prose" or ":" not in name:
            continue
        qualname = name.rsplit(":", 1)[1]
        module = Path(name.rsplit(":", 1)[0]).stem
        paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
        messages = [{"role": "user", "content": f"What does `{module}.{qualname}` do?"},
                    {"role": "assistant", "content": paragraphs[0]}]
        if len(conversations) % 3 == 2 and len(paragraphs) > 1:
            messages += [{"role": "user", "content": "Anything else to know?"},
                         {"role": "assistant", "content": paragraphs[-1]}]
        conversations.append(messages)
    for i in range(files):
        with open(out / f"part-{i:04d}.jsonl", "w", encoding="utf-8") as f:
            for j, messages in enumerate(conversations[i::files]):
                f.write(json.dumps({"id": j, "messages": messages}) + "\n")
    return len(conversations)


def train_sentencepiece(out_model: str | Path, texts: list[str], vocab_size: int = 4000) -> Path:
    """Train a BPE SentencePiece model on ``texts`` (single-threaded, no shuffling: reproducible)."""
    return _train_bpe(out_model, texts, vocab_size)


def _train_bpe(out_model: str | Path, texts: list[str], vocab_size: int, **options: Any) -> Path:
    """:func:`train_sentencepiece` with more trainer ``options`` (the vision-language tokenizer's image pieces)."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, byte_fallback=True, num_threads=1, shuffle_input_sentence=False,
        input_sentence_size=0, hard_vocab_limit=False, max_sentence_length=1 << 16, minloglevel=2,
        bos_id=1, eos_id=2, unk_id=0, pad_id=3, split_digits=True, **options,
    )
    path = Path(out_model)
    path.write_bytes(model.getvalue())
    return path

"""The demo: an embedded default corpus and tokenizers, made offline from what the interpreter ships.

Three parts, each checked and built on its own (:data:`PARTS`, :func:`missing_parts`), so ``zephon demo
recipes`` run again after installing the ``vision`` extra adds the vision-language part and keeps the others:

- ``text`` and ``tokenizer`` (:mod:`.text`): prose and code from Python's standard library, chat
  conversations made from its docstrings, and a SentencePiece tokenizer trained on them;
- ``vl`` (:mod:`.vl`): image-caption pairs and interleaved documents made from the pictures that installed
  packages ship, and the vision-language tokenizer.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

# part -> the files that make it, relative to the output folder (each glob must match at least one file)
PARTS: dict[str, tuple[str, ...]] = {
    "text": ("data/web/*.parquet", "data/code/*.jsonl", "data/chat/*.jsonl"),
    "tokenizer": ("tok.model",),
    "vl": ("data/vl/pairs/*.tar", "data/vl/docs/*.parquet", "tok_vl.model"),  # recipes/vl_quickstart.toml
}
PART_NAMES = {"text": "text corpus (data/web, data/code, data/chat)", "tokenizer": "tokenizer (tok.model)",
              "vl": "vision-language data and tokenizer (data/vl, tok_vl.model)"}


def part_present(out_dir: str | Path, part: str) -> bool:
    """Whether every file pattern of ``part`` (a key of :data:`PARTS`) matches a non-empty file in
    ``out_dir``. A part whose build was interrupted half-way may still look present: ``--force`` rebuilds."""
    out = Path(out_dir)
    return all(any(f.is_file() and f.stat().st_size > 0 for f in out.glob(pattern)) for pattern in PARTS[part])


def missing_parts(out_dir: str | Path) -> list[str]:
    """The parts of the demo (keys of :data:`PARTS`, in order) not present in ``out_dir``."""
    return [part for part in PARTS if not part_present(out_dir, part)]


def make_demo(out_dir: str | Path, max_files: int | None = None, vocab_size: int = 8000,
              parts: Collection[str] | None = None) -> dict[str, Any]:
    """Build the demo's ``parts`` (keys of :data:`PARTS`; None: all of them) in ``out_dir``:

    - ``text``: the corpus in ``out_dir/data`` (web, code, chat), as the quickstart recipes expect;
    - ``tokenizer``: ``out_dir/tok.model``, trained on the same documents;
    - ``vl``: when Pillow and scikit-image's sample pictures are installed, the vision-language quickstart's
      data (``out_dir/data/vl``, ``out_dir/tok_vl.model``: :func:`zephon.demo.vl.build_quickstart`), else
      ``counts["vl_skipped"]`` says why and how to install them.

    Every part is a pure function of the standard library's files and ``max_files`` (and ``vocab_size``), so
    a part built later matches the ones built before with the same arguments. Returns counts of what was
    written (``prose``, ``code``, ``chat``; ``vl_*``) and ``built``, the parts built."""
    out = Path(out_dir)
    todo = list(PARTS) if parts is None else [p for p in PARTS if p in parts]
    unknown = sorted(set(parts or ()) - set(PARTS))
    if unknown:
        raise ValueError(f"make_demo: unknown parts {unknown}; the parts are {', '.join(PARTS)}")
    counts: dict[str, Any] = {"built": []}
    if "vl" in todo:
        from . import vl

        reason = vl.unavailable()
        if reason is not None:
            counts["vl_skipped"] = reason
            todo.remove("vl")
    if not todo:
        return counts
    from .text import stdlib_documents, train_sentencepiece, write_chat, write_corpus

    documents = list(stdlib_documents(max_files))  # every part is made from them
    if "text" in todo:
        counts.update(write_corpus(out / "data", documents=documents))
        counts["chat"] = write_chat(out / "data" / "chat", documents)
    if "tokenizer" in todo:
        sample = [t for i, (_, _, t) in enumerate(documents) if i % 3 == 0]
        train_sentencepiece(out / "tok.model", sample, vocab_size)
    if "vl" in todo:
        counts.update(vl.build_quickstart(out, documents))
    counts["built"] = todo
    return counts

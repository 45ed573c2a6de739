#!/usr/bin/env python
"""Build the offline benchmark corpus: real English prose and real code, as Parquet + a 32k BPE.

Documents come from files already on this machine, read as text and never imported:

* the Python standard library and every installed site-package (torch, numpy, pyarrow, ...): each
  module's docstring, each class/function docstring, each function's source, and, for modules with
  a lot of documentation, *all* the module's docstrings concatenated into one long document (these are
  the documents longer than 2048 tokens);
* text files under ``/usr/share/doc`` (READMEs, copyright files, gzipped changelogs), when present.

Function sources are kept with probability ``--code-fraction`` (a hash of the text decides, so the choice
is deterministic), which keeps prose (docstrings, docs) a large share of the characters.

Exact duplicates are dropped, the documents are shuffled with a fixed seed (so that every row group is a
representative mix), and written as ``DIR/parquet/part-XXXX.parquet`` (row groups of ``--row-group``
rows; columns ``text``, ``kind``, ``origin``). A byte-level BPE ``DIR/tokenizer.json`` (Hugging Face
``tokenizers``, ``BpeTrainer``, special token ``<|endoftext|>``) is trained on a deterministic sample,
and ``DIR/recipe.toml`` is a Zephon recipe over the corpus (``kind="huggingface"``, seq_len 2048,
32 lanes, batch_per_lane 1, best_fit). ``DIR/manifest.json`` records counts, length statistics and the
SHA-256 of every file. Same machine (same installed packages), same output.

    python scripts/bench/make_corpus.py --out bench_data
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import os
import random
import sys
import sysconfig
import time
from pathlib import Path
from typing import Iterator, Sequence

SKIP_PARTS = {"__pycache__", "test", "tests", "testing", "idlelib", "lib2to3", "turtledemo", "_vendor",
              "vendored", "benchmarks"}
DOC_SUFFIXES = {".txt", ".md", ".rst", ".text", ""}
DOC_NAMES = ("readme", "copyright", "changelog", "news", "changes", "authors", "todo", "faq", "notice")
MAX_DOC_CHARS = 128_000  # longer code / module documents are cut at this many characters
MAX_SHARE_DOC_CHARS = 64_000  # /usr/share/doc: the first this many characters of a file (changelogs are long)
MIN_DOCSTRING_CHARS = 40
MIN_CODE_CHARS = 80
LONG_MODULE_CHARS = 6_000  # a module whose docstrings total this much also yields one long document


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- Python sources ------------------------------------------------------------------------------
# Installed packages mined by default: big, well-documented, and stable on a given machine (mining
# "all" of site-packages makes the corpus change whenever anyone installs anything). Missing ones are
# skipped; the manifest lists those used, with versions.
DEFAULT_PACKAGES = ("torch", "numpy", "pyarrow", "pandas", "scipy", "sympy", "networkx", "botocore", "boto3",
                    "awscli", "pip", "setuptools", "hypothesis", "_pytest", "IPython", "docutils", "pygments",
                    "jinja2", "werkzeug", "flask", "cryptography", "fsspec", "tokenizers", "torchdata")


def python_files(packages: Sequence[str] | None) -> list[tuple[str, Path]]:
    """(label, path) of the .py files of the standard library and of site-packages ``packages``
    (top-level names; None: all of site-packages), sorted."""
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    site = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    out: list[tuple[str, Path]] = []
    for p in sorted(stdlib.rglob("*.py")):
        rel = p.relative_to(stdlib).parts
        if "site-packages" in rel or "dist-packages" in rel or SKIP_PARTS.intersection(rel):
            continue
        out.append(("stdlib", p))
    wanted = None if packages is None else set(packages)
    for root in sorted(site):
        for p in sorted(root.rglob("*.py")):
            rel = p.relative_to(root).parts
            if SKIP_PARTS.intersection(rel) or rel[0].endswith((".dist-info", ".egg-info")):
                continue
            if p.name.startswith("__editable__"):
                continue
            top = rel[0][:-3] if len(rel) == 1 else rel[0]
            if wanted is not None and top not in wanted:
                continue
            out.append(("site", p))
    return out


def package_versions(packages: Sequence[str] | None) -> dict[str, str | None]:
    from importlib.metadata import packages_distributions, version

    dists = packages_distributions()
    names = sorted(dists) if packages is None else list(packages)
    out: dict[str, str | None] = {}
    site = [Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")]
    for name in names:
        if not any((d / name).is_dir() or (d / f"{name}.py").is_file() for d in site):
            continue
        try:
            out[name] = version(dists[name][0])
        except Exception:  # noqa: BLE001
            out[name] = None
    return out


def _signature(node: ast.AST) -> str:
    if isinstance(node, ast.ClassDef):
        return f"class {node.name}"
    try:
        return f"def {node.name}({ast.unparse(node.args)})"
    except Exception:  # noqa: BLE001 - odd syntax in a third-party file must not stop the corpus
        return f"def {node.name}(...)"


def python_documents(label: str, path: Path, root_name: str) -> Iterator[tuple[str, str, str]]:
    """Yields ``(kind, origin, text)`` for one module: docstrings, function sources, one long doc."""
    try:
        raw = path.read_bytes()
        if len(raw) > 4_000_000:
            return
        source = raw.decode("utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError, MemoryError):
        return
    lines = source.splitlines(keepends=True)
    origin = f"{label}:{root_name}"
    sections: list[str] = []
    module_doc = ast.get_docstring(tree)
    if module_doc and len(module_doc) >= MIN_DOCSTRING_CHARS:
        yield "docstring", origin, module_doc
        sections.append(module_doc)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        doc = ast.get_docstring(node)
        if doc and len(doc) >= MIN_DOCSTRING_CHARS:
            yield "docstring", origin, doc
            sections.append(f"{_signature(node)}\n\n{doc}")
        if not isinstance(node, ast.ClassDef) and node.end_lineno:
            segment = "".join(lines[node.lineno - 1:node.end_lineno])
            if MIN_CODE_CHARS <= len(segment) <= MAX_DOC_CHARS:
                yield "code", origin, segment
    if sum(len(s) for s in sections) >= LONG_MODULE_CHARS:
        title = f"Module {root_name}\n{'=' * (7 + len(root_name))}\n\n"
        yield "module_docs", origin, (title + "\n\n".join(sections))[:MAX_DOC_CHARS]


def module_name(label: str, path: Path) -> str:
    if label == "stdlib":
        base = Path(sysconfig.get_paths()["stdlib"]).resolve()
    else:
        base = next(Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")
                    if path.is_relative_to(Path(sysconfig.get_paths()[k]).resolve()))
    rel = path.relative_to(base).with_suffix("")
    parts = list(rel.parts)
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or path.stem


# -- /usr/share/doc ------------------------------------------------------------------------------
def share_doc_documents(root: Path = Path("/usr/share/doc")) -> Iterator[tuple[str, str, str]]:
    if not root.is_dir():
        return
    for p in sorted(root.rglob("*")):
        try:
            if not p.is_file() or p.is_symlink() or p.stat().st_size > 8_000_000:
                continue
        except OSError:
            continue
        name = p.name.lower()
        gz = name.endswith(".gz")
        stem = name[:-3] if gz else name
        suffix = Path(stem).suffix
        if suffix not in DOC_SUFFIXES and not stem.startswith(DOC_NAMES):
            continue
        if suffix == "" and not stem.startswith(DOC_NAMES):
            continue
        try:
            data = gzip.decompress(p.read_bytes()) if gz else p.read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        text = text.strip()
        if len(text) < 200 or "\x00" in text:
            continue
        yield "share_doc", f"doc:{p.relative_to(root)}", text[:MAX_SHARE_DOC_CHARS]


# -- tokenizer -----------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.save(str(out))


RECIPE = """\
# Zephon recipe over the benchmark corpus written by scripts/bench/make_corpus.py.
# Paths resolve relative to this file.
seed = 1234
lanes = 32
seq_len = 2048
batch_per_lane = 1
flush_every = 8

[tokenizer]
kind = "huggingface"
path = "tokenizer.json"
eos_token = "<|endoftext|>"

[pack]
algorithm = "best_fit"

[[sources]]
name = "text"
path = "parquet"
format = "parquet"
text_field = "text"
"""


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_data", help="output directory (default: bench_data/)")
    ap.add_argument("--min-docs", type=int, default=100_000, help="fail if fewer documents are found")
    ap.add_argument("--max-docs", type=int, default=0, help="keep at most this many (0: all)")
    ap.add_argument("--files", type=int, default=16, help="number of Parquet files")
    ap.add_argument("--row-group", type=int, default=1000, help="rows per Parquet row group")
    ap.add_argument("--vocab-size", type=int, default=32768)
    ap.add_argument("--tokenizer-sample-mb", type=float, default=24.0,
                    help="MB of text (a deterministic stride over the shuffled corpus) to train the BPE on")
    ap.add_argument("--code-fraction", type=float, default=0.75,
                    help="share of function sources kept (deterministic by content hash)")
    ap.add_argument("--seed", type=int, default=20240601)
    ap.add_argument("--packages", default=",".join(DEFAULT_PACKAGES),
                    help="comma-separated top-level site-packages to mine, or 'all' (default: a fixed list of "
                         "big, stable packages; see DEFAULT_PACKAGES)")
    ap.add_argument("--no-share-doc", action="store_true", help="skip /usr/share/doc")
    ap.add_argument("--dry-run", action="store_true", help="mine and count the documents, write nothing")
    ap.add_argument("--force", action="store_true", help="overwrite an existing corpus in --out")
    args = ap.parse_args(argv)
    # Single-threaded, reproducible tokenizer training (and polite on a shared machine).
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(args.out)
    pq_dir = out / "parquet"
    if pq_dir.exists() and any(pq_dir.iterdir()) and not (args.force or args.dry_run):
        log(f"{pq_dir} already holds a corpus; pass --force to rebuild it")
        return 2

    t0 = time.perf_counter()
    seen: set[bytes] = set()
    docs: list[tuple[str, str, str]] = []

    def add(kind: str, origin: str, text: str) -> None:
        text = text.strip()
        if not text:
            return
        key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        if key in seen:
            return
        if kind == "code" and int.from_bytes(key[:8], "little") >= args.code_fraction * 2**64:
            return
        seen.add(key)
        docs.append((kind, origin, text))

    packages = None if args.packages.strip() == "all" else [p.strip() for p in args.packages.split(",") if p.strip()]
    files = python_files(packages)
    log(f"mining {len(files)} Python files with ast (never imported) ...")
    for i, (label, path) in enumerate(files):
        name = module_name(label, path)
        for kind, origin, text in python_documents(label, path, name):
            add(kind, origin, text)
        if i % 2000 == 0:
            log(f"  {i}/{len(files)} files, {len(docs)} documents, {time.perf_counter() - t0:.0f}s")
    if not args.no_share_doc:
        n0 = len(docs)
        for kind, origin, text in share_doc_documents():
            add(kind, origin, text)
        log(f"  /usr/share/doc: {len(docs) - n0} documents")
    # Strings that cannot be encoded as UTF-8 (lone surrogates) cannot go into Parquet.
    docs = [d for d in docs if _utf8_ok(d[2])]
    random.Random(args.seed).shuffle(docs)
    if args.max_docs:
        docs = docs[:args.max_docs]
    if len(docs) < args.min_docs:
        log(f"only {len(docs)} documents found, fewer than --min-docs={args.min_docs}"
            + ("" if packages is None else "; try --packages all"))
        return 1
    if args.dry_run:
        kinds = {k: sum(1 for d in docs if d[0] == k) for k in sorted({d[0] for d in docs})}
        log(f"dry run: {len(docs)} documents {kinds}, {sum(len(d[2]) for d in docs) / 1e6:.0f}M characters")
        return 0
    pq_dir.mkdir(parents=True, exist_ok=True)
    for old in pq_dir.glob("*.parquet"):
        old.unlink()

    n_files = max(1, args.files)
    per_file = -(-len(docs) // n_files)
    for f in range(n_files):
        part = docs[f * per_file:(f + 1) * per_file]
        if not part:
            continue
        table = pa.table({"text": [d[2] for d in part], "kind": [d[0] for d in part],
                          "origin": [d[1] for d in part]})
        pq.write_table(table, pq_dir / f"part-{f:04d}.parquet", row_group_size=args.row_group,
                       compression="zstd")
    log(f"wrote {len(docs)} documents into {n_files} Parquet files ({time.perf_counter() - t0:.0f}s)")

    budget = int(args.tokenizer_sample_mb * 1e6)
    total_chars = sum(len(d[2]) for d in docs)
    stride = max(1, round(total_chars / max(1, budget)))
    sample = [d[2] for d in docs[::stride]]
    log(f"training a {args.vocab_size}-token byte-level BPE on {len(sample)} documents "
        f"({sum(map(len, sample)) / 1e6:.1f} MB) ...")
    train_tokenizer(sample, args.vocab_size, out / "tokenizer.json")
    (out / "recipe.toml").write_text(RECIPE, encoding="utf-8")

    # Statistics, with the trained tokenizer, on a deterministic 1/20 sample.
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    probe = docs[::20]
    lengths = sorted(len(e.ids) + 1 for e in tok.encode_batch_fast([d[2] for d in probe], add_special_tokens=False))
    n = len(lengths)
    stats = {
        "docs": len(docs), "chars": total_chars,
        "by_kind": {k: sum(1 for d in docs if d[0] == k) for k in sorted({d[0] for d in docs})},
        "tokens_per_doc_sample": {"n": n, "mean": sum(lengths) / n, "p10": lengths[n // 10], "p50": lengths[n // 2],
                                  "p90": lengths[9 * n // 10], "p99": lengths[99 * n // 100], "max": lengths[-1]},
        "docs_over_2048_tokens_share": sum(1 for x in lengths if x > 2048) / n,
        "tokens_in_docs_over_2048_share": sum(x for x in lengths if x > 2048) / sum(lengths),
        "estimated_total_tokens": int(sum(lengths) * len(docs) / n),
    }
    manifest = {
        "generator": "scripts/bench/make_corpus.py", "seed": args.seed, "python": sys.version.split()[0],
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "force", "dry_run")},
        "packages": package_versions(packages),
        "vocab_size": tok.get_vocab_size(), "row_group": args.row_group, "stats": stats,
        "files": {str(p.relative_to(out)): sha256_file(p)
                  for p in sorted(pq_dir.glob("*.parquet")) + [out / "tokenizer.json", out / "recipe.toml"]},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    log(json.dumps(stats, indent=2))
    log(f"done in {time.perf_counter() - t0:.0f}s: {out}/recipe.toml, {out}/tokenizer.json, {pq_dir}/")
    return 0


def _utf8_ok(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


if __name__ == "__main__":
    sys.exit(main())

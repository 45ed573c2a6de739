"""The documentation's Python snippets run as written.

Every ```python block of README.md, of the plugins' READMEs and of every page of the documentation site
(docs/**/*.md) runs in a fresh interpreter, from the root of a temporary folder holding a copy of ``recipes/`` after ``zephon demo recipes``
(on a slice of the standard library, for time), as a reader who follows "Two commands" would run it. A
snippet that uses a name it never defines, or an API that has changed, fails here. A block that cannot run on
a CPU machine says why in an HTML comment on the line before it, ``<!-- not-run: needs a Megatron-LM
checkout -->``, and is only checked to be valid Python.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.optional import require

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "plugins/torchtitan/README.md", "plugins/megatron/README.md",
        *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md")))
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(?P<why>\S.*?)\s*-->$")


@dataclass(frozen=True)
class Block:
    """One fenced ```python block of a document."""

    doc: str
    line: int  # of the opening fence, 1-based
    code: str
    not_run: str | None  # the reason given by a preceding <!-- not-run: ... --> comment

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"


def python_blocks(doc: str, root: Path = REPO) -> list[Block]:
    """The ```python blocks of ``doc`` (a path relative to ``root``), in order."""
    lines = (root / doc).read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{doc}:{i + 1}: the ```python block is never closed"
        before = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = NOT_RUN.match(before)
        code = textwrap.dedent("\n".join(lines[i + 1:end])) + "\n"
        blocks.append(Block(doc, i + 1, code, marker["why"] if marker else None))
        i = end + 1
    return blocks


ALL_BLOCKS = [block for doc in DOCS for block in python_blocks(doc)]


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory) -> Path:
    """A folder laid out like the repository root after ``zephon demo recipes``: the shipped recipes, the
    demo corpus and its tokenizer."""
    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(REPO / "recipes", root / "recipes",
                    ignore=shutil.ignore_patterns("data", "tok.model", "tok.vocab", "__pycache__"))
    result = subprocess.run([sys.executable, "-m", "zephon", "demo", "recipes", "--max-files", "150",
                             "--vocab-size", "2000"], cwd=root, env=_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def _env() -> dict[str, str]:
    paths = [str(REPO), str(REPO / "plugins" / "torchtitan"), str(REPO / "plugins" / "megatron")]
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")])}


def test_the_readme_has_runnable_python_blocks():
    """Guards the parser: README.md's example (two ranks, a checkpoint, a resume on four) and the docs pages'
    blocks are found, and nothing in README.md is exempted."""
    readme = [b for b in ALL_BLOCKS if b.doc == "README.md"]
    assert readme and all(b.not_run is None for b in readme)
    assert any("merge_states" in b.code and "global_digest" in b.code for b in readme)
    pages = {b.doc for b in ALL_BLOCKS if b.doc.startswith("docs/")}
    assert {"docs/getting-started.md", "docs/guides/pipelines.md", "docs/guides/chat.md"} <= pages, pages


def test_the_parser_reads_fences_and_markers(tmp_path):
    (tmp_path / "doc.md").write_text("text\n\n```python\nx = 1\n```\n\n<!-- not-run: needs a GPU cluster -->\n\n"
                                     "  ```python\n  y = 2\n  ```\n```bash\nls\n```\n")
    assert python_blocks("doc.md", tmp_path) == [Block("doc.md", 3, "x = 1\n", None),
                                                 Block("doc.md", 9, "y = 2\n", "needs a GPU cluster")]


@pytest.mark.e2e
@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.not_run is None], ids=lambda b: b.name)
def test_python_block_runs(block: Block, demo_root: Path):
    script = demo_root / f"snippet_{re.sub(r'[^A-Za-z0-9]+', '_', block.name)}.py"
    script.write_text(block.code, encoding="utf-8")
    result = subprocess.run([sys.executable, script.name], cwd=demo_root, env=_env(), capture_output=True,
                            text=True, timeout=600)
    missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", result.stderr)
    if result.returncode and missing:  # an extra this machine lacks (ray, torchtitan...): skip here, fail in CI
        require(missing.group(1).split(".")[0], f"the ```python block at {block.name} needs "
                                                f"{missing.group(1)}, which is not installed")
    assert result.returncode == 0, (f"the ```python block at {block.name} failed (exit {result.returncode}):\n"
                                    f"{result.stderr[-4000:]}")


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.not_run is not None], ids=lambda b: b.name)
def test_not_run_block_is_valid_python(block: Block):
    ast.parse(block.code, filename=block.name)

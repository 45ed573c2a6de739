"""Every Zephon module and name that a script or plugin imports exists.

Scripts reach into internals (benchmarks time private functions); a module that moves must not leave a
benchmark that fails only when it is run. This reads every import of ``zephon`` in ``scripts/`` and
``plugins/`` (without running the scripts) and resolves it.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FILES = sorted(p for d in ("scripts", "plugins") for p in (REPO / d).rglob("*.py"))


def zephon_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) for each ``import zephon...`` / ``from zephon... import name``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "zephon"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "zephon":
            out += [(node.lineno, node.module, a.name) for a in node.names if a.name != "*"]
    return out


def test_the_scan_finds_the_imports_it_checks():
    found = {(m, n) for p in FILES for _, m, n in zephon_imports(p)}
    assert ("zephon.batches.images", None) in found  # scripts/bench/scaling_model.py
    assert len(found) > 20


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_zephon_import_resolves(path):
    missing = []
    for line, module, name in zephon_imports(path):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            missing.append(f"{path.relative_to(REPO)}:{line}: no module {module} ({e})")
            continue
        if name is not None and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{path.relative_to(REPO)}:{line}: {module} has no {name}")
    assert not missing, "\n".join(missing)

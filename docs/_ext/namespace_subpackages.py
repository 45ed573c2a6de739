"""A griffe extension for the API reference (mkdocs.yml): load a package's sub-folders that have no ``__init__.py``.

Python imports such a folder as a namespace package (``zephon/ops/``), but griffe, which reads the source without
importing it, skips it, so the public names defined there (``zephon.Transform``, ``zephon.Accumulator``...) could
not be resolved. This visits each ``.py`` file of such a folder as a module of that (namespace) subpackage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import griffe


class NamespaceSubpackages(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        init = Path(pkg.filepath) if not isinstance(pkg.filepath, list) else None
        if init is None or init.name != "__init__.py":
            return
        root = init.parent
        for folder in sorted(p for p in root.rglob("*") if p.is_dir()):
            if folder.name == "__pycache__" or (folder / "__init__.py").exists() or not any(folder.glob("*.py")):
                continue
            parent: Any = pkg
            parts = folder.relative_to(root).parts
            try:
                for part in parts[:-1]:
                    parent = parent.members[part]
            except KeyError:
                continue
            if parts[-1] in parent.members and isinstance(parent.members[parts[-1]], griffe.Module):
                continue
            namespace = griffe.Module(parts[-1], filepath=folder, parent=parent)
            parent.set_member(parts[-1], namespace)
            for file in sorted(folder.glob("*.py")):
                module = griffe.visit(file.stem, file, file.read_text(encoding="utf-8"), parent=namespace,
                                      extensions=loader.extensions, docstring_parser=loader.docstring_parser,
                                      docstring_options=loader.docstring_options,
                                      lines_collection=loader.lines_collection,
                                      modules_collection=loader.modules_collection)
                namespace.set_member(file.stem, module)

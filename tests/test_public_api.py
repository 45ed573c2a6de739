"""Every public name has a docstring, and every parameter of a public function or method is documented.

The public surface is what a user reaches without a leading underscore: the names of ``zephon``'s lazy table
(``zephon._EXPORTS``), every function and class of ``zephon.read``, the names of the plugins' ``__all__``, and
every object the API reference renders (``::: name`` in docs/reference/*.md); for each class, its public
methods, properties and attributes (dataclass fields, class attributes, and the attributes ``__init__`` sets).

Each of them needs a docstring; a function or method with parameters (``self``, ``cls``, ``*args`` and
``**kwargs`` aside) needs a Google-style ``Args:`` section with one entry per parameter (a class documents its
constructor's in its own docstring, or ``__init__``'s); an attribute or property needs a docstring of its own
(or an entry in its class's ``Attributes:`` section), no ``Args``; so does a dataclass field. The source is read with griffe, as the API
reference reads it, without importing anything: the plugins' frameworks need not be installed. Whether the
docstrings parse cleanly (one name per entry, consistent indentation) is tests/test_docs.py's check.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.optional import require

REPO = Path(__file__).resolve().parents[1]
PLUGINS = {"zephon_megatron": REPO / "plugins" / "megatron", "zephon_torchtitan": REPO / "plugins" / "torchtitan"}
NOT_PARAMETERS = {"self", "cls"}


@pytest.fixture(scope="module")
def griffe() -> Any:
    return require("griffe", "griffe is not installed (the docs extra brings it: python -m pip install -e '.[docs]')")


def load(griffe: Any, root: Path = REPO, packages: tuple[str, ...] = ("zephon", *PLUGINS)) -> Any:
    """The packages as griffe reads them (statically), their aliases resolved within them."""
    paths = [str(root)] + [str(p) for p in PLUGINS.values()]
    loader = griffe.GriffeLoader(search_paths=paths, docstring_parser="google", allow_inspection=False)
    for package in packages:
        loader.load(package, try_relative_path=False)
    loader.resolve_aliases(implicit=False, external=False)
    return loader.modules_collection


def public_names(root: Path = REPO) -> list[str]:
    """The public surface's entry points, as dotted paths."""
    import zephon

    names = [f"zephon.{name}" for name in zephon._EXPORTS]
    names += [f"{package}.{name}" for package in PLUGINS for name in _all_of(root, package)]
    for page in sorted((root / "docs" / "reference").glob("*.md")):
        names += re.findall(r"^:::\s+(\S+)", page.read_text(encoding="utf-8"), re.MULTILINE)
    return list(dict.fromkeys(names))


def _all_of(root: Path, package: str) -> list[str]:
    """A plugin package's ``__all__``, read from its source (importing it would import its framework)."""
    import ast

    init = PLUGINS[package] / package / "__init__.py" if root == REPO else root / package / "__init__.py"
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


class Check:
    """Walks objects and collects what is missing, as ``path: problem`` lines."""

    def __init__(self, griffe: Any, collection: Any) -> None:
        self.griffe = griffe
        self.kinds = griffe.DocstringSectionKind
        self.collection = collection
        self.problems: list[str] = []
        self.seen: set[str] = set()

    def name(self, path: str) -> None:
        try:
            obj = self.collection[path]
        except KeyError:
            obj = self.lazy(path)
            if obj is None:
                self.problems.append(f"{path}: not found")
                return
        self.object(obj, path)

    def lazy(self, path: str) -> Any:
        """A name a package's ``__getattr__`` serves from a submodule (zephon_torchtitan.ZephonTrainer)."""
        package, _, name = path.rpartition(".")
        try:
            modules = self.collection[package].modules
        except (KeyError, AttributeError):
            return None
        return next((m.members[name] for m in modules.values() if name in m.members), None)

    def sections(self, obj: Any) -> list[Any]:
        doc = obj.docstring
        return doc.parse("google", warnings=False) if doc is not None else []

    def entries(self, obj: Any, *kinds: Any) -> set[str]:
        return {item.name for s in self.sections(obj) if s.kind in kinds for item in s.value}

    def documented(self, obj: Any) -> bool:
        return obj.docstring is not None and bool(obj.docstring.value.strip())

    def parameters(self, fn: Any) -> list[str]:
        return [p.name for p in fn.parameters if p.name not in NOT_PARAMETERS
                and p.kind.value not in ("variadic positional", "variadic keyword")]

    def function(self, fn: Any, path: str) -> None:
        if not self.documented(fn):
            self.problems.append(f"{path}: no docstring")
            return
        args = self.entries(fn, self.kinds.parameters, self.kinds.other_parameters)
        missing = [p for p in self.parameters(fn) if p not in args]
        if missing:
            self.problems.append(f"{path}: no Args entry for {', '.join(missing)}")

    def object(self, obj: Any, path: str) -> None:
        if obj.is_alias:
            try:
                obj = obj.final_target
            except (self.griffe.AliasResolutionError, self.griffe.CyclicAliasError) as exc:  # outside the packages
                self.problems.append(f"{path}: cannot be resolved ({type(exc).__name__}: {exc})")
                return
        if obj.path in self.seen:
            return
        self.seen.add(obj.path)
        if obj.is_module:
            if not self.documented(obj):
                self.problems.append(f"{path}: no docstring")
            if obj.path.split(".")[0] in PLUGINS and "." not in obj.path:
                return  # a plugin package: its __all__ names are walked on their own
            for name, member in obj.members.items():
                if not name.startswith("_") and not member.is_alias and not member.is_module:
                    self.object(member, f"{path}.{name}")
        elif obj.is_class:
            self.cls(obj, path)
        elif obj.is_function:
            self.function(obj, path)
        elif not self.documented(obj):
            self.problems.append(f"{path}: no docstring")

    def cls(self, cls: Any, path: str) -> None:
        if not self.documented(cls):
            self.problems.append(f"{path}: no docstring")
        init = cls.members.get("__init__")
        if "dataclass" in cls.labels:
            init = None  # its fields are its parameters: each needs a docstring of its own (below), no Args
        if init is not None and init.is_function and not init.is_alias:
            documented = self.entries(cls, self.kinds.parameters, self.kinds.other_parameters)
            if self.documented(init):
                documented |= self.entries(init, self.kinds.parameters, self.kinds.other_parameters)
            missing = [p for p in self.parameters(init) if p not in documented]
            if missing:
                self.problems.append(f"{path}: no Args entry (in the class's docstring or __init__'s) for "
                                     f"{', '.join(missing)}")
        attributes = self.entries(cls, self.kinds.attributes)
        for name, member in cls.members.items():
            if name.startswith("_") or member.is_alias:
                continue
            where = f"{path}.{name}"
            if member.is_function and "property" not in member.labels:
                self.function(member, where)
            elif member.is_class:
                self.object(member, where)
            elif not self.documented(member) and name not in attributes:
                kind = "property" if "property" in member.labels else "attribute"
                self.problems.append(f"{where}: no docstring ({kind})")


def problems(griffe: Any, names: list[str], collection: Any) -> list[str]:
    check = Check(griffe, collection)
    for name in names:
        check.name(name)
    return check.problems


def test_the_walk_covers_the_public_surface():
    """The entry points include every lazy export, zephon.read, the plugins' __all__ and the API reference."""
    import zephon

    names = public_names()
    assert {f"zephon.{n}" for n in zephon.__all__} <= set(names)
    assert "zephon.read" in names and "zephon.testing.check_accumulator" in names
    assert {"zephon_megatron.train_valid_test_datasets_provider", "zephon_torchtitan.ZephonTokenizer"} <= set(names)


def test_every_public_name_and_parameter_is_documented(griffe):
    found = problems(griffe, public_names(), load(griffe))
    assert not found, ("public names without a docstring, or parameters without an Args entry (Google style: "
                       "'Args:' then one 'name: what it is' line per parameter):\n  " + "\n  ".join(found))


MUTANT = '''"""A package."""

from .mod import Documented, helper, undocumented

__all__ = ["Documented", "helper", "undocumented"]
'''

MUTANT_MOD = '''"""A module."""


def helper(a: int, b: int = 0) -> int:
    """Adds.

    Args:
        a: one.

    Returns:
        The sum.
    """
    return a + b


def undocumented() -> None:
    pass


class Documented:
    """A class.

    Args:
        x: its x.
    """

    def __init__(self, x: int, y: int) -> None:
        self.x = x
        """Its x."""
        self.y = y

    @property
    def size(self) -> int:
        return 1

    def method(self, n: int) -> int:
        """Returns n.

        Args:
            n: a number.
        """
        return n
'''


def test_the_check_catches_a_missing_docstring_and_a_missing_args_entry(griffe, tmp_path):
    """Mutation check of the checker itself: a made-up package with one of each fault."""
    package = tmp_path / "zephon_megatron"
    package.mkdir()
    (package / "__init__.py").write_text(MUTANT, encoding="utf-8")
    (package / "mod.py").write_text(MUTANT_MOD, encoding="utf-8")
    loader = griffe.GriffeLoader(search_paths=[str(tmp_path)], docstring_parser="google", allow_inspection=False)
    loader.load("zephon_megatron", try_relative_path=False)
    loader.resolve_aliases(implicit=False, external=False)
    names = [f"zephon_megatron.{n}" for n in _all_of(tmp_path, "zephon_megatron")]
    assert set(problems(griffe, names, loader.modules_collection)) == {
        "zephon_megatron.Documented: no Args entry (in the class's docstring or __init__'s) for y",
        "zephon_megatron.Documented.size: no docstring (property)",
        "zephon_megatron.Documented.y: no docstring (attribute)",
        "zephon_megatron.helper: no Args entry for b",
        "zephon_megatron.undocumented: no docstring",
    }


def test_removing_one_docstring_from_the_library_fails_the_check(griffe, tmp_path):
    """Mutation check on the real source: a copy of zephon with Accumulator.push's docstring removed."""
    import shutil

    copy = tmp_path / "repo"
    shutil.copytree(REPO / "zephon", copy / "zephon", ignore=shutil.ignore_patterns("__pycache__"))
    base = copy / "zephon" / "ops" / "base.py"
    source = base.read_text(encoding="utf-8")
    mutated = re.sub(r'(    def push\(self[^\n]*\n)        """.*?"""\n', r"\1", source, count=1, flags=re.DOTALL)
    assert mutated != source
    base.write_text(mutated, encoding="utf-8")
    loader = griffe.GriffeLoader(search_paths=[str(copy)], docstring_parser="google", allow_inspection=False)
    loader.load("zephon", try_relative_path=False)
    loader.resolve_aliases(implicit=False, external=False)
    assert problems(griffe, ["zephon.Accumulator"], loader.modules_collection) == \
        ["zephon.Accumulator.push: no docstring"]

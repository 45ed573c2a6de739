"""Optional test dependencies: a missing one skips the test on a developer's machine (with the reason, shown
by ``pytest -ra``) but fails it in CI, where .ci/run installs every extra and sets ``CI``."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require(module: str, reason: str | None = None) -> ModuleType:
    """Import ``module``; without it, skip (locally) or fail (``CI`` set)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        why = reason or f"{module} is not installed ({exc}); .ci/run installs every library the tests use"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must run every test", pytrace=False)
        pytest.skip(why, allow_module_level=True)


def require_recorded_inputs(got: dict[str, str], recorded: dict[str, str], recorded_env: dict[str, str],
                            env: dict[str, str], what: str) -> None:
    """Golden hashes hold only for the inputs they were recorded on (``recorded``). The suite generates its
    inputs locally, from this interpreter's standard library and with the installed codecs, so another
    environment (``env`` against ``recorded_env``: the Python version, codec versions) generates others:
    then skip (locally) or fail (``CI`` set: CI runs the recording's Python, 3.11, with the library versions
    of .ci/constraints.txt). In the recording's own environment, other inputs mean the generator changed,
    or a library that builds them (the tokenizer trainers, pyarrow): fail."""
    if got == recorded:
        return
    why = (f"{what}: the generated inputs differ from those the golden hashes were recorded on "
           f"({got} != {recorded})")
    differs = {k: (recorded_env.get(k), v) for k, v in env.items() if recorded_env.get(k) != v}
    if not differs:
        pytest.fail(f"{why}, in the recording's own environment ({env}): the input generator changed, or a "
                    f"library that builds the inputs (sentencepiece, tokenizers, pyarrow: .ci/constraints.txt "
                    f"pins them)", pytrace=False)
    why += "; recorded with " + ", ".join(f"{k} {a}, this is {b}" for k, (a, b) in differs.items())
    if os.environ.get("CI"):
        pytest.fail(f"{why}; CI must run the recording's Python with .ci/constraints.txt", pytrace=False)
    pytest.skip(why)

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

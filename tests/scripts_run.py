"""Running the repository's scripts from the tests: the interpreter running the tests, the checkout first on
``PYTHONPATH``, and the script's output in the failure message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "scripts" / "bench"


def run_script(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` from the repository's root; fail the test, with the end of its output, unless it
    exits 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                       check=False)
    assert p.returncode == 0, f"{' '.join(args)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p

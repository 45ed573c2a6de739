"""``python -m pip check`` for CI, failing on what .ci/run installed, not on what the machine brought.

    python .ci/pip_check.py 'zephon-loader[test,ray]' boto3 ...   # the requirements .ci/run installed

``pip check`` checks every distribution in the environment. In a fresh environment that is exactly what
.ci/run installed, and this is plain ``pip check``. CI's machine image comes with packages of its own,
among them awscli 1.45.11, which requires botocore==1.43.11 while the test extra's aiobotocore 3.10.0
requires botocore>=1.43.115: no set of versions satisfies both, and the tests never use awscli. So this
runs ``pip check``, prints everything it reports, and fails (exit 1) on the lines about the distributions
that the given requirements pull in (themselves and their dependencies, transitively, extras and markers
included); a line about any other distribution is shown as not .ci/run's.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name


def closure(requirements: list[str]) -> set[str]:
    """The installed distributions that ``requirements`` pull in, by canonical name."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue  # pip check names it as missing, on the line of the distribution that requires it
        for line in dist.requires or []:
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in (req.extras or {""})):
                todo.append(dep)
    return {name for name, _ in seen}


def main(requirements: list[str]) -> int:
    ours = closure(requirements)
    run = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    broken = []
    for line in lines:
        name = re.match(r"(\S+) \S+ (requires|has requirement|is not supported)", line)
        if name and canonicalize_name(name.group(1)) not in ours:
            print(f"{line}    [not installed by .ci/run: ignored]")
        else:
            print(line)
            broken += [line] if run.returncode else []
    if broken:
        print(f"pip check: {len(broken)} broken requirement(s) among what .ci/run installed", file=sys.stderr)
        return 1
    print(f"pip check: the {len(ours)} distributions .ci/run installed have all they require")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Install Zephon from this clone without pulling a CUDA build of torch onto a machine that has no GPU.

    python scripts/install.py                     # then: python -m pip install -e .
    python scripts/install.py --extras vision     # ... -e '.[vision]'
    python scripts/install.py --dry-run           # say what it would do, install nothing

Zephon needs torch. On Linux, ``pip install torch`` takes a CUDA build from the package index (several GB
with its nvidia-* packages and triton), which a CPU-only machine cannot use. So, before ``pip install -e .``,
this script decides where torch comes from, and prints what it decided and why:

1. torch already installed (importable by this Python): keep it; pip keeps it too, whatever its build.
2. not Linux (macOS, Windows): the package index's torch has no CUDA packages there; pip takes it.
3. an NVIDIA GPU (``nvidia-smi -L`` lists one): pip takes the index's torch, a CUDA build.
4. otherwise a CPU build of torch first, from the first of:
   a. a local CPU wheel that pip's own configuration finds offline (``find-links``, ``PIP_FIND_LINKS``);
   b. the PyTorch CPU index (https://download.pytorch.org/whl/cpu, or the mirror ZEPHON_TORCH_CPU_INDEX
      names), with a short timeout and no retries;
   and if neither has one, it stops and says what to run, installing nothing.

Only this interpreter and pip are used (``python -m pip``); pip's configuration (indexes, find-links,
proxies, certificates, constraints) applies to every command it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parents[1]
# A mirror of the PyTorch CPU index can stand in for it: ZEPHON_TORCH_CPU_INDEX=https://mirror/whl/cpu
CPU_INDEX = os.environ.get("ZEPHON_TORCH_CPU_INDEX") or "https://download.pytorch.org/whl/cpu"
CPU_INDEX_TIMEOUT_S = 15


def say(msg: str) -> None:
    print(f"[zephon install] {msg}", flush=True)


def pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", *args]


def installed_torch() -> tuple[str, str] | None:
    """(version, build) of the torch this interpreter imports, or None when it has none. A torch that is
    installed but fails to import is reported and kept: pip would not replace it either."""
    probe = ("import torch; v = torch.version; print(torch.__version__); "
             "print(f'CUDA {v.cuda}' if v.cuda else f'ROCm {v.hip}' if getattr(v, 'hip', None) else 'no CUDA')")
    try:
        run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return ("?", "importing it took over 5 minutes")
    if run.returncode == 0:
        version, build = run.stdout.split()[0], run.stdout.strip().splitlines()[-1]
        return version, build
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version("torch"), "installed, but `import torch` fails: " + run.stderr.strip().splitlines()[-1]
    except PackageNotFoundError:
        return None


def nvidia_gpus() -> tuple[list[str], str]:
    """The GPUs ``nvidia-smi -L`` lists, and why there are none when it lists none."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return [], "no nvidia-smi on PATH"
    try:
        run = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"{exe} -L failed ({exc})"
    gpus = [line.strip() for line in run.stdout.splitlines() if line.startswith("GPU ")]
    if run.returncode != 0 or not gpus:
        why = (run.stderr or run.stdout).strip().splitlines()
        return [], f"{exe} -L lists no GPU (exit {run.returncode}{': ' + why[-1] if why else ''})"
    return gpus, ""


def resolve_torch(source_args: list[str], env: dict[str, str]) -> tuple[str | None, str]:
    """The torch pip would install from ``source_args`` (version, and the file or URL), asked with
    ``--dry-run`` (which downloads only metadata where the index serves it apart, as PyPI and the PyTorch
    index do), or None and why pip found none."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = pip("install", "--dry-run", "--ignore-installed", "--no-deps", "-vv", "--report", str(report),
                  *source_args, "torch")
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        except subprocess.TimeoutExpired:
            return None, "pip took over 10 minutes to answer"
        if run.returncode != 0 or not report.exists():
            return None, pip_failure(run.stdout + run.stderr, run.returncode)
        picked = json.loads(report.read_text())["install"]
        if not picked:
            return None, "pip picked nothing"
        return picked[0]["metadata"]["version"], unquote(picked[0]["download_info"]["url"])


def pip_failure(output: str, returncode: int) -> str:
    """One line saying why pip found no torch: the index it could not reach, or that it found none."""
    for line in output.splitlines():
        if "Could not fetch URL" in line:  # pip goes on to say only that nothing matches
            url = line.split("Could not fetch URL", 1)[1].split(": ", 1)[0].strip()
            why = re.search(r"\[Errno [^\]]*\][^'\")]*|[Tt]imed out[^'\")]*|SSL[^'\")]*", line)
            return f"could not reach {url} ({why.group(0).strip() if why else line.strip()[-160:]})"
    if "ResolutionImpossible" in output or "No matching distribution" in output:
        return "pip finds no torch there"
    errors = [line.strip() for line in output.splitlines() if line.startswith("ERROR")]
    return errors[0][:300] if errors else f"pip exited {returncode}"


def is_cpu_build(version: str) -> bool:
    """PyTorch labels its CPU-only Linux wheels with a local version ``+cpu`` (``2.13.0+cpu``,
    ``2.3.0+cpu.cxx11.abi``); the package index's Linux wheels carry no label and are CUDA builds."""
    return "+" in version and version.split("+", 1)[1].startswith("cpu")


def cpu_torch_source() -> tuple[list[str], dict[str, str], str, str] | None:
    """pip arguments and environment that install a CPU build of torch, its version, and where it is."""
    # a. Offline: only what pip's configuration points at on disk (find-links); no index is asked.
    offline = ["--no-index"]
    version, where = resolve_torch(offline, dict(os.environ))
    if version and is_cpu_build(version):
        return offline, dict(os.environ), version, f"a local CPU wheel, {where}"
    say(f"  a. no local CPU wheel through pip's find-links: "
        f"{f'it finds torch {version}, not a CPU build' if version else where}")
    # b. The PyTorch CPU index, and no other: pip's configured extra indexes are set aside, or pip could take
    #    a newer CUDA build from one of them. PIP_EXTRA_INDEX_URL overrides the configuration files (pip
    #    ignores an empty value, so it names the CPU index again).
    online = ["--index-url", CPU_INDEX, "--timeout", str(CPU_INDEX_TIMEOUT_S), "--retries", "0"]
    env = {**os.environ, "PIP_EXTRA_INDEX_URL": CPU_INDEX}
    version, where = resolve_torch(online, env)
    if version and is_cpu_build(version):
        return online, env, version, f"the PyTorch CPU index, {where}"
    say(f"  b. none from {CPU_INDEX} (timeout {CPU_INDEX_TIMEOUT_S} s, no retries): "
        f"{f'pip picks torch {version}, not a CPU build' if version else where}")
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extras", default="", help="comma-separated extras, e.g. vision,formats")
    ap.add_argument("--dry-run", action="store_true", help="print the decision and the commands; install nothing")
    args = ap.parse_args(argv)

    target = "." + (f"[{args.extras}]" if args.extras else "")
    zephon = pip("install", "-e", target)
    say(f"Python: {sys.executable} ({sys.version.split()[0]}, {sys.platform})")

    steps: list[tuple[list[str], dict[str, str] | None]] = []
    torch = installed_torch()
    if torch is not None:
        version, build = torch
        say(f"torch {version} ({build}) is already installed: keeping it; pip keeps it too.")
        if version != "?" and int(version.split(".")[0]) < 2:
            say("  (Zephon needs torch>=2.0: pip will upgrade this one.)")
    elif not sys.platform.startswith("linux"):
        say(f"no torch installed; on {sys.platform} the package index's torch has no CUDA packages: "
            "pip takes it.")
    else:
        gpus, why_none = nvidia_gpus()
        if gpus:
            more = f" and {len(gpus) - 1} more" if gpus[1:] else ""
            say(f"no torch installed; NVIDIA GPU found ({gpus[0]}{more}): pip takes the package index's torch, "
                "a CUDA build.")
        else:
            say(f"no torch installed and no NVIDIA GPU ({why_none}): installing a CPU build of torch first.")
            found = cpu_torch_source()
            if found is None:
                say("No CPU build of torch could be found; nothing was installed. Either:")
                say("  - install one from the PyTorch CPU index (or a mirror of it), then run this again:")
                say(f"      {shlex.join(pip('install', 'torch', '--index-url', CPU_INDEX))}")
                say("  - or put a CPU wheel (torch-X.Y.Z+cpu-...whl) in a folder and run this again with")
                say("      PIP_FIND_LINKS=/that/folder")
                say("  - or take the package index's CUDA build anyway (several GB, unused without a GPU):")
                say(f"      {shlex.join(zephon)}")
                return 1
            source, env, version, where = found
            say(f"  -> torch {version} from {where}")
            # --no-deps: torch's own requirements (sympy, networkx, ...) come with Zephon's next, from the
            # package index (a local wheel folder rarely holds them).
            steps.append((pip("install", "--no-deps", *source, f"torch=={version}"), env))
    steps.append((zephon, None))

    for cmd, env in steps:
        extra = env.get("PIP_EXTRA_INDEX_URL") if env else None
        shown = (f"PIP_EXTRA_INDEX_URL={extra} " if extra == CPU_INDEX else "") + shlex.join(cmd)
        say(f"{'would run' if args.dry_run else 'running'}: {shown}")
        if not args.dry_run:
            rc = subprocess.call(cmd, cwd=REPO, env=env)
            if rc != 0:
                say(f"failed (exit {rc}): {shown}")
                return rc
    if not args.dry_run:
        version, build = installed_torch() or ("none", "")
        say(f"done: torch {version} ({build}) and Zephon (the `zephon` command).")
    return 0


if __name__ == "__main__":
    sys.exit(main())

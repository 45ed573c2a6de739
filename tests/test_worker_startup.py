"""Worker processes start as forks of a forkserver that already imported Zephon (and torch).

Checked from the outside, in a fresh interpreter (a forkserver that an earlier test started keeps its
own preload): right after ``build_loader`` with worker processes, before the first batch, this
process has a forkserver child, that server maps torch's shared library, and it has imported the
module of the program's own preload list. So no worker pays the import, and the program's list is kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import base_recipe_dict

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="forkserver and /proc/PID/maps are Linux's")

SCRIPT = """
import json, os, sys, time
import multiprocessing as mp
import zephon

def server():
    me = f"/proc/{os.getpid()}/task"
    children = {int(c) for t in os.listdir(me) for c in open(f"{me}/{t}/children").read().split()}
    for pid in children:
        if b"forkserver" in open(f"/proc/{pid}/cmdline", "rb").read():
            return pid, open(f"/proc/{pid}/maps").read()
    return None, None

if __name__ == "__main__":
    mp.set_forkserver_preload(["__main__", "preload_marker"])  # the program's own preload, to be kept
    recipe = zephon.recipe_from_dict(json.loads(sys.argv[1]))
    loader = zephon.build_loader(recipe, rank=0, world_size=1, num_workers=1, runner=sys.argv[2])
    deadline = time.monotonic() + 90
    while True:  # the server imports in the background; no batch has been asked for
        pid, maps = server()
        marked = pid is not None and os.path.exists(os.path.join(sys.argv[3], f"imported-by-{pid}"))
        done = maps is not None and "libtorch_cpu" in maps and marked
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    print(json.dumps({"server": maps is not None,
                      "torch": maps is not None and "libtorch_cpu" in maps,
                      "program_preload": marked,
                      "first_batch": sorted(next(iter(loader))) != []}))
    loader.close()
"""


@pytest.mark.e2e
@pytest.mark.parametrize("runner", ["pool", "process"])
def test_the_forkserver_starts_with_the_loader_and_preloads_zephon(corpus, sp_model, tmp_path, runner):
    recipe = base_recipe_dict(corpus, {"kind": "sentencepiece", "path": str(sp_model)})
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    marks = tmp_path / "marks"
    marks.mkdir()
    # on import, records which process imported it (the forkserver imports from PYTHONPATH, not sys.path)
    (tmp_path / "preload_marker.py").write_text(
        f"import os\nopen(os.path.join({str(marks)!r}, f'imported-by-{{os.getpid()}}'), 'w').close()\n")
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, str(tmp_path), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(script), json.dumps(recipe), runner, str(marks)],
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"server": True, "torch": True, "program_preload": True, "first_batch": True}, proc.stderr[-2000:]


def test_no_preload_when_the_forkserver_would_import_another_zephon(tmp_path):
    """On Python 3.11 (CPython gh-117378) the forkserver imports from a fresh interpreter's sys.path, not the
    parent's: a program that put another zephon checkout first must not get workers forked from a
    server that holds a different zephon. Zephon then asks for no preload at all."""
    import shutil

    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "zephon", tmp_path / "other" / "zephon", ignore=shutil.ignore_patterns("__pycache__"))
    probe = ("import multiprocessing.forkserver as fs, sys\n"
             "if len(sys.argv) > 1: sys.path.insert(0, sys.argv[1])\n"
             "import zephon.engine.processes as r\n"
             "r.process_context()\n"
             "print(r.__file__, r._server_finds_this_zephon(),\n"
             "      'zephon.engine.executors' in fs._forkserver._preload_modules)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    for argv, found, preloaded in [([], str(root / "zephon"), "True True"),
                                   ([str(tmp_path / "other")], str(tmp_path / "other" / "zephon"), "False False")]:
        out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120,
                             env=env, cwd=elsewhere)
        assert out.returncode == 0, out.stderr[-2000:]
        path, verdict = out.stdout.split(" ", 1)
        assert path.startswith(found) and verdict.strip() == preloaded, out.stdout

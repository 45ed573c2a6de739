#!/usr/bin/env python
"""Is the tokenizer slower on a process's main thread? A paired measurement of CPU time per call.

Why this exists: Zephon's pool and lane processes, and its inline runner, used to tokenize on the main
thread of their process, and were ~15% slower per token than the same work on a worker thread of the
trainer. The cause is glibc's malloc: the main thread allocates from the main (brk) arena, every other
thread from an arena of its own, and the Rust tokenizer's per-call allocations run slower on the main
one. Zephon now hands such work to one helper thread (``zephon.runner.run_off_main_thread``).

How: the corpus's documents in chunks of ``--chunk`` (64, Zephon's ``read.chunk_rows``). Two tokenizer
objects (each with its own BPE cache, so neither warms the other's) encode the same chunks, one on the
main thread and one on a helper thread that the main thread waits for; the order alternates per chunk.
Each call's CPU time is that thread's own (``time.thread_time``), so the machine's speed drifts cancel
in the per-chunk ratio. ``--arena-max-1`` repeats the run in a subprocess with ``MALLOC_ARENA_MAX=1``
(every thread on the main arena): if the arena is the cause, the helper thread loses its advantage.

    python scripts/bench/arena.py --data bench_data --arena-max-1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import apply_single_thread_env, child_env, require_data  # noqa: E402


def measure(data: Path, chunk: int, chunks: int) -> dict:
    apply_single_thread_env()
    from tokenizers import Tokenizer

    import _pipelines

    texts = _pipelines.load_texts(data, min_chars=chunk * chunks * 1200)
    batches = [texts[i:i + chunk] for i in range(0, len(texts) - chunk + 1, chunk)][:chunks]
    on_main = Tokenizer.from_file(str(data / "tokenizer.json"))
    on_helper = Tokenizer.from_file(str(data / "tokenizer.json"))
    helper = ThreadPoolExecutor(1)

    def timed(tok, texts: list[str]) -> tuple[float, int]:
        t = time.thread_time()
        n = sum(len(e.ids) for e in tok.encode_batch_fast(texts, add_special_tokens=False))
        return time.thread_time() - t, n

    for b in batches[:4]:  # warm both tokenizers' caches alike
        timed(on_main, b)
        helper.submit(timed, on_helper, b).result()
    main_rate, helper_rate, ratios = [], [], []
    for i, b in enumerate(batches):
        if i % 2:
            m = timed(on_main, b)
            h = helper.submit(timed, on_helper, b).result()
        else:
            h = helper.submit(timed, on_helper, b).result()
            m = timed(on_main, b)
        if m[0] > 0 and h[0] > 0:
            main_rate.append(m[1] / m[0])
            helper_rate.append(h[1] / h[0])
            ratios.append(helper_rate[-1] / main_rate[-1])
    helper.shutdown()
    q = statistics.quantiles(ratios, n=4)
    return {"chunks": len(ratios), "main_ktok_per_cpu_s": statistics.median(main_rate) / 1e3,
            "helper_ktok_per_cpu_s": statistics.median(helper_rate) / 1e3,
            "helper_over_main_median": statistics.median(ratios), "helper_over_main_iqr": [q[0], q[2]],
            "helper_faster_in": sum(r > 1 for r in ratios), "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX")}


def show(label: str, r: dict) -> None:
    print(f"{label:<34} main {r['main_ktok_per_cpu_s']:6.0f}k tok/cpu-s   helper {r['helper_ktok_per_cpu_s']:6.0f}k   "
          f"helper/main per chunk: median {r['helper_over_main_median']:.3f} (IQR {r['helper_over_main_iqr'][0]:.3f}-"
          f"{r['helper_over_main_iqr'][1]:.3f}), helper faster in {r['helper_faster_in']}/{r['chunks']} chunks")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="bench_data")
    ap.add_argument("--chunk", type=int, default=64, help="documents per call (Zephon's read.chunk_rows)")
    ap.add_argument("--chunks", type=int, default=300, help="calls per side")
    ap.add_argument("--arena-max-1", action="store_true", help="also run with MALLOC_ARENA_MAX=1")
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    data = Path(args.data).resolve()
    require_data(data)
    result = measure(data, args.chunk, args.chunks)
    if args._child:
        print(json.dumps(result))
        return 0
    show("default malloc", result)
    if args.arena_max_1:
        out = subprocess.run([sys.executable, __file__, "--data", str(data), "--chunk", str(args.chunk),
                              "--chunks", str(args.chunks), "--_child"], capture_output=True, text=True,
                             env=child_env({"MALLOC_ARENA_MAX": "1"}), check=True)
        show("MALLOC_ARENA_MAX=1 (one arena)", json.loads(out.stdout.strip().splitlines()[-1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

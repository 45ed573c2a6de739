"""Which Megatron numbers fit a recipe: ``python -m zephon_megatron.plan RECIPE --gpus 16 --tp 2``.

Prints the data-parallel size, the rows each data-parallel rank gets per step, the micro-batch
sizes that work and the Megatron options to pass; exits non-zero (with the reason) when the
layout does not fit. Needs neither Megatron nor a GPU.
"""

from __future__ import annotations

import argparse
import sys

import zephon

from .layout import Layout, ZephonMegatronError, check_fit


def plan(recipe: zephon.Recipe, gpus: int, tp: int = 1, pp: int = 1, cp: int = 1,
         micro_batch_size: int | None = None) -> dict:
    """The fitting Megatron numbers for ``recipe`` on ``gpus`` GPUs (raises ZephonMegatronError)."""
    model = tp * pp * cp
    if gpus % model:
        raise ZephonMegatronError(f"{gpus} GPUs are not a multiple of tensor x pipeline x context parallel = "
                                  f"{tp} x {pp} x {cp} = {model}.")
    dp = gpus // model
    G = recipe.lanes * recipe.batch_per_lane
    rows = G // dp if recipe.lanes % dp == 0 else None
    mbs = micro_batch_size or 1
    nmb = rows // mbs if rows and rows % mbs == 0 else 0
    check_fit(recipe, Layout(dp_rank=0, dp_size=dp, micro_batch_size=mbs, num_microbatches=nmb),
              seq_length=recipe.seq_len, global_batch_size=G, option=getattr(recipe, "origin", "RECIPE"))
    assert rows is not None
    return {
        "data_parallel_size": dp, "lanes_per_rank": recipe.lanes // dp, "rows_per_rank": rows,
        "micro_batch_sizes": [d for d in range(1, rows + 1) if rows % d == 0],
        "micro_batch_size": mbs, "num_microbatches": rows // mbs,
        "megatron_args": (f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} "
                          f"--context-parallel-size {cp} --seq-length {recipe.seq_len} "
                          f"--global-batch-size {G} --micro-batch-size {mbs} --dataloader-type external"),
        "data_parallel_sizes": [d for d in range(1, recipe.lanes + 1) if recipe.lanes % d == 0],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zephon_megatron.plan", description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--micro-batch-size", type=int, default=None)
    a = ap.parse_args(argv)
    recipe = zephon.load_recipe(a.recipe)
    try:
        p = plan(recipe, a.gpus, a.tp, a.pp, a.cp, a.micro_batch_size)
    except ZephonMegatronError as e:
        print(f"does not fit: {e}", file=sys.stderr)
        return 2
    print(f"recipe: lanes={recipe.lanes} batch_per_lane={recipe.batch_per_lane} seq_len={recipe.seq_len} "
          f"(global batch {recipe.lanes * recipe.batch_per_lane} rows)")
    print(f"data-parallel size {p['data_parallel_size']}: {p['lanes_per_rank']} lanes, {p['rows_per_rank']} rows "
          f"per rank per step = {p['num_microbatches']} micro-batches of {p['micro_batch_size']}")
    print(f"micro-batch sizes that fit: {p['micro_batch_sizes']}")
    print(f"data-parallel sizes this recipe can resume on: {p['data_parallel_sizes']}")
    print(f"Megatron options: {p['megatron_args']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

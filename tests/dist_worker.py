"""Run by ``torchrun --nproc_per_node=N`` from test_distributed.py: real processes, gloo.

Each rank builds its loader with rank/world size taken from the process group, iterates, gathers the
rank batches to rank 0 (which hashes the global batch) and, at ``--checkpoint-at``, gathers the
lane-keyed state with ``gather_state_dict``. Rank 0 writes hashes and state as JSON.
"""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist

import zephon


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe-json", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--checkpoint-at", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    recipe = zephon.recipe_from_dict(json.load(open(args.recipe_json)))
    loader = zephon.build_loader(recipe, num_workers=1)  # rank and world size from the process group
    hashes, state = [], None
    for step in range(args.steps):
        batch = next(loader)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {k: v for k, v in batch.items() if k != "cu_seqlens"})
        hashes.append(zephon.global_digest(gathered))
        if step + 1 == args.checkpoint_at:
            state = loader.gather_state_dict()
    if dist.get_rank() == 0:
        json.dump({"world_size": dist.get_world_size(), "lanes": list(loader.lanes), "hashes": hashes,
                   "state": state}, open(args.out, "w"))
    loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

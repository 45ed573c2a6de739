"""Run by ``torchrun --nproc_per_node=2`` from test_megatron.py: the Zephon provider under a real
megatron-core ``parallel_state`` (gloo, CPU) and Megatron's real micro-batch calculator.

Phases run one after the other in the same two processes, re-initialising the model-parallel
groups each time (as separate launches would, minus the start-up cost):

  A  TP=1 -> DP=2   fresh; saves the data state at iteration 3 (via the save_checkpoint hook)
  B  TP=2 -> DP=1   resumes iteration 3 (saved at DP=2); saves at iteration 5
  C  TP=1 -> DP=2   resumes iteration 5 (saved at DP=1)
  D  PP=2 -> DP=1   fresh; both the first and the last pipeline stage read data

Each rank pulls micro-batches through megatron-core's ``RerunDataIterator`` as Megatron's training
loop does (``get_num_microbatches()`` per iteration); rank 0 gathers them and writes, per phase,
which ranks got iterators, the batch schema and the global batch of every iteration (tensor-parallel
rank 0, first stage, micro-batches concatenated in order, then data-parallel ranks in order).

Megatron-LM's own ``get_args()`` namespace is not part of megatron-core: the options the provider
reads are given here as a plain namespace with the same attribute names.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", required=True, help="JSON list of phase dicts")
    a = ap.parse_args()

    dist.init_process_group("gloo")
    import zephon_megatron
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.core import parallel_state as mpu
    from megatron.core.rerun_state_machine import RerunDataIterator, RerunMode, initialize_rerun_state_machine

    import zephon

    initialize_rerun_state_machine(mode=RerunMode.DISABLED)
    recipe = zephon.load_recipe(a.recipe)
    gbs = recipe.lanes * recipe.batch_per_lane
    rank = dist.get_rank()
    saved_calls = []

    def megatron_save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                                 checkpointing_context=None, non_persistent_ckpt=False, **kw):
        saved_calls.append(iteration)  # stands in for Megatron's model/optimizer save

    save_checkpoint = zephon_megatron.wrap_save_checkpoint(megatron_save_checkpoint)
    results = []
    for ph in json.loads(a.phases):
        mpu.initialize_model_parallel(tensor_model_parallel_size=ph.get("tp", 1),
                                      pipeline_model_parallel_size=ph.get("pp", 1))
        dp = mpu.get_data_parallel_world_size()
        nmc.init_num_microbatches_calculator(rank, None, gbs, ph["mbs"], dp)
        args = SimpleNamespace(
            zephon_recipe=a.recipe, zephon_valid_recipe=None, zephon_num_workers=1, zephon_runner="thread",
            zephon_prefetch=None, zephon_cu_seqlens=ph.get("cu_seqlens", False), zephon_ignore_data_state=False,
            dataloader_type="external", micro_batch_size=ph["mbs"], global_batch_size=gbs,
            seq_length=recipe.seq_len, rampup_batch_size=None, eval_iters=0,
            create_attention_mask_in_dataloader=ph.get("attention_mask", False),
            reset_attention_mask=ph.get("attention_mask", False), reset_position_ids=ph.get("reset_position_ids", True),
            iteration=ph["start"], load=a.ckpt if ph["start"] else None, save=a.ckpt,
            non_persistent_ckpt_type=None, non_persistent_global_ckpt_dir=None)
        provider = zephon_megatron.make_datasets_provider(lambda args=args: args)
        train, valid, test = provider([gbs * ph["stop"], 0, 0])
        data_iterator = RerunDataIterator(train) if train is not None else None
        iterations = []
        for it in range(ph["start"], ph["stop"]):
            if data_iterator is not None:
                iterations.append([next(data_iterator) for _ in range(nmc.get_num_microbatches())])
            if it + 1 in ph.get("save_at", []):
                save_checkpoint(iteration=it + 1, model=None, optimizer=None, opt_param_scheduler=None,
                                num_floating_point_operations_so_far=0, checkpointing_context={})
        mine = {"rank": rank, "dp_rank": mpu.get_data_parallel_rank(), "dp_size": dp,
                "tp_rank": mpu.get_tensor_model_parallel_rank(), "pp_rank": mpu.get_pipeline_model_parallel_rank(),
                "has_iterator": train is not None, "valid": valid is not None, "test": test is not None,
                "num_microbatches": nmc.get_num_microbatches(), "iterations": iterations}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            readers = sorted((g for g in gathered if g["has_iterator"] and g["pp_rank"] == 0),
                             key=lambda g: g["dp_rank"])
            global_batches = []
            for i in range(ph["stop"] - ph["start"]):
                keys = readers[0]["iterations"][i][0].keys()
                global_batches.append({k: torch.cat([mb[k] for g in readers for mb in g["iterations"][i]])
                                       for k in keys if k != "cu_seqlens"})
            first = readers[0]["iterations"][0][0]
            lasts = [g for g in gathered if g["has_iterator"] and g["pp_rank"] != 0]
            results.append({
                "name": ph["name"],
                "ranks": [{k: v for k, v in g.items() if k != "iterations"} for g in gathered],
                "schema": {k: [str(v.dtype), list(v.shape)] for k, v in first.items()},
                "first_micro_batch": first,
                "global": global_batches,
                "last_stage_equal": [all(torch.equal(x[k], y[k])
                                         for xs, ys in zip(g["iterations"], readers[0]["iterations"])
                                         for x, y in zip(xs, ys) for k in x) for g in lasts],
            })
        zephon_megatron.reset()
        nmc.destroy_num_microbatches_calculator()
        mpu.destroy_model_parallel()
    if rank == 0:
        files = sorted(os.path.relpath(os.path.join(d, f), a.ckpt) for d, _, fs in os.walk(a.ckpt) for f in fs)
        import megatron.core

        torch.save({"phases": results, "files": files, "save_calls": saved_calls,
                    "megatron_core": megatron.core.__version__}, a.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

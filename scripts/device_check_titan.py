"""Torchtitan's own trainer (``torchtitan.train``) on CUDA, as scripts/device_check.py launches it.

    torchrun --nproc_per_node=N scripts/device_check_titan.py --module zephon_torchtitan --config llama3_debug ...

Nothing is changed but what this torch or this machine lacks (the CPU launcher, with its device and
attention shims, is plugins/torchtitan/testing/cpu_train.py):

1. ``torch.distributed.set_timeout``, which the trainer calls after its first step, is missing from torch
   releases up to at least 2.13 (the CPU launcher's shim 2): defined over ``_set_pg_timeout`` when absent.
2. ``ZEPHON_DC_BACKEND=gloo``: data-parallel ranks that share one GPU (NCCL refuses two ranks on one
   device). Torchtitan takes the backend from ``Backend.default_device_backend_map["cuda"]``; gloo takes no
   ``device_ids`` in ``barrier`` (the CPU launcher's shim 2b).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d

if not hasattr(dist, "set_timeout"):
    def _set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
        distributed_c10d._set_pg_timeout(timeout, group)

    dist.set_timeout = _set_timeout

if os.environ.get("ZEPHON_DC_BACKEND") == "gloo":
    dist.Backend.default_device_backend_map["cuda"] = "gloo"
    _barrier = dist.barrier

    def _gloo_barrier(group=None, async_op=False, device_ids=None):
        return _barrier(group=group, async_op=async_op)

    dist.barrier = _gloo_barrier

if __name__ == "__main__":
    from torchtitan.train import main

    sys.exit(main())

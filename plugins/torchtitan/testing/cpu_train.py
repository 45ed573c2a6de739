"""Test tooling: run ``torchtitan.train`` on a CPU-only machine (gloo). Not part of the plugin.

    torchrun --nproc_per_node=2 plugins/torchtitan/testing/cpu_train.py --module zephon_torchtitan ...

Torchtitan 0.3 targets GPUs; these shims let the real trainer run on CPU for CI. Each is the smallest
change that works, applied before Torchtitan is imported. (``triton`` must also be *installed*:
``torchtitan.trainer`` imports it unconditionally; nothing here touches it.)
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

# 1. Device type. torchtitan.tools.utils picks the device at import time from
#    torch._utils._get_available_device_type() and falls back to "cuda" when it returns None (CPU).
torch._utils._get_available_device_type = lambda: "cpu"

# 1b. torch.cpu lacks the memory-statistics API that Torchtitan's DeviceMemoryMonitor calls on its
#     device module: report zeros (no GPU memory to monitor).
for _name, _stub in {
    "get_device_name": lambda device=None: "cpu",
    "get_device_properties": lambda device=None: type("CPUProps", (), {"total_memory": 1 << 40})(),
    "reset_peak_memory_stats": lambda device=None: None,
    "empty_cache": lambda: None,
    "memory_stats": lambda device=None: {},
}.items():
    if not hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, _stub)

# 2. Timeout helper. Torchtitan calls torch.distributed.set_timeout(timeout, group) after the first
#    step; torch 2.13 has it only as the private distributed_c10d._set_pg_timeout.
if not hasattr(dist, "set_timeout"):
    def _set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
        distributed_c10d._set_pg_timeout(timeout, group)

    dist.set_timeout = _set_timeout

# 2b. The same helper first calls barrier(device_ids=[current_device()]); gloo rejects device_ids.
_barrier = dist.barrier


def _cpu_barrier(group=None, async_op=False, device_ids=None):
    return _barrier(group=group, async_op=async_op)


dist.barrier = _cpu_barrier

# 3. Attention. The Llama 3 configs use FlexAttention, which Torchtitan runs through torch.compile
#    (Triton/GPU kernels). Use SDPA instead: causal over the whole row (no block-causal document mask,
#    SDPA takes none); positions still drive RoPE. Data and checkpoints are unaffected.
import torchtitan.models.llama3 as _llama3  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402

_llama3.get_attention_config = lambda backend, **kwargs: ScaledDotProductAttention.Config()

# 4. Exact losses for the tests (the console prints 5 decimals): ZEPHON_TT_LOSS_LOG=path appends
#    {"step", "loss"} per logged step, and {"step", "validation_loss"} per evaluation, from rank 0.
_loss_log = os.environ.get("ZEPHON_TT_LOSS_LOG")
if _loss_log:
    from torchtitan.components.metrics import MetricsProcessor

    def _append(record: dict) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            with open(_loss_log, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    _log, _log_validation = MetricsProcessor.log, MetricsProcessor.log_validation

    def _log_with_file(self, step, global_avg_loss, *args, **kwargs):
        _append({"step": int(step), "loss": float(global_avg_loss)})
        return _log(self, step, global_avg_loss, *args, **kwargs)

    def _log_validation_with_file(self, loss, step, *args, **kwargs):
        _append({"step": int(step), "validation_loss": float(loss)})
        return _log_validation(self, loss, step, *args, **kwargs)

    MetricsProcessor.log = _log_with_file
    MetricsProcessor.log_validation = _log_validation_with_file


if __name__ == "__main__":
    from torchtitan.train import main

    sys.exit(main())

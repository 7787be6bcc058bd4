"""Processes and devices: one process (plain python) or torchrun's many, DDP or FSDP."""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from eagle3_train.common.errors import PipelineError


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        """What hidden states are read in: bf16 on CUDA, fp32 on CPU."""
        return torch.bfloat16 if self.cuda else torch.float32

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.cuda else contextlib.nullcontext()

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            t = t.clone()
            torch.distributed.all_reduce(t)
        return t

    def close(self) -> None:
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def setup_dist(device: str) -> Dist:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK (multi-node included); plain python = 1 process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise PipelineError("--device cuda was asked for, but no CUDA device is available")
    dev = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    d = Dist(rank, world, local, dev)
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if use_cuda else "gloo",
                                             timeout=_dt.timedelta(minutes=30))
    return d


def wrap(objective: nn.Module, distributed: str, d: Dist) -> nn.Module:
    """The objective as the processes share it: itself (one process), DDP, or FSDP-sharded."""
    if d.world == 1:
        return objective
    if distributed == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(d.device.type, (d.world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if d.cuda else MixedPrecisionPolicy()
        for layer in objective.draft.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(objective, mesh=mesh, mp_policy=mp)
        return objective
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(objective, device_ids=[d.local_rank] if d.cuda else None,
                                   broadcast_buffers=False)

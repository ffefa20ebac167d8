"""Data-parallel training of the draft (04 under torchrun): the process group from torchrun's
environment, sums and maxima over ranks, DDP, and the optimizer with optional ZeRO-1 state sharding.

A run without torchrun is world size 1 and every helper here is then a plain pass-through, so the
single-process trainer and the data-parallel one share one code path. CPU runs use the gloo backend
(tests), CUDA runs NCCL with one GPU per process (LOCAL_RANK).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# AdamW with fp32 master weights holds 16 bytes per trainable parameter (weight, gradient, two
# moments); ZeRO-1 ("auto") shards the 8 bytes of moments when the 16 would take more than this
# share of one GPU (Kimi's ~0.96 B-parameter draft: 15 GB).
SHARD_WHEN_STATE_SHARE = 0.15


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        """Rank 0: the one process that writes checkpoints, logs, exports and the manifest."""
        return self.rank == 0


def setup(device_arg: str | None) -> Ranks:
    """The process group when torchrun started us (WORLD_SIZE > 1), else a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = (device_arg or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if world == 1:
        return Ranks(device=torch.device(device_arg or ("cuda" if cuda else "cpu")))
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        device = _cuda_device(local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return Ranks(rank=rank, world=world, device=device)


def _cuda_device(local_rank: int) -> torch.device:
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def teardown(ranks: Ranks) -> None:
    if ranks.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def _all_reduce(x, op, ranks: Ranks):
    """x reduced over ranks with `op` (a new tensor; x itself when there is one rank)."""
    if ranks.world == 1:
        return x
    x = x.clone()
    dist.all_reduce(x, op=op)
    return x


def all_sum(x, ranks: Ranks):
    return _all_reduce(x, dist.ReduceOp.SUM, ranks)


def all_max(x, ranks: Ranks):
    return _all_reduce(x, dist.ReduceOp.MAX, ranks)


def broadcast_flag(value: bool, ranks: Ranks) -> bool:
    """Rank 0's decision, on every rank."""
    if ranks.world == 1:
        return value
    t = torch.tensor([int(value)], device=ranks.device)
    dist.broadcast(t, src=0)
    return bool(t.item())


def barrier(ranks: Ranks) -> None:
    if ranks.world > 1:
        dist.barrier()


def wrap_model(model, ranks: Ranks):
    """DDP over the ranks (gradients averaged in buckets during the backward), or the model itself."""
    if ranks.world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel
    ids = [ranks.device.index] if ranks.device.type == "cuda" else None
    # broadcast_buffers off: the only buffers (d2t, t2d) are constant, and an eval on some ranks only
    # must not wait for a buffer broadcast on the others
    return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False, gradient_as_bucket_view=True)


def unwrap(model):
    return getattr(model, "module", model)


def shard_optimizer_wanted(choice: str, params, ranks: Ranks) -> bool:
    """--shard-optimizer: on/off, or auto (several ranks on CUDA and the AdamW state is big)."""
    if choice != "auto":
        return choice == "on" and ranks.world > 1
    if ranks.world == 1 or ranks.device.type != "cuda":
        return False
    state_bytes = 16 * sum(p.numel() for p in params)
    return state_bytes > SHARD_WHEN_STATE_SHARE * _cuda_memory(ranks.device)


def _cuda_memory(device) -> int:
    return torch.cuda.get_device_properties(device).total_memory


def make_optimizer(params, lr: float, betas, shard: bool, ranks: Ranks):
    """AdamW (no weight decay); with `shard`, ZeRO-1: each rank keeps the moments of ~1/world of the
    parameters, steps them and broadcasts the result (the gradients stay DDP-averaged)."""
    kwargs = {"lr": lr, "betas": tuple(betas), "weight_decay": 0.0}
    if not shard:
        return torch.optim.AdamW(params, **kwargs)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **kwargs)


def optimizer_state(opt, ranks: Ranks) -> dict | None:
    """The full optimizer state on rank 0 (None elsewhere); collective for a sharded optimizer, so
    every rank calls it. The saved format is the plain AdamW one (global parameter indices)."""
    if hasattr(opt, "consolidate_state_dict"):
        opt.consolidate_state_dict(to=0)
    return opt.state_dict() if ranks.main else None

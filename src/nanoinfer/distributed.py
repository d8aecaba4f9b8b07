"""Tensor-parallel state: this process's rank and the group size (1 when not distributed).

Layers read rank and size when they are built and decide themselves whether to communicate, so a
single-process model and a sharded one can live in the same process. The collectives run over the default
process group (set up by engine/tp_executor.py and engine/tp_worker.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1


def set_tensor_parallel(rank: int, size: int) -> None:
    global _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = rank, size


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks in place (no-op without a process group)."""
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def all_gather_last_dim(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dimension (vocab-parallel logits)."""
    if not dist.is_initialized():
        return tensor
    shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, tensor.contiguous())
    return torch.cat(shards, dim=-1)

"""torch.distributed helpers: who is the main process, and how many are there."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["get_rank", "get_world_size", "is_main_process"]


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main_process() -> bool:
    """True on rank 0, and in a run that is not distributed."""
    return get_rank() == 0

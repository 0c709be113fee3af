"""Where this process stands in the default process group; imports nothing else of :mod:`lora_lab.distributed`."""
from __future__ import annotations

import torch.distributed as dist

__all__ = ["rank_and_world"]


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1

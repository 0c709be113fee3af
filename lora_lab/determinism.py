"""Seeds and switches for experiments that must be exact (parity, merge numerics)."""
from __future__ import annotations

import os
import random

import torch

__all__ = ["seed_everything", "deterministic"]


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and every CUDA device) generators."""
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass
    torch.manual_seed(seed)  # also seeds every CUDA device


def deterministic(seed: int = 0) -> dict:
    """Seed everything, turn TF32 off and ask for deterministic algorithms where torch has them.

    Returns the settings applied, so a notebook can print or record them.
    """
    seed_everything(seed)
    # cuBLAS needs a fixed workspace for deterministic GEMMs; it must be set before its first use.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True, warn_only=True)
    return {
        "seed": seed,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }

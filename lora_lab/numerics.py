"""How close two tensors are: the error measures every check in the package and the notebooks uses (one copy).

All are computed in fp64 on the tensors' values; 0.0 from :func:`max_abs_diff` means bit-identical for
finite inputs of the same dtype.
"""
from __future__ import annotations

import torch

__all__ = ["max_abs_diff", "rel_l2", "cosine", "error_stats"]


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| (0.0 for empty tensors); the shapes must match."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    return float((a.detach().double() - b.detach().double()).abs().max())


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    """‖got - ref‖ / ‖ref‖ (the plain difference norm when ``ref`` is zero)."""
    got, ref = got.detach().double(), ref.detach().double()
    norm = ref.norm()
    diff = (got - ref).norm()
    return float(diff / norm) if norm > 0 else float(diff)


def cosine(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors (1.0 when both are zero)."""
    got, ref = got.detach().double().flatten(), ref.detach().double().flatten()
    if ref.norm() == 0 and got.norm() == 0:
        return 1.0
    return float(torch.nn.functional.cosine_similarity(got, ref, dim=0))


def error_stats(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """``{"max_abs", "rel_l2", "cosine"}`` of ``got`` against ``ref``."""
    return {"max_abs": max_abs_diff(got.reshape(-1), ref.reshape(-1)), "rel_l2": rel_l2(got, ref),
            "cosine": cosine(got, ref)}

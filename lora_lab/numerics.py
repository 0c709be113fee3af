"""How close two tensors are: the error measures every check in the package and the notebooks uses (one copy).

All are computed in fp64 on the tensors' values; 0.0 from :func:`max_abs_diff` means bit-identical for
finite inputs of the same dtype. They read the tensors in slices of :data:`CHUNK` elements, upcast one slice at a
time, so measuring a tensor costs a few slices of fp64 on its device, not three fp64 copies of it (a 400M-element
expert gradient would take 9 GiB more, and a 24 GB card has none to spare).
"""
from __future__ import annotations

import math

import torch

__all__ = ["max_abs_diff", "rel_l2", "cosine", "error_stats", "CHUNK"]

CHUNK = 1 << 24  # elements per slice: 128 MiB in fp64


def _flat_pair(got: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if got.numel() != ref.numel():
        raise ValueError(f"sizes differ: {tuple(got.shape)} vs {tuple(ref.shape)}")
    return got.detach().reshape(-1), ref.detach().reshape(-1)


def _sums(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """max |got - ref|, Σ(got - ref)², Σref², Σgot², Σgot·ref, in fp64, one slice at a time."""
    got, ref = _flat_pair(got, ref)
    zero = torch.zeros((), dtype=torch.float64, device=got.device)
    acc = {name: zero.clone() for name in ("max_abs", "diff_sq", "ref_sq", "got_sq", "dot")}
    for start in range(0, got.numel(), CHUNK):
        g = got[start:start + CHUNK].double()
        r = ref[start:start + CHUNK].double().to(g.device)
        d = g - r
        acc["max_abs"] = torch.maximum(acc["max_abs"], d.abs().max())
        acc["diff_sq"] += d.square().sum()
        acc["ref_sq"] += r.square().sum()
        acc["got_sq"] += g.square().sum()
        acc["dot"] += (g * r).sum()
        del g, r, d
    return {name: float(value) for name, value in acc.items()}


def _rel_l2(sums: dict[str, float]) -> float:
    diff, norm = math.sqrt(sums["diff_sq"]), math.sqrt(sums["ref_sq"])
    return diff / norm if norm > 0 else diff


def _cosine(sums: dict[str, float], eps: float = 1e-8) -> float:
    if sums["ref_sq"] == 0 and sums["got_sq"] == 0:
        return 1.0
    return sums["dot"] / (max(math.sqrt(sums["got_sq"]), eps) * max(math.sqrt(sums["ref_sq"]), eps))


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| (0.0 for empty tensors); the shapes must match."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return _sums(a, b)["max_abs"]


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    """‖got - ref‖ / ‖ref‖ (the plain difference norm when ``ref`` is zero)."""
    return _rel_l2(_sums(got, ref))


def cosine(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Cosine similarity of the flattened tensors (1.0 when both are zero)."""
    return _cosine(_sums(got, ref))


def error_stats(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """``{"max_abs", "rel_l2", "cosine"}`` of ``got`` against ``ref``, from one pass over both."""
    sums = _sums(got, ref)
    return {"max_abs": sums["max_abs"], "rel_l2": _rel_l2(sums), "cosine": _cosine(sums)}

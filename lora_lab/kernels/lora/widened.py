"""The LoRA linear with its rank-r terms as r more columns of cuBLAS's reduction (``KernelConfig(base_gemm="wide")``).

The layer's two big products, each with its rank-r term folded into the reduction (s = scaling)::

    Y  = [X | P] · [W | B]ᵀ + b        P = s · X Aᵀ        (reduction over K + r)
    dX = [dY | Q] · [W ; A]            Q = s · dY B        (reduction over N + r)

so each is one cuBLAS GEMM with nothing to add afterwards. The price is building the widened operands. On the
activation side, ``[X | P]`` (M×(K + r)) is written by the Triton pass that computes P: it reads X once, as P needs
anyway, and writes it back beside P (``rank_projection(copy_to=...)``); the backward's ``[dY | Q]`` likewise comes
from the pass that computes Q and dB (``q_and_db(copy_to=...)``). Per step that is one M×K and one M×N write, where
the β = 1 route (``base_gemm="cublas"``) writes the rank-r term into Y and dX and reads it back inside the GEMM (two
M×N and two M×K passes). On the weight side, ``[W | B]`` and ``[W ; A]`` are built per call (W is N×K, small
beside the activations at many tokens) and never kept, so the frozen weight's memory is not doubled.

The widened X is what backward keeps: X and P are its two column blocks, so nothing more is saved than the Triton
route saves. A rank that is not a multiple of 8 is padded with zero columns (in the widened buffers and in B and
Aᵀ), so that every widened row stays 16-byte aligned for cuBLAS; the zeros add nothing to any product.

Measured on an H100 it is slower than the shipped op. In the route's component table cuBLAS ran the forward GEMM
over K + 16 about a tenth slower than over K, and the copying passes, which run unpipelined
(``tuning._prune_configs``), took about twice a read-only pass (docs/changelog.md). Timed alone
(``tools/wide_gemm_probe.py``), 16 more reduction columns cost cuBLAS about 2%, packed rows or not, so the depth
and the row alignment do not explain that tenth. It stays an option, off by default.
"""
from __future__ import annotations

import torch

from lora_lab.kernels.lora.dispatch import warn_route_fallback
from lora_lab.kernels.lora.rank_ops import q_and_db, rank_projection

__all__ = ["forward", "backward", "padded_rank", "warn_fallback"]

_WARNED: set = set()


def warn_fallback(reason: str) -> None:
    """One RuntimeWarning per distinct reason: the op asked for the widened route and runs the Triton route."""
    warn_route_fallback(_WARNED, "wide", reason)


def padded_rank(rank: int) -> int:
    """The rank rounded up to a multiple of 8 (a bf16 row of K + r elements then stays 16-byte aligned)."""
    return -(-rank // 8) * 8


def _widened(t: torch.Tensor, rank: int, rp: int) -> torch.Tensor:
    """M×(D + rp) buffer for ``t`` (M×D) and a rank-r block; the padding columns beyond the rank are zeroed."""
    M, D = t.shape
    out = torch.empty((M, D + rp), device=t.device, dtype=t.dtype)
    if rp > rank:
        out[:, D + rank:].zero_()
    return out


def _with_zero_cols(t: torch.Tensor, cols: int) -> torch.Tensor:
    """``t`` (R×C) with zero columns appended up to ``cols`` (``t`` itself when it has them)."""
    if t.shape[1] == cols:
        return t
    return torch.cat([t, t.new_zeros((t.shape[0], cols - t.shape[1]))], dim=1)


def forward(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
            scaling: float, tune: bool = True):
    """(Y, X, P): Y = X Wᵀ + b + P Bᵀ with P = s · X Aᵀ; X and P returned as views of the widened ``[X | P]``."""
    M, K = x2.shape
    rank = a.shape[0]
    rp = padded_rank(rank)
    xw = _widened(x2, rank, rp)
    rank_projection(x2, a.t(), scaling, out=xw[:, K:K + rank], copy_to=xw[:, :K], tune=tune)
    w_wide = torch.cat([weight, _with_zero_cols(b, rp)], dim=1)  # [W | B], N×(K + rp)
    y = torch.addmm(bias, xw, w_wide.t()) if bias is not None else torch.mm(xw, w_wide.t())
    return y, xw[:, :K], xw[:, K:K + rank]


def backward(dy2: torch.Tensor, p: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             scaling: float, need_b: bool, tune: bool = True):
    """(dX, Q, dBᵀ) for the forward above: dX = dY W + Q A from one GEMM, Q = s · dY B (a view of ``[dY | Q]``)
    and the fp32 dBᵀ = Pᵀ dY (None unless ``need_b``); dA = Qᵀ X is left to the caller."""
    M, N = dy2.shape
    rank = a.shape[0]
    rp = padded_rank(rank)
    dyw = _widened(dy2, rank, rp)
    q_view, copy_view = dyw[:, N:N + rank], dyw[:, :N]
    dbt = None
    if need_b:
        _, dbt = q_and_db(dy2, b, p, scaling, tune=tune, q_out=q_view, copy_to=copy_view)
    else:
        rank_projection(dy2, b, scaling, out=q_view, copy_to=copy_view, tune=tune)
    w_tall = torch.cat([weight, _with_zero_cols(a.t(), rp).t()], dim=0)  # [W ; A], (N + rp)×K
    return torch.mm(dyw, w_tall), q_view, dbt

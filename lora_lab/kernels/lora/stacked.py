"""The merged route with its two rank-r projections as more output columns of the big GEMMs
(``KernelConfig(base_gemm="stacked")``).

The merged route (:mod:`.merged`) runs the frozen layer's GEMMs on ``W' = W + s·B A`` and still reads X once for
P = s·X Aᵀ in the forward and dY once for Q = s·dY B in the backward. Here both come out of the GEMMs that read
X and dY anyway: the merged weight gets r more rows (forward) or columns (backward)::

    [Y | P]  = X · [W' ; s·A]ᵀ + [b | 0]        (M×(N + r): Y and P are its two column blocks)
    [dX | Q] = dY · [W' | s·B]                  (M×(K + r))

so the step's passes over the activations beyond the frozen layer's GEMMs are the two token reductions alone,
dB = dYᵀ P and dA = Qᵀ X (``rank_ops`` picks their engine, as on every route). Why the extra columns can be nearly
free: a GEMM cuts its output into tiles, and where N is not a multiple of the tile's width (4096 and a 192-wide
tile) the last column of tiles is partly empty, so r more columns may fit in it. Whether cuBLAS keeps its tile and
its speed for N + r is what ``benchmarks/bench_lora_linear.py`` (``fused_stacked``) and
``benchmarks/profile_kernels.py`` measure.

What it costs: the stacked weights are built per call and never kept, as the merged route's W' (N×K, r rows or
columns more). With ``rank_ops="triton"`` one Triton pass over W writes each of them whole
(``rank_ops.stack_weight``: the merge, the scaled factor and the zero padding), so one launch stands between the
call and its GEMM. P is copied out of ``[Y | P]`` (M×r) so that backward does not keep Y alive; Y is returned as
the first N columns of ``[Y | P]`` (row stride N + r, a view) and dX as the first K columns of ``[dX | Q]``. The
rank is padded to a multiple of 8 with zero rows or columns, so that every row of the outputs stays 16-byte
aligned for cuBLAS.

Numerics: Y and dX are the merged route's (W' rounded once, then the output). P and Q come from a GEMM on s·A and
s·B rounded to the input's dtype, one rounding more than the passes' fp32 scaling (none when s is a power of
two). Dropout cannot be merged: with dropout the op warns and takes the Triton route.
"""
from __future__ import annotations

import torch

from lora_lab.kernels.lora.dispatch import warn_route_fallback
from lora_lab.kernels.lora.merged import MAX_TRITON_RANK, merged_weight
from lora_lab.kernels.lora.rank_ops import stack_weight
from lora_lab.kernels.lora.widened import padded_rank

__all__ = ["forward_gemm", "input_grad_gemm", "warn_fallback"]

_WARNED: set = set()


def warn_fallback(reason: str) -> None:
    """One RuntimeWarning per distinct reason: the op asked for the stacked route and runs the Triton route."""
    warn_route_fallback(_WARNED, "stacked", reason)


def _stacked(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, engine: str, side: str,
             rp: int) -> torch.Tensor:
    """``[W' ; s·A ; 0]`` ((N + rp)×K, ``side="rows"``) or ``[W' | s·B | 0]`` (N×(K + rp), ``"cols"``), W' = W + s·B A:
    one Triton pass that writes all of it (``engine="triton"``, ranks up to the merge's), else s times the factor,
    the zero padding and cuBLAS's merge written into their blocks apart."""
    N, K = weight.shape
    rank = a.shape[0]
    if engine == "triton" and rank <= MAX_TRITON_RANK:
        return stack_weight(weight, a, b, scaling, side, rp)
    rows = side == "rows"
    stack = torch.empty((N + rp, K) if rows else (N, K + rp), device=weight.device, dtype=weight.dtype)
    factor, pad = (stack[N:N + rank], stack[N + rank:]) if rows else (stack[:, K:K + rank], stack[:, K + rank:])
    torch.mul(a if rows else b, scaling, out=factor)  # s·A under W', or s·B beside it
    if rp > rank:
        pad.zero_()
    merged_weight(weight, a, b, scaling, engine, out=stack[:N] if rows else stack[:, :K])
    return stack


def forward_gemm(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor,
                 b: torch.Tensor, scaling: float, engine: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """(Y, P): ``[Y | P] = X · [W + s·B A ; s·A]ᵀ + [b | 0]`` in one merge and one GEMM; Y a view (row stride
    N + r padded), P = s·X Aᵀ a contiguous M×r copy."""
    N, K = weight.shape
    rank = a.shape[0]
    rp = padded_rank(rank)
    bias_ext = torch.nn.functional.pad(bias, (0, rp)) if bias is not None else None
    # the stack is the last launch before the GEMM that waits for it: the host then has little to do between them
    stack = _stacked(weight, a, b, scaling, engine, "rows", rp)
    yp = torch.addmm(bias_ext, x2, stack.t()) if bias_ext is not None else torch.mm(x2, stack.t())
    return yp[:, :N], yp[:, N:N + rank].contiguous()


def input_grad_gemm(dy2: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float,
                    engine: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """(dX, Q): ``[dX | Q] = dY · [W + s·B A | s·B]`` in one merge and one GEMM, both views of its output
    (dX = dY (W + s·B A), Q = s·dY B)."""
    N, K = weight.shape
    rank = a.shape[0]
    dxq = torch.mm(dy2, _stacked(weight, a, b, scaling, engine, "cols", padded_rank(rank)))
    return dxq[:, :K], dxq[:, K:K + rank]

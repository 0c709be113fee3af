"""The LoRA linear's big GEMMs on a weight merged per call (``KernelConfig(base_gemm="merged")``).

The layer's two big products both go through ``W + s·B A``::

    W' = W + s · B A                  (N×K, one call: cuBLAS's addmm or a Triton pass over W; one rounding)
    Y  = X W'ᵀ + b                    (one cuBLAS GEMM, the frozen layer's)
    dX = dY W'                        (one cuBLAS GEMM, the frozen layer's; W' built again, never kept)

so neither GEMM has a rank-r term to add: each is the frozen layer's own call on another N×K operand. What merging
costs is one pass over W per GEMM (read W, write W'), which does not grow with the tokens M. The adapter's
gradients still need the four rank-r products: P = s·X Aᵀ in the forward (saved, M×r), then Q = s·dY B,
dB = dYᵀ P and dA = Qᵀ X, computed as the other routes compute them (``rank_ops``, ``fuse_q_db``). So a step reads X
twice and dY once or twice beyond the frozen layer's GEMMs, and writes nothing of size M×N or M×K besides Y
and dX.

Numerics: W' is rounded to the weight's dtype before the GEMM reads it, so each output of a 16-bit layer is
rounded twice (W', then Y) where the Triton route rounds it once; that is the rounding count of the unfused layer
(PEFT's: the base output and the rank-r term rounded apart, then added), and the forward's relative error grows
about as much (``tests/kernels/lora/test_merged_route.py`` holds it to the unfused layer's). The gradients of A and
B come from the same P, Q and dY as on every other route. Dropout cannot be merged (its mask multiplies the rank-r
term alone): with dropout the op warns and takes the Triton route.

The merge is a rank-r product like P, Q, dA and dB, and ``rank_ops`` picks its engine alike: a Triton pass over W
(``triton``) or cuBLAS's ``addmm`` (``torch``).

Order: Y needs no P and dX no Q, so each big GEMM is launched first and the host prepares the rank-r passes while
it runs. Measured on an H100 it is the fastest of the ungraphed routes at 32k × 4096², r 16, and still about a
fifth above the frozen layer (docs/changelog.md). With ``overlap="on"`` the passes run on a side stream (P beside
Y's GEMM; Q, dB and dA beside dX's), so the GPU may run the memory-bound passes next to the compute-bound GEMM
instead of after it.
"""
from __future__ import annotations

import torch

from lora_lab.kernels.lora.dispatch import warn_route_fallback
from lora_lab.kernels.lora.rank_ops import merge_weight

__all__ = ["merged_weight", "forward_gemm", "input_grad_gemm", "unavailable_reason", "warn_fallback"]

_WARNED: set = set()
MAX_TRITON_RANK = 128  # the Triton merge holds a rank tile of B and of A whole; above this rank cuBLAS merges


def unavailable_reason(dropout_p: float) -> str | None:
    """Why the merged route cannot run this call (None: it can)."""
    return "dropout needs the Triton route (the mask multiplies the rank-r term alone)" if dropout_p else None


def warn_fallback(reason: str) -> None:
    """One RuntimeWarning per distinct reason: the op asked for the merged route and runs the Triton route."""
    warn_route_fallback(_WARNED, "merged", reason)


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float,
                  engine: str = "torch", out: torch.Tensor | None = None) -> torch.Tensor:
    """``W + s · B A`` (N×K) in the weight's dtype, B A accumulated with W in fp32 and rounded once: one cuBLAS call
    (``engine="torch"``, written into ``out`` if given), or one Triton pass over W (``"triton"``, ranks up to
    ``MAX_TRITON_RANK``: cuBLAS's GEMM with a depth-r reduction ran well below the memory's speed in the route's
    component table)."""
    if engine == "triton" and a.shape[0] <= MAX_TRITON_RANK:
        return merge_weight(weight, a, b, scaling, out=out)
    return torch.addmm(weight, b, a, beta=1.0, alpha=scaling, out=out)


def forward_gemm(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor,
                 b: torch.Tensor, scaling: float, engine: str = "torch") -> torch.Tensor:
    """``Y = X (W + s·B A)ᵀ + b`` as one merge and one GEMM."""
    wm = merged_weight(weight, a, b, scaling, engine)
    return torch.addmm(bias, x2, wm.t()) if bias is not None else torch.mm(x2, wm.t())


def input_grad_gemm(dy2: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    scaling: float, engine: str = "torch") -> torch.Tensor:
    """``dX = dY (W + s·B A)`` as one merge and one GEMM."""
    return torch.mm(dy2, merged_weight(weight, a, b, scaling, engine))

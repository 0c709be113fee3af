"""DoRA on the fused LoRA kernels, without the out x in matrix W + s·B·A.

DoRA's layer (PEFT's formulation, the norm detached) is

    y = g ⊙ (W x + s·B A x) + b,      g = m / n,      n_i = ‖W_i + s·(B A)_i‖  (row i, no gradient)

The unfused layer (PEFT's, and :class:`lora_lab.LoRALinear`'s) forms ``B A`` and ``W + s·B A`` ([out x in],
in fp32 for PEFT) in every forward just to take the row norms. Expanding the square gives the same norms from
rank-r quantities:

    n_i² = ‖W_i‖² + 2s·⟨B_i, (W Aᵀ)_i⟩ + s²·B_i (A Aᵀ) B_iᵀ

one GEMM ``W Aᵀ`` ([out x r], reading W once), an r x r Gram matrix and row sums. The rest is the fused LoRA
linear (:func:`~lora_lab.kernels.lora.linear.fused_lora_linear`) times ``g``; autograd gives ``dm`` from the saved
output and scales ``dy`` by ``g`` for the LoRA backward. Only the rounding differs from the unfused layer.
"""
from __future__ import annotations

import torch

from lora_lab.kernels.config import KernelConfig
from lora_lab.kernels.lora.linear import fused_lora_linear

__all__ = ["dora_row_norm", "fused_dora_linear"]


@torch.no_grad()
def dora_row_norm(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> torch.Tensor:
    """‖W + s·B A‖ of every output row (fp32, no gradient), without forming the [out x in] matrix."""
    w_sq = torch.linalg.vector_norm(weight, dim=1, dtype=torch.float32).square()
    a32, b32 = lora_A.float(), lora_B.float()
    # W Aᵀ in the weight's dtype (one pass over W), accumulated in fp32 by the GEMM
    wa = (weight @ lora_A.to(weight.dtype).t()).float()
    cross = (b32 * wa).sum(dim=1)  # ⟨W_i, (B A)_i⟩ = B_i · (W Aᵀ)_i
    ba_sq = ((b32 @ (a32 @ a32.t())) * b32).sum(dim=1)  # ‖(B A)_i‖² = B_i (A Aᵀ) B_iᵀ
    return (w_sq + (2.0 * scale) * cross + (scale * scale) * ba_sq).clamp_min(0.0).sqrt()


def fused_dora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_A: torch.Tensor,
                      lora_B: torch.Tensor, scale: float, magnitude: torch.Tensor,
                      config: KernelConfig | None = None) -> torch.Tensor:
    """DoRA's ``m / ‖W + sBA‖ ⊙ (W x + s·B A x) + b`` on the fused LoRA kernels (no dropout; x, W, A, B, m on one
    device). Gradients flow to x, A, B and m; the norm is a constant, as in DoRA's paper and PEFT."""
    if magnitude.shape != (weight.shape[0],):
        raise ValueError(f"magnitude must have one entry per output row ({weight.shape[0]}), got "
                         f"{tuple(magnitude.shape)}")
    norm = dora_row_norm(weight, lora_A, lora_B, scale)
    g = magnitude / norm.to(magnitude.dtype)
    y = fused_lora_linear(x, weight, None, lora_A, lora_B, scale, config=config)
    y = y * g.to(y.dtype)
    return y + bias if bias is not None else y

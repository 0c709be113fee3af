"""DoRA on the fused LoRA kernels, without the out x in matrix W + s·B·A.

DoRA's layer (PEFT's formulation, the norm detached) is

    y = g ⊙ (W x + s·B A x) + b,      g = m / n,      n_i = ‖W_i + s·(B A)_i‖  (row i, no gradient)

The unfused layer (PEFT's, and :class:`lora_lab.LoRALinear`'s) forms ``B A`` and ``W + s·B A`` ([out x in],
in fp32 for PEFT) in every forward just to take the row norms. Expanding the square gives the same norms from
rank-r quantities:

    n_i² = ‖W_i‖² + 2s·⟨B_i, (W Aᵀ)_i⟩ + s²·B_i (A Aᵀ) B_iᵀ

one GEMM ``W Aᵀ`` ([out x r], reading W once), an r x r Gram matrix and row sums, all in one Triton launch
(:func:`dora_row_norm`; written with torch ops, :func:`dora_row_norm_reference`, it is a dozen small kernels per
layer and step, which on a short step cost more than the arithmetic). The rest is the fused LoRA linear
(:func:`~lora_lab.kernels.lora.linear.fused_lora_linear`) times ``g`` plus the bias in one ``addcmul``; autograd
gives ``dm`` from the saved output and scales ``dy`` by ``g`` for the LoRA backward. Only the rounding differs
from the unfused layer.
"""
from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from lora_lab.kernels.config import KernelConfig
from lora_lab.kernels.lora.linear import fused_lora_linear
from lora_lab.kernels.triton_helpers import (
    cdiv,
    check_interpreter_dtype,
    check_kernel_device,
    dot_precision,
    rank_block,
    running_in_interpreter,
)

__all__ = ["dora_row_norm", "dora_row_norm_reference", "fused_dora_linear"]


@torch.no_grad()
def dora_row_norm_reference(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """‖W + s·B A‖ of every output row (fp32, no gradient) in plain torch, without the [out x in] matrix."""
    w_sq = torch.linalg.vector_norm(weight, dim=1, dtype=torch.float32).square()
    a32, b32 = lora_A.float(), lora_B.float()
    # W Aᵀ in the weight's dtype (one pass over W), accumulated in fp32 by the GEMM
    wa = (weight @ lora_A.to(weight.dtype).t()).float()
    cross = (b32 * wa).sum(dim=1)  # ⟨W_i, (B A)_i⟩ = B_i · (W Aᵀ)_i
    ba_sq = ((b32 @ (a32 @ a32.t())) * b32).sum(dim=1)  # ‖(B A)_i‖² = B_i (A Aᵀ) B_iᵀ
    return (w_sq + (2.0 * scale) * cross + (scale * scale) * ba_sq).clamp_min(0.0).sqrt()


# One program per block of output rows: a single pass over its rows of W gives ‖W_i‖² and (W Aᵀ)_i together, the
# program also forms A Aᵀ (r x r, the same in every program: r·r·in multiply-adds, small next to its W pass),
# then combines them with its rows of B. One launch instead of the dozen small ops of the reference.
@triton.jit
def _dora_row_norm_kernel(w_ptr, stride_wo, stride_wi, a_ptr, stride_ar, stride_ai, b_ptr, stride_bo, stride_br,
                          out_ptr, OUT, IN, R, scale, PRECISION: tl.constexpr, BLOCK_O: tl.constexpr,
                          BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
    ranks = tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_I)
    row_ok = rows < OUT
    rank_ok = ranks < R
    w_sq = tl.zeros((BLOCK_O,), dtype=tl.float32)
    wa = tl.zeros((BLOCK_O, BLOCK_R), dtype=tl.float32)
    aa = tl.zeros((BLOCK_R, BLOCK_R), dtype=tl.float32)
    for i0 in range(0, tl.cdiv(IN, BLOCK_I)):
        c = i0 * BLOCK_I + cols
        c_ok = c < IN
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wo + c[None, :] * stride_wi,
                    mask=row_ok[:, None] & c_ok[None, :], other=0.0)
        a = tl.load(a_ptr + ranks[:, None] * stride_ar + c[None, :] * stride_ai,
                    mask=rank_ok[:, None] & c_ok[None, :], other=0.0)
        wf = w.to(tl.float32)
        w_sq += tl.sum(wf * wf, axis=1)
        wa = tl.dot(w, tl.trans(a.to(w.dtype)), wa, input_precision=PRECISION)
        af = a.to(tl.float32)
        aa = tl.dot(af, tl.trans(af), aa, input_precision="ieee")
    b = tl.load(b_ptr + rows.to(tl.int64)[:, None] * stride_bo + ranks[None, :] * stride_br,
                mask=row_ok[:, None] & rank_ok[None, :], other=0.0).to(tl.float32)
    cross = tl.sum(b * wa, axis=1)
    ba_sq = tl.sum(tl.dot(b, aa, input_precision="ieee") * b, axis=1)
    n_sq = w_sq + (2.0 * scale) * cross + (scale * scale) * ba_sq
    tl.store(out_ptr + rows, tl.sqrt(tl.maximum(n_sq, 0.0)), mask=row_ok)


@torch.no_grad()
def dora_row_norm(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> torch.Tensor:
    """‖W + s·B A‖ of every output row (fp32, no gradient), without forming the [out x in] matrix: one Triton
    launch (:func:`dora_row_norm_reference` is the same in plain torch)."""
    out_f, in_f = weight.shape
    r = lora_A.shape[0]
    if lora_A.shape != (r, in_f) or lora_B.shape != (out_f, r):
        raise ValueError(f"dora_row_norm: W {tuple(weight.shape)}, A {tuple(lora_A.shape)} and B "
                         f"{tuple(lora_B.shape)} do not fit (W [out, in], A [r, in], B [out, r])")
    check_kernel_device(weight, "the DoRA weight")
    check_interpreter_dtype(weight, op="dora_row_norm")  # A is read in W's dtype, B in fp32
    out = torch.empty(out_f, dtype=torch.float32, device=weight.device)
    if out_f == 0:
        return out
    if _KERNEL_FAILED:  # a Triton build where the kernel does not compile: the torch version, warned once
        return dora_row_norm_reference(weight, lora_A, lora_B, scale)
    block_o, block_i = (16, 32) if running_in_interpreter() else (64, 128)
    try:
        _dora_row_norm_kernel[(cdiv(out_f, block_o),)](
            weight, weight.stride(0), weight.stride(1), lora_A, lora_A.stride(0), lora_A.stride(1),
            lora_B, lora_B.stride(0), lora_B.stride(1), out, out_f, in_f, r, float(scale),
            PRECISION=dot_precision(weight.dtype), BLOCK_O=block_o, BLOCK_I=block_i, BLOCK_R=rank_block(r),
            num_warps=4)
    except Exception as err:
        if running_in_interpreter():
            raise
        _KERNEL_FAILED.append(f"{type(err).__name__}: {err}"[:300])
        warnings.warn(f"lora_lab: the DoRA row-norm kernel failed ({_KERNEL_FAILED[0]}); using torch ops",
                      RuntimeWarning, stacklevel=2)
        return dora_row_norm_reference(weight, lora_A, lora_B, scale)
    return out


_KERNEL_FAILED: list[str] = []


def fused_dora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_A: torch.Tensor,
                      lora_B: torch.Tensor, scale: float, magnitude: torch.Tensor,
                      config: KernelConfig | None = None) -> torch.Tensor:
    """DoRA's ``m / ‖W + sBA‖ ⊙ (W x + s·B A x) + b`` on the fused LoRA kernels (no dropout; x, W, A, B, m on one
    device). Gradients flow to x, A, B and m; the norm is a constant, as in DoRA's paper and PEFT."""
    if magnitude.shape != (weight.shape[0],):
        raise ValueError(f"magnitude must have one entry per output row ({weight.shape[0]}), got "
                         f"{tuple(magnitude.shape)}")
    check_interpreter_dtype(x, weight, op="fused_dora_linear")
    norm = dora_row_norm(weight, lora_A, lora_B, scale)
    g = magnitude / norm.to(magnitude.dtype)
    y = fused_lora_linear(x, weight, None, lora_A, lora_B, scale, config=config)
    g = g.to(y.dtype)
    # one op for the scale and the bias: b + y ⊙ g
    return torch.addcmul(bias.to(y.dtype), y, g) if bias is not None else y * g

"""SiLU(gate) · up in one pass each way: the activation between a SwiGLU MLP's LoRA projections.

A SwiGLU MLP computes ``h = silu(g) · u`` between its gate/up projections and its down projection. Written as
``F.silu(g) * u`` in torch it is two kernels forward (silu writes a tensor the size of g, the product reads it back)
and, through autograd, four or five backward; each pass reads or writes an M×I tensor, and at M = 32,768 tokens,
I = 12,288 one such tensor is 0.8 GB. Here each direction is one kernel:

    forward    read g, u                  write h = g σ(g) · u
    backward   read dh, g, u              write du = dh · g σ(g)
                                                dg = dh · u · σ(g) (1 + g (1 − σ(g)))

with σ the logistic function, the math in fp32 and the results stored in the inputs' dtype.

When g and u are the two column blocks of one buffer — what :func:`fused_shared_input_lora` returns for the
gate/up pair, ``[g | u]`` in one M×2I output — dg and du are written as the column blocks of one buffer too, so
the projections' backward reads them in place. Otherwise they are two tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_lab.kernels.triton_helpers import cdiv, check_interpreter_dtype, check_kernel_device

__all__ = ["SiLUMulFunction", "silu_mul", "silu_mul_reference"]

_BLOCK = 1024  # columns per program: each program handles one row's block of columns
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _silu_mul_forward(g_ptr, u_ptr, h_ptr, n_cols, stride_g, stride_u, stride_h, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + row * stride_h + cols, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_backward(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n_cols, stride_dh, stride_g, stride_u, stride_dg,
                       stride_du, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dh = tl.load(dh_ptr + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(du_ptr + row * stride_du + cols, (dh * silu).to(du_ptr.dtype.element_ty), mask=mask)
    dg = dh * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(dg_ptr + row * stride_dg + cols, dg.to(dg_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as rows × columns without a copy where its last dimension is contiguous and its leading ones merge
    (a column block of a wider buffer qualifies); otherwise a contiguous copy."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:  # leading dimensions that do not merge into one stride
        return t.contiguous().view(-1, t.shape[-1])


def _adjacent_blocks(g2: torch.Tensor, u2: torch.Tensor) -> bool:
    """True when g and u are the left and right column blocks of one row-major buffer (u starts where g ends)."""
    n = g2.shape[1]
    return (g2.stride(0) == u2.stride(0) == 2 * n and u2.data_ptr() == g2.data_ptr() + n * g2.element_size()
            and g2.untyped_storage().data_ptr() == u2.untyped_storage().data_ptr())


class SiLUMulFunction(torch.autograd.Function):
    """``silu(g) · u`` with the fused kernels; saves g and u (no extra tensor) for the backward."""

    @staticmethod
    def forward(ctx, g, u):
        g2, u2 = _rows(g), _rows(u)
        M, n = g2.shape
        h = torch.empty((M, n), device=g.device, dtype=g.dtype)
        if M and n:
            _silu_mul_forward[(M, cdiv(n, _BLOCK))](g2, u2, h, n, g2.stride(0), u2.stride(0), h.stride(0),
                                                    BLOCK=_BLOCK)
        ctx.save_for_backward(g2, u2)
        ctx.shape = g.shape
        return h.view(g.shape)

    @staticmethod
    def backward(ctx, dh):
        g2, u2 = ctx.saved_tensors
        M, n = g2.shape
        dh2 = _rows(dh.to(g2.dtype))
        if _adjacent_blocks(g2, u2):  # one buffer [dg | du], as the gate/up projections' backward reads it
            both = torch.empty((M, 2 * n), device=g2.device, dtype=g2.dtype)
            dg, du = both[:, :n], both[:, n:]
        else:
            dg = torch.empty((M, n), device=g2.device, dtype=g2.dtype)
            du = torch.empty_like(dg)
        if M and n:
            _silu_mul_backward[(M, cdiv(n, _BLOCK))](dh2, g2, u2, dg, du, n, dh2.stride(0), g2.stride(0),
                                                     u2.stride(0), dg.stride(0), du.stride(0), BLOCK=_BLOCK)
        return dg.reshape(ctx.shape), du.reshape(ctx.shape)  # views: [dg | du] stays one buffer


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``F.silu(g) * u``, forward and backward each one Triton kernel (see the module docstring).

    ``g`` and ``u`` must have the same shape, dtype (fp32, fp16 or bf16) and device; their last dimension is read
    in place when it is contiguous (column blocks of a wider buffer included).
    """
    if not isinstance(g, torch.Tensor) or not isinstance(u, torch.Tensor):
        raise TypeError("silu_mul: gate and up must be tensors")
    if g.shape != u.shape:
        raise ValueError(f"silu_mul: gate and up must have the same shape, got {tuple(g.shape)} and {tuple(u.shape)}")
    if g.dim() == 0:
        raise ValueError("silu_mul: gate and up need at least one dimension (the features)")
    if g.dtype != u.dtype:
        raise TypeError(f"silu_mul: gate dtype {g.dtype} != up dtype {u.dtype}")
    if g.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"silu_mul: dtype {g.dtype} is not supported (fp32, fp16 or bf16)")
    if g.device != u.device:
        raise ValueError(f"silu_mul: gate is on {g.device} and up on {u.device}")
    check_kernel_device(g, "gate and up")
    check_interpreter_dtype(g, op="silu_mul")
    return SiLUMulFunction.apply(g, u)


def silu_mul_reference(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The plain-torch definition the kernels are checked against."""
    return torch.nn.functional.silu(g) * u

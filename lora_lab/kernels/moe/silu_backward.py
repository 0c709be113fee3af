"""The grouped-GEMM engine's passes around CUTLASS's GEMMs: SiLU·up backward with the routing weight and the router
gradient (:func:`silu_backward`), SiLU·up forward (:func:`silu_mul`) and the weighted un-sort (:func:`unsort_sum`).

Given, per expert-sorted row j, D_j = dOut_t W2_e (the down projection's input gradient before the routing
weight), the saved [g | u] and the routing weight w_j (0 for a dropped choice, ``valid_j`` False):

    h_j   = SiLU(g_j) · u_j                                  (returned, times w_j with ``weight_h``: dW2 needs it)
    dw_j  = ⟨D_j, h_j⟩  where valid_j, else 0               router-weight gradient (fp32, summed over columns)
    dh_j  = w_j · D_j
    dg_j  = dh_j · u_j · σ(g_j) · (1 + g_j (1 − σ(g_j))),   du_j = dh_j · SiLU(g_j)

One program owns a (BLOCK_S rows) x (BLOCK_I columns) tile, math in fp32, outputs in the input dtype; the
column partials of dw meet through fp32 atomics. Done in torch this is a handful of (S, I) fp32 temporaries
(about 1 GB each at a Mixtral-like layer with 8,192 tokens); here nothing but dGU, h and dw is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_lab.kernels.triton_helpers import cdiv, running_in_interpreter


@triton.jit
def _silu_backward_kernel(
    d_ptr, gu_ptr, weight_ptr, valid_ptr, dgu_ptr, h_ptr, dw_ptr, extra_ptr,
    S, I, stride_d, stride_gu, stride_dgu, stride_h, stride_extra, extra_scale,
    COMPUTE_DW: tl.constexpr, WEIGHT_H: tl.constexpr, HAS_EXTRA: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_I: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    row_mask = rows < S
    mask = row_mask[:, None] & (cols < I)[None, :]
    rows64 = rows.to(tl.int64)
    d = tl.load(d_ptr + rows64[:, None] * stride_d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_EXTRA:  # D = d + s · extra (the LoRA path of the down projection, added here instead of in place)
        extra = tl.load(extra_ptr + rows64[:, None] * stride_extra + cols[None, :], mask=mask, other=0.0)
        d += extra_scale * extra.to(tl.float32)
    gu_ptrs = gu_ptr + rows64[:, None] * stride_gu + cols[None, :]
    g = tl.load(gu_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    h = silu * u
    out_ty = dgu_ptr.dtype.element_ty
    h_out = h * w[:, None] if WEIGHT_H else h
    tl.store(h_ptr + rows64[:, None] * stride_h + cols[None, :], h_out.to(out_ty), mask=mask)
    if COMPUTE_DW:  # the router gradient takes the unweighted h
        valid = tl.load(valid_ptr + rows, mask=row_mask, other=0) != 0
        partial = tl.sum(d * h, axis=1)
        tl.atomic_add(dw_ptr + rows, tl.where(valid, partial, 0.0), mask=row_mask, sem="relaxed")
    dh = d * w[:, None]
    dgu_ptrs = dgu_ptr + rows64[:, None] * stride_dgu + cols[None, :]
    tl.store(dgu_ptrs, (dh * u * sig * (1.0 + g * (1.0 - sig))).to(out_ty), mask=mask)
    tl.store(dgu_ptrs + I, (dh * silu).to(out_ty), mask=mask)


def silu_backward(d: torch.Tensor, gu: torch.Tensor, weight: torch.Tensor, valid: torch.Tensor, *,
                  compute_router_grad: bool, weight_h: bool = False, extra: torch.Tensor | None = None,
                  extra_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dGU (S, 2I), h (S, I), dw (S,) fp32 or None) in gu's dtype; ``d`` (S, I), ``weight`` (S,), ``valid`` (S,)
    bool, all in sorted order (module docstring); ``weight_h``: h comes back times the routing weight, as the
    engine's forward used it; ``extra`` (S, I): D is ``d + extra_scale · extra`` (read here, never added in place).
    Rows must be contiguous in their last dimension."""
    num_rows, inter = d.shape
    if gu.shape != (num_rows, 2 * inter) or weight.shape != (num_rows,) or valid.shape != (num_rows,):
        raise ValueError(f"silu_backward: D {tuple(d.shape)}, [g|u] {tuple(gu.shape)}, weight {tuple(weight.shape)}, "
                         f"valid {tuple(valid.shape)} do not fit (S, I), (S, 2I), (S,), (S,)")
    if d.stride(1) != 1 or gu.stride(1) != 1:
        raise ValueError("silu_backward: D and [g|u] must be contiguous along their columns")
    if extra is not None and (extra.shape != d.shape or extra.stride(1) != 1):
        raise ValueError(f"silu_backward: extra {tuple(extra.shape)} must be D's shape {tuple(d.shape)}, "
                         "contiguous along its columns")
    dgu = torch.empty_like(gu)
    h = torch.empty(num_rows, inter, device=gu.device, dtype=gu.dtype)
    dw = torch.zeros(num_rows, device=gu.device, dtype=torch.float32) if compute_router_grad else None
    if num_rows == 0 or inter == 0:
        return dgu, h, dw
    block_s, block_i = (16, 32) if running_in_interpreter() else (32, 256)
    grid = (cdiv(num_rows, block_s), cdiv(inter, block_i))
    valid8 = valid.view(torch.int8) if valid.dtype == torch.bool else valid.to(torch.int8)  # a bool mask: no copy
    _silu_backward_kernel[grid](
        d, gu, weight, valid8, dgu, h, dw if dw is not None else weight, extra if extra is not None else d,
        num_rows, inter, d.stride(0), gu.stride(0), dgu.stride(0), h.stride(0),
        extra.stride(0) if extra is not None else 0, float(extra_scale),
        COMPUTE_DW=compute_router_grad, WEIGHT_H=weight_h, HAS_EXTRA=extra is not None,
        BLOCK_S=block_s, BLOCK_I=block_i,
        num_warps=8 if not running_in_interpreter() else 4,
    )
    return dgu, h, dw


def silu_backward_reference(d, gu, weight, valid, *, compute_router_grad: bool, weight_h: bool = False,
                            extra=None, extra_scale: float = 1.0):
    """Plain torch, fp32 math (what :func:`silu_backward` computes)."""
    d = d.float() if extra is None else d.float() + extra_scale * extra.float()
    g, u = (t.float() for t in gu.chunk(2, dim=-1))
    sig = torch.sigmoid(g)
    silu = g * sig
    h = silu * u
    dw = torch.where(valid, (d * h).sum(-1), 0) if compute_router_grad else None
    dh = d * weight.float()[:, None]
    dgu = torch.cat([dh * u * sig * (1 + g * (1 - sig)), dh * silu], dim=-1)
    h_out = h * weight.float()[:, None] if weight_h else h
    return dgu.to(gu.dtype), h_out.to(gu.dtype), dw


@triton.jit
def _silu_mul_kernel(gu_ptr, weight_ptr, h_ptr, extra_ptr, S, I, stride_gu, stride_h, stride_extra, extra_scale,
                     WEIGHTED: tl.constexpr, HAS_EXTRA: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_I: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < S)[:, None] & (cols < I)[None, :]
    rows64 = rows.to(tl.int64)
    gu_ptrs = gu_ptr + rows64[:, None] * stride_gu + cols[None, :]
    g = tl.load(gu_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    if HAS_EXTRA:  # [g | u] += s · extra, written back (backward's SiLU·up needs the sum)
        extra_ptrs = extra_ptr + rows64[:, None] * stride_extra + cols[None, :]
        g += extra_scale * tl.load(extra_ptrs, mask=mask, other=0.0).to(tl.float32)
        u += extra_scale * tl.load(extra_ptrs + I, mask=mask, other=0.0).to(tl.float32)
        tl.store(gu_ptrs, g.to(gu_ptr.dtype.element_ty), mask=mask)
        tl.store(gu_ptrs + I, u.to(gu_ptr.dtype.element_ty), mask=mask)
        g = g.to(gu_ptr.dtype.element_ty).to(tl.float32)  # h from the values saved, as without extra
        u = u.to(gu_ptr.dtype.element_ty).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    if WEIGHTED:
        h = h * tl.load(weight_ptr + rows, mask=rows < S, other=0.0).to(tl.float32)[:, None]
    tl.store(h_ptr + rows64[:, None] * stride_h + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


def silu_mul(gu: torch.Tensor, weight: torch.Tensor | None = None, extra: torch.Tensor | None = None,
             extra_scale: float = 1.0) -> torch.Tensor:
    """h = SiLU(g) · u for [g | u] (S, 2I), times ``weight`` (S,) per row when given, math in fp32, one pass, h in
    gu's dtype (the forward of the grouped-GEMM engine; torch would write SiLU(g) first, then the product).
    ``extra`` (S, 2I): first [g | u] += extra_scale · extra, **in place** in ``gu`` (the LoRA term of the gate/up
    projection, added in this pass instead of by a separate in-place add)."""
    num_rows, two_i = gu.shape
    if two_i % 2 or gu.stride(1) != 1:
        raise ValueError(f"silu_mul needs [g | u] (S, 2I) contiguous along its columns; got {tuple(gu.shape)}, "
                         f"strides {tuple(gu.stride())}")
    inter = two_i // 2
    if weight is not None and weight.shape != (num_rows,):
        raise ValueError(f"silu_mul: weight {tuple(weight.shape)} must be ({num_rows},)")
    if extra is not None and (extra.shape != gu.shape or extra.stride(1) != 1):
        raise ValueError(f"silu_mul: extra {tuple(extra.shape)} must be [g | u]'s shape {tuple(gu.shape)}, "
                         "contiguous along its columns")
    h = torch.empty(num_rows, inter, device=gu.device, dtype=gu.dtype)
    if num_rows == 0 or inter == 0:
        return h
    block_s, block_i = (16, 32) if running_in_interpreter() else (32, 256)
    _silu_mul_kernel[(cdiv(num_rows, block_s), cdiv(inter, block_i))](
        gu, weight if weight is not None else gu, h, extra if extra is not None else gu, num_rows, inter,
        gu.stride(0), h.stride(0), extra.stride(0) if extra is not None else 0, float(extra_scale),
        WEIGHTED=weight is not None, HAS_EXTRA=extra is not None, BLOCK_S=block_s, BLOCK_I=block_i,
        num_warps=4 if running_in_interpreter() else 8,
    )
    return h


@triton.jit
def _unsort_sum_kernel(rows_ptr, position_ptr, weight_ptr, out_ptr, extra_ptr, N, stride_rows, stride_out,
                       stride_extra, extra_scale,
                       TOP_K: tl.constexpr, WEIGHTED: tl.constexpr, HAS_EXTRA: tl.constexpr, BLOCK_N: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        slot = token * TOP_K + k
        row = tl.load(position_ptr + slot).to(tl.int64)
        part = tl.load(rows_ptr + row * stride_rows + cols, mask=col_mask, other=0.0).to(tl.float32)
        if HAS_EXTRA:
            part += extra_scale * tl.load(extra_ptr + row * stride_extra + cols, mask=col_mask, other=0.0).to(
                tl.float32)
        if WEIGHTED:
            part = part * tl.load(weight_ptr + slot).to(tl.float32)
        acc += part
    tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


def unsort_sum(rows: torch.Tensor, position: torch.Tensor, num_tokens: int, top_k: int,
               weight: torch.Tensor | None = None, extra: torch.Tensor | None = None,
               extra_scale: float = 1.0) -> torch.Tensor:
    """out[t] = Σ_k w[t·K + k] · rows[position[t·K + k]]: expert-sorted rows (S, N) summed back per token in fp32,
    rounded once to rows' dtype (``position[s]``: the sorted row of assignment s; ``weight`` (S,) in assignment
    order, None: 1). One pass: no weighted copy and no unsorted copy of the rows. ``extra`` (S, N): each row is
    ``rows + extra_scale · extra`` (a LoRA term summed here instead of added to the rows in place)."""
    num_rows, n_dim = rows.shape
    if position.shape != (num_tokens * top_k,) or num_rows != num_tokens * top_k:
        raise ValueError(f"unsort_sum: rows {tuple(rows.shape)} and positions {tuple(position.shape)} do not fit "
                         f"{num_tokens} tokens x top-{top_k}")
    if weight is not None and weight.shape != position.shape:
        raise ValueError(f"unsort_sum: weight {tuple(weight.shape)} must be ({num_tokens * top_k},)")
    if rows.stride(1) != 1:
        raise ValueError("unsort_sum: rows must be contiguous along their columns")
    if extra is not None and (extra.shape != rows.shape or extra.stride(1) != 1):
        raise ValueError(f"unsort_sum: extra {tuple(extra.shape)} must be the rows' shape {tuple(rows.shape)}, "
                         "contiguous along its columns")
    out = torch.empty(num_tokens, n_dim, device=rows.device, dtype=rows.dtype)
    if num_tokens == 0 or n_dim == 0:
        return out.zero_()
    block_n = 32 if running_in_interpreter() else 512
    _unsort_sum_kernel[(num_tokens, cdiv(n_dim, block_n))](
        rows, position, weight if weight is not None else position, out, extra if extra is not None else rows,
        n_dim, rows.stride(0), out.stride(0), extra.stride(0) if extra is not None else 0, float(extra_scale),
        TOP_K=top_k, WEIGHTED=weight is not None, HAS_EXTRA=extra is not None, BLOCK_N=block_n, num_warps=4,
    )
    return out

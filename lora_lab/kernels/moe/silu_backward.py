"""The grouped-GEMM engine's passes around CUTLASS's GEMMs: SiLU·up backward with the routing weight and the router
gradient (:func:`silu_backward`), SiLU·up forward (:func:`silu_mul`) and the weighted un-sort (:func:`unsort_sum`).

Given, per expert-sorted row j, D_j = dOut_t W2_e (the down projection's input gradient before the routing
weight), the saved [g | u] and the routing weight w_j (0 for a dropped choice, ``valid_j`` False):

    h_j   = SiLU(g_j) · u_j                                  (returned, times w_j with ``weight_h``: dW2 needs it)
    dw_j  = ⟨D_j, h_j⟩  where valid_j, else 0               router-weight gradient (fp32, summed over columns)
    dh_j  = w_j · D_j
    dg_j  = dh_j · u_j · σ(g_j) · (1 + g_j (1 − σ(g_j))),   du_j = dh_j · SiLU(g_j)

One program owns a (BLOCK_S rows) x (BLOCK_I columns) tile, math in fp32, outputs in the input dtype; the
column partials of dw meet through fp32 atomics.

A LoRA term can come in factored form (:class:`LowRankRows`: made in registers from the rank-r rows and the row's
expert factor) and a pass can sum the rank-r product of the rows it writes (:class:`LowRankOut`). The grouped-GEMM
engine does not use either: with both in both passes it measured 4-10% slower on an H200 than the dense terms made by
grouped GEMMs (the ledger's moe rows of commit 2d65ec1); ``tools/moe_lora_pass_bench.py`` times the
pieces one by one. Done in torch this is a handful of (S, I) fp32 temporaries
(about 1 GB each at a Mixtral-like layer with 8,192 tokens); here nothing but dGU, h and dw is written.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lora_lab.kernels.triton_helpers import cdiv, dot_precision, next_power_of_2, running_in_interpreter


class LowRankRows(NamedTuple):
    """A LoRA term in factored form, read by a pass over expert-sorted rows: row j of the term is
    ``Σ_k p[j, k] · factor[e(j), k, n]``, e(j) the expert that owns sorted row j (``offsets``: (E + 1,) int32, expert e
    owns rows [offsets[e], offsets[e+1])). ``p`` (S, r): the rank-r rows (P = X Aᵀ, or Q2 = dOut B2); ``factor``
    (E, r, N), any strides (``b1.transpose(1, 2)`` for the gate/up term, ``a2`` for the down projection's D). The
    pass multiplies each tile of rows by its expert's factor in registers, so the (S, N) term is never written."""

    p: torch.Tensor
    factor: torch.Tensor
    offsets: torch.Tensor


class LowRankOut(NamedTuple):
    """A rank-r product of the rows a pass writes, made by that pass:
    ``out[j, k] += Σ_n rows[j, n] · factor[e(j), n, k]``. ``factor`` (E, N, r), any strides: ``a2.transpose(1, 2)``
    for P2 = h A2_eᵀ, ``b1`` for Q1 = dGU B1_e. ``out`` (S, r) fp32, zeroed by the caller; the column blocks'
    partial sums meet through fp32 atomics. ``offsets`` as in :class:`LowRankRows`. Saves the grouped GEMM that
    would read the (S, N) rows again."""

    factor: torch.Tensor
    offsets: torch.Tensor
    out: torch.Tensor


def _check_low_rank_out(low_rank_out: LowRankOut, num_rows: int, n_dim: int, dtype: torch.dtype, op: str) -> None:
    factor, offsets, out = low_rank_out
    num_experts = factor.shape[0] if factor.dim() == 3 else -1
    if (factor.dim() != 3 or factor.shape[1] != n_dim or out.shape != (num_rows, factor.shape[2])
            or offsets.shape != (num_experts + 1,)):
        raise ValueError(f"{op}: low-rank output factor {tuple(factor.shape)}, out {tuple(out.shape)}, offsets "
                         f"{tuple(offsets.shape)} do not fit (E, {n_dim}, r), (S={num_rows}, r), (E + 1,)")
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise TypeError(f"{op}: the low-rank output must be a contiguous fp32 buffer, got {out.dtype}")
    if factor.dtype != dtype:
        raise TypeError(f"{op}: the low-rank output factor is {factor.dtype} but the rows are {dtype}")
    if offsets.dtype != torch.int32:
        raise TypeError(f"{op}: offsets must be int32, got {offsets.dtype}")


def _low_rank_out_launch_args(low_rank_out: LowRankOut | None, fallback: torch.Tensor) -> tuple[tuple, dict]:
    if low_rank_out is None:
        return (fallback, fallback, 0, 0, 0, 1), dict(LOW_RANK_OUT=False, RANK_OUT_P=16)
    factor, _, out = low_rank_out
    rank = factor.shape[2]
    return ((factor, out, factor.stride(0), factor.stride(1), factor.stride(2), rank),
            dict(LOW_RANK_OUT=True, RANK_OUT_P=max(16, next_power_of_2(rank))))


def _search_args(offsets_of: tuple, fallback: torch.Tensor) -> tuple[tuple, dict]:
    """(offsets, E) and the binary search's steps, from whichever low-rank term is given."""
    for term in offsets_of:
        if term is not None:
            num_experts = term.offsets.shape[0] - 1
            return (term.offsets, num_experts), dict(SEARCH_STEPS=max(1, (num_experts - 1).bit_length()))
    return (fallback, 1), dict(SEARCH_STEPS=1)


def _check_low_rank(low_rank: LowRankRows, num_rows: int, n_dim: int, op: str) -> None:
    p, factor, offsets = low_rank
    num_experts = factor.shape[0] if factor.dim() == 3 else -1
    if (p.dim() != 2 or p.shape[0] != num_rows or factor.dim() != 3 or factor.shape[1] != p.shape[1]
            or factor.shape[2] != n_dim or offsets.shape != (num_experts + 1,)):
        raise ValueError(f"{op}: low-rank term p {tuple(p.shape)}, factor {tuple(factor.shape)}, offsets "
                         f"{tuple(offsets.shape)} do not fit (S={num_rows}, r), (E, r, {n_dim}), (E + 1,)")
    if p.dtype != factor.dtype:
        raise TypeError(f"{op}: low-rank p is {p.dtype} but its factor is {factor.dtype}")
    if p.stride(1) != 1:
        raise ValueError(f"{op}: low-rank p must be contiguous along its columns")
    if offsets.dtype != torch.int32:
        raise TypeError(f"{op}: offsets must be int32, got {offsets.dtype}")


def _check_low_rank_terms(op: str, extra, low_rank: LowRankRows | None, low_rank_out: LowRankOut | None,
                          num_rows: int, n_term: int, n_written: int, dtype: torch.dtype) -> None:
    """A pass's LoRA inputs: at most one of ``extra`` and ``low_rank`` (its term, N = ``n_term``), and
    ``low_rank_out`` fitting the rows the pass writes (N = ``n_written``)."""
    if low_rank is not None:
        if extra is not None:
            raise ValueError(f"{op}: give the LoRA term as extra or as low_rank, not both")
        _check_low_rank(low_rank, num_rows, n_term, op)
    if low_rank_out is not None:
        _check_low_rank_out(low_rank_out, num_rows, n_written, dtype, op)


def _low_rank_launch_args(low_rank: LowRankRows | None, fallback: torch.Tensor) -> tuple[tuple, dict]:
    """(pointer and stride arguments, constexprs) for a kernel's low-rank term (dummies when absent)."""
    if low_rank is None:
        return (fallback, fallback, 0, 0, 0, 0, 1), dict(LOW_RANK=False, RANK_P=16,
                                                         LR_PRECISION=dot_precision(fallback.dtype))
    p, factor, _ = low_rank
    rank = factor.shape[1]
    return ((p, factor, p.stride(0), factor.stride(0), factor.stride(1), factor.stride(2), rank),
            dict(LOW_RANK=True, RANK_P=max(16, next_power_of_2(rank)), LR_PRECISION=dot_precision(p.dtype)))


@triton.jit
def _row_experts(off_ptr, rows, row_mask, num_experts, SEARCH_STEPS: tl.constexpr, BLOCK_S: tl.constexpr):
    """(expert of each sorted row, the tile's first and last expert): a binary search of the offsets for the largest
    e in [0, E) with offsets[e] <= row. Sorted rows make a tile's rows one expert, sometimes a few."""
    lo = tl.zeros([BLOCK_S], dtype=tl.int32)
    hi = tl.zeros([BLOCK_S], dtype=tl.int32) + num_experts
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        right = tl.load(off_ptr + mid) <= rows
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    first = tl.min(tl.where(row_mask, lo, num_experts), axis=0)
    last = tl.max(tl.where(row_mask, lo, -1), axis=0)
    return lo, first, last


@triton.jit
def _low_rank_tile(p_ptr, f_ptr, rows, row_mask, cols, col_mask, expert, first, last, stride_p, stride_fe, stride_fk,
                   stride_fn, rank, RANK_P: tl.constexpr, LR_PRECISION: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """(BLOCK_S, BLOCK_N) fp32: rows' Σ_k p[j, k] factor[e(j), k, cols] (:class:`LowRankRows`), one small dot per
    expert in the tile."""
    ks = tl.arange(0, RANK_P)
    k_mask = ks < rank
    p = tl.load(p_ptr + rows.to(tl.int64)[:, None] * stride_p + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                other=0.0)
    z = tl.zeros([BLOCK_S, BLOCK_N], dtype=tl.float32)
    for e in range(first, last + 1):
        f = tl.load(f_ptr + e * stride_fe + ks[:, None] * stride_fk + cols[None, :] * stride_fn,
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        z = tl.where((expert == e)[:, None], tl.dot(p, f, input_precision=LR_PRECISION), z)
    return z


@triton.jit
def _low_rank_out(vals, rows, row_mask, cols, col_mask, expert, first, last, g_ptr, o_ptr, stride_ge, stride_gn,
                  stride_gk, rank, RANK_P: tl.constexpr, LR_PRECISION: tl.constexpr, BLOCK_S: tl.constexpr):
    """out[rows] += Σ_{n in cols} vals[:, n] · factor[e(j), n, :] (:class:`LowRankOut`): one small dot per expert in
    the tile, the column blocks' partials added by fp32 atomics."""
    ks = tl.arange(0, RANK_P)
    k_mask = ks < rank
    acc = tl.zeros([BLOCK_S, RANK_P], dtype=tl.float32)
    for e in range(first, last + 1):
        f = tl.load(g_ptr + e * stride_ge + cols[:, None] * stride_gn + ks[None, :] * stride_gk,
                    mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        v = tl.where((expert == e)[:, None], vals, 0.0).to(f.dtype)
        acc += tl.dot(v, f, input_precision=LR_PRECISION)
    tl.atomic_add(o_ptr + rows.to(tl.int64)[:, None] * rank + ks[None, :], acc,
                  mask=row_mask[:, None] & k_mask[None, :], sem="relaxed")


@triton.jit
def _silu_backward_kernel(
    d_ptr, gu_ptr, weight_ptr, valid_ptr, dgu_ptr, h_ptr, dw_ptr, extra_ptr,
    S, I, stride_d, stride_gu, stride_dgu, stride_h, stride_extra, extra_scale, off_ptr, num_experts,
    p_ptr, f_ptr, stride_p, stride_fe, stride_fk, stride_fn, rank,
    g_ptr, o_ptr, stride_ge, stride_gn, stride_gk, rank_out,
    COMPUTE_DW: tl.constexpr, WEIGHT_H: tl.constexpr, WRITE_H: tl.constexpr, HAS_EXTRA: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    LOW_RANK: tl.constexpr, RANK_P: tl.constexpr, LR_PRECISION: tl.constexpr,
    LOW_RANK_OUT: tl.constexpr, RANK_OUT_P: tl.constexpr,
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
    if LOW_RANK or LOW_RANK_OUT:
        expert, first, last = _row_experts(off_ptr, rows, row_mask, num_experts, SEARCH_STEPS, BLOCK_S)
    if LOW_RANK:  # D = d + s · Q2 A2_e, the term made here from its factors
        d += extra_scale * _low_rank_tile(p_ptr, f_ptr, rows, row_mask, cols, cols < I, expert, first, last, stride_p,
                                          stride_fe, stride_fk, stride_fn, rank, RANK_P, LR_PRECISION, BLOCK_S,
                                          BLOCK_I)
    gu_ptrs = gu_ptr + rows64[:, None] * stride_gu + cols[None, :]
    g = tl.load(gu_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    h = silu * u
    out_ty = dgu_ptr.dtype.element_ty
    if WRITE_H:
        h_out = h * w[:, None] if WEIGHT_H else h
        tl.store(h_ptr + rows64[:, None] * stride_h + cols[None, :], h_out.to(out_ty), mask=mask)
    if COMPUTE_DW:  # the router gradient takes the unweighted h
        valid = tl.load(valid_ptr + rows, mask=row_mask, other=0) != 0
        partial = tl.sum(d * h, axis=1)
        tl.atomic_add(dw_ptr + rows, tl.where(valid, partial, 0.0), mask=row_mask, sem="relaxed")
    dh = d * w[:, None]
    dgu_ptrs = dgu_ptr + rows64[:, None] * stride_dgu + cols[None, :]
    dg = (dh * u * sig * (1.0 + g * (1.0 - sig))).to(out_ty)
    du = (dh * silu).to(out_ty)
    tl.store(dgu_ptrs, dg, mask=mask)
    tl.store(dgu_ptrs + I, du, mask=mask)
    if LOW_RANK_OUT:  # Q1 += dGU B1_e over this tile's columns of both halves, from the values stored
        col_mask = cols < I
        _low_rank_out(dg.to(tl.float32), rows, row_mask, cols, col_mask, expert, first, last, g_ptr, o_ptr,
                      stride_ge, stride_gn, stride_gk, rank_out, RANK_OUT_P, LR_PRECISION, BLOCK_S)
        _low_rank_out(du.to(tl.float32), rows, row_mask, cols + I, col_mask, expert, first, last, g_ptr, o_ptr,
                      stride_ge, stride_gn, stride_gk, rank_out, RANK_OUT_P, LR_PRECISION, BLOCK_S)


def silu_backward(d: torch.Tensor, gu: torch.Tensor, weight: torch.Tensor, valid: torch.Tensor, *,
                  compute_router_grad: bool, weight_h: bool = False, write_h: bool = True,
                  extra: torch.Tensor | None = None, extra_scale: float = 1.0, low_rank: LowRankRows | None = None,
                  low_rank_out: LowRankOut | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dGU (S, 2I), h (S, I) or None, dw (S,) fp32 or None) in gu's dtype; ``d`` (S, I), ``weight`` (S,), ``valid``
    (S,) bool, all in sorted order (module docstring); ``weight_h``: h comes back times the routing weight, as the
    engine's forward used it; ``write_h=False``: h is not written (None; for a caller that saved it in forward);
    ``extra`` (S, I): D is ``d + extra_scale · extra`` (read here, never added in place);
    ``low_rank`` (:class:`LowRankRows`, N = I): D is ``d + extra_scale ·`` that term, made in registers;
    ``low_rank_out`` (:class:`LowRankOut`, N = 2I): dGU's rank-r product (Q1 = dGU B1_e) added into its buffer.
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
    _check_low_rank_terms("silu_backward", extra, low_rank, low_rank_out, num_rows, inter, 2 * inter, gu.dtype)
    dgu = torch.empty_like(gu)
    h = torch.empty(num_rows, inter, device=gu.device, dtype=gu.dtype) if write_h else None
    dw = torch.zeros(num_rows, device=gu.device, dtype=torch.float32) if compute_router_grad else None
    if num_rows == 0 or inter == 0:
        return dgu, h, dw
    block_s, block_i = (16, 32) if running_in_interpreter() else (32, 256)
    grid = (cdiv(num_rows, block_s), cdiv(inter, block_i))
    valid8 = valid.view(torch.int8) if valid.dtype == torch.bool else valid.to(torch.int8)  # a bool mask: no copy
    search_args, search_flags = _search_args((low_rank, low_rank_out), d)
    lr_args, lr_flags = _low_rank_launch_args(low_rank, d)
    lro_args, lro_flags = _low_rank_out_launch_args(low_rank_out, d)
    _silu_backward_kernel[grid](
        d, gu, weight, valid8, dgu, h if h is not None else dgu, dw if dw is not None else weight,
        extra if extra is not None else d, num_rows, inter, d.stride(0), gu.stride(0), dgu.stride(0),
        h.stride(0) if h is not None else 0,
        extra.stride(0) if extra is not None else 0, float(extra_scale), *search_args, *lr_args, *lro_args,
        COMPUTE_DW=compute_router_grad, WEIGHT_H=weight_h, WRITE_H=write_h, HAS_EXTRA=extra is not None,
        **search_flags, **lr_flags, **lro_flags,
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
                     off_ptr, num_experts, p_ptr, f_ptr, stride_p, stride_fe, stride_fk, stride_fn, rank,
                     g_ptr, o_ptr, stride_ge, stride_gn, stride_gk, rank_out,
                     WEIGHTED: tl.constexpr, HAS_EXTRA: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                     LOW_RANK: tl.constexpr, RANK_P: tl.constexpr, LR_PRECISION: tl.constexpr,
                     LOW_RANK_OUT: tl.constexpr, RANK_OUT_P: tl.constexpr,
                     BLOCK_S: tl.constexpr, BLOCK_I: tl.constexpr):
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
    row_mask = rows < S
    col_mask = cols < I
    if LOW_RANK or LOW_RANK_OUT:
        expert, first, last = _row_experts(off_ptr, rows, row_mask, num_experts, SEARCH_STEPS, BLOCK_S)
    if LOW_RANK:  # [g | u] += s · P B1_e^T, made here from its factors (columns n and I + n of the term)
        g += extra_scale * _low_rank_tile(p_ptr, f_ptr, rows, row_mask, cols, col_mask, expert, first, last, stride_p,
                                          stride_fe, stride_fk, stride_fn, rank, RANK_P, LR_PRECISION, BLOCK_S,
                                          BLOCK_I)
        u += extra_scale * _low_rank_tile(p_ptr, f_ptr, rows, row_mask, cols + I, col_mask, expert, first, last,
                                          stride_p, stride_fe, stride_fk, stride_fn, rank, RANK_P, LR_PRECISION,
                                          BLOCK_S, BLOCK_I)
    if HAS_EXTRA or LOW_RANK:
        tl.store(gu_ptrs, g.to(gu_ptr.dtype.element_ty), mask=mask)
        tl.store(gu_ptrs + I, u.to(gu_ptr.dtype.element_ty), mask=mask)
        g = g.to(gu_ptr.dtype.element_ty).to(tl.float32)  # h from the values saved, as without extra
        u = u.to(gu_ptr.dtype.element_ty).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    if WEIGHTED:
        h = h * tl.load(weight_ptr + rows, mask=rows < S, other=0.0).to(tl.float32)[:, None]
    h = h.to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + rows64[:, None] * stride_h + cols[None, :], h, mask=mask)
    if LOW_RANK_OUT:  # P2 += h A2_e^T over this tile's columns, from the values stored
        _low_rank_out(h.to(tl.float32), rows, row_mask, cols, col_mask, expert, first, last, g_ptr, o_ptr, stride_ge,
                      stride_gn, stride_gk, rank_out, RANK_OUT_P, LR_PRECISION, BLOCK_S)


def silu_mul(gu: torch.Tensor, weight: torch.Tensor | None = None, extra: torch.Tensor | None = None,
             extra_scale: float = 1.0, *, low_rank: LowRankRows | None = None,
             low_rank_out: LowRankOut | None = None) -> torch.Tensor:
    """h = SiLU(g) · u for [g | u] (S, 2I), times ``weight`` (S,) per row when given, math in fp32, one pass, h in
    gu's dtype (the forward of the grouped-GEMM engine; torch would write SiLU(g) first, then the product).
    ``extra`` (S, 2I): first [g | u] += extra_scale · extra, **in place** in ``gu`` (the LoRA term of the gate/up
    projection, added in this pass instead of by a separate in-place add); or ``low_rank``
    (:class:`LowRankRows`, N = 2I): the same with the term made in registers from its factors. ``low_rank_out``
    (:class:`LowRankOut`, N = I): h's rank-r product (P2 = h A2_eᵀ) added into its buffer."""
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
    _check_low_rank_terms("silu_mul", extra, low_rank, low_rank_out, num_rows, two_i, inter, gu.dtype)
    h = torch.empty(num_rows, inter, device=gu.device, dtype=gu.dtype)
    if num_rows == 0 or inter == 0:
        return h
    block_s, block_i = (16, 32) if running_in_interpreter() else (32, 256)
    search_args, search_flags = _search_args((low_rank, low_rank_out), gu)
    lr_args, lr_flags = _low_rank_launch_args(low_rank, gu)
    lro_args, lro_flags = _low_rank_out_launch_args(low_rank_out, gu)
    _silu_mul_kernel[(cdiv(num_rows, block_s), cdiv(inter, block_i))](
        gu, weight if weight is not None else gu, h, extra if extra is not None else gu, num_rows, inter,
        gu.stride(0), h.stride(0), extra.stride(0) if extra is not None else 0, float(extra_scale), *search_args,
        *lr_args, *lro_args, WEIGHTED=weight is not None, HAS_EXTRA=extra is not None, **search_flags, **lr_flags,
        **lro_flags, BLOCK_S=block_s, BLOCK_I=block_i,
        num_warps=4 if running_in_interpreter() else 8,
    )
    return h


@triton.jit
def _unsort_sum_kernel(rows_ptr, position_ptr, weight_ptr, out_ptr, extra_ptr, range_ptr, range_last, N,
                       stride_rows, stride_out, stride_extra, extra_scale,
                       TOP_K: tl.constexpr, WEIGHTED: tl.constexpr, HAS_EXTRA: tl.constexpr, IN_RANGE: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if IN_RANGE:  # only sorted rows in [range[0], range[-1]) count (the rest belong to no expert)
        lo = tl.load(range_ptr)
        hi = tl.load(range_ptr + range_last)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        slot = token * TOP_K + k
        row32 = tl.load(position_ptr + slot)
        row = row32.to(tl.int64)
        mask = col_mask
        if IN_RANGE:  # a row of no expert: no column is read
            mask = cols < tl.where((row32 >= lo) & (row32 < hi), N, 0)
        part = tl.load(rows_ptr + row * stride_rows + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_EXTRA:
            part += extra_scale * tl.load(extra_ptr + row * stride_extra + cols, mask=mask, other=0.0).to(
                tl.float32)
        if WEIGHTED:
            part = part * tl.load(weight_ptr + slot).to(tl.float32)
        acc += part
    tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


def unsort_sum(rows: torch.Tensor, position: torch.Tensor, num_tokens: int, top_k: int,
               weight: torch.Tensor | None = None, extra: torch.Tensor | None = None,
               extra_scale: float = 1.0, row_range: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = Σ_k w[t·K + k] · rows[position[t·K + k]]: expert-sorted rows (S, N) summed back per token in fp32,
    rounded once to rows' dtype (``position[s]``: the sorted row of assignment s; ``weight`` (S,) in assignment
    order, None: 1). One pass: no weighted copy and no unsorted copy of the rows. ``extra`` (S, N): each row is
    ``rows + extra_scale · extra`` (a LoRA term summed here instead of added to the rows in place). ``row_range``
    (an int32 tensor on the device, e.g. the expert offsets): only sorted rows in ``[row_range[0], row_range[-1])``
    are summed, the others (assignments of no expert, whose rows nothing wrote) add nothing; read on the device."""
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
    if row_range is not None and (row_range.dim() != 1 or row_range.numel() < 1 or row_range.dtype != torch.int32):
        raise ValueError(f"unsort_sum: row_range must be a 1-D int32 tensor; got {tuple(row_range.shape)} "
                         f"{row_range.dtype}")
    _unsort_sum_kernel[(num_tokens, cdiv(n_dim, block_n))](
        rows, position, weight if weight is not None else position, out, extra if extra is not None else rows,
        row_range if row_range is not None else position, row_range.numel() - 1 if row_range is not None else 0,
        n_dim, rows.stride(0), out.stride(0), extra.stride(0) if extra is not None else 0, float(extra_scale),
        TOP_K=top_k, WEIGHTED=weight is not None, HAS_EXTRA=extra is not None, IN_RANGE=row_range is not None,
        BLOCK_N=block_n, num_warps=4,
    )
    return out


@triton.jit
def _zero_empty_experts_kernel(out_ptr, ends_ptr, M, N, stride_e, stride_m, stride_n,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # program (e, tile of rows): reads expert e's row count from the end offsets; a non-empty expert's program
    # returns at once, so nothing of a gradient with rows is read or written
    e = tl.program_id(0)
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    if tl.load(ends_ptr + e) == start:
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            ptrs = out_ptr + e.to(tl.int64) * stride_e + rows[:, None] * stride_m + cols[None, :] * stride_n
            tl.store(ptrs, zeros, mask=(rows[:, None] < M) & (cols[None, :] < N))


def zero_empty_experts_(out: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Zero ``out[e]`` ((E, M, N), any strides, in place) for every expert e without rows: ``ends`` ((E,) int32)
    are the experts' end rows, so e is empty when ``ends[e] == ends[e - 1]`` (``ends[-1]`` read as 0 for e = 0).

    The K-grouped GEMM (``torch._grouped_mm`` with K split at ``ends``) leaves an empty expert's block unwritten;
    a masked write over the whole (E, M, N) gradient would read and write every expert's block to fix the rare
    empty one (805 MB at a 30B-A3B-like dW1, 1.11 ms on an H200 in a kernel profile of 3746665). Here a
    program per (expert, tile of rows) loads two offsets and writes only where the expert is empty. Returns ``out``.
    """
    if out.dim() != 3 or ends.dim() != 1 or ends.shape[0] != out.shape[0]:
        raise ValueError(f"zero_empty_experts_: out must be (E, M, N) and ends (E,); got {tuple(out.shape)} and "
                         f"{tuple(ends.shape)}")
    if ends.dtype != torch.int32 or ends.device != out.device:
        raise ValueError(f"zero_empty_experts_: ends must be int32 on {out.device}; got {ends.dtype} on "
                         f"{ends.device}")
    num_experts, m_dim, n_dim = out.shape
    if out.numel() == 0:
        return out
    block_m, block_n = 32, min(256, next_power_of_2(n_dim))
    _zero_empty_experts_kernel[(num_experts, cdiv(m_dim, block_m))](
        out, ends, m_dim, n_dim, *out.stride(), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
    return out

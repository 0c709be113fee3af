"""The memory-bound rank-r passes of a LoRA layer, in Triton.

* ``rank_projection``  out[M, r] = scale · drop(In)[M, D] @ Mat[D, r]      (reads In once)
* ``rank_reduction``   out[r, D] = L[M, r]ᵀ @ drop(In)[M, D]             (split over M, fp32 partials)
* ``q_and_db``         Q = s · dY B and dBᵀ = Pᵀ dY from one pass over dY (atomics: dB not deterministic)
* ``dropout_keep_mask`` the mask every kernel regenerates from a seed: keep(m, k) = rand(seed, m·K + k) ≥ p
* ``merge_weight``     W + s · B A (N×K) for the merged-weight route: one read of W, one write, B A on the way

``rank_projection`` and ``q_and_db`` can also copy the input they read into another buffer (``copy_to``) on the
way: the K-widened route (``KernelConfig(base_gemm="wide")``) builds ``[X | P]`` and ``[dY | Q]`` that way, the
copy riding on the read the rank-r product needs anyway.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_lab.kernels.lora.tuning import autotune, skinny_configs
from lora_lab.kernels.triton_helpers import (
    cdiv,
    check_interpreter_dtype,
    check_kernel_device,
    dot_precision,
    kernels_interpreted,
    rank_block,
    row_bucket,
)

__all__ = ["rank_projection", "rank_reduction", "q_and_db", "dropout_keep_mask", "dropout_args", "merge_weight",
           "stack_weight"]


# ----------------------------------------------------------------------------------------------
# Kernel 1: out[M, r] = scale · drop(In)[M, D] @ Mat[D, r]
#   forward  P = s · drop(X) Aᵀ   (Mat = Aᵀ through strides)
#   backward Q = s · dY B         (Mat = B)
# One program owns BLOCK_M rows and all (up to BLOCK_R) rank columns, so In is read once.
# ----------------------------------------------------------------------------------------------
@autotune(skinny_configs(), key=["M_BUCKET", "D", "R", "TUNE", "COPY"])  # COPY: unpipelined (tuning._prune_configs)
@triton.jit
def _rank_projection_kernel(
    in_ptr, stride_im, stride_id,
    mat_ptr, stride_md, stride_mr,
    out_ptr, stride_om, stride_or,
    copy_ptr, stride_cm, stride_cd,
    M, D, R, M_BUCKET, TUNE,
    scale, col_scale_ptr, seed, p_drop, keep_scale,
    HAS_COL_SCALE: tl.constexpr, DROPOUT: tl.constexpr, COPY: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ranks = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < M
    rank_ok = ranks < R
    in_rows = in_ptr + rows.to(tl.int64)[:, None] * stride_im
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + cols
        x = tl.load(in_rows + d[None, :] * stride_id, mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
        if COPY:
            # the input as read (before dropout) into the copy buffer, by the first rank block's programs only
            tl.store(copy_ptr + rows.to(tl.int64)[:, None] * stride_cm + d[None, :] * stride_cd, x,
                     mask=(row_ok & (rows * 0 + pid_r == 0))[:, None] & (d[None, :] < D))
        if DROPOUT:
            # drop(X)[m, d] = X[m, d] · keep/(1-p), rounded to X's dtype like torch's dropout
            keep = tl.rand(seed, rows[:, None] * D + d[None, :]) >= p_drop
            x = tl.where(keep, x.to(tl.float32) * keep_scale, 0.0).to(x.dtype)
        w = tl.load(mat_ptr + d[:, None] * stride_md + ranks[None, :] * stride_mr,
                    mask=(d[:, None] < D) & rank_ok[None, :], other=0.0)
        # acc[m, r] += Σ_d drop(X)[m, d] · Mat[d, r]
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_COL_SCALE:
        # one scale per rank column (the shared-input op stacks several adapters' A, each with its own s)
        acc = acc * tl.load(col_scale_ptr + ranks, mask=rank_ok, other=0.0)[None, :]
    out = (acc * scale).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + ranks[None, :] * stride_or, out,
             mask=row_ok[:, None] & rank_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Kernel 2: partial[split, r, D] = Σ_{m in split} L[m, r] · drop(In)[m, D]      (= Lᵀ drop(In))
#   dA = Qᵀ drop(X)   (In = X, with the forward's dropout mask)
#   dBᵀ = Pᵀ dY       (In = dY)
# The reduction runs over M, the long axis: each program sums a contiguous slice of rows in fp32
# registers; the few per-slice partials are summed on the host (deterministic, no atomics).
# ----------------------------------------------------------------------------------------------
@autotune(skinny_configs(), key=["M_BUCKET", "D", "R", "TUNE"])
@triton.jit
def _rank_reduction_kernel(
    l_ptr, stride_lm, stride_lr,
    in_ptr, stride_im, stride_id,
    partial_ptr, stride_ps, stride_pr, stride_pd,
    M, D, R, M_BUCKET, TUNE, rows_per_split,
    seed, p_drop, keep_scale,
    DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid_d = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_s = tl.program_id(2)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    ranks = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    col_ok = cols < D
    rank_ok = ranks < R
    row_start = pid_s * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, M)
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for m0 in range(row_start, row_end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        # Lᵀ tile, loaded transposed: lt[r, m] = L[m, r]
        lt = tl.load(l_ptr + rows.to(tl.int64)[None, :] * stride_lm + ranks[:, None] * stride_lr,
                     mask=rank_ok[:, None] & row_ok[None, :], other=0.0)
        x = tl.load(in_ptr + rows.to(tl.int64)[:, None] * stride_im + cols[None, :] * stride_id,
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        if DROPOUT:
            keep = tl.rand(seed, rows[:, None] * D + cols[None, :]) >= p_drop
            x = tl.where(keep, x.to(tl.float32) * keep_scale, 0.0).to(x.dtype)
        # acc[r, d] += Σ_m L[m, r] · drop(In)[m, d]
        acc = tl.dot(lt, x, acc, input_precision=PRECISION)
    tl.store(partial_ptr + pid_s * stride_ps + ranks[:, None] * stride_pr + cols[None, :] * stride_pd, acc,
             mask=rank_ok[:, None] & col_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Kernel 2b (experimental, KernelConfig(fuse_q_db=True)): Q and dB from ONE pass over dY.
#   Q[m, :]  = s · Σ_n dY[m, n] B[n, :]        (reduction over N: stays inside the program)
#   dBᵀ[:, n] += Σ_{m in block} P[m, :]ᵀ dY[m, n]  (reduction over M: fp32 atomic adds across programs)
# Saves one read of dY; the price is a non-deterministic summation order for dB.
# ----------------------------------------------------------------------------------------------
@autotune(skinny_configs(), key=["M_BUCKET", "D", "R", "TUNE", "COPY"], reset_to_zero=["dbt_ptr"])
@triton.jit
def _q_and_db_kernel(
    dy_ptr, stride_ym, stride_yn,
    b_ptr, stride_bn, stride_br,
    p_ptr, stride_pm, stride_pr,
    q_ptr, stride_qm, stride_qr,
    dbt_ptr, stride_dr, stride_dn,
    copy_ptr, stride_cm, stride_cd,
    M, D, R, M_BUCKET, TUNE, scale,
    COPY: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid_m = tl.program_id(0)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ranks = tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < M
    rank_ok = ranks < R
    # Pᵀ tile of this row block, loaded once: pt[r, m] = P[m, r]
    pt = tl.load(p_ptr + rows.to(tl.int64)[None, :] * stride_pm + ranks[:, None] * stride_pr,
                 mask=rank_ok[:, None] & row_ok[None, :], other=0.0)
    q_acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    dy_rows = dy_ptr + rows.to(tl.int64)[:, None] * stride_ym
    for d0 in range(0, D, BLOCK_D):
        d = d0 + cols
        dy = tl.load(dy_rows + d[None, :] * stride_yn, mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
        if COPY:
            tl.store(copy_ptr + rows.to(tl.int64)[:, None] * stride_cm + d[None, :] * stride_cd, dy,
                     mask=row_ok[:, None] & (d[None, :] < D))
        bt = tl.load(b_ptr + d[:, None] * stride_bn + ranks[None, :] * stride_br,
                     mask=(d[:, None] < D) & rank_ok[None, :], other=0.0)
        q_acc = tl.dot(dy, bt, q_acc, input_precision=PRECISION)
        part = tl.dot(pt, dy, input_precision=PRECISION)  # [R, BLOCK_D]
        tl.atomic_add(dbt_ptr + ranks[:, None] * stride_dr + d[None, :] * stride_dn, part,
                      mask=rank_ok[:, None] & (d[None, :] < D), sem="relaxed")
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_qm + ranks[None, :] * stride_qr,
             (q_acc * scale).to(q_ptr.dtype.element_ty), mask=row_ok[:, None] & rank_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Kernel 4: out[N, K] = W + s · B[N, r] A[r, K]   (the merged-weight route's per-call merge)
# One program owns one BLOCK_N × BLOCK_K tile: W's tile read once, B A's tile one dot of depth r, one store.
# ----------------------------------------------------------------------------------------------
MERGE_BLOCK_N, MERGE_BLOCK_K = 64, 128


@triton.jit
def _merge_weight_kernel(
    w_ptr, stride_wn, stride_wk,
    b_ptr, stride_bn, stride_br,
    a_ptr, stride_ar, stride_ak,
    out_ptr, stride_on, stride_ok,
    N, K, R, N_OUT, K_OUT, scale,
    PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    EXTRA: tl.constexpr,
):
    # out[:N, :K] = W + scale·B A; EXTRA 1: rows N.. of out (N_OUT in all) hold scale·A, then zeros; EXTRA 2:
    # columns K.. (K_OUT in all) hold scale·B, then zeros. Beyond N (or K) W and B A load as zeros, so those tiles
    # add the extra block alone.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ranks = tl.arange(0, BLOCK_R)
    row_ok, col_ok, rank_ok = rows < N, cols < K, ranks < R
    rows64 = rows.to(tl.int64)
    b = tl.load(b_ptr + rows64[:, None] * stride_bn + ranks[None, :] * stride_br,
                mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
    a = tl.load(a_ptr + ranks[:, None] * stride_ar + cols[None, :] * stride_ak,
                mask=rank_ok[:, None] & col_ok[None, :], other=0.0)
    tile = row_ok[:, None] & col_ok[None, :]
    w = tl.load(w_ptr + rows64[:, None] * stride_wn + cols[None, :] * stride_wk, mask=tile, other=0.0)
    acc = w.to(tl.float32) + scale * tl.dot(b, a, input_precision=PRECISION)
    if EXTRA == 1:
        extra = rows - N
        in_a = (extra >= 0) & (extra < R)
        a_rows = tl.load(a_ptr + extra[:, None] * stride_ar + cols[None, :] * stride_ak,
                         mask=in_a[:, None] & col_ok[None, :], other=0.0)
        acc += scale * a_rows.to(tl.float32)
        tile = (rows < N_OUT)[:, None] & col_ok[None, :]
    elif EXTRA == 2:
        extra = cols - K
        in_b = (extra >= 0) & (extra < R)
        b_cols = tl.load(b_ptr + rows64[:, None] * stride_bn + extra[None, :] * stride_br,
                         mask=row_ok[:, None] & in_b[None, :], other=0.0)
        acc += scale * b_cols.to(tl.float32)
        tile = row_ok[:, None] & (cols < K_OUT)[None, :]
    tl.store(out_ptr + rows64[:, None] * stride_on + cols[None, :] * stride_ok, acc.to(out_ptr.dtype.element_ty),
             mask=tile)


@triton.jit
def _dropout_mask_kernel(out_ptr, M, D, seed, p_drop, BLOCK: tl.constexpr):
    # keep(m, d) = rand(seed, m·D + d) ≥ p — the same stream the three kernels above draw from
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * D
    keep = tl.rand(seed, offs) >= p_drop
    tl.store(out_ptr + offs, keep.to(tl.int8), mask=ok)


def dropout_args(p: float, seed: int | None):
    if p > 0.0:
        if seed is None:
            raise ValueError("dropout > 0 needs a seed")
        return True, int(seed), float(p), 1.0 / (1.0 - p)
    return False, 0, 0.0, 1.0


def _check_copy(copy_to: torch.Tensor | None, inp: torch.Tensor, op: str) -> None:
    if copy_to is not None and (copy_to.shape != inp.shape or copy_to.dtype != inp.dtype
                                or copy_to.device != inp.device):
        raise ValueError(f"{op}: copy_to must match the input ({tuple(inp.shape)}, {inp.dtype}, {inp.device}); got "
                         f"{tuple(copy_to.shape)}, {copy_to.dtype}, {copy_to.device}")


def rank_projection(inp: torch.Tensor, mat: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                    dropout_p: float = 0.0, seed: int | None = None,
                    col_scale: torch.Tensor | None = None, tune: bool = True,
                    copy_to: torch.Tensor | None = None) -> torch.Tensor:
    """out[M, r] = scale · drop(inp)[M, D] @ mat[D, r] [· col_scale[r]] (``mat`` may be a transposed view);
    ``copy_to`` (a tensor, or a view, shaped like ``inp``) receives ``inp`` as read, before dropout."""
    check_interpreter_dtype(inp, op="rank_projection")
    _check_copy(copy_to, inp, "rank_projection")
    M, D = inp.shape
    R = mat.shape[1]
    if out is None:
        out = torch.empty((M, R), device=inp.device, dtype=inp.dtype)
    if M == 0 or R == 0:
        if copy_to is not None:
            copy_to.copy_(inp)
        return out
    dropout, seed_, p_, keep_scale = dropout_args(dropout_p, seed)
    block_r = rank_block(R, cap=128)

    def grid(meta):
        return (cdiv(M, meta["BLOCK_M"]), cdiv(R, block_r))
    _rank_projection_kernel[grid](
        inp, inp.stride(0), inp.stride(1),
        mat, mat.stride(0), mat.stride(1),
        out, out.stride(0), out.stride(1),
        *_copy_args(copy_to, out),
        M, D, R, row_bucket(M), int(tune),
        float(scale), col_scale if col_scale is not None else out, seed_, p_, keep_scale,
        HAS_COL_SCALE=col_scale is not None, DROPOUT=dropout, COPY=copy_to is not None,
        PRECISION=dot_precision(inp.dtype), BLOCK_R=block_r,
    )
    return out


def _copy_args(copy_to: torch.Tensor | None, dummy: torch.Tensor) -> tuple:
    return (copy_to, copy_to.stride(0), copy_to.stride(1)) if copy_to is not None else (dummy, 0, 0)


def _num_row_splits(M: int, D: int, R: int, block_r: int) -> int:
    # enough programs to fill the GPU (≈ 2 waves of 132 SMs) without a large partial buffer
    if kernels_interpreted():
        return 2 if M >= 32 else 1
    programs_per_split = cdiv(D, 64) * cdiv(R, block_r)
    splits = cdiv(264, max(programs_per_split, 1))
    return int(max(1, min(splits, 32, cdiv(M, 128))))


def q_and_db(dy: torch.Tensor, b: torch.Tensor, p: torch.Tensor, scale: float, tune: bool = True,
             q_out: torch.Tensor | None = None, copy_to: torch.Tensor | None = None):
    """(Q = scale · dY B in dY's dtype, fp32 dBᵀ = Pᵀ dY) from one pass over dY (atomic adds for dB); Q goes into
    ``q_out`` when given (M×r, a view is fine), and ``copy_to`` (shaped like dY) receives dY as read."""
    check_interpreter_dtype(dy, op="q_and_db")
    _check_copy(copy_to, dy, "q_and_db")
    M, D = dy.shape
    R = b.shape[1]
    if q_out is not None and (q_out.shape != (M, R) or q_out.dtype != dy.dtype or q_out.device != dy.device):
        raise ValueError(f"q_and_db: q_out must be {M}×{R} in {dy.dtype} on {dy.device}; got "
                         f"{tuple(q_out.shape)}, {q_out.dtype}, {q_out.device}")
    q = torch.empty((M, R), device=dy.device, dtype=dy.dtype) if q_out is None else q_out
    dbt = torch.zeros((R, D), device=dy.device, dtype=torch.float32)
    if M == 0 or R == 0:
        if copy_to is not None:
            copy_to.copy_(dy)
        return q, dbt
    block_r = rank_block(R, cap=128)
    if block_r < R:
        raise ValueError("q_and_db handles r <= 128")

    def grid(meta):
        return (cdiv(M, meta["BLOCK_M"]),)
    _q_and_db_kernel[grid](
        dy, dy.stride(0), dy.stride(1), b, b.stride(0), b.stride(1), p, p.stride(0), p.stride(1),
        q, q.stride(0), q.stride(1), dbt, dbt.stride(0), dbt.stride(1), *_copy_args(copy_to, q),
        M, D, R, row_bucket(M), int(tune), float(scale),
        COPY=copy_to is not None, PRECISION=dot_precision(dy.dtype), BLOCK_R=block_r,
    )
    return q, dbt


def rank_reduction(l: torch.Tensor, inp: torch.Tensor, dropout_p: float = 0.0,
                   seed: int | None = None, tune: bool = True) -> torch.Tensor:
    """fp32 out[r, D] = l[M, r]ᵀ @ drop(inp)[M, D], summed over M in a few deterministic slices."""
    check_interpreter_dtype(inp, op="rank_reduction")
    M, R = l.shape
    D = inp.shape[1]
    if M == 0 or R == 0 or D == 0:
        return torch.zeros((R, D), device=inp.device, dtype=torch.float32)
    dropout, seed_, p_, keep_scale = dropout_args(dropout_p, seed)
    block_r = rank_block(R, cap=64)
    splits = _num_row_splits(M, D, R, block_r)
    rows_per_split = cdiv(cdiv(M, splits), 128) * 128 if not kernels_interpreted() \
        else cdiv(M, splits)
    splits = cdiv(M, rows_per_split)
    partial = torch.empty((splits, R, D), device=inp.device, dtype=torch.float32)

    def grid(meta):
        return (cdiv(D, meta["BLOCK_D"]), cdiv(R, block_r), splits)
    _rank_reduction_kernel[grid](
        l, l.stride(0), l.stride(1),
        inp, inp.stride(0), inp.stride(1),
        partial, partial.stride(0), partial.stride(1), partial.stride(2),
        M, D, R, row_bucket(M), int(tune), rows_per_split,
        seed_, p_, keep_scale,
        DROPOUT=dropout, PRECISION=dot_precision(inp.dtype), BLOCK_R=block_r,
    )
    return partial[0] if splits == 1 else partial.sum(0)


# dtype → error text once a TMA launch failed for that dtype: the pointer kernel from then on (per dtype, so an
# fp32 tile that overflows shared memory does not take TMA away from bf16)
_TMA_STATE: dict = {}



def _merge_dims(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: str) -> tuple[int, int, int]:
    """(N, K, r) of a merge of W (N×K) with B (N×r) A (r×K); a mismatch raises, naming ``op``."""
    check_interpreter_dtype(weight, op=op)
    N, K = weight.shape
    R = a.shape[0]
    if a.shape[1] != K or b.shape != (N, R):
        raise ValueError(f"{op}: A must be r×{K} and B {N}×r, got {tuple(a.shape)} and {tuple(b.shape)}")
    return N, K, R


def merge_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``W + scale · B A`` (N×K, W's dtype) in one pass over W: B A accumulated with W in fp32, rounded once (what
    ``torch.addmm(W, B, A, alpha=scale)`` computes, without cuBLAS's GEMM machinery for a depth-r product); written
    into ``out`` (N×K, W's dtype, any strides: a block of a larger buffer) when given."""
    N, K, R = _merge_dims(weight, a, b, "merge_weight")
    if out is None:
        out = torch.empty((N, K), device=weight.device, dtype=weight.dtype)
    elif out.shape != (N, K) or out.dtype != weight.dtype or out.device != weight.device:
        raise ValueError(f"merge_weight: out must be {N}×{K} {weight.dtype} on {weight.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if N == 0 or K == 0:
        return out
    if R == 0:
        return out.copy_(weight)
    _launch_merge(weight, a, b, scale, out, extra=0)
    return out


def _launch_merge(weight, a, b, scale, out, extra: int) -> None:
    N, K = weight.shape
    grid = (cdiv(out.shape[0], MERGE_BLOCK_N), cdiv(out.shape[1], MERGE_BLOCK_K))
    _merge_weight_kernel[grid](
        weight, weight.stride(0), weight.stride(1),
        b, b.stride(0), b.stride(1),
        a, a.stride(0), a.stride(1),
        out, out.stride(0), out.stride(1),
        N, K, a.shape[0], out.shape[0], out.shape[1], float(scale),
        PRECISION=dot_precision(weight.dtype), BLOCK_N=MERGE_BLOCK_N, BLOCK_K=MERGE_BLOCK_K,
        BLOCK_R=rank_block(a.shape[0]), EXTRA=extra, num_warps=4,
    )


def stack_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, side: str,
                 padded: int) -> torch.Tensor:
    """The stacked route's weight in one pass over W (:mod:`.stacked`): ``side="rows"``, ``[W + s·B A ; s·A ; 0]``
    ((N + padded)×K, the forward's); ``side="cols"``, ``[W + s·B A | s·B | 0]`` (N×(K + padded), dX's). The r rows
    or columns of the scaled factor are followed by zeros up to ``padded`` (>= r); W's dtype, B A accumulated with
    W in fp32 and rounded once, the factor scaled in fp32 and rounded once."""
    N, K, R = _merge_dims(weight, a, b, "stack_weight")
    if side not in ("rows", "cols") or padded < R:
        raise ValueError(f"stack_weight: side is 'rows' or 'cols' and padded >= r ({R}); got {side!r}, {padded}")
    shape = (N + padded, K) if side == "rows" else (N, K + padded)
    out = torch.empty(shape, device=weight.device, dtype=weight.dtype)
    if R == 0:  # no factor: W, then zeros
        out.zero_()
        (out[:N] if side == "rows" else out[:, :K]).copy_(weight)
    elif out.numel():
        _launch_merge(weight, a, b, scale, out, extra=1 if side == "rows" else 2)
    return out


def dropout_keep_mask(seed: int, rows: int, cols: int, p: float, device) -> torch.Tensor:
    """The keep mask (bool, rows×cols) the kernels regenerate from ``seed`` — for references and tests."""
    out = torch.empty((rows, cols), device=device, dtype=torch.int8)
    n = rows * cols
    if n:
        check_kernel_device(out, "the mask")
        _dropout_mask_kernel[(cdiv(n, 1024),)](out, rows, cols, int(seed), float(p), BLOCK=1024)
    return out.bool()

"""Fused LoRA linear layer: forward and backward in Triton, no dtype round trip.

The layer (W frozen, A and B trained, s = alpha / r, drop = inverted dropout on the LoRA input)::

    Y = X Wᵀ + b + s · (drop(X) Aᵀ) Bᵀ          X: M×K, W: N×K, A: r×K, B: N×r, Y: M×N

We fold the scale into the two rank-r products the layer keeps, so every later formula is free of ``s``::

    P = s · drop(X) Aᵀ          (M×r, saved for backward)
    Y = X Wᵀ + b + P Bᵀ         (one GEMM; the rank-r term is an extra depth-r step of its K loop)

Backward, given dY (M×N)::

    Q  = s · dY B               (M×r)
    dB = dYᵀ P                  (N×r)
    dA = Qᵀ drop(X)             (r×K; the dropout mask is regenerated from the seed, never stored)
    dX = dY W + (Q A) ⊙ keep/(1-p)   (one GEMM; the rank-r term again rides at the end of its loop)

Saved for backward: X, P (M×r), and the parameters. Nothing else of size M×K, no fp32 copy of X.
The input stays in its dtype end to end (bf16, fp16 or fp32); the tensor cores accumulate in fp32 and
each output is rounded once.

Three Triton kernels do the work, each reused by :mod:`lora_lab.kernels.lora_shared_input`:

* ``_rank_projection_kernel``  out = scale · drop(In) Mat       (M×D @ D×r, memory-bound, reads In once)
* ``_rank_reduction_kernel``   out = Lᵀ drop(In)                (r×M @ M×D, split over M, fp32 partials)
* ``_lora_gemm_kernel``        out = Σ_seg In_seg Mat_seg + bias + (L Rt) [⊙ dropout]   (the big GEMM;
  ``_lora_gemm_tma_kernel`` is the same GEMM reading its operands through TMA descriptors when they are
  row-major and 16-byte aligned — the usual case on Hopper)

Dropout mask: keep(m, k) = rand(seed, m·K + k) ≥ p, the same Philox stream in every kernel that needs it.

Switches (environment, read at call time): ``LORA_LAB_GEMM`` = auto | tma | pointer; ``LORA_LAB_OVERLAP`` = auto |
0 | 1 runs the memory-bound dA/dB reductions on a side CUDA stream while the dX GEMM runs (see :func:`side_stream`); ``LORA_LAB_FUSE_QDB=1`` computes
Q and dB in one pass over dY (fp32 atomics: dB's summation order is then not deterministic);
``LORA_LAB_AUTOTUNE=0`` keeps one tile configuration (quick test runs); ``LORA_LAB_DISPATCH`` = auto | triton |
cublas picks the engine per call (see :func:`engine_for`); ``LORA_LAB_BASE_GEMM`` = triton | cublas picks who runs the
big GEMM on the Triton engine (see :func:`base_gemm_engine`).

Engine dispatch (measured on an H200, bf16, first GPU run): every Triton launch costs host time (argument
binding, autotuner lookup, TMA descriptors) that cuBLAS calls do not, and the backward makes four of them. When
the GEMMs are small the GPU finishes before the host has launched the next kernel, and the fused path was
slower than chained cuBLAS calls: at M=8192, K=N=4096, r=16 fused forward+backward took 1.50 ms against 0.91 ms
chained (the forward alone was faster fused: 0.41 vs 0.45 ms), and a 24-layer hidden-896 model's training
step took 219 ms fused against 142 ms for PEFT. So below a size threshold the same math runs as cuBLAS calls
(:func:`engine_for`); the saved tensors (X and P) are the same for both engines, so forward and backward
choose independently.
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl
import triton.testing

__all__ = [
    "FusedLoRALinearFunction",
    "fused_lora_linear",
    "lora_linear_reference",
    "lora_linear_unfused",
    "dropout_keep_mask",
    "SUPPORTED_DTYPES",
    "engine_for",
    "base_gemm_engine",
    "triton_engine",
]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def running_in_interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ----------------------------------------------------------------------------------------------
# Autotune configurations: a handful of Hopper-friendly tiles on the GPU, one tiny tile in the
# interpreter (which proves correctness, not speed, and is slow per program).
# ----------------------------------------------------------------------------------------------
def _gemm_configs():
    if running_in_interpreter():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}, num_warps=4)]
    return [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    ]


def _skinny_configs():
    if running_in_interpreter():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_D": 32}, num_warps=4)]
    return [
        triton.Config({"BLOCK_M": 64, "BLOCK_D": 128}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_D": 64}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_D": 128}, num_warps=8, num_stages=3),
    ]


def _tuning_bench(kernel_call, quantiles):
    # short autotuning runs: a few configs per shape, each timed over ~25 ms
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


_SHARED_MEMORY_BUDGET = 200 * 1024  # bytes per program; Hopper allows 227 KiB


def _prune_configs(configs, named_args, **kwargs):
    """Drop tiles whose pipelined operand buffers overflow shared memory for this dtype (fp32 needs smaller
    tiles than bf16); ``LORA_LAB_AUTOTUNE=0`` keeps only the first survivor (quick test runs)."""
    if running_in_interpreter():
        return configs
    ref = named_args.get("in0_ptr", named_args.get("in_ptr"))
    if ref is None:  # the TMA GEMM: its operands arrive as descriptors over a tensor (``base``)
        ref = getattr(named_args.get("in0_desc"), "base", None)
    elsize = ref.element_size() if hasattr(ref, "element_size") else 2
    block_r = kwargs.get("BLOCK_R", 16)
    kept = []
    for c in configs:
        kw = c.kwargs
        if "BLOCK_N" in kw:  # the GEMM: In tile BM×BK and Mat tile BK×BN per stage
            tile = kw["BLOCK_M"] * kw["BLOCK_K"] + kw["BLOCK_K"] * kw["BLOCK_N"]
        else:  # the skinny kernels: In tile BM×BD and a rank tile BD×BR (or BR×BM) per stage
            tile = kw["BLOCK_M"] * kw["BLOCK_D"] + max(kw["BLOCK_D"], kw["BLOCK_M"]) * block_r
        if tile * elsize * max(c.num_stages, 1) <= _SHARED_MEMORY_BUDGET:
            kept.append(c)
    if not kept:  # fp32 with wide tiles: a small safe tile
        first = dict(configs[0].kwargs)
        if "BLOCK_N" in first:
            first.update(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32)
        else:
            first.update(BLOCK_M=64, BLOCK_D=64)
        kept = [triton.Config(first, num_warps=4, num_stages=2, pre_hook=configs[0].pre_hook)]
    if os.environ.get("LORA_LAB_AUTOTUNE", "1") == "0":
        kept = kept[:1]
    return kept


def _autotune(configs, key, reset_to_zero=None):
    import inspect

    kwargs = {"prune_configs_by": {"early_config_prune": _prune_configs}, "reset_to_zero": reset_to_zero}
    if "do_bench" in inspect.signature(triton.autotune).parameters:
        kwargs["do_bench"] = _tuning_bench
    return triton.autotune(configs=configs, key=key, **kwargs)


def _m_bucket(m: int) -> int:
    """Autotune key for the row count: its power-of-two bucket, so every sequence length does not re-tune."""
    return 1 << max(0, (max(m, 1) - 1).bit_length())


def _rank_block(r: int, cap: int = 64) -> int:
    """Width of the rank tile: a power of two, at least 16 (the smallest tl.dot), at most ``cap``."""
    return min(max(16, triton.next_power_of_2(max(r, 1))), cap)


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs get true fp32 products (like torch.matmul with TF32 off); 16-bit types ignore this.
    return "ieee" if dtype == torch.float32 else "tf32"


# ----------------------------------------------------------------------------------------------
# Kernel 1: out[M, r] = scale · drop(In)[M, D] @ Mat[D, r]
#   forward  P = s · drop(X) Aᵀ   (Mat = Aᵀ through strides)
#   backward Q = s · dY B         (Mat = B)
# One program owns BLOCK_M rows and all (up to BLOCK_R) rank columns, so In is read once.
# ----------------------------------------------------------------------------------------------
@_autotune(_skinny_configs(), key=["M_BUCKET", "D", "R"])
@triton.jit
def _rank_projection_kernel(
    in_ptr, stride_im, stride_id,
    mat_ptr, stride_md, stride_mr,
    out_ptr, stride_om, stride_or,
    M, D, R, M_BUCKET,
    scale, col_scale_ptr, seed, p_drop, keep_scale,
    HAS_COL_SCALE: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
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
@_autotune(_skinny_configs(), key=["M_BUCKET", "D", "R"])
@triton.jit
def _rank_reduction_kernel(
    l_ptr, stride_lm, stride_lr,
    in_ptr, stride_im, stride_id,
    partial_ptr, stride_ps, stride_pr, stride_pd,
    M, D, R, M_BUCKET, rows_per_split,
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
# Kernel 2b (experimental, LORA_LAB_FUSE_QDB=1): Q and dB from ONE pass over dY.
#   Q[m, :]  = s · Σ_n dY[m, n] B[n, :]        (reduction over N: stays inside the program)
#   dBᵀ[:, n] += Σ_{m in block} P[m, :]ᵀ dY[m, n]  (reduction over M: fp32 atomic adds across programs)
# Saves one read of dY; the price is a non-deterministic summation order for dB.
# ----------------------------------------------------------------------------------------------
@_autotune(_skinny_configs(), key=["M_BUCKET", "D", "R"], reset_to_zero=["dbt_ptr"])
@triton.jit
def _q_and_db_kernel(
    dy_ptr, stride_ym, stride_yn,
    b_ptr, stride_bn, stride_br,
    p_ptr, stride_pm, stride_pr,
    q_ptr, stride_qm, stride_qr,
    dbt_ptr, stride_dr, stride_dn,
    M, D, R, M_BUCKET, scale,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
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
        bt = tl.load(b_ptr + d[:, None] * stride_bn + ranks[None, :] * stride_br,
                     mask=(d[:, None] < D) & rank_ok[None, :], other=0.0)
        q_acc = tl.dot(dy, bt, q_acc, input_precision=PRECISION)
        part = tl.dot(pt, dy, input_precision=PRECISION)  # [R, BLOCK_D]
        tl.atomic_add(dbt_ptr + ranks[:, None] * stride_dr + d[None, :] * stride_dn, part,
                      mask=rank_ok[:, None] & (d[None, :] < D), sem="relaxed")
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_qm + ranks[None, :] * stride_qr,
             (q_acc * scale).to(q_ptr.dtype.element_ty), mask=row_ok[:, None] & rank_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Kernel 3: the GEMM with the rank-r term folded in.
#   out[M, N] = Σ_seg In_seg[M, D_seg] @ Mat_seg[D_seg, N]  + bias[N]  +  (L[M, r] @ Rt[r, N]) [⊙ keep/(1-p)]
#   forward: one segment, In = X, Mat = Wᵀ, L = P, Rt = Bᵀ, bias
#   dX:      In_seg = dY_seg, Mat_seg = W_seg (several for the shared-input op), L = Q, Rt = A, dropout mask
# The rank-r term costs one more MMA of depth r after the main loop (r/K extra work, ~0.4% at r=16,
# K=4096) and no extra pass over Y. A rank-range table restricts it to the ranks that touch this tile's
# columns (block-diagonal B of the shared-input op).
# ----------------------------------------------------------------------------------------------
@triton.jit
def _accumulate_segment(acc, in_ptr, stride_im, stride_ik, D, mat_ptr, stride_wk, stride_wn, rows, cols,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # acc[m, n] += Σ_k In[m, k] · Mat[k, n]; rows/cols are already wrapped into range (stores are masked)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = in_ptr + rows.to(tl.int64)[:, None] * stride_im + ks[None, :] * stride_ik
    b_ptrs = mat_ptr + ks[:, None] * stride_wk + cols.to(tl.int64)[None, :] * stride_wn
    for k0 in range(0, tl.cdiv(D, BLOCK_K)):
        k_left = D - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=ks[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=ks[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ik
        b_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit
def _finish_tile(acc, rows, cols, rows_true, cols_true, M, N, out_ptr, stride_om, stride_on,
                 l_ptr, stride_lm, stride_lr, rt_ptr, stride_rr, stride_rn, R, rank_lo_ptr, rank_hi_ptr, bias_ptr,
                 seed, p_drop, keep_scale, HAS_LOWRANK: tl.constexpr, HAS_RANK_RANGE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # epilogue shared by both GEMM kernels: rank-r step, bias, store (rows/cols wrapped into range)
    if HAS_LOWRANK:
        # ranks that can touch this tile: all of them, or (block-diagonal B) the range of the segments it spans
        if HAS_RANK_RANGE:
            r_lo = tl.min(tl.load(rank_lo_ptr + cols), axis=0)
            r_hi = tl.max(tl.load(rank_hi_ptr + cols), axis=0)
        else:
            r_lo = 0
            r_hi = R
        rk = tl.arange(0, BLOCK_R)
        if DROPOUT:
            low = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(r_lo, r_hi, BLOCK_R):
            rr = r0 + rk
            l = tl.load(l_ptr + rows.to(tl.int64)[:, None] * stride_lm + rr[None, :] * stride_lr,
                        mask=rr[None, :] < r_hi, other=0.0)
            rt = tl.load(rt_ptr + rr[:, None] * stride_rr + cols.to(tl.int64)[None, :] * stride_rn,
                         mask=rr[:, None] < r_hi, other=0.0)
            if DROPOUT:
                low = tl.dot(l, rt, low, input_precision=PRECISION)
            else:
                # the extra depth-r step: acc += L Rt
                acc = tl.dot(l, rt, acc, input_precision=PRECISION)
        if DROPOUT:
            # dX's rank-r term goes through the forward's dropout: ⊙ keep(m, k) / (1 - p)
            keep = tl.rand(seed, rows_true[:, None] * N + cols_true[None, :]) >= p_drop
            acc += tl.where(keep, low * keep_scale, 0.0)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]

    out_mask = (rows_true[:, None] < M) & (cols_true[None, :] < N)
    tl.store(out_ptr + rows_true.to(tl.int64)[:, None] * stride_om + cols_true[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program in grouped order: GROUP_M row-blocks share each column block while it
    sits in L2 (both GEMM kernels)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@_autotune(_gemm_configs(), key=["M_BUCKET", "N", "D0", "D1", "D2", "D3", "R"])
@triton.jit
def _lora_gemm_kernel(
    out_ptr, stride_om, stride_on,
    M, N, M_BUCKET,
    in0_ptr, s_i0m, s_i0k, D0, mat0_ptr, s_w0k, s_w0n,
    in1_ptr, s_i1m, s_i1k, D1, mat1_ptr, s_w1k, s_w1n,
    in2_ptr, s_i2m, s_i2k, D2, mat2_ptr, s_w2k, s_w2n,
    in3_ptr, s_i3m, s_i3k, D3, mat3_ptr, s_w3k, s_w3n,
    l_ptr, stride_lm, stride_lr, rt_ptr, stride_rr, stride_rn, R,
    rank_lo_ptr, rank_hi_ptr, bias_ptr,
    seed, p_drop, keep_scale,
    NUM_SEG: tl.constexpr, HAS_LOWRANK: tl.constexpr, HAS_RANK_RANGE: tl.constexpr, HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rows_true = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols_true = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = rows_true % M  # wrapped: loads need no row/col mask, the store is masked
    cols = cols_true % N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # main loop(s): acc = Σ_seg In_seg Mat_seg
    acc = _accumulate_segment(acc, in0_ptr, s_i0m, s_i0k, D0, mat0_ptr, s_w0k, s_w0n, rows, cols, BLOCK_K, PRECISION)
    if NUM_SEG > 1:
        acc = _accumulate_segment(acc, in1_ptr, s_i1m, s_i1k, D1, mat1_ptr, s_w1k, s_w1n, rows, cols, BLOCK_K, PRECISION)
    if NUM_SEG > 2:
        acc = _accumulate_segment(acc, in2_ptr, s_i2m, s_i2k, D2, mat2_ptr, s_w2k, s_w2n, rows, cols, BLOCK_K, PRECISION)
    if NUM_SEG > 3:
        acc = _accumulate_segment(acc, in3_ptr, s_i3m, s_i3k, D3, mat3_ptr, s_w3k, s_w3n, rows, cols, BLOCK_K, PRECISION)

    _finish_tile(acc, rows, cols, rows_true, cols_true, M, N, out_ptr, stride_om, stride_on,
                 l_ptr, stride_lm, stride_lr, rt_ptr, stride_rr, stride_rn, R, rank_lo_ptr, rank_hi_ptr, bias_ptr,
                 seed, p_drop, keep_scale, HAS_LOWRANK, HAS_RANK_RANGE, HAS_BIAS, DROPOUT, PRECISION, BLOCK_R,
                 BLOCK_M, BLOCK_N)


# The same GEMM reading its two big operands through TMA descriptors (Hopper's tensor memory accelerator):
# tiles arrive by bulk copy, out-of-range rows/columns read as zero, so the loop has no masks. Used when
# every operand is row-major with 16-byte aligned rows (the usual case); the pointer kernel covers the rest.
def _set_tma_block_shapes(nargs):
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    mat_nk = nargs.get("MAT_NK", True)
    for i in range(4):
        nargs[f"in{i}_desc"].block_shape = [bm, bk]
        nargs[f"mat{i}_desc"].block_shape = [bn, bk] if mat_nk else [bk, bn]


def _tma_gemm_configs():
    return [triton.Config(dict(c.kwargs), num_warps=c.num_warps, num_stages=c.num_stages,
                          pre_hook=_set_tma_block_shapes) for c in _gemm_configs()]


@triton.jit
def _accumulate_segment_tma(acc, in_desc, mat_desc, D, off_m, off_n, MAT_NK: tl.constexpr,
                            BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # acc[m, n] += Σ_k In[m, k] · Mat[k, n]; Mat is stored N×D (MAT_NK, e.g. W for Y = X Wᵀ) or D×N (W for dX)
    for k0 in range(0, tl.cdiv(D, BLOCK_K)):
        a = in_desc.load([off_m, k0 * BLOCK_K])
        if MAT_NK:
            b = tl.trans(mat_desc.load([off_n, k0 * BLOCK_K]))
        else:
            b = mat_desc.load([k0 * BLOCK_K, off_n])
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@_autotune(_tma_gemm_configs(), key=["M_BUCKET", "N", "D0", "D1", "D2", "D3", "R"])
@triton.jit
def _lora_gemm_tma_kernel(
    out_ptr, stride_om, stride_on,
    M, N, M_BUCKET,
    in0_desc, mat0_desc, D0, in1_desc, mat1_desc, D1, in2_desc, mat2_desc, D2, in3_desc, mat3_desc, D3,
    l_ptr, stride_lm, stride_lr, rt_ptr, stride_rr, stride_rn, R,
    rank_lo_ptr, rank_hi_ptr, bias_ptr,
    seed, p_drop, keep_scale,
    NUM_SEG: tl.constexpr, MAT_NK: tl.constexpr, HAS_LOWRANK: tl.constexpr, HAS_RANK_RANGE: tl.constexpr,
    HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # main loop(s): acc = Σ_seg In_seg Mat_seg
    acc = _accumulate_segment_tma(acc, in0_desc, mat0_desc, D0, off_m, off_n, MAT_NK, BLOCK_K, PRECISION)
    if NUM_SEG > 1:
        acc = _accumulate_segment_tma(acc, in1_desc, mat1_desc, D1, off_m, off_n, MAT_NK, BLOCK_K, PRECISION)
    if NUM_SEG > 2:
        acc = _accumulate_segment_tma(acc, in2_desc, mat2_desc, D2, off_m, off_n, MAT_NK, BLOCK_K, PRECISION)
    if NUM_SEG > 3:
        acc = _accumulate_segment_tma(acc, in3_desc, mat3_desc, D3, off_m, off_n, MAT_NK, BLOCK_K, PRECISION)

    rows_true = off_m + tl.arange(0, BLOCK_M)
    cols_true = off_n + tl.arange(0, BLOCK_N)
    _finish_tile(acc, rows_true % M, cols_true % N, rows_true, cols_true, M, N, out_ptr, stride_om, stride_on,
                 l_ptr, stride_lm, stride_lr, rt_ptr, stride_rr, stride_rn, R, rank_lo_ptr, rank_hi_ptr, bias_ptr,
                 seed, p_drop, keep_scale, HAS_LOWRANK, HAS_RANK_RANGE, HAS_BIAS, DROPOUT, PRECISION, BLOCK_R,
                 BLOCK_M, BLOCK_N)


@triton.jit
def _dropout_mask_kernel(out_ptr, M, D, seed, p_drop, BLOCK: tl.constexpr):
    # keep(m, d) = rand(seed, m·D + d) ≥ p — the same stream the three kernels above draw from
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * D
    keep = tl.rand(seed, offs) >= p_drop
    tl.store(out_ptr + offs, keep.to(tl.int8), mask=ok)


# ----------------------------------------------------------------------------------------------
# Launch wrappers (host side): shapes, strides, grids.
# ----------------------------------------------------------------------------------------------
def _check_kernel_device(t: torch.Tensor, what: str) -> None:
    if t.device.type != "cuda" and not running_in_interpreter():
        raise RuntimeError(
            f"fused LoRA kernels need {what} on a CUDA device (got {t.device}); on CPU set TRITON_INTERPRET=1 "
            "before importing triton to run them in the interpreter"
        )


def _dropout_args(p: float, seed: int | None):
    if p > 0.0:
        if seed is None:
            raise ValueError("dropout > 0 needs a seed")
        return True, int(seed), float(p), 1.0 / (1.0 - p)
    return False, 0, 0.0, 1.0


def rank_projection(inp: torch.Tensor, mat: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                    dropout_p: float = 0.0, seed: int | None = None,
                    col_scale: torch.Tensor | None = None) -> torch.Tensor:
    """out[M, r] = scale · drop(inp)[M, D] @ mat[D, r] [· col_scale[r]] (``mat`` may be a transposed view)."""
    M, D = inp.shape
    R = mat.shape[1]
    if out is None:
        out = torch.empty((M, R), device=inp.device, dtype=inp.dtype)
    if M == 0 or R == 0:
        return out
    dropout, seed_, p_, keep_scale = _dropout_args(dropout_p, seed)
    block_r = _rank_block(R, cap=128)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(R, block_r))  # noqa: E731
    _rank_projection_kernel[grid](
        inp, inp.stride(0), inp.stride(1),
        mat, mat.stride(0), mat.stride(1),
        out, out.stride(0), out.stride(1),
        M, D, R, _m_bucket(M),
        float(scale), col_scale if col_scale is not None else out, seed_, p_, keep_scale,
        HAS_COL_SCALE=col_scale is not None, DROPOUT=dropout, PRECISION=_precision(inp.dtype), BLOCK_R=block_r,
    )
    return out


def _num_row_splits(M: int, D: int, R: int, block_r: int) -> int:
    # enough programs to fill the GPU (≈ 2 waves of 132 SMs) without a large partial buffer
    if running_in_interpreter():
        return 2 if M >= 32 else 1
    programs_per_split = triton.cdiv(D, 64) * triton.cdiv(R, block_r)
    splits = triton.cdiv(264, max(programs_per_split, 1))
    return int(max(1, min(splits, 32, triton.cdiv(M, 128))))


def q_and_db(dy: torch.Tensor, b: torch.Tensor, p: torch.Tensor, scale: float):
    """(Q = scale · dY B in dY's dtype, fp32 dBᵀ = Pᵀ dY) from one pass over dY (atomic adds for dB)."""
    M, D = dy.shape
    R = b.shape[1]
    q = torch.empty((M, R), device=dy.device, dtype=dy.dtype)
    dbt = torch.zeros((R, D), device=dy.device, dtype=torch.float32)
    if M == 0 or R == 0:
        return q, dbt
    block_r = _rank_block(R, cap=128)
    if block_r < R:
        raise ValueError("q_and_db handles r <= 128")
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]),)  # noqa: E731
    _q_and_db_kernel[grid](
        dy, dy.stride(0), dy.stride(1), b, b.stride(0), b.stride(1), p, p.stride(0), p.stride(1),
        q, q.stride(0), q.stride(1), dbt, dbt.stride(0), dbt.stride(1),
        M, D, R, _m_bucket(M), float(scale),
        PRECISION=_precision(dy.dtype), BLOCK_R=block_r,
    )
    return q, dbt


def rank_reduction(l: torch.Tensor, inp: torch.Tensor, dropout_p: float = 0.0,
                   seed: int | None = None) -> torch.Tensor:
    """fp32 out[r, D] = l[M, r]ᵀ @ drop(inp)[M, D], summed over M in a few deterministic slices."""
    M, R = l.shape
    D = inp.shape[1]
    if M == 0 or R == 0 or D == 0:
        return torch.zeros((R, D), device=inp.device, dtype=torch.float32)
    dropout, seed_, p_, keep_scale = _dropout_args(dropout_p, seed)
    block_r = _rank_block(R, cap=64)
    splits = _num_row_splits(M, D, R, block_r)
    rows_per_split = triton.cdiv(triton.cdiv(M, splits), 128) * 128 if not running_in_interpreter() \
        else triton.cdiv(M, splits)
    splits = triton.cdiv(M, rows_per_split)
    partial = torch.empty((splits, R, D), device=inp.device, dtype=torch.float32)
    grid = lambda meta: (triton.cdiv(D, meta["BLOCK_D"]), triton.cdiv(R, block_r), splits)  # noqa: E731
    _rank_reduction_kernel[grid](
        l, l.stride(0), l.stride(1),
        inp, inp.stride(0), inp.stride(1),
        partial, partial.stride(0), partial.stride(1), partial.stride(2),
        M, D, R, _m_bucket(M), rows_per_split,
        seed_, p_, keep_scale,
        DROPOUT=dropout, PRECISION=_precision(inp.dtype), BLOCK_R=block_r,
    )
    return partial[0] if splits == 1 else partial.sum(0)


# dtype → error text once a TMA launch failed for that dtype: the pointer kernel from then on (per dtype, so an
# fp32 tile that overflows shared memory does not take TMA away from bf16)
_TMA_STATE: dict = {}


def _tma_layout(segments):
    """'nk' / 'kn' when every (in, mat) pair can be read through TMA descriptors, else None."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401  (triton >= 3.4)
    except ImportError:
        return None

    def rows_ok(t, stride):  # row-major rows: 16-byte aligned base and row stride
        return t.data_ptr() % 16 == 0 and (stride * t.element_size()) % 16 == 0 and stride > 0

    layouts = set()
    for inp, mat in segments:
        if inp.stride(1) != 1 or not rows_ok(inp, inp.stride(0)):
            return None
        if mat.stride(0) == 1 and mat.shape[1] > 1 and rows_ok(mat, mat.stride(1)):
            layouts.add("nk")  # mat = Wᵀ of a row-major W (N×D)
        elif mat.stride(1) == 1 and rows_ok(mat, mat.stride(0)):
            layouts.add("kn")  # mat = a row-major D×N block
        else:
            return None
    return layouts.pop() if len(layouts) == 1 else None


def gemm_implementation() -> str:
    """'tma', 'pointer' or 'auto' (the default) from ``LORA_LAB_GEMM``."""
    return os.environ.get("LORA_LAB_GEMM", "auto")


def lora_gemm(out: torch.Tensor, segments, low: torch.Tensor | None = None, rt: torch.Tensor | None = None,
              bias: torch.Tensor | None = None, rank_lo: torch.Tensor | None = None,
              rank_hi: torch.Tensor | None = None, dropout_p: float = 0.0, seed: int | None = None,
              impl: str | None = None) -> torch.Tensor:
    """out[M, N] = Σ in_s @ mat_s + bias + (low @ rt) [⊙ keep/(1-p)], one Triton launch.

    ``segments``: list of 1 to 4 pairs (in_s [M, D_s], mat_s [D_s, N]), any strides. ``impl``: 'tma' (descriptor
    loads; needs row-major, 16-byte aligned operands), 'pointer', or 'auto' (TMA when the layout allows it).
    """
    M, N = out.shape
    if M == 0 or N == 0:
        return out
    if not 1 <= len(segments) <= 4:
        raise ValueError(f"lora_gemm takes 1 to 4 input segments, got {len(segments)}")
    has_low = low is not None and low.shape[1] > 0
    R = low.shape[1] if has_low else 0
    dropout, seed_, p_, keep_scale = _dropout_args(dropout_p, seed)
    if dropout and not has_low:
        dropout = False
    dummy = out
    tail = [
        low if has_low else dummy, low.stride(0) if has_low else 0, low.stride(1) if has_low else 0,
        rt if has_low else dummy, rt.stride(0) if has_low else 0, rt.stride(1) if has_low else 0, R,
        rank_lo if rank_lo is not None else dummy, rank_hi if rank_hi is not None else dummy,
        bias if bias is not None else dummy,
        seed_, p_, keep_scale,
    ]
    flags = dict(NUM_SEG=len(segments), HAS_LOWRANK=has_low, HAS_RANK_RANGE=rank_lo is not None,
                 HAS_BIAS=bias is not None, DROPOUT=dropout, PRECISION=_precision(out.dtype),
                 BLOCK_R=_rank_block(R, cap=64))
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731

    impl = impl or gemm_implementation()
    broken = _TMA_STATE.get(out.dtype)
    # auto: TMA for 16-bit types only (fp32 is the correctness path; its tiles are the pointer kernel's)
    want_tma = impl == "tma" or (impl == "auto" and out.dtype != torch.float32)
    layout = _tma_layout(segments) if want_tma and broken is None else None
    if impl == "tma" and layout is None:
        raise ValueError("lora_gemm: impl='tma' needs row-major, 16-byte aligned operands "
                         f"(or TMA was disabled for {out.dtype}: {broken})")
    if layout is not None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        descs = []
        for inp, mat in segments:
            d_in = TensorDescriptor(inp, [M, inp.shape[1]], [inp.stride(0), 1], [16, 16])
            if layout == "nk":  # the row-major N×D matrix whose transpose is ``mat``
                d_mat = TensorDescriptor(mat, [N, mat.shape[0]], [mat.stride(1), 1], [16, 16])
            else:
                d_mat = TensorDescriptor(mat, [mat.shape[0], N], [mat.stride(0), 1], [16, 16])
            descs += [d_in, d_mat, inp.shape[1]]
        for _ in range(4 - len(segments)):
            descs += [descs[0], descs[1], 0]
        try:
            _lora_gemm_tma_kernel[grid](out, out.stride(0), out.stride(1), M, N, _m_bucket(M), *descs, *tail,
                                        MAT_NK=layout == "nk", **flags)
            return out
        except Exception as err:  # a Triton build without working TMA: fall back once, loudly
            if impl == "tma":
                raise
            import warnings

            _TMA_STATE[out.dtype] = f"{type(err).__name__}: {err}"[:300]
            warnings.warn(f"lora_lab: TMA GEMM failed for {out.dtype} ({_TMA_STATE[out.dtype]}); using the "
                          "pointer kernel", RuntimeWarning, stacklevel=2)

    seg_args = []
    for inp, mat in segments:
        seg_args += [inp, inp.stride(0), inp.stride(1), inp.shape[1], mat, mat.stride(0), mat.stride(1)]
    first = seg_args[:7]
    for _ in range(4 - len(segments)):
        seg_args += [first[0], 0, 0, 0, first[4], 0, 0]
    _lora_gemm_kernel[grid](out, out.stride(0), out.stride(1), M, N, _m_bucket(M), *seg_args, *tail, **flags)
    return out


def dropout_keep_mask(seed: int, rows: int, cols: int, p: float, device) -> torch.Tensor:
    """The keep mask (bool, rows×cols) the kernels regenerate from ``seed`` — for references and tests."""
    out = torch.empty((rows, cols), device=device, dtype=torch.int8)
    n = rows * cols
    if n:
        _check_kernel_device(out, "the mask")
        _dropout_mask_kernel[(triton.cdiv(n, 1024),)](out, rows, cols, int(seed), float(p), BLOCK=1024)
    return out.bool()


# ----------------------------------------------------------------------------------------------
# Argument checks shared with the shared-input op: bad input → an error naming the problem.
# ----------------------------------------------------------------------------------------------
def check_lora_args(x, weight, bias, lora_A, lora_B, name="fused_lora_linear"):
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: input dtype {x.dtype} not supported (bf16, fp16, fp32)")
    if weight.dim() != 2:
        raise ValueError(f"{name}: weight must be 2-D (out_features × in_features), got shape {tuple(weight.shape)}")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"{name}: input's last dimension {x.shape[-1]} != weight in_features {K}")
    if weight.dtype != x.dtype:
        raise TypeError(f"{name}: weight dtype {weight.dtype} != input dtype {x.dtype}; cast the base layer "
                        "(these kernels never round-trip the input through another dtype)")
    if lora_A.dim() != 2 or lora_A.shape[1] != K:
        raise ValueError(f"{name}: lora_A must be r × {K}, got {tuple(lora_A.shape)}")
    r = lora_A.shape[0]
    if lora_B.dim() != 2 or lora_B.shape != (N, r):
        raise ValueError(f"{name}: lora_B must be {N} × {r}, got {tuple(lora_B.shape)}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"{name}: bias must have shape ({N},), got {tuple(bias.shape)}")
    for t, what in ((weight, "weight"), (lora_A, "lora_A"), (lora_B, "lora_B"), (bias, "bias")):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: {what} is on {t.device} but the input is on {x.device}")
    for t, what in ((lora_A, "lora_A"), (lora_B, "lora_B"), (bias, "bias")):
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: {what} dtype {t.dtype} not supported")
    _check_kernel_device(x, "the input")


# ----------------------------------------------------------------------------------------------
# Overlap: the memory-bound rank reductions (dA, dB) on a second CUDA stream while the compute-bound dX
# GEMM runs (LORA_LAB_OVERLAP = auto | 0 | 1). ``auto`` is each op's default, from two H200 runs (bf16, fwd+bwd):
#   GatedDeltaNet group, seq 32768: next to cuBLAS GEMMs 14.58 vs 15.37 ms, then 14.85 vs 14.94 (a gain);
#   next to the Triton GEMM 16.22 vs 15.67, then 16.85 vs 16.45 (a loss)
#   single projection, M=32768, next to the Triton GEMM: level in the first run (3.19 vs 3.20 ms at 4096², r=16),
#   faster in 5 of the 6 cells of the second (3.18 vs 3.26 ms there) — within run-to-run noise, so not yet on
# so the shared-input op overlaps when its GEMMs are cuBLAS's, the single projection does not (yet).
# ----------------------------------------------------------------------------------------------
_SIDE_STREAMS: dict = {}


def _switch(name: str, allowed: tuple, default: str) -> str:
    mode = os.environ.get(name, "auto")
    if mode not in ("auto", *allowed):
        raise ValueError(f"{name} must be auto, {' or '.join(allowed)}, got {mode!r}")
    return default if mode == "auto" else mode


def side_stream(device: torch.device, default: bool = False):
    """The side stream for ``device`` when overlap is on (CUDA only), else None; ``default`` is the op's
    choice under ``LORA_LAB_OVERLAP=auto``."""
    if _switch("LORA_LAB_OVERLAP", ("0", "1"), "1" if default else "0") != "1" or device.type != "cuda":
        return None
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[key]


def join_side_stream(side, main, *made_on_side) -> None:
    """Main stream waits for the side stream; tensors made there are marked as used by main."""
    main.wait_stream(side)
    for t in made_on_side:
        if t is not None:
            t.record_stream(main)


# ----------------------------------------------------------------------------------------------
# Engine dispatch: Triton kernels for large GEMMs, the same math as cuBLAS calls for small ones.
# ----------------------------------------------------------------------------------------------
# Thresholds on the GEMM volume M·K·N, from the H200 runs (bf16, r = 16 and 64; fwd / fwd+bwd ms):
#   forward  : at 8192·4096·4096 ≈ 1.4e11 Triton and chained cuBLAS were level in the first run (0.41 vs 0.45)
#              and not in the fourth (r=16: 0.56 vs 0.43; r=64: 0.41 vs 0.43), so that size now stays on cuBLAS;
#              from 8192·4096·12288 ≈ 4.1e11 up the Triton forward is level or faster (1.24–1.27 vs 1.25;
#              8192·12288·4096: 1.10–1.18 vs 1.20)
#   backward : fused slower than chained at M·K·N ≤ 4.1e11 (8192·4096·12288: 1.32 vs 1.11 ms of backward;
#              8192·12288·4096: equal), faster from 5.5e11 up (32768·4096·4096 and above)
FORWARD_TRITON_MIN_VOLUME = 3.0e11
BACKWARD_TRITON_MIN_VOLUME = 5.0e11


def engine_for(M: int, K: int, N: int, device: torch.device, backward: bool = False) -> str:
    """'triton' or 'cublas' for a GEMM of volume M·K·N (``LORA_LAB_DISPATCH`` = auto | triton | cublas).

    In Triton's CPU interpreter (tests) ``auto`` means Triton: the interpreter proves the kernels' correctness.
    """
    mode = os.environ.get("LORA_LAB_DISPATCH", "auto")
    if mode not in ("auto", "triton", "cublas"):
        raise ValueError(f"LORA_LAB_DISPATCH must be auto, triton or cublas, got {mode!r}")
    if mode != "auto":
        return mode
    if device.type != "cuda":
        return "triton"
    threshold = BACKWARD_TRITON_MIN_VOLUME if backward else FORWARD_TRITON_MIN_VOLUME
    return "triton" if float(M) * K * N >= threshold else "cublas"


def base_gemm_engine(default: str = "triton") -> str:
    """Who runs the big GEMM on the Triton engine (``LORA_LAB_BASE_GEMM`` = auto | triton | cublas; ``auto`` is
    ``default``, the op's choice: ``triton`` for one projection, ``cublas`` for the shared-input op).

    ``triton``: one Triton GEMM with the rank-r term as the last step of its K loop. ``cublas``: a Triton pass
    writes the rank-r term (P Bᵀ + b, or Q A) into the output, then cuBLAS adds the base GEMM onto it with
    β = 1 (``addmm_``): the rank-r term rides in cuBLAS's epilogue, and the GEMM is cuBLAS's (faster than the
    Triton GEMM on the H200: 774 vs 664 TFLOP/s), at the price of one M×N write. The backward's dX takes this
    path only without dropout (the mask multiplies the rank-r term alone).

    Measured on the H200 in two runs (bf16, fwd+bwd): one projection at M=32768, 4096², r=16: Triton 3.20 /
    3.26 ms, cuBLAS 3.38 / 3.38 ms (the Triton pass writing the rank-r term takes 0.15 ms, the β = 1 GEMM
    1.41–1.48 vs 1.37–1.39 ms for β = 0); the GatedDeltaNet group at seq 32768: Triton 15.67 / 16.45 ms,
    cuBLAS 15.37 / 14.94 ms, cuBLAS with the side stream 14.58 / 14.85 ms.
    """
    return _switch("LORA_LAB_BASE_GEMM", ("triton", "cublas"), default)


@contextlib.contextmanager
def triton_engine():
    """Run every call inside on the Triton kernels whatever the shape (numerics checks of the kernels)."""
    before = os.environ.get("LORA_LAB_DISPATCH")
    os.environ["LORA_LAB_DISPATCH"] = "triton"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LORA_LAB_DISPATCH", None)
        else:
            os.environ["LORA_LAB_DISPATCH"] = before


def _cublas_forward(x2, weight, bias, a, b, scaling):
    """(Y, P) with P = s · X Aᵀ and Y = X Wᵀ + b + P Bᵀ, as three cuBLAS calls (no dropout)."""
    p = torch.mm(x2, a.t()).mul_(scaling)
    y = torch.addmm(bias, x2, weight.t()) if bias is not None else torch.mm(x2, weight.t())
    y.addmm_(p, b.t())
    return y, p


# ----------------------------------------------------------------------------------------------
# The autograd Function.
# ----------------------------------------------------------------------------------------------
class FusedLoRALinearFunction(torch.autograd.Function):
    """Y = X Wᵀ + b + s·(drop(X) Aᵀ) Bᵀ with W (and b) frozen unless they require grad."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_A, lora_B, scaling, dropout_p, seed):
        K = x.shape[-1]
        N = weight.shape[0]
        x2 = x.reshape(-1, K)  # a view whenever the input's layout allows it
        M = x2.shape[0]
        cdt = x.dtype
        # LoRA weights kept in another dtype (PEFT keeps fp32 adapters) are cast once per call — r×K and
        # N×r, tiny — so the M×K input never leaves its dtype.
        a = lora_A.to(cdt)
        b = lora_B.to(cdt)

        if dropout_p == 0.0 and engine_for(M, K, N, x.device) == "cublas":
            # small GEMMs: the same P and Y from cuBLAS calls (host-bound otherwise, see the module notes)
            y, p = _cublas_forward(x2, weight, bias, a, b, scaling)
        else:
            # P = s · drop(X) Aᵀ          (M×r)
            p = rank_projection(x2, a.t(), scaling, dropout_p=dropout_p, seed=seed)
            y = torch.empty((M, N), device=x.device, dtype=cdt)
            if base_gemm_engine() == "cublas":
                # Y = P Bᵀ + b (Triton, one write), then Y += X Wᵀ (cuBLAS, β = 1)
                lora_gemm(y, [(p, b.t())], bias=bias)
                y.addmm_(x2, weight.t())
            else:
                # Y = X Wᵀ + b + P Bᵀ     (one GEMM, rank-r step at the end of its K loop)
                lora_gemm(y, [(x2, weight.t())], low=p, rt=b.t(), bias=bias)

        ctx.save_for_backward(x2, p, weight, bias, lora_A, lora_B)
        ctx.scaling, ctx.dropout_p, ctx.seed = scaling, dropout_p, seed
        ctx.x_shape = x.shape
        return y.reshape(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, dy):
        x2, p, weight, bias, lora_A, lora_B = ctx.saved_tensors
        N, K = weight.shape
        dy2 = dy.reshape(-1, N)
        cdt = x2.dtype
        if dy2.dtype != cdt:
            dy2 = dy2.to(cdt)
        a = lora_A.to(cdt)
        b = lora_B.to(cdt)
        need_x, need_w, need_b, need_a, need_lb = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                                   ctx.needs_input_grad[2], ctx.needs_input_grad[3],
                                                   ctx.needs_input_grad[4])
        dx = dw = dbias = da = db = None

        if ctx.dropout_p == 0.0 and engine_for(x2.shape[0], K, N, dy2.device, backward=True) == "cublas":
            # small GEMMs: the same formulas as cuBLAS calls (the Triton launches would leave the GPU idle)
            q = torch.mm(dy2, b).mul_(ctx.scaling) if (need_x or need_a) else None  # Q = s · dY B
            if need_lb:
                db = torch.mm(dy2.t(), p).to(lora_B.dtype)  # dB = dYᵀ P
            if need_a:
                da = torch.mm(q.t(), x2).to(lora_A.dtype)  # dA = Qᵀ X
            if need_x:
                dx = torch.mm(dy2, weight).addmm_(q, a).reshape(ctx.x_shape)  # dX = dY W + Q A
            if need_w:
                dw = (dy2.t() @ x2).to(weight.dtype)
            if need_b:
                dbias = dy2.sum(0, dtype=torch.float32).to(bias.dtype)
            return dx, dw, dbias, da, db, None, None, None

        # Q = s · dY B               (M×r)
        fused_q_db = need_lb and lora_B.shape[1] <= 128 and os.environ.get("LORA_LAB_FUSE_QDB", "0") == "1"
        if fused_q_db:  # experimental: Q and dB in one pass over dY (atomic, non-deterministic dB)
            q, dbt = q_and_db(dy2, b, p, ctx.scaling)
            db = dbt.t().to(lora_B.dtype)
        else:
            q = rank_projection(dy2, b, ctx.scaling) if (need_x or need_a) else None

        def low_rank_grads():
            grads = [None, db if fused_q_db else None]
            if need_lb and not fused_q_db:
                # dB = dYᵀ P = (Pᵀ dY)ᵀ    (N×r)
                grads[1] = rank_reduction(p, dy2).t().to(lora_B.dtype)
            if need_a:
                # dA = Qᵀ drop(X)          (r×K, mask regenerated from the seed)
                grads[0] = rank_reduction(q, x2, ctx.dropout_p, ctx.seed).to(lora_A.dtype)
            return grads

        # dA and dB only read memory; the dX GEMM is compute-bound: optionally run them side by side
        side = side_stream(dy2.device) if need_x and (need_a or need_lb) else None
        if side is not None:
            main = torch.cuda.current_stream(dy2.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                da, db = low_rank_grads()
        else:
            da, db = low_rank_grads()
        if need_x:
            # dX = dY W + (Q A) ⊙ keep/(1-p)
            dx = torch.empty((dy2.shape[0], K), device=dy2.device, dtype=cdt)
            if ctx.dropout_p == 0.0 and base_gemm_engine() == "cublas":
                # dX = Q A (Triton, one write), then dX += dY W (cuBLAS, β = 1)
                lora_gemm(dx, [(q, a)])
                dx.addmm_(dy2, weight)
            else:
                lora_gemm(dx, [(dy2, weight)], low=q, rt=a, dropout_p=ctx.dropout_p, seed=ctx.seed)
            dx = dx.reshape(ctx.x_shape)
        if side is not None:
            join_side_stream(side, main, da, db)
        if need_w:  # only when the base weight is trained too (not LoRA's usual setting): dW = dYᵀ X
            dw = (dy2.t() @ x2).to(weight.dtype)
        if need_b:
            dbias = dy2.sum(0, dtype=torch.float32).to(bias.dtype)
        return dx, dw, dbias, da, db, None, None, None


def _draw_seed() -> int:
    # from torch's CPU generator: reproducible under torch.manual_seed, and restored by activation
    # checkpointing's RNG-state preservation so a recomputed forward sees the same mask
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def fused_lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_A: torch.Tensor,
                      lora_B: torch.Tensor, scaling: float, dropout_p: float = 0.0, training: bool = True,
                      seed: int | None = None) -> torch.Tensor:
    """Y = X Wᵀ + b + scaling · (dropout(X) lora_Aᵀ) lora_Bᵀ, fused (forward and backward) in Triton.

    ``dropout_p`` applies only when ``training``; the mask comes from ``seed`` (drawn from torch's RNG when
    None) and is regenerated in backward, never stored.
    """
    check_lora_args(x, weight, bias, lora_A, lora_B)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"fused_lora_linear: dropout_p must be in [0, 1), got {dropout_p}")
    p = float(dropout_p) if training else 0.0
    if p > 0.0:
        M = x.numel() // max(x.shape[-1], 1)
        if M * x.shape[-1] >= 2**31:
            raise ValueError("fused_lora_linear: dropout offsets are int32; input has ≥ 2^31 elements")
        if seed is None:
            seed = _draw_seed()
    return FusedLoRALinearFunction.apply(x, weight, bias, lora_A, lora_B, float(scaling), p, seed)


# ----------------------------------------------------------------------------------------------
# Plain-torch references.
# ----------------------------------------------------------------------------------------------
def lora_linear_reference(x, weight, bias, lora_A, lora_B, scaling, keep_mask=None, dropout_p=0.0,
                          dtype=torch.float32):
    """The layer in plain torch, every tensor upcast to ``dtype`` (fp32 or fp64): the numerics yardstick."""
    xr = x.to(dtype)
    xd = xr if keep_mask is None else xr * keep_mask.reshape(xr.shape).to(dtype) / (1.0 - dropout_p)
    y = xr @ weight.to(dtype).t() + scaling * ((xd @ lora_A.to(dtype).t()) @ lora_B.to(dtype).t())
    if bias is not None:
        y = y + bias.to(dtype)
    return y


def lora_linear_unfused(x, weight, bias, lora_A, lora_B, scaling):
    """What an unfused implementation computes in x's dtype: base, then (X Aᵀ) Bᵀ, scaled, added."""
    a = lora_A.to(x.dtype)
    b = lora_B.to(x.dtype)
    base = torch.nn.functional.linear(x, weight, bias)
    return base + (x @ a.t() @ b.t()) * scaling

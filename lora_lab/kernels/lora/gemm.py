"""The LoRA GEMM: a dense GEMM with the rank-r term folded into its epilogue, in Triton.

    out[M, N] = Σ_seg In_seg[M, D_seg] @ Mat_seg[D_seg, N] + bias[N] + (L[M, r] @ Rt[r, N]) [⊙ keep/(1-p)]

    forward: one segment, In = X, Mat = Wᵀ, L = P, Rt = Bᵀ, bias
    dX:      In_seg = dY_seg, Mat_seg = W_seg (several for the shared-input op), L = Q, Rt = A, dropout mask

Three kernels compute it: one reading its operands through pointers (any strides), one through TMA descriptors
(Hopper's bulk tensor copies; row-major, 16-byte aligned operands — the usual case), and a persistent form of the
TMA kernel (``gemm_loads="persistent"``): one program per SM walks the output tiles in the same grouped order, so
tile set-up and the launch tail are paid once per SM instead of once per tile. The persistent kernel is opt-in
until the benchmarks say where it wins (``benchmarks/bench_gemm_core.py``); it takes every input the default form
takes: an input TMA cannot read as it is (an expanded gradient such as ``y.sum()``'s, a transposed view) is copied
into a packed row-major buffer first, and operands no copy makes readable (rows whose byte width is not a multiple
of 16, an unusual weight layout, a Triton without descriptors) run on the default form instead.
(A warp-specialised variant, ``persistent_ws``, was removed: its build failed to compile on the H200.)
"""
from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from lora_lab import gpu_arch
from lora_lab.kernels.config import KernelConfig, resolve_config
from lora_lab.kernels.lora.rank_ops import dropout_args, rank_projection
from lora_lab.kernels.lora.tuning import autotune, gemm_configs
from lora_lab.kernels.triton_helpers import (
    accumulate_matmul,
    cdiv,
    check_interpreter_dtype,
    dot_precision,
    num_sms,
    rank_block,
    row_bucket,
    tile_coords,
)

__all__ = ["lora_gemm"]


# ----------------------------------------------------------------------------------------------
# Kernel 3: the GEMM with the rank-r term folded in.
#   out[M, N] = Σ_seg In_seg[M, D_seg] @ Mat_seg[D_seg, N]  + bias[N]  +  (L[M, r] @ Rt[r, N]) [⊙ keep/(1-p)]
#   forward: one segment, In = X, Mat = Wᵀ, L = P, Rt = Bᵀ, bias
#   dX:      In_seg = dY_seg, Mat_seg = W_seg (several for the shared-input op), L = Q, Rt = A, dropout mask
# The rank-r term costs one more MMA of depth r after the main loop (r/K extra work)
# and no extra pass over Y. A rank-range table restricts it to the ranks that touch this tile's
# columns (block-diagonal B of the shared-input op).
# ----------------------------------------------------------------------------------------------
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
    """(pid_m, pid_n) of this program's one tile (the non-persistent kernels)."""
    return tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)


@autotune(gemm_configs(), key=["M_BUCKET", "N", "D0", "D1", "D2", "D3", "R", "TUNE"])
@triton.jit
def _lora_gemm_kernel(
    out_ptr, stride_om, stride_on,
    M, N, M_BUCKET, TUNE,
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
    acc = accumulate_matmul(acc, in0_ptr, s_i0m, s_i0k, D0, mat0_ptr, s_w0k, s_w0n, rows, cols, BLOCK_K, PRECISION)
    if NUM_SEG > 1:
        acc = accumulate_matmul(acc, in1_ptr, s_i1m, s_i1k, D1, mat1_ptr, s_w1k, s_w1n, rows, cols,
                                  BLOCK_K, PRECISION)
    if NUM_SEG > 2:
        acc = accumulate_matmul(acc, in2_ptr, s_i2m, s_i2k, D2, mat2_ptr, s_w2k, s_w2n, rows, cols,
                                  BLOCK_K, PRECISION)
    if NUM_SEG > 3:
        acc = accumulate_matmul(acc, in3_ptr, s_i3m, s_i3k, D3, mat3_ptr, s_w3k, s_w3n, rows, cols,
                                  BLOCK_K, PRECISION)

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
        if nargs.get(f"in{i}_desc") is None:  # a segment the call does not use (passed as None)
            continue
        nargs[f"in{i}_desc"].block_shape = [bm, bk]
        nargs[f"mat{i}_desc"].block_shape = [bn, bk] if mat_nk else [bk, bn]


def _tma_gemm_configs():
    return [triton.Config(dict(c.kwargs), num_warps=c.num_warps, num_stages=c.num_stages,
                          pre_hook=_set_tma_block_shapes) for c in gemm_configs()]


@triton.jit
def _tma_k_step(acc, in_desc, mat_desc, k0, off_m, off_n, MAT_NK: tl.constexpr, BLOCK_K: tl.constexpr,
                PRECISION: tl.constexpr):
    # one K step: acc += In[off_m:, k] · Mat[k, off_n:]; returns the In tile too (the folded projection reuses it).
    # Mat is stored N×D (MAT_NK, e.g. W for Y = X Wᵀ) or D×N (W for dX)
    a = in_desc.load([off_m, k0 * BLOCK_K])
    if MAT_NK:
        b = tl.trans(mat_desc.load([off_n, k0 * BLOCK_K]))
    else:
        b = mat_desc.load([k0 * BLOCK_K, off_n])
    return tl.dot(a, b, acc, input_precision=PRECISION), a


@triton.jit
def _accumulate_segment_tma(acc, in_desc, mat_desc, D, off_m, off_n, MAT_NK: tl.constexpr,
                            BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # acc[m, n] += Σ_k In[m, k] · Mat[k, n]
    for k0 in range(0, tl.cdiv(D, BLOCK_K)):
        acc, _ = _tma_k_step(acc, in_desc, mat_desc, k0, off_m, off_n, MAT_NK, BLOCK_K, PRECISION)
    return acc


@triton.jit
def _accumulate_segments_tma(acc, in0_desc, mat0_desc, D0, in1_desc, mat1_desc, D1, in2_desc, mat2_desc, D2,
                             in3_desc, mat3_desc, D3, off_m, off_n, NUM_SEG: tl.constexpr, MAT_NK: tl.constexpr,
                             BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # the main loop(s) of both TMA kernels: acc = Σ_seg In_seg Mat_seg
    acc = _accumulate_segment_tma(acc, in0_desc, mat0_desc, D0, off_m, off_n, MAT_NK, BLOCK_K, PRECISION)
    if NUM_SEG > 1:
        acc = _accumulate_segment_tma(acc, in1_desc, mat1_desc, D1, off_m, off_n, MAT_NK, BLOCK_K, PRECISION)
    if NUM_SEG > 2:
        acc = _accumulate_segment_tma(acc, in2_desc, mat2_desc, D2, off_m, off_n, MAT_NK, BLOCK_K, PRECISION)
    if NUM_SEG > 3:
        acc = _accumulate_segment_tma(acc, in3_desc, mat3_desc, D3, off_m, off_n, MAT_NK, BLOCK_K, PRECISION)
    return acc


@autotune(_tma_gemm_configs(), key=["M_BUCKET", "N", "D0", "D1", "D2", "D3", "R", "TUNE"])
@triton.jit
def _lora_gemm_tma_kernel(
    out_ptr, stride_om, stride_on,
    M, N, M_BUCKET, TUNE,
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
    acc = _accumulate_segments_tma(acc, in0_desc, mat0_desc, D0, in1_desc, mat1_desc, D1, in2_desc, mat2_desc, D2,
                                   in3_desc, mat3_desc, D3, off_m, off_n, NUM_SEG, MAT_NK, BLOCK_K, PRECISION)

    rows_true = off_m + tl.arange(0, BLOCK_M)
    cols_true = off_n + tl.arange(0, BLOCK_N)
    _finish_tile(acc, rows_true % M, cols_true % N, rows_true, cols_true, M, N, out_ptr, stride_om, stride_on,
                 l_ptr, stride_lm, stride_lr, rt_ptr, stride_rr, stride_rn, R, rank_lo_ptr, rank_hi_ptr, bias_ptr,
                 seed, p_drop, keep_scale, HAS_LOWRANK, HAS_RANK_RANGE, HAS_BIAS, DROPOUT, PRECISION, BLOCK_R,
                 BLOCK_M, BLOCK_N)


@triton.jit
def _accumulate_segment_tma_fold(acc, p_acc, in_desc, mat_desc, D, off_m, off_n, proj_ptr, stride_pk, stride_pr, R,
                                 MAT_NK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                                 PRECISION: tl.constexpr):
    # the segment's K loop, and with the same In tiles the projection p_acc[m, r] += Σ_k In[m, k] · Proj[k, r]
    # (P = X Aᵀ in the forward, Q = dY B in dX): the separate pass over In that would compute it is saved
    ks = tl.arange(0, BLOCK_K)
    rr = tl.arange(0, BLOCK_R)
    for k0 in range(0, tl.cdiv(D, BLOCK_K)):
        acc, a = _tma_k_step(acc, in_desc, mat_desc, k0, off_m, off_n, MAT_NK, BLOCK_K, PRECISION)
        k = k0 * BLOCK_K + ks
        proj = tl.load(proj_ptr + k.to(tl.int64)[:, None] * stride_pk + rr[None, :] * stride_pr,
                       mask=(k[:, None] < D) & (rr[None, :] < R), other=0.0)
        p_acc = tl.dot(a, proj.to(a.dtype), p_acc, input_precision=PRECISION)
    return acc, p_acc


# The TMA GEMM as a persistent kernel: NUM_SMS programs, each walking tiles start, start + NUM_SMS, ... The body
# is the TMA kernel's (main loop(s), then the shared epilogue). Its tiles are the TMA kernel's (gemm_configs, with
# the descriptors' block shapes set per config).
@autotune(_tma_gemm_configs(), key=["M_BUCKET", "N", "D0", "D1", "D2", "D3", "R", "TUNE", "NUM_SMS"])
@triton.jit
def _lora_gemm_persistent_kernel(
    out_ptr, stride_om, stride_on,
    M, N, M_BUCKET, TUNE,
    in0_desc, mat0_desc, D0, in1_desc, mat1_desc, D1, in2_desc, mat2_desc, D2, in3_desc, mat3_desc, D3,
    l_ptr, stride_lm, stride_lr, rt_ptr, stride_rr, stride_rn, R,
    rank_lo_ptr, rank_hi_ptr, bias_ptr,
    seed, p_drop, keep_scale,
    proj_ptr, stride_pk, stride_pr, proj_scale,
    NUM_SMS: tl.constexpr, FOLD_P: tl.constexpr,
    NUM_SEG: tl.constexpr, MAT_NK: tl.constexpr, HAS_LOWRANK: tl.constexpr, HAS_RANK_RANGE: tl.constexpr,
    HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS):
        pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        rows_true = off_m + tl.arange(0, BLOCK_M)
        cols_true = off_n + tl.arange(0, BLOCK_N)
        if FOLD_P:
            # one segment; the low-rank factor is computed here, rounded like a stored one, added, and written
            # out by the tiles of the first column block (backward needs it)
            p_acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            acc, p_acc = _accumulate_segment_tma_fold(acc, p_acc, in0_desc, mat0_desc, D0, off_m, off_n, proj_ptr,
                                                      stride_pk, stride_pr, R, MAT_NK, BLOCK_K, BLOCK_R, PRECISION)
            low = (p_acc * proj_scale).to(out_ptr.dtype.element_ty)
            rr = tl.arange(0, BLOCK_R)
            rt = tl.load(rt_ptr + rr[:, None] * stride_rr + (cols_true % N).to(tl.int64)[None, :] * stride_rn,
                         mask=rr[:, None] < R, other=0.0)
            acc = tl.dot(low, rt.to(low.dtype), acc, input_precision=PRECISION)
            if off_n == 0:
                tl.store(l_ptr + rows_true.to(tl.int64)[:, None] * stride_lm + rr[None, :] * stride_lr, low,
                         mask=(rows_true[:, None] < M) & (rr[None, :] < R))
        else:
            acc = _accumulate_segments_tma(acc, in0_desc, mat0_desc, D0, in1_desc, mat1_desc, D1, in2_desc,
                                           mat2_desc, D2, in3_desc, mat3_desc, D3, off_m, off_n, NUM_SEG, MAT_NK,
                                           BLOCK_K, PRECISION)
        _finish_tile(acc, rows_true % M, cols_true % N, rows_true, cols_true, M, N, out_ptr, stride_om, stride_on,
                     l_ptr, stride_lm, stride_lr, rt_ptr, stride_rr, stride_rn, R, rank_lo_ptr, rank_hi_ptr,
                     bias_ptr, seed, p_drop, keep_scale, HAS_LOWRANK, HAS_RANK_RANGE, HAS_BIAS,
                     DROPOUT, PRECISION, BLOCK_R, BLOCK_M, BLOCK_N)


# dtype → error text once a TMA launch failed for that dtype: the pointer kernel from then on (per dtype, so an
# fp32 tile that overflows shared memory does not take TMA away from bf16)
_TMA_STATE: dict = {}


def _rows_ok(t, stride) -> bool:
    """Rows TMA can read: a 16-byte aligned base and a positive, 16-byte aligned row stride."""
    return t.data_ptr() % 16 == 0 and (stride * t.element_size()) % 16 == 0 and stride > 0


def _input_row_major(inp) -> bool:
    return inp.stride(1) == 1 and _rows_ok(inp, inp.stride(0))


try:  # TMA descriptors: triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pointer kernel only
    TensorDescriptor = None


def _tma_layout(segments):
    """'nk' / 'kn' when every (in, mat) pair can be read through TMA descriptors, else None."""
    if TensorDescriptor is None:
        return None

    rows_ok = _rows_ok
    layouts = set()
    for inp, mat in segments:
        if not _input_row_major(inp):
            return None
        if mat.stride(0) == 1 and mat.shape[1] > 1 and rows_ok(mat, mat.stride(1)):
            layouts.add("nk")  # mat = Wᵀ of a row-major W (N×D)
        elif mat.stride(1) == 1 and rows_ok(mat, mat.stride(0)):
            layouts.add("kn")  # mat = a row-major D×N block
        else:
            return None
    return layouts.pop() if len(layouts) == 1 else None


def gemm_loads_for(requested: str, device) -> str:
    """``KernelConfig.gemm_loads`` as ``device``'s GPU class runs it (:mod:`lora_lab.gpu_arch`, which honours
    ``$LORA_LAB_ARCH``): unchanged where TMA exists; before Hopper 'auto' reads through pointers and 'tma' /
    'persistent' are refused with a ValueError naming the class."""
    if gpu_arch.has_tma(device):
        return requested
    if requested in ("tma", "persistent"):
        raise ValueError(f"lora_gemm: gemm_loads={requested!r} reads through TMA descriptors, which GPU class "
                         f"{gpu_arch.gpu_class(device)!r} on {device} lacks (${gpu_arch.ARCH_ENV} may force it); use "
                         "'auto' or 'pointer'")
    return "pointer"


def lora_gemm(out: torch.Tensor, segments, low: torch.Tensor | None = None, rt: torch.Tensor | None = None,
              bias: torch.Tensor | None = None, rank_lo: torch.Tensor | None = None,
              rank_hi: torch.Tensor | None = None, dropout_p: float = 0.0, seed: int | None = None,
              config: KernelConfig | None = None, project: tuple | None = None) -> torch.Tensor:
    """out[M, N] = Σ in_s @ mat_s + bias + (low @ rt) [⊙ keep/(1-p)], one Triton launch.

    ``project=(proj, scale, low)`` (persistent ``gemm_loads`` only, one segment, rank <= 64, no dropout): the
    kernel computes ``low = scale · in_0 @ proj`` itself (proj: D×R, e.g. Aᵀ or B) inside its K loop, writes it
    into ``low`` (M×R) and uses it for the rank-r term, instead of reading a precomputed one.

    ``segments``: list of 1 to 4 pairs (in_s [M, D_s], mat_s [D_s, N]), any strides. ``config.gemm_loads``:
    'tma' (descriptor loads; needs row-major, 16-byte aligned operands), 'pointer', or 'auto' (TMA when the
    layout allows it; 16-bit types only, fp32 being the correctness path).
    """
    check_interpreter_dtype(out, op="lora_gemm")
    M, N = out.shape
    if project is not None:
        proj, proj_scale, low = project
        if len(segments) != 1 or rt is None or dropout_p or rank_lo is not None:
            raise ValueError("lora_gemm: project= folds one segment's projection (with rt, no dropout, no rank "
                             "ranges)")
        if proj.shape != (segments[0][0].shape[1], rt.shape[0]) or low.shape != (M, rt.shape[0]):
            raise ValueError(f"lora_gemm: project= shapes do not fit: proj {tuple(proj.shape)}, low "
                             f"{tuple(low.shape)}, in {tuple(segments[0][0].shape)}, rt {tuple(rt.shape)}")
        if rt.shape[0] > 64:
            raise ValueError(f"lora_gemm: project= holds the projection in registers: rank <= 64, got {rt.shape[0]}")
    if M == 0 or N == 0:
        return out
    if not 1 <= len(segments) <= 4:
        raise ValueError(f"lora_gemm takes 1 to 4 input segments, got {len(segments)}")
    if project is not None:
        low = project[2]  # written by the kernel, then its rank-r term
    has_low = low is not None and low.shape[1] > 0
    R = low.shape[1] if has_low else 0
    dropout, seed_, p_, keep_scale = dropout_args(dropout_p, seed)
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
                 HAS_BIAS=bias is not None, DROPOUT=dropout, PRECISION=dot_precision(out.dtype),
                 BLOCK_R=rank_block(R, cap=64))

    def grid(meta):
        return (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)

    config = resolve_config(config)
    impl = gemm_loads_for(config.gemm_loads, out.device)
    if project is not None and impl != "persistent":
        raise ValueError(f"lora_gemm: project= needs gemm_loads='persistent', got {impl!r}")
    if impl == "persistent":
        readable = _persistent_operands(segments)
        if readable is not None:
            return _persistent_gemm(out, *readable, tail, flags, config, project)
        # operands TMA cannot read even after a copy: the default form, with the projection as its own pass
        if project is not None:
            proj, proj_scale, low = project
            rank_projection(segments[0][0], proj, proj_scale, out=low, tune=config.autotune)
        impl = "auto"
    broken = _TMA_STATE.get(out.dtype)
    # auto: TMA for 16-bit types only (fp32 is the correctness path; its tiles are the pointer kernel's)
    want_tma = impl == "tma" or (impl == "auto" and out.dtype != torch.float32)
    layout = _tma_layout(segments) if want_tma and broken is None else None
    if impl == "tma" and layout is None:
        raise ValueError("lora_gemm: gemm_loads='tma' needs row-major, 16-byte aligned operands "
                         f"(or TMA was disabled for {out.dtype}: {broken})")
    if layout is not None:
        descs = _descriptors(segments, layout, M, N)
        try:
            _lora_gemm_tma_kernel[grid](out, out.stride(0), out.stride(1), M, N, row_bucket(M),
                                        int(config.autotune), *descs, *tail,
                                        MAT_NK=layout == "nk", **flags)
            return out
        except Exception as err:  # a Triton build without working TMA: fall back once, loudly
            if impl == "tma":
                raise
            _TMA_STATE[out.dtype] = f"{type(err).__name__}: {err}"[:300]
            warnings.warn(f"lora_lab: TMA GEMM failed for {out.dtype} ({_TMA_STATE[out.dtype]}); using the "
                          "pointer kernel", RuntimeWarning, stacklevel=2)

    seg_args = []
    for inp, mat in segments:
        seg_args += [inp, inp.stride(0), inp.stride(1), inp.shape[1], mat, mat.stride(0), mat.stride(1)]
    first = seg_args[:7]
    for _ in range(4 - len(segments)):
        seg_args += [first[0], 0, 0, 0, first[4], 0, 0]
    _lora_gemm_kernel[grid](out, out.stride(0), out.stride(1), M, N, row_bucket(M), int(config.autotune),
                            *seg_args, *tail, **flags)
    return out


def _descriptors(segments, layout: str, M: int, N: int) -> list:
    """TMA descriptors (block shapes set per config by the pre-hook) and depth of each segment, padded to 4 with
    None (a constexpr the kernel never reads: ``NUM_SEG`` prunes those segments), so a launch encodes only the
    descriptors it uses — each one costs the launcher host time on the critical path before the GEMM starts."""
    descs = []
    for inp, mat in segments:
        d_in = TensorDescriptor(inp, [M, inp.shape[1]], [inp.stride(0), 1], [16, 16])
        if layout == "nk":  # the row-major N×D matrix whose transpose is ``mat``
            d_mat = TensorDescriptor(mat, [N, mat.shape[0]], [mat.stride(1), 1], [16, 16])
        else:
            d_mat = TensorDescriptor(mat, [mat.shape[0], N], [mat.stride(0), 1], [16, 16])
        descs += [d_in, d_mat, inp.shape[1]]
    for _ in range(4 - len(segments)):
        descs += [None, None, 0]
    return descs


def _persistent_operands(segments):
    """(segments, layout) the persistent kernel reads through TMA, or None (the caller uses the default form).

    An input that is not packed row-major with 16-byte aligned rows — the stride-0 gradient of ``y.sum()``, a
    transposed or offset view — is copied into a fresh row-major buffer (one pass over an M×D operand the GEMM
    reads anyway); that makes it readable whenever its row width in bytes is a multiple of 16. Weights are not
    copied per call: a weight layout TMA cannot read means the default form.
    """
    fixed = [(inp if _input_row_major(inp) else inp.clone(memory_format=torch.contiguous_format), mat)
             for inp, mat in segments]
    layout = _tma_layout(fixed)
    return None if layout is None else (fixed, layout)


def _persistent_gemm(out, segments, layout, tail, flags, config, project=None) -> torch.Tensor:
    """The persistent TMA kernel on operands :func:`_persistent_operands` made readable."""
    M, N = out.shape
    num_sms_ = num_sms(out.device)

    def grid(meta):
        return (min(num_sms_, cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])),)

    if project is not None:
        proj, proj_scale, _ = project
        fold = [proj, proj.stride(0), proj.stride(1), float(proj_scale)]
        # the folded branch adds its rank-r term itself: the shared epilogue only adds the bias and stores
        flags = {**flags, "HAS_LOWRANK": False}
    else:
        fold = [out, 0, 0, 0.0]
    _lora_gemm_persistent_kernel[grid](out, out.stride(0), out.stride(1), M, N, row_bucket(M),
                                       int(config.autotune), *_descriptors(segments, layout, M, N), *tail, *fold,
                                       NUM_SMS=num_sms_, FOLD_P=project is not None,
                                       MAT_NK=layout == "nk", **flags)
    return out

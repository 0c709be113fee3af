"""Pieces shared by the row-tiled MoE kernels: inlined ``@triton.jit`` tile helpers and the launch.

A row-tiled program (pid_n, tile) of ``moe_grouped_gemm``, ``moe_gate_up_silu`` and
``moe_down_backward`` owns BLOCK_M expert-sorted rows of one expert e = tile_expert[tile]
(see ``moe_routing``) and BLOCK_N output columns:

    rows   = [row_start, row_start + BLOCK_M) ∩ [.., offsets[e+1])       row_mask marks the real ones
    token  = sorted_token[rows]                                           the token each row came from
    C      = Σ_k A[rows, k] · B_e[k, cols]                                fp32 accumulation, BLOCK_K at a time
    P, L_e = LoRA factor tiles, rank R zero-padded to BLOCK_R (tl.dot needs sides >= 16)

The ``@triton.jit`` helpers below are inlined into each kernel at compile time: the kernels
compute exactly what they computed with these lines written out in place (same loads, masks,
pointer arithmetic and tl.dot accumulation order). Host side, ``with_even_k`` and
``launch_row_tiles`` hold the launch code the three kernels share.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_lab import gpu_arch
from lora_lab.kernels.config import KernelConfig
from lora_lab.kernels.moe.launch import (
    autotune_enabled,
    fixed_kernel,
    heuristic_meta,
    narrow_block_size,
    set_expert_block_shape,
)
from lora_lab.kernels.triton_helpers import cdiv, num_sms

# ---------------------------------------------------------------- device side (inlined)


@triton.jit
def rows_of_tile(tile, expert, tile_row_start_ptr, expert_offsets_ptr, sorted_token_ptr, BLOCK_M: tl.constexpr):
    """(rows, row_mask, rows as int64, token as int64) of a row tile whose expert is real (< E)."""
    # rows of this tile: [row_start, row_start + BLOCK_M) ∩ [.., offsets[e+1])
    row_start = tl.load(tile_row_start_ptr + tile)
    row_end = tl.load(expert_offsets_ptr + expert + 1)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    rows64 = rows.to(tl.int64)
    # token = sorted_token[rows]   (0 for rows past the expert's end; they are masked everywhere)
    token = tl.load(sorted_token_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    return rows, row_mask, rows64, token


@triton.jit
def load_rows_by_k(ptrs, row_mask, offs_k, k0, K, EVEN_K: tl.constexpr):
    """(BLOCK_M, BLOCK_K) tile A[rows, k0:k0+BLOCK_K]; masks K only when K % BLOCK_K != 0."""
    if EVEN_K:
        tile = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    else:
        k_mask = (k0 + offs_k) < K
        tile = tl.load(ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    return tile


@triton.jit
def load_k_by_cols(ptrs, col_mask, offs_k, k0, K, EVEN_K: tl.constexpr):
    """(BLOCK_K, BLOCK_N) tile B_e[k0:k0+BLOCK_K, cols]; masks K only when K % BLOCK_K != 0."""
    if EVEN_K:
        tile = tl.load(ptrs, mask=col_mask[None, :], other=0.0)
    else:
        k_mask = (k0 + offs_k) < K
        tile = tl.load(ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
    return tile


@triton.jit
def load_expert_block(desc, expert, k0, off_n, MAT_NK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """(BLOCK_K, BLOCK_N) tile B_e[k0:k0+BLOCK_K, off_n:off_n+BLOCK_N] through a 3-D TMA descriptor.

    The descriptor spans (E, N, K) when MAT_NK (B_e is the transpose of a row-major N×K block, e.g. W2_eᵀ) and
    (E, K, N) otherwise; TMA reads zeros past each dimension's end, so a tile never reaches into the next expert.
    """
    if MAT_NK:
        tile = tl.trans(desc.load([expert, off_n, k0]).reshape(BLOCK_N, BLOCK_K))
    else:
        tile = desc.load([expert, k0, off_n]).reshape(BLOCK_K, BLOCK_N)
    return tile


@triton.jit
def weight_grad_k_step(acc, k0, row_end, off_m, off_n, a_ptr, stride_a_row, stride_a_m, b_ptr, stride_b_row,
                       stride_b_n, row_weight_ptr, sorted_slot_ptr, sorted_token_ptr, M, N,
                       GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, ROW_WEIGHT: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step of an expert weight gradient: acc += (w · A[src_a(rows)])ᵀ B[src_b(rows)] over the sorted rows
    [k0, k0 + BLOCK_K) below ``row_end`` (rows gathered by token where GATHER_*, read through a TMA descriptor
    where *_TMA; rows past the expert's end read as zero). Shared by the per-tile and the K-grouped kernels."""
    rows = k0 + tl.arange(0, BLOCK_K)
    r_mask = rows < row_end
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    if A_TMA:
        a_block = a_ptr.load([k0, off_m])
        a_t = tl.trans(tl.where(r_mask[:, None], a_block, tl.zeros_like(a_block)))
    else:
        if GATHER_A:  # the token each row came from (a gathered operand is never read through TMA)
            a_rows = tl.load(sorted_token_ptr + rows, mask=r_mask, other=0).to(tl.int64)
        else:
            a_rows = rows.to(tl.int64)
        a_t = tl.load(a_ptr + a_rows[None, :] * stride_a_row + offs_m[:, None] * stride_a_m,
                      mask=(offs_m < M)[:, None] & r_mask[None, :], other=0.0)
    if ROW_WEIGHT:
        slot = tl.load(sorted_slot_ptr + rows, mask=r_mask, other=0)
        weight = tl.load(row_weight_ptr + slot, mask=r_mask, other=0.0).to(tl.float32)
        a_t = (a_t.to(tl.float32) * weight[None, :]).to(a_t.dtype)
    if B_TMA:
        b = b_ptr.load([k0, off_n])
        b = tl.where(r_mask[:, None], b, tl.zeros_like(b))
    else:
        if GATHER_B:
            b_rows = tl.load(sorted_token_ptr + rows, mask=r_mask, other=0).to(tl.int64)
        else:
            b_rows = rows.to(tl.int64)
        b = tl.load(b_ptr + b_rows[:, None] * stride_b_row + offs_n[None, :] * stride_b_n,
                    mask=r_mask[:, None] & (offs_n < N)[None, :], other=0.0)
    return tl.dot(a_t, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def rows_times_expert_matrix(
    a_ptr, a_rows, row_mask, stride_a_row, stride_a_k,
    b_ptr, expert, off_n, cols, col_mask, stride_b_e, stride_b_k, stride_b_n, K,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    W_TMA: tl.constexpr, MAT_NK: tl.constexpr,
):
    """C = A[a_rows, :] @ B_e[:, cols] with fp32 accumulation over K.

    B (E, K, N) is read through pointers (any strides), or, when W_TMA, ``b_ptr`` is its TMA descriptor
    (:func:`load_expert_block`). A's rows are gathered through pointers either way.
    """
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_a_row + offs_k[None, :] * stride_a_k
    if not W_TMA:
        b_ptrs = (b_ptr + expert.to(tl.int64) * stride_b_e + offs_k[:, None] * stride_b_k
                  + cols[None, :] * stride_b_n)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = load_rows_by_k(a_ptrs, row_mask, offs_k, k0, K, EVEN_K)
        if W_TMA:
            b = load_expert_block(b_ptr, expert, k0, off_n, MAT_NK, BLOCK_K, BLOCK_N)
        else:
            b = load_k_by_cols(b_ptrs, col_mask, offs_k, k0, K, EVEN_K)
        # C += A[rows, k0:k0+BLOCK_K] @ B_e[k0:k0+BLOCK_K, cols]
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_a_k
        if not W_TMA:
            b_ptrs += BLOCK_K * stride_b_k
    return acc


@triton.jit
def load_masked_tile(ptr, offs_i, mask_i, stride_i, offs_j, mask_j, stride_j):
    """tile[i, j] = ptr[offs_i[i]·stride_i + offs_j[j]·stride_j] where mask_i[i] & mask_j[j], else 0."""
    return tl.load(
        ptr + offs_i[:, None] * stride_i + offs_j[None, :] * stride_j,
        mask=mask_i[:, None] & mask_j[None, :], other=0.0,
    )


@triton.jit
def load_rank_rows(p_ptr, rows64, row_mask, stride_p_row, stride_p_r, R, BLOCK_R: tl.constexpr):
    """(BLOCK_M, BLOCK_R) tile P[rows, :R] of a LoRA factor product, zero past R."""
    offs_r = tl.arange(0, BLOCK_R)
    return load_masked_tile(p_ptr, rows64, row_mask, stride_p_row, offs_r, offs_r < R, stride_p_r)


@triton.jit
def load_rank_cols(l_ptr, cols, col_mask, stride_l_r, stride_l_n, R, BLOCK_R: tl.constexpr):
    """(BLOCK_R, BLOCK_N) tile L_e[:R, cols] of a LoRA factor, zero past R; l_ptr points at L_e."""
    offs_r = tl.arange(0, BLOCK_R)
    return load_masked_tile(l_ptr, offs_r, offs_r < R, stride_l_r, cols, col_mask, stride_l_n)


# ---------------------------------------------------------------- host side


def with_even_k(kernel):
    """``kernel`` with the constexpr EVEN_K = (K % BLOCK_K == 0) set at each launch (no K mask then)."""
    return triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(kernel)


GROUP_M = 8  # persistent form: row tiles that walk each column block together while it sits in L2


def _descriptor_class():
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        raise ValueError(f"moe_loads='persistent' reads through TMA descriptors, which triton {triton.__version__} "
                         "lacks (needs >= 3.4); use moe_loads='pointer'") from None
    return TensorDescriptor


def _check_tma_alignment(t: torch.Tensor, strides: list[int], what: str) -> None:
    size = t.element_size()
    if t.data_ptr() % 16 or any(stride * size % 16 for stride in strides[:-1]):
        raise ValueError(f"moe_loads='persistent': TMA needs a 16-byte aligned {what} with 16-byte aligned row "
                         f"strides; got strides {tuple(t.stride())} of {t.dtype}; use moe_loads='pointer'")


def expert_descriptor(weight_kn: torch.Tensor):
    """(TMA descriptor, MAT_NK) of an expert matrix given as its (E, K, N) view; ValueError naming what TMA lacks.

    K-contiguous views (W2ᵀ for the down projection, W1ᵀ for gate/up) get an (E, N, K) descriptor (MAT_NK), N-contiguous
    ones (W1 for dX, W2 for the down backward) an (E, K, N) one. The block shape is set per launch config.
    """
    descriptor = _descriptor_class()
    experts, k_dim, n_dim = weight_kn.shape
    s_e, s_k, s_n = weight_kn.stride()
    if s_n == 1:
        mat_nk, shape, strides = False, [experts, k_dim, n_dim], [s_e, s_k, 1]
    elif s_k == 1:
        mat_nk, shape, strides = True, [experts, n_dim, k_dim], [s_e, s_n, 1]
    else:
        raise ValueError(f"moe_loads='persistent': the expert matrix (strides {tuple(weight_kn.stride())}) has no "
                         "contiguous dimension for TMA; use moe_loads='pointer'")
    _check_tma_alignment(weight_kn, strides, "expert matrix")
    return descriptor(weight_kn, shape, strides, [1, 16, 16]), mat_nk


def row_descriptor(rows: torch.Tensor):
    """TMA descriptor of a row-major (rows, columns) operand, read a block of rows at a time; ValueError naming
    what TMA lacks. The block shape is set per launch config."""
    descriptor = _descriptor_class()
    if rows.stride(1) != 1 and rows.shape[1] > 1:
        raise ValueError(f"moe_loads='persistent': a row operand with column stride {rows.stride(1)} is not "
                         "row-major; use moe_loads='pointer'")
    _check_tma_alignment(rows, [rows.stride(0), 1], "row operand")
    return descriptor(rows, list(rows.shape), [rows.stride(0), 1], [16, 16])


def schedule_flags(config: KernelConfig, device: torch.device) -> dict:
    """The launch flags every MoE kernel takes for ``config.moe_loads``: PERSISTENT, NUM_SMS and GROUP_M."""
    persistent = config.moe_loads == "persistent"
    if persistent and not gpu_arch.has_tma(device):
        raise ValueError(f"moe_loads='persistent' reads through TMA descriptors, which GPU class "
                         f"{gpu_arch.gpu_class(device)!r} on {device} lacks (${gpu_arch.ARCH_ENV} may force it); "
                         "use moe_loads='pointer'")
    return dict(PERSISTENT=persistent, NUM_SMS=num_sms(device) if persistent else 1, GROUP_M=GROUP_M)


def launch_grid(flags: dict, one_tile_grid: tuple[int, int]) -> tuple[int, ...]:
    """``one_tile_grid`` (one program per tile), or for the persistent form one program per SM, at most one per
    tile."""
    if not flags["PERSISTENT"]:
        return one_tile_grid
    return (min(flags["NUM_SMS"], one_tile_grid[0] * one_tile_grid[1]),)


def launch_row_tiles(
    tuned, specialized, unspecialized, args: tuple, flags: dict, *,
    kind: str, num_cols: int, num_tiles: int, tune: bool, config: KernelConfig, one_tile_if_narrow: bool = False,
    weight: tuple[int, torch.Tensor], k_dim: int, num_rows: int, num_experts: int,
) -> None:
    """Launch a row-tiled kernel: one program per (column block, row tile), or the persistent form.

    One program per tile: the grid (cdiv(num_cols, BLOCK_N), num_tiles). Persistent (``config.moe_loads``
    'persistent'): one program per SM walking the (row tile, column block) pairs in grouped
    order (:func:`schedule_flags`, :func:`launch_grid`), the expert matrix ``weight = (position in args, its
    (E, K, N) view)`` read through a TMA descriptor where TMA can read it, through pointers otherwise.
    Autotuned (``tuned``: {persistent: kernel}, see :func:`~lora_lab.kernels.moe.launch.make_tuned`) when ``tune``
    and ``config`` enables tuning, else with the tile :func:`~lora_lab.kernels.moe.launch.heuristic_meta` picks
    for ``kind`` at this shape (``k_dim``: the GEMM's K; ``num_rows`` sorted rows over ``num_experts``).
    ``one_tile_if_narrow``: outputs of <= 128 columns (LoRA factors, N = rank) are never tuned and get one tile
    across their columns.
    """
    narrow = one_tile_if_narrow and num_cols <= 128
    position, weight_kn = weight
    flags = dict(flags, **schedule_flags(config, weight_kn.device), W_TMA=False, MAT_NK=False)
    if flags["PERSISTENT"]:
        try:
            desc, flags["MAT_NK"] = expert_descriptor(weight_kn)
            args = args[:position] + (desc,) + args[position + 1:]
            flags["W_TMA"] = True
        except ValueError:  # odd sizes, misaligned views, an old Triton: the same schedule with pointer loads
            pass

    def grid_of(block_n):
        return launch_grid(flags, (cdiv(num_cols, block_n), num_tiles))

    if tune and autotune_enabled(config) and not narrow:
        tuned[flags["PERSISTENT"]][lambda meta: grid_of(meta["BLOCK_N"])](*args, **flags)
    else:
        meta = heuristic_meta(kind, block_m=flags["BLOCK_M"], n_dim=num_cols, k_dim=k_dim,
                              rows_per_expert=num_rows / max(num_experts, 1), lora=bool(flags.get("HAS_LORA")))
        if narrow:
            meta["BLOCK_N"] = narrow_block_size(num_cols, config, volume=num_rows * num_cols * k_dim)
        if flags["W_TMA"]:
            set_expert_block_shape({**dict(enumerate(args)), **flags, **meta})
        kernel = fixed_kernel(specialized, unspecialized, config, volume=num_rows * num_cols * k_dim)
        kernel[grid_of(meta["BLOCK_N"])](*args, **flags, **meta)

"""Routing-aware grouped GEMM over expert-sorted rows, with gather / scatter-add fused in.

For every sorted row j of expert e (see ``moe_routing``):

    C[j, :] = A[src(j), :] @ B_e                        B_e: (K, N), any strides (so W or Wᵀ views)
            + scale · P[j, :] @ L_e                     optional LoRA term, P: (S, R), L_e: (R, N)

    src(j) = sorted_token[j]  if GATHER_A  (read X / dOut rows directly, no sorted copy)
           = j                otherwise    (A already in sorted order, e.g. SiLU·up output)

Epilogue, one of

    STORE:        C_sorted[j, :] = C[j, :]                                 (sorted order, A's dtype)
    SCATTER_ADD:  Out[sorted_token[j], :] += w[sorted_slot[j]] · C[j, :]    (fp32, atomics; w optional)

Uses in the MoE layer (E experts, X: (T, H), W1 = gate_up_proj (E, 2I, H), W2 = down_proj (E, H, I)):

    forward  down:  Out[t] += Σ_k w_tk · (h_j @ W2_eᵀ + s₂ (h_j A2_eᵀ) B2_eᵀ)      SCATTER_ADD, weighted
    backward dX:    dX[t]  += Σ_k       (dGU_j @ W1_e + s₁ (dGU_j B1_e) A1_e)     SCATTER_ADD
    LoRA factors:   P1 = X[tok] A1_eᵀ,  P2 = h A2_eᵀ,  Q1 = dGU B1_e,  Q2 = dOut[tok] B2_e   STORE, N = rank

The scatter-add uses fp32 atomics, so the summation order over a token's K experts is not fixed
(results are not bitwise deterministic; they are within fp32 rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_lab.kernels.config import KernelConfig, resolve_config
from lora_lab.kernels.moe.launch import make_tuned, rank_block_size, unspecialized_twin
from lora_lab.kernels.moe.routing import ExpertRouting
from lora_lab.kernels.moe.tiles import (
    launch_row_tiles,
    load_rank_cols,
    load_rank_rows,
    rows_of_tile,
    rows_times_expert_matrix,
    with_even_k,
)
from lora_lab.kernels.triton_helpers import check_interpreter_dtype, dot_precision, tile_coords


@triton.jit
def _grouped_rows_gemm_tile(
    pid_n, tile,
    a_ptr, stride_a_row, stride_a_k,
    b_ptr, stride_b_e, stride_b_k, stride_b_n,
    lora_p_ptr, stride_p_row, stride_p_r,
    lora_l_ptr, stride_l_e, stride_l_r, stride_l_n,
    out_ptr, stride_out_row, stride_out_n,
    row_weight_ptr, sorted_slot_ptr, sorted_token_ptr,
    tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
    N, K, R, lora_scale, num_experts,
    GATHER_A: tl.constexpr, HAS_LORA: tl.constexpr, ROW_WEIGHT: tl.constexpr, SCATTER_ADD: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, W_TMA: tl.constexpr, MAT_NK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # one (row tile, column block); B through pointers, or (W_TMA) b_ptr is its TMA descriptor
    expert = tl.load(tile_expert_ptr + tile)
    if expert < num_experts:  # tiles past the real total have nothing to do
        rows, row_mask, rows64, token = rows_of_tile(
            tile, expert, tile_row_start_ptr, expert_offsets_ptr, sorted_token_ptr, BLOCK_M,
        )
        if GATHER_A:
            a_rows = token  # A[sorted_token[j]]: gather fused into the load
        else:
            a_rows = rows64

        off_n = pid_n * BLOCK_N
        cols = off_n + tl.arange(0, BLOCK_N)
        col_mask = cols < N

        # C = A_rows @ B_e, fp32 accumulation over K
        acc = rows_times_expert_matrix(
            a_ptr, a_rows, row_mask, stride_a_row, stride_a_k,
            b_ptr, expert, off_n, cols, col_mask, stride_b_e, stride_b_k, stride_b_n, K,
            EVEN_K, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, W_TMA, MAT_NK,
        )

        if HAS_LORA:
            # C += scale · P_rows @ L_e   (rank-R product; W + B·A is never built)
            p = load_rank_rows(lora_p_ptr, rows64, row_mask, stride_p_row, stride_p_r, R, BLOCK_R)
            lo = load_rank_cols(
                lora_l_ptr + expert.to(tl.int64) * stride_l_e, cols, col_mask, stride_l_r, stride_l_n, R, BLOCK_R,
            )
            acc += lora_scale * tl.dot(p, lo, input_precision=DOT_PRECISION)

        if ROW_WEIGHT:
            # C[j] *= w[sorted_slot[j]]   (routing weight of this token-expert pair)
            slot = tl.load(sorted_slot_ptr + rows, mask=row_mask, other=0)
            weight = tl.load(row_weight_ptr + slot, mask=row_mask, other=0.0).to(tl.float32)
            acc = acc * weight[:, None]

        mask = row_mask[:, None] & col_mask[None, :]
        if SCATTER_ADD:
            # Out[sorted_token[j]] += C[j]: the gather back to token order, fused (fp32 atomics)
            out_ptrs = out_ptr + token[:, None] * stride_out_row + cols[None, :] * stride_out_n
            tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")
        else:
            out_ptrs = out_ptr + rows64[:, None] * stride_out_row + cols[None, :] * stride_out_n
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_rows_gemm_kernel(
    a_ptr, stride_a_row, stride_a_k,
    b_ptr, stride_b_e, stride_b_k, stride_b_n,
    lora_p_ptr, stride_p_row, stride_p_r,
    lora_l_ptr, stride_l_e, stride_l_r, stride_l_n,
    out_ptr, stride_out_row, stride_out_n,
    row_weight_ptr, sorted_slot_ptr, sorted_token_ptr,
    tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
    N, K, R, lora_scale, num_experts, num_tiles,
    GATHER_A: tl.constexpr, HAS_LORA: tl.constexpr, ROW_WEIGHT: tl.constexpr, SCATTER_ADD: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr, W_TMA: tl.constexpr, MAT_NK: tl.constexpr,
    NUM_SMS: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    if PERSISTENT:
        # one program per SM walks the (row tile, column block) pairs in grouped order
        num_pid_n = tl.cdiv(N, BLOCK_N)
        for work in tl.range(tl.program_id(0), num_tiles * num_pid_n, NUM_SMS):
            tile, pid_n = tile_coords(work, num_tiles, num_pid_n, GROUP_M)
            _grouped_rows_gemm_tile(
                pid_n, tile, a_ptr, stride_a_row, stride_a_k, b_ptr, stride_b_e, stride_b_k, stride_b_n,
                lora_p_ptr, stride_p_row, stride_p_r, lora_l_ptr, stride_l_e, stride_l_r, stride_l_n,
                out_ptr, stride_out_row, stride_out_n, row_weight_ptr, sorted_slot_ptr, sorted_token_ptr,
                tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, N, K, R, lora_scale, num_experts,
                GATHER_A, HAS_LORA, ROW_WEIGHT, SCATTER_ADD, EVEN_K, DOT_PRECISION, W_TMA, MAT_NK,
                BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R,
            )
    else:
        _grouped_rows_gemm_tile(
            tl.program_id(0), tl.program_id(1), a_ptr, stride_a_row, stride_a_k, b_ptr, stride_b_e, stride_b_k,
            stride_b_n, lora_p_ptr, stride_p_row, stride_p_r, lora_l_ptr, stride_l_e, stride_l_r, stride_l_n,
            out_ptr, stride_out_row, stride_out_n, row_weight_ptr, sorted_slot_ptr, sorted_token_ptr,
            tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr, N, K, R, lora_scale, num_experts,
            GATHER_A, HAS_LORA, ROW_WEIGHT, SCATTER_ADD, EVEN_K, DOT_PRECISION, W_TMA, MAT_NK,
            BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R,
        )


_rows_kernel = with_even_k(_grouped_rows_gemm_kernel)
_rows_kernel_unspecialized = with_even_k(unspecialized_twin(_grouped_rows_gemm_kernel))
_rows_kernel_tuned = make_tuned(
    _rows_kernel, "rows",
    key=["N", "K", "GATHER_A", "HAS_LORA", "ROW_WEIGHT", "SCATTER_ADD", "BLOCK_M", "PERSISTENT"],
    reset_to_zero=["out_ptr"],
)


def _check_operands(a: torch.Tensor, b: torch.Tensor, routing: ExpertRouting, gather_rows: bool) -> None:
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(f"grouped_rows_gemm needs A (rows, K) and B (E, K, N); got {tuple(a.shape)}, {tuple(b.shape)}")
    if b.shape[0] != routing.num_experts:
        raise ValueError(f"B has {b.shape[0]} experts, routing has {routing.num_experts}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"K mismatch: A has {a.shape[1]} columns, B_e has {b.shape[1]} rows")
    expected_rows = routing.num_tokens if gather_rows else routing.num_assignments
    if a.shape[0] != expected_rows:
        raise ValueError(f"A has {a.shape[0]} rows, expected {expected_rows} (gather_rows={gather_rows})")
    if a.dtype != b.dtype:
        raise TypeError(f"A is {a.dtype} but B is {b.dtype}; cast one of them first")


def grouped_rows_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    routing: ExpertRouting,
    *,
    gather_rows: bool,
    scatter_into: torch.Tensor | None = None,
    row_weight: torch.Tensor | None = None,
    lora: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    tune: bool = True,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """C_j = A[src(j)] @ B_e (+ scale · P_j @ L_e), stored in sorted order or scatter-added by token.

    a: (T, K) if ``gather_rows`` else (S, K); b: (E, K, N) with any strides; ``lora = (P (S, R),
    L (E, R, N), scale)``; ``scatter_into``: fp32 (T, N) accumulated in place (then returned);
    ``row_weight``: (S,) routing weights in assignment order (only with ``scatter_into``).
    """
    check_interpreter_dtype(a, op="grouped_rows_gemm")
    _check_operands(a, b, routing, gather_rows)
    num_experts, k_dim, n_dim = b.shape
    num_rows = routing.num_assignments
    if scatter_into is not None:
        if scatter_into.dtype != torch.float32 or tuple(scatter_into.shape) != (routing.num_tokens, n_dim):
            raise ValueError(
                f"scatter_into must be fp32 ({routing.num_tokens}, {n_dim}), got "
                f"{scatter_into.dtype} {tuple(scatter_into.shape)}"
            )
        out = scatter_into
    else:
        out = torch.empty(num_rows, n_dim, device=a.device, dtype=a.dtype)
    if row_weight is not None and scatter_into is None:
        raise ValueError("row_weight is only supported together with scatter_into")
    if num_rows == 0 or n_dim == 0:
        return out

    if lora is not None:
        lora_p, lora_l, lora_scale = lora
        rank = lora_p.shape[1]
        if lora_l.shape != (num_experts, rank, n_dim) or lora_p.shape[0] != num_rows:
            raise ValueError(f"LoRA operands P {tuple(lora_p.shape)} / L {tuple(lora_l.shape)} "
                             f"do not fit B {tuple(b.shape)}")
        block_r = rank_block_size(rank)
    else:
        lora_p, lora_l, lora_scale, rank, block_r = a, b, 0.0, 0, 16
    weight = row_weight if row_weight is not None else a

    args = (
        a, a.stride(0), a.stride(1),
        b, b.stride(0), b.stride(1), b.stride(2),
        lora_p, lora_p.stride(0), lora_p.stride(1),
        lora_l, lora_l.stride(0), lora_l.stride(1), lora_l.stride(2),
        out, out.stride(0), out.stride(1),
        weight, routing.sorted_slot, routing.sorted_token,
        routing.tile_expert, routing.tile_row_start, routing.expert_offsets,
        n_dim, k_dim, rank, float(lora_scale), num_experts, routing.max_tiles,
    )
    flags = dict(
        GATHER_A=gather_rows, HAS_LORA=lora is not None, ROW_WEIGHT=row_weight is not None,
        SCATTER_ADD=scatter_into is not None, DOT_PRECISION=dot_precision(a.dtype),
        BLOCK_M=routing.block_m, BLOCK_R=block_r,
    )
    # Narrow outputs (LoRA factors, N = rank) get one tile across N and no tuning.
    launch_row_tiles(
        _rows_kernel_tuned, _rows_kernel, _rows_kernel_unspecialized, args, flags,
        kind="rows", num_cols=n_dim, num_tiles=routing.max_tiles, tune=tune, config=resolve_config(config),
        one_tile_if_narrow=True, weight=(3, b), k_dim=k_dim, num_rows=num_rows, num_experts=num_experts,
    )
    return out


def grouped_rows_gemm_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    routing: ExpertRouting,
    *,
    gather_rows: bool,
    scatter_into: torch.Tensor | None = None,
    row_weight: torch.Tensor | None = None,
    lora: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Plain-torch version of ``grouped_rows_gemm`` (per-expert loop, fp32 math)."""
    src = routing.sorted_token.long() if gather_rows else torch.arange(routing.num_assignments, device=a.device)
    result = torch.zeros(routing.num_assignments, b.shape[2], device=a.device, dtype=torch.float32)
    for e, lo, hi in routing.nonempty_experts():
        rows = a[src[lo:hi]].float()
        part = rows @ b[e].float()
        if lora is not None:
            lora_p, lora_l, scale = lora
            part = part + scale * (lora_p[lo:hi].float() @ lora_l[e].float())
        result[lo:hi] = part
    if scatter_into is None:
        return result.to(a.dtype)
    in_range = slice(*routing.expert_offsets[[0, -1]].tolist())
    contrib = result[in_range]
    if row_weight is not None:
        contrib = contrib * row_weight.float()[routing.sorted_slot[in_range].long()][:, None]
    return scatter_into.index_add(0, routing.sorted_token[in_range].long(), contrib)

"""Backward through the down projection, the routing weight and SiLU·up, fused in one grouped GEMM.

Forward (per sorted row j of expert e, token t, routing weight w_j):

    y_j   = h_j @ W2_eᵀ + s₂ · (h_j A2_eᵀ) B2_eᵀ        W2 = down_proj (E, H, I)
    Out_t = Σ_{j of t} w_j · y_j

Backward, given dOut (T, H):

    D_j   = ∂L/∂(h_j) / w_j  = dOut_t @ W2_e + s₂ · Q2_j @ A2_e     Q2_j = dOut_t @ B2_e  (LoRA)
    dw_j  = ⟨dOut_t, y_j⟩    = ⟨D_j, h_j⟩                          router-weight gradient
    dh_j  = w_j · D_j
    dg_j  = dh_j · u_j · σ(g_j) · (1 + g_j · (1 − σ(g_j)))          SiLU'(g) = σ(g)(1 + g(1 − σ(g)))
    du_j  = dh_j · SiLU(g_j)

One program computes a (BLOCK_M rows) × (BLOCK_N columns of I) tile of D, reading dOut rows by
token in place, then reloads g, u for the same tile, emits dGU = [dg | du] (S, 2I) and adds its
partial ⟨D, h⟩ over these columns into dw (fp32 atomics: the I columns are split over programs).
y_j itself is never stored: ⟨dOut_t, y_j⟩ = ⟨D_j, h_j⟩ recovers the router gradient.
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
def _down_backward_silu_tile(
    pid_n, tile,
    dout_ptr, stride_d_tok, stride_d_k,
    w_ptr, stride_w_e, stride_w_k, stride_w_n,
    lora_q_ptr, stride_q_row, stride_q_r,
    lora_a_ptr, stride_la_e, stride_la_r, stride_la_n,
    gu_ptr, stride_gu_row, stride_gu_n,
    dgu_ptr, stride_dgu_row, stride_dgu_n,
    row_weight_ptr, dw_ptr,
    sorted_slot_ptr, sorted_token_ptr, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
    I, K, R, lora_scale, num_experts,
    HAS_LORA: tl.constexpr, COMPUTE_DW: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    W_TMA: tl.constexpr, MAT_NK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # one (row tile, column block of I); W2 through pointers, or (W_TMA) w_ptr is its (E, H, I) TMA descriptor
    expert = tl.load(tile_expert_ptr + tile)
    if expert < num_experts:  # tiles past the real total have nothing to do
        rows, row_mask, rows64, token = rows_of_tile(
            tile, expert, tile_row_start_ptr, expert_offsets_ptr, sorted_token_ptr, BLOCK_M,
        )

        off_n = pid_n * BLOCK_N
        cols = off_n + tl.arange(0, BLOCK_N)  # columns within I
        col_mask = cols < I

        # D = dOut[token] @ W2_e   (K = H; dOut rows read by token in place)
        acc = rows_times_expert_matrix(
            dout_ptr, token, row_mask, stride_d_tok, stride_d_k,
            w_ptr, expert, off_n, cols, col_mask, stride_w_e, stride_w_k, stride_w_n, K,
            EVEN_K, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, W_TMA, MAT_NK,
        )

        if HAS_LORA:
            # D += s₂ · Q2_rows @ A2_e   with A2_e: (R, I)
            q = load_rank_rows(lora_q_ptr, rows64, row_mask, stride_q_row, stride_q_r, R, BLOCK_R)
            la = load_rank_cols(
                lora_a_ptr + expert.to(tl.int64) * stride_la_e, cols, col_mask, stride_la_r, stride_la_n, R,
                BLOCK_R,
            )
            acc += lora_scale * tl.dot(q, la, input_precision=DOT_PRECISION)

        mask = row_mask[:, None] & col_mask[None, :]
        gu_ptrs = gu_ptr + rows64[:, None] * stride_gu_row + cols[None, :] * stride_gu_n
        g = tl.load(gu_ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptrs + I * stride_gu_n, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        slot = tl.load(sorted_slot_ptr + rows, mask=row_mask, other=0)
        if COMPUTE_DW:
            # dw_j += Σ_cols D · h   (h = SiLU(g)·u recomputed from the saved g, u)
            partial = tl.sum(acc * (silu * u), axis=1)
            tl.atomic_add(dw_ptr + slot, partial, mask=row_mask, sem="relaxed")
        weight = tl.load(row_weight_ptr + slot, mask=row_mask, other=0.0).to(tl.float32)
        dh = acc * weight[:, None]
        dg = dh * u * sig * (1.0 + g * (1.0 - sig))
        du = dh * silu
        dgu_ptrs = dgu_ptr + rows64[:, None] * stride_dgu_row + cols[None, :] * stride_dgu_n
        out_ty = dgu_ptr.dtype.element_ty
        tl.store(dgu_ptrs, dg.to(out_ty), mask=mask)
        tl.store(dgu_ptrs + I * stride_dgu_n, du.to(out_ty), mask=mask)


@triton.jit
def _down_backward_silu_kernel(
    dout_ptr, stride_d_tok, stride_d_k,
    w_ptr, stride_w_e, stride_w_k, stride_w_n,
    lora_q_ptr, stride_q_row, stride_q_r,
    lora_a_ptr, stride_la_e, stride_la_r, stride_la_n,
    gu_ptr, stride_gu_row, stride_gu_n,
    dgu_ptr, stride_dgu_row, stride_dgu_n,
    row_weight_ptr, dw_ptr,
    sorted_slot_ptr, sorted_token_ptr, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
    I, K, R, lora_scale, num_experts, num_tiles,
    HAS_LORA: tl.constexpr, COMPUTE_DW: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr, W_TMA: tl.constexpr, MAT_NK: tl.constexpr,
    NUM_SMS: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    if PERSISTENT:
        # one program per SM walks the (row tile, column block) pairs in grouped order
        num_pid_n = tl.cdiv(I, BLOCK_N)
        for work in tl.range(tl.program_id(0), num_tiles * num_pid_n, NUM_SMS):
            tile, pid_n = tile_coords(work, num_tiles, num_pid_n, GROUP_M)
            _down_backward_silu_tile(
                pid_n, tile, dout_ptr, stride_d_tok, stride_d_k, w_ptr, stride_w_e, stride_w_k, stride_w_n,
                lora_q_ptr, stride_q_row, stride_q_r, lora_a_ptr, stride_la_e, stride_la_r, stride_la_n,
                gu_ptr, stride_gu_row, stride_gu_n, dgu_ptr, stride_dgu_row, stride_dgu_n, row_weight_ptr, dw_ptr,
                sorted_slot_ptr, sorted_token_ptr, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                I, K, R, lora_scale, num_experts, HAS_LORA, COMPUTE_DW, EVEN_K, DOT_PRECISION, W_TMA, MAT_NK,
                BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R,
            )
    else:
        _down_backward_silu_tile(
            tl.program_id(0), tl.program_id(1), dout_ptr, stride_d_tok, stride_d_k, w_ptr, stride_w_e, stride_w_k,
            stride_w_n, lora_q_ptr, stride_q_row, stride_q_r, lora_a_ptr, stride_la_e, stride_la_r, stride_la_n,
            gu_ptr, stride_gu_row, stride_gu_n, dgu_ptr, stride_dgu_row, stride_dgu_n, row_weight_ptr, dw_ptr,
            sorted_slot_ptr, sorted_token_ptr, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
            I, K, R, lora_scale, num_experts, HAS_LORA, COMPUTE_DW, EVEN_K, DOT_PRECISION, W_TMA, MAT_NK,
            BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R,
        )


_down_backward_kernel = with_even_k(_down_backward_silu_kernel)
_down_backward_kernel_unspecialized = with_even_k(unspecialized_twin(_down_backward_silu_kernel))
_down_backward_kernel_tuned = make_tuned(
    _down_backward_kernel, "down_backward",
    key=["I", "K", "HAS_LORA", "COMPUTE_DW", "BLOCK_M", "PERSISTENT"],
    reset_to_zero=["dw_ptr"],
)


def down_backward_silu(
    grad_out: torch.Tensor,
    down_proj: torch.Tensor,
    gu: torch.Tensor,
    row_weight: torch.Tensor,
    routing: ExpertRouting,
    *,
    compute_router_grad: bool,
    lora: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    tune: bool = True,
    config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dGU (S, 2I), dw (S,) fp32 or None) from dOut (T, H), W2 (E, H, I), saved GU and weights (S,).

    ``lora = (Q2 (S, R), A2 (E, R, I), scale)`` adds the LoRA path of the down projection.
    """
    check_interpreter_dtype(grad_out, op="down_backward_silu")
    num_experts, hidden, inter = down_proj.shape
    num_rows = routing.num_assignments
    if grad_out.shape != (routing.num_tokens, hidden):
        raise ValueError(f"dOut {tuple(grad_out.shape)} != ({routing.num_tokens}, {hidden})")
    if gu.shape != (num_rows, 2 * inter):
        raise ValueError(f"saved GU {tuple(gu.shape)} != ({num_rows}, {2 * inter})")
    if row_weight.shape != (num_rows,):
        raise ValueError(f"routing weights must be flat ({num_rows},), got {tuple(row_weight.shape)}")
    dgu = torch.empty_like(gu)
    dw = torch.zeros(num_rows, device=gu.device, dtype=torch.float32) if compute_router_grad else None
    if num_rows == 0 or inter == 0:
        return dgu, dw
    if lora is not None:
        lora_q, lora_a, lora_scale = lora
        rank = lora_q.shape[1]
        if lora_a.shape != (num_experts, rank, inter):
            raise ValueError(f"LoRA A {tuple(lora_a.shape)} does not fit down_proj {tuple(down_proj.shape)}")
        block_r = rank_block_size(rank)
    else:
        lora_q, lora_a, lora_scale, rank, block_r = gu, down_proj, 0.0, 0, 16
    # without the router gradient the kernel never touches dw_ptr, but the autotuner zeroes it before every timed
    # config (reset_to_zero): a one-element scratch buffer, never an input (the routing weights once stood in
    # here, and the first, tuning call of a layer whose router needs no gradient zeroed them: every LoRA
    # gradient of that layer came back zero)
    dw_arg = dw if dw is not None else torch.empty(1, device=gu.device, dtype=torch.float32)
    args = (
        grad_out, grad_out.stride(0), grad_out.stride(1),
        down_proj, down_proj.stride(0), down_proj.stride(1), down_proj.stride(2),
        lora_q, lora_q.stride(0), lora_q.stride(1),
        lora_a, lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        gu, gu.stride(0), gu.stride(1),
        dgu, dgu.stride(0), dgu.stride(1),
        row_weight, dw_arg,
        routing.sorted_slot, routing.sorted_token, routing.tile_expert, routing.tile_row_start,
        routing.expert_offsets,
        inter, hidden, rank, float(lora_scale), num_experts, routing.max_tiles,
    )
    flags = dict(
        HAS_LORA=lora is not None, COMPUTE_DW=dw is not None, DOT_PRECISION=dot_precision(gu.dtype),
        BLOCK_M=routing.block_m, BLOCK_R=block_r,
    )
    launch_row_tiles(
        _down_backward_kernel_tuned, _down_backward_kernel, _down_backward_kernel_unspecialized, args, flags,
        kind="down_backward", num_cols=inter, num_tiles=routing.max_tiles, tune=tune, config=resolve_config(config),
        weight=(3, down_proj), k_dim=hidden, num_rows=num_rows, num_experts=num_experts,
    )
    return dgu, dw


def down_backward_silu_reference(
    grad_out: torch.Tensor,
    down_proj: torch.Tensor,
    gu: torch.Tensor,
    row_weight: torch.Tensor,
    routing: ExpertRouting,
    *,
    lora: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch per-expert loop in fp32: (dGU, dw) in sorted / assignment order."""
    token = routing.sorted_token.long()
    slot = routing.sorted_slot.long()
    inter = down_proj.shape[2]
    dgu = torch.zeros(routing.num_assignments, 2 * inter, device=gu.device, dtype=torch.float32)
    dw = torch.zeros(routing.num_assignments, device=gu.device, dtype=torch.float32)
    for e, lo, hi in routing.nonempty_experts():
        d = grad_out[token[lo:hi]].float() @ down_proj[e].float()
        if lora is not None:
            lora_q, lora_a, scale = lora
            d = d + scale * lora_q[lo:hi].float() @ lora_a[e].float()
        g, u = gu[lo:hi].float().chunk(2, dim=-1)
        sig = torch.sigmoid(g)
        dw[slot[lo:hi]] = (d * g * sig * u).sum(-1)
        dh = d * row_weight.float()[slot[lo:hi]][:, None]
        dgu[lo:hi] = torch.cat([dh * u * sig * (1 + g * (1 - sig)), dh * g * sig], dim=-1)
    return dgu.to(gu.dtype), dw

"""Expert gate/up projection with SiLU·up fused into the GEMM epilogue (forward of the MoE MLP).

transformers stores W1 = ``gate_up_proj`` as (E, 2I, H): rows [0, I) are the gate projection,
rows [I, 2I) the up projection. For sorted row j of expert e and token t = sorted_token[j]:

    g_j = X[t] @ W1_e[:I]ᵀ  + s₁ · P1_j @ B1_e[:I]ᵀ       P1_j = X[t] @ A1_eᵀ  (LoRA, optional)
    u_j = X[t] @ W1_e[I:]ᵀ  + s₁ · P1_j @ B1_e[I:]ᵀ
    h_j = w_j · SiLU(g_j) · u_j = w_j · g_j · σ(g_j) · u_j      w_j: the row's routing weight (1 without one)

One program owns a (BLOCK_M rows) × (BLOCK_N columns of I) tile and keeps two accumulators, the
gate and the up column blocks, so SiLU·up is applied before anything leaves registers. X rows
are gathered by token inside the load (no sorted copy of X). Outputs, in X's dtype:

    GU (S, 2I) = [g | u]   saved for backward (SiLU'·up needs g and u)
    h  (S, I)              the input of the down projection, also saved (dW2, dA2 need it)

With ``row_weight`` the routing weight is folded into h here, once, in fp32 before the rounding: every later use of h
in the layer is weighted (the down projection's output, dW2 = Σ dOutᵀ h, dA2 = s₂ Σ Q2ᵀ h), so the down GEMM and the
weight-gradient GEMMs need no per-row scaling. Scaling the gathered operand inside the dW2 GEMM cost it half its
speed: on the H200 at the 30B-A3B-like layer, 8k tokens, dW2 (gathered, weighted) took 1.68 ms and dW1 (twice the
FLOPs, not weighted) 1.17 ms (a kernel timeline of af954d1 traced by ``tools/moe_host_profile.py``).
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
    load_expert_block,
    load_k_by_cols,
    load_rank_cols,
    load_rank_rows,
    load_rows_by_k,
    rows_of_tile,
    with_even_k,
)
from lora_lab.kernels.triton_helpers import check_interpreter_dtype, dot_precision, tile_coords


@triton.jit
def _gate_up_silu_tile(
    pid_n, tile,
    x_ptr, stride_x_tok, stride_x_k,
    w_ptr, stride_w_e, stride_w_n, stride_w_k,
    lora_p_ptr, stride_p_row, stride_p_r,
    lora_b_ptr, stride_lb_e, stride_lb_n, stride_lb_r,
    gu_ptr, stride_gu_row, stride_gu_n,
    h_ptr, stride_h_row, stride_h_n,
    sorted_token_ptr, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
    row_weight_ptr, sorted_slot_ptr,
    I, K, R, lora_scale, num_experts,
    HAS_LORA: tl.constexpr, ROW_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    W_TMA: tl.constexpr, MAT_NK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # one (row tile, column block of I); W1 through pointers, or (W_TMA) w_ptr is its (E, 2I, H) TMA descriptor
    expert = tl.load(tile_expert_ptr + tile)
    if expert < num_experts:  # tiles past the real total have nothing to do
        rows, row_mask, rows64, token = rows_of_tile(
            tile, expert, tile_row_start_ptr, expert_offsets_ptr, sorted_token_ptr, BLOCK_M,
        )

        off_n = pid_n * BLOCK_N
        cols = off_n + tl.arange(0, BLOCK_N)  # columns within I
        col_mask = cols < I
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + token[:, None] * stride_x_tok + offs_k[None, :] * stride_x_k
        if not W_TMA:
            w_base = w_ptr + expert.to(tl.int64) * stride_w_e + offs_k[:, None] * stride_w_k
            wg_ptrs = w_base + cols[None, :] * stride_w_n  # W1_e[:I]ᵀ tile (BLOCK_K, BLOCK_N)
            wu_ptrs = w_base + (cols + I)[None, :] * stride_w_n  # W1_e[I:]ᵀ tile

        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = load_rows_by_k(x_ptrs, row_mask, offs_k, k0, K, EVEN_K)
            if W_TMA:
                wg = load_expert_block(w_ptr, expert, k0, off_n, MAT_NK, BLOCK_K, BLOCK_N)
                wu = load_expert_block(w_ptr, expert, k0, off_n + I, MAT_NK, BLOCK_K, BLOCK_N)
            else:
                wg = load_k_by_cols(wg_ptrs, col_mask, offs_k, k0, K, EVEN_K)
                wu = load_k_by_cols(wu_ptrs, col_mask, offs_k, k0, K, EVEN_K)
            # g += X_rows @ W1_e[:I]ᵀ ;  u += X_rows @ W1_e[I:]ᵀ
            acc_g = tl.dot(x, wg, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(x, wu, acc_u, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K * stride_x_k
            if not W_TMA:
                wg_ptrs += BLOCK_K * stride_w_k
                wu_ptrs += BLOCK_K * stride_w_k

        if HAS_LORA:
            # [g | u] += s₁ · P1_rows @ B1_eᵀ   with B1_e: (2I, R)
            p = load_rank_rows(lora_p_ptr, rows64, row_mask, stride_p_row, stride_p_r, R, BLOCK_R)
            lb_e = lora_b_ptr + expert.to(tl.int64) * stride_lb_e
            bg = load_rank_cols(lb_e, cols, col_mask, stride_lb_r, stride_lb_n, R, BLOCK_R)  # B1_e[:I]ᵀ
            bu = load_rank_cols(lb_e, cols + I, col_mask, stride_lb_r, stride_lb_n, R, BLOCK_R)  # B1_e[I:]ᵀ
            acc_g += lora_scale * tl.dot(p, bg, input_precision=DOT_PRECISION)
            acc_u += lora_scale * tl.dot(p, bu, input_precision=DOT_PRECISION)

        # h = g · σ(g) · u, times the row's routing weight (ROW_WEIGHT; w of sorted row j: row_weight[sorted_slot[j]])
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        if ROW_WEIGHT:
            slot = tl.load(sorted_slot_ptr + rows64, mask=row_mask, other=0)
            h = h * tl.load(row_weight_ptr + slot, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        mask = row_mask[:, None] & col_mask[None, :]
        gu_ptrs = gu_ptr + rows64[:, None] * stride_gu_row + cols[None, :] * stride_gu_n
        out_ty = gu_ptr.dtype.element_ty
        tl.store(gu_ptrs, acc_g.to(out_ty), mask=mask)
        tl.store(gu_ptrs + I * stride_gu_n, acc_u.to(out_ty), mask=mask)
        tl.store(h_ptr + rows64[:, None] * stride_h_row + cols[None, :] * stride_h_n, h.to(out_ty), mask=mask)


@triton.jit
def _gate_up_silu_kernel(
    x_ptr, stride_x_tok, stride_x_k,
    w_ptr, stride_w_e, stride_w_n, stride_w_k,
    lora_p_ptr, stride_p_row, stride_p_r,
    lora_b_ptr, stride_lb_e, stride_lb_n, stride_lb_r,
    gu_ptr, stride_gu_row, stride_gu_n,
    h_ptr, stride_h_row, stride_h_n,
    sorted_token_ptr, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
    row_weight_ptr, sorted_slot_ptr,
    I, K, R, lora_scale, num_experts, num_tiles,
    HAS_LORA: tl.constexpr, ROW_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr, W_TMA: tl.constexpr, MAT_NK: tl.constexpr,
    NUM_SMS: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    if PERSISTENT:
        # one program per SM walks the (row tile, column block) pairs in grouped order
        num_pid_n = tl.cdiv(I, BLOCK_N)
        for work in tl.range(tl.program_id(0), num_tiles * num_pid_n, NUM_SMS):
            tile, pid_n = tile_coords(work, num_tiles, num_pid_n, GROUP_M)
            _gate_up_silu_tile(
                pid_n, tile, x_ptr, stride_x_tok, stride_x_k, w_ptr, stride_w_e, stride_w_n, stride_w_k,
                lora_p_ptr, stride_p_row, stride_p_r, lora_b_ptr, stride_lb_e, stride_lb_n, stride_lb_r,
                gu_ptr, stride_gu_row, stride_gu_n, h_ptr, stride_h_row, stride_h_n,
                sorted_token_ptr, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
                row_weight_ptr, sorted_slot_ptr,
                I, K, R, lora_scale, num_experts, HAS_LORA, ROW_WEIGHT, EVEN_K, DOT_PRECISION, W_TMA, MAT_NK,
                BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R,
            )
    else:
        _gate_up_silu_tile(
            tl.program_id(0), tl.program_id(1), x_ptr, stride_x_tok, stride_x_k, w_ptr, stride_w_e, stride_w_n,
            stride_w_k, lora_p_ptr, stride_p_row, stride_p_r, lora_b_ptr, stride_lb_e, stride_lb_n, stride_lb_r,
            gu_ptr, stride_gu_row, stride_gu_n, h_ptr, stride_h_row, stride_h_n,
            sorted_token_ptr, tile_expert_ptr, tile_row_start_ptr, expert_offsets_ptr,
            row_weight_ptr, sorted_slot_ptr,
            I, K, R, lora_scale, num_experts, HAS_LORA, ROW_WEIGHT, EVEN_K, DOT_PRECISION, W_TMA, MAT_NK,
            BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R,
        )


_gate_up_kernel = with_even_k(_gate_up_silu_kernel)
_gate_up_kernel_unspecialized = with_even_k(unspecialized_twin(_gate_up_silu_kernel))
_gate_up_kernel_tuned = make_tuned(
    _gate_up_kernel, "gate_up",
    key=["I", "K", "HAS_LORA", "ROW_WEIGHT", "BLOCK_M", "PERSISTENT"],
)


def gate_up_silu(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    routing: ExpertRouting,
    *,
    lora: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    row_weight: torch.Tensor | None = None,
    tune: bool = True,
    config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(GU, h) for X (T, H) and W1 (E, 2I, H); ``lora = (P1 (S, R), B1 (E, 2I, R), scale)``; ``row_weight`` (S,)
    in assignment order: h carries each row's routing weight (module docstring)."""
    if x.dim() != 2 or gate_up_proj.dim() != 3:
        raise ValueError("need X (T, H) and gate_up_proj (E, 2I, H); "
                         f"got {tuple(x.shape)}, {tuple(gate_up_proj.shape)}")
    check_interpreter_dtype(x, op="gate_up_silu")
    num_experts, two_i, hidden = gate_up_proj.shape
    if two_i % 2:
        raise ValueError(f"gate_up_proj dim 1 must be 2·intermediate (even), got {two_i}")
    if x.shape != (routing.num_tokens, hidden):
        raise ValueError(f"X {tuple(x.shape)} does not match tokens {routing.num_tokens} × hidden {hidden}")
    inter = two_i // 2
    num_rows = routing.num_assignments
    if row_weight is not None and row_weight.shape != (num_rows,):
        raise ValueError(f"routing weights must be flat ({num_rows},), got {tuple(row_weight.shape)}")
    gu = torch.empty(num_rows, two_i, device=x.device, dtype=x.dtype)
    h = torch.empty(num_rows, inter, device=x.device, dtype=x.dtype)
    if num_rows == 0 or inter == 0:
        return gu, h
    if lora is not None:
        lora_p, lora_b, lora_scale = lora
        rank = lora_p.shape[1]
        if lora_b.shape != (num_experts, two_i, rank):
            raise ValueError(f"LoRA B {tuple(lora_b.shape)} does not fit gate_up_proj {tuple(gate_up_proj.shape)}")
        block_r = rank_block_size(rank)
    else:
        lora_p, lora_b, lora_scale, rank, block_r = x, gate_up_proj, 0.0, 0, 16
    args = (
        x, x.stride(0), x.stride(1),
        gate_up_proj, gate_up_proj.stride(0), gate_up_proj.stride(1), gate_up_proj.stride(2),
        lora_p, lora_p.stride(0), lora_p.stride(1),
        lora_b, lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        gu, gu.stride(0), gu.stride(1),
        h, h.stride(0), h.stride(1),
        routing.sorted_token, routing.tile_expert, routing.tile_row_start, routing.expert_offsets,
        row_weight if row_weight is not None else x, routing.sorted_slot,
        inter, hidden, rank, float(lora_scale), num_experts, routing.max_tiles,
    )
    flags = dict(
        HAS_LORA=lora is not None, ROW_WEIGHT=row_weight is not None, DOT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=routing.block_m, BLOCK_R=block_r,
    )
    launch_row_tiles(
        _gate_up_kernel_tuned, _gate_up_kernel, _gate_up_kernel_unspecialized, args, flags,
        kind="gate_up", num_cols=inter, num_tiles=routing.max_tiles, tune=tune, config=resolve_config(config),
        weight=(3, gate_up_proj.transpose(1, 2)), k_dim=hidden, num_rows=num_rows, num_experts=num_experts,
    )
    return gu, h


def gate_up_silu_reference(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    routing: ExpertRouting,
    *,
    lora: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    row_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch per-expert loop in fp32 (rows outside every expert stay zero)."""
    token = routing.sorted_token.long()
    two_i = gate_up_proj.shape[1]
    gu = torch.zeros(routing.num_assignments, two_i, device=x.device, dtype=torch.float32)
    for e, lo, hi in routing.nonempty_experts():
        part = x[token[lo:hi]].float() @ gate_up_proj[e].float().T
        if lora is not None:
            lora_p, lora_b, scale = lora
            part = part + scale * lora_p[lo:hi].float() @ lora_b[e].float().T
        gu[lo:hi] = part
    g, u = gu.chunk(2, dim=-1)
    h = torch.nn.functional.silu(g) * u
    if row_weight is not None:
        h = h * row_weight.float()[routing.sorted_slot.long()][:, None]
    return gu.to(x.dtype), h.to(x.dtype)

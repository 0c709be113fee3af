"""Per-expert weight gradient: a grouped GEMM that reduces over each expert's own rows.

For every expert e with sorted rows j ∈ [offsets[e], offsets[e+1]):

    G_e = scale · Σ_j  (w_j · A[src_a(j), :])ᵀ  B[src_b(j), :]          G_e: (M, N)

    src(j) = sorted_token[j] if GATHER (rows of X or dOut, read in place), else j (sorted rows)
    w_j    = routing weight of row j if ROW_WEIGHT, else 1

Uses (W1 = gate_up_proj (E, 2I, H), W2 = down_proj (E, H, I), dGU: (S, 2I), h = SiLU(g)·u: (S, I)):

    dW1_e = Σ_j dGU_jᵀ X[tok_j]                          (2I, H)  full fine-tuning
    dW2_e = Σ_j (w_j dOut[tok_j])ᵀ h_j                   (H, I)   full fine-tuning
    dA1_e = s₁ Σ_j Q1_jᵀ X[tok_j],   dB1_e = s₁ Σ_j dGU_jᵀ P1_j          LoRA on gate_up_proj
    dA2_e = s₂ Σ_j w_j Q2_jᵀ h_j,    dB2_e = s₂ Σ_j (w_j dOut[tok_j])ᵀ P2_j   LoRA on down_proj

An expert that received no token gets an exact zero gradient (the loop runs zero times).

``KernelConfig.moe_loads='persistent'``: one program per SM walks expert by expert, each
expert's (M, N) tiles in grouped order, and a sorted operand (not gathered by token) is read through a TMA
descriptor where its rows are 16-byte aligned (its rows past the expert's end are zeroed after the load).

**Which engine** (``KernelConfig.moe_weight_grad``; :func:`weight_grad_engine`). ``per_tile`` is the Triton kernel
below. ``grouped_mm`` sends dW1 and dW2 of full fine-tuning to ``torch._grouped_mm`` (:func:`grouped_mm_weight_grad`);
every gradient that function declines (the LoRA factors' rank-sized sides, unaligned rows) stays with the Triton kernel.
``auto``, the default, takes ``per_tile`` everywhere; ``grouped_mm`` is opt-in. The history of that rule:
in isolation ``_grouped_mm`` with its gathers ran dW1 1.43x and dW2 2.08x as fast as ``per_tile`` (H200, the
Qwen3-30B-A3B-like layer, 8,192 tokens, bf16;
the ledger's moe_weight_grad rows of commit d30ccda), but the whole layer told otherwise:
with ``grouped_mm`` it took 8.94 ms against 7.58 ms with ``per_tile`` at 8,192 tokens, and 25.54 against 25.77 ms at
32,768 (one session, 3 repetitions; the ledger's moe rows of commit eecd7de).
Notebook 06's H200 run of 6c94d2c then found ``grouped_mm`` slower with at most 1,024 rows per expert (every 8k cell)
and faster above 2,048 (1.085x at the Qwen1.5-MoE-like layer's 2,185 rows, 1.202x at DeepSeek-V2-Lite's 3,072, 1.139x
at OLMoE's 4,096), so ``auto`` took ``grouped_mm`` above 2,112 rows per expert. Then the routing weight moved into h
(the down GEMM's rows), which left dW2 an unweighted operand, and notebook 06's H200 run of a6cdfd4 timed
``ours_per_tile`` beside ``auto`` in the three 32k cells above that bound: ``per_tile`` was the faster one in all three
(medians 17.77 against 19.55 ms on the Qwen1.5-MoE-like layer, 26.06 against 27.63 on DeepSeek-V2-Lite, 25.78 against
28.27 on OLMoE; 95% intervals apart; ``outputs/gpu/06_moe_layer_summary.csv``) and tied at the GPT-OSS-20B-like layer
(38.89 against 39.05 ms, 4,096 rows). So ``auto`` no longer sends the weight gradients to ``_grouped_mm``.

Work decomposition (``KernelConfig.moe_weight_grad='per_tile'``): no split-K and no atomics; one
program per (tile of G_e, expert), each reducing over the expert's whole row range in its own pipelined K loop
and storing its tile once. ``moe_weight_grad='kgrouped'`` (opt-in, not yet timed on a GPU) runs the same sum in
:mod:`~lora_lab.kernels.moe.kgrouped_weight_grad`: one program per SM whose single loop walks the K-steps of all its
(expert, tile) items, meant to keep the software pipeline from draining and refilling at every tile (its docstring
says why that matters at ~8 K-steps per tile, and that Triton 3.9 does not yet pipeline that loop: opt-in only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_lab.kernels.config import KernelConfig, resolve_config
from lora_lab.kernels.moe.kgrouped_weight_grad import launch_kgrouped_weight_grad
from lora_lab.kernels.moe.launch import (
    autotune_enabled,
    fixed_kernel,
    heuristic_meta,
    make_tuned,
    narrow_block_size,
    set_expert_block_shape,
    unspecialized_twin,
)
from lora_lab.kernels.moe.routing import ExpertRouting
from lora_lab.kernels.moe.tiles import launch_grid, row_descriptor, schedule_flags, weight_grad_k_step
from lora_lab.kernels.triton_helpers import (
    cdiv,
    check_interpreter_dtype,
    dot_precision,
    tile_coords,
)


@triton.jit
def _expert_weight_grad_tile(
    pid_m, pid_n, expert,
    a_ptr, stride_a_row, stride_a_m,
    b_ptr, stride_b_row, stride_b_n,
    out_ptr, stride_out_e, stride_out_m, stride_out_n,
    row_weight_ptr, sorted_slot_ptr, sorted_token_ptr, expert_offsets_ptr,
    M, N, scale,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, ROW_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    A_TMA: tl.constexpr, B_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # one (BLOCK_M, BLOCK_N) tile of G_e; a sorted (not gathered) operand is read through its TMA descriptor when
    # A_TMA / B_TMA (rows past the expert's end belong to the next expert: zeroed after the load)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    row_start = tl.load(expert_offsets_ptr + expert)
    row_end = tl.load(expert_offsets_ptr + expert + 1)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # reduce over this expert's rows, BLOCK_K rows at a time
    for k0 in range(row_start, row_end, BLOCK_K):
        acc = weight_grad_k_step(acc, k0, row_end, off_m, off_n, a_ptr, stride_a_row, stride_a_m, b_ptr,
                                 stride_b_row, stride_b_n, row_weight_ptr, sorted_slot_ptr, sorted_token_ptr, M, N,
                                 GATHER_A, GATHER_B, ROW_WEIGHT, DOT_PRECISION, A_TMA, B_TMA,
                                 BLOCK_M, BLOCK_N, BLOCK_K)

    acc = acc * scale
    out_ptrs = (out_ptr + expert.to(tl.int64) * stride_out_e + offs_m[:, None] * stride_out_m
                + offs_n[None, :] * stride_out_n)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _expert_weight_grad_kernel(
    a_ptr, stride_a_row, stride_a_m,
    b_ptr, stride_b_row, stride_b_n,
    out_ptr, stride_out_e, stride_out_m, stride_out_n,
    row_weight_ptr, sorted_slot_ptr, sorted_token_ptr, expert_offsets_ptr,
    M, N, scale, num_experts,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, ROW_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr,
    NUM_SMS: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        # one program per SM walks expert by expert, each expert's tiles in grouped order (its rows stay in L2)
        tiles = num_m * num_n
        for work in tl.range(tl.program_id(0), num_experts * tiles, NUM_SMS):
            pid_m, pid_n = tile_coords(work % tiles, num_m, num_n, GROUP_M)
            _expert_weight_grad_tile(
                pid_m, pid_n, work // tiles, a_ptr, stride_a_row, stride_a_m, b_ptr, stride_b_row, stride_b_n,
                out_ptr, stride_out_e, stride_out_m, stride_out_n,
                row_weight_ptr, sorted_slot_ptr, sorted_token_ptr, expert_offsets_ptr, M, N, scale,
                GATHER_A, GATHER_B, ROW_WEIGHT, DOT_PRECISION, A_TMA, B_TMA, BLOCK_M, BLOCK_N, BLOCK_K,
            )
    else:
        pid = tl.program_id(0)
        _expert_weight_grad_tile(
            pid // num_n, pid % num_n, tl.program_id(1), a_ptr, stride_a_row, stride_a_m, b_ptr, stride_b_row,
            stride_b_n, out_ptr, stride_out_e, stride_out_m, stride_out_n,
            row_weight_ptr, sorted_slot_ptr, sorted_token_ptr, expert_offsets_ptr, M, N, scale,
            GATHER_A, GATHER_B, ROW_WEIGHT, DOT_PRECISION, A_TMA, B_TMA, BLOCK_M, BLOCK_N, BLOCK_K,
        )


KGROUPED_FLAGS = ("GATHER_A", "GATHER_B", "ROW_WEIGHT", "DOT_PRECISION", "A_TMA", "B_TMA")
_expert_weight_grad_kernel_unspecialized = unspecialized_twin(_expert_weight_grad_kernel)
_weight_grad_kernel_tuned = make_tuned(
    _expert_weight_grad_kernel, "weight_grad",
    key=["M", "N", "GATHER_A", "GATHER_B", "ROW_WEIGHT", "PERSISTENT", "A_TMA", "B_TMA"],
)


def expert_weight_grad(
    a: torch.Tensor,
    b: torch.Tensor,
    routing: ExpertRouting,
    *,
    gather_a: bool,
    gather_b: bool,
    row_weight: torch.Tensor | None = None,
    scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
    tune: bool = True,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """G (E, M, N) with G_e = scale · Σ_{j ∈ e} (w_j A[src_a(j)])ᵀ B[src_b(j)]."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"expert_weight_grad needs 2-D row operands, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"A is {a.dtype} but B is {b.dtype}")
    for name, t, gathered in (("A", a, gather_a), ("B", b, gather_b)):
        expected = routing.num_tokens if gathered else routing.num_assignments
        if t.shape[0] != expected:
            raise ValueError(f"{name} has {t.shape[0]} rows, expected {expected} (gather={gathered})")
    check_interpreter_dtype(a, op="expert_weight_grad")
    m_dim, n_dim = a.shape[1], b.shape[1]
    num_experts = routing.num_experts
    if num_experts * m_dim * n_dim == 0:
        return torch.empty(num_experts, m_dim, n_dim, device=a.device, dtype=out_dtype or a.dtype)
    config = resolve_config(config)
    engine = weight_grad_engine(config)
    if engine == "grouped_mm" and (out_dtype or a.dtype) == a.dtype:
        # CUTLASS's grouped GEMM with K split at the expert offsets; its result is the gradient (no second E x M x N
        # buffer to copy it into)
        done = grouped_mm_weight_grad(a, b, routing, gather_a=gather_a, gather_b=gather_b, row_weight=row_weight,
                                      scale=scale)
        if done is not None:
            return done
    out = torch.empty(num_experts, m_dim, n_dim, device=a.device, dtype=out_dtype or a.dtype)
    weight = row_weight if row_weight is not None else a
    flags = dict(
        GATHER_A=gather_a, GATHER_B=gather_b, ROW_WEIGHT=row_weight is not None,
        DOT_PRECISION=dot_precision(a.dtype), A_TMA=False, B_TMA=False, **schedule_flags(config, a.device),
    )
    a_arg, b_arg = a, b
    if flags["PERSISTENT"]:
        # a sorted operand (not gathered by token) is read through TMA where its rows are aligned
        if not gather_a:
            a_arg, flags["A_TMA"] = _descriptor_or_pointer(a)
        if not gather_b:
            b_arg, flags["B_TMA"] = _descriptor_or_pointer(b)
    args = (
        a_arg, a.stride(0), a.stride(1),
        b_arg, b.stride(0), b.stride(1),
        out, out.stride(0), out.stride(1), out.stride(2),
        weight, routing.sorted_slot, routing.sorted_token, routing.expert_offsets,
        m_dim, n_dim, float(scale), num_experts,
    )

    if engine == "kgrouped":  # one flat pipelined loop per SM over its items' K-steps
        kgrouped_flags = {name: flags[name] for name in KGROUPED_FLAGS}
        launch_kgrouped_weight_grad(args, kgrouped_flags, m_dim=m_dim, n_dim=n_dim, num_experts=num_experts,
                                    num_rows=routing.num_assignments, device=a.device, tune=tune, config=config)
        return out

    def grid_of(block_m, block_n):
        return launch_grid(flags, (cdiv(m_dim, block_m) * cdiv(n_dim, block_n), num_experts))

    narrow = min(m_dim, n_dim) <= 128  # LoRA factor gradients: rank-sized side, fixed tiles
    if tune and autotune_enabled(config) and not narrow:
        tuned = _weight_grad_kernel_tuned[flags["PERSISTENT"]]
        tuned[lambda meta: grid_of(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **flags)
    else:
        num_rows = routing.num_assignments
        meta = heuristic_meta("weight_grad", block_m=128, n_dim=n_dim, k_dim=num_rows,
                              rows_per_expert=num_rows / max(num_experts, 1))
        if m_dim <= 128:
            meta["BLOCK_M"] = narrow_block_size(m_dim, config, volume=m_dim * n_dim * num_rows)
        if n_dim <= 128:
            meta["BLOCK_N"] = narrow_block_size(n_dim, config, volume=m_dim * n_dim * num_rows)
        set_expert_block_shape({"a_ptr": a_arg, "b_ptr": b_arg, **flags, **meta})
        kernel = fixed_kernel(_expert_weight_grad_kernel, _expert_weight_grad_kernel_unspecialized, config,
                              volume=m_dim * n_dim * num_rows)
        kernel[grid_of(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **flags, **meta)
    return out


def weight_grad_engine(config: KernelConfig) -> str:
    """``config.moe_weight_grad`` with ``auto`` resolved: ``per_tile`` on every device and shape since notebook 06's
    H200 run of a6cdfd4 (the module docstring has the measurement); an explicit setting is taken as given."""
    return "per_tile" if config.moe_weight_grad == "auto" else config.moe_weight_grad


def grouped_mm_weight_grad(a: torch.Tensor, b: torch.Tensor, routing: ExpertRouting, *, gather_a: bool,
                           gather_b: bool, row_weight: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    """G (E, M, N) in A's dtype by one ``torch._grouped_mm`` (``KernelConfig.moe_weight_grad='grouped_mm'``), or None
    where it does not apply — torch without ``_grouped_mm``, a rank-sized side (the LoRA factors' gradients: the
    Triton kernel's narrow tiles), rows whose byte width is not a multiple of 16.

    The rows are put in expert order first (``index_select`` of a gathered operand; a sorted operand is read as it
    is), A's rows scaled by their routing weight where one is given (a fresh copy, as the Triton kernel applies it).
    Then ``_grouped_mm(Aᵀ, B, offs)`` reduces each expert's rows — K split at the expert offsets, one (M, N) block
    per expert. Rows of out-of-range expert ids sort after the last expert (:mod:`.routing`: ``offsets[0]`` is 0),
    outside every group, so they are never read and need no mask. An expert without rows gets an exact zero."""
    from lora_lab.kernels.moe.engine import grouped_mm_available, k_grouped_mm

    m_dim, n_dim = a.shape[1], b.shape[1]
    if (not grouped_mm_available() or min(m_dim, n_dim) <= 128
            or (m_dim * a.element_size()) % 16 or (n_dim * b.element_size()) % 16):
        return None
    token = routing.sorted_token.long()
    rows_b = b.index_select(0, token) if gather_b else b.contiguous()
    rows_a = a.index_select(0, token) if gather_a else a.contiguous()
    if row_weight is not None:
        # scaled in place on a fresh buffer in A's dtype (the gather makes one; a sorted operand is copied): the
        # product formed in fp32 and rounded once into A's dtype, without an fp32 copy of the rows
        if not gather_a:
            rows_a = rows_a.clone()
        rows_a.mul_(row_weight.index_select(0, routing.sorted_slot.long()).to(torch.float32)[:, None])
    return k_grouped_mm(rows_a, rows_b, routing.expert_offsets[1:].to(torch.int32), scale)


def _descriptor_or_pointer(rows: torch.Tensor):
    """(TMA descriptor, True) for a row operand TMA can read, else (the tensor, False)."""
    try:
        return row_descriptor(rows), True
    except ValueError:
        return rows, False


def expert_weight_grad_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    routing: ExpertRouting,
    *,
    gather_a: bool,
    gather_b: bool,
    row_weight: torch.Tensor | None = None,
    scale: float = 1.0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain-torch per-expert loop in fp32, returned in A's dtype; with ``dtype`` (e.g. fp64), computed and
    returned in that dtype."""
    work = dtype or torch.float32
    token = routing.sorted_token.long()
    out = torch.zeros(routing.num_experts, a.shape[1], b.shape[1], device=a.device, dtype=work)
    for e, lo, hi in routing.nonempty_experts():
        rows = torch.arange(lo, hi, device=a.device)
        a_rows = a[token[lo:hi] if gather_a else rows].to(work)
        b_rows = b[token[lo:hi] if gather_b else rows].to(work)
        if row_weight is not None:
            a_rows = a_rows * row_weight.to(work)[routing.sorted_slot[lo:hi].long()][:, None]
        out[e] = scale * a_rows.T @ b_rows
    return out if dtype is not None else out.to(a.dtype)

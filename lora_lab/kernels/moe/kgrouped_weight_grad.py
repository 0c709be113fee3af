"""Per-expert weight gradient as a K-grouped GEMM, one software pipeline per program (``moe_weight_grad="kgrouped"``).

Same contract as :func:`~lora_lab.kernels.moe.expert_weight_grad.expert_weight_grad` (which launches this kernel when
``KernelConfig.moe_weight_grad == 'kgrouped'``): for every expert e with sorted rows j ∈ [offsets[e], offsets[e+1])

    G_e = scale · Σ_j (w_j · A[src_a(j), :])ᵀ B[src_b(j), :]                 G_e: (M, N), K = the expert's rows

What the default kernel (``moe_weight_grad='per_tile'``) does
-------------------------------------------------------------
It is already K-grouped in its *decomposition*: no split-K, no atomics; one program per (dW tile, expert) (grid
``(tiles of G_e, E)``, or with ``moe_loads='persistent'`` one program per SM taking the (expert, tile) items in turn),
each program reducing over its expert's whole row range and storing its tile once. What it lacks is a pipeline that
spans tiles: every tile is its own K loop, so each tile pays the software pipeline's fill (the first ``num_stages - 1``
row blocks: a ``sorted_token`` load, then the dependent gather, before the first MMA can start) and its drain (wait
for the last MMA, scale, convert, store) with nothing to overlap them. At the Qwen3-30B-A3B-like layer of notebook 06
(H 2048, I 768, 128 experts, top-8) at 8,192 tokens an expert holds 512 rows on average: 8 K-steps of 64 rows per
128 x 128 tile, about 2.2 µs of tensor-core work per tile on one H200 SM (16.8 MFLOP at 989/132 TFLOP/s), against a
fill of two dependent global loads plus the epilogue per tile — the same order of time. (The short K is the problem's:
a tile of G_e can reduce over no more than the rows expert e received, however the work is split.)

What this kernel changes
------------------------
One program per SM (grid ``min(SMs, E · tiles)``) owns the work items w ≡ program (mod SMs) of the list
(expert-major, each expert's tiles in grouped order) and walks *all of their K-steps in one flat loop*: a step either
continues the current tile or, after the last step of a tile, has stored it and reset the accumulator, then moves
on to the next item: a single ``for`` over the program's whole K (Σ over its items of max(cdiv(rows_e, BLOCK_K), 1)
steps, counted up front from the expert offsets in one vector load). The intent: the loads of the next tile's first
row blocks in flight while the current tile's last MMAs and its store run, the fill paid once per program instead
of once per tile. Triton's own nested-loop flattening (``tl.range(..., flatten=True)``) does not apply: it needs the
inner trip count to be the same for every outer iteration, and here it is each expert's row count.

**Status (Triton 3.9, sm_90 compiled on a CPU with ``tools/moe_weight_grad_sm90.py``): the intent is not met.**
Triton's software pipeliner leaves this flat loop unpipelined — every row block is copied and waited on before its
MMA — because the loop stores and resets its accumulator inside it (a minimal kernel showed it: the same loop
without the in-loop reset is pipelined; with it, as a select or an ``if``, with or without the store, it is not).
The default kernel's per-tile K loop *is* pipelined (two buffers, the next row block loaded during the MMA). Expect
this kernel to be slower than the default until the epilogue is taken out of the pipelined loop (a warp-specialised
producer, a newer Triton's pipeliner, or CUTLASS / DeepGEMM-style K-grouped GEMM); it stays opt-in and correct
(``tests/kernels/moe/test_moe_weight_grad_sm90.py`` holds an xfail that passes once it is pipelined).
Consecutive programs take consecutive tiles of one expert at the same time, so an expert's rows (gathered X or dOut,
sorted dGU or h) are read from L2 by all of them. This is the schedule of the K-grouped weight-gradient GEMMs of
DeepGEMM and SonicMoE (a persistent producer that keeps streaming across tile boundaries), written here as one
software-pipelined Triton loop rather than a warp-specialised kernel.

Rows are gathered in the loader (``sorted_token`` for the operands read by token), masked past the expert's end;
with ``moe_loads='persistent'`` a sorted operand is read through a TMA descriptor where aligned (its rows past the
expert's end zeroed after the load), as the default kernel does. Every (expert, tile) is written exactly once: an
expert without rows gets one step of zero rows and a stored zero tile (the output need not be zero-filled). fp32
accumulation, one store per tile, no atomics: deterministic, and the order of summation over an expert's rows is the
default kernel's (BLOCK_K rows at a time, in sorted order; in the CPU interpreter both give identical results for the
same tile config, which the tests check).

Load balance is static (round robin over the items): with very uneven experts a program can hold more steps than
another. Not measured yet; never run on a GPU at the time of writing — opt in with ``moe_weight_grad='kgrouped'``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lora_lab.kernels.config import KernelConfig
from lora_lab.kernels.moe.launch import (
    autotune_enabled,
    fixed_kernel,
    heuristic_meta,
    make_tuned,
    narrow_block_size,
    set_expert_block_shape,
    unspecialized_twin,
)
from lora_lab.kernels.moe.tiles import GROUP_M, weight_grad_k_step
from lora_lab.kernels.triton_helpers import cdiv, next_power_of_2, num_sms, tile_coords


@triton.jit
def _kgrouped_weight_grad_kernel(
    a_ptr, stride_a_row, stride_a_m,
    b_ptr, stride_b_row, stride_b_n,
    out_ptr, stride_out_e, stride_out_m, stride_out_n,
    row_weight_ptr, sorted_slot_ptr, sorted_token_ptr, expert_offsets_ptr,
    M, N, scale, num_experts,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, ROW_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    A_TMA: tl.constexpr, B_TMA: tl.constexpr,
    NUM_SMS: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    tiles = num_m * num_n

    # this program's steps: Σ_e (its items among expert e's tiles) · max(cdiv(rows_e, BLOCK_K), 1).
    # Items w = pid, pid + NUM_SMS, ...; those below x number cdiv(max(x - pid, 0), NUM_SMS).
    experts = tl.arange(0, BLOCK_E)
    e_mask = experts < num_experts
    lo = tl.load(expert_offsets_ptr + experts, mask=e_mask, other=0)
    hi = tl.load(expert_offsets_ptr + experts + 1, mask=e_mask, other=0)
    expert_steps = tl.maximum(tl.cdiv(hi - lo, BLOCK_K), 1)
    first_item = experts * tiles
    owned = (tl.cdiv(tl.maximum(first_item + tiles - pid, 0), NUM_SMS)
             - tl.cdiv(tl.maximum(first_item - pid, 0), NUM_SMS))
    total_steps = tl.sum(tl.where(e_mask, owned * expert_steps, 0), axis=0)

    # The current item (work: rows [row_start, row_end), step ki of steps) and the next item's rows, loaded one item
    # ahead, so that no load in a step feeds that step's addresses but the row-index loads. (Tried for the pipeliner's
    # sake; what still stops it is the store and accumulator reset below, see the module docstring.)
    work = pid
    row_start = tl.load(expert_offsets_ptr + pid // tiles)
    row_end = tl.load(expert_offsets_ptr + pid // tiles + 1)
    following = tl.minimum((pid + NUM_SMS) // tiles, num_experts - 1)  # (clamped: past the last item, unused)
    next_start = tl.load(expert_offsets_ptr + following)
    next_end = tl.load(expert_offsets_ptr + following + 1)
    steps = tl.maximum(tl.cdiv(row_end - row_start, BLOCK_K), 1)
    ki = pid * 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, total_steps):
        advance = ki == steps  # the previous step was its item's last (stored): on to this program's next item
        work = tl.where(advance, work + NUM_SMS, work)
        row_start = tl.where(advance, next_start, row_start)
        row_end = tl.where(advance, next_end, row_end)
        steps = tl.maximum(tl.cdiv(row_end - row_start, BLOCK_K), 1)
        ki = tl.where(advance, 0, ki)
        following = tl.minimum((work + NUM_SMS) // tiles, num_experts - 1)
        next_start = tl.where(advance, tl.load(expert_offsets_ptr + following, mask=advance, other=0), next_start)
        next_end = tl.where(advance, tl.load(expert_offsets_ptr + following + 1, mask=advance, other=0), next_end)
        expert = work // tiles
        pid_m, pid_n = tile_coords(work % tiles, num_m, num_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N

        acc = weight_grad_k_step(acc, row_start + ki * BLOCK_K, row_end, off_m, off_n, a_ptr, stride_a_row,
                                 stride_a_m, b_ptr, stride_b_row, stride_b_n, row_weight_ptr, sorted_slot_ptr,
                                 sorted_token_ptr, M, N, GATHER_A, GATHER_B, ROW_WEIGHT, DOT_PRECISION, A_TMA, B_TMA,
                                 BLOCK_M, BLOCK_N, BLOCK_K)

        ki += 1
        if ki == steps:  # the tile's last step: one store, then a fresh accumulator for the next item
            offs_m = off_m + tl.arange(0, BLOCK_M)
            offs_n = off_n + tl.arange(0, BLOCK_N)
            out_ptrs = (out_ptr + expert.to(tl.int64) * stride_out_e + offs_m[:, None] * stride_out_m
                        + offs_n[None, :] * stride_out_n)
            tl.store(out_ptrs, (acc * scale).to(out_ptr.dtype.element_ty),
                     mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


_kgrouped_weight_grad_kernel_unspecialized = unspecialized_twin(_kgrouped_weight_grad_kernel)
# {with TMA descriptors: kernel}: the TMA form carries the descriptor pre-hook (tuned per process), the pointer form
# keeps its picks in Triton's disk cache where it can (launch.make_tuned)
_kgrouped_weight_grad_tuned = make_tuned(
    _kgrouped_weight_grad_kernel, "weight_grad",
    key=["M", "N", "num_experts", "GATHER_A", "GATHER_B", "ROW_WEIGHT", "A_TMA", "B_TMA"],
)


def launch_kgrouped_weight_grad(args: tuple, flags: dict, *, m_dim: int, n_dim: int, num_experts: int,
                                num_rows: int, device: torch.device, tune: bool, config: KernelConfig) -> None:
    """Launch the K-grouped kernel on ``args`` (the default kernel's arguments, descriptors in place where
    ``flags['A_TMA']`` / ``flags['B_TMA']``); ``flags``: GATHER_A, GATHER_B, ROW_WEIGHT, DOT_PRECISION, A_TMA, B_TMA.
    One program per SM, at most one per (expert, tile) item."""
    sms = num_sms(device)
    flags = dict(flags, NUM_SMS=sms, GROUP_M=GROUP_M, BLOCK_E=max(16, next_power_of_2(num_experts)))

    def grid_of(block_m, block_n):
        return (min(sms, num_experts * cdiv(m_dim, block_m) * cdiv(n_dim, block_n)),)

    with_tma = flags["A_TMA"] or flags["B_TMA"]
    narrow = min(m_dim, n_dim) <= 128  # LoRA factor gradients: rank-sized side, fixed tiles
    if tune and autotune_enabled(config) and not narrow:
        tuned = _kgrouped_weight_grad_tuned[with_tma]
        tuned[lambda meta: grid_of(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **flags)
        return
    meta = heuristic_meta("weight_grad", block_m=128, n_dim=n_dim, k_dim=num_rows,
                          rows_per_expert=num_rows / max(num_experts, 1))
    volume = m_dim * n_dim * num_rows
    if m_dim <= 128:
        meta["BLOCK_M"] = narrow_block_size(m_dim, config, volume=volume)
    if n_dim <= 128:
        meta["BLOCK_N"] = narrow_block_size(n_dim, config, volume=volume)
    if with_tma:
        set_expert_block_shape({"a_ptr": args[0], "b_ptr": args[3], **flags, **meta})
    kernel = fixed_kernel(_kgrouped_weight_grad_kernel, _kgrouped_weight_grad_kernel_unspecialized, config,
                          volume=volume)
    kernel[grid_of(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **flags, **meta)

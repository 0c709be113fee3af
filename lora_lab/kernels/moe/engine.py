"""Which engine runs the expert GEMMs of a MoE layer, and the CUTLASS grouped-GEMM engine itself.

Measured on an H200 (bf16, full fine-tuning, fwd + bwd): on coarse experts (Mixtral-like, E 8, I 14336,
8,192 tokens) ``torch._grouped_mm`` (CUTLASS's grouped GEMM) ran the layer 1.45x faster than the Triton kernels;
on fine-grained experts (E >= 64, I <= 1408) the Triton kernels were 1.17-1.36x faster. :func:`choose_engine`
routes a layer by its shape class:

====================================  ==========================================================
condition (all must hold)             engine
====================================  ==========================================================
``config.moe_engine`` given           that engine (``grouped_mm`` refuses what it cannot run)
LoRA on the experts, or all three:    (LoRA: any shape class, see below)
  E <= 32 experts                     coarse experts (fine-grained ones are Triton's win)
  I >= 2048                           big per-expert GEMMs
  S / E >= 1024 rows per expert       enough rows per expert to fill CUTLASS's tiles
bf16, CUDA capability >= 9.0          ``torch._grouped_mm``'s fast path (Hopper and newer)
H, I, LoRA rank: multiples of 8       its 16-byte stride rule
otherwise                             ``triton``
====================================  ==========================================================

The thresholds sit between the cells of notebook 06's H200 run of bec6a1b (full fine-tuning, the Triton kernels
against plain ``grouped_mm``): the GPT-OSS-20B-like layer (E 32, I 2880) ran at 0.953 and 0.886 of grouped_mm's
speed at 8,192 and 32,768 tokens (one session), so E <= 32 and I >= 2048 send it to this engine (first set at
E <= 16, I >= 4096, placeholders); the Qwen1.5-MoE-like layer (E 60, I 1408) ran 1.146 and 1.166 times faster on
Triton (two sessions) and stays there, as do the layers with 64 or more experts. The rows-per-expert bound (1024)
is still a placeholder.

With LoRA on the experts the shape class does not matter: this engine's LoRA form ran faster than the Triton
kernels' in every cell it was timed in. Notebook 06's H200 run of 6c94d2c (``outputs/gpu/06_moe_layer_summary.csv``
of that run) timed it (``ours_gmm_engine``) in every LoRA cell with E <= 32: 2.41x and 2.42x the Triton kernels'
speed on the Mixtral-8x7B-like layer (8k and 32k tokens; 1.84x and 1.65x grouped_mm + PEFT), 2.56x on the
Mixtral-8x22B-like layer (8k) and 1.77x and 1.84x on the GPT-OSS-20B-like layer (E 32, I 2880), the last two cells
one session each. A diagnostic of 67c6617 (one session, 2 repetitions, 8k tokens; the ledger's moe rows of that
commit) timed it on two fine-grained layers: 6.277
against 8.668 ms on the 30B-A3B-like layer (E 128, I 768) and 5.531 against 7.748 ms on the Qwen1.5-MoE-like one
(E 60, I 1408), where full fine-tuning is Triton's win. Before these measurements LoRA layers stayed on Triton. The
Triton kernels keep the LoRA layers this engine cannot run (a rank that is not a multiple of 8, fp16, pre-Hopper
GPUs).

The grouped-GEMM engine (:func:`grouped_mm_experts`) keeps the work around the GEMMs in the same shape as the
Triton path: the routing sort on the device (no host sync), X gathered by token, SiLU·up on [g | u] with the routing
weight folded into h there (so into the down GEMM's rows, and into P2 with LoRA), and the un-sort as one Triton pass
that sums each token's K rows in fp32 in registers (:func:`~lora_lab.kernels.moe.silu_backward.unsort_sum`: no
weighted copy, no unsorted copy, no fp32 T x H buffer); SiLU·up forward is one Triton pass too
(:func:`~lora_lab.kernels.moe.silu_backward.silu_mul`).
Saved for backward: X, the weights, [g | u] and the routing; the sorted copy of X is
gathered again in backward, except with LoRA on frozen experts when the layer has more than 16 experts
(:func:`keep_sorted_x`): there the forward's sorted copy is kept for dA1, which saves a gather of (S, H) in backward
(about 0.55 ms of a 16.6 ms call at the 30B-A3B-like layer, 32k tokens, in an H200 kernel profile of 3746665) for
S x H more memory held from forward to backward. Coarse layers gather again: at the Mixtral-8x7B-like layer, 32k
tokens, our LoRA peak was already 0.964 of grouped_mm's in notebook 06's run of 3746665.
Backward: D = dOut_e W2_e (one grouped GEMM); one fused Triton pass for the router gradient ⟨D, SiLU(g) u⟩, the
routing weight and SiLU·up's backward, which also returns the weighted h again
(:mod:`~lora_lab.kernels.moe.silu_backward`); dX = dGU W1_e; the weight gradients as K-grouped GEMMs (``_grouped_mm``
of two 2-D operands, K split at the expert offsets): dW1_e = dGU_eᵀ X_e, dW2_e = dOut_eᵀ (w · h)_e, with no weighted
copy of the (S, H) dOut rows. Expert ids outside [0, E) contribute nothing.

LoRA on the experts (the rule above, or ``moe_engine='grouped_mm'``): each LoRA term is two more grouped GEMMs on the
same sorted rows, P = X_e A_eᵀ (S x r, saved) and s·P B_eᵀ added to the frozen GEMM's result, for gate/up and for down.
Backward: Q2 = dOut_e B2_e joins D (D += s2 Q2 A2_e), Q1 = dGU_e B1_e joins dX (+= s1 Q1 A1_e), and the factors'
gradients are K-grouped GEMMs: dB2_e = s2 (w·dOut)_eᵀ P2, dA2_e = s2 (w·Q2)_eᵀ h_e, dB1_e = s1 dGU_eᵀ P1, dA1_e = s1
Q1_eᵀ X_e. This is PEFT's arithmetic on CUTLASS's grouped GEMM (the LoRA term is added in the model's dtype); the Triton
path adds it inside the fp32 accumulators.

Tried and measured slower: SiLU·up's forward and backward passes can make the LoRA terms from their factors and sum
P2 and Q1 themselves (:class:`~lora_lab.kernels.moe.silu_backward.LowRankRows` and ``LowRankOut``), which removes four
rank-r grouped GEMMs and two (S, N) temporaries. With all four in use, this engine with LoRA took 4-10% longer in
every LoRA cell of notebook 06's four fine-grained layers (H200, one session, 5 repetitions;
the ledger's moe rows of commit 2d65ec1), so the engine keeps the dense terms above.
``tools/moe_lora_pass_bench.py`` times each piece both ways, to find which one costs; ``FACTORED_LORA_PIECES`` names
the pieces the engine takes factored (none by default).
"""

from __future__ import annotations

import torch

from lora_lab import gpu_arch
from lora_lab.kernels.config import KernelConfig
from lora_lab.kernels.moe.routing import free_saved, refuse_second_backward, sort_assignments
from lora_lab.kernels.moe.silu_backward import (
    LowRankOut,
    LowRankRows,
    silu_backward,
    silu_backward_reference,
    silu_mul,
    unsort_sum,
    zero_empty_experts_,
)
from lora_lab.kernels.triton_helpers import running_in_interpreter

ENGINES = ("triton", "grouped_mm")
COARSE_MAX_EXPERTS = 32  # from notebook 06's H200 run of bec6a1b (see the module docstring)
COARSE_MIN_INTERMEDIATE = 2048
COARSE_MIN_ROWS_PER_EXPERT = 1024
# LoRA pieces the SiLU·up passes make from factors instead of a rank-r grouped GEMM (module docstring, "Tried and
# measured slower"): "gate_up_term" (s1 P1 B1_e^T in SiLU·up forward), "p2" (P2 = h A2_e^T summed by SiLU·up forward),
# "d_term" (s2 Q2 A2_e in SiLU·up backward), "q1" (Q1 = dGU B1_e summed by SiLU·up backward). Empty: all four by
# grouped GEMMs (all four factored measured 4-10% slower); tools/moe_lora_pass_bench.py times each piece both ways.
FACTORED_LORA_PIECES: frozenset[str] = frozenset()
LORA_PIECES = ("gate_up_term", "p2", "d_term", "q1")
# LoRA with frozen experts: the expert-sorted X the forward gathered is kept for dA1 when the layer has more experts
# than this, instead of gathered again in backward (module docstring: keep_sorted_x)
KEEP_SORTED_X_MIN_EXPERTS = 17


def grouped_mm_available() -> bool:
    """Whether this torch has ``torch._grouped_mm``."""
    return hasattr(torch, "_grouped_mm")


def grouped_mm_blockers(*, hidden: int, intermediate: int, dtype: torch.dtype, available: bool = True,
                        ranks: tuple[int, ...] = ()) -> list[str]:
    """Why the grouped-GEMM engine cannot run a layer (empty: it can). ``ranks``: the LoRA factors' ranks."""
    reasons = []
    if not available:
        reasons.append(f"torch {torch.__version__} has no torch._grouped_mm")
    if dtype not in (torch.bfloat16, torch.float32):
        reasons.append(f"dtype {dtype} (bf16 on CUDA, fp32 where torch has its fallback)")
    align = 16 // (2 if dtype in (torch.bfloat16, torch.float16) else 4)
    if hidden % align or intermediate % align:
        reasons.append(f"hidden {hidden} and intermediate {intermediate} must be multiples of {align} "
                       "(16-byte strides)")
    if any(rank % align for rank in ranks):
        reasons.append(f"LoRA rank {', '.join(map(str, ranks))} must be a multiple of {align} (16-byte strides of "
                       "the rank-wide products)")
    return reasons


def choose_engine(*, num_experts: int, num_assignments: int, hidden: int, intermediate: int, dtype: torch.dtype,
                  capability: tuple[int, int] | None, requested: str = "auto",
                  available: bool = True, ranks: tuple[int, ...] = ()) -> str:
    """'triton' or 'grouped_mm' for one MoE layer call: the rule in the module docstring (a pure function).

    ``capability``: the CUDA device's (major, minor), None off CUDA; ``requested``: ``KernelConfig.moe_engine``;
    ``available``: whether torch has ``_grouped_mm``; ``ranks``: the LoRA factors' ranks (empty without LoRA; with
    LoRA every shape class goes to the grouped-GEMM engine where it runs fast, and a rank that breaks the 16-byte
    strides keeps a layer on Triton). Asking for 'grouped_mm' where it cannot run raises a ValueError naming why.
    """
    if requested not in ("auto", *ENGINES):
        raise ValueError(f"moe_engine must be one of auto, {', '.join(ENGINES)}; got {requested!r}")
    blockers = grouped_mm_blockers(hidden=hidden, intermediate=intermediate, dtype=dtype, available=available,
                                   ranks=ranks)
    if requested == "grouped_mm":
        if blockers:
            raise ValueError("moe_engine='grouped_mm' cannot run this layer: " + "; ".join(blockers))
        return "grouped_mm"
    if requested == "triton" or blockers:
        return "triton"
    coarse = (num_experts <= COARSE_MAX_EXPERTS and intermediate >= COARSE_MIN_INTERMEDIATE
              and num_assignments / max(num_experts, 1) >= COARSE_MIN_ROWS_PER_EXPERT)
    hopper_bf16 = dtype == torch.bfloat16 and capability is not None and capability >= gpu_arch.TMA_MIN
    return "grouped_mm" if (coarse or bool(ranks)) and hopper_bf16 else "triton"


def k_grouped_mm(left: torch.Tensor, right: torch.Tensor, offsets: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """(E, M, N): Σ over each expert's rows of leftᵀ right, times ``scale``, as one ``torch._grouped_mm`` with K split
    at ``offsets`` (each expert's end row, int32). An expert without rows gets an exact zero, written by
    :func:`~lora_lab.kernels.moe.silu_backward.zero_empty_experts_` into its block alone where Triton runs (a masked
    fill over the whole gradient cost as much as half the GEMM on an H200), by a masked fill elsewhere. The
    weight-gradient GEMM of this engine and of ``moe_weight_grad='grouped_mm'``."""
    out = torch._grouped_mm(left.t(), right, offs=offsets)
    if _triton_runs(out):
        zero_empty_experts_(out, offsets)
    else:
        out.masked_fill_((offsets == torch.cat([offsets.new_zeros(1), offsets[:-1]]))[:, None, None], 0)
    return out.mul_(scale) if scale != 1.0 else out


def engine_for(hidden_states: torch.Tensor, top_k_index: torch.Tensor, gate_up_proj: torch.Tensor, *,
               config: KernelConfig, ranks: tuple[int, ...] = ()) -> str:
    """:func:`choose_engine` for one call's tensors and ``config`` (``ranks``: the LoRA factors' ranks)."""
    device = hidden_states.device
    capability = gpu_arch.capability(device)  # honours $LORA_LAB_ARCH
    num_experts, two_i, hidden = gate_up_proj.shape
    return choose_engine(num_experts=num_experts, num_assignments=top_k_index.numel(), hidden=hidden,
                         intermediate=two_i // 2, dtype=hidden_states.dtype, capability=capability,
                         requested=config.moe_engine, available=grouped_mm_available(), ranks=ranks)


def _sort_by_expert(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int):
    """Device ops only: (position, token, offsets, weight in sorted order, valid in sorted order). ``position[s]``:
    the sorted row of assignment s; ``offsets`` (E + 1,) int32: expert e owns sorted rows [offsets[e], offsets[e+1]).
    Ids outside [0, E) go to expert 0 with weight 0 (so they add nothing to the output
    or to any gradient) and their router gradient is masked. Where Triton runs, the counting sort of
    :func:`~lora_lab.kernels.moe.routing.sort_assignments` (three launches); plain torch elsewhere."""
    if _triton_runs(top_k_index):
        s = sort_assignments(top_k_index, num_experts, invalid_to_first=True, with_position=True,
                             weights=top_k_weights)
        return s.position, s.sorted_token, s.expert_offsets, s.weight_sorted, s.valid_sorted
    top_k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    expert = torch.where(valid, flat, 0).to(torch.int64)
    _, perm = torch.sort(expert, stable=True)
    position = torch.empty_like(perm)
    position[perm] = torch.arange(perm.numel(), device=perm.device)
    counts = torch.bincount(expert, minlength=num_experts)
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int32)
    weight_slot = torch.where(valid, top_k_weights.reshape(-1), 0)
    token = torch.div(perm, top_k, rounding_mode="floor")
    return position, token, offsets, weight_slot[perm], valid[perm]


def keep_sorted_x(*, num_experts: int, lora_gate_up: bool, full_fine_tuning: bool) -> bool:
    """Whether the grouped-GEMM engine keeps the forward's expert-sorted X for backward (module docstring): LoRA on
    gate/up with frozen experts (dA1 = s1 Q1_eᵀ X_e reads it; full fine-tuning's dW1 gathers again, where the larger
    backward keeps the memory closer to grouped_mm's) and more than 16 experts. A pure function."""
    return lora_gate_up and not full_fine_tuning and num_experts >= KEEP_SORTED_X_MIN_EXPERTS


def _triton_runs(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" or running_in_interpreter()


def _unsort_sum(rows: torch.Tensor, position: torch.Tensor, num_tokens: int, top_k: int,
                weight: torch.Tensor | None = None, extra: torch.Tensor | None = None,
                extra_scale: float = 1.0) -> torch.Tensor:
    """out[t] = Σ_k w[t·K + k] · (rows + s·extra)[position[t·K + k]]
    (:func:`~lora_lab.kernels.moe.silu_backward.unsort_sum` where Triton runs; plain torch on a CPU without the
    interpreter)."""
    if _triton_runs(rows):
        return unsort_sum(rows.contiguous(), position, num_tokens, top_k, weight,
                          extra.contiguous() if extra is not None else None, extra_scale)
    picked = rows[position].float()
    if extra is not None:
        picked = picked + extra_scale * extra[position].float()
    if weight is not None:
        picked = picked * weight.float()[:, None]
    return picked.view(num_tokens, top_k, rows.shape[1]).sum(1).to(rows.dtype)


class _GroupedMmExperts(torch.autograd.Function):
    """Inputs: x, the routing, w1 (E, 2I, H), w2 (E, H, I), and LoRA's factors or None: a1 (E, r, H), b1 (E, 2I, r),
    a2 (E, r, I), b2 (E, H, r), with their scales s1, s2. A LoRA term adds s·(X Aᵀ) Bᵀ to its GEMM's rows through two
    more grouped GEMMs: P = X_e A_eᵀ (S x r, saved for backward) and Z = P B_eᵀ, and the pass that reads the GEMM's
    rows next adds s·Z as it reads them (SiLU·up for [g | u], the un-sort for the output and for dX, SiLU·up's
    backward for D): no separate in-place add over an (S, 2I), (S, H) or (S, I) tensor."""

    @staticmethod
    def forward(ctx, x, top_k_index, top_k_weights, w1, w2, a1, b1, a2, b2, s1, s2):
        num_tokens, top_k = top_k_index.shape
        position, token, expert_offsets, weight, valid = _sort_by_expert(
            top_k_index, top_k_weights, w1.shape[0])
        offsets = expert_offsets[1:]  # _grouped_mm's group ends
        xs = x.index_select(0, token)
        gu = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offsets)  # (S, 2I)
        p1 = p2 = z = None
        factored = FACTORED_LORA_PIECES if _triton_runs(gu) else frozenset()
        gate_up_term = p2_acc = None
        if a1 is not None:
            p1 = torch._grouped_mm(xs, a1.transpose(1, 2), offs=offsets)  # (S, r)
            if "gate_up_term" in factored:  # made by SiLU·up from P1 and B1
                gate_up_term = LowRankRows(p1, b1.transpose(1, 2), expert_offsets)
            else:
                z = torch._grouped_mm(p1, b1.transpose(1, 2), offs=offsets)  # (S, 2I): added to [g | u] by SiLU·up
        need = ctx.needs_input_grad
        kept_xs = xs if keep_sorted_x(num_experts=w1.shape[0], lora_gate_up=a1 is not None and need[5],
                                      full_fine_tuning=need[3]) else None
        del xs
        # h_j = w_j SiLU(g_j) u_j: the routing weight rides in h (and in P2), so the un-sort sums plain rows and
        # backward's dW2 / dA2 / dB2 need no weighted copy of dOut or Q2 (0 for a dropped id: its row adds nothing)
        if _triton_runs(gu):
            if a2 is not None and "p2" in factored:  # P2 = h A2_e^T summed by SiLU·up from the h it writes
                p2_acc = torch.zeros(gu.shape[0], a2.shape[1], device=gu.device, dtype=torch.float32)
            h = silu_mul(gu, weight, z, s1, low_rank=gate_up_term,  # gu += s1 z in place
                         low_rank_out=LowRankOut(a2.transpose(1, 2), expert_offsets, p2_acc) if p2_acc is not None
                         else None)
        else:
            if z is not None:
                gu.add_(z, alpha=s1)
            g, u = gu.chunk(2, dim=-1)
            h = (torch.nn.functional.silu(g) * u * weight[:, None]).to(gu.dtype)
        y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offsets)  # (S, H)
        z = None
        if a2 is not None:  # (S, r)
            p2 = p2_acc.to(h.dtype) if p2_acc is not None else torch._grouped_mm(h, a2.transpose(1, 2), offs=offsets)
            z = torch._grouped_mm(p2, b2.transpose(1, 2), offs=offsets)  # (S, H): summed in by the un-sort
        del h
        ctx.save_for_backward(x, w1, w2, gu, weight, position, token, expert_offsets, valid,
                              a1, b1, a2, b2, p1, p2, kept_xs)
        ctx.shape = (num_tokens, top_k, top_k_weights.dtype)
        ctx.scales = (s1, s2)
        return _unsort_sum(y, position, num_tokens, top_k, extra=z, extra_scale=s2)

    @staticmethod
    def backward(ctx, grad_out):
        (x, w1, w2, gu, weight, position, token, expert_offsets, valid,
         a1, b1, a2, b2, p1, p2, kept_xs) = ctx.saved_tensors
        offsets = expert_offsets[1:]
        refuse_second_backward(ctx, "the grouped_mm MoE engine")
        num_tokens, top_k, weights_dtype = ctx.shape
        s1, s2 = ctx.scales
        need = ctx.needs_input_grad
        grad_out = grad_out.to(x.dtype).contiguous()
        dout_rows = grad_out.index_select(0, token)  # (S, H)
        d = torch._grouped_mm(dout_rows, w2, offs=offsets)  # D = dOut_t W2_e, (S, I)
        q2 = z = d_term = None
        factored = FACTORED_LORA_PIECES if _triton_runs(d) else frozenset()
        if a2 is not None:  # D += s2 (dOut_t B2_e) A2_e, added inside SiLU·up's backward
            q2 = torch._grouped_mm(dout_rows, b2, offs=offsets)  # (S, r)
            if "d_term" in factored:  # made by that pass from Q2 and A2
                d_term = LowRankRows(q2, a2, expert_offsets)
            else:
                z = torch._grouped_mm(q2, a2, offs=offsets)  # (S, I)
        need_q1 = a1 is not None and (need[0] or need[5])
        q1_acc = None
        if need_q1 and "q1" in factored:  # Q1 = dGU B1_e summed by SiLU·up's backward from the dGU it writes
            q1_acc = torch.zeros(d.shape[0], b1.shape[2], device=d.device, dtype=torch.float32)
        # h comes back weighted, as the forward used it
        dgu, h, dw_sorted = _silu_backward(
            d, gu, weight, valid, compute_router_grad=need[2], extra=z, extra_scale=s2, low_rank=d_term,
            low_rank_out=LowRankOut(b1, expert_offsets, q1_acc) if q1_acc is not None else None)
        del d, z
        free_saved(gu)  # [g | u] (S x 2I) has had its one use: freed now, not after the GEMMs below
        d_weights = None
        if need[2]:
            d_weights = dw_sorted.index_select(0, position).view(num_tokens, top_k).to(weights_dtype)
        dx = dw1 = dw2 = da1 = db1 = da2 = db2 = None

        def k_grouped(left, right, scale=1.0):  # an expert with no rows gets an exact zero
            return k_grouped_mm(left, right, offsets, scale)

        # the down projection's gradients first: h and the dOut rows (S x I and S x H) are freed before dX and dW1
        # allocate theirs
        # (the routing weight is in h and P2 already: no weighted copy of the dOut rows or of Q2)
        if need[4]:
            dw2 = k_grouped(dout_rows, h)  # (E, H, I)
        if need[8]:
            db2 = k_grouped(dout_rows, p2, s2)  # (E, H, r)
        if need[7]:
            da2 = k_grouped(q2, h, s2)  # (E, r, I)
        del h, dout_rows, q2
        q1 = None  # (S, r)
        if need_q1:
            q1 = q1_acc.to(dgu.dtype) if q1_acc is not None else torch._grouped_mm(dgu, b1, offs=offsets)
        if need[0]:
            dx_rows = torch._grouped_mm(dgu, w1, offs=offsets)
            z = torch._grouped_mm(q1, a1, offs=offsets) if q1 is not None else None  # summed in by the un-sort
            dx = _unsort_sum(dx_rows, position, num_tokens, top_k, extra=z, extra_scale=s1)
            del dx_rows, z
        if need[6]:
            db1 = k_grouped(dgu, p1, s1)  # (E, 2I, r)
        if need[3] or need[5]:
            xs = kept_xs if kept_xs is not None else x.index_select(0, token)
            if need[3]:
                dw1 = k_grouped(dgu, xs)  # (E, 2I, H)
            if need[5]:
                da1 = k_grouped(q1, xs, s1)  # (E, r, H)
        return dx, None, d_weights, dw1, dw2, da1, db1, da2, db2, None, None


def _silu_backward(d, gu, weight, valid, *, compute_router_grad, extra=None, extra_scale=1.0, low_rank=None,
                   low_rank_out=None):
    """The fused Triton pass (:mod:`~lora_lab.kernels.moe.silu_backward`) where Triton can run (CUDA, or the
    interpreter), its plain-torch twin on a CPU without the interpreter (which never gets the factored forms)."""
    kw = dict(compute_router_grad=compute_router_grad, weight_h=True, extra=extra, extra_scale=extra_scale)
    if _triton_runs(d):
        return silu_backward(d, gu, weight, valid, low_rank=low_rank, low_rank_out=low_rank_out, **kw)
    return silu_backward_reference(d, gu, weight, valid, **kw)


def grouped_mm_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       gate_up_proj: torch.Tensor, down_proj: torch.Tensor, lora=None) -> torch.Tensor:
    """Σ_k w_tk · Expert_{e_tk}(x_t) with ``torch._grouped_mm`` for the expert GEMMs (module docstring), with the
    LoRA terms of ``lora`` (an :class:`~lora_lab.kernels.moe.lora.ExpertLoRA` in the weights' dtype, or None);
    inputs validated by :func:`~lora_lab.kernels.moe.experts.fused_moe_experts`."""
    if not grouped_mm_available():
        raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm; use moe_engine='triton'")
    a1 = b1 = a2 = b2 = None
    s1 = s2 = 0.0
    if lora is not None:  # PEFT's factors are strided views (B's expert index is its fastest): _grouped_mm needs a
        # plain layout, so each factor is copied once per call (E·r·(H + 2I) numbers, differentiably)
        def plain(t):
            return None if t is None else t.contiguous()

        a1, b1, s1 = plain(lora.gate_up_A), plain(lora.gate_up_B), float(lora.gate_up_scale)
        a2, b2, s2 = plain(lora.down_A), plain(lora.down_B), float(lora.down_scale)
    return _GroupedMmExperts.apply(hidden_states.contiguous(), top_k_index, top_k_weights, gate_up_proj, down_proj,
                                   a1, b1, a2, b2, s1, s2)

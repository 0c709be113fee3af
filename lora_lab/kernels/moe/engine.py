"""Which engine runs the expert GEMMs of a MoE layer, and the CUTLASS grouped-GEMM engine itself.

Issue #24 measured (H200, bf16, full fine-tuning, fwd + bwd): on coarse experts (Mixtral-like, E 8, I 14336,
8,192 tokens) ``torch._grouped_mm`` (CUTLASS's grouped GEMM) ran the layer 1.45x faster than the Triton kernels;
on fine-grained experts (E >= 64, I <= 1408) the Triton kernels were 1.17-1.36x faster. :func:`choose_engine`
routes a layer by its shape class:

====================================  ==========================================================
condition (all must hold)             engine
====================================  ==========================================================
``config.moe_engine`` given           that engine (``grouped_mm`` refuses what it cannot run)
no LoRA on the experts                ``grouped_mm`` has no rank-r terms: LoRA stays on Triton
E <= 32 experts                       coarse experts (fine-grained ones are Triton's win)
I >= 2048                             big per-expert GEMMs
S / E >= 1024 rows per expert         enough rows per expert to fill CUTLASS's tiles
bf16, CUDA capability >= 9.0          ``torch._grouped_mm``'s fast path (Hopper and newer)
H and I multiples of 8                its 16-byte stride rule
otherwise                             ``triton``
====================================  ==========================================================

The thresholds sit between the cells of notebook 06's H200 run of bec6a1b (full fine-tuning, the Triton kernels
against plain ``grouped_mm``): the GPT-OSS-20B-like layer (E 32, I 2880) ran at 0.953 and 0.886 of grouped_mm's
speed at 8,192 and 32,768 tokens (one session), so E <= 32 and I >= 2048 send it to this engine (first set at
E <= 16, I >= 4096, placeholders); the Qwen1.5-MoE-like layer (E 60, I 1408) ran 1.146 and 1.166 times faster on
Triton (two sessions) and stays there, as do the layers with 64 or more experts. The rows-per-expert bound (1024)
is still a placeholder, and this engine has not been timed at the GPT-OSS-like shape yet.

The grouped-GEMM engine (:func:`grouped_mm_experts`) keeps the work around the GEMMs in the same shape as the
Triton path: the routing sort on the device (no host sync), X gathered by token, SiLU·up on [g | u], the routing
weight applied in the un-sort, and the un-sort as one Triton pass that sums each token's K rows in fp32 in registers
(:func:`~lora_lab.kernels.moe.silu_backward.unsort_sum`: no weighted copy, no unsorted copy, no fp32 T x H buffer);
SiLU·up forward is one Triton pass too (:func:`~lora_lab.kernels.moe.silu_backward.silu_mul`).
Saved for backward: X, the weights, [g | u] and the routing; the sorted copy of X is
gathered again in backward. Backward: D = dOut_e W2_e (one grouped GEMM); one fused Triton pass for the
router gradient ⟨D, h⟩, the routing weight and SiLU·up's backward (:mod:`~lora_lab.kernels.moe.silu_backward`);
dX = dGU W1_e; the weight gradients as K-grouped GEMMs (``_grouped_mm`` of two 2-D operands, K split at the expert
offsets): dW1_e = dGU_eᵀ X_e, dW2_e = (w · dOut)_eᵀ h_e. Expert ids outside [0, E) contribute nothing.
"""

from __future__ import annotations

import torch

from lora_lab.kernels.config import KernelConfig
from lora_lab.kernels.moe.routing import free_saved, refuse_second_backward
from lora_lab.kernels.moe.silu_backward import silu_backward, silu_backward_reference, silu_mul, unsort_sum
from lora_lab.kernels.triton_helpers import running_in_interpreter

ENGINES = ("triton", "grouped_mm")
COARSE_MAX_EXPERTS = 32  # from notebook 06's H200 run of bec6a1b (see the module docstring)
COARSE_MIN_INTERMEDIATE = 2048
COARSE_MIN_ROWS_PER_EXPERT = 1024


def grouped_mm_available() -> bool:
    """Whether this torch has ``torch._grouped_mm``."""
    return hasattr(torch, "_grouped_mm")


def grouped_mm_blockers(*, hidden: int, intermediate: int, dtype: torch.dtype, lora: bool,
                        available: bool) -> list[str]:
    """Why the grouped-GEMM engine cannot run a layer (empty: it can)."""
    reasons = []
    if not available:
        reasons.append(f"torch {torch.__version__} has no torch._grouped_mm")
    if lora:
        reasons.append("it runs full fine-tuning only (no LoRA on the experts)")
    if dtype not in (torch.bfloat16, torch.float32):
        reasons.append(f"dtype {dtype} (bf16 on CUDA, fp32 where torch has its fallback)")
    align = 16 // (2 if dtype in (torch.bfloat16, torch.float16) else 4)
    if hidden % align or intermediate % align:
        reasons.append(f"hidden {hidden} and intermediate {intermediate} must be multiples of {align} "
                       "(16-byte strides)")
    return reasons


def choose_engine(*, num_experts: int, num_assignments: int, hidden: int, intermediate: int, dtype: torch.dtype,
                  capability: tuple[int, int] | None, lora: bool, requested: str = "auto",
                  available: bool = True) -> str:
    """'triton' or 'grouped_mm' for one MoE layer call: the rule in the module docstring (a pure function).

    ``capability``: the CUDA device's (major, minor), None off CUDA; ``requested``: ``KernelConfig.moe_engine``;
    ``available``: whether torch has ``_grouped_mm``. Asking for 'grouped_mm' where it cannot run raises a
    ValueError naming why.
    """
    if requested not in ("auto", *ENGINES):
        raise ValueError(f"moe_engine must be one of auto, {', '.join(ENGINES)}; got {requested!r}")
    blockers = grouped_mm_blockers(hidden=hidden, intermediate=intermediate, dtype=dtype, lora=lora,
                                   available=available)
    if requested == "grouped_mm":
        if blockers:
            raise ValueError("moe_engine='grouped_mm' cannot run this layer: " + "; ".join(blockers))
        return "grouped_mm"
    if requested == "triton" or blockers:
        return "triton"
    coarse = (num_experts <= COARSE_MAX_EXPERTS and intermediate >= COARSE_MIN_INTERMEDIATE
              and num_assignments / max(num_experts, 1) >= COARSE_MIN_ROWS_PER_EXPERT)
    hopper_bf16 = dtype == torch.bfloat16 and capability is not None and capability >= (9, 0)
    return "grouped_mm" if coarse and hopper_bf16 else "triton"


def engine_for(hidden_states: torch.Tensor, top_k_index: torch.Tensor, gate_up_proj: torch.Tensor, *, lora: bool,
               config: KernelConfig) -> str:
    """:func:`choose_engine` for one call's tensors and ``config``."""
    device = hidden_states.device
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    num_experts, two_i, hidden = gate_up_proj.shape
    return choose_engine(num_experts=num_experts, num_assignments=top_k_index.numel(), hidden=hidden,
                         intermediate=two_i // 2, dtype=hidden_states.dtype, capability=capability, lora=lora,
                         requested=config.moe_engine, available=grouped_mm_available())


def _sort_by_expert(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int):
    """Device ops only: (perm, position, token, offsets, weight in assignment order, weight in sorted order, valid in
    sorted order, counts). ``position[s]``: the sorted row of assignment s. Ids outside [0, E) go to expert 0 with
    weight 0 (so they add nothing to the output or to any gradient) and their router gradient is masked."""
    top_k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    expert = torch.where(valid, flat, 0).to(torch.int64)
    _, perm = torch.sort(expert, stable=True)
    position = torch.empty_like(perm)
    position[perm] = torch.arange(perm.numel(), device=perm.device)
    counts = torch.bincount(expert, minlength=num_experts)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    weight_slot = torch.where(valid, top_k_weights.reshape(-1), 0)
    token = torch.div(perm, top_k, rounding_mode="floor")
    return perm, position, token, offsets, weight_slot, weight_slot[perm], valid[perm], counts


def _triton_runs(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" or running_in_interpreter()


def _unsort_sum(rows: torch.Tensor, position: torch.Tensor, num_tokens: int, top_k: int,
                weight: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = Σ_k w[t·K + k] · rows[position[t·K + k]] (:func:`~lora_lab.kernels.moe.silu_backward.unsort_sum`
    where Triton runs; plain torch on a CPU without the interpreter)."""
    if _triton_runs(rows):
        return unsort_sum(rows.contiguous(), position, num_tokens, top_k, weight)
    picked = rows[position].float()
    if weight is not None:
        picked = picked * weight.float()[:, None]
    return picked.view(num_tokens, top_k, rows.shape[1]).sum(1).to(rows.dtype)


class _GroupedMmExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, top_k_index, top_k_weights, w1, w2):
        num_tokens, top_k = top_k_index.shape
        perm, position, token, offsets, weight_slot, weight, valid, counts = _sort_by_expert(
            top_k_index, top_k_weights, w1.shape[0])
        gu = torch._grouped_mm(x.index_select(0, token), w1.transpose(1, 2), offs=offsets)  # (S, 2I)
        if _triton_runs(gu):
            h = silu_mul(gu)
        else:
            g, u = gu.chunk(2, dim=-1)
            h = torch.nn.functional.silu(g) * u
        y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offsets)  # (S, H)
        del h
        ctx.save_for_backward(x, w1, w2, gu, weight, perm, position, token, offsets, valid, counts)
        ctx.shape = (num_tokens, top_k, top_k_weights.dtype)
        return _unsort_sum(y, position, num_tokens, top_k, weight_slot)

    @staticmethod
    def backward(ctx, grad_out):
        x, w1, w2, gu, weight, perm, position, token, offsets, valid, counts = ctx.saved_tensors
        refuse_second_backward(ctx, "the grouped_mm MoE engine")
        num_tokens, top_k, weights_dtype = ctx.shape
        need = ctx.needs_input_grad
        grad_out = grad_out.to(x.dtype).contiguous()
        dout_rows = grad_out.index_select(0, token)  # (S, H)
        d = torch._grouped_mm(dout_rows, w2, offs=offsets)  # D = dOut_t W2_e, (S, I)
        dgu, h, dw_sorted = _silu_backward(d, gu, weight, valid, compute_router_grad=need[2])
        del d
        free_saved(gu)  # [g | u] (S x 2I) has had its one use: freed now, not after the four GEMMs below
        d_weights = None
        if need[2]:
            d_weights = dw_sorted[position].view(num_tokens, top_k).to(weights_dtype)
        dx = dw1 = dw2 = None
        empty = (counts == 0)[:, None, None]  # an expert with no rows gets an exact zero gradient
        # dW2 first: h and the dOut rows (S x I and S x H) are freed before dX and dW1 allocate theirs
        if need[4]:
            scaled = (dout_rows * weight.to(x.dtype)[:, None]).t()  # (H, S)
            dw2 = torch._grouped_mm(scaled, h, offs=offsets).masked_fill_(empty, 0)  # (E, H, I)
            del scaled
        del h, dout_rows
        if need[0]:
            dx = _unsort_sum(torch._grouped_mm(dgu, w1, offs=offsets), position, num_tokens, top_k)
        if need[3]:
            dw1 = torch._grouped_mm(dgu.t(), x.index_select(0, token), offs=offsets)  # (E, 2I, H)
            dw1 = dw1.masked_fill_(empty, 0)
        return dx, None, d_weights, dw1, dw2


def _silu_backward(d, gu, weight, valid, *, compute_router_grad):
    """The fused Triton pass (:mod:`~lora_lab.kernels.moe.silu_backward`) where Triton can run (CUDA, or the
    interpreter), its plain-torch twin on a CPU without the interpreter."""
    if _triton_runs(d):
        return silu_backward(d, gu, weight, valid, compute_router_grad=compute_router_grad)
    return silu_backward_reference(d, gu, weight, valid, compute_router_grad=compute_router_grad)


def grouped_mm_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """Σ_k w_tk · Expert_{e_tk}(x_t) with ``torch._grouped_mm`` for the expert GEMMs (module docstring); inputs
    validated by :func:`~lora_lab.kernels.moe.experts.fused_moe_experts`."""
    if not grouped_mm_available():
        raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm; use moe_engine='triton'")
    return _GroupedMmExperts.apply(hidden_states.contiguous(), top_k_index, top_k_weights, gate_up_proj, down_proj)

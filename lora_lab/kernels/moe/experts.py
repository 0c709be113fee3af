"""Fused MoE experts: autograd Function over the routing-aware Triton kernels, plus the reference.

Shapes: X (T, H) hidden states, top_k_index / top_k_weights (T, K), W1 = ``gate_up_proj``
(E, 2I, H), W2 = ``down_proj`` (E, H, I), as in transformers 5.x experts modules. S = T·K.

Forward (per expert-sorted row j of expert e, token t, weight w_j; see ``moe_routing``):

    route   : sort assignments by expert on the device (no host sync)
    [P1     : P1_j = X_t A1_eᵀ                                   LoRA only, (S, r)]
    gate_up : [g_j | u_j] = X_t W1_eᵀ (+ s₁ P1_j B1_eᵀ),  h_j = w_j SiLU(g_j) u_j   one kernel
    [P2     : P2_j = h_j A2_eᵀ                                   LoRA only]
    down    : Out_t += h_j W2_eᵀ (+ s₂ P2_j B2_eᵀ)                one kernel, scatter-add by token
              (full fine-tuning, bf16 on Hopper: ``torch._grouped_mm`` into the sorted rows, then one pass
              that sums each token's K rows; :func:`scatter_engine`)

The routing weight w_j rides in h_j (and so in P2_j) from the gate/up epilogue on: the down GEMM and every weight
gradient of the down projection then read plain rows (see ``moe_gate_up_silu``).

Saved for backward: X, W1, W2, weights, GU (S, 2I), h (S, I), the routing, P1/P2 (LoRA).
Nothing of size (S, H) is saved (transformers' grouped_mm path saves sorted copies of X and of
the down output).

Backward, given dOut (T, H):

    [Q2     : Q2_j = dOut_t B2_e]
    down_bw : D_j = dOut_t W2_e (+ s₂ Q2_j A2_e);  dw_j = ⟨D_j, SiLU(g_j) u_j⟩ (from the saved [g | u]);
              dGU_j = SiLU·up backward of w_j D_j
    [Q1     : Q1_j = dGU_j B1_e]
    dX      : dX_t += dGU_j W1_e (+ s₁ Q1_j A1_e)                  scatter-add by token (or as the down GEMM)
    dW1_e   = Σ_j dGU_jᵀ X_t,            dW2_e = Σ_j dOut_tᵀ h_j (h_j weighted)   full fine-tuning only
    dA1_e   = s₁ Σ Q1_jᵀ X_t,  dB1_e = s₁ Σ dGU_jᵀ P1_j,  dA2_e = s₂ Σ Q2_jᵀ h_j,  dB2_e = s₂ Σ dOut_tᵀ P2_j

Each gradient is computed only when autograd asks for it, so LoRA on frozen experts runs two
big grouped GEMMs in backward instead of four.

**The two scatter GEMMs (down forward, dX) on CUTLASS** (``KernelConfig.moe_scatter``, :func:`scatter_engine`).
A kernel profile of this path at e24f153 (H200, the Qwen3-30B-A3B-like layer, 32,768 tokens, full fine-tuning)
timed our down GEMM, which adds every row into an fp32 (T, H) buffer with
atomics, at 2.33 ms for its 0.82 TFLOP (about 354 TFLOP/s; the zeroed buffer and its bf16 copy cost 0.15 ms more), and
the dX GEMM at 3.35 ms for 1.65 TFLOP; the grouped-GEMM engine's CUTLASS GEMMs averaged about 550 TFLOP/s in the
same profile. So for bf16 on Hopper the default writes these two GEMMs' rows in expert order with
``torch._grouped_mm`` and sums each token's K rows in one Triton pass (:func:`~lora_lab.kernels.moe.silu_backward.
unsort_sum`, fp32 in registers, rows of no expert skipped). ``moe_scatter='triton'`` keeps the atomic form; notebook 06
times both side by side (``ours_scatter_triton``).

A diagnostic H200 run of that change (a23ff54, 3 repetitions, one process; the ledger's moe rows of that commit)
timed the layer 3-8% faster (medians) in every full fine-tuning cell of four fine-grained layers (at the 30B-A3B-like
layer 18.72 against 20.21 ms at 32k tokens, 5.56 against 5.81 at 8k), and its kernel profile afterwards put CUTLASS's
two GEMMs at 1.37 and 2.44 ms. In the same run ``benchmarks/bench_moe_weight_grad.py`` timed dW1 alone (X gathered
by token in its time) at 2.89 ms on ``torch._grouped_mm`` against 4.16 ms for our per-tile kernel at 32k tokens (0.94
against 1.33 ms at 8k). So with ``moe_weight_grad='auto'``, where the scatter GEMMs' rule puts them on CUTLASS
(:func:`dw1_on_grouped_mm`), dW1 goes there too: X gathered into expert order, one K-grouped ``_grouped_mm`` (rows
of no expert sort after the last group and are never read). dW2 stays on the per-tile kernel, which reads the
routing-weighted h and gathers dOut in its loader.

Notebook 06's H200 run of that code (commit 3746665) timed the dW1 rule slower than both weight gradients
per-tile at 8k tokens (``ours_per_tile`` 1.136 times as fast) and a tie at 32k; a kernel profile of the same code
found a ``masked_fill_`` of 1.11 ms after the K-grouped GEMM, zeroing experts without rows by a masked write over the
whole (E, 2I, H) gradient. :func:`~lora_lab.kernels.moe.silu_backward.zero_empty_experts_` now writes only the
empty experts' blocks (4.6 us in the next profile).

**The down projection's backward on CUTLASS** (``KernelConfig.moe_down_backward``, :func:`down_backward_engine`). Our
fused down-backward kernel takes about 3.3 ms at the 30B-A3B-like layer, 32k tokens (its GEMM is 0.82 TFLOP: about 250
TFLOP/s) and dW2 per-tile about 2 ms. The other form gathers dOut into expert order once (S x H), runs D = dOut_s W2_e
on ``torch._grouped_mm``, SiLU·up's backward and the router gradient in the grouped-GEMM engine's Triton pass (which
does not write h again), and dW2 as one K-grouped ``_grouped_mm`` over the same gathered rows and the weighted h the
forward saved. With the masked fill gone, a diagnostic H200 run (3746665, one process, 3 repetitions, medians;
the ledger's moe rows of that commit) timed it faster on every fine-grained layer with 60 or more experts:
15.78 against 16.97 ms (30B-A3B-like, 32k), 4.98 against 5.09 (8k), 13.88 against 15.00 (Qwen1.5-MoE-like, 32k), 21.01
against 21.94 (DeepSeek-V2-Lite-like, 32k), 20.14 against 21.59 (OLMoE-like, 32k), and a tie on the 32-expert
GPT-OSS-20B-like and the coarse Mixtral-like layers. So ``auto`` follows the scatter GEMMs' rule (bf16 on Hopper, no
LoRA); ``moe_down_backward='triton'`` keeps the fused kernel, which notebook 06 times as ``ours_down_triton``.
(Those figures are of the form whose pass wrote h a second time and whose dW2 read that copy; it now reads the h the
forward saved.) It costs memory: the gathered dOut rows live through SiLU·up's backward (peak above the resident
tensors 3.76 against 3.13 GiB at the 30B-A3B-like layer, 32k; grouped_mm's 6.63), closest to grouped_mm's at the
Qwen1.5-MoE-like layer, 8k tokens (1.41 against 1.42 GiB).
"""

from __future__ import annotations

import torch

from lora_lab import gpu_arch
from lora_lab.kernels.config import KernelConfig, resolve_config
from lora_lab.kernels.moe.down_backward import down_backward_silu
from lora_lab.kernels.moe.engine import (
    engine_for,
    grouped_mm_available,
    grouped_mm_blockers,
    grouped_mm_experts,
    k_grouped_mm,
)
from lora_lab.kernels.moe.expert_weight_grad import expert_weight_grad, grouped_mm_weight_grad
from lora_lab.kernels.moe.gate_up_silu import gate_up_silu
from lora_lab.kernels.moe.grouped_gemm import grouped_rows_gemm
from lora_lab.kernels.moe.launch import row_block_size
from lora_lab.kernels.moe.lora import ExpertLoRA, moe_experts_reference
from lora_lab.kernels.moe.routing import ExpertRouting, free_saved, refuse_second_backward, route_experts
from lora_lab.kernels.moe.silu_backward import silu_backward, unsort_sum
from lora_lab.kernels.triton_helpers import check_interpreter_dtype, check_kernel_device

__all__ = ["fused_moe_experts", "moe_experts_reference", "ExpertLoRA", "scatter_engine", "dw1_on_grouped_mm",
           "down_backward_engine"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCATTER_ENGINES = ("triton", "grouped_mm")


def _piece_engine(field: str, requested: str, *, dtype: torch.dtype, capability: tuple[int, int] | None,
                  hidden: int, intermediate: int, has_lora: bool, available: bool) -> str:
    """'grouped_mm' or 'triton' for one piece of the Triton engine (``field``: its ``KernelConfig`` field, whose value
    ``requested`` is checked): ``auto`` takes 'grouped_mm' for bf16 on Hopper where nothing blocks it; asking for
    'grouped_mm' where it cannot run raises a ValueError naming why."""
    if requested not in ("auto", *SCATTER_ENGINES):
        raise ValueError(f"{field} must be one of auto, {', '.join(SCATTER_ENGINES)}; got {requested!r}")
    blockers = grouped_mm_blockers(hidden=hidden, intermediate=intermediate, dtype=dtype, available=available)
    if has_lora:
        blockers.append("LoRA on the experts (the Triton engine adds its terms inside its own GEMMs)")
    if requested == "grouped_mm":
        if blockers:
            raise ValueError(f"{field}='grouped_mm' cannot run this layer: " + "; ".join(blockers))
        return "grouped_mm"
    hopper_bf16 = dtype == torch.bfloat16 and capability is not None and capability >= gpu_arch.TMA_MIN
    return "grouped_mm" if requested == "auto" and not blockers and hopper_bf16 else "triton"


def scatter_engine(*, requested: str, dtype: torch.dtype, capability: tuple[int, int] | None, hidden: int,
                   intermediate: int, has_lora: bool, available: bool = True) -> str:
    """Who runs the Triton engine's down-forward and dX GEMMs (module docstring): 'triton' (our grouped GEMM,
    atomic scatter-add by token) or 'grouped_mm' (``torch._grouped_mm`` into the sorted rows, then the un-sort pass).
    A pure function. ``requested``: ``KernelConfig.moe_scatter``; ``capability``: the CUDA device's (major, minor),
    None off CUDA; ``has_lora``: LoRA on the experts (those layers keep 'triton', whose kernels add the terms
    inside their accumulators). Asking for 'grouped_mm' where it cannot run raises a ValueError naming why."""
    return _piece_engine("moe_scatter", requested, dtype=dtype, capability=capability, hidden=hidden,
                         intermediate=intermediate, has_lora=has_lora, available=available)


def dw1_on_grouped_mm(*, weight_grad: str, dtype: torch.dtype, capability: tuple[int, int] | None, hidden: int,
                      intermediate: int, has_lora: bool, available: bool = True) -> bool:
    """Whether dW1 of full fine-tuning runs as one K-grouped ``torch._grouped_mm`` over X gathered by token (module
    docstring): with ``moe_weight_grad='auto'`` (``weight_grad``) wherever ``moe_scatter='auto'`` would put the
    scatter GEMMs on CUTLASS (bf16 on Hopper, aligned, no LoRA), whatever ``moe_scatter`` itself asks for, so that
    the ``ours_scatter_triton`` variant differs from ours in the scatter GEMMs alone. A pure function."""
    return weight_grad == "auto" and scatter_engine(
        requested="auto", dtype=dtype, capability=capability, hidden=hidden, intermediate=intermediate,
        has_lora=has_lora, available=available) == "grouped_mm"


def down_backward_engine(*, requested: str, dtype: torch.dtype, capability: tuple[int, int] | None, hidden: int,
                         intermediate: int, has_lora: bool, available: bool = True) -> str:
    """Who runs the Triton engine's down-projection backward in full fine-tuning (``KernelConfig.moe_down_backward``):
    'triton' (the fused ``down_backward_silu`` kernel) or 'grouped_mm' (dOut gathered into expert order once,
    D = dOut_s W2_e on ``torch._grouped_mm``, the SiLU·up backward pass of the grouped-GEMM engine, and dW2 as one
    K-grouped ``_grouped_mm`` over the same gathered rows). ``auto``: 'grouped_mm' for bf16 on Hopper where nothing
    blocks it, the scatter GEMMs' rule (module docstring: timed faster on every fine-grained layer of an H200 run);
    asking for 'grouped_mm' where it cannot run raises a ValueError naming why. A pure function."""
    return _piece_engine("moe_down_backward", requested, dtype=dtype, capability=capability, hidden=hidden,
                         intermediate=intermediate, has_lora=has_lora, available=available)


def _layer_rules(x: torch.Tensor, w1: torch.Tensor, has_lora: bool, config: KernelConfig) -> tuple[str, bool, str]:
    """(:func:`scatter_engine`, :func:`dw1_on_grouped_mm`, :func:`down_backward_engine`) for one call's tensors
    and ``config``."""
    capability = gpu_arch.capability(x.device)  # honours $LORA_LAB_ARCH
    shape = dict(dtype=x.dtype, capability=capability, hidden=w1.shape[2], intermediate=w1.shape[1] // 2,
                 has_lora=has_lora, available=grouped_mm_available())
    return (scatter_engine(requested=config.moe_scatter, **shape),
            dw1_on_grouped_mm(weight_grad=config.moe_weight_grad, **shape),
            down_backward_engine(requested=config.moe_down_backward, **shape))


class _FusedMoeExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, top_k_index, top_k_weights, w1, w2, a1, b1, a2, b2, scale1, scale2, block_m, config):
        num_tokens, top_k = top_k_index.shape
        c = config
        scatter, dw1_gmm, down_bw = _layer_rules(x, w1, a1 is not None or a2 is not None, c)
        routing = route_experts(top_k_index, w1.shape[0], block_m,
                                with_position="grouped_mm" in (scatter, down_bw))
        row_weight = top_k_weights.reshape(-1).contiguous()

        p1 = grouped_rows_gemm(x, a1.transpose(1, 2), routing, gather_rows=True, config=c) if a1 is not None else None
        gu, h = gate_up_silu(x, w1, routing, lora=(p1, b1, scale1) if a1 is not None else None,
                             row_weight=row_weight, config=c)  # h_j carries w_j
        p2 = grouped_rows_gemm(h, a2.transpose(1, 2), routing, gather_rows=False, config=c) if a2 is not None else None

        if scatter == "grouped_mm":  # the sorted rows by CUTLASS, each token's K rows summed by one pass
            out = unsort_sum(torch._grouped_mm(h, w2.transpose(1, 2), offs=routing.expert_offsets[1:]),
                             routing.position, num_tokens, top_k, row_range=routing.expert_offsets)
        else:
            out = torch.zeros(num_tokens, w2.shape[1], device=x.device, dtype=torch.float32)
            grouped_rows_gemm(
                h, w2.transpose(1, 2), routing, gather_rows=False, scatter_into=out,
                lora=(p2, b2.transpose(1, 2), scale2) if a2 is not None else None, config=c,
            )

        # routing tensors go through save_for_backward too, so saved-tensor accounting sees them
        ctx.routing_meta = (routing.num_tokens, routing.top_k, routing.num_experts, routing.block_m)
        ctx.scales = (scale1, scale2)
        ctx.config = config
        ctx.scatter = scatter
        ctx.dw1_gmm = dw1_gmm
        ctx.down_bw = down_bw
        ctx.has_lora = (a1 is not None, a2 is not None)
        ctx.weights_dtype = top_k_weights.dtype
        ctx.weights_shape = top_k_weights.shape
        ctx.save_for_backward(
            x, row_weight, w1, w2, gu, h, a1, b1, a2, b2, p1, p2,
            routing.sorted_slot, routing.sorted_token, routing.expert_offsets, routing.tile_expert,
            routing.tile_row_start, routing.position,
        )
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, row_weight, w1, w2, gu, h, a1, b1, a2, b2, p1, p2, *routing_tensors = ctx.saved_tensors
        refuse_second_backward(ctx, "the fused MoE experts")
        routing = ExpertRouting(*ctx.routing_meta, *routing_tensors)
        scale1, scale2 = ctx.scales
        has_lora1, has_lora2 = ctx.has_lora
        need = ctx.needs_input_grad
        grad_out = grad_out.to(x.dtype)
        c = ctx.config

        q2 = grouped_rows_gemm(grad_out, b2, routing, gather_rows=True, config=c) if has_lora2 else None
        dout_rows = dw2 = None
        if ctx.down_bw == "grouped_mm":  # D on CUTLASS over dOut gathered once, then SiLU·up's backward pass
            offsets = routing.expert_offsets
            dout_rows = grad_out.index_select(0, routing.sorted_token.long())  # (S, H), expert order
            d = torch._grouped_mm(dout_rows, w2, offs=offsets[1:])  # (S, I)
            valid = torch.arange(routing.num_assignments, device=x.device) < offsets[-1]  # rows of no expert: last
            # h (weighted, sorted) was saved by the forward: the pass does not write it again
            dgu, _, dw_sorted = silu_backward(
                d, gu, row_weight.index_select(0, routing.sorted_slot.long()), valid, compute_router_grad=need[2],
                write_h=False)
            del d
            free_saved(gu)  # [g | u]'s one use: freed before dW2 allocates its output, which lowers the peak
            dw = dw_sorted.index_select(0, routing.position.long()) if need[2] else None  # back to slot order
            if need[4] and c.moe_weight_grad == "auto":  # dW2 over the same gathered rows and the saved h
                dw2 = k_grouped_mm(dout_rows, h, offsets[1:])
            del dout_rows
        else:
            dgu, dw = down_backward_silu(
                grad_out, w2, gu, row_weight, routing, compute_router_grad=need[2],
                lora=(q2, a2, scale2) if has_lora2 else None, config=c,
            )
            free_saved(gu)  # [g | u] (S x 2I) has had its one use: freed now, not when backward returns
        q1 = grouped_rows_gemm(dgu, b1, routing, gather_rows=False, config=c) if has_lora1 else None

        dx = None
        if need[0] and ctx.scatter == "grouped_mm":
            dx = unsort_sum(torch._grouped_mm(dgu, w1, offs=routing.expert_offsets[1:]), routing.position,
                            routing.num_tokens, routing.top_k, row_range=routing.expert_offsets)
        elif need[0]:
            dx = torch.zeros(routing.num_tokens, x.shape[1], device=x.device, dtype=torch.float32)
            grouped_rows_gemm(
                dgu, w1, routing, gather_rows=False, scatter_into=dx,
                lora=(q1, a1, scale1) if has_lora1 else None, config=c,
            )
            dx = dx.to(x.dtype)
        d_weights = dw.view(ctx.weights_shape).to(ctx.weights_dtype) if need[2] else None
        dw1 = None
        if need[3] and ctx.dw1_gmm:
            # dW1 as one K-grouped CUTLASS GEMM over X gathered by token (module docstring); None where it cannot run
            dw1 = grouped_mm_weight_grad(dgu, x, routing, gather_a=False, gather_b=True, row_weight=None, scale=1.0)
        if need[3] and dw1 is None:
            dw1 = expert_weight_grad(dgu, x, routing, gather_a=False, gather_b=True, config=c)
        if need[4] and dw2 is None:
            dw2 = expert_weight_grad(grad_out, h, routing, gather_a=True, gather_b=False, config=c)
        da1 = (
            expert_weight_grad(q1, x, routing, gather_a=False, gather_b=True, scale=scale1, config=c)
            if has_lora1 and need[5] else None
        )
        db1 = (
            expert_weight_grad(dgu, p1, routing, gather_a=False, gather_b=False, scale=scale1, config=c)
            if has_lora1 and need[6] else None
        )
        da2 = (
            expert_weight_grad(q2, h, routing, gather_a=False, gather_b=False, scale=scale2, config=c)
            if has_lora2 and need[7] else None
        )
        db2 = (
            expert_weight_grad(grad_out, p2, routing, gather_a=True, gather_b=False, scale=scale2, config=c)
            if has_lora2 and need[8] else None
        )
        return dx, None, d_weights, dw1, dw2, da1, db1, da2, db2, None, None, None, None


def _validate(x, top_k_index, top_k_weights, gate_up_proj, down_proj) -> None:
    if x.dim() != 2:
        raise ValueError(f"hidden_states must be 2-D (tokens, hidden), got shape {tuple(x.shape)}")
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(
            f"gate_up_proj must be (E, 2I, H) and down_proj (E, H, I); got {tuple(gate_up_proj.shape)}, "
            f"{tuple(down_proj.shape)}"
        )
    num_experts, two_i, hidden = gate_up_proj.shape
    if two_i % 2 or tuple(down_proj.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(
            f"down_proj {tuple(down_proj.shape)} does not match gate_up_proj {tuple(gate_up_proj.shape)}: "
            f"expected ({num_experts}, {hidden}, {two_i // 2})"
        )
    if x.shape[1] != hidden:
        raise ValueError(f"hidden_states has {x.shape[1]} features, experts expect {hidden}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != x.shape[0]:
        raise ValueError(f"top_k_index must be ({x.shape[0]}, K), got {tuple(top_k_index.shape)}")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"top_k_weights {tuple(top_k_weights.shape)} "
                         f"must match top_k_index {tuple(top_k_index.shape)}")
    if top_k_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"top_k_index must be int32/int64, got {top_k_index.dtype}")
    if not top_k_weights.is_floating_point():
        raise TypeError(f"top_k_weights must be floating point, got {top_k_weights.dtype}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"fused MoE experts support {_SUPPORTED_DTYPES}, got {x.dtype}")
    if gate_up_proj.dtype != x.dtype or down_proj.dtype != x.dtype:
        raise TypeError(
            f"dtype mismatch: hidden_states {x.dtype}, gate_up_proj {gate_up_proj.dtype}, down_proj {down_proj.dtype}"
        )
    devices = {t.device for t in (x, top_k_index, top_k_weights, gate_up_proj, down_proj)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")

def _validate_for_triton(x) -> None:
    check_kernel_device(x, "the hidden states")
    check_interpreter_dtype(x, op="fused_moe_experts")


def _validate_lora(lora: ExpertLoRA, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
    num_experts, two_i, hidden = gate_up_proj.shape
    inter = two_i // 2
    pairs = (
        ("gate_up", lora.gate_up_A, lora.gate_up_B, hidden, two_i),
        ("down", lora.down_A, lora.down_B, inter, hidden),
    )
    for name, a, b, in_f, out_f in pairs:
        if (a is None) != (b is None):
            raise ValueError(f"LoRA on {name}: A and B must both be given or both be None")
        if a is None:
            continue
        rank = a.shape[1]
        if tuple(a.shape) != (num_experts, rank, in_f) or tuple(b.shape) != (num_experts, out_f, rank):
            raise ValueError(
                f"LoRA on {name}: expected A ({num_experts}, r, {in_f}) and B ({num_experts}, {out_f}, r), "
                f"got {tuple(a.shape)} and {tuple(b.shape)}"
            )
        if a.device != gate_up_proj.device or b.device != gate_up_proj.device:
            raise ValueError(f"LoRA on {name}: factors on {a.device}/{b.device}, experts on {gate_up_proj.device}")


def fused_moe_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    lora: ExpertLoRA | None = None,
    block_m: int | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Σ_k w_tk · Expert_{e_tk}(x_t) for every token, with Triton kernels (forward and backward).

    Semantics match transformers' experts modules (SiLU gate, [gate; up] concatenated in
    ``gate_up_proj``); expert ids outside [0, E) contribute nothing. ``lora`` adds per-expert
    LoRA terms (factors are cast to the weights' dtype, differentiably). ``config``: kernel settings
    (:class:`~lora_lab.kernels.KernelConfig`; None: the defaults). ``config.moe_engine`` and the shape pick
    the engine (:func:`~lora_lab.kernels.moe.engine.choose_engine`): coarse experts, bf16 on Hopper, with or
    without LoRA, run their GEMMs on ``torch._grouped_mm``; ``moe_engine`` forces either engine.
    """
    config = resolve_config(config)
    _validate(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)
    has_lora = lora is not None and (lora.gate_up_A is not None or lora.down_A is not None)
    if lora is not None:  # one check and one cast for either engine
        _validate_lora(lora, gate_up_proj, down_proj)
        lora = lora.cast(gate_up_proj.dtype)
    ranks = tuple(a.shape[1] for a in ((lora.gate_up_A, lora.down_A) if has_lora else ()) if a is not None)
    engine = engine_for(hidden_states, top_k_index, gate_up_proj, config=config, ranks=ranks)
    if engine == "grouped_mm":
        if top_k_index.numel() == 0:
            return torch.zeros_like(hidden_states)
        return grouped_mm_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                  lora if has_lora else None)
    _validate_for_triton(hidden_states)
    if lora is None:
        lora = ExpertLoRA()
    num_tokens, top_k = top_k_index.shape
    if num_tokens * top_k == 0:
        return torch.zeros_like(hidden_states)
    if block_m is None:
        block_m = row_block_size(num_tokens * top_k, gate_up_proj.shape[0], config)
    return _FusedMoeExpertsFunction.apply(
        hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
        lora.gate_up_A, lora.gate_up_B, lora.down_A, lora.down_B,
        float(lora.gate_up_scale), float(lora.down_scale), block_m, config,
    )

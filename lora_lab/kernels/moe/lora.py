"""LoRA on MoE experts, in PEFT's ``target_parameters`` layout, applied without building W + B·A.

PEFT 0.21 adapts a 3-D expert parameter W: (E, out, in) (transformers' layout, ``is_transposed``
False) with a ``ParamWrapper`` holding two ``nn.Linear`` weights:

    lora_A.weight: (E·r, in)    expert e's A_e = rows [e·r, (e+1)·r)        → view (E, r, in)
    lora_B.weight: (out, r·E)   column j·E + e is rank j of expert e        → view (out, r, E), permute → (E, out, r)
    W'_e = W_e + s · B_e A_e,   s = lora_alpha / r   (or alpha / √r with rsLoRA)

(``ParamWrapper.get_delta_factors``/``get_delta_weight`` in peft/tuners/lora/layer.py.) Both
views share storage with PEFT's parameters, so training through them updates the very tensors
PEFT saves (``adapter_model.safetensors``) and loads back: the on-disk format *is* PEFT's.

For a token row x of expert e the kernels compute

    x W'_eᵀ = x W_eᵀ + s · (x A_eᵀ) B_eᵀ          rank-r product first; W'_e never exists

and give no gradient to the frozen W (no dW GEMMs at all: the backward is 2 grouped GEMMs
instead of 4, plus rank-r work).

Targeting both ``gate_up_proj`` and ``down_proj`` nests two wrappers: the one listed first in
``target_parameters`` is the inner ``base_layer`` (keys ``...experts.base_layer.lora_A.weight``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


@dataclass
class ExpertLoRA:
    """Per-expert LoRA factors (views) for the two expert weights; either half may be absent."""

    gate_up_A: torch.Tensor | None = None  # (E, r, H)
    gate_up_B: torch.Tensor | None = None  # (E, 2I, r)
    gate_up_scale: float = 0.0
    down_A: torch.Tensor | None = None  # (E, r, I)
    down_B: torch.Tensor | None = None  # (E, H, r)
    down_scale: float = 0.0

    def cast(self, dtype: torch.dtype) -> ExpertLoRA:
        """Differentiable cast of every factor (PEFT keeps fp32 adapters on a bf16 base by default)."""
        def conv(t):
            return None if t is None else t.to(dtype)
        return ExpertLoRA(
            conv(self.gate_up_A), conv(self.gate_up_B), self.gate_up_scale,
            conv(self.down_A), conv(self.down_B), self.down_scale,
        )


def peft_expert_factors(
    lora_a_weight: torch.Tensor, lora_b_weight: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's flat ``lora_A.weight`` (E·r, in) and ``lora_B.weight`` (out, r·E) → views A (E, r, in), B (E, out, r)."""
    rows, in_features = lora_a_weight.shape
    out_features, cols = lora_b_weight.shape
    if rows % num_experts or cols != rows:
        raise ValueError(
            f"PEFT expert LoRA shapes do not fit {num_experts} experts: lora_A {tuple(lora_a_weight.shape)}, "
            f"lora_B {tuple(lora_b_weight.shape)}"
        )
    rank = rows // num_experts
    a = lora_a_weight.view(num_experts, rank, in_features)
    b = lora_b_weight.view(out_features, rank, num_experts).permute(2, 0, 1)
    return a, b


def peft_delta_weight(lora_a_weight: torch.Tensor, lora_b_weight: torch.Tensor, num_experts: int, scale: float):
    """ΔW (E, out, in) = s · B_e A_e, for tests against PEFT's own ``get_delta_weight``."""
    a, b = peft_expert_factors(lora_a_weight, lora_b_weight, num_experts)
    return scale * torch.bmm(b, a)


def moe_experts_reference(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    lora: ExpertLoRA | None = None,
) -> torch.Tensor:
    """Plain-torch MoE experts (transformers' eager per-expert loop) with LoRA as (x Aᵀ) Bᵀ; differentiable.

        out_t = Σ_k w_tk · [ (SiLU(g) · u) W2_eᵀ + s₂ ((SiLU(g) · u) A2_eᵀ) B2_eᵀ ],   e = top_k_index[t, k]
        [g | u] = x_t W1_eᵀ + s₁ (x_t A1_eᵀ) B1_eᵀ
    """
    num_experts = gate_up_proj.shape[0]
    out = torch.zeros_like(hidden_states)
    for expert in range(num_experts):
        token_idx, k_pos = torch.where(top_k_index == expert)
        if token_idx.numel() == 0:
            continue
        x = hidden_states[token_idx]
        gu = x @ gate_up_proj[expert].T
        if lora is not None and lora.gate_up_A is not None:
            gu = gu + lora.gate_up_scale * (x @ lora.gate_up_A[expert].T) @ lora.gate_up_B[expert].T
        gate, up = gu.chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up
        y = h @ down_proj[expert].T
        if lora is not None and lora.down_A is not None:
            y = y + lora.down_scale * (h @ lora.down_A[expert].T) @ lora.down_B[expert].T
        y = y * top_k_weights[token_idx, k_pos, None]
        out = out.index_add(0, token_idx, y.to(out.dtype))
    return out

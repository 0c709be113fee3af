"""Fused Triton kernels for LoRA training, and the switch that puts them into a model.

* :mod:`.lora`      — one LoRA linear (:func:`fused_lora_linear`), several projections of one input
                      (:func:`fused_shared_input_lora`), SiLU·up between an MLP's projections (:func:`silu_mul`),
                      DoRA (:func:`fused_dora_linear`, :func:`dora_row_norm`), the chained-cuBLAS baseline, and
                      one layer as CUDA graphs (:func:`graphed_lora_linear`)
* :mod:`.moe`       — MoE experts with optional LoRA on them (:func:`fused_moe_experts`)
* :mod:`.loss`      — cross-entropy from hidden states without logits (:func:`linear_cross_entropy`)
* :mod:`.patching`  — :func:`patch_model` / :func:`unpatch_model` for PEFT and lora_lab models
* :mod:`.config`    — :class:`KernelConfig`, every setting of the kernels as one argument

Importing this package imports Triton; on a CPU set ``TRITON_INTERPRET=1`` before that to run the kernels in
Triton's interpreter.
"""
from lora_lab.kernels.config import KernelConfig
from lora_lab.kernels.lora.chained import ChainedLoRALinearFunction, chained_lora_linear
from lora_lab.kernels.lora.dora import dora_row_norm, fused_dora_linear
from lora_lab.kernels.lora.graphs import GraphedLayer, graphed_lora_linear
from lora_lab.kernels.lora.linear import (
    FusedLoRALinearFunction,
    fused_lora_linear,
    lora_linear_reference,
    lora_linear_unfused,
)
from lora_lab.kernels.lora.rank_ops import dropout_keep_mask
from lora_lab.kernels.lora.shared_input import (
    SharedInputLoRAFunction,
    fused_shared_input_lora,
    shared_input_lora_reference,
)
from lora_lab.kernels.lora.swiglu import SiLUMulFunction, silu_mul, silu_mul_reference
from lora_lab.kernels.loss import (
    LossKernelConfig,
    linear_cross_entropy,
    linear_cross_entropy_reference,
    patch_causal_lm_loss,
    unpatch_causal_lm_loss,
)
from lora_lab.kernels.moe.experts import ExpertLoRA, fused_moe_experts, moe_experts_reference
from lora_lab.kernels.moe.patch import patch_moe_experts, unpatch_moe_experts
from lora_lab.kernels.patching import UnsupportedLoRAError, patch_model, patched_layers, unpatch_model

__all__ = [
    "ChainedLoRALinearFunction",
    "ExpertLoRA",
    "FusedLoRALinearFunction",
    "GraphedLayer",
    "KernelConfig",
    "LossKernelConfig",
    "SharedInputLoRAFunction",
    "SiLUMulFunction",
    "UnsupportedLoRAError",
    "chained_lora_linear",
    "dora_row_norm",
    "dropout_keep_mask",
    "fused_dora_linear",
    "fused_lora_linear",
    "fused_moe_experts",
    "fused_shared_input_lora",
    "graphed_lora_linear",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "lora_linear_reference",
    "lora_linear_unfused",
    "moe_experts_reference",
    "patch_model",
    "patch_causal_lm_loss",
    "patch_moe_experts",
    "patched_layers",
    "shared_input_lora_reference",
    "silu_mul",
    "silu_mul_reference",
    "unpatch_causal_lm_loss",
    "unpatch_model",
    "unpatch_moe_experts",
]

"""The panel notebook 06 benchmarks (``benchmarks/bench_moe.py``): the real MoE layer shapes it times, the names of
the implementations it compares (with the kernel settings of our variants), and the GPU's dense bf16 peak. Plain
data, below both the notebook's code (:mod:`lora_lab.experiments.fused_moe`, which builds and runs these layers and
re-exports every name here) and the benchmark's metrics (:mod:`lora_lab.experiments.fused_moe_metrics`)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

__all__ = ["H200_DENSE_BF16_TFLOPS", "IMPLEMENTATIONS", "OURS_PERSISTENT", "OURS_UNTUNED", "OURS_KGROUPED",
           "OURS_ENGINES", "OURS_SCATTER", "OURS_VARIANTS", "MoeLayerShape", "LAYER_SHAPES", "COARSE_SHAPES", "LIGER"]

H200_DENSE_BF16_TFLOPS = 989.5  # NVIDIA H200 SXM: 1,979 TFLOP/s bf16 with 2:4 sparsity, half of it dense
IMPLEMENTATIONS = ("eager", "grouped_mm", "ours")
# ours with the persistent form of the row kernels (KernelConfig.moe_loads), timed when a benchmark asks for them
OURS_PERSISTENT = {"ours_persistent": "persistent"}
# ours without autotuning: the shape-aware tile table alone
OURS_UNTUNED = {"ours_untuned": {"moe_autotune": False}}
# ours with another engine for the expert weight gradients (KernelConfig.moe_weight_grad), timed when a benchmark asks
# for them: the K-grouped Triton kernel; torch._grouped_mm everywhere it applies (the default ``auto`` takes it above
# 2,112 rows per expert); and the Triton per-tile kernel named explicitly
OURS_KGROUPED = {"ours_kgrouped": {"moe_weight_grad": "kgrouped"},
                 "ours_dw_grouped_mm": {"moe_weight_grad": "grouped_mm"},
                 "ours_per_tile": {"moe_weight_grad": "per_tile"}}
# ours with its expert GEMMs on one engine, whatever the rule picks (KernelConfig.moe_engine), timed in LoRA cells
# when a benchmark asks for them: ``ours_gmm_engine`` on CUTLASS's grouped GEMM, ``ours_triton`` on the Triton
# kernels (a path the rule no longer takes for LoRA on fine-grained experts)
OURS_ENGINES = {"ours_gmm_engine": {"moe_engine": "grouped_mm"}, "ours_triton": {"moe_engine": "triton"}}
# ours with the down-forward and dX GEMMs of full fine-tuning on our atomic scatter-add kernels
# (KernelConfig.moe_scatter='triton'; ``auto`` picks torch._grouped_mm plus an un-sort pass where it runs:
# lora_lab.kernels.moe.experts.scatter_engine); and ours with the down projection's backward on our fused kernel
# (KernelConfig.moe_down_backward='triton'; ``auto`` picks torch._grouped_mm where it runs:
# lora_lab.kernels.moe.experts.down_backward_engine). Full cells, when a benchmark asks for them
OURS_SCATTER = {"ours_scatter_triton": {"moe_scatter": "triton"}, "ours_down_triton": {"moe_down_backward": "triton"}}
# (the persistent form is one of the Triton kernels': forced there, whatever engine the rule picks for ours)
OURS_VARIANTS = {**{name: {"moe_loads": loads, "moe_engine": "triton"} for name, loads in OURS_PERSISTENT.items()},
                 **OURS_UNTUNED,
                 **OURS_KGROUPED, **OURS_ENGINES, **OURS_SCATTER}


@dataclass(frozen=True)
class MoeLayerShape:
    name: str
    hidden: int
    num_experts: int
    top_k: int
    intermediate: int
    norm_topk_prob: bool
    family: str  # transformers model family whose experts class is used

    def build_experts(self, device, dtype, seed: int = 0) -> nn.Module:
        """The transformers experts module of this shape, weights ~ N(0, 0.02), drawn on ``device`` (the
        30B-like layer holds 600M values: a host draw and copy would take seconds)."""
        if self.family == "qwen3_moe":
            from transformers import Qwen3MoeConfig as config_class
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as experts_class
        elif self.family == "qwen2_moe":
            from transformers import Qwen2MoeConfig as config_class
            from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts as experts_class
        else:
            raise ValueError(f"unknown family {self.family}")
        config = config_class(hidden_size=self.hidden, moe_intermediate_size=self.intermediate,
                              num_experts=self.num_experts, num_experts_per_tok=self.top_k)
        config._experts_implementation = "eager"
        device = torch.device(device)
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.device(device):
            experts = experts_class(config)
        with torch.no_grad():
            for p in (experts.gate_up_proj, experts.down_proj):
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
        return experts.to(device=device, dtype=dtype)

    def scaled(self, hidden: int, num_experts: int, top_k: int, intermediate: int) -> MoeLayerShape:
        """The same layer (name, family, routing rule) at other sizes: the tiny stand-ins of smoke runs."""
        return replace(self, hidden=hidden, num_experts=num_experts, top_k=top_k, intermediate=intermediate)


# The panel: the expert shapes of public MoE models, from each model's config.json on the Hugging Face
# hub (hidden_size, number of routed experts, experts per token, expert intermediate size, whether the top-k
# weights are renormalised). Every layer runs as SiLU-gated experts in transformers' layout ("-like": GPT-OSS's
# clamped SwiGLU with biases, DeepSeek's shared experts and Mixtral's own module class are not reproduced).
LAYER_SHAPES = {
    # Qwen/Qwen3-30B-A3B: 2048, 128 experts, top-8, moe_intermediate_size 768, norm_topk_prob true
    "qwen3_30b_a3b": MoeLayerShape("qwen3_30b_a3b", 2048, 128, 8, 768, True, "qwen3_moe"),
    # Qwen/Qwen1.5-MoE-A2.7B: 2048, 60 experts, top-4, moe_intermediate_size 1408, norm_topk_prob false
    "qwen1_5_moe_a2_7b": MoeLayerShape("qwen1_5_moe_a2_7b", 2048, 60, 4, 1408, False, "qwen2_moe"),
    # allenai/OLMoE-1B-7B-0924: 2048, 64 experts, top-8, intermediate_size 1024, norm_topk_prob false
    "olmoe_1b_7b": MoeLayerShape("olmoe_1b_7b", 2048, 64, 8, 1024, False, "qwen3_moe"),
    # deepseek-ai/DeepSeek-V2-Lite (and moonshotai/Moonlight-16B-A3B): 2048, 64 routed experts, top-6,
    # moe_intermediate_size 1408
    "deepseek_v2_lite": MoeLayerShape("deepseek_v2_lite", 2048, 64, 6, 1408, False, "qwen3_moe"),
    # openai/gpt-oss-20b: 2880, 32 experts, top-4, intermediate_size 2880 (router softmax over the top-4)
    "gpt_oss_20b": MoeLayerShape("gpt_oss_20b", 2880, 32, 4, 2880, True, "qwen3_moe"),
    # mistralai/Mixtral-8x7B-v0.1: 4096, 8 experts, top-2, intermediate_size 14336 (softmax over the top-2)
    "mixtral_8x7b": MoeLayerShape("mixtral_8x7b", 4096, 8, 2, 14336, True, "qwen3_moe"),
    # mistralai/Mixtral-8x22B-v0.1: 6144, 8 experts, top-2, intermediate_size 16384
    "mixtral_8x22b": MoeLayerShape("mixtral_8x22b", 6144, 8, 2, 16384, True, "qwen3_moe"),
}
COARSE_SHAPES = ("mixtral_8x7b", "mixtral_8x22b")  # <= 16 experts; the others are fine-grained (>= 32 experts)

# Liger-Kernel's fused MoE (``liger_kernel.ops.fused_moe``), a baseline for full fine-tuning: it computes the
# experts of transformers' layout (gate_up_proj [E, 2I, H], down_proj [E, H, I], SwiGLU) and has no LoRA on them.
LIGER = "liger"

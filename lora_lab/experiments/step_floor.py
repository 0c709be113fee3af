"""The matrix-product floor of a LoRA training step: the FLOPs its products must compute, and the time they take at
the GPU's dense bf16 rate.

A LoRA step over T tokens (B sequences of S) with the base frozen computes, per linear projection of K inputs and N
outputs: the forward ``2KN·T``, the input gradient ``2KN·T`` (no weight gradient), and again the forward where
gradient checkpointing recomputes it. The rank-r adapter adds ``P = X Aᵀ`` and ``P Bᵀ`` forward (``2r(K+N)·T``) and
``Q = dY B``, ``dB``, ``dA``, ``Q A`` backward (``4r(K+N)·T``), plus the recomputed forward. Attention's two
products (``Q Kᵀ``, ``P V``) cost ``4·S²·d_head·heads`` per sequence and layer forward, half of it under a causal
mask for kernels that skip the masked blocks (FlashAttention's, SDPA's), and ``attention_backward`` times that
backward (2.5 for FlashAttention's backward, which recomputes the scores; 2 for autograd over plain matmuls). The
head adds ``2·d·V·T`` forward and the same for its input gradient (frozen; never recomputed). A mixture of experts
adds its router (a frozen ``d × E`` projection) and ``top_k`` experts per token, each a gated MLP.

Nothing else is counted (norms, activations, RoPE, the loss's softmax, the optimizer): they move memory rather than
compute, so the floor is what the step's products would take if they all ran at the dense rate of one large GEMM,
``floor_ms = flops / rate``. A step's time over it says how much is left to win, and where: an implementation cannot
run below its floor, and one within a few percent of it has nothing left to fuse.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lora_lab.memory.byte_model import ModelShape

__all__ = ["StepShape", "shape_of", "step_flops", "floor_ms", "floor_rows"]

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class StepShape:
    """What the step's FLOPs depend on (:func:`shape_of` reads it from a transformers config)."""

    layers: int
    hidden: int
    intermediate: int  # the dense MLP's (0 for a mixture-of-experts layer without one)
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # a shared expert's (Qwen1.5-MoE, Qwen2-MoE); 0: none


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def shape_of(config: Any) -> StepShape:
    """The :class:`StepShape` of a transformers decoder config (Llama, Qwen2, Qwen3-MoE and the like)."""
    hidden = _get(config, "hidden_size")
    heads = _get(config, "num_attention_heads")
    layers = _get(config, "num_hidden_layers")
    vocab = _get(config, "vocab_size")
    if not all(isinstance(v, int) and v > 0 for v in (hidden, heads, layers, vocab)):
        raise ValueError(f"shape_of: {type(config).__name__} lacks hidden_size, num_attention_heads, "
                         "num_hidden_layers or vocab_size")
    experts = int(_get(config, "num_experts", "num_local_experts", "n_routed_experts", default=0) or 0)
    top_k = int(_get(config, "num_experts_per_tok", default=0) or 0) if experts else 0
    dense_layers = _get(config, "mlp_only_layers", default=()) or ()
    if experts and (dense_layers or int(_get(config, "decoder_sparse_step", default=1) or 1) != 1):
        raise ValueError("shape_of: layers with a dense MLP among the MoE layers (mlp_only_layers, "
                         "decoder_sparse_step) are not modelled")
    return StepShape(
        layers=layers, hidden=hidden, intermediate=0 if experts else int(_get(config, "intermediate_size")),
        heads=heads, kv_heads=int(_get(config, "num_key_value_heads", default=heads)),
        head_dim=int(_get(config, "head_dim", default=hidden // heads)), vocab=vocab, experts=experts, top_k=top_k,
        expert_intermediate=int(_get(config, "moe_intermediate_size", default=0) or 0) if experts else 0,
        shared_intermediate=int(_get(config, "shared_expert_intermediate_size", default=0) or 0) if experts else 0)


def step_flops(shape: StepShape, batch: int, seq: int, rank: int = 16, checkpointing: bool = False,
               causal: bool = True, attention_backward: float = 2.5, lora_experts: bool = True) -> dict[str, float]:
    """FLOPs of one training step's matrix products, by part (``projections``, ``lora``, ``attention``, ``head``,
    ``router``, ``experts``) and ``total``: LoRA of ``rank`` on every linear projection (and on the experts'
    gate/up and down with ``lora_experts``), the base, router and head frozen."""
    if batch < 1 or seq < 1 or rank < 0:
        raise ValueError(f"step_flops: batch and seq must be >= 1 and rank >= 0, got {batch}, {seq}, {rank}")
    if attention_backward <= 0:
        raise ValueError(f"step_flops: attention_backward must be positive, got {attention_backward}")
    tokens = batch * seq
    replay = 1 if checkpointing else 0
    frozen = 2 * (2 + replay)  # per K·N and token: forward, input gradient, recomputed forward
    adapter = 2 * (3 + replay)  # per r·(K+N) and token: two forward products, four backward, recomputed forward
    d, q_out = shape.hidden, shape.heads * shape.head_dim
    # the layer's dense projections as the byte model lists them (q, k, v, o, and gate, up, down without experts)
    dense = ModelShape(hidden_size=d, intermediate_size=shape.intermediate, num_layers=shape.layers,
                       num_heads=shape.heads, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                       vocab_size=shape.vocab).linear_shapes()
    linears = [(k, n) for name, (k, n, _) in dense.items() if shape.intermediate or name in ATTENTION]
    parts = dict.fromkeys(("projections", "lora", "attention", "head", "router", "experts"), 0.0)
    per_layer_proj = sum(k * n for k, n in linears)
    per_layer_lora = sum(k + n for k, n in linears)
    if shape.experts:  # the experts' gate_up as one adapter (d → 2·width), down another (PEFT's target_parameters)
        width = shape.expert_intermediate
        parts["experts"] = shape.layers * shape.top_k * 3 * d * width * frozen * tokens
        if lora_experts:
            parts["lora"] = shape.layers * shape.top_k * rank * ((d + 2 * width) + (width + d)) * adapter * tokens
        if shape.shared_intermediate:  # a shared expert: a dense gated MLP, an adapter on each of its projections
            per_layer_proj += 3 * d * shape.shared_intermediate
            per_layer_lora += 3 * (d + shape.shared_intermediate)
    parts["projections"] = shape.layers * per_layer_proj * frozen * tokens
    parts["lora"] += shape.layers * rank * per_layer_lora * adapter * tokens
    if shape.experts:
        parts["router"] = shape.layers * d * shape.experts * frozen * tokens
    forward_attention = 4.0 * seq * seq * q_out * (0.5 if causal else 1.0) * batch
    parts["attention"] = shape.layers * forward_attention * (1 + attention_backward + replay)
    parts["head"] = 4.0 * d * shape.vocab * tokens
    parts = {k: float(v) for k, v in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


def floor_ms(flops: float, tflops: float) -> float:
    """Milliseconds ``flops`` take at ``tflops`` TFLOP/s."""
    if tflops <= 0:
        raise ValueError(f"floor_ms: the rate must be positive, got {tflops} TFLOP/s")
    return flops / (tflops * 1e12) * 1e3


def floor_rows(model: str, config: Any, batch: int, seq: int, checkpointing: str, tflops: float | None,
               rank: int = 16, lora_experts: bool = True) -> dict[str, Any]:
    """One CSV row: the model's step FLOPs by part and, with a measured ``tflops``, its floor in milliseconds."""
    shape = shape_of(config)
    flops = step_flops(shape, batch, seq, rank=rank, checkpointing=checkpointing == "on", lora_experts=lora_experts)
    row = dict(model=model, checkpointing=checkpointing, layers=shape.layers, batch=batch, seq=seq, rank=rank,
               **{f"flops_{k}": v for k, v in flops.items()}, matmul_tflops=tflops,
               floor_ms=floor_ms(flops["total"], tflops) if tflops else None)
    row.update({f"shape_{k}": v for k, v in asdict(shape).items()})
    return row

"""An op-by-op byte model of a Qwen2/Llama-style decoder's training step.

:func:`analytic_memory` predicts, from shapes alone, what :mod:`.accounting` and :mod:`.cuda_peak`
measure: fixed memory (weights, gradients, AdamW states), the tensors each decoder layer saves for
backward (per dtype, full fine-tuning vs LoRA, attention kernel, checkpointing), the head and the
loss (standard vs chunked), and the peak of each phase of the step.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .accounting import GIB, dtype_of

__all__ = ["ModelShape", "TrainingSetup", "AnalyticMemory", "analytic_memory", "ATTENTION_KERNELS", "LINEARS"]

ATTENTION_KERNELS = ("flash", "efficient", "cudnn", "cpu_flash", "math", "eager")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_SMS = 132  # the H200's SMs: how many vocabulary splits the fused loss's forward uses depends on them


@dataclass(frozen=True)
class ModelShape:
    """The shapes that decide memory in a Qwen2 / Llama-style decoder."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool = True
    attention_bias: bool = True  # bias on q/k/v (Qwen2); o_proj and the MLP have none

    @classmethod
    def from_config(cls, config) -> ModelShape:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        bias = getattr(config, "attention_bias", None)
        if bias is None:
            bias = getattr(config, "model_type", "") == "qwen2"
        return cls(
            hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim, vocab_size=config.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)), attention_bias=bool(bias),
        )

    def linear_shapes(self) -> dict[str, tuple[int, int, bool]]:
        """name -> (in_features, out_features, has_bias) for one decoder layer."""
        d, m, qd, kvd, b = (self.hidden_size, self.intermediate_size, self.num_heads * self.head_dim,
                            self.num_kv_heads * self.head_dim, self.attention_bias)
        return {"q_proj": (d, qd, b), "k_proj": (d, kvd, b), "v_proj": (d, kvd, b), "o_proj": (qd, d, False),
                "gate_proj": (d, m, False), "up_proj": (d, m, False), "down_proj": (m, d, False)}

    def layer_parameter_count(self) -> int:
        linears = sum(i * o + (o if b else 0) for i, o, b in self.linear_shapes().values())
        return linears + 2 * self.hidden_size  # two RMSNorm weights

    def parameter_count(self) -> int:
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tied_embeddings else embed
        return embed + head + self.num_layers * self.layer_parameter_count() + self.hidden_size

    def lora_parameter_count(self, r: int, targets: Sequence[str]) -> int:
        shapes = self.linear_shapes()
        unknown = [t for t in targets if t not in shapes]
        if unknown:
            raise ValueError(f"unknown LoRA target(s) {unknown}; the byte model knows {list(shapes)}")
        return self.num_layers * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets)


@dataclass(frozen=True)
class TrainingSetup:
    """One training configuration for :func:`analytic_memory`.

    ``attention`` is the kernel that runs: ``flash`` / ``efficient`` / ``cudnn`` (CUDA SDPA),
    ``cpu_flash`` (CPU SDPA), ``math`` (SDPA's composite fallback) or ``eager`` (transformers'
    own matmul + softmax). ``embedding_grad`` says whether the embedding output requires grad:
    True for full fine-tuning, and for checkpointing because transformers'
    ``gradient_checkpointing_enable`` calls ``enable_input_require_grads``; None picks that default.
    """

    batch: int
    seq_len: int
    dtype: str = "bf16"
    method: str = "full"  # "full" | "lora"
    lora_r: int = 8
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    attention: str = "flash"
    checkpointing: bool = False
    loss: str = "standard"  # "standard" | "chunked" | "fused" (lora_lab.kernels.loss.linear_cross_entropy)
    chunk_size: int = 1024
    embedding_grad: bool | None = None
    optimizer_foreach: bool = True  # AdamW's foreach path allocates one temporary the size of the trainable params
    adapter_dtype: str | None = None  # LoRA factors' dtype; None: add_lora's default (fp32 on bf16/fp16, else dtype)

    def __post_init__(self):
        if self.method not in ("full", "lora"):
            raise ValueError(f"method must be 'full' or 'lora', got {self.method!r}")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, got {self.attention!r}")
        if self.loss not in ("standard", "chunked", "fused"):
            raise ValueError(f"loss must be 'standard', 'chunked' or 'fused', got {self.loss!r}")
        for name in ("batch", "seq_len", "chunk_size", "lora_r"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        dtype_of(self.dtype)
        if self.adapter_dtype is not None:
            dtype_of(self.adapter_dtype)

    @property
    def adapter_itemsize(self) -> int:
        """Bytes per element of the LoRA factors (and their gradients and AdamW states)."""
        if self.adapter_dtype is not None:
            return dtype_of(self.adapter_dtype).itemsize
        s = dtype_of(self.dtype).itemsize
        return 4 if s == 2 else s


class PhasePeaks:
    """What a per-phase memory prediction derives from its fields ``weights``, ``optimizer_states`` and ``phases``
    (phase -> predicted peak bytes): shared by :class:`AnalyticMemory` and the FSDP2 model's ``FsdpMemory``."""

    @property
    def fixed(self) -> int:
        """Held before the forward: weights (or this rank's shards of them) + optimizer states."""
        return self.weights + self.optimizer_states

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)


@dataclass
class AnalyticMemory(PhasePeaks):
    """What :func:`analytic_memory` predicts (bytes)."""

    weights: int
    gradients: int
    optimizer_states: int
    layer_terms: list[dict[str, int]]  # per decoder layer: saved tensor -> bytes (no checkpointing)
    embed_saved: int
    final_norm_saved: int
    lm_head_saved: int
    loss_saved: int
    body_held: int  # held at the end of the decoder body (what "layers" measures)
    phases: dict[str, int]  # phase -> predicted peak of that phase

    @property
    def saved_per_layer(self) -> list[int]:
        return [sum(t.values()) for t in self.layer_terms]

    @property
    def layers_saved(self) -> int:
        return sum(self.saved_per_layer)

    @property
    def head_loss(self) -> int:
        """What the head, the loss and backward add to the peak above fixed + body."""
        return self.peak - self.fixed - self.body_held

    def bars(self) -> dict[str, float]:
        return {"fixed": self.fixed / GIB, "layers": self.body_held / GIB, "head_loss": self.head_loss / GIB}


def _norm_terms(prefix, n_tok, d, s, input_grad, weight_grad) -> dict[str, int]:
    """RMSNorm y = w * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype):
    pow and mul save the fp32 input x32 (x itself in fp32), rsqrt saves its [N, 1] fp32 output,
    and w * y saves y when w is trained."""
    terms = {}
    if input_grad:
        terms[f"{prefix} fp32 input"] = n_tok * d * 4
        terms[f"{prefix} rsqrt"] = n_tok * 4
    if weight_grad:
        terms[f"{prefix} normalised (norm weight grad)"] = n_tok * d * s
    return terms


def _layer_terms(shape: ModelShape, st: TrainingSetup, input_grad: bool,
                 first_rotary: bool) -> tuple[dict[str, int], bool]:
    """Tensors one decoder layer saves for backward (bytes), and whether its output requires grad.

    ``first_rotary``: no earlier layer has saved the rotary cos/sin tables (one storage shared by all layers).
    """
    B, T = st.batch, st.seq_len
    N = B * T
    s = dtype_of(st.dtype).itemsize
    d, m, hd = shape.hidden_size, shape.intermediate_size, shape.head_dim
    h, g = shape.num_heads, shape.num_kv_heads
    qd, kvd = h * hd, g * hd
    full = st.method == "full"
    lora = set() if full else set(st.lora_targets)

    def weight_trained(name):  # the linear's input must be saved: for W's grad (full) or A's grad (LoRA)
        return full or name in lora

    terms: dict[str, int] = {}

    a = st.adapter_itemsize
    widened = a != s  # adapters in another dtype: each LoRA branch casts its input and saves that copy for A's grad
    inputs = {"q_proj": d, "k_proj": d, "v_proj": d, "o_proj": qd, "gate_proj": d, "up_proj": d, "down_proj": m}

    def lora_mid(name):  # (x A^T) is saved for B's grad
        if name in lora:
            if widened:
                terms[f"{name} LoRA input (adapter dtype copy)"] = N * inputs[name] * a
            terms[f"{name} LoRA x A^T"] = N * st.lora_r * a

    def input_saved(*names):  # is the shared model-dtype input saved (for W's grad, or A's in the adapter's dtype)?
        return full or (not widened and any(n in lora for n in names))

    # --- attention block ---
    terms.update(_norm_terms("input_layernorm", N, d, s, input_grad, full))
    z_grad = input_grad or full
    if input_saved("q_proj", "k_proj", "v_proj"):
        terms["q/k/v input"] = N * d * s
    for n in ("q_proj", "k_proj", "v_proj"):
        lora_mid(n)
    q_grad = z_grad or weight_trained("q_proj")
    k_grad = z_grad or weight_trained("k_proj")
    v_grad = z_grad or weight_trained("v_proj")
    if first_rotary and (q_grad or k_grad):
        terms["rotary cos, sin (shared by all layers)"] = 2 * T * hd * s
    any_grad = q_grad or k_grad or v_grad
    kernel = st.attention
    out_copy = True  # is the attention output copied by transpose(1, 2).contiguous()?
    saves_output = False
    if kernel in ("flash", "efficient", "cudnn", "cpu_flash"):
        if any_grad:
            terms["sdpa q"] = N * qd * s
            terms["sdpa k"] = N * kvd * s
            terms["sdpa v"] = N * kvd * s
            terms["sdpa output"] = N * qd * s
            rows = T if kernel != "efficient" else 32 * math.ceil(T / 32)
            terms["sdpa logsumexp"] = B * h * rows * 4
            saves_output = True
        # the fused kernels write their output in q's memory layout ([B, T, heads, head_dim] as
        # transformers lays q out), so transpose(1, 2).contiguous() is free and o_proj saves that storage
        out_copy = False
    elif kernel == "math":
        # k, v repeated to all heads; q and k scaled by sqrt(scale); P = softmax(q k^T) is [B, h, T, T].
        # bf16/fp16 inputs are upcast to fp32 first (PyTorch >= 2.5), so these are fp32 tensors.
        sm = 4 if s < 4 else s
        if k_grad:
            terms["math q (scaled)"] = N * qd * sm
        if q_grad:
            terms["math k (repeated, scaled)"] = N * qd * sm
        if q_grad or k_grad or v_grad:
            terms["math softmax P (T x T)"] = B * h * T * T * sm
        if q_grad or k_grad:
            terms["math v (repeated)"] = N * qd * sm
    else:  # eager: transformers' repeat_kv, matmul, softmax in fp32, cast, matmul
        if k_grad:
            terms["eager q"] = N * qd * s
        if q_grad:
            terms["eager k (repeated)"] = N * qd * s
        if q_grad or k_grad:
            terms["eager softmax fp32 (T x T)"] = B * h * T * T * 4
            terms["eager v (repeated)"] = N * qd * s
        if v_grad and s != 4:
            terms["eager P in model dtype (T x T)"] = B * h * T * T * s
    if input_saved("o_proj") and (out_copy or not saves_output):
        terms["o_proj input"] = N * qd * s
    lora_mid("o_proj")
    h1_grad = input_grad or any_grad or weight_trained("o_proj")

    # --- MLP block ---
    terms.update(_norm_terms("post_attention_layernorm", N, d, s, h1_grad, full))
    z2_grad = h1_grad or full
    if input_saved("gate_proj", "up_proj"):
        terms["MLP input"] = N * d * s
    lora_mid("gate_proj")
    lora_mid("up_proj")
    gate_grad = z2_grad or weight_trained("gate_proj")
    up_grad = z2_grad or weight_trained("up_proj")
    if gate_grad:
        terms["SiLU input (gate)"] = N * m * s  # silu saves its input
        terms["up (for SiLU(gate) * up)"] = N * m * s  # mul saves the other factor
    if up_grad:
        terms["SiLU(gate) (for SiLU(gate) * up)"] = N * m * s
    if input_saved("down_proj"):
        terms["down_proj input"] = N * m * s
    lora_mid("down_proj")
    out_grad = h1_grad or gate_grad or up_grad or weight_trained("down_proj")
    return terms, out_grad


def _layer_backward_transient(shape: ModelShape, st: TrainingSetup) -> int:
    """Rough size of the temporaries alive while one layer runs backward: two residual-stream
    gradients plus the larger of the MLP's (three [N, intermediate]) and attention's temporaries."""
    N = st.batch * st.seq_len
    s = dtype_of(st.dtype).itemsize
    d, m = shape.hidden_size, shape.intermediate_size
    qd = shape.num_heads * shape.head_dim
    B, T, h = st.batch, st.seq_len, shape.num_heads
    mlp = 3 * N * m * s
    if st.attention == "math":
        attn = 2 * B * h * T * T * s + 3 * N * qd * s
    elif st.attention == "eager":
        attn = B * h * T * T * (s + 4 + 4) + 3 * N * qd * s
    else:  # fused kernels: dq, dk, dv expanded to all heads, an fp32 dq accumulator
        attn = N * qd * (3 * s + 4)
    return 2 * N * d * s + max(mlp, attn)


def analytic_memory(shape: ModelShape, setup: TrainingSetup) -> AnalyticMemory:
    """Predict one training step's memory from shapes alone.

    Fixed: weights (all parameters, model dtype), gradients and two AdamW states for the trainable
    ones. Activations: the op-by-op list of tensors each decoder layer saves (``_layer_terms``),
    the final norm, the lm_head and the loss. The peak is the largest of these phases:

    * ``forward``: fixed + body + the logits, their fp32 copy and the log-softmax (standard loss),
      or one chunk's logits and logsumexp temporary (chunked);
    * ``loss_backward``: fixed + body + the saved log-softmax, its incoming gradient and its
      result (3 x 4 bytes per token x vocab), or one chunk's recomputed buffers plus the
      hidden-state and lm_head gradients (chunked);
    * ``layers_backward``: walking down the layers, the gradients accumulated so far, what the
      layers below still hold, the layer being differentiated (recomputed under checkpointing)
      and its temporaries;
    * ``optimizer``: weights + gradients + states + AdamW's foreach temporary.
    """
    st = setup
    s = dtype_of(st.dtype).itemsize
    B, T = st.batch, st.seq_len
    N = B * T
    d, V, L = shape.hidden_size, shape.vocab_size, shape.num_layers
    full = st.method == "full"
    if not full:
        shape.lora_parameter_count(st.lora_r, st.lora_targets)  # validates the targets

    n_params = shape.parameter_count()
    trainable = n_params if full else shape.lora_parameter_count(st.lora_r, st.lora_targets)
    a = s if full else st.adapter_itemsize  # LoRA factors, their gradients and states: in the adapter dtype
    weights = n_params * s + (0 if full else trainable * a)
    gradients = trainable * a
    states = 2 * trainable * a

    embedding_grad = st.embedding_grad if st.embedding_grad is not None else (full or st.checkpointing)
    layer_terms = []
    grad_flag = embedding_grad
    rotary_saved = False
    for _ in range(L):
        terms, grad_flag = _layer_terms(shape, st, grad_flag, first_rotary=not rotary_saved)
        rotary_saved = rotary_saved or any(k.startswith("rotary") for k in terms)
        layer_terms.append(terms)
    saved_per_layer = [sum(t.values()) for t in layer_terms]
    final_norm = sum(_norm_terms("final norm", N, d, s, grad_flag, full).values())
    hidden = N * d * s  # the final norm's output, the lm_head input
    embed_saved = N * 8 if full else 0  # the embedding's backward keeps the token ids

    if st.loss == "standard":
        lm_head_saved = hidden if full else 0
        loss_saved = N * V * 4 + N * 8 + 4  # fp32 log-softmax output, int64 shifted targets, total weight
    else:
        lm_head_saved = 0
        loss_saved = hidden + N * 8 + N * 4 + 4  # hidden, targets, fp32 logsumexp per row, label count

    if st.checkpointing:
        layers_held = L * N * d * s  # each checkpointed layer keeps its input
    else:
        layers_held = sum(saved_per_layer)
    body_held = layers_held + final_norm + hidden

    fixed = weights + states
    layer_param_bytes = shape.layer_parameter_count() * s if full else 0
    head_grad = V * d * s if full else 0  # the tied embedding / lm_head gradient, first of the backward
    phases: dict[str, int] = {}
    if st.loss == "standard":
        upcast = N * V * 4 if s != 4 else 0
        phases["forward"] = fixed + body_held + N * V * s + upcast + N * V * 4
        phases["loss_backward"] = fixed + body_held + 3 * N * V * 4
    elif st.loss == "chunked":
        C = min(st.chunk_size, N)
        # one chunk's logits in the model dtype and their fp32 copy (the same buffer in fp32)
        phases["forward"] = fixed + body_held + N * 4 + C * V * (4 + (s if s != 4 else 0))
        bwd_chunk = C * V * (4 + (s if s != 4 else 0))
        grad_w = (V * d * 4 + (V * d * s if s != 4 else 0)) if full else 0
        phases["loss_backward"] = fixed + body_held + N * 4 + hidden + bwd_chunk + grad_w
    else:
        # the fused op (lora_lab.kernels.loss, its default plan): no logits. Forward: per-row partial (max, sum,
        # target) of each vocabulary split (the op's split count on FUSED_SMS SMs). Backward: dH plus its fp32
        # accumulator (N/32 rows for a frozen head; all N rows, plus dW and a V/32-row fp32 slab, when it trains)
        splits = min(math.ceil(V / 256), max(1, math.ceil(2 * FUSED_SMS / math.ceil(N / 128))))
        phases["forward"] = fixed + body_held + N * 4 + 3 * splits * N * 4
        if full:
            acc = N * d * 4 + V * d * s + max(1024, math.ceil(V / 32)) * d * 4
        else:
            acc = min(N, max(256, math.ceil(N / 32))) * d * 4
        phases["loss_backward"] = fixed + body_held + N * 4 + hidden + N * d * s + acc
    transient = _layer_backward_transient(shape, st)
    worst = 0
    for i in range(L - 1, -1, -1):
        grads_so_far = head_grad + (L - 1 - i) * layer_param_bytes
        if st.checkpointing:
            below = i * N * d * s + saved_per_layer[i]  # inputs of layers below + the recomputed layer
        else:
            below = sum(saved_per_layer[: i + 1])
        worst = max(worst, fixed + grads_so_far + below + transient)
    phases["layers_backward"] = worst
    foreach_tmp = trainable * a if st.optimizer_foreach else 0
    phases["optimizer"] = weights + gradients + states + foreach_tmp
    return AnalyticMemory(
        weights=weights, gradients=gradients, optimizer_states=states, layer_terms=layer_terms,
        embed_saved=embed_saved, final_norm_saved=final_norm, lm_head_saved=lm_head_saved,
        loss_saved=loss_saved, body_held=body_held, phases=phases,
    )

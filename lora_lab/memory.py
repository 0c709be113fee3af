"""Where training memory goes: measured peaks, fixed memory by category, saved activations, and a byte model.

Four views of one training step, from the most device-specific to the least:

* :func:`peak_memory` -- the original article's loop on CUDA: a few steps of forward, backward,
  AdamW step, ``zero_grad(set_to_none=True)``, with ``reset_peak_memory_stats`` before each step;
  the last step is read (AdamW creates its two states at the first step). Besides the peak it
  reads ``memory_allocated`` before the forward, at the end of the decoder body and after the
  loss, which splits the peak into *fixed* (weights + optimizer states), *layers* (activations the
  decoder holds for backward) and *head + loss* (everything the lm_head, the loss and the backward
  add on top at the peak moment).
* :func:`fixed_memory_by_category` -- weights, gradients and optimizer states measured from the
  tensors themselves (storages counted once, so tied weights count once).
* :class:`SavedTensorAccounting` -- on **any** device: the bytes of the tensors autograd saves
  for backward, deduplicated by storage, attributed to the module that saved them first (each
  decoder layer, the embedding, the final norm, the lm_head, and the loss outside any module),
  through ``torch.autograd.graph.saved_tensors_hooks``.
* :func:`analytic_memory` -- an op-by-op byte model of a Qwen2/Llama-style decoder (per dtype,
  full fine-tuning vs LoRA, attention kernel, checkpointing, standard vs chunked loss) that
  predicts all of the above from shapes alone.

:func:`sdpa_kernels_used` names the scaled-dot-product-attention kernel that actually ran (from
the profiler's op names), and :func:`run_memory_config` / :func:`memory_sweep` run configurations
one by one, recording an out-of-memory configuration as a result instead of crashing.
"""
from __future__ import annotations

import contextlib
import gc
import math
import weakref
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

__all__ = [
    "GIB",
    "FixedMemory",
    "fixed_memory_by_category",
    "SavedTensorAccounting",
    "SavedActivationReport",
    "saved_activation_bytes",
    "saved_bytes_excluding",
    "default_module_labels",
    "sdpa_kernels_used",
    "SDPA_OPS",
    "ModelShape",
    "TrainingSetup",
    "AnalyticMemory",
    "analytic_memory",
    "PeakMemory",
    "peak_memory",
    "MemoryConfig",
    "prepare_model",
    "remove_lora",
    "run_memory_config",
    "memory_sweep",
    "MODES",
    "config_for",
    "sweep_configs",
    "analytic_row",
    "relative_error",
    "format_table",
    "plot_memory_bars",
    "byte_model_kernel",
    "row_metrics",
]

GIB = 2**30


def _dtype_of(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if dtype in names:
        return names[dtype]
    raise ValueError(f"unknown dtype {dtype!r}; use a torch.dtype or one of {sorted(names)}")


def _storage_key(t: torch.Tensor):
    """(device, address) of the tensor's storage, or None for tensors without a plain storage."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None, 0
    return (t.device.type, t.device.index, storage.data_ptr()), storage.nbytes()


def _unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        key, nbytes = _storage_key(t)
        if key is None or key in seen:
            continue
        seen.add(key)
        total += nbytes
    return total


# ---------------------------------------------------------------------------------------------
# Fixed memory, from the tensors
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FixedMemory:
    """Bytes held by parameters, their gradients and the optimizer state (each storage once)."""

    weights: int
    gradients: int
    optimizer_states: int
    buffers: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_states + self.buffers

    def gib(self) -> dict[str, float]:
        return {k: v / GIB for k, v in {**asdict(self), "total": self.total}.items()}


def fixed_memory_by_category(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> FixedMemory:
    """Weights, gradients, optimizer states and buffers of ``model``, measured from the tensors.

    Each storage counts once (tied embeddings are one tensor). Optimizer states are every tensor
    in ``optimizer.state`` (AdamW: ``exp_avg``, ``exp_avg_sq`` and the step counters).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    params = list(model.parameters())
    state_tensors = []
    if optimizer is not None:
        for state in optimizer.state.values():
            state_tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return FixedMemory(
        weights=_unique_storage_bytes(params),
        gradients=_unique_storage_bytes(p.grad for p in params),
        optimizer_states=_unique_storage_bytes(state_tensors),
        buffers=_unique_storage_bytes(model.buffers()),
    )


# ---------------------------------------------------------------------------------------------
# Saved-activation accounting (any device)
# ---------------------------------------------------------------------------------------------


def _decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The model's stack of decoder layers: its longest nn.ModuleList."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=len) if lists else None


def default_module_labels(model: nn.Module) -> dict[nn.Module, str]:
    """Labels for a transformers causal LM: ``embed``, ``layers.<i>``, ``final_norm``, ``lm_head``.

    Anything saved outside these modules (the loss computed in the top-level forward, or a loss
    function called by the user) is labelled ``loss`` by :class:`SavedTensorAccounting`.
    """
    labels: dict[nn.Module, str] = {}
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(embed, nn.Module):
        labels[embed] = "embed"
    layers = _decoder_layers(model)
    if layers is not None:
        for i, layer in enumerate(layers):
            labels[layer] = f"layers.{i}"
    body = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    norm = getattr(body, "norm", None) if isinstance(body, nn.Module) else None
    if isinstance(norm, nn.Module):
        labels[norm] = "final_norm"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Module):
        labels[head] = "lm_head"
    return labels


@dataclass
class SavedActivationReport:
    """Bytes saved for backward, by label (distinct storages alive when the accounting ended)."""

    by_label: dict[str, int]
    tensors_by_label: dict[str, int]
    parameter_tensors_skipped: int
    largest: list[tuple[str, tuple[int, ...], str, int]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.by_label.values())

    @property
    def per_layer(self) -> list[int]:
        layer_items = [(int(k.split(".", 1)[1]), v) for k, v in self.by_label.items() if k.startswith("layers.")]
        if not layer_items:
            return []
        n = max(i for i, _ in layer_items) + 1
        out = [0] * n
        for i, v in layer_items:
            out[i] = v
        return out

    @property
    def layers(self) -> int:
        return sum(self.per_layer)

    @property
    def logits_loss(self) -> int:
        """Saved by the lm_head and the loss."""
        return self.by_label.get("lm_head", 0) + self.by_label.get("loss", 0)

    def summary(self) -> dict[str, int]:
        """Bytes by group: embed, layers, final_norm, lm_head, loss."""
        out = {"embed": self.by_label.get("embed", 0), "layers": self.layers}
        for k in ("final_norm", "lm_head", "loss"):
            out[k] = self.by_label.get(k, 0)
        return out


class SavedTensorAccounting:
    """Count the bytes autograd saves for backward while the context is open, by module.

    ``with SavedTensorAccounting(model) as acc: loss = loss_fn(model, batch)`` then
    ``acc.report``. Every tensor passed to a pack hook is keyed by its storage (device, address):
    views and repeated saves of one storage count once, attributed to the innermost labelled
    module running when it was first saved (``default_module_labels``; ``outside_label`` when
    none is). Storages of the model's parameters and buffers are skipped (they are fixed memory).
    Only storages still alive when the context closes are counted, so a tensor saved by a graph
    branch that was discarded during the forward does not count.

    Limits: tensors saved inside a non-reentrant ``torch.utils.checkpoint`` region are handled by
    checkpoint's own (innermost) hooks and are not seen; the layer inputs that checkpointing holds
    are not saved tensors either. Open the context around the forward only.
    """

    def __init__(self, model: nn.Module, labels: dict[nn.Module, str] | None = None,
                 outside_label: str = "loss", keep_largest: int = 0):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.model = model
        self.labels = default_module_labels(model) if labels is None else dict(labels)
        self.outside_label = outside_label
        self.keep_largest = keep_largest
        self.report: SavedActivationReport | None = None
        self._stack: list[str] = []
        self._entries: dict = {}
        self._handles: list = []
        self._hooks_ctx = None
        self._skip_keys: set = set()
        self._param_saves = 0

    # label stack driven by module hooks
    def _push(self, label):
        def hook(module, args):
            self._stack.append(label)
        return hook

    def _pop(self, module, args, output):
        if self._stack:
            self._stack.pop()

    def _pack(self, t: torch.Tensor):
        key, nbytes = _storage_key(t)
        if key is None:
            return t
        if key in self._skip_keys:
            self._param_saves += 1
            return t
        # Keep a detached alias (same storage, no grad_fn): returning ``t`` itself would make a saved
        # *output* reference its own node (tensor -> grad_fn -> saved tensor), a cycle that keeps a
        # discarded branch alive. The weak reference then dies exactly when the graph lets go.
        packed = t.detach()
        entry = self._entries.get(key)
        if entry is None or not any(ref() is not None for ref in entry[4]):
            # a new storage, or one whose earlier savers are all gone (the address was reused)
            label = self._stack[-1] if self._stack else self.outside_label
            entry = (label, nbytes, tuple(t.shape), str(t.dtype).replace("torch.", ""), [])
            self._entries[key] = entry
        entry[4].append(weakref.ref(packed))
        return packed

    @staticmethod
    def _unpack(t):
        return t

    def __enter__(self):
        self._skip_keys = {_storage_key(p)[0] for p in self.model.parameters()}
        self._skip_keys |= {_storage_key(b)[0] for b in self.model.buffers()}
        self._skip_keys.discard(None)
        for module, label in self.labels.items():
            self._handles.append(module.register_forward_pre_hook(self._push(label)))
            self._handles.append(module.register_forward_hook(self._pop, always_call=True))
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks_ctx.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        by_label: Counter = Counter()
        counts: Counter = Counter()
        alive = []
        for label, nbytes, shape, dtype, refs in self._entries.values():
            if not any(ref() is not None for ref in refs):
                continue
            by_label[label] += nbytes
            counts[label] += 1
            alive.append((label, shape, dtype, nbytes))
        alive.sort(key=lambda e: -e[3])
        self.report = SavedActivationReport(
            by_label=dict(by_label), tensors_by_label=dict(counts),
            parameter_tensors_skipped=self._param_saves, largest=alive[: self.keep_largest],
        )
        self._entries.clear()
        return False


def saved_activation_bytes(model: nn.Module, forward: Callable[[], torch.Tensor], **kwargs):
    """Run ``forward()`` under :class:`SavedTensorAccounting`; return ``(report, output)``."""
    with SavedTensorAccounting(model, **kwargs) as acc:
        out = forward()
    return acc.report, out


def saved_bytes_excluding(forward: Callable[[], object], exclude: Iterable[torch.Tensor]) -> int:
    """Bytes of every storage autograd saves during ``forward()``, each storage once, leaving out
    the storages of ``exclude`` (inputs and parameters that exist anyway).

    Unlike :class:`SavedTensorAccounting` this needs no model and attributes nothing: it is the
    number a kernel benchmark compares between implementations of one op.
    """
    skip = {_storage_key(t)[0] for t in exclude if t is not None}
    seen: dict = {}

    def pack(t):
        key, nbytes = _storage_key(t)
        if key is not None and key not in skip:
            seen[key] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return sum(seen.values())


# ---------------------------------------------------------------------------------------------
# Which SDPA kernel ran
# ---------------------------------------------------------------------------------------------

#: profiler op name -> kernel family
SDPA_OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "cpu_flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_attention_math_for_mps": "math",
}


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence file descriptor 2 (native code's stderr) for the duration; Python's stderr is flushed first."""
    import os
    import sys

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def sdpa_kernels_used(fn: Callable[[], object]) -> dict:
    """Run ``fn()`` under ``torch.profiler`` and report which SDPA implementation(s) ran.

    Returns ``{"kernels": sorted kernel families (keys of SDPA_OPS' values), "ops": {op name:
    calls}, "device_kernels": [GPU kernel names that look like attention]}``. The families are
    read from the dispatcher op names, which name the implementation the SDPA dispatcher chose.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    with _quiet_native_stderr():  # some profiler builds log a line to fd 2 at start and stop
        prof.__enter__()
    try:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        with _quiet_native_stderr():
            prof.__exit__(None, None, None)
    ops: Counter = Counter()
    device_kernels = set()
    for event in prof.events():
        name = event.name
        if name in SDPA_OPS or "scaled_dot_product" in name:
            ops[name] += 1
        if getattr(event, "device_type", None) is not None and str(event.device_type).endswith("CUDA"):
            low = name.lower()
            if any(s in low for s in ("flash", "fmha", "attention", "cutlass", "cudnn")):
                device_kernels.add(name)
    kernels = sorted({SDPA_OPS[n] for n in ops if n in SDPA_OPS})
    return {"kernels": kernels, "ops": dict(ops), "device_kernels": sorted(device_kernels)}


# ---------------------------------------------------------------------------------------------
# The analytic byte model
# ---------------------------------------------------------------------------------------------

ATTENTION_KERNELS = ("flash", "efficient", "cudnn", "cpu_flash", "math", "eager")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
    def from_config(cls, config) -> "ModelShape":
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
    loss: str = "standard"  # "standard" | "chunked"
    chunk_size: int = 1024
    embedding_grad: bool | None = None
    optimizer_foreach: bool = True  # AdamW's foreach path allocates one temporary the size of the trainable params

    def __post_init__(self):
        if self.method not in ("full", "lora"):
            raise ValueError(f"method must be 'full' or 'lora', got {self.method!r}")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, got {self.attention!r}")
        if self.loss not in ("standard", "chunked"):
            raise ValueError(f"loss must be 'standard' or 'chunked', got {self.loss!r}")
        for name in ("batch", "seq_len", "chunk_size", "lora_r"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        _dtype_of(self.dtype)


@dataclass
class AnalyticMemory:
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
    def fixed(self) -> int:
        """Held before the forward: weights + optimizer states."""
        return self.weights + self.optimizer_states

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

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


def _layer_terms(shape: ModelShape, st: TrainingSetup, input_grad: bool, first_rotary: bool) -> tuple[dict[str, int], bool]:
    """Tensors one decoder layer saves for backward (bytes), and whether its output requires grad.

    ``first_rotary``: no earlier layer has saved the rotary cos/sin tables (one storage shared by all layers).
    """
    B, T = st.batch, st.seq_len
    N = B * T
    s = _dtype_of(st.dtype).itemsize
    d, m, hd = shape.hidden_size, shape.intermediate_size, shape.head_dim
    h, g = shape.num_heads, shape.num_kv_heads
    qd, kvd = h * hd, g * hd
    full = st.method == "full"
    lora = set() if full else set(st.lora_targets)

    def weight_trained(name):  # the linear's input must be saved: for W's grad (full) or A's grad (LoRA)
        return full or name in lora

    terms: dict[str, int] = {}

    def lora_mid(name):  # (x A^T) is saved for B's grad
        if name in lora:
            terms[f"{name} LoRA x A^T"] = N * st.lora_r * s

    # --- attention block ---
    terms.update(_norm_terms("input_layernorm", N, d, s, input_grad, full))
    z_grad = input_grad or full
    if any(weight_trained(n) for n in ("q_proj", "k_proj", "v_proj")):
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
    if weight_trained("o_proj") and (out_copy or not saves_output):
        terms["o_proj input"] = N * qd * s
    lora_mid("o_proj")
    h1_grad = input_grad or any_grad or weight_trained("o_proj")

    # --- MLP block ---
    terms.update(_norm_terms("post_attention_layernorm", N, d, s, h1_grad, full))
    z2_grad = h1_grad or full
    if weight_trained("gate_proj") or weight_trained("up_proj"):
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
    if weight_trained("down_proj"):
        terms["down_proj input"] = N * m * s
    lora_mid("down_proj")
    out_grad = h1_grad or gate_grad or up_grad or weight_trained("down_proj")
    return terms, out_grad


def _layer_backward_transient(shape: ModelShape, st: TrainingSetup) -> int:
    """Rough size of the temporaries alive while one layer runs backward: two residual-stream
    gradients plus the larger of the MLP's (three [N, intermediate]) and attention's temporaries."""
    N = st.batch * st.seq_len
    s = _dtype_of(st.dtype).itemsize
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
    s = _dtype_of(st.dtype).itemsize
    B, T = st.batch, st.seq_len
    N = B * T
    d, V, L = shape.hidden_size, shape.vocab_size, shape.num_layers
    full = st.method == "full"
    if not full:
        shape.lora_parameter_count(st.lora_r, st.lora_targets)  # validates the targets

    n_params = shape.parameter_count()
    trainable = n_params if full else shape.lora_parameter_count(st.lora_r, st.lora_targets)
    weights = (n_params + (0 if full else trainable)) * s
    gradients = trainable * s
    states = 2 * trainable * s

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
    else:
        C = min(st.chunk_size, N)
        # one chunk's logits in the model dtype and their fp32 copy (the same buffer in fp32)
        phases["forward"] = fixed + body_held + N * 4 + C * V * (4 + (s if s != 4 else 0))
        bwd_chunk = C * V * (4 + (s if s != 4 else 0))
        grad_w = (V * d * 4 + (V * d * s if s != 4 else 0)) if full else 0
        phases["loss_backward"] = fixed + body_held + N * 4 + hidden + bwd_chunk + grad_w
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
    foreach_tmp = trainable * s if st.optimizer_foreach else 0
    phases["optimizer"] = weights + gradients + states + foreach_tmp
    return AnalyticMemory(
        weights=weights, gradients=gradients, optimizer_states=states, layer_terms=layer_terms,
        embed_saved=embed_saved, final_norm_saved=final_norm, lm_head_saved=lm_head_saved,
        loss_saved=loss_saved, body_held=body_held, phases=phases,
    )


# ---------------------------------------------------------------------------------------------
# Measured peaks on CUDA
# ---------------------------------------------------------------------------------------------


@dataclass
class PeakMemory:
    """One configuration's measured memory (bytes), read on the last step."""

    step_peaks: list[int]
    forward_peak: int
    backward_peak: int
    optimizer_peak: int
    before_forward: int
    after_body: int | None
    after_forward: int
    fixed_after_backward: FixedMemory
    accounting: SavedActivationReport | None = None

    @property
    def peak(self) -> int:
        return self.step_peaks[-1]

    @property
    def peak_phase(self) -> str:
        phases = {"forward": self.forward_peak, "backward": self.backward_peak, "optimizer": self.optimizer_peak}
        return max(phases, key=phases.get)

    @property
    def layers(self) -> int | None:
        return None if self.after_body is None else self.after_body - self.before_forward

    @property
    def head_loss(self) -> int | None:
        return None if self.after_body is None else self.peak - self.after_body

    def bars(self) -> dict[str, float]:
        return {"fixed": self.before_forward / GIB, "layers": (self.layers or 0) / GIB,
                "head_loss": (self.head_loss or 0) / GIB}


def _require_cuda(model: nn.Module) -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError(
            "peak_memory measures torch.cuda.max_memory_allocated and needs a CUDA device; none is "
            "available. On other devices use SavedTensorAccounting (saved activations) and analytic_memory."
        )
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"peak_memory needs the whole model on one CUDA device, found parameters on {sorted(map(str, devices))}")
    return next(iter(devices))


def _standard_loss(model, batch):
    return model(**batch, use_cache=False).loss


def peak_memory(
    model: nn.Module,
    batch: dict[str, torch.Tensor] | torch.Tensor,
    steps: int = 3,
    loss_fn: Callable[[nn.Module, dict], torch.Tensor] | None = None,
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    account_step: int | None = None,
) -> PeakMemory:
    """Peak CUDA memory of a training step, the original article's way.

    ``steps`` times: ``reset_peak_memory_stats``; forward (``loss_fn(model, batch)``, default
    ``model(**batch).loss`` -- the output object is dropped, only the loss is kept); backward;
    ``optimizer.step()``; ``zero_grad(set_to_none=True)``. The last step is read (AdamW creates
    its state at the first). The peak is also reset at the phase boundaries, so the last step's
    forward / backward / optimizer peaks are known separately (the step peak is their maximum).
    A forward hook on the decoder body reads ``memory_allocated`` at the end of the body.
    ``account_step`` (an index < steps) runs that step's forward under SavedTensorAccounting.
    ``batch`` is a dict of model inputs (e.g. input_ids, labels) or a tensor of token ids
    (then used as labels too). Optimizer: AdamW(lr=1e-5) over the parameters that require grad.
    """
    device = _require_cuda(model)
    if isinstance(batch, torch.Tensor):
        batch = {"input_ids": batch, "labels": batch}
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if account_step is not None and not 0 <= account_step < steps:
        raise ValueError(f"account_step must be in [0, {steps}), got {account_step}")
    bad = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.device != device]
    if bad:
        raise ValueError(f"batch tensors {bad} are not on the model's device {device}")
    loss_fn = loss_fn or _standard_loss
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("no parameter of the model requires grad: nothing to train")
    optimizer = optimizer_factory(params) if optimizer_factory else torch.optim.AdamW(params, lr=1e-5)
    body = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    marks: dict[str, int] = {}

    def mark_body(module, args, output):
        marks["after_body"] = torch.cuda.memory_allocated(device)

    handle = body.register_forward_hook(mark_body) if isinstance(body, nn.Module) and body is not model else None
    step_peaks: list[int] = []
    report = None
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()
    try:
        for step in range(steps):
            marks.pop("after_body", None)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            if step == account_step:
                with SavedTensorAccounting(model) as acc:
                    loss = loss_fn(model, batch)
                report = acc.report
            else:
                loss = loss_fn(model, batch)
            after_forward = torch.cuda.memory_allocated(device)
            forward_peak = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            loss.backward()
            backward_peak = torch.cuda.max_memory_allocated(device)
            fixed = fixed_memory_by_category(model, optimizer)
            torch.cuda.reset_peak_memory_stats(device)
            optimizer.step()
            optimizer_peak = torch.cuda.max_memory_allocated(device)
            optimizer.zero_grad(set_to_none=True)
            del loss
            torch.cuda.synchronize(device)
            step_peaks.append(max(forward_peak, backward_peak, optimizer_peak))
    finally:
        if handle is not None:
            handle.remove()
    result = PeakMemory(
        step_peaks=step_peaks, forward_peak=forward_peak, backward_peak=backward_peak,
        optimizer_peak=optimizer_peak, before_forward=before, after_body=marks.get("after_body"),
        after_forward=after_forward, fixed_after_backward=fixed, accounting=report,
    )
    del optimizer
    return result


# ---------------------------------------------------------------------------------------------
# Configurations and the sweep
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryConfig:
    """One row of the sweep."""

    dtype: str
    batch: int
    seq_len: int
    method: str  # "full" | "lora"
    checkpointing: bool = False
    loss: str = "standard"
    chunk_size: int = 1024

    @property
    def mode(self) -> str:
        parts = [self.method] + (["ckpt"] if self.checkpointing else []) + (["chunked"] if self.loss == "chunked" else [])
        return "_".join(parts)

    @property
    def name(self) -> str:
        suffix = f"_c{self.chunk_size}" if self.loss == "chunked" and self.chunk_size != 1024 else ""
        return f"{self.dtype}_b{self.batch}_l{self.seq_len}_{self.mode}{suffix}"

    def setup(self, attention: str, lora_r: int = 8, lora_targets: Sequence[str] = ("q_proj", "v_proj")) -> TrainingSetup:
        return TrainingSetup(batch=self.batch, seq_len=self.seq_len, dtype=self.dtype, method=self.method,
                             lora_r=lora_r, lora_targets=tuple(lora_targets), attention=attention,
                             checkpointing=self.checkpointing, loss=self.loss, chunk_size=self.chunk_size)


def remove_lora(model: nn.Module) -> nn.Module:
    """Unwrap every LoRALinear back to its base nn.Linear (no merge: the base weights are untouched)."""
    from .layer import lora_layers

    for name, layer in lora_layers(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer.base)
    if hasattr(model, "_lora_lab_config"):
        del model._lora_lab_config
    return model


def prepare_model(model: nn.Module, config: MemoryConfig, lora_r: int = 8, lora_alpha: float = 16,
                  lora_targets: Sequence[str] = ("q_proj", "v_proj")) -> nn.Module:
    """Put a (reused) model into ``config``'s training mode: LoRA or all weights trainable,
    gradient checkpointing (non-reentrant, transformers' default) on or off, train mode."""
    from .layer import add_lora

    remove_lora(model)
    model.zero_grad(set_to_none=True)
    if config.method == "full":
        for p in model.parameters():
            p.requires_grad_(True)
    else:
        add_lora(model, r=lora_r, alpha=lora_alpha, targets=tuple(lora_targets))
    if config.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
        if hasattr(model, "disable_input_require_grads"):
            model.disable_input_require_grads()
    model.config.use_cache = False
    return model.train()


def _loss_fn_for(config: MemoryConfig):
    if config.loss == "standard":
        return _standard_loss
    from .chunked_loss import causal_lm_loss

    def chunked(model, batch):
        return causal_lm_loss(model, batch["input_ids"], batch.get("labels"), chunked=True,
                              chunk_size=config.chunk_size)

    return chunked


def run_memory_config(model: nn.Module, config: MemoryConfig, steps: int = 3, seed: int = 0,
                      account: bool = True, **lora) -> dict:
    """Measure one configuration on a prepared-in-place model; an out-of-memory error becomes a result.

    Returns a flat dict: the config, ``oom`` (bool), ``error`` (first line of the OOM message) and,
    when it ran, the measured bytes (peak, phase peaks, before_forward, layers, head_loss, fixed by
    category) and, with ``account`` and no checkpointing, the saved-tensor accounting of step 1.
    """
    row: dict = {"name": config.name, **asdict(config), "mode": config.mode, "oom": False, "error": None}
    device = next(model.parameters()).device
    prepare_model(model, config, **lora)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (config.batch, config.seq_len), generator=gen).to(device)
    batch = {"input_ids": ids, "labels": ids}
    account_step = 1 if (account and steps > 1 and not config.checkpointing) else None
    measured = None
    try:
        measured = peak_memory(model, batch, steps=steps, loss_fn=_loss_fn_for(config), account_step=account_step)
    except torch.OutOfMemoryError as exc:
        row["oom"] = True
        row["error"] = str(exc).strip().splitlines()[0][:300]
    except RuntimeError as exc:  # cuBLAS / cuDNN report a failed workspace allocation as a RuntimeError
        text = str(exc)
        if not any(s in text for s in ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")):
            raise
        row["oom"] = True
        row["error"] = text.strip().splitlines()[0][:300]
    # outside the except block: the traceback (and the tensors its frames hold) is gone
    model.zero_grad(set_to_none=True)
    del batch, ids
    gc.collect()
    torch.cuda.empty_cache()
    if measured is not None:
        row.update({
            "peak": measured.peak, "step_peaks": measured.step_peaks, "peak_phase": measured.peak_phase,
            "forward_peak": measured.forward_peak, "backward_peak": measured.backward_peak,
            "optimizer_peak": measured.optimizer_peak, "before_forward": measured.before_forward,
            "after_body": measured.after_body, "after_forward": measured.after_forward,
            "layers": measured.layers, "head_loss": measured.head_loss,
            "weights": measured.fixed_after_backward.weights,
            "gradients": measured.fixed_after_backward.gradients,
            "optimizer_states": measured.fixed_after_backward.optimizer_states,
        })
        if measured.accounting is not None:
            row["saved_per_layer"] = measured.accounting.per_layer
            row["saved_summary"] = measured.accounting.summary()
    return row


def memory_sweep(configs: Sequence[MemoryConfig], build_model: Callable[[str], nn.Module], steps: int = 3,
                 progress: bool = True, on_row: Callable[[dict], None] | None = None, **kwargs) -> list[dict]:
    """Run ``configs`` in order, building one model per dtype (``build_model(dtype)``) and reusing it.

    Each row is :func:`run_memory_config`'s dict; ``on_row`` is called after each (e.g. to record
    it at once, so partial results survive). A tqdm progress bar shows the configuration running.
    """
    from tqdm.auto import tqdm

    rows = []
    model, model_dtype = None, None
    bar = tqdm(configs, desc="memory sweep", disable=not progress)
    for config in bar:
        bar.set_postfix_str(config.name)
        if model_dtype != config.dtype:
            model = None
            gc.collect()
            torch.cuda.empty_cache()
            model, model_dtype = build_model(config.dtype), config.dtype
        row = run_memory_config(model, config, steps=steps, **kwargs)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# Helpers for the notebook: the sweep grid, the byte model per row, summaries and plots
# ---------------------------------------------------------------------------------------------

MODES = {
    "full": ("full", False, "standard"),
    "lora": ("lora", False, "standard"),
    "lora_ckpt": ("lora", True, "standard"),
    "lora_ckpt_chunked": ("lora", True, "chunked"),
    "full_ckpt_chunked": ("full", True, "chunked"),
    "lora_chunked": ("lora", False, "chunked"),
    "full_ckpt": ("full", True, "standard"),
    "full_chunked": ("full", False, "chunked"),
}


def config_for(dtype: str, batch: int, seq_len: int, mode: str, chunk_size: int = 1024) -> MemoryConfig:
    """The MemoryConfig of a named mode (``full``, ``lora``, ``lora_ckpt``, ``lora_ckpt_chunked``, ...)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {sorted(MODES)}")
    method, ckpt, loss = MODES[mode]
    _dtype_of(dtype)
    return MemoryConfig(dtype=dtype, batch=batch, seq_len=seq_len, method=method, checkpointing=ckpt,
                        loss=loss, chunk_size=chunk_size)


def sweep_configs(dtypes: Sequence[str], batch: int, lengths: Sequence[int], modes: Sequence[str],
                  extra: Sequence[Sequence] = (), chunk_size: int = 1024,
                  extra_chunk_sizes: Sequence[int] = (), extra_chunk_point: Sequence = ("bf16", 4, 4096)) -> list[MemoryConfig]:
    """The sweep grid, grouped by dtype (one model build per dtype): every (batch, length) point,
    then ``extra`` (dtype, batch, length) points, times ``modes``; plus ``lora_ckpt_chunked`` at
    ``extra_chunk_point`` with each of ``extra_chunk_sizes``."""
    configs = []
    for dtype in dtypes:
        points = [(batch, t) for t in lengths] + [(b, t) for d, b, t in extra if d == dtype]
        for b, t in points:
            configs.extend(config_for(dtype, b, t, mode, chunk_size) for mode in modes)
        d, b, t = extra_chunk_point
        if d == dtype:
            configs.extend(config_for(d, b, t, "lora_ckpt_chunked", c) for c in extra_chunk_sizes if c != chunk_size)
    return configs


def analytic_row(config: MemoryConfig, shape: ModelShape, attention: str, lora_r: int = 8,
                 lora_targets: Sequence[str] = ("q_proj", "v_proj")) -> AnalyticMemory:
    """The byte model's prediction for one sweep row."""
    return analytic_memory(shape, config.setup(attention, lora_r=lora_r, lora_targets=lora_targets))


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured."""
    return (predicted - measured) / measured


def format_table(header: Sequence[str], rows: Sequence[Sequence], floatfmt: str = ".2f") -> str:
    """A plain-text table (no pandas needed)."""
    def cell(v):
        if isinstance(v, float):
            return "nan" if math.isnan(v) else format(v, floatfmt)
        return "-" if v is None else str(v)

    text = [[cell(v) for v in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in text)) if text else len(str(h)) for i, h in enumerate(header)]
    line = lambda items: "  ".join(str(x).rjust(w) for x, w in zip(items, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in text])


def plot_memory_bars(entries: Sequence[tuple[str, dict[str, float] | None]], title: str, ax=None,
                     capacity_gib: float | None = None):
    """Stacked bars fixed / layers / head+loss (GiB) per labelled entry; ``None`` bars read 'OOM'."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(max(6, 0.45 * len(entries)), 4))
    colors = {"fixed": "#4c72b0", "layers": "#55a868", "head_loss": "#c44e52"}
    names = {"fixed": "fixed (weights + optimizer states)", "layers": "layers (held at end of decoder)",
             "head_loss": "logits + loss + backward at the peak"}
    xs = range(len(entries))
    for part in ("fixed", "layers", "head_loss"):
        bottoms = [sum(b[p] for p in ("fixed", "layers", "head_loss")[: ("fixed", "layers", "head_loss").index(part)])
                   if b else 0 for _, b in entries]
        heights = [b[part] if b else 0 for _, b in entries]
        ax.bar(xs, heights, bottom=bottoms, color=colors[part], label=names[part])
    for x, (_, b) in zip(xs, entries):
        if b is None:
            ax.text(x, 0, "OOM", rotation=90, ha="center", va="bottom", fontsize=8, color="black")
    if capacity_gib:
        ax.axhline(capacity_gib, color="grey", ls=":", lw=1)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([n for n, _ in entries], rotation=90, fontsize=7)
    ax.set_ylabel("GiB")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return ax


def byte_model_kernel(kernels: Sequence[str]) -> str:
    """The byte model's attention kernel for what :func:`sdpa_kernels_used` saw (no SDPA call: eager)."""
    if not kernels:
        return "eager"
    # one kernel is the normal case; if several ran, the byte model takes the one that saves the most
    for kernel in ("math", "efficient", "cudnn", "flash", "cpu_flash"):
        if kernel in kernels:
            return kernel
    return "flash"  # an out-of-tree fused kernel ("overrideable"): saves what flash saves


def row_metrics(row: dict, prefix: str = "gpu_") -> dict:
    """Flat metrics of one sweep row: ``<prefix><name>_oom`` and, when it ran, peak / fixed / layers /
    head_loss / fixed_after_backward (GiB) and the peak phase."""
    key = prefix + row["name"]
    out = {f"{key}_oom": int(bool(row["oom"]))}
    if not row["oom"]:
        out.update({
            f"{key}_peak_gib": row["peak"] / GIB,
            f"{key}_fixed_gib": row["before_forward"] / GIB,
            f"{key}_layers_gib": None if row["layers"] is None else row["layers"] / GIB,
            f"{key}_head_loss_gib": None if row["head_loss"] is None else row["head_loss"] / GIB,
            f"{key}_fixed_after_backward_gib": (row["weights"] + row["gradients"] + row["optimizer_states"]) / GIB,
            f"{key}_peak_phase": row["peak_phase"],
        })
    return out

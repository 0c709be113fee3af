"""Fixed memory by category and the bytes autograd saves for backward, on any device.

* :func:`fixed_memory_by_category` -- weights, gradients and optimizer states measured from the
  tensors themselves (storages counted once, so tied weights count once).
* :class:`SavedTensorAccounting` -- the bytes of the tensors autograd saves for backward,
  deduplicated by storage, attributed to the module that saved them first (each decoder layer, the
  embedding, the final norm, the lm_head, and the loss outside any module), through
  ``torch.autograd.graph.saved_tensors_hooks``.
* :func:`saved_bytes_excluding` -- the same count for one op, without a model (kernel benchmarks).
"""
from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

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
    "dtype_of",
]

GIB = 2**30


def dtype_of(dtype) -> torch.dtype:
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

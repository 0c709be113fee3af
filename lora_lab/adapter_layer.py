"""What every adapter layer is (:class:`AdapterLinear`: a frozen ``nn.Linear`` called ``base`` plus ``merge()``),
how to find them in a model, the argument checks they share and how they are put into a model. Below the layers
(:mod:`lora_lab.layer`, :mod:`lora_lab.embedding_lora`, :mod:`lora_lab.vera`, :mod:`lora_lab.modules_to_save`) and
the target selection (:mod:`lora_lab.targets`), which must tell adapter layers from the linears they wrap."""
from __future__ import annotations

import torch
from torch import nn

from lora_lab.dtypes import as_float_dtype

__all__ = [
    "AdapterLinear",
    "adapter_layers",
    "check_flags",
    "check_rank_alpha",
    "resolve_adapter_dtype",
    "replace_module",
    "install_adapter_layers",
]


class AdapterLinear(nn.Module):
    """What the adapter layers (:class:`~lora_lab.layer.LoRALinear`, :class:`lora_lab.vera.VeRALinear`) share: a
    frozen ``nn.Linear`` called ``base`` and ``merge()`` back to one ``nn.Linear``; ``kind`` names the method."""

    kind = "adapter"
    base: nn.Linear

    def merge(self, compute_dtype: torch.dtype = torch.float32) -> nn.Linear:  # pragma: no cover - abstract
        raise NotImplementedError


def adapter_layers(model: nn.Module) -> list[tuple[str, AdapterLinear]]:
    """All adapter layers of a model (LoRA, its variants and VeRA), with their module names."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, AdapterLinear)]


def check_flags(**flags) -> None:
    """Each keyword argument must be a bool (a variant switch); the error names the first that is not."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {name}={value!r}")

def check_rank_alpha(r, alpha) -> None:
    """r must be a positive int and alpha a positive number."""
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(f"LoRA rank r must be a positive integer, got r={r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"LoRA alpha must be a positive number, got alpha={alpha!r}")


WIDENED_DTYPES = (torch.bfloat16, torch.float16)  # base dtypes whose adapters default to fp32


def resolve_adapter_dtype(weight_dtype: torch.dtype, adapter_dtype: torch.dtype | str | None) -> torch.dtype:
    """The dtype of a new adapter's trainable tensors: ``adapter_dtype`` when given (a float dtype or its name),
    else fp32 for a bf16/fp16 base weight (PEFT's ``autocast_adapter_dtype=True``) and the weight's dtype
    otherwise."""
    if adapter_dtype is not None:
        return as_float_dtype(adapter_dtype, "adapter_dtype")
    return torch.float32 if weight_dtype in WIDENED_DTYPES else weight_dtype


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where the submodule called ``name`` (dotted path) is."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def install_adapter_layers(model: nn.Module, wrapped: list[tuple[str, AdapterLinear]]) -> None:
    """Freeze every parameter of ``model`` except those of its adapter layers (not their bases), then put the
    ``wrapped`` layers in place, each in the train/eval mode of the module it replaces."""
    keep = {id(p) for _, layer in adapter_layers(model) for p in layer.parameters()}
    keep -= {id(p) for _, layer in adapter_layers(model) for p in layer.base.parameters()}
    for p in model.parameters():
        if id(p) not in keep:
            p.requires_grad_(False)
    for name, layer in wrapped:
        layer.train(layer.base.training)  # a new layer takes the mode of the module it replaces (dropout off in eval)
        replace_module(model, name, layer)

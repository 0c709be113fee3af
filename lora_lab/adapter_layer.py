"""What every adapter layer is (:class:`AdapterLinear`: a frozen ``nn.Linear`` called ``base`` plus ``merge()``) and
how to find them in a model. Below both the layers (:mod:`lora_lab.layer`, :mod:`lora_lab.vera`) and the target
selection (:mod:`lora_lab.targets`), which must tell adapter layers from the linears they wrap."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["AdapterLinear", "adapter_layers"]


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

"""The LoRA factors of a model by their adapter-file keys: lora_lab's ``<module>.lora_A`` and PEFT's
``base_model.model.<module>.lora_A.<adapter>.weight`` both map to PEFT's file key
``base_model.model.<module>.lora_A.weight``.

Imports nothing else of :mod:`lora_lab.distributed`, so sharding and the sharded adapter files can both use it.
"""
from __future__ import annotations

import re

from torch import nn

from lora_lab.adapters.errors import AdapterError
from lora_lab.adapters.peft_files import PREFIX

__all__ = ["adapter_key", "lora_parameters"]

_LORA_LAB_PARAM = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])$")
_PEFT_PARAM = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.(?P<adapter>[^.]+)\.weight$")


def adapter_key(param_name: str) -> str | None:
    """The key a LoRA factor has in ``adapter_model.safetensors``, or None for a parameter that is no LoRA factor.

    lora_lab's ``<module>.lora_A`` -> ``base_model.model.<module>.lora_A.weight``; PEFT's
    ``base_model.model.<module>.lora_A.<adapter>.weight`` -> ``base_model.model.<module>.lora_A.weight``.
    """
    m = _PEFT_PARAM.match(param_name)
    if m and param_name.startswith(PREFIX):
        return f"{m['module']}.lora_{m['which']}.weight"
    m = _LORA_LAB_PARAM.match(param_name)
    if m:
        return f"{PREFIX}{m['module']}.lora_{m['which']}.weight"
    return None


def lora_parameters(model: nn.Module) -> dict[str, tuple[str, nn.Parameter]]:
    """``{adapter key: (parameter name, parameter)}`` of every LoRA factor, in ``named_parameters`` order."""
    found = {}
    for name, p in model.named_parameters():
        key = adapter_key(name)
        if key is not None:
            if key in found:
                raise AdapterError(f"{name} and {found[key][0]} map to the same adapter key {key} (several PEFT "
                                   "adapters in one model are not supported here)")
            found[key] = (name, p)
    if not found:
        raise AdapterError(f"{type(model).__name__} carries no LoRA factor: nothing to save or load")
    return found

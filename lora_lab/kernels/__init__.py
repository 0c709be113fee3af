"""Fused Triton kernels for LoRA training, one kernel per file, each with its autograd Function and a
plain-torch reference.

* :mod:`.lora_linear`        — one LoRA linear, forward + backward, rank-r term folded into the GEMMs
* :mod:`.lora_shared_input`  — several LoRA projections of the same input (q/k/v, gate/up, GatedDeltaNet)
* :mod:`.chained_lora_linear` — the chained-cuBLAS baseline the benchmarks compare against
* :mod:`.patching`           — ``patch_model`` / ``unpatch_model`` for PEFT and lora_lab LoRA layers
  (also patches MoE experts through :mod:`.moe_patch` when that module is present)

Names are imported lazily so that ``import lora_lab.kernels`` does not import Triton until a kernel is used.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "fused_lora_linear": "lora_linear",
    "FusedLoRALinearFunction": "lora_linear",
    "lora_linear_reference": "lora_linear",
    "lora_linear_unfused": "lora_linear",
    "dropout_keep_mask": "lora_linear",
    "fused_shared_input_lora": "lora_shared_input",
    "SharedInputLoRAFunction": "lora_shared_input",
    "shared_input_lora_reference": "lora_shared_input",
    "chained_lora_linear": "chained_lora_linear",
    "ChainedLoRALinearFunction": "chained_lora_linear",
    "patch_model": "patching",
    "unpatch_model": "patching",
    "patched_layers": "patching",
    "UnsupportedLoRAError": "patching",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lora_lab.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__

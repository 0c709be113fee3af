"""The mark :func:`~lora_lab.kernels.patch_model` leaves on every layer it puts on the fused kernels: an attribute
that holds the layer's patch state. :mod:`lora_lab.kernels.patching` sets, reads and removes it; the Liger-Kernel
composition report (:mod:`lora_lab.kernels.liger`) reads it to tell fused LoRA layers from unfused ones."""
from __future__ import annotations

__all__ = ["FUSED_STATE_ATTR"]

FUSED_STATE_ATTR = "_lora_lab_fused"

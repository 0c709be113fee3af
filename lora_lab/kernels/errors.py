"""The error of a LoRA configuration the fused kernels refuse: raised by :func:`~lora_lab.kernels.patch_model` and by
the Liger-Kernel composition checks (:mod:`lora_lab.kernels.liger`)."""
from __future__ import annotations

__all__ = ["UnsupportedLoRAError"]


class UnsupportedLoRAError(ValueError):
    """The model carries a LoRA configuration the fused kernels do not implement."""

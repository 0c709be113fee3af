"""LoRA variants that are not a different layer: LoRA+'s learning rates.

The layer variants live on :class:`lora_lab.LoRALinear` and are chosen with ``add_lora`` keyword arguments:
rsLoRA (``use_rslora``: s = alpha / sqrt(r)), DoRA (``use_dora``: W' = m (W + s B A) / ||W + s B A||) and
LoRA-FA's frozen A (``lora_fa``).

LoRA+ (Hayou et al. 2024) trains B with a learning rate ``ratio`` times A's (the paper suggests 16), because
with B starting at zero the two factors want very different step sizes. :func:`loraplus_param_groups` builds the
optimizer groups as PEFT's ``create_loraplus_optimizer`` does:

    A and other trainable matrices:          lr,          weight_decay
    lora_B and 1-D parameters (DoRA's m):    lr * ratio,  weight_decay
    the same, but biases and LayerNorm:      lr * ratio,  0
"""
from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["loraplus_param_groups", "loraplus_optimizer"]


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"LoRA+ {name} must be a positive number, got {name}={value!r}")
    return float(value)


def loraplus_param_groups(model: nn.Module, lr: float, ratio: float = 16.0, weight_decay: float = 0.0) -> list[dict]:
    """The trainable parameters of ``model`` in LoRA+'s groups: ``lr`` for A, ``lr * ratio`` for B.

    A parameter goes with B when its name contains ``lora_B`` or it is 1-D (DoRA's magnitude, a bias), as in
    PEFT; of those, biases and LayerNorm parameters get no weight decay. Frozen parameters are left out (a
    LoRA-FA model has no A group). Empty groups are dropped. Raises when nothing trainable is a B.
    """
    lr, ratio = _positive("lr", lr), _positive("ratio", ratio)
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or weight_decay < 0:
        raise ValueError(f"LoRA+ weight_decay must be a number >= 0, got weight_decay={weight_decay!r}")
    in_layernorm = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
    a, b, b_no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if "lora_B" in name or p.ndim == 1:
            (b_no_decay if "bias" in name or id(p) in in_layernorm else b).append(p)
        else:
            a.append(p)
    if not b and not b_no_decay:
        raise ValueError(f"{type(model).__name__} has no trainable LoRA B parameter: LoRA+ has nothing to speed up")
    groups = [
        {"params": a, "lr": lr, "weight_decay": weight_decay},
        {"params": b, "lr": lr * ratio, "weight_decay": weight_decay},
        {"params": b_no_decay, "lr": lr * ratio, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def loraplus_optimizer(model: nn.Module, lr: float, ratio: float = 16.0, weight_decay: float = 0.0,
                       **adamw_kwargs) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over :func:`loraplus_param_groups` (lr_B = ratio * lr_A); other keyword arguments
    (betas, eps, ...) go to AdamW."""
    return torch.optim.AdamW(loraplus_param_groups(model, lr, ratio, weight_decay), lr=lr, **adamw_kwargs)

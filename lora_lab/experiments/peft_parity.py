"""Does lora_lab's LoRALinear compute what PEFT computes, bit for bit?

The protocol (from the original write-up): fp32 weights, TF32 off, eager attention. Our A and B
are copied into a PEFT ``LoraConfig(r, lora_alpha, lora_dropout=0, target_modules)`` model built
on an identical base. With B = 0 both models equal the base and nothing is tested, so B is first
filled from N(0, 0.02) with a fixed seed and the logits are compared; then B = 0 again and both
models train with AdamW for the same steps on the same batch, and every loss and the final A, B
are compared.

In bf16 the answer depends on PEFT's ``autocast_adapter_dtype``: by default PEFT keeps the
adapter in fp32 and computes the LoRA branch in fp32 (``result + lora_B(lora_A(x.float())) *
scaling`` is formed in fp32 and rounded once), while our bf16 layer rounds the branch's
intermediate, its output and the sum to bf16; notebook 02 writes that default out in a cell.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lora_lab.adapters import peft_lora_pairs
from lora_lab.layer import lora_layers
from lora_lab.numerics import max_abs_diff
from lora_lab.training import train_steps

__all__ = ["zero_lora_B", "adapter_max_abs_diff", "twin_training"]


@torch.no_grad()
def zero_lora_B(model: nn.Module) -> None:
    """B <- 0 in every LoRA layer of a lora_lab model."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} carries no LoRA layer")
    for _, layer in layers:
        layer.lora_B.zero_()


@torch.no_grad()
def adapter_max_abs_diff(ours: nn.Module, peft_model) -> dict[str, float]:
    """Largest |diff| over all A and over all B between our model and the PEFT model."""
    mine = dict(lora_layers(ours))
    theirs = peft_lora_pairs(peft_model)
    if set(mine) != set(theirs):
        raise ValueError("LoRA targets differ between the models")
    da = max(max_abs_diff(layer.lora_A, theirs[n][0]) for n, layer in mine.items())
    db = max(max_abs_diff(layer.lora_B, theirs[n][1]) for n, layer in mine.items())
    return {"A": da, "B": db}


def twin_training(
    ours: nn.Module, peft_model, batch: Mapping[str, torch.Tensor], steps: int = 30, lr: float = 1e-3
) -> dict:
    """Train both models the same way on the same batch; compare every loss and the final A, B."""
    losses_ours = train_steps(ours, batch, steps, lr)
    losses_peft = train_steps(peft_model, batch, steps, lr)
    final = adapter_max_abs_diff(ours, peft_model)
    return {
        "losses_ours": losses_ours,
        "losses_peft": losses_peft,
        "losses_max_abs_diff": max(abs(a - b) for a, b in zip(losses_ours, losses_peft)),
        "losses_identical": losses_ours == losses_peft,
        "final_A_max_abs_diff": final["A"],
        "final_B_max_abs_diff": final["B"],
    }

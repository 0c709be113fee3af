"""The smallest training loop the notebooks need: full-batch AdamW steps on one batch.

Memorising one batch is the protocol of the original comparisons (parity with PEFT, merge drift): the
same steps on the same data make two implementations comparable step by step, and training until the
loss is tiny makes the adapter matter (``stop_below``).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["train_steps"]


def train_steps(model: nn.Module, batch: Mapping[str, torch.Tensor], steps: int = 30, lr: float = 1e-3,
                stop_below: float | None = None) -> list[float]:
    """AdamW (torch defaults besides ``lr``) on the model's trainable parameters, up to ``steps`` full-batch steps
    on ``batch`` (``input_ids``, ``labels``, optional ``attention_mask``); returns the loss before each step.

    With ``stop_below``, stops after the first step whose loss was below it. The model is left in eval mode.
    """
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameter (add LoRA first)")
    if "labels" not in batch:
        raise ValueError("the batch needs 'labels' for the loss")
    optimizer = torch.optim.AdamW(params, lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), labels=batch["labels"])
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
        if stop_below is not None and losses[-1] < stop_below:
            break
    model.eval()
    return losses

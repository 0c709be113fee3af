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
intermediate, its output and the sum to bf16. ``RoundedLoRAProjection``'s ``bf16_fp32_lora`` recipe
is that default written out, which lets a notebook show that it explains the whole difference.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from lora_lab.layer import lora_layers
from lora_lab.numerics import max_abs_diff

__all__ = [
    "PARITY_SENTENCES",
    "text_batch",
    "fill_lora_B_normal",
    "zero_lora_B",
    "peft_lora_model",
    "peft_lora_pairs",
    "copy_adapters_to_peft",
    "adapter_max_abs_diff",
    "train_lora_steps",
    "twin_training",
]

# Two English and two Korean sentences, as in the original comparison.
PARITY_SENTENCES: tuple[str, ...] = (
    "The cat sat on the warm windowsill and watched the rain.",
    "Low-rank adapters train a small update next to frozen weights.",
    "오늘 아침에 공원에서 오래 산책을 했다.",
    "작은 모델도 충분히 많은 것을 배울 수 있다.",
)


def text_batch(tokenizer, texts: Sequence[str] = PARITY_SENTENCES, device="cpu") -> dict[str, torch.Tensor]:
    """Right-padded batch with ``labels`` (padding -> -100) for a causal-LM loss."""
    enc = tokenizer(list(texts), padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


@torch.no_grad()
def fill_lora_B_normal(model: nn.Module, std: float = 0.02, seed: int = 1) -> None:
    """B <- N(0, std^2) for every LoRA layer, in module order, from a private generator seeded ``seed``.

    Drawn in fp32 on the CPU and then cast, so the values do not depend on device or dtype.
    """
    layers = lora_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} carries no LoRA layer")
    g = torch.Generator().manual_seed(seed)
    for _, layer in layers:
        values = torch.randn(layer.lora_B.shape, generator=g, dtype=torch.float32) * std
        layer.lora_B.copy_(values.to(layer.lora_B.dtype))


@torch.no_grad()
def zero_lora_B(model: nn.Module) -> None:
    """B <- 0 in every LoRA layer of a lora_lab model."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} carries no LoRA layer")
    for _, layer in layers:
        layer.lora_B.zero_()


def peft_lora_model(
    base: nn.Module,
    r: int = 8,
    alpha: float = 16,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    dropout: float = 0.0,
    autocast_adapter_dtype: bool = True,
):
    """``peft.get_peft_model`` with ``LoraConfig(r, lora_alpha=alpha, lora_dropout, target_modules)``.

    Modifies ``base`` in place (PEFT's behaviour): pass a model of its own.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets))
    return get_peft_model(base, config, autocast_adapter_dtype=autocast_adapter_dtype)


def peft_lora_pairs(peft_model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module name as in the plain model: (lora_A weight, lora_B weight)} of a PEFT LoRA model."""
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    pairs = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer):
            adapter = module.active_adapters[0]
            short = name[len(prefix):] if name.startswith(prefix) else name
            pairs[short] = (module.lora_A[adapter].weight, module.lora_B[adapter].weight)
    if not pairs:
        raise ValueError(f"{type(peft_model).__name__} has no PEFT LoRA layer")
    return pairs


@torch.no_grad()
def copy_adapters_to_peft(ours: nn.Module, peft_model) -> int:
    """Copy every A and B of ``ours`` into the PEFT model (cast to PEFT's adapter dtype). Returns the
    number of layers copied. Raises if the two models carry LoRA at different modules, ranks or shapes."""
    mine = dict(lora_layers(ours))
    theirs = peft_lora_pairs(peft_model)
    if set(mine) != set(theirs):
        only = sorted(set(mine) ^ set(theirs))
        raise ValueError(f"LoRA targets differ between the models, e.g. {only[0]}")
    for name, layer in mine.items():
        A, B = theirs[name]
        if A.shape != layer.lora_A.shape or B.shape != layer.lora_B.shape:
            raise ValueError(
                f"{name}: our A {tuple(layer.lora_A.shape)}, B {tuple(layer.lora_B.shape)} vs PEFT's "
                f"A {tuple(A.shape)}, B {tuple(B.shape)} (different r or projection size)"
            )
        A.copy_(layer.lora_A.to(A.dtype))
        B.copy_(layer.lora_B.to(B.dtype))
    return len(mine)


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


def train_lora_steps(
    model: nn.Module, batch: Mapping[str, torch.Tensor], steps: int = 30, lr: float = 1e-3
) -> list[float]:
    """AdamW (torch defaults besides ``lr``) on the model's trainable parameters, ``steps`` full-batch
    steps on the same batch; returns the loss before each step. The model is left in eval mode."""
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
    model.eval()
    return losses


def twin_training(
    ours: nn.Module, peft_model, batch: Mapping[str, torch.Tensor], steps: int = 30, lr: float = 1e-3
) -> dict:
    """Train both models the same way on the same batch; compare every loss and the final A, B."""
    losses_ours = train_lora_steps(ours, batch, steps, lr)
    losses_peft = train_lora_steps(peft_model, batch, steps, lr)
    final = adapter_max_abs_diff(ours, peft_model)
    return {
        "losses_ours": losses_ours,
        "losses_peft": losses_peft,
        "losses_max_abs_diff": max(abs(a - b) for a, b in zip(losses_ours, losses_peft)),
        "losses_identical": losses_ours == losses_peft,
        "final_A_max_abs_diff": final["A"],
        "final_B_max_abs_diff": final["B"],
    }

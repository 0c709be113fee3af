"""The same adapters in a PEFT model in memory: build one (``peft_lora_model``), read its factors
(``peft_lora_pairs``) and copy lora_lab's factors into it (``copy_adapters_to_peft``), for parity checks and PEFT's
merge."""
from __future__ import annotations

import torch
from torch import nn

from lora_lab.adapters.peft_files import PREFIX
from lora_lab.layer import lora_layers

__all__ = ["peft_lora_model", "peft_lora_pairs", "copy_adapters_to_peft"]


def peft_lora_model(base: nn.Module, r: int = 8, alpha: float = 16, targets=("q_proj", "v_proj"),
                    dropout: float = 0.0, autocast_adapter_dtype: bool = True):
    """``peft.get_peft_model`` with ``LoraConfig(r, lora_alpha=alpha, lora_dropout, target_modules)``.

    Modifies ``base`` in place (PEFT's behaviour): pass a model of its own.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets))
    return get_peft_model(base, config, autocast_adapter_dtype=autocast_adapter_dtype)


def peft_lora_pairs(peft_model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module name as in the plain model: (lora_A weight, lora_B weight)} of a PEFT LoRA model."""
    from peft.tuners.lora import LoraLayer

    pairs = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer):
            adapter = module.active_adapters[0]
            short = name[len(PREFIX):] if name.startswith(PREFIX) else name
            pairs[short] = (module.lora_A[adapter].weight, module.lora_B[adapter].weight)
    if not pairs:
        raise ValueError(f"{type(peft_model).__name__} has no PEFT LoRA layer")
    return pairs


@torch.no_grad()
def copy_adapters_to_peft(ours: nn.Module, peft_model) -> int:
    """Copy every A and B (and DoRA magnitude) of ``ours`` into the PEFT model (cast to PEFT's adapter dtype).
    Returns the number of layers copied. Raises if the two models carry LoRA at different modules, ranks or
    shapes, with different scales (rsLoRA or not) or with DoRA on one side only."""
    from peft.tuners.lora import LoraLayer

    mine = dict(lora_layers(ours))
    theirs = peft_lora_pairs(peft_model)
    if set(mine) != set(theirs):
        only = sorted(set(mine) ^ set(theirs))
        raise ValueError(f"LoRA targets differ between the models, e.g. {only[0]}")
    modules = {n[len(PREFIX):] if n.startswith(PREFIX) else n: m for n, m in peft_model.named_modules()
               if isinstance(m, LoraLayer)}
    for name, layer in mine.items():
        A, B = theirs[name]
        if A.shape != layer.lora_A.shape or B.shape != layer.lora_B.shape:
            raise ValueError(
                f"{name}: our A {tuple(layer.lora_A.shape)}, B {tuple(layer.lora_B.shape)} vs PEFT's "
                f"A {tuple(A.shape)}, B {tuple(B.shape)} (different r or projection size)"
            )
        module = modules[name]
        adapter = module.active_adapters[0]
        if module.scaling[adapter] != layer.scaling:
            raise ValueError(f"{name}: our scale {layer.scaling} vs PEFT's {module.scaling[adapter]} "
                             "(different alpha, or use_rslora on one side only)")
        peft_dora = adapter in getattr(module, "lora_magnitude_vector", {})
        if peft_dora != (layer.magnitude is not None):
            raise ValueError(f"{name}: use_dora={layer.magnitude is not None} here but {peft_dora} in the PEFT model")
    for name, layer in mine.items():
        A, B = theirs[name]
        A.copy_(layer.lora_A.to(A.dtype))
        B.copy_(layer.lora_B.to(B.dtype))
        if layer.magnitude is not None:
            module = modules[name]
            m = module.lora_magnitude_vector[module.active_adapters[0]].weight
            m.copy_(layer.magnitude.to(m.dtype))
    return len(mine)

"""The full tensors a PEFT LoRA adapter file may hold beside the LoRA factors.

* Base weights. PEFT's default save (``save_embedding_layers="auto"``) of an adapter whose ``target_modules`` name
  ``embed_tokens`` or ``lm_head`` writes the base weight of the model's input and output embedding layers when they
  carry LoRA, as ``base_model.model.<name>.base_layer.weight``; with ``save_embedding_layers=True`` and untargeted
  embeddings it writes them as ``base_model.model.<name>.weight``. PEFT's reload copies such tensors into the model
  (``load_state_dict``): load_adapter does the same, leaves the model alone where they equal its weights, and warns,
  naming them, where they differ.
* ``modules_to_save``: the trained copy of each such module, under the module's own keys
  (``base_model.model.lm_head.weight``), as PEFT 0.21 writes them.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lora_lab.adapters.errors import AdapterError
from lora_lab.adapters.peft_files import PREFIX
from lora_lab.embedding_lora import LoRAEmbedding
from lora_lab.layer import LoRALinear, adapter_layers
from lora_lab.modules_to_save import (
    TrainedCopy,
    install_modules_to_save,
    peft_entries,
    plan_modules_to_save,
    select_modules_to_save,
    trained_copies,
)

__all__: list[str] = []

EMBEDDING_LAYER_NAMES = ("embed_tokens", "lm_head")  # the names PEFT's save_embedding_layers="auto" looks for


@dataclass
class FullTensors:
    """What ``split_full_tensors`` took out of an adapter file, checked, to be put into the model after the LoRA
    layers are in place (PEFT's order)."""

    base: list[tuple[str, str, str, torch.Tensor]] = field(default_factory=list)  # key, LoRA target, name in base
    plain: list[tuple[str, str, torch.Tensor]] = field(default_factory=list)  # key, parameter name in the model
    copies: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # module name: its state dict
    plan: list = field(default_factory=list)  # modules still to wrap in a TrainedCopy

    def apply(self, model: nn.Module, lora: dict[str, nn.Module]) -> None:
        """Copy the base weights into the model (where they differ, with a warning) and fill the trained copies."""
        replaced = []
        for key, target, pname, t in self.base:
            replaced += _put(lora[target].base.get_parameter(pname), t, key)
        for key, pname, t in self.plain:
            replaced += _put(model.get_parameter(pname), t, key)
        if replaced:
            warnings.warn(
                f"load_adapter: the adapter holds base weights that differ from the model's ({', '.join(replaced)}); "
                "they were loaded into the model, as PEFT's reload does (a weight tied to another changes it too)",
                stacklevel=3,
            )
        if self.plan:
            install_modules_to_save(model, self.plan)
        for name, state in self.copies.items():
            model.get_submodule(name).trained.load_state_dict(state)


def _put(param: torch.Tensor, t: torch.Tensor, key: str) -> list[str]:
    t = t.to(device=param.device, dtype=param.dtype)
    if torch.equal(param, t):
        return []
    param.copy_(t)
    return [key]


def split_full_tensors(model: nn.Module, cfg: dict, tensors: dict[str, torch.Tensor], planned: dict,
                       existing: dict[str, nn.Module], source: Path) -> tuple[dict[str, torch.Tensor], FullTensors]:
    """(the LoRA tensors, the full tensors checked): base weights of LoRA targets (``...base_layer.<param>``), whole
    parameters of the model outside its LoRA targets (PEFT's ``save_embedding_layers``), the modules_to_save
    copies of ``cfg["modules_to_save"]``. Every full tensor's shape is checked here, before the model changes."""
    full = FullTensors()
    copies = trained_copies(model)
    entries = cfg.get("modules_to_save") or []
    modules: dict[str, nn.Module] = {}
    if entries:
        found = select_modules_to_save(model, entries)
        if copies or any(isinstance(m, TrainedCopy) for _, _, m in found):
            if {n for n, _, _ in found} != {n for n, _ in copies}:
                raise AdapterError(f"the model's modules_to_save ({', '.join(n for n, _ in copies) or 'none'}) are "
                                   f"not those the adapter's modules_to_save={entries!r} select")
            modules = {n: m.trained for n, _, m in found}
        else:
            full.plan = plan_modules_to_save(model, entries, list(planned), error=AdapterError, strict=False)
            modules = {n: m for n, _, m in full.plan}
    elif copies:
        raise AdapterError(f"{copies[0][0]} is in the model's modules_to_save, but the adapter has none")
    wanted = {n: dict(m.state_dict()) for n, m in modules.items()}
    inside = {n for n, _ in adapter_layers(model)} | set(planned)
    plain = {n: p for n, p in model.named_parameters(remove_duplicate=False)
             if not any(n.startswith(t + ".") for t in inside)}
    rest = {}
    for key, t in tensors.items():
        k = key[len(PREFIX):] if key.startswith(PREFIX) else key
        owner = next((n for n in wanted if k.startswith(n + ".") and k[len(n) + 1:] in wanted[n]), None)
        based = re.fullmatch(r"(.+)\.base_layer\.([^.]+)", k)
        if owner is not None:
            like = wanted[owner][k[len(owner) + 1:]]
            full.copies.setdefault(owner, {})[k[len(owner) + 1:]] = _checked(key, t, like, source)
        elif based and based[1] in planned:
            target, pname = based[1], based[2]
            base = existing[target].base if target in existing else model.get_submodule(target)
            like = dict(base.named_parameters()).get(pname)
            if like is None:
                raise AdapterError(f"{source}: tensor {key!r}: the base layer of {target} has no parameter {pname!r}")
            full.base.append((key, target, pname, _checked(key, t, like, source)))
        elif k in plain:
            full.plain.append((key, k, _checked(key, t, plain[k], source)))
        else:
            rest[key] = t
    for name, state in wanted.items():
        missing = [k for k in state if k not in full.copies.get(name, {})]
        if missing:
            raise AdapterError(f"adapter has no {PREFIX}{name}.{missing[0]} for modules_to_save module {name}")
    return rest, full


def _checked(key: str, t: torch.Tensor, like: torch.Tensor, source: Path) -> torch.Tensor:
    if tuple(t.shape) != tuple(like.shape):
        raise AdapterError(f"{key}: adapter has shape {tuple(t.shape)}, the model's tensor is {tuple(like.shape)}"
                           + (" (a resized vocabulary? resize the model's embeddings first)"
                              if any(e in key for e in EMBEDDING_LAYER_NAMES) else ""))
    if t.is_floating_point() != like.is_floating_point():
        raise AdapterError(f"{source}: {key} holds {t.dtype} values, the model's tensor is {like.dtype}")
    return t


def _embedding_targeted(model: nn.Module, targets) -> bool:
    """PEFT's test for ``save_embedding_layers="auto"``: a target list that names embed_tokens or lm_head, or a
    regex that matches a module so named."""
    if isinstance(targets, str):
        return any(re.fullmatch(targets, n) and any(re.match(rf"(.*\.)?{e}$", n) for e in EMBEDDING_LAYER_NAMES)
                   for n, _ in model.named_modules())
    return any(e in targets for e in EMBEDDING_LAYER_NAMES)


def full_tensors_to_save(model: nn.Module, targets, save_embedding_layers: bool | str) -> dict[str, torch.Tensor]:
    """The full tensors PEFT's ``save_pretrained(save_embedding_layers=...)`` writes beside the LoRA factors: the
    trained copies of modules_to_save and, where PEFT would, the base weights of LoRA-carrying embedding layers."""
    if save_embedding_layers not in (True, False, "auto"):
        raise ValueError(f"save_embedding_layers must be True, False or 'auto', got {save_embedding_layers!r}")
    out = {}
    for name, c in trained_copies(model):
        for k, v in c.trained.state_dict().items():
            out[f"{PREFIX}{name}.{k}"] = v.detach().contiguous().cpu().clone()
    targeted = _embedding_targeted(model, targets)
    if save_embedding_layers == "auto":
        save_embedding_layers = targeted
    if save_embedding_layers and hasattr(model, "get_input_embeddings"):
        names = {id(m): n for n, m in model.named_modules()}
        for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
            if isinstance(layer, (LoRALinear, LoRAEmbedding)):  # PEFT: the base layer of a LoRA-carrying embedding
                state = {f"{names[id(layer)]}.base_layer.{k}": v for k, v in layer.base.state_dict().items()}
            elif not targeted and layer is not None and not isinstance(layer, TrainedCopy) and id(layer) in names:
                state = {f"{names[id(layer)]}.{k}": v for k, v in layer.state_dict().items()}  # the whole layer
            else:
                continue
            out.update({PREFIX + k: v.detach().contiguous().cpu().clone() for k, v in state.items()})
    return out


def modules_to_save_entries(model: nn.Module) -> list[str] | None:
    """The ``modules_to_save`` field to write: None without trained copies."""
    if not trained_copies(model):
        return None
    try:
        return peft_entries(model)
    except ValueError as exc:
        raise AdapterError(str(exc)) from None

"""LoRA adapters of a sharded model, in PEFT's format.

Saving gathers the full tensor of each LoRA factor only (``DTensor.full_tensor``: an all-gather per factor, on
every rank in the same order; the frozen base is never gathered) and rank 0 writes the files — the same files
:func:`lora_lab.save_adapter` (lora_lab's layers) or ``PeftModel.save_pretrained`` (PEFT's) writes on one
process. Loading reads the files on every rank and copies each rank's rows of every factor into its shard.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lora_lab.adapters.errors import AdapterError, AdapterExistsError
from lora_lab.adapters.peft_config import _read_config
from lora_lab.adapters.peft_files import CONFIG_NAME, LEGACY_WEIGHTS_NAME, WEIGHTS_NAME, _read_tensors
from lora_lab.adapters.saving import _save_adapter
from lora_lab.distributed.lora_factors import adapter_key, lora_parameters
from lora_lab.distributed.process_group import rank_and_world
from lora_lab.layer import lora_layers

__all__ = ["lora_parameters", "adapter_key", "gather_lora_state", "save_sharded_adapter", "load_sharded_adapter"]

def _full(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    t = p.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).contiguous().cpu()


def gather_lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{parameter name: full CPU tensor}`` of the LoRA factors. A collective on a sharded model: every rank calls
    it, and every rank gets the full tensors."""
    return {name: _full(p) for name, p in lora_parameters(model).values()}


def _agree(error: BaseException | None) -> None:
    """Raise on every rank if rank 0 failed (the others would otherwise go on alone)."""
    rank, world = rank_and_world()
    if world == 1:
        if error is not None:
            raise error
        return
    message = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(message, src=0)
    if error is not None:
        raise error
    if message[0] is not None:
        raise AdapterError(f"rank 0 could not save the adapter: {message[0]}")


def save_sharded_adapter(model: nn.Module, path: str | Path, overwrite: bool = False) -> Path | None:
    """Save the LoRA adapter of a (sharded) model in PEFT's format; rank 0 writes. Every rank must call it.

    lora_lab's layers are written by :func:`lora_lab.save_adapter`'s code (its config fields, its refusal of a
    directory that holds an adapter unless ``overwrite``); a ``peft.PeftModel`` by ``save_pretrained`` with the
    gathered LoRA tensors as its state dict. Returns the directory (on every rank).
    """
    from lora_lab.embedding_lora import embedding_lora_layers
    from lora_lab.modules_to_save import trained_copies

    unsharded = embedding_lora_layers(model) + trained_copies(model)
    if unsharded:
        raise AdapterError(f"saving a sharded adapter with LoRA on embeddings or modules_to_save is not supported "
                           f"({unsharded[0][0]} is a {type(unsharded[0][1]).__name__}); save it from an unsharded "
                           "model with lora_lab.save_adapter")
    dora = [name for name, layer in lora_layers(model) if layer.magnitude is not None]
    if dora:
        raise AdapterError(f"saving a sharded DoRA adapter is not supported: the magnitude vectors ({dora[0]}, ...) "
                           "are not gathered; save it from an unsharded model with lora_lab.save_adapter")
    gathered = gather_lora_state(model)
    rank, _ = rank_and_world()
    error = None
    out = Path(path)
    if rank == 0:
        try:
            if lora_layers(model):
                by_id = {id(p): gathered[name] for name, p in lora_parameters(model).values()}
                _save_adapter(model, out, overwrite, lambda p: by_id[id(p)])
            else:
                present = [f for f in (CONFIG_NAME, WEIGHTS_NAME, LEGACY_WEIGHTS_NAME) if (out / f).exists()]
                if present and not overwrite:
                    raise AdapterExistsError(f"{out} already holds an adapter ({', '.join(present)}); pass "
                                             "overwrite=True to replace it, or choose another directory")
                model.save_pretrained(str(out), state_dict=gathered)
        except Exception as exc:  # noqa: BLE001 - reported on every rank by _agree
            error = exc
    _agree(error)
    return out


@torch.no_grad()
def load_sharded_adapter(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a PEFT-format adapter into a (sharded) model that already carries LoRA at exactly its modules.

    Every rank reads the files and copies its rows of each factor into its shard: the model then holds the saved
    values exactly. r and alpha must match lora_lab's layers; the keys and shapes must match the model's factors.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    path = Path(path)
    cfg = _read_config(path)
    layers = lora_layers(model)
    for name, layer in layers:
        if (layer.r, layer.alpha) != (cfg["r"], cfg["lora_alpha"]):
            raise AdapterError(f"{name} has r={layer.r}, alpha={layer.alpha} but the adapter has r={cfg['r']}, "
                               f"lora_alpha={cfg['lora_alpha']}")
    tensors = {k.replace(".default.weight", ".weight"): v for k, v in _read_tensors(path).items()}
    params = lora_parameters(model)
    if set(tensors) != set(params):
        extra, missing = sorted(set(tensors) - set(params)), sorted(set(params) - set(tensors))
        raise AdapterError(f"{path}: the adapter's factors differ from the model's"
                           + (f"; not in the model: {extra[:3]}" if extra else "")
                           + (f"; not in the adapter: {missing[:3]}" if missing else ""))
    for key, (name, p) in params.items():
        full = tensors[key]
        if tuple(full.shape) != tuple(p.shape):
            raise AdapterError(f"{name}: adapter has shape {tuple(full.shape)}, the model needs {tuple(p.shape)}")
        if isinstance(p.data, DTensor):
            local = p.data.to_local()
            # each rank takes its own rows of the full tensor (no communication: src_data_rank=None)
            shard = distribute_tensor(full.to(device=local.device, dtype=local.dtype), p.data.device_mesh,
                                      p.data.placements, src_data_rank=None).to_local()
            local.copy_(shard)
        else:
            p.copy_(full.to(p.dtype))
    lora_fa = cfg.get("lora_fa", False)  # LoRA-FA: A frozen, as save_adapter recorded it
    for name, layer in layers:
        if lora_fa is True or isinstance(lora_fa, list) and name in lora_fa:
            layer.freeze_A()
    return model

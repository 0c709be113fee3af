"""``save_adapter``: a model's LoRA layers written as a PEFT adapter directory (VeRA layers: see ``vera_format``)."""
from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from lora_lab.adapters.errors import AdapterError
from lora_lab.adapters.full_weights import full_tensors_to_save, modules_to_save_entries
from lora_lab.adapters.peft_config import LORA_FA_KEY, _patterns_for, _peft_config, _peft_targets
from lora_lab.adapters.peft_files import CONFIG_NAME, PREFIX, WEIGHTS_NAME, _check_destination, _refuse_non_finite_save
from lora_lab.adapters.vera_format import _save_vera
from lora_lab.embedding_lora import LoRAEmbedding
from lora_lab.layer import all_lora_layers
from lora_lab.vera import vera_layers

__all__ = ["save_adapter"]


def save_adapter(model: nn.Module, path: str | Path, overwrite: bool = False,
                 save_embedding_layers: bool | str = "auto") -> Path:
    """Write the model's LoRA weights and config to ``path`` in PEFT's format. Returns the directory.

    Layers with different r or alpha are written with PEFT's ``rank_pattern``/``alpha_pattern``; dropout,
    ``use_rslora``, ``use_dora`` and ``init_lora_weights`` must be the same for every layer (PEFT stores one value
    each). A PiSSA adapter (``init_lora_weights="pissa"``) loads on the original base model, whose weights PEFT
    and ``load_adapter`` turn into the same residual. A directory that already holds an adapter is refused unless
    ``overwrite=True``. LoRA-FA layers (A frozen) are recorded under the key ``lora_lab_lora_fa``, which PEFT's
    loader ignores and :func:`load_adapter` restores. A model with VeRA layers (:func:`lora_lab.vera.add_vera`) is
    saved as PEFT's VeRA adapter (``peft_type`` VERA, the shared projections included: ``save_projection=True``).

    LoRA on embeddings is written under PEFT's keys (``...lora_embedding_A``, ``...lora_embedding_B``), the trained
    copies of ``modules_to_save`` under the module's own keys (``base_model.model.lm_head.weight``) with the
    config's ``modules_to_save``. ``save_embedding_layers`` is PEFT's argument of that name: with ``"auto"`` (PEFT's
    default) the base weights of the input and output embedding layers that carry LoRA are written too
    (``...base_layer.weight``) when the targets name ``embed_tokens`` or ``lm_head``; ``False`` leaves them out,
    ``True`` always writes them.
    """
    return _save_adapter(model, path, overwrite, lambda t: t.detach().contiguous().cpu(), save_embedding_layers)


def _save_adapter(model: nn.Module, path: str | Path, overwrite: bool, value_of,
                  save_embedding_layers: bool | str = "auto") -> Path:
    """:func:`save_adapter` with ``value_of(parameter)`` giving the CPU tensor to write (a sharded model passes the
    full tensors it gathered)."""
    from safetensors.torch import save_file

    layers = all_lora_layers(model)
    if layers and vera_layers(model):
        raise AdapterError(f"{type(model).__name__} carries LoRA and VeRA layers; an adapter file holds one kind")
    if not layers and vera_layers(model):
        return _save_vera(model, Path(path), overwrite)
    if not layers:
        raise AdapterError(f"{type(model).__name__} carries no LoRA layer: nothing to save")
    first_name, first = layers[0]
    for name, layer in layers:
        for field, attr in (("lora_dropout", "dropout_p"), ("use_rslora", "use_rslora"), ("use_dora", "use_dora"),
                            ("init_lora_weights", "init_lora_weights")):
            if getattr(layer, attr) != getattr(first, attr):
                raise AdapterError(
                    f"{name} has {field}={getattr(layer, attr)!r} but {first_name} has {getattr(first, attr)!r}; "
                    f"PEFT's format stores one {field} for all layers"
                )
    r, alpha, rank_pattern, alpha_pattern = _patterns_for(layers)
    out = Path(path)
    _check_destination(out, overwrite)
    targets, exclude = _peft_targets(model, [n for n, _ in layers])
    base_name = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    tensors = {}
    for name, layer in layers:
        if isinstance(layer, LoRAEmbedding):
            tensors[f"{PREFIX}{name}.lora_embedding_A"] = value_of(layer.lora_embedding_A)
            tensors[f"{PREFIX}{name}.lora_embedding_B"] = value_of(layer.lora_embedding_B)
            continue
        tensors[f"{PREFIX}{name}.lora_A.weight"] = value_of(layer.lora_A)
        tensors[f"{PREFIX}{name}.lora_B.weight"] = value_of(layer.lora_B)
        if layer.magnitude is not None:
            tensors[f"{PREFIX}{name}.lora_magnitude_vector"] = value_of(layer.magnitude)
    tensors.update(full_tensors_to_save(model, targets, save_embedding_layers))
    modules_to_save = modules_to_save_entries(model)
    _refuse_non_finite_save(tensors, out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    config = _peft_config(r, alpha, first.dropout_p, targets, exclude, base_name, use_rslora=first.use_rslora,
                          use_dora=first.use_dora, rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
                          init_lora_weights=first.init_lora_weights)
    config["modules_to_save"] = modules_to_save
    frozen_a = [name for name, layer in layers if layer.lora_fa]
    if frozen_a:
        config[LORA_FA_KEY] = True if len(frozen_a) == len(layers) else frozen_a
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out

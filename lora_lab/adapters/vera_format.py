"""VeRA adapters in PEFT's format (``peft_type`` VERA): the shared projections ``base_model.vera_A``/``vera_B`` and
each layer's ``vera_lambda_b``/``vera_lambda_d``; saved from and loaded into :class:`lora_lab.vera.VeRALinear`
layers."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from lora_lab.adapter_layer import install_adapter_layers, resolve_adapter_dtype
from lora_lab.adapters.errors import AdapterError
from lora_lab.adapters.peft_config import _peft_targets
from lora_lab.adapters.peft_files import (
    CONFIG_NAME,
    PREFIX,
    VERA_A_KEY,
    VERA_B_KEY,
    WEIGHTS_NAME,
    _check_destination,
    _refuse_non_finite_save,
)
from lora_lab.targets import _refuse_unwrappable, _select
from lora_lab.vera import VeRALinear, vera_layers, vera_projections

__all__: list[str] = []


def _save_vera(model: nn.Module, out: Path, overwrite: bool) -> Path:
    from safetensors.torch import save_file

    layers = vera_layers(model)
    first_name, first = layers[0]
    for name, layer in layers:
        if layer.vera_A is not first.vera_A or layer.vera_B is not first.vera_B:
            raise AdapterError(f"{name} does not share {first_name}'s VeRA projections; PEFT's format holds one pair")
        if layer.dropout_p != first.dropout_p:
            raise AdapterError(f"{name} has vera_dropout={layer.dropout_p!r} but {first_name} has "
                               f"{first.dropout_p!r}; PEFT's format stores one vera_dropout for all layers")
    _check_destination(out, overwrite)
    targets, _ = _peft_targets(model, [n for n, _ in layers], allow_exclude=False)
    recorded = getattr(model, "_lora_lab_vera", {})
    tensors = {VERA_A_KEY: first.vera_A.detach().contiguous().cpu(),
               VERA_B_KEY: first.vera_B.detach().contiguous().cpu()}
    for name, layer in layers:
        tensors[f"{PREFIX}{name}.vera_lambda_b"] = layer.lambda_b.detach().contiguous().cpu()
        tensors[f"{PREFIX}{name}.vera_lambda_d"] = layer.lambda_d.detach().contiguous().cpu()
    _refuse_non_finite_save(tensors, out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    config = {
        "peft_type": "VERA", "task_type": None,
        "base_model_name_or_path": getattr(getattr(model, "config", None), "_name_or_path", None) or None,
        "r": first.r, "target_modules": targets, "projection_prng_key": recorded.get("projection_prng_key", 0),
        "save_projection": True, "vera_dropout": first.dropout_p, "d_initial": recorded.get("d_initial", 0.1),
        "fan_in_fan_out": False, "bias": "none", "modules_to_save": None, "init_weights": True,
        "layers_to_transform": None, "layers_pattern": None, "revision": None, "inference_mode": True,
    }
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out


def _load_vera(model: nn.Module, cfg: dict, tensors: dict[str, torch.Tensor], source: Path) -> nn.Module:
    """A VeRA adapter into a model without adapters: the shared projections from the file (or, with
    save_projection=false, drawn again from projection_prng_key, as PEFT does), one VeRALinear per target."""
    from lora_lab.layer import adapter_layers

    if adapter_layers(model):
        raise AdapterError(f"{type(model).__name__} already carries adapter layers; a VeRA adapter loads into a "
                           "model without them")
    r, targets = cfg["r"], cfg["target_modules"]
    modules = _select(model, targets)  # "all-linear" expanded as PEFT does
    bad = [(n, type(m).__name__) for n, m in modules if not isinstance(m, nn.Linear)]
    if bad:
        raise AdapterError(f"adapter targets {bad[0][0]}, a {bad[0][1]}; only nn.Linear targets are supported")
    if not modules:
        raise AdapterError(f"adapter targets {targets!r} match no module of {type(model).__name__}")
    _refuse_unwrappable(model, [n for n, _ in modules], "load_adapter", AdapterError)
    in_max, out_max = max(m.in_features for _, m in modules), max(m.out_features for _, m in modules)
    want = {VERA_A_KEY: (r, in_max), VERA_B_KEY: (out_max, r)}
    for n, m in modules:
        want[f"{PREFIX}{n}.vera_lambda_b"] = (m.out_features,)
        want[f"{PREFIX}{n}.vera_lambda_d"] = (r,)
    if not cfg["save_projection"]:
        del want[VERA_A_KEY], want[VERA_B_KEY]
    for key, t in tensors.items():
        if key not in want:
            raise AdapterError(
                f"{source}: unexpected tensor {key!r} in the VeRA adapter (expected {VERA_A_KEY}, {VERA_B_KEY} "
                "with save_projection, and ...vera_lambda_b / ...vera_lambda_d per target)"
            )
        if tuple(t.shape) != want[key]:
            raise AdapterError(f"{key}: adapter has shape {tuple(t.shape)}, the model needs {want[key]} "
                               f"(r={r}, largest in={in_max}, out={out_max})")
        if not t.is_floating_point():
            raise AdapterError(f"{source}: {key} holds {t.dtype} values, not floating point")
    missing = [k for k in want if k not in tensors]
    if missing:
        raise AdapterError(f"VeRA adapter has no {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1
                                                                  else ""))
    w = modules[0][1].weight
    if cfg["save_projection"]:
        a, b = tensors[VERA_A_KEY], tensors[VERA_B_KEY]
    else:  # drawn again and rounded to the model's dtype, as PEFT's reload does
        a, b = vera_projections(r, in_max, out_max, cfg["projection_prng_key"], w.dtype)
    dtype = resolve_adapter_dtype(w.dtype, None)  # fp32 on a bf16/fp16 model, as add_vera and PEFT's reload
    a, b = a.to(device=w.device, dtype=dtype), b.to(device=w.device, dtype=dtype)
    wrapped = [(n, VeRALinear(m, a, b, dropout=cfg["vera_dropout"])) for n, m in modules]
    for n, layer in wrapped:
        layer.lambda_b.copy_(tensors[f"{PREFIX}{n}.vera_lambda_b"].to(layer.lambda_b.dtype))
        layer.lambda_d.copy_(tensors[f"{PREFIX}{n}.vera_lambda_d"].to(layer.lambda_d.dtype))
    install_adapter_layers(model, wrapped)
    model._lora_lab_vera = {"projection_prng_key": cfg["projection_prng_key"], "d_initial": cfg["d_initial"]}
    return model

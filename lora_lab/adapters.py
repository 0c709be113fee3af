"""Adapters on disk in PEFT's format.

A directory with ``adapter_config.json`` (PEFT's LoraConfig fields) and
``adapter_model.safetensors`` whose keys are PEFT's:
``base_model.model.<module name>.lora_A.weight`` (r x in) and ``...lora_B.weight`` (out x r).
So an adapter trained here loads with ``peft.PeftModel.from_pretrained`` and a PEFT-saved LoRA
adapter loads here.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from lora_lab.layer import LoRALinear, _matches, add_lora, lora_layers

__all__ = ["save_adapter", "load_adapter", "AdapterError", "peft_lora_model", "peft_lora_pairs",
           "copy_adapters_to_peft"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter that does not fit the model or uses a PEFT feature lora_lab does not implement."""


def _peft_config(r, alpha, dropout, targets, base_name) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_name,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def save_adapter(model: nn.Module, path: str | Path) -> Path:
    """Write the model's LoRA weights and config to ``path`` in PEFT's format. Returns the directory."""
    from safetensors.torch import save_file

    layers = lora_layers(model)
    if not layers:
        raise AdapterError(f"{type(model).__name__} carries no LoRA layer: nothing to save")
    first = layers[0][1]
    for name, layer in layers:
        if (layer.r, layer.alpha, layer.dropout_p) != (first.r, first.alpha, first.dropout_p):
            raise AdapterError(
                f"{name} has r={layer.r}, alpha={layer.alpha}; PEFT's format stores one r/alpha "
                f"(first layer: r={first.r}, alpha={first.alpha})"
            )
    cfg = getattr(model, "_lora_lab_config", None)
    targets = cfg["targets"] if cfg else sorted({n.rsplit(".", 1)[-1] for n, _ in layers})
    base_name = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    tensors = {}
    for name, layer in layers:
        tensors[f"{PREFIX}{name}.lora_A.weight"] = layer.lora_A.detach().contiguous().cpu()
        tensors[f"{PREFIX}{name}.lora_B.weight"] = layer.lora_B.detach().contiguous().cpu()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    config = _peft_config(first.r, first.alpha, first.dropout_p, targets, base_name)
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out


def _read_config(path: Path) -> dict:
    cfg_file = path / CONFIG_NAME
    if not cfg_file.is_file():
        raise AdapterError(f"{path} holds no {CONFIG_NAME}; not a PEFT adapter directory")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    unsupported = {
        "use_dora": bool(cfg.get("use_dora")),
        "use_rslora": bool(cfg.get("use_rslora")),
        "fan_in_fan_out": bool(cfg.get("fan_in_fan_out")),
        "bias": cfg.get("bias", "none") != "none",
        "rank_pattern": bool(cfg.get("rank_pattern")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
        "modules_to_save": bool(cfg.get("modules_to_save")),
        "layers_to_transform": cfg.get("layers_to_transform") is not None,
        "target_parameters": bool(cfg.get("target_parameters")),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise AdapterError(f"{path}: adapter uses {', '.join(bad)}, which lora_lab's LoRALinear does not implement")
    if not cfg.get("target_modules"):
        raise AdapterError(f"{path}: adapter_config.json names no target_modules")
    return cfg


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    weights = path / WEIGHTS_NAME
    if weights.is_file():
        from safetensors.torch import load_file

        return load_file(str(weights))
    legacy = path / "adapter_model.bin"
    if legacy.is_file():
        return torch.load(legacy, map_location="cpu", weights_only=True)
    raise AdapterError(f"{path} holds neither {WEIGHTS_NAME} nor adapter_model.bin")


def _module_name(key: str) -> tuple[str, str]:
    """'base_model.model.X.lora_A.weight' -> ('X', 'A'). Tolerates an adapter name ('lora_A.default.weight')."""
    k = key[len(PREFIX):] if key.startswith(PREFIX) else key
    for which in ("A", "B"):
        for suffix in (f".lora_{which}.weight", f".lora_{which}.default.weight"):
            if k.endswith(suffix):
                return k[: -len(suffix)], which
    raise AdapterError(f"unexpected tensor {key!r} in the adapter (expected ...lora_A.weight / ...lora_B.weight)")


@torch.no_grad()
def load_adapter(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a PEFT-format LoRA adapter into ``model``.

    A model without LoRA gets it added (``add_lora`` with the adapter's r, alpha, dropout and
    targets); a model that already has LoRA must match. Every tensor's module and shape is checked
    before anything is changed, so a failing call leaves the model as it was.
    """
    path = Path(path)
    cfg = _read_config(path)
    tensors = _read_tensors(path)
    r, alpha = int(cfg["r"]), cfg["lora_alpha"]
    targets = cfg["target_modules"]
    dropout = float(cfg.get("lora_dropout") or 0.0)

    existing = dict(lora_layers(model))
    if existing:
        planned = {n: (m.base.in_features, m.base.out_features) for n, m in existing.items()}
        for n, m in existing.items():
            if (m.r, m.alpha) != (r, alpha):
                raise AdapterError(f"{n} has r={m.r}, alpha={m.alpha} but the adapter has r={r}, lora_alpha={alpha}")
    else:
        modules = [(n, m) for n, m in model.named_modules() if n and _matches(n, targets)]
        bad = [(n, type(m).__name__) for n, m in modules if not isinstance(m, nn.Linear)]
        if bad:
            raise AdapterError(f"adapter targets {bad[0][0]}, a {bad[0][1]}; only nn.Linear targets are supported")
        planned = {n: (m.in_features, m.out_features) for n, m in modules}
    if not planned:
        raise AdapterError(f"adapter targets {targets!r} match no module of {type(model).__name__}")

    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name, which = _module_name(key)
        if name not in planned:
            raise AdapterError(f"adapter tensor {key!r} is for {name}, which the model has no LoRA target at")
        fan_in, fan_out = planned[name]
        want = (r, fan_in) if which == "A" else (fan_out, r)
        if tuple(t.shape) != want:
            raise AdapterError(
                f"{name}.lora_{which}: adapter has shape {tuple(t.shape)}, the model needs {want} "
                f"(r={r}, in={fan_in}, out={fan_out})"
            )
        found.setdefault(name, {})[which] = t
    missing = [n for n in planned if set(found.get(n, {})) != {"A", "B"}]
    if missing:
        more = f" and {len(missing)-1} more" if len(missing) > 1 else ""
        raise AdapterError(f"adapter has no lora_A/lora_B for {missing[0]}" + more)

    if not existing:
        add_lora(model, r=r, alpha=alpha, targets=targets, dropout=dropout)
    layers = dict(lora_layers(model))
    for name, ab in found.items():
        layer: LoRALinear = layers[name]
        layer.lora_A.copy_(ab["A"].to(layer.lora_A.dtype))
        layer.lora_B.copy_(ab["B"].to(layer.lora_B.dtype))
    return model


# ---------------------------------------------------------------------------------------------
# The same adapters in a PEFT model in memory (parity checks, PEFT's merge)
# ---------------------------------------------------------------------------------------------


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

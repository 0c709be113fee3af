"""Adapters on disk in PEFT's format.

A directory with ``adapter_config.json`` (PEFT's LoraConfig fields) and
``adapter_model.safetensors`` whose keys are PEFT's:
``base_model.model.<module name>.lora_A.weight`` (r x in) and ``...lora_B.weight`` (out x r).
So an adapter trained here loads with ``peft.PeftModel.from_pretrained`` and a PEFT-saved LoRA
adapter loads here.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from torch import nn

from lora_lab.layer import LoRALinear, _lora_internals, _matches, _wrap, lora_layers

__all__ = ["save_adapter", "load_adapter", "AdapterError", "AdapterNotFoundError", "AdapterExistsError",
           "peft_lora_model", "peft_lora_pairs", "copy_adapters_to_peft"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
LEGACY_WEIGHTS_NAME = "adapter_model.bin"
PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter that does not fit the model, is broken on disk, or uses a PEFT feature lora_lab does not implement."""


class AdapterNotFoundError(AdapterError, FileNotFoundError):
    """A path that holds no adapter (no directory, no adapter_config.json or no weights file)."""


class AdapterExistsError(AdapterError, FileExistsError):
    """``save_adapter`` into a directory that already holds an adapter, without ``overwrite=True``."""


def _peft_config(r, alpha, dropout, targets, exclude, base_name) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_name,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": targets,
        "exclude_modules": exclude,
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


def _selected(names: list[str], targets, exclude) -> set[str]:
    """The module names PEFT wraps for ``target_modules=targets, exclude_modules=exclude``."""
    return {n for n in names if _matches(n, targets) and not (exclude and _matches(n, exclude))}


def _peft_targets(model: nn.Module, layer_names: list[str]):
    """(target_modules, exclude_modules) that make PEFT wrap exactly ``layer_names`` in ``model``.

    Tried in order, each checked against the model's module names as PEFT will see them (LoRA internals
    left out): what add_lora recorded, the layers' last name components, and the full names (always exact).
    """
    internals = _lora_internals(model)
    names = [n for n, _ in model.named_modules() if n and n not in internals]
    want = set(layer_names)
    cfg = getattr(model, "_lora_lab_config", None)
    candidates = []
    if cfg and cfg.get("targets") is not None:
        candidates.append((cfg["targets"], cfg.get("exclude")))
    candidates.append((sorted({n.rsplit(".", 1)[-1] for n in layer_names}), None))
    for targets, exclude in candidates:
        if _selected(names, targets, exclude) == want:
            return targets, exclude
    return sorted(want), None


def save_adapter(model: nn.Module, path: str | Path, overwrite: bool = False) -> Path:
    """Write the model's LoRA weights and config to ``path`` in PEFT's format. Returns the directory.

    A directory that already holds an adapter is refused unless ``overwrite=True``.
    """
    return _save_adapter(model, path, overwrite, lambda t: t.detach().contiguous().cpu())


def _save_adapter(model: nn.Module, path: str | Path, overwrite: bool, value_of) -> Path:
    """:func:`save_adapter` with ``value_of(parameter)`` giving the CPU tensor to write (a sharded model passes the
    full tensors it gathered)."""
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
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise AdapterExistsError(f"{out} is a file, not a directory: cannot save an adapter there")
    present = [f for f in (CONFIG_NAME, WEIGHTS_NAME, LEGACY_WEIGHTS_NAME) if (out / f).exists()]
    if present and not overwrite:
        raise AdapterExistsError(
            f"{out} already holds an adapter ({', '.join(present)}); pass overwrite=True to replace it, "
            "or choose another directory"
        )
    targets, exclude = _peft_targets(model, [n for n, _ in layers])
    base_name = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    tensors = {}
    for name, layer in layers:
        tensors[f"{PREFIX}{name}.lora_A.weight"] = value_of(layer.lora_A)
        tensors[f"{PREFIX}{name}.lora_B.weight"] = value_of(layer.lora_B)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    config = _peft_config(first.r, first.alpha, first.dropout_p, targets, exclude, base_name)
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out


# init_lora_weights values after which PEFT's reload is a plain LoRA on the unchanged base weights: they only
# decide the initial A and B, which the saved tensors replace. (MiCA also freezes B; load_adapter does too.)
_PLAIN_INITS = (True, False, "gaussian", "orthogonal", "eva", "mica")

# init_lora_weights values refused, and why. PiSSA, OLoRA and CorDA subtract scaling * B0 A0 from the base weight
# when PEFT builds the layer, on load too (CorDA needs preprocess_corda first); LoftQ replaces it with its
# quantization; LoRA-GA subtracted it at initialisation but not on load, so the saved A and B belong to a base
# that PEFT's reload does not rebuild either.
_CONVERT = (
    "convert it into a plain LoRA adapter in PEFT: save_pretrained(..., path_initial_model_for_weight_conversion="
    "<the adapter saved before training>) writes one with init_lora_weights=True (and r, lora_alpha doubled)"
)
_BASE_CHANGING_INITS = {
    "pissa": f"PEFT turns the base weights into the PiSSA residual W - scaling*B0 A0 when it loads it; {_CONVERT}",
    "olora": f"PEFT turns the base weights into the OLoRA residual W - scaling*B0 A0 when it loads it; {_CONVERT}",
    "corda": f"PEFT turns the base weights into the CorDA residual W - scaling*B0 A0 when it loads it; {_CONVERT}",
    "lora_ga": "its A and B were trained on base weights that LoRA-GA rewrote at initialisation (W - scaling*B0 A0), "
               f"which neither PEFT's reload nor lora_lab rebuilds; {_CONVERT}",
    "loftq": "PEFT replaces the base weights with their LoftQ quantization when it loads it; load the LoftQ base "
             "model and an adapter whose config says init_lora_weights=True instead",
}

# Fields read and implemented here, and fields that do not change the model PEFT builds from the adapter
# (metadata, or settings used only by a refused init_lora_weights or together with a field that must be off).
# Every other field must hold its "off" value (None, False, empty, bias "none"), or the adapter is refused.
_IMPLEMENTED = {
    "peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "init_lora_weights",
}
_NO_EFFECT = {
    "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping", "peft_version",
    "megatron_core", "qalora_group_size", "layers_pattern",
    "loftq_config", "corda_config", "lora_ga_config", "eva_config",
}


def _is_off(field: str, value) -> bool:
    if value is None or value is False:
        return True
    if field == "bias":
        return value == "none"
    return isinstance(value, (dict, list)) and len(value) == 0


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_patterns_field(cfg_file: Path, field: str, value, required: bool):
    if value is None and not required:
        return None
    if isinstance(value, str) and value:
        try:
            re.compile(value)
        except re.error as exc:
            raise AdapterError(
                f"invalid adapter config {cfg_file}: {field}={value!r} is not a valid regular expression ({exc})"
            ) from None
        return value
    if isinstance(value, list) and value and all(isinstance(t, str) and t for t in value):
        return value
    raise AdapterError(
        f"invalid adapter config {cfg_file}: {field}={value!r}; expected a regex string or a non-empty list of "
        "module names"
    )


def _read_config(path: Path) -> dict:
    """adapter_config.json, validated: the values lora_lab uses, and a refusal of anything it would not
    reproduce exactly. Missing r, lora_alpha and lora_dropout take LoraConfig's defaults, as in PEFT."""
    if not path.exists():
        raise AdapterNotFoundError(f"{path}: no such adapter directory")
    cfg_file = path / CONFIG_NAME
    if not cfg_file.is_file():
        raise AdapterNotFoundError(f"{path} holds no {CONFIG_NAME}; not a PEFT adapter directory")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{cfg_file} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_file} holds a JSON {type(cfg).__name__}, not an object of LoraConfig fields")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{cfg_file}: peft_type {cfg.get('peft_type')!r} is not LORA")

    r, alpha, dropout = cfg.get("r", 8), cfg.get("lora_alpha", 8), cfg.get("lora_dropout", 0.0)
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise AdapterError(f"invalid adapter config {cfg_file}: r={r!r}; the rank must be a positive integer")
    if not _is_number(alpha):
        raise AdapterError(f"invalid adapter config {cfg_file}: lora_alpha={alpha!r} is not a number")
    if alpha <= 0:
        raise AdapterError(f"{cfg_file}: lora_alpha={alpha!r}; lora_lab's LoRALinear needs a positive lora_alpha")
    if dropout is None:
        dropout = 0.0
    if not _is_number(dropout) or not 0.0 <= dropout < 1.0:
        raise AdapterError(f"invalid adapter config {cfg_file}: lora_dropout={dropout!r}; expected a number in [0, 1)")
    targets = _check_patterns_field(cfg_file, "target_modules", cfg.get("target_modules"), required=True)
    exclude = _check_patterns_field(cfg_file, "exclude_modules", cfg.get("exclude_modules"), required=False)
    if isinstance(targets, str) and targets.lower() == "all-linear":
        raise AdapterError(
            f"{cfg_file}: target_modules='all-linear' is PEFT's shorthand, which lora_lab does not expand; "
            "list the module names instead"
        )

    init = cfg.get("init_lora_weights", True)
    if not isinstance(init, (bool, str)):
        raise AdapterError(f"invalid adapter config {cfg_file}: init_lora_weights={init!r}; expected a bool or a name")
    family = next((f for f in _BASE_CHANGING_INITS if isinstance(init, str) and init.lower().startswith(f)), None)
    if family is not None:
        raise AdapterError(f"{cfg_file}: init_lora_weights={init!r} is not supported: {_BASE_CHANGING_INITS[family]}")
    if init not in _PLAIN_INITS:
        raise AdapterError(
            f"{cfg_file}: init_lora_weights={init!r} is not supported: lora_lab does not know what PEFT does with "
            f"it on load (supported: {', '.join(map(repr, _PLAIN_INITS))})"
        )

    bad = [f"{k}={v!r}" for k, v in cfg.items() if k not in _IMPLEMENTED | _NO_EFFECT and not _is_off(k, v)]
    if bad:
        raise AdapterError(
            f"{cfg_file}: adapter uses {', '.join(bad)}, which lora_lab's LoRALinear does not implement"
        )
    return {"r": r, "lora_alpha": alpha, "lora_dropout": float(dropout), "target_modules": targets,
            "exclude_modules": exclude, "init_lora_weights": init}


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    weights = path / WEIGHTS_NAME
    if weights.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(weights))
        except (SafetensorError, OSError, ValueError) as exc:
            raise AdapterError(f"{weights} is not a readable safetensors file (truncated or corrupt?): {exc}") from exc
    legacy = path / LEGACY_WEIGHTS_NAME
    if legacy.is_file():
        import pickle

        try:
            tensors = torch.load(legacy, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as exc:
            raise AdapterError(f"{legacy} is not a readable torch checkpoint (truncated or corrupt?): {exc}") from exc
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise AdapterError(f"{legacy} does not hold a dict of tensors")
        return tensors
    raise AdapterNotFoundError(f"{path} holds neither {WEIGHTS_NAME} nor {LEGACY_WEIGHTS_NAME}")


def _module_name(key: str, source: Path) -> tuple[str, str]:
    """'base_model.model.X.lora_A.weight' -> ('X', 'A'). Tolerates an adapter name ('lora_A.default.weight')."""
    k = key[len(PREFIX):] if key.startswith(PREFIX) else key
    for which in ("A", "B"):
        for suffix in (f".lora_{which}.weight", f".lora_{which}.default.weight"):
            if k.endswith(suffix):
                return k[: -len(suffix)], which
    raise AdapterError(
        f"{source}: unexpected tensor {key!r} in the adapter (expected ...lora_A.weight / ...lora_B.weight)"
    )


@torch.no_grad()
def load_adapter(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a PEFT-format LoRA adapter into ``model``.

    A model without LoRA gets it at the modules PEFT would wrap (``target_modules`` minus
    ``exclude_modules``), with the adapter's r, alpha and dropout; a model that already has LoRA must
    match. Whatever would make the model compute something other than PEFT's reload of the same files
    is refused by name (DoRA, rsLoRA, PiSSA/OLoRA/CorDA/LoftQ/LoRA-GA inits, ...). A MiCA adapter
    (``init_lora_weights="mica"``) loads with B frozen, as PEFT trains it. Every tensor's module and
    shape is checked before anything is changed, so a failing call leaves the model as it was.
    """
    path = Path(path)
    cfg = _read_config(path)
    tensors = _read_tensors(path)
    source = path / WEIGHTS_NAME if (path / WEIGHTS_NAME).is_file() else path / LEGACY_WEIGHTS_NAME
    r, alpha, dropout = cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"]
    targets, exclude = cfg["target_modules"], cfg["exclude_modules"]

    existing = dict(lora_layers(model))
    if existing:
        planned = {n: (m.base.in_features, m.base.out_features) for n, m in existing.items()}
        for n, m in existing.items():
            if (m.r, m.alpha) != (r, alpha):
                raise AdapterError(f"{n} has r={m.r}, alpha={m.alpha} but the adapter has r={r}, lora_alpha={alpha}")
    else:
        modules = [(n, m) for n, m in model.named_modules()
                   if n and _matches(n, targets) and not (exclude and _matches(n, exclude))]
        bad = [(n, type(m).__name__) for n, m in modules if not isinstance(m, nn.Linear)]
        if bad:
            raise AdapterError(f"adapter targets {bad[0][0]}, a {bad[0][1]}; only nn.Linear targets are supported")
        planned = {n: (m.in_features, m.out_features) for n, m in modules}
    if not planned:
        raise AdapterError(
            f"adapter targets {targets!r}" + (f" (exclude_modules {exclude!r})" if exclude else "")
            + f" match no module of {type(model).__name__}"
        )

    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name, which = _module_name(key, source)
        if name not in planned:
            raise AdapterError(f"adapter tensor {key!r} is for {name}, which the model has no LoRA target at")
        fan_in, fan_out = planned[name]
        want = (r, fan_in) if which == "A" else (fan_out, r)
        if tuple(t.shape) != want:
            raise AdapterError(
                f"{name}.lora_{which}: adapter has shape {tuple(t.shape)}, the model needs {want} "
                f"(r={r}, in={fan_in}, out={fan_out})"
            )
        if not t.is_floating_point():
            raise AdapterError(f"{source}: {key} holds {t.dtype} values, not floating point")
        found.setdefault(name, {})[which] = t
    missing = [n for n in planned if set(found.get(n, {})) != {"A", "B"}]
    if missing:
        more = f" and {len(missing)-1} more" if len(missing) > 1 else ""
        raise AdapterError(f"adapter has no lora_A/lora_B for {missing[0]}" + more)

    if not existing:
        _wrap(model, list(planned), r, alpha, dropout)
        model._lora_lab_config = {"r": r, "alpha": alpha, "dropout": dropout, "targets": targets, "exclude": exclude}
    layers = dict(lora_layers(model))
    for name, ab in found.items():
        layer: LoRALinear = layers[name]
        layer.lora_A.copy_(ab["A"].to(layer.lora_A.dtype))
        layer.lora_B.copy_(ab["B"].to(layer.lora_B.dtype))
        if cfg["init_lora_weights"] == "mica":
            layer.lora_B.requires_grad_(False)
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

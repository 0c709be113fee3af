"""``adapter_config.json``: the LoraConfig lora_lab writes, and the reading of a LoraConfig or VeraConfig, validated.

Reading refuses, by name, every field whose value would make PEFT build a model other than the one lora_lab builds
(see ``_IMPLEMENTED``/``_NO_EFFECT`` and the init_lora_weights tables). Writing picks ``target_modules``,
``rank_pattern`` and ``alpha_pattern`` that make PEFT wrap exactly the layers lora_lab carries, with their r and alpha.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

from torch import nn

from lora_lab.adapters.errors import AdapterError, AdapterNotFoundError
from lora_lab.adapters.peft_files import CONFIG_NAME
from lora_lab.targets import _lora_internals, _matches

__all__ = ["LORA_FA_KEY"]

# LoRA-FA (A frozen) has no LoraConfig field (PEFT does it in an optimizer, create_lorafa_optimizer): lora_lab writes
# it under its own key, true for every layer or a list of module names, which PEFT's config loader drops (with a
# warning about an unexpected key) and load_adapter restores.
LORA_FA_KEY = "lora_lab_lora_fa"


def _peft_config(r, alpha, dropout, targets, exclude, base_name, *, use_rslora=False, use_dora=False,
                 rank_pattern=None, alpha_pattern=None, init_lora_weights=True) -> dict:
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
        "use_rslora": use_rslora,
        "use_dora": use_dora,
        "init_lora_weights": init_lora_weights,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": rank_pattern or {},
        "alpha_pattern": alpha_pattern or {},
        "revision": None,
    }


def _pattern_value(patterns: dict, name: str, default):
    r"""PEFT's lookup of ``rank_pattern``/``alpha_pattern`` (``get_pattern_key``): the first key, in the dict's
    order, that matches the end of the module name after a dot (regex ``(.*\.)?(key)$``); else the default."""
    key = next((k for k in patterns if re.match(rf"(.*\.)?({k})$", name)), name)
    return patterns.get(key, default)


def _patterns_for(layers) -> tuple[int, float, dict, dict]:
    """(r, lora_alpha, rank_pattern, alpha_pattern) that give each of ``layers`` its own r and alpha in PEFT:
    the first layer's values as the defaults, and each layer that differs named in full (escaped)."""
    first = layers[0][1]
    rank_pattern = {re.escape(n): m.r for n, m in layers if m.r != first.r}
    alpha_pattern = {re.escape(n): m.alpha for n, m in layers if m.alpha != first.alpha}
    for n, m in layers:  # the lookup must give every layer back its own values
        if (_pattern_value(rank_pattern, n, first.r), _pattern_value(alpha_pattern, n, first.alpha)) != (m.r, m.alpha):
            raise AdapterError(f"{n}: cannot express r={m.r}, alpha={m.alpha} as a PEFT rank/alpha pattern")
    return first.r, first.alpha, rank_pattern, alpha_pattern


def _selected(names: list[str], targets, exclude) -> set[str]:
    """The module names PEFT wraps for ``target_modules=targets, exclude_modules=exclude``."""
    return {n for n in names if _matches(n, targets) and not (exclude and _matches(n, exclude))}


def _peft_targets(model: nn.Module, layer_names: list[str], allow_exclude: bool = True):
    """(target_modules, exclude_modules) that make PEFT wrap exactly ``layer_names`` in ``model``.

    Tried in order, each checked against the model's module names as PEFT will see them (LoRA internals
    left out): what add_lora recorded, the layers' last name components, and the full names (always exact).
    """
    internals = _lora_internals(model)
    names = [n for n, _ in model.named_modules() if n and n not in internals]
    want = set(layer_names)
    cfg = getattr(model, "_lora_lab_config", None)
    candidates = []
    if cfg and cfg.get("targets") is not None and (allow_exclude or cfg.get("exclude") is None):
        candidates.append((cfg["targets"], cfg.get("exclude")))
    candidates.append((sorted({n.rsplit(".", 1)[-1] for n in layer_names}), None))
    for targets, exclude in candidates:
        if _selected(names, targets, exclude) == want:
            return targets, exclude
    return sorted(want), None


# init_lora_weights values after which PEFT's reload is a plain LoRA on the unchanged base weights: they only
# decide the initial A and B, which the saved tensors replace. (MiCA also freezes B; load_adapter does too.)
_PLAIN_INITS = (True, False, "gaussian", "orthogonal", "eva", "mica")


# "pissa" loads: PEFT turns the base weights into the residual W - scaling*B0 A0 of an fp32 SVD when it loads the
# adapter, and load_adapter does the same (LoRALinear's init_lora_weights="pissa"), then copies the saved A and B.
#
# init_lora_weights values refused, and why. PiSSA with a randomized SVD (pissa_niter_*), OLoRA and CorDA subtract
# scaling * B0 A0 from the base weight when PEFT builds the layer, on load too (CorDA needs preprocess_corda first),
# from a factorisation lora_lab does not rebuild; LoftQ replaces it with its
# quantization; LoRA-GA subtracted it at initialisation but not on load, so the saved A and B belong to a base
# that PEFT's reload does not rebuild either.
_CONVERT = (
    "convert it into a plain LoRA adapter in PEFT: save_pretrained(..., path_initial_model_for_weight_conversion="
    "<the adapter saved before training>) writes one with init_lora_weights=True (and r, lora_alpha doubled)"
)
_BASE_CHANGING_INITS = {
    "pissa": "PEFT turns the base weights into the PiSSA residual W - scaling*B0 A0 of a randomized SVD "
             f"(svd_lowrank) when it loads it, which lora_lab does not rebuild (it does init_lora_weights='pissa'); "
             f"{_CONVERT}",
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
    "use_rslora", "use_dora", "rank_pattern", "alpha_pattern", LORA_FA_KEY, "modules_to_save",
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
    if cfg.get("peft_type") == "VERA":
        return _read_vera_config(cfg_file, cfg)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{cfg_file}: peft_type {cfg.get('peft_type')!r} is not LORA or VERA")

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

    init = cfg.get("init_lora_weights", True)
    if not isinstance(init, (bool, str)):
        raise AdapterError(f"invalid adapter config {cfg_file}: init_lora_weights={init!r}; expected a bool or a name")
    family = next((f for f in _BASE_CHANGING_INITS if isinstance(init, str) and init.lower().startswith(f)), None)
    if init == "pissa":
        family = None
    if family is not None:
        raise AdapterError(f"{cfg_file}: init_lora_weights={init!r} is not supported: {_BASE_CHANGING_INITS[family]}")
    if init not in _PLAIN_INITS + ("pissa",):
        raise AdapterError(
            f"{cfg_file}: init_lora_weights={init!r} is not supported: lora_lab does not know what PEFT does with "
            f"it on load (supported: {', '.join(map(repr, _PLAIN_INITS + ('pissa',)))})"
        )

    flags = {}
    for field in ("use_rslora", "use_dora"):
        flags[field] = cfg.get(field, False)
        if not isinstance(flags[field], bool):
            raise AdapterError(f"invalid adapter config {cfg_file}: {field}={flags[field]!r}; expected true or false")
    rank_pattern = _check_pattern_dict(cfg_file, "rank_pattern", cfg.get("rank_pattern"),
                                       lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
                                       "positive integer ranks")
    alpha_pattern = _check_pattern_dict(cfg_file, "alpha_pattern", cfg.get("alpha_pattern"),
                                        lambda v: _is_number(v) and v > 0, "positive alphas")

    lora_fa = cfg.get(LORA_FA_KEY, False)
    if not (isinstance(lora_fa, bool) or isinstance(lora_fa, list) and all(isinstance(n, str) for n in lora_fa)):
        raise AdapterError(f"invalid adapter config {cfg_file}: {LORA_FA_KEY}={lora_fa!r}; expected true, false or a "
                           "list of module names (the layers whose A is frozen)")

    modules_to_save = cfg.get("modules_to_save")
    if not (modules_to_save is None or isinstance(modules_to_save, list)
            and all(isinstance(n, str) and n for n in modules_to_save)):
        raise AdapterError(f"invalid adapter config {cfg_file}: modules_to_save={modules_to_save!r}; expected null or "
                           "a list of module names")
    bad = [f"{k}={v!r}" for k, v in cfg.items() if k not in _IMPLEMENTED | _NO_EFFECT and not _is_off(k, v)]
    if bad:
        raise AdapterError(
            f"{cfg_file}: adapter uses {', '.join(bad)}, which lora_lab's LoRALinear does not implement"
        )
    return {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "lora_dropout": float(dropout), "target_modules": targets,
            "exclude_modules": exclude, "init_lora_weights": init, "rank_pattern": rank_pattern,
            "alpha_pattern": alpha_pattern, "lora_fa": lora_fa, "modules_to_save": modules_to_save or None, **flags}


def _check_pattern_dict(cfg_file: Path, field: str, value, valid, what: str) -> dict:
    """``rank_pattern``/``alpha_pattern``: {regex: value}, as PEFT reads them (None counts as empty)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise AdapterError(f"invalid adapter config {cfg_file}: {field}={value!r}; expected an object of patterns")
    for key, v in value.items():
        try:
            re.compile(key)
        except re.error as exc:
            raise AdapterError(
                f"invalid adapter config {cfg_file}: {field}={value!r}; key {key!r} is not a valid regular "
                f"expression ({exc})"
            ) from None
        if not valid(v):
            raise AdapterError(f"invalid adapter config {cfg_file}: {field}={value!r}; expected {what}, got {v!r}")
    return value


# VeraConfig fields read here, and those that do not change the model PEFT builds; any other must be off.
_VERA_IMPLEMENTED = {"peft_type", "r", "target_modules", "vera_dropout", "projection_prng_key", "save_projection",
                     "d_initial", "init_weights"}
_VERA_NO_EFFECT = {"task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping",
                   "peft_version", "layers_pattern"}


def _read_vera_config(cfg_file: Path, cfg: dict) -> dict:
    """A VeraConfig, validated; missing fields take VeraConfig's defaults. ``d_initial`` and ``init_weights`` only
    set the starting vectors, which the saved ones replace."""
    r, dropout, key = cfg.get("r", 256), cfg.get("vera_dropout", 0.0), cfg.get("projection_prng_key", 0)
    save_projection = cfg.get("save_projection", True)
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise AdapterError(f"invalid adapter config {cfg_file}: r={r!r}; the rank must be a positive integer")
    if dropout is None:
        dropout = 0.0
    if not _is_number(dropout) or not 0.0 <= dropout < 1.0:
        raise AdapterError(f"invalid adapter config {cfg_file}: vera_dropout={dropout!r}; expected a number in [0, 1)")
    if not isinstance(key, int) or isinstance(key, bool):
        raise AdapterError(f"invalid adapter config {cfg_file}: projection_prng_key={key!r}; expected an integer")
    if not isinstance(save_projection, bool):
        raise AdapterError(f"invalid adapter config {cfg_file}: save_projection={save_projection!r}; expected a bool")
    d_initial = cfg.get("d_initial", 0.1)
    if not _is_number(d_initial):
        raise AdapterError(f"invalid adapter config {cfg_file}: d_initial={d_initial!r} is not a number")
    targets = _check_patterns_field(cfg_file, "target_modules", cfg.get("target_modules"), required=True)
    bad = [f"{k}={v!r}" for k, v in cfg.items()
           if k not in _VERA_IMPLEMENTED | _VERA_NO_EFFECT and not _is_off(k, v)]
    if bad:
        raise AdapterError(f"{cfg_file}: VeRA adapter uses {', '.join(bad)}, which lora_lab's VeRALinear does not "
                           "implement")
    return {"peft_type": "VERA", "r": r, "vera_dropout": float(dropout), "projection_prng_key": key,
            "save_projection": save_projection, "target_modules": targets, "d_initial": float(d_initial)}

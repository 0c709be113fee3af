"""Adapters on disk in PEFT's format.

A directory with ``adapter_config.json`` (PEFT's LoraConfig fields) and
``adapter_model.safetensors`` whose keys are PEFT's:
``base_model.model.<module name>.lora_A.weight`` (r x in) and ``...lora_B.weight`` (out x r), and for DoRA
``...lora_magnitude_vector`` (out). So an adapter trained here loads with ``peft.PeftModel.from_pretrained`` and a
PEFT-saved LoRA adapter loads here. rsLoRA and DoRA (``use_rslora``, ``use_dora``) and per-layer ranks and alphas
(``rank_pattern``, ``alpha_pattern``) travel both ways.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from torch import nn

from lora_lab.layer import (
    LoRALinear,
    _install,
    _lora_internals,
    _matches,
    _refuse_peft_layers,
    _select,
    _wrap,
    lora_layers,
)
from lora_lab.vera import VeRALinear, vera_layers, vera_projections

__all__ = ["save_adapter", "load_adapter", "AdapterError", "AdapterNotFoundError", "AdapterExistsError",
           "peft_lora_model", "peft_lora_pairs", "copy_adapters_to_peft"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
LEGACY_WEIGHTS_NAME = "adapter_model.bin"
PREFIX = "base_model.model."
# LoRA-FA (A frozen) has no LoraConfig field (PEFT does it in an optimizer, create_lorafa_optimizer): lora_lab writes
# it under its own key, true for every layer or a list of module names, which PEFT's config loader drops (with a
# warning about an unexpected key) and load_adapter restores.
LORA_FA_KEY = "lora_lab_lora_fa"


class AdapterError(ValueError):
    """An adapter that does not fit the model, is broken on disk, or uses a PEFT feature lora_lab does not implement."""


class AdapterNotFoundError(AdapterError, FileNotFoundError):
    """A path that holds no adapter (no directory, no adapter_config.json or no weights file)."""


class AdapterExistsError(AdapterError, FileExistsError):
    """``save_adapter`` into a directory that already holds an adapter, without ``overwrite=True``."""


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


def _check_destination(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise AdapterExistsError(f"{out} is a file, not a directory: cannot save an adapter there")
    present = [f for f in (CONFIG_NAME, WEIGHTS_NAME, LEGACY_WEIGHTS_NAME) if (out / f).exists()]
    if present and not overwrite:
        raise AdapterExistsError(
            f"{out} already holds an adapter ({', '.join(present)}); pass overwrite=True to replace it, "
            "or choose another directory"
        )


def save_adapter(model: nn.Module, path: str | Path, overwrite: bool = False) -> Path:
    """Write the model's LoRA weights and config to ``path`` in PEFT's format. Returns the directory.

    Layers with different r or alpha are written with PEFT's ``rank_pattern``/``alpha_pattern``; dropout,
    ``use_rslora``, ``use_dora`` and ``init_lora_weights`` must be the same for every layer (PEFT stores one value
    each). A PiSSA adapter (``init_lora_weights="pissa"``) loads on the original base model, whose weights PEFT
    and ``load_adapter`` turn into the same residual. A directory that already holds an adapter is refused unless
    ``overwrite=True``. LoRA-FA layers (A frozen) are recorded under the key ``lora_lab_lora_fa``, which PEFT's
    loader ignores and :func:`load_adapter` restores. A model with VeRA layers (:func:`lora_lab.vera.add_vera`) is
    saved as PEFT's VeRA adapter (``peft_type`` VERA, the shared projections included: ``save_projection=True``).
    """
    return _save_adapter(model, path, overwrite, lambda t: t.detach().contiguous().cpu())


def _save_adapter(model: nn.Module, path: str | Path, overwrite: bool, value_of) -> Path:
    """:func:`save_adapter` with ``value_of(parameter)`` giving the CPU tensor to write (a sharded model passes the
    full tensors it gathered)."""
    from safetensors.torch import save_file

    layers = lora_layers(model)
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
        tensors[f"{PREFIX}{name}.lora_A.weight"] = value_of(layer.lora_A)
        tensors[f"{PREFIX}{name}.lora_B.weight"] = value_of(layer.lora_B)
        if layer.magnitude is not None:
            tensors[f"{PREFIX}{name}.lora_magnitude_vector"] = value_of(layer.magnitude)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    config = _peft_config(r, alpha, first.dropout_p, targets, exclude, base_name, use_rslora=first.use_rslora,
                          use_dora=first.use_dora, rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
                          init_lora_weights=first.init_lora_weights)
    frozen_a = [name for name, layer in layers if layer.lora_fa]
    if frozen_a:
        config[LORA_FA_KEY] = True if len(frozen_a) == len(layers) else frozen_a
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out


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
    "use_rslora", "use_dora", "rank_pattern", "alpha_pattern", LORA_FA_KEY,
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

    bad = [f"{k}={v!r}" for k, v in cfg.items() if k not in _IMPLEMENTED | _NO_EFFECT and not _is_off(k, v)]
    if bad:
        raise AdapterError(
            f"{cfg_file}: adapter uses {', '.join(bad)}, which lora_lab's LoRALinear does not implement"
        )
    return {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "lora_dropout": float(dropout), "target_modules": targets,
            "exclude_modules": exclude, "init_lora_weights": init, "rank_pattern": rank_pattern,
            "alpha_pattern": alpha_pattern, "lora_fa": lora_fa, **flags}


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


def _check_finite(tensors: dict[str, torch.Tensor], source: Path) -> dict[str, torch.Tensor]:
    """``tensors``, after checking that none holds a NaN or an infinity (PEFT loads such an adapter silently, and
    the model's outputs turn into NaN)."""
    for key, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            raise AdapterError(f"{source}: tensor {key!r} holds non-finite values ({nan} NaN, {inf} inf of "
                               f"{t.numel()}); refusing to load a broken adapter")
    return tensors


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    weights = path / WEIGHTS_NAME
    if weights.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(weights))
        except (SafetensorError, OSError, ValueError) as exc:
            raise AdapterError(f"{weights} is not a readable safetensors file (truncated or corrupt?): {exc}") from exc
        return _check_finite(tensors, weights)
    legacy = path / LEGACY_WEIGHTS_NAME
    if legacy.is_file():
        import pickle

        try:
            tensors = torch.load(legacy, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as exc:
            raise AdapterError(f"{legacy} is not a readable torch checkpoint (truncated or corrupt?): {exc}") from exc
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise AdapterError(f"{legacy} does not hold a dict of tensors")
        return _check_finite(tensors, legacy)
    raise AdapterNotFoundError(f"{path} holds neither {WEIGHTS_NAME} nor {LEGACY_WEIGHTS_NAME}")


_TENSOR_SUFFIXES = {
    "A": (".lora_A.weight", ".lora_A.default.weight"),
    "B": (".lora_B.weight", ".lora_B.default.weight"),
    "M": (".lora_magnitude_vector", ".lora_magnitude_vector.weight", ".lora_magnitude_vector.default.weight"),
}


def _module_name(key: str, source: Path) -> tuple[str, str]:
    """'base_model.model.X.lora_A.weight' -> ('X', 'A'); '...X.lora_magnitude_vector' -> ('X', 'M') (DoRA).
    Tolerates an adapter name ('lora_A.default.weight')."""
    k = key[len(PREFIX):] if key.startswith(PREFIX) else key
    for which, suffixes in _TENSOR_SUFFIXES.items():
        for suffix in suffixes:
            if k.endswith(suffix):
                return k[: -len(suffix)], which
    raise AdapterError(
        f"{source}: unexpected tensor {key!r} in the adapter (expected ...lora_A.weight / ...lora_B.weight, "
        "and ...lora_magnitude_vector with use_dora)"
    )


@torch.no_grad()
def load_adapter(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a PEFT-format LoRA adapter into ``model``.

    A model without LoRA gets it at the modules PEFT would wrap (``target_modules`` minus
    ``exclude_modules``), with the adapter's r, alpha (per layer through ``rank_pattern``/``alpha_pattern``,
    as PEFT resolves them), dropout, ``use_rslora`` and ``use_dora``; a model that already has LoRA must
    match. Whatever would make the model compute something other than PEFT's reload of the same files
    is refused by name (``modules_to_save``, ``lora_bias``, pissa_niter_*/OLoRA/CorDA/LoftQ/LoRA-GA inits, ...).
    A PiSSA adapter turns the targeted base weights into PiSSA's residual, as PEFT's reload does, so give it
    the original base model.
    A MiCA adapter (``init_lora_weights="mica"``) loads with B frozen, as PEFT trains it; a LoRA-FA adapter
    (saved from ``add_lora(..., lora_fa=True)``: the ``lora_lab_lora_fa`` key) with A frozen. A tensor holding a
    NaN or an infinity is refused by name. A VeRA adapter
    (``peft_type`` VERA) loads into a model without adapters as :class:`~lora_lab.vera.VeRALinear` layers.
    Every tensor's module and shape is checked before anything is changed, so a failing call leaves the
    model as it was.
    """
    path = Path(path)
    cfg = _read_config(path)
    tensors = _read_tensors(path)
    source = path / WEIGHTS_NAME if (path / WEIGHTS_NAME).is_file() else path / LEGACY_WEIGHTS_NAME
    _refuse_peft_layers(model, "load_adapter", AdapterError)
    if cfg["peft_type"] == "VERA":
        return _load_vera(model, cfg, tensors, source)
    if vera_layers(model):
        raise AdapterError(
            f"{type(model).__name__} carries VeRA layers; a LoRA adapter loads into a model without them"
        )
    targets, exclude = cfg["target_modules"], cfg["exclude_modules"]
    use_rslora, use_dora = cfg["use_rslora"], cfg["use_dora"]

    def rank_alpha(name):
        return (_pattern_value(cfg["rank_pattern"], name, cfg["r"]),
                _pattern_value(cfg["alpha_pattern"], name, cfg["lora_alpha"]))

    existing = dict(lora_layers(model))
    if existing:
        planned = {n: (m.base.in_features, m.base.out_features, m.r) for n, m in existing.items()}
        for n, m in existing.items():
            r, alpha = rank_alpha(n)
            if (m.r, m.alpha) != (r, alpha):
                raise AdapterError(f"{n} has r={m.r}, alpha={m.alpha} but the adapter has r={r}, lora_alpha={alpha}")
            for field in ("use_rslora", "use_dora"):
                if getattr(m, field) != cfg[field]:
                    raise AdapterError(f"{n} has {field}={getattr(m, field)} but the adapter has {field}={cfg[field]}")
            if (m.init_lora_weights == "pissa") != (cfg["init_lora_weights"] == "pissa"):
                raise AdapterError(f"{n} has init_lora_weights={m.init_lora_weights!r} but the adapter has "
                                   f"init_lora_weights={cfg['init_lora_weights']!r}: the base weights do not fit")
    else:
        modules = _select(model, targets, exclude)  # "all-linear" expanded as PEFT does
        bad = [(n, type(m).__name__) for n, m in modules if not isinstance(m, nn.Linear)]
        if bad:
            raise AdapterError(f"adapter targets {bad[0][0]}, a {bad[0][1]}; only nn.Linear targets are supported")
        planned = {n: (m.in_features, m.out_features, rank_alpha(n)[0]) for n, m in modules}
    if not planned:
        raise AdapterError(
            f"adapter targets {targets!r}" + (f" (exclude_modules {exclude!r})" if exclude else "")
            + f" match no module of {type(model).__name__}"
        )

    if cfg["init_lora_weights"] == "pissa" and not existing:
        small = [n for n, (fan_in, fan_out, r) in planned.items() if r > min(fan_in, fan_out)]
        if small:
            raise AdapterError(f"init_lora_weights='pissa' needs r <= min(in, out), which {small[0]} does not meet")

    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name, which = _module_name(key, source)
        if name not in planned:
            raise AdapterError(f"adapter tensor {key!r} is for {name}, which the model has no LoRA target at")
        if which == "M" and not use_dora:
            raise AdapterError(f"adapter tensor {key!r} is a DoRA magnitude, but the config says use_dora=false")
        fan_in, fan_out, r = planned[name]
        want = {"A": (r, fan_in), "B": (fan_out, r), "M": (fan_out,)}[which]
        if tuple(t.shape) != want:
            label = "lora_magnitude_vector" if which == "M" else f"lora_{which}"
            raise AdapterError(
                f"{name}.{label}: adapter has shape {tuple(t.shape)}, the model needs {want} "
                f"(r={r}, in={fan_in}, out={fan_out})"
            )
        if not t.is_floating_point():
            raise AdapterError(f"{source}: {key} holds {t.dtype} values, not floating point")
        found.setdefault(name, {})[which] = t
    lora_fa = cfg["lora_fa"]
    unknown = [n for n in lora_fa if n not in planned] if isinstance(lora_fa, list) else []
    if unknown:
        raise AdapterError(f"{source.parent / CONFIG_NAME}: {LORA_FA_KEY} names {unknown[0]}, which the adapter has no "
                           "LoRA layer at")
    need = {"A", "B", "M"} if use_dora else {"A", "B"}
    missing = [n for n in planned if set(found.get(n, {})) != need]
    if missing:
        more = f" and {len(missing)-1} more" if len(missing) > 1 else ""
        what = "lora_A/lora_B/lora_magnitude_vector (use_dora)" if use_dora else "lora_A/lora_B"
        raise AdapterError(f"adapter has no {what} for {missing[0]}" + more)

    if not existing:
        specs = {}
        for n in planned:
            r, alpha = rank_alpha(n)
            specs[n] = {"r": r, "alpha": alpha, "dropout": cfg["lora_dropout"], "use_rslora": use_rslora,
                        "use_dora": use_dora, "init_lora_weights": "pissa" if cfg["init_lora_weights"] == "pissa"
                        else True}
        _wrap(model, specs)
        model._lora_lab_config = {"r": cfg["r"], "alpha": cfg["lora_alpha"], "dropout": cfg["lora_dropout"],
                                  "targets": targets, "exclude": exclude}
    layers = dict(lora_layers(model))
    for name, tensors_of in found.items():
        layer: LoRALinear = layers[name]
        layer.lora_A.copy_(tensors_of["A"].to(layer.lora_A.dtype))
        layer.lora_B.copy_(tensors_of["B"].to(layer.lora_B.dtype))
        if use_dora:
            layer.magnitude.copy_(tensors_of["M"].to(layer.magnitude.dtype))
        if cfg["init_lora_weights"] == "mica":
            layer.lora_B.requires_grad_(False)
        if lora_fa is True or isinstance(lora_fa, list) and name in lora_fa:
            layer.freeze_A()
    return model


# ---------------------------------------------------------------------------------------------
# VeRA adapters (PEFT's peft_type VERA)
# ---------------------------------------------------------------------------------------------

# VeraConfig fields read here, and those that do not change the model PEFT builds; any other must be off.
_VERA_IMPLEMENTED = {"peft_type", "r", "target_modules", "vera_dropout", "projection_prng_key", "save_projection",
                     "d_initial", "init_weights"}
_VERA_NO_EFFECT = {"task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping",
                   "peft_version", "layers_pattern"}
VERA_A_KEY, VERA_B_KEY = "base_model.vera_A", "base_model.vera_B"


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
    if cfg["save_projection"]:
        a, b = tensors[VERA_A_KEY], tensors[VERA_B_KEY]
    else:
        a, b = vera_projections(r, in_max, out_max, cfg["projection_prng_key"])
    w = modules[0][1].weight
    a, b = a.to(device=w.device, dtype=w.dtype), b.to(device=w.device, dtype=w.dtype)
    wrapped = [(n, VeRALinear(m, a, b, dropout=cfg["vera_dropout"])) for n, m in modules]
    for n, layer in wrapped:
        layer.lambda_b.copy_(tensors[f"{PREFIX}{n}.vera_lambda_b"].to(layer.lambda_b.dtype))
        layer.lambda_d.copy_(tensors[f"{PREFIX}{n}.vera_lambda_d"].to(layer.lambda_d.dtype))
    _install(model, wrapped)
    model._lora_lab_vera = {"projection_prng_key": cfg["projection_prng_key"], "d_initial": cfg["d_initial"]}
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

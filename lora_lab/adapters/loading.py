"""``load_adapter``: a PEFT adapter directory (LoRA, its variants, or VeRA) loaded into a model, checked in full before
the model changes."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lora_lab.adapters.errors import AdapterError
from lora_lab.adapters.full_weights import split_full_tensors
from lora_lab.adapters.peft_config import LORA_FA_KEY, _pattern_value, _read_config
from lora_lab.adapters.peft_files import CONFIG_NAME, LEGACY_WEIGHTS_NAME, WEIGHTS_NAME, _module_name, _read_tensors
from lora_lab.adapters.vera_format import _load_vera
from lora_lab.dtypes import as_float_dtype
from lora_lab.layer import _wrap, all_lora_layers
from lora_lab.targets import _refuse_peft_layers, _refuse_unwrappable, _select
from lora_lab.vera import vera_layers

__all__ = ["load_adapter"]


@torch.no_grad()
def load_adapter(model: nn.Module, path: str | Path, *, adapter_dtype: torch.dtype | str | None = None) -> nn.Module:
    """Load a PEFT-format LoRA adapter into ``model``.

    A model without LoRA gets it at the modules PEFT would wrap (``target_modules`` minus
    ``exclude_modules``), with the adapter's r, alpha (per layer through ``rank_pattern``/``alpha_pattern``,
    as PEFT resolves them), dropout, ``use_rslora`` and ``use_dora``; a model that already has LoRA must
    match. Whatever would make the model compute something other than PEFT's reload of the same files
    is refused by name (``trainable_token_indices``, ``lora_bias``, pissa_niter_*/OLoRA/CorDA/LoftQ/LoRA-GA inits, ...).
    A PiSSA adapter turns the targeted base weights into PiSSA's residual, as PEFT's reload does, so give it
    the original base model.
    A MiCA adapter (``init_lora_weights="mica"``) loads with B frozen, as PEFT trains it; a LoRA-FA adapter
    (saved from ``add_lora(..., lora_fa=True)``: the ``lora_lab_lora_fa`` key) with A frozen. A tensor holding a
    NaN or an infinity is refused by name. A VeRA adapter
    (``peft_type`` VERA) loads into a model without adapters as :class:`~lora_lab.vera.VeRALinear` layers.
    Every tensor's module and shape is checked before anything is changed, so a failing call leaves the
    model as it was. New layers take the train/eval mode of the modules they replace (an eval-mode model loads
    with dropout off, as PEFT's reload).

    LoRA on an ``nn.Embedding`` (``lora_embedding_A``/``lora_embedding_B``) loads as a
    :class:`~lora_lab.embedding_lora.LoRAEmbedding`, ``modules_to_save`` as trainable copies
    (:class:`~lora_lab.modules_to_save.TrainedCopy`) of the modules it selects. Base weights in the file (PEFT's
    default save of an adapter that targets ``embed_tokens`` or ``lm_head`` holds ``...base_layer.weight``) are
    compared with the model's: equal ones change nothing; different ones are copied into the model, as PEFT's reload
    does, with a warning that names them.

    ``adapter_dtype``: the dtype of the new LoRA factors. ``None`` (default) is PEFT's ``autocast_adapter_dtype=True``:
    fp32 on a bf16/fp16 model, whatever dtype the file holds, else the weight's dtype. A float dtype (or its name)
    forces it, as ``add_lora``'s argument; ``"saved"`` keeps the dtype of the saved tensors, e.g. a bf16 adapter
    saved from ``add_lora(..., adapter_dtype="bf16")`` reloads in bf16 and computes what it did.
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

    saved_dtype = isinstance(adapter_dtype, str) and adapter_dtype == "saved"
    if adapter_dtype is not None and not saved_dtype:
        as_float_dtype(adapter_dtype, "adapter_dtype")
    existing = dict(all_lora_layers(model))
    if existing and adapter_dtype is not None:
        raise AdapterError(f"adapter_dtype={adapter_dtype!r}: {type(model).__name__} already carries LoRA layers, "
                           "which keep their dtype; pass adapter_dtype only when loading into a model without LoRA")
    if existing:
        planned = {n: (m.in_features, m.out_features, m.r) for n, m in existing.items()}
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
        bad = [(n, type(m).__name__) for n, m in modules if not isinstance(m, (nn.Linear, nn.Embedding))]
        if bad:
            raise AdapterError(f"adapter targets {bad[0][0]}, a {bad[0][1]}; only nn.Linear and nn.Embedding targets "
                               "are supported")
        _refuse_unwrappable(model, [n for n, _ in modules], "load_adapter", AdapterError)
        embeddings = [n for n, m in modules if isinstance(m, nn.Embedding)]
        if embeddings and (use_dora or cfg["init_lora_weights"] in ("pissa", "mica")):
            what = "use_dora" if use_dora else f"init_lora_weights={cfg['init_lora_weights']!r}"
            raise AdapterError(f"adapter targets {embeddings[0]}, an nn.Embedding, with {what}, which lora_lab "
                               "implements for nn.Linear targets only")
        planned = {n: (m.num_embeddings, m.embedding_dim, rank_alpha(n)[0]) if isinstance(m, nn.Embedding)
                   else (m.in_features, m.out_features, rank_alpha(n)[0]) for n, m in modules}
        is_embedding = set(embeddings)
    if not planned:
        raise AdapterError(
            f"adapter targets {targets!r}" + (f" (exclude_modules {exclude!r})" if exclude else "")
            + f" match no module of {type(model).__name__}"
        )

    if cfg["init_lora_weights"] == "pissa" and not existing:
        small = [n for n, (fan_in, fan_out, r) in planned.items() if r > min(fan_in, fan_out)]
        if small:
            raise AdapterError(f"init_lora_weights='pissa' needs r <= min(in, out), which {small[0]} does not meet")

    if existing:
        is_embedding = {n for n, m in existing.items() if not hasattr(m, "lora_A")}
    tensors, full = split_full_tensors(model, cfg, tensors, planned, existing, source)
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name, which = _module_name(key, source)
        if name not in planned and existing:
            raise AdapterError(
                f"adapter tensor {key!r} is for {name}, which carries no LoRA layer in this model; its LoRA layers are "
                f"at {', '.join(sorted(existing)[:3])}{', ...' if len(existing) > 3 else ''}. Load the adapter into a "
                "model without LoRA (load_adapter adds its layers) or into one with LoRA at the adapter's targets"
            )
        if name not in planned:
            raise AdapterError(f"adapter tensor {key!r} is for {name}, which the model has no LoRA target at")
        if which.startswith("E") != (name in is_embedding):
            kind = "nn.Embedding" if which[0] == "E" else "nn.Linear"
            raise AdapterError(f"adapter tensor {key!r} is LoRA for an {kind}, but {name} is not one")
        which = which[-1] if which[0] == "E" else which
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
                        else True,
                        "adapter_dtype": found[n]["A"].dtype if saved_dtype else adapter_dtype}
        _wrap(model, specs)
        model._lora_lab_config = {"r": cfg["r"], "alpha": cfg["lora_alpha"], "dropout": cfg["lora_dropout"],
                                  "targets": targets, "exclude": exclude}
    layers = dict(all_lora_layers(model))
    for name, tensors_of in found.items():
        layer = layers[name]
        if name in is_embedding:
            layer.lora_embedding_A.copy_(tensors_of["A"].to(layer.lora_embedding_A.dtype))
            layer.lora_embedding_B.copy_(tensors_of["B"].to(layer.lora_embedding_B.dtype))
            continue
        layer.lora_A.copy_(tensors_of["A"].to(layer.lora_A.dtype))
        layer.lora_B.copy_(tensors_of["B"].to(layer.lora_B.dtype))
        if use_dora:
            layer.magnitude.copy_(tensors_of["M"].to(layer.magnitude.dtype))
        if cfg["init_lora_weights"] == "mica":
            layer.lora_B.requires_grad_(False)
        if lora_fa is True or isinstance(lora_fa, list) and name in lora_fa:
            layer.freeze_A()
    full.apply(model, layers)
    return model

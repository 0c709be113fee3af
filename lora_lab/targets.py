"""Which modules an adapter wraps: PEFT's ``target_modules`` / ``exclude_modules`` rules, ``"all-linear"``, and the
checks that turn a selection nobody meant into an error that names the problem.

PEFT's rule: a list of names matches a module whose name equals an entry or ends with ``.entry``; a single string
is a regular expression that must match the whole name; ``"all-linear"`` is every ``nn.Linear`` but the output
head. Used by ``add_lora`` (:mod:`lora_lab.layer`), ``add_vera`` and the adapter loaders.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from torch import nn

from lora_lab.adapter_layer import AdapterLinear, adapter_layers

__all__ = ["ALL_LINEAR", "all_linear", "find_target_linears", "peft_layers"]


def _matches(name: str, targets: Sequence[str] | str) -> bool:
    """PEFT's rule: a list matches a module whose name equals a target or ends with '.target';
    a single string is a regular expression that must match the whole name."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


ALL_LINEAR = "all-linear"


def _is_all_linear(targets) -> bool:
    """PEFT's shorthand ``target_modules="all-linear"`` (any case)."""
    return isinstance(targets, str) and targets.lower() == ALL_LINEAR


def all_linear(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """What PEFT's ``target_modules="all-linear"`` selects: every ``nn.Linear`` except the output head (the
    module ``model.get_output_embeddings()`` returns, e.g. ``lm_head``) and the linears inside adapter layers."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    internals = _lora_internals(model)
    return [(n, m) for n, m in model.named_modules()
            if n and isinstance(m, nn.Linear) and m is not head and n not in internals]


def _select(model: nn.Module, targets, exclude=None) -> list[tuple[str, nn.Module]]:
    """The modules PEFT would wrap for ``target_modules=targets, exclude_modules=exclude``, in model order."""
    if _is_all_linear(targets):
        candidates = all_linear(model)
    else:
        candidates = [(n, m) for n, m in model.named_modules() if n and _matches(n, targets)]
    return [(n, m) for n, m in candidates if not (exclude is not None and _matches(n, exclude))]


def find_target_linears(model: nn.Module, targets: Sequence[str] | str) -> list[tuple[str, nn.Module]]:
    """Modules whose names match ``targets`` (PEFT's matching rule, ``"all-linear"`` included), in model order."""
    return _select(model, targets)


def peft_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The PEFT adapter layers (subclasses of peft's ``BaseTunerLayer``: ``lora.Linear``, ...) in ``model``;
    found by class name, so that peft need not be imported."""
    return [(n, m) for n, m in model.named_modules()
            if any(c.__name__ == "BaseTunerLayer" and c.__module__.startswith("peft.") for c in type(m).__mro__)]


def _refuse_peft_layers(model: nn.Module, action: str, error: type[Exception] = ValueError) -> None:
    """A clear error for lora_lab's layers on top of PEFT's: say what the model carries and how to get a base."""
    found = peft_layers(model)
    if found:
        name, layer = found[0]
        more = f" and {len(found) - 1} more" if len(found) > 1 else ""
        raise error(
            f"{type(model).__name__} already carries PEFT adapter layers ({name} is a peft "
            f"{type(layer).__module__.rsplit('.', 1)[-1]}.{type(layer).__name__}{more}); {action} works on a "
            "model of plain nn.Linear layers. Take the base model back from PEFT first: "
            "model = peft_model.merge_and_unload() (the PEFT adapter merged into the weights) or "
            "model = peft_model.unload() (the adapter dropped); or save the PEFT adapter with "
            "peft_model.save_pretrained(path) and load it into the plain base model with "
            "lora_lab.load_adapter(base, path)"
        )


def _lora_internals(model: nn.Module) -> set[str]:
    """Names of the modules inside adapter layers (their ``base``): not targets in their own right."""
    return {f"{n}.{sub}" for n, layer in adapter_layers(model) for sub, _ in layer.named_modules() if sub}


def _nearest_names(target: str, names: Iterable[str]) -> list[str]:
    """The module names closest to ``target`` (difflib), compared at the same depth: a dotless target against
    the last component of each name, ``self_attn.q_proj`` against the last two, and so on."""
    import difflib

    depth = target.count(".") + 1
    tails = {".".join(n.split(".")[-depth:]) for n in names if n.count(".") + 1 >= depth}
    return difflib.get_close_matches(target, sorted(tails), n=3, cutoff=0.6)


def _check_patterns(model: nn.Module, names: Sequence[str], patterns, what: str) -> None:
    """Every entry of a list of ``targets``/``exclude`` must match some module; a regex string must match one."""
    linear_names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
    linears = f"its linear layers are named: {', '.join(linear_names) or '(none)'}"
    if isinstance(patterns, str):
        if not any(_matches(n, patterns) for n in names):
            ends = [n for n in names if _matches(n, (patterns,))]
            if ends:  # a module name given as a string: PEFT reads it as a regex over the whole name, too
                regex = ".*\\." + patterns
                raise ValueError(
                    f"{what}={patterns!r} is a string, which lora_lab (like PEFT's target_modules) reads as one "
                    f"regular expression that must match a whole module name, such as {ends[0]!r}; it matches none. "
                    f"To select every module whose name ends in {patterns!r}, pass a list: {what}=[{patterns!r}] "
                    f"(or the regex {what}=r'{regex}')"
                )
            raise ValueError(f"{what} {patterns!r} match no module of {type(model).__name__}; {linears}")
        return
    missing = [t for t in patterns if not any(_matches(n, (t,)) for n in names)]
    if missing:
        near = "; ".join(
            f"{t!r} is nearest to {', '.join(_nearest_names(t, names)) or '(nothing close)'}" for t in missing
        )
        raise ValueError(
            f"{what} {tuple(missing)!r} match no module of {type(model).__name__} ({near}); {linears}"
        )


def _as_patterns(patterns, what: str, allow_none: bool = False):
    """A regex string or a tuple of names (PEFT's two forms); refuses empty ones and non-strings."""
    if patterns is None and allow_none:
        return None
    if isinstance(patterns, str):
        if not patterns:
            raise ValueError(f"{what} is empty")
        try:
            re.compile(patterns)
        except re.error as exc:
            raise ValueError(f"{what} {patterns!r} is not a valid regular expression: {exc}") from None
        return patterns
    try:
        patterns = tuple(patterns)
    except TypeError:
        raise TypeError(f"{what} must be a string (a regex) or a sequence of module names, got {patterns!r}") from None
    if not patterns:
        raise ValueError(f"{what} is empty")
    bad = [t for t in patterns if not isinstance(t, str) or not t]
    if bad:
        raise TypeError(f"{what} must hold non-empty module names (strings), got {bad[0]!r}")
    return patterns


def _matched_linears(model: nn.Module, targets, exclude, what: str, allow_embedding: bool = False):
    """(targets, exclude, [(name, nn.Linear)]) for PEFT-style ``targets``/``exclude``, after every check: each
    entry matches some module, no target already carries an adapter or lies inside one, every target is an
    ``nn.Linear`` (or, with ``allow_embedding``, an ``nn.Embedding``; else a TypeError saying ``what`` only wraps
    linear layers), something is left to wrap."""
    _refuse_peft_layers(model, what)
    targets = _as_patterns(targets, "targets")
    exclude = _as_patterns(exclude, "exclude", allow_none=True)
    names = [n for n, _ in model.named_modules() if n]
    if _is_all_linear(targets):
        if not all_linear(model):
            raise ValueError(f"targets={targets!r}: {type(model).__name__} has no nn.Linear outside its output head "
                             "and its adapter layers")
    else:
        _check_patterns(model, names, targets, "targets")
    if exclude is not None:
        _check_patterns(model, names, exclude, "exclude")
    matched = _select(model, targets, exclude)
    already = [(n, m.kind) for n, m in matched if isinstance(m, AdapterLinear)]
    if already:
        raise ValueError(
            f"{already[0][1]} is already applied to {already[0][0]}"
            + (f" (and {len(already) - 1} more)" if len(already) > 1 else "")
            + "; merge_lora(model) or start from a fresh model before wrapping again"
        )
    internals = _lora_internals(model)
    inside = [n for n, _ in matched if n in internals]
    if inside:
        raise ValueError(
            f"target {inside[0]} is part of a LoRA layer ({inside[0].rsplit('.', 1)[0]}); LoRA cannot wrap "
            "a layer that already carries LoRA"
        )
    kinds = (nn.Linear, nn.Embedding) if allow_embedding else nn.Linear
    not_linear = [(n, type(m).__name__) for n, m in matched if not isinstance(m, kinds)]
    if not_linear:
        n, t = not_linear[0]
        also = " or nn.Embedding" if allow_embedding else ""
        raise TypeError(f"target {n} is a {t}, not an nn.Linear{also}; {what} only wraps linear"
                        f"{' and embedding' if allow_embedding else ''} layers")
    if not matched:
        raise ValueError(f"exclude={exclude!r} excludes every module that targets={targets!r} match: nothing to wrap")
    _refuse_unwrappable(model, [n for n, _ in matched], what)
    return targets, exclude, matched


def _refuse_unwrappable(model: nn.Module, names: Iterable[str], what: str, error: type[Exception] = ValueError) -> None:
    """Refuse a linear its parent never calls: ``nn.MultiheadAttention`` reads ``out_proj.weight`` and ``.bias``
    directly, so a wrapper there would be skipped (and break MHA's forward)."""
    for n in names:
        parent_name, _, child = n.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(parent, nn.MultiheadAttention) and child == "out_proj":
            raise error(
                f"target {n} is the out_proj of an nn.MultiheadAttention ({parent_name or 'the model'}), which reads "
                f"its weight directly instead of calling it; {what} cannot wrap it (exclude it from the targets)"
            )

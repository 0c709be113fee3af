"""PEFT's ``modules_to_save``: whole modules (a classifier head, ``lm_head``, ...) trained in full beside a LoRA
adapter. Each such module is kept frozen as ``base`` and a trainable copy, ``trained``, computes in its place
(:class:`TrainedCopy`, PEFT's ``ModulesToSaveWrapper``). ``merge_lora`` puts the trained copy in the module's place,
``remove_lora`` the original.

PEFT's rule for which modules an entry selects: every module whose name ends with the entry (a plain string
suffix, not only after a dot).
"""
from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from lora_lab.adapter_layer import AdapterLinear, adapter_layers, install_adapter_layers

__all__ = ["TrainedCopy", "trained_copies"]


class TrainedCopy(AdapterLinear):
    """A module trained in full: ``base`` (the original, frozen) and ``trained`` (a deep copy, trainable), which
    the forward calls. ``entry`` is the ``modules_to_save`` entry that selected it (written back at save). Other
    attributes (``weight``, ``in_features``, ...) read through to the trained copy, as PEFT's wrapper does.

    On a model with tied input and output embeddings, the copy of one of them has its own weight: training it
    leaves the other one as it was (PEFT's default, ``ensure_weight_tying=False``).
    """

    kind = "modules_to_save"

    def __init__(self, base: nn.Module, entry: str | None = None):
        super().__init__()
        self.base = base
        self.trained = copy.deepcopy(base)
        self.entry = entry
        for p in self.base.parameters():
            p.requires_grad_(False)
        for p in self.trained.parameters():
            p.requires_grad_(p.is_floating_point() or p.is_complex())
        self.train(base.training)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")  # absent while copy/pickle rebuild the object
            if modules is None or "trained" not in modules or name.startswith("__") or name in ("base", "trained"):
                raise
            return getattr(modules["trained"], name)

    def forward(self, *args, **kwargs):
        return self.trained(*args, **kwargs)

    def merge(self, compute_dtype: torch.dtype | str = torch.float32) -> nn.Module:
        """The trained copy, which takes the original's place (PEFT's ``merge_and_unload``)."""
        return self.trained

    def extra_repr(self) -> str:
        return f"modules_to_save entry={self.entry!r}"


def trained_copies(model: nn.Module) -> list[tuple[str, TrainedCopy]]:
    """The ``modules_to_save`` modules of a model (:class:`TrainedCopy`), with their module names."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, TrainedCopy)]


def _internals(model: nn.Module) -> set[str]:
    return {f"{n}.{sub}" for n, layer in adapter_layers(model) for sub, _ in layer.named_modules() if sub}


def select_modules_to_save(model: nn.Module, entries: Sequence[str]) -> list[tuple[str, str, nn.Module]]:
    """[(module name, entry, module)] that PEFT wraps for ``modules_to_save=entries``: names ending with an entry,
    in model order, adapter layers' insides left out (a module already wrapped is found by its own name)."""
    internals = _internals(model)
    found = []
    for name, module in model.named_modules(remove_duplicate=False):
        if not name or name in internals:
            continue
        entry = next((e for e in entries if name.endswith(e)), None)
        if entry is not None:
            found.append((name, entry, module))
    return found


def _as_entries(entries, what: str = "modules_to_save") -> tuple[str, ...]:
    if isinstance(entries, str):
        entries = (entries,)
    try:
        entries = tuple(entries)
    except TypeError:
        raise TypeError(f"{what} must be a list of module names, got {entries!r}") from None
    bad = [e for e in entries if not isinstance(e, str) or not e]
    if bad:
        raise TypeError(f"{what} must hold non-empty module names (strings), got {bad[0]!r}")
    if not entries:
        raise ValueError(f"{what} is empty")
    return entries


def plan_modules_to_save(model: nn.Module, entries, lora_targets: Sequence[str] = (),
                         error: type[Exception] = ValueError,
                         strict: bool = True) -> list[tuple[str, str, nn.Module]]:
    """Check ``modules_to_save=entries`` against ``model`` before anything changes; returns what to wrap.

    With ``strict`` every entry must select some module (a typo is an error); PEFT's loader skips entries that match
    nothing, and so does ``strict=False``. A selected module may not be, hold or sit inside a LoRA target
    (``lora_targets``) or an adapter layer already in the model, and may not hold another selected module.
    """
    entries = _as_entries(entries)
    found = select_modules_to_save(model, entries)
    if strict:
        missing = [e for e in entries if not any(entry == e for _, entry, _ in found)]
        if missing:
            raise error(f"modules_to_save entry {missing[0]!r} matches no module of {type(model).__name__} "
                        "(PEFT's rule: a module whose name ends with the entry)")
    names = [n for n, _, _ in found]
    adapters = [n for n, _ in adapter_layers(model)]

    def related(a: str, b: str) -> bool:
        return a == b or a.startswith(b + ".") or b.startswith(a + ".")

    for name, _, module in found:
        if isinstance(module, TrainedCopy):
            raise error(f"{name} is already in modules_to_save (a TrainedCopy); merge_lora(model) or start from a "
                        "fresh model before selecting it again")
        clash = next((t for t in list(lora_targets) + adapters if related(name, t)), None)
        if clash is not None:
            raise error(f"modules_to_save selects {name}, which is, holds or sits inside the adapter layer {clash}; "
                        "a module is either trained in full or given LoRA, not both")
        inner = next((o for o in names if o != name and related(name, o)), None)
        if inner is not None:
            raise error(f"modules_to_save selects both {name} and {inner}, one inside the other")
    return found


def install_modules_to_save(model: nn.Module, plan: list[tuple[str, str, nn.Module]]) -> list[TrainedCopy]:
    """Wrap every planned module in a :class:`TrainedCopy` (trainable copy); every other parameter outside adapter
    layers is frozen, as ``add_lora`` freezes the model."""
    wrapped = [(name, TrainedCopy(module, entry)) for name, entry, module in plan]
    install_adapter_layers(model, wrapped)
    return [w for _, w in wrapped]


def peft_entries(model: nn.Module) -> list[str]:
    """``modules_to_save`` entries that make PEFT select exactly the model's trained copies: the entries that
    selected them, else their full names; an error if neither does (a name that is the suffix of another)."""
    copies = trained_copies(model)
    want = {n for n, _ in copies}
    recorded = list(dict.fromkeys(c.entry for _, c in copies if c.entry))
    for entries in (recorded, [n for n, _ in copies]):
        if entries and {n for n, _, _ in select_modules_to_save(model, entries)} == want:
            return entries
    raise ValueError(f"no modules_to_save list makes PEFT select exactly {sorted(want)} (PEFT selects every module "
                     "whose name ends with an entry)")

"""lora_lab composed with Liger-Kernel: Liger's RMSNorm / RoPE / SwiGLU / fused linear CE around the fused LoRA kernels.

The recipe (``pip install lora_lab[liger]``)::

    model = AutoModelForCausalLM.from_pretrained(...)
    apply_liger_kernel_to_llama(model=model)          # or before the model is built, or after patch_model
    model = get_peft_model(model, LoraConfig(...))
    summary = patch_model(model, fused_loss=True)     # summary["loss"]: whose loss runs; summary["liger"]: the report

Why it composes: Liger swaps *forwards* — of RMSNorm modules, of the MLP (SiLU·up in one kernel), of the causal LM
(the loss straight from the hidden states) and the module-level ``apply_rotary_pos_emb`` — and leaves the
``gate_proj`` / ``up_proj`` / ``down_proj`` / attention ``nn.Linear`` children where they are. PEFT wraps those
children and :func:`~lora_lab.kernels.patch_model` finds them by walking the module tree, so every LoRA projection
still runs on the fused kernels (a Liger SwiGLU MLP calls ``gate_proj(x)`` then ``up_proj(x)`` on the same ``x``:
the shared-input group still forms). :func:`composition_report` checks that afterwards, per Liger MLP.

Where both offer the loss (lora_lab's ``fused_loss`` and Liger's fused linear CE), :func:`choose_loss` picks one by a
rule: :data:`LOSS_TABLE`, keyed by the head shape (hidden, vocabulary), holds which one measured faster in a whole
training step; at a head shape not in it, Liger's. ``fused_loss="lora_lab"`` or ``"liger"`` forces one. The choice
and its reason are in ``patch_model``'s summary (``"loss"``, ``"liger"``) and in the ``lora_lab.kernels`` log.

Refused, with the reason (:class:`~lora_lab.kernels.UnsupportedLoRAError`): ``fused_loss="liger"`` without Liger's
fused linear CE on the model; Liger applied to the PEFT wrapper instead of the transformers model (Liger's loss would
run on PeftModel); Liger's fused linear CE with a LoRA on ``lm_head`` (Liger reads ``lm_head.weight`` and would drop
the adapter); Liger's experts forward on a PEFT expert-LoRA wrapper left in place (it would drop the experts' LoRA —
``patch_model`` replaces it, :func:`check_composition` finds it when Liger came last).

Liger's modules are recognised by class, ``_get_name()`` and the module of their forward function
(``liger_kernel.*``); nothing here imports ``liger_kernel`` unless it is installed and asked for (:func:`apply_liger`).
"""
from __future__ import annotations

import importlib.util
import logging
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from torch import nn

from lora_lab.kernels.errors import UnsupportedLoRAError
from lora_lab.kernels.fused_mark import FUSED_STATE_ATTR

__all__ = ["LigerDetection", "LigerComposition", "LigerPatch", "LOSS_TABLE", "liger_installed", "detect_liger",
           "choose_loss", "composition_report", "check_composition", "apply_liger"]

log = logging.getLogger("lora_lab.kernels")

LIGER_PACKAGE = "liger_kernel"
LORA_LAB_LOSS_MODULE = "lora_lab.kernels.loss.patch"

# Which fused loss made a whole LoRA training step faster, by head shape (hidden, vocabulary): the value is
# ("liger" | "lora_lab", where it was measured). benchmarks/bench_whole_step.py measures exactly this — its variants
# "peft_liger_patch" (Liger's loss) and "peft_liger_patch_lora_lab_loss" (lora_lab's) differ only in the loss — and
# prints the entry its run supports. Shapes not listed get Liger's loss.
LOSS_TABLE: dict[tuple[int, int], tuple[str, str]] = {
    (4096, 128256): ("lora_lab", "notebook 10, H200 run of a9f0a02: Llama-3-8B-like 2-layer step, 2x4096 tokens, r=16; "
                                 "step with lora_lab's loss / with Liger's 0.934 [0.924, 0.944], 10 repetitions, "
                                 "2 sessions"),
    (3584, 151936): ("lora_lab", "notebook 10, H200 run of a9f0a02: Qwen2-7B-like 2-layer step, 2x4096 tokens, r=16; "
                                 "step with lora_lab's loss / with Liger's 0.937 [0.934, 0.951], 10 repetitions, "
                                 "2 sessions"),
    (2048, 151936): ("lora_lab", "notebook 10, H200 run of bec6a1b: Qwen3-30B-A3B-like 2-layer step, 2x4096 tokens, "
                                 "r=16; step with lora_lab's loss / with Liger's 0.832 [0.808, 0.851], 10 repetitions, "
                                 "2 sessions"),
}


def liger_installed() -> bool:
    """Whether ``liger_kernel`` can be imported (without importing it)."""
    return importlib.util.find_spec(LIGER_PACKAGE) is not None


def _from_liger(obj) -> bool:
    return str(getattr(obj, "__module__", "") or "").startswith(LIGER_PACKAGE)


def _forward_function(module: nn.Module):
    """The function ``module(...)`` runs: an instance-level forward if set, else the class's."""
    fwd = module.__dict__.get("forward", type(module).forward)
    return getattr(fwd, "__func__", fwd)


def _liger_kind(module: nn.Module) -> str | None:
    """"rms_norm" / "swiglu" / "experts" / "other" for a module running Liger code, None otherwise."""
    fwd = _forward_function(module)
    names = [type(module).__name__ if _from_liger(type(module)) else ""]
    if _from_liger(fwd):
        names.append(getattr(fwd, "__qualname__", "").split(".")[0])
    get_name = module.__dict__.get("_get_name")
    if get_name is not None:
        try:
            shown = get_name()
        except TypeError:  # pragma: no cover - a _get_name that wants arguments is not Liger's
            shown = ""
        if shown.startswith("Liger"):
            names.append(shown)
    name = " ".join(n for n in names if n)
    if not name:
        return None
    if "Norm" in name:
        return "rms_norm"
    if "Expert" in name or (("MoE" in name or "Moe" in name) and "MLP" not in name):
        return "experts"
    if "MLP" in name or "GLU" in name:
        return "swiglu"
    return "other"


@dataclass
class LigerDetection:
    """Where Liger's code runs in a model (module names), found by class / forward / ``_get_name``."""

    rms_norm: list[str] = field(default_factory=list)
    swiglu: list[str] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)
    rope: list[str] = field(default_factory=list)  # transformers modeling modules whose apply_rotary_pos_emb is Liger's
    loss: str | None = None  # "liger" when the causal LM's (possibly shadowed) forward is Liger's fused linear CE
    loss_shadowed: bool = False  # Liger's loss is there but lora_lab's fused loss runs in front of it
    on_peft_wrapper: bool = False  # Liger's forward was put on the PeftModel itself (refused)

    @property
    def found(self) -> bool:
        return bool(self.rms_norm or self.swiglu or self.experts or self.other or self.rope or self.loss
                    or self.on_peft_wrapper)


def _causal_lm(model: nn.Module):
    from lora_lab.kernels.loss.patch import causal_lm_of

    try:
        return causal_lm_of(model)
    except TypeError:
        return None


def detect_liger(model: nn.Module) -> LigerDetection:
    """Which parts of ``model`` run Liger-Kernel's code (no import of ``liger_kernel``)."""
    from lora_lab.kernels.loss.patch import _STATE_ATTR as LOSS_STATE

    found = LigerDetection()
    modeling = set()
    for name, module in model.named_modules():
        modeling.add(type(module).__module__)
        kind = _liger_kind(module)
        if kind is not None and not (hasattr(module, "get_base_model") or name == ""):
            getattr(found, kind).append(name or "(model)")
    for mod_name in sorted(modeling):
        mod = sys.modules.get(mod_name)
        rope = getattr(mod, "apply_rotary_pos_emb", None) if mod is not None else None
        if rope is not None and _from_liger(rope):
            found.rope.append(mod_name)
    if hasattr(model, "get_base_model") and _from_liger(model.__dict__.get("forward")):
        found.on_peft_wrapper = True
    lm = _causal_lm(model)
    if lm is not None:
        current = _forward_function(lm)
        if _from_liger(current):
            found.loss = "liger"
        elif hasattr(lm, LOSS_STATE):  # lora_lab's loss in front: what does it shadow?
            shadowed = getattr(lm, LOSS_STATE)
            shadowed = getattr(shadowed, "__func__", shadowed) if shadowed is not None else type(lm).forward
            if _from_liger(shadowed):
                found.loss, found.loss_shadowed = "liger", True
    return found


def _head_shape(model: nn.Module) -> tuple[int, int] | None:
    lm = _causal_lm(model)
    head = lm.get_output_embeddings() if lm is not None else None
    weight = getattr(head, "weight", None)
    if weight is None and head is not None and hasattr(head, "get_base_layer"):
        weight = head.get_base_layer().weight
    return None if weight is None or weight.dim() != 2 else (int(weight.shape[1]), int(weight.shape[0]))


def choose_loss(head: tuple[int, int] | None) -> tuple[str, str]:
    """(``"liger"`` or ``"lora_lab"``, why) for a model offering both fused losses, by :data:`LOSS_TABLE`."""
    if head is not None and head in LOSS_TABLE:
        choice, source = LOSS_TABLE[head]
        return choice, f"head (hidden {head[0]}, vocab {head[1]}) is in LOSS_TABLE: {choice} measured faster ({source})"
    shape = "unknown head" if head is None else f"head (hidden {head[0]}, vocab {head[1]})"
    return "liger", f"{shape} not in LOSS_TABLE: Liger's fused linear CE by default"


@dataclass
class LigerComposition:
    """What ``patch_model`` did with a model that (also) runs Liger-Kernel, and whose loss runs."""

    detected: LigerDetection
    loss: str | None  # "lora_lab", "liger" or None (the model's own loss)
    loss_reason: str
    head: tuple[int, int] | None = None
    swiglu_mlps: int = 0  # Liger SwiGLU MLPs found
    swiglu_lora_fused: int = 0  # LoRA projections inside them routed through lora_lab's kernels
    swiglu_lora_unfused: list[str] = field(default_factory=list)  # LoRA projections inside them left unfused
    experts_replaced: list[str] = field(default_factory=list)  # Liger experts forwards replaced by lora_lab's
    problems: list[str] = field(default_factory=list)  # unsupported compositions found (check_composition raises)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["head"] = list(self.head) if self.head else None
        return out


def _loss_plan(model: nn.Module, fused_loss, detected: LigerDetection) -> tuple[bool, str | None, str]:
    """(install lora_lab's loss?, whose loss runs, why) for ``patch_model(fused_loss=...)``; raises on refusals."""
    liger_loss = detected.loss == "liger"
    if fused_loss == "liger" and not liger_loss:
        raise UnsupportedLoRAError(
            "patch_model(fused_loss='liger'): Liger's fused linear cross-entropy is not applied to this model; apply "
            "it first (e.g. apply_liger_kernel_to_llama(model=model), fused_linear_cross_entropy=True is its "
            "default) or pass fused_loss=True / 'lora_lab'")
    if not liger_loss:
        if fused_loss in (True, "lora_lab"):
            return True, "lora_lab", "lora_lab's fused linear cross-entropy (Liger's loss is not applied)"
        return False, None, "the model's own loss (fused_loss=False)"
    head = _head_shape(model)
    if fused_loss == "lora_lab":
        return True, "lora_lab", "forced: fused_loss='lora_lab' (shadows Liger's fused linear CE)"
    if fused_loss == "liger":
        return False, "liger", "forced: fused_loss='liger'"
    if fused_loss is False:
        return False, "liger", "Liger's fused linear CE (already applied; fused_loss=False adds none)"
    choice, why = choose_loss(head)
    return choice == "lora_lab", choice, why


def step_aside_for_liger_loss(model: nn.Module) -> None:
    """Let Liger's fused linear CE run: remove lora_lab's loss where it sits in front of Liger's; where Liger was
    applied after it (Liger's forward already in front), only forget lora_lab's state (unpatching would drop
    Liger's forward)."""
    from lora_lab.kernels.loss.patch import _STATE_ATTR as LOSS_STATE
    from lora_lab.kernels.loss.patch import unpatch_causal_lm_loss

    lm = _causal_lm(model)
    if lm is None or not hasattr(lm, LOSS_STATE):
        return
    if _from_liger(_forward_function(lm)):
        delattr(lm, LOSS_STATE)
    else:
        unpatch_causal_lm_loss(model)


def _refusals(model: nn.Module, detected: LigerDetection, liger_loss_will_run: bool) -> list[str]:
    """Compositions that would silently compute something else than the model with LoRA."""
    problems = []
    if detected.on_peft_wrapper:
        problems.append("Liger's forward was set on the PEFT wrapper (PeftModel) itself: apply Liger to the "
                        "transformers model (peft_model.get_base_model(), or before get_peft_model)")
    if liger_loss_will_run:
        lm = _causal_lm(model)
        head = lm.get_output_embeddings() if lm is not None else None
        if head is not None and type(head) is not nn.Linear and hasattr(head, "lora_A"):
            problems.append("Liger's fused linear cross-entropy reads lm_head.weight and would drop the LoRA on "
                            "lm_head: apply Liger with fused_linear_cross_entropy=False or pass fused_loss='lora_lab'"
                            " (which refuses an adapted head too) — a LoRA head needs the model's own loss")
    return problems


def _wrapper_with_liger_experts(model: nn.Module) -> list[str]:
    from lora_lab.kernels.moe.patch import _is_param_wrapper, is_moe_patched

    return [name for name, m in model.named_modules()
            if _is_param_wrapper(m) and _from_liger(_forward_function(m)) and not is_moe_patched(m)]


def composition_report(model: nn.Module, loss: str | None = None, loss_reason: str = "",
                       experts_replaced=()) -> LigerComposition:
    """The state of ``model`` now: Liger's parts, whose loss runs, whether every LoRA projection inside a Liger
    SwiGLU MLP is on lora_lab's kernels, and unsupported compositions (``problems``). Callable any time, e.g. after
    applying Liger to an already patched model."""
    detected = detect_liger(model)
    lm = _causal_lm(model)
    if loss is None and lm is not None:
        fwd = _forward_function(lm)
        loss = "liger" if _from_liger(fwd) else "lora_lab" if fwd.__module__ == LORA_LAB_LOSS_MODULE else None
        loss_reason = loss_reason or "found on the model"
    report = LigerComposition(detected=detected, loss=loss, loss_reason=loss_reason, head=_head_shape(model),
                              experts_replaced=list(experts_replaced))
    modules = dict(model.named_modules())
    for name in detected.swiglu:
        report.swiglu_mlps += 1
        mlp = modules.get(name)
        for child_name, child in (mlp.named_children() if mlp is not None else ()):
            if hasattr(child, "lora_A") or type(child).__name__ == "LoRALinear":
                if hasattr(child, FUSED_STATE_ATTR):
                    report.swiglu_lora_fused += 1
                else:
                    report.swiglu_lora_unfused.append(f"{name}.{child_name}")
    report.problems = _refusals(model, detected, loss == "liger")
    report.problems += [f"{n}: Liger's experts forward sits on a PEFT expert-LoRA wrapper and would drop the "
                        "experts' LoRA (Liger applied after get_peft_model/patch_model): call patch_model(model) "
                        "again, or apply Liger with swiglu=False" for n in _wrapper_with_liger_experts(model)]
    if loss == "lora_lab" and detected.loss == "liger" and not detected.loss_shadowed:
        report.problems.append("lora_lab's fused loss was chosen but Liger's fused linear CE runs (Liger applied "
                               "after patch_model): call patch_model again to re-decide")
    return report


def check_composition(model: nn.Module) -> LigerComposition:
    """:func:`composition_report`, raising :class:`~lora_lab.kernels.UnsupportedLoRAError` on any problem."""
    report = composition_report(model)
    if report.problems:
        raise UnsupportedLoRAError("lora_lab + Liger-Kernel: unsupported composition:\n  " +
                                   "\n  ".join(report.problems))
    return report


# ----------------------------------------------------------------------------------------------
# Applying Liger to one model (used by benchmarks that build several models in one process).
# ----------------------------------------------------------------------------------------------
@dataclass
class LigerPatch:
    """Liger applied to one model instance, with the module-level changes Liger made (``globals``: modeling module
    → {name: Liger's value}); :meth:`active` puts them in place for a block (RoPE is looked up there per call)."""

    model_type: str
    globals: dict = field(default_factory=dict)
    kept: bool = True

    @contextmanager
    def active(self):
        saved = {mod: {k: getattr(sys.modules[mod], k) for k in changes} for mod, changes in self.globals.items()}
        try:
            for mod, changes in self.globals.items():
                for k, v in changes.items():
                    setattr(sys.modules[mod], k, v)
            yield
        finally:
            if not self.kept:
                for mod, values in saved.items():
                    for k, v in values.items():
                        setattr(sys.modules[mod], k, v)


def apply_liger(model: nn.Module, keep_globals: bool = True, **kwargs) -> LigerPatch:
    """Liger-Kernel's ``apply_liger_kernel_to_<model_type>(model=..., **kwargs)`` on the transformers model inside
    ``model`` (a PEFT wrapper is looked through), as its users call it.

    Liger also changes module-level names of the transformers modeling module (RoPE, the RMSNorm / MLP / experts
    classes new models are built from). ``keep_globals=False`` puts those back after applying — other models built
    later in this process stay plain — and the returned :class:`LigerPatch` re-installs them around a call
    (``with patch.active(): step()``); RoPE is then Liger's inside that block only."""
    if not liger_installed():
        raise ImportError("Liger-Kernel is not installed: pip install 'lora_lab[liger]' (or liger-kernel)")
    from liger_kernel.transformers import monkey_patch

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    fn = monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if fn is None:
        raise ValueError(f"Liger-Kernel has no apply function for model_type {model_type!r}")
    mods = {m for m in (type(x).__module__ for x in inner.modules()) if m.startswith("transformers.models.")}
    before = {m: dict(vars(sys.modules[m])) for m in mods}
    cls_forward = type(inner).forward
    fn(model=inner, **kwargs)
    changed = {m: {k: v for k, v in vars(sys.modules[m]).items() if before[m].get(k, v) is not v}
               for m in mods}
    changed = {m: c for m, c in changed.items() if c}
    patch = LigerPatch(model_type=model_type, globals=changed, kept=keep_globals)
    if not keep_globals:
        for m, c in changed.items():
            for k in c:
                setattr(sys.modules[m], k, before[m][k])
        type(inner).forward = cls_forward
    log.info("Liger-Kernel applied to %s (%s); module-level changes %s", type(inner).__name__, model_type,
             {m: sorted(c) for m, c in changed.items()})
    return patch

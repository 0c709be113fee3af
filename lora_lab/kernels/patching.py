"""Switch a model's LoRA layers to the fused Triton kernels, and back.

``patch_model(model)`` finds every PEFT ``lora.Linear`` and every :class:`lora_lab.LoRALinear`, checks that the
fused kernel computes exactly what the layer computes, and replaces the layer's ``forward`` (an instance
attribute; the module tree, parameter names and state dict are untouched). Projections that read the same
input — q/k/v, gate/up, GatedDeltaNet's in_proj_qkv/z/b/a — are grouped into one shared-input op; frozen plain
``nn.Linear`` siblings join their group (they read the same X for free). The group's frozen weights are moved into
one concatenated buffer and each member's weight becomes a view of it (no extra memory).

Checked once at patch time (unsupported → ``UnsupportedLoRAError`` naming every offending layer, nothing
patched): PEFT's DoRA (lora_lab's DoRA layers run on :func:`~lora_lab.kernels.lora.dora.fused_dora_linear`, outside
shared-input groups) and other PEFT LoRA variants, ``lora_bias``, ``fan_in_fan_out``
(Conv1D) layers, quantized or non-``nn.Linear`` bases, LoRA on embeddings/convolutions, dtypes other than
bf16/fp16/fp32, tensors off CUDA (unless Triton's interpreter is on). ``strict=False`` leaves such layers on their
own forward instead. rsLoRA needs no check: it only changes the layer's scale, which the kernels read per call.

Transformers' SwiGLU MLPs that hold a patched projection get SiLU·up on :func:`~lora_lab.kernels.silu_mul`
(:mod:`lora_lab.kernels.mlp_patch`).

Checked at every call (then the layer's original forward runs, which is right by construction): adapters
disabled or merged, several active adapters or a mixed-adapter batch (``adapter_names``), an input dtype that
differs from the weights, autocast.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from lora_lab.kernels.bound_forward import BoundForward
from lora_lab.kernels.config import KernelConfig, resolve_config
from lora_lab.kernels.errors import UnsupportedLoRAError
from lora_lab.kernels.fused_mark import FUSED_STATE_ATTR as _STATE_ATTR
from lora_lab.kernels.lora.dora import fused_dora_linear
from lora_lab.kernels.lora.linear import SUPPORTED_DTYPES, fused_lora_linear
from lora_lab.kernels.lora.shared_input import MAX_SEGMENTS, fused_shared_input_lora
from lora_lab.kernels.loss.patch import UnsupportedLogitTransform, patch_causal_lm_loss, unpatch_causal_lm_loss
from lora_lab.kernels.mlp_patch import patch_swiglu_mlps, unpatch_swiglu_mlps
from lora_lab.kernels.moe import patch as moe_patch
from lora_lab.kernels.triton_helpers import interpreter_reason, running_in_interpreter

__all__ = ["patch_model", "unpatch_model", "UnsupportedLoRAError", "patched_layers", "SHARED_INPUT_GROUPS"]

# sibling projections that read the same input in the supported architectures
SHARED_INPUT_GROUPS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
)

def _peft_lora_classes():
    try:
        from peft.tuners.lora.layer import Linear as PeftLoraLinear
        from peft.tuners.lora.layer import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return None, None
    return PeftLoraLinear, LoraLayer


def _lora_lab_linear_class():
    from lora_lab.layer import LoRALinear

    return LoRALinear


# ----------------------------------------------------------------------------------------------
# What one patched layer needs at call time.
# ----------------------------------------------------------------------------------------------
@dataclass
class _LayerState:
    kind: str  # "peft", "lora_lab" or "frozen" (a plain nn.Linear that joined a shared-input group)
    original_forward_in_dict: object  # instance-level forward before patching (normally absent → None)
    had_forward_attr: bool
    config: KernelConfig
    group: _SharedInputGroup | None = None
    index: int = -1
    weight_view_of_group: bool = False

    # --- per-call resolution of the layer's LoRA parts -----------------------------------------
    @staticmethod
    def parts(module):
        """(base nn.Linear, A, B, scaling, dropout_p) for the simple case, or None: use the original forward."""
        st = getattr(module, _STATE_ATTR)
        if st.kind == "frozen":
            return module, None, None, 0.0, 0.0
        if st.kind == "lora_lab":
            p = module.dropout_p if module.training else 0.0
            if module.magnitude is not None and p > 0.0:
                return None  # DoRA with dropout recomputes W x on the dropped input: the layer's own forward
            return module.base, module.lora_A, module.lora_B, module.scaling, p
        # PEFT lora.Linear
        if module.disable_adapters or module.merged:
            return None
        active = module.active_adapters
        if len(active) != 1 or active[0] not in module.lora_A:
            return None
        name = active[0]
        if module.use_dora.get(name, False) or name in getattr(module, "lora_variant", {}):
            return None
        drop = module.lora_dropout[name]
        p = drop.p if isinstance(drop, nn.Dropout) and drop.training else 0.0
        return (module.get_base_layer(), module.lora_A[name].weight, module.lora_B[name].weight,
                module.scaling[name], p)


def _fusable_call(x, base) -> bool:
    if not isinstance(x, torch.Tensor) or x.dtype != base.weight.dtype or x.device != base.weight.device:
        return False
    if torch.is_autocast_enabled(x.device.type):
        return False
    return x.device.type == "cuda" or running_in_interpreter()


def _original_forward(module):
    # the class's forward, bound to this module (we only ever patch an instance attribute)
    return type(module).forward.__get__(module, type(module))


def _fused_forward(module, x, *args, **kwargs):
    """The patched forward, installed as ``BoundForward(_fused_forward, module)`` (not a closure over the module):
    a deep copy or a pickled copy of the model calls it with its own module, so it runs on its own parameters."""
    st = getattr(module, _STATE_ATTR)
    parts = None if (args or kwargs) else _LayerState.parts(module)
    if parts is None or not _fusable_call(x, parts[0]):
        return _original_forward(module)(x, *args, **kwargs)
    base, a, b, s, p = parts
    if st.group is not None and p == 0.0:
        y = st.group.output_for(st.index, x)
        if y is not None:
            return y
    if a is None:  # a frozen plain linear outside its group's fast path
        return _original_forward(module)(x)
    if st.kind == "lora_lab" and module.magnitude is not None:
        return fused_dora_linear(x, base.weight, base.bias, a, b, s, module.magnitude, config=st.config)
    return fused_lora_linear(x, base.weight, base.bias, a, b, s, dropout_p=p, training=module.training,
                             config=st.config)


# ----------------------------------------------------------------------------------------------
# Shared-input groups.
# ----------------------------------------------------------------------------------------------
class _SharedInputGroup:
    """One fused op for sibling projections of the same input; the first member called computes all outputs,
    the others pick theirs up (matched by tensor identity and version of the input).

    The members' frozen weights are views of one concatenated buffer. When they stop being views — a deep copy
    of the model (``nn.Parameter`` deep-copies by cloning), ``load_state_dict(assign=True)``, ``model.to(...)`` —
    the next call concatenates the members' current weights into a new buffer and makes them views of it again,
    so the group always computes with its own members' weights.
    """

    MAX_UNUSED = 3  # after this many computed-but-never-collected outputs the group turns itself off

    def __init__(self, members, config: KernelConfig):
        self.members = members  # list of modules, in call order of SHARED_INPUT_GROUPS
        self.config = config
        self.splits = [self._base(m).out_features for m in members]
        self._bind_views()
        self._pending = None
        self.unused = 0
        self.enabled = True

    def __deepcopy__(self, memo):
        # the members are deep-copied through the memo (the copied model's modules); the copied members'
        # weights are clones, not views of a buffer: the first call of the copy binds them (_bind_views)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.members = copy.deepcopy(self.members, memo)
        new.config, new.splits = self.config, list(self.splits)
        new.weight_cat = new.bias_cat = None
        new._pending, new.unused, new.enabled = None, 0, self.enabled
        return new

    def _bind_views(self) -> bool:
        """Concatenate the members' current weights (and biases) into one buffer and make each a view of it;
        False (nothing changed) when they cannot share one (different in_features, dtypes or devices)."""
        bases = [self._base(m) for m in self.members]
        w0 = bases[0].weight
        if len({(b.weight.shape[1], b.weight.dtype, b.weight.device) for b in bases}) != 1 or \
                [b.weight.shape[0] for b in bases] != self.splits:
            return False
        with torch.no_grad():
            self.weight_cat = torch.cat([b.weight.detach() for b in bases], 0)
            has_bias = [b.bias is not None for b in bases]
            self.bias_cat = None
            if any(has_bias):
                self.bias_cat = torch.cat([b.bias.detach() if b.bias is not None else
                                           torch.zeros(b.out_features, device=w0.device, dtype=w0.dtype)
                                           for b in bases], 0)
            # members' weights become views of the concatenated buffer (no duplicate memory)
            off = 0
            for b in bases:
                n = b.out_features
                b.weight.data = self.weight_cat[off:off + n]
                if b.bias is not None:
                    b.bias.data = self.bias_cat[off:off + n]
                off += n
        return True

    @staticmethod
    def _base(m):
        st = getattr(m, _STATE_ATTR, None)
        kind = st.kind if st is not None else None
        if kind == "peft":
            return m.get_base_layer()
        if kind == "lora_lab":
            return m.base
        return m

    def _weights_still_views(self) -> bool:
        if self.weight_cat is None:
            return False
        off = 0
        ptr0 = self.weight_cat.data_ptr()
        es = self.weight_cat.element_size() * self.weight_cat.shape[1]
        for m, n in zip(self.members, self.splits):
            w = self._base(m).weight
            if w.data_ptr() != ptr0 + off * es or w.shape != (n, self.weight_cat.shape[1]):
                return False
            off += n
        return True

    def output_for(self, index, x):
        """This member's output, or None when the group cannot serve it (caller runs the single kernel).

        An inference tensor (``torch.inference_mode``) has no version counter, so an in-place change between two
        members' calls could not be seen: each member then runs its own kernel."""
        if not self.enabled or x.is_inference():
            return None
        pend = self._pending
        if pend is not None:
            px, pver, outs = pend
            if px is x and pver == x._version and index in outs:
                y = outs.pop(index)
                if not outs:
                    self._pending = None
                return y
            self.unused += len(outs)
            self._pending = None
            if self.unused > self.MAX_UNUSED:
                self.enabled = False
                warnings.warn("lora_lab.kernels: projections of a shared-input group are not called on the same "
                              "input; running them one by one", RuntimeWarning, stacklevel=3)
                return None
        parts = [_LayerState.parts(m) for m in self.members]
        if any(p is None or p[4] != 0.0 for p in parts):
            return None
        if any(self._base(m).weight.requires_grad or (self._base(m).bias is not None and
                                                      self._base(m).bias.requires_grad) for m in self.members):
            return None
        if not self._weights_still_views() and not self._bind_views():
            return None
        outs = fused_shared_input_lora(x, self.weight_cat, self.bias_cat, self.splits,
                                       [p[1] for p in parts], [p[2] for p in parts], [p[3] for p in parts],
                                       config=self.config)
        rest = {j: o for j, o in enumerate(outs) if j != index}
        self._pending = (x, x._version, rest) if rest else None
        return outs[index]

    def release(self):
        """Give every member its own contiguous weight again (a saved model then has no shared storage)."""
        with torch.no_grad():
            for m in self.members:
                b = self._base(m)
                b.weight.data = b.weight.data.clone()
                if b.bias is not None:
                    b.bias.data = b.bias.data.clone()
        self._pending = None


# ----------------------------------------------------------------------------------------------
# Support checks.
# ----------------------------------------------------------------------------------------------
def _why_unsupported_base(base, where) -> str | None:
    if type(base) is not nn.Linear:
        return (f"{where}: base layer is {type(base).__name__}, "
                "not a plain nn.Linear (quantized bases are not supported)")
    if base.weight.dtype not in SUPPORTED_DTYPES:
        return f"{where}: base weight dtype {base.weight.dtype} is not bf16/fp16/fp32 (quantized?)"
    return interpreter_reason(base.weight, where)


def _why_unsupported_peft(module, name) -> str | None:
    PeftLoraLinear, _ = _peft_lora_classes()
    if type(module) is not PeftLoraLinear:
        return f"{name}: PEFT LoRA layer type {type(module).__name__} (only lora.Linear on nn.Linear is fused)"
    if getattr(module, "fan_in_fan_out", False):
        return f"{name}: fan_in_fan_out=True (Conv1D weights) is not supported"
    for adapter in module.lora_A:
        if module.use_dora.get(adapter, False) or getattr(module, "lora_magnitude_vector", {}) and \
                adapter in module.lora_magnitude_vector:
            return f"{name}: DoRA (use_dora=True) is not supported"
        if adapter in getattr(module, "lora_variant", {}):
            return f"{name}: LoRA variant {type(module.lora_variant[adapter]).__name__} is not supported"
        if getattr(module, "lora_bias", {}).get(adapter, False):
            return f"{name}: lora_bias=True is not supported"
        drop = module.lora_dropout[adapter]
        if not isinstance(drop, (nn.Dropout, nn.Identity)):
            return f"{name}: LoRA dropout module {type(drop).__name__} is not supported"
        if module.lora_A[adapter].weight.dtype not in SUPPORTED_DTYPES:
            return f"{name}: LoRA weight dtype {module.lora_A[adapter].weight.dtype} is not supported"
    return _why_unsupported_base(module.get_base_layer(), name)


def _why_unsupported_lora_lab(module, name) -> str | None:
    # rsLoRA needs nothing here: it only changes module.scaling, which the fused kernels read at every call.
    # DoRA (module.magnitude) runs on fused_dora_linear; with dropout in training it keeps its own forward.
    return _why_unsupported_base(module.base, name)


def _handled_by_moe_patcher(module) -> bool:
    """True for a PEFT wrapper around stacked MoE experts: :mod:`.moe.patch` fuses those, not this module."""
    return moe_patch.is_expert_lora_wrapper(module)


def _lora_modules(model):
    """(name, module, kind, reason-if-unsupported) for every LoRA-carrying module this patcher handles
    (PEFT wrappers of stacked MoE experts are skipped, not refused: the MoE patcher takes them)."""
    PeftLoraLinear, LoraLayer = _peft_lora_classes()
    LoRALinear = _lora_lab_linear_class()
    found = []
    for name, m in model.named_modules():
        if _handled_by_moe_patcher(m):
            continue
        if isinstance(m, LoRALinear):
            found.append((name, m, "lora_lab", _why_unsupported_lora_lab(m, name)))
        elif LoraLayer is not None and isinstance(m, LoraLayer):
            found.append((name, m, "peft", _why_unsupported_peft(m, name)))
    return found


# ----------------------------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------------------------
def _install(module, kind, config: KernelConfig):
    had = "forward" in module.__dict__
    state = _LayerState(kind=kind, original_forward_in_dict=module.__dict__.get("forward"), had_forward_attr=had,
                        config=config)
    setattr(module, _STATE_ATTR, state)
    module.forward = BoundForward(_fused_forward, module)


def patch_model(model: nn.Module, strict: bool = True, fuse_shared_inputs: bool = True,
                config: KernelConfig | None = None, fused_loss: bool | str = False,
                fuse_mlp_activation: bool = True) -> dict:
    """Route every supported LoRA linear of ``model`` through the fused Triton kernels (idempotent).

    ``config`` sets how the kernels run (:class:`~lora_lab.kernels.KernelConfig`; None: the defaults, seeded
    from the environment when this is called); the patched layers keep it.

    ``fused_loss=True`` also routes ``model(..., labels=...)`` through the fused linear cross-entropy
    (:func:`~lora_lab.kernels.loss.patch_causal_lm_loss`: no logits are built when labels are given); a model whose
    forward does to its logits what the fused loss cannot (:mod:`lora_lab.logit_transforms`) keeps its
    own loss, with the reason in ``skipped`` and ``fused_loss`` False.

    With Liger-Kernel applied to the model (before or after this call; :mod:`lora_lab.kernels.liger`), the LoRA
    projections inside Liger's modules are fused all the same. When both offer a loss (``fused_loss=True`` and
    Liger's fused linear CE), :func:`lora_lab.kernels.liger.choose_loss` picks the faster by head shape (Liger's where
    unmeasured); ``fused_loss="lora_lab"`` / ``"liger"`` forces one.

    ``fuse_mlp_activation`` puts SiLU·up of transformers' SwiGLU MLPs that hold a patched projection on
    :func:`~lora_lab.kernels.silu_mul` (:mod:`lora_lab.kernels.mlp_patch`; False keeps their own forward).

    Returns a summary: ``{"lora_layers": n, "shared_input_groups": g, "frozen_members": f, "moe_experts": e,
    "swiglu_mlps": m (MLPs whose SiLU·up runs on silu_mul),
    "fused_loss": bool (lora_lab's loss runs), "loss": "lora_lab" | "liger" | None (the model's own),
    "liger": the composition report (``LigerComposition.as_dict()``) or None without Liger, "skipped": [reasons]}``.
    A model with nothing to patch (no LoRA layer, no MoE experts, no fused loss) gets a RuntimeWarning saying so, and
    the reason in ``skipped``.
    Raises :class:`UnsupportedLoRAError` (and patches nothing) when
    ``strict`` and any LoRA layer is unsupported; with ``strict=False`` those layers keep their own forward.
    """
    config = resolve_config(config)
    if not isinstance(fused_loss, bool) and fused_loss not in ("lora_lab", "liger"):
        raise TypeError(f"fused_loss must be True or False (or 'lora_lab' / 'liger' to force whose fused loss runs "
                        f"when Liger-Kernel's is applied too); got {fused_loss!r}")
    found = _lora_modules(model)
    bad = [(n, why) for n, _, _, why in found if why is not None]
    if bad and strict:
        lines = "\n  ".join(why for _, why in bad)
        raise UnsupportedLoRAError(f"patch_model: {len(bad)} LoRA layer(s) cannot use the fused kernels:\n  {lines}\n"
                                   "(pass strict=False to fuse the others and leave these as they are)")
    if fuse_shared_inputs and _is_fsdp_sharded(model):
        raise UnsupportedLoRAError(
            "patch_model: the model is sharded with FSDP (DTensor parameters); a shared-input group reads its "
            "members' weights from one concatenated buffer, which FSDP's all-gathered weights are not. Pass "
            "fuse_shared_inputs=False (each LoRA linear gets its own fused op, inside its FSDP unit's forward)"
        )
    liger = _liger_loss_plan(model, fused_loss)  # Liger-Kernel composition: refusals before anything is patched
    loss_skipped = []
    if liger["install_loss"]:
        try:
            patch_causal_lm_loss(model)  # checks the head first: a refusal leaves the model untouched
        except UnsupportedLogitTransform as e:  # the model's own loss stays: reported, not raised
            loss_skipped.append(f"fused_loss: not installed: {e}")
            liger = {**liger, "install_loss": False, "loss": "liger" if liger["detected"].loss == "liger" else None}
    elif liger["loss"] == "liger":
        _liger_module().step_aside_for_liger_loss(model)  # a former fused_loss=True chose lora_lab's: Liger's now
    if bad:
        warnings.warn(f"patch_model: leaving {len(bad)} unsupported LoRA layer(s) unfused", RuntimeWarning,
                      stacklevel=2)
    patched = 0
    for _, m, kind, why in found:
        if why is None and not hasattr(m, _STATE_ATTR):
            _install(m, kind, config)
            patched += 1

    groups = frozen = 0
    if fuse_shared_inputs:
        for parent in model.modules():
            for names in SHARED_INPUT_GROUPS:
                members = []
                for n in names:
                    child = parent._modules.get(n)
                    if child is None:
                        continue
                    st = getattr(child, _STATE_ATTR, None)
                    if st is not None and st.group is None and st.kind in ("peft", "lora_lab") \
                            and getattr(child, "magnitude", None) is None:
                        if _LayerState.parts(child) is not None and _LayerState.parts(child)[4] == 0.0 \
                                and not _has_dropout(child):
                            members.append(child)
                    elif st is None and type(child) is nn.Linear and not child.weight.requires_grad and \
                            (child.bias is None or not child.bias.requires_grad) and \
                            _why_unsupported_base(child, n) is None:
                        members.append(child)
                lora_members = [c for c in members if hasattr(c, _STATE_ATTR)]
                if len(members) < 2 or not lora_members or len(members) > MAX_SEGMENTS:
                    continue
                bases = [_SharedInputGroup._base(c) if hasattr(c, _STATE_ATTR) else c for c in members]
                if len({(b.in_features, b.weight.dtype, b.weight.device) for b in bases}) != 1:
                    continue
                if any(b.weight.requires_grad for b in bases):
                    continue
                for c in members:
                    if not hasattr(c, _STATE_ATTR):
                        _install(c, "frozen", config)
                        frozen += 1
                group = _SharedInputGroup(members, config)
                for i, c in enumerate(members):
                    st = getattr(c, _STATE_ATTR)
                    st.group, st.index, st.weight_view_of_group = group, i, True
                groups += 1

    moe = moe_patch.patch_moe_experts(model, config=config)
    swiglu = patch_swiglu_mlps(model) if fuse_mlp_activation else 0
    skipped = [why for _, why in bad]
    if not found and not moe and liger["loss"] is None:
        skipped.append(f"{type(model).__name__} has no LoRA layer (nor MoE experts, nor a fused loss asked for): "
                       "nothing was patched; add LoRA first (add_lora or load_adapter)")
        warnings.warn(f"patch_model: {skipped[-1]}", RuntimeWarning, stacklevel=2)
    return {"lora_layers": patched, "shared_input_groups": groups, "frozen_members": frozen, "moe_experts": moe,
            "swiglu_mlps": swiglu, "fused_loss": liger["install_loss"], "loss": liger["loss"],
            "liger": _liger_summary(model, liger, moe), "skipped": skipped + loss_skipped}


def _liger_module():
    from lora_lab.kernels import liger

    return liger


def _liger_loss_plan(model: nn.Module, fused_loss) -> dict:
    """Whose fused loss runs (:mod:`lora_lab.kernels.liger`); raises ``UnsupportedLoRAError`` on a composition with
    Liger-Kernel that would compute something else."""
    from lora_lab.kernels import liger

    detected = liger.detect_liger(model)
    install, loss, why = liger._loss_plan(model, fused_loss, detected)
    problems = liger._refusals(model, detected, loss == "liger")
    if problems:
        raise UnsupportedLoRAError("patch_model: unsupported composition with Liger-Kernel:\n  "
                                   + "\n  ".join(problems))
    return {"install_loss": install, "loss": loss, "reason": why, "detected": detected}


def _liger_summary(model: nn.Module, plan: dict, moe_patched: int) -> dict | None:
    """The composition report after patching (None without Liger), logged at INFO on ``lora_lab.kernels``."""
    from lora_lab.kernels import liger

    if not plan["detected"].found:
        return None
    replaced = plan["detected"].experts if moe_patched else []
    report = liger.composition_report(model, plan["loss"], plan["reason"], replaced)
    liger.log.info("patch_model with Liger-Kernel: loss %s (%s); %d Liger SwiGLU MLPs, %d LoRA projections in them "
                   "fused; experts replaced: %s", report.loss, report.loss_reason, report.swiglu_mlps,
                   report.swiglu_lora_fused, report.experts_replaced or "none")
    return report.as_dict()


def _is_fsdp_sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _has_dropout(module) -> bool:
    st = getattr(module, _STATE_ATTR)
    if st.kind == "lora_lab":
        return module.dropout_p > 0
    return any(isinstance(d, nn.Dropout) and d.p > 0 for d in module.lora_dropout.values())


def patched_layers(model: nn.Module) -> list[str]:
    """Names of the modules currently routed through the fused kernels."""
    return [n for n, m in model.named_modules() if hasattr(m, _STATE_ATTR)]


def unpatch_model(model: nn.Module) -> int:
    """Undo :func:`patch_model`: original forwards back, members' weights contiguous again. Returns the count."""
    count = 0
    released = set()
    for _, m in model.named_modules():
        st = getattr(m, _STATE_ATTR, None)
        if st is None:
            continue
        if st.group is not None and id(st.group) not in released:
            st.group.release()
            released.add(id(st.group))
        if st.had_forward_attr:
            m.forward = st.original_forward_in_dict
        else:
            m.__dict__.pop("forward", None)
        delattr(m, _STATE_ATTR)
        count += 1
    unpatch_swiglu_mlps(model)
    unpatch_causal_lm_loss(model)
    return count + moe_patch.unpatch_moe_experts(model)

"""Swap transformers 5.x experts modules (and PEFT expert-LoRA wrappers around them) to the fused kernels.

``patch_moe_experts(model)`` replaces, per instance, the ``forward`` of

* every supported experts module (``Qwen3MoeExperts``, ``Qwen3_5MoeExperts``, ``MixtralExperts``, …)
  that is not wrapped by PEFT: forward becomes ``fused_moe_experts`` on its own weights;
* every outermost PEFT ``ParamWrapper`` stack around such a module (``target_parameters`` on
  ``gate_up_proj`` and/or ``down_proj``): forward becomes the fused kernels with the LoRA factors
  read straight from PEFT's ``lora_A`` / ``lora_B`` (views, so training updates PEFT's own
  parameters and ``save_pretrained`` / ``from_pretrained`` work unchanged).

Anything else that looks like an experts module (3-D ``down_proj``) is refused with the reason:
unknown class, bias, transposed or interleaved layout, non-SiLU activation, a custom gate, LoRA on
another parameter, several active adapters. ``unpatch_moe_experts`` restores the class forwards.
"""

from __future__ import annotations

import torch
from torch import nn

from lora_lab.kernels.bound_forward import BoundForward
from lora_lab.kernels.config import KernelConfig, resolve_config
from lora_lab.kernels.moe.experts import fused_moe_experts
from lora_lab.kernels.moe.lora import EXPERT_PARAMETERS, ExpertLoRA, peft_expert_factors
from lora_lab.kernels.triton_helpers import interpreter_reason

# Experts classes whose forward is exactly the SiLU-gated per-expert MLP over (hidden, top_k_index,
# top_k_weights) with gate_up_proj (E, 2I, H) = [gate; up] and down_proj (E, H, I).
SUPPORTED_EXPERTS_CLASSES = frozenset(
    {
        "Qwen2MoeExperts",  # Qwen1.5-MoE / Qwen2-MoE
        "Qwen3MoeExperts",
        "Qwen3_5MoeExperts",
        "Qwen3NextExperts",
        "MixtralExperts",
        "OlmoeExperts",
    }
)

_PATCH_FLAG = "_lora_lab_moe_patched"


def _is_param_wrapper(module: nn.Module) -> bool:
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:  # PEFT missing: nothing can be wrapped
        return False
    return isinstance(module, ParamWrapper)


def _looks_like_experts(module: nn.Module) -> bool:
    """A stacked-experts module: a 3-D ``down_proj`` tensor (parameter or parametrized)."""
    if _is_param_wrapper(module):
        return False
    down = getattr(module, "down_proj", None)
    return isinstance(down, torch.Tensor) and down.dim() == 3


def is_expert_lora_wrapper(module: nn.Module) -> bool:
    """True for a PEFT ParamWrapper (outer or nested) whose innermost base is a stacked-experts module.

    ``patch_moe_experts`` handles these; other patchers (``lora_lab.kernels.patching``) should leave them alone.
    """
    if not _is_param_wrapper(module):
        return False
    return _looks_like_experts(_wrapper_chain(module)[1])


def unsupported_reason(experts: nn.Module) -> str | None:
    """Why this experts module cannot use the fused kernels, or None if it can."""
    name = type(experts).__name__
    if name not in SUPPORTED_EXPERTS_CLASSES:
        return f"experts class {name} is not in the supported list {sorted(SUPPORTED_EXPERTS_CLASSES)}"
    if getattr(experts, "has_bias", False):
        return "expert biases are not supported"
    if getattr(experts, "is_transposed", False):
        return "transposed expert weights (E, in, out) are not supported"
    if not getattr(experts, "is_concatenated", True):
        return "interleaved gate/up layout is not supported"
    if not getattr(experts, "has_gate", True):
        return "experts without a gate projection are not supported"
    act = getattr(experts, "act_fn", None)
    if not isinstance(act, nn.SiLU) and type(act).__name__ not in ("SiLUActivation", "SiLU"):
        return f"activation {type(act).__name__} is not SiLU"
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or gate_up.dim() != 3 or down.dim() != 3:
        return "expected 3-D gate_up_proj and down_proj"
    num_experts, two_i, hidden = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (num_experts, hidden, two_i // 2):
        return (f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} "
                "do not fit (E, 2I, H) / (E, H, I)")
    if gate_up.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"weights of dtype {gate_up.dtype} (quantized?) are not supported"
    return interpreter_reason(gate_up, "experts")


def _fused_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    w1 = self.gate_up_proj
    out = fused_moe_experts(hidden_states.to(w1.dtype), top_k_index, top_k_weights, w1, self.down_proj,
                            config=getattr(self, _PATCH_FLAG))
    return out.to(hidden_states.dtype)


def _wrapper_chain(wrapper: nn.Module) -> tuple[list[nn.Module], nn.Module]:
    """Nested ParamWrappers from the outside in, and the experts module at the bottom."""
    chain = []
    module = wrapper
    while _is_param_wrapper(module):
        chain.append(module)
        module = module.base_layer
    return chain, module


def _lora_from_wrappers(chain: list[nn.Module], experts: nn.Module) -> ExpertLoRA | None:
    """ExpertLoRA views onto PEFT's parameters; None means "let PEFT's own forward handle it"."""
    lora = ExpertLoRA()
    for wrapper in chain:
        if wrapper.merged or wrapper.disable_adapters:
            if wrapper.merged and not wrapper.disable_adapters:
                continue  # delta already folded into the base weight
            return None  # disabled (maybe with a pending unmerge): PEFT's forward is the reference
        adapters = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
        if not adapters:
            continue
        if len(adapters) > 1:
            raise NotImplementedError(
                f"fused MoE LoRA supports one active adapter per expert parameter, got {adapters}"
            )
        adapter = adapters[0]
        a, b = peft_expert_factors(
            wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight, experts.gate_up_proj.shape[0]
        )
        scale = float(wrapper.scaling[adapter])
        if wrapper.parameter_name == "gate_up_proj":
            lora.gate_up_A, lora.gate_up_B, lora.gate_up_scale = a, b, scale
        else:
            lora.down_A, lora.down_B, lora.down_scale = a, b, scale
    return lora


def _fused_peft_forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
    if args or kwargs:
        raise NotImplementedError("fused MoE LoRA forward takes (hidden_states, top_k_index, top_k_weights) only")
    chain, experts = _wrapper_chain(self)
    lora = _lora_from_wrappers(chain, experts)
    if lora is None:
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    w1 = experts.gate_up_proj
    out = fused_moe_experts(
        hidden_states.to(w1.dtype), top_k_index, top_k_weights, w1, experts.down_proj, lora=lora,
        config=getattr(self, _PATCH_FLAG),
    )
    return out.to(hidden_states.dtype)


def _check_wrappers(name: str, chain: list[nn.Module]) -> None:
    for wrapper in chain:
        if wrapper.parameter_name not in EXPERT_PARAMETERS:
            raise NotImplementedError(
                f"{name}: PEFT LoRA on expert parameter {wrapper.parameter_name!r} is not supported "
                f"(only {EXPERT_PARAMETERS})"
            )
        if getattr(wrapper, "fan_in_fan_out", False):
            raise NotImplementedError(f"{name}: fan_in_fan_out expert LoRA is not supported")


def patch_moe_experts(model: nn.Module, config: KernelConfig | None = None) -> int:
    """Route every supported experts module of ``model`` through the fused kernels; returns how many.

    ``config``: kernel settings the patched modules keep (None: the defaults, seeded from the environment).

    Raises NotImplementedError (naming the module and the reason) if any experts-like module is
    not supported, before changing anything.
    """
    config = resolve_config(config)
    named = dict(model.named_modules())
    plan = []  # (module, forward)
    inside_wrappers = set()
    for name, module in named.items():
        if not _is_param_wrapper(module):
            continue
        parent_name = name.rsplit(".", 1)[0] if "." in name else ""
        if name.endswith("base_layer") and _is_param_wrapper(named.get(parent_name)):
            continue  # inner wrapper: handled through its outermost one
        chain, experts = _wrapper_chain(module)
        if not _looks_like_experts(experts):
            continue  # PEFT target_parameters on something that is not an experts module: not ours
        reason = unsupported_reason(experts)
        if reason is not None:
            raise NotImplementedError(f"cannot fuse MoE experts at {name!r}: {reason}")
        _check_wrappers(name, chain)
        inside_wrappers.add(id(experts))
        plan.append((module, _fused_peft_forward))
    for name, module in named.items():
        if _looks_like_experts(module) and id(module) not in inside_wrappers:
            reason = unsupported_reason(module)
            if reason is not None:
                raise NotImplementedError(f"cannot fuse MoE experts at {name!r}: {reason}")
            plan.append((module, _fused_experts_forward))
    for module, forward in plan:
        module.forward = BoundForward(forward, module)
        setattr(module, _PATCH_FLAG, config)
    return len(plan)


def unpatch_moe_experts(model: nn.Module) -> int:
    """Undo ``patch_moe_experts``: drop the per-instance forwards; returns how many were restored."""
    count = 0
    for module in model.modules():
        if getattr(module, _PATCH_FLAG, None) is not None:
            if "forward" in module.__dict__:
                del module.forward
            delattr(module, _PATCH_FLAG)
            count += 1
    return count


def is_moe_patched(module: nn.Module) -> bool:
    return getattr(module, _PATCH_FLAG, None) is not None

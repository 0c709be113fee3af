"""SwiGLU MLPs with SiLU·up on :func:`~lora_lab.kernels.silu_mul`, for :func:`~lora_lab.kernels.patch_model`.

An MLP whose forward is exactly transformers' ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (Llama, Mistral,
Qwen2/3 and their copies; checked on the class's source, whitespace aside) with a SiLU ``act_fn``, and that holds a
patched projection, gets a ``BoundForward`` calling silu_mul on the gate/up pair: one kernel each way, the pair read
in place from their shared-input group's output. An MLP someone else already replaced (Liger's SwiGLU, another
patcher: a ``forward`` on the instance) is left alone, and :func:`unpatch_swiglu_mlps` keeps a forward set after ours.
"""
from __future__ import annotations

import functools
import inspect

from torch import nn

from lora_lab.kernels.bound_forward import BoundForward
from lora_lab.kernels.fused_mark import FUSED_STATE_ATTR
from lora_lab.kernels.lora.swiglu import SUPPORTED_DTYPES, silu_mul
from lora_lab.kernels.triton_helpers import interpreter_reason

__all__ = ["patch_swiglu_mlps", "unpatch_swiglu_mlps"]

_SWIGLU_ATTR = "_lora_lab_swiglu"
_SWIGLU_EXPRESSION = "self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))"


@functools.cache
def _forward_is_swiglu(cls) -> bool:
    """True when ``cls.forward(self, x)`` returns exactly ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""
    try:
        source = inspect.getsource(cls.forward)
        params = list(inspect.signature(cls.forward).parameters)
    except (OSError, TypeError, ValueError):
        return False
    body = [line.strip() for line in source.splitlines()[1:] if line.strip() and not line.strip().startswith("#")]
    text = "".join("".join(line.split()) for line in body)
    return params == ["self", "x"] and text in (f"return{_SWIGLU_EXPRESSION}",
                                                 f"down_proj={_SWIGLU_EXPRESSION}returndown_proj")


def _candidate(module) -> bool:
    if "forward" in module.__dict__ or not _forward_is_swiglu(type(module)):
        return False
    projections = [module._modules.get(n) for n in ("gate_proj", "up_proj", "down_proj")]
    act = getattr(module, "act_fn", None)  # nn.SiLU, or transformers' SiLUActivation (F.silu)
    return all(isinstance(p, nn.Module) for p in projections) \
        and (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation") \
        and any(hasattr(p, FUSED_STATE_ATTR) for p in projections)


def _swiglu_forward(module, x, *args, **kwargs):
    """The patched SwiGLU MLP forward (``BoundForward``): SiLU·up on silu_mul where the kernel can run."""
    if args or kwargs:
        return type(module).forward(module, x, *args, **kwargs)
    g, u = module.gate_proj(x), module.up_proj(x)
    if g.shape != u.shape or g.dtype != u.dtype or g.device != u.device or g.dtype not in SUPPORTED_DTYPES \
            or interpreter_reason(g, "silu_mul") is not None:  # silu_mul's own device and interpreter checks
        return module.down_proj(module.act_fn(g) * u)
    return module.down_proj(silu_mul(g, u))


def patch_swiglu_mlps(model: nn.Module) -> int:
    """Put every candidate MLP of ``model`` on :func:`silu_mul` (idempotent); returns how many were patched now."""
    count = 0
    for m in model.modules():
        if not hasattr(m, _SWIGLU_ATTR) and _candidate(m):
            setattr(m, _SWIGLU_ATTR, True)
            m.forward = BoundForward(_swiglu_forward, m)
            count += 1
    return count


def unpatch_swiglu_mlps(model: nn.Module) -> None:
    """Undo :func:`patch_swiglu_mlps`; a forward set on an MLP after ours (e.g. Liger's) stays."""
    for m in model.modules():
        if getattr(m, _SWIGLU_ATTR, False):
            forward = m.__dict__.get("forward")
            if isinstance(forward, BoundForward) and forward.function is _swiglu_forward:
                del m.__dict__["forward"]  # patched only where the instance had no forward of its own
            delattr(m, _SWIGLU_ATTR)

"""Shard a LoRA model with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each decoder layer becomes one FSDP unit and the root (embeddings, final norm, lm_head; tied weights stay in one
unit) another. Every parameter is a ``DTensor`` sharded on dim 0 across the ranks; a unit's parameters are
all-gathered just before its forward (and again before its backward when ``reshard_after_forward``), and the
gradients of the trainable ones are reduce-scattered after its backward. FSDP2 lets frozen and trainable
parameters share a unit, so the frozen base and the LoRA factors of a layer travel together; only the LoRA
gradients are reduced.

FSDP only unshards around a unit's ``forward``. The chunked and fused losses read the lm_head weight outside
``forward`` (they run the decoder body and apply the head themselves), so :func:`shard_model` installs
:data:`LOSS_METHOD` on the root, registered with ``register_fsdp_forward_method``: the loss then runs with the
root's parameters unsharded, and FSDP's end-of-backward bookkeeping is queued as for a forward.

The fused LoRA kernels (:func:`lora_lab.kernels.patch_model`) read the base and LoRA weights inside a custom
autograd Function, so they must run where FSDP has unsharded them. Patched *after* sharding with
``fuse_shared_inputs=False``, each LoRA linear's fused op runs in its own module's forward, inside its decoder
layer's forward: after the layer's unshard pre-hook; the Function saves the unsharded weight tensors, whose storage
FSDP refills before the layer's backward. Shared-input groups (q/k/v in one op) read a concatenated copy of the
weights instead, which FSDP never updates: ``patch_model`` refuses them on a sharded model, and
:func:`shard_model` refuses a model patched with them.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from lora_lab.distributed.lora_factors import adapter_key

__all__ = ["LOSS_METHOD", "decoder_layers", "shard_model", "is_sharded", "unwrap_peft", "device_mesh"]

LOSS_METHOD = "lora_lab_causal_lm_loss"  # the root's loss method, run under FSDP's pre/post-forward hooks


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a ``peft.PeftModel`` (the model itself otherwise)."""
    get_base = getattr(type(model), "get_base_model", None)
    return model.get_base_model() if callable(get_base) else model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers model (PEFT-wrapped or not), in order: the modules whose class is
    listed in the model's ``_no_split_modules`` (``Qwen2DecoderLayer``, ...)."""
    inner = unwrap_peft(model)
    names = set(getattr(inner, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise TypeError(
            f"{type(inner).__name__} declares no decoder layer class (_no_split_modules={sorted(names)}); "
            "shard_model needs a transformers causal LM"
        )
    return layers


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def device_mesh(device: torch.device | str | None = None):
    """A 1-D mesh over every rank of the default process group, on ``device``'s type (CPU: gloo, CUDA: nccl)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: start the job with lora_lab.distributed.launch "
                           "(torchrun) or call torch.distributed.init_process_group first")
    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    return init_device_mesh(kind, (dist.get_world_size(),))


def _checkpoint_forward(layer: nn.Module) -> None:
    """Recompute ``layer``'s forward in backward (non-reentrant checkpointing).

    The layer's own forward is wrapped, inside the module call: FSDP's hooks stay outside the checkpointed region
    (the parameters are unsharded when the recomputation runs, as FSDP unshards a unit before its backward), and
    the parameter names do not change (``checkpoint_wrapper`` would add ``_checkpoint_wrapped_module``).
    """
    from torch.utils.checkpoint import checkpoint

    forward = layer.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = checkpointed


def shard_model(
    model: nn.Module,
    mp_policy=None,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
    mesh=None,
) -> nn.Module:
    """``fully_shard`` every decoder layer of ``model``, then the root; returns the model (sharded in place).

    ``model`` is a transformers causal LM carrying LoRA (lora_lab's ``add_lora`` or a ``peft.PeftModel``), on a
    real device or on ``meta`` (then materialise it with :meth:`InitPlan.materialize` or :func:`materialize_random`).
    ``mp_policy`` is an FSDP2 ``MixedPrecisionPolicy`` (None: compute in the parameters' dtype, reduce in it too);
    ``reshard_after_forward`` frees each layer's gathered parameters after its forward (ZeRO-3) or keeps them
    until its backward (False: ZeRO-2-like, more memory, one all-gather fewer); ``activation_checkpointing``
    recomputes each decoder layer in backward (non-reentrant). ``mesh``: default, one dimension over all ranks.

    The root gets a method :data:`LOSS_METHOD` (``model.lora_lab_causal_lm_loss(input_ids, labels, ...)``, the
    arguments of :func:`lora_lab.causal_lm_loss`) that runs with FSDP's forward hooks.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    from lora_lab.loss import causal_lm_loss

    if is_sharded(model):
        raise ValueError(f"{type(model).__name__} is already sharded (fully_shard was applied)")
    if not any(adapter_key(n) is not None and p.requires_grad for n, p in model.named_parameters()):
        raise ValueError(f"{type(model).__name__} has no trainable LoRA factor: add LoRA (lora_lab.add_lora or "
                         "peft.get_peft_model) before sharding")
    grouped = [n for n, m in model.named_modules() if getattr(getattr(m, "_lora_lab_fused", None), "group", None)]
    if grouped:
        raise ValueError(
            f"{grouped[0]} (and {len(grouped) - 1} more) was patched with lora_lab.kernels.patch_model into a "
            "shared-input group, whose weights are views of one concatenated buffer that FSDP would copy apart; "
            "unpatch_model(model), shard, then patch_model(model, fuse_shared_inputs=False)"
        )
    layers = decoder_layers(model)
    if mesh is None:
        where = next(model.parameters()).device
        mesh = device_mesh(where if where.type != "meta" else None)  # a meta model: CUDA if there is one
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
              "mp_policy": mp_policy if mp_policy is not None else MixedPrecisionPolicy()}
    for layer in layers:
        if activation_checkpointing:
            _checkpoint_forward(layer)
        fully_shard(layer, **kwargs)
    inner = unwrap_peft(model)
    setattr(model, LOSS_METHOD, functools.partial(causal_lm_loss, inner))
    fully_shard(model, **kwargs)
    register_fsdp_forward_method(model, LOSS_METHOD)
    return model

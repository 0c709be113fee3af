"""Route a transformers causal LM's loss through :func:`linear_cross_entropy` (no logits when labels are given).

``patch_causal_lm_loss(model)`` replaces the forward of the ``*ForCausalLM`` module (an instance attribute; PEFT
wrappers are looked through) by one that, when ``labels`` are passed, runs the decoder body for the final hidden
states and computes the loss from them and the lm_head weight; ``logits`` in the output is then None. Without
labels the original forward runs. Gradient checkpointing, PEFT and the fused LoRA kernels act inside the body and
are unaffected. Transformers' loss conventions are kept: labels are shifted by one (or ``shift_labels`` is used
as given), ``ignore_index`` -100, and ``num_items_in_batch`` (gradient accumulation) turns the mean into
sum / num_items_in_batch.
What the model's forward does to its logits between the head and the loss (a scale, a soft-cap:
:mod:`lora_lab.logit_transforms`) is done here too; a forward that does something else is refused
(:class:`~lora_lab.logit_transforms.UnsupportedLogitTransform`, naming the class and the statement) and left unpatched.
An MoE forward that adds its router's auxiliary loss (``output_router_logits``) is refused while that is on: at
patching when the config turns it on, at the call when the call does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lora_lab.kernels.loss.linear_ce import LossKernelConfig, linear_cross_entropy
from lora_lab.logit_transforms import UnsupportedLogitTransform, logit_transform

__all__ = ["patch_causal_lm_loss", "unpatch_causal_lm_loss", "causal_lm_of", "fused_head_loss",
           "UnsupportedLogitTransform"]

_STATE_ATTR = "_lora_lab_fused_loss"
IGNORE_INDEX = -100


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers ``*ForCausalLM`` inside ``model`` (itself, or PEFT's base model)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(inner, getattr(inner, "base_model_prefix", ""), None)
    if not hasattr(inner, "get_output_embeddings") or not isinstance(body, nn.Module) or body is inner:
        raise TypeError(f"{type(model).__name__} holds no transformers *ForCausalLM model (decoder body + lm_head)")
    return inner


def _plain_head(lm: nn.Module) -> nn.Linear:
    head = lm.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise TypeError(f"the fused loss needs the lm_head to be a plain nn.Linear (no adapter on it); got "
                        f"{type(head).__name__}")
    if head.bias is not None:
        raise ValueError("the fused loss supports an lm_head without bias only")
    return head


def fused_head_loss(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor | None = None,
                    shift_labels: torch.Tensor | None = None, num_items_in_batch=None,
                    ignore_index: int = IGNORE_INDEX, config: LossKernelConfig | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Transformers' causal-LM loss of ``hidden`` [B, T, d] under the head ``head_weight`` [V, d] (logits soft-capped
    at ``softcap`` first, if given), fused."""
    if shift_labels is None:
        if labels is None:
            raise ValueError("fused_head_loss needs labels or shift_labels")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    if num_items_in_batch is None:
        return linear_cross_entropy(hidden, head_weight, shift_labels, ignore_index=ignore_index, config=config,
                                    softcap=softcap)
    total = linear_cross_entropy(hidden, head_weight, shift_labels, ignore_index=ignore_index, reduction="sum",
                                 config=config, softcap=softcap)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def patch_causal_lm_loss(model: nn.Module, config: LossKernelConfig | None = None) -> nn.Module:
    """Make ``model(..., labels=...)`` compute its loss with the fused op (idempotent); returns the patched
    ``*ForCausalLM`` module. Raises :class:`UnsupportedLogitTransform` (and patches nothing) where the model's
    forward does something to its logits before the loss that the op cannot reproduce."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    lm = causal_lm_of(model)
    head = _plain_head(lm)
    if hasattr(lm, _STATE_ATTR):
        return lm
    transform = logit_transform(lm, head)
    if transform.loss_added_when and getattr(lm.config, transform.loss_added_when, False):
        raise UnsupportedLogitTransform(_router_loss_message(lm, "config."))
    original = lm.__dict__.get("forward")
    body = getattr(lm, lm.base_model_prefix)

    def forward(input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        shift = kwargs.pop("shift_labels", None)
        if labels is None and shift is None:
            return type(lm).forward(lm, input_ids=input_ids, attention_mask=attention_mask,
                                    position_ids=position_ids, past_key_values=past_key_values,
                                    inputs_embeds=inputs_embeds, use_cache=use_cache,
                                    logits_to_keep=logits_to_keep, **kwargs)
        num_items = kwargs.pop("num_items_in_batch", None)
        if transform.loss_added_when:
            flag = kwargs.get(transform.loss_added_when)
            if flag if flag is not None else getattr(lm.config, transform.loss_added_when, False):
                raise ValueError(_router_loss_message(lm, ""))
        out = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        weight = _plain_head(lm).weight
        hidden, softcap = transform.apply(lm, out.last_hidden_state, weight)
        loss = fused_head_loss(hidden, weight, labels, shift, num_items, config=config, softcap=softcap)
        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=getattr(out, "past_key_values", None),
                                      hidden_states=out.hidden_states, attentions=out.attentions)

    setattr(lm, _STATE_ATTR, original)
    lm.forward = forward
    return lm


def _router_loss_message(lm: nn.Module, where: str) -> str:
    return (f"{type(lm).__name__} adds its router's auxiliary loss to the loss when {where}output_router_logits is "
            "True, which the fused loss does not; set it False or leave the model's own loss (fused_loss=False, "
            "unpatch_causal_lm_loss)")


def unpatch_causal_lm_loss(model: nn.Module) -> bool:
    """Undo :func:`patch_causal_lm_loss`; True if something was unpatched."""
    try:
        lm = causal_lm_of(model)
    except TypeError:
        return False
    if not hasattr(lm, _STATE_ATTR):
        return False
    original = getattr(lm, _STATE_ATTR)
    if original is None:
        lm.__dict__.pop("forward", None)
    else:
        lm.forward = original
    delattr(lm, _STATE_ATTR)
    return True

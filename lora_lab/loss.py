"""Causal-LM cross-entropy over the lm_head that never holds all [tokens x vocab] logits at once.

The standard path (transformers' ``ForCausalLMLoss``) materialises the logits ``Z = H W^T``
([N x V] in the model dtype), an fp32 copy of them, and the fp32 log-softmax that
``cross_entropy`` saves for backward; its backward then builds two more fp32 [N x V] buffers.
For Qwen2.5-0.5B (V = 151,936) at 16,384 tokens that is ~28 GiB on top of everything else.

Here the N rows are processed ``chunk_size`` at a time. With ``z_i = W h_i`` (row i of Z), target
``y_i`` and the set ``S`` of rows whose label is not ``ignore_index``:

    lse_i  = log sum_v exp(z_iv)                         (fp32)
    loss   = (1/|S|) sum_{i in S} (lse_i - z_{i,y_i})      (reduction="mean"; "sum" drops 1/|S|)

Backward, with ``g`` the incoming gradient of the loss and ``p_i = softmax(z_i) = exp(z_i - lse_i)``:

    dL/dz_i = (g/|S|) (p_i - onehot(y_i))   for i in S,   0 otherwise
    dL/dh_i = (dL/dz_i) W                   dL/dW = sum_i (dL/dz_i)^T h_i

Only H, the labels and lse (one fp32 per row) are saved; each chunk's logits are recomputed in
backward. Peak extra memory is a few [chunk_size x V] buffers instead of several [N x V] ones.
Numerics follow the standard path: logits are produced by a GEMM in the model dtype, then
upcast to fp32 for the softmax, and the logits gradient is rounded back to the model dtype before
the two backward GEMMs (what autograd does through ``logits.float()``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lora_lab.logit_transforms import logit_transform

__all__ = [
    "ChunkedLinearCrossEntropy",
    "chunked_cross_entropy",
    "reference_cross_entropy",
    "shift_labels",
    "causal_lm_loss",
]

DEFAULT_CHUNK_SIZE = 1024


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                  reduction: str) -> None:
    if (not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor)
            or not isinstance(labels, torch.Tensor)):
        raise TypeError("hidden, weight and labels must be torch.Tensors")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [vocab, hidden], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden's last dimension ({tuple(hidden.shape)}) must equal weight's second "
            f"dimension ({tuple(weight.shape)})"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal hidden's leading dimensions {tuple(hidden.shape[:-1])}"
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be int64 (or int32) class indices, got {labels.dtype}")
    if not hidden.is_floating_point() or hidden.dtype != weight.dtype:
        raise TypeError(f"hidden and weight must share one floating dtype, got {hidden.dtype} and {weight.dtype}")
    if hidden.device != weight.device or labels.device != hidden.device:
        raise ValueError(
            f"hidden, weight and labels must be on one device, got {hidden.device}, {weight.device}, {labels.device}"
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32 and lower precisions (as the standard path's upcast), fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(H W^T, y)`` computed ``chunk_size`` rows at a time; logits recomputed in backward.

    Inputs: hidden [N, d], weight [V, d], labels [N] (int64; ``ignore_index`` rows are skipped).
    Saves hidden, weight, labels and lse [N] (fp32) -- never an [N, V] tensor.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, ignore_index, reduction):
        n_rows = hidden.shape[0]
        vocab = weight.shape[0]
        valid = labels != ignore_index
        bad = valid & ((labels < 0) | (labels >= vocab))
        if bool(bad.any()):
            first = int(labels[bad][0])
            raise IndexError(f"label {first} is outside the vocabulary [0, {vocab}) "
                             f"and is not ignore_index={ignore_index}")
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
        acc = _softmax_dtype(hidden.dtype)
        lse = torch.empty(n_rows, dtype=acc, device=hidden.device)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        for start in range(0, n_rows, chunk_size):
            rows = slice(start, min(start + chunk_size, n_rows))
            # z = h W^T in the model dtype (the GEMM lm_head runs), then fp32 for the softmax
            logits = F.linear(hidden[rows], weight).to(acc)
            target_logit = logits.gather(1, safe_labels[rows].unsqueeze(1)).squeeze(1)
            # lse_i = max_i + log sum_v exp(z_iv - max_i), exponentiated in place (no second chunk buffer)
            row_max = logits.amax(dim=-1)
            lse[rows] = row_max + logits.sub_(row_max.unsqueeze(1)).exp_().sum(dim=-1).log()
            del logits
            # loss_i = lse_i - z_{i, y_i} on rows with a label
            total += torch.where(valid[rows], lse[rows] - target_logit, 0.0).sum()
        # |S|: the number of rows that carry a label (mean reduction divides by it; 0 gives nan, as F.cross_entropy)
        count = valid.sum().to(acc)
        loss = total / count if reduction == "mean" else total
        ctx.save_for_backward(hidden, weight, labels, lse, count)
        ctx.chunk_size = chunk_size
        ctx.ignore_index = ignore_index
        ctx.reduction = reduction
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse, count = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n_rows = hidden.shape[0]
        valid = labels != ctx.ignore_index
        safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
        # every labelled row's gradient is scaled by g (and 1/|S| for the mean)
        acc = _softmax_dtype(hidden.dtype)
        scale = grad_loss.to(acc)
        if ctx.reduction == "mean":
            scale = scale / count
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # dL/dW accumulates over chunks in fp32, rounded once at the end
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
        for start in range(0, n_rows, ctx.chunk_size):
            rows = slice(start, min(start + ctx.chunk_size, n_rows))
            h = hidden[rows]
            # recompute z in the model dtype, upcast: the same numbers the forward used
            probs = F.linear(h, weight).to(acc)
            # p = exp(z - lse), in place
            probs.sub_(lse[rows].unsqueeze(1)).exp_()
            # p - onehot(y) on labelled rows
            row_index = torch.arange(probs.shape[0], device=probs.device)
            probs[row_index, safe_labels[rows]] -= 1.0
            # times g/|S| on labelled rows, 0 on ignored ones
            probs.mul_((valid[rows].to(acc) * scale).unsqueeze(1))
            # the logits gradient in the model dtype (what autograd's .float() backward does)
            grad_logits = probs.to(hidden.dtype)
            del probs
            if need_hidden:
                # dL/dh = dL/dz W
                grad_hidden[rows] = grad_logits @ weight
            if need_weight:
                # dL/dW += (dL/dz)^T h  (fp32: straight into the accumulator; else one chunk product, added in fp32)
                if grad_logits.dtype == acc:
                    grad_weight.addmm_(grad_logits.t(), h)
                else:
                    grad_weight.add_(grad_logits.t() @ h)
            del grad_logits
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels``, ``chunk_size`` rows at a time.

    ``hidden`` [..., d], ``weight`` [V, d] (an lm_head weight, no bias), ``labels`` [...] with
    ``ignore_index`` marking rows without a target. Matches
    ``F.cross_entropy((hidden @ weight.T).float().view(-1, V), labels.view(-1), ignore_index=...)``
    in value and gradients. Labels are used as given: shift them first for next-token prediction
    (:func:`shift_labels`).
    """
    _check_inputs(hidden, weight, labels, chunk_size, reduction)
    d = hidden.shape[-1]
    return ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, d), weight, labels.reshape(-1).long(), chunk_size, ignore_index, reduction
    )


def reference_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """The plain-torch reference: all logits at once, upcast to fp32 (fp64 stays), ``F.cross_entropy``."""
    logits = F.linear(hidden, weight).to(_softmax_dtype(hidden.dtype))
    return F.cross_entropy(logits.reshape(-1, weight.shape[0]), labels.reshape(-1).long(),
                           ignore_index=ignore_index, reduction=reduction)


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Next-token targets, as transformers' ForCausalLMLoss builds them: position t predicts
    ``labels[t+1]``; the last position gets ``ignore_index``."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


def _decoder_of(model: nn.Module) -> nn.Module:
    prefix = getattr(model, "base_model_prefix", "model")
    body = getattr(model, prefix, None)
    if not isinstance(body, nn.Module) or body is model:
        raise TypeError(
            f"{type(model).__name__} has no decoder body at .{prefix}; causal_lm_loss needs a "
            "transformers *ForCausalLM model (body + lm_head)"
        )
    return body


def causal_lm_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    chunked: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    ignore_index: int = -100,
    fused: bool = False,
) -> torch.Tensor:
    """Next-token loss of a transformers causal LM (mean over labelled positions).

    ``chunked=False`` is the standard path, ``model(input_ids, labels=labels).loss`` (all logits).
    ``chunked=True`` runs the decoder body for the final hidden states and applies
    :func:`chunked_cross_entropy` with the lm_head weight; labels are shifted the same way
    transformers shifts them. ``fused=True`` (whatever ``chunked`` says) applies the Triton op
    :func:`lora_lab.kernels.loss.linear_cross_entropy` to those hidden states instead: no logits at all.
    ``labels=None`` uses ``input_ids``. The lm_head must be a plain linear layer without bias (as in
    Qwen2 / Llama); a LoRA-wrapped head is rejected. What the model's forward does to its logits before its
    loss is done too (:mod:`lora_lab.logit_transforms`: a scale on both paths, a soft-cap with ``fused=True``);
    a forward that does something else raises :class:`~lora_lab.logit_transforms.UnsupportedLogitTransform`.
    """
    if labels is None:
        labels = input_ids
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal input_ids shape {tuple(input_ids.shape)}")
    if not (chunked or fused):
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False).loss
    which = "fused" if fused else "chunked"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"the {which} loss needs the lm_head to be a plain nn.Linear, got {type(head).__name__}"
        )
    if head.bias is not None:
        raise ValueError(f"the {which} loss supports an lm_head without bias only")
    body = _decoder_of(model)
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    transform = logit_transform(lm, head)  # what the forward does to the logits before its loss (or refused)
    if not fused and transform.softcap_value(lm) is not None:
        raise ValueError(f"{type(lm).__name__} soft-caps its logits ({transform.softcap} = "
                         f"{transform.softcap_value(lm)}), which the chunked loss does not; pass fused=True")
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    hidden, softcap = transform.apply(lm, hidden, head.weight)
    targets = shift_labels(labels, ignore_index)
    if fused:
        from lora_lab.kernels.loss import linear_cross_entropy  # imports Triton: only when asked for

        return linear_cross_entropy(hidden, head.weight, targets, ignore_index=ignore_index, softcap=softcap)
    return chunked_cross_entropy(hidden, head.weight, targets, chunk_size=chunk_size, ignore_index=ignore_index)

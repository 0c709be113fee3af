"""The loss block in Triton: cross-entropy straight from the hidden states and the lm_head weight.

* :func:`linear_cross_entropy` — forward and backward without the [tokens x vocabulary] logits
  (:mod:`.linear_ce` for the maths and the memory plan, :mod:`.kernels` for the two Triton kernels);
* :func:`linear_cross_entropy_reference` — the same definition in plain torch, all logits at once;
* :func:`patch_causal_lm_loss` — ``model(..., labels=...)`` of a transformers causal LM through the fused op.
"""
from lora_lab.kernels.loss.linear_ce import (
    LinearCrossEntropyFunction,
    LossKernelConfig,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)
from lora_lab.kernels.loss.patch import fused_head_loss, patch_causal_lm_loss, unpatch_causal_lm_loss

__all__ = ["LinearCrossEntropyFunction", "LossKernelConfig", "fused_head_loss", "linear_cross_entropy",
           "linear_cross_entropy_reference", "patch_causal_lm_loss", "unpatch_causal_lm_loss"]

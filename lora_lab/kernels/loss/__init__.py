"""The loss block in Triton: cross-entropy straight from the hidden states and the lm_head weight.

* :func:`linear_cross_entropy` — forward and backward without the [tokens x vocabulary] logits, on one of two
  paths: gradients in forward on cuBLAS GEMMs over row chunks (:mod:`.fwdgrad`, a training step's scalar loss) or
  the recomputing Triton kernels (:mod:`.linear_ce`, :mod:`.kernels`: inference, reduction="none", fp16, small or
  memory-capped problems); :func:`choose_impl` is the rule, :func:`chosen_impl` what a call would take;
* :func:`linear_cross_entropy_reference` — the same definition in plain torch, all logits at once;
* :func:`patch_causal_lm_loss` — ``model(..., labels=...)`` of a transformers causal LM through the fused op.
"""
from lora_lab.kernels.loss.linear_ce import (
    LinearCrossEntropyFunction,
    LossKernelConfig,
    choose_impl,
    chosen_impl,
    linear_cross_entropy,
    linear_cross_entropy_reference,
)
from lora_lab.kernels.loss.patch import fused_head_loss, patch_causal_lm_loss, unpatch_causal_lm_loss

__all__ = ["LinearCrossEntropyFunction", "LossKernelConfig", "choose_impl", "chosen_impl", "fused_head_loss",
           "linear_cross_entropy",
           "linear_cross_entropy_reference", "patch_causal_lm_loss", "unpatch_causal_lm_loss"]

"""MoE experts in Triton, with optional LoRA on them.

:mod:`.routing` sorts token→expert assignments on the device; :mod:`.gate_up_silu`, :mod:`.grouped_gemm`,
:mod:`.down_backward` and :mod:`.expert_weight_grad` are the grouped GEMMs (sharing :mod:`.tiles` and
:mod:`.launch`); :mod:`.experts` is the autograd Function, :mod:`.lora` PEFT's expert-LoRA layout, and
:mod:`.patch` swaps transformers' experts modules for the fused ones.
"""

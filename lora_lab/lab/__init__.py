"""The lab: pre-registered predictions, the notebook runner, recording, grading, verification, publishing, timing
and the ``lora-lab`` command. Nothing here is needed to use the LoRA layer or the kernels."""

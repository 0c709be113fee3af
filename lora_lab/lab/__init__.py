"""The lab: pre-registered predictions, the notebook runner, recording, grading, verification, publishing, timing
and the ``lora-lab`` command. Nothing here is needed to use the LoRA layer or the kernels."""
from lora_lab.lab.answers import figures, show_answer
from lora_lab.lab.recording import environment_report, finish_run, output_dir, record, resolve_profile, start_run
from lora_lab.lab.verdicts import show_verdicts

# what a notebook calls (``from lora_lab import lab``; ``lab.start_run(...)``, ``lab.record(...)``, ...)
__all__ = ["start_run", "record", "finish_run", "output_dir", "resolve_profile", "environment_report", "show_verdicts",
           "figures", "show_answer"]

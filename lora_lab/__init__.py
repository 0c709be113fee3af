"""lora_lab: the LoRA layer, adapters in PEFT's format, model loading, a chunked loss and memory probes, plus the
lab that runs the pre-registered notebooks.

The three layers of the package, a folder each:

* the library — this package's top level, :mod:`lora_lab.memory` and :mod:`lora_lab.kernels` (Triton; imported
  on demand, so ``import lora_lab`` does not import Triton);
* :mod:`lora_lab.lab` — predictions, the notebook runner, recording, grading, verification, publishing, the CLI;
  a notebook's harness (``start_run``, ``record``, ``finish_run``, ``show_verdicts``, ...) is imported from there
  (``from lora_lab import lab``), not from this top level, which holds the library only;
* :mod:`lora_lab.experiments` — code that one notebook uses, a module named after its notebook.
"""
from lora_lab.adapters import (
    AdapterError,
    AdapterExistsError,
    AdapterNotFoundError,
    copy_adapters_to_peft,
    load_adapter,
    peft_lora_model,
    save_adapter,
)
from lora_lab.determinism import deterministic, seed_everything
from lora_lab.embedding_lora import LoRAEmbedding
from lora_lab.layer import (
    LoRALinear,
    ParameterCount,
    adapter_layers,
    add_lora,
    count_parameters,
    fill_lora_B,
    find_target_linears,
    lora_layers,
    merge_lora,
    remove_lora,
    replace_module,
)
from lora_lab.loss import causal_lm_loss, chunked_cross_entropy
from lora_lab.memory.budget import apply_memory_cap as _apply_memory_cap
from lora_lab.memory.peaks import install as _record_peak_at_exit
from lora_lab.models import (
    ENGLISH_SENTENCES,
    SAMPLE_SENTENCES,
    ByteTokenizer,
    ModelNotFoundError,
    english_sentences,
    load_model,
    load_tokenizer,
    model_config,
    model_logits,
    random_model_names,
    text_batch,
)
from lora_lab.modules_to_save import TrainedCopy, trained_copies
from lora_lab.numerics import cosine, error_stats, max_abs_diff, rel_l2
from lora_lab.training import train_steps
from lora_lab.variants import loraplus_optimizer, loraplus_param_groups
from lora_lab.vera import VeRALinear, add_vera, vera_layers

__version__ = "0.1.0"

_apply_memory_cap()  # $LORA_LAB_MEMORY_CAP_GIB (the capped gpu profiles): before this process's first CUDA allocation
_record_peak_at_exit()  # $LORA_LAB_PEAK_DIR (set by lora-lab run): this process's GPU memory peak, written at exit

__all__ = [
    "train_steps",
    "text_batch",
    "peft_lora_model",
    "model_logits",
    "copy_adapters_to_peft",
    "AdapterError",
    "AdapterExistsError",
    "AdapterNotFoundError",
    "ByteTokenizer",
    "SAMPLE_SENTENCES",
    "ENGLISH_SENTENCES",
    "english_sentences",
    "LoRALinear",
    "LoRAEmbedding",
    "TrainedCopy",
    "trained_copies",
    "VeRALinear",
    "add_vera",
    "vera_layers",
    "adapter_layers",
    "ModelNotFoundError",
    "ParameterCount",
    "__version__",
    "add_lora",
    "causal_lm_loss",
    "chunked_cross_entropy",
    "cosine",
    "count_parameters",
    "deterministic",
    "error_stats",
    "fill_lora_B",
    "find_target_linears",
    "load_adapter",
    "load_model",
    "load_tokenizer",
    "loraplus_optimizer",
    "loraplus_param_groups",
    "lora_layers",
    "max_abs_diff",
    "merge_lora",
    "model_config",
    "random_model_names",
    "rel_l2",
    "remove_lora",
    "replace_module",
    "save_adapter",
    "seed_everything",
]

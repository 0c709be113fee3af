"""Adapters on disk in PEFT's format.

A directory with ``adapter_config.json`` (PEFT's LoraConfig fields) and
``adapter_model.safetensors`` whose keys are PEFT's:
``base_model.model.<module name>.lora_A.weight`` (r x in) and ``...lora_B.weight`` (out x r), and for DoRA
``...lora_magnitude_vector`` (out). So an adapter trained here loads with ``peft.PeftModel.from_pretrained`` and a
PEFT-saved LoRA adapter loads here. rsLoRA and DoRA (``use_rslora``, ``use_dora``) and per-layer ranks and alphas
(``rank_pattern``, ``alpha_pattern``) travel both ways, and so do LoRA on embeddings (``...lora_embedding_A``,
``...lora_embedding_B``) and ``modules_to_save`` (see :mod:`~lora_lab.adapters.full_weights`).

The modules, by what they do:

* :mod:`~lora_lab.adapters.errors` — ``AdapterError`` and its two file-error subclasses;
* :mod:`~lora_lab.adapters.peft_files` — the directory's file names, tensor keys, reading the weights;
* :mod:`~lora_lab.adapters.peft_config` — ``adapter_config.json``: the LoraConfig written, any config read and checked;
* :mod:`~lora_lab.adapters.saving` / :mod:`~lora_lab.adapters.loading` — ``save_adapter`` / ``load_adapter``;
* :mod:`~lora_lab.adapters.full_weights` — the full tensors beside the factors: base weights, modules_to_save;
* :mod:`~lora_lab.adapters.vera_format` — the same for VeRA adapters;
* :mod:`~lora_lab.adapters.peft_models` — the adapters in a PEFT model in memory (parity checks, PEFT's merge).
"""
from lora_lab.adapters.errors import AdapterError, AdapterExistsError, AdapterNotFoundError
from lora_lab.adapters.loading import load_adapter
from lora_lab.adapters.peft_models import copy_adapters_to_peft, peft_lora_model, peft_lora_pairs
from lora_lab.adapters.saving import save_adapter

__all__ = ["save_adapter", "load_adapter", "AdapterError", "AdapterNotFoundError", "AdapterExistsError",
           "peft_lora_model", "peft_lora_pairs", "copy_adapters_to_peft"]

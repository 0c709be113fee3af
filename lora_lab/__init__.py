"""lora_lab: pre-registered experiments, and the kernels behind them, about making LoRA cheap.

The public names are imported lazily, so ``import lora_lab`` stays cheap (no transformers import
until a model is loaded, no Triton until a kernel is used).
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    # the layer and model surgery
    "LoRALinear": "layer",
    "ParameterCount": "layer",
    "add_lora": "layer",
    "merge_lora": "layer",
    "count_parameters": "layer",
    "lora_layers": "layer",
    "fill_lora_B": "layer",
    # adapters in PEFT's format
    "save_adapter": "adapters",
    "load_adapter": "adapters",
    "AdapterError": "adapters",
    # models and tokenizers
    "load_model": "models",
    "load_tokenizer": "models",
    "model_config": "models",
    "random_model_names": "models",
    "ModelNotFoundError": "models",
    "ByteTokenizer": "models",
    # exact experiments
    "seed_everything": "determinism",
    "deterministic": "determinism",
    # recording metrics from notebooks
    "resolve_profile": "recording",
    "start_run": "recording",
    "record": "recording",
    "finish_run": "recording",
    "output_dir": "recording",
    "environment_report": "recording",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lora_lab' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__

"""The files of an adapter directory in PEFT's layout: their names, the prefix of the tensor keys, where a save may
write, and reading the weights (safetensors, or the legacy torch pickle) with every tensor checked to be finite."""
from __future__ import annotations

from pathlib import Path

import torch

from lora_lab.adapters.errors import AdapterError, AdapterExistsError, AdapterNotFoundError

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "LEGACY_WEIGHTS_NAME", "PREFIX", "VERA_A_KEY", "VERA_B_KEY"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
LEGACY_WEIGHTS_NAME = "adapter_model.bin"
PREFIX = "base_model.model."
VERA_A_KEY, VERA_B_KEY = "base_model.vera_A", "base_model.vera_B"


def _check_destination(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise AdapterExistsError(f"{out} is a file, not a directory: cannot save an adapter there")
    present = [f for f in (CONFIG_NAME, WEIGHTS_NAME, LEGACY_WEIGHTS_NAME) if (out / f).exists()]
    if present and not overwrite:
        raise AdapterExistsError(
            f"{out} already holds an adapter ({', '.join(present)}); pass overwrite=True to replace it, "
            "or choose another directory"
        )


def _check_finite(tensors: dict[str, torch.Tensor], source: Path) -> dict[str, torch.Tensor]:
    """``tensors``, after checking that none holds a NaN or an infinity (PEFT loads such an adapter silently, and
    the model's outputs turn into NaN)."""
    for key, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            raise AdapterError(f"{source}: tensor {key!r} holds non-finite values ({nan} NaN, {inf} inf of "
                               f"{t.numel()}); refusing to load a broken adapter")
    return tensors


def _refuse_non_finite_save(tensors: dict[str, torch.Tensor], out: Path) -> None:
    """Before a save writes anything: a tensor holding a NaN or an infinity is refused by name (load_adapter would
    refuse the file)."""
    for key, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            raise AdapterError(f"tensor {key!r} holds non-finite values ({nan} NaN, {inf} inf of {t.numel()}); "
                               f"refusing to save a broken adapter to {out}")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    weights = path / WEIGHTS_NAME
    if weights.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(weights))
        except (SafetensorError, OSError, ValueError) as exc:
            raise AdapterError(f"{weights} is not a readable safetensors file (truncated or corrupt?): {exc}") from exc
        return _check_finite(tensors, weights)
    legacy = path / LEGACY_WEIGHTS_NAME
    if legacy.is_file():
        import pickle

        try:
            tensors = torch.load(legacy, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as exc:
            raise AdapterError(f"{legacy} is not a readable torch checkpoint (truncated or corrupt?): {exc}") from exc
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise AdapterError(f"{legacy} does not hold a dict of tensors")
        return _check_finite(tensors, legacy)
    raise AdapterNotFoundError(f"{path} holds neither {WEIGHTS_NAME} nor {LEGACY_WEIGHTS_NAME}")


_TENSOR_SUFFIXES = {
    "A": (".lora_A.weight", ".lora_A.default.weight"),
    "B": (".lora_B.weight", ".lora_B.default.weight"),
    "M": (".lora_magnitude_vector", ".lora_magnitude_vector.weight", ".lora_magnitude_vector.default.weight"),
    "EA": (".lora_embedding_A", ".lora_embedding_A.default"),  # LoRA on an nn.Embedding
    "EB": (".lora_embedding_B", ".lora_embedding_B.default"),
}


def _module_name(key: str, source: Path) -> tuple[str, str]:
    """'base_model.model.X.lora_A.weight' -> ('X', 'A'); '...X.lora_magnitude_vector' -> ('X', 'M') (DoRA);
    '...X.lora_embedding_A' -> ('X', 'EA') (an embedding's A). Tolerates an adapter name ('lora_A.default.weight')."""
    k = key[len(PREFIX):] if key.startswith(PREFIX) else key
    for which, suffixes in _TENSOR_SUFFIXES.items():
        for suffix in suffixes:
            if k.endswith(suffix):
                return k[: -len(suffix)], which
    raise AdapterError(
        f"{source}: unexpected tensor {key!r} in the adapter (expected ...lora_A.weight / ...lora_B.weight, "
        "...lora_embedding_A / ...lora_embedding_B for an embedding, ...lora_magnitude_vector with use_dora, "
        "...base_layer.weight of a target, and the tensors of modules_to_save)"
    )

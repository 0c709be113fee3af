"""huggingface_hub held offline for the length of a block: local reads of models and tokenizers that must not
touch the network. Used by :mod:`lora_lab.models` and :mod:`lora_lab.pretrained`."""
from __future__ import annotations

import contextlib

__all__ = ["hub_offline"]


@contextlib.contextmanager
def hub_offline():
    """huggingface_hub in offline mode for the duration (its ``HF_HUB_OFFLINE``, read once at import, set and then
    restored). ``local_files_only`` alone is not enough: building the headers of a request that is never sent still
    fetches huggingface_hub's agent registry from the hub (a 3 s timeout when the network is down)."""
    from huggingface_hub import constants

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before

"""Shared test set-up: Triton's interpreter on CPU-only machines, and GPU tests skipped there."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must happen before anything imports triton: the interpreter runs kernels on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

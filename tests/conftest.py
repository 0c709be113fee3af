"""Shared test set-up: Triton's interpreter on CPU-only machines, GPU tests skipped there, the files with slow
tests collected first, and the tiny model and token ids that the memory tests share."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must happen before anything imports triton: the interpreter runs kernels on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")


def pytest_collection_modifyitems(config, items):
    # The files holding a test marked slow first, each file's tests and the other files keeping their order: make
    # test's pytest-xdist (--dist loadfile --no-loadscope-reorder) hands out whole files in this order, so the longest
    # start early and the last to finish are short ones, instead of one worker running a long file while the other
    # waits.
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item):
    # a test of a TMA form (gemm_loads 'tma' / 'persistent', moe_loads='persistent', the loss's accumulate='tma') on a
    # GPU class without TMA, the hardware's or the one $LORA_LAB_ARCH forces: the kernels refuse it by name, so the
    # test has nothing to check there
    if item.get_closest_marker("needs_tma") is not None and torch.cuda.is_available():
        from lora_lab import gpu_arch

        if not gpu_arch.has_tma("cuda"):
            pytest.skip(f"reads through TMA descriptors, which GPU class {gpu_arch.gpu_class('cuda')!r} lacks "
                        f"(${gpu_arch.ARCH_ENV} may force it)")


@pytest.fixture(autouse=True)
def _profile_switches_steer_gpu_tests_only(request, monkeypatch):
    """``$LORA_LAB_ARCH`` and ``$LORA_LAB_MEMORY_CAP_GIB`` (the switches of the gpu-sm80 and capped profiles) set
    for a test run steer the kernels of the tests marked gpu: ``LORA_LAB_ARCH=sm80 pytest -m gpu`` is the GPU suite
    on the Ampere path. Every other test checks logic that sets them itself (the runner's profile checks, a peer's
    capability message), so it runs without the ambient values."""
    if request.node.get_closest_marker("gpu") is None:
        from lora_lab.gpu_arch import ARCH_ENV
        from lora_lab.memory.budget import MEMORY_CAP_ENV

        for name in (ARCH_ENV, MEMORY_CAP_ENV):
            monkeypatch.delenv(name, raising=False)


@pytest.fixture
def ampere_path(monkeypatch):
    """Every device, the CPU included, reports compute capability 8.0 to :mod:`lora_lab.gpu_arch`: the kernels make
    the Ampere class's choices (what ``LORA_LAB_ARCH=sm80`` forces on a GPU) in Triton's interpreter too."""
    from lora_lab import gpu_arch

    monkeypatch.setattr(gpu_arch, "capability", lambda device=None: (8, 0))


@pytest.fixture(scope="module")
def tiny_fp32():
    """A random-init tiny Qwen2 in fp32 with SDPA attention, in train mode (one per test module)."""
    import lora_lab

    return lora_lab.load_model("random:tiny-qwen2", attn_implementation="sdpa").train()


@pytest.fixture
def random_ids():
    """``random_ids(model, batch=2, seq=24, seed=0)``: seeded token ids over the model's vocabulary."""

    def make(model, batch=2, seq=24, seed=0):
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen)

    return make


@pytest.fixture(scope="session")
def load_tool():
    """``load_tool("name")``: ``tools/name.py`` imported as a module (``tools/`` is a folder of scripts, not a
    package)."""
    import importlib.util
    from pathlib import Path

    tools = Path(__file__).resolve().parents[1] / "tools"

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, tools / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load

"""lora_lab.memory.budget: the process-wide GPU memory cap, and cells that shrink or skip under it."""
from types import SimpleNamespace

import pytest
import torch

import lora_lab
from lora_lab.experiments import memory_breakdown as mb
from lora_lab.memory import budget

GIB = 1024 ** 3


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "")
    budget.clear_skipped()
    yield
    budget.clear_skipped()


@pytest.mark.parametrize("text, cap", [("22", 22.0), (" 39.5 ", 39.5), ("", None)])
def test_the_cap_is_read_from_the_environment(monkeypatch, text, cap):
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, text)
    assert budget.memory_cap_gib() == cap


@pytest.mark.parametrize("text", ["abc", "0", "-4", "inf", "nan"])
def test_a_bad_cap_is_an_error_naming_the_variable(monkeypatch, text):
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, text)
    with pytest.raises(ValueError, match=r"\$LORA_LAB_MEMORY_CAP_GIB=.*positive number of GiB"):
        budget.memory_cap_gib()


def test_apply_sets_each_gpus_fraction_when_cuda_starts(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "_lazy_call", lambda fn: fn())  # as if CUDA initialised now
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(total_memory=[141 * GIB, 16 * GIB][index]))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, index: calls.append((index, fraction)))
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "22")
    assert budget.apply_memory_cap() == 22.0
    assert calls == [(0, pytest.approx(22 / 141)), (1, 1.0)]  # a card smaller than the cap keeps all of it
    calls.clear()
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "")
    assert budget.apply_memory_cap() is None and calls == []


def test_import_applies_the_cap_in_a_fresh_process():
    import os
    import subprocess
    import sys

    code = ("import torch\n"
            "queued = []\n"
            "torch.cuda._lazy_call = queued.append\n"
            "import lora_lab\n"
            "print(len(queued))\n")
    env = {**os.environ, budget.MEMORY_CAP_ENV: "22"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
    env[budget.MEMORY_CAP_ENV] = ""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"


def test_fits_against_a_given_capacity_or_the_cap(monkeypatch):
    assert budget.fits(10 * GIB, capacity=10 * GIB) and not budget.fits(10 * GIB + 1, capacity=10 * GIB)
    assert budget.fits(10 ** 15, device="cpu")  # no cap, no GPU: no limit known
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "22")
    assert budget.capacity_bytes("cpu") == 22 * GIB
    assert budget.fits(21 * GIB, device="cpu") and not budget.fits(23 * GIB, device="cpu")
    with pytest.raises(ValueError, match="estimated_bytes must be a number >= 0"):
        budget.fits(-1)


def test_skip_or_shrink_runs_shrinks_or_skips_by_name(monkeypatch):
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "22")
    need = {(4, 4096): 30 * GIB, (4, 2048): 18 * GIB, (2, 2048): 9 * GIB}
    asked = budget.skip_or_shrink("bf16_small", [(2, 2048)], need.get, device="cpu")
    assert asked.shape == (2, 2048) and not asked.shrunk and not asked.skipped and budget.skipped_cells() == {}
    shrunk = budget.skip_or_shrink("bf16_4x4096", [(4, 4096), (4, 2048)], need.get, device="cpu")
    assert shrunk.shrunk and shrunk.shape == (4, 2048)
    assert "shrunk from (4, 4096) (needs about 30.0 GiB) to (4, 2048)" in shrunk.reason
    assert "LORA_LAB_MEMORY_CAP_GIB=22) allows 22.0 GiB" in shrunk.reason
    skipped = budget.skip_or_shrink("bf16_8x4096", [(4, 4096)], need.get, device="cpu")
    assert skipped.skipped and skipped.shape is None and skipped.reason.startswith("skipped: needs more than")
    assert budget.skipped_cells() == {"bf16_4x4096": shrunk.reason, "bf16_8x4096": skipped.reason}
    with pytest.raises(ValueError, match="give at least one shape"):
        budget.skip_or_shrink("empty", [], need.get)


def test_the_memory_sweep_skips_a_configuration_over_the_cap_by_name(monkeypatch):
    model = lora_lab.load_model("random:tiny-qwen2")
    config = mb.MemoryConfig("fp32", 2, 64, "full")
    cuda = torch.device("cuda", 0)
    assert mb.over_memory_cap(model, config, cuda) is None  # no cap: the sweep runs and an OOM is its result
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "22")
    assert mb.over_memory_cap(model, config, torch.device("cpu")) is None  # off CUDA: nothing to cap
    monkeypatch.setattr(budget, "capacity_bytes", lambda device=None: 1000)  # a cap the tiny model cannot fit
    reason = mb.over_memory_cap(model, config, cuda)
    assert reason.startswith("skipped: needs more than") and config.name in budget.skipped_cells()
    budget.clear_skipped()
    monkeypatch.setattr(budget, "capacity_bytes", lambda device=None: 64 * GIB)
    assert mb.over_memory_cap(model, config, cuda) is None and budget.skipped_cells() == {}


def test_worker_cap_divides_what_this_process_leaves_of_the_cap(monkeypatch):
    monkeypatch.delenv(budget.MEMORY_CAP_ENV, raising=False)
    assert budget.worker_cap_gib(4) is None  # no cap: nothing to share
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "22")
    assert budget.worker_cap_gib(4) == pytest.approx(5.5)  # the CPU: this process holds no GPU memory
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 6 * budget.GIB)
    assert budget.worker_cap_gib(4, "cuda") == pytest.approx(4.0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 23 * budget.GIB)
    with pytest.raises(ValueError, match="leaves nothing for 2 worker processes: this process holds 23.0 GiB"):
        budget.worker_cap_gib(2, "cuda")
    with pytest.raises(ValueError, match="workers must be an integer"):
        budget.worker_cap_gib(0)

"""tests/conftest.py hands ``$LORA_LAB_ARCH`` and ``$LORA_LAB_MEMORY_CAP_GIB``, set for a whole test run, to the tests
marked gpu only (``LORA_LAB_ARCH=sm80 pytest -m gpu``: the GPU suite on the Ampere path); the other tests run without
them, and a test of a TMA form (``needs_tma``) is skipped on the forced class, which refuses it by name. Checked in a
pytest process of its own, on a copy of the conftest, with a Hopper CUDA device faked so the gpu tests run."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

INNER = '''
import os

import pytest
import torch

torch.cuda.is_available = lambda: True  # after the conftest's import: the gpu tests below are collected, not skipped
torch.cuda.get_device_capability = lambda device=None: (9, 0)  # a Hopper card, which LORA_LAB_ARCH=sm80 steps down


@pytest.mark.gpu
def test_a_gpu_test_sees_the_switches():
    assert os.environ["LORA_LAB_ARCH"] == "sm80" and os.environ["LORA_LAB_MEMORY_CAP_GIB"] == "22"


def test_another_test_runs_without_them():
    assert "LORA_LAB_ARCH" not in os.environ and "LORA_LAB_MEMORY_CAP_GIB" not in os.environ


@pytest.mark.gpu
@pytest.mark.needs_tma
def test_a_tma_form_on_the_forced_ampere_path():
    raise AssertionError("ran on a GPU class without TMA")
'''


@pytest.mark.slow
def test_ambient_profile_switches_reach_the_gpu_tests_only(tmp_path):
    (tmp_path / "conftest.py").write_text((Path(__file__).parent / "conftest.py").read_text())
    (tmp_path / "test_inner.py").write_text(INNER)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n    slow: slow\n"
                                         "    needs_tma: TMA\n")
    env = {**os.environ, "LORA_LAB_ARCH": "sm80", "LORA_LAB_MEMORY_CAP_GIB": "22", "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-p", "no:randomly", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "2 passed, 1 skipped" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert "reads through TMA descriptors, which GPU class 'ampere' lacks" in done.stdout

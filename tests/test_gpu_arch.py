"""lora_lab.gpu_arch: the GPU class the kernels write for, $LORA_LAB_ARCH, and every generation-dependent choice
asking it."""
import re
from pathlib import Path

import pytest
import torch

from lora_lab import gpu_arch
from lora_lab.kernels.config import KernelConfig
from lora_lab.kernels.lora.gemm import gemm_loads_for
from lora_lab.kernels.moe import engine, experts, tiles

H200 = (9, 0)
CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def h200(monkeypatch):
    """A machine whose cuda:0 is an H200 (capability 9.0), no override."""
    monkeypatch.setattr(gpu_arch, "_device_capability", lambda device: H200)
    monkeypatch.setenv(gpu_arch.ARCH_ENV, "")


@pytest.mark.parametrize("text, cap", [("", None), ("native", None), ("sm80", (8, 0)), (" Ampere ", (8, 0)),
                                       ("sm89", (8, 9)), ("ada", (8, 9)), ("hopper", (9, 0)), ("SM86", (8, 6))])
def test_the_override_is_parsed(monkeypatch, text, cap):
    monkeypatch.setenv(gpu_arch.ARCH_ENV, text)
    assert gpu_arch.arch_override() == cap


@pytest.mark.parametrize("text", ["sm75", "volta", "80", "sm_80"])
def test_an_unknown_override_names_the_allowed_values(monkeypatch, text):
    monkeypatch.setenv(gpu_arch.ARCH_ENV, text)
    with pytest.raises(ValueError, match=rf"\$LORA_LAB_ARCH='{text}' .*sm80, sm86, sm89, sm90, ampere, ada, hopper"):
        gpu_arch.arch_override()


def test_the_override_forces_an_older_class_only(h200, monkeypatch):
    assert gpu_arch.capability(CUDA) == H200 and gpu_arch.gpu_class(CUDA) == "hopper"
    assert gpu_arch.capability("cpu") is None and gpu_arch.gpu_class("cpu") == "cpu"
    monkeypatch.setenv(gpu_arch.ARCH_ENV, "sm80")
    assert gpu_arch.capability(CUDA) == (8, 0) and gpu_arch.gpu_class(CUDA) == "ampere"
    monkeypatch.setenv(gpu_arch.ARCH_ENV, "ada")
    assert gpu_arch.gpu_class(CUDA) == "ada"
    about = gpu_arch.describe(CUDA)
    assert about == {"gpu_class": "ada", "capability": "8.9", "device_capability": "9.0", "arch_override": "ada"}
    monkeypatch.setattr(gpu_arch, "_device_capability", lambda device: (8, 6))
    monkeypatch.setenv(gpu_arch.ARCH_ENV, "sm90")
    with pytest.raises(ValueError, match="newer than cuda:0's 8.6: the switch only forces an older"):
        gpu_arch.capability(CUDA)


def test_features_and_tile_budgets_follow_the_class(h200, monkeypatch):
    assert gpu_arch.has_tma(CUDA) and gpu_arch.grouped_mm_fast(CUDA)
    assert gpu_arch.tile_shared_memory_budget(CUDA) == 200 * 1024  # the Hopper table as before
    hopper_rule = gpu_arch.dispatch_rule(CUDA)
    monkeypatch.setenv(gpu_arch.ARCH_ENV, "sm80")
    assert not gpu_arch.has_tma(CUDA) and not gpu_arch.grouped_mm_fast(CUDA)
    assert gpu_arch.tile_shared_memory_budget(CUDA) < 163 * 1024
    ampere_rule = gpu_arch.dispatch_rule(CUDA)
    assert ampere_rule["gemm_loads auto"] == "pointer loads (no TMA)"
    assert ampere_rule["moe_engine auto"].startswith("triton") and hopper_rule["moe_engine auto"].startswith("grouped")
    assert ampere_rule["loss accumulate auto"] == "atomic" and hopper_rule["loss accumulate auto"] == "tma"
    monkeypatch.setenv(gpu_arch.ARCH_ENV, "sm89")
    assert gpu_arch.tile_shared_memory_budget(CUDA) < 99 * 1024
    # off CUDA (Triton's interpreter) the TMA forms stay testable; the CUTLASS path is CUDA's
    assert gpu_arch.has_tma("cpu") and not gpu_arch.grouped_mm_fast("cpu")


def test_the_moe_engine_rule_asks_the_switch(h200, monkeypatch):
    # engine_for on CPU tensors, with the switch's answer taken for cuda:0 (an H200 here)
    real = gpu_arch.capability
    monkeypatch.setattr(gpu_arch, "capability", lambda device: real(CUDA))
    x = torch.zeros(64, 64, dtype=torch.bfloat16)
    top_k = torch.zeros(64, 2, dtype=torch.int64)
    w1 = torch.zeros(8, 2 * 64, 64, dtype=torch.bfloat16)
    cfg = KernelConfig()
    assert engine.engine_for(x, top_k, w1, config=cfg, ranks=(8, 8)) == "grouped_mm"
    assert experts._layer_rules(x, w1, False, cfg) == ("grouped_mm", True, "grouped_mm")
    monkeypatch.setenv(gpu_arch.ARCH_ENV, "sm80")
    assert engine.engine_for(x, top_k, w1, config=cfg, ranks=(8, 8)) == "triton"
    assert experts._layer_rules(x, w1, False, cfg) == ("triton", False, "triton")


def test_the_tma_forms_ask_the_switch(h200, monkeypatch):
    monkeypatch.setattr(gpu_arch, "capability", lambda device: (9, 0))
    assert gemm_loads_for("auto", CUDA) == "auto" and gemm_loads_for("persistent", CUDA) == "persistent"
    assert tiles.schedule_flags(KernelConfig(moe_loads="persistent"), torch.device("cpu"))["PERSISTENT"]
    monkeypatch.setattr(gpu_arch, "capability", lambda device: (8, 0))
    assert gemm_loads_for("auto", CUDA) == "pointer" and gemm_loads_for("pointer", CUDA) == "pointer"
    for form in ("tma", "persistent"):
        with pytest.raises(ValueError, match=f"gemm_loads='{form}'.*GPU class 'ampere'.*LORA_LAB_ARCH"):
            gemm_loads_for(form, CUDA)
    with pytest.raises(ValueError, match="moe_loads='persistent'.*GPU class 'ampere'"):
        tiles.schedule_flags(KernelConfig(moe_loads="persistent"), torch.device("cpu"))
    assert not tiles.schedule_flags(KernelConfig(), torch.device("cpu"))["PERSISTENT"]


def test_no_code_reads_the_capability_around_the_switch():
    """Every generation check goes through lora_lab.gpu_arch (so $LORA_LAB_ARCH reaches it)."""
    direct = re.compile(r"get_device_capability|\.major\s*>=\s*9|capability\s*>=\s*\(9")
    found = []
    for folder in ("lora_lab", "benchmarks", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "gpu_arch.py":
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if direct.search(line.split("#")[0]):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "capability read directly:\n" + "\n".join(found)


def test_the_benchmarks_header_names_the_class_the_switch_and_the_cap(h200, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_common

    monkeypatch.setenv("LORA_LAB_MEMORY_CAP_GIB", "")
    assert bench_common.gpu_arch_text(CUDA) == "class hopper"
    monkeypatch.setenv(gpu_arch.ARCH_ENV, "sm80")
    monkeypatch.setenv("LORA_LAB_MEMORY_CAP_GIB", "22")
    assert bench_common.gpu_arch_text(CUDA) == ("class ampere, forced by LORA_LAB_ARCH=sm80 (device 9.0); "
                                                "memory cap 22 GiB")


@pytest.mark.parametrize("cap, tiles", [((9, 0), [(128, 256, 64, 3), (256, 128, 64, 3), (128, 128, 64, 4),
                                                  (128, 128, 64, 4)]),
                                        ((8, 0), [(128, 256, 64, 3), (256, 128, 64, 3), (128, 128, 64, 4),
                                                  (128, 128, 64, 4)]),
                                        ((8, 9), [(128, 128, 32, 3), (128, 128, 64, 2), (64, 128, 64, 3)])])
def test_the_lora_tile_table_follows_the_class(monkeypatch, cap, tiles):
    from lora_lab.kernels.lora import tuning

    monkeypatch.setattr(tuning, "running_in_interpreter", lambda: False)  # the GPU's table, pruned as on a GPU
    monkeypatch.setattr(gpu_arch, "capability", lambda device: cap)
    kept = tuning._prune_configs(tuning.gemm_configs(), {"in0_ptr": torch.zeros(1, dtype=torch.bfloat16), "TUNE": 1})
    assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_stages) for c in kept] == tiles

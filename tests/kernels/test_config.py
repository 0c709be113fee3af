"""KernelConfig: every kernel setting as one argument; the environment only seeds the defaults."""
import pytest

from lora_lab.kernels import KernelConfig
from lora_lab.kernels.config import ENV_VARIABLES, resolve_config


def test_defaults_are_the_shipped_behaviour():
    config = KernelConfig()
    assert (config.dispatch, config.base_gemm, config.overlap, config.gemm_loads) == ("auto",) * 4
    assert config.autotune and config.moe_autotune and not config.fuse_q_db and config.moe_block_m is None
    # auto: torch._grouped_mm on bf16 Hopper with many rows per expert, else the Triton per-tile kernel
    assert config.moe_weight_grad == "auto"


def test_environment_seeds_defaults_and_arguments_win(monkeypatch):
    for variable in ENV_VARIABLES.values():
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("LORA_LAB_DISPATCH", "triton")
    monkeypatch.setenv("LORA_LAB_OVERLAP", "1")
    monkeypatch.setenv("LORA_LAB_AUTOTUNE", "0")
    monkeypatch.setenv("LORA_LAB_MOE_BLOCK_M", "32")
    monkeypatch.setenv("LORA_LAB_MOE_WEIGHT_GRAD", "KGrouped")
    config = KernelConfig.from_env()
    assert (config.dispatch, config.overlap, config.autotune, config.moe_block_m) == ("triton", "on", False, 32)
    assert config.moe_weight_grad == "kgrouped"
    assert KernelConfig.from_env(dispatch="cublas").dispatch == "cublas"
    assert resolve_config(None) == config  # no config given: the environment's defaults, read at the call
    # a field left out of KernelConfig(...) takes its variable's value, as from_env; one given wins
    assert KernelConfig() == config and KernelConfig(autotune=True).dispatch == "triton"
    assert KernelConfig(dispatch="auto").dispatch == "auto" and KernelConfig(dispatch="auto").autotune is False
    assert KernelConfig.from_env({}) == KernelConfig.from_env({}, dispatch="auto")  # another environment: its own
    assert KernelConfig.from_env({}).dispatch == "auto" and KernelConfig.from_env({}).autotune is True


@pytest.mark.parametrize("variable, value, message", [
    ("LORA_LAB_DISPATCH", "fast", "LORA_LAB_DISPATCH='fast': expected one of auto, triton, cublas"),
    ("LORA_LAB_FUSE_QDB", "maybe", "LORA_LAB_FUSE_QDB='maybe': expected 1 or 0"),
    ("LORA_LAB_MOE_BLOCK_M", "big", "LORA_LAB_MOE_BLOCK_M='big'"),
    ("LORA_LAB_MOE_WEIGHT_GRAD", "rowsplit",
     "LORA_LAB_MOE_WEIGHT_GRAD='rowsplit': expected one of auto, per_tile, kgrouped"),
])
def test_bad_environment_values_are_named(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=message):
        KernelConfig.from_env()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="KernelConfig.base_gemm must be one of auto, triton, cublas"):
        KernelConfig(base_gemm="cutlass")
    with pytest.raises(TypeError, match="KernelConfig.autotune must be True or False"):
        KernelConfig(autotune="no")
    with pytest.raises(ValueError, match="KernelConfig.moe_weight_grad must be one of auto, per_tile, kgrouped, "
                                         "grouped_mm; got 'split'"):
        KernelConfig(moe_weight_grad="split")
    with pytest.raises(ValueError, match="moe_block_m must be a power of two >= 16"):
        KernelConfig(moe_block_m=24)
    with pytest.raises(TypeError, match="config must be a lora_lab.kernels.KernelConfig"):
        resolve_config({"dispatch": "triton"})
    assert KernelConfig().replace(fuse_q_db=True).fuse_q_db


def test_no_package_code_writes_the_environment():
    """Settings travel as arguments: nothing under lora_lab/ assigns to os.environ. One exception, named:
    determinism.py sets CUBLAS_WORKSPACE_CONFIG, which cuBLAS itself reads to run deterministically."""
    import re
    from pathlib import Path

    import lora_lab

    writes = re.compile(r"os\.environ\[[^\]]+\]\s*=|os\.environ\.(setdefault|update|pop)\(|os\.putenv\(")
    offenders = [f"{path}:{number}" for path in Path(lora_lab.__file__).parent.rglob("*.py")
                 for number, line in enumerate(path.read_text().splitlines(), 1)
                 if writes.search(line) and "CUBLAS_WORKSPACE_CONFIG" not in line]
    assert offenders == []

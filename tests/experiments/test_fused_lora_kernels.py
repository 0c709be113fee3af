"""Notebook 05's measurement helpers (lora_lab.experiments.fused_lora_kernels)."""
from lora_lab.experiments import fused_lora_kernels as fk


def test_numerics_config_runs_triton_with_one_tile(monkeypatch):
    # the numerics and the patched-training check time no tiles: tuning is for speed, and it compiled every
    # tile at every odd shape of the GPU cases; an environment that turns autotuning on must not undo that
    monkeypatch.setenv("LORA_LAB_AUTOTUNE", "1")
    cfg = fk.triton_everywhere()
    assert cfg.dispatch == "triton"
    assert cfg.autotune is False


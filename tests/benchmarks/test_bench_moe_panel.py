"""bench_moe's panel of issue #24 on the CPU: the time budget, the sessions pooled, the untuned form and the first
calls recorded, and the panel metrics notebook 06 grades (smoke: tiny stand-ins in Triton's interpreter)."""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora_lab.experiments import fused_moe
from lora_lab.lab import measure

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("bench_moe")


def test_panel_names_six_or_more_public_layers_coarse_and_fine(bench):
    shapes = fused_moe.LAYER_SHAPES
    assert len(shapes) >= 6 and {"qwen3_30b_a3b", "mixtral_8x7b"} <= set(shapes)
    assert shapes["mixtral_8x7b"].hidden == 4096 and shapes["mixtral_8x7b"].intermediate == 14336
    coarse = [s for s in shapes.values() if s.num_experts <= 16]
    fine = [s for s in shapes.values() if s.num_experts >= 64]
    assert {s.name for s in coarse} == set(fused_moe.COARSE_SHAPES) and len(fine) >= 3
    assert set(bench.SMOKE_SHAPES) == set(shapes)
    assert len(fused_moe.PANEL_CELLS) == len(shapes) * 2 * 2


def test_calls_fit_the_budget(bench):
    assert bench.calls_within(None, {"a": 5.0}, 5, 10) == 10
    assert bench.calls_within(10.0, {"a": 100.0, "b": 100.0}, 5, 10) == 10  # 10 s >= 5 reps × 200 ms × 10
    assert bench.calls_within(2.0, {"a": 100.0, "b": 100.0}, 5, 10) == 2
    assert bench.calls_within(0.01, {"a": 100.0}, 5, 10) == 1  # never below one call


def test_graded_cells_run_first(bench):
    args = argparse.Namespace(shapes=["mixtral_8x7b", "qwen3_30b_a3b"], tokens=[8192, 32768], modes=["full", "lora"],
                              graded_only=False)
    cells = [f"{n}_t{t}_{m}" for n, t, m in bench.layer_cells(args)]
    graded = [c for c in cells if c in fused_moe.GRADED_CELLS]
    assert cells[:len(graded)] == graded and len(cells) == 8 and 0 < len(graded) < 8


@pytest.mark.slow
def test_two_sessions_pooled_with_untuned_form_and_first_calls(tmp_path):
    env = {**os.environ, "MPLBACKEND": "Agg", "TQDM_DISABLE": "1"}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_moe.py"), "--out", str(tmp_path), "--smoke",
           "--sessions", "2", "--budget-s", "600", "--repetitions", "2", "--shapes", "mixtral_8x7b", "olmoe_1b_7b",
           "--tokens", "8192", "--modes", "full", "--no-e2e", "--variants", "ours_untuned", "--secondary"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = measure.read_csv(tmp_path / fused_moe.LAYER_CSV)
    assert measure.sessions_in(rows) == 2 and {r["impl"] for r in rows} == {"grouped_mm", "ours", "ours_untuned"}
    assert all(r["first_call_s"] > 0 for r in rows)
    metrics = fused_moe.benchmark_metrics(tmp_path, allow_smoke=True)
    for cell in ("mixtral_8x7b_t8192_full", "olmoe_1b_7b_t8192_full"):
        assert metrics[f"{cell}_speedup_vs_grouped_mm"]["sessions"] == 2
        assert metrics[f"{cell}_ours_untuned_slowdown_vs_ours"]["n"] == 4
        assert metrics[f"{cell}_ours_first_call_s"] > 0
    assert metrics["panel_ours_first_call_max_s"] > 0 and metrics["panel_ours_untuned_slowdown_max"] > 0

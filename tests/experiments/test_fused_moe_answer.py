"""Notebook 06's answer cell ("What this run showed") writes its text from a run's metrics: from the published gpu
run's (every figure quoted, none typed), from the same without Liger or the end-to-end steps (named as not timed,
no error), and from a cpu run's (correctness only)."""
import json
import types
from pathlib import Path

import pytest

from lora_lab.experiments import fused_moe
from lora_lab.lab.answers import Figures

ROOT = Path(__file__).resolve().parents[2]


def answer_source() -> str:
    notebook = json.loads((ROOT / "notebooks" / "06_fused_moe.ipynb").read_text(encoding="utf-8"))
    cells = ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]
    (source,) = [s for s in cells if "lab.figures()" in s]
    return source


def render(metrics: dict, profile: str) -> str:
    shown = []
    lab = types.SimpleNamespace(figures=lambda: Figures(metrics, profile), show_answer=shown.append)
    exec(answer_source(), {"lab": lab, "fm": fused_moe, "profile": profile})  # the notebook's own cell
    (text,) = shown
    return text


def published(profile: str) -> dict:
    path = ROOT / "outputs" / profile / "06_fused_moe.metrics.json"
    if not path.is_file():
        pytest.skip(f"no published {profile} run of notebook 06")
    return json.loads(path.read_text())["metrics"]


def test_answer_quotes_the_gpu_run_figures():
    metrics = published("gpu")
    text = render(metrics, "gpu")
    key = "qwen3_30b_a3b_t8192_full_speedup_vs_grouped_mm"
    assert f"{metrics[key]['median']:.3f}×" in text and "Liger takes" in text and "End to end" in text
    assert "Limits:" in text and "cpu" not in text


def test_answer_without_liger_or_end_to_end_says_so():
    metrics = {k: v for k, v in published("gpu").items() if "liger" not in k and not k.startswith("e2e")}
    text = render(metrics, "gpu")
    assert "was not timed" in text and "End to end" not in text


def test_answer_on_the_cpu_profile_is_correctness_only():
    metrics = published("cpu")
    text = render(metrics, "cpu")
    assert "correctness only" in text and "gpu profile" in text
    assert f"{metrics['fp32_max_rel_l2_vs_reference']:.2e}".replace("e-0", "e-") in text

"""Notebook 03 takes a real checkpoint through MODEL (a local directory, loaded by from_pretrained): the same cells
run on it, and the run is recorded with its override so it is not graded against the registered predictions."""
import io
import json
from pathlib import Path

import lora_lab
from lora_lab.lab.runner import run

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def test_notebook_03_runs_on_a_local_checkpoint(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    lora_lab.load_model("random:tiny-qwen2", seed=3).save_pretrained(checkpoint)
    printed = io.StringIO()
    code = run(profile="cpu", only=["03"], overrides={"MODEL": str(checkpoint)}, notebooks_dir=NOTEBOOKS,
               outputs_root=tmp_path / "runs", disable_progress=True, stream=printed)
    assert code == 0, printed.getvalue()
    payload = json.loads((tmp_path / "runs" / "cpu" / "03_merge_precision.metrics.json").read_text())
    assert payload["parameters"]["MODEL"] == str(checkpoint)
    assert payload["provenance"]["parameter_overrides"] == {"MODEL": str(checkpoint)}
    assert payload["metrics"]["drift_exact_swap_max_abs"] == 0.0  # the harness reproduces the model exactly

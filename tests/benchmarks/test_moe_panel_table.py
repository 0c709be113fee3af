"""benchmarks/moe_panel_table.py: the MoE panel's targets judged per cell from a notebook 06 output folder (a small
synthetic one here: the verdict rules, the faster peer, the table and its refusals)."""
import csv
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import moe_panel_table as table  # noqa: E402


def _stat(median, low, high):
    return {"median": median, "ci95": [low, high], "level": 0.95, "n": 10}


def _folder(tmp_path: Path) -> Path:
    metrics = {
        "qwen3_30b_a3b_t32768_full_speedup_vs_grouped_mm": _stat(2.0, 1.9, 2.1),
        "qwen3_30b_a3b_t32768_full_speedup_vs_liger": _stat(1.25, 1.2, 1.35),  # Liger is the faster peer
        "qwen3_30b_a3b_t32768_full_ours_tflops": _stat(453.0, 432.0, 457.0),
        "qwen3_30b_a3b_t32768_full_peak_ratio_vs_grouped_mm": 0.53,
        "qwen3_30b_a3b_t32768_full_ours_first_call_s": 16.0,
        "qwen3_30b_a3b_t32768_full_ours_untuned_slowdown_vs_ours": _stat(1.02, 0.99, 1.03),
        "qwen3_30b_a3b_t32768_lora_speedup_vs_grouped_mm": _stat(2.33, 2.32, 2.34),
        "qwen3_30b_a3b_t32768_lora_peak_ratio_vs_grouped_mm": 1.01,
        "mixtral_8x7b_t8192_full_speedup_vs_grouped_mm": _stat(0.98, 0.95, 1.02),
    }
    (tmp_path / table.METRICS).write_text(json.dumps({"metrics": metrics}))
    fields = ["cell", "shape", "tokens", "mode", "impl", "ms", "ms_ci95", "tflops"]
    rows = [
        ("mixtral_8x7b_t8192_full", "mixtral_8x7b", 8192, "full", "ours", 30.0, "[29.0, 31.0]", 570.0),
        ("mixtral_8x7b_t8192_full", "mixtral_8x7b", 8192, "full", "grouped_mm", 29.5, "[29.0, 30.0]", 580.0),
        ("qwen3_30b_a3b_t32768_full", "qwen3_30b_a3b", 32768, "full", "ours", 16.4, "[16.2, 17.2]", 453.2),
        ("qwen3_30b_a3b_t32768_full", "qwen3_30b_a3b", 32768, "full", "liger", 26.5, "[26.1, 26.6]", 280.0),
        ("qwen3_30b_a3b_t32768_lora", "qwen3_30b_a3b", 32768, "lora", "ours", 16.4, "[16.3, 16.4]", 302.0),
        ("qwen3_30b_a3b_t32768_lora", "qwen3_30b_a3b", 32768, "lora", "grouped_mm", 38.2, "", 129.0),
    ]
    with (tmp_path / table.SUMMARY).open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(fields)
        writer.writerows(rows)
    return tmp_path


EXPERTS = {"qwen3_30b_a3b": 128, "mixtral_8x7b": 8}


def test_targets_per_cell(tmp_path):
    metrics, cells = table.load(_folder(tmp_path))
    rows = {r["cell"]: r for r in table.cell_rows(metrics, cells, EXPERTS)}
    assert [r["cell"] for r in table.cell_rows(metrics, cells, EXPERTS)] == [
        "qwen3_30b_a3b_t32768_full", "qwen3_30b_a3b_t32768_lora", "mixtral_8x7b_t8192_full"]  # layer order
    full = rows["qwen3_30b_a3b_t32768_full"]
    assert full["faster_peer"] == "liger" and full["vs_peer"]["median"] == 1.25
    assert full["targets"] == {"peer >= 1.0": "met", "peer >= 1.3": "inconclusive", ">= 450 TFLOP/s": "inconclusive",
                               "peak <= grouped_mm": "met", "first call <= 15 s": "missed",
                               "untuned <= 1.3x": "met"}
    lora = rows["qwen3_30b_a3b_t32768_lora"]
    assert lora["targets"]["grouped_mm+PEFT >= 2.5"] == "missed" and lora["targets"]["peak <= grouped_mm"] == "missed"
    coarse = rows["mixtral_8x7b_t8192_full"]
    assert coarse["targets"] == {"peer >= 1.0": "inconclusive"}  # not fine-grained: no 1.3x target
    assert table.verdict_at_least(_stat(0.9, 0.85, 0.95), 1.0) == "missed"
    assert table.verdict_at_least(None, 1.0) == "not run"


def test_main_prints_and_writes_the_table(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    folder = _folder(tmp_path / "run")
    out = tmp_path / "panel.md"
    assert table.main([str(folder), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed == out.read_text()
    assert "| qwen3_30b_a3b (fine) | 32768 | full | 16.40 [16.20, 17.20] | – | 26.50 [26.10, 26.60] | liger " in printed
    assert "453.0 [432.0, 457.0]" in printed and "| 38.20 |" in printed  # an empty interval prints the median alone


def test_refuses_a_folder_without_notebook_06_outputs(tmp_path, capsys):
    assert table.main([str(tmp_path)]) == 2
    assert "06_fused_moe.metrics.json: not found" in capsys.readouterr().err

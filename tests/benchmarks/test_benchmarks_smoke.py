"""The GPU benchmarks' whole code path, in ``--smoke`` mode (tiny stand-in shapes; Triton's interpreter on a CPU),
and what notebooks 05 and 06 read from their CSVs: the per-repetition rows, the code-hash check, the metrics."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lora_lab.experiments import fused_lora_kernels, fused_moe
from lora_lab.lab import measure
from lora_lab.lab.provenance import code_hash

ROOT = Path(__file__).resolve().parents[2]
REPETITIONS = 2  # the scripts' default is measure.MIN_REPETITIONS; two suffice to check the pairing
SCRIPTS = {  # longest first: two run at a time
    "bench_moe.py": ["--graded-only"],
    "bench_lora_train_step.py": [],
    "bench_lora_linear.py": ["--components", "target"],
    "bench_gated_deltanet.py": ["--check-seq", "32"],
}
CSVS = ["05_lora_linear.csv", "05_lora_linear_components.csv", "05_gated_deltanet.csv", "05_train_step.csv",
        "06_moe_layer.csv", "06_moe_e2e.csv"]
PNGS = ["05_lora_linear_ratio.png", "05_lora_linear_time_vs_tokens.png", "05_gated_deltanet.png",
        "05_train_step.png", "06_moe_layer_speed.png", "06_moe_layer_memory.png"]
TIME_05 = ["lora_linear_time_vs_base_32k_4096x4096_r16", "peft_time_vs_base_32k_4096x4096_r16",
           "lora_linear_speedup_vs_peft_32k_4096x4096_r16", "lora_linear_worst_time_vs_base", "gdn_time_vs_base",
           "gdn_speedup_vs_peft", "gdn_peft_time_vs_base", "train_speedup_vs_peft_qwen3_4096",
           "train_speedup_vs_peft_qwen2_5_0_5b", "lora_linear_base_tflops_32k_4096x4096_r16",
           "lora_linear_fused_tflops_32k_4096x4096_r16", "lora_linear_peft_tflops_32k_4096x4096_r16"]
MEMORY_05 = ["lora_linear_peak_vs_base_32k_4096x4096_r16", "train_peak_vs_peft_qwen3_4096",
             "train_peak_vs_peft_qwen2_5_0_5b"]
TIME_06 = ["qwen3_30b_a3b_t8192_full_speedup_vs_grouped_mm", "qwen3_30b_a3b_t8192_lora_speedup_vs_grouped_mm",
           "qwen3_30b_a3b_t8192_full_speedup_vs_eager", "qwen3_30b_a3b_t8192_full_ours_fraction_of_peak",
           "qwen1_5_moe_a2_7b_t8192_full_speedup_vs_grouped_mm", "qwen3_30b_a3b_t32768_full_speedup_vs_grouped_mm",
           "e2e_lora_speedup_vs_eager", "e2e_lora_speedup_vs_grouped_mm", "e2e_full_speedup_vs_grouped_mm"]
MEMORY_06 = ["qwen3_30b_a3b_t8192_full_peak_ratio_vs_grouped_mm", "qwen3_30b_a3b_t8192_lora_peak_ratio_vs_grouped_mm"]


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory) -> Path:
    """Every script's ``--smoke`` run into one directory (two processes at a time)."""
    out = tmp_path_factory.mktemp("bench_smoke")
    env = {**os.environ, "MPLBACKEND": "Agg", "TQDM_DISABLE": "1"}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"  # before the scripts import Triton
    pending = list(SCRIPTS.items())
    running, failed = [], []
    while pending or running:
        while pending and len(running) < 2:
            script, extra = pending.pop(0)
            cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--out", str(out), "--smoke",
                   "--repetitions", str(REPETITIONS), *extra]
            log = open(out / f"{script}.log", "w+")  # closed below, once the process has ended
            running.append((script, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT),
                            log))
        time.sleep(0.2)
        for item in [r for r in running if r[1].poll() is not None]:
            script, proc, log = item
            running.remove(item)
            log.seek(0)
            if proc.returncode != 0:
                failed.append(f"{script} exited {proc.returncode}:\n{log.read()[-4000:]}")
            log.close()
    assert not failed, "\n\n".join(failed)
    return out


@pytest.mark.slow
def test_csvs_and_plots_carry_the_current_code(smoke_dir):
    current = code_hash()
    for name in CSVS:
        rows = measure.read_csv(smoke_dir / name)  # raises StaleResultError for another code hash
        assert rows and all(r["code_hash"] == current for r in rows), name
        assert all(r["smoke"] is True for r in rows), name
        assert {r["rep"] for r in rows} == set(range(REPETITIONS)), name
    for name in PNGS:
        assert (smoke_dir / name).stat().st_size > 0, name


@pytest.mark.slow
def test_one_row_per_cell_variant_and_repetition(smoke_dir):
    rows = measure.read_csv(smoke_dir / "05_lora_linear.csv")
    keys = [(r["cell"], r["variant"], r["rep"]) for r in rows]
    assert len(keys) == len(set(keys)) == 2 * 3 * REPETITIONS  # two stand-in cells, base / peft / fused
    layer = measure.read_csv(smoke_dir / "06_moe_layer.csv")
    assert {r["cell"] for r in layer} == set(fused_moe.GRADED_CELLS)  # --graded-only


def _check_repeated(metrics, keys):
    for key in keys:
        value = metrics[key]
        assert isinstance(value, dict), key
        assert value["n"] == REPETITIONS and len(value["samples"]) == REPETITIONS, key
        assert value["ci95"][0] <= value["median"] <= value["ci95"][1], key


def _check_memory(metrics, keys):
    for key in keys:  # peak memory needs CUDA: None on a CPU, never a made-up number
        value = metrics[key]
        assert (isinstance(value, float) and value > 0) if torch.cuda.is_available() else value is None, key


@pytest.mark.slow
def test_notebook_05_metrics(smoke_dir):
    metrics = fused_lora_kernels.benchmark_metrics(smoke_dir, allow_smoke=True)
    _check_repeated(metrics, TIME_05)
    _check_memory(metrics, MEMORY_05)
    assert metrics["lora_linear_cells"] == 2
    assert isinstance(metrics["gdn_saved_gib_less_than_peft"], float)
    with pytest.raises(ValueError, match="smoke"):
        fused_lora_kernels.benchmark_metrics(smoke_dir)


@pytest.mark.slow
def test_notebook_06_metrics(smoke_dir):
    metrics = fused_moe.benchmark_metrics(smoke_dir, allow_smoke=True)
    _check_repeated(metrics, TIME_06)
    _check_memory(metrics, MEMORY_06)
    with pytest.raises(ValueError, match="smoke"):
        fused_moe.benchmark_metrics(smoke_dir)
    table = fused_moe.layer_table(measure.read_csv(smoke_dir / fused_moe.LAYER_CSV))
    assert {t["impl"] for t in table} == set(fused_moe.IMPLEMENTATIONS)


def test_read_csv_refuses_an_edited_code_hash(tmp_path):
    path = measure.write_csv([{"variant": "base", "rep": 0, "ms": 1.0}, {"variant": "fused", "rep": 0, "ms": 1.1}],
                             tmp_path / "05_x.csv")
    assert measure.read_csv(path)[1]["ms"] == 1.1
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    rows[1]["code_hash"] = "0" * 64  # one row from other code is enough to refuse the file
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with pytest.raises(measure.StaleResultError):
        measure.read_csv(path)


def test_repetition_ratios_pair_rows_by_repetition():
    rows = [{"v": "a", "rep": 1, "ms": 4.0}, {"v": "b", "rep": 0, "ms": 1.0}, {"v": "a", "rep": 0, "ms": 3.0},
            {"v": "b", "rep": 1, "ms": 2.0}]
    assert measure.repetition_ratios(rows, "ms", {"v": "a"}, {"v": "b"}) == [3.0, 2.0]
    with pytest.raises(ValueError, match="pair"):
        measure.repetition_ratios(rows[:3], "ms", {"v": "a"}, {"v": "b"})
    assert [measure.rotation("abc", rep) for rep in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]

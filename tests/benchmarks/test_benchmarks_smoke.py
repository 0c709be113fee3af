"""The GPU benchmarks' whole code path, in ``--smoke`` mode (tiny stand-in shapes; Triton's interpreter on a CPU),
and what notebooks 05 and 06 read from their CSVs: the per-repetition rows, the code-hash check, the metrics."""
from __future__ import annotations

import csv
import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora_lab.experiments import fused_lora_kernels, fused_moe
from lora_lab.lab import measure
from lora_lab.lab.provenance import code_hash

ROOT = Path(__file__).resolve().parents[2]
REPETITIONS = 2  # the scripts' default is measure.MIN_REPETITIONS; two suffice to check the pairing
# every loss method, the opt-in fixed-chunk ones included (in bench_loss.METHODS's order); the smoke run names them all
LOSS_METHODS = ["torch_fp32", "torch_bf16", "chunked", "lora_lab", "lora_lab_fwdgrad", "lora_lab_fwdgrad_lowmem",
                "lora_lab_fwdgrad_r256", "lora_lab_fwdgrad_r1024", "lora_lab_fwdgrad_r4096", "lora_lab_recompute",
                "lora_lab_two_pass", "liger", "cce", "cce_exact", "gemm_floor", "gemm_floor_recompute"]
# two of the four heads' stand-in shapes (hidden 20 / 40, vocab 100 / 72): every method's code path, at half the time
LOSS_SHAPES = ["qwen2.5-0.5b", "llama3-8b"]
SCRIPTS = {
    # the graded cells but the Mixtral-like engine cells (their order is test_bench_moe_panel's; at smoke sizes the
    # engine rule sends them to Triton anyway): CI time
    "bench_moe.py": ["--graded-only", "--variants", "eager", "ours_persistent", "--shapes", "qwen3_30b_a3b",
                     "qwen1_5_moe_a2_7b"],
    "bench_lora_train_step.py": [],
    "bench_loss.py": ["--methods", *LOSS_METHODS, "--shapes", *LOSS_SHAPES],
    # the GEMM-core variants by name (the default leaves the persistent GEMM alone out; the interpreter checks its
    # code path here); the default set, routes included, is test_bench_lora_linear_routes'
    "bench_lora_linear.py": ["--components", "target", "--variants", "fused_torch_rank", "fused_persistent",
                             "fused_fold"],
    "bench_loss_train_step.py": ["--variants", "all"],
    "bench_gated_deltanet.py": ["--check-seq", "32", "--secondary", "kernel", "back_to_back"],
    "bench_gemm_core.py": ["--variants", "all", "--tokens", "8192", "--shapes", "4096x4096", "4096x12288"],
    "profile_kernels.py": ["--variants", "base", "fused", "ours", "grouped_mm"],
}
# the scripts in two processes, side by side, each running its share one script after another (one Python start and
# one import of torch, Triton and lora_lab per share rather than per script); each share about as long as the other
SHARES = [["bench_moe.py", "bench_loss_train_step.py", "bench_lora_linear.py", "bench_gemm_core.py"],
          ["bench_loss.py", "profile_kernels.py", "bench_lora_train_step.py", "bench_gated_deltanet.py"]]
# runs each script of a share as ``python SCRIPT ARGS`` would (``__main__``, its folder on sys.path, its argv), its
# output (Python's and the C libraries') into its own log, and writes each script's exit status into a JSON file
SHARE_RUNNER = """
import gc, json, os, runpy, sys, traceback
jobs, status_file = json.loads(sys.argv[1]), sys.argv[2]
sys.path.insert(0, os.path.dirname(jobs[0][0]))
status = {}
for script, argv, log in jobs:
    sys.stdout.flush(); sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "w") as handle:
        os.dup2(handle.fileno(), 1); os.dup2(handle.fileno(), 2)
        sys.argv = [script, *argv]
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if stop.code is not None and not isinstance(stop.code, int):
                print(stop.code)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
    os.close(saved[0]); os.close(saved[1])
    status[os.path.basename(script)] = code
    import matplotlib.pyplot as plt
    plt.close("all"); gc.collect()
    with open(status_file, "w") as handle:
        json.dump(status, handle)
"""
CSVS = ["05_lora_linear.csv", "05_lora_linear_components.csv", "05_gated_deltanet.csv", "05_train_step.csv",
        "06_moe_layer.csv", "06_moe_e2e.csv", "07_loss_block.csv", "07_train_step.csv", "gemm_core.csv"]
PNGS = ["05_lora_linear_ratio.png", "05_lora_linear_time_vs_tokens.png", "05_gated_deltanet.png",
        "05_train_step.png", "06_moe_layer_speed.png", "06_moe_layer_memory.png", "07_loss_time.png",
        "07_loss_memory.png", "07_train_step.png", "gemm_core.png", "profile_kernels.png"]
TIME_05 = ["lora_linear_time_vs_base_32k_4096x4096_r16", "peft_time_vs_base_32k_4096x4096_r16",
           "lora_linear_speedup_vs_peft_32k_4096x4096_r16", "lora_linear_worst_time_vs_base", "gdn_time_vs_base",
           "gdn_speedup_vs_peft", "gdn_peft_time_vs_base", "train_speedup_vs_peft_qwen3_4096",
           "train_speedup_vs_peft_qwen2_5_0_5b", "lora_linear_base_tflops_32k_4096x4096_r16",
           "lora_linear_fused_tflops_32k_4096x4096_r16", "lora_linear_peft_tflops_32k_4096x4096_r16"]
TIME_05 += ["lora_linear_base_host_ms_32k_4096x4096_r16", "lora_linear_fused_host_ms_32k_4096x4096_r16",
            "lora_linear_fused_torch_rank_time_vs_base_32k_4096x4096_r16",
            "lora_linear_fused_torch_rank_time_vs_fused_32k_4096x4096_r16",
            "lora_linear_fused_torch_rank_host_ms_32k_4096x4096_r16", "lora_linear_fused_torch_rank_worst_time_vs_base"]
TIME_05 += [f"lora_linear_{variant}_{metric}" for variant in fused_lora_kernels.CORE_VARIANTS  # the GEMM core
            for metric in ("time_vs_base_32k_4096x4096_r16", "tflops_32k_4096x4096_r16", "worst_time_vs_base")]
MEMORY_05 = ["lora_linear_peak_vs_base_32k_4096x4096_r16", "train_peak_vs_peft_qwen3_4096",
             "train_peak_vs_peft_qwen2_5_0_5b",
             *(f"lora_linear_{v}_peak_vs_base_32k_4096x4096_r16" for v in fused_lora_kernels.CORE_VARIANTS)]
TIME_06 = ["qwen3_30b_a3b_t8192_full_speedup_vs_grouped_mm", "qwen3_30b_a3b_t8192_lora_speedup_vs_grouped_mm",
           "qwen3_30b_a3b_t8192_full_speedup_vs_eager", "qwen3_30b_a3b_t8192_full_ours_fraction_of_peak",
           "qwen1_5_moe_a2_7b_t8192_full_speedup_vs_grouped_mm", "qwen3_30b_a3b_t32768_full_speedup_vs_grouped_mm",
           "e2e_lora_speedup_vs_eager", "e2e_lora_speedup_vs_grouped_mm", "e2e_full_speedup_vs_grouped_mm"]
MEMORY_06 = ["qwen3_30b_a3b_t8192_full_peak_ratio_vs_grouped_mm", "qwen3_30b_a3b_t8192_lora_peak_ratio_vs_grouped_mm"]
LOSS_TORCH_METHODS = ["torch_fp32", "torch_bf16", "chunked"]  # run everywhere; the floors too, with no loss
LOSS_BLOCK_COLUMNS = ["shape", "hidden", "vocab", "tokens", "head", "method", "rep", "status", "ms", "calls", "tflops",
                      "peak_extra_gib", "grad_floor_gib", "peak_vs_floor", "loss", "loss_rel_err",
                      "loss_vs_torch_fp32", "dh_rel_err", "dw_rel_err", "mode", "version", "note", "smoke"]
LOSS_SUMMARY_COLUMNS = ["shape", "tokens", "head", "method", "status", "ms", "ms_ci95_low", "ms_ci95_high", "n",
                        "tflops", "fastest_baseline", "time_vs_fastest_baseline", "time_vs_gemm_floor",
                        "time_vs_gemm_floor_recompute", "peak_extra_gib", "grad_floor_gib", "peak_vs_floor",
                        "loss_rel_err", "dh_rel_err", "dw_rel_err"]
TRAIN_STEP_COLUMNS = ["model", "variant", "rep", "status", "batch", "seq", "tokens", "step_ms", "tokens_per_s",
                      "peak_gib", "losses", "adapters", "loss_impl", "note", "smoke"]
FP32_TOLERANCE = 1e-5  # smoke runs are fp32: every exact method agrees with the fp32 reference to rounding


def _fused_loss_missing() -> str | None:
    """Why the lora_lab rows of the loss benchmarks are recorded as skipped, or None when the op is there."""
    if importlib.util.find_spec("lora_lab.kernels.loss") is None:
        return "lora_lab.kernels.loss does not exist yet: its benchmark rows are recorded as skipped"
    from lora_lab.loss import causal_lm_loss

    if "fused" not in inspect.signature(causal_lm_loss).parameters:
        return "causal_lm_loss has no fused= keyword yet"
    return None


@pytest.fixture
def bench_module(monkeypatch):
    """``bench_module(name)`` imports a script of ``benchmarks/`` as a module; ``sys.path`` is restored after the
    test."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory) -> Path:
    """Every script's ``--smoke`` run into one directory (:data:`SHARES`: two processes at a time)."""
    assert sorted(name for share in SHARES for name in share) == sorted(SCRIPTS)
    out = tmp_path_factory.mktemp("bench_smoke")
    env = {**os.environ, "MPLBACKEND": "Agg", "TQDM_DISABLE": "1"}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"  # before the scripts import Triton
    running = []
    for k, share in enumerate(SHARES):
        jobs = [[str(ROOT / "benchmarks" / script), ["--out", str(out), "--smoke", "--repetitions", str(REPETITIONS),
                                                     *SCRIPTS[script]], str(out / f"{script}.log")] for script in share]
        status = out / f"share{k}.json"
        cmd = [sys.executable, "-c", SHARE_RUNNER, json.dumps(jobs), str(status)]
        running.append((share, status, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                                         stderr=subprocess.STDOUT, text=True)))
    failed = []
    for share, status, proc in running:
        output = proc.communicate()[0]
        codes = json.loads(status.read_text()) if status.exists() else {}
        for script in share:
            if codes.get(script) != 0:
                log = out / f"{script}.log"
                text = log.read_text()[-4000:] if log.exists() else ""
                failed.append(f"{script} exited {codes.get(script, 'before it finished')}:\n{text}")
        if proc.returncode != 0:
            failed.append(f"the process running {', '.join(share)} exited {proc.returncode}:\n{output[-4000:]}")
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
    # two stand-in cells; base, peft, fused, fused_torch_rank and the GEMM-core variants
    assert len(keys) == len(set(keys)) == 2 * (4 + len(fused_lora_kernels.CORE_VARIANTS)) * REPETITIONS
    assert all(r["status"] == "ok" for r in rows)
    layer = measure.read_csv(smoke_dir / "06_moe_layer.csv")
    from lora_lab.experiments.fused_moe_metrics import ENGINE_CELLS

    assert {r["cell"] for r in layer} == set(fused_moe.GRADED_CELLS) - set(ENGINE_CELLS)  # --graded-only, --shapes


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
def test_notebook_05_pools_sessions_and_redraws_its_figures(smoke_dir, tmp_path):
    # two sessions' folders (here the same smoke run twice), pooled as notebook 05 pools them, then redrawn
    parts = [smoke_dir, smoke_dir]
    names = [name for csvs in fused_lora_kernels.BENCHMARK_CSVS.values() for name in csvs]
    assert set(measure.pool_csv_sessions(parts, tmp_path, names)) == set(names)
    drawn = fused_lora_kernels.plot_pooled(ROOT, tmp_path)
    assert drawn == list(fused_lora_kernels.BENCHMARK_CSVS)
    for png in ("05_lora_linear_ratio.png", "05_lora_linear_time_vs_tokens.png", "05_gated_deltanet.png",
                "05_train_step.png"):
        assert (tmp_path / png).stat().st_size > 0, png
    summary = measure.read_csv(tmp_path / "05_lora_linear_summary.csv")
    assert {row["n"] for row in summary} == {2 * REPETITIONS}
    metrics = fused_lora_kernels.benchmark_metrics(tmp_path, allow_smoke=True)
    ratio = metrics["lora_linear_time_vs_base_32k_4096x4096_r16"]
    assert ratio["n"] == 2 * REPETITIONS and ratio["sessions"] == 2


@pytest.mark.slow
def test_notebook_06_metrics(smoke_dir):
    metrics = fused_moe.benchmark_metrics(smoke_dir, allow_smoke=True)
    _check_repeated(metrics, TIME_06)
    _check_repeated(metrics, [f"{cell}_{impl}_speedup_vs_ours" for cell in fused_moe.PERSISTENT_CELLS
                              for impl in fused_moe.OURS_PERSISTENT])  # --variants ours_persistent ...
    _check_memory(metrics, MEMORY_06)
    with pytest.raises(ValueError, match="smoke"):
        fused_moe.benchmark_metrics(smoke_dir)
    table = fused_moe.layer_table(measure.read_csv(smoke_dir / fused_moe.LAYER_CSV))
    assert {t["impl"] for t in table} == set(fused_moe.IMPLEMENTATIONS) | set(fused_moe.OURS_PERSISTENT)


def _loss_block(smoke_dir):
    return measure.read_csv(smoke_dir / "07_loss_block.csv"), measure.read_csv(smoke_dir / "07_loss_block_summary.csv")


@pytest.mark.slow
def test_loss_block_rows(smoke_dir):
    rows, summary = _loss_block(smoke_dir)
    assert set(LOSS_BLOCK_COLUMNS) <= set(rows[0]) and set(LOSS_SUMMARY_COLUMNS) <= set(summary[0])
    cells = {(r["shape"], r["tokens"], r["head"]) for r in rows}
    assert {c[0] for c in cells} == set(LOSS_SHAPES)
    assert {c[2] for c in cells} == {"trainable", "frozen"}
    keys = [(r["shape"], r["tokens"], r["head"], r["method"], r["rep"]) for r in rows]
    assert len(keys) == len(set(keys)) == len(cells) * len(LOSS_METHODS) * REPETITIONS  # every method, skipped too
    assert {r["status"] for r in rows} <= {"ok", "skipped", "oom"}
    for r in rows:
        if r["method"] in LOSS_TORCH_METHODS + ["gemm_floor", "gemm_floor_recompute"]:
            assert r["status"] == "ok" and r["ms"] > 0 and r["tflops"] > 0, r
        if r["method"] in LOSS_TORCH_METHODS:
            assert r["loss_rel_err"] < FP32_TOLERANCE and r["dh_rel_err"] < FP32_TOLERANCE, r
            assert (r["dw_rel_err"] < FP32_TOLERANCE) if r["head"] == "trainable" else r["dw_rel_err"] is None, r
        if r["status"] == "skipped":
            assert r["note"], r  # the reason
        # peak memory needs CUDA: None on a CPU, never a made-up number
        assert (r["peak_extra_gib"] is None) == (not torch.cuda.is_available() or r["method"].startswith("gemm")
                                                 or r["status"] != "ok"), r
    assert len(summary) == len(cells) * len(LOSS_METHODS)
    for s in summary:
        if s["method"] in LOSS_TORCH_METHODS:
            assert s["time_vs_gemm_floor"] > 0 and s["fastest_baseline"] in LOSS_TORCH_METHODS + ["liger", "cce",
                                                                                                  "cce_exact"], s


@pytest.mark.slow
def test_loss_block_lora_lab_rows(smoke_dir):
    rows, _ = _loss_block(smoke_dir)
    mine = [r for r in rows if r["method"] in ("lora_lab", "lora_lab_fwdgrad", "lora_lab_fwdgrad_lowmem",
                                               "lora_lab_fwdgrad_r256", "lora_lab_fwdgrad_r1024",
                                               "lora_lab_fwdgrad_r4096", "lora_lab_recompute", "lora_lab_two_pass")]
    reason = _fused_loss_missing()
    if reason is not None:
        assert {r["status"] for r in mine} == {"skipped"}
        pytest.skip(reason)
    trainable_only = ("lora_lab_two_pass", "lora_lab_fwdgrad_lowmem")
    assert {r["status"] for r in mine if r["method"] in trainable_only and r["head"] == "frozen"} == {"skipped"}
    for r in mine:
        if r["method"] in trainable_only and r["head"] == "frozen":
            continue
        assert r["status"] == "ok" and r["ms"] > 0, r
        assert r["loss_rel_err"] < FP32_TOLERANCE and r["dh_rel_err"] < FP32_TOLERANCE, r
        assert (r["dw_rel_err"] < FP32_TOLERANCE) if r["head"] == "trainable" else r["dw_rel_err"] is None, r


@pytest.mark.slow
def test_loss_train_step_rows(smoke_dir):
    rows = measure.read_csv(smoke_dir / "07_train_step.csv")
    summary = {s["variant"]: s for s in measure.read_csv(smoke_dir / "07_train_step_summary.csv")}
    assert set(TRAIN_STEP_COLUMNS) <= set(rows[0])
    variants = ["standard", "chunked", "fused", "fused_fwdgrad", "fused_recompute", "peft_liger",
                "peft_standard"]  # --variants all
    assert sorted((r["variant"], r["rep"]) for r in rows) == sorted((v, k) for v in variants
                                                                     for k in range(REPETITIONS))
    for r in rows:
        if r["variant"] in ("standard", "chunked", "peft_standard"):
            assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["losses"], r
        if r["variant"] == "peft_liger" and not torch.cuda.is_available():
            assert r["status"] == "skipped" and "CUDA" in r["note"], r
    for variant in ("chunked", "peft_standard"):  # the same adapters and data: the same losses, to rounding
        assert summary[variant]["max_loss_rel_diff_vs_standard"] < FP32_TOLERANCE, summary[variant]
        assert summary[variant]["tokens_per_s_vs_standard"] > 0


@pytest.mark.slow
def test_loss_train_step_fused_rows(smoke_dir):
    rows = [r for r in measure.read_csv(smoke_dir / "07_train_step.csv")
            if r["variant"] in ("fused", "fused_fwdgrad", "fused_recompute")]
    reason = _fused_loss_missing()
    if reason is not None:
        assert {r["status"] for r in rows} == {"skipped"}
        pytest.skip(reason)
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows), rows
    summary = {s["variant"]: s for s in measure.read_csv(smoke_dir / "07_train_step_summary.csv")}
    for variant in ("fused", "fused_fwdgrad", "fused_recompute"):
        assert summary[variant]["max_loss_rel_diff_vs_standard"] < FP32_TOLERANCE


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
    # a repetition with one side missing gives no sample (rows[:3]: b has no rep 1); none in common is an error
    assert measure.repetition_ratios(rows[:3], "ms", {"v": "a"}, {"v": "b"}) == [3.0]
    with pytest.raises(ValueError, match="pair up: no repetition holds both"):
        measure.repetition_ratios([rows[0], rows[1]], "ms", {"v": "a"}, {"v": "b"})
    assert [measure.rotation("abc", rep) for rep in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]


@pytest.mark.slow
def test_gemm_core_rows(smoke_dir):
    """Every GEMM-core variant ran, right to fp32 rounding, with a per-repetition time ratio to cuBLAS in the
    summary."""
    rows = measure.read_csv(smoke_dir / "gemm_core.csv")
    variants = {r["variant"] for r in rows}
    assert variants == {"cublas", "tma", "persistent", "tma+lora", "persistent+lora"}
    assert {r["cell"] for r in rows} == {"8k_4096x4096", "8k_4096x12288"} and {r["gemm"] for r in rows} == {
        "forward", "dx"}
    assert all(r["status"] == "ok" and r["rel_l2_vs_fp32"] < FP32_TOLERANCE for r in rows)
    summary = measure.read_csv(smoke_dir / "gemm_core_summary.csv")
    for s in summary:
        assert (s["time_vs_cublas"] is None) == (s["variant"] == "cublas"), s


def test_a_failing_optional_linear_variant_is_a_recorded_row_not_a_crash(monkeypatch, bench_module):
    """bench_lora_linear: a GEMM-core variant that cannot run (here: made to raise) leaves one ``error`` row with
    the message, the other variants are timed, and notebook 05's metrics say which variant failed instead of
    ratios; a failure of a variant the notebook's own metrics need still fails the benchmark."""
    import argparse

    import lora_lab.kernels

    bench = bench_module("bench_lora_linear")

    real = lora_lab.kernels.fused_lora_linear

    def refusing(*args, config=None, **kwargs):
        if config is not None and config.fold_projection:
            raise RuntimeError("made-up failure of the folded kernel")
        return real(*args, config=config, **kwargs)

    monkeypatch.setattr(lora_lab.kernels, "fused_lora_linear", refusing)
    args = argparse.Namespace(variants=["base", "peft", "fused_fold"], repetitions=2, warmup_ms=1.0,
                              rep_ms=2.0, forward=False, components="none")
    shipped = lora_lab.kernels.KernelConfig()
    rows, _ = bench.measure_cell("c", (16, 32, 32, 4), args, shipped, torch.float32, torch.device("cpu"), True)
    failed = [r for r in rows if r["status"] == "error"]
    assert [(r["variant"], r["fwd_bwd_ms"]) for r in failed] == [("fused_fold", None)]
    assert "made-up failure" in failed[0]["error"]
    assert {(r["variant"], r["rep"]) for r in rows if r["status"] == "ok"} == {
        (v, rep) for v in ("base", "peft") for rep in range(2)}
    assert {s["variant"] for s in bench.summary_rows(rows)} == {"base", "peft"}
    metrics = fused_lora_kernels.core_variant_metrics(rows, ["c"])
    assert metrics == {"lora_linear_fused_fold_failed_cells": 1}
    monkeypatch.setitem(bench.FUSED_CONFIGS, "fused", {"fold_projection": True})  # now a required variant fails
    args.variants = ["base", "peft", "fused"]
    with pytest.raises(RuntimeError, match="made-up failure"):
        bench.measure_cell("c", (16, 32, 32, 4), args, shipped, torch.float32, torch.device("cpu"), True)


@pytest.mark.slow
def test_kernel_profile_rows(smoke_dir):
    """profile_kernels.py: for every case and implementation asked for, the largest kernels (operators on a CPU)
    with launches and time per profiled step; their shares add up to one."""
    rows = measure.read_csv(smoke_dir / "profile_kernels.csv")  # refuses another code hash
    assert rows and all(r["smoke"] is True for r in rows)
    groups = {(r["case"], r["impl"]) for r in rows}
    assert groups == {("lora_linear", "base"), ("lora_linear", "fused"), ("lora_linear_8k", "base"),
                      ("lora_linear_8k", "fused"), ("moe_full", "ours"), ("moe_full", "grouped_mm"),
                      ("moe_lora", "ours"), ("moe_lora", "grouped_mm"), ("loss_trainable", "ours"),
                      ("loss_frozen", "ours")}
    assert all(r["status"] == "ok" and r["us_per_step"] > 0 and r["calls_per_step"] > 0 for r in rows)
    for group in groups:
        mine = [r for r in rows if (r["case"], r["impl"]) == group]
        assert abs(sum(r["share"] for r in mine) - 1.0) < 1e-6, group
        assert len({r["kernel"] for r in mine}) == len(mine), group


def test_profile_occupancy_arithmetic(bench_module):
    """profile_kernels.occupancy: programs per Hopper SM from warps, registers and shared memory, and which of
    them binds first."""
    prof = bench_module("profile_kernels")

    # 8 warps x 32 threads x 128 registers = 32768 of the SM's 65536: two programs; 100 KiB of shared memory: two
    assert prof.occupancy(8, 128, 100 * 1024) == {"blocks_per_sm": 2, "occupancy_limited_by": "registers",
                                                  "warp_occupancy": 0.25}
    # 168 registers round up to 176 per thread (256 per warp): one program of 8 warps fits, not two
    assert prof.occupancy(8, 168, 0)["blocks_per_sm"] == 1
    # 4 warps, few registers, 160 KiB of shared memory: shared memory allows one program
    assert prof.occupancy(4, 64, 160 * 1024) == {"blocks_per_sm": 1, "occupancy_limited_by": "shared memory",
                                                 "warp_occupancy": 4 / 64}
    # 1 warp, 32 registers, no shared memory: the 32-programs limit binds
    assert prof.occupancy(1, 32, 0) == {"blocks_per_sm": 32, "occupancy_limited_by": "blocks", "warp_occupancy": 0.5}


def test_profile_cut_short_keeps_the_implementations_it_finished(monkeypatch, tmp_path, bench_module):
    """profile_kernels writes its CSV after every implementation: a run stopped in the middle of a case (a timeout)
    keeps the profiles it finished."""
    prof = bench_module("profile_kernels")

    real, calls = prof.profile_step, []

    def stopping(step, steps, cuda):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a timeout's signal does in the middle of the second implementation
        return real(step, steps, cuda)

    monkeypatch.setattr(prof, "profile_step", stopping)
    with pytest.raises(KeyboardInterrupt):
        prof.main(["--out", str(tmp_path), "--smoke", "--cases", "lora_linear", "--variants", "base", "fused",
                   "--repetitions", "2"])
    rows = measure.read_csv(tmp_path / prof.CSV)
    assert rows and {(r["case"], r["impl"]) for r in rows} == {("lora_linear", "base")}


def test_profile_lists_autotuner_picks_per_key():
    """profile_kernels.autotuner_picks: one row per (autotuned kernel, tuning key) with the picked settings; every
    autotuned lora_lab kernel is found through its wrappers. Run without the interpreter (in a subprocess), which
    would replace the JIT functions."""
    script = """
import json, triton, profile_kernels as prof
objects = prof.kernel_objects()
tuned = sorted(name for name, _fn, tuners in objects if tuners)
name, _fn, tuners = next(o for o in objects if o[0].endswith("_grouped_rows_gemm_kernel"))
tuners[0].cache = {(2048, 768, True, "torch.bfloat16"): triton.Config({"BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8,
                                                                       num_stages=3)}
print(json.dumps({"tuned": tuned, "picks": prof.autotuner_picks()}))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT / "benchmarks", env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"lora_lab.kernels.lora.gemm._lora_gemm_tma_kernel", "lora_lab.kernels.lora.rank_ops._rank_reduction_kernel",
            "lora_lab.kernels.moe.grouped_gemm._grouped_rows_gemm_kernel",
            "lora_lab.kernels.moe.expert_weight_grad._expert_weight_grad_kernel"} <= set(found["tuned"])
    assert found["picks"] == [{"function": "lora_lab.kernels.moe.grouped_gemm._grouped_rows_gemm_kernel",
                               "key": "2048 768 True torch.bfloat16", "config": "BLOCK_K=64 BLOCK_N=256",
                               "num_warps": 8, "num_stages": 3}]


def test_a_failing_optional_moe_implementation_is_a_recorded_row_not_a_crash(monkeypatch, bench_module):
    """bench_moe: a persistent form (or Liger) that cannot run leaves rows with status ``error`` and the message,
    the other implementations are timed, and notebook 06's table keeps the failed one without a time; a failure of
    ``ours`` or a baseline still fails the benchmark."""
    import argparse

    bench = bench_module("bench_moe")

    real = bench.set_implementation

    def refusing(holder, experts, impl, cfg=None):  # the refused implementation's step raises, as a compile would
        real(holder, experts, impl, cfg)
        holder.__dict__.pop("forward", None)
        if impl in refused:
            def forward(*args, **kwargs):
                raise RuntimeError(f"made-up failure of {impl}")
            holder.forward = forward

    monkeypatch.setattr(bench, "set_implementation", refusing)
    shape = fused_moe.LAYER_SHAPES["qwen3_30b_a3b"].scaled(**bench.SMOKE_SHAPES["qwen3_30b_a3b"])
    args = argparse.Namespace(repetitions=2, eager_calls=1, warmup_ms=1.0, rep_ms=2.0, smoke=True, calls=2, warmup=0,
                              secondary=["kernel", "back_to_back"])
    refused = {"ours_persistent"}
    rows = bench.bench_layer_cell(shape, 8, 8192, "full", ["grouped_mm", "ours", "ours_persistent"], args, None,
                                  torch.device("cpu"), torch.float32)
    failed = [r for r in rows if r["impl"] == "ours_persistent"]
    assert len(failed) == 2 and all(r["status"] == "error" and r["ms"] is None for r in failed)
    assert "made-up failure of ours_persistent" in failed[0]["error"]
    assert {(r["impl"], r["rep"]) for r in rows if r["status"] == "ok" and r["ms"] > 0} == {
        (i, rep) for i in ("grouped_mm", "ours") for rep in range(2)}
    table = {t["impl"]: t for t in fused_moe.layer_table(rows)}
    assert table["ours_persistent"]["status"] == "error" and "ms" not in table["ours_persistent"]
    refused = {"ours"}
    with pytest.raises(RuntimeError, match="made-up failure of ours"):
        bench.bench_layer_cell(shape, 8, 8192, "full", ["grouped_mm", "ours"], args, None, torch.device("cpu"),
                               torch.float32)


@pytest.mark.slow
def test_primary_figure_is_the_users_loop_with_labelled_secondary_columns(smoke_dir):
    """The timed rows carry the synchronised loop's figure (``timing`` = loop, every timed call in
    ``ms_each``) and kernel time only as a separate, labelled column; no do_bench column without CUDA."""
    for name, value in (("06_moe_layer.csv", "ms"), ("05_gated_deltanet.csv", "fwd_bwd_ms")):
        rows = [r for r in measure.read_csv(smoke_dir / name) if r.get(value) is not None]
        assert rows, name
        for r in rows:
            assert r["timing"] == "loop", name
            each = [float(t) for t in str(r["ms_each"]).split()]
            assert r[value] == pytest.approx(sorted(each)[len(each) // 2] if len(each) % 2 else
                                             (sorted(each)[len(each) // 2 - 1] + sorted(each)[len(each) // 2]) / 2,
                                             rel=1e-3, abs=1e-3)
            if r.get("impl") != "eager":
                assert r["kernel_ms"] > 0, name
            assert r.get("back_to_back_ms") is None or torch.cuda.is_available()
    profile = [r for r in measure.read_csv(smoke_dir / "profile_kernels.csv") if r["status"] == "ok"]
    assert profile and all(r["loop_ms_per_step"] > 0 for r in profile)

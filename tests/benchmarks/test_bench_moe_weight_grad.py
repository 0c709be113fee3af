"""bench_moe_weight_grad's code path on the CPU (--smoke: a tiny stand-in layer, fp32, Triton's interpreter): every
implementation timed, its result checked against the fp32 reference, the summary's speedups over per_tile."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from lora_lab.kernels.triton_helpers import running_in_interpreter
from lora_lab.lab import measure

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not running_in_interpreter(), reason="the smoke run is the CPU interpreter's")
def test_smoke_run_times_every_kernel_and_checks_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = importlib.import_module("bench_moe_weight_grad")
    bench.main(["--out", str(tmp_path), "--smoke", "--repetitions", "2",
                "--variants", "kgrouped_persistent"])  # besides the defaults: per_tile, kgrouped, grouped_mm
    rows = measure.read_csv(tmp_path / bench.CSV)
    kernels = {"per_tile", "kgrouped", "kgrouped_persistent"}
    assert {(r["gemm"], r["impl"]) for r in rows} >= {(g, i) for g in ("dW1", "dW2") for i in kernels}
    kernel_rows = [r for r in rows if r["impl"] in kernels]
    assert all(r["status"] == "ok" and r["ms"] > 0 and r["rel_l2_vs_fp32"] < 1e-5 for r in kernel_rows)
    # torch._grouped_mm: timed where this torch runs it on the CPU, else an error row (a recorded result)
    assert all(r["status"] == "error" or r["rel_l2_vs_fp32"] < 1e-5 for r in rows if r["impl"] == "grouped_mm")
    summary = measure.read_csv(tmp_path / bench.SUMMARY_CSV)
    assert {r["n"] for r in summary} == {2}
    assert all(r["speedup_vs_per_tile"] > 0 for r in summary if r["impl"] != "per_tile")

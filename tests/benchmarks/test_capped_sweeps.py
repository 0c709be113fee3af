"""Under a GPU memory cap (the gpu-24g / gpu-40g profiles), the sweeps of notebooks 05, 07 and 10 skip by name what
their byte models say cannot fit, keep an OOM as a skipped cell, and leave the affected metrics out so they grade
void with the reason. CPU only: the device is a torch.device object, the GPU's size a fixture."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lora_lab.lab import measure, rules
from lora_lab.memory import budget

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it


@pytest.fixture(autouse=True)
def no_cap(monkeypatch):
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "")
    budget.clear_skipped()
    yield
    budget.clear_skipped()


@pytest.fixture
def h200(monkeypatch):
    """cuda:0 has 141 GiB, as an H200: the cap, when set, is what limits."""
    card = SimpleNamespace(total_memory=141 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: card)


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))

    def load(name):
        import importlib

        return importlib.import_module(name)
    return load


def void_reason(metric: str) -> str | None:
    """Why a prediction on ``metric`` would grade void, from the skipped cells kept so far."""
    found = rules.skipped_cell_of(metric, {"skipped_cells": budget.skipped_cells()})
    return None if found is None else f"{found[0]}: {found[1]}"


# ---- notebook 10: bench_whole_step -------------------------------------------------------------------------------

def _whole_step_args(bench):
    args, _ = bench("bench_whole_step").parse_args(["--out", "x"])  # the gpu profile's shapes: 2 x 4096, 2 layers
    return args


@pytest.mark.parametrize("cap, alone, timing", [("39", set(), False), ("12", {"peft", "peft_patch"}, True)])
def test_whole_step_skips_what_the_byte_model_says_cannot_fit(bench, h200, monkeypatch, cap, alone, timing):
    ws = bench("bench_whole_step")
    args = _whole_step_args(bench)
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, cap)
    skip_alone, skip_timing, run_args, shrunk = ws.over_memory_cap("llama", args.variants, args, CUDA)
    assert set(skip_alone) == alone  # the standard loss's logits: the two variants without a fused loss
    assert (skip_timing is not None) == timing
    assert run_args is args and shrunk == ""  # runs as asked, or not at all
    if timing:
        assert skip_timing.startswith("timing pass skipped: needs more than the memory cap")
        assert "6 variants built at once, batch 2 x 4096" in skip_timing  # every smaller shape tried is named too
        assert "6 variants built at once, batch 1 x 1024" in skip_timing
    for reason in skip_alone.values():
        assert reason.startswith("memory pass skipped") and "byte model" in reason


def test_whole_step_shrinks_to_the_first_token_shape_that_fits(bench, h200, monkeypatch):
    """At 22 GiB the six Llama-like variants built at once need about 33 GiB at 2 x 4096 and 25 GiB at 1 x 4096,
    so they run at 1 x 2048, said as a shrink (the asked shape's predictions grade void with it)."""
    ws = bench("bench_whole_step")
    args = _whole_step_args(bench)
    assert ws.shrink_shapes(args) == [(2, 4096), (1, 4096), (1, 2048), (1, 1024)]
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "22")
    skip_alone, skip_timing, run_args, shrunk = ws.over_memory_cap("llama", args.variants, args, CUDA)
    assert skip_alone == {} and skip_timing is None
    assert (run_args.batch, run_args.seq) == (1, 2048) and (args.batch, args.seq) == (2, 4096)
    assert shrunk.startswith("shrunk from '6 variants built at once, batch 2 x 4096'") and "batch 1 x 2048" in shrunk
    assert budget.skipped_cells()["llama"] + " (lora_lab's byte model)" == shrunk


def test_whole_step_metrics_of_a_shrunk_model_carry_its_tokens(tmp_path, monkeypatch):
    from lora_lab.experiments import whole_step

    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "22")
    why = "shrunk from '6 variants built at once, batch 2 x 4096' (needs about 33.1 GiB) to '... batch 1 x 2048'"
    ok = {"batch": 1, "seq": 2048, "layers": 2, "dtype": "bfloat16", "smoke": False, "shrunk": why}
    rows = [{**ok, "model": "llama", "variant": v, "rep": rep, "status": "ok", "step_ms": ms, "session": s}
            for s in range(1) for rep in range(2) for v, ms in (("peft", 10.0 + rep), ("peft_liger_patch", 8.0))]
    memory = [{**ok, "model": "llama", "variant": "peft", "status": "ok", "peak_gib": 9.0, "session": 0}]
    measure.write_csv(rows, tmp_path / "whole_step.csv")
    measure.write_csv(memory, tmp_path / "whole_step_memory.csv")
    metrics = whole_step.benchmark_metrics(tmp_path)
    assert "llama_recipe_speedup_vs_peft" not in metrics and "llama_peft_step_ms" not in metrics
    assert metrics["llama_1x2048_recipe_speedup_vs_peft"]["median"] > 1 and metrics["llama_1x2048_peft_peak_gib"] == 9
    assert void_reason("llama_recipe_speedup_vs_peft") == f"llama: under the 22 GiB memory cap " \
                                                          f"($LORA_LAB_MEMORY_CAP_GIB): {why}"


def test_whole_step_estimates_the_timing_pass_from_every_variant_built(bench):
    ws = bench("bench_whole_step")
    args = _whole_step_args(bench)
    est = ws.estimated_bytes("llama", args.variants, args)
    fixed = {f for f, _ in est.values()}
    assert len(fixed) == 1  # the same weights and adapters in every variant
    assert est["peft"][1] > est["peft_patch_fused_loss"][1]  # the standard loss's logits
    assert ws.timing_bytes(est) == 6 * fixed.pop() + est["peft"][1] - est["peft"][0]
    assert ws.estimated_bytes("qwen3_moe", args.variants, args) is None  # no byte model: an OOM is caught instead


def test_whole_step_runs_everything_without_a_cap_or_off_cuda(bench, h200, monkeypatch):
    ws = bench("bench_whole_step")
    args = _whole_step_args(bench)
    assert ws.over_memory_cap("llama", args.variants, args, CUDA) == ({}, None, args, "")
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "1")
    assert ws.over_memory_cap("llama", args.variants, args, torch.device("cpu")) == ({}, None, args, "")
    assert ws.over_memory_cap("qwen3_moe", args.variants, args, CUDA) == ({}, None, args, "")


def test_whole_step_passes_write_skipped_rows(bench, monkeypatch):
    ws = bench("bench_whole_step")

    class Fake:
        def __init__(self, *a):
            self.losses = []

        def step(self):
            self.losses.append(torch.tensor(2.0))

        def describe(self):
            return {"loss_impl": "torch"}

    monkeypatch.setattr(ws, "Variant", Fake)
    args, _ = ws.parse_args(["--out", "x", "--smoke", "--repetitions", "2", "--variants", "peft", "peft_patch"])
    cpu = torch.device("cpu")
    memory = ws.memory_pass("llama", args.variants, args, cpu, torch.float32, {"peft_patch": "memory pass skipped: x"})
    assert {r["variant"]: r["status"] for r in memory} == {"peft": "ok", "peft_patch": "skipped"}
    rows = ws.timing_pass("llama", args.variants, args, cpu, torch.float32, "timing pass skipped: y")
    assert [(r["variant"], r["status"]) for r in rows] == [("peft", "skipped")] * 2 + [("peft_patch", "skipped")] * 2
    summary = {s["variant"]: s for s in ws.summarize(rows, memory)}
    assert summary["peft_patch"]["status"] == "skipped" and summary["peft"]["status"] == "skipped"


def _whole_step_csvs(tmp_path):
    ok = {"batch": 2, "seq": 4096, "layers": 2, "dtype": "bfloat16", "smoke": False, "session": 0}
    rows = [{**ok, "model": "llama", "variant": v, "rep": rep, "status": "ok", "step_ms": ms}
            for rep in range(2) for v, ms in (("peft", 10.0 + rep), ("peft_liger_patch", 8.0))]
    rows += [{**ok, "model": "qwen2", "variant": v, "rep": rep, "status": "skipped",
              "error": "timing pass skipped: needs more than the memory cap"} for rep in range(2)
             for v in ("peft", "peft_liger_patch")]
    memory = [{**ok, "model": "llama", "variant": "peft", "status": "oom", "error": "CUDA out of memory"},
              {**ok, "model": "llama", "variant": "peft_liger_patch", "status": "ok", "peak_gib": 5.0,
               "losses_first": "2.0 1.9 1.8"},
              {**ok, "model": "qwen2", "variant": "peft", "status": "ok", "peak_gib": 19.0,
               "losses_first": "2.0 1.9 1.8"}]
    measure.write_csv(rows, tmp_path / "whole_step.csv")
    measure.write_csv(memory, tmp_path / "whole_step_memory.csv")


def test_whole_step_metrics_name_the_skipped_model_under_a_cap(tmp_path, monkeypatch):
    from lora_lab.experiments import whole_step

    _whole_step_csvs(tmp_path)
    plain = whole_step.benchmark_metrics(tmp_path)
    assert budget.skipped_cells() == {}  # without a cap an OOM is the measurement's own result
    assert plain["llama_peft_peak_gib"] is None
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "22")
    metrics = whole_step.benchmark_metrics(tmp_path)
    assert metrics["llama_recipe_speedup_vs_peft"]["median"] > 1  # what ran is still graded
    assert "llama_peft_peak_gib" not in metrics and "qwen2_recipe_speedup_vs_peft" not in metrics
    assert metrics["qwen2_peft_peak_gib"] == 19.0
    assert "peft oom: out of memory: CUDA out of memory" in void_reason("llama_peft_peak_gib")
    why = void_reason("qwen2_recipe_speedup_vs_peft")
    assert why.startswith("qwen2: under the 22 GiB memory cap") and "timing pass skipped" in why
    # the variants that failed alike share one clause, once, however many repetitions and sessions repeat it
    assert "peft, peft_liger_patch skipped: timing pass skipped" in why and why.count("timing pass skipped") == 1


def test_whole_step_capped_reason_shortens_out_of_memory(monkeypatch):
    from lora_lab.experiments import whole_step

    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "22")
    oom = "OutOfMemoryError: CUDA out of memory. Tried to allocate {} GiB. GPU 0 has a total capacity of 79.18 GiB"
    rows = [{"model": "qwen3_moe", "variant": v, "status": "oom", "error": oom.format(size)}
            for v, size in (("peft", "4.64"), ("peft_patch", "4.64"), ("peft_liger", "0.25"), ("peft", "4.64"))]
    why = whole_step.note_capped_models(rows)["qwen3_moe"]
    assert why == ("under the 22 GiB memory cap ($LORA_LAB_MEMORY_CAP_GIB): peft, peft_patch oom: out of memory "
                   "(asked for 4.64 GiB); peft_liger oom: out of memory (asked for 0.25 GiB)")


TORCH_OOM = ("CUDA out of memory. Tried to allocate 3.91 GiB. GPU 0 has a total capacity of 79.18 GiB of which "
             "58.31 GiB is free. Process 967 has 826.00 MiB memory in use. Including non-PyTorch memory, this process "
             "has 20.05 GiB memory in use. Of the allocated memory 17.62 GiB is allocated by PyTorch, and 1.93 GiB is "
             "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
             "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def test_an_out_of_memory_row_keeps_the_allocators_split(monkeypatch):
    """PyTorch's OOM message gives the allocator's split (allocated, reserved but unallocated) last: a row cut at 300
    characters lost it. The row keeps every figure, and the capped reason says how much of the cap was fragmentation."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from bench_common import error_text, oom_text

    from lora_lab.experiments import whole_step

    text = error_text(torch.OutOfMemoryError(TORCH_OOM))
    assert text == ("OutOfMemoryError: CUDA out of memory: asked for 3.91 GiB; the process held 20.05 GiB; "
                    "allocated by PyTorch 17.62 GiB; reserved but unallocated 1.93 GiB")
    assert budget.oom_figures(text) == budget.oom_figures(TORCH_OOM)  # the compact text reads back the same
    assert oom_text(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED")) is None
    assert error_text(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED")) == "RuntimeError: CUBLAS_STATUS_ALLOC_FAILED"
    assert error_text(ValueError("x" * 400)) == ("ValueError: " + "x" * 400)[:300]  # other errors as before
    for error in (TORCH_OOM, text):
        assert whole_step._short_failure("oom", error) == (
            "out of memory (asked for 3.91 GiB, allocated by PyTorch 17.62 GiB, reserved but unallocated 1.93 GiB)")


# ---- notebook 07: bench_loss -------------------------------------------------------------------------------------

def _loss_csv(tmp_path):
    rows = []
    for shape in ("qwen2.5-0.5b", "llama3-8b"):
        for head in ("trainable", "frozen"):
            for method, ms in (("lora_lab", 5.0), ("torch_bf16", 9.0), ("liger", 7.0), ("gemm_floor", 4.0),
                               ("gemm_floor_recompute", 4.5)):
                oom = (shape, head, method) == ("llama3-8b", "trainable", "torch_bf16")
                for rep in range(2):
                    rows.append({"shape": shape, "tokens": 16384, "head": head, "method": method, "rep": rep,
                                 "status": "oom" if oom else "ok", "ms": None if oom else ms + rep,
                                 "peak_vs_floor": None if oom else 2.0, "peak_extra_gib": None if oom else 1.0,
                                 "loss_rel_err": None, "note": "predicted: 3 [N x V] buffers" if oom else ""})
    measure.write_csv(rows, tmp_path / "07_loss_block.csv")


def test_loss_metrics_over_a_cell_where_a_method_ran_out_of_memory_are_void_under_a_cap(tmp_path, monkeypatch):
    from lora_lab.experiments import loss_block

    _loss_csv(tmp_path)
    plain = loss_block.benchmark_metrics(tmp_path)
    assert "time_vs_torch_bf16_max" in plain and budget.skipped_cells() == {}  # uncapped: over the cells that ran
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "22")
    metrics = loss_block.benchmark_metrics(tmp_path)
    assert "time_vs_torch_bf16_max" not in metrics
    assert void_reason("time_vs_torch_bf16_max") == (
        "time_vs_torch_bf16_max: ran out of memory under the 22 GiB memory cap ($LORA_LAB_MEMORY_CAP_GIB): "
        "torch_bf16 in llama3-8b_16384_trainable")
    for kept in ("time_vs_liger_max", "time_vs_three_gemm_floor_max", "time_vs_fastest_baseline_max",
                 "peak_vs_liger_max", "frozen_peak_over_floor_max", "lora_lab_ms_llama3-8b_16384_trainable"):
        assert metrics[kept] == plain[kept], kept  # what the OOM does not touch is graded as before
    assert budget.skipped_cells()["llama3-8b_16384_trainable"].endswith("memory cap ($LORA_LAB_MEMORY_CAP_GIB): "
                                                                        "torch_bf16")


def test_loss_metric_of_a_peer_that_never_ran_says_why(tmp_path, monkeypatch):
    """A peer that is not installed is a skip with its reason, not a metric missing for a reader to guess at: under
    a cap as without one."""
    from lora_lab.experiments import loss_block

    _loss_csv(tmp_path)
    rows = measure.read_csv(tmp_path / "07_loss_block.csv")
    missing = "cut-cross-entropy is not installed (No module named 'cut_cross_entropy')"
    rows += [{**rows[0], "method": "cce", "rep": rep, "status": "skipped", "ms": None, "note": missing}
             for rep in range(2)]
    measure.write_csv(rows, tmp_path / "07_loss_block.csv")
    for cap in (None, "22"):
        budget.clear_skipped()
        if cap:
            monkeypatch.setenv(budget.MEMORY_CAP_ENV, cap)
        metrics = loss_block.benchmark_metrics(tmp_path)
        assert "time_vs_cce_max" not in metrics and "time_vs_liger_max" in metrics
        assert budget.skipped_cells()["time_vs_cce_max"] == f"cce skipped: {missing}"
        assert void_reason("time_vs_cce_max") == f"time_vs_cce_max: cce skipped: {missing}"
        assert "time_vs_chunked_max" not in budget.skipped_cells()  # a method with no rows at all: nothing to say


# ---- notebook 05: bench_lora_train_step ----------------------------------------------------------------------------

def _train_args(bench, *extra):
    ts = bench("bench_lora_train_step")
    ap_args = ["--out", "x", *extra]
    import argparse

    ap = argparse.ArgumentParser()
    ts.add_common_arguments(ap, list(ts.VARIANTS), ts.DEFAULT_VARIANTS, "smoke")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args(ap_args)
    args.variants = ts.DEFAULT_VARIANTS
    return ts, args


def _qwen3_4096_config():
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=4, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)


@pytest.mark.parametrize("cap, skipped", [("22", True), ("39", False)])
def test_train_step_skips_a_model_the_byte_model_says_cannot_fit(bench, h200, monkeypatch, cap, skipped):
    ts, args = _train_args(bench)
    config = _qwen3_4096_config()
    peak = ts.estimated_peak_bytes(config, args.batch, args.seq)
    assert 22 * GIB < peak < 39 * GIB  # the standard loss's fp32 logits at 4 x 2048 tokens, vocab 151936
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, cap)
    why = ts.over_memory_cap("qwen3-4096", config, args, CUDA)
    assert (why is not None) == skipped
    if skipped:
        assert why.startswith("skipped: needs more than the memory cap ($LORA_LAB_MEMORY_CAP_GIB=22)")
        assert "'batch 4 x 2048' about" in why and why.endswith("(lora_lab's byte model)")
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "")
    assert ts.over_memory_cap("qwen3-4096", config, args, CUDA) is None  # no cap: it runs


def test_train_step_rows_of_a_model_that_did_not_run(bench):
    ts, args = _train_args(bench, "--repetitions", "2")
    rows = ts.not_run_rows("qwen3-4096", args, "oom", "OutOfMemoryError: CUDA out of memory")
    assert [(r["variant"], r["rep"], r["status"]) for r in rows] == [
        ("peft", 0, "oom"), ("fused", 0, "oom"), ("peft", 1, "oom"), ("fused", 1, "oom")]


def test_notebook_05_train_metrics_name_the_skipped_model_under_a_cap(tmp_path, monkeypatch):
    from lora_lab.experiments import fused_lora_kernels as fk

    ok = {"batch": 4, "seq": 2048, "smoke": False, "status": "ok", "peak_bytes": 10 * GIB}
    rows = [{**ok, "model": "qwen2.5-0.5b", "variant": v, "rep": rep, "tokens_per_s": tps}
            for rep in range(2) for v, tps in (("peft", 100.0 + rep), ("fused", 130.0))]
    rows += [{"model": "qwen3-4096", "variant": v, "rep": rep, "batch": 4, "seq": 2048, "smoke": False,
              "status": "skipped", "error": "skipped: needs more than the memory cap"}
             for rep in range(2) for v in ("peft", "fused")]
    measure.write_csv(rows, tmp_path / fk.TRAIN_CSV)
    plain = fk.benchmark_metrics(tmp_path)
    assert "train_speedup_vs_peft_qwen2_5_0_5b" in plain and budget.skipped_cells() == {}
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "22")
    metrics = fk.benchmark_metrics(tmp_path)
    assert metrics["train_speedup_vs_peft_qwen2_5_0_5b"] == plain["train_speedup_vs_peft_qwen2_5_0_5b"]
    assert "train_speedup_vs_peft_qwen3_4096" not in metrics
    assert void_reason("train_speedup_vs_peft_qwen3_4096") == (
        "qwen3_4096: skipped under the 22 GiB memory cap ($LORA_LAB_MEMORY_CAP_GIB): skipped: needs more than the "
        "memory cap")


def test_train_step_records_an_oom_under_a_cap_and_crashes_without_one(bench, monkeypatch, tmp_path):
    ts = bench("bench_lora_train_step")

    def out_of_memory(name, *a):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12 GiB")

    monkeypatch.setattr(ts, "bench_model", out_of_memory)
    argv = ["--out", str(tmp_path), "--smoke", "--repetitions", "1"]
    with pytest.raises(torch.OutOfMemoryError):  # on the whole card an OOM stays what it was
        ts.main(argv)
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "22")
    ts.main(argv)
    rows = measure.read_csv(tmp_path / ts.CSV)
    assert {(r["model"], r["status"]) for r in rows} == {("qwen3-4096", "oom"), ("qwen2.5-0.5b", "oom")}
    assert all("CUDA out of memory" in r["error"] for r in rows)


def test_bench_loss_predicts_the_standard_losses_oom_against_the_cap(bench, h200, monkeypatch):
    bl = bench("bench_loss")
    assert bl.memory_limit(CUDA) == (141 * GIB, "the GPU's")
    assert bl.memory_limit(torch.device("cpu")) == (None, "")
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "22")
    capacity, limit = bl.memory_limit(CUDA)
    assert (capacity, limit) == (22 * GIB, "the memory cap's")
    # torch_fp32 at qwen2.5-0.5b, 16,384 tokens: 5 [N x V] buffers, about 23 GiB: predicted, not tried, under 22 GiB
    assert bl.LOGIT_BUFFERS["torch_fp32"] * 16384 * 151936 * 2 > capacity


def test_whole_step_session_marks_the_rows_of_a_shrunk_model(bench, monkeypatch, tmp_path):
    ws = bench("bench_whole_step")

    class Fake:
        def __init__(self, model_name, variant, args, *a):
            self.losses, self.tokens = [], (args.batch, args.seq)

        def step(self):
            self.losses.append(torch.tensor(2.0))

        def describe(self):
            return {"loss_impl": "torch"}

    args, _ = ws.parse_args(["--out", str(tmp_path), "--smoke", "--repetitions", "2", "--steps", "1",
                             "--models", "llama", "--variants", "peft", "peft_patch"])
    monkeypatch.setattr(ws, "Variant", Fake)
    monkeypatch.setattr(ws, "over_memory_cap",
                        lambda model, variants, a, device: ({}, None, ws.with_tokens(a, 1, 8), "shrunk from x to y"))
    ws.run_session(args, tmp_path)
    for name in (ws.CSV, ws.MEMORY_CSV):
        rows = measure.read_csv(tmp_path / name)
        assert rows and all((r["batch"], r["seq"], r["shrunk"]) == (1, 8, "shrunk from x to y") for r in rows), name

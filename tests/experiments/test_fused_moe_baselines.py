"""Liger-Kernel's fused MoE as notebook 06's baseline for full fine-tuning: it computes what transformers' experts
compute (fp32, Triton's interpreter on CPU), is offered for full fine-tuning only, and its ratios reach the
benchmark's metrics. The tests that run Liger need ``liger_kernel`` installed (the GPU machine carries it)."""
import pytest
import torch

from lora_lab.experiments import fused_moe as fm
from lora_lab.lab import measure

SHAPE = fm.LAYER_SHAPES["qwen3_30b_a3b"].scaled(hidden=32, num_experts=4, top_k=2, intermediate=16)


def test_liger_is_offered_for_full_fine_tuning_only():
    assert "liger" not in fm.implementations("lora")
    assert fm.implementations("full")[:3] == fm.IMPLEMENTATIONS
    assert ("liger" in fm.implementations("full")) == fm.liger_available()
    with pytest.raises(ValueError, match="mode must be"):
        fm.implementations("qlora")
    holder, experts, _ = fm.layer_holder(SHAPE, "lora", "cpu", torch.float32)
    with pytest.raises(ValueError, match="no LoRA on experts"):
        fm.set_implementation(holder, experts, "liger")


@pytest.mark.parametrize("shape_name", list(fm.LAYER_SHAPES))
def test_liger_experts_match_transformers_eager_in_fp32(shape_name):
    pytest.importorskip("liger_kernel")
    shape = fm.LAYER_SHAPES[shape_name].scaled(hidden=32, num_experts=5, top_k=2, intermediate=24)
    holder, experts, params = fm.layer_holder(shape, "full", "cpu", torch.float32, seed=1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(41, shape.hidden, generator=gen).requires_grad_(True)
    index, weights = fm.random_routing(41, shape, "cpu", torch.float32, seed=1)
    grad_out = torch.randn(41, shape.hidden, generator=gen)
    results = {}
    for impl in ("eager", "liger"):
        fm.set_implementation(holder, experts, impl)
        out = holder(x, index, weights)
        results[impl] = [out, *torch.autograd.grad(out, [x, weights, *params], grad_out)]
    fm.set_implementation(holder, experts, "eager")
    names = ["out", "d_x", "d_weights", "d_gate_up_proj", "d_down_proj"]
    for name, got, want in zip(names, results["liger"], results["eager"]):
        assert measure_rel_l2(got, want) < 1e-5, name


def measure_rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_benchmark_metrics_compare_ours_with_liger(tmp_path):
    rows = []
    for rep in range(5):
        for impl, ms in (("ours", 2.0 + 0.01 * rep), ("grouped_mm", 4.0), ("liger", 3.0)):
            for cell, tokens in (("qwen3_30b_a3b_t8192_full", 8192), ("qwen3_30b_a3b_t32768_full", 32768)):
                rows.append(dict(cell=cell, shape="qwen3_30b_a3b", tokens=tokens, label_tokens=tokens, mode="full",
                                 impl=impl, rep=rep, ms=ms, gemm_flops=4e12, status="ok", peak_bytes=None,
                                 resident_bytes=None, smoke=False))
    measure.write_csv(rows, tmp_path / fm.LAYER_CSV)
    metrics = fm.benchmark_metrics(tmp_path)
    speedup = metrics["qwen3_30b_a3b_t8192_full_speedup_vs_liger"]
    assert speedup["n"] == 5 and 1.45 < speedup["median"] < 1.5  # 3.0 ms / ~2.02 ms
    assert metrics["qwen3_30b_a3b_t32768_full_liger_tflops"]["median"] == pytest.approx(4e12 / 3e-3 / 1e12)
    assert metrics["qwen3_30b_a3b_t32768_full_ours_tflops"]["median"] > metrics[
        "qwen3_30b_a3b_t32768_full_grouped_mm_tflops"]["median"]
    assert "qwen1_5_moe_a2_7b_t8192_full_speedup_vs_liger" not in metrics  # a cell that did not run


def test_an_oom_under_a_memory_cap_names_its_cell_for_grading(tmp_path, monkeypatch):
    from lora_lab.memory import budget

    rows = []
    for rep in range(5):
        for impl, status in (("ours", "ok"), ("grouped_mm", "oom"), ("liger", "oom")):
            rows.append(dict(cell="mixtral_8x22b_t32768_full", shape="mixtral_8x22b", tokens=32768,
                             label_tokens=32768, mode="full", impl=impl, rep=rep, ms=2.0 if status == "ok" else None,
                             gemm_flops=4e12, status=status, peak_bytes=None, resident_bytes=None, smoke=False))
    measure.write_csv(rows, tmp_path / fm.LAYER_CSV)
    budget.clear_skipped()
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "")
    fm.benchmark_metrics(tmp_path)
    assert budget.skipped_cells() == {}  # on the whole card an OOM is the measurement's own result
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "22")
    metrics = fm.benchmark_metrics(tmp_path)
    assert "mixtral_8x22b_t32768_full_speedup_vs_grouped_mm" not in metrics
    assert budget.skipped_cells() == {"mixtral_8x22b_t32768_full": "ran out of memory under the 22 GiB memory cap "
                                                                  "($LORA_LAB_MEMORY_CAP_GIB): grouped_mm, liger"}
    budget.clear_skipped()


def test_the_engine_table_gives_ours_engine_by_the_gpu_class(monkeypatch):
    from lora_lab import gpu_arch

    shape = fm.LAYER_SHAPES["mixtral_8x7b"]
    monkeypatch.setattr(gpu_arch, "capability", lambda device: (9, 0))
    assert fm.ours_engine(shape, 8192, "lora", "cuda", torch.bfloat16) == "grouped_mm"
    monkeypatch.setattr(gpu_arch, "capability", lambda device: (8, 0))  # the Ampere path, e.g. LORA_LAB_ARCH=sm80
    assert fm.ours_engine(shape, 8192, "lora", "cuda", torch.bfloat16) == "triton"
    rows = [dict(cell="c", shape="s", tokens=1, label_tokens=1, mode="lora", impl=impl, status="ok", ms=1.0,
                 gemm_flops=1e9, peak_bytes=None, engine="triton") for impl in ("ours", "grouped_mm")]
    table = fm.layer_table(rows)
    assert table[0]["engine"] == "triton" and "engine" not in table[1]  # the rule concerns ours only

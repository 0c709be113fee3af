"""benchmarks/profile_step.py: kernel names sort into the categories a reader needs (GPU names as the profiler
reports them, CPU operators in smoke); a smoke run writes a row per implementation and category whose times add up
to the step's kernel time, and a missing peer is a skipped row with its error."""
import sys
from pathlib import Path

import pytest

from lora_lab.lab import measure

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def profile_step(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import profile_step

    return profile_step


@pytest.mark.parametrize("name, expected", [
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>", "matmul"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>", "attention"),
    ("_lora_gemm_kernel", "lora_triton"), ("_rank_projection_kernel", "lora_triton"),
    ("_gate_up_silu_kernel", "moe_triton"), ("lse_partials_kernel", "loss"),
    ("_liger_cross_entropy_kernel", "loss"), ("_rms_norm_forward_kernel", "norm"), ("_rope_backward_kernel", "rope"),
    ("_swiglu_forward_kernel", "activation"),
    ("void at::native::multi_tensor_apply_kernel<at::native::FusedOptimizerTensorListMetadata>", "optimizer"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("void at::native::elementwise_kernel<128, 2, at::native::direct_copy_kernel_cuda>", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
    ("FusedLoRALinearFunctionBackward", "lora_triton"), ("MmBackward0", "matmul"), ("something_new", "other"),
])
def test_categories(profile_step, name, expected):
    assert profile_step.category(name) == expected


@pytest.mark.slow
def test_smoke_rows_add_up(profile_step, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "unsloth", None)  # missing, whether or not installed
    profile_step.main(["--out", str(tmp_path), "--smoke", "--impls", "ours", "peft", "unsloth"])
    rows = measure.read_csv(tmp_path / profile_step.CSV)
    skipped = [r for r in rows if r["impl"] == "unsloth"]
    assert len(skipped) == 1 and skipped[0]["status"] == "skipped" and "unsloth" in skipped[0]["error"]
    for impl in ("ours", "peft"):
        mine = [r for r in rows if r["impl"] == impl]
        assert [r["category"] for r in mine] == profile_step.ORDER and all(r["status"] == "ok" for r in mine)
        assert sum(r["ms_per_step"] for r in mine) == pytest.approx(mine[0]["kernel_ms"])
        assert sum(r["share"] for r in mine) == pytest.approx(1.0)
        assert mine[0]["loop_ms"] > 0 and mine[0]["floor_ms"] is None  # no measured rate on a CPU
    ours = {r["category"]: r["ms_per_step"] for r in rows if r["impl"] == "ours"}
    assert ours["lora_triton"] > 0  # the fused LoRA ops ran, and were sorted as such
    kernels = measure.read_csv(tmp_path / profile_step.KERNELS_CSV)
    assert {r["impl"] for r in kernels} == {"ours", "peft"}

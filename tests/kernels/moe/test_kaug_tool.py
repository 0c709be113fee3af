"""tools/moe_lora_kaug_bench.py: the K-widened LoRA form (every LoRA term inside a grouped GEMM whose K grows by r)
computes what the grouped-GEMM engine computes, output and every gradient, fp32 on CPU, odd shapes, an empty
expert; and its timing model, which leaves SiLU·up's rows out of the wide buffers, does not (the check can fail)."""

import pytest
import torch


@pytest.fixture(scope="module")
def tool(load_tool):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no _grouped_mm")
    return load_tool("moe_lora_kaug_bench")


def test_the_widened_form_matches_the_engine(tool):
    assert tool.check() == []


def test_the_timing_model_is_not_the_engine(tool):
    from lora_lab.experiments.fused_moe import MoeLayerShape

    cell = tool.make_cell(MoeLayerShape("t", 24, 5, 2, 40, True, "qwen3_moe"), 37, 8, "cpu", torch.float32)
    run = tool.steps(cell, 8)
    ref, model = run["engine"](), run["kaug_model"]()
    assert tool.rel_l2(model[0], ref[0]) > 0.5  # h is missing from the down GEMM's rows


def test_timing_takes_the_calls_in_turns_each_round(tool):
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    times = tool.timed(fns, calls=3, reps=2)
    assert sorted(times) == ["a", "b"] and all(len(v) == 2 for v in times.values())
    # round 0: a then b (2 warm-up turns + 3 timed); round 1 rotated: b first
    assert calls[:10] == ["a", "b"] * 5 and calls[10:20] == ["b", "a"] * 5

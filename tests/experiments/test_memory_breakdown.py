"""Notebook 04's sweep (lora_lab.experiments.memory_breakdown): setups switched on one model, OOM as a result."""
import copy

import pytest
import torch

import lora_lab
from lora_lab import memory as mem
from lora_lab.experiments import memory_breakdown as mb
from lora_lab.loss import causal_lm_loss


def test_accounting_under_checkpointing_sees_only_the_loss(tiny_fp32, random_ids):
    model = copy.deepcopy(tiny_fp32)
    mb.prepare_model(model, mb.config_for("fp32", 2, 24, "lora_ckpt"), lora_r=4, lora_alpha=8)
    with mem.SavedTensorAccounting(model) as acc:
        loss = causal_lm_loss(model, random_ids(model), chunked=True, chunk_size=8)
    assert acc.report.layers == 0 and acc.report.by_label["loss"] > 0
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_prepare_model_switches_between_setups(tiny_fp32):
    model = copy.deepcopy(tiny_fp32)
    w_before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    mb.prepare_model(model, mb.config_for("fp32", 1, 8, "lora_ckpt"), lora_r=4, lora_alpha=8)
    assert len(lora_lab.lora_layers(model)) == 2 * model.config.num_hidden_layers
    assert model.model.layers[0].gradient_checkpointing and model.training
    shape = mem.ModelShape.from_config(model.config)
    assert lora_lab.count_parameters(model).trainable == shape.lora_parameter_count(4, ("q_proj", "v_proj"))
    mb.prepare_model(model, mb.config_for("fp32", 1, 8, "full"))
    assert not lora_lab.lora_layers(model)
    assert not model.model.layers[0].gradient_checkpointing
    assert all(p.requires_grad for p in model.parameters())
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, w_before)
    assert not getattr(model, "_require_grads_hooks", None)  # input-grad hook gone with checkpointing


def test_sweep_records_out_of_memory_and_continues(monkeypatch, tiny_fp32):
    calls = []

    def fake_peak_memory(model, batch, steps, loss_fn, account_step):
        calls.append(batch["input_ids"].shape)
        if batch["input_ids"].shape[1] == 32:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.99 GiB")
        fixed = mem.fixed_memory_by_category(model)
        return mem.PeakMemory(step_peaks=[3, 2, 1], forward_peak=1, backward_peak=1, optimizer_peak=0,
                              before_forward=0, after_body=1, after_forward=1, fixed_after_backward=fixed)

    monkeypatch.setattr(mb, "peak_memory", fake_peak_memory)
    configs = mb.sweep_configs(["fp32"], 1, [16, 32, 64], ["full", "lora"])
    seen = []
    rows = mb.memory_sweep(configs, lambda dtype: copy.deepcopy(tiny_fp32), progress=False,
                            on_row=seen.append, lora_r=4, lora_alpha=8)
    assert len(rows) == len(configs) == 6 and seen == rows and len(calls) == 6
    assert [r["oom"] for r in rows] == [False, False, True, True, False, False]
    assert "out of memory" in rows[2]["error"] and "peak" not in rows[2]
    assert rows[0]["peak"] == 1 and rows[0]["name"] == "fp32_b1_l16_full"


def test_sweep_leaves_out_what_the_cap_skipped_before_it_ran(monkeypatch, tiny_fp32):
    """Under a memory cap the byte model may say a configuration cannot fit: it is not run, and no metric records
    that estimate (a prediction on it grades void with the skipped cell's reason); the others run as before."""
    ran = []

    def fake_peak_memory(model, batch, steps, loss_fn, account_step):
        ran.append(batch["input_ids"].shape[1])
        return mem.PeakMemory(step_peaks=[3, 2, 1], forward_peak=1, backward_peak=1, optimizer_peak=0,
                              before_forward=0, after_body=1, after_forward=1,
                              fixed_after_backward=mem.fixed_memory_by_category(model))

    def fake_over_cap(model, config, device, **lora):
        return "skipped: needs more than the memory cap allows" if config.seq_len == 64 else None

    monkeypatch.setattr(mb, "peak_memory", fake_peak_memory)
    monkeypatch.setattr(mb, "over_memory_cap", fake_over_cap)
    configs = mb.sweep_configs(["fp32"], 1, [16, 64], ["full", "lora"])
    seen = []
    rows = mb.memory_sweep(configs, lambda dtype: copy.deepcopy(tiny_fp32), progress=False,
                            on_row=seen.append, lora_r=4, lora_alpha=8)
    assert [r["name"] for r in rows] == ["fp32_b1_l16_full", "fp32_b1_l16_lora"] and seen == rows
    assert ran == [16, 16] and not any(r["oom"] for r in rows)
    skipped = mb.run_memory_config(copy.deepcopy(tiny_fp32), configs[2], lora_r=4, lora_alpha=8)
    assert skipped["skipped"] and "memory cap" in skipped["error"] and mb.row_metrics(skipped) == {}


def test_row_metrics_and_kernel_names():
    row = {"name": "bf16_b4_l512_lora", "oom": False, "peak": 3 * mem.GIB, "before_forward": mem.GIB,
           "layers": mem.GIB // 2, "head_loss": mem.GIB + mem.GIB // 2, "weights": mem.GIB, "gradients": 0,
           "optimizer_states": 0, "peak_phase": "backward"}
    m = mb.row_metrics(row)
    assert m["gpu_bf16_b4_l512_lora_oom"] == 0 and m["gpu_bf16_b4_l512_lora_peak_gib"] == 3.0
    assert m["gpu_bf16_b4_l512_lora_layers_gib"] == 0.5 and m["gpu_bf16_b4_l512_lora_peak_phase"] == "backward"
    assert mb.row_metrics({"name": "x", "oom": True}) == {"gpu_x_oom": 1}
    assert mb.byte_model_kernel([]) == "eager"
    assert mb.byte_model_kernel(["flash"]) == "flash"
    assert mb.byte_model_kernel(["flash", "math"]) == "math"


def test_sweep_grid():
    configs = mb.sweep_configs(["fp32", "bf16"], 4, [512, 1024], ["full", "lora_ckpt_chunked"],
                                extra=[["fp32", 2, 4096]], extra_chunk_sizes=[256, 1024],
                                extra_chunk_point=["bf16", 4, 1024])
    names = [c.name for c in configs]
    assert names == [
        "fp32_b4_l512_full", "fp32_b4_l512_lora_ckpt_chunked", "fp32_b4_l1024_full",
        "fp32_b4_l1024_lora_ckpt_chunked", "fp32_b2_l4096_full", "fp32_b2_l4096_lora_ckpt_chunked",
        "bf16_b4_l512_full", "bf16_b4_l512_lora_ckpt_chunked", "bf16_b4_l1024_full",
        "bf16_b4_l1024_lora_ckpt_chunked", "bf16_b4_l1024_lora_ckpt_chunked_c256",
    ]
    with pytest.raises(ValueError, match="unknown mode"):
        mb.config_for("fp32", 1, 8, "qlora")


@pytest.mark.gpu
def test_peak_memory_on_cuda_is_consistent():
    model = lora_lab.load_model("random:tiny-qwen2", device="cuda", attn_implementation="sdpa")
    row = mb.run_memory_config(model, mb.config_for("fp32", 2, 64, "full"), lora_r=4, lora_alpha=8)
    assert not row["oom"]
    assert row["peak"] >= row["after_body"] >= row["before_forward"] > 0
    assert row["weights"] == lora_lab.count_parameters(model).total * 4
    assert row["gradients"] == row["weights"]
    assert row["saved_per_layer"] and all(b > 0 for b in row["saved_per_layer"])


"""Exact parity of lora_lab's LoRA with PEFT on the tiny Qwen2 (fp32 logits, 30-step training), and
the bf16 variants: bit-identical without PEFT's adapter autocast, different with it, and the
difference fully explained by computing the LoRA branch in fp32."""
import copy

import pytest
import torch

import lora_lab
from lora_lab.experiments import merge_precision as mn
from lora_lab.experiments import peft_parity as pp

SPEC = "random:tiny-qwen2"


def _twin_models(dtype=torch.float32, device="cpu", autocast_adapter_dtype=True):
    lora_lab.deterministic(0)
    ours = lora_lab.add_lora(lora_lab.load_model(SPEC, dtype=dtype, device=device))
    theirs = pp.peft_lora_model(
        lora_lab.load_model(SPEC, dtype=dtype, device=device), autocast_adapter_dtype=autocast_adapter_dtype
    )
    return ours, theirs


def _batch(device="cpu"):
    return pp.text_batch(lora_lab.load_tokenizer(SPEC), device=device)


def test_fp32_logits_bit_identical_with_peft():
    ours, theirs = _twin_models()
    pp.fill_lora_B_normal(ours, std=0.02, seed=1)
    assert pp.copy_adapters_to_peft(ours, theirs) == 4
    batch = _batch()
    a, b = mn.model_logits(ours, batch), mn.model_logits(theirs, batch)
    assert pp.max_abs_diff(a, b) == 0.0
    # the test has teeth: B != 0 really changes the logits, and a one-ulp change in one B breaks parity
    base = copy.deepcopy(ours)
    pp.zero_lora_B(base)
    assert pp.max_abs_diff(mn.model_logits(base, batch), a) > 1e-4
    with torch.no_grad():
        layer = lora_lab.lora_layers(ours)[0][1]
        layer.lora_B[0, 0] = torch.nextafter(layer.lora_B[0, 0], torch.tensor(1.0))
    assert pp.max_abs_diff(mn.model_logits(ours, batch), b) > 0.0


def test_30_step_training_identical_with_peft():
    ours, theirs = _twin_models()
    pp.zero_lora_B(ours)
    pp.copy_adapters_to_peft(ours, theirs)
    out = pp.twin_training(ours, theirs, _batch(), steps=30, lr=1e-3)
    assert len(out["losses_ours"]) == 30
    assert out["losses_identical"] and out["losses_max_abs_diff"] == 0.0
    assert out["final_A_max_abs_diff"] == 0.0 and out["final_B_max_abs_diff"] == 0.0
    assert out["losses_ours"][-1] < out["losses_ours"][0]  # it did train
    assert any(float(l.lora_B.detach().abs().max()) > 0 for _, l in lora_lab.lora_layers(ours))


def test_bf16_parity_depends_on_peft_autocast():
    ours32, default = _twin_models(autocast_adapter_dtype=True)
    pp.fill_lora_B_normal(ours32, std=0.02, seed=1)
    ours = copy.deepcopy(ours32).to(torch.bfloat16)
    default = pp.peft_lora_model(lora_lab.load_model(SPEC, dtype=torch.bfloat16))
    plain = pp.peft_lora_model(lora_lab.load_model(SPEC, dtype=torch.bfloat16), autocast_adapter_dtype=False)
    pp.copy_adapters_to_peft(ours, default)
    pp.copy_adapters_to_peft(ours, plain)
    assert all(a.dtype == torch.float32 for a, _ in pp.peft_lora_pairs(default).values())
    assert all(a.dtype == torch.bfloat16 for a, _ in pp.peft_lora_pairs(plain).values())
    batch = _batch()
    mine = mn.model_logits(ours, batch)
    assert pp.max_abs_diff(mine, mn.model_logits(plain, batch)) == 0.0
    peft_default = mn.model_logits(default, batch)
    assert pp.max_abs_diff(mine, peft_default) > 0.0
    with mn.projections_swapped(ours, ours, "bf16_fp32_lora"):
        emulated = mn.model_logits(ours, batch)
    assert pp.max_abs_diff(emulated, peft_default) == 0.0


def test_copy_adapters_rejects_mismatched_models():
    lora_lab.deterministic(0)
    ours = lora_lab.add_lora(lora_lab.load_model(SPEC), r=4)
    theirs = pp.peft_lora_model(lora_lab.load_model(SPEC), r=8)
    with pytest.raises(ValueError, match="different r"):
        pp.copy_adapters_to_peft(ours, theirs)
    other = pp.peft_lora_model(lora_lab.load_model(SPEC), r=4, targets=("q_proj",))
    with pytest.raises(ValueError, match="targets differ"):
        pp.copy_adapters_to_peft(ours, other)
    with pytest.raises(ValueError, match="no LoRA layer"):
        pp.fill_lora_B_normal(lora_lab.load_model(SPEC))


def test_train_lora_steps_checks_inputs():
    model = lora_lab.load_model(SPEC)
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        pp.train_lora_steps(model, _batch(), steps=1)
    with pytest.raises(ValueError, match="steps must be positive"):
        pp.train_lora_steps(model, _batch(), steps=0)


def test_text_batch_masks_padding_in_labels():
    batch = _batch()
    assert batch["input_ids"].shape[0] == len(pp.PARITY_SENTENCES)
    pad = batch["attention_mask"] == 0
    assert pad.any()  # the sentences differ in length
    assert (batch["labels"][pad] == -100).all()
    assert torch.equal(batch["labels"][~pad], batch["input_ids"][~pad])


@pytest.mark.gpu
def test_fp32_parity_and_training_on_cuda_without_tf32():
    ours, theirs = _twin_models(device="cuda")
    assert not torch.backends.cuda.matmul.allow_tf32
    batch = _batch("cuda")
    pp.fill_lora_B_normal(ours)
    pp.copy_adapters_to_peft(ours, theirs)
    assert pp.max_abs_diff(mn.model_logits(ours, batch), mn.model_logits(theirs, batch)) == 0.0
    pp.zero_lora_B(ours)
    pp.copy_adapters_to_peft(ours, theirs)
    out = pp.twin_training(ours, theirs, batch, steps=30)
    assert out["losses_identical"]
    assert out["final_A_max_abs_diff"] == 0.0 and out["final_B_max_abs_diff"] == 0.0


@pytest.mark.gpu
def test_bf16_parity_without_autocast_on_cuda():
    ours32, _ = _twin_models(device="cuda")
    pp.fill_lora_B_normal(ours32)
    ours = copy.deepcopy(ours32).to(torch.bfloat16)
    plain = pp.peft_lora_model(
        lora_lab.load_model(SPEC, dtype=torch.bfloat16, device="cuda"), autocast_adapter_dtype=False
    )
    default = pp.peft_lora_model(lora_lab.load_model(SPEC, dtype=torch.bfloat16, device="cuda"))
    pp.copy_adapters_to_peft(ours, plain)
    pp.copy_adapters_to_peft(ours, default)
    batch = _batch("cuda")
    mine = mn.model_logits(ours, batch)
    assert pp.max_abs_diff(mine, mn.model_logits(plain, batch)) == 0.0
    with mn.projections_swapped(ours, ours, "bf16_fp32_lora"):
        emulated = mn.model_logits(ours, batch)
    assert pp.max_abs_diff(emulated, mn.model_logits(default, batch)) == 0.0

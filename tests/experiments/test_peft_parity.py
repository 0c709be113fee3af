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
    theirs = lora_lab.peft_lora_model(
        lora_lab.load_model(SPEC, dtype=dtype, device=device), autocast_adapter_dtype=autocast_adapter_dtype
    )
    return ours, theirs


def _batch(device="cpu"):
    return lora_lab.text_batch(lora_lab.load_tokenizer(SPEC), device=device)


def test_fp32_logits_bit_identical_with_peft():
    ours, theirs = _twin_models()
    lora_lab.fill_lora_B(ours, 0.02, torch.Generator().manual_seed(1))
    assert lora_lab.copy_adapters_to_peft(ours, theirs) == 4
    batch = _batch()
    a, b = lora_lab.model_logits(ours, batch), lora_lab.model_logits(theirs, batch)
    assert lora_lab.max_abs_diff(a, b) == 0.0
    # the test has teeth: B != 0 really changes the logits, and a one-ulp change in one B breaks parity
    base = copy.deepcopy(ours)
    pp.zero_lora_B(base)
    assert lora_lab.max_abs_diff(lora_lab.model_logits(base, batch), a) > 1e-4
    with torch.no_grad():
        layer = lora_lab.lora_layers(ours)[0][1]
        layer.lora_B[0, 0] = torch.nextafter(layer.lora_B[0, 0], torch.tensor(1.0))
    assert lora_lab.max_abs_diff(lora_lab.model_logits(ours, batch), b) > 0.0


def test_30_step_training_identical_with_peft():
    ours, theirs = _twin_models()
    pp.zero_lora_B(ours)
    lora_lab.copy_adapters_to_peft(ours, theirs)
    out = pp.twin_training(ours, theirs, _batch(), steps=30, lr=1e-3)
    assert len(out["losses_ours"]) == 30
    assert out["losses_identical"] and out["losses_max_abs_diff"] == 0.0
    assert out["final_A_max_abs_diff"] == 0.0 and out["final_B_max_abs_diff"] == 0.0
    assert out["losses_ours"][-1] < out["losses_ours"][0]  # it did train
    assert any(float(l.lora_B.detach().abs().max()) > 0 for _, l in lora_lab.lora_layers(ours))


def test_bf16_parity_depends_on_peft_autocast():
    ours32, default = _twin_models(autocast_adapter_dtype=True)
    lora_lab.fill_lora_B(ours32, 0.02, torch.Generator().manual_seed(1))
    ours = copy.deepcopy(ours32).to(torch.bfloat16)
    default = lora_lab.peft_lora_model(lora_lab.load_model(SPEC, dtype=torch.bfloat16))
    plain = lora_lab.peft_lora_model(lora_lab.load_model(SPEC, dtype=torch.bfloat16), autocast_adapter_dtype=False)
    lora_lab.copy_adapters_to_peft(ours, default)
    lora_lab.copy_adapters_to_peft(ours, plain)
    assert all(a.dtype == torch.float32 for a, _ in lora_lab.adapters.peft_lora_pairs(default).values())
    assert all(a.dtype == torch.bfloat16 for a, _ in lora_lab.adapters.peft_lora_pairs(plain).values())
    batch = _batch()
    mine = lora_lab.model_logits(ours, batch)
    assert lora_lab.max_abs_diff(mine, lora_lab.model_logits(plain, batch)) == 0.0
    peft_default = lora_lab.model_logits(default, batch)
    assert lora_lab.max_abs_diff(mine, peft_default) > 0.0
    with mn.projections_swapped(ours, ours, "bf16_fp32_lora"):
        emulated = lora_lab.model_logits(ours, batch)
    assert lora_lab.max_abs_diff(emulated, peft_default) == 0.0


def test_copy_adapters_rejects_mismatched_models():
    lora_lab.deterministic(0)
    ours = lora_lab.add_lora(lora_lab.load_model(SPEC), r=4)
    theirs = lora_lab.peft_lora_model(lora_lab.load_model(SPEC), r=8)
    with pytest.raises(ValueError, match="different r"):
        lora_lab.copy_adapters_to_peft(ours, theirs)
    other = lora_lab.peft_lora_model(lora_lab.load_model(SPEC), r=4, targets=("q_proj",))
    with pytest.raises(ValueError, match="targets differ"):
        lora_lab.copy_adapters_to_peft(ours, other)
    with pytest.raises(ValueError, match="no LoRA B parameter"):
        lora_lab.fill_lora_B(lora_lab.load_model(SPEC), 0.02)


def test_train_steps_stops_below_a_loss_and_checks_inputs():
    model = lora_lab.add_lora(lora_lab.load_model(SPEC), r=4, alpha=8)
    losses = lora_lab.train_steps(model, _batch(), steps=50, lr=1e-2, stop_below=1e9)
    assert len(losses) == 1 and not model.training


def test_train_lora_steps_checks_inputs():
    model = lora_lab.load_model(SPEC)
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        lora_lab.train_steps(model, _batch(), steps=1)
    with pytest.raises(ValueError, match="steps must be positive"):
        lora_lab.train_steps(model, _batch(), steps=0)


def test_text_batch_masks_padding_in_labels():
    batch = _batch()
    assert batch["input_ids"].shape[0] == len(lora_lab.SAMPLE_SENTENCES)
    pad = batch["attention_mask"] == 0
    assert pad.any()  # the sentences differ in length
    assert (batch["labels"][pad] == -100).all()
    assert torch.equal(batch["labels"][~pad], batch["input_ids"][~pad])


@pytest.mark.gpu
def test_fp32_parity_and_training_on_cuda_without_tf32():
    ours, theirs = _twin_models(device="cuda")
    assert not torch.backends.cuda.matmul.allow_tf32
    batch = _batch("cuda")
    lora_lab.fill_lora_B(ours, 0.02, torch.Generator().manual_seed(1))
    lora_lab.copy_adapters_to_peft(ours, theirs)
    assert lora_lab.max_abs_diff(lora_lab.model_logits(ours, batch), lora_lab.model_logits(theirs, batch)) == 0.0
    pp.zero_lora_B(ours)
    lora_lab.copy_adapters_to_peft(ours, theirs)
    out = pp.twin_training(ours, theirs, batch, steps=30)
    assert out["losses_identical"]
    assert out["final_A_max_abs_diff"] == 0.0 and out["final_B_max_abs_diff"] == 0.0


@pytest.mark.gpu
def test_bf16_parity_without_autocast_on_cuda():
    ours32, _ = _twin_models(device="cuda")
    lora_lab.fill_lora_B(ours32, 0.02, torch.Generator().manual_seed(1))
    ours = copy.deepcopy(ours32).to(torch.bfloat16)
    plain = lora_lab.peft_lora_model(
        lora_lab.load_model(SPEC, dtype=torch.bfloat16, device="cuda"), autocast_adapter_dtype=False
    )
    default = lora_lab.peft_lora_model(lora_lab.load_model(SPEC, dtype=torch.bfloat16, device="cuda"))
    lora_lab.copy_adapters_to_peft(ours, plain)
    lora_lab.copy_adapters_to_peft(ours, default)
    batch = _batch("cuda")
    mine = lora_lab.model_logits(ours, batch)
    assert lora_lab.max_abs_diff(mine, lora_lab.model_logits(plain, batch)) == 0.0
    with mn.projections_swapped(ours, ours, "bf16_fp32_lora"):
        emulated = lora_lab.model_logits(ours, batch)
    assert lora_lab.max_abs_diff(emulated, lora_lab.model_logits(default, batch)) == 0.0

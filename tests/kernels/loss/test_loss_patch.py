"""The fused loss inside a model: causal_lm_loss(fused=True), patch_causal_lm_loss and patch_model(fused_loss=True).

Each is compared with the standard transformers loss (all logits) on a tiny Qwen2: the loss and every trainable
gradient, with lora_lab's LoRA, PEFT's LoRA, gradient checkpointing and the fused LoRA kernels.
CPU runs the Triton kernels in the interpreter, fp32; GPU (@pytest.mark.gpu) in bf16.
"""
import copy

import pytest
import torch

import lora_lab
from lora_lab.kernels import patch_model, unpatch_model
from lora_lab.kernels.loss import patch_causal_lm_loss, unpatch_causal_lm_loss
from lora_lab.kernels.loss.patch import causal_lm_of
from lora_lab.loss import causal_lm_loss
from lora_lab.numerics import rel_l2

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _lora_model(kind="lora_lab", dtype=torch.float32):
    model = lora_lab.load_model("random:tiny-qwen2", attn_implementation="sdpa", dtype=dtype, device=DEVICE)
    model.train()
    if kind == "peft":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                    "down_proj"]),
                               autocast_adapter_dtype=False)
    else:
        lora_lab.add_lora(model, r=4, alpha=8)
    torch.manual_seed(1)
    lora_lab.fill_lora_B(model, 0.02)  # B != 0: LoRA gradients depend on the loss's gradient everywhere
    return model


def _batch(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    vocab = causal_lm_of(model).config.vocab_size
    ids = torch.randint(0, vocab, (2, 19), generator=gen).to(DEVICE)
    labels = ids.clone()
    labels[0, :4] = -100
    return ids, labels


def _loss_and_grads(model, run):
    model.zero_grad(set_to_none=True)
    loss = run(model)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, ref, loss_tol=1e-5, grad_tol=1e-4):
    assert abs(got[0].item() - ref[0].item()) <= loss_tol * abs(ref[0].item())
    assert got[1].keys() == ref[1].keys() and got[1]
    for n in ref[1]:
        assert rel_l2(got[1][n], ref[1][n]) <= grad_tol, n


def test_causal_lm_loss_fused_matches_standard():
    model = _lora_model()
    ids, labels = _batch(model)
    ref = _loss_and_grads(model, lambda m: causal_lm_loss(m, ids, labels, chunked=False))
    got = _loss_and_grads(model, lambda m: causal_lm_loss(m, ids, labels, fused=True))
    _assert_same(got, ref)


@pytest.mark.parametrize("kind", ["lora_lab", "peft"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_patched_model_loss_matches_and_builds_no_logits(kind, checkpointing):
    model = _lora_model(kind)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, labels = _batch(model)
    ref = _loss_and_grads(model, lambda m: m(input_ids=ids, labels=labels).loss)
    patch_causal_lm_loss(model)
    patch_causal_lm_loss(model)  # idempotent
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None
    got = _loss_and_grads(model, lambda m: m(input_ids=ids, labels=labels).loss)
    _assert_same(got, ref)
    # without labels the original forward runs and returns logits
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (*ids.shape, 512)
    assert unpatch_causal_lm_loss(model) and not unpatch_causal_lm_loss(model)
    assert model(input_ids=ids, labels=labels).logits is not None


def test_num_items_in_batch_gives_sum_over_items():
    model = _lora_model()
    ids, labels = _batch(model)
    ref = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(50)).loss
    patch_causal_lm_loss(model)
    got = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(50)).loss
    assert abs(got.item() - ref.item()) <= 1e-5 * abs(ref.item())


def test_with_the_fused_lora_kernels(monkeypatch):
    monkeypatch.setenv("LORA_LAB_DISPATCH", "triton")
    model = _lora_model("peft")
    ids, labels = _batch(model)
    ref = _loss_and_grads(model, lambda m: m(input_ids=ids, labels=labels).loss)
    fused = copy.deepcopy(model)
    summary = patch_model(fused, fused_loss=True)
    assert summary["fused_loss"] and summary["lora_layers"] == 6
    got = _loss_and_grads(fused, lambda m: m(input_ids=ids, labels=labels).loss)
    _assert_same(got, ref)
    unpatch_model(fused)
    assert fused(input_ids=ids, labels=labels).logits is not None


def test_a_head_with_an_adapter_or_bias_is_refused():
    model = lora_lab.load_model("random:tiny-qwen2", device=DEVICE)
    lora_lab.add_lora(model, r=2, alpha=4, targets=("q_proj", "lm_head"))
    with pytest.raises(TypeError, match="plain nn.Linear"):
        patch_causal_lm_loss(model)
    with pytest.raises(TypeError, match="fused_loss must be True or False"):
        patch_model(model, fused_loss="yes")
    with pytest.raises(TypeError, match="no transformers"):
        patch_causal_lm_loss(torch.nn.Linear(3, 3))


@pytest.mark.gpu
def test_gpu_bf16_patched_model_close_to_standard():
    model = _lora_model("peft", dtype=torch.bfloat16)
    ids, labels = _batch(model)
    ref = _loss_and_grads(model, lambda m: m(input_ids=ids, labels=labels).loss)
    patch_model(model, fused_loss=True)
    got = _loss_and_grads(model, lambda m: m(input_ids=ids, labels=labels).loss)
    _assert_same(got, ref, loss_tol=1e-2, grad_tol=5e-2)


def _lora_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("impl", ["recompute", "fwdgrad"])
def test_second_backward_through_a_retained_graph_doubles_the_lora_gradients(impl, monkeypatch):
    model = _lora_model()
    ids, labels = _batch(model)
    ref = _loss_and_grads(model, lambda m: m(input_ids=ids, labels=labels).loss)
    monkeypatch.setenv("LORA_LAB_LOSS_IMPL", impl)
    patch_causal_lm_loss(model)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward(retain_graph=True)
    loss.backward()
    twice = _lora_grads(model)
    assert twice.keys() == ref[1].keys()
    for n in ref[1]:
        assert rel_l2(twice[n], 2 * ref[1][n]) <= 1e-4, n
    # autograd.grad with retain_graph, then backward: the gradient once, in .grad
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    lora = [p for n, p in model.named_parameters() if n in ref[1]]
    first = torch.autograd.grad(loss, lora, retain_graph=True)
    loss.backward()
    for (n, p), g in zip([(n, p) for n, p in model.named_parameters() if n in ref[1]], first):
        assert p.grad is not None and rel_l2(p.grad, ref[1][n]) <= 1e-4 and rel_l2(g, ref[1][n]) <= 1e-4, n


@pytest.mark.parametrize("impl", ["recompute", "fwdgrad"])
def test_every_label_ignored_gives_zero_lora_gradients_as_unpatched(impl, monkeypatch):
    model = _lora_model()
    ids, _ = _batch(model)
    labels = torch.full_like(ids, -100)
    ref = _loss_and_grads(model, lambda m: m(input_ids=ids, labels=labels).loss)
    assert torch.isnan(ref[0]) and all(torch.count_nonzero(g) == 0 for g in ref[1].values())
    monkeypatch.setenv("LORA_LAB_LOSS_IMPL", impl)
    patch_causal_lm_loss(model)
    got = _loss_and_grads(model, lambda m: m(input_ids=ids, labels=labels).loss)
    assert torch.isnan(got[0])
    assert got[1].keys() == ref[1].keys()
    for n, g in got[1].items():
        assert not torch.isnan(g).any() and torch.count_nonzero(g) == 0, n

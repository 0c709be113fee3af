"""LoRA variants: rsLoRA, DoRA, LoRA-FA (LoRALinear / add_lora) and LoRA+ (lora_lab.variants), each against a
plain-torch computation of its formula, its gradients, its merge, and PEFT where PEFT has the same thing."""
import math

import pytest
import torch
from torch import nn

import lora_lab
from lora_lab import LoRALinear, add_lora, merge_lora
from lora_lab.layer import SingleChild
from lora_lab.variants import loraplus_optimizer, loraplus_param_groups


def _layer(dtype=torch.float64, seed=0, **variant):
    torch.manual_seed(seed)
    layer = LoRALinear(nn.Linear(16, 12, dtype=dtype), r=4, alpha=6, **variant)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
        if layer.magnitude is not None:
            layer.magnitude.mul_(1 + 0.1 * torch.randn(layer.magnitude.shape, dtype=dtype))
    return layer


def _x(dtype=torch.float64, seed=1):
    return torch.randn(3, 5, 16, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _dora_reference(layer, x):
    """m / ||W + s B A||_row * (W + s B A) x + b in plain torch, the norm detached (DoRA section 4.3)."""
    W, b = layer.base.weight, layer.base.bias
    v = W + layer.scaling * layer.lora_B @ layer.lora_A
    g = layer.magnitude / torch.linalg.norm(v, dim=1).detach()
    y = x @ (g[:, None] * v).T
    return y if b is None else y + b


# --- rsLoRA ---------------------------------------------------------------------------------------------------------


def test_rslora_scale_and_forward():
    layer = _layer(use_rslora=True)
    assert layer.scaling == 6 / math.sqrt(4) == 3.0 and layer.magnitude is None
    x = _x()
    want = x @ layer.base.weight.T + layer.base.bias + 3.0 * (x @ layer.lora_A.T) @ layer.lora_B.T
    torch.testing.assert_close(layer(x), want)
    assert "use_rslora=True" in repr(layer)


# --- DoRA -----------------------------------------------------------------------------------------------------------


def test_fresh_dora_layer_is_the_base_layer_and_m_is_the_row_norm():
    torch.manual_seed(0)
    base = nn.Linear(16, 12)
    layer = LoRALinear(base, r=4, alpha=8, use_dora=True)
    assert torch.equal(layer.magnitude, torch.linalg.norm(base.weight, dim=1))
    assert layer.magnitude.requires_grad and layer.magnitude.shape == (12,)
    x = _x(torch.float32)
    assert torch.equal(layer(x), base(x))


@pytest.mark.parametrize("bias", [True, False])
def test_dora_forward_matches_the_formula(bias):
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(16, 12, bias=bias, dtype=torch.float64), r=4, alpha=6, use_dora=True)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
        layer.magnitude.mul_(1.2)
    x = _x()
    torch.testing.assert_close(layer(x), _dora_reference(layer, x))


def test_dora_gradients_treat_the_norm_as_a_constant():
    layer = _layer(use_dora=True)
    x = _x()
    layer(x).square().sum().backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters() if p.requires_grad}
    assert set(got) == {"lora_A", "lora_B", "magnitude"} and got["magnitude"].abs().sum() > 0
    layer.zero_grad()
    _dora_reference(layer, x).square().sum().backward()
    for n, p in layer.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(got[n], p.grad, msg=n)
    assert layer.base.weight.grad is None


@pytest.mark.parametrize("variant", [{}, {"use_rslora": True}, {"use_dora": True},
                                     {"use_dora": True, "use_rslora": True}])
def test_merge_equals_the_unmerged_forward(variant):
    layer = _layer(**variant)
    x = _x()
    torch.testing.assert_close(layer.merge(torch.float64)(x), layer(x), rtol=1e-12, atol=1e-12)
    layer32 = _layer(torch.float32, **variant)
    x32 = _x(torch.float32)
    torch.testing.assert_close(layer32.merge()(x32), layer32(x32), rtol=1e-5, atol=1e-5)


def test_merge_lora_on_a_dora_model_matches_its_logits():
    model = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, targets=("q_proj", "o_proj"),
                     use_dora=True)
    lora_lab.fill_lora_B(model, 0.05, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        merge_lora(model)
        after = model(ids).logits
    assert not lora_lab.lora_layers(model)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("training, dropout", [(False, 0.0), (False, 0.3), (True, 0.0), (True, 0.3)])
def test_dora_layer_matches_peft_bit_for_bit_with_dropout_and_bias(training, dropout):
    """PEFT reuses the base output minus the bias as W x, except in training with dropout, where it recomputes
    W x on the dropped-out input; the same draws of the RNG must give the same bits, gradients included."""
    peft = pytest.importorskip("peft")
    ours = _layer(torch.float32, use_dora=True, dropout=dropout)
    base = nn.Linear(16, 12)
    with torch.no_grad():
        base.load_state_dict(ours.base.state_dict())
    pm = peft.get_peft_model(SingleChild(base, "proj"), peft.LoraConfig(
        r=4, lora_alpha=6, lora_dropout=dropout, target_modules=["proj"], use_dora=True))
    theirs = pm.base_model.model.proj
    with torch.no_grad():
        theirs.lora_A["default"].weight.copy_(ours.lora_A)
        theirs.lora_B["default"].weight.copy_(ours.lora_B)
        theirs.lora_magnitude_vector["default"].weight.copy_(ours.magnitude)
    ours.train(training)
    pm.train(training)
    x = _x(torch.float32)
    torch.manual_seed(7)
    a = ours(x)
    torch.manual_seed(7)
    b = pm(x)
    assert torch.equal(a, b)
    a.square().sum().backward()
    b.square().sum().backward()
    assert torch.equal(ours.lora_B.grad, theirs.lora_B["default"].weight.grad)
    assert torch.equal(ours.magnitude.grad, theirs.lora_magnitude_vector["default"].weight.grad)


# --- LoRA-FA --------------------------------------------------------------------------------------------------------


def test_lora_fa_trains_b_only():
    model = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, lora_fa=True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_B" in n for n in trainable)
    A0 = {n: layer.lora_A.detach().clone() for n, layer in lora_lab.lora_layers(model)}
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    losses = lora_lab.train_steps(model, {"input_ids": ids, "labels": ids}, steps=3, lr=1e-2)
    assert losses[-1] < losses[0]
    for n, layer in lora_lab.lora_layers(model):
        assert layer.lora_A.grad is None and torch.equal(layer.lora_A, A0[n])
        assert torch.count_nonzero(layer.lora_B) > 0


def test_lora_fa_frozen_A_counts_as_adapter_not_base():
    base = lora_lab.count_parameters(lora_lab.load_model("random:tiny-qwen2"))
    model = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, lora_fa=True)
    a = sum(layer.lora_A.numel() for _, layer in lora_lab.lora_layers(model))
    b = sum(layer.lora_B.numel() for _, layer in lora_lab.lora_layers(model))
    count = lora_lab.count_parameters(model)
    assert count == (b, base.total, a)
    assert count.total == base.total + a + b and f"{a:,} frozen adapter parameters" in str(count)


def test_lora_fa_with_dora_trains_b_and_m():
    model = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, lora_fa=True, use_dora=True)
    trainable = {n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"lora_B", "magnitude"}


def test_a_second_add_lora_keeps_the_first_layers_trainable_magnitude():
    model = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, targets=("q_proj",), use_dora=True)
    add_lora(model, r=4, alpha=8, targets=("v_proj",), lora_fa=True)
    layers = dict(lora_lab.lora_layers(model))
    q, v = layers["model.layers.0.self_attn.q_proj"], layers["model.layers.0.self_attn.v_proj"]
    assert q.magnitude.requires_grad and q.lora_A.requires_grad
    assert v.magnitude is None and not v.lora_A.requires_grad and v.lora_B.requires_grad


# --- bad input ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["use_rslora", "use_dora", "lora_fa"])
def test_variant_flags_must_be_booleans(flag):
    model = lora_lab.load_model("random:tiny-qwen2")
    with pytest.raises(TypeError, match=rf"{flag}=1"):
        add_lora(model, **{flag: 1})
    assert not lora_lab.lora_layers(model)


def test_dora_on_a_non_linear_is_refused_by_name():
    model = lora_lab.load_model("random:tiny-qwen2")
    with pytest.raises(TypeError, match=r"model\.embed_tokens is a Embedding.*DoRA \(use_dora=True\)"):
        add_lora(model, targets=("embed_tokens",), use_dora=True)
    assert not lora_lab.lora_layers(model)


# --- PiSSA ---------------------------------------------------------------------------------------------------------


def test_pissa_init_is_the_principal_part_and_the_base_the_residual():
    torch.manual_seed(0)
    base = nn.Linear(16, 12)
    W = base.weight.detach().clone()
    x = _x(torch.float32)
    want = base(x)
    layer = LoRALinear(base, r=4, alpha=8, init_lora_weights="pissa")
    assert layer.base is base and "pissa" in repr(layer)
    U, S, Vh = torch.linalg.svd(W.double(), full_matrices=False)
    principal = U[:, :4] @ torch.diag(S[:4]) @ Vh[:4]
    sBA = layer.scaling * (layer.lora_B.double() @ layer.lora_A.double())
    torch.testing.assert_close(sBA, principal, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(base.weight.double(), W.double() - principal, rtol=1e-5, atol=1e-5)
    # A's rows are orthogonal with squared norms S_r / s; both factors train, the base does not
    torch.testing.assert_close(layer.lora_A.double() @ layer.lora_A.double().T, torch.diag(S[:4] / layer.scaling),
                               rtol=1e-5, atol=1e-5)
    assert layer.lora_A.requires_grad and layer.lora_B.requires_grad and not base.weight.requires_grad
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.merge()(x), layer(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.merge().weight, W, rtol=1e-5, atol=1e-5)


def test_pissa_on_a_tied_head_is_refused_and_the_embedding_kept():
    model = lora_lab.load_model("random:tiny-qwen2")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    before = model.model.embed_tokens.weight.detach().clone()
    with pytest.raises(ValueError, match=r"init_lora_weights='pissa' on lm_head: its weight is tied to "
                                         r"model\.embed_tokens\.weight"):
        add_lora(model, r=4, alpha=8, targets=["q_proj", "lm_head"], init_lora_weights="pissa")
    assert torch.equal(model.model.embed_tokens.weight, before) and not lora_lab.lora_layers(model)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied: accepted
    add_lora(model, r=4, alpha=8, targets=["lm_head"], init_lora_weights="pissa")
    assert torch.equal(model.model.embed_tokens.weight, before)


def test_pissa_model_merges_and_refuses_remove_lora():
    model = lora_lab.load_model("random:tiny-qwen2")
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    add_lora(model, r=4, alpha=8, targets=("q_proj", "down_proj"), init_lora_weights="pissa", use_dora=True)
    with torch.no_grad():
        adapted = model(ids).logits
    torch.testing.assert_close(adapted, before, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"q_proj is a PiSSA layer.*merge_lora"):
        lora_lab.remove_lora(model)
    merge_lora(model)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, adapted, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, error, problem", [
    ({"init_lora_weights": "olora"}, ValueError, r"init_lora_weights='olora' is not supported"),
    ({"init_lora_weights": "Gauss"}, ValueError, r"init_lora_weights='Gauss' is not supported"),
    ({"init_lora_weights": 0}, ValueError, r"init_lora_weights=0 is not supported"),
    ({"init_lora_weights": "pissa", "r": 40}, ValueError, r"PiSSA needs r <= min\(in, out\); .*k_proj is 64 -> 32"),
])
def test_bad_init_is_named(kwargs, error, problem):
    model = lora_lab.load_model("random:tiny-qwen2")
    weight = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    with pytest.raises(error, match=problem):
        add_lora(model, **{"targets": ("q_proj", "k_proj"), **kwargs})
    assert not lora_lab.lora_layers(model) and torch.equal(model.model.layers[0].self_attn.q_proj.weight, weight)


# --- init_lora_weights=False and "gaussian", as PEFT 0.21 draws them ---------------------------------------------


def test_init_false_draws_A_and_B_as_peft_does():
    """PEFT's init_lora_weights=False keeps nn.Linear's default init for both factors (A then B, per layer): with the
    same seed the factors are the same bits, and B is not zero, so the fresh adapter changes the output."""
    peft = pytest.importorskip("peft")
    ours, base = lora_lab.load_model("random:tiny-qwen2"), lora_lab.load_model("random:tiny-qwen2")
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = ours(ids).logits
    torch.manual_seed(11)
    add_lora(ours, r=4, alpha=8, targets=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(11)
    theirs = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       init_lora_weights=False))
    pairs = lora_lab.adapters.peft_lora_pairs(theirs)
    for name, layer in lora_lab.lora_layers(ours):
        assert torch.equal(layer.lora_A, pairs[name][0]) and torch.equal(layer.lora_B, pairs[name][1])
        assert torch.count_nonzero(layer.lora_B) == layer.lora_B.numel()
        assert layer.lora_B.abs().max() <= 1 / math.sqrt(4)  # U(-1/sqrt(r), 1/sqrt(r))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
        assert not torch.allclose(ours(ids).logits, before)


def test_init_gaussian_matches_peft_in_distribution():
    """PEFT's "gaussian": A ~ N(0, std = 1/r), B = 0 (the model still computes what it did)."""
    peft = pytest.importorskip("peft")
    r, targets = 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(5)
    ours = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=r, alpha=16, targets=targets,
                    init_lora_weights="gaussian")
    theirs = peft.get_peft_model(lora_lab.load_model("random:tiny-qwen2"),
                                 peft.LoraConfig(r=r, lora_alpha=16, target_modules=targets,
                                                 init_lora_weights="gaussian"))
    a_ours = torch.cat([layer.lora_A.flatten() for _, layer in lora_lab.lora_layers(ours)])
    a_theirs = torch.cat([a.flatten() for a, _ in lora_lab.adapters.peft_lora_pairs(theirs).values()])
    assert a_ours.numel() == a_theirs.numel() > 8000
    for a in (a_ours, a_theirs):  # within 4 (std) and 5 (mean) standard errors of N(0, 1/r^2)
        assert abs(a.std().item() * r - 1) < 4 / math.sqrt(2 * a.numel())
        assert abs(a.mean().item()) < 5 / r / math.sqrt(a.numel())
    # Kaiming-uniform (the default) would be bounded by 1/sqrt(in) = 0.125 here; a Gaussian of std 1/8 is not
    assert a_ours.abs().max() > 1 / math.sqrt(64)
    assert all(torch.count_nonzero(layer.lora_B) == 0 for _, layer in lora_lab.lora_layers(ours))


@pytest.mark.parametrize("init", [False, "gaussian"])
def test_init_false_and_gaussian_save_and_load_both_ways(tmp_path, init):
    peft = pytest.importorskip("peft")
    ours = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, init_lora_weights=init)
    lora_lab.fill_lora_B(ours, 0.02, generator=torch.Generator().manual_seed(3))
    lora_lab.save_adapter(ours, tmp_path)
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    theirs = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2"), str(tmp_path))
    again = lora_lab.load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
        assert torch.equal(ours(ids).logits, again(ids).logits)


# --- LoRA+ ----------------------------------------------------------------------------------------------------------


def test_loraplus_groups():
    model = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, use_dora=True)
    groups = loraplus_param_groups(model, lr=1e-4, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(1e-4, 0.1), (16e-4, 0.1)]
    assert all(names[id(p)].endswith("lora_A") for p in groups[0]["params"])
    assert {names[id(p)].rsplit(".", 1)[-1] for p in groups[1]["params"]} == {"lora_B", "magnitude"}
    opt = loraplus_optimizer(model, lr=2e-4, ratio=4, betas=(0.8, 0.9))
    assert isinstance(opt, torch.optim.AdamW) and [g["lr"] for g in opt.param_groups] == [2e-4, 8e-4]
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)
    # LoRA-FA: no trainable A, so no A group
    fa = add_lora(lora_lab.load_model("random:tiny-qwen2"), lora_fa=True)
    assert [g["lr"] for g in loraplus_param_groups(fa, lr=1e-3)] == [16e-3]


def test_loraplus_groups_match_peft():
    peft = pytest.importorskip("peft")
    from peft.optimizers import create_loraplus_optimizer

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True)
    pm = peft.get_peft_model(lora_lab.load_model("random:tiny-qwen2"), config)
    theirs = create_loraplus_optimizer(pm, torch.optim.AdamW, lr=1e-4, loraplus_lr_ratio=16,
                                       loraplus_weight_decay=0.1)
    ours = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, use_dora=True)
    mine = loraplus_optimizer(ours, lr=1e-4, ratio=16, weight_decay=0.1)

    def summary(opt):
        return sorted((g["lr"], g["weight_decay"], sorted(tuple(p.shape) for p in g["params"]))
                      for g in opt.param_groups if g["params"])

    assert summary(mine) == summary(theirs)


@pytest.mark.parametrize("kwargs, problem", [
    ({"ratio": 0}, "ratio=0"), ({"ratio": -2.0}, "ratio=-2.0"), ({"lr": 0}, "lr=0"), ({"ratio": math.nan}, "ratio=nan"),
    ({"weight_decay": -1}, "weight_decay=-1"),
])
def test_loraplus_bad_input_is_named(kwargs, problem):
    model = add_lora(lora_lab.load_model("random:tiny-qwen2"))
    with pytest.raises(ValueError, match=problem):
        loraplus_param_groups(model, **{"lr": 1e-4, **kwargs})


def test_loraplus_without_lora_is_refused():
    with pytest.raises(ValueError, match="no trainable LoRA B"):
        loraplus_param_groups(lora_lab.load_model("random:tiny-qwen2").requires_grad_(False), lr=1e-4)

"""Merge numerics: each rounding recipe rounds exactly where it says, vanishing entries, PEFT's
safe_merge double rounding, position statistics, and the drift harness on the tiny Qwen2."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lora_lab
from lora_lab.experiments import merge_precision as mn
from lora_lab.layer import LoRALinear

SPEC = "random:tiny-qwen2"
bf16 = torch.bfloat16


def _layer(seed=0, in_f=40, out_f=24, r=4):
    torch.manual_seed(seed)
    base = nn.Linear(in_f, out_f)
    layer = LoRALinear(base, r=r, alpha=2 * r)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.05)
        base.bias.normal_(0, 0.1)
    return layer


def _r(t):
    return t.to(bf16).float()


def test_every_recipe_matches_its_formula():
    layer = _layer()
    x = torch.randn(3, 5, 40)
    W, b, A, B, s = layer.base.weight, layer.base.bias, layer.lora_A, layer.lora_B, layer.scaling
    D = (B @ A) * s
    def lora(x, A, B):
        return F.linear(F.linear(x, A), B) * s

    x16 = x.to(bf16)
    W16, b16 = W.to(bf16), b.to(bf16)
    want = {
        "exact": F.linear(x, W, b) + lora(x, A, B),
        "base_only": F.linear(x, W, b),
        "round_input": F.linear(_r(x), W, b) + lora(_r(x), A, B),
        "round_base_weight": F.linear(x, _r(W), b) + lora(x, A, B),
        "round_base_out": _r(F.linear(x, W, b)) + lora(x, A, B),
        "round_lora_weights": F.linear(x, W, b) + lora(x, _r(A), _r(B)),
        "round_lora_mid": F.linear(x, W, b) + F.linear(_r(F.linear(x, A)), B) * s,
        "round_lora_out": F.linear(x, W, b) + _r(lora(x, A, B)),
        "round_sum": _r(F.linear(x, W, b) + lora(x, A, B)),
        "round_merged_weight": F.linear(x, _r(W + D), b),
        "bf16_adapter": (F.linear(x16, W16, b16) + lora(x16, A.to(bf16), B.to(bf16))).float(),
        "bf16_fp32_lora": (F.linear(x16, W16, b16).float() + lora(x16.float(), A, B)).to(bf16).float(),
        "bf16_merged": F.linear(x16, (W16.float() + D).to(bf16), b16).float(),
        "bf16_single_round": (F.linear(x16.float(), W16.float(), b16.float())
                              + lora(x16.float(), A, B)).to(bf16).float(),
        "bf16_exact_qv": (F.linear(x16.float(), W, b) + lora(x16.float(), A, B)).to(bf16).float(),
    }
    assert set(want) == set(mn.RECIPES)
    with torch.no_grad():
        exact = want["exact"]
        for recipe, expected in want.items():
            got = mn.RoundedLoRAProjection(layer, recipe)(x)
            assert got.dtype == torch.float32
            assert torch.equal(got, expected), recipe
            if recipe not in ("exact",):
                assert not torch.equal(got, exact), f"{recipe} changed nothing"
        assert torch.equal(mn.RoundedLoRAProjection(layer, "exact")(x), layer(x))
        # a bf16 host gets bf16 back
        assert mn.RoundedLoRAProjection(layer, "bf16_merged")(x16).dtype == bf16


def test_bf16_recipes_are_our_layer_and_our_merge_in_bf16():
    layer = _layer(1)
    x = torch.randn(6, 40).to(bf16)
    layer16 = copy.deepcopy(layer).to(bf16)
    with torch.no_grad():
        assert torch.equal(mn.RoundedLoRAProjection(layer, "bf16_adapter")(x), layer16(x))
        # LoRALinear.merge on a bf16 base with fp32 A, B forms W16 + D in fp32 and rounds once
        on_bf16_base = copy.deepcopy(layer)
        on_bf16_base.base.to(bf16)
        merged = on_bf16_base.merge()
        assert merged.weight.dtype == bf16
        assert torch.equal(mn.RoundedLoRAProjection(layer, "bf16_merged").W_merged16, merged.weight)
        assert torch.equal(mn.RoundedLoRAProjection(layer, "bf16_merged")(x), merged(x))


def test_recipe_errors_are_clear():
    layer = _layer()
    with pytest.raises(ValueError, match="unknown rounding recipe 'round_everything'"):
        mn.RoundedLoRAProjection(layer, "round_everything")
    with pytest.raises(TypeError, match="must be a LoRALinear"):
        mn.RoundedLoRAProjection(nn.Linear(4, 4), "exact")
    with pytest.raises(TypeError, match="needs the input in the reference dtype"):
        mn.RoundedLoRAProjection(layer, "round_sum")(torch.randn(2, 40).to(bf16))
    with pytest.raises(ValueError, match="16-bit"):
        mn.RoundedLoRAProjection(layer, "exact", low_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"DoRA layer \(use_dora=True\)"):
        mn.RoundedLoRAProjection(lora_lab.LoRALinear(nn.Linear(4, 4), r=2, alpha=4, use_dora=True), "exact")


def test_vanishing_entries_counts_exactly():
    w = torch.tensor([1.0, 1.0, 1.0, 2.0, 0.5]).to(bf16)
    ulp1 = 2.0 ** -7  # bf16 spacing in [1, 2)
    delta = torch.tensor([ulp1 / 4, ulp1 * 0.51, 0.0, ulp1 * 0.9, -ulp1 / 8])
    # 1 + ulp/4 -> 1 (vanishes); 1 + 0.51 ulp -> next value (kept); a zero delta is not counted;
    # 2 + 0.9 * 2^-7 is below half of 2's spacing 2^-6 (vanishes); 0.5 - 2^-10 is exactly half of
    # the spacing 2^-9 below 0.5, a tie that rounds to even, i.e. back to 0.5 (vanishes)
    vanished, nonzero = mn.vanishing_entries(w, delta)
    assert (vanished, nonzero) == (3, 4)
    with pytest.raises(ValueError, match="low-precision"):
        mn.vanishing_entries(w.float(), delta)
    with pytest.raises(ValueError, match="differ in shape"):
        mn.vanishing_entries(w, delta[:3])


def test_model_vanishing_share_tiny():
    lora_lab.deterministic(0)
    model = lora_lab.add_lora(lora_lab.load_model(SPEC))
    lora_lab.fill_lora_B(model, 1e-3, torch.Generator().manual_seed(1))
    small = mn.model_vanishing_share(model)
    lora_lab.fill_lora_B(model, 1e-1, torch.Generator().manual_seed(1))
    large = mn.model_vanishing_share(model)
    assert small["nonzero"] == large["nonzero"] == small["total"]
    assert 0 < large["share"] < small["share"] < 1  # smaller updates vanish more often


def test_safe_merge_double_rounds_and_default_merge_is_ours():
    lora_lab.deterministic(0)
    ours = lora_lab.add_lora(lora_lab.load_model(SPEC))
    lora_lab.fill_lora_B(ours, 0.02, torch.Generator().manual_seed(1))
    peft_model = lora_lab.peft_lora_model(lora_lab.load_model(SPEC, dtype=bf16))
    lora_lab.copy_adapters_to_peft(ours, peft_model)
    default = mn.peft_merged_weights(peft_model, safe_merge=False)
    safe = mn.peft_merged_weights(peft_model, safe_merge=True)
    layers = dict(lora_lab.lora_layers(ours))
    assert set(default) == set(layers)
    mismatched = 0
    for name, layer in layers.items():
        w16 = layer.base.weight.to(bf16)
        delta = layer.delta_weight(torch.float32)
        assert torch.equal(default[name], (w16.float() + delta).to(bf16))  # one rounding
        assert torch.equal(safe[name], w16 + delta.to(bf16))  # two roundings
        mismatched += int((default[name] != safe[name]).sum())
    assert mismatched > 0
    ours_merged = mn.low_precision_merged_weights(ours)
    assert all(torch.equal(ours_merged[n], default[n]) for n in layers)
    assert lora_lab.lora_layers(ours)  # untouched
    assert all(p.dtype == torch.float32 for p, _ in lora_lab.adapters.peft_lora_pairs(peft_model).values())


def test_position_statistics():
    ref = torch.zeros(2, 3, 5)
    logits = ref.clone()
    logits[0, 1, 2] = 0.5
    logits[1, 2, 0] = 2.0  # raises the reference top-1 (index 0): no flip
    logits[1, 0, 4] = 1.0  # flips argmax at (1, 0)
    d = mn.compare_logits(logits, ref)
    assert d.max_abs.tolist() == [[0, 0.5, 0], [1.0, 0, 2.0]]
    assert torch.allclose(d.mean_abs, d.max_abs / 5)
    assert d.top1_agree.tolist() == [[True, False, True], [False, True, True]]
    s = mn.summarise_positions(d.max_abs, mask=torch.tensor([[1, 1, 1], [1, 1, 0]]))
    assert s["n"] == 5 and s["max"] == 1.0 and math.isclose(s["mean"], 0.3)
    with pytest.raises(ValueError, match="empty mask"):
        mn.summarise_positions(d.max_abs, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="cannot compare"):
        mn.compare_logits(logits, ref[:1])


def test_per_position_loss_matches_transformers():
    lora_lab.deterministic(0)
    model = lora_lab.load_model(SPEC)
    batch = lora_lab.text_batch(lora_lab.load_tokenizer(SPEC))
    with torch.no_grad():
        out = model(**batch)
    loss = mn.per_position_loss(out.logits, batch["labels"])
    assert torch.isnan(loss[:, -1]).all()
    torch.testing.assert_close(loss[~torch.isnan(loss)].mean(), out.loss, rtol=1e-6, atol=1e-6)
    cmp = mn.logit_comparison(out.logits, out.logits, batch)
    assert cmp["max_abs_all"] == 0.0 and cmp["top1_flips_real"] == 0
    assert cmp["n_real"] == int(batch["attention_mask"].sum())
    assert math.isclose(cmp["loss"], float(out.loss), rel_tol=1e-6)


def test_bootstrap_and_subset_statistics():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(500, generator=g) + 1.0
    ratio, lo, hi = mn.bootstrap_ratio_ci(a * 2, a, n_boot=200)
    assert ratio == pytest.approx(2.0) and lo == pytest.approx(2.0) and hi == pytest.approx(2.0)
    b = torch.rand(500, generator=g) + 1.0
    ratio, lo, hi = mn.bootstrap_ratio_ci(a, b, n_boot=500)
    assert lo < ratio < hi and hi - lo < 0.2
    assert mn.share_of_subsets_with_gap(a * 3, a, subset=20, factor=2.0, n_draws=50) == 1.0
    assert mn.share_of_subsets_with_gap(a, a, subset=20, factor=2.0, n_draws=50) == 0.0
    with pytest.raises(ValueError, match="subset size"):
        mn.share_of_subsets_with_gap(a, a, subset=0, factor=2.0)


def test_drift_verdict_rule():
    assert mn.drift_verdict(1.5, 1.3, 1.7) == "adapter drifts further"
    assert mn.drift_verdict(0.7, 0.6, 0.8) == "merged drifts further"
    assert mn.drift_verdict(1.05, 0.95, 1.15) == "no systematic difference"
    with pytest.raises(ValueError, match="inconsistent"):
        mn.drift_verdict(2.0, 0.9, 1.1)


def test_drift_harness_on_tiny_model():
    lora_lab.deterministic(0)
    model = lora_lab.add_lora(lora_lab.load_model(SPEC))
    batch = mn.random_token_batch(model.config.vocab_size, batch=2, length=24, seed=3)
    lora_lab.train_steps(model, batch, steps=3)
    params_before = [p.detach().clone() for p in model.parameters()]
    res = mn.run_drift_experiments(model, batch, keep_logits=("reference", "full_bf16_adapter"))
    assert set(res) == set(mn.DRIFT_VARIANTS) | {mn.FLOOR, "reference"}
    assert res["exact"].summary()["max"] == 0.0  # the harness itself adds nothing
    for name in mn.DRIFT_VARIANTS:
        if name != "exact":
            assert res[name].summary()["mean"] > 0, name
    # the full bf16 adapter variant is the bf16 copy of the model with our LoRALinear
    bf16_model = copy.deepcopy(model).to(bf16)
    assert torch.equal(res["full_bf16_adapter"].logits, lora_lab.model_logits(bf16_model, batch))
    # every single injection drifts less than the whole bf16 model
    full = res["full_bf16_adapter"].summary()["mean"]
    assert all(res[n].summary()["mean"] < full for n in mn.DRIFT_VARIANTS if n.startswith("inj_"))
    # the model and its LoRA layers are restored
    assert len(lora_lab.lora_layers(model)) == 4
    assert all(torch.equal(p, q) for p, q in zip(params_before, model.parameters()))
    with pytest.raises(ValueError, match="unknown drift variant"):
        mn.run_drift_experiments(model, batch, variants=["inj_everything"])
    with pytest.raises(ValueError, match="must be fp32"):
        mn.run_drift_experiments(bf16_model, batch, variants=["exact"])


def test_projections_swapped_restores_on_error():
    lora_lab.deterministic(0)
    model = lora_lab.add_lora(lora_lab.load_model(SPEC))
    before = dict(lora_lab.lora_layers(model))
    with pytest.raises(RuntimeError, match="boom"):
        with mn.projections_swapped(model, model, "round_sum"):
            assert not lora_lab.lora_layers(model)
            raise RuntimeError("boom")
    assert dict(lora_lab.lora_layers(model)) == before
    with pytest.raises(ValueError, match="no LoRA layer"):
        with mn.projections_swapped(lora_lab.load_model(SPEC), model, "exact"):
            pass


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_recipes_on_a_bf16_host(device):
    layer = _layer().to(device)
    x = torch.randn(4, 7, 40, device=device).to(bf16)
    layer16 = copy.deepcopy(layer).to(bf16)
    with torch.no_grad():
        assert torch.equal(mn.RoundedLoRAProjection(layer, "bf16_adapter")(x), layer16(x))
        single = mn.RoundedLoRAProjection(layer, "bf16_single_round")(x)
        # the same sum in fp64 from the same bf16 inputs and weights: single_round may differ from it
        # only by its one final rounding (half a bf16 ulp: at most 2^-8 relative) plus fp32 accumulation noise
        W16, b16 = layer.base.weight.to(bf16).double(), layer.base.bias.to(bf16).double()
        A, B = layer.lora_A.double(), layer.lora_B.double()
        x64 = x.double()
        exact = x64 @ W16.T + b16 + (x64 @ A.T) @ B.T * layer.scaling
        assert ((single.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-6).all()
        assert single.dtype == bf16


def test_sequence_bootstrap_resamples_sequences_not_positions():
    # 8 sequences whose positions are identical within a sequence but differ across sequences: a position
    # bootstrap would treat 8 * 64 draws as independent and give a far narrower interval than the sequence one.
    g = torch.Generator().manual_seed(0)
    per_seq = torch.rand(8, 1, generator=g, dtype=torch.float64) * 2 + 0.5
    a = per_seq.expand(8, 64).clone()
    b = torch.ones(8, 64, dtype=torch.float64)
    ratio, lo, hi = mn.sequence_bootstrap_ratio_ci(a, b, n_boot=1000)
    assert ratio == pytest.approx(float(a.mean()))
    assert lo < ratio < hi
    _, plo, phi = mn.bootstrap_ratio_ci(a, b, n_boot=1000)
    assert (hi - lo) > 3 * (phi - plo)
    # the sequence interval is the interval of a bootstrap over the 8 per-sequence values themselves
    _, slo, shi = mn.bootstrap_ratio_ci(per_seq.flatten(), torch.ones(8, dtype=torch.float64), n_boot=1000)
    assert (lo, hi) == pytest.approx((slo, shi), rel=1e-12)


def test_sequence_bootstrap_uses_only_masked_finite_positions():
    values = torch.tensor([[1.0, 3.0, float("nan"), 100.0], [2.0, 2.0, 2.0, 100.0], [4.0, float("nan"), 4.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0]])
    mean, lo, hi = mn.sequence_bootstrap_mean_ci(values, mask, n_boot=500)
    assert mean == pytest.approx((1 + 3 + 2 + 2 + 2 + 4 + 4) / 7)   # NaN and masked-out positions dropped
    assert 1.0 <= lo <= mean <= hi <= 4.0
    ratio, lo, hi = mn.sequence_bootstrap_ratio_ci(values * 3, values, mask, n_boot=200)
    assert ratio == pytest.approx(3.0) and lo == pytest.approx(3.0) and hi == pytest.approx(3.0)


def test_sequence_bootstrap_refuses_bad_input():
    x = torch.ones(4, 5)
    with pytest.raises(ValueError, match="batch x seq"):
        mn.sequence_bootstrap_mean_ci(torch.ones(20))
    with pytest.raises(ValueError, match="differ in shape"):
        mn.sequence_bootstrap_ratio_ci(x, torch.ones(4, 6))
    with pytest.raises(ValueError, match="mask of shape"):
        mn.sequence_bootstrap_mean_ci(x, torch.ones(4, 4))
    with pytest.raises(ValueError, match="at least 2 sequences"):
        mn.sequence_bootstrap_mean_ci(x, torch.tensor([[1, 1, 0, 0, 0]] + [[0] * 5] * 3))
    with pytest.raises(ValueError, match="level"):
        mn.sequence_bootstrap_mean_ci(x, level=1.5)
    with pytest.raises(ValueError, match="n_boot"):
        mn.sequence_bootstrap_ratio_ci(x, x, n_boot=0)

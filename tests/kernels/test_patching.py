"""patch_model / unpatch_model: PEFT and lora_lab LoRA layers switched to the fused kernels and back.

CPU runs the kernels in Triton's interpreter on CI-sized models in fp32; GPU (@pytest.mark.gpu) in bf16.
"""
import copy

import pytest
import torch

import lora_lab
from lora_lab.kernels import UnsupportedLoRAError, patch_model, patched_layers, unpatch_model
from lora_lab.layer import SingleChild
from lora_lab.numerics import rel_l2

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _triton_engine(monkeypatch):
    # patched layers must run the Triton kernels here, not the small-shape cuBLAS dispatch
    monkeypatch.setenv("LORA_LAB_DISPATCH", "triton")


ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_tiny(targets=ALL_PROJ, dtype=torch.float32, device=DEVICE, **cfg):
    from peft import LoraConfig, get_peft_model

    base = lora_lab.load_model("random:tiny-qwen2", dtype=dtype, device=device)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, **cfg),
                           autocast_adapter_dtype=False)
    torch.manual_seed(1)
    lora_lab.fill_lora_B(model, 0.02)
    return model


def lora_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_logits_and_lora_grads_match(ref, fused, ids, n_grads):
    """One forward and backward of both models on ``ids``: logits within 1e-5 and each of the ``n_grads`` LoRA
    gradients within 1e-4 (relative L2), fp32."""
    out_r, out_f = ref(input_ids=ids, labels=ids), fused(input_ids=ids, labels=ids)
    assert rel_l2(out_f.logits, out_r.logits) < 1e-5
    out_r.loss.backward()
    out_f.loss.backward()
    gr, gf = lora_grads(ref), lora_grads(fused)
    assert gr.keys() == gf.keys() and len(gr) == n_grads
    for n in gr:
        assert rel_l2(gf[n], gr[n]) < 1e-4, n


def test_peft_model_forward_backward_and_training_match():
    ref = peft_tiny()
    fused = copy.deepcopy(ref)
    summary = patch_model(fused)
    assert summary["lora_layers"] == 14  # 7 projections × 2 layers
    assert summary["shared_input_groups"] == 4  # q/k/v and gate/up in each layer
    assert len(patched_layers(fused)) == 14
    ids = torch.randint(0, 512, (2, 13), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    ref.train()
    fused.train()
    assert_logits_and_lora_grads_match(ref, fused, ids, 28)
    ref.zero_grad(set_to_none=True)
    fused.zero_grad(set_to_none=True)
    lr_, lf = (lora_lab.train_steps(ref, {'input_ids': ids, 'labels': ids}, 5),
               lora_lab.train_steps(fused, {'input_ids': ids, 'labels': ids}, 5))
    assert lf[-1] < lf[0]
    assert max(abs(a - b) for a, b in zip(lr_, lf)) < 1e-4


def test_unpatch_restores_forward_and_separate_weights():
    model = peft_tiny()
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    patch_model(model)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    k = model.base_model.model.model.layers[0].self_attn.k_proj
    assert "forward" in q.__dict__
    # group weights live in one buffer
    assert q.base_layer.weight.untyped_storage().data_ptr() == k.base_layer.weight.untyped_storage().data_ptr()
    assert unpatch_model(model) == 14
    assert patched_layers(model) == [] and "forward" not in q.__dict__
    assert q.base_layer.weight.untyped_storage().data_ptr() != k.base_layer.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)


def test_frozen_siblings_join_the_group_and_dropout_stays_single():
    # LoRA on q and v only: k (frozen nn.Linear) joins the q/k/v group; with dropout no group is formed
    model = peft_tiny(targets=["q_proj", "v_proj"])
    ref = copy.deepcopy(model)
    s = patch_model(model)
    assert s["lora_layers"] == 4 and s["shared_input_groups"] == 2 and s["frozen_members"] == 2
    ids = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.no_grad():
        assert rel_l2(model(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-5
    unpatch_model(model)

    drop = peft_tiny(targets=["q_proj", "v_proj"], lora_dropout=0.1)
    s = patch_model(drop)
    assert s["lora_layers"] == 4 and s["shared_input_groups"] == 0
    drop.train()
    loss = drop(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_dynamic_states_fall_back_to_the_original_forward():
    model = peft_tiny(targets=["q_proj", "v_proj"])
    ref = copy.deepcopy(model)
    patch_model(model)
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with torch.no_grad():
        with model.disable_adapter(), ref.disable_adapter():
            assert rel_l2(model(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-6
        model.merge_adapter()
        ref.merge_adapter()
        assert rel_l2(model(input_ids=ids).logits, ref(input_ids=ids).logits) < 1e-5


def test_unsupported_configurations_are_refused():
    dora = peft_tiny(targets=["q_proj"], use_dora=True)
    with pytest.raises(UnsupportedLoRAError, match="DoRA"):
        patch_model(dora)
    assert patched_layers(dora) == []
    with pytest.warns(RuntimeWarning, match="unsupported"):
        s = patch_model(dora, strict=False)
    assert s["lora_layers"] == 0 and len(s["skipped"]) == 2

    biased = peft_tiny(targets=["q_proj"], lora_bias=True)
    with pytest.raises(UnsupportedLoRAError, match="lora_bias"):
        patch_model(biased)

    emb = peft_tiny(targets=["embed_tokens", "q_proj"])
    with pytest.raises(UnsupportedLoRAError, match="Embedding"):
        patch_model(emb)


def test_lora_lab_layers_are_patched():
    base = lora_lab.load_model("random:tiny-qwen2", dtype=torch.float32, device=DEVICE)
    model = lora_lab.add_lora(base, r=4, alpha=8, targets=ALL_PROJ)
    model = model if model is not None else base
    torch.manual_seed(0)
    lora_lab.fill_lora_B(model, 0.02)
    ref = copy.deepcopy(model)
    s = patch_model(model)
    assert s["lora_layers"] == 14 and s["shared_input_groups"] == 4
    ids = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    model.train()
    ref.train()
    lr_, lf = (lora_lab.train_steps(ref, {'input_ids': ids, 'labels': ids}, 3),
               lora_lab.train_steps(model, {'input_ids': ids, 'labels': ids}, 3))
    assert max(abs(a - b) for a, b in zip(lr_, lf)) < 1e-4


def test_lora_lab_rslora_is_fused_with_its_own_scale():
    # rsLoRA only changes layer.scaling (alpha / sqrt(r) = 4 here, not alpha / r = 1), which the fused op reads
    model = lora_lab.add_lora(lora_lab.load_model("random:tiny-qwen2", device=DEVICE), r=16, alpha=16,
                              targets=["q_proj", "k_proj", "v_proj"], use_rslora=True)
    lora_lab.fill_lora_B(model, 0.05, generator=torch.Generator().manual_seed(3))
    assert lora_lab.lora_layers(model)[0][1].scaling == 4.0
    ref = copy.deepcopy(model)
    plain = copy.deepcopy(model)
    for _, layer in lora_lab.lora_layers(plain):
        layer.scaling = 1.0
    s = patch_model(model)
    assert s["lora_layers"] == 6 and s["shared_input_groups"] == 2
    ids = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with torch.no_grad():
        fused, want, unscaled = (m(input_ids=ids).logits for m in (model, ref, plain))
    assert rel_l2(fused, want) < 1e-6 < rel_l2(unscaled, want)


def test_lora_lab_dora_runs_on_the_fused_dora_op_outside_groups():
    # q/k/v and gate/up with DoRA: no shared-input group (the group op has no magnitude), every layer fused alone
    model = lora_lab.add_lora(lora_lab.load_model("random:tiny-qwen2", device=DEVICE), r=4, alpha=8,
                              targets=["q_proj", "k_proj", "v_proj", "down_proj"], use_dora=True)
    torch.manual_seed(3)
    with torch.no_grad():
        for _, layer in lora_lab.lora_layers(model):
            layer.lora_B.normal_(0, 0.05)
            layer.magnitude.mul_(1 + 0.1 * torch.rand_like(layer.magnitude))
    ref = copy.deepcopy(model).train()
    s = patch_model(model)
    assert s["lora_layers"] == 8 and s["shared_input_groups"] == 0
    model.train()
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out_f, out_r = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    assert rel_l2(out_f.logits, out_r.logits) < 1e-5
    out_f.loss.backward()
    out_r.loss.backward()
    gf, gr = lora_grads(model), lora_grads(ref)
    assert gf.keys() == gr.keys() and any("magnitude" in n for n in gf)
    for n in gr:
        assert rel_l2(gf[n], gr[n]) < 1e-4, n
    # DoRA with dropout in training keeps the layer's own forward (it recomputes W x on the dropped input)
    drop = lora_lab.add_lora(lora_lab.load_model("random:tiny-qwen2", device=DEVICE), targets=["q_proj"],
                             use_dora=True, dropout=0.1)
    patch_model(drop)
    layer = drop.get_submodule("model.layers.0.self_attn.q_proj")
    x = torch.randn(3, layer.in_features, device=DEVICE)
    layer.train()
    torch.manual_seed(0)
    want = lora_lab.layer.LoRALinear.forward(layer, x)
    torch.manual_seed(0)
    assert torch.equal(layer(x), want)


@pytest.mark.parametrize("out_f,in_f,r", [(37, 53, 5), (1, 200, 20), (70, 33, 1)])
def test_dora_row_norm_without_the_full_matrix(out_f, in_f, r):
    from lora_lab.kernels.lora.dora import dora_row_norm, dora_row_norm_reference

    gen = torch.Generator().manual_seed(out_f)
    w, a, b = (torch.randn(out_f, in_f, generator=gen), torch.randn(r, in_f, generator=gen),
               torch.randn(out_f, r, generator=gen))
    want = torch.linalg.norm(w.double() + 0.7 * (b.double() @ a.double()), dim=1)
    w, a, b = (t.to(DEVICE) for t in (w, a, b))
    assert rel_l2(dora_row_norm_reference(w, a, b, 0.7), want) < 1e-6
    got = dora_row_norm(w, a, b, 0.7)  # the one-launch Triton kernel
    assert got.dtype == torch.float32 and got.shape == (out_f,)
    assert rel_l2(got, want) < 1e-6
    # 16-bit weights: the kernel reads them as they are and accumulates in fp32, like the reference
    h = [t.half() for t in (w, a, b)]
    assert rel_l2(dora_row_norm(*h, 0.7), dora_row_norm_reference(*h, 0.7)) < 1e-3
    assert dora_row_norm(w[:0], a, b[:0], 0.7).shape == (0,)
    with pytest.raises(ValueError, match="do not fit"):
        dora_row_norm(w, a[:, :-1], b, 0.7)


def _tiny_gated_deltanet(dtype, device, hidden=64):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    cfg = Qwen3_5TextConfig(hidden_size=hidden, linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=16, linear_value_head_dim=16, num_hidden_layers=1,
                            layer_types=["linear_attention"], vocab_size=32)
    torch.manual_seed(0)
    return Qwen3_5GatedDeltaNet(cfg, layer_idx=0).to(device=device, dtype=dtype)


def _peft_gated_deltanet(dtype, device, hidden=64):
    from peft import LoraConfig, get_peft_model

    layer = _tiny_gated_deltanet(dtype, device, hidden)
    targets = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
    model = get_peft_model(SingleChild(layer, "layer"), LoraConfig(r=16, lora_alpha=32, target_modules=targets),
                           autocast_adapter_dtype=False)
    torch.manual_seed(1)
    lora_lab.fill_lora_B(model, 0.02)
    return model


def test_gated_deltanet_layer_patched_matches():
    ref = _peft_gated_deltanet(torch.float32, DEVICE)
    fused = copy.deepcopy(ref)
    s = patch_model(fused)
    assert s["lora_layers"] == 5 and s["shared_input_groups"] == 1
    x = torch.randn(2, 12, 64, device=DEVICE, generator=None)
    xr = x.clone().requires_grad_()
    xf = x.clone().requires_grad_()
    yr, yf = ref(xr), fused(xf)
    assert rel_l2(yf, yr) < 1e-5
    g = torch.randn_like(yr)
    yr.backward(g)
    yf.backward(g)
    assert rel_l2(xf.grad, xr.grad) < 1e-5
    gr, gf = lora_grads(ref), lora_grads(fused)
    assert len(gr) == 10
    for n in gr:
        assert rel_l2(gf[n], gr[n]) < 1e-4, n


@pytest.mark.gpu
def test_gpu_bf16_training_tracks_unpatched():
    ref = peft_tiny(dtype=torch.bfloat16, device="cuda")
    fused = copy.deepcopy(ref)
    patch_model(fused)
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0)).cuda()
    ref.train()
    fused.train()
    lr_, lf = (lora_lab.train_steps(ref, {'input_ids': ids, 'labels': ids}, 10),
               lora_lab.train_steps(fused, {'input_ids': ids, 'labels': ids}, 10))
    assert lf[-1] < lf[0] - 0.05
    assert max(abs(a - b) / abs(a) for a, b in zip(lr_, lf)) < 0.02


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 333, 4097])
def test_gpu_bf16_fused_dora_layer_against_fp32(tokens):
    """The fused DoRA op in bf16 at an odd real-ish shape (in 896, out 4864 + 3, r 16): output, dx, dA, dB and dm
    no further from the fp32 layer than the unfused bf16 layer is."""
    from lora_lab.kernels.lora.dora import fused_dora_linear

    holder = torch.nn.Sequential()
    holder.add_module("proj", torch.nn.Linear(896, 4867, device="cuda"))
    lora_lab.add_lora(holder, r=16, alpha=32, targets=("proj",), use_dora=True)
    layer = holder.proj
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.02, generator=gen)
        layer.magnitude.mul_(1 + 0.1 * torch.rand(layer.magnitude.shape, device="cuda", generator=gen))
    truth = copy.deepcopy(layer)
    ref = copy.deepcopy(layer).to(torch.bfloat16)
    mine = copy.deepcopy(layer).to(torch.bfloat16)
    x = torch.randn(tokens, 896, device="cuda", generator=gen)
    g = torch.randn(tokens, 4867, device="cuda", generator=gen)
    xt, xr, xf = (x.clone().requires_grad_(), x.bfloat16().requires_grad_(), x.bfloat16().requires_grad_())
    yt, yr = truth(xt), ref(xr)
    yf = fused_dora_linear(xf, mine.base.weight, mine.base.bias, mine.lora_A, mine.lora_B, mine.scaling,
                           mine.magnitude)
    yt.backward(g)
    yr.backward(g.bfloat16())
    yf.backward(g.bfloat16())
    assert rel_l2(yf, yt) <= 1.25 * rel_l2(yr, yt) + 1e-3
    assert rel_l2(xf.grad, xt.grad) <= 1.25 * rel_l2(xr.grad, xt.grad) + 1e-3
    for name in ("lora_A", "lora_B", "magnitude"):
        gt, gr, gf = (getattr(m, name).grad for m in (truth, ref, mine))
        assert rel_l2(gf, gt) <= 1.5 * rel_l2(gr, gt) + 2e-3, (name, rel_l2(gf, gt), rel_l2(gr, gt))


@pytest.mark.gpu
def test_gpu_bf16_gated_deltanet_hidden_1024():
    ref = _peft_gated_deltanet(torch.bfloat16, "cuda", hidden=1024)
    fused = copy.deepcopy(ref)
    patch_model(fused)
    x = torch.randn(2, 256, 1024, device="cuda", dtype=torch.bfloat16)
    xr = x.clone().requires_grad_()
    xf = x.clone().requires_grad_()
    yr, yf = ref(xr), fused(xf)
    cos = torch.nn.functional.cosine_similarity(yf.double().flatten(), yr.double().flatten(), dim=0).item()
    assert cos > 0.9999
    g = torch.randn_like(yr)
    yr.backward(g)
    yf.backward(g)
    # The whole layer (delta-rule core included) loses accuracy in bf16 whichever projections it uses, so two
    # bf16 runs differ by about √2 × each one's own error. The yardstick is the same layer in fp32: the fused
    # layer's error must be no worse than the unfused bf16 layer's own (plus a little slack).
    truth = copy.deepcopy(ref).float()
    truth.zero_grad(set_to_none=True)  # the copy carries ref's gradients
    xt = x.float().requires_grad_()
    yt = truth(xt)
    yt.backward(g.float())
    err_fused_y, err_unfused_y = rel_l2(yf, yt), rel_l2(yr, yt)
    err_fused_dx, err_unfused_dx = rel_l2(xf.grad, xt.grad), rel_l2(xr.grad, xt.grad)
    assert err_fused_y <= 1.25 * err_unfused_y + 1e-3, (err_fused_y, err_unfused_y)
    assert err_fused_dx <= 1.25 * err_unfused_dx + 1e-3, (err_fused_dx, err_unfused_dx)
    gt, gf = lora_grads(truth), lora_grads(fused)
    gr = lora_grads(ref)
    for n in gt:  # some factors are tiny (in_proj_b/a: a few hundred entries), so their errors fluctuate more
        assert rel_l2(gf[n], gt[n]) <= 1.5 * rel_l2(gr[n], gt[n]) + 2e-3, \
            (n, rel_l2(gf[n], gt[n]), rel_l2(gr[n], gt[n]))


def test_moe_expert_wrappers_are_left_to_the_moe_patcher():
    # strict mode must not refuse PEFT's wrappers of stacked MoE experts: lora_lab.kernels.moe.patch fuses them
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, intermediate_size=64, moe_intermediate_size=24,
                            num_experts=4, num_experts_per_tok=2, experts_implementation="eager")
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU weights are refused outside the interpreter
    model = get_peft_model(Qwen3MoeForCausalLM(config).to(device), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    summary = patch_model(model)  # strict by default
    assert summary["skipped"] == [] and summary["lora_layers"] == 2 and summary["moe_experts"] >= 1
    assert unpatch_model(model) >= 3


def _zero_lora_B(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()


@pytest.mark.parametrize("kind", ["peft", "lora_lab"])
def test_deep_copy_of_a_patched_model_is_independent(kind):
    # the patched forward once closed over the original module, so a deep copy ran on the original's
    # parameters and sent its gradients there
    if kind == "peft":
        model = peft_tiny(targets=["q_proj", "k_proj", "v_proj", "down_proj"])
    else:
        model = lora_lab.add_lora(lora_lab.load_model("random:tiny-qwen2", device=DEVICE), r=4, alpha=8,
                                  targets=["q_proj", "k_proj", "v_proj", "down_proj"])
        lora_lab.fill_lora_B(model, 0.05, generator=torch.Generator().manual_seed(3))
    summary = patch_model(model)
    assert summary["shared_input_groups"] == 2  # q/k/v in each layer: the group path is exercised too
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    twin = copy.deepcopy(model)
    assert patched_layers(twin) == patched_layers(model)
    with torch.no_grad():
        assert torch.equal(twin(input_ids=ids).logits, before)
    _zero_lora_B(twin)
    with torch.no_grad():
        after_twin, after_orig = twin(input_ids=ids).logits, model(input_ids=ids).logits
    assert rel_l2(after_twin, before) > 1e-3  # the copy runs on its own (zeroed) lora_B
    assert torch.equal(after_orig, before)  # the original is untouched
    twin(input_ids=ids, labels=ids).loss.backward()
    twin_grads = lora_grads(twin)
    assert any("lora_A" in n for n in twin_grads) and any("lora_B" in n for n in twin_grads)
    assert not lora_grads(model)  # no gradient reached the original
    # the copy's group computes with the copy's frozen weights: its members are views of the copy's own buffer
    layer = twin.get_submodule(("base_model.model." if kind == "peft" else "") + "model.layers.0.self_attn")
    orig_layer = model.get_submodule(("base_model.model." if kind == "peft" else "") + "model.layers.0.self_attn")

    def weight(m):
        return m.base_layer.weight if kind == "peft" else m.base.weight

    storage = {weight(getattr(layer, n)).untyped_storage().data_ptr() for n in ("q_proj", "k_proj", "v_proj")}
    assert len(storage) == 1
    assert storage != {weight(orig_layer.q_proj).untyped_storage().data_ptr()}
    with torch.no_grad():
        weight(layer.k_proj).mul_(0.5)
        assert not torch.equal(twin(input_ids=ids).logits, after_twin)
        assert torch.equal(model(input_ids=ids).logits, before)
    assert unpatch_model(twin) == unpatch_model(model)


def test_state_dict_round_trips_of_a_patched_model_are_independent():
    model = peft_tiny(targets=["q_proj", "k_proj", "v_proj"])
    fresh = copy.deepcopy(model)  # never patched: the target of a plain load
    patch_model(model)
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    state = model.state_dict()
    fresh.load_state_dict(state)
    with torch.no_grad():
        assert rel_l2(fresh(input_ids=ids).logits, want) < 1e-6
        _zero_lora_B(fresh)
        assert torch.equal(model(input_ids=ids).logits, want)
    # load into a patched model, copying (the group's buffer is written through its views) and assigning
    # (new tensors: the group binds them on the next call)
    for assign in (False, True):
        other = peft_tiny(targets=["q_proj", "k_proj", "v_proj"])
        _zero_lora_B(other)
        patch_model(other)
        other.load_state_dict({k: v.clone() for k, v in state.items()}, assign=assign)
        with torch.no_grad():
            assert rel_l2(other(input_ids=ids).logits, want) < 1e-6, assign
            _zero_lora_B(other)
            assert rel_l2(other(input_ids=ids).logits, want) > 1e-3
            assert torch.equal(model(input_ids=ids).logits, want)


def test_saved_and_loaded_patched_model_runs_on_its_own_parameters(tmp_path):
    # the patched forward is a BoundForward object, not a closure (torch.save failed) nor a bound method (pickle
    # stores those by name, so torch.load failed): a whole-model save/load gives a working, independent copy
    model = peft_tiny(targets=["q_proj", "k_proj", "v_proj"])
    patch_model(model)
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert patched_layers(loaded) == patched_layers(model)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, want)
        _zero_lora_B(loaded)
        assert rel_l2(loaded(input_ids=ids).logits, want) > 1e-3
        assert torch.equal(model(input_ids=ids).logits, want)
    loaded(input_ids=ids, labels=ids).loss.backward()
    assert lora_grads(loaded) and not lora_grads(model)


def test_patched_model_runs_under_inference_mode():
    """Inference tensors carry no version counter: the shared-input groups step aside and each layer runs its
    own kernel, forward and generate giving what the unpatched model gives."""
    model = lora_lab.add_lora(lora_lab.load_model("random:tiny-qwen2", dtype=torch.float32, device=DEVICE), r=4,
                              targets=ALL_PROJ)
    lora_lab.fill_lora_B(model, 0.02, generator=torch.Generator().manual_seed(0))
    ref = copy.deepcopy(model)
    assert patch_model(model)["shared_input_groups"] == 4
    ids = torch.randint(3, 500, (2, 7), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.inference_mode():
        assert rel_l2(model(ids).logits, ref(ids).logits) < 1e-5
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert torch.equal(out, ref.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0))


def test_a_model_without_lora_is_reported_not_silently_left_alone():
    model = lora_lab.load_model("random:tiny-qwen2", dtype=torch.float32, device=DEVICE)
    with pytest.warns(RuntimeWarning, match="patch_model: Qwen2ForCausalLM has no LoRA layer .*nothing was patched"):
        report = patch_model(model)
    assert report["lora_layers"] == 0 and "has no LoRA layer" in report["skipped"][0]


def test_swiglu_mlps_run_silu_mul_and_match(monkeypatch):
    from lora_lab.kernels.lora import swiglu

    ref = peft_tiny()
    fused = copy.deepcopy(ref)
    summary = patch_model(fused)
    assert summary["swiglu_mlps"] == 2  # one Qwen2 MLP per layer, its gate/up in a shared-input group
    calls = []
    real = swiglu.SiLUMulFunction.apply
    monkeypatch.setattr(swiglu.SiLUMulFunction, "apply", lambda g, u: calls.append(
        swiglu._adjacent_blocks(g.reshape(-1, g.shape[-1]), u.reshape(-1, u.shape[-1]))) or real(g, u))
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    out_r, out_f = ref(input_ids=ids, labels=ids), fused(input_ids=ids, labels=ids)
    assert calls == [True, True]  # each MLP once, on the two column blocks of its gate/up output
    assert rel_l2(out_f.logits, out_r.logits) < 1e-5
    out_r.loss.backward()
    out_f.loss.backward()
    gr, gf = lora_grads(ref), lora_grads(fused)
    for n in gr:
        assert rel_l2(gf[n], gr[n]) < 1e-4, n
    mlp = fused.base_model.model.model.layers[0].mlp
    assert "forward" in mlp.__dict__
    unpatch_model(fused)
    assert "forward" not in mlp.__dict__ and not hasattr(mlp, "_lora_lab_swiglu")


def test_swiglu_mlps_left_alone_when_asked_or_not_plain():
    model = peft_tiny()
    assert patch_model(model, fuse_mlp_activation=False)["swiglu_mlps"] == 0
    unpatch_model(model)
    model = peft_tiny()
    model.base_model.model.model.layers[0].mlp.act_fn = torch.nn.GELU()  # not SiLU: its own forward
    taken = model.base_model.model.model.layers[1].mlp
    own = taken.forward
    taken.forward = own  # a forward on the instance (Liger's, another patcher's): not ours to replace
    assert patch_model(model)["swiglu_mlps"] == 0
    assert taken.__dict__["forward"] is own
    model = peft_tiny(targets=["q_proj", "v_proj"])  # no patched projection in the MLP
    assert patch_model(model)["swiglu_mlps"] == 0


def test_unpatch_keeps_a_forward_set_after_the_swiglu_patch():
    model = peft_tiny()
    patch_model(model)
    mlp = model.base_model.model.model.layers[0].mlp
    later = type(mlp).forward.__get__(mlp)  # e.g. Liger applied after patch_model
    mlp.forward = later
    unpatch_model(model)
    assert mlp.__dict__["forward"] is later


def test_stacked_route_in_a_patched_model_matches(monkeypatch):
    # base_gemm="stacked" returns Y and dX as column blocks of wider outputs (views, row stride N + r and K + r):
    # the model around the patched projections (residual adds, the MLP) takes them as they come
    from lora_lab.kernels import KernelConfig
    from lora_lab.kernels.lora import stacked

    calls = []

    def counted(name):
        fn = getattr(stacked, name)

        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapper

    for name in ("forward_gemm", "input_grad_gemm"):
        monkeypatch.setattr(stacked, name, counted(name))
    ref = peft_tiny(targets=["o_proj", "down_proj"])
    fused = copy.deepcopy(ref)
    patch_model(fused, config=KernelConfig.from_env(dispatch="triton", base_gemm="stacked"))
    ids = torch.randint(0, 512, (2, 13), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    assert_logits_and_lora_grads_match(ref, fused, ids, 8)
    # 2 projections × 2 layers; the first layer's o_proj reads frozen activations only (no dX to compute)
    assert calls.count("forward_gemm") == 4 and calls.count("input_grad_gemm") == 3

"""VeRA: the formula against plain torch, shared frozen projections, gradients, merge, PEFT's VeRA both ways."""
import json

import pytest
import torch
from torch import nn

import lora_lab
from lora_lab import AdapterError, load_adapter, merge_lora, save_adapter
from lora_lab.vera import VeRALinear, add_vera, vera_layers, vera_projections

TARGETS = ["q_proj", "v_proj", "down_proj"]  # in 64/160, out 64/32: the projections are sized 160 in, 64 out


def _ids():
    return torch.randint(3, 500, (2, 11), generator=torch.Generator().manual_seed(0))


def _fill_lambdas(model, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lambda" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def test_formula_gradients_and_merge():
    torch.manual_seed(0)
    base = nn.Linear(16, 12, dtype=torch.float64)
    a, b = (t.double() for t in vera_projections(4, 20, 15))
    layer = VeRALinear(base, a, b, d_initial=0.1)
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    assert torch.equal(layer(x), base(x))  # lambda_b starts at 0
    assert torch.equal(layer.lambda_d, torch.full((4,), 0.1, dtype=torch.float64))
    with torch.no_grad():
        layer.lambda_b.normal_()
        layer.lambda_d.normal_()
    a_s, b_s = a[:, :16], b[:12, :]
    want = x @ base.weight.T + base.bias + layer.lambda_b * ((layer.lambda_d * (x @ a_s.T)) @ b_s.T)
    torch.testing.assert_close(layer(x), want)
    layer(x).square().sum().backward()
    assert {n for n, p in layer.named_parameters() if p.grad is not None} == {"lambda_b", "lambda_d"}
    assert base.weight.grad is None and not layer.vera_A.requires_grad
    torch.testing.assert_close(layer.merge(torch.float64)(x), layer(x), rtol=1e-12, atol=1e-12)


def test_projections_are_shared_frozen_and_drawn_as_peft_draws_them():
    peft = pytest.importorskip("peft")
    ours = add_vera(lora_lab.load_model("random:tiny-qwen2"), r=8, targets=TARGETS, projection_prng_key=5)
    layers = vera_layers(ours)
    assert len(layers) == 6 and all(m.vera_A is layers[0][1].vera_A for _, m in layers)
    assert layers[0][1].vera_A.shape == (8, 160) and layers[0][1].vera_B.shape == (64, 8)
    trainable = {n.rsplit(".", 1)[-1] for n, p in ours.named_parameters() if p.requires_grad}
    assert trainable == {"lambda_b", "lambda_d"}
    assert not any("vera_A" in k for k in ours.state_dict())  # shared buffers are not part of each module's state
    pm = peft.get_peft_model(lora_lab.load_model("random:tiny-qwen2"),
                             peft.VeraConfig(r=8, target_modules=TARGETS, projection_prng_key=5))
    q = pm.base_model.model.model.layers[0].self_attn.q_proj
    assert torch.equal(q.vera_A["default"], layers[0][1].vera_A)
    assert torch.equal(q.vera_B["default"], layers[0][1].vera_B)


def test_training_moves_only_the_vectors_and_merge_matches():
    model = add_vera(lora_lab.load_model("random:tiny-qwen2"), r=8, targets=TARGETS)
    ids = _ids()
    losses = lora_lab.train_steps(model, {"input_ids": ids, "labels": ids}, steps=3, lr=1e-2)
    assert losses[-1] < losses[0]
    assert torch.count_nonzero(vera_layers(model)[0][1].lambda_b) > 0
    with torch.no_grad():
        before = model(ids).logits
        merge_lora(model)
        after = model(ids).logits
    assert not vera_layers(model)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_peft_to_ours_exact(tmp_path):
    peft = pytest.importorskip("peft")
    for save_projection in (True, False):
        out = tmp_path / str(save_projection)
        pm = peft.get_peft_model(lora_lab.load_model("random:tiny-qwen2"), peft.VeraConfig(
            r=8, target_modules=TARGETS, projection_prng_key=7, save_projection=save_projection))
        _fill_lambdas(pm)
        pm.save_pretrained(str(out))
        ours = load_adapter(lora_lab.load_model("random:tiny-qwen2"), out)
        assert len(vera_layers(ours)) == 6
        with torch.no_grad():
            assert torch.equal(pm(_ids()).logits, ours(_ids()).logits)


def test_ours_to_peft_exact(tmp_path):
    peft = pytest.importorskip("peft")
    ours = add_vera(lora_lab.load_model("random:tiny-qwen2"), r=8, targets=TARGETS, projection_prng_key=2)
    _fill_lambdas(ours)
    save_adapter(ours, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "VERA" and cfg["projection_prng_key"] == 2 and cfg["save_projection"] is True
    theirs = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2"), str(tmp_path))
    with torch.no_grad():
        assert torch.equal(ours(_ids()).logits, theirs(_ids()).logits)
    back = load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)
    with torch.no_grad():
        assert torch.equal(ours(_ids()).logits, back(_ids()).logits)
    save_adapter(back, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "adapter_config.json").read_text()) == cfg
    lora_lab.remove_lora(back)
    assert not vera_layers(back) and not hasattr(back, "_lora_lab_vera")


def test_patch_model_leaves_vera_layers_alone():
    from lora_lab.kernels import patch_model, patched_layers

    model = add_vera(lora_lab.load_model("random:tiny-qwen2"), r=8, targets=TARGETS)
    _fill_lambdas(model)
    with torch.no_grad():
        before = model(_ids()).logits
    summary = patch_model(model)
    assert summary["lora_layers"] == 0 and patched_layers(model) == []
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, before)


@pytest.mark.parametrize("kwargs, error, problem", [
    ({"r": 0}, ValueError, "r=0"), ({"d_initial": float("nan")}, ValueError, "d_initial=nan"),
    ({"projection_prng_key": 1.5}, TypeError, "projection_prng_key=1.5"),
    ({"targets": ["embed_tokens"]}, TypeError, r"model\.embed_tokens is a Embedding.*VeRALinear only wraps"),
    ({"targets": ["q_prj"]}, ValueError, "nearest to q_proj"),
])
def test_bad_input_is_named(kwargs, error, problem):
    model = lora_lab.load_model("random:tiny-qwen2")
    with pytest.raises(error, match=problem):
        add_vera(model, **{"r": 8, **kwargs})
    assert not vera_layers(model) and all(p.requires_grad for p in model.parameters())


def test_vera_and_lora_do_not_mix(tmp_path):
    model = add_vera(lora_lab.load_model("random:tiny-qwen2"), r=8)
    for targets in (("q_proj",), ("k_proj",)):  # refused when added, on the same targets or on others
        with pytest.raises(ValueError, match=r"carries VeRA layers \(model\.layers\.0\.self_attn\.q_proj, \.\.\.\); "
                                             "LoRA and VeRA do not mix"):
            lora_lab.add_lora(model, targets=targets)
    assert not lora_lab.lora_layers(model)
    with pytest.raises(ValueError, match="already has VeRA layers"):
        add_vera(model, r=8, targets=("k_proj",))
    lora = lora_lab.add_lora(lora_lab.load_model("random:tiny-qwen2"), targets=("k_proj",))
    with pytest.raises(ValueError, match=r"carries LoRA layers \(model\.layers\.0\.self_attn\.k_proj, \.\.\.\); "
                                         "LoRA and VeRA do not mix"):
        add_vera(lora, r=8)
    assert not vera_layers(lora)
    save_adapter(add_vera(lora_lab.load_model("random:tiny-qwen2"), r=8), tmp_path)
    with pytest.raises(AdapterError, match="already carries adapter layers"):
        load_adapter(lora_lab.add_lora(lora_lab.load_model("random:tiny-qwen2")), tmp_path)


@pytest.mark.parametrize("field, value", [("bias", "all"), ("modules_to_save", ["lm_head"]),
                                          ("fan_in_fan_out", True), ("layers_to_transform", [0])])
def test_unsupported_vera_fields_are_refused_by_name(tmp_path, field, value):
    save_adapter(add_vera(lora_lab.load_model("random:tiny-qwen2"), r=8), tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    cfg[field] = value
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    fresh = lora_lab.load_model("random:tiny-qwen2")
    with pytest.raises(AdapterError, match=rf"VeRA adapter uses {field}="):
        load_adapter(fresh, tmp_path)
    assert not vera_layers(fresh)


def test_vera_tensor_shapes_are_checked(tmp_path):
    from safetensors.torch import load_file, save_file

    save_adapter(add_vera(lora_lab.load_model("random:tiny-qwen2"), r=8), tmp_path)
    f = tmp_path / "adapter_model.safetensors"
    sd = load_file(str(f))
    sd["base_model.vera_A"] = torch.zeros(8, 10)
    save_file(sd, str(f))
    with pytest.raises(AdapterError, match=r"base_model\.vera_A: adapter has shape \(8, 10\), .* needs \(8, 64\)"):
        load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)


def test_vera_on_a_bf16_model_keeps_fp32_vectors_by_default_and_bf16_on_request(tmp_path):
    """As add_lora: fp32 projections and vectors on a bf16 model (PEFT's autocast), bf16 with adapter_dtype; the
    output keeps the input's dtype; saved from bf16 and reloaded here and by PEFT, the same logits."""
    import peft

    model = lora_lab.add_vera(lora_lab.load_model("random:tiny-qwen2", dtype="bf16"), r=8)
    layer = dict(lora_lab.vera.vera_layers(model))["model.layers.0.self_attn.q_proj"]
    assert layer.lambda_b.dtype == layer.lambda_d.dtype == layer.vera_A.dtype == torch.float32
    with torch.no_grad():
        for _, vl in lora_lab.vera.vera_layers(model):
            vl.lambda_b.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16
    lora_lab.save_adapter(model, tmp_path / "v")
    back = lora_lab.load_adapter(lora_lab.load_model("random:tiny-qwen2", dtype="bf16"), tmp_path / "v")
    theirs = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2", dtype="bf16"), str(tmp_path / "v"))
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, logits)
        assert torch.equal(theirs(input_ids=ids).logits, logits)
    bf16 = lora_lab.add_vera(lora_lab.load_model("random:tiny-qwen2", dtype="bf16"), r=8, adapter_dtype="bf16")
    assert all(vl.lambda_d.dtype == torch.bfloat16 for _, vl in lora_lab.vera.vera_layers(bf16))
    with pytest.raises(ValueError, match="adapter_dtype"):
        lora_lab.add_vera(lora_lab.load_model("random:tiny-qwen2"), r=8, adapter_dtype="int8")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_vera_projections_on_a_half_model_are_rounded_as_peft_rounds_them(tmp_path, dtype):
    """PEFT casts the drawn projections to the base layer's dtype before widening them to fp32: add_vera, and a
    reload with save_projection=False (projections drawn again), give PEFT's projections and PEFT's logits."""
    import peft
    from safetensors.torch import load_file, save_file

    model = add_vera(lora_lab.load_model("random:tiny-qwen2", dtype=dtype), r=8, targets=TARGETS,
                     projection_prng_key=3)
    pm = peft.get_peft_model(lora_lab.load_model("random:tiny-qwen2", dtype=dtype),
                             peft.VeraConfig(r=8, target_modules=TARGETS, projection_prng_key=3))
    q = pm.base_model.model.model.layers[0].self_attn.q_proj
    layer = vera_layers(model)[0][1]
    assert torch.equal(q.vera_A["default"], layer.vera_A) and torch.equal(q.vera_B["default"], layer.vera_B)
    _fill_lambdas(model)
    save_adapter(model, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    cfg["save_projection"] = False
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    sd = {k: v for k, v in load_file(str(tmp_path / "adapter_model.safetensors")).items() if "vera_A" not in k
          and "vera_B" not in k}
    save_file(sd, str(tmp_path / "adapter_model.safetensors"))
    ours = load_adapter(lora_lab.load_model("random:tiny-qwen2", dtype=dtype), tmp_path)
    theirs = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2", dtype=dtype), str(tmp_path))
    with torch.no_grad():
        assert torch.equal(ours(input_ids=_ids()).logits, theirs(input_ids=_ids()).logits)

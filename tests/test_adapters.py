"""PEFT on-disk format, both ways, with exact logits."""
import json

import pytest
import torch

import lora_lab
from lora_lab import AdapterError, add_lora, load_adapter, save_adapter

peft = pytest.importorskip("peft")


def _randomize_b(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _, layer in lora_lab.lora_layers(model):
        with torch.no_grad():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * 0.02)


def _ids():
    return torch.randint(3, 500, (2, 11), generator=torch.Generator().manual_seed(0))


def test_ours_to_peft_exact(tmp_path):
    ours = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=8, alpha=16)
    _randomize_b(ours)
    save_adapter(ours, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16 and sorted(cfg["target_modules"]) == ["q_proj", "v_proj"]
    theirs = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2"), str(tmp_path))
    with torch.no_grad():
        a, b = ours(_ids()).logits, theirs(_ids()).logits
    assert torch.count_nonzero(lora_lab.lora_layers(ours)[0][1].lora_B) > 0
    assert torch.equal(a, b)


def test_peft_to_ours_exact(tmp_path):
    base = lora_lab.load_model("random:tiny-qwen2")
    pm = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "k_proj", "v_proj"]))
    lora_lab.fill_lora_B(pm, 0.02, generator=torch.Generator().manual_seed(2))
    pm.save_pretrained(str(tmp_path))
    ours = load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)
    layers = lora_lab.lora_layers(ours)
    assert len(layers) == 6 and layers[0][1].r == 4 and layers[0][1].scaling == 3.0
    with torch.no_grad():
        assert torch.equal(pm(_ids()).logits, ours(_ids()).logits)


def test_round_trip_into_existing_lora(tmp_path):
    a = add_lora(lora_lab.load_model("random:tiny-qwen2"))
    _randomize_b(a, seed=3)
    save_adapter(a, tmp_path)
    b = add_lora(lora_lab.load_model("random:tiny-qwen2"))
    load_adapter(b, tmp_path)
    for (_, la), (_, lb) in zip(lora_lab.lora_layers(a), lora_lab.lora_layers(b)):
        assert torch.equal(la.lora_A, lb.lora_A) and torch.equal(la.lora_B, lb.lora_B)


def test_shape_mismatch_names_module_and_leaves_model(tmp_path):
    a = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=8, alpha=16)
    save_adapter(a, tmp_path)
    # tamper: give one B the wrong output size
    from safetensors.torch import load_file, save_file

    f = tmp_path / "adapter_model.safetensors"
    sd = load_file(str(f))
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    sd[key] = torch.zeros(99, 8)
    save_file(sd, str(f))
    fresh = lora_lab.load_model("random:tiny-qwen2")
    with pytest.raises(AdapterError, match=r"model\.layers\.1\.self_attn\.v_proj\.lora_B.*\(99, 8\).*\(32, 8\)"):
        load_adapter(fresh, tmp_path)
    assert not lora_lab.lora_layers(fresh)
    assert all(p.requires_grad for p in fresh.parameters())


def test_save_without_lora_and_unsupported_config(tmp_path):
    with pytest.raises(AdapterError, match="no LoRA layer"):
        save_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)
    a = add_lora(lora_lab.load_model("random:tiny-qwen2"))
    save_adapter(a, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="use_dora"):
        load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)


def test_rank_mismatch_with_existing_lora(tmp_path):
    a = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=8, alpha=16)
    save_adapter(a, tmp_path)
    b = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=16)
    with pytest.raises(AdapterError, match="r=4"):
        load_adapter(b, tmp_path)

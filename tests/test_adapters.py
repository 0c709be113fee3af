"""PEFT on-disk format, both ways, with exact logits."""
import contextlib
import json
import re

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


# --- what PEFT can save: loaded exactly, or refused by name ---------------------------------------------------------


def _peft_saved(path, init=True, r=4, alpha=8, targets=("q_proj", "v_proj"), **extra):
    """A PEFT LoRA model on the tiny Qwen2 with B filled, saved to ``path``; returns the PEFT model."""
    with pytest.warns(UserWarning, match="eva") if init == "eva" else contextlib.nullcontext():  # eva without data
        config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=init, **extra)
        pm = peft.get_peft_model(lora_lab.load_model("random:tiny-qwen2"), config)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)) * 0.02)
    pm.save_pretrained(str(path))
    return pm


def _edit_config(path, **fields):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(fields)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora"])
def test_inits_that_rewrite_the_base_on_load_are_refused(tmp_path, init):
    _peft_saved(tmp_path, init=init)
    reloaded = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2"), str(tmp_path))
    base = reloaded.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.equal(base, lora_lab.load_model("random:tiny-qwen2").model.layers[0].self_attn.q_proj.weight)
    fresh = lora_lab.load_model("random:tiny-qwen2")
    with pytest.raises(AdapterError, match=rf"init_lora_weights='{init}'.*path_initial_model_for_weight_conversion"):
        load_adapter(fresh, tmp_path)
    assert not lora_lab.lora_layers(fresh)


@pytest.mark.parametrize("init, why", [
    ("corda", "CorDA residual"), ("lora_ga", "LoRA-GA rewrote"), ("loftq", "LoftQ quantization"),
    ("some_future_init", "does not know"),
])
def test_inits_lora_lab_cannot_reproduce_are_refused(tmp_path, init, why):
    _peft_saved(tmp_path)
    _edit_config(tmp_path, init_lora_weights=init)
    with pytest.raises(AdapterError, match=rf"adapter_config\.json: init_lora_weights='{init}'.*{why}"):
        load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)


@pytest.mark.parametrize("init", [False, "gaussian", "orthogonal", "eva", "mica"])
def test_inits_that_only_set_the_starting_A_B_load_exactly(tmp_path, init):
    _peft_saved(tmp_path, init=init)
    theirs = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2"), str(tmp_path))
    ours = load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)
    with torch.no_grad():
        assert torch.equal(theirs(_ids()).logits, ours(_ids()).logits)
    layer = lora_lab.lora_layers(ours)[0][1]
    assert layer.lora_A.requires_grad and layer.lora_B.requires_grad == (init != "mica")  # MiCA trains A only


@pytest.mark.parametrize("field, value", [
    ("lora_bias", True), ("alora_invocation_tokens", [5, 6]), ("layer_replication", [[0, 2], [1, 2]]),
    ("trainable_token_indices", [3, 4]), ("ensure_weight_tying", True), ("use_qalora", True),
    ("velora_config", {"rank": 4}), ("a_field_of_a_later_peft", 1),
])
def test_fields_that_change_the_model_are_refused_by_name(tmp_path, field, value):
    _peft_saved(tmp_path)
    _edit_config(tmp_path, **{field: value})
    with pytest.raises(AdapterError, match=rf"adapter_config\.json: adapter uses {field}="):
        load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)


@pytest.mark.parametrize("exclude", [["layers.0.self_attn.k_proj", "v_proj"], r".*\.1\.self_attn\.[qk]_proj"])
def test_exclude_modules_both_ways_exact(tmp_path, exclude):
    targets = ["q_proj", "k_proj", "v_proj"]
    pm = _peft_saved(tmp_path / "peft", targets=targets, exclude_modules=exclude)
    ours = load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path / "peft")
    peft_names = sorted(lora_lab.adapters.peft_lora_pairs(pm))
    assert sorted(n for n, _ in lora_lab.lora_layers(ours)) == peft_names and len(peft_names) in (3, 4)
    with torch.no_grad():
        assert torch.equal(pm(_ids()).logits, ours(_ids()).logits)

    mine = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, targets=targets, exclude=exclude)
    _randomize_b(mine, seed=5)
    save_adapter(mine, tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "adapter_config.json").read_text())["exclude_modules"] == exclude
    theirs = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2"), str(tmp_path / "ours"))
    assert sorted(lora_lab.adapters.peft_lora_pairs(theirs)) == peft_names
    with torch.no_grad():
        assert torch.equal(mine(_ids()).logits, theirs(_ids()).logits)


@pytest.mark.parametrize("first, second, written", [
    (("q_proj",), ("v_proj",), ["q_proj", "v_proj"]),
    (r"model\.layers\.0\.self_attn\.q_proj", ("v_proj",), None),  # no short form: the full names
])
def test_two_add_lora_calls_save_what_peft_wraps(tmp_path, first, second, written):
    model = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, targets=first)
    add_lora(model, r=4, alpha=8, targets=second)
    _randomize_b(model, seed=6)
    save_adapter(model, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    names = [n for n, _ in lora_lab.lora_layers(model)]
    assert cfg["target_modules"] == (written or sorted(names))
    theirs = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2"), str(tmp_path))
    assert sorted(lora_lab.adapters.peft_lora_pairs(theirs)) == sorted(names)
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, theirs(_ids()).logits)


# --- broken files and configs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_unreadable_weights_file_is_named(tmp_path, damage):
    save_adapter(add_lora(lora_lab.load_model("random:tiny-qwen2")), tmp_path)
    f = tmp_path / "adapter_model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x00\xff" * 64 + data[:40], "empty": b""}[damage])
    with pytest.raises(AdapterError, match=re.escape(str(f)) + " is not a readable safetensors file"):
        load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)


@pytest.mark.parametrize("text, problem", [
    ('{"r": 8, "lora_alpha": ', "is not valid JSON"), ("[8, 16]", "holds a JSON list"), ("\xff\xfe", "not valid JSON"),
])
def test_broken_config_file_is_named(tmp_path, text, problem):
    save_adapter(add_lora(lora_lab.load_model("random:tiny-qwen2")), tmp_path)
    f = tmp_path / "adapter_config.json"
    f.write_bytes(text.encode("latin-1"))
    with pytest.raises(AdapterError, match=re.escape(str(f)) + ".*" + problem):
        load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)


@pytest.mark.parametrize("field, value", [
    ("r", 0), ("r", -4), ("r", 2.5), ("r", "8"), ("r", True), ("lora_alpha", "sixteen"), ("lora_alpha", None),
    ("lora_dropout", 1.5), ("target_modules", []), ("target_modules", [3]), ("exclude_modules", 7),
    ("target_modules", ".*(q_proj"),
])
def test_invalid_config_values_are_reported_as_such(tmp_path, field, value):
    save_adapter(add_lora(lora_lab.load_model("random:tiny-qwen2")), tmp_path)
    _edit_config(tmp_path, **{field: value})
    f = re.escape(str(tmp_path / "adapter_config.json"))
    fresh = lora_lab.load_model("random:tiny-qwen2")
    with pytest.raises(AdapterError, match=rf"invalid adapter config {f}: {field}={re.escape(repr(value))}"):
        load_adapter(fresh, tmp_path)
    assert not lora_lab.lora_layers(fresh)


def test_missing_adapter_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such adapter directory"):
        load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path / "nowhere")
    save_adapter(add_lora(lora_lab.load_model("random:tiny-qwen2")), tmp_path)
    (tmp_path / "adapter_model.safetensors").unlink()
    with pytest.raises(lora_lab.AdapterNotFoundError, match="neither adapter_model.safetensors"):
        load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)


def test_save_refuses_to_overwrite_an_adapter_unless_asked(tmp_path):
    a = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=8, alpha=16)
    save_adapter(a, tmp_path)
    before = (tmp_path / "adapter_model.safetensors").read_bytes()
    b = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8)
    with pytest.raises(FileExistsError, match=r"already holds an adapter.*overwrite=True"):
        save_adapter(b, tmp_path)
    assert (tmp_path / "adapter_model.safetensors").read_bytes() == before
    save_adapter(b, tmp_path, overwrite=True)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["r"] == 4

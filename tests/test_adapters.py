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
    cfg["layers_to_transform"] = [0]
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match=r"layers_to_transform=\[0\].*does not implement"):
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


@pytest.mark.parametrize("init", ["pissa_niter_4", "olora"])
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


# --- variants: rsLoRA, DoRA, rank and alpha patterns ----------------------------------------------------------------


def _perturb_magnitudes(model, seed=8):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "magnitude" in name:
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))


VARIANTS = [{"use_rslora": True}, {"use_dora": True}, {"use_dora": True, "use_rslora": True}]


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_ours_to_peft_exact(tmp_path, variant):
    ours = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=12, targets=["q_proj", "o_proj", "up_proj"],
                    dropout=0.1, **variant)
    _randomize_b(ours, seed=7)
    _perturb_magnitudes(ours)
    save_adapter(ours, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (cfg["use_rslora"], cfg["use_dora"]) == (variant.get("use_rslora", False), variant.get("use_dora", False))
    theirs = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2"), str(tmp_path))
    ours.eval()
    with torch.no_grad():
        assert torch.equal(ours(_ids()).logits, theirs(_ids()).logits)
    if variant.get("use_dora"):
        layer = lora_lab.lora_layers(ours)[0][1]
        peft_m = theirs.base_model.model.model.layers[0].self_attn.q_proj.lora_magnitude_vector["default"].weight
        assert torch.equal(layer.magnitude, peft_m) and not torch.equal(layer.magnitude, layer.base.weight.norm(dim=1))


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_peft_to_ours_exact(tmp_path, variant):
    pm = _peft_saved(tmp_path, r=4, alpha=12, targets=("k_proj", "v_proj", "down_proj"), **variant)
    ours = load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)
    layer = lora_lab.lora_layers(ours)[0][1]
    assert layer.scaling == (12 / 2 if variant.get("use_rslora") else 3.0)
    assert (layer.magnitude is not None) == variant.get("use_dora", False)
    with torch.no_grad():
        assert torch.equal(pm(_ids()).logits, ours(_ids()).logits)
    if variant.get("use_dora"):
        assert layer.magnitude.requires_grad


def test_rank_and_alpha_patterns_both_ways_exact(tmp_path):
    # PEFT: the first matching key wins, matched at the end of the name after a dot. Both keys of alpha_pattern
    # match layers.0's q_proj: the PEFT model in memory gives it 5 ("q_proj" first), but save_pretrained writes the
    # keys sorted, so PEFT's reload (and lora_lab's, which follows the file) gives it 3.
    rank_pattern = {r"layers\.1\.self_attn\.q_proj": 2, "v_proj": 6}
    alpha_pattern = {"q_proj": 5, r"layers\.0\..*": 3}
    _peft_saved(tmp_path / "peft", r=4, alpha=8, targets=("q_proj", "v_proj"), rank_pattern=rank_pattern,
                alpha_pattern=alpha_pattern)
    reloaded = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2"), str(tmp_path / "peft"))
    ours = load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path / "peft")
    got = {n: (m.r, m.alpha) for n, m in lora_lab.lora_layers(ours)}
    assert got == {"model.layers.0.self_attn.q_proj": (4, 3), "model.layers.0.self_attn.v_proj": (6, 3),
                   "model.layers.1.self_attn.q_proj": (2, 5), "model.layers.1.self_attn.v_proj": (6, 8)}
    assert reloaded.base_model.model.model.layers[0].self_attn.q_proj.lora_alpha["default"] == 3
    with torch.no_grad():
        assert torch.equal(reloaded(_ids()).logits, ours(_ids()).logits)

    mine = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, targets=("q_proj",))
    add_lora(mine, r=2, alpha=6, targets=("v_proj",))
    add_lora(mine, r=4, alpha=7, targets=(r"model\.layers\.1\.mlp\.up_proj"))
    _randomize_b(mine, seed=9)
    save_adapter(mine, tmp_path / "ours")
    cfg = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"]) == (4, 8) and set(cfg["rank_pattern"].values()) == {2}
    theirs = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2"), str(tmp_path / "ours"))
    peft_layers = {n: m for n, m in theirs.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    assert sorted((m.r["default"], m.lora_alpha["default"]) for m in peft_layers.values()) == \
        sorted((m.r, m.alpha) for _, m in lora_lab.lora_layers(mine))
    with torch.no_grad():
        assert torch.equal(mine(_ids()).logits, theirs(_ids()).logits)
    back = load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path / "ours")
    assert {n: (m.r, m.alpha) for n, m in lora_lab.lora_layers(back)} == \
        {n: (m.r, m.alpha) for n, m in lora_lab.lora_layers(mine)}


def test_save_refuses_mixed_variants_by_field(tmp_path):
    model = add_lora(lora_lab.load_model("random:tiny-qwen2"), targets=("q_proj",), use_dora=True)
    add_lora(model, targets=("v_proj",))
    with pytest.raises(AdapterError, match=r"v_proj has use_dora=False but .*q_proj has True; .*one use_dora"):
        save_adapter(model, tmp_path)
    assert not (tmp_path / "adapter_config.json").exists()


def test_dora_tensors_must_fit_the_config(tmp_path):
    from safetensors.torch import load_file, save_file

    dora = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, use_dora=True)
    save_adapter(dora, tmp_path / "dora")
    f = tmp_path / "dora" / "adapter_model.safetensors"
    # a magnitude without use_dora
    _edit_config(tmp_path / "dora", use_dora=False)
    with pytest.raises(AdapterError, match=r"lora_magnitude_vector.*is a DoRA magnitude.*use_dora=false"):
        load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path / "dora")
    _edit_config(tmp_path / "dora", use_dora=True)
    # a magnitude of the wrong size, then none at all
    sd = load_file(str(f))
    key = "base_model.model.model.layers.0.self_attn.v_proj.lora_magnitude_vector"
    sd[key] = torch.ones(5)
    save_file(sd, str(f))
    with pytest.raises(AdapterError, match=r"v_proj\.lora_magnitude_vector: adapter has shape \(5,\).*\(32,\)"):
        load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path / "dora")
    del sd[key]
    save_file(sd, str(f))
    fresh = lora_lab.load_model("random:tiny-qwen2")
    with pytest.raises(AdapterError, match=r"no lora_A/lora_B/lora_magnitude_vector \(use_dora\) for .*v_proj"):
        load_adapter(fresh, tmp_path / "dora")
    assert not lora_lab.lora_layers(fresh)
    # into a model whose layers are not DoRA
    save_adapter(dora, tmp_path / "dora", overwrite=True)
    with pytest.raises(AdapterError, match="has use_dora=False but the adapter has use_dora=True"):
        load_adapter(add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8), tmp_path / "dora")


@pytest.mark.parametrize("field, value", [
    ("use_dora", "yes"), ("use_rslora", 1), ("rank_pattern", [4]), ("rank_pattern", {"q_proj": 0}),
    ("rank_pattern", {"q_proj": 2.5}), ("alpha_pattern", {"q_proj": -1}), ("alpha_pattern", {"(q_proj": 4}),
])
def test_invalid_variant_fields_are_named(tmp_path, field, value):
    save_adapter(add_lora(lora_lab.load_model("random:tiny-qwen2")), tmp_path)
    _edit_config(tmp_path, **{field: value})
    with pytest.raises(AdapterError, match=rf"invalid adapter config .*: {field}={re.escape(repr(value))}"):
        load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)


@pytest.mark.parametrize("field, value", [
    ("fan_in_fan_out", True), ("layers_to_transform", [0]),
    ("target_parameters", ["mlp.experts.gate_up_proj"]),
])
def test_still_unsupported_fields_are_refused_by_name(tmp_path, field, value):
    _peft_saved(tmp_path)
    _edit_config(tmp_path, **{field: value})
    with pytest.raises(AdapterError, match=rf"adapter uses {field}="):
        load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)


@pytest.mark.parametrize("variant", [{}, {"use_dora": True}])
def test_pissa_both_ways_exact(tmp_path, variant):
    # PEFT -> lora_lab: both rebuild the residual from the original base weights, then load the trained A and B
    pm = _peft_saved(tmp_path / "peft", init="pissa", r=4, alpha=8, targets=("q_proj", "down_proj"), **variant)
    ours = load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path / "peft")
    layer = lora_lab.lora_layers(ours)[0][1]
    assert layer.init_lora_weights == "pissa"
    assert torch.equal(layer.base.weight, pm.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight)
    with torch.no_grad():
        assert torch.equal(pm(_ids()).logits, ours(_ids()).logits)

    # lora_lab -> PEFT
    mine = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, targets=("v_proj", "up_proj"),
                    init_lora_weights="pissa", **variant)
    _randomize_b(mine, seed=10)
    save_adapter(mine, tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "adapter_config.json").read_text())["init_lora_weights"] == "pissa"
    theirs = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2"), str(tmp_path / "ours"))
    with torch.no_grad():
        assert torch.equal(mine(_ids()).logits, theirs(_ids()).logits)


def test_pissa_and_plain_layers_do_not_mix(tmp_path):
    model = add_lora(lora_lab.load_model("random:tiny-qwen2"), targets=("q_proj",), init_lora_weights="pissa")
    save_adapter(model, tmp_path / "pissa")
    add_lora(model, targets=("v_proj",))
    with pytest.raises(AdapterError, match=r"has init_lora_weights=True but .*q_proj has 'pissa'"):
        save_adapter(model, tmp_path / "mixed")
    with pytest.raises(AdapterError, match=r"has init_lora_weights=True but the adapter has init_lora_weights='pissa'"):
        load_adapter(add_lora(lora_lab.load_model("random:tiny-qwen2"), targets=("q_proj",)), tmp_path / "pissa")


def test_copy_adapters_to_peft_carries_dora_and_checks_the_scale():
    ours = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, use_dora=True, use_rslora=True)
    _randomize_b(ours, seed=11)
    _perturb_magnitudes(ours)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True, use_rslora=True)
    theirs = peft.get_peft_model(lora_lab.load_model("random:tiny-qwen2"), config)
    assert lora_lab.copy_adapters_to_peft(ours, theirs) == 4
    with torch.no_grad():
        assert torch.equal(ours(_ids()).logits, theirs(_ids()).logits)
    for kwargs, problem in [({"use_dora": True}, "our scale 4.0 vs PEFT's 2.0"),
                            ({"use_rslora": True}, "use_dora=True here but False")]:
        other = peft.get_peft_model(lora_lab.load_model("random:tiny-qwen2"), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **kwargs))
        with pytest.raises(ValueError, match=re.escape(problem)):
            lora_lab.copy_adapters_to_peft(ours, other)


# --- LoRA-FA survives a save and a load; non-finite tensors are refused -------------------------------------------


def test_lora_fa_frozen_A_survives_save_and_load_and_peft_still_loads_it(tmp_path):
    ours = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8, lora_fa=True)
    _randomize_b(ours)
    save_adapter(ours, tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["lora_lab_lora_fa"] is True
    loaded = load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)
    layers = lora_lab.lora_layers(loaded)
    assert layers and all(not layer.lora_A.requires_grad and layer.lora_B.requires_grad for _, layer in layers)
    assert all(layer.lora_fa for _, layer in layers)
    # into a model that already carries (trainable-A) LoRA too
    existing = load_adapter(add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8), tmp_path)
    assert not any(layer.lora_A.requires_grad for _, layer in lora_lab.lora_layers(existing))
    # PEFT drops the key it does not know (with a warning) and builds the same model
    with pytest.warns(UserWarning, match="lora_lab_lora_fa"):
        theirs = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2"), str(tmp_path))
    with torch.no_grad():
        assert torch.equal(ours(_ids()).logits, theirs(_ids()).logits)


def test_lora_fa_on_some_layers_is_saved_by_name(tmp_path):
    model = add_lora(lora_lab.load_model("random:tiny-qwen2"), targets=["q_proj"], lora_fa=True)
    add_lora(model, targets=["v_proj"])
    save_adapter(model, tmp_path)
    frozen = json.loads((tmp_path / "adapter_config.json").read_text())["lora_lab_lora_fa"]
    assert sorted(frozen) == [f"model.layers.{i}.self_attn.q_proj" for i in range(2)]
    loaded = load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)
    assert {n: layer.lora_A.requires_grad for n, layer in lora_lab.lora_layers(loaded)} == {
        n: not n.endswith("q_proj") for n, _ in lora_lab.lora_layers(model)}
    plain = tmp_path / "plain"
    save_adapter(add_lora(lora_lab.load_model("random:tiny-qwen2")), plain)
    assert "lora_lab_lora_fa" not in json.loads((plain / "adapter_config.json").read_text())  # PEFT: no warning


@pytest.mark.parametrize("value", ["yes", 1, [1]])
def test_invalid_lora_fa_key_is_named(tmp_path, value):
    save_adapter(add_lora(lora_lab.load_model("random:tiny-qwen2")), tmp_path)
    _edit_config(tmp_path, lora_lab_lora_fa=value)
    with pytest.raises(AdapterError, match=r"lora_lab_lora_fa=.*expected true, false or a list of module names"):
        load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("legacy", [False, True])
def test_a_non_finite_adapter_tensor_is_refused_by_name(tmp_path, bad, legacy):
    from safetensors.torch import load_file

    save_adapter(add_lora(lora_lab.load_model("random:tiny-qwen2")), tmp_path)
    weights = tmp_path / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors[key][3, 1] = bad
    if legacy:
        weights.unlink()
        torch.save(tensors, tmp_path / "adapter_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(tensors, str(weights))
    model = lora_lab.load_model("random:tiny-qwen2")
    with pytest.raises(AdapterError, match=re.escape(key) + r".* holds non-finite values"):
        load_adapter(model, tmp_path)
    assert not lora_lab.lora_layers(model)


def test_save_refuses_a_non_finite_tensor_by_name_and_writes_nothing(tmp_path):
    model = add_lora(lora_lab.load_model("random:tiny-qwen2"))
    with torch.no_grad():
        dict(lora_lab.lora_layers(model))["model.layers.1.self_attn.v_proj"].lora_B[2, 0] = float("nan")
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    with pytest.raises(AdapterError, match=re.escape(key) + r".* holds non-finite values \(1 NaN, 0 inf"):
        save_adapter(model, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    vera = lora_lab.add_vera(lora_lab.load_model("random:tiny-qwen2"), r=8)
    with torch.no_grad():
        lora_lab.vera.vera_layers(vera)[0][1].lambda_d[0] = float("inf")
    with pytest.raises(AdapterError, match=r"'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.vera_lambda_d' "
                                           r"holds non-finite values \(0 NaN, 1 inf"):
        save_adapter(vera, tmp_path / "v")
    assert not (tmp_path / "v").exists()


def test_load_into_a_model_with_lora_elsewhere_says_where_its_lora_is(tmp_path):
    save_adapter(add_lora(lora_lab.load_model("random:tiny-qwen2"), targets=["q_proj"]), tmp_path)
    model = add_lora(lora_lab.load_model("random:tiny-qwen2"), targets=["k_proj"])
    with pytest.raises(AdapterError, match=r"is for model\.layers\.0\.self_attn\.q_proj, which carries no LoRA "
                                           r"layer in this model; its LoRA layers are at model\.layers\.0\.self_attn"):
        load_adapter(model, tmp_path)


def test_load_adapter_layers_take_the_models_mode(tmp_path):
    """A PEFT adapter with lora_dropout loads into an eval-mode model as PEFT's reload does: dropout off."""
    _peft_saved(tmp_path, lora_dropout=0.5)
    model = lora_lab.load_model("random:tiny-qwen2")
    assert not model.training
    load_adapter(model, tmp_path)
    assert not any(m.training for m in model.modules())
    theirs = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2"), str(tmp_path))
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, theirs(_ids()).logits)
    model = load_adapter(lora_lab.load_model("random:tiny-qwen2").train(), tmp_path)
    assert all(layer.training for _, layer in lora_lab.lora_layers(model))


def test_lora_on_a_multihead_attention_out_proj_is_refused_by_name(tmp_path):
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return self.fc(self.attn(x, x, x)[0])

    with pytest.raises(ValueError, match=r"target attn\.out_proj is the out_proj of an nn\.MultiheadAttention "
                                         r"\(attn\)"):
        add_lora(Block(), targets=["out_proj", "fc"])
    with pytest.raises(ValueError, match=r"attn\.out_proj is the out_proj of an nn\.MultiheadAttention"):
        lora_lab.add_vera(Block(), r=4, targets=["out_proj"])
    model = Block()
    add_lora(model, targets=["fc"])
    save_adapter(model, tmp_path)
    _edit_config(tmp_path, target_modules=["out_proj", "fc"])
    fresh = Block()
    with pytest.raises(AdapterError, match=r"attn\.out_proj is the out_proj of an nn\.MultiheadAttention"):
        load_adapter(fresh, tmp_path)
    assert not lora_lab.lora_layers(fresh)

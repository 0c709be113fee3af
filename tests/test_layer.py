import json
import math

import pytest
import torch
from torch import nn

import lora_lab
from lora_lab import LoRALinear, add_lora, count_parameters, merge_lora


def test_fresh_layer_equals_base_and_init():
    torch.manual_seed(0)
    base = nn.Linear(24, 40)
    layer = LoRALinear(base, r=4, alpha=8)
    x = torch.randn(3, 5, 24)
    assert torch.equal(layer(x), base(x))  # B = 0
    assert torch.count_nonzero(layer.lora_B) == 0
    bound = 1 / math.sqrt(24)  # Kaiming-uniform, a = sqrt(5)
    assert layer.lora_A.abs().max() <= bound
    assert layer.lora_A.std() > bound / 4  # not all zeros
    assert layer.scaling == 2.0
    assert not base.weight.requires_grad and layer.lora_A.requires_grad


def test_forward_formula_and_merge():
    torch.manual_seed(1)
    base = nn.Linear(16, 12, dtype=torch.float64)
    layer = LoRALinear(base, r=3, alpha=6)
    assert layer.lora_A.dtype == torch.float64
    nn.init.normal_(layer.lora_B, std=0.1)
    x = torch.randn(7, 16, dtype=torch.float64)
    want = x @ base.weight.T + base.bias + 2.0 * (x @ layer.lora_A.T) @ layer.lora_B.T
    torch.testing.assert_close(layer(x), want)
    merged = layer.merge()
    assert type(merged) is nn.Linear
    torch.testing.assert_close(merged(x), want)


def test_add_lora_count_on_qwen_shape_without_memory():
    model = lora_lab.load_model("random:qwen2.5-0.5b", device="meta")
    assert count_parameters(model).total == 494_032_768
    add_lora(model)
    c = count_parameters(model)
    assert (c.trainable, c.frozen) == (540_672, 494_032_768)
    # the formula: 24 layers x r (in+out) for q (896->896) and v (896->128)
    assert c.trainable == 24 * 8 * ((896 + 896) + (896 + 128))


def test_add_lora_wraps_targets_and_freezes():
    model = lora_lab.load_model("random:tiny-qwen2")
    add_lora(model, r=4, alpha=8, targets=("q_proj", "v_proj"))
    names = [n for n, _ in lora_lab.lora_layers(model)]
    assert names == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(".lora_A" in n or ".lora_B" in n for n in trainable) and len(trainable) == 8


@pytest.mark.parametrize("r,alpha", [(0, 16), (-1, 16), (2.5, 16), (8, 0), (8, -3)])
def test_bad_rank_or_alpha(r, alpha):
    model = lora_lab.load_model("random:tiny-qwen2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="rank|alpha"):
        add_lora(model, r=r, alpha=alpha)
    assert not lora_lab.lora_layers(model)
    assert all(p.requires_grad for p in model.parameters())  # not half-frozen
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_targets_matching_nothing_names_the_linears():
    model = lora_lab.load_model("random:tiny-qwen2")
    with pytest.raises(ValueError, match=r"match no module.*q_proj"):
        add_lora(model, targets=("query",))
    assert not lora_lab.lora_layers(model)
    assert all(p.requires_grad for p in model.parameters())


def test_wrapping_twice_is_refused_and_leaves_model_intact():
    model = lora_lab.load_model("random:tiny-qwen2")
    add_lora(model, targets=("q_proj",))
    with pytest.raises(ValueError, match=r"already applied to model\.layers\.0\.self_attn\.q_proj"):
        add_lora(model, targets=("q_proj", "k_proj"))
    assert [n.rsplit(".", 1)[-1] for n, _ in lora_lab.lora_layers(model)] == ["q_proj", "q_proj"]
    assert not isinstance(model.model.layers[0].self_attn.k_proj, LoRALinear)


def test_non_linear_target_refused():
    model = lora_lab.load_model("random:tiny-qwen2")
    with pytest.raises(TypeError, match="not an nn.Linear"):
        add_lora(model, targets=("self_attn",))


def test_merge_lora_model_and_no_lora_error():
    torch.manual_seed(0)
    model = lora_lab.load_model("random:tiny-qwen2")
    with pytest.raises(ValueError, match="no LoRA layer"):
        merge_lora(model)
    add_lora(model, r=4, alpha=8)
    for _, layer in lora_lab.lora_layers(model):
        nn.init.normal_(layer.lora_B, std=0.05)
    ids = torch.randint(3, 500, (2, 9))
    with torch.no_grad():
        ref = model(ids).logits
        merge_lora(model)
        got = model(ids).logits
    assert not lora_lab.lora_layers(model)
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    assert (got - ref).abs().max() < 1e-4


def test_layer_rejects_non_linear():
    with pytest.raises(TypeError, match="nn.Linear"):
        LoRALinear(nn.Conv1d(3, 3, 1), r=2, alpha=2)


def test_fill_lora_B_fills_only_B_and_names_a_model_without_adapter():
    from lora_lab.layer import SingleChild

    model = SingleChild(nn.Linear(8, 6), "proj")
    with pytest.raises(ValueError, match="no LoRA B"):
        lora_lab.fill_lora_B(model, 0.1)
    add_lora(model, r=2, alpha=4, targets=("proj",))
    a_before = model.proj.lora_A.detach().clone()
    assert torch.count_nonzero(model.proj.lora_B) == 0
    assert lora_lab.fill_lora_B(model, 0.1, generator=torch.Generator().manual_seed(3)) == 1
    assert torch.equal(model.proj.lora_A, a_before)
    expected = torch.randn(6, 2, generator=torch.Generator().manual_seed(3)) * 0.1
    assert torch.equal(model.proj.lora_B.detach(), expected)
    x = torch.randn(3, 8)
    assert torch.equal(model(x), model.proj(x))  # SingleChild passes straight through


def test_second_add_lora_keeps_the_first_adapter_trainable_and_counted():
    model = lora_lab.load_model("random:tiny-qwen2")
    add_lora(model, r=4, alpha=8, targets=("q_proj",))
    first = count_parameters(model).trainable
    add_lora(model, r=4, alpha=8, targets=("v_proj",))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"model.layers.{i}.self_attn.{p}.lora_{w}" for i in range(2)
                         for p in ("q_proj", "v_proj") for w in "AB"}
    assert count_parameters(model).trainable == first + 2 * 4 * (64 + 32)  # v_proj: 64 -> 32
    assert first == 2 * 4 * (64 + 64)


def test_wrapping_the_base_inside_a_lora_layer_is_refused():
    model = lora_lab.load_model("random:tiny-qwen2")
    add_lora(model, targets=("q_proj",))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.base is part of a LoRA layer"):
        add_lora(model, targets=r".*\.q_proj\.base")
    assert all(type(layer.base) is nn.Linear for _, layer in lora_lab.lora_layers(model))


def test_a_target_that_matches_nothing_is_named_with_the_nearest_module_names():
    model = lora_lab.load_model("random:tiny-qwen2")
    with pytest.raises(ValueError, match=r"\('qproj_typo',\) match no module.*'qproj_typo' is nearest to q_proj"):
        add_lora(model, targets=("q_proj", "qproj_typo"))
    assert not lora_lab.lora_layers(model)
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match=r"'self_attn\.v_prj' is nearest to self_attn\.v_proj"):
        add_lora(model, targets=("self_attn.v_prj",))


def test_an_invalid_regex_target_is_named():
    model = lora_lab.load_model("random:tiny-qwen2")
    with pytest.raises(ValueError, match=r"targets '\.\*\(q_proj' is not a valid regular expression"):
        add_lora(model, targets=".*(q_proj")
    assert not lora_lab.lora_layers(model)


@pytest.mark.parametrize("name, dtype", [("fp32", torch.float32), ("float32", torch.float32), ("bf16", torch.bfloat16),
                                         ("bfloat16", torch.bfloat16), ("fp16", torch.float16),
                                         ("float64", torch.float64)])
def test_merge_lora_takes_the_dtype_names_load_model_takes(name, dtype):
    """merge_lora(compute_dtype="fp32") used to fail with torch's "Invalid device string: 'fp32'"."""
    def merged(compute_dtype):
        torch.manual_seed(0)
        model = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8)
        lora_lab.fill_lora_B(model, 0.05, generator=torch.Generator().manual_seed(1))
        return merge_lora(model, compute_dtype=compute_dtype).model.layers[0].self_attn.q_proj.weight

    assert torch.equal(merged(name), merged(dtype))
    assert lora_lab.load_model("random:tiny-qwen2", dtype=name).dtype == dtype  # the same spellings


@pytest.mark.parametrize("bad", ["cpu", "fp8", "int8", torch.int8, 32])
def test_merge_lora_refuses_a_non_float_compute_dtype_by_name(bad):
    model = add_lora(lora_lab.load_model("random:tiny-qwen2"), r=4, alpha=8)
    with pytest.raises(ValueError, match=r"unsupported compute_dtype .*expected one of torch\.float32.*by name: fp32"):
        merge_lora(model, compute_dtype=bad)
    assert lora_lab.lora_layers(model)  # nothing merged


# --- targets: a plain string, "all-linear"; a PEFT model -----------------------------------------------------------


def test_a_module_name_given_as_a_string_explains_the_regex_rule():
    """PEFT 0.21 reads target_modules="q_proj" as a regex over the whole name (it wraps nothing and raises): so do
    we, with an error that says so and gives the list form, instead of "q_proj matches nothing ... q_proj"."""
    peft = pytest.importorskip("peft")
    with pytest.raises(ValueError, match="not found in the base model"):
        peft.get_peft_model(lora_lab.load_model("random:tiny-qwen2"), peft.LoraConfig(target_modules="q_proj"))
    model = lora_lab.load_model("random:tiny-qwen2")
    with pytest.raises(ValueError, match=r"targets='q_proj' is a string, which .* reads as one regular expression "
                                         r"that must match a whole module name, such as 'model\.layers\.0\.self_attn"
                                         r"\.q_proj'.*pass a list: targets=\['q_proj'\]"):
        add_lora(model, targets="q_proj")
    assert not lora_lab.lora_layers(model)
    add_lora(model, targets=r".*\.q_proj")  # the regex the message suggests works
    assert [n for n, _ in lora_lab.lora_layers(model)] == [f"model.layers.{i}.self_attn.q_proj" for i in range(2)]


def test_all_linear_selects_what_peft_selects():
    peft = pytest.importorskip("peft")
    ours = add_lora(lora_lab.load_model("random:tiny-qwen2"), targets="all-linear")
    theirs = peft.get_peft_model(lora_lab.load_model("random:tiny-qwen2"), peft.LoraConfig(target_modules="all-linear"))
    names = [n for n, _ in lora_lab.lora_layers(ours)]
    assert sorted(names) == sorted(lora_lab.adapters.peft_lora_pairs(theirs))
    assert len(names) == 14 and "lm_head" not in names  # 7 linears x 2 layers; the output head is left alone
    assert [n for n, _ in lora_lab.find_target_linears(lora_lab.load_model("random:tiny-qwen2"), "ALL-LINEAR")] == names
    excluded = add_lora(lora_lab.load_model("random:tiny-qwen2"), targets="all-linear", exclude=["down_proj"])
    assert len(lora_lab.lora_layers(excluded)) == 12


def test_all_linear_adapter_saves_and_loads_both_ways(tmp_path):
    peft = pytest.importorskip("peft")
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    ours = add_lora(lora_lab.load_model("random:tiny-qwen2"), targets="all-linear")
    lora_lab.fill_lora_B(ours, 0.02, generator=torch.Generator().manual_seed(1))
    lora_lab.save_adapter(ours, tmp_path / "ours")
    theirs = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2"), str(tmp_path / "ours"))
    pm = peft.get_peft_model(lora_lab.load_model("random:tiny-qwen2"), peft.LoraConfig(target_modules="all-linear"))
    lora_lab.fill_lora_B(pm, 0.02, generator=torch.Generator().manual_seed(2))
    pm.save_pretrained(str(tmp_path / "peft"))
    # PEFT writes the names it expanded "all-linear" to; an adapter_config.json that says "all-linear" (written by
    # hand, or by another tool) is expanded again on load, by PEFT and by load_adapter alike
    cfg_file = tmp_path / "peft" / "adapter_config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "target_modules": "all-linear"}))
    loaded = lora_lab.load_adapter(lora_lab.load_model("random:tiny-qwen2"), tmp_path / "peft")
    reloaded = peft.PeftModel.from_pretrained(lora_lab.load_model("random:tiny-qwen2"), str(tmp_path / "peft"))
    assert len(lora_lab.lora_layers(loaded)) == 14
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
        assert torch.equal(pm(ids).logits, loaded(ids).logits)
        assert torch.equal(reloaded(ids).logits, loaded(ids).logits)


def test_add_lora_on_a_peft_model_says_what_to_do(tmp_path):
    peft = pytest.importorskip("peft")
    pm = peft.get_peft_model(lora_lab.load_model("random:tiny-qwen2"), peft.LoraConfig(target_modules=["q_proj"]))
    want = (r"PeftModel already carries PEFT adapter layers \(base_model\.model\.model\.layers\.0\.self_attn\.q_proj "
            r"is a peft layer\.Linear and \d+ more\); {}.*merge_and_unload\(\).*unload\(\).*lora_lab\.load_adapter")
    with pytest.raises(ValueError, match=want.format("LoRALinear")):
        add_lora(pm, targets=["q_proj"])
    with pytest.raises(ValueError, match=want.format("VeRALinear")):
        lora_lab.add_vera(pm, targets=["v_proj"])
    save = tmp_path / "a"
    lora_lab.save_adapter(add_lora(lora_lab.load_model("random:tiny-qwen2")), save)
    with pytest.raises(lora_lab.AdapterError, match=want.format("load_adapter")):
        lora_lab.load_adapter(pm, save)
    assert not lora_lab.lora_layers(pm)
    add_lora(pm.merge_and_unload(), targets=["q_proj"])  # the way out the message gives


# --- the library's top level ----------------------------------------------------------------------------------------

LAB_HARNESS = ("start_run", "record", "finish_run", "output_dir", "resolve_profile", "environment_report",
               "show_verdicts")


def test_the_top_level_holds_the_library_not_the_lab_harness():
    """The notebook harness lives in lora_lab.lab (``from lora_lab import lab``); ``import lora_lab`` neither
    exports it nor imports the lab at all."""
    import subprocess
    import sys

    from lora_lab import lab

    assert not [n for n in LAB_HARNESS if n in lora_lab.__all__ or hasattr(lora_lab, n)]
    assert all(callable(getattr(lab, n)) for n in LAB_HARNESS) and set(LAB_HARNESS) <= set(lab.__all__)
    script = "import sys, lora_lab; print(sorted(m for m in sys.modules if m.startswith('lora_lab.lab')))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "[]"

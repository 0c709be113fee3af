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


# ---------------------------------------------------------------------------------------------------------------
# Adapter dtype: fp32 factors (and DoRA magnitude) on a bf16/fp16 base by default, as PEFT's autocast_adapter_dtype
# ---------------------------------------------------------------------------------------------------------------
def _bf16_holder(dtype=torch.bfloat16):
    torch.manual_seed(3)
    holder = nn.Sequential()
    holder.add_module("proj", nn.Linear(32, 24, dtype=dtype))
    return holder


@pytest.mark.parametrize("base_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", [{}, {"use_dora": True}, {"use_rslora": True}, {"init_lora_weights": "pissa"}])
def test_adapters_on_a_half_precision_base_default_to_fp32(base_dtype, variant):
    holder = add_lora(_bf16_holder(base_dtype), r=4, alpha=8, targets=("proj",), **variant)
    layer = holder.proj
    assert layer.base.weight.dtype == base_dtype
    assert layer.lora_A.dtype == layer.lora_B.dtype == torch.float32
    if "use_dora" in variant:
        assert layer.magnitude.dtype == torch.float32
    x = torch.randn(5, 32).to(base_dtype)
    y = layer(x)
    assert y.dtype == base_dtype  # the layer's output keeps the input's dtype
    y.float().sum().backward()
    assert layer.lora_A.grad.dtype == torch.float32 and layer.lora_B.grad.dtype == torch.float32
    assert "adapter_dtype=torch.float32" in repr(layer)


def test_fp32_and_fp64_bases_keep_their_dtype_for_adapters():
    for dtype in (torch.float32, torch.float64):
        layer = add_lora(_bf16_holder(dtype), r=4, alpha=8, targets=("proj",), use_dora=True).proj
        assert layer.lora_A.dtype == layer.lora_B.dtype == layer.magnitude.dtype == dtype
        assert "adapter_dtype" not in repr(layer)


@pytest.mark.parametrize("name", ["bf16", torch.bfloat16])
def test_bf16_adapters_stay_an_option(name):
    layer = add_lora(_bf16_holder(), r=4, alpha=8, targets=("proj",), use_dora=True, adapter_dtype=name).proj
    assert layer.lora_A.dtype == layer.lora_B.dtype == layer.magnitude.dtype == torch.bfloat16
    x = torch.randn(5, 32).to(torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16


def test_fp32_adapter_forward_is_the_fp32_branch_rounded_once():
    """With fp32 factors on a bf16 base: h = round_bf16(W16 x16 + b16 + s (x Aᵀ) Bᵀ in fp32), PEFT's order."""
    layer = add_lora(_bf16_holder(), r=4, alpha=8, targets=("proj",)).proj
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    x = torch.randn(6, 32).to(torch.bfloat16)
    base = layer.base(x)
    branch = (x.float() @ layer.lora_A.T) @ layer.lora_B.T
    assert torch.equal(layer(x), (base + branch * layer.scaling).to(torch.bfloat16))


def test_fp32_adapter_on_fp32_model_is_unchanged_by_the_option():
    """On an fp32 model the default and adapter_dtype='fp32' are the same layer, bit for bit."""
    torch.manual_seed(5)
    one = add_lora(_bf16_holder(torch.float32), r=4, alpha=8, targets=("proj",), use_dora=True)
    torch.manual_seed(5)
    two = add_lora(_bf16_holder(torch.float32), r=4, alpha=8, targets=("proj",), use_dora=True, adapter_dtype="fp32")
    x = torch.randn(3, 32)
    assert torch.equal(one(x), two(x))


def test_small_updates_survive_in_fp32_adapters_and_round_away_in_bf16():
    """A DoRA magnitude near 1 takes an update of 1e-4 in fp32 and loses it in bf16 (half an ulp there is ~4e-3)."""
    for dtype, moved in ((None, True), ("bf16", False)):
        layer = add_lora(_bf16_holder(), r=4, alpha=8, targets=("proj",), use_dora=True, adapter_dtype=dtype).proj
        with torch.no_grad():
            layer.magnitude.fill_(1.0)
            before = layer.magnitude.clone()
            layer.magnitude.add_(1e-4)
        assert bool((layer.magnitude != before).all()) is moved


def test_merge_of_fp32_adapters_on_a_bf16_base_rounds_once_to_bf16():
    layer = add_lora(_bf16_holder(), r=4, alpha=8, targets=("proj",), use_dora=True).proj
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    merged = layer.merge()
    assert merged.weight.dtype == torch.bfloat16
    assert torch.equal(merged.weight, layer.merged_weight(torch.float32).to(torch.bfloat16))


@pytest.mark.parametrize("bad", ["int8", torch.int32, "cuda", 3])
def test_a_bad_adapter_dtype_is_named_and_leaves_the_model(bad):
    holder = _bf16_holder()
    with pytest.raises(ValueError, match="adapter_dtype"):
        add_lora(holder, r=4, alpha=8, targets=("proj",), adapter_dtype=bad)
    assert isinstance(holder.proj, nn.Linear) and not isinstance(holder.proj, LoRALinear)


def test_an_adapter_saved_from_a_bf16_model_loads_as_fp32_and_as_peft_does(tmp_path):
    """save/load on a bf16 model: the file holds the fp32 factors; load_adapter makes fp32 adapters (as PEFT's
    from_pretrained does by default) with the same values, and PEFT's reload gives the same logits."""
    import peft

    spec = "random:tiny-qwen2"
    ours = add_lora(lora_lab.load_model(spec, dtype="bf16"), r=4, alpha=8, targets=("q_proj", "v_proj"))
    lora_lab.fill_lora_B(ours, std=0.02, generator=torch.Generator().manual_seed(0))
    lora_lab.save_adapter(ours, tmp_path / "a")
    back = lora_lab.load_adapter(lora_lab.load_model(spec, dtype="bf16"), tmp_path / "a")
    theirs = peft.PeftModel.from_pretrained(lora_lab.load_model(spec, dtype="bf16"), str(tmp_path / "a"))
    for (n1, p1), (n2, p2) in zip(
        sorted((n, p) for n, p in ours.named_parameters() if p.requires_grad),
        sorted((n, p) for n, p in back.named_parameters() if p.requires_grad),
    ):
        assert n1 == n2 and p2.dtype == torch.float32 and torch.equal(p1, p2)
    peft_a = [p for n, p in theirs.named_parameters() if "lora_A" in n]
    assert peft_a and all(p.dtype == torch.float32 for p in peft_a)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, back(input_ids=ids).logits)
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)


@pytest.mark.parametrize("add", ["lora", "dora", "vera"])
def test_new_layers_take_the_mode_of_the_module_they_replace(add):
    """load_model returns an eval-mode model: the new layers' dropout must be off, so two forwards agree."""
    def build():
        model = lora_lab.load_model("random:tiny-qwen2")
        if add == "vera":
            return lora_lab.add_vera(model, r=8, dropout=0.5)
        return add_lora(model, r=4, dropout=0.5, use_dora=add == "dora")

    model = build()
    assert not model.training and not any(m.training for m in model.modules())
    with torch.no_grad():  # a branch that changes the output, so that dropout would show
        for name, p in model.named_parameters():
            if "lora_B" in name or "lambda_b" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model(ids).logits)
    trained = add_lora(lora_lab.load_model("random:tiny-qwen2").train(), r=4, dropout=0.5)
    assert all(layer.training for _, layer in lora_lab.adapter_layers(trained))

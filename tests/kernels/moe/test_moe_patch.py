"""patch_moe_experts on real transformers models, with and without PEFT expert LoRA (CPU interpreter, fp32)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lora_lab.kernels.moe.patch import is_moe_patched, patch_moe_experts, unpatch_moe_experts
from lora_lab.kernels.triton_helpers import running_in_interpreter as triton_interpreting
from lora_lab.layer import fill_lora_B

interpreter = pytest.mark.skipif(not triton_interpreting(), reason="CPU tests run the kernels in TRITON_INTERPRET=1")

TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8)
EXPERT_TARGETS = ["experts.gate_up_proj", "experts.down_proj"]


def tiny_qwen3_moe(seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**TINY, intermediate_size=64, moe_intermediate_size=24, num_experts=6,
                            num_experts_per_tok=2, experts_implementation="eager")
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config)


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def ids(seed=1, shape=(2, 7)):
    return torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(seed))


def patch_and_compare(model, x):
    """Patch ``model``'s two MoE layers and check loss and every gradient against its unpatched self;
    returns the patched run's gradients."""
    loss_ref, grads_ref = loss_and_grads(model, x)
    assert patch_moe_experts(model) == 2
    loss, grads = loss_and_grads(model, x)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)
    return grads


@interpreter
def test_full_finetuning_model_matches_eager():
    model = tiny_qwen3_moe()
    patch_and_compare(model, ids())
    assert all(is_moe_patched(layer.mlp.experts) for layer in model.model.layers)
    assert unpatch_moe_experts(model) == 2
    assert "forward" not in model.model.layers[0].mlp.experts.__dict__


@interpreter
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_5_moe", "olmoe"])
def test_other_families_forward_matches_eager(family):
    import transformers as tf

    if family == "mixtral":
        config = tf.MixtralConfig(**TINY, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
        cls = tf.MixtralForCausalLM
    elif family == "qwen2_moe":
        config = tf.Qwen2MoeConfig(**TINY, intermediate_size=48, moe_intermediate_size=24,
                                   shared_expert_intermediate_size=24, num_experts=5, num_experts_per_tok=2)
        cls = tf.Qwen2MoeForCausalLM
    elif family == "olmoe":
        config = tf.OlmoeConfig(**{k: v for k, v in TINY.items() if k != "head_dim"}, intermediate_size=24,
                                num_experts=4, num_experts_per_tok=2)
        cls = tf.OlmoeForCausalLM
    else:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

        config = tf.Qwen3_5MoeTextConfig(
            **TINY, moe_intermediate_size=24, shared_expert_intermediate_size=24, num_experts=6,
            num_experts_per_tok=2, layer_types=["full_attention", "full_attention"],
        )
        cls = Qwen3_5MoeForCausalLM
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).eval()
    x = ids()
    with torch.no_grad():
        ref = model(input_ids=x).logits
        assert patch_moe_experts(model) == 2
        got = model(input_ids=x).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@interpreter
def test_peft_expert_lora_matches_peft_and_saves_like_peft(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    base = tiny_qwen3_moe()
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=[],
                                                           target_parameters=EXPERT_TARGETS))
    fill_lora_B(model, 0.1)
    x = ids()
    grads = patch_and_compare(model, x)  # LoRA factors only: the frozen experts get no gradient
    assert not any("gate_up_proj" in n or "down_proj" in n for n in grads if "lora" not in n)

    # one optimizer step through the fused path updates PEFT's own parameters; PEFT saves / loads them
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5).step()
    with torch.no_grad():
        after = model(input_ids=x).logits
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    keys = set(load_file(tmp_path / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight" in keys
    assert "base_model.model.model.layers.0.mlp.experts.lora_B.weight" in keys
    reloaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    with torch.no_grad():
        peft_logits = reloaded(input_ids=x).logits  # PEFT's own forward
        assert patch_moe_experts(reloaded) == 2
        fused_logits = reloaded(input_ids=x).logits
    torch.testing.assert_close(peft_logits, after, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fused_logits, after, rtol=1e-4, atol=1e-5)

    # disabled adapters: PEFT's forward (base model) is used
    with torch.no_grad(), reloaded.disable_adapter():
        torch.testing.assert_close(reloaded(input_ids=x).logits, base(input_ids=x).logits, rtol=1e-4, atol=1e-5)


@interpreter
def test_peft_lora_on_one_expert_parameter_only():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_qwen3_moe(), LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj"],
                                                        target_parameters=["experts.down_proj"]))
    fill_lora_B(model, 0.1)
    patch_and_compare(model, ids())


def test_dense_model_patches_nothing():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(**TINY, intermediate_size=48))
    assert patch_moe_experts(model) == 0
    assert unpatch_moe_experts(model) == 0


def test_unsupported_experts_are_refused_before_any_change():
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(**TINY, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    model = GptOssForCausalLM(config)
    with pytest.raises(NotImplementedError, match="GptOssExperts"):
        patch_moe_experts(model)
    assert not any(is_moe_patched(m) for m in model.modules())


def test_non_silu_activation_is_refused():
    model = tiny_qwen3_moe()
    model.model.layers[1].mlp.experts.act_fn = nn.GELU()
    with pytest.raises(NotImplementedError, match=r"layers\.1\.mlp\.experts.*not SiLU"):
        patch_moe_experts(model)
    assert not any(is_moe_patched(m) for m in model.modules())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_patched_peft_model_bf16_gpu_close_to_fp32_eager():
    """bf16 fused (PEFT expert LoRA) vs fp32 eager PEFT: logits and LoRA gradients, cosine >= 0.999."""
    from peft import LoraConfig, get_peft_model

    def build(dtype):
        model = get_peft_model(tiny_qwen3_moe(), LoraConfig(r=4, lora_alpha=8, target_modules=[],
                                                            target_parameters=EXPERT_TARGETS))
        torch.manual_seed(5)
        fill_lora_B(model, 0.1)
        return model.to("cuda", dtype)

    x = ids(shape=(4, 64)).cuda()
    ref = build(torch.float32)
    fused = build(torch.bfloat16)
    # bf16-round the fp32 model's weights the same way: compare arithmetic, not weight rounding
    with torch.no_grad():
        for (_, p), (_, q) in zip(ref.named_parameters(), fused.named_parameters()):
            p.copy_(q.float())
    ref_logits = ref(input_ids=x).logits
    ref_logits.float().square().mean().backward()
    assert patch_moe_experts(fused) == 2
    logits = fused(input_ids=x).logits
    logits.float().square().mean().backward()
    cos = torch.nn.functional.cosine_similarity
    assert cos(logits.float().flatten(), ref_logits.float().flatten(), dim=0) >= 0.999
    for (n, p), (_, q) in zip(fused.named_parameters(), ref.named_parameters()):
        if p.grad is not None and "lora" in n:
            assert cos(p.grad.float().flatten(), q.grad.float().flatten(), dim=0) >= 0.99, n


@interpreter
def test_deep_copy_of_a_patched_moe_model_is_independent():
    # a deep copy's patched forward must run on the copy's experts and send gradients there
    model = tiny_qwen3_moe()
    patch_moe_experts(model)
    x = ids()
    with torch.no_grad():
        want = model(input_ids=x).logits
    twin = copy.deepcopy(model)
    assert all(is_moe_patched(layer.mlp.experts) for layer in twin.model.layers)
    with torch.no_grad():
        assert torch.equal(twin(input_ids=x).logits, want)
        for layer in twin.model.layers:
            layer.mlp.experts.down_proj.zero_()
        assert not torch.allclose(twin(input_ids=x).logits, want)
        assert torch.equal(model(input_ids=x).logits, want)
    model.zero_grad(set_to_none=True)
    twin(input_ids=x, labels=x).loss.backward()
    assert twin.model.layers[0].mlp.experts.gate_up_proj.grad is not None
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad is None

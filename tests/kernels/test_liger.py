"""lora_lab + Liger-Kernel: module detection, the loss choice and its report, refusals, and losses that track PEFT's.

On CPU, Liger's RMSNorm and SiLU·mul kernels do not run in Triton's interpreter (they pass Python floats where the
interpreter wants tensors), so the CPU loss test applies Liger's RoPE, SwiGLU MLP forward and fused linear CE with
Liger's SiLU·mul kernel swapped for torch's — the routing of the MLP's LoRA children through lora_lab's kernels is
what it checks. The GPU test runs all of Liger in bf16.
"""
import importlib.util

import pytest
import torch
from torch import nn

from lora_lab.experiments.whole_step import train_losses
from lora_lab.kernels import liger as lg
from lora_lab.kernels import patch_model, patched_layers, unpatch_model
from lora_lab.kernels.patching import UnsupportedLoRAError

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
needs_liger = pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed (pip install lora_lab[liger])")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LAYERS = 2


def tiny_llama(dtype=torch.float32, device="cpu", seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).train()


def peft(model, targets=TARGETS):
    from peft import LoraConfig, get_peft_model

    from lora_lab.layer import fill_lora_B

    torch.manual_seed(1)
    wrapped = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    fill_lora_B(wrapped, 0.02)
    return wrapped


# ---------------------------------------------------------------------------------------------------------------
# Detection by class / forward module / _get_name — no liger_kernel needed.
# ---------------------------------------------------------------------------------------------------------------
def _fake_liger_forward(self, x):
    return x


_fake_liger_forward.__module__ = "liger_kernel.transformers.swiglu"
_fake_liger_forward.__qualname__ = "LigerSwiGLUMLP.forward"


class LigerRMSNorm(nn.Module):  # a stand-in with Liger's class name and module
    def forward(self, x):
        return x


LigerRMSNorm.__module__ = "liger_kernel.transformers.rms_norm"


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.down_proj(self.gate_proj(x) * self.up_proj(x))


def test_detects_liger_modules_by_class_and_by_forward():
    model = nn.Sequential(LigerRMSNorm(), MLP(), MLP())
    model[1].forward = _fake_liger_forward.__get__(model[1])  # as Liger binds it on an existing instance
    found = lg.detect_liger(model)
    assert found.rms_norm == ["0"] and found.swiglu == ["1"] and not found.experts
    assert found.found and found.loss is None
    assert not lg.detect_liger(nn.Sequential(MLP())).found


def test_choose_loss_uses_the_table_then_liger():
    head = next(iter(lg.LOSS_TABLE))
    choice, why = lg.choose_loss(head)
    assert choice == lg.LOSS_TABLE[head][0] and "LOSS_TABLE" in why
    assert lg.choose_loss((17, 1001))[0] == "liger"
    assert lg.choose_loss(None)[0] == "liger"


def test_fused_loss_liger_without_liger_is_refused():
    model = peft(tiny_llama())
    with pytest.raises(UnsupportedLoRAError, match="Liger's fused linear cross-entropy is not applied"):
        patch_model(model, fused_loss="liger")
    assert patched_layers(model) == []  # nothing patched
    with pytest.raises(TypeError, match="fused_loss must be True or False"):
        patch_model(model, fused_loss="cce")


def test_without_liger_the_summary_says_so():
    model = peft(tiny_llama())
    summary = patch_model(model, fused_loss=True)
    assert summary["liger"] is None and summary["loss"] == "lora_lab" and summary["fused_loss"] is True
    unpatch_model(model)


# ---------------------------------------------------------------------------------------------------------------
# With Liger-Kernel installed.
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def torch_silu_mul(monkeypatch):
    """Liger's SiLU·mul kernel, which the interpreter cannot run, replaced by torch's (CPU only)."""
    from liger_kernel.transformers import swiglu

    monkeypatch.setattr(swiglu, "_swiglu_dispatch", lambda a, b, *rest: nn.functional.silu(a) * b)


def _apply(model, **kwargs):
    kwargs = {"rms_norm": False, **kwargs}  # Liger's RMSNorm kernel does not run in the interpreter
    return lg.apply_liger(model, keep_globals=False, **kwargs)


@needs_liger
def test_apply_liger_restores_module_globals_outside_active():
    import transformers.models.llama.modeling_llama as ml

    rope, mlp_cls = ml.apply_rotary_pos_emb, ml.LlamaMLP
    patch = _apply(tiny_llama())
    assert ml.apply_rotary_pos_emb is rope and ml.LlamaMLP is mlp_cls
    with patch.active():
        assert ml.apply_rotary_pos_emb.__module__.startswith("liger_kernel")
    assert ml.apply_rotary_pos_emb is rope


@needs_liger
@pytest.mark.parametrize("order", ["liger_then_peft", "peft_then_liger", "after_patch_model"])
def test_every_lora_projection_is_fused_under_liger(order):
    base = tiny_llama()
    if order == "liger_then_peft":
        patch = _apply(base)
        model = peft(base)
    else:
        model = peft(base)
        if order == "peft_then_liger":
            patch = _apply(model)
    summary = patch_model(model, fused_loss=True)
    assert summary["lora_layers"] == len(TARGETS) * LAYERS
    assert summary["shared_input_groups"] == 2 * LAYERS  # q/k/v and gate/up still grouped
    if order == "after_patch_model":
        assert summary["loss"] == "lora_lab" and summary["liger"] is None
        patch = _apply(model)
        # Liger's loss now runs in front of lora_lab's (Liger came last): the report says so and asks to re-decide
        report = lg.composition_report(model)
        assert report.loss == "liger" and not report.problems
        with patch.active():
            summary = patch_model(model, fused_loss=True)  # idempotent: re-decides the loss, patches nothing new
        assert summary["lora_layers"] == 0
    else:
        with patch.active():  # RoPE is module-level: Liger's inside the block
            summary = patch_model(model, fused_loss=True)
    report = summary["liger"]
    assert report["swiglu_mlps"] == LAYERS
    assert report["swiglu_lora_fused"] == 3 * LAYERS and report["swiglu_lora_unfused"] == []
    assert report["detected"]["rope"] == ["transformers.models.llama.modeling_llama"]
    assert report["detected"]["loss"] == "liger"
    assert summary["loss"] == "liger" and "not in LOSS_TABLE" in report["loss_reason"]
    assert len(patched_layers(model)) == len(TARGETS) * LAYERS
    assert lg.check_composition(model).problems == []
    assert patch.model_type == "llama"
    unpatch_model(model)


@needs_liger
def test_loss_choice_can_be_forced_and_is_reported():
    model = peft(tiny_llama())
    _apply(model)
    lm = model.get_base_model()
    summary = patch_model(model, fused_loss="lora_lab")
    assert summary["loss"] == "lora_lab" and summary["fused_loss"] is True
    assert "forced" in summary["liger"]["loss_reason"]
    assert lg._forward_function(lm).__module__ == lg.LORA_LAB_LOSS_MODULE
    assert lg.detect_liger(model).loss_shadowed
    summary = patch_model(model, fused_loss=True)  # back to the rule: Liger's at an unknown head
    assert summary["loss"] == "liger" and summary["fused_loss"] is False
    assert lg._forward_function(lm).__module__.startswith("liger_kernel")
    summary = patch_model(model, fused_loss="liger")
    assert summary["loss"] == "liger" and "forced" in summary["liger"]["loss_reason"]
    unpatch_model(model)


@needs_liger
def test_table_entry_picks_lora_lab(monkeypatch):
    model = peft(tiny_llama())
    _apply(model)
    monkeypatch.setitem(lg.LOSS_TABLE, (32, 128), ("lora_lab", "test entry"))
    summary = patch_model(model, fused_loss=True)
    assert summary["loss"] == "lora_lab" and "test entry" in summary["liger"]["loss_reason"]
    unpatch_model(model)


@needs_liger
def test_liger_on_the_peft_wrapper_is_refused():
    from liger_kernel.transformers.model.llama import lce_forward

    model = peft(tiny_llama())
    model.forward = lce_forward.__get__(model)  # apply_liger_kernel_to_llama(model=peft_model) does this
    with pytest.raises(UnsupportedLoRAError, match="PEFT wrapper"):
        patch_model(model)
    assert patched_layers(model) == []


@needs_liger
def test_liger_loss_with_lora_on_lm_head_is_refused():
    base = tiny_llama()
    _apply(base)
    model = peft(base, targets=[*TARGETS, "lm_head"])
    with pytest.raises(UnsupportedLoRAError, match="lm_head"):
        patch_model(model, strict=False)


@needs_liger
def test_losses_track_peft_under_liger_and_patch_model(torch_silu_mul):
    """fp32, interpreter: PEFT vs PEFT + Liger (RoPE, SwiGLU forward, fused linear CE) + patch_model, 3 AdamW
    steps from the same weights."""
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))

    def losses(model, patch=None):
        return train_losses(model, patch, ids, steps=3, lr=1e-2)

    reference = losses(peft(tiny_llama()))
    model = peft(tiny_llama())
    patch = _apply(model)
    summary = patch_model(model, fused_loss=True)
    assert summary["loss"] == "liger" and summary["liger"]["swiglu_lora_fused"] == 3 * LAYERS
    got = losses(model, patch)
    assert got == pytest.approx(reference, rel=1e-4, abs=1e-5)
    assert got[-1] < got[0]  # it trains


@pytest.mark.gpu
@needs_liger
@pytest.mark.parametrize("fused_loss", [True, "lora_lab"])
def test_gpu_bf16_losses_track_peft_with_all_of_liger(fused_loss):
    from liger_kernel.transformers import apply_liger_kernel_to_llama  # noqa: F401 - installed check

    ids = torch.randint(0, 128, (2, 256), generator=torch.Generator().manual_seed(3)).cuda()

    def losses(model, patch=None):
        return train_losses(model, patch, ids, steps=5, lr=1e-3)

    reference = losses(peft(tiny_llama(torch.bfloat16, "cuda")))
    model = peft(tiny_llama(torch.bfloat16, "cuda"))
    patch = lg.apply_liger(model, keep_globals=False)  # RMSNorm, RoPE, SwiGLU, fused linear CE
    summary = patch_model(model, fused_loss=fused_loss)
    assert summary["liger"]["swiglu_lora_fused"] == 3 * LAYERS
    assert summary["loss"] == ("lora_lab" if fused_loss == "lora_lab" else "liger")
    got = losses(model, patch)
    assert got == pytest.approx(reference, rel=2e-2)

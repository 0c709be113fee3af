"""The fused loss inside models whose forward transforms the logits between the head and the loss.

Every causal LM of the installed transformers whose forward scales or soft-caps its logits is built tiny, random,
fp32, with LoRA on every linear: the loss and the LoRA gradients of ``patch_model(..., fused_loss=True)`` match
the unpatched model's on both loss paths (forced through ``LORA_LAB_LOSS_IMPL``). Forwards that do something
else are refused by name (a ``skipped`` entry, the model's own loss kept). The transforms' values are set where
they change the loss a lot (scales far from 1, soft-caps below the logits' range). A forward that adds an MoE
router's auxiliary loss after the causal-LM loss is refused while that loss is on. CPU: Triton's interpreter.
"""
import ast
import glob
import importlib
import os

import pytest
import torch

import lora_lab
from lora_lab.kernels import KernelConfig, patch_model, unpatch_model
from lora_lab.kernels.loss import patch_causal_lm_loss
from lora_lab.kernels.loss.patch import causal_lm_of
from lora_lab.logit_transforms import (
    UnsupportedLogitTransform,
    analyze_forward,
    logit_transform,
)
from lora_lab.numerics import rel_l2

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 96
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
CAP = {"final_logit_softcapping": 2.0}
GRANITE = {"logits_scaling": 8.0}
_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]}
_MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16)
# module.class -> (config settings, the transform expected from the forward's code)
TRANSFORMING = {
    "cohere.CohereForCausalLM": ({}, "logits * self.logit_scale"),
    "cohere2.Cohere2ForCausalLM": ({}, "logits * self.logit_scale"),
    "cohere2_moe.Cohere2MoeForCausalLM": ({}, "logits * self.logit_scale"),
    "cohere_compass.CohereCompassForCausalLM": (
        dict(logit_scale=0.0625, layer_types=["sliding_attention", "full_attention"],
             rope_parameters={"full_attention": _ROPE, "sliding_attention": _ROPE}), "logits * self.logit_scale"),
    "falcon_h1.FalconH1ForCausalLM": (dict(lm_head_multiplier=4.0, mamba_d_ssm=64, **_MAMBA),
                                      "logits * self.model.lm_head_multiplier"),
    "gemma2.Gemma2ForCausalLM": (CAP, "softcap self.config.final_logit_softcapping"),
    "gemma3.Gemma3ForCausalLM": (CAP, "softcap self.config.final_logit_softcapping"),
    "gemma3n.Gemma3nForCausalLM": (
        dict(CAP, layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=VOCAB,
             hidden_size_per_layer_input=8, num_kv_shared_layers=0, laurel_rank=4, altup_num_inputs=2,
             activation_sparsity_pattern=[0.0, 0.0]), "softcap self.config.final_logit_softcapping"),
    "gemma4.Gemma4ForCausalLM": (dict(CAP, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8),
                                 "softcap self.config.final_logit_softcapping"),
    "gemma4_unified.Gemma4UnifiedForCausalLM": (CAP, "softcap self.config.final_logit_softcapping"),
    "granite.GraniteForCausalLM": (GRANITE, "logits / self.config.logits_scaling"),
    "granite_swa.GraniteSWAForCausalLM": (GRANITE, "logits / self.config.logits_scaling"),
    "granitemoe.GraniteMoeForCausalLM": (GRANITE, "logits / self.config.logits_scaling"),
    "granitemoe_swa.GraniteMoeSWAForCausalLM": (GRANITE, "logits / self.config.logits_scaling"),
    "granitemoehybrid.GraniteMoeHybridForCausalLM": (dict(GRANITE, layer_types=["mamba", "attention"], **_MAMBA),
                                                     "logits / self.config.logits_scaling"),
    "granitemoeshared.GraniteMoeSharedForCausalLM": (GRANITE, "logits / self.config.logits_scaling"),
    "hyperclovax.HyperCLOVAXForCausalLM": ({"logits_scaling": 0.25}, "logits * self.config.logits_scaling"),
    "minicpm3.MiniCPM3ForCausalLM": (dict(dim_model_base=4, num_key_value_heads=2),  # logits_scaling 32 / 4
                                     "logits / self.config.logits_scaling"),
    "nanochat.NanoChatForCausalLM": (CAP, "softcap self.config.final_logit_softcapping"),
    "recurrent_gemma.RecurrentGemmaForCausalLM": (dict(logits_soft_cap=2.0, block_types=["recurrent", "attention"]),
                                                  "softcap self.config.logits_soft_cap"),
    "vaultgemma.VaultGemmaForCausalLM": (CAP, "softcap self.config.final_logit_softcapping"),
}
# LoRA targets other than every linear (Gemma-3n reads some of its linears' weights directly)
TARGETS = {"gemma3n.Gemma3nForCausalLM": ["q_proj", "v_proj", "down_proj"]}
# expert classes patch_model's MoE fusion refuses: the loss is installed on its own
MOE = {"cohere2_moe.Cohere2MoeForCausalLM", "granitemoe.GraniteMoeForCausalLM",
       "granitemoe_swa.GraniteMoeSWAForCausalLM", "granitemoehybrid.GraniteMoeHybridForCausalLM",
       "granitemoeshared.GraniteMoeSharedForCausalLM"}
# forwards that change the logits in ways the op does not take (refused by name)
REFUSED = {
    "inkling.InklingForCausalLM": "logits = logits\\[..., :unpadded_vocab_size\\]",
    "xlstm.xLSTMForCausalLM": "max_inference_chunksize",
    "modernbert_decoder.ModernBertDecoderForCausalLM": "self.decoder\\(self.lm_head",
    "clvp.ClvpForCausalLM": "final_norm",
    "bart.BartForCausalLM": "self.model\\(...\\)",
}


def _class(arch):
    mod, name = arch.split(".")
    return getattr(importlib.import_module(f"transformers.models.{mod}.modeling_{mod}"), name)


def _model(arch):
    cls = _class(arch)
    config = cls.config_class(**{**TINY, **TRANSFORMING[arch][0]})
    torch.manual_seed(0)
    model = cls(config).float().to(DEVICE).train()
    with torch.no_grad():  # logits of a few units: the soft-caps and scales above change the loss a lot
        model.get_output_embeddings().weight.normal_(0, 1.0)
    lora_lab.add_lora(model, r=4, alpha=8, targets=TARGETS.get(arch, "all-linear"))
    lora_lab.fill_lora_B(model, 0.02)  # B != 0: every LoRA gradient depends on the loss's gradient
    return model


def _batch():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 19), generator=gen).to(DEVICE)
    labels = ids.clone()
    labels[0, :4] = -100
    return ids, labels


def _loss_and_grads(model, ids, labels, run=None):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss if run is None else run(model)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _forward_of(cls):
    import inspect

    return next(inspect.unwrap(c.__dict__["forward"]) for c in cls.__mro__ if "forward" in c.__dict__)


def _transforming_in_transformers():
    """Every *ForCausalLM class of the installed transformers whose forward's code, as read here, transforms its
    logits (so a new one fails the inventory test below until it is added to TRANSFORMING)."""
    import transformers

    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    found = {}
    for path in sorted(glob.glob(os.path.join(root, "*", "modeling_*.py"))):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("ForCausalLM"):
                mod = os.path.basename(os.path.dirname(path))
                if f"modeling_{mod}.py" != os.path.basename(path):
                    continue
                try:
                    cls = _class(f"{mod}.{node.name}")
                    t = analyze_forward(_forward_of(cls), node.name, "self.lm_head",
                                        "self." + getattr(cls, "base_model_prefix", ""))
                except (UnsupportedLogitTransform, ImportError, AttributeError, StopIteration):
                    continue
                if t.scales or t.softcap:
                    found[f"{mod}.{node.name}"] = t.describe()
    return found


def test_every_transforming_causal_lm_of_transformers_is_tested_here():
    found = _transforming_in_transformers()
    assert found == {arch: expected for arch, (_, expected) in TRANSFORMING.items()}


@pytest.mark.parametrize("impl", ["recompute", "fwdgrad"])
@pytest.mark.parametrize("arch", list(TRANSFORMING))
def test_patched_model_matches_the_unpatched_one(arch, impl, monkeypatch):
    model = _model(arch)
    ids, labels = _batch()
    ref = _loss_and_grads(model, ids, labels)
    monkeypatch.setenv("LORA_LAB_LOSS_IMPL", impl)
    if arch in MOE:
        patch_causal_lm_loss(model)
    else:
        # the LoRA layers' GEMMs and rank-r passes as torch calls: this test is about the loss (the LoRA kernels
        # have their own tests), and the interpreter would run them for most of its time
        summary = patch_model(model, fused_loss=True, config=KernelConfig(dispatch="cublas", rank_ops="torch"))
        assert summary["fused_loss"] and not summary["skipped"]
    lm = causal_lm_of(model)
    transform = logit_transform(lm, lm.get_output_embeddings())
    assert transform.describe() == TRANSFORMING[arch][1]
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None
    got = _loss_and_grads(model, ids, labels)
    assert abs(got[0].item() - ref[0].item()) <= 1e-5 * abs(ref[0].item())
    assert got[1].keys() == ref[1].keys() and any("lora" in n for n in ref[1])
    for n in ref[1]:
        assert rel_l2(got[1][n], ref[1][n]) <= 1e-4, n
    unpatch_model(model)


@pytest.mark.parametrize("arch", list(REFUSED))
def test_a_forward_the_op_cannot_follow_is_refused_by_name(arch):
    cls = _class(arch)
    with pytest.raises(UnsupportedLogitTransform, match=REFUSED[arch]) as info:
        analyze_forward(_forward_of(cls), cls.__name__, "self.lm_head", "self." + cls.base_model_prefix)
    assert cls.__name__ in str(info.value)


def _refusing_model():
    """A tiny Qwen2 whose class's forward cuts the vocabulary before the loss (as Inkling's does)."""
    from transformers import Qwen2ForCausalLM

    class CutVocabForCausalLM(Qwen2ForCausalLM):
        def forward(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
            outputs = self.model(input_ids=input_ids, **kwargs)
            hidden_states = outputs.last_hidden_state
            slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(hidden_states[:, slice_indices, :])
            logits = logits[..., :100]
            loss = None
            if labels is not None:
                loss = self.loss_function(logits, labels, 100, **kwargs)
            return loss

    base = lora_lab.load_model("random:tiny-qwen2", dtype=torch.float32, device=DEVICE)
    model = CutVocabForCausalLM(base.config).to(DEVICE)
    lora_lab.add_lora(model, r=2, alpha=4)
    return model


def test_patch_model_skips_the_loss_of_a_refused_forward_and_says_why():
    model = _refusing_model()
    summary = patch_model(model, fused_loss=True)
    assert summary["fused_loss"] is False and summary["loss"] is None and summary["lora_layers"] > 0
    assert len(summary["skipped"]) == 1
    assert "CutVocabForCausalLM.forward" in summary["skipped"][0]
    assert "logits = logits[..., :100]" in summary["skipped"][0]
    assert "forward" not in causal_lm_of(model).__dict__  # the model's own loss stays
    with pytest.raises(UnsupportedLogitTransform, match="CutVocabForCausalLM.forward"):
        patch_causal_lm_loss(model)
    unpatch_model(model)


@pytest.mark.parametrize("scale", [0.0625, 8.0, 0.3, 3.7])
def test_a_scale_folded_into_the_hidden_states_gives_the_scaled_logits(scale):
    # (s·H) Wᵀ = s·(H Wᵀ): bit for bit for a power of two; otherwise within the rounding bound of a d-term fp32 dot
    # product, (d + 2)·2⁻²⁴ · s·Σ|h||w|
    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(40, 32, generator=gen), torch.randn(96, 32, generator=gen)
    folded, scaled = (h * scale) @ w.t(), (h @ w.t()) * scale
    if scale in (0.0625, 8.0):
        assert torch.equal(folded, scaled)
    else:
        bound = (32 + 2) * 2.0**-24 * scale * (h.abs() @ w.abs().t())
        assert torch.all((folded - scaled).abs() <= bound)


@pytest.mark.parametrize("arch", ["granite.GraniteForCausalLM", "cohere.CohereForCausalLM",
                                  "gemma2.Gemma2ForCausalLM"])
def test_causal_lm_loss_follows_the_transform(arch):
    from lora_lab.loss import causal_lm_loss

    model = _model(arch)
    ids, labels = _batch()
    ref = _loss_and_grads(model, ids, labels, lambda m: causal_lm_loss(m, ids, labels, chunked=False))
    runs = {"fused": {"fused": True}}
    if TRANSFORMING[arch][1].startswith("softcap"):
        with pytest.raises(ValueError, match="soft-caps its logits.*fused=True"):
            causal_lm_loss(model, ids, labels, chunked=True)
    else:
        runs["chunked"] = {"chunked": True}
    for kwargs in runs.values():
        got = _loss_and_grads(model, ids, labels, lambda m, kw=kwargs: causal_lm_loss(m, ids, labels, **kw))
        assert abs(got[0].item() - ref[0].item()) <= 1e-5 * abs(ref[0].item())
        for n in ref[1]:
            assert rel_l2(got[1][n], ref[1][n]) <= 1e-4, n


def _mixtral(output_router_logits):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**TINY, num_local_experts=2, num_experts_per_tok=1, router_aux_loss_coef=0.5,
                           output_router_logits=output_router_logits)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).float().to(DEVICE).train()
    lora_lab.add_lora(model, r=4, alpha=8)
    lora_lab.fill_lora_B(model, 0.02)
    return model


def test_a_router_auxiliary_loss_is_not_dropped_silently():
    # Mixtral adds router_aux_loss_coef * its load-balancing loss when output_router_logits is on
    ids, labels = _batch()
    model = _mixtral(output_router_logits=False)
    ref = _loss_and_grads(model, ids, labels)
    patch_causal_lm_loss(model)
    got = _loss_and_grads(model, ids, labels)
    assert abs(got[0].item() - ref[0].item()) <= 1e-5 * abs(ref[0].item())
    for n in ref[1]:
        assert rel_l2(got[1][n], ref[1][n]) <= 1e-4, n
    with pytest.raises(ValueError, match="MixtralForCausalLM adds its router's auxiliary loss.*output_router_logits"):
        model(input_ids=ids, labels=labels, output_router_logits=True)
    on = _mixtral(output_router_logits=True)
    with_aux = on(input_ids=ids, labels=labels).loss
    summary = patch_model(on, fused_loss=True)
    assert summary["fused_loss"] is False and "config.output_router_logits" in summary["skipped"][-1]
    unpatch_model(on)
    assert abs(with_aux.item() - ref[0].item()) > 1e-3  # the auxiliary term is there to lose

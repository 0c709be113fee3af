"""Correctness checks of the fused MoE experts, shared by notebook 06 and the tests.

* ``make_moe_problem``: a random MoE experts problem (X, routing, weights, optional LoRA factors);
* ``fused_vs_reference``: output and every gradient of ``fused_moe_experts`` vs ``moe_experts_reference``;
* ``EDGE_CASES``: odd sizes, T = 1, one expert receiving every token (others none), top-k = E, many tiles;
* ``patched_model_check``: a tiny Qwen3-MoE, eager vs patched, full fine-tuning and PEFT expert LoRA;
* ``peft_roundtrip_check``: train one step through the fused path, PEFT ``save_pretrained`` /
  ``from_pretrained``, logits of the reloaded model (PEFT's forward and the fused one).
"""

from __future__ import annotations

import copy
import tempfile

import torch

from lora_lab.kernels import ExpertLoRA, KernelConfig, fused_moe_experts, moe_experts_reference, patch_moe_experts
from lora_lab.layer import fill_lora_B
from lora_lab.numerics import error_stats

TENSOR_NAMES = ["out", "d_x", "d_weights", "d_gate_up_proj", "d_down_proj",
                "d_gate_up_A", "d_gate_up_B", "d_down_A", "d_down_B"]

EDGE_CASES = [
    dict(case="odd sizes (H=37, I=19)", T=9, H=37, I=19, E=5, K=2, routing="random"),
    dict(case="T = 1", T=1, H=24, I=16, E=4, K=2, routing="random"),
    dict(case="all tokens to one expert", T=12, H=32, I=16, E=6, K=1, routing="one_expert"),
    dict(case="top-k = number of experts", T=7, H=20, I=12, E=4, K=4, routing="random"),
    dict(case="several row tiles per expert", T=40, H=48, I=24, E=3, K=2, routing="random"),
]


def make_moe_problem(T, H, I, E, K, *, rank=0, seed=0, dtype=torch.float32, device="cpu", routing="random"):
    """(X, top_k_index, top_k_weights, W1, W2, ExpertLoRA | None) with weights scaled like a trained layer."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    x = rnd(T, H)
    if routing == "random":
        logits = torch.randn(T, E, generator=gen)
        weights, index = torch.topk(logits.softmax(-1), K, dim=-1)
    elif routing == "one_expert":  # every token's choices are experts 1..K: expert 0 (and K+1..) get nothing
        index = torch.stack([(torch.arange(K) + 1) % E for _ in range(T)])
        weights = torch.rand(T, K, generator=gen)
    else:
        raise ValueError(f"unknown routing {routing!r}")
    w1 = rnd(E, 2 * I, H, scale=H ** -0.5)
    w2 = rnd(E, H, I, scale=I ** -0.5)
    lora = None
    if rank:
        lora = ExpertLoRA(
            rnd(E, rank, H, scale=H ** -0.5), rnd(E, 2 * I, rank, scale=0.3), 1.7,
            rnd(E, rank, I, scale=I ** -0.5), rnd(E, H, rank, scale=0.3), 0.6,
        )
    return x, index.to(device), weights.to(device=device, dtype=dtype), w1, w2, lora


def fixed_tiles() -> KernelConfig:
    """Correctness checks over many small shapes: fixed tile configs (a tuning sweep per shape proves nothing
    about correctness and costs minutes on a GPU); other settings as configured."""
    return KernelConfig.from_env(moe_autotune=False)


def _lora_list(lora):
    return [] if lora is None else [lora.gate_up_A, lora.gate_up_B, lora.down_A, lora.down_B]


def outputs_and_grads(fn, x, index, weights, w1, w2, lora, grad_seed=1, config=None):
    """[out, dX, dweights, dW1, dW2, (dA1, dB1, dA2, dB2)] of one implementation, on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, weights, w1, w2, *_lora_list(lora))]
    lo = None
    if lora is not None:
        lo = ExpertLoRA(leaves[4], leaves[5], lora.gate_up_scale, leaves[6], leaves[7], lora.down_scale)
    if fn is fused_moe_experts:
        out = fn(leaves[0], index, leaves[1], leaves[2], leaves[3], lora=lo, config=config or fixed_tiles())
    else:
        out = fn(leaves[0], index, leaves[1], leaves[2], leaves[3], lo)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out)
    grads = torch.autograd.grad(out, leaves, g, allow_unused=True)
    return [out.detach(), *grads]


def fused_vs_reference(problem) -> list[dict]:
    """Per-tensor errors of the fused kernels against the plain-torch reference (same dtype)."""
    got = outputs_and_grads(fused_moe_experts, *problem)
    ref = outputs_and_grads(moe_experts_reference, *problem)
    rows = []
    for name, a, b in zip(TENSOR_NAMES, got, ref):
        if a is None or b is None:
            raise AssertionError(f"{name}: missing gradient (fused {a is None}, reference {b is None})")
        rows.append(dict(tensor=name, **error_stats(a, b)))
    return rows


def edge_case_table(device="cpu", dtype=torch.float32, ranks=(0, 3)) -> list[dict]:
    """Every EDGE_CASES entry, without and with LoRA, fused vs reference."""
    rows = []
    for spec in EDGE_CASES:
        shape = {k: v for k, v in spec.items() if k not in ("case", "routing")}
        for rank in ranks:
            problem = make_moe_problem(**shape, rank=rank, routing=spec["routing"], device=device, dtype=dtype)
            for row in fused_vs_reference(problem):
                rows.append(dict(case=spec["case"], lora_rank=rank, **row))
    return rows


def tiny_qwen3_moe(seed: int = 0, hidden: int = 32, experts: int = 6, top_k: int = 2):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=experts,
        num_experts_per_tok=top_k, experts_implementation="eager",
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config)


def add_expert_lora(model, rank=4, alpha=8, seed=0, b_std=0.1):
    """PEFT LoRA on experts.gate_up_proj / down_proj with B ~ N(0, b_std) (B = 0 would test nothing)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=[],
                                             target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    fill_lora_B(model, b_std, generator=torch.Generator().manual_seed(seed))
    return model


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def patched_model_check(device="cpu", seed=0) -> dict:
    """Largest relative error (loss and every gradient) of patched vs eager, full FT and PEFT expert LoRA."""
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(seed + 1)).to(device)
    result = {}
    for mode in ("full", "lora"):
        model = tiny_qwen3_moe(seed).to(device)
        if mode == "lora":
            model = add_expert_lora(model, seed=seed)
        loss_ref, grads_ref = _loss_and_grads(model, ids)
        patched = patch_moe_experts(model, config=fixed_tiles())
        loss, grads = _loss_and_grads(model, ids)
        errors = [abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())]
        same_keys = grads.keys() == grads_ref.keys()
        errors += [error_stats(grads[n], grads_ref[n])["rel_l2"] for n in grads_ref if n in grads]
        result[mode] = dict(patched_modules=patched, max_rel_err=max(errors), same_gradient_set=same_keys,
                            trainable=len(grads_ref), loss=loss.item(), loss_eager=loss_ref.item())
    return result


def peft_roundtrip_check(device="cpu", seed=0) -> dict:
    """One SGD step through the fused path, then PEFT save → load: do PEFT and fused logits agree?"""
    from peft import PeftModel
    from safetensors.torch import load_file

    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(seed + 1)).to(device)
    base = tiny_qwen3_moe(seed).to(device)
    model = add_expert_lora(copy.deepcopy(base), seed=seed)
    patch_moe_experts(model, config=fixed_tiles())
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5).step()
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        keys = sorted(load_file(f"{tmp}/adapter_model.safetensors"))
        reloaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp).to(device)
    with torch.no_grad():
        peft_logits = reloaded(input_ids=ids).logits
        patch_moe_experts(reloaded, config=fixed_tiles())
        fused_logits = reloaded(input_ids=ids).logits
    return dict(
        adapter_keys=keys,
        peft_reload_max_abs=(peft_logits - trained).abs().max().item(),
        fused_reload_max_abs=(fused_logits - trained).abs().max().item(),
        logit_scale=trained.abs().max().item(),
    )


__all__ = [
    "EDGE_CASES", "TENSOR_NAMES", "make_moe_problem", "outputs_and_grads", "fused_vs_reference",
    "edge_case_table", "tiny_qwen3_moe", "add_expert_lora", "patched_model_check", "peft_roundtrip_check",
]

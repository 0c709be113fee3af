"""The Triton MoE path with LoRA on the experts at small ranks, bf16 against the fp32 reference, gradient by gradient
and kernel by kernel: which piece goes wrong where a rank is not a multiple of 8 (such a rank keeps a layer on the
Triton engine). A diagnostic for session 8's GPU failure of ``test_patched_peft_model_bf16_gpu_close_to_fp32_eager``
(PEFT, rank 4: the gate_up LoRA A gradient came back all zeros); no notebook reads it.

    python tools/moe_lora_rank_check.py [--ranks 4 8 16] > rank_check.txt

On CPU (TRITON_INTERPRET=1) it runs the same checks in fp32 (the interpreter's bf16 dot is wrong).
"""
from __future__ import annotations

import argparse

import torch

from lora_lab.experiments.fused_moe import make_moe_problem
from lora_lab.kernels.config import KernelConfig
from lora_lab.kernels.moe.expert_weight_grad import expert_weight_grad, expert_weight_grad_reference
from lora_lab.kernels.moe.experts import ExpertLoRA, fused_moe_experts, moe_experts_reference
from lora_lab.kernels.moe.grouped_gemm import grouped_rows_gemm, grouped_rows_gemm_reference
from lora_lab.kernels.moe.launch import row_block_size
from lora_lab.kernels.moe.lora import peft_expert_factors
from lora_lab.kernels.moe.routing import route_experts
from lora_lab.numerics import cosine, rel_l2

NAMES = ["out", "dx", "d_weights", "d_gate_up", "d_down", "dA1", "dB1", "dA2", "dB2"]


def peft_flat(a, b):
    """PEFT's flat layout of factors A (E, r, in), B (E, out, r): lora_A.weight (E·r, in), lora_B.weight (out, r·E)."""
    num_experts, rank, _ = a.shape
    return a.reshape(num_experts * rank, -1), b.permute(1, 2, 0).reshape(b.shape[1], rank * num_experts)


def grads(fn, x, index, weights, w1, w2, lora, peft=False, **kw):
    """Output and every gradient; ``peft``: the factors are views of PEFT-layout leaves (B strided, expert index
    fastest), the gradients those of the flat leaves, viewed back."""
    factors = [lora.gate_up_A, lora.gate_up_B, lora.down_A, lora.down_B]
    if peft:
        factors = [*peft_flat(*factors[:2]), *peft_flat(*factors[2:])]
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, weights, w1, w2, *factors)]
    views = leaves[4:]
    if peft:
        num_experts = w1.shape[0]
        views = [*peft_expert_factors(*leaves[4:6], num_experts), *peft_expert_factors(*leaves[6:8], num_experts)]
    lo = ExpertLoRA(views[0], views[1], lora.gate_up_scale, views[2], views[3], lora.down_scale)
    out = fn(leaves[0], index, leaves[1], leaves[2], leaves[3], lora=lo, **kw) if kw else fn(
        leaves[0], index, leaves[1], leaves[2], leaves[3], lo)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    result = [out.detach(), *torch.autograd.grad(out, leaves, g, allow_unused=True)]
    if peft:  # back to (E, r, in) / (E, out, r), to compare with the reference's gradients
        num_experts = w1.shape[0]
        result[5:9] = [*peft_expert_factors(*result[5:7], num_experts), *peft_expert_factors(*result[7:9], num_experts)]
    return result


def up(t):
    return None if t is None else t.float()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shapes = [(256, 32, 24, 6, 2), (1000, 264, 136, 16, 4)]
    configs = {"default": KernelConfig(moe_engine="triton"),
               "untuned": KernelConfig(moe_engine="triton", moe_autotune=False)}
    print(f"device {device}, dtype {dtype}")
    for T, H, I, E, K in shapes:
        for rank in args.ranks:
            x, index, weights, w1, w2, lora = make_moe_problem(T, H, I, E, K, rank=rank, device=device, dtype=dtype)
            lora32 = ExpertLoRA(up(lora.gate_up_A), up(lora.gate_up_B), lora.gate_up_scale, up(lora.down_A),
                                up(lora.down_B), lora.down_scale)
            ref = grads(moe_experts_reference, x.float(), index, weights.float(), w1.float(), w2.float(), lora32)
            for cname, config, peft in [(c, cfg, False) for c, cfg in configs.items()] + [
                    ("peft-layout", configs["default"], True)]:
                got = grads(fused_moe_experts, x, index, weights, w1, w2, lora, peft=peft, config=config)
                row = "  ".join(f"{n} cos {cosine(a, b):.4f} l2 {rel_l2(a, b):.1e}" for n, a, b in zip(NAMES, got, ref)
                                if a is not None and b is not None)
                print(f"T{T} H{H} I{I} E{E} K{K} r{rank} {cname}: {row}", flush=True)
            # the two kernels of dA1 on their own: Q1 = dGU B1 (N = rank), dA1 = Σ Q1ᵀ X (M = rank)
            routing = route_experts(index, E, row_block_size(T * K, E, KernelConfig()))
            gen = torch.Generator().manual_seed(2)
            dgu = torch.randn(T * K, 2 * I, generator=gen).to(device, dtype)
            q1 = grouped_rows_gemm(dgu, lora.gate_up_B, routing, gather_rows=False)
            q1_ref = grouped_rows_gemm_reference(dgu.float(), lora.gate_up_B.float(), routing, gather_rows=False)
            da1 = expert_weight_grad(q1_ref.to(dtype), x, routing, gather_a=False, gather_b=True)
            da1_ref = expert_weight_grad_reference(q1_ref.to(dtype).float(), x.float(), routing, gather_a=False,
                                                   gather_b=True)
            print(f"    kernels r{rank}: Q1 cos {cosine(q1, q1_ref):.4f} max|Q1| {q1.float().abs().max():.3e}  "
                  f"dA1 cos {cosine(da1, da1_ref):.4f} max|dA1| {da1.float().abs().max():.3e} "
                  f"ref {da1_ref.abs().max():.3e}", flush=True)


if __name__ == "__main__":
    main()

"""Baseline: LoRA linear as a chain of cuBLAS calls inside one autograd Function.

lora_lab's own baseline, written here from the math: the shape of a LoRA autograd Function built on cuBLAS calls
alone (the benchmark's strongest non-Triton baseline). It is ours, not a peer's: axolotl's and unsloth's own LoRA
kernels are timed as shipped by ``benchmarks/bench_peers.py`` (docs/peers.md)::

    forward   XA = X Aᵀ;  Y = X Wᵀ (+ b);  Y += s · XA Bᵀ            (in-place addmm: one more pass over Y)
    backward  dYB = dY B;  dX = dY W;  dX += s · dYB A                 (one more pass over dX)
              dA = s · dYBᵀ X;  dB = s · dYᵀ XA                        (one more pass each over X and dY)

Saves X and XA (M×r). No dropout (the baselines run with dropout 0).
"""
from __future__ import annotations

import torch

__all__ = ["ChainedLoRALinearFunction", "chained_lora_linear"]


class ChainedLoRALinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_A, lora_B, scaling):
        K = x.shape[-1]
        x2 = x.reshape(-1, K)
        a = lora_A.to(x.dtype)
        b = lora_B.to(x.dtype)
        xa = x2 @ a.t()
        y = torch.addmm(bias, x2, weight.t()) if bias is not None else x2 @ weight.t()
        y.addmm_(xa, b.t(), alpha=scaling)
        ctx.save_for_backward(x2, xa, weight, lora_A, lora_B)
        ctx.scaling = scaling
        ctx.x_shape = x.shape
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, xa, weight, lora_A, lora_B = ctx.saved_tensors
        s = ctx.scaling
        dy2 = dy.reshape(-1, weight.shape[0])
        a = lora_A.to(x2.dtype)
        b = lora_B.to(x2.dtype)
        dyb = dy2 @ b
        dx = dy2 @ weight
        dx.addmm_(dyb, a, alpha=s)
        da = (dyb.t() @ x2) * s
        db = (dy2.t() @ xa) * s
        return dx.reshape(ctx.x_shape), None, None, da.to(lora_A.dtype), db.to(lora_B.dtype), None


def chained_lora_linear(x, weight, bias, lora_A, lora_B, scaling):
    """Y = X Wᵀ + b + s (X Aᵀ) Bᵀ with the chained-cuBLAS Function (frozen W and b)."""
    return ChainedLoRALinearFunction.apply(x, weight, bias, lora_A, lora_B, float(scaling))

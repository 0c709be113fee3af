"""The grouped-GEMM engine's LoRA passes, piece by piece, two ways side by side in one process: the LoRA term as a
dense (S, N) tensor made by a rank-r grouped GEMM and read by the SiLU·up pass (the "dense" way), against the term
made inside that pass from its factors (:class:`~lora_lab.kernels.moe.silu_backward.LowRankRows`), and the rank-r
product of the rows a pass writes by its own grouped GEMM against summing it inside the pass
(:class:`~lora_lab.kernels.moe.silu_backward.LowRankOut`). A diagnostic for the MoE layer's LoRA speed target: a
benchmark of 2d65ec1 found the engine slower with every piece factored, and this says which piece costs. No
notebook reads it.

    python tools/moe_lora_pass_bench.py [--tokens 8192 32768] [--rank 16] > lora_passes.txt

Each line: the median of ``--reps`` synchronised loops of ``--calls`` calls (CUDA events), ms per call, with the
spread (min-max) of the loops. On CPU (TRITON_INTERPRET=1) it runs each piece once in fp32 as a smoke test.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from lora_lab.kernels.moe.routing import sort_assignments
from lora_lab.kernels.moe.silu_backward import LowRankOut, LowRankRows, silu_backward, silu_mul
from lora_lab.kernels.triton_helpers import running_in_interpreter

SHAPES = {  # (experts, top-k, hidden, intermediate) of notebook 06's panel
    "qwen3_30b_a3b": (128, 8, 2048, 768),
    "qwen1_5_moe_a2_7b": (60, 4, 2048, 1408),
    "deepseek_v2_lite": (64, 6, 2048, 1408),
}


def gmm(a, b, offsets):
    if hasattr(torch, "_grouped_mm") and a.is_cuda:
        return torch._grouped_mm(a, b, offs=offsets[1:])
    out = torch.empty(a.shape[0], b.shape[2], dtype=a.dtype, device=a.device)
    for e in range(b.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        out[lo:hi] = a[lo:hi] @ b[e]
    return out


def timed(fn, calls: int, reps: int) -> tuple[float, float, float]:
    """(median, min, max) over ``reps`` loops of ms per call; each loop synchronised, host time in."""
    if not torch.cuda.is_available():
        fn()
        return float("nan"), float("nan"), float("nan")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        per_call.append(start.elapsed_time(end) / calls)
    return statistics.median(per_call), min(per_call), max(per_call)


def pieces(shape: str, tokens: int, rank: int, device: str, dtype: torch.dtype):
    """name -> a callable running one piece on the shape's tensors."""
    num_experts, top_k, _, inter = SHAPES[shape]
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = tokens * top_k
    index = torch.randint(0, num_experts, (tokens, top_k), generator=gen).to(device)
    offsets = sort_assignments(index, num_experts).expert_offsets

    def randn(*size):
        return (torch.randn(*size, generator=gen) * 0.1).to(device=device, dtype=dtype)

    gu, d = randn(rows, 2 * inter), randn(rows, inter)
    weight = torch.rand(rows, generator=gen).to(device=device, dtype=dtype)
    valid = torch.ones(rows, dtype=torch.bool, device=device)
    p1, q2 = randn(rows, rank), randn(rows, rank)
    b1, a2 = randn(num_experts, 2 * inter, rank), randn(num_experts, rank, inter)
    b1t, a2t = b1.transpose(1, 2), a2.transpose(1, 2)
    kw = dict(compute_router_grad=True, weight_h=True, extra_scale=0.5)
    h = silu_mul(gu.clone(), weight)
    dgu = torch.empty_like(gu)

    def zeros():
        return torch.zeros(rows, rank, device=device, dtype=torch.float32)

    return {
        # forward: SiLU·up alone, then with the gate/up LoRA term and P2 = h A2^T
        "fwd silu_mul plain": lambda: silu_mul(gu, weight),
        "fwd term dense (gmm P1 B1^T + silu_mul extra)": lambda: silu_mul(gu, weight, gmm(p1, b1t, offsets), 0.5),
        "fwd term factored (silu_mul low_rank)": lambda: silu_mul(gu, weight, None, 0.5,
                                                                  low_rank=LowRankRows(p1, b1t, offsets)),
        "fwd P2 dense (gmm h A2^T)": lambda: gmm(h, a2t, offsets),
        "fwd P2 in pass (silu_mul low_rank_out)": lambda: silu_mul(gu, weight,
                                                                   low_rank_out=LowRankOut(a2t, offsets, zeros())),
        # backward: SiLU·up's backward alone, then with D's LoRA term and Q1 = dGU B1
        "bwd silu_backward plain": lambda: silu_backward(d, gu, weight, valid, **kw),
        "bwd term dense (gmm Q2 A2 + silu_backward extra)": lambda: silu_backward(
            d, gu, weight, valid, extra=gmm(q2, a2, offsets), **kw),
        "bwd term factored (silu_backward low_rank)": lambda: silu_backward(
            d, gu, weight, valid, low_rank=LowRankRows(q2, a2, offsets), **kw),
        "bwd Q1 dense (gmm dGU B1)": lambda: gmm(dgu, b1, offsets),
        "bwd Q1 in pass (silu_backward low_rank_out)": lambda: silu_backward(
            d, gu, weight, valid, low_rank_out=LowRankOut(b1, offsets, zeros()), **kw),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["qwen3_30b_a3b"], choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cpu" and not running_in_interpreter():
        raise SystemExit("no GPU: run with TRITON_INTERPRET=1 for the CPU smoke test")
    tokens = args.tokens if device == "cuda" else [16]
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (interpreter smoke test)'}, "
          f"{dtype}, rank {args.rank}, {args.calls} calls x {args.reps} loops")
    for shape in args.shapes:
        for t in tokens:
            for name, fn in pieces(shape, t, args.rank, device, dtype).items():
                med, lo, hi = timed(fn, args.calls, args.reps)
                print(f"{shape:18s} T={t:6d}  {name:52s} {med:8.4f} ms  [{lo:.4f}, {hi:.4f}]", flush=True)


if __name__ == "__main__":
    main()

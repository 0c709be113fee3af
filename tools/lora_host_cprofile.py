"""Where the fused LoRA linear's host time goes, function by function: ``cProfile`` over ``--calls`` forward +
backward calls at one cell (default notebook 05's target: M 32768, 4096², r 16), each synchronised, after warm-up.
Prints the top functions by own time and by cumulative time (Python and the C calls it makes: Triton's launcher,
the autotuner, TMA descriptors, torch ops). A diagnostic; no notebook reads it.

    python tools/lora_host_cprofile.py [--calls 50] [--rank-ops triton|torch] > host_cprofile.txt
"""
from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

from lora_lab.kernels import KernelConfig, fused_lora_linear


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", type=int, nargs=4, default=[32768, 4096, 4096, 16], metavar=("M", "K", "N", "R"))
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rank-ops", default="triton", choices=["triton", "torch"])
    ap.add_argument("--top", type=int, default=35)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    M, K, N, r = args.cell if cuda else (64, 32, 32, 4)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(M, K, generator=g).to(device, dtype).requires_grad_(True)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(device, dtype)
    a = (torch.randn(r, K, generator=g) / K**0.5).to(device).requires_grad_(True)
    b = (0.02 * torch.randn(N, r, generator=g)).to(device).requires_grad_(True)
    dy = torch.randn(M, N, generator=g).to(device, dtype)
    config = KernelConfig(dispatch="triton", rank_ops=args.rank_ops) if args.rank_ops == "torch" else KernelConfig()

    def step():
        y = fused_lora_linear(x, w, None, a, b, 2.0, config=config)
        torch.autograd.grad(y, [x, a, b], dy)
        if cuda:
            torch.cuda.synchronize()

    for _ in range(5):
        step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.calls):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    print(f"cell M={M} K={K} N={N} r={r}, rank_ops={args.rank_ops}, {args.calls} calls (times are totals)")
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()

"""Host (Python) cost of the MoE routing's launch path with its Triton kernels stubbed out: what our own code adds
around the three routing launches (allocations, argument set-up), without Triton's launch path or any GPU.

CPU only; CPU tensors, no interpreter (the kernels never run). A diagnostic for issue #24's idle GPU time at the
start of a call (session 11's H200 host timeline: about 0.7 ms idle, almost all before the first expert GEMM).

    python tools/moe_routing_host_cost.py [--tokens 8192] [--top-k 8] [--experts 128] [--calls 1000]
"""
from __future__ import annotations

import argparse
import time

import torch

from lora_lab.kernels.moe import routing


class _Stub:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args()
    for name in dir(routing):
        if name.startswith("_route_") and name.endswith("_kernel"):
            setattr(routing, name, _Stub())
    gen = torch.Generator().manual_seed(0)
    index = torch.randint(0, args.experts, (args.tokens, args.top_k), generator=gen)
    weights = torch.rand(args.tokens, args.top_k, generator=gen)

    def call():
        routing.sort_assignments(index, args.experts, block_m=128, with_position=True, weights=weights)

    for _ in range(100):
        call()
    start = time.perf_counter()
    for _ in range(args.calls):
        call()
    per_call_us = (time.perf_counter() - start) / args.calls * 1e6
    print(f"torch {torch.__version__}; T={args.tokens} K={args.top_k} E={args.experts}: sort_assignments with its "
          f"kernels stubbed, {per_call_us:.1f} us per call (mean of {args.calls}, CPU)")


if __name__ == "__main__":
    main()

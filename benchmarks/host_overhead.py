"""Diagnostic (not a benchmark): where the host time of one LoRA linear step goes at M = 8192, where
notebook 05 timed the GEMM core's persistent forms at 2.1-2.5x the shipped op's time while the kernel profile
(run 1) gave them less device time than the shipped op.

For each form: the host's time to launch one forward + backward step (50 steps, no synchronisation inside), the
wall time per step including the final synchronisation, and a cProfile of 20 steps (top functions by cumulative
time). Run from the repository root on a CUDA machine:

    python benchmarks/host_overhead.py

Not a
benchmark in the sense of benchmarks/README.md: one run, no repetitions, no CSV; its numbers say where host time
goes, never whether a target is met.
"""
import cProfile
import pstats
import sys
import time

import torch
from bench_lora_linear import FUSED_CONFIGS  # this folder is on sys.path when the script runs

from lora_lab.kernels import KernelConfig, fused_lora_linear

M, K, N, r = 8192, 4096, 4096, 16
dev, dt = "cuda", torch.bfloat16
gen = torch.Generator(device=dev).manual_seed(0)
x = torch.randn(M, K, generator=gen, device=dev).to(dt).requires_grad_(True)
dy = torch.randn(M, N, generator=gen, device=dev).to(dt)
W = (torch.randn(N, K, generator=gen, device=dev) / K**0.5).to(dt)
A = (torch.randn(r, K, generator=gen, device=dev) / K**0.5).to(dt).requires_grad_(True)
B = (torch.randn(N, r, generator=gen, device=dev) * 0.02).to(dt).requires_grad_(True)
shipped = KernelConfig.from_env()
for name in ["fused", "fused_persistent", "fused_fold"]:
    cfg = shipped.replace(**FUSED_CONFIGS[name])

    def step(cfg=cfg):
        return torch.autograd.grad(fused_lora_linear(x, W, None, A, B, 2.0, config=cfg), [x, A, B], dy)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        step()
    host_ms = (time.perf_counter() - start) / 50 * 1e3
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / 50 * 1e3
    print(f"== {name}: host {host_ms:.3f} ms per step to launch, wall {wall_ms:.3f} ms per step with the sync",
          flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(30)

"""Host time of the fused LoRA linear per forward + backward, without a GPU: every Triton launch is replaced by a
stub that only evaluates the launch grid and counts the launch, so what is timed is the op's own Python work
(argument checks, config, dispatch, TMA descriptors, grids), the autograd Function and the torch allocations,
on tiny CPU tensors. Triton's own launcher (argument binding, the autotuner's lookup) is not in it: that needs
a GPU driver.

Time is the thread's CPU time (``time.thread_time``), which other processes on a shared machine disturb less
than wall time; the figure is the median over ``--rounds`` rounds of ``--calls`` calls.

    TRITON_INTERPRET=1 python benchmarks/host_time_lora_linear.py
    TRITON_INTERPRET=1 python benchmarks/host_time_lora_linear.py --configs default persistent fold
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

CONFIGS = {  # KernelConfig fields per named setting (None: config=None, the environment's defaults)
    "default": None,
    "triton": {"dispatch": "triton"},
    "persistent": {"dispatch": "triton", "base_gemm": "triton", "gemm_loads": "persistent"},
    "fold": {"dispatch": "triton", "base_gemm": "triton", "gemm_loads": "persistent", "fold_projection": True},
}
STUBBED = {  # module → its Triton kernels
    "lora_lab.kernels.lora.gemm": ["_lora_gemm_kernel", "_lora_gemm_tma_kernel", "_lora_gemm_persistent_kernel"],
    "lora_lab.kernels.lora.rank_ops": ["_rank_projection_kernel", "_rank_reduction_kernel", "_q_and_db_kernel"],
}
META = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_D": 128, "BLOCK_K": 64}  # what a grid function is evaluated with


class _StubKernel:
    """``kernel[grid](*args, **kwargs)`` that evaluates ``grid`` like Triton does and records the launch."""

    def __init__(self, name: str, launches: list):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if callable(grid):
                grid(META)
            self.launches.append(self.name)
        return launch


def stub_kernels() -> list:
    """Replace every Triton kernel of the LoRA linear by a stub; returns the list the launches are appended to."""
    import importlib

    launches: list = []
    for module_name, names in STUBBED.items():
        module = importlib.import_module(module_name)
        for name in names:
            setattr(module, name, _StubKernel(name, launches))
    return launches


def host_time(config_name: str, launches: list, M: int, K: int, N: int, r: int, calls: int, rounds: int) -> dict:
    from lora_lab.kernels import KernelConfig, fused_lora_linear

    fields = CONFIGS[config_name]
    config = None if fields is None else KernelConfig(**fields)
    x = torch.randn(M, K, requires_grad=True)
    w = torch.randn(N, K)
    a, b = torch.randn(r, K, requires_grad=True), torch.randn(N, r, requires_grad=True)
    dy = torch.ones(M, N)

    def step():
        y = fused_lora_linear(x, w, None, a, b, 2.0, config=config)
        y.backward(dy)

    for _ in range(max(10, calls // 5)):
        step()
    launches.clear()
    step()
    per_step = list(launches)
    times = []
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(calls):
            step()
        times.append((time.thread_time() - start) / calls * 1e6)
    return {"config": config_name, "launches": len(per_step), "kernels": per_step,
            "median_us": statistics.median(times), "min_us": min(times)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--shape", type=int, nargs=4, default=[64, 256, 256, 16], metavar=("M", "K", "N", "R"),
                    help="tiny CPU tensors: the time is the host's, not the arithmetic's")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 (CPU tensors; the kernels are stubbed, so nothing is interpreted)")
    torch.set_num_threads(1)
    launches = stub_kernels()
    for name in args.configs:
        row = host_time(name, launches, *args.shape, args.calls, args.rounds)
        print(f"{name:11s} {row['launches']} Triton launches per forward + backward; host CPU time per call "
              f"median {row['median_us']:.1f} us (min {row['min_us']:.1f}) [{', '.join(row['kernels'])}]")


if __name__ == "__main__":
    main()

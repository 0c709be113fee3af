"""First call and steady call of the fused MoE layer per panel shape: autotuned, untuned (the tile table alone) and
the engine each runs on (issue #24's "no traps"). A diagnostic, not a benchmark: one process, no rotation, no
repetitions; notebook 06's benchmark (benchmarks/bench_moe.py) records the graded figures.

Each shape runs in a fresh child process (so no in-process tuning or compile cache helps the first call; Triton's
disk caches do, as they would for a user; --fresh-cache points TRITON_CACHE_DIR at an empty folder). Run from the
repository root on a GPU:

    python tools/moe_first_call.py                                   # every panel shape, T = 8192, full
    python tools/moe_first_call.py --shapes mixtral_8x7b --mode lora --fresh-cache
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def one(shape_name: str, tokens: int, mode: str, autotune: bool, smoke: bool = False) -> dict:
    import torch

    from lora_lab.experiments import fused_moe as fm
    from lora_lab.kernels import KernelConfig
    from lora_lab.kernels.moe.engine import engine_for

    shape = fm.LAYER_SHAPES[shape_name]
    device, dtype = torch.device("cuda"), torch.bfloat16
    if smoke:  # the code path on a CPU (TRITON_INTERPRET=1): a tiny stand-in, fp32; its times mean nothing
        shape, tokens, device, dtype = shape.scaled(32, 4, 2, 16), 8, torch.device("cpu"), torch.float32
    holder, experts, params = fm.layer_holder(shape, mode, device, dtype, seed=0)
    x = torch.randn(tokens, shape.hidden, device=device, dtype=dtype, requires_grad=True)
    index, weights = fm.random_routing(tokens, shape, device, dtype, seed=0)
    grad = torch.randn_like(x)
    config = KernelConfig.from_env(moe_autotune=autotune)
    fm.set_implementation(holder, experts, "ours", config)
    inputs = [x, weights, *params]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step():
        torch.autograd.grad(holder(x, index, weights), inputs, grad)
        sync()

    sync()
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    times = []
    for _ in range(5):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    ranks = (16, 16) if mode == "lora" else ()  # layer_holder's rank on both expert weights
    engine = engine_for(x, index, experts.gate_up_proj, config=config, ranks=ranks)
    return dict(shape=shape_name, tokens=tokens, mode=mode, autotune=autotune, engine=engine,
                first_call_s=round(first, 2), steady_ms=round(sorted(times)[2], 3))


def main() -> None:
    from lora_lab.experiments.fused_moe import LAYER_SHAPES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(LAYER_SHAPES), choices=list(LAYER_SHAPES))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--mode", default="full", choices=["full", "lora"])
    ap.add_argument("--fresh-cache", action="store_true", help="an empty TRITON_CACHE_DIR (compile and tuning)")
    ap.add_argument("--smoke", action="store_true", help="the code path on a CPU with TRITON_INTERPRET=1 (tiny shapes)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one(*json.loads(args.child))), flush=True)
        return
    env = dict(os.environ)
    if args.fresh_cache:
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="moe_first_call_")
    for name in args.shapes:
        for autotune in (True, False):
            child = json.dumps([name, args.tokens, args.mode, autotune, args.smoke])
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", child], env=env,
                                  capture_output=True, text=True)
            line = done.stdout.strip().splitlines()[-1] if done.returncode == 0 else f"FAILED: {done.stderr[-600:]}"
            print(f"{name} T={args.tokens} {args.mode} autotune={autotune}: {line}", flush=True)


if __name__ == "__main__":
    main()

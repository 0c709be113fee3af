"""Where a MoE experts layer's plain-loop time goes beyond its kernels: host time before the first kernel, GPU idle
gaps between kernels, kernel busy time, per implementation, at one benchmark cell of notebook 06 (default: the
30B-A3B-like layer, 8,192 tokens, full fine-tuning, where ours trails Liger by about 2%).

Each implementation runs the call notebook 06 times (``benchmarks/bench_moe.py``: forward and
``torch.autograd.grad`` of a fixed upstream gradient). For each one, in rotated order:
  * ``loop_ms``: the user's loop (``measure.loop_ms``, synchronised after each call), median of ``--calls``;
  * ``host_ms``: the host's own time per call (``measure.host_ms``);
  * from a ``torch.profiler`` trace of ``--traced`` calls, each synchronised (``lora_host_profile.trace``): per call,
    the time from the call's start to its first kernel (``lead_us``), the GPU idle time between its kernels
    (``gaps_us``), the kernels' busy time (``busy_us``), the number of kernels; medians over the traced calls.
The top host operators of each implementation (self CPU time) go to ``<impl>_host_ops.txt``, its whole traced
timeline (host ops, launches, kernels; first repetition) to ``<impl>_trace.json.gz`` (chrome://tracing, Perfetto),
a ``cProfile`` of ``--calls`` synchronised calls (Python functions by own and by cumulative time: the autotuner,
Triton's launcher, torch ops) to ``<impl>_cprofile.txt``, rows to ``moe_host_profile.csv``.

    python tools/moe_host_profile.py --out DIR [--shape qwen3_30b_a3b] [--tokens 8192] [--mode full]
        [--impls ours grouped_mm liger]
A diagnostic (no notebook reads it). On CPU it runs a scaled-down layer through the code path only
(TRITON_INTERPRET=1): no kernels, so no gaps.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_host_profile import trace  # noqa: E402  (a sibling script: the same trace summary for both tools)

from lora_lab.experiments import fused_moe  # noqa: E402
from lora_lab.lab import measure  # noqa: E402

SMOKE_SHAPE = dict(hidden=32, num_experts=4, top_k=2, intermediate=16)


def cell_step(shape, num_tokens: int, mode: str, device, dtype):
    """(holder, experts, step): the experts layer of one notebook-06 cell and its timed call."""
    holder, experts, params = fused_moe.layer_holder(shape, mode, device, dtype, seed=0)
    gen = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(num_tokens, shape.hidden, generator=gen, device=device).to(dtype).requires_grad_(True)
    index, weights = fused_moe.random_routing(num_tokens, shape, device, dtype, seed=0)
    grad_out = torch.randn(num_tokens, shape.hidden, generator=gen, device=device).to(dtype)
    inputs = [x, weights, *params]

    def step():
        return torch.autograd.grad(holder(x, index, weights), inputs, grad_out)

    return holder, experts, step


def cprofile_text(step, calls: int, cuda: bool, top: int = 40) -> str:
    """``cProfile`` of ``calls`` synchronised calls: the top functions by own time, then by cumulative time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
        if cuda:
            torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    text.write(f"{calls} calls, each synchronised (times are totals)\n")
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen3_30b_a3b", choices=sorted(fused_moe.LAYER_SHAPES))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--mode", default="full", choices=("full", "lora"))
    ap.add_argument("--impls", nargs="+", default=["ours", "grouped_mm", fused_moe.LIGER])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--traced", type=int, default=5)
    ap.add_argument("--repetitions", type=int, default=3)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    known = set(fused_moe.implementations(args.mode)) | set(fused_moe.OURS_VARIANTS)
    unknown = [impl for impl in args.impls if impl not in known]
    if unknown:
        ap.error(f"--impls: {', '.join(unknown)} cannot run a {args.mode} cell here; choose from "
                 f"{', '.join(sorted(known))}")
    shape = fused_moe.LAYER_SHAPES[args.shape]
    tokens = args.tokens
    if not cuda:
        shape, tokens = shape.scaled(**SMOKE_SHAPE), 64
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    holder, experts, step = cell_step(shape, tokens, args.mode, device, dtype)
    first_s = {}
    results = []
    for rep in range(args.repetitions):
        for impl in measure.rotation(list(args.impls), rep):
            fused_moe.set_implementation(holder, experts, impl)
            if impl not in first_s:  # compile and tune outside its timed loops, when it first comes up (a slow
                # first call, e.g. Liger's autotuning, then costs only what comes after it if a time limit hits)
                first_s[impl] = sum(measure.loop_ms(step, calls=1, warmup=0)) / 1e3
                measure.loop_ms(step, calls=1, warmup=1)
            loop = statistics.median(measure.loop_ms(step, calls=args.calls, warmup=2))
            host = statistics.median(measure.host_ms(step, calls=args.calls, warmup=2))
            rows, table = trace(step, args.traced, cuda, chrome=out / f"{impl}_trace.json.gz" if rep == 0 else None)
            summary = {key: statistics.median(r[key] for r in rows) for key in rows[0]} if rows else {}
            results.append({"impl": impl, "rep": rep, "shape": shape.name, "tokens": tokens, "mode": args.mode,
                            "first_call_s": first_s[impl], "loop_ms": loop, "host_ms": host, **summary})
            if rep == 0:
                (out / f"{impl}_host_ops.txt").write_text(table)
                (out / f"{impl}_cprofile.txt").write_text(cprofile_text(step, args.calls, cuda))
            print(results[-1], flush=True)
            measure.write_csv(results, out / "moe_host_profile.csv")  # after every row: a time limit keeps what ran
    fused_moe.set_implementation(holder, experts, "eager")  # unpatch


if __name__ == "__main__":
    main()

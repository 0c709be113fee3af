"""Where a LoRA linear's plain-loop time goes beyond its kernels: host time before the first kernel, GPU idle gaps
between kernels, kernel busy time — per variant, at one cell (default: notebook 05's target, M 32768, 4096², r 16).

For each variant (by default the frozen layer, the fused op as shipped, the fused op with the rank-r passes as cuBLAS
calls; ``--variants`` picks any of bench_lora_linear's fused settings by its name):
  * ``loop_ms``: the user's loop (``measure.loop_ms``, synchronised after each call), median of ``--calls``;
  * ``host_ms``: the host's own time per call (``measure.host_ms``);
  * from a ``torch.profiler`` trace of ``--traced`` calls, each synchronised: per call, the time from the call's
    start to its first kernel (``lead_us``), the GPU idle time between its kernels (``gaps_us``), the kernels' busy
    time (``busy_us``) and the number of kernels; medians over the traced calls.
The top host operators of each variant (self CPU time) go to ``<variant>_host_ops.txt``. The LoRA factors are fp32
(PEFT's default) unless ``--adapters input`` makes them the input's dtype, as ``bench_lora_linear`` has them.

    python tools/lora_host_profile.py --out DIR [--cell 32768 4096 4096 16] [--variants base fused_stacked ...]
A diagnostic (no notebook reads it); on CPU it runs the code path only (no kernels, TRITON_INTERPRET=1).
"""
from __future__ import annotations

import argparse
import gzip
import statistics
import sys
from pathlib import Path

import torch

from lora_lab.kernels import KernelConfig, fused_lora_linear
from lora_lab.lab import measure

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_lora_linear  # noqa: E402

# the frozen layer, and the fused op in each setting bench_lora_linear times, under the benchmark's names
VARIANTS = {"base": None, **{name: KernelConfig(**fields) for name, fields in bench_lora_linear.FUSED_CONFIGS.items()}}
DEFAULT_VARIANTS = ["base", "fused", "fused_torch_rank"]


def build(M, K, N, r, device, dtype, adapter_dtype=torch.float32):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(M, K, generator=g).to(device, dtype).requires_grad_(True)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(device, dtype)
    a = (torch.randn(r, K, generator=g) / K**0.5).to(device, adapter_dtype).requires_grad_(True)
    b = (0.02 * torch.randn(N, r, generator=g)).to(device, adapter_dtype).requires_grad_(True)
    dy = torch.randn(M, N, generator=g).to(device, dtype)
    return x, w, a, b, dy


def step_fn(variant, x, w, a, b, dy):
    config = VARIANTS[variant]
    if config is None:
        def step():
            y = torch.nn.functional.linear(x, w)
            return torch.autograd.grad(y, [x], dy)
    else:
        def step():
            y = fused_lora_linear(x, w, None, a, b, 2.0, config=config)
            return torch.autograd.grad(y, [x, a, b], dy)
    return step


def trace(step, calls: int, cuda: bool, chrome: Path | None = None):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for i in range(calls):
            with record_function(f"call_{i}"):
                step()
            if cuda:
                torch.cuda.synchronize()
    events = list(prof.events())
    marks = sorted((e.time_range.start, e.time_range.end) for e in events if e.name.startswith("call_"))
    # GPU work only: the call_<i> annotation is mirrored on the GPU timeline too (a CUDA-side event spanning the
    # call), which, counted as a kernel, would make lead_us 0 and busy_us larger than the span
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type == DeviceType.CUDA and not e.name.startswith("call_"))
    rows = []
    for k, (start, _end) in enumerate(marks):
        nxt = marks[k + 1][0] if k + 1 < len(marks) else float("inf")
        mine = [kr for kr in kernels if start <= kr[0] < nxt]
        if not mine:
            continue
        gaps = sum(max(0.0, mine[j + 1][0] - mine[j][1]) for j in range(len(mine) - 1))
        rows.append({"lead_us": mine[0][0] - start, "gaps_us": gaps,
                     "busy_us": sum(e - s for s, e in mine), "kernels": len(mine),
                     "span_us": max(e for _, e in mine) - start})
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    if chrome is not None:  # the whole timeline (host ops, launches, kernels), gzip-compressed
        raw = chrome.with_suffix("")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(chrome, "wb") as dst:
            dst.write(src.read())
        raw.unlink()
    return rows, table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cell", type=int, nargs=4, default=[32768, 4096, 4096, 16], metavar=("M", "K", "N", "R"))
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--traced", type=int, default=5)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS),
                    help=f"what to profile (default: {' '.join(DEFAULT_VARIANTS)}); base is always profiled")
    ap.add_argument("--adapters", choices=["fp32", "input"], default="fp32",
                    help="the LoRA factors' dtype: fp32 (PEFT's default, cast per call; the default) or the input's "
                         "(as bench_lora_linear builds them)")
    args = ap.parse_args(argv)
    variants = list(dict.fromkeys(["base", *args.variants]))
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    M, K, N, r = args.cell if cuda else [64, 32, 32, 4]
    tensors = build(M, K, N, r, device, dtype, torch.float32 if args.adapters == "fp32" else dtype)
    steps = {v: step_fn(v, *tensors) for v in variants}
    for step in steps.values():  # compile and tune outside every timed loop
        measure.loop_ms(step, calls=1, warmup=2)
    results = []
    for rep in range(args.repetitions):
        for variant in measure.rotation(variants, rep):
            step = steps[variant]
            loop = statistics.median(measure.loop_ms(step, calls=args.calls, warmup=2))
            host = statistics.median(measure.host_ms(step, calls=args.calls, warmup=2))
            rows, table = trace(step, args.traced, cuda)
            summary = {key: statistics.median(r_[key] for r_ in rows) for key in rows[0]} if rows else {}
            results.append({"variant": variant, "rep": rep, "M": M, "K": K, "N": N, "r": r,
                            "loop_ms": loop, "host_ms": host, **summary})
            if rep == 0:
                (out / f"{variant}_host_ops.txt").write_text(table)
            print(results[-1], flush=True)
    measure.write_csv(results, out / "lora_host_profile.csv")


if __name__ == "__main__":
    main()

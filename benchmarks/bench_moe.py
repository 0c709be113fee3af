"""MoE experts benchmark (GPU): transformers eager vs grouped_mm vs lora_lab's fused Triton kernels.

    python benchmarks/bench_moe.py --out outputs/gpu/moe_bench            # everything (~1.5-2 min on an H200)
    python benchmarks/bench_moe.py --out /tmp/moe --tokens 8192 --no-e2e  # one token count, layer only

Writes into --out: moe_numerics.csv, moe_layer_bench.csv, moe_e2e_bench.csv, moe_layer_speed.png,
moe_layer_memory.png and moe_summary.json (the ratios the notebook records).
"""

from __future__ import annotations

import argparse
import os
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MPLBACKEND", "Agg")

from lora_lab.kernels.moe_benchmark import LAYER_SHAPES, run_moe_benchmarks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory for CSV / PNG / JSON")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 32768], help="token counts T")
    parser.add_argument("--shapes", nargs="+", default=list(LAYER_SHAPES), choices=list(LAYER_SHAPES))
    parser.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--eager-tokens", type=int, nargs="*", default=[8192],
                        help="token counts at which the slow eager loop is also timed (empty: every T)")
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end training-step benchmark")
    parser.add_argument("--e2e-steps", type=int, default=3, help="timed end-to-end steps per implementation")
    args = parser.parse_args()

    import torch

    t0 = time.perf_counter()
    print(f"[moe-bench] {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    result = run_moe_benchmarks(
        args.out, tokens=tuple(args.tokens), shapes=tuple(args.shapes), modes=tuple(args.modes),
        e2e=not args.no_e2e, e2e_steps=args.e2e_steps, eager_tokens=tuple(args.eager_tokens) or None,
        log=lambda msg: print(msg, flush=True),
    )
    worst = {}
    for row in result["numerics"]:
        key = (row["impl"], row["mode"])
        worst[key] = min(worst.get(key, 1.0), row["cosine"])
    for (impl, mode), cos in sorted(worst.items()):
        print(f"[moe-bench] numerics {impl:10s} {mode}: worst cosine vs fp32 reference {cos:.6f}")
    summary = result["summary"]
    with open(Path(args.out) / "moe_summary.json", "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
    for key in sorted(summary):
        if "speedup" in key or "peak_ratio" in key or "fraction_of_peak" in key:
            print(f"[moe-bench] {key} = {summary[key]:.3f}")
    print(f"[moe-bench] done in {time.perf_counter() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()

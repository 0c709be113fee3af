"""Benchmark: the MoE expert weight gradients alone — the default kernel, the K-grouped one, ``torch._grouped_mm``.

A kernel profile put the two weight-gradient kernels of the Qwen3-30B-A3B-like layer at 46% of its kernel time
(218 TFLOP/s on an H200). ``bench_moe.py --variants ours_kgrouped`` times the whole layer with the K-grouped kernel;
this script times the two GEMMs themselves, on the same routing the layer would see (softmax router over random
logits, ``fused_moe.random_routing``), bf16:

* ``dW1`` (gate/up): dW1_e = Σ_{j∈e} dGU_jᵀ X[tok_j]   — (E, 2I, H); X gathered by token in the loader;
* ``dW2`` (down):    dW2_e = Σ_{j∈e} (w_j dOut[tok_j])ᵀ h_j — (E, H, I); dOut gathered, the routing weight applied.

Implementations, timed side by side in one process, the order rotating over ``--repetitions`` loops, each a median
of ``measure.loop_ms`` (CUDA events around each call, synchronised after it):

* ``per_tile``, ``per_tile_persistent`` — ``expert_weight_grad`` with ``KernelConfig.moe_weight_grad='per_tile'``
  (the default), ``moe_loads`` 'pointer' / 'persistent' (sorted operands through TMA);
* ``kgrouped``, ``kgrouped_persistent`` — the same with ``moe_weight_grad='kgrouped'``
  (:mod:`lora_lab.kernels.moe.kgrouped_weight_grad`);
* ``grouped_mm`` — what the grouped-GEMM engine runs: ``torch._grouped_mm`` of the sorted 2-D operands, K split at
  the expert offsets, the gather of X / dOut (and the weighting of dOut) included in its time, as that engine
  pays it (where torch has ``_grouped_mm``; a failure is an ``error`` row).

Autotuning is on (``moe_autotune``, ``--untuned`` for the tile table alone); the first call of each implementation
(compile, tuning) is untimed and recorded as ``first_call_s``. TFLOP/s count 2·S·M·N per GEMM (S = T·top-k rows).
Each row carries the relative L2 error of its result against an fp32 reference (a per-expert loop, once per cell).

Writes into --out: moe_weight_grad.csv (one row per cell, GEMM, implementation and repetition ``rep``) and
moe_weight_grad_summary.csv (median ms and TFLOP/s with 95% intervals, the per-repetition speedup over per_tile).

    python benchmarks/bench_moe_weight_grad.py --out DIR --variants all         # the four kernels and grouped_mm
    python benchmarks/bench_moe_weight_grad.py --out DIR --tokens 8192 --variants kgrouped_persistent
    TRITON_INTERPRET=1 python benchmarks/bench_moe_weight_grad.py --out DIR --smoke
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from bench_common import (
    add_common_arguments,
    add_timing_arguments,
    check_device,
    chosen_variants,
    device_line,
    error_text,
    time_call,
    write_summary,
)

from lora_lab.experiments.fused_moe import LAYER_SHAPES, random_routing
from lora_lab.kernels import KernelConfig
from lora_lab.kernels.moe.engine import grouped_mm_available
from lora_lab.kernels.moe.expert_weight_grad import expert_weight_grad, expert_weight_grad_reference
from lora_lab.kernels.moe.launch import row_block_size
from lora_lab.kernels.moe.routing import route_experts
from lora_lab.lab import measure
from lora_lab.numerics import rel_l2

CSV, SUMMARY_CSV = "moe_weight_grad.csv", "moe_weight_grad_summary.csv"
KERNELS = {  # implementation: (moe_weight_grad, moe_loads)
    "per_tile": ("per_tile", "pointer"),
    "per_tile_persistent": ("per_tile", "persistent"),
    "kgrouped": ("kgrouped", "pointer"),
    "kgrouped_persistent": ("kgrouped", "persistent"),
}
VARIANTS = [*KERNELS, "grouped_mm"]
DEFAULT_VARIANTS = ["per_tile", "kgrouped", "grouped_mm"]  # the persistent forms when --variants names them
SHAPE = "qwen3_30b_a3b"
SMOKE = dict(hidden=40, intermediate=24, num_experts=4, top_k=2)  # --smoke: fp32, T = 24, the interpreter
SMOKE_TOKENS = 24


def operands(num_tokens: int, hidden: int, inter: int, routing, dtype, device, seed: int = 0) -> dict:
    """The backward's tensors, drawn on the device: X and dOut (T, H), dGU (S, 2I) and h (S, I) in sorted order."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = routing.num_assignments

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    return {"x": randn(num_tokens, hidden), "dout": randn(num_tokens, hidden), "dgu": randn(rows, 2 * inter),
            "h": randn(rows, inter)}


def gemm_calls(t: dict, routing, row_weight, config_of) -> dict:
    """{(gemm, implementation): zero-argument call}, the kernels with their ``KernelConfig`` (``config_of(impl)``)."""
    calls = {}
    token = routing.sorted_token.long()
    offsets = routing.expert_offsets[1:]  # _grouped_mm's offs: the end of each expert's rows
    sorted_weight = row_weight[routing.sorted_slot.long()]
    for impl in KERNELS:
        c = config_of(impl)
        calls["dW1", impl] = lambda c=c: expert_weight_grad(t["dgu"], t["x"], routing, gather_a=False, gather_b=True,
                                                            config=c)
        calls["dW2", impl] = lambda c=c: expert_weight_grad(t["dout"], t["h"], routing, gather_a=True,
                                                            gather_b=False, row_weight=row_weight, config=c)
    calls["dW1", "grouped_mm"] = lambda: torch._grouped_mm(t["dgu"].t(), t["x"].index_select(0, token), offs=offsets)
    calls["dW2", "grouped_mm"] = lambda: torch._grouped_mm(
        (t["dout"].index_select(0, token) * sorted_weight[:, None]).t(), t["h"], offs=offsets)
    return calls


def references(t: dict, routing, row_weight) -> dict:
    """fp32 per-expert reference of each GEMM (``expert_weight_grad_reference``)."""
    return {
        "dW1": expert_weight_grad_reference(t["dgu"].float(), t["x"].float(), routing, gather_a=False, gather_b=True),
        "dW2": expert_weight_grad_reference(t["dout"].float(), t["h"].float(), routing, gather_a=True,
                                            gather_b=False, row_weight=row_weight.float()),
    }


def bench_cell(num_tokens: int, args, device, dtype) -> list[dict]:
    shape = LAYER_SHAPES[SHAPE].scaled(**SMOKE) if args.smoke else LAYER_SHAPES[SHAPE]
    hidden, inter, experts = shape.hidden, shape.intermediate, shape.num_experts
    index, weights = random_routing(num_tokens, shape, device, dtype)
    block_m = row_block_size(index.numel(), experts, KernelConfig())
    routing = route_experts(index, experts, block_m)
    row_weight = weights.detach().reshape(-1).contiguous()
    t = operands(num_tokens, hidden, inter, routing, dtype, device)
    base = KernelConfig.from_env(moe_autotune=not args.untuned)

    def config_of(impl):
        weight_grad, loads = KERNELS[impl]
        return base.replace(moe_weight_grad=weight_grad, moe_loads=loads)

    calls = gemm_calls(t, routing, row_weight, config_of)
    refs = references(t, routing, row_weight)
    rows_per_gemm = routing.num_assignments
    flops = {"dW1": 2 * rows_per_gemm * 2 * inter * hidden, "dW2": 2 * rows_per_gemm * hidden * inter}
    cell = f"{SHAPE}_t{num_tokens}"
    impls = [i for i in args.variants if i != "grouped_mm" or grouped_mm_available()]
    first, errors, failed = {}, {}, {}
    for (gemm, impl), call in calls.items():  # first calls: compile, tuning, and the error against the reference
        if impl not in impls:
            continue
        try:
            start = time.perf_counter()
            out = call()
            if device.type == "cuda":
                torch.cuda.synchronize()
            first[gemm, impl] = time.perf_counter() - start
            errors[gemm, impl] = rel_l2(out.float(), refs[gemm])
        except Exception as err:  # a kernel that fails to compile or run is a recorded result
            failed[gemm, impl] = error_text(err)
    rows = []
    for rep in range(args.repetitions):
        order = impls[rep % len(impls):] + impls[:rep % len(impls)]
        for gemm in ("dW1", "dW2"):
            for impl in order:
                row = {"cell": cell, "gemm": gemm, "impl": impl, "rep": rep, "tokens": num_tokens,
                       "hidden": hidden, "intermediate": inter, "experts": experts, "top_k": shape.top_k,
                       "untuned": args.untuned, "smoke": args.smoke, "gemm_flops": flops[gemm]}
                if (gemm, impl) in failed:
                    rows.append({**row, "status": "error", "error": failed[gemm, impl], "ms": None})
                    continue
                timing = time_call(calls[gemm, impl], args)
                rows.append({**row, **timing, "status": "ok", "tflops": flops[gemm] / (timing["ms"] * 1e-3) / 1e12,
                             "first_call_s": first[gemm, impl], "rel_l2_vs_fp32": errors[gemm, impl]})
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per (cell, GEMM, implementation): median ms and TFLOP/s with 95% intervals, speedup over per_tile."""
    out = []
    keys = dict.fromkeys((r["cell"], r["gemm"], r["impl"]) for r in rows if r.get("ms") is not None)
    for cell, gemm, impl in keys:
        mine = [r for r in rows if (r["cell"], r["gemm"], r["impl"]) == (cell, gemm, impl) and r["ms"] is not None]
        ms = measure.summarize([r["ms"] for r in mine])
        tflops = measure.summarize([r["tflops"] for r in mine])
        row = {"cell": cell, "gemm": gemm, "impl": impl, "n": ms["n"], "ms": ms["median"], "ms_ci95": ms["ci95"],
               "tflops": tflops["median"], "tflops_ci95": tflops["ci95"],
               "rel_l2_vs_fp32": max(r["rel_l2_vs_fp32"] for r in mine)}
        base = {"cell": cell, "gemm": gemm, "impl": "per_tile"}
        if impl != "per_tile" and any((r["cell"], r["gemm"], r["impl"]) == (cell, gemm, "per_tile")
                                      and r["ms"] is not None for r in rows):
            speedup = measure.ratio_summary(rows, "ms", base, {"cell": cell, "gemm": gemm, "impl": impl})
            row["speedup_vs_per_tile"], row["speedup_ci95"] = speedup["median"], speedup["ci95"]
        out.append(row)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(ap, VARIANTS, DEFAULT_VARIANTS, f"fp32 on a tiny stand-in ({SMOKE}, T = {SMOKE_TOKENS})")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768], help="token counts T")
    ap.add_argument("--untuned", action="store_true", help="moe_autotune off: the kernels' tile table alone")
    add_timing_arguments(ap, secondary=())
    args = ap.parse_args(argv)
    args.variants = chosen_variants(ap, args, VARIANTS, DEFAULT_VARIANTS)
    device = check_device(args.smoke)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    print(device_line(device, dtype, args.repetitions, f"{SHAPE} layer's weight gradients"), flush=True)
    rows = []
    for tokens in ([SMOKE_TOKENS] if args.smoke else args.tokens):
        rows += bench_cell(tokens, args, device, dtype)
        measure.write_csv(rows, Path(args.out) / CSV)  # after every cell: a run cut short keeps its cells
    table = summary(rows)
    write_summary(table, Path(args.out) / SUMMARY_CSV, args)
    for t in table:
        speed = f"{t['speedup_vs_per_tile']:6.3f}x" if "speedup_vs_per_tile" in t else "      -"
        print(f"{t['cell']:>22} {t['gemm']} {t['impl']:>20} {t['ms']:9.4f} ms {t['tflops']:7.1f} TFLOP/s "
              f"{speed} vs per_tile  rel_l2 {t['rel_l2_vs_fp32']:.1e}", flush=True)
    for r in rows:
        if r.get("status") == "error" and r["rep"] == 0:
            print(f"{r['cell']} {r['gemm']} {r['impl']}: {r['error']}", flush=True)


if __name__ == "__main__":
    main()

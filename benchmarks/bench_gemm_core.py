"""Benchmark: the GEMM core of the fused LoRA kernels against cuBLAS, on notebook 05's base GEMM shapes.

Cells: M ∈ {8192, 32768} tokens × (K, N) ∈ {4096×4096, 4096×12288, 12288×4096} (bench_lora_linear.py's grid), bf16,
two GEMMs per cell: the forward ``Y = X Wᵀ`` and the backward's ``dX = dY W``. Implementations, timed side by side
in one process, the order rotating over ``--repetitions`` loops (``measure.kernel_loop_ms`` each:
kernel time of calls queued back to back — a GEMM kernel figure, not a user's step):

* ``cublas`` — ``torch.matmul`` (what the frozen layer runs);
* ``tma`` — ``lora_gemm`` with ``gemm_loads="tma"``: one program per output tile (the kernel the fused LoRA
  linear uses on Hopper today);
* ``persistent`` — ``lora_gemm`` with the persistent TMA kernel (its warp-specialised form was removed: it failed
  to compile on the H200);
* ``<kernel>+lora`` — the same Triton kernels with the rank-``--rank`` term folded in (``+ (X Aᵀ)(s B)ᵀ`` in the
  forward, ``+ (dY B)(s A)`` in dX, the small factors precomputed): what a LoRA layer's GEMM costs over the frozen
  GEMM.

TFLOP/s count 2·M·K·N (the rank term not counted). Each row also carries the relative L2 error of its output
against an fp32 product of the same bf16 operands (computed once per cell). A kernel that fails to compile or
run is a row with status ``error`` and the message, not a crash. The target: the core at >= 97% of cuBLAS's
TFLOP/s on these shapes (``time_vs_cublas`` <= 1/0.97 ≈ 1.031).

Writes into --out: gemm_core.csv (one row per cell, GEMM, implementation and repetition),
gemm_core_summary.csv (median TFLOP/s with its 95% interval, and the per-repetition time ratio to cuBLAS) and
gemm_core.png (TFLOP/s per cell and GEMM, cuBLAS's as a dashed line).

    python benchmarks/bench_gemm_core.py --out DIR
    python benchmarks/bench_gemm_core.py --out DIR --tokens 32768 --shapes 4096x4096 --variants tma persistent
    TRITON_INTERPRET=1 python benchmarks/bench_gemm_core.py --out DIR --smoke
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from bench_common import add_common_arguments, check_device, chosen_variants, device_line, error_text, write_summary

from lora_lab.kernels import KernelConfig
from lora_lab.kernels.lora.gemm import lora_gemm
from lora_lab.lab import measure
from lora_lab.numerics import rel_l2

CSV, SUMMARY_CSV = "gemm_core.csv", "gemm_core_summary.csv"
KERNELS = ["tma", "persistent"]
VARIANTS = ["cublas", *KERNELS, *(f"{k}+lora" for k in KERNELS)]
DEFAULT_VARIANTS = ["cublas", "tma", "persistent", "tma+lora", "persistent+lora"]
GRID = {"tokens": [8192, 32768], "shapes": ["4096x4096", "4096x12288", "12288x4096"]}
SMOKE_DIVISOR = 256  # --smoke: M, K and N / 256 (fp32, interpreter)


def operands(M: int, K: int, N: int, r: int, dtype, device, seed: int = 0) -> dict:
    """The cell's tensors, drawn on the device: X [M, K], W [N, K], dY [M, N] and the rank-r factors."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    return {"x": randn(M, K), "w": randn(N, K, scale=K ** -0.5), "dy": randn(M, N),
            "p": randn(M, r), "bt": randn(r, N, scale=0.1),  # forward: P = X Aᵀ, (s B)ᵀ
            "q": randn(M, r), "a": randn(r, K, scale=0.1)}  # dX: Q = dY B, s A


def calls(t: dict, variant: str, gemm: str, config_by_kernel: dict):
    """A no-argument function computing ``gemm`` ('forward' or 'dx') with ``variant``, writing one output."""
    x, w, dy = t["x"], t["w"], t["dy"]
    out = torch.empty(x.shape[0], w.shape[0] if gemm == "forward" else w.shape[1], dtype=x.dtype, device=x.device)
    if variant == "cublas":
        if gemm == "forward":
            return lambda: torch.matmul(x, w.t(), out=out)
        return lambda: torch.matmul(dy, w, out=out)
    kernel, _, lora = variant.partition("+")
    cfg = config_by_kernel[kernel]
    if gemm == "forward":
        segments, low, rt = [(x, w.t())], t["p"], t["bt"]
    else:
        segments, low, rt = [(dy, w)], t["q"], t["a"]
    if lora:
        return lambda: lora_gemm(out, segments, low, rt, config=cfg)
    return lambda: lora_gemm(out, segments, config=cfg)


def reference(t: dict, gemm: str, lora: bool) -> torch.Tensor:
    """fp32 product of the same (rounded) operands."""
    if gemm == "forward":
        y = t["x"].float() @ t["w"].float().t()
        return y + t["p"].float() @ t["bt"].float() if lora else y
    y = t["dy"].float() @ t["w"].float()
    return y + t["q"].float() @ t["a"].float() if lora else y


def bench_cell(label: str, M, K, N, variants, args, dtype, device) -> list[dict]:
    t = operands(M, K, N, args.rank, dtype, device)
    configs = {k: KernelConfig.from_env(dispatch="triton", gemm_loads=k, autotune=not args.smoke) for k in KERNELS}
    base = dict(cell=label, M=M, K=K, N=N, r=args.rank, smoke=args.smoke)
    rows = []
    for gemm in ("forward", "dx"):
        flops = 2.0 * M * K * N
        refs = {lora: reference(t, gemm, lora) for lora in (False, True)}
        fns, once = {}, {}
        for v in variants:  # warm-up (autotune, compile) and the error against fp32, untimed
            try:
                fn = calls(t, v, gemm, configs)
                out = fn()
                once[v] = dict(status="ok", error=None, rel_l2_vs_fp32=rel_l2(out, refs["+lora" in v]))
                fns[v] = fn
            except Exception as exc:  # noqa: BLE001 - a kernel that does not build here is a result
                once[v] = dict(status="error", error=error_text(exc), rel_l2_vs_fp32=None)
        del refs
        for rep in range(args.repetitions):
            for v in measure.rotation(list(fns), rep):
                ms = measure.kernel_loop_ms(fns[v], args.warmup_ms, args.rep_ms)
                rows.append(dict(base, gemm=gemm, variant=v, rep=rep, ms=ms, tflops=flops / (ms * 1e-3) / 1e12,
                                 **once[v]))
            rows += [dict(base, gemm=gemm, variant=v, rep=rep, ms=None, tflops=None, **once[v])
                     for v in variants if v not in fns]
        print(f"{base['cell']} {gemm}: " + "  ".join(
            f"{v} {statistics.median(r['tflops'] for r in rows if r['gemm'] == gemm and r['variant'] == v):.3g}"
            for v in fns) + " TFLOP/s (medians)"
            + "".join(f"\n    {v}: {once[v]['error']}" for v in variants if v not in fns), flush=True)
    return rows


def summary_rows(rows: list[dict]) -> list[dict]:
    """Per (cell, GEMM, variant): median TFLOP/s with its interval, and the per-repetition time ratio to cuBLAS."""
    out = []
    for cell, gemm, variant in dict.fromkeys((r["cell"], r["gemm"], r["variant"]) for r in rows):
        mine = [r for r in rows if (r["cell"], r["gemm"], r["variant"]) == (cell, gemm, variant)]
        entry = dict(cell=cell, gemm=gemm, variant=variant, status=mine[0]["status"],
                     rel_l2_vs_fp32=mine[0]["rel_l2_vs_fp32"])
        tflops = [r["tflops"] for r in mine if r["tflops"] is not None]
        if tflops:
            s = measure.summarize(tflops)
            entry.update(tflops=s["median"], tflops_ci95_low=s["ci95"][0], tflops_ci95_high=s["ci95"][1], n=s["n"])
        cublas = [r for r in rows if (r["cell"], r["gemm"], r["variant"]) == (cell, gemm, "cublas")]
        if tflops and cublas and variant != "cublas":
            ratio = measure.summarize(measure.repetition_ratios(
                rows, "ms", {"cell": cell, "gemm": gemm, "variant": variant},
                {"cell": cell, "gemm": gemm, "variant": "cublas"}))
            entry.update(time_vs_cublas=ratio["median"], time_vs_cublas_ci95_low=ratio["ci95"][0],
                         time_vs_cublas_ci95_high=ratio["ci95"][1])
        out.append(entry)
    return out


def plot(summary: list[dict], out: Path) -> None:
    """TFLOP/s per cell and GEMM, one bar per variant (95% interval as error bar), cuBLAS's median as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((s["cell"], s["gemm"]) for s in summary))
    variants = [v for v in VARIANTS if any(s["variant"] == v and s.get("tflops") is not None for s in summary)]
    width = 0.8 / max(1, len(variants))
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(keys)), 4.5))
    for k, v in enumerate(variants):
        xs, ys, lo, hi = [], [], [], []
        for i, key in enumerate(keys):
            s = next((s for s in summary if (s["cell"], s["gemm"], s["variant"]) == (*key, v)), None)
            if s and s.get("tflops") is not None:
                xs.append(i + (k - (len(variants) - 1) / 2) * width)
                ys.append(s["tflops"])
                lo.append(s["tflops"] - s["tflops_ci95_low"])
                hi.append(s["tflops_ci95_high"] - s["tflops"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=v)
    for i, key in enumerate(keys):
        s = next((s for s in summary if (s["cell"], s["gemm"], s["variant"]) == (*key, "cublas")), None)
        if s and s.get("tflops") is not None:
            ax.hlines(s["tflops"], i - 0.45, i + 0.45, colors="k", linestyles="--", lw=1)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([f"{c}\n{g}" for c, g in keys], fontsize=8)
    ax.set_ylabel("TFLOP/s (median over repetitions; dashed: cuBLAS)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "gemm_core.png", dpi=120)
    plt.close(fig)


def main(argv=None):
    start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(ap, VARIANTS, ["cublas"],
                         "the whole code path on tiny stand-ins of the cells (M, K, N / 256), fp32")
    ap.add_argument("--tokens", type=int, nargs="+", default=GRID["tokens"], help="values of M")
    ap.add_argument("--shapes", nargs="+", default=GRID["shapes"], help="KxN of the weight (N x K)")
    ap.add_argument("--rank", type=int, default=16, help="rank of the folded LoRA term (the +lora variants)")
    ap.add_argument("--rep-ms", type=float, default=100.0, help="measure.kernel_loop_ms: milliseconds of timed calls")
    ap.add_argument("--warmup-ms", type=float, default=25.0, help="measure.kernel_loop_ms: milliseconds of warm-up")
    ap.set_defaults(variants=DEFAULT_VARIANTS)
    args = ap.parse_args(argv)
    variants = chosen_variants(ap, args, VARIANTS, ["cublas"])
    device = check_device(args.smoke)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(device_line(device, dtype, args.repetitions, f"variants {' '.join(variants)}"), flush=True)
    rows = []
    for M in args.tokens:
        for shape in args.shapes:  # smoke: M / 256 + 1 (odd), K and N / 256
            K, N = (int(v) for v in shape.split("x"))
            label = f"{M // 1024}k_{K}x{N}"  # the cell's name: its real sizes, also for a smoke stand-in
            m, k, n = (M // SMOKE_DIVISOR + 1, K // SMOKE_DIVISOR, N // SMOKE_DIVISOR) if args.smoke else (M, K, N)
            rows += bench_cell(label, m, k, n, variants, args, dtype, device)
            measure.write_csv(rows, out / CSV)  # after every cell: a run cut short keeps its cells
            if device.type == "cuda":
                torch.cuda.empty_cache()
    summary = summary_rows(rows)
    write_summary(summary, out / SUMMARY_CSV, args)
    plot(summary, out)
    print(f"{'cell':>16} {'gemm':>8} {'variant':>20} {'TFLOP/s':>8} {'vs cuBLAS (time)':>18} {'rel L2':>9}")
    for s in summary:
        ratio = f"{s['time_vs_cublas']:.3f}" if s.get("time_vs_cublas") is not None else "-"
        err = f"{s['rel_l2_vs_fp32']:.1e}" if s.get("rel_l2_vs_fp32") is not None else s["status"]
        print(f"{s['cell']:>16} {s['gemm']:>8} {s['variant']:>20} {s.get('tflops', float('nan')):8.1f} {ratio:>18} "
              f"{err:>9}")
    print(f"wrote {out / CSV} ({len(rows)} rows) in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()

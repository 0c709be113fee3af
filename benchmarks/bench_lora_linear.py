"""Benchmark: one LoRA projection, forward + backward, bf16, on the GPU.

Variants, side by side in one process on the same X and dY:
  base          frozen nn.Linear (Y = X Wᵀ, dX = dY W: two GEMMs)
  peft          PEFT lora.Linear, default settings (fp32 adapters → X cast bf16→fp32→bf16)
  peft_nocast   PEFT lora.Linear with bf16 adapters (no input-dtype cast)
  chained       chained-cuBLAS autograd Function (lora_lab.kernels.chained_lora_linear)
  fused         lora_lab.kernels.fused_lora_linear as shipped (Triton, rank-r term folded into the GEMMs; the
                same formulas as cuBLAS calls below a GEMM-size threshold, see lora_linear.engine_for)
  fused_triton  the same with the Triton kernels at every shape (LORA_LAB_DISPATCH=triton)
  fused_overlap, fused_qdb, fused_qdb_overlap   the same kernels with experimental switches: dA/dB on a
                side CUDA stream during the dX GEMM; Q and dB in one pass over dY (atomic adds)
  fused_cublas_base, fused_cublas_base_overlap  the big GEMMs by cuBLAS onto a Triton-written rank-r term
                (LORA_LAB_BASE_GEMM=cublas: Y = P Bᵀ, then Y += X Wᵀ with β = 1; the same for dX)

Writes <out>/05_lora_linear.csv (one row per cell and variant), <out>/05_lora_linear_components.csv (where
the fused kernel's time goes, next to cuBLAS for the same GEMMs) and two plots.

    python benchmarks/bench_lora_linear.py --out outputs/gpu            # the issue's grid
    python benchmarks/bench_lora_linear.py --out DIR --quick            # M = 32768, 4096×4096 only
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # lora_lab without installing
from bench_timing import environment_line, median_ms, out_dir, peak_bytes, set_kernel_switches, write_csv  # noqa: E402
from lora_lab.layer import SingleChild, fill_lora_B  # noqa: E402


# environment switches of lora_lab.kernels.lora_linear per fused variant (the rest as shipped)
VARIANT_ENV = {
    "fused": {},  # what fused_lora_linear ships: Triton, or cuBLAS calls for small GEMMs (engine_for)
    "fused_triton": {"DISPATCH": "triton"},  # the Triton kernels at every shape
    "fused_overlap": {"OVERLAP": "1"},  # dA/dB on a side stream
    "fused_qdb": {"FUSE_QDB": "1"},  # Q and dB in one pass over dY
    "fused_qdb_overlap": {"OVERLAP": "1", "FUSE_QDB": "1"},
    "fused_cublas_base": {"BASE_GEMM": "cublas"},  # cuBLAS GEMM, rank-r term in its epilogue
    "fused_cublas_base_overlap": {"BASE_GEMM": "cublas", "OVERLAP": "1"},
}


def set_variant_env(name):
    set_kernel_switches(**VARIANT_ENV.get(name, {}))


def peft_projection(lin: nn.Linear, r: int, alpha: float, fp32_adapters: bool):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=["proj"], lora_dropout=0.0)
    model = get_peft_model(SingleChild(lin, "proj"), cfg, autocast_adapter_dtype=fp32_adapters)
    fill_lora_B(model, 0.02)
    return model, model.base_model.model.proj


def make_variants(M, K, N, r, dtype=torch.bfloat16, device="cuda"):
    from lora_lab.kernels import chained_lora_linear, fused_lora_linear

    torch.manual_seed(0)
    alpha = 2.0 * r
    s = alpha / r
    lin = nn.Linear(K, N, bias=False, device=device, dtype=dtype)
    lin.weight.requires_grad_(False)
    A = nn.Parameter(torch.randn(r, K, device=device, dtype=dtype) / K**0.5)
    B = nn.Parameter(torch.randn(N, r, device=device, dtype=dtype) * 0.02)
    peft_model, peft_layer = peft_projection(nn.Linear(K, N, bias=False, device=device, dtype=dtype), r, alpha, True)
    peft_layer.base_layer.weight.data = lin.weight.data
    nocast_model, nocast_layer = peft_projection(nn.Linear(K, N, bias=False, device=device, dtype=dtype), r, alpha,
                                                 False)
    nocast_layer.base_layer.weight.data = lin.weight.data
    nocast_layer.lora_A.to(dtype)  # adapters in the input's dtype: PEFT then casts nothing
    nocast_layer.lora_B.to(dtype)
    nocast_layer.cast_input_dtype_enabled = False
    variants = {
        "base": (lambda x: lin(x), []),
        "peft": (lambda x: peft_model(x), [p for p in peft_model.parameters() if p.requires_grad]),
        "peft_nocast": (lambda x: nocast_model(x), [p for p in nocast_model.parameters() if p.requires_grad]),
        "chained": (lambda x: chained_lora_linear(x, lin.weight, None, A, B, s), [A, B]),
        "fused": (lambda x: fused_lora_linear(x, lin.weight, None, A, B, s), [A, B]),
    }
    # the same kernels with the experimental switches (see VARIANT_ENV)
    for name in VARIANT_ENV:
        if name != "fused":
            variants[name] = variants["fused"]
    info = {"peft_adapter_dtype": str(peft_layer.lora_A["default"].weight.dtype),
            "peft_nocast_adapter_dtype": str(nocast_layer.lora_A["default"].weight.dtype)}
    return variants, info, (lin, A, B, s)


def measure_cell(M, K, N, r, rep, warmup, only=None, components=True):
    dtype = torch.bfloat16
    x = torch.randn(M, K, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(M, N, device="cuda", dtype=dtype)
    variants, info, parts = make_variants(M, K, N, r)
    if only:  # a subset (the ratios need base and peft)
        keep = {"base", "peft", *only}
        variants = {k: v for k, v in variants.items() if k in keep}
    rows = []
    for name, (f, params) in variants.items():
        set_variant_env(name)

        def step():
            f(x).backward(dy)

        def fwd():
            with torch.no_grad():
                f(x)

        step()  # compile / autotune outside the timed region
        t_step = median_ms(step, grad_to_none=[x] + params, warmup=warmup, rep=rep)
        t_fwd = median_ms(fwd, warmup=warmup, rep=rep)
        x.grad = None
        for p in params:
            p.grad = None
        peak, before = peak_bytes(step)
        x.grad = None
        for p in params:
            p.grad = None
        rows.append({"M": M, "K": K, "N": N, "r": r, "variant": name, "fwd_ms": round(t_fwd, 4),
                     "fwd_bwd_ms": round(t_step, 4), "peak_bytes": peak, "resident_bytes": before, **info})
        set_variant_env("fused")
        print(f"M={M} K={K} N={N} r={r} {name:12s} fwd {t_fwd:7.3f} ms  fwd+bwd {t_step:7.3f} ms  "
              f"peak {peak / 2**20:8.1f} MiB", flush=True)
    base = next(r_ for r_ in rows if r_["variant"] == "base")
    peft = next(r_ for r_ in rows if r_["variant"] == "peft")
    for row in rows:
        row["time_vs_base"] = round(row["fwd_bwd_ms"] / base["fwd_bwd_ms"], 4)
        row["time_vs_peft"] = round(row["fwd_bwd_ms"] / peft["fwd_bwd_ms"], 4)
        row["peak_vs_base"] = round(row["peak_bytes"] / base["peak_bytes"], 4)
    comps = measure_components(x.detach(), dy, *parts, rep=rep, warmup=warmup) if components else {}
    comps.update({"M": M, "K": K, "N": N, "r": r})
    del x, dy, variants
    torch.cuda.empty_cache()
    return rows, comps


def measure_components(x, dy, lin, A, B, s, rep, warmup):
    """Where the fused step's time goes, and cuBLAS for the same two big GEMMs."""
    from lora_lab.kernels.lora_linear import lora_gemm, q_and_db, rank_projection, rank_reduction

    M, K = x.shape
    N = lin.weight.shape[0]
    W = lin.weight
    a, b = A.detach(), B.detach()
    p = rank_projection(x, a.t(), s)
    q = rank_projection(dy, b, s)
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    dx = torch.empty(M, K, device=x.device, dtype=x.dtype)
    def bench(fn):
        try:
            return median_ms(fn, warmup=warmup, rep=rep)
        except Exception as err:  # one failing variant must not lose the others
            print("   component failed:", type(err).__name__, str(err)[:200], flush=True)
            return float("nan")

    c = {
        "cublas_fwd_gemm_ms": bench(lambda: torch.mm(x, W.t())),
        "cublas_dx_gemm_ms": bench(lambda: torch.mm(dy, W)),
        # cuBLAS base GEMM, then the rank-r term added in place (one more read+write of Y)
        "cublas_fwd_plus_addmm_ms": bench(lambda: torch.mm(x, W.t()).addmm_(p, b.t())),
        "cublas_dx_plus_addmm_ms": bench(lambda: torch.mm(dy, W).addmm_(q, a)),
        # LORA_LAB_BASE_GEMM=cublas: the rank-r term written by Triton, then cuBLAS adds the GEMM (beta = 1)
        "lowrank_fill_fwd_ms": bench(lambda: lora_gemm(y, [(p, b.t())])),
        "cublas_beta1_fwd_gemm_ms": bench(lambda: y.addmm_(x, W.t())),
        "lowrank_fill_dx_ms": bench(lambda: lora_gemm(dx, [(q, a)])),
        "cublas_beta1_dx_gemm_ms": bench(lambda: dx.addmm_(dy, W)),
        "triton_fwd_gemm_ms": bench(lambda: lora_gemm(y, [(x, W.t())], low=p, rt=b.t())),
        "triton_fwd_gemm_tma_ms": bench(lambda: lora_gemm(y, [(x, W.t())], low=p, rt=b.t(), impl="tma")),
        "triton_fwd_gemm_pointer_ms": bench(lambda: lora_gemm(y, [(x, W.t())], low=p, rt=b.t(), impl="pointer")),
        "triton_fwd_gemm_nolowrank_ms": bench(lambda: lora_gemm(y, [(x, W.t())])),
        "triton_dx_gemm_ms": bench(lambda: lora_gemm(dx, [(dy, W)], low=q, rt=a)),
        "triton_dx_gemm_tma_ms": bench(lambda: lora_gemm(dx, [(dy, W)], low=q, rt=a, impl="tma")),
        "triton_dx_gemm_pointer_ms": bench(lambda: lora_gemm(dx, [(dy, W)], low=q, rt=a, impl="pointer")),
        "p_pass_ms": bench(lambda: rank_projection(x, a.t(), s)),
        "q_pass_ms": bench(lambda: rank_projection(dy, b, s)),
        "db_pass_ms": bench(lambda: rank_reduction(p, dy)),
        "q_db_one_pass_ms": bench(lambda: q_and_db(dy, b, p, s)),
        "da_pass_ms": bench(lambda: rank_reduction(q, x)),
        "cublas_p_mm_ms": bench(lambda: torch.mm(x, a.t())),
        "cublas_q_mm_ms": bench(lambda: torch.mm(dy, b)),
        "cublas_db_mm_ms": bench(lambda: torch.mm(dy.t(), p)),
        "cublas_da_mm_ms": bench(lambda: torch.mm(q.t(), x)),
    }
    c = {k: round(v, 4) for k, v in c.items()}
    flops = 2.0 * M * N * K
    c["cublas_fwd_tflops"] = round(flops / c["cublas_fwd_gemm_ms"] / 1e9, 1)
    c["triton_fwd_tflops"] = round(flops / c["triton_fwd_gemm_ms"] / 1e9, 1)
    from lora_lab.kernels import lora_linear as ll

    c["tma_disabled_reason"] = ll._TMA_STATE.get(torch.bfloat16) or ""

    def best(kernel):
        cfg = getattr(kernel, "best_config", None)
        return "" if cfg is None else f"{cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages}"

    # the tile each kernel's autotuner picked for its last launch (the dX GEMM measured just above)
    c["best_tma_gemm"] = best(ll._lora_gemm_tma_kernel)
    c["best_pointer_gemm"] = best(ll._lora_gemm_kernel)
    c["best_rank_projection"] = best(ll._rank_projection_kernel)
    c["best_rank_reduction"] = best(ll._rank_reduction_kernel)
    print("   components:", c, flush=True)
    return c


def plot(rows, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = {r["variant"] for r in rows}
    variants = [v for v in ["peft", "peft_nocast", "chained"] + list(VARIANT_ENV) if v in present]
    cells = sorted({(r["M"], r["K"], r["N"], r["r"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(8, len(cells) * 0.9), 4.5))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        vals = [next(r["time_vs_base"] for r in rows if (r["M"], r["K"], r["N"], r["r"]) == c and r["variant"] == v)
                for c in cells]
        ax.bar([j + i * width for j in range(len(cells))], vals, width, label=v)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.05, color="r", lw=0.8, ls="--", label="target 1.05× base")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cells))])
    ax.set_xticklabels([f"M={c[0] // 1024}k\n{c[1]}×{c[2]}\nr={c[3]}" for c in cells], fontsize=7)
    ax.set_ylabel("fwd+bwd time / frozen base")
    ax.set_title("One LoRA projection, bf16: time relative to the frozen nn.Linear")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "05_lora_linear_ratio.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    shapes = sorted({(r["K"], r["N"]) for r in rows})
    for ax, (K, N) in zip(axes, shapes):
        for v in ["base"] + variants:
            pts = sorted((r["M"], r["fwd_bwd_ms"]) for r in rows
                         if r["K"] == K and r["N"] == N and r["variant"] == v and r["r"] == 16)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=v)
        ax.set_title(f"K×N = {K}×{N}, r=16")
        ax.set_xlabel("tokens M")
        ax.set_ylabel("fwd+bwd ms")
        ax.set_xscale("log", base=2)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "05_lora_linear_time_vs_tokens.png", dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output directory (default outputs/gpu)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768], help="values of M")
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "4096x12288", "12288x4096"], help="K x N")
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up (ms)")
    ap.add_argument("--quick", action="store_true", help="M=32768, 4096x4096, r=16 only")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="measure only these variants (base and peft always; default: all)")
    ap.add_argument("--components", choices=["all", "target", "none"], default="all",
                    help="per-kernel breakdown for every cell, only the target cell (M=32768, 4096x4096, r=16), "
                         "or none")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_lora_linear needs a CUDA GPU")
    if args.quick:
        args.tokens, args.shapes, args.ranks = [32768], ["4096x4096"], [16]
    out = out_dir(args.out)
    print(environment_line(), flush=True)
    rows, comps = [], []
    for M in args.tokens:
        for shape in args.shapes:
            K, N = (int(v) for v in shape.lower().split("x"))
            for r in args.ranks:
                cr, cc = measure_cell(M, K, N, r, args.rep, args.warmup, args.variants,
                                      args.components == "all" or (args.components == "target" and
                                                                   (M, K, N, r) == (32768, 4096, 4096, 16)))
                rows += cr
                if len(cc) > 4:  # more than the cell's M, K, N, r
                    comps.append(cc)
                write_csv(rows, out / "05_lora_linear.csv")
                if comps:
                    write_csv(comps, out / "05_lora_linear_components.csv")
    plot(rows, out)
    print("wrote", out / "05_lora_linear.csv")


if __name__ == "__main__":
    main()

"""Does a reduction over the tokens lose a token? dB = dYᵀ P at odd token counts, computed five ways.

lora_lab splits its reductions over the tokens (``lora_lab.kernels.lora.linear._wide_mm``) because cuBLAS once
returned dYᵀ P without the last token's term at some odd token counts (the note at ``REDUCTION_ALIGN``). This probe
measures whether that happens on the device it runs on, and whom it reaches: per cell (tokens M, width N, rank r;
bf16 operands) the relative L2 error, against the product in fp64 of the same bf16 operands, of

* ``cublas``: ``dY.t() @ P`` in bf16, as autograd's matrix-product backward computes a weight's gradient;
* ``cublas_fp32_out``: the same call with an fp32 result, where the build has one (else as ``cublas``);
* ``cublas_contiguous``: ``dY.t().contiguous() @ P``;
* ``lora_lab``: ``_wide_mm(dY.t(), P)``, what lora_lab's routes call;
* ``peft_lora_B``: a PEFT ``lora.Linear``'s ``lora_B`` gradient after one forward and backward (adapters in bf16,
  input cast off; P = X Aᵀ as PEFT rounds it, the upstream gradient dY · s), against s·dYᵀ P in fp64;

each as two ledger figures: ``rel_l2`` (against the whole product) and ``rel_l2_without_last`` (against the product
without the last token's term: near zero, and far below ``rel_l2``, when that term is what is missing).

    python tools/token_reduction_probe.py [--ledger FILE.csv]          # the cells below, on CUDA
    python tools/token_reduction_probe.py --smoke                      # tiny cells, any device (the code path)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lora_lab.numerics import rel_l2  # noqa: E402 - after the checkout is on the path

TOKENS, WIDTHS, RANKS = (4096, 4097, 8193), (2048, 2056, 2064, 4104), (16, 64)
SMOKE_TOKENS, SMOKE_WIDTHS, SMOKE_RANKS = (64, 65), (24,), (4,)
PEFT_IN = 1032  # the input width of the PEFT layer (K), as in the GPU test that found the missing term
SCALING = 2.0  # lora_alpha = 2 r: exact in bf16
METHODS = ("cublas", "cublas_fp32_out", "cublas_contiguous", "lora_lab", "peft_lora_B")


def references(upstream, p) -> tuple:
    """(Σ_t upstreamᵀ p in fp64, the same without the last token's term) of bf16 ``upstream`` (M×N) and ``p``."""
    upstream, p = upstream.double(), p.double()
    full = upstream.t() @ p
    return full, full - upstream[-1:].t() @ p[-1:]


def products(torch, dy, p) -> dict:
    """{method: dYᵀ P} of the four direct methods (module docstring)."""
    from lora_lab.kernels.lora.linear import _mm_fp32_out, _wide_mm

    return {"cublas": dy.t() @ p, "cublas_fp32_out": _mm_fp32_out(dy.t(), p),
            "cublas_contiguous": dy.t().contiguous() @ p, "lora_lab": _wide_mm(dy.t(), p)}


def peft_lora_b(torch, M: int, N: int, r: int, device, dtype, seed: int = 0):
    """(PEFT's lora_B gradient, the fp64 product s·dYᵀ P of the P and dY it used, the same without the last
    token's term)."""
    from peft import LoraConfig, get_peft_model

    gen = torch.Generator(device=device).manual_seed(seed)
    holder = torch.nn.Sequential()
    holder.add_module("proj", torch.nn.Linear(PEFT_IN, N, bias=False))
    model = get_peft_model(holder, LoraConfig(r=r, lora_alpha=int(SCALING * r), target_modules=["proj"],
                                              lora_dropout=0.0), autocast_adapter_dtype=False)
    model.to(device=device, dtype=dtype)
    layer = model.base_model.model.proj
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(torch.randn(r, PEFT_IN, generator=gen, device=device) / PEFT_IN ** 0.5)
        layer.lora_B["default"].weight.copy_(torch.randn(N, r, generator=gen, device=device) * 0.02)
    x = torch.randn(M, PEFT_IN, generator=gen, device=device).to(dtype)
    dy = torch.randn(M, N, generator=gen, device=device).to(dtype)
    layer(x).backward(dy)
    with torch.no_grad():
        p = layer.lora_A["default"](x)  # P as PEFT computed it (the same call, the same rounding)
    return (layer.lora_B["default"].weight.grad, *references(dy * SCALING, p))


def probe_cell(torch, M: int, N: int, r: int, device, dtype, seed: int = 0) -> dict:
    """{method: (rel_l2, rel_l2_without_last)} at one cell."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dy = torch.randn(M, N, generator=gen, device=device).to(dtype)
    p = (torch.randn(M, r, generator=gen, device=device) * 0.1).to(dtype)
    full, without_last = references(dy, p)
    out = {name: (rel_l2(value, full), rel_l2(value, without_last))
           for name, value in products(torch, dy, p).items()}
    grad, reference, reference_without_last = peft_lora_b(torch, M, N, r, device, dtype, seed)
    out["peft_lora_B"] = (rel_l2(grad, reference), rel_l2(grad, reference_without_last))
    return out


def ledger_rows(results: dict) -> list[dict]:
    """Ledger rows of ``results`` ({(M, N, r): {method: (rel_l2, rel_l2_without_last)}})."""
    rows = []
    for (M, N, r), by_method in results.items():
        cell = f"M={M};N={N};r={r};dtype=bfloat16"
        for method, (whole, without_last) in by_method.items():
            for statistic, value in (("rel_l2", whole), ("rel_l2_without_last", without_last)):
                rows.append({"benchmark": "token_reduction_probe", "cell": cell, "method": method,
                             "statistic": statistic, "value": value, "unit": "ratio",
                             "source": "tools/token_reduction_probe.py"})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny cells on any device: the code path only")
    ap.add_argument("--ledger", help="append the figures to this measurement ledger (a CSV file)")
    args = ap.parse_args(argv)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("token_reduction_probe: needs a CUDA device (--smoke runs the code path anywhere)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cells = [(M, N, r) for M in (SMOKE_TOKENS if args.smoke else TOKENS)
             for N in (SMOKE_WIDTHS if args.smoke else WIDTHS) for r in (SMOKE_RANKS if args.smoke else RANKS)]
    results = {cell: probe_cell(torch, *cell, device, torch.bfloat16) for cell in cells}
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}: relative L2 against fp64 (in brackets: against the product without "
          "the last token's term)")
    print(f"{'M':>6s} {'N':>5s} {'r':>3s}  " + "  ".join(f"{m:>24s}" for m in METHODS))
    for (M, N, r), by_method in results.items():
        texts = [f"{w:.2e} [{o:.2e}]" for w, o in (by_method[m] for m in METHODS)]
        print(f"{M:6d} {N:5d} {r:3d}  " + "  ".join(f"{t:>24s}" for t in texts))
    if args.ledger:
        from lora_lab.lab.ledger import append_measurements

        print("appended to", append_measurements(ledger_rows(results), ledger=args.ledger))
    return 0


if __name__ == "__main__":
    sys.exit(main())

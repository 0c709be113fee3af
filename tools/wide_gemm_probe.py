"""What does cuBLAS charge for a reduction a few columns deeper, and does the row stride of the operand matter?

The widened LoRA route (``KernelConfig(base_gemm="wide")``) runs the layer's two GEMMs over K + r and N + r instead
of K and N, with r padded to a multiple of 8 (``widened.padded_rank``). Its components table on an H100 gave the
forward GEMM over 4,096 + 16 columns well above the frozen layer's over 4,096, far more than the 0.4% of extra work.
Candidate causes: a depth that is no multiple of cuBLAS's K tile (its last tile mostly empty, or a slower
kernel picked for the remainder), and a row stride of the widened operand ((K + r) · 2 bytes) that is 16-byte but
not 128-byte aligned. This tool separates them: the same two products as the route,

    forward  [M × (D + e)] · [N × (D + e)]ᵀ   (torch.mm(x, w.t()), the widened X against [W | B])
    dX       [M × (N + e)] · [(N + e) × D]    (torch.mm(dy, w), the widened dY against [W ; A])

for extra columns e (0 is the frozen layer's product), each with the activation's rows packed (stride D + e) or
padded in memory to a multiple of ``--stride-multiple`` elements (the columns used are the same; only the stride
moves). All variants of one form are timed in turns (``interleaved_loop_ms``: each call between CUDA events and
synchronised, as a user's loop), ``--repetitions`` rounds of ``--calls`` each; the ledger gets each variant's
median with its 95% interval, and its ratio to e = 0 (the per-round ratio of medians, summarised the same way).

    python tools/wide_gemm_probe.py [--rows 32768] [--depth 4096] [--out-features 4096] [--extras 0 8 16 64 128]
                                    [--stride-multiple 64] [--repetitions 7] [--calls 10] [--ledger FILE.csv]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FORMS = ("forward", "dx")


def padded_stride(cols: int, multiple: int) -> int:
    """``cols`` rounded up to a multiple of ``multiple`` (elements)."""
    return -(-cols // multiple) * multiple


def operands(torch, form: str, rows: int, depth: int, out_features: int, extra: int, stride: int | None,
             device: str, dtype, seed: int = 0):
    """(activation, weight) of ``form`` with ``extra`` more reduction columns; the activation's rows ``stride``
    elements apart in memory (None: packed)."""
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}: {FORMS}")
    gen = torch.Generator().manual_seed(seed)
    inner = (depth if form == "forward" else out_features) + extra  # the reduction's length
    other = out_features if form == "forward" else depth
    stride = inner if stride is None else stride
    if stride < inner:
        raise ValueError(f"stride {stride} is shorter than the row ({inner} elements)")
    buf = torch.randn(rows, stride, generator=gen).to(device, dtype)
    act = buf[:, :inner]
    weight = (torch.randn(other, inner, generator=gen) / inner ** 0.5).to(device, dtype)
    if form == "dx":
        weight = weight.t().contiguous()  # [(N + e) × D], row-major as [W ; A] is built
    return act, weight


def product(torch, form: str, act, weight):
    return torch.mm(act, weight.t()) if form == "forward" else torch.mm(act, weight)


def variants(extras, stride_multiple: int | None) -> list[tuple[int, str]]:
    """(extra columns, layout) pairs: each extra packed, and padded where that changes the stride."""
    out = []
    for e in extras:
        out.append((e, "packed"))
        if stride_multiple:
            out.append((e, f"stride{stride_multiple}"))
    return out


def probe(torch, rows: int, depth: int, out_features: int, extras, stride_multiple: int | None, repetitions: int,
          calls: int, device: str = "cuda", dtype=None) -> list[dict]:
    """One result per form and variant: its per-round medians (ms) and its per-round ratios to e = 0 packed."""
    from lora_lab.lab.measure import interleaved_loop_ms

    dtype = dtype or torch.bfloat16
    extras = sorted(set([0, *extras]))
    results = []
    for form in FORMS:
        fns, reference = {}, None
        for e, layout in variants(extras, stride_multiple):
            inner = (depth if form == "forward" else out_features) + e
            stride = None if layout == "packed" else padded_stride(inner, stride_multiple)
            if layout != "packed" and stride == inner:
                continue  # already a multiple: the packed variant is this one
            act, weight = operands(torch, form, rows, depth, out_features, e, stride, device, dtype)
            key = (e, layout, act.stride(0))
            fns[key] = (lambda a=act, w=weight, f=form: product(torch, f, a, w))
            if e == 0 and layout == "packed":
                reference = key
        rounds = {key: [] for key in fns}
        for _ in range(repetitions):
            times = interleaved_loop_ms(fns, calls=calls, warmup=1)
            for key, samples in times.items():
                rounds[key].append(statistics.median(samples))
        for key, medians in rounds.items():
            e, layout, stride = key
            results.append({"form": form, "extra": e, "layout": layout, "stride": stride, "ms": medians,
                            "ratio": [m / r for m, r in zip(medians, rounds[reference])]})
    return results


def ledger_rows(results, rows: int, depth: int, out_features: int) -> list[dict]:
    """Each variant's median time and its ratio to e = 0 (method ``<variant>/extra0``), with 95% intervals."""
    from lora_lab.lab.ledger import summary_figures
    from lora_lab.lab.measure import summarize

    out = []
    for r in results:
        cell = f"M={rows};K={depth};N={out_features};form={r['form']};extra={r['extra']};dtype=bfloat16"
        method = f"cublas_{r['layout']}_ld{r['stride']}"
        for values, unit, name in ((r["ms"], "ms", method), (r["ratio"], "ratio", f"{method}/extra0")):
            out += summary_figures(summarize(values), benchmark="wide_gemm_probe", cell=cell, method=name, unit=unit,
                                   source="tools/wide_gemm_probe.py")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--out-features", type=int, default=4096)
    ap.add_argument("--extras", type=int, nargs="+", default=[8, 16, 64, 128])
    ap.add_argument("--stride-multiple", type=int, default=64, help="elements; 0: packed rows only")
    ap.add_argument("--repetitions", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--ledger", help="append the results to this measurement ledger (a CSV file)")
    args = ap.parse_args(argv)
    if min(args.rows, args.depth, args.out_features, args.repetitions, args.calls) < 1 or min(args.extras) < 0:
        ap.error("--rows, --depth, --out-features, --repetitions and --calls must be positive, --extras >= 0")
    if args.stride_multiple < 0 or args.stride_multiple % 8:
        ap.error("--stride-multiple must be 0 or a multiple of 8 elements (16-byte aligned bf16 rows)")
    import torch

    if not torch.cuda.is_available():
        print("wide_gemm_probe: needs a CUDA device (it times cuBLAS)", file=sys.stderr)
        return 2
    results = probe(torch, args.rows, args.depth, args.out_features, args.extras, args.stride_multiple or None,
                    args.repetitions, args.calls)
    print(f"{torch.cuda.get_device_name()}: M {args.rows}, K {args.depth}, N {args.out_features}, bf16; "
          f"median of {args.repetitions} rounds of {args.calls} calls")
    for r in results:
        print(f"{r['form']:8s} extra {r['extra']:4d} {r['layout']:9s} ld {r['stride']:5d}: "
              f"{statistics.median(r['ms']):.4f} ms, {statistics.median(r['ratio']):.4f}x extra 0")
    if args.ledger:
        from lora_lab.lab.ledger import append_measurements

        rows = ledger_rows(results, args.rows, args.depth, args.out_features)
        print("appended to", append_measurements(rows, ledger=args.ledger))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Variants of the loss op beside it: each variant's own time, its time over the default op's, Liger's and the GEMM
floor's (repetition by repetition, median and 95% interval), and the extra peaks, from bench_loss.py raw CSVs.

benchmarks/loss_panel_table.py tables the loss panel for one method; this one answers "what would a different
setting of the same op buy" (``lora_lab_fwdgrad_lowmem``: dW accumulated in the input dtype; ``..._r4096``: 4,096-row
chunks for a frozen head too), cell by cell, for the variants a run measured.

    python tools/loss_variant_table.py RUN_DIR [RUN_DIR ...] [--variants lora_lab_fwdgrad_lowmem ...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_loss  # noqa: E402
import loss_panel_table  # noqa: E402

from lora_lab.lab import measure  # noqa: E402

BASES = ("lora_lab", "liger", "gemm_floor")


def _ci(s) -> str:
    return "-" if s is None else f"{s['median']:.3f} [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]"


def table(rows: list[dict], variants: list[str]) -> list[dict]:
    """One entry per cell and variant that ran: its ms summary, its ratios to each of BASES (None where a base did
    not run in the same repetitions) and the extra peaks of the variant, lora_lab and Liger."""
    out = []
    for shape, tokens, head in bench_loss.cells_of(rows):
        mine = [r for r in rows if (r["shape"], r["tokens"], r["head"]) == (shape, tokens, head)]
        ok: dict[str, list[dict]] = {}
        for r in mine:
            if r["status"] == "ok":
                ok.setdefault(r["method"], []).append(r)
        medians = {m: measure.summarize(r["ms"] for r in rs)["median"] for m, rs in ok.items()}
        for variant in variants:
            if variant not in ok:
                continue
            out.append({"shape": shape, "tokens": tokens, "head": head, "variant": variant,
                        "ms": measure.summarize(r["ms"] for r in ok[variant]),
                        **{f"vs_{b}": bench_loss._time_ratio(mine, medians, variant, b) for b in BASES},
                        "peaks": [ok[m][0].get("peak_extra_gib") if m in ok else None
                                  for m in (variant, "lora_lab", "liger")]})
    return out


def markdown(entries: list[dict]) -> str:
    lines = ["| head | N | head mode | variant | variant ms | variant / lora_lab | variant / Liger | variant / floor "
             "| extra peak GiB variant / lora_lab / Liger |", "|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        ms = e["ms"]
        peaks = " / ".join("-" if p is None else f"{p:.2f}" for p in e["peaks"])
        lines.append(f"| {e['shape']} | {e['tokens']} | {e['head']} | {e['variant']} | {ms['median']:.2f} "
                     f"[{ms['ci95'][0]:.2f}, {ms['ci95'][1]:.2f}] | "
                     + " | ".join(_ci(e[f"vs_{b}"]) for b in BASES) + f" | {peaks} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="bench_loss.py output folders or raw CSVs (one version of the code)")
    ap.add_argument("--variants", nargs="+", default=list(bench_loss.CHUNK_ROWS) + ["lora_lab_fwdgrad_lowmem"],
                    help="methods to table (default: the opt-in fixed-chunk ones and lora_lab_fwdgrad_lowmem)")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.variants) - set(bench_loss.METHODS))
    if unknown:
        ap.error(f"unknown method(s) {', '.join(unknown)} (bench_loss.py has: {', '.join(bench_loss.METHODS)})")
    entries = table(loss_panel_table.load(args.inputs), args.variants)
    if not entries:
        print(f"none of {', '.join(args.variants)} ran in these CSVs", file=sys.stderr)
        return 1
    print(markdown(entries))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

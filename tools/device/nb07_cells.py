"""Median ms per (head, tokens, mode) and method of notebook 07 CSVs, ours against Liger and the GEMM floor.

    python tools/device/nb07_cells.py RUN.csv [PUBLISHED.csv ...]

Medians pooled over every repetition of a cell: a quick side-by-side look at two runs, not the graded metrics
(those are per-repetition ratios with intervals, in the notebook's metrics.json).
"""
import csv
import statistics
import sys
from collections import defaultdict

METHODS = ("lora_lab", "liger", "cce", "torch_bf16", "gemm_floor")


def cell_medians(path: str) -> dict[tuple[str, str, str], dict[str, float]]:
    times = defaultdict(list)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["status"] == "ok" and row["ms"]:
                times[(row["shape"], row["tokens"], row["head"], row["method"])].append(float(row["ms"]))
    cells = sorted({key[:3] for key in times})
    return {cell: {m: statistics.median(times[(*cell, m)]) for m in METHODS if (*cell, m) in times} for cell in cells}


def main(paths: list[str]) -> None:
    for path in paths:
        print(path)
        for cell, row in cell_medians(path).items():
            ms = {m: round(v, 2) for m, v in row.items()}
            print(f"  {cell} {ms} ours/liger {row['lora_lab'] / row['liger']:.3f} "
                  f"ours/floor {row['lora_lab'] / row['gemm_floor']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])

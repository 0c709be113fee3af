"""The loss panel as one table, from the raw CSVs (``07_loss_block.csv``) of one or more ``bench_loss.py`` runs.

    python benchmarks/loss_panel_table.py DIR_OR_CSV [...] [--out panel.csv] [--method lora_lab]

Per cell (head shape, tokens, frozen / trainable): each method's median ms and its 95% interval over the run's
repetitions; our method's time over Liger's and over the GEMM floor, repetition by repetition (median and 95%
interval: both ran side by side in each repetition); the extra peak of ours and of Liger; and the verdict of each of
the panel's speed and memory targets:

* floor: ours <= 1.10 x the GEMM floor where d >= 2,048, <= 1.25 x where d < 2,048 (``met`` when the interval's
  upper end is at or under the target, ``missed`` when its lower end is above it, ``inconclusive`` otherwise);
* liger: ours <= 0.9 x Liger, judged the same way, and ``infeasible`` when 0.9 x Liger's median is under the
  floor's median (no op runs below its GEMM floor);
* peak: our extra peak <= Liger's.

Cells a run could not start (``not_run``, the time budget) are listed as such. CSVs from different code (their
``code_hash`` columns) are refused unless ``--mixed-code``: one table should describe one version of the op.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_loss  # noqa: E402

from lora_lab.lab import measure  # noqa: E402

RAW_CSV = "07_loss_block.csv"
TABLE_METHODS = ["lora_lab", "liger", "cce", "torch_bf16", "gemm_floor"]
COLUMNS = ["ours", "liger", "cce", "torch_bf16", "gemm_floor"]  # the markdown's ms columns; "ours" is --method's
LIGER_TARGET = 0.9
SMALL_D, FLOOR_TARGET_SMALL, FLOOR_TARGET = 2048, 1.25, 1.10


def load(paths: list[str], mixed_code: bool = False) -> list[dict]:
    """The rows of every raw CSV named (a directory stands for its ``07_loss_block.csv``), each with its
    ``code_hash``."""
    rows, hashes = [], set()
    for p in paths:
        path = Path(p)
        path = path / RAW_CSV if path.is_dir() else path
        found = measure.read_csv(path, require_current=False)
        if not found:
            raise ValueError(f"{path}: no rows")
        missing = {"shape", "hidden", "tokens", "head", "method", "rep", "status", "ms"} - set(found[0])
        if missing:
            raise ValueError(f"{path}: not a bench_loss.py raw CSV (no column {', '.join(sorted(missing))})")
        hashes |= {r.get("code_hash") for r in found}
        rows += found
    if len(hashes) > 1 and not mixed_code:
        raise ValueError(f"the CSVs come from {len(hashes)} versions of the code "
                         f"({', '.join(sorted(str(h)[:12] for h in hashes))}); pass --mixed-code to table them anyway")
    return rows


def _verdict(ratio: dict | None, target: float) -> str:
    if ratio is None:
        return "n/a"
    low, high = ratio["ci95"]
    return "met" if high <= target else "missed" if low > target else "inconclusive"


def panel(rows: list[dict], method: str = "lora_lab") -> list[dict]:
    """One row per cell: the table's figures and the targets' verdicts."""
    out = []
    for shape, tokens, head in bench_loss.cells_of(rows):
        mine = [r for r in rows if (r["shape"], r["tokens"], r["head"]) == (shape, tokens, head)]
        hidden = mine[0]["hidden"]
        ok = {m: [r for r in mine if r["method"] == m and r["status"] == "ok"]
              for m in dict.fromkeys(r["method"] for r in mine)}
        medians = {m: statistics.median(r["ms"] for r in rs) for m, rs in ok.items() if rs}
        row = {"shape": shape, "hidden": hidden, "tokens": tokens, "head": head, "method": method}
        if method not in medians:
            statuses = sorted({r["status"] for r in mine if r["method"] == method}) or ["absent"]
            row["status"] = "/".join(statuses)
            out.append(row)
            continue
        row["status"] = "ok"
        s = measure.summarize(r["ms"] for r in ok[method])
        row["ours_ms"], (row["ours_ms_low"], row["ours_ms_high"]) = s["median"], s["ci95"]
        for m in TABLE_METHODS:
            if m in medians:
                s = measure.summarize(r["ms"] for r in ok[m])
                row[f"{m}_ms"], (row[f"{m}_ms_low"], row[f"{m}_ms_high"]) = s["median"], s["ci95"]
            else:
                row[f"{m}_ms"] = None
        vs_liger = bench_loss._time_ratio(mine, medians, method, "liger")
        vs_floor = bench_loss._time_ratio(mine, medians, method, "gemm_floor")
        for key, ratio in (("vs_liger", vs_liger), ("vs_floor", vs_floor)):
            row[key] = ratio and ratio["median"]
            row[f"{key}_low"], row[f"{key}_high"] = ratio["ci95"] if ratio else (None, None)
        floor_target = FLOOR_TARGET_SMALL if hidden < SMALL_D else FLOOR_TARGET
        row["floor_target"] = floor_target
        row["floor_verdict"] = _verdict(vs_floor, floor_target)
        row["liger_verdict"] = _verdict(vs_liger, LIGER_TARGET)
        if vs_liger and "gemm_floor" in medians and LIGER_TARGET * medians["liger"] < medians["gemm_floor"]:
            row["liger_verdict"] += ", infeasible"  # the target sits under the GEMM floor
        peaks = {m: ok[m][0].get("peak_extra_gib") for m in (method, "liger") if ok.get(m)}
        row["peak_extra_gib"], row["liger_peak_extra_gib"] = peaks.get(method), peaks.get("liger")
        if None in (row["peak_extra_gib"], row["liger_peak_extra_gib"]):
            row["peak_verdict"] = "n/a"
        else:
            row["peak_verdict"] = "met" if row["peak_extra_gib"] <= row["liger_peak_extra_gib"] else "missed"
        row["dh_rel_err"] = ok[method][0].get("dh_rel_err")
        out.append(row)
    return out


def _ms(row, m):
    if row.get(f"{m}_ms") is None:
        return "-"
    return f"{row[f'{m}_ms']:.2f} [{row[f'{m}_ms_low']:.2f}, {row[f'{m}_ms_high']:.2f}]"


def _ratio(row, key):
    if row.get(key) is None:
        return "-"
    return f"{row[key]:.3f} [{row[f'{key}_low']:.3f}, {row[f'{key}_high']:.3f}]"


def markdown(table: list[dict]) -> str:
    """The table; "ours" is the method the targets are about (``panel``'s ``method``; named when not lora_lab)."""
    method = next((r["method"] for r in table if r.get("method")), "lora_lab")
    ours = "ours" if method == "lora_lab" else f"ours ({method})"
    head = (f"| head (d, V) | N | head | {ours} ms | Liger ms | CCE ms | torch bf16 ms | floor ms | ours/Liger | "
            "ours/floor | extra peak GiB ours / Liger | targets: floor · Liger · peak |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in table:
        cell = f"| {r['shape']} ({r['hidden']}) | {r['tokens']} | {r['head']} "
        if r["status"] != "ok":
            lines.append(cell + f"| {r['status']} |" + " |" * 9)
            continue
        peaks = f"{r['peak_extra_gib']:.2f} / {r['liger_peak_extra_gib']:.2f}" if r["peak_verdict"] != "n/a" else "-"
        lines.append(cell + "| " + " | ".join(_ms(r, m) for m in COLUMNS) + f" | {_ratio(r, 'vs_liger')} | "
                     f"{_ratio(r, 'vs_floor')} | {peaks} | ≤{r['floor_target']:.2f}: {r['floor_verdict']} · "
                     f"{r['liger_verdict']} · {r['peak_verdict']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="bench_loss.py output folders or raw CSVs")
    ap.add_argument("--method", default="lora_lab", help="the method the targets are about (default %(default)s)")
    ap.add_argument("--out", help="also write the table as a CSV here")
    ap.add_argument("--mixed-code", action="store_true", help="table CSVs written by different code")
    args = ap.parse_args(argv)
    try:
        rows = load(args.inputs, args.mixed_code)
        table = panel(rows, args.method)
    except (ValueError, FileNotFoundError) as exc:
        print(f"loss_panel_table: {exc}", file=sys.stderr)
        return 2
    print(markdown(table))
    if args.out:  # stamped with the code that measured the rows, not the code that tables them
        hashes = sorted({str(r.get("code_hash")) for r in rows})
        measure.write_csv(table, args.out, code_hash=hashes[0] if len(hashes) == 1 else "mixed:" + ",".join(hashes))
    return 0


if __name__ == "__main__":
    sys.exit(main())

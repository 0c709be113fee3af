"""The MoE panel as one table, from notebook 06's outputs: ``06_fused_moe.metrics.json`` and
``06_moe_layer_summary.csv``.

    python benchmarks/moe_panel_table.py OUTPUTS_DIR [--out panel.md]

Per cell (layer, tokens, full fine-tuning / LoRA on the experts): ours, grouped_mm (with PEFT under LoRA) and Liger
(full fine-tuning, where the run timed it) in ms with the 95% interval over the repetitions of every session;
ours' speed over the faster peer, the median and 95% interval of the per-repetition ratios the notebook recorded
(``<cell>_speedup_vs_grouped_mm`` / ``_vs_liger``; the faster peer is the one with the smaller median ratio); ours'
expert-GEMM TFLOP/s; peak above the resident tensors over grouped_mm's; the first call (compile and autotuning
included); the untuned configuration's time over the tuned one. Then the verdict of each of the panel's targets
that applies to the cell:

* every cell: ours' time <= the faster peer's (speed ratio >= 1.0);
* fine-grained (>= 64 experts), full fine-tuning: >= 1.3x the faster peer;
* fine-grained, LoRA: >= 2.5x grouped_mm + PEFT;
* the Qwen3-30B-A3B-like layer, 32,768 tokens, full fine-tuning: >= 450 TFLOP/s;
* every cell: peak <= grouped_mm's, first call <= 15 s, untuned <= 1.3x tuned.

A ratio's verdict: ``met`` when its interval clears the target, ``missed`` when the interval lies on the wrong side,
``inconclusive`` otherwise; single figures (peak, first call, untuned) are compared as they are.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

METRICS = "06_fused_moe.metrics.json"
SUMMARY = "06_moe_layer_summary.csv"
FINE_GRAINED_MIN_EXPERTS = 64
PEER_TARGET, FINE_TARGET, LORA_TARGET, TFLOPS_TARGET = 1.0, 1.3, 2.5, 450.0
TFLOPS_CELL = "qwen3_30b_a3b_t32768_full"
FIRST_CALL_S, UNTUNED_MAX = 15.0, 1.3


def verdict_at_least(stat: dict | None, target: float) -> str:
    """``met`` / ``missed`` / ``inconclusive`` for a ratio (or rate) that must be >= ``target``."""
    if not stat:
        return "not run"
    low, high = stat["ci95"]
    return "met" if low >= target else "missed" if high < target else "inconclusive"


def _num(value) -> float | None:
    return float(value) if value not in (None, "") else None


def _interval(text: str) -> list[float] | None:
    return json.loads(text) if text else None


def load(folder: Path) -> tuple[dict, dict]:
    """(metrics, {cell: {impl: summary row}}) of one notebook 06 output folder."""
    metrics_path, summary_path = folder / METRICS, folder / SUMMARY
    for path in (metrics_path, summary_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: not found (a notebook 06 output folder has {METRICS} and {SUMMARY})")
    metrics = json.loads(metrics_path.read_text())["metrics"]
    cells: dict[str, dict[str, dict]] = {}
    with summary_path.open(newline="") as f:
        for row in csv.DictReader(f):
            cells.setdefault(row["cell"], {})[row["impl"]] = row
    return metrics, cells


def cell_rows(metrics: dict, cells: dict, num_experts: dict[str, int]) -> list[dict]:
    rows = []
    for cell, impls in cells.items():
        ours = impls.get("ours")
        if ours is None:
            continue
        shape, mode, tokens = ours["shape"], ours["mode"], int(ours["tokens"])
        peers = {p: metrics.get(f"{cell}_speedup_vs_{p}") for p in ("grouped_mm", "liger")}
        peers = {p: s for p, s in peers.items() if isinstance(s, dict)}
        faster = min(peers, key=lambda p: peers[p]["median"]) if peers else None
        fine = num_experts.get(shape, 0) >= FINE_GRAINED_MIN_EXPERTS
        row = {
            "cell": cell, "shape": shape, "tokens": tokens, "mode": mode, "fine_grained": fine,
            "ms": {impl: (_num(r["ms"]), _interval(r["ms_ci95"])) for impl, r in impls.items()
                   if impl in ("ours", "grouped_mm", "liger")},
            "faster_peer": faster, "vs_peer": peers.get(faster) if faster else None,
            "vs_grouped_mm": peers.get("grouped_mm"),
            "tflops": metrics.get(f"{cell}_ours_tflops") if cell == TFLOPS_CELL else _num(ours["tflops"]),
            "peak_ratio": metrics.get(f"{cell}_peak_ratio_vs_grouped_mm"),
            "first_call_s": metrics.get(f"{cell}_ours_first_call_s"),
            "untuned": metrics.get(f"{cell}_ours_untuned_slowdown_vs_ours"),
        }
        targets = {"peer >= 1.0": verdict_at_least(row["vs_peer"], PEER_TARGET)}
        if fine and mode == "full":
            targets["peer >= 1.3"] = verdict_at_least(row["vs_peer"], FINE_TARGET)
        if fine and mode == "lora":
            targets["grouped_mm+PEFT >= 2.5"] = verdict_at_least(row["vs_grouped_mm"], LORA_TARGET)
        if cell == TFLOPS_CELL and isinstance(row["tflops"], dict):
            targets[">= 450 TFLOP/s"] = verdict_at_least(row["tflops"], TFLOPS_TARGET)
        if row["peak_ratio"] is not None:
            targets["peak <= grouped_mm"] = "met" if row["peak_ratio"] <= 1.0 else "missed"
        if row["first_call_s"] is not None:
            targets["first call <= 15 s"] = "met" if row["first_call_s"] <= FIRST_CALL_S else "missed"
        untuned = row["untuned"]
        if isinstance(untuned, dict):
            targets["untuned <= 1.3x"] = "met" if untuned["median"] <= UNTUNED_MAX else "missed"
        row["targets"] = targets
        rows.append(row)
    order = {name: i for i, name in enumerate(num_experts)}
    return sorted(rows, key=lambda r: (order.get(r["shape"], len(order)), r["tokens"], r["mode"]))


def _ms(entry) -> str:
    if not entry or entry[0] is None:
        return "–"
    value, ci = entry
    return f"{value:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def _ratio(stat) -> str:
    return f"{stat['median']:.3f} [{stat['ci95'][0]:.3f}, {stat['ci95'][1]:.3f}]" if stat else "–"


def _fmt(value, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(rows: list[dict]) -> str:
    lines = ["| layer | tokens | mode | ours ms | grouped_mm ms | Liger ms | faster peer | ours vs it | ours TFLOP/s "
             "| peak / grouped_mm | first call s | untuned / tuned | targets |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tflops = r["tflops"]
        tflops = (f"{tflops['median']:.1f} [{tflops['ci95'][0]:.1f}, {tflops['ci95'][1]:.1f}]"
                  if isinstance(tflops, dict) else _fmt(tflops, 1))
        untuned = r["untuned"]["median"] if isinstance(r["untuned"], dict) else None
        targets = "; ".join(f"{k}: {v}" for k, v in r["targets"].items())
        layer = r["shape"] + (" (fine)" if r["fine_grained"] else "")
        cells = [layer, str(r["tokens"]), r["mode"], _ms(r["ms"].get("ours")), _ms(r["ms"].get("grouped_mm")),
                 _ms(r["ms"].get("liger")), r["faster_peer"] or "–", _ratio(r["vs_peer"]), tflops,
                 _fmt(r["peak_ratio"], 3), _fmt(r["first_call_s"], 2), _fmt(untuned, 3), targets]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a notebook 06 output folder (outputs/gpu, or build/runs/gpu)")
    parser.add_argument("--out", help="write the markdown table here too")
    args = parser.parse_args(argv)
    from lora_lab.experiments.fused_moe import LAYER_SHAPES

    try:
        metrics, cells = load(Path(args.folder))
    except (FileNotFoundError, json.JSONDecodeError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    table = markdown(cell_rows(metrics, cells, {n: s.num_experts for n, s in LAYER_SHAPES.items()}))
    print(table, end="")
    if args.out:
        Path(args.out).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

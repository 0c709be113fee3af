"""The metrics of notebook 06's GPU benchmark (``benchmarks/bench_moe.py``), from its per-repetition CSVs: graded
speedups and peaks, the panel's ratios and first-call times, and the per-implementation layer table. It reads the
panel's shapes and names (:mod:`lora_lab.experiments.fused_moe_panel`); :mod:`lora_lab.experiments.fused_moe`
re-exports it."""
from __future__ import annotations

from pathlib import Path

from lora_lab.experiments.fused_moe_panel import (
    H200_DENSE_BF16_TFLOPS,
    LAYER_SHAPES,
    LIGER,
    OURS_ENGINES,
    OURS_KGROUPED,
    OURS_PERSISTENT,
    OURS_SCATTER,
    OURS_UNTUNED,
)
from lora_lab.lab import measure
from lora_lab.memory import budget

__all__ = ["LAYER_CSV", "E2E_CSV", "GRADED_SPEEDUPS", "TFLOPS_CELLS", "GRADED_PEAKS", "PERSISTENT_CELLS",
           "PANEL_TOKENS", "PANEL_CELLS", "ENGINE_CELLS", "GRADED_CELLS", "NOTEBOOK_CELLS", "VARIANT_CELLS",
           "benchmark_metrics", "layer_table"]

LAYER_CSV = "06_moe_layer.csv"
E2E_CSV = "06_moe_e2e.csv"
# (metric cell, implementation it is compared with): time ratios, per repetition
GRADED_SPEEDUPS = [
    ("qwen3_30b_a3b_t8192_full", "grouped_mm"),
    ("qwen3_30b_a3b_t8192_lora", "grouped_mm"),
    ("qwen3_30b_a3b_t8192_full", "eager"),
    ("qwen1_5_moe_a2_7b_t8192_full", "grouped_mm"),
    ("qwen3_30b_a3b_t32768_full", "grouped_mm"),
    # Liger-Kernel's fused MoE (full fine-tuning), where it is installed
    ("qwen3_30b_a3b_t8192_full", LIGER),
    ("qwen3_30b_a3b_t32768_full", LIGER),
    ("qwen1_5_moe_a2_7b_t8192_full", LIGER),
]
# cells whose TFLOP/s (expert GEMM FLOPs over the median time) are recorded for ours and the baselines
TFLOPS_CELLS = ["qwen3_30b_a3b_t8192_full", "qwen3_30b_a3b_t32768_full"]
GRADED_PEAKS = ["qwen3_30b_a3b_t8192_full", "qwen3_30b_a3b_t8192_lora"]
GRADED_E2E = [("lora", "eager"), ("lora", "grouped_mm"), ("full", "grouped_mm"), ("full", LIGER)]
# cells where the persistent form and the K-grouped weight gradient (ours_persistent, ours_kgrouped; bench_moe
# --variants) are compared with ours: full fine-tuning only (with LoRA ours runs on the grouped-GEMM engine, which has
# neither form; the LoRA cell of the 30B-A3B-like layer stays graded through GRADED_PEAKS)
PERSISTENT_CELLS = ["qwen3_30b_a3b_t8192_full", "qwen3_30b_a3b_t32768_full"]
# the panel: every shape at 8,192 and 32,768 tokens, full and LoRA; ours against each peer, the untuned
# form against ours, peak memory against grouped_mm, ours' first call (compile + any tuning) in seconds
PANEL_TOKENS = (8192, 32768)
PANEL_CELLS = [f"{shape}_t{tokens}_{mode}" for shape in LAYER_SHAPES for tokens in PANEL_TOKENS
               for mode in ("full", "lora")]
# the coarse layer's 8k cells, where the engine rule and its LoRA form are graded: timed early, with the graded cells
# (notebook 06's run of bfc8cc2 reached no Mixtral-like cell within its budget)
ENGINE_CELLS = ["mixtral_8x7b_t8192_full", "mixtral_8x7b_t8192_lora"]
GRADED_CELLS = list(dict.fromkeys([cell for cell, _ in GRADED_SPEEDUPS] + GRADED_PEAKS + PERSISTENT_CELLS
                                  + ENGINE_CELLS))
# the cells notebook 06 times (bench_moe --cells): the graded cells, then every other panel cell whose speedup or peak
# one of the notebook's standing predictions reads (tests/benchmarks/test_bench_moe_panel.py checks this against
# predictions/predictions.yaml); the panel's maxima (first call, peak, untuned form) are taken over these cells
NOTEBOOK_CELLS = list(dict.fromkeys(GRADED_CELLS + [
    "qwen3_30b_a3b_t32768_lora", "qwen1_5_moe_a2_7b_t8192_lora", "qwen1_5_moe_a2_7b_t32768_full",
    "olmoe_1b_7b_t8192_full", "olmoe_1b_7b_t32768_full", "deepseek_v2_lite_t32768_full", "gpt_oss_20b_t8192_full",
    "mixtral_8x22b_t8192_full"]))
# the cells where notebook 06 times ours' opt-in variants (bench_moe --variant-cells), those the predictions compare
# with ours: the weight-gradient and down-projection forms in the 30B-A3B-like layer's full cells, our Triton engine
# with LoRA in two LoRA cells (each variant runs in its own mode's cells only)
VARIANT_CELLS = ["qwen3_30b_a3b_t8192_full", "qwen3_30b_a3b_t32768_full", "qwen3_30b_a3b_t8192_lora",
                 "qwen1_5_moe_a2_7b_t8192_lora"]


def _refuse_smoke(rows, path, allow_smoke):
    if not allow_smoke and any(row.get("smoke") for row in rows):
        raise ValueError(f"{path} holds a --smoke run (tiny stand-in shapes): not a measurement to record")


def benchmark_metrics(directory, allow_smoke: bool = False) -> dict:
    """Notebook 06's speed and memory metrics from ``06_moe_layer.csv`` and ``06_moe_e2e.csv`` in ``directory``.

    Time ratios are ``measure.summarize`` dicts over the repetitions (each repetition's ratio pairs two
    implementations timed in the same side-by-side loop); memory ratios (peak above resident, measured once)
    are floats, None where not measured (CPU smoke runs). A metric whose cell was not run (or ran out of memory)
    is left out. CSVs written by other code are refused (``measure.StaleResultError``), and so are smoke runs
    unless ``allow_smoke``.
    """
    directory = Path(directory)
    out: dict = {}
    layer = measure.read_csv(directory / LAYER_CSV)
    _refuse_smoke(layer, directory / LAYER_CSV, allow_smoke)
    for row in layer:  # under a capped profile: a cell's metrics that are missing for an OOM say so when graded
        if row.get("status") == "oom":
            budget.note_out_of_memory(str(row["cell"]), str(row["impl"]))

    def timed(rows, **match):  # measured at all (the cell was run and did not run out of memory)
        return any(all(r.get(k) == v for k, v in match.items()) and r.get("ms", r.get("samples_per_s")) is not None
                   for r in rows)

    for cell, base in GRADED_SPEEDUPS:
        if timed(layer, cell=cell, impl=base) and timed(layer, cell=cell, impl="ours"):
            out[f"{cell}_speedup_vs_{base}"] = measure.ratio_summary(
                layer, "ms", {"cell": cell, "impl": base}, {"cell": cell, "impl": "ours"})
    for cell in PERSISTENT_CELLS:  # the persistent form, the K-grouped dW against ours, where the benchmark timed it
        for impl in (*OURS_PERSISTENT, *OURS_KGROUPED, *OURS_SCATTER):
            if timed(layer, cell=cell, impl=impl) and timed(layer, cell=cell, impl="ours"):
                out[f"{cell}_{impl}_speedup_vs_ours"] = measure.ratio_summary(
                    layer, "ms", {"cell": cell, "impl": "ours"}, {"cell": cell, "impl": impl})
    for cell in PANEL_CELLS:  # the panel: every peer, the untuned form, memory, first calls
        for base in ("grouped_mm", LIGER):
            key = f"{cell}_speedup_vs_{base}"
            if key not in out and timed(layer, cell=cell, impl=base) and timed(layer, cell=cell, impl="ours"):
                out[key] = measure.ratio_summary(layer, "ms", {"cell": cell, "impl": base},
                                                 {"cell": cell, "impl": "ours"})
        for impl in OURS_ENGINES:  # our layer with its GEMMs forced onto one engine, where the benchmark timed it
            for base in ("ours", "grouped_mm"):
                if timed(layer, cell=cell, impl=impl) and timed(layer, cell=cell, impl=base):
                    out[f"{cell}_{impl}_speedup_vs_{base}"] = measure.ratio_summary(
                        layer, "ms", {"cell": cell, "impl": base}, {"cell": cell, "impl": impl})
        for impl in OURS_UNTUNED:
            if timed(layer, cell=cell, impl=impl) and timed(layer, cell=cell, impl="ours"):
                out[f"{cell}_{impl}_slowdown_vs_ours"] = measure.ratio_summary(
                    layer, "ms", {"cell": cell, "impl": impl}, {"cell": cell, "impl": "ours"})
        peaks = {}
        for impl in ("ours", "grouped_mm"):
            row = next((r for r in layer if r["cell"] == cell and r["impl"] == impl
                        and r.get("peak_bytes") is not None), {})
            peaks[impl] = (row["peak_bytes"] - row["resident_bytes"]) if row else None
        if None not in peaks.values() and peaks["grouped_mm"]:
            out[f"{cell}_peak_ratio_vs_grouped_mm"] = peaks["ours"] / peaks["grouped_mm"]
        first = [r["first_call_s"] for r in layer
                 if r["cell"] == cell and r["impl"] == "ours" and r.get("first_call_s") is not None]
        if first:
            out[f"{cell}_ours_first_call_s"] = max(first)
        # Liger's first call (its autotuning: minutes at a new shape), the slowest over the sessions (a later
        # session may reuse an earlier one's picks through Triton's disk cache), and the fastest beside it
        first = [r["first_call_s"] for r in layer
                 if r["cell"] == cell and r["impl"] == LIGER and r.get("first_call_s") is not None]
        if first:
            out[f"{cell}_liger_first_call_s"] = max(first)
            if len(set(r.get("session") for r in layer if r["cell"] == cell and r["impl"] == LIGER)) > 1:
                out[f"{cell}_liger_first_call_min_s"] = min(first)
    panel_first = [v for k, v in out.items() if k.endswith("_ours_first_call_s")]
    if panel_first:
        out["panel_ours_first_call_max_s"] = max(panel_first)
    panel_peaks = [out[f"{c}_peak_ratio_vs_grouped_mm"] for c in PANEL_CELLS
                   if out.get(f"{c}_peak_ratio_vs_grouped_mm") is not None]
    if panel_peaks:
        out["panel_peak_ratio_vs_grouped_mm_max"] = max(panel_peaks)
    slowdowns = [v["median"] for k, v in out.items() if k.endswith("_ours_untuned_slowdown_vs_ours")]
    if slowdowns:
        out["panel_ours_untuned_slowdown_max"] = max(slowdowns)
    for cell in TFLOPS_CELLS:
        for impl in ("ours", "grouped_mm", LIGER, *OURS_PERSISTENT, *OURS_KGROUPED, *OURS_SCATTER):
            mine = [r for r in layer if r["cell"] == cell and r["impl"] == impl and r["ms"] is not None]
            if mine:
                tflops = [r["gemm_flops"] / (r["ms"] * 1e-3) / 1e12 for r in mine]
                out[f"{cell}_{impl}_tflops"] = measure.summarize(tflops, sessions=measure.sessions_in(mine))
                if impl == "ours":
                    out[f"{cell}_ours_fraction_of_peak"] = measure.summarize(
                        [t / H200_DENSE_BF16_TFLOPS for t in tflops], sessions=measure.sessions_in(mine))
    for cell in GRADED_PEAKS:
        extra = {}
        for impl in ("ours", "grouped_mm"):
            row = next((r for r in layer if r["cell"] == cell and r["impl"] == impl), {})
            peak, resident = row.get("peak_bytes"), row.get("resident_bytes")
            extra[impl] = None if peak is None or resident is None else peak - resident
        if any(r["cell"] == cell for r in layer):
            ratio = None if None in extra.values() else extra["ours"] / extra["grouped_mm"]
            out[f"{cell}_peak_ratio_vs_grouped_mm"] = ratio
    path = directory / E2E_CSV
    if path.exists():
        e2e = measure.read_csv(path)
        _refuse_smoke(e2e, path, allow_smoke)
        for mode, base in GRADED_E2E:
            if timed(e2e, mode=mode, impl=base) and timed(e2e, mode=mode, impl="ours"):
                out[f"e2e_{mode}_speedup_vs_{base}"] = measure.ratio_summary(
                    e2e, "samples_per_s", {"mode": mode, "impl": "ours"}, {"mode": mode, "impl": base})
    return out


def layer_table(rows: list[dict]) -> list[dict]:
    """One row per (cell, implementation) of the layer benchmark's rows (``measure.read_csv`` of
    ``06_moe_layer.csv``): median ms over the repetitions and its 95% interval, TFLOP/s of the median, peak GiB
    above resident — what the notebook prints. ``tokens`` is the T that ran, ``label_tokens`` the T of the cell's
    name (they differ only in smoke runs' tiny stand-ins)."""
    table = []
    for cell, impl in dict.fromkeys((r["cell"], r["impl"]) for r in rows):
        mine = [r for r in rows if r["cell"] == cell and r["impl"] == impl]
        times = [r["ms"] for r in mine if r["ms"] is not None]
        first = mine[0]
        entry = {k: first[k] for k in ("cell", "shape", "tokens", "label_tokens", "mode", "impl", "status")}
        if impl == "ours" and first.get("engine"):  # the engine the rule gave ours here (bench_moe records it)
            entry["engine"] = first["engine"]
        if times:
            summary = measure.summarize(times)
            entry.update(ms=summary["median"], ms_ci95=summary["ci95"], n=summary["n"],
                         tflops=first["gemm_flops"] / (summary["median"] * 1e-3) / 1e12)
        if first.get("peak_bytes") is not None:
            entry["peak_extra_gib"] = (first["peak_bytes"] - first["resident_bytes"]) / 2**30
        table.append(entry)
    return table

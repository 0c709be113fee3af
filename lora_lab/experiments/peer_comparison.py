"""The metrics of lora_lab beside the peers users pick instead (axolotl, unsloth, LlamaFactory, VeOmni, SonicMoE,
QuACK), from the rows of ``benchmarks/bench_peers.py`` (per op) and of a full-depth step benchmark (per model).

Every ratio pairs ours with a peer within one repetition (``measure.repetition_ratios``); a "worst" metric is, per
repetition, the worst cell's ratio. A peer that did not run in every cell of a metric gets
``peers_<group>_<peer>_cells_not_run`` (a count) instead of the ratio, and :func:`peer_status` says why.

Keys (notebook 10 records them):

* ``peers_lora_worst_time_vs_<peer>`` (axolotl, unsloth): ours' time over the peer's, the worst cell of notebook 05's
  grid across the LoRA linear, QKV and MLP (below 1: ours faster everywhere); per op
  ``peers_<op>_worst_time_vs_<peer>``;
* ``peers_moe_full_worst_speedup_vs_<peer>`` (sonicmoe, llamafactory, veomni, liger, unsloth): the peer's time over
  ours, the worst fine-grained cell; ``peers_moe_lora_worst_speedup_vs_veomni`` with LoRA on the experts;
* ``peers_loss_time_vs_quack_<head>`` (trainable, frozen) at the Llama-3-8B head and 16,384 tokens, and
  ``peers_loss_worst_time_vs_quack``;
* ``peers_step_<model>_ckpt_<off|on>_speedup_vs_fastest_peer``: ours' tokens/s over the fastest peer's (the peer
  with the highest median tokens/s that ran), ``..._peak_vs_fastest_peer`` (ours' peak over that peer's) and
  ``..._fastest_peer`` (its name); ``..._cublas_base_speedup_vs_ours``, ``..._pure_cublas_speedup_vs_ours`` and
  ``..._quack_speedup_vs_ours``: the recipe with the LoRA linear's big GEMMs (every GEMM) by cuBLAS, or its big GEMMs
  on QuACK, over the recipe as shipped (tokens/s), variants of ours, never peers.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from lora_lab.lab import measure

LORA_OPS = ("lora_linear", "lora_qkv", "lora_mlp")
LORA_PEERS = ("axolotl", "unsloth")
MOE_PEERS = ("sonicmoe", "llamafactory", "veomni", "liger", "unsloth")
OURS = "ours"
# the recipe with another route of the LoRA linear (bench_peers_step): variants of ours, never peers
OUR_VARIANTS = {"ours_cublas_base": "cublas_base", "ours_pure_cublas": "pure_cublas", "ours_quack": "quack"}


def _ok(rows, **match) -> list[dict]:
    return [r for r in rows if r.get("status", "ok") == "ok" and r.get("ms", 0) is not None
            and all(r.get(k) == v for k, v in match.items())]


def _cells(rows, op) -> list[str]:
    return list(dict.fromkeys(r["cell"] for r in rows if r["op"] == op and r["impl"] == OURS))


def _worst(rows, cells, peer, value, ours_on_top: bool, worst=max) -> dict:
    """Per repetition, the worst (``worst``) cell's ratio ours/peer (``ours_on_top``) or peer/ours."""
    per_cell = []
    for cell in cells:
        a, b = {"cell": cell, "impl": OURS}, {"cell": cell, "impl": peer}
        per_cell.append(measure.repetition_ratios(rows, value, *((a, b) if ours_on_top else (b, a))))
    return measure.summarize((worst(reps) for reps in zip(*per_cell)), sessions=measure.sessions_in(rows))


def _missing(rows, cells, peer) -> int:
    return sum(1 for c in cells if not _ok(rows, cell=c, impl=peer))


def peer_status(rows) -> list[dict]:
    """One row per (op, peer) that did not run everywhere: the cells it missed and its first error or skip text."""
    out = []
    for op, peer in dict.fromkeys((r["op"], r["impl"]) for r in rows if r["impl"] != OURS):
        cells = _cells(rows, op)
        missed = _missing(rows, cells, peer)
        if missed:
            first = next((r for r in rows if r["op"] == op and r["impl"] == peer and r.get("error")), {})
            out.append({"op": op, "peer": peer, "cells_not_run": missed, "cells": len(cells),
                        "status": first.get("status", "missing"), "error": first.get("error"),
                        "tried": first.get("tried")})
    return out


def ops_metrics(rows) -> dict:
    """The per-op metrics (module docstring) from bench_peers' rows."""
    out: dict = {}
    for peer in LORA_PEERS:
        all_cells = []
        for op in LORA_OPS:
            cells = _cells(rows, op)
            if not cells:
                continue
            all_cells += cells
            if _missing(rows, cells, peer):
                out[f"peers_{op}_{peer}_cells_not_run"] = _missing(rows, cells, peer)
            else:
                out[f"peers_{op}_worst_time_vs_{peer}"] = _worst(rows, cells, peer, "ms", ours_on_top=True)
        if all_cells and not _missing(rows, all_cells, peer):
            out[f"peers_lora_worst_time_vs_{peer}"] = _worst(rows, all_cells, peer, "ms", ours_on_top=True)
        elif all_cells:
            out[f"peers_lora_{peer}_cells_not_run"] = _missing(rows, all_cells, peer)
    for op, peers in (("moe_full", MOE_PEERS), ("moe_lora", ("veomni",))):
        cells = _cells(rows, op)
        group = op
        for peer in peers if cells else ():
            if _missing(rows, cells, peer):
                out[f"peers_{group}_{peer}_cells_not_run"] = _missing(rows, cells, peer)
            else:
                out[f"peers_{group}_worst_speedup_vs_{peer}"] = _worst(rows, cells, peer, "ms", ours_on_top=False,
                                                                       worst=min)
    cells = _cells(rows, "loss")
    if cells and _missing(rows, cells, "quack"):
        out["peers_loss_quack_cells_not_run"] = _missing(rows, cells, "quack")
    elif cells:
        for cell in cells:
            head = next(r["head"] for r in rows if r["cell"] == cell)
            out[f"peers_loss_time_vs_quack_{head}"] = measure.ratio_summary(
                rows, "ms", {"cell": cell, "impl": OURS}, {"cell": cell, "impl": "quack"})
        out["peers_loss_worst_time_vs_quack"] = _worst(rows, cells, "quack", "ms", ours_on_top=True)
    return out


def step_metrics(rows) -> dict:
    """The full-depth metrics from rows with ``model``, ``checkpointing`` ('off' / 'on'), ``impl``, ``rep``,
    ``status``, ``tokens_per_s`` and ``peak_bytes`` (one full-depth training step per row)."""
    out: dict = {}
    for model, ckpt in dict.fromkeys((r["model"], r["checkpointing"]) for r in rows):
        mine = [r for r in rows if r["model"] == model and r["checkpointing"] == ckpt]
        ran = {}
        for r in mine:
            if not r["impl"].startswith(OURS) and r.get("status", "ok") == "ok" and r.get("tokens_per_s") is not None:
                ran.setdefault(r["impl"], []).append(r["tokens_per_s"])
        key = f"peers_step_{model}_ckpt_{ckpt}"
        for variant, name in OUR_VARIANTS.items():  # the recipe with another route, over the recipe itself
            if _ok(mine, impl=variant) and _ok(mine, impl=OURS):
                out[f"{key}_{name}_speedup_vs_ours"] = measure.ratio_summary(
                    mine, "tokens_per_s", {"impl": variant}, {"impl": OURS})
        if not ran or not _ok(mine, impl=OURS):
            out[f"{key}_peers_run"] = len(ran)
            continue
        fastest = max(ran, key=lambda p: statistics.median(ran[p]))
        out[f"{key}_fastest_peer"] = fastest
        out[f"{key}_speedup_vs_fastest_peer"] = measure.ratio_summary(
            mine, "tokens_per_s", {"impl": OURS}, {"impl": fastest})
        peaks = {impl: [r["peak_bytes"] for r in mine if r["impl"] == impl and r.get("peak_bytes") is not None]
                 for impl in (OURS, fastest)}
        if all(peaks.values()):
            out[f"{key}_peak_vs_fastest_peer"] = statistics.median(peaks[OURS]) / statistics.median(peaks[fastest])
    return out


OPS_CSV, STEP_CSV = "peers_ops.csv", "peers_step.csv"  # what bench_peers.py and bench_peers_step.py write
FLOOR_CSV = "peers_step_floor.csv"  # bench_peers_step.py: each model's step FLOPs and its floor at the measured rate


def floor_table(step_rows, floor_rows) -> list[dict]:
    """Per model, checkpointing and implementation that ran: the median step time, the step's matrix-product floor
    (:mod:`lora_lab.experiments.step_floor`, at the dense bf16 rate measured in the same processes; the median over
    them) and ``floor_share`` = floor / step: the share of the step its products would take at that rate."""
    table = []
    for model, ckpt in dict.fromkeys((r["model"], r["checkpointing"]) for r in step_rows):
        floors = [float(r["floor_ms"]) for r in floor_rows
                  if r["model"] == model and r["checkpointing"] == ckpt and r.get("floor_ms") not in (None, "")]
        floor = statistics.median(floors) if floors else None
        ran: dict[str, list[float]] = {}
        for r in step_rows:
            if (r["model"], r["checkpointing"]) == (model, ckpt) and r.get("status", "ok") == "ok" \
                    and r.get("step_ms") is not None:
                ran.setdefault(r["impl"], []).append(float(r["step_ms"]))
        for impl, times in ran.items():
            step = statistics.median(times)
            table.append(dict(model=model, checkpointing=ckpt, impl=impl, step_ms=step, floor_ms=floor,
                              floor_share=floor / step if floor else None))
    return table


def benchmark_metrics(directory, allow_smoke: bool = False) -> dict:
    """:func:`ops_metrics` and :func:`step_metrics` of the CSVs in ``directory`` (either may be absent), refusing
    rows written by other code (``measure.read_csv``) and, unless ``allow_smoke``, rows of a ``--smoke`` run."""
    out: dict = {}
    for name, metrics in ((OPS_CSV, ops_metrics), (STEP_CSV, step_metrics)):
        rows = _read_rows(Path(directory) / name, allow_smoke)
        if rows is not None:
            out.update(metrics(rows))
    return out


def _read_rows(path: Path, allow_smoke: bool) -> list[dict] | None:
    """A benchmark CSV's rows (None when absent), refusing rows of other code and, unless ``allow_smoke``, of a
    ``--smoke`` run."""
    if not path.is_file():
        return None
    rows = measure.read_csv(path)
    if not allow_smoke and any(r.get("smoke") for r in rows):
        raise ValueError(f"{path} holds a --smoke run (tiny stand-in shapes): not a measurement to record")
    return rows


# --- the results folder notebook 10 reads ---------------------------------------------------------------------------
# ``tools/peers_bench.sh`` with ``RES=<run folder>/10_peers`` writes one folder per process: the peers that share a
# process with ours (the MoE peers, in one device call, a process of their own), unsloth in its own (its import
# patches the process), SonicMoE and QuACK each in their own (their CUTLASS DSL pins disagree), and the full-depth
# step with checkpointing off and on.
PEERS_FOLDER = "10_peers"
RESULT_FOLDERS = {"ops": OPS_CSV, "ops_moe": OPS_CSV, "ops_unsloth": OPS_CSV, "ops_sonicmoe": OPS_CSV,
                  "ops_quack": OPS_CSV, "step_ckpt_off": STEP_CSV, "step_ckpt_on": STEP_CSV}
PEER_NAMES = ("axolotl", "unsloth", "sonicmoe", "llamafactory", "veomni", "liger", "quack")
STEP_LABELS = {"ours": "lora_lab's recipe", "ours_cublas_base": "the recipe, big GEMMs by cuBLAS",
               "ours_pure_cublas": "the recipe, every GEMM by cuBLAS",
               "ours_quack": "the recipe, single LoRA linears on QuACK", "peft": "PEFT", "peft_liger": "PEFT + Liger",
               "axolotl": "axolotl (its kernels + Liger)", "unsloth": "unsloth"}
MODEL_LABELS = {"llama3_8b": "Llama-3-8B shape, 32 layers", "qwen3_30b_a3b": "Qwen3-30B-A3B shape, 48 layers"}


def read_results(directory, allow_smoke: bool = False) -> dict[str, list[dict]]:
    """The rows of every process folder of ``RESULT_FOLDERS`` present under ``directory``, by folder. Rows written by
    other code are refused (``measure.StaleResultError``), and so are ``--smoke`` rows unless ``allow_smoke``."""
    out = {}
    for folder, name in RESULT_FOLDERS.items():
        rows = _read_rows(Path(directory) / folder / name, allow_smoke)
        if rows is not None:
            out[folder] = [{**r, "process": folder} for r in rows]
    return out


def _peer_of(key: str) -> str | None:
    return next((p for p in PEER_NAMES if f"_vs_{p}" in key or f"_{p}_cells_not_run" in key), None)


def _ran(rows, peer) -> int:
    return sum(1 for r in rows if r["impl"] == peer and r.get("status", "ok") == "ok" and r.get("ms") is not None)


def results_metrics(results: dict[str, list[dict]]) -> dict:
    """:func:`ops_metrics` per process folder, each peer's keys taken from the folder where it ran most (ours timed
    in that same process), and :func:`step_metrics` of the step folders."""
    per_folder = {f: ops_metrics(rows) for f, rows in results.items() if RESULT_FOLDERS[f] == OPS_CSV}
    out: dict = {}
    for peer in PEER_NAMES:
        folders = [f for f in per_folder if any(_peer_of(k) == peer for k in per_folder[f])]
        if not folders:
            continue
        best = max(folders, key=lambda f: (_ran(results[f], peer), -list(RESULT_FOLDERS).index(f)))
        out.update({k: v for k, v in per_folder[best].items() if _peer_of(k) == peer})
    step_rows = [r for f, rows in results.items() if RESULT_FOLDERS[f] == STEP_CSV for r in rows]
    if step_rows:
        out.update(step_metrics(step_rows))
    return out


def merged_rows(results: dict[str, list[dict]], kind: str) -> list[dict]:
    """Every folder's rows of one kind (``OPS_CSV`` or ``STEP_CSV``), each with its ``process`` folder: the table
    notebook 10 saves beside itself."""
    return [r for f, rows in results.items() if RESULT_FOLDERS[f] == kind for r in rows]


def not_run(results: dict[str, list[dict]]) -> list[dict]:
    """:func:`peer_status` of every ops folder, without a peer's rows in a folder where it only skipped while it ran
    in another (unsloth, SonicMoE and QuACK each run in a process of their own): what a reader should know failed."""
    ran = {(r["op"], r["impl"]) for f, rows in results.items() if RESULT_FOLDERS[f] == OPS_CSV for r in _ok(rows)}
    out = []
    for folder, rows in results.items():
        if RESULT_FOLDERS[folder] == OPS_CSV:
            out += [dict(s, process=folder) for s in peer_status(rows)
                    if s["cells_not_run"] < s["cells"] or (s["op"], s["peer"]) not in ran]
    return out


def ops_table(results: dict[str, list[dict]]) -> list[dict]:
    """Per op and peer that ran: the cells, and ours' time over the peer's (medians per cell, ours timed in the
    peer's process): the smallest and the largest cell's ratio. Below 1: ours faster."""
    out = []
    for folder, rows in results.items():
        if RESULT_FOLDERS[folder] != OPS_CSV:
            continue
        for op in dict.fromkeys(r["op"] for r in rows):
            for peer in dict.fromkeys(r["impl"] for r in rows if r["op"] == op and r["impl"] != OURS):
                ratios = []
                for cell in _cells(rows, op):
                    ours = [r["ms"] for r in _ok(rows, cell=cell, impl=OURS)]
                    theirs = [r["ms"] for r in _ok(rows, cell=cell, impl=peer)]
                    if ours and theirs:
                        ratios.append(statistics.median(ours) / statistics.median(theirs))
                if ratios and not any(row["op"] == op and row["peer"] == peer for row in out):
                    out.append({"op": op, "peer": peer, "cells": len(ratios), "ours_over_peer_min": min(ratios),
                                "ours_over_peer_max": max(ratios), "process": folder})
    return out


def step_table(results: dict[str, list[dict]]) -> list[dict]:
    """Per model, checkpointing and implementation: median tokens/s and peak GiB over its repetitions, or the status
    and the first line of the error of one that did not run."""
    rows = merged_rows(results, STEP_CSV)
    out = []
    for model, ckpt, impl in dict.fromkeys((r["model"], r["checkpointing"], r["impl"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["checkpointing"], r["impl"]) == (model, ckpt, impl)]
        ok = [r for r in mine if r.get("status", "ok") == "ok" and r.get("tokens_per_s") is not None]
        peaks = [r["peak_bytes"] for r in ok if r.get("peak_bytes") is not None]
        failed = next((r for r in mine if r.get("status") != "ok"), {})
        out.append({"model": model, "checkpointing": ckpt, "impl": impl, "repetitions": len(ok),
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok) if ok else None,
                    "peak_gib": statistics.median(peaks) / 2**30 if peaks else None,
                    "status": "ok" if ok else failed.get("status", "missing"),
                    "error": None if ok else str(failed.get("error") or "").split(". ")[0][:160]})
    return out


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def tables_text(results: dict[str, list[dict]]) -> str:
    """The reader's tables as text: the full-depth steps (tokens/s, peak GiB or the status), per op and peer the
    range over the cells of ours' time over the peer's, and every peer that did not run with its error."""
    steps = step_table(results)
    lines = []
    if steps:
        lines.append(f"{'model':14s} {'ckpt':4s} {'implementation':16s} {'tokens/s':>9s} {'peak GiB':>9s}")
        for row in steps:
            what = (f"{_num(row['tokens_per_s'], '9.0f')} {_num(row['peak_gib'], '9.1f')}" if row["status"] == "ok"
                    else row["status"])
            lines.append(f"{row['model']:14s} {row['checkpointing']:4s} {row['impl']:16s} {what}")
        lines.append("")
    ops = ops_table(results)
    if ops:
        lines.append(f"{'op':12s} {'peer':13s} {'cells':>5s}  ours' time / the peer's (per cell, medians)")
        lines += [f"{r['op']:12s} {r['peer']:13s} {r['cells']:5d}  {r['ours_over_peer_min']:.3f} to "
                  f"{r['ours_over_peer_max']:.3f}" for r in ops]
        lines.append("")
    for row in not_run(results):
        lines.append(f"did not run: {row['peer']} ({row['op']}, {row['cells_not_run']} of {row['cells']} cells): "
                     f"{row['status']}: {row['error']}")
    for row in steps:
        if row["status"] != "ok":
            lines.append(f"did not run: {row['impl']} ({row['model']} step, checkpointing {row['checkpointing']}): "
                         f"{row['status']}: {row['error']}")
    return "\n".join(lines).strip()


def plot_steps(table: list[dict], ax_speed, ax_peak) -> None:
    """Tokens/s (``ax_speed``) and peak GiB (``ax_peak``) of each implementation, grouped by model and checkpointing;
    an implementation that did not run is an empty slot marked with its status."""
    groups = list(dict.fromkeys((r["model"], r["checkpointing"]) for r in table))
    impls = list(dict.fromkeys(r["impl"] for r in table))
    width = 0.8 / max(1, len(impls))
    for k, impl in enumerate(impls):
        xs, speeds, peaks = [], [], []
        for g, (model, ckpt) in enumerate(groups):
            row = next((r for r in table if (r["model"], r["checkpointing"], r["impl"]) == (model, ckpt, impl)), None)
            x = g + (k - (len(impls) - 1) / 2) * width
            if row is None or row["tokens_per_s"] is None:
                if row is not None:
                    ax_speed.text(x, 0, row["status"], rotation=90, ha="center", va="bottom", fontsize=7)
                continue
            xs.append(x)
            speeds.append(row["tokens_per_s"])
            peaks.append(row["peak_gib"] or 0.0)
        ax_speed.bar(xs, speeds, width, label=STEP_LABELS.get(impl, impl))
        ax_peak.bar(xs, peaks, width, label=STEP_LABELS.get(impl, impl))
    names = [f"{MODEL_LABELS.get(m, m).split(',')[0]}\ncheckpointing {c}" for m, c in groups]
    for ax, label in ((ax_speed, "tokens / s (median)"), (ax_peak, "peak GiB (median)")):
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(names, fontsize=8)
        ax.set_ylabel(label)
    ax_speed.legend(fontsize=7)


def _verdict(fig, key: str, ours_on_top: bool) -> str:
    """'ours faster', 'ours slower' or 'level' for a repeated ratio of times (interval across 1: level); a ratio of
    speeds is one of times upside down (``ours_on_top`` False)."""
    side = fig.above(key, 1.0)
    if side == "level with":
        return "level, the interval spanning parity"
    return "ours faster" if (side == "below") == ours_on_top else "ours slower"


def answer_lines(fig) -> list[str]:
    """Plain-words lines for notebook 10's answer, from the run's figures (:class:`lora_lab.lab.answers.Figures`);
    nothing for a figure the run did not record."""
    lines = []
    for model in MODEL_LABELS:
        for ckpt in ("off", "on"):
            key = f"peers_step_{model}_ckpt_{ckpt}"
            speedup = f"{key}_speedup_vs_fastest_peer"
            if fig.has(speedup):
                peer = fig.raw(f"{key}_fastest_peer")
                peak = (f"; its peak is {fig.x(f'{key}_peak_vs_fastest_peer')} that peer's"
                        if fig.has(f"{key}_peak_vs_fastest_peer") else "")
                lines.append(f"* **{MODEL_LABELS[model]}, checkpointing {ckpt}:** the recipe's tokens/s are "
                             f"{fig.x(speedup)} {fig.interval(speedup)}"
                             f" those of the fastest peer that ran, {STEP_LABELS.get(peer, peer)}{peak}.")
    for model in MODEL_LABELS:
        for ckpt in ("off", "on"):
            for variant, name in OUR_VARIANTS.items():
                key = f"peers_step_{model}_ckpt_{ckpt}_{name}_speedup_vs_ours"
                if fig.has(key):
                    label = STEP_LABELS[variant]
                    lines.append(f"* **{label[0].upper() + label[1:]}** ({MODEL_LABELS[model]}, checkpointing "
                                 f"{ckpt}): {fig.x(key)} {fig.interval(key)} the recipe's tokens/s "
                                 f"({_verdict(fig, key, False)}).")
    for peer in LORA_PEERS:
        key = f"peers_lora_worst_time_vs_{peer}"
        if fig.has(key):
            lines.append(f"* **LoRA projections against {peer}:** in the worst cell of notebook 05's grid ours takes "
                         f"{fig.x(key)} {fig.interval(key)} {peer}'s time ({_verdict(fig, key, True)}).")
    for peer in MOE_PEERS:
        key = f"peers_moe_full_worst_speedup_vs_{peer}"
        if fig.has(key):
            lines.append(f"* **MoE experts against {peer}:** in the worst fine-grained cell {peer} takes "
                         f"{fig.x(key)} {fig.interval(key)} our time ({_verdict(fig, key, False)}).")
    if fig.has("peers_loss_worst_time_vs_quack"):
        key = "peers_loss_worst_time_vs_quack"
        lines.append(f"* **The loss against QuACK:** at the Llama-3-8B head ours takes {fig.x(key)} "
                     f"{fig.interval(key)} QuACK's time in the worse of the trainable and frozen cells "
                     f"({_verdict(fig, key, True)}).")
    return lines

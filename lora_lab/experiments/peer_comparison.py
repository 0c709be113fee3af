"""The metrics of lora_lab beside the peers users pick instead (axolotl, unsloth, LlamaFactory, VeOmni, SonicMoE,
QuACK), from the rows of ``benchmarks/bench_peers.py`` (per op) and of a full-depth step benchmark (per model).

Every ratio pairs ours with a peer within one repetition (``measure.repetition_ratios``); a "worst" metric is, per
repetition, the worst cell's ratio. A peer that did not run in every cell of a metric gets
``peers_<group>_<peer>_cells_not_run`` (a count) instead of the ratio, and :func:`peer_status` says why.

Keys (notebook 10 records them):

* ``peers_lora_worst_time_vs_<peer>`` (axolotl, unsloth): ours' time over the peer's, the worst cell of notebook 05's
  grid across the LoRA linear, QKV and MLP (below 1: ours faster everywhere); per op
  ``peers_<op>_worst_time_vs_<peer>``;
* ``peers_moe_full_worst_speedup_vs_<peer>`` (sonicmoe, llamafactory, veomni, liger): the peer's time over ours, the
  worst fine-grained cell; ``peers_moe_lora_worst_speedup_vs_veomni`` with LoRA on the experts;
* ``peers_loss_time_vs_quack_<head>`` (trainable, frozen) at the Llama-3-8B head and 16,384 tokens, and
  ``peers_loss_worst_time_vs_quack``;
* ``peers_step_<model>_ckpt_<off|on>_speedup_vs_fastest_peer``: ours' tokens/s over the fastest peer's (the peer
  with the highest median tokens/s that ran), ``..._peak_vs_fastest_peer`` (ours' peak over that peer's) and
  ``..._fastest_peer`` (its name).
"""
from __future__ import annotations

import statistics
from pathlib import Path

from lora_lab.lab import measure

LORA_OPS = ("lora_linear", "lora_qkv", "lora_mlp")
LORA_PEERS = ("axolotl", "unsloth")
MOE_PEERS = ("sonicmoe", "llamafactory", "veomni", "liger")
OURS = "ours"


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
            if r["impl"] != OURS and r.get("status", "ok") == "ok" and r.get("tokens_per_s") is not None:
                ran.setdefault(r["impl"], []).append(r["tokens_per_s"])
        key = f"peers_step_{model}_ckpt_{ckpt}"
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


def benchmark_metrics(directory, allow_smoke: bool = False) -> dict:
    """:func:`ops_metrics` and :func:`step_metrics` of the CSVs in ``directory`` (either may be absent), refusing
    rows written by other code (``measure.read_csv``) and, unless ``allow_smoke``, rows of a ``--smoke`` run."""
    out: dict = {}
    for name, metrics in ((OPS_CSV, ops_metrics), (STEP_CSV, step_metrics)):
        path = Path(directory) / name
        if not path.is_file():
            continue
        rows = measure.read_csv(path)
        if not allow_smoke and any(r.get("smoke") for r in rows):
            raise ValueError(f"{path} holds a --smoke run (tiny stand-in shapes): not a measurement to record")
        out.update(metrics(rows))
    return out

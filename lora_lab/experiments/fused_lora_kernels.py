"""The measurements notebook 05 reports about the fused LoRA kernels, as plain functions.

* :func:`linear_numerics`     — fused LoRA linear vs the fp64 reference: worst cosine and relative L2 errors
* :func:`shared_input_numerics` — the same for the shared-input op (GatedDeltaNet-like four projections)
* :func:`saved_bytes_per_linear` — bytes autograd keeps for backward: PEFT default vs fused
* :func:`patched_training_losses` — losses of a PEFT model trained unpatched and patched from the same start
* :func:`dora_is_refused`     — patch_model refuses DoRA and changes nothing
* :func:`benchmark_metrics`   — the speed and memory ratios of the GPU benchmarks' CSVs (benchmarks/bench_*.py)
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from lora_lab.kernels import (
    KernelConfig,
    UnsupportedLoRAError,
    dropout_keep_mask,
    fused_lora_linear,
    fused_shared_input_lora,
    lora_linear_reference,
    patch_model,
    patched_layers,
    shared_input_lora_reference,
)
from lora_lab.lab import measure
from lora_lab.layer import SingleChild
from lora_lab.memory import budget, saved_bytes_excluding
from lora_lab.numerics import cosine, rel_l2
from lora_lab.training import train_steps

__all__ = [
    "linear_numerics",
    "shared_input_numerics",
    "saved_bytes_per_linear",
    "patched_training_losses",
    "dora_is_refused",
    "benchmark_metrics",
]


def triton_everywhere() -> KernelConfig:
    """The kernels' own numerics, whatever engine a shape would be dispatched to, each kernel with its first tile
    configuration (no autotuning: tuning picks a tile for speed, and every tile accumulates in fp32; it would
    compile and time every tile at each odd shape); other settings as configured."""
    return KernelConfig.from_env(dispatch="triton", autotune=False)


def _one_linear_case(M, K, N, r, dtype, device, bias, p, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(N, K, generator=g) / K**0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if bias else None
    A = (torch.randn(r, K, generator=g) / K**0.5).to(device, dtype).requires_grad_()
    B = (torch.randn(N, r, generator=g) / r**0.5).to(device, dtype).requires_grad_()
    dropout_seed = 1000 + seed
    y = fused_lora_linear(x, w, b, A, B, 2.0, dropout_p=p, seed=dropout_seed if p else None,
                          config=triton_everywhere())
    mask = dropout_keep_mask(dropout_seed, M, K, p, device) if p else None
    xr, Ar, Br = (t.detach().double().requires_grad_() for t in (x, A, B))
    yr = lora_linear_reference(xr, w, b, Ar, Br, 2.0, keep_mask=mask, dropout_p=p, dtype=torch.float64)
    gy = torch.randn(yr.shape, generator=g, dtype=torch.float64).to(device)
    y.backward(gy.to(dtype))
    yr.backward(gy)
    return {"fwd_cosine": cosine(y, yr), "y_rel_l2": rel_l2(y, yr), "dx_rel_l2": rel_l2(x.grad, xr.grad),
            "da_rel_l2": rel_l2(A.grad, Ar.grad), "db_rel_l2": rel_l2(B.grad, Br.grad)}


def linear_numerics(cases, dtype, device) -> dict:
    """Worst errors over ``cases`` = [(M, K, N, r, bias, dropout_p), ...]: min cosine, max relative L2s."""
    worst = {"fwd_cosine": 1.0, "y_rel_l2": 0.0, "dx_rel_l2": 0.0, "da_rel_l2": 0.0, "db_rel_l2": 0.0}
    rows = []
    for i, (M, K, N, r, bias, p) in enumerate(cases):
        res = _one_linear_case(M, K, N, r, dtype, device, bias, p, seed=i)
        rows.append({"M": M, "K": K, "N": N, "r": r, "bias": bias, "dropout": p, **res})
        worst["fwd_cosine"] = min(worst["fwd_cosine"], res["fwd_cosine"])
        for k in ("y_rel_l2", "dx_rel_l2", "da_rel_l2", "db_rel_l2"):
            worst[k] = max(worst[k], res[k])
    return {"worst": worst, "cases": rows}


def shared_input_numerics(lead, K, splits, ranks, dtype, device, seed=0) -> dict:
    """Shared-input op vs separate fp64 projections: worst output cosine and worst gradient relative L2."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, K, generator=g).to(device, dtype).requires_grad_()
    Ws = [(torch.randn(n, K, generator=g) / K**0.5).to(device, dtype) for n in splits]
    As = [(torch.randn(r, K, generator=g) / K**0.5).to(device, dtype).requires_grad_() if r else None for r in ranks]
    Bs = [(torch.randn(n, r, generator=g) / max(r, 1) ** 0.5).to(device, dtype).requires_grad_() if r else None
          for n, r in zip(splits, ranks)]
    scalings = [2.0] * len(splits)
    outs = fused_shared_input_lora(x, torch.cat(Ws), None, splits, As, Bs, scalings, config=triton_everywhere())
    xr = x.detach().double().requires_grad_()
    Ar = [a.detach().double().requires_grad_() if a is not None else None for a in As]
    Br = [b.detach().double().requires_grad_() if b is not None else None for b in Bs]
    refs = shared_input_lora_reference(xr, Ws, [None] * len(Ws), Ar, Br, scalings, dtype=torch.float64)
    gys = [torch.randn(r.shape, generator=g, dtype=torch.float64).to(device) for r in refs]
    sum((o * gy.to(dtype)).sum() for o, gy in zip(outs, gys)).backward()
    sum((r * gy).sum() for r, gy in zip(refs, gys)).backward()
    grad_errs = [rel_l2(x.grad, xr.grad)]
    for a, ar, b, br in zip(As, Ar, Bs, Br):
        if a is not None:
            grad_errs += [rel_l2(a.grad, ar.grad), rel_l2(b.grad, br.grad)]
    return {"fwd_cosine": min(cosine(o, r) for o, r in zip(outs, refs)), "grad_max_rel_l2": max(grad_errs)}


def saved_bytes_per_linear(M, K, N, r, dtype, device) -> dict:
    """Bytes saved for backward by one LoRA linear (parameters excluded), PEFT default (fp32 adapters) vs fused."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    lin = nn.Linear(K, N, bias=False, device=device, dtype=dtype)
    model = get_peft_model(SingleChild(lin, "proj"), LoraConfig(r=r, lora_alpha=2 * r, target_modules=["proj"]))
    fused = copy.deepcopy(model)
    patch_model(fused)
    x = torch.randn(M, K, device=device, dtype=dtype, requires_grad=True)
    params = list(model.parameters()) + list(fused.parameters())
    peft_bytes = saved_bytes_excluding(lambda: model(x), params + [x])
    fused_bytes = saved_bytes_excluding(lambda: fused(x), params + [x])
    x_bytes = x.numel() * x.element_size()
    # X itself is saved by both (excluded above, as the layer's input is kept by whoever produced it anyway):
    # count it once for each so the ratio compares what each layer keeps alive
    return {"peft": peft_bytes + x_bytes, "fused": fused_bytes + x_bytes,
            "adapter_dtype": str(model.base_model.model.proj.lora_A["default"].weight.dtype)}


def patched_training_losses(model, ids, steps, lr=1e-3) -> tuple[list[float], list[float]]:
    """Train a copy unpatched and a copy patched from the same weights (train mode); returns both loss lists."""
    fused = copy.deepcopy(model)
    patch_model(fused, config=triton_everywhere())  # the Triton kernels, not the small-shape cuBLAS dispatch
    model.train()
    fused.train()
    batch = {"input_ids": ids, "labels": ids}
    ref_losses = train_steps(model, batch, steps, lr)
    fused_losses = train_steps(fused, batch, steps, lr)
    return ref_losses, fused_losses


def dora_is_refused(model_factory) -> bool:
    """True iff patch_model raises UnsupportedLoRAError naming DoRA and leaves every layer unpatched."""
    model = model_factory()
    try:
        patch_model(model)
    except UnsupportedLoRAError as err:
        return "DoRA" in str(err) and patched_layers(model) == []
    return False


LINEAR_CSV, GDN_CSV, TRAIN_CSV = "05_lora_linear.csv", "05_gated_deltanet.csv", "05_train_step.csv"
# the per-repetition CSVs each benchmark script writes: what notebook 05 pools over sessions
BENCHMARK_CSVS = {"bench_lora_linear.py": [LINEAR_CSV, "05_lora_linear_components.csv"],
                  "bench_gated_deltanet.py": [GDN_CSV], "bench_lora_train_step.py": [TRAIN_CSV]}
TARGET_CELL = "32k_4096x4096_r16"  # M = 32768 tokens, K = N = 4096, r = 16: the target cell
# the GEMM core as a LoRA linear: bench_lora_linear's persistent / folded variants (its default set; there are no
# warp-specialised forms: their build failed to compile on the H200)
CORE_VARIANTS = ("fused_persistent", "fused_fold")
# the shipped op with its four rank-r passes as cuBLAS calls (KernelConfig(rank_ops="torch"))
RANK_OPS_VARIANT = "fused_torch_rank"
TRAIN_MODELS = {"qwen3-4096": "qwen3_4096", "qwen2.5-0.5b": "qwen2_5_0_5b"}
# the routes to the frozen layer's cost (bench_lora_linear --variants routes): {variant: the frozen layer it is
# compared with}; a graphed step is compared with the frozen layer graphed (the same dY copy into the graph)
ROUTE_VARIANTS = {"fused_cublas_base": "base", "fused_cublas_base_qdb": "base", "fused_pure_cublas": "base",
                  "fused_graphed": "base_graphed", "fused_cublas_base_graphed": "base_graphed",
                  "fused_pure_cublas_graphed": "base_graphed"}
# the big GEMMs on QuACK with the rank-r term in their epilogue (kernels/lora/quack_gemm), ungraphed (also with Q
# and dB in one pass over dY: fuse_q_db) and graphed: measured like the routes, kept out of the routes' best-of
# figure (registered before this route existed)
QUACK_VARIANTS = {"fused_quack": "base", "fused_quack_qdb": "base", "fused_quack_graphed": "base_graphed"}
# one cuBLAS GEMM over a widened reduction ([X | P] · [W | B]ᵀ, kernels/lora/widened), ungraphed and graphed:
# measured like the routes in every cell, kept out of the routes' best-of figure (registered before it existed)
WIDE_VARIANTS = {"fused_wide": "base", "fused_wide_graphed": "base_graphed"}
# the frozen layer's cuBLAS GEMMs on W + s·B A merged per call (kernels/lora/merged): rank-r products by cuBLAS, or Q
# and dB in one Triton pass; ungraphed, graphed, and with the rank-r passes on a side stream beside the GEMMs
# (overlap="on"), and with P and Q as more output columns of its GEMMs (base_gemm="stacked", kernels/lora/stacked:
# Triton's merge and token reductions, or cuBLAS's; ungraphed and graphed): measured like the routes, kept out of
# their best-of figure
MERGED_VARIANTS = {"fused_merged": "base", "fused_merged_qdb": "base", "fused_merged_graphed": "base_graphed",
                   "fused_merged_overlap": "base", "fused_merged_qdb_overlap": "base", "fused_stacked": "base",
                   "fused_stacked_cublas": "base", "fused_stacked_graphed": "base_graphed",
                   "fused_stacked_cublas_graphed": "base_graphed"}


def _rows(path: Path, allow_smoke: bool) -> list[dict]:
    rows = measure.read_csv(path)  # refuses rows written by other code (StaleResultError)
    if not allow_smoke and any(row.get("smoke") for row in rows):
        raise ValueError(f"{path} holds a --smoke run (tiny stand-in shapes): not a measurement to record")
    return rows


def _ratio(rows, value, numerator: dict, denominator: dict) -> dict:
    return measure.ratio_summary(rows, value, numerator, denominator)


def _memory_ratio(rows, column, numerator: dict, denominator: dict):
    """``column`` of the numerator's rows over the denominator's (measured once per cell, on every rep's row);
    None where it was not measured (CPU smoke runs)."""
    def value(match):
        return next(r[column] for r in rows if all(r.get(k) == v for k, v in match.items()))

    top, bottom = value(numerator), value(denominator)
    return None if top is None or bottom is None else top / bottom


def _tflops(rows, cell: str, variant: str) -> dict:
    """TFLOP/s of ``variant`` in ``cell`` per repetition, counting the frozen layer's forward and dX GEMMs."""
    first = next(r for r in rows if r["cell"] == cell)
    flops = 4.0 * first["M"] * first["K"] * first["N"]
    times = measure.by_repetition(rows, "fwd_bwd_ms", cell=cell, variant=variant)
    return measure.summarize((flops / (ms * 1e-3) / 1e12 for _, ms in sorted(times.items())),
                             sessions=measure.sessions_in(rows))


def _worst_cell(rows, cells, variant: str) -> dict:
    """Per repetition, the largest time ratio of ``variant`` over the frozen layer across ``cells``."""
    per_cell = [measure.repetition_ratios(rows, "fwd_bwd_ms", {"cell": c, "variant": variant},
                                          {"cell": c, "variant": "base"}) for c in cells]
    return measure.summarize((max(reps) for reps in zip(*per_cell)), sessions=measure.sessions_in(rows))


def core_variant_metrics(rows, cells) -> dict:
    """The GEMM core as a LoRA linear (``fused_persistent``, ``fused_fold``), for each variant the benchmark
    timed in every cell: time and peak over the frozen layer in the target cell, the forward and dX GEMMs' TFLOP/s
    there, and the worst cell's time ratio. A variant that failed somewhere
    (a row with status ``error``) gets ``lora_linear_<variant>_failed_cells`` instead of ratios."""
    out: dict = {}
    t = TARGET_CELL
    for variant in CORE_VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]
        if not mine:
            continue
        failed = sorted({r["cell"] for r in mine if r.get("status", "ok") != "ok"})
        if failed:
            out[f"lora_linear_{variant}_failed_cells"] = len(failed)
            continue
        if t in cells:
            out[f"lora_linear_{variant}_time_vs_base_{t}"] = _ratio(
                rows, "fwd_bwd_ms", {"cell": t, "variant": variant}, {"cell": t, "variant": "base"})
            out[f"lora_linear_{variant}_peak_vs_base_{t}"] = _memory_ratio(
                rows, "peak_bytes", {"cell": t, "variant": variant}, {"cell": t, "variant": "base"})
            out[f"lora_linear_{variant}_tflops_{t}"] = _tflops(rows, t, variant)
        out[f"lora_linear_{variant}_worst_time_vs_base"] = _worst_cell(rows, cells, variant)
    return out


def rank_ops_metrics(rows, cells) -> dict:
    """The rank-r passes as cuBLAS calls (``fused_torch_rank``), where the benchmark timed it in every cell: its
    time over the frozen layer at the target cell and in its worst cell, over the shipped op at the target cell,
    and its host time per call there."""
    v, t = RANK_OPS_VARIANT, TARGET_CELL
    mine = [r for r in rows if r["variant"] == v]
    if not mine or any(r.get("status", "ok") != "ok" for r in mine):
        return {f"lora_linear_{v}_failed_cells": len({r["cell"] for r in mine if r.get("status", "ok") != "ok"})} \
            if mine else {}
    out = {}
    if t in cells:
        out[f"lora_linear_{v}_time_vs_base_{t}"] = _ratio(rows, "fwd_bwd_ms", {"cell": t, "variant": v},
                                                           {"cell": t, "variant": "base"})
        out[f"lora_linear_{v}_time_vs_fused_{t}"] = _ratio(rows, "fwd_bwd_ms", {"cell": t, "variant": v},
                                                            {"cell": t, "variant": "fused"})
        out.update(_host_ms(rows, t, v))
    out[f"lora_linear_{v}_worst_time_vs_base"] = _worst_cell(rows, cells, v)
    return out


def _worst_host_ms(rows, cells, variant: str) -> dict:
    """Per repetition, the largest host time per call of ``variant`` across ``cells``."""
    per_cell = [measure.by_repetition(rows, "host_ms", cell=c, variant=variant) for c in cells]
    reps = sorted(set.intersection(*(set(p) for p in per_cell)))
    if not reps:
        raise ValueError(f"host_ms of {variant}: no repetition holds every cell")
    return measure.summarize((max(p[k] for p in per_cell) for k in reps), sessions=measure.sessions_in(rows))


def route_metrics(rows, cells) -> dict:
    """The routes to the frozen layer's cost (:data:`ROUTE_VARIANTS`, QuACK's :data:`QUACK_VARIANTS`, the widened
    reduction's :data:`WIDE_VARIANTS` and the merged weight's :data:`MERGED_VARIANTS`), each where
    the benchmark timed it and its reference in every cell (the target cell's metrics need only that cell): time
    over the reference at the target cell, in the worst cell, and (graphed steps) over the ungraphed frozen layer
    at the target cell; host time per call at the target cell and in the worst cell.
    ``lora_linear_routes_best_worst_time_vs_base``: per repetition, the smallest worst-cell ratio among
    :data:`ROUTE_VARIANTS` (each over its own reference). The frozen layer graphed: its host time and its time over
    the ungraphed one at the target cell. A route that failed somewhere gets ``lora_linear_<variant>_failed_cells``."""
    out: dict = {}
    t = TARGET_CELL
    ran = {c: {r["variant"] for r in rows if r["cell"] == c and r.get("status", "ok") == "ok"} for c in cells}
    if "base_graphed" in ran.get(t, ()):
        out[f"lora_linear_base_graphed_time_vs_base_{t}"] = _ratio(
            rows, "fwd_bwd_ms", {"cell": t, "variant": "base_graphed"}, {"cell": t, "variant": "base"})
        out.update(_host_ms(rows, t, "base_graphed"))
    worst = {}
    for variant, ref in {**ROUTE_VARIANTS, **QUACK_VARIANTS, **WIDE_VARIANTS, **MERGED_VARIANTS}.items():
        # a route's target-cell figures need it in every cell; QuACK's only in the target cell (its epilogue takes
        # ranks up to 32: the r = 64 cells run without it)
        reps = _route_metrics(rows, cells, ran, variant, ref, out, every_cell=variant not in QUACK_VARIANTS)
        if reps is not None and variant in ROUTE_VARIANTS:
            worst[variant] = reps
    if worst:
        out["lora_linear_routes_best_worst_time_vs_base"] = measure.summarize(
            (min(reps) for reps in zip(*worst.values())), sessions=measure.sessions_in(rows))
    return out


def _route_metrics(rows, cells, ran: dict, variant: str, ref: str, out: dict, every_cell: bool) -> list | None:
    """One route's metrics into ``out`` (see :func:`route_metrics`); returns its worst-cell ratio per repetition,
    or None where it did not run against its reference in every cell (``every_cell``: then nothing is recorded)."""
    t = TARGET_CELL
    mine = [r for r in rows if r["variant"] == variant]
    failed = sorted({r["cell"] for r in mine if r.get("status", "ok") == "error"})
    if failed:
        out[f"lora_linear_{variant}_failed_cells"] = len(failed)
        return None
    suffix = "time_vs_base" if ref == "base" else "time_vs_base_graphed"
    in_every_cell = bool(cells) and all({variant, ref} <= ran[c] for c in cells)
    if every_cell and not in_every_cell:
        return None
    if t in cells and {variant, ref} <= ran[t]:
        out[f"lora_linear_{variant}_{suffix}_{t}"] = _ratio(rows, "fwd_bwd_ms", {"cell": t, "variant": variant},
                                                             {"cell": t, "variant": ref})
        if ref != "base":
            out[f"lora_linear_{variant}_time_vs_base_{t}"] = _ratio(
                rows, "fwd_bwd_ms", {"cell": t, "variant": variant}, {"cell": t, "variant": "base"})
        out.update(_host_ms(rows, t, variant))
    if not in_every_cell:
        return None
    per_cell = [measure.repetition_ratios(rows, "fwd_bwd_ms", {"cell": c, "variant": variant},
                                          {"cell": c, "variant": ref}) for c in cells]
    worst = [max(reps) for reps in zip(*per_cell)]
    out[f"lora_linear_{variant}_worst_{suffix}"] = measure.summarize(worst, sessions=measure.sessions_in(rows))
    if all(r.get("host_ms") is not None for r in mine):
        out[f"lora_linear_{variant}_worst_host_ms"] = _worst_host_ms(rows, cells, variant)
    return worst


def note_skipped_quack(rows: list[dict]) -> dict[str, str]:
    """Each QuACK variant the benchmark skipped at the target cell (QuACK not installed, a GPU before Hopper, ...)
    kept as a skipped cell under its name with the benchmark's reason (:func:`lora_lab.memory.budget.note_skipped`),
    so a prediction on its metrics grades void saying why. Returns {variant: reason}."""
    noted = {}
    for r in rows:
        v = r["variant"]
        if v in QUACK_VARIANTS and r["cell"] == TARGET_CELL and r.get("status") == "skipped" and v not in noted:
            noted[v] = f"not run: {str(r.get('error') or 'skipped')[:240]}"
            budget.note_skipped(v, noted[v])
    return noted


HOST_COLUMNS = ("host_ms", "host_busy_ms")  # the host's time per call from an idle device, and behind a busy one


def _host_ms(rows, cell: str, variant: str) -> dict:
    """``{lora_linear_<variant>_<column>_<cell>: summary}`` for each of :data:`HOST_COLUMNS` the rows hold (the
    repetitions that have it; ``host_busy_ms`` is absent from CPU runs and older CSVs)."""
    out = {}
    for column in HOST_COLUMNS:
        host = measure.by_repetition(rows, column, cell=cell, variant=variant)
        if host:
            out[f"lora_linear_{variant}_{column}_{cell}"] = measure.summarize(
                (v for _, v in sorted(host.items())), sessions=measure.sessions_in(rows))
    return out


def plot_pooled(root: Path | str, directory: Path | str) -> list[str]:
    """Redraw the benchmark scripts' figures and summary CSVs from the pooled per-repetition CSVs in ``directory``
    (each script's own ``summary_rows`` and ``plot``, imported from ``root/benchmarks``), so the published figures
    show every session's repetitions. Returns the scripts redrawn (those whose CSV is present)."""
    import importlib
    import sys

    d, bench = Path(directory), str(Path(root) / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    done = []
    for script, csvs in BENCHMARK_CSVS.items():
        if not (d / csvs[0]).is_file():
            continue
        module = importlib.import_module(Path(script).stem)
        rows = measure.read_csv(d / csvs[0])
        ok = [r for r in rows if r.get("status", "ok") == "ok"]
        if not ok:  # nothing ran (under a memory cap, every cell skipped): no figure to draw
            continue
        summary = module.summary_rows(ok)
        measure.write_csv(summary, d / module.SUMMARY_CSV)
        if script == "bench_gated_deltanet.py":
            module.plot(summary, ok, d, ok[0]["seq"])
        else:
            module.plot(summary, ok, d)
        done.append(script)
    return done


def note_capped_train_models(rows: list[dict]) -> dict[str, str]:
    """Under a GPU memory cap (:mod:`lora_lab.memory.budget`): each model of ``bench_lora_train_step`` that was skipped
    as not fitting, or ran out of memory, kept as a skipped cell under its metrics' suffix (``qwen3_4096``), so its
    missing ``train_*`` metrics grade void with the reason. Returns {suffix: reason}; without a cap, nothing."""
    cap = budget.memory_cap_gib()
    if cap is None:
        return {}
    noted = {}
    for r in rows:
        key = TRAIN_MODELS.get(r["model"])
        if key is None or r.get("status", "ok") not in ("skipped", "oom") or key in noted:
            continue
        noted[key] = (f"{r['status']} under the {cap:g} GiB memory cap (${budget.MEMORY_CAP_ENV}): "
                      f"{str(r.get('error') or '')[:240]}")
        budget.note_skipped(key, noted[key])
    return noted


def benchmark_metrics(directory, allow_smoke: bool = False) -> dict:
    """Notebook 05's speed and memory metrics from the benchmark CSVs in ``directory`` (those present).

    Every time or throughput ratio is a ``measure.summarize`` dict over the repetitions — each repetition's ratio
    pairs two variants timed in the same side-by-side loop; memory ratios are floats (None where not measured).
    The target-cell metrics need the run to include that cell. CSVs written by other code are refused
    (``measure.StaleResultError``), and so are ``--smoke`` runs unless ``allow_smoke``.
    """
    d = Path(directory)
    out: dict = {}
    if (d / LINEAR_CSV).exists():
        rows = _rows(d / LINEAR_CSV, allow_smoke)
        t = TARGET_CELL

        def at(variant, cell=t):
            return {"cell": cell, "variant": variant}

        if any(r["cell"] == t for r in rows):
            out[f"lora_linear_time_vs_base_{t}"] = _ratio(rows, "fwd_bwd_ms", at("fused"), at("base"))
            out[f"peft_time_vs_base_{t}"] = _ratio(rows, "fwd_bwd_ms", at("peft"), at("base"))
            out[f"lora_linear_speedup_vs_peft_{t}"] = _ratio(rows, "fwd_bwd_ms", at("peft"), at("fused"))
            out[f"lora_linear_peak_vs_base_{t}"] = _memory_ratio(rows, "peak_bytes", at("fused"), at("base"))
            for variant in ("base", "fused", "peft"):
                out[f"lora_linear_{variant}_tflops_{t}"] = _tflops(rows, t, variant)
            for variant in ("base", "fused"):  # the host's own time per call (absent from older CSVs)
                out.update(_host_ms(rows, t, variant))
        cells = list(dict.fromkeys(r["cell"] for r in rows))
        out["lora_linear_worst_time_vs_base"] = _worst_cell(rows, cells, "fused")
        out["lora_linear_cells"] = len(cells)
        out.update(core_variant_metrics(rows, cells))
        out.update(rank_ops_metrics(rows, cells))
        out.update(route_metrics(rows, cells))
        note_skipped_quack(rows)
    if (d / GDN_CSV).exists():
        rows = _rows(d / GDN_CSV, allow_smoke)
        out["gdn_time_vs_base"] = _ratio(rows, "fwd_bwd_ms", {"variant": "fused"}, {"variant": "base"})
        out["gdn_speedup_vs_peft"] = _ratio(rows, "fwd_bwd_ms", {"variant": "peft"}, {"variant": "fused"})
        out["gdn_peft_time_vs_base"] = _ratio(rows, "fwd_bwd_ms", {"variant": "peft"}, {"variant": "base"})
        saved = {v: next(r["saved_activation_bytes"] for r in rows if r["variant"] == v) for v in ("peft", "fused")}
        out["gdn_saved_gib_less_than_peft"] = (saved["peft"] - saved["fused"]) / 2**30
    if (d / TRAIN_CSV).exists():
        every = _rows(d / TRAIN_CSV, allow_smoke)
        rows = [r for r in every if r.get("status", "ok") == "ok"]
        note_capped_train_models(every)
        for model, key in TRAIN_MODELS.items():
            if not any(r["model"] == model for r in rows):
                continue
            fused, peft = {"model": model, "variant": "fused"}, {"model": model, "variant": "peft"}
            out[f"train_speedup_vs_peft_{key}"] = _ratio(rows, "tokens_per_s", fused, peft)
            out[f"train_peak_vs_peft_{key}"] = _memory_ratio(rows, "peak_bytes", fused, peft)
    return out

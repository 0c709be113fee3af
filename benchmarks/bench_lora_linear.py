"""Benchmark: one LoRA projection, forward + backward, bf16 — the frozen layer, PEFT and the fused kernels.

What a LoRA layer costs over the frozen one it adapts, on the issue's grid: tokens M ∈ {8192, 32768},
(K, N) ∈ {4096×4096, 4096×12288, 12288×4096}, rank r ∈ {16, 64}. One step = forward, then
``torch.autograd.grad`` of a fixed dY for X and the trainable parameters (nothing accumulates between calls).

Variants, on the same X, dY and frozen weight (default: DEFAULT_VARIANTS below; ``--variants`` names others, base,
peft and fused always; ``all`` for every one, ``routes`` for ROUTES):
  base          frozen nn.Linear (Y = X Wᵀ, dX = dY W: two GEMMs)
  peft          PEFT lora.Linear, default settings (fp32 adapters: X cast bf16 → fp32 for the adapter)
  peft_nocast   PEFT lora.Linear with bf16 adapters (no input cast)
  chained       chained-cuBLAS autograd Function, ours (lora_lab.kernels.chained_lora_linear; the peers' own
                kernels are timed by bench_peers.py)
  fused         lora_lab.kernels.fused_lora_linear with the shipped KernelConfig (Triton, rank-r term folded
                into the GEMMs; the same formulas as cuBLAS calls below a GEMM volume, see kernels/lora/dispatch)
  fused_*       the same op with one KernelConfig field changed (FUSED_CONFIGS below): Triton at every shape,
                dA/dB on a side stream, Q and dB in one pass, the big GEMM by cuBLAS onto a Triton rank-r term,
                every GEMM by cuBLAS (fused_pure_cublas: the rank-r terms first, the big GEMMs added with β = 1)
  *_graphed     the variant's forward and backward captured as two CUDA graphs (lora_lab.kernels.graphed_lora_linear):
                the host launches two graphs per step; base_graphed is their fair reference (the incoming dY is
                copied into the graph's buffer, by every graphed variant alike). CUDA only: skipped rows on a CPU

Repetitions: ``--repetitions N`` (default measure.MIN_REPETITIONS) complete side-by-side loops per cell; each
times every variant once, the order rotating from one repetition to the next. Peak memory
(``measure.peak_bytes`` of one step, everything the step needs already allocated) is measured once per cell and
variant (not for a graphed one: its memory is the graph's pool, allocated at capture). ``--sessions N`` runs the
script N times, one process after another, and pools the rows (intervals then span processes).
``fwd_bwd_ms`` / ``fwd_ms``: the user's loop (median of ``measure.loop_ms``: CUDA events around each call,
synchronised after it, so host time counts); ``host_ms``: the host's own time per call (``measure.host_ms``:
from the call to its return, synchronised outside; a step is host-bound where it exceeds the GPU time);
``host_busy_ms`` (CUDA; ``--host-busy``: the target cell by default): the same call made behind a sleep kernel
that keeps the device busy (``measure.host_ms_busy``: launches behind a busy queue cost the host more than from an
idle device, so it is not the call's CPU time; tools/host_busy_probe.py), and ``host_waits``, the calls among them
that returned only after the device had run dry (a call that synchronises);
``--host-profile``: 05_lora_linear_host_profile.csv, the host-side events of a few calls per cell and variant
(operators, autograd functions, CUDA runtime calls), to tell a launch or a synchronisation from Python work;
``back_to_back_ms`` (with ``--back-to-back``): ``measure.kernel_loop_ms`` (``do_bench``, calls
queued unsynchronised), a labelled secondary column, as are the components' ``ms``. Notebook 05 reads the
per-repetition rows
through ``fused_lora_kernels.benchmark_metrics``.

Writes into --out: 05_lora_linear.csv (one row per cell, variant and repetition), 05_lora_linear_summary.csv
(medians and 95% intervals), 05_lora_linear_components.csv (with --components: where the fused step's time goes,
next to cuBLAS for the same GEMMs), 05_lora_linear_ratio.png and 05_lora_linear_time_vs_tokens.png.

    python benchmarks/bench_lora_linear.py --out DIR                      # the 12-cell grid, base/peft/fused
    python benchmarks/bench_lora_linear.py --out DIR --variants all --components target
    python benchmarks/bench_lora_linear.py --out DIR --variants routes --sessions 2 --repetitions 3 --calls 6 \
        --no-back-to-back --ledger FILE    # the cuBLAS and graphed routes (ROUTES) beside base, peft and fused
    TRITON_INTERPRET=1 python benchmarks/bench_lora_linear.py --out DIR --smoke    # CPU: the grid at tiny size
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_common import (
    add_common_arguments,
    check_device,
    chosen_variants,
    device_line,
    error_text,
    ledger_csv,
    repetition_dots,
    without_options,
    write_summary,
)
from torch import nn

from lora_lab.lab import measure
from lora_lab.layer import SingleChild, fill_lora_B

CSV, SUMMARY_CSV, COMPONENTS_CSV = "05_lora_linear.csv", "05_lora_linear_summary.csv", "05_lora_linear_components.csv"
HOST_PROFILE_CSV = "05_lora_linear_host_profile.csv"  # --host-profile: where each variant's host time goes
TARGET = (32768, 4096, 4096, 16)  # the target cell (M, K, N, r)
REQUIRED_VARIANTS = ("base", "peft", "fused")  # a failure of one of these fails the benchmark; always timed
# the fused op with one KernelConfig field changed from the shipped settings
FUSED_CONFIGS = {
    "fused": {},
    "fused_triton": {"dispatch": "triton"},
    # the four rank-r passes as cuBLAS calls around the Triton GEMMs (fewer Triton launches per step)
    "fused_torch_rank": {"dispatch": "triton", "rank_ops": "torch"},
    "fused_overlap": {"overlap": "on"},
    "fused_qdb": {"fuse_q_db": True},
    "fused_qdb_overlap": {"fuse_q_db": True, "overlap": "on"},
    "fused_cublas_base": {"base_gemm": "cublas"},
    "fused_cublas_base_overlap": {"base_gemm": "cublas", "overlap": "on"},
    "fused_cublas_base_qdb": {"base_gemm": "cublas", "fuse_q_db": True},
    # no Triton launch at all: P, Q, dA, dB and the rank-r terms by cuBLAS, the big GEMMs added onto them (β = 1)
    "fused_pure_cublas": {"base_gemm": "cublas", "rank_ops": "torch"},
    # the GEMM core: the persistent TMA GEMM, and P / Q folded into its K loops
    "fused_persistent": {"dispatch": "triton", "base_gemm": "triton", "gemm_loads": "persistent"},
    "fused_fold": {"dispatch": "triton", "base_gemm": "triton", "gemm_loads": "persistent", "fold_projection": True},
    # the big GEMMs on QuACK's Hopper GEMM with the rank-r term in its epilogue (kernels/lora/quack_gemm; needs
    # quack-kernels: a skipped row naming why where it cannot run, never the Triton route under this name)
    "fused_quack": {"dispatch": "triton", "base_gemm": "quack"},
    "fused_quack_qdb": {"dispatch": "triton", "base_gemm": "quack", "fuse_q_db": True},  # Q and dB: one pass over dY
    # one cuBLAS GEMM over a widened reduction, [X | P] · [W | B]ᵀ and [dY | Q] · [W ; A], the widened activation
    # written by the pass that computes P (Q and dB) from the same read (kernels/lora/widened)
    "fused_wide": {"dispatch": "triton", "base_gemm": "wide"},
    # the frozen layer's cuBLAS GEMMs on W + s·B A, merged per call (kernels/lora/merged): P, Q, dA and dB as cuBLAS
    # calls (no Triton launch), or with Q and dB from one Triton pass over dY
    "fused_merged": {"dispatch": "triton", "base_gemm": "merged", "rank_ops": "torch"},
    "fused_merged_qdb": {"dispatch": "triton", "base_gemm": "merged", "rank_ops": "triton", "fuse_q_db": True},
    # the same two with their rank-r passes on a side stream beside the GEMMs (P beside Y's, Q, dB and dA beside dX's):
    # memory-bound passes next to compute-bound GEMMs
    "fused_merged_overlap": {"dispatch": "triton", "base_gemm": "merged", "rank_ops": "torch", "overlap": "on"},
    "fused_merged_qdb_overlap": {"dispatch": "triton", "base_gemm": "merged", "rank_ops": "triton", "fuse_q_db": True,
                                 "overlap": "on"},
    # the merged route with P and Q as r more output columns of its two GEMMs ([Y | P] = X [W' ; s·A]ᵀ,
    # [dX | Q] = dY [W' | s·B], kernels/lora/stacked): the token reductions dB and dA are the only rank-r passes left,
    # by Triton (with Triton's merge) or by cuBLAS (no Triton launch)
    "fused_stacked": {"dispatch": "triton", "base_gemm": "stacked", "rank_ops": "triton"},
    "fused_stacked_cublas": {"dispatch": "triton", "base_gemm": "stacked", "rank_ops": "torch"},
}
# a variant's forward and backward as CUDA graphs: {graphed variant: the variant it captures}
GRAPHED = {"base_graphed": "base", "fused_graphed": "fused", "fused_cublas_base_graphed": "fused_cublas_base",
           "fused_pure_cublas_graphed": "fused_pure_cublas", "fused_quack_graphed": "fused_quack",
           "fused_wide_graphed": "fused_wide", "fused_merged_graphed": "fused_merged",
           "fused_stacked_graphed": "fused_stacked", "fused_stacked_cublas_graphed": "fused_stacked_cublas"}
ALL_VARIANTS = ["base", "peft", "peft_nocast", "chained", *FUSED_CONFIGS, *GRAPHED]
# --variants routes: the big GEMMs by cuBLAS and the graphed steps, beside the frozen layer (graphed too)
ROUTES = ["fused_cublas_base", "fused_cublas_base_qdb", "fused_pure_cublas", "base_graphed", "fused_graphed",
          "fused_cublas_base_graphed"]
# what notebook 05 times: base, PEFT and ours as shipped, every GEMM by cuBLAS, the graphed step, QuACK's route
# (skipped rows naming why where it cannot run) and the merged weight. The forms docs/changelog.md keeps as tried
# and slower (fused_persistent, fused_fold, fused_torch_rank; the big GEMMs by cuBLAS onto a Triton rank-r term,
# fused_cublas_base*; the widened reduction, fused_wide*; the shipped, all-cuBLAS and merged ops graphed, for which
# the stacked route graphed stands: their predictions were graded by earlier runs) run only when --variants names
# them (``routes``, ``wide``, ``merged``), which keeps the notebook's GPU run short
DROPPED_FROM_DEFAULT = ("fused_cublas_base", "fused_cublas_base_qdb", "fused_cublas_base_graphed", "fused_wide",
                        "fused_wide_graphed", "fused_graphed", "fused_pure_cublas_graphed", "fused_merged_graphed")
DEFAULT_VARIANTS = [v for v in ALL_VARIANTS
                    if v in (*REQUIRED_VARIANTS, *ROUTES, "fused_quack", "fused_quack_qdb", "fused_quack_graphed",
                             "fused_merged", "fused_merged_qdb", "fused_merged_graphed", "fused_merged_overlap",
                             "fused_merged_qdb_overlap", "fused_stacked", "fused_stacked_cublas",
                             "fused_stacked_graphed", "fused_stacked_cublas_graphed")
                    and v not in DROPPED_FROM_DEFAULT]
# --variants quack: the QuACK epilogue route beside the best cuBLAS route, each also as CUDA graphs
QUACK_ROUTES = ["fused_pure_cublas", "fused_quack", "fused_quack_qdb", "base_graphed", "fused_pure_cublas_graphed",
                "fused_quack_graphed"]
# --variants wide: the widened-reduction route beside the β = 1 cuBLAS routes, each also as CUDA graphs
WIDE_ROUTES = ["fused_cublas_base_qdb", "fused_pure_cublas", "fused_wide", "base_graphed",
               "fused_pure_cublas_graphed", "fused_wide_graphed"]
# --variants merged: the merged-weight route beside the all-cuBLAS β = 1 route, each also as CUDA graphs
MERGED_ROUTES = ["fused_pure_cublas", "fused_merged", "fused_merged_qdb", "fused_merged_overlap",
                 "fused_merged_qdb_overlap", "fused_stacked", "fused_stacked_cublas", "base_graphed",
                 "fused_pure_cublas_graphed", "fused_merged_graphed", "fused_stacked_graphed",
                 "fused_stacked_cublas_graphed"]
PRESETS = {"routes": ROUTES, "quack": QUACK_ROUTES, "wide": WIDE_ROUTES, "merged": MERGED_ROUTES}
GRID = {"tokens": [8192, 32768], "shapes": ["4096x4096", "4096x12288", "12288x4096"], "ranks": [16, 64]}
# --smoke: two cells of the grid with every dimension divided (M / 512, K and N / 128, r / 4): the Triton
# interpreter runs the whole code path in seconds
SMOKE_GRID = {"tokens": [8192, 32768], "shapes": ["4096x4096"], "ranks": [16]}
SMOKE_DIVISORS = {"M": 512, "KN": 128, "r": 4}


# measure.loop_ms per variant and repetition (the primary figure: the median); smoke: the code path only
LOOP = {False: dict(calls=6, warmup=3), True: dict(calls=2, warmup=0)}


def cell_label(M: int, K: int, N: int, r: int) -> str:
    return f"{M // 1024}k_{K}x{N}_r{r}"


def peft_projection(weight: torch.Tensor, r: int, fp32_adapters: bool):
    """(model, trainable parameters): PEFT LoRA (alpha 2r, B ~ N(0, 0.02)) around a frozen linear sharing
    ``weight``; ``fp32_adapters=False``: adapters in the weight's dtype and PEFT's input cast off."""
    from peft import LoraConfig, get_peft_model

    N, K = weight.shape
    lin = nn.Linear(K, N, bias=False, device=weight.device, dtype=weight.dtype)
    lin.weight.data = weight
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["proj"], lora_dropout=0.0)
    model = get_peft_model(SingleChild(lin, "proj"), config, autocast_adapter_dtype=fp32_adapters)
    fill_lora_B(model, 0.02)
    if not fp32_adapters:
        layer = model.base_model.model.proj
        layer.lora_A.to(weight.dtype)
        layer.lora_B.to(weight.dtype)
        layer.cast_input_dtype_enabled = False
    return model, [p for p in model.parameters() if p.requires_grad]


class FusedLinear(nn.Module):
    """fused_lora_linear with one KernelConfig as a module (frozen weight, trainable A and B): what a graph captures."""

    def __init__(self, weight, A, B, cfg):
        super().__init__()
        self.register_buffer("weight", weight)
        self.A, self.B, self.cfg = A, B, cfg

    def forward(self, x):
        from lora_lab.kernels import fused_lora_linear

        return fused_lora_linear(x, self.weight, None, self.A, self.B, 2.0, config=self.cfg)


class LazyGraph:
    """``module`` captured as CUDA graphs at its first call's input (lora_lab.kernels.graphed_lora_linear), then
    replayed: the capture happens where the benchmark makes its untimed first call, so a failure is a recorded row."""

    def __init__(self, module):
        self.module, self.graphed = module, None

    def __call__(self, x):
        if self.graphed is None:
            from lora_lab.kernels import graphed_lora_linear

            self.graphed = graphed_lora_linear(self.module, x)
        return self.graphed(x)


def graph_skip_reason(device) -> str | None:
    """Why the graphed variants cannot run here (None: they can)."""
    return None if device.type == "cuda" else "CUDA graphs need a CUDA device (this run is on the CPU)"


def skip_reason(name: str, device, dims, dtype) -> str | None:
    """Why variant ``name`` cannot run in this cell (None: it can): a graphed variant off CUDA; the QuACK route
    where :func:`lora_lab.kernels.lora.quack_gemm.unavailable_reason` names a problem (its op would take the
    Triton route, which must not be timed under this name)."""
    if name in GRAPHED:
        problem = graph_skip_reason(device)
        if problem:
            return problem
        name = GRAPHED[name]
    if FUSED_CONFIGS.get(name, {}).get("base_gemm") == "quack":
        from lora_lab.kernels.lora import quack_gemm

        M, K, N, r = dims
        return quack_gemm.unavailable_reason(M, K, N, r, dtype, device)
    return None


def build_variants(names, K, N, r, dtype, device, shipped):
    """{name: (forward fn, trainable parameters, config text)} over one shared frozen weight and factors."""
    from lora_lab.kernels import chained_lora_linear, fused_lora_linear

    torch.manual_seed(0)
    lin = nn.Linear(K, N, bias=False, device=device, dtype=dtype).requires_grad_(False)
    A = nn.Parameter(torch.randn(r, K, device=device, dtype=dtype) / K**0.5)
    B = nn.Parameter(torch.randn(N, r, device=device, dtype=dtype) * 0.02)
    variants = {}
    for name in names:
        if name == "base":
            variants[name] = (lin, [], "")
        elif name in ("peft", "peft_nocast"):
            model, params = peft_projection(lin.weight, r, fp32_adapters=name == "peft")
            variants[name] = (model, params, f"adapters {params[0].dtype}")
        elif name == "chained":
            variants[name] = (lambda x: chained_lora_linear(x, lin.weight, None, A, B, 2.0), [A, B], "")
        elif name in GRAPHED:
            inner = GRAPHED[name]
            if inner == "base":  # its own module over the shared weight: the capture must not change ``lin``
                module, params, text = nn.Linear(K, N, bias=False, device="meta"), [], "graphed"
                module.weight = lin.weight
            else:
                cfg = shipped.replace(**FUSED_CONFIGS[inner])
                module, params, text = FusedLinear(lin.weight, A, B, cfg), [A, B], f"graphed {cfg!r}"
            variants[name] = (LazyGraph(module), params, text)
        else:
            cfg = shipped.replace(**FUSED_CONFIGS[name])
            variants[name] = (lambda x, cfg=cfg: fused_lora_linear(x, lin.weight, None, A, B, 2.0, config=cfg),
                              [A, B], repr(cfg))
    return variants, (lin.weight, A, B)


def components(x, dy, weight, A, B, shipped):
    """{name: fn}: the fused step's parts (rank-r passes, Triton GEMMs by operand loads) and cuBLAS for the
    same GEMMs — where the fused step's time goes."""
    from lora_lab.kernels.lora.gemm import lora_gemm
    from lora_lab.kernels.lora.rank_ops import merge_weight, q_and_db, rank_projection, rank_reduction

    a, b, tune = A.detach(), B.detach(), shipped.autotune
    p = rank_projection(x, a.t(), 2.0, tune=tune)
    q = rank_projection(dy, b, 2.0, tune=tune)
    y = torch.empty(x.shape[0], weight.shape[0], device=x.device, dtype=x.dtype)
    dx = torch.empty_like(x)
    tma, pointer = shipped.replace(gemm_loads="tma"), shipped.replace(gemm_loads="pointer")
    quack = _quack_components(x, dy, weight, a, b, p, q, y, dx)
    return {**quack, **_wide_components(x, dy, weight, a, b, p, q), **_stacked_components(x, dy, weight, a, b),
        # the merged-weight route's extra work per GEMM: W + s·B A (N×K), one cuBLAS call (rank_ops="torch") or
        # one Triton pass over W (rank_ops="triton")
        "merge_weight": lambda: torch.addmm(weight, b, a, alpha=2.0),
        "merge_weight_triton": lambda: merge_weight(weight, a, b, 2.0),
        "cublas_fwd_gemm": lambda: torch.mm(x, weight.t()),
        "cublas_dx_gemm": lambda: torch.mm(dy, weight),
        "cublas_fwd_plus_addmm": lambda: torch.mm(x, weight.t()).addmm_(p, b.t()),
        "cublas_dx_plus_addmm": lambda: torch.mm(dy, weight).addmm_(q, a),
        "lowrank_fill_fwd": lambda: lora_gemm(y, [(p, b.t())], config=shipped),
        "cublas_beta1_fwd_gemm": lambda: y.addmm_(x, weight.t()),
        "lowrank_fill_dx": lambda: lora_gemm(dx, [(q, a)], config=shipped),
        "cublas_beta1_dx_gemm": lambda: dx.addmm_(dy, weight),
        "triton_fwd_gemm": lambda: lora_gemm(y, [(x, weight.t())], low=p, rt=b.t(), config=shipped),
        "triton_fwd_gemm_tma": lambda: lora_gemm(y, [(x, weight.t())], low=p, rt=b.t(), config=tma),
        "triton_fwd_gemm_pointer": lambda: lora_gemm(y, [(x, weight.t())], low=p, rt=b.t(), config=pointer),
        "triton_fwd_gemm_nolowrank": lambda: lora_gemm(y, [(x, weight.t())], config=shipped),
        "triton_dx_gemm": lambda: lora_gemm(dx, [(dy, weight)], low=q, rt=a, config=shipped),
        "triton_dx_gemm_tma": lambda: lora_gemm(dx, [(dy, weight)], low=q, rt=a, config=tma),
        "triton_dx_gemm_pointer": lambda: lora_gemm(dx, [(dy, weight)], low=q, rt=a, config=pointer),
        "p_pass": lambda: rank_projection(x, a.t(), 2.0, tune=tune),
        "q_pass": lambda: rank_projection(dy, b, 2.0, tune=tune),
        "db_pass": lambda: rank_reduction(p, dy, tune=tune),
        "q_db_one_pass": lambda: q_and_db(dy, b, p, 2.0, tune=tune),
        "da_pass": lambda: rank_reduction(q, x, tune=tune),
        "cublas_p_mm": lambda: torch.mm(x, a.t()),
        "cublas_q_mm": lambda: torch.mm(dy, b),
        "cublas_db_mm": lambda: torch.mm(dy.t(), p),
        "cublas_da_mm": lambda: torch.mm(q.t(), x),
    }


def _wide_components(x, dy, weight, a, b, p, q) -> dict:
    """K-widening: the rank-r term as r more columns of the GEMM's reduction, so one cuBLAS call with no fill gives
    the whole result — ``[X | P] · [W | B]ᵀ = X Wᵀ + P Bᵀ`` (P = s · X Aᵀ) and ``[dY | Q] · [W ; A] = dY W + Q A``
    (Q = s · dY B). Timed: the two widened GEMMs (K + r, N + r) beside cublas_fwd_gemm / cublas_dx_gemm, and the
    copy that builds ``[dY | Q]`` where dY comes from autograd (``[X | P]`` needs none where the layer before
    writes X into the wide buffer). The weight side is one (N + r)×(K + r) buffer: W, B in its right margin, A in
    its bottom one, so ``[W | B]`` is its first N rows and ``[W ; A]`` its first K columns (leading dimension
    K + r), both read in place."""
    p, q = p.to(x.dtype), q.to(dy.dtype)
    x_wide, dy_wide = torch.cat([x, p], dim=1), torch.cat([dy, q], dim=1)
    (N, K), r = weight.shape, a.shape[0]
    big = weight.new_zeros(N + r, K + r)
    big[:N, :K], big[:N, K:], big[N:, :K] = weight, b, a
    w_wide, w_tall = big[:N], big[:, :K]
    from lora_lab.kernels.lora.rank_ops import q_and_db, rank_projection

    def copy_p_pass():  # the fused_wide route's forward pass: P into [X | P], X copied beside it from the same read
        rank_projection(x, a.t(), 2.0, out=x_wide[:, K:], copy_to=x_wide[:, :K])

    def copy_q_db_pass():  # its backward pass: Q into [dY | Q] with dY copied beside it, and dB, from one read of dY
        q_and_db(dy, b, p, 2.0, q_out=dy_wide[:, N:], copy_to=dy_wide[:, :N])
    return {
        "cublas_wide_fwd_gemm": lambda: torch.mm(x_wide, w_wide.t()),
        "cublas_wide_dx_gemm": lambda: torch.mm(dy_wide, w_tall),
        "wide_dy_copy": lambda: torch.cat([dy, q], dim=1),
        "wide_weight_fwd": lambda: torch.cat([weight, b], dim=1),
        "wide_weight_dx": lambda: torch.cat([weight, a], dim=0),
        "wide_copy_p_pass": copy_p_pass,
        "wide_copy_q_db_pass": copy_q_db_pass,
    }


def _stacked_components(x, dy, weight, a, b) -> dict:
    """The stacked route's two GEMMs (``base_gemm="stacked"``): the frozen layer's with r more output columns,
    ``X · [W ; s·A]ᵀ`` (M×(N + r)) and ``dY · [W | s·B]`` (M×(K + r)), rank padded to 8 as the route pads it; beside
    cublas_fwd_gemm and cublas_dx_gemm they say what the extra columns cost cuBLAS (the weights stacked once here:
    the merge is merge_weight's row)."""
    from lora_lab.kernels.lora.widened import padded_rank

    (N, K), r = weight.shape, a.shape[0]
    rp = padded_rank(r)
    tall = weight.new_zeros(N + rp, K)
    tall[:N], tall[N:N + r] = weight, 2.0 * a
    wide = weight.new_zeros(N, K + rp)
    wide[:, :K], wide[:, K:K + r] = weight, 2.0 * b
    return {
        "stacked_fwd_gemm": lambda: torch.mm(x, tall.t()),
        "stacked_dx_gemm": lambda: torch.mm(dy, wide),
    }


def _quack_components(x, dy, weight, a, b, p, q, y, dx) -> dict:
    """QuACK's GEMMs with the rank-r epilogue (the ``fused_quack`` route's two big GEMMs), with none, and on QuACK's
    ping-pong schedule (``*_pingpong``: the route runs the cooperative one, ``quack_gemm.gemm_config``), where the
    route can run here (else no components: the table names what ran)."""
    from lora_lab.kernels.lora import quack_gemm

    M, K = x.shape
    if quack_gemm.unavailable_reason(M, K, weight.shape[0], a.shape[0], x.dtype, x.device) is not None:
        return {}
    p_t, q_t, b_t = p.t().contiguous(), q.t().contiguous(), b.t().contiguous()
    return {
        "quack_fwd_gemm": lambda: quack_gemm.gemm_with_rank_epilogue(y, x, weight.t(), p_t, b_t),
        "quack_dx_gemm": lambda: quack_gemm.gemm_with_rank_epilogue(dx, dy, weight, q_t, a.contiguous()),
        # rank 0: QuACK's GEMM with the epilogue adding nothing, beside cuBLAS's cublas_fwd_gemm
        "quack_fwd_gemm_norank": lambda: quack_gemm.gemm_with_rank_epilogue(y, x, weight.t(), p_t[:0], b_t[:0]),
        "quack_fwd_gemm_pingpong": lambda: quack_gemm.gemm_with_rank_epilogue(y, x, weight.t(), p_t, b_t,
                                                                              schedule="pingpong"),
        "quack_dx_gemm_pingpong": lambda: quack_gemm.gemm_with_rank_epilogue(dx, dy, weight, q_t, a.contiguous(),
                                                                             schedule="pingpong"),
    }


def measure_cell(cell, dims, args, shipped, dtype, device, smoke):
    """Rows of one cell: every variant timed once per repetition; peak memory once per variant."""
    label, (M, K, N, r) = cell, dims
    cuda = device.type == "cuda"
    x = torch.randn(M, K, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(M, N, device=device, dtype=dtype)
    skips = {v: skip_reason(v, device, dims, dtype) for v in args.variants}
    names = [v for v in args.variants if not skips[v]]
    variants, (weight, A, B) = build_variants(names, K, N, r, dtype, device, shipped)
    steps, forwards, peaks, failed = {}, {}, {}, {}
    for name, (fn, params, _) in list(variants.items()):
        steps[name] = lambda fn=fn, params=params: torch.autograd.grad(fn(x), [x, *params], dy)
        forwards[name] = torch.no_grad()(lambda fn=fn: fn(x))  # the forward alone (--forward)
        try:
            steps[name]()  # compile / autotune (and capture a graph) outside the timed loops
            # CUDA only: None in smoke; a graph's memory is its pool, allocated at capture: no per-step peak
            peaks[name] = measure.peak_bytes(steps[name]) if cuda and name not in GRAPHED else (None, None)
        except Exception as err:  # an optional variant this build cannot run is a recorded result, not a crash
            if name in REQUIRED_VARIANTS:
                raise
            failed[name] = error_text(err)
            print(f"   {label}: variant {name} failed, left out of the timings: {failed[name][:200]}", flush=True)
            del variants[name]
            if cuda:
                torch.cuda.empty_cache()
    base = {"cell": label, "M": M, "K": K, "N": N, "r": r, "dtype": str(dtype).removeprefix("torch."),
            "smoke": smoke}
    rows = [{**base, "variant": name, "rep": 0, "fwd_bwd_ms": None, "status": "error", "error": message}
            for name, message in failed.items()]
    rows += [{**base, "variant": name, "rep": 0, "fwd_bwd_ms": None, "status": "skipped", "error": skips[name]}
             for name in args.variants if name not in names]
    loop = dict(LOOP[smoke])
    if getattr(args, "calls", None) and not smoke:
        loop["calls"] = args.calls
    busy_here = host_busy_here(getattr(args, "host_busy", "target"), dims, smoke)
    for rep in range(args.repetitions):
        for name in measure.rotation(variants, rep):
            row = {**base, "variant": name, "rep": rep, "status": "ok",
                   "fwd_bwd_ms": statistics.median(measure.loop_ms(steps[name], **loop)),
                   "host_ms": statistics.median(measure.host_ms(steps[name], **loop)),
                   **host_busy(steps[name], loop, cuda and busy_here),
                   "back_to_back_ms": measure.kernel_loop_ms(steps[name], args.warmup_ms, args.rep_ms)
                   if cuda and getattr(args, "back_to_back", False) else None}
            if args.forward:
                row["fwd_ms"] = statistics.median(measure.loop_ms(forwards[name], **loop))
            row.update(peak_bytes=peaks[name][0], resident_bytes=peaks[name][1], config=variants[name][2])
            rows.append(row)
    if getattr(args, "host_profile", False):
        profile_rows = [{**base, "variant": name, **event} for name in variants
                        for event in measure.host_profile(steps[name], calls=loop["calls"], warmup=1)]
        write_host_profile(profile_rows, Path(args.out))
    comp_rows = []
    if args.components == "all" or (args.components == "target" and dims == scaled(TARGET, smoke)):
        parts = components(x.detach(), dy, weight, A, B, shipped)
        working = {}
        for name, fn in parts.items():
            try:
                fn()  # compile / autotune; a form this build cannot run (TMA) is left out, not faked
                working[name] = fn
            except Exception as err:  # one failing component must not lose the others
                print(f"   component {name} skipped: {type(err).__name__}: {str(err)[:160]}", flush=True)
        for rep in range(args.repetitions):
            for name in measure.rotation(working, rep):
                comp_rows.append({**base, "component": name, "rep": rep,
                                  "ms": measure.kernel_loop_ms(working[name], args.warmup_ms, args.rep_ms)})
    return rows, comp_rows


def write_host_profile(new_rows: list[dict], out: Path) -> None:
    """Append ``new_rows`` (one cell's :func:`measure.host_profile` events per variant) to :data:`HOST_PROFILE_CSV`
    in ``out``: rewritten after every cell, so a run cut short keeps what it profiled."""
    path = out / HOST_PROFILE_CSV
    earlier = measure.read_csv(path) if path.is_file() else []
    measure.write_csv([*earlier, *new_rows], path)


def host_busy_here(choice: str, dims, smoke: bool) -> bool:
    """Whether ``--host-busy`` ``choice`` (none, target, all) times ``host_busy_ms`` in the cell of ``dims``."""
    return choice == "all" or (choice == "target" and dims == scaled(TARGET, smoke))


def host_busy(step, loop: dict, measured: bool) -> dict:
    """``host_busy_ms`` (median over the timed calls) and ``host_waits`` of :func:`measure.host_ms_busy` where
    ``measured`` (a CUDA device, a cell ``--host-busy`` names); empty columns elsewhere."""
    if not measured:
        return {"host_busy_ms": None, "host_waits": None}
    times, waited = measure.host_ms_busy(step, **loop)
    return {"host_busy_ms": statistics.median(times), "host_waits": waited}


def scaled(dims, smoke: bool):
    M, K, N, r = dims
    if not smoke:
        return dims
    d = SMOKE_DIVISORS
    return M // d["M"], K // d["KN"], N // d["KN"], max(1, r // d["r"])


def timed(rows):
    """The rows of variants that ran (a variant that failed in a cell has one row with status ``error``)."""
    return [r for r in rows if r.get("status", "ok") == "ok"]


def summary_rows(rows):
    """One row per (cell, variant): medians and 95% intervals over the repetitions, ratios per repetition."""
    out = []
    rows = timed(rows)
    for cell, variant in dict.fromkeys((r["cell"], r["variant"]) for r in rows):
        mine = [r for r in rows if r["cell"] == cell and r["variant"] == variant]
        first = mine[0]
        ms = measure.summarize(r["fwd_bwd_ms"] for r in mine)
        row = {k: first[k] for k in ("cell", "M", "K", "N", "r", "variant")}
        row.update(fwd_bwd_ms=ms["median"], ms_ci95_low=ms["ci95"][0], ms_ci95_high=ms["ci95"][1], n=ms["n"],
                   host_ms=statistics.median(r["host_ms"] for r in mine if r.get("host_ms") is not None)
                   if any(r.get("host_ms") is not None for r in mine) else None,
                   host_busy_ms=statistics.median(r["host_busy_ms"] for r in mine if r.get("host_busy_ms") is not None)
                   if any(r.get("host_busy_ms") is not None for r in mine) else None,
                   tflops=4.0 * first["M"] * first["K"] * first["N"] / (ms["median"] * 1e-3) / 1e12)
        refs = [("base", "time_vs_base"), ("peft", "time_vs_peft")]
        if any(r["cell"] == cell and r["variant"] == "base_graphed" for r in rows):
            refs.append(("base_graphed", "time_vs_base_graphed"))  # the graphed steps' fair reference
        for ref, key in refs:
            ratio = measure.summarize(measure.repetition_ratios(
                rows, "fwd_bwd_ms", {"cell": cell, "variant": variant}, {"cell": cell, "variant": ref}))
            row.update({key: ratio["median"], f"{key}_ci95_low": ratio["ci95"][0],
                        f"{key}_ci95_high": ratio["ci95"][1]})
        base_peak = next(r["peak_bytes"] for r in rows if r["cell"] == cell and r["variant"] == "base")
        row["peak_bytes"] = first["peak_bytes"]
        peak = first["peak_bytes"]  # None for a graphed variant and without CUDA
        row["peak_vs_base"] = None if base_peak is None or peak is None else peak / base_peak
        out.append(row)
    return out


def plot(summary, rows, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = [v for v in ALL_VARIANTS if v != "base" and any(s["variant"] == v for s in summary)]
    cells = list(dict.fromkeys(s["cell"] for s in summary))
    fig, ax = plt.subplots(figsize=(max(8, len(cells) * 0.9), 4.5))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        xs = [j + i * width for j in range(len(cells))]
        # no bar where the variant failed in that cell
        med = [next((s["time_vs_base"] for s in summary if s["cell"] == c and s["variant"] == v), float("nan"))
               for c in cells]
        ax.bar(xs, med, width, label=v, alpha=0.8)
        for x, c, m in zip(xs, cells, med):  # every repetition's ratio as a point: the spread the median hides
            if m == m:
                repetition_dots(ax, x, measure.repetition_ratios(rows, "fwd_bwd_ms", {"cell": c, "variant": v},
                                                                 {"cell": c, "variant": "base"}))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.05, color="r", lw=0.8, ls="--", label="target 1.05× base")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cells))])
    ax.set_xticklabels([c.replace("_", "\n") for c in cells], fontsize=7)
    ax.set_ylabel("fwd+bwd time / frozen base")
    ax.set_title("One LoRA projection: time relative to the frozen nn.Linear\n(bars: median, dots: repetitions)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "05_lora_linear_ratio.png", dpi=120)
    plt.close(fig)

    shapes = list(dict.fromkeys((s["K"], s["N"]) for s in summary))
    rank = min(s["r"] for s in summary)
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.4 * len(shapes), 4), squeeze=False)
    for ax, (K, N) in zip(axes[0], shapes):
        for v in ["base", *variants]:
            pts = sorted((s["M"], s["fwd_bwd_ms"], s["ms_ci95_low"], s["ms_ci95_high"]) for s in summary
                         if (s["K"], s["N"], s["r"], s["variant"]) == (K, N, rank, v))
            if pts:
                ms = [p[1] for p in pts]
                err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
                ax.errorbar([p[0] for p in pts], ms, yerr=err, marker="o", capsize=3, label=v)
        ax.set_title(f"K×N = {K}×{N}, r={rank}")
        ax.set_xlabel("tokens M")
        ax.set_ylabel("fwd+bwd ms (median, 95% interval)")
        ax.set_xscale("log", base=2)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "05_lora_linear_time_vs_tokens.png", dpi=120)
    plt.close(fig)


def print_table(summary):
    variants = list(dict.fromkeys(s["variant"] for s in summary))
    print(f"{'cell':>20} | " + " ".join(f"{v:>13}" for v in variants) + " | fused/base fused/peft peak/base")
    for cell in dict.fromkeys(s["cell"] for s in summary):
        by = {s["variant"]: s for s in summary if s["cell"] == cell}
        f = by.get("fused", {})
        peak = f.get("peak_vs_base")
        print(f"{cell:>20} | " + " ".join(f"{by[v]['fwd_bwd_ms']:10.3f} ms" if v in by else f"{'-':>13}"
                                          for v in variants)  # "-": the variant failed in this cell
              + f" | {f.get('time_vs_base', float('nan')):10.3f} {f.get('time_vs_peft', float('nan')):9.3f} "
              + (f"{peak:9.3f}" if peak is not None else "        -"))
    print("(medians over the repetitions; ratios: median of the per-repetition ratios)")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(ap, ALL_VARIANTS, DEFAULT_VARIANTS,
                         "the whole code path on tiny stand-ins of the cells (default: two of them), fp32")
    ap._option_string_actions["--variants"].help = (
        f"what to time (default: {' '.join(DEFAULT_VARIANTS)}); {', '.join(REQUIRED_VARIANTS)} always; names "
        f"separated by spaces or commas; 'all' for every one, 'routes' for {' '.join(ROUTES)}; known: "
        + " ".join(ALL_VARIANTS))
    ap.add_argument("--sessions", type=int, default=1,
                    help="separate processes (this script again, one after another), their CSVs pooled: speed "
                         f"ratios are graded on >= {measure.MIN_SESSIONS}")
    ap.add_argument("--cells", nargs="+", default=None,
                    help="only these cells of the grid, by label (e.g. 32k_4096x4096_r16 8k_4096x12288_r64; "
                         "commas also separate them)")
    ap.add_argument("--tokens", type=int, nargs="+", help=f"values of M (default {GRID['tokens']})")
    ap.add_argument("--shapes", nargs="+", help=f"K x N (default {GRID['shapes']})")
    ap.add_argument("--ranks", type=int, nargs="+", help=f"LoRA ranks (default {GRID['ranks']})")
    ap.add_argument("--rep-ms", type=float, default=50.0, help="back_to_back_ms: do_bench milliseconds of timed calls")
    ap.add_argument("--warmup-ms", type=float, default=10.0, help="back_to_back_ms: do_bench milliseconds of warm-up")
    ap.add_argument("--calls", type=int, default=LOOP[False]["calls"],
                    help="timed calls per variant and repetition, in the loop and again for host_ms (their medians "
                         "are the figures; %(default)s by default; --smoke makes two)")
    ap.add_argument("--back-to-back", dest="back_to_back", action="store_true", default=False,
                    help="also fill the back_to_back_ms column (a do_bench loop per variant and repetition: a third "
                         "or more of a cell's time; no metric reads it); off by default")
    ap.add_argument("--no-back-to-back", dest="back_to_back", action="store_false",
                    help="leave the back_to_back_ms column empty (the default)")
    ap.add_argument("--forward", action="store_true", help="also time the forward alone")
    ap.add_argument("--host-busy", choices=["none", "target", "all"], default="target",
                    help="where to time host_busy_ms (measure.host_ms_busy: each call behind a sleep kernel; one more "
                         "loop per variant and repetition): the target cell (default), every cell, or none")
    ap.add_argument("--host-profile", action="store_true",
                    help=f"also where each variant's host time goes (measure.host_profile: torch.profiler's host-side "
                         f"events, the top 15 per cell and variant) into {HOST_PROFILE_CSV} (with --sessions: in each "
                         "process's folder)")
    ap.add_argument("--components", choices=["none", "target", "all"], default="none",
                    help="per-kernel breakdown of the target cell (M=32768, 4096x4096, r=16), of every cell, or none")
    args = ap.parse_args(argv)
    if args.sessions < 1 or args.calls < 1:
        ap.error(f"--sessions and --calls must be >= 1, got {args.sessions} and {args.calls}")
    # commas separate names too; a preset (routes) stands for its variants; base, peft and fused are always timed
    args.variants = [PRESETS.get(v, [v]) for item in args.variants for v in item.split(",") if v]
    args.variants = [v for names in args.variants for v in names]
    args.variants = chosen_variants(ap, args, ALL_VARIANTS, REQUIRED_VARIANTS)
    for key, value in (SMOKE_GRID if args.smoke else GRID).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.cells = None if args.cells is None else [c for item in args.cells for c in item.split(",") if c]
    if args.cells is not None:
        grid = grid_cells(args)
        unknown = [c for c in args.cells if c not in grid]
        if unknown:
            ap.error(f"--cells: {', '.join(unknown)} not in the grid (--tokens, --shapes, --ranks give "
                     f"{' '.join(grid)})")
    return args


def grid_cells(args) -> dict:
    """{cell label: (M, K, N, r)} of the grid that --tokens, --shapes and --ranks span, in the order they run."""
    cells = {}
    for M in args.tokens:
        for shape in args.shapes:
            K, N = (int(v) for v in shape.lower().split("x"))
            for r in args.ranks:
                cells[cell_label(M, K, N, r)] = (M, K, N, r)
    return cells


def main(argv=None):
    start = time.perf_counter()
    args = parse_args(argv)
    out = Path(args.out)
    (out / COMPONENTS_CSV).unlink(missing_ok=True)  # an earlier run's table in this folder is not this run's
    if args.sessions > 1:  # this script once per session, then the pooled rows summarised (and put in the ledger)
        raw = sys.argv[1:] if argv is None else list(argv)
        measure.run_script_sessions(Path(__file__), without_options(raw, ("--out", "--sessions", "--ledger")), out,
                                    [CSV, COMPONENTS_CSV], sessions=args.sessions)
        rows = measure.read_csv(out / CSV)
        finish(rows, args, out, start)
        return
    device = check_device(args.smoke)
    from lora_lab.kernels import KernelConfig

    shipped = KernelConfig.from_env()
    dtype = torch.float32 if args.smoke else torch.bfloat16
    out.mkdir(parents=True, exist_ok=True)
    print(device_line(device, dtype, args.repetitions, f"variants {' '.join(args.variants)}, shipped {shipped}"),
          flush=True)
    rows, comp_rows = [], []
    for label, cell in grid_cells(args).items():
        if args.cells is not None and label not in args.cells:
            continue
        t0 = time.perf_counter()
        dims = scaled(cell, args.smoke)
        cell_rows, cell_comps = measure_cell(label, dims, args, shipped, dtype, device, args.smoke)
        rows += cell_rows
        comp_rows += cell_comps
        medians = {s["variant"]: s["fwd_bwd_ms"] for s in summary_rows(cell_rows)}
        print(f"{label}{' (smoke ' + 'x'.join(map(str, dims)) + ')' if args.smoke else ''}: "
              + "  ".join(f"{v} {ms:.3f} ms" for v, ms in medians.items())
              + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
        measure.write_csv(rows, out / CSV)  # after every cell: a run cut short keeps what it measured
    if comp_rows:
        measure.write_csv(comp_rows, out / COMPONENTS_CSV)
    finish(rows, args, out, start)


def finish(rows, args, out: Path, start: float):
    """The summary CSV (and with --ledger its figures in the ledger), the figures and the table of ``rows``."""
    summary = summary_rows(rows)
    write_summary(summary, out / SUMMARY_CSV, args)
    if (out / COMPONENTS_CSV).is_file():  # the components' medians too: they come back with the ledger file
        ledger_csv(out / COMPONENTS_CSV, args, benchmark="lora_linear_components", repetitions=True)
    plot(summary, timed(rows), out)
    print_table(summary)
    print(f"wrote {out / CSV} ({len(rows)} rows) in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()

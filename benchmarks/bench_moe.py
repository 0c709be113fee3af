"""Benchmark: MoE experts — transformers eager, transformers grouped_mm, lora_lab's fused kernels and Liger-Kernel's
fused MoE, side by side.

Layer: one experts module of a real MoE shape (``fused_moe.LAYER_SHAPES``, the MoE panel: Qwen3-30B-A3B,
Qwen1.5-MoE-A2.7B, OLMoE-1B-7B, DeepSeek-V2-Lite, GPT-OSS-20B, Mixtral-8x7B and Mixtral-8x22B-like),
forward + ``torch.autograd.grad`` of a fixed upstream gradient, bf16, routing from a random
softmax router, T tokens (default 8192 and 32768). Modes: ``full`` (gradients for X, the routing weights and both
expert weights) and ``lora`` (frozen experts, PEFT ``target_parameters`` LoRA r=16 on gate_up_proj and down_proj;
the baselines run PEFT's wrapper, ours patches that wrapper; ``ours_persistent`` is ours
with ``KernelConfig.moe_loads`` set: the persistent form of the Triton kernels, timed next to the one-tile form, in
``full`` cells only (with LoRA ours runs on the grouped-GEMM engine, which has no persistent form);
``ours_kgrouped``, ``ours_dw_grouped_mm`` and ``ours_per_tile``, opt-in (only when ``--variants`` names them, in
``full`` cells only), are ours with ``KernelConfig.moe_weight_grad`` set to ``kgrouped``, ``grouped_mm`` or
``per_tile``: another engine for the expert weight gradients, everything else the same; ``ours_gmm_engine`` and
``ours_triton``, opt-in, are ours with ``KernelConfig.moe_engine`` set to ``grouped_mm`` or ``triton``: every
expert GEMM on CUTLASS's grouped GEMM, or on the Triton kernels, whatever the rule picks (``ours_triton`` in ``lora``
cells only, ``ours_gmm_engine`` in both);
``ours_scatter_triton`` and ``ours_down_triton``, opt-in, in ``full`` cells only, are ours with
``KernelConfig.moe_scatter='triton'`` (the down-forward and dX GEMMs on our atomic scatter-add kernels instead of
``torch._grouped_mm`` and the un-sort pass) or ``moe_down_backward='triton'`` (the down projection's backward on our
fused kernel instead of CUTLASS over dOut gathered once, dW2 per-tile)).
Liger-Kernel's fused MoE (``liger``) joins the ``full`` cells and the ``full`` end-to-end steps when
``liger_kernel`` is importable; it has no LoRA on experts.
The eager per-expert loop, tens of times slower, runs only at the T in ``--eager-tokens``, the shapes in
``--eager-shapes`` and the modes in ``--eager-modes`` (default: the 30B-A3B-like full cell at 8,192 tokens, the one
notebook 06 grades against it), one timed call per repetition. TFLOP/s count the dense expert GEMMs
(``fused_moe.expert_gemm_flops``).

End to end: a Qwen3-MoE-shaped causal LM with the 30B-A3B layer shape and 4 layers (vocabulary 151,936, random
init, bf16, sdpa), batch 4 × 2048: forward, backward, AdamW step, zero_grad; ``full`` trains everything, ``lora``
is PEFT LoRA on q_proj/v_proj plus the expert parameters. Eager runs end to end only in ``--e2e-eager-modes``.

Repetitions: ``--repetitions N`` side-by-side loops per cell (per mode end to end), each timing every
implementation once, order rotating. The primary figure is the user's loop (``measure.loop_ms``: CUDA events around
each whole call, synchronised after it, so host time — e.g. Liger's ``.item()`` sync or our launches — counts): the
median of ``--calls`` layer calls (``ms``; ``--eager-calls`` for the eager loop) and of ``--e2e-steps`` training
steps (``step_ms``). Layer cells also carry labelled secondary columns (``--secondary``): ``kernel_ms`` (profiler
device time per call) and ``back_to_back_ms`` (``do_bench``, calls queued without synchronisation — the figure
notebook 06 published before the synchronised loop). Peak memory (``measure.peak_bytes``: peak and resident
bytes of one untimed call) is measured once per cell and implementation. Notebook 06 reads the per-repetition
rows through ``fused_moe.benchmark_metrics``.

``--budget-s`` bounds one session's layer cells, first calls included (graded cells first; each cell's timed calls cut
to its share of what is left; an implementation whose first call is expected, from ``COLD_FIRST_CALL_S`` unless it is
tuned at that key already, to exceed what is left skipped and named, and the end-to-end steps then leave it out too
where it is still untuned; cells left when it is spent skipped and named; one value per session allowed); ``--sessions
N`` runs the whole script N times in separate processes and pools their CSVs (``measure.pool_sessions``), so intervals
span sessions; the sessions share Triton's disk cache of autotuning results (``TRITON_CACHE_AUTOTUNING=1`` unless set
otherwise), so a later session reuses an earlier one's picks (Liger's and our pointer-form kernels'; the persistent
form tunes per process). A session folder that this code already finished with the same arguments (its
``session_complete.json``) is kept, not run again, so one run can be split over machines
(``tools/remote_gpu_run.sh --triton-cache``). ``first_call_s`` (each implementation's first call in a cell:
compile and any tuning) and ``ours_untuned`` (ours with ``moe_autotune=False``: the tile table alone) measure
whether a first call or a missing tuning is a trap.

``--cells`` runs only the named layer cells (``<shape>_t<T>_<mode>``); ``--variant-cells`` times ours' opt-in
variants only in the named cells (``ours_untuned`` runs wherever ours does).

Writes into --out: 06_moe_layer.csv, 06_moe_e2e.csv (one row per cell or mode, implementation and repetition),
06_moe_layer_summary.csv, 06_moe_layer_speed.png and 06_moe_layer_memory.png.

    python benchmarks/bench_moe.py --out DIR --sessions 2 --budget-s 400 150 --repetitions 3 --secondary \
        --variants eager liger ours_untuned ours_per_tile ours_down_triton ours_triton \
        --cells CELL ... --variant-cells CELL ...  # what notebook 06 records (fused_moe.NOTEBOOK_CELLS, VARIANT_CELLS)
    python benchmarks/bench_moe.py --out DIR --graded-only              # only the cells the metrics read
    python benchmarks/bench_moe.py --out DIR --tokens 4096 8192 32768 --no-e2e
    python benchmarks/bench_moe.py --out DIR --no-e2e --variants liger              # no eager, no persistent form
    python benchmarks/bench_moe.py --out DIR --no-e2e --modes full --shapes qwen3_30b_a3b \
        --variants ours_kgrouped ours_persistent                       # the K-grouped dW against ours
    TRITON_INTERPRET=1 python benchmarks/bench_moe.py --out DIR --smoke
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_common import (
    add_common_arguments,
    add_timing_arguments,
    check_device,
    chosen_variants,
    device_line,
    error_text,
    session_argv,
    time_call,
    without_options,
    write_summary,
)

from lora_lab import gpu_arch
from lora_lab.experiments.fused_moe import (
    H200_DENSE_BF16_TFLOPS,
    IMPLEMENTATIONS,
    LAYER_SHAPES,
    LIGER,
    OURS_ENGINES,
    OURS_KGROUPED,
    OURS_PERSISTENT,
    OURS_SCATTER,
    OURS_UNTUNED,
    OURS_VARIANTS,
    expert_gemm_flops,
    implementations,
    layer_holder,
    liger_available,
    ours_config,
    ours_engine,
    random_routing,
    register_liger,
    set_implementation,
)
from lora_lab.experiments.fused_moe_metrics import E2E_CSV, GRADED_CELLS, LAYER_CSV, layer_table
from lora_lab.lab import measure, resume_marks

SUMMARY_CSV = "06_moe_layer_summary.csv"
# Liger: full fine-tuning only, when installed; ours_persistent: ours with KernelConfig.moe_loads set
ALL_IMPLS = [*IMPLEMENTATIONS, *OURS_PERSISTENT, *OURS_UNTUNED, *OURS_KGROUPED, *OURS_ENGINES, *OURS_SCATTER, LIGER]
# what runs when --variants is not given: every implementation but the opt-in weight-gradient, engine and scatter
# variants
DEFAULT_RUN = [impl for impl in ALL_IMPLS
               if impl not in OURS_KGROUPED and impl not in OURS_ENGINES and impl not in OURS_SCATTER]
# --smoke: tiny stand-ins of the layer shapes (same names, routing rule and family), T / 1024
SMOKE_SHAPES = {name: dict(hidden=32, num_experts=4, top_k=2, intermediate=16 + 8 * (k % 2))
                for k, name in enumerate(LAYER_SHAPES)}
SMOKE_TOKEN_DIVISOR = 1024


# Liger's shapes by default: the 30B-A3B-like layer alone. Its first call at a new shape autotunes for minutes (221 s
# on an H200 at that layer, 8,192 tokens, in notebook 06's run of 14de7b6) and its autotune key is (H_dim, I_dim)
# (liger_kernel/ops/fused_moe_kernels.py, 0.8.5): both token counts of one layer share one tuning
LIGER_SHAPES = ("qwen3_30b_a3b",)
# our variants that change only the expert weights' gradient engine, or only the scatter GEMMs of full fine-tuning:
# full fine-tuning cells only (LoRA cells compute no expert weight gradient and run on the grouped-GEMM engine, so
# there they would repeat ours)
WEIGHT_GRAD_VARIANTS = (*OURS_KGROUPED, *OURS_SCATTER)
OPTIONAL_IMPLS = (*OURS_VARIANTS, LIGER)  # their failure is a recorded result; the others' fails the run
# the variants --variant-cells limits: ours' opt-in forms, not the untuned one (the panel's untuned maximum reads
# every cell)
CELL_LIMITED = tuple(impl for impl in OURS_VARIANTS if impl not in OURS_UNTUNED)
# First calls known to be expensive with a cold cache (compile + autotuning), in seconds: what the H200 run of
# notebook 06 at 14de7b6 measured at the 30B-A3B-like layer, 8,192 tokens, full fine-tuning (its layer CSV's
# first_call_s; git history keeps that CSV). --budget-s charges an implementation this
# before its first call at an autotune key that is not tuned yet (an estimate for other shapes, not a measurement)
COLD_FIRST_CALL_S = {LIGER: 221.4, "ours": 11.7, "ours_persistent": 19.2}
# implementations whose tuning Triton's disk cache of autotuning results (TRITON_CACHE_AUTOTUNING=1, set for the
# sessions) carries from one session to the next; the persistent form tunes per process (its TMA pre-hook)
DISK_CACHED = (LIGER, "ours")
FIRST_CALL_LEDGER = "first_calls.json"


def autotune_disk_cache_on() -> bool:
    """Whether Triton keeps autotuning results on disk in this process (``TRITON_CACHE_AUTOTUNING``)."""
    return os.environ.get("TRITON_CACHE_AUTOTUNING", "").strip().lower() in ("1", "true", "on", "yes")


def tuning_key(impl: str, shape, mode: str) -> str:
    """What an implementation's tuning depends on: Liger's autotuners key on (H, I) only; ours per layer and mode."""
    if impl == LIGER:
        return f"{LIGER}|h{shape.hidden}|i{shape.intermediate}"
    return f"{impl}|{shape.name}|{mode}"


class FirstCalls:
    """The autotune keys each implementation was tuned at: in this process, or in an earlier session of the same
    run (``ledger``, a JSON file the sessions share) for those whose picks Triton's disk cache keeps
    (:data:`DISK_CACHED`, when the cache is on). :meth:`expected_s` is what the budget charges a first call."""

    def __init__(self, ledger: Path | None = None):
        self.ledger = ledger
        self.here: dict[str, float] = {}
        self.shared: dict[str, float] = json.loads(ledger.read_text()) if ledger and ledger.exists() else {}
        self.skipped: set[str] = set()  # implementations a cell left out for the budget

    def expected_s(self, impl: str, shape, mode: str) -> float:
        key = tuning_key(impl, shape, mode)
        if key in self.here or (key in self.shared and impl in DISK_CACHED and autotune_disk_cache_on()):
            return 0.0
        return COLD_FIRST_CALL_S.get(impl, 0.0)

    def record(self, impl: str, shape, mode: str, seconds: float) -> None:
        key = tuning_key(impl, shape, mode)
        self.here.setdefault(key, seconds)
        if self.ledger is not None and key not in self.shared:
            self.shared[key] = seconds
            self.ledger.write_text(json.dumps(self.shared, indent=1))


def runs_in(impl: str, mode: str) -> bool:
    """Whether ``impl`` runs in ``mode``'s cells here (our persistent variants run wherever ours does)."""
    return impl in implementations(mode) or impl in OURS_VARIANTS


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synced_seconds(fn) -> float:
    """Wall seconds of one call of ``fn``, the device synchronised before and after."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def calls_within(seconds: float | None, call_ms: dict, repetitions: int, most: int) -> int:
    """Timed calls per implementation and repetition so that a cell's timed loops fit ``seconds`` (None: ``most``):
    at least 1, at most ``most``; ``call_ms`` holds each implementation's time per call (from its warm-up)."""
    if seconds is None:
        return most
    per_round_ms = sum(call_ms.values()) * repetitions
    if per_round_ms <= 0:
        return most
    return max(1, min(most, int(seconds * 1e3 / per_round_ms)))


def bench_layer_cell(shape, num_tokens, label_tokens, mode, impls, args, cfg, device, dtype, seconds=None,
                     first_calls=None, deadline=None):
    """Rows of one (shape, T, mode) cell: each implementation timed once per repetition (the caller frees the
    cell's memory after it returns). ``seconds``: the time the cell's timed loops may take (--budget-s), which
    sets the calls per loop (:func:`calls_within`); ``first_call_s``: the first call (compile, any tuning).
    ``deadline`` (``time.perf_counter()`` value, --budget-s) with ``first_calls`` (:class:`FirstCalls`): an
    implementation whose expected first call does not fit what is left is skipped (status ``skipped``, the reason
    in ``skip_reason``, named on stdout); when that is ``ours``, the whole cell is."""
    holder, experts, params = layer_holder(shape, mode, device, dtype, seed=0)
    gen = torch.Generator(device=device).manual_seed(3)  # drawn on the device (T=32768: 67M values)
    x = torch.randn(num_tokens, shape.hidden, generator=gen, device=device).to(dtype).requires_grad_(True)
    index, weights = random_routing(num_tokens, shape, device, dtype, seed=0)
    grad_out = torch.randn(num_tokens, shape.hidden, generator=gen, device=device).to(dtype)
    inputs = [x, weights, *params]

    def step():
        return torch.autograd.grad(holder(x, index, weights), inputs, grad_out)

    cell = f"{shape.name}_t{label_tokens}_{mode}"
    flops = expert_gemm_flops(num_tokens, shape, mode)
    base = dict(cell=cell, shape=shape.name, tokens=num_tokens, label_tokens=label_tokens, hidden=shape.hidden,
                experts=shape.num_experts, top_k=shape.top_k, intermediate=shape.intermediate, mode=mode,
                smoke=args.smoke, gemm_flops=flops,
                engine=ours_engine(shape, num_tokens, mode, device, dtype, cfg))  # what the rule gives ours here
    once = {}

    def budget_skip(impl):  # the reason an implementation's first call does not fit the budget, else None
        if first_calls is None or deadline is None:
            return None
        expected, left = first_calls.expected_s(impl, shape, mode), deadline - time.perf_counter()
        if expected <= left:
            return None
        first_calls.skipped.add(impl)
        return (f"budget: its first call here is expected to take ~{expected:.0f} s (compile + tuning, cold cache), "
                f"{max(left, 0.0):.0f} s of the session's budget left")

    reason = budget_skip("ours") if "ours" in impls else None
    if reason is not None:  # no cell without ours: every implementation is named as skipped
        print(f"   {cell}: skipped ({reason})", flush=True)
        return [dict(base, impl=i, rep=rep, ms=None, status="skipped", skip_reason=reason, peak_bytes=None,
                     resident_bytes=None) for rep in range(args.repetitions) for i in impls]
    for impl in impls:  # warm-up (compile / autotune) and peak memory, outside the timed loops
        reason = budget_skip(impl) if impl != "ours" else None  # ours: checked above
        if reason is not None:
            once[impl] = dict(status="skipped", skip_reason=reason, peak_bytes=None, resident_bytes=None)
            print(f"   {cell}: {impl} skipped ({reason})", flush=True)
            continue
        set_implementation(holder, experts, impl, cfg)
        try:
            first = synced_seconds(step)
            if first_calls is not None:
                first_calls.record(impl, shape, mode, first)
            again = synced_seconds(step)  # compiled and tuned: the time of one call, for the budget
            peak, resident = measure.peak_bytes(step) if device.type == "cuda" else (None, None)  # CUDA only
            once[impl] = dict(status="ok", peak_bytes=peak, resident_bytes=resident, first_call_s=first,
                              call_ms=again * 1e3)
        except torch.OutOfMemoryError:
            once[impl] = dict(status="oom", peak_bytes=None, resident_bytes=None)
        except Exception as err:  # an optional variant (persistent form, Liger) that fails is recorded, not fatal
            if impl not in OPTIONAL_IMPLS:
                raise
            once[impl] = dict(status="error", peak_bytes=None, resident_bytes=None, error=error_text(err))
            print(f"   {cell}: {impl} failed, left out of the timings: {once[impl]['error'][:200]}", flush=True)
        free_memory()
    rows = []
    ok = [i for i in impls if once[i]["status"] == "ok"]
    calls = calls_within(seconds, {i: once[i]["call_ms"] for i in ok if i != "eager"}, args.repetitions, args.calls)
    for rep in range(args.repetitions):
        for impl in measure.rotation(ok, rep):
            set_implementation(holder, experts, impl, cfg)
            if impl == "eager":  # a Python loop over experts: a few long calls, no secondary columns
                times = measure.loop_ms(step, calls=args.eager_calls, warmup=0)
                timed = dict(ms=statistics.median(times), ms_each=" ".join(f"{t:.4f}" for t in times), timing="loop")
            else:
                timed = time_call(step, args, calls=calls)
            ms = timed["ms"]
            rows.append(dict(base, impl=impl, rep=rep, **timed, tflops=flops / (ms * 1e-3) / 1e12,
                             fraction_of_peak=flops / (ms * 1e-3) / (H200_DENSE_BF16_TFLOPS * 1e12),
                             **once[impl], config=repr(ours_config(impl, cfg)) if impl.startswith("ours") else ""))
        rows += [dict(base, impl=i, rep=rep, ms=None, **once[i]) for i in impls if i not in ok]
    set_implementation(holder, experts, "eager")  # unpatch
    return rows


def e2e_config(smoke: bool, num_layers: int):
    """Qwen3-30B-A3B layer shape (hidden 2048, 128 experts, top-8, expert I 768), few layers; tiny with smoke."""
    from transformers import Qwen3MoeConfig

    if smoke:
        sizes = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
                     num_experts_per_tok=2)
    else:
        sizes = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=num_layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8)
    return Qwen3MoeConfig(**sizes, norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False,
                          output_router_logits=False)


def bench_e2e(args, cfg, device, dtype):
    """Rows of the end-to-end training steps: one model, ``full`` first, then wrapped by PEFT for ``lora``."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeForCausalLM

    config = e2e_config(args.smoke, args.e2e_layers)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):  # random init on the device: ~3B parameters, slow on the host
        model = Qwen3MoeForCausalLM(config)
    model = model.to(device=device, dtype=dtype).train()
    gen = torch.Generator(device="cpu").manual_seed(5)
    ids = torch.randint(0, config.vocab_size, (args.e2e_batch, args.e2e_seq), generator=gen).to(device)
    rows = []
    for mode in [m for m in ("full", "lora") if m in args.modes]:
        root = model
        if mode == "lora":
            root = get_peft_model(model, LoraConfig(
                r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
        rows += bench_e2e_mode(model, root, ids, mode, args, cfg, device)
        free_memory()
    return rows


def bench_e2e_mode(model, root, ids, mode, args, cfg, device):
    """One mode end to end: each implementation's training steps timed once per repetition, order rotating."""
    from lora_lab.kernels import patch_moe_experts, unpatch_moe_experts

    opt = torch.optim.AdamW([p for p in root.parameters() if p.requires_grad], lr=1e-5, foreach=True)
    last_loss = []

    def step():
        loss = root(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        last_loss[:] = [loss.detach()]

    def use(impl):
        unpatch_moe_experts(root)
        if impl == LIGER:
            register_liger()  # transformers' experts implementation "liger"
        model.set_experts_implementation("eager" if impl.startswith("ours") else impl)
        if impl.startswith("ours"):
            patch_moe_experts(root, config=ours_config(impl, cfg))

    # the end-to-end steps compare ours with the baselines; our variants (persistent form, untuned) stay in the layer
    # cells, unless --e2e-variants asks for them
    impls = [i for i in args.impls if (i != "eager" or mode in args.e2e_eager_modes) and runs_in(i, mode)
             and (i not in OURS_VARIANTS or args.e2e_variants)]
    first_calls = getattr(args, "first_calls", None)
    if first_calls is not None:  # an optional implementation the budget left out of the layer
        # cells is left out here too when it is still untuned at this layer (its first call is the expensive part)
        shape = LAYER_SHAPES["qwen3_30b_a3b"]
        for impl in [i for i in impls if i in OPTIONAL_IMPLS and i in first_calls.skipped
                     and first_calls.expected_s(i, shape, mode) > 0]:
            print(f"   e2e {mode}: {impl} skipped (the budget left it out of the layer cells and it is not tuned at "
                  f"this layer: first call ~{first_calls.expected_s(impl, shape, mode):.0f} s)", flush=True)
            impls.remove(impl)
    once = {}
    for impl in impls:  # warm-up (optimizer state, compile / autotune) and peak memory, untimed
        use(impl)
        try:
            step()
            peak = measure.peak_bytes(step)[0] if device.type == "cuda" else None  # CUDA only
            once[impl] = dict(status="ok", peak_bytes=peak)
        except torch.OutOfMemoryError:
            once[impl] = dict(status="oom", peak_bytes=None)
            opt.zero_grad(set_to_none=True)
        except Exception as err:  # as in the layer cells: an optional variant's failure is a recorded result
            if impl not in OPTIONAL_IMPLS:
                raise
            once[impl] = dict(status="error", peak_bytes=None, error=error_text(err))
            print(f"   e2e {mode}: {impl} failed, left out of the timings: {once[impl]['error'][:200]}", flush=True)
            opt.zero_grad(set_to_none=True)
        free_memory()
    ok = [i for i in impls if once[i]["status"] == "ok"]
    rows = []
    batch, seq = ids.shape
    for rep in range(args.repetitions):
        for impl in measure.rotation(ok, rep):
            use(impl)
            times = measure.loop_ms(step, calls=args.e2e_steps, warmup=0)  # warmed up above (optimizer state)
            ms = statistics.median(times)
            rows.append(dict(mode=mode, impl=impl, rep=rep, batch=batch, seq_len=seq,
                             layers=model.config.num_hidden_layers, smoke=args.smoke, step_ms=ms,
                             step_ms_each=" ".join(f"{t:.2f}" for t in times),
                             samples_per_s=batch / ms * 1e3, tokens_per_s=batch * seq / ms * 1e3,
                             final_loss=last_loss[0].item(), **once[impl]))
        rows += [dict(mode=mode, impl=i, rep=rep, samples_per_s=None, **once[i]) for i in impls if i not in ok]
    use("eager")
    print(f"e2e {mode}: " + "  ".join(
        f"{i} {statistics.median(r['samples_per_s'] for r in rows if r['impl'] == i):.3f}" for i in ok)
        + " samples/s (medians)", flush=True)
    return rows


def plot_layer(table, out: Path):
    """Time vs T per (shape, mode) with the repetitions' 95% intervals; peak memory above resident per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(t["shape"] for t in table))
    modes = list(dict.fromkeys(t["mode"] for t in table))
    fig, axes = plt.subplots(len(shapes), len(modes), figsize=(5.5 * len(modes), 4 * len(shapes)), squeeze=False)
    for i, shape in enumerate(shapes):
        for j, mode in enumerate(modes):
            ax = axes[i][j]
            for impl in ALL_IMPLS:
                pts = sorted((t["label_tokens"], t["ms"], *t["ms_ci95"]) for t in table
                             if (t["shape"], t["mode"], t["impl"]) == (shape, mode, impl) and "ms" in t)
                if pts:
                    err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
                    ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=err, marker="o", capsize=3, label=impl)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens T")
            ax.set_ylabel("forward+backward ms (median, 95% interval)")
            ax.set_title(f"{shape} — {'full fine-tuning' if mode == 'full' else 'LoRA on experts (PEFT)'}")
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend()
    fig.tight_layout()
    fig.savefig(out / "06_moe_layer_speed.png", dpi=120)
    plt.close(fig)

    cells = list(dict.fromkeys(t["cell"] for t in table))
    labels = {t["cell"]: f"{t['shape'].split('_')[0]}\nT={t['label_tokens']}\n{t['mode']}" for t in table}
    fig, ax = plt.subplots(figsize=(max(8, len(cells) * 0.9), 4.5))
    shown = [i for i in ALL_IMPLS if any(t["impl"] == i for t in table)]
    width = 0.8 / len(shown)
    for k, impl in enumerate(shown):
        vals = [next((t.get("peak_extra_gib") for t in table if t["cell"] == c and t["impl"] == impl), None)
                for c in cells]
        ax.bar([x + (k - (len(shown) - 1) / 2) * width for x in range(len(cells))],
               [float("nan") if v is None else v for v in vals], width,
               label=impl)  # eager runs only at --eager-tokens, Liger in full cells; no bar where not measured
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([labels[c] for c in cells], fontsize=7)
    ax.set_ylabel("peak GiB above resident (fwd+bwd, measured once)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "06_moe_layer_memory.png", dpi=120)
    plt.close(fig)


def cell_name(name: str, tokens: int, mode: str) -> str:
    """A layer cell's name, as the CSVs and the metrics spell it: ``<shape>_t<T>_<mode>``."""
    return f"{name}_t{tokens}_{mode}"


def layer_cells(args) -> list[tuple[str, int, str]]:
    """(shape, T, mode) of every layer cell to run (those ``--cells`` names, when given), the cells notebook 06's
    graded metrics read first (so a budget that runs out leaves out panel cells, not graded ones)."""
    cells = [(name, tokens, mode) for name in args.shapes for tokens in args.tokens for mode in args.modes]
    if args.graded_only:
        cells = [c for c in cells if cell_name(*c) in GRADED_CELLS]
    if getattr(args, "cells", None):
        cells = [c for c in cells if cell_name(*c) in args.cells]
    return sorted(cells, key=lambda c: cell_name(*c) not in GRADED_CELLS)


def unknown_cells(args) -> list[str]:
    """The names in ``--cells`` and ``--variant-cells`` that are no cell of ``--shapes`` x ``--tokens`` x
    ``--modes``."""
    known = {cell_name(n, t, m) for n in args.shapes for t in args.tokens for m in args.modes}
    named = [*(args.cells or []), *(args.variant_cells or [])]
    return [c for c in dict.fromkeys(named) if c not in known]


def runs_variant_here(impl: str, cell: str, variant_cells) -> bool:
    """Whether ``impl`` runs in ``cell`` as far as ``--variant-cells`` goes: ours' opt-in variants
    (:data:`CELL_LIMITED`) only in the cells it names, when given; every other implementation anywhere."""
    return impl not in CELL_LIMITED or not variant_cells or cell in variant_cells


def cell_implementations(args, impls: list[str], name: str, label_tokens: int, mode: str) -> list[str]:
    """The implementations of ``impls`` that one layer cell times: eager, Liger and the persistent form only where
    their options put them, each variant only in its mode's cells, ours' opt-in variants only in --variant-cells."""
    with_eager = ((not args.eager_tokens or label_tokens in args.eager_tokens) and name in args.eager_shapes
                  and mode in args.eager_modes)
    return [i for i in impls if (i != "eager" or with_eager) and (i != LIGER or name in args.liger_shapes)
            and (i not in OURS_PERSISTENT or (name in args.persistent_shapes and mode == "full"))
            and (i not in WEIGHT_GRAD_VARIANTS or mode == "full")
            and (i not in OURS_ENGINES or mode == "lora" or i == "ours_gmm_engine")
            and runs_variant_here(i, cell_name(name, label_tokens, mode), args.variant_cells)
            and runs_in(i, mode)]


def session_budget(args) -> float | None:
    """This session's --budget-s: the value of its index (session k takes the k-th, the last one repeats)."""
    if args.budget_s is None:
        return None
    return args.budget_s[min(args.session_index or 0, len(args.budget_s) - 1)]


def run_session(args, impls, out: Path) -> None:
    """One process's layer cells (within --budget-s), then the end-to-end steps; CSVs into ``out``."""
    device = check_device(args.smoke)
    ledger = Path(args.first_call_ledger) if args.first_call_ledger else None
    args.first_calls = FirstCalls(ledger)
    from lora_lab.kernels import KernelConfig

    cfg = KernelConfig.from_env()
    dtype = torch.float32 if args.smoke else torch.bfloat16
    print(device_line(device, dtype, args.repetitions, f"implementations {' '.join(impls)}, {cfg}"), flush=True)
    rows = []
    cells = layer_cells(args)
    started = time.perf_counter()
    budget = session_budget(args)
    deadline = None if budget is None else started + budget
    for k, (name, label_tokens, mode) in enumerate(cells):
        seconds = None
        if budget is not None:
            left = budget - (time.perf_counter() - started)
            if left <= 0:
                print(f"budget of {budget:.0f} s spent: {len(cells) - k} cells left out: "
                      + " ".join(f"{n}_t{t}_{m}" for n, t, m in cells[k:]), flush=True)
                break
            seconds = left / (len(cells) - k) / 2  # half of a cell's share for its timed loops (warm-ups, peaks)
        shape = LAYER_SHAPES[name].scaled(**SMOKE_SHAPES[name]) if args.smoke else LAYER_SHAPES[name]
        num_tokens = max(1, label_tokens // SMOKE_TOKEN_DIVISOR) if args.smoke else label_tokens
        cell_impls = cell_implementations(args, impls, name, label_tokens, mode)
        t0 = time.perf_counter()
        cell_rows = bench_layer_cell(shape, num_tokens, label_tokens, mode, cell_impls, args, cfg, device, dtype,
                                     seconds=seconds, first_calls=args.first_calls, deadline=deadline)
        free_memory()
        rows += cell_rows
        measure.write_csv(rows, out / LAYER_CSV)  # after every cell: a run cut short keeps its cells
        medians = {i: statistics.median(r["ms"] for r in cell_rows if r["impl"] == i and r["ms"] is not None)
                   for i in cell_impls if any(r["impl"] == i and r["ms"] is not None for r in cell_rows)}
        print(f"{cell_rows[0]['cell']}{f' (smoke T={num_tokens})' if args.smoke else ''}: "
              + "  ".join(f"{i} {ms:.3f} ms" for i, ms in medians.items())
              + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"layer cells: {time.perf_counter() - started:.0f} s", flush=True)
    if not args.no_e2e:
        measure.write_csv(bench_e2e(args, cfg, device, dtype), out / E2E_CSV)


SESSION_COMPLETE = resume_marks.SESSION_COMPLETE


def _session_key(argv: list[str], index: int) -> dict:
    rest = without_options(argv, ("--out", "--sessions", "--session-index", "--first-call-ledger"))
    return resume_marks.session_key(Path(__file__).name, rest, index)


def mark_session_complete(part: Path, argv: list[str], index: int) -> None:
    """Record that session ``index`` finished in ``part`` (exit 0) with this code and these arguments."""
    resume_marks.mark_done(part, _session_key(argv, index))


def session_complete(part: Path, argv: list[str], index: int) -> bool:
    """Whether ``part`` holds session ``index`` of a run with these arguments, finished, by this code, on this GPU
    (:mod:`lora_lab.lab.resume_marks`) with its layer CSV: then ``--sessions`` keeps it instead of running it again.
    So a run can be split over machines (GPU calls of at most a few minutes): the first runs ``--session-index 0``
    (or the whole run, cut short), its folder travels, and the next runs ``--sessions N`` over it; Triton's
    autotuning cache should travel too, or the ledger of first calls overstates what is tuned."""
    return (Path(part) / LAYER_CSV).is_file() and resume_marks.is_done(part, _session_key(argv, index))


def _child_argv(argv: list[str], out: Path, index: int) -> list[str]:
    """``argv`` for session ``index``: ``--out`` pointing at ``out``, without ``--sessions``."""
    return [*session_argv(argv, out), "--session-index", str(index)]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(ap, ALL_IMPLS, ["grouped_mm", "ours"],
                         "the whole code path on tiny stand-ins of the layers (T / 1024) and of the model, fp32")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768], help="token counts T of the layer cells")
    ap.add_argument("--shapes", nargs="+", default=list(LAYER_SHAPES), choices=list(LAYER_SHAPES))
    ap.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    ap.add_argument("--eager-tokens", type=int, nargs="*", default=[8192],
                    help="T at which the eager loop is also timed (empty: every T)")
    ap.add_argument("--eager-shapes", nargs="*", default=["qwen3_30b_a3b"], choices=list(LAYER_SHAPES),
                    help="shapes whose cells (at --eager-tokens) also time the eager loop")
    ap.add_argument("--eager-modes", nargs="*", default=["full"], choices=["full", "lora"],
                    help="modes whose cells (at --eager-tokens and --eager-shapes) also time the eager loop (default: "
                         "full, the cell notebook 06's eager metric reads; the loop costs seconds per cell)")
    ap.add_argument("--eager-calls", type=int, default=1, help="timed eager calls per repetition")
    ap.add_argument("--liger-shapes", nargs="*", default=list(LIGER_SHAPES), choices=list(LAYER_SHAPES),
                    help="shapes whose full cells also run Liger (default: the 30B-A3B-like layer alone; Liger "
                         "autotunes at each new (H, I), 221 s at that layer on an H200, 102 s at the Mixtral-like one "
                         ", so one timing session's budget holds at most one)")
    ap.add_argument("--persistent-shapes", nargs="*", default=["qwen3_30b_a3b"], choices=list(LAYER_SHAPES),
                    help="shapes whose cells also run the persistent form when --variants asks for it")
    # one warm-up call per loop: each implementation's first call, a second one and its peak-memory call already ran
    # in the cell before the repetitions; the warm-up only re-primes it after the other implementations' loops
    add_timing_arguments(ap, warmup=1)
    ap.add_argument("--budget-s", type=float, nargs="+", default=None,
                    help="seconds the layer cells of one session may take, first calls (compile, autotuning) "
                         "included: one value, or one per session (the last repeats). Each cell's timed calls are cut "
                         "to its share; an implementation whose first call is expected (COLD_FIRST_CALL_S, unless "
                         "already tuned at that key in this run) to exceed what is left is skipped and named, a cell "
                         "is skipped when ours is, and cells left when it is spent are skipped (graded cells first)")
    ap.add_argument("--sessions", type=int, default=1,
                    help="separate processes (this script again, one after another), their CSVs pooled "
                         "(measure.pool_sessions): intervals then span sessions")
    ap.add_argument("--session-index", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--first-call-ledger", default=None, help=argparse.SUPPRESS)  # set for the sessions
    ap.add_argument("--graded-only", action="store_true",
                    help="only the layer cells notebook 06's metrics read (" + ", ".join(GRADED_CELLS) + ")")
    ap.add_argument("--cells", nargs="+", default=None, metavar="CELL",
                    help="only these layer cells, named <shape>_t<T>_<mode> (each one of --shapes x --tokens x "
                         "--modes; notebook 06 passes fused_moe.NOTEBOOK_CELLS)")
    ap.add_argument("--variant-cells", nargs="+", default=None, metavar="CELL",
                    help="the cells where ours' opt-in variants (" + " ".join(CELL_LIMITED) + ") run, each in its "
                         "own mode's cells (default: every cell; notebook 06 passes fused_moe.VARIANT_CELLS); "
                         "ours_untuned runs in every cell")
    ap.add_argument("--no-e2e", action="store_true", help="skip the end-to-end training steps")
    ap.add_argument("--e2e-steps", type=int, default=2, help="timed training steps per implementation and repetition")
    ap.add_argument("--e2e-layers", type=int, default=4)
    ap.add_argument("--e2e-batch", type=int, default=4)
    ap.add_argument("--e2e-seq", type=int, default=2048)
    ap.add_argument("--e2e-variants", action="store_true",
                    help="also run our variants (ours_persistent, ours_untuned, ours_kgrouped) in the end-to-end "
                         "steps")
    ap.add_argument("--e2e-eager-modes", nargs="*", default=["lora"], choices=["full", "lora"],
                    help="modes whose end-to-end comparison includes the eager loop")
    ap.set_defaults(variants=DEFAULT_RUN)  # eager is limited by --eager-tokens / --eager-shapes
    return ap


def main(argv=None):
    start = time.perf_counter()
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.sessions < 1 or (args.budget_s is not None and min(args.budget_s) <= 0):
        ap.error("--sessions must be >= 1 and --budget-s > 0")
    impls = chosen_variants(ap, args, ALL_IMPLS, ["grouped_mm", "ours"])
    unknown = unknown_cells(args)
    if unknown:
        ap.error(f"--cells / --variant-cells: {' '.join(unknown)} is no cell of --shapes x --tokens x --modes "
                 "(a cell is named <shape>_t<T>_<mode>, e.g. qwen3_30b_a3b_t8192_full)")
    if LIGER in impls and not liger_available():
        print("liger: liger_kernel is not installed (pip install liger-kernel); its cells are skipped", flush=True)
        impls = [i for i in impls if i != LIGER]
    args.impls = impls
    if args.smoke:
        args.e2e_batch, args.e2e_seq, args.e2e_steps = 2, 8, 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.session_index is not None or args.sessions == 1:
        run_session(args, impls, out)
        if args.session_index is not None:
            mark_session_complete(out, list(sys.argv[1:] if argv is None else argv), args.session_index)
            return
    else:
        import subprocess

        raw = list(sys.argv[1:] if argv is None else argv)
        parts = []
        kept = [k for k in range(args.sessions) if session_complete(measure.process_folder(out, k), raw, k)]
        ledger = out / FIRST_CALL_LEDGER  # which keys an earlier session tuned (and took how long): fresh per run
        if not kept:  # (a run that keeps sessions keeps their ledger: carry Triton's cache with them)
            ledger.unlink(missing_ok=True)
        # the sessions share Triton's disk cache of autotuning results: a later session reuses an earlier one's picks
        env = {**os.environ, "TRITON_CACHE_AUTOTUNING": os.environ.get("TRITON_CACHE_AUTOTUNING", "1")}
        for k in range(args.sessions):
            part = measure.process_folder(out, k)
            if k in kept:
                print(f"--- process {k + 1} of {args.sessions} kept: {part} holds it, complete, from this code "
                      "and these arguments", flush=True)
                parts.append(part)
                continue
            resume_marks.clear(part)
            cmd = [sys.executable, str(Path(__file__).resolve()), *_child_argv(raw, part, k),
                   "--first-call-ledger", str(ledger)]
            print(f"--- process {k + 1} of {args.sessions}", flush=True)
            t0 = time.perf_counter()
            done = subprocess.run(cmd, env=env)
            print(f"--- process {k + 1} of {args.sessions} done in {time.perf_counter() - t0:.0f} s", flush=True)
            if done.returncode != 0 and not (part / LAYER_CSV).exists():
                raise SystemExit(f"process {k + 1} of {args.sessions} failed (exit {done.returncode}) "
                                 f"before writing {part / LAYER_CSV}")
            parts.append(part)  # (a child that finished wrote its own session_complete.json)
        measure.pool_csv_sessions(parts, out, [LAYER_CSV, E2E_CSV])
    rows = measure.read_csv(out / LAYER_CSV)
    table = layer_table(rows)
    write_summary(table, out / SUMMARY_CSV, args)
    plot_layer(table, out)
    print(f"ours' engine per cell: the rule on GPU class {gpu_arch.gpu_class()} "
          f"(moe_engine auto: {gpu_arch.dispatch_rule()['moe_engine auto']})")
    print(f"{'cell':>34} {'impl':>12} {'ms':>10} {'TFLOP/s':>8} {'peak GiB':>9} {'engine':>10}")
    for t in table:
        peak = f"{t['peak_extra_gib']:9.2f}" if t.get("peak_extra_gib") is not None else "        -"
        print(f"{t['cell']:>34} {t['impl']:>12} {t.get('ms', float('nan')):10.3f} "
              f"{t.get('tflops', float('nan')):8.1f} {peak} {t.get('engine', '-'):>10}")
    print(f"wrote {out / LAYER_CSV} ({len(rows)} rows, {measure.sessions_in(rows)} session(s)) in "
          f"{time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()

"""Profile: where a fused op's step goes, kernel by kernel (``torch.profiler``) — what limits their speed.

Cases (bf16 on the GPU; forward + backward of a fixed upstream gradient, as the benchmarks time them):

  lora_linear   one LoRA projection at notebook 05's target cell (M = 32768, K = N = 4096, r = 16): the frozen
                ``nn.Linear`` (``base``) and ``fused_lora_linear`` with the shipped ``KernelConfig`` (``fused``; with
                ``--variants``, the GEMM core's forms ``fused_persistent`` and ``fused_fold`` and the routes
                ``fused_pure_cublas``, ``fused_merged``, ``fused_merged_qdb`` and their rank-r passes on a side stream,
                ``fused_merged_overlap`` and ``fused_merged_qdb_overlap``, and P and Q from the GEMMs, ``fused_stacked``
                and ``fused_stacked_cublas``, as ``bench_lora_linear`` runs them)
  lora_linear_8k  the same at M = 8192, where the shipped op hands the GEMMs to cuBLAS and the core's forms do not
  moe_full      the Qwen3-30B-A3B-like experts layer at T = 8192 (``--moe-shape``, ``--moe-tokens``: another
                layer of notebook 06), full fine-tuning: ``ours`` (and, with
                ``--variants``, ``grouped_mm``, ``liger``, ``ours_persistent``, ``ours_kgrouped``: the K-grouped
                weight gradient)
  moe_lora      the same layer with PEFT LoRA on the experts: ``ours`` (and ``grouped_mm``)
  loss_trainable  the loss block of notebook 07 at the Llama-3-8B head (d 4096, V 128,256; ``--loss-shape``,
                ``--loss-tokens``: another head of ``bench_loss.py``), 16,384 tokens, head trainable: ``ours`` (the
                op as a user calls it) and, with ``--variants``, ``liger`` and ``gemm_floor`` (its cuBLAS GEMMs alone,
                outputs preallocated: 3 GEMMs)
  loss_frozen   the same with the head frozen (2 GEMMs)

Each (case, implementation) runs a few warm-up steps, then ``--repetitions`` steps under the profiler. Every GPU
kernel's device time is summed over those steps and divided by their number; a row gives the kernel's name,
launches per step, microseconds per step and its share of the step's kernel time; ``loop_ms_per_step`` beside
it is the step in the user's loop (``measure.loop_ms``, unprofiled, synchronised per call: host time included).
The kernels that account for most of the time, and whether they are GEMMs or memory-bound passes, say where a
target is lost. With ``--smoke`` (CPU, Triton's interpreter, tiny shapes) the rows are the CPU operators instead:
the code path only.

Writes into --out: profile_kernels.csv, profile_kernels.png (the largest kernels of each case as stacked bars) and,
on a GPU, profile_kernels_compiled.csv: every lora_lab Triton kernel the run compiled (autotuning candidates
included), with its tile sizes, launch settings (warps, stages, shared memory), registers and spills per thread, and
the occupancy those allow on one SM; profile_kernels_picks.csv: the settings each autotuner picked, per key; and
profile_kernels_gaps.csv: where the device sits idle inside a synchronised step and what it waited for (the
launching host operator, whether the host was blocked in a CUDA call; :mod:`idle_gaps`), the time a step's loop
pays over its kernels.

    python benchmarks/profile_kernels.py --out DIR
    python benchmarks/profile_kernels.py --out DIR --cases moe_full --variants grouped_mm liger ours_persistent
    python benchmarks/profile_kernels.py --out DIR --cases lora_linear --variants base fused_merged_qdb fused_merged
    TRITON_INTERPRET=1 python benchmarks/profile_kernels.py --out DIR --smoke
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import bench_loss
import idle_gaps
import torch
from bench_common import add_common_arguments, check_device, chosen_variants, device_line, error_text
from torch import nn

from lora_lab.experiments.fused_moe import (
    LAYER_SHAPES,
    LIGER,
    OURS_KGROUPED,
    OURS_PERSISTENT,
    layer_holder,
    liger_available,
    random_routing,
    set_implementation,
)
from lora_lab.lab import measure

CSV = "profile_kernels.csv"
COMPILED_CSV, PICKS_CSV = "profile_kernels_compiled.csv", "profile_kernels_picks.csv"
GAPS_CSV = "profile_kernels_gaps.csv"
CASES = ["lora_linear", "lora_linear_8k", "moe_full", "moe_lora", "loss_trainable", "loss_frozen"]
# the routes of notebook 05's "other forms" beside them: every product a cuBLAS call, the merged weight (and with
# Q and dB from one pass), where the idle gaps of a synchronised step say what the loop pays over their kernels
LINEAR_VARIANTS = ["base", "fused", "fused_persistent", "fused_fold", "fused_pure_cublas", "fused_merged",
                   "fused_merged_qdb", "fused_merged_overlap", "fused_merged_qdb_overlap", "fused_stacked",
                   "fused_stacked_cublas"]
MOE_VARIANTS = ["ours", "grouped_mm", *OURS_PERSISTENT, *OURS_KGROUPED, LIGER]
LOSS_VARIANTS = {"ours": "lora_lab", "ours_r4096": "lora_lab_fwdgrad_r4096", LIGER: "liger",  # variant: bench_loss
                 "gemm_floor": "gemm_floor"}  # method (ours_r4096: 4,096-row chunks, frozen heads too)
ALL_VARIANTS = [*dict.fromkeys([*LINEAR_VARIANTS, *MOE_VARIANTS, *LOSS_VARIANTS])]
DEFAULT_VARIANTS = ["base", "fused", "ours"]
LINEAR_CELL = (32768, 4096, 4096, 16)  # notebook 05's target cell (M, K, N, r)
LINEAR_8K_CELL = (8192, 4096, 4096, 16)  # below the shipped op's cuBLAS dispatch volume
MOE_SHAPE, MOE_TOKENS = "qwen3_30b_a3b", 8192
LOSS_SHAPE, LOSS_TOKENS = "llama3-8b", 16384
SMOKE_LINEAR_CELL = (64, 32, 32, 4)
SMOKE_MOE = dict(hidden=32, num_experts=4, top_k=2, intermediate=16)
SMOKE_MOE_TOKENS = 16
WARMUP_STEPS = 3
MIN_GAP_US = 5.0  # idle intervals shorter than this are not listed (launch-to-launch spacing)
TOP_GAPS = 8  # printed per (case, implementation); the CSV has them all
TOP_KERNELS = 12  # kept per (case, implementation); the rest is one row named "(other kernels)"


def linear_steps(variants, device, dtype, smoke: bool, cell=LINEAR_CELL):
    """{variant: (prepare, step)} for a LoRA linear case: the forward, then the gradients of X and of the factors
    (of X only for the frozen layer). The fused forms use notebook 05's settings (``bench_lora_linear``)."""
    from bench_lora_linear import FUSED_CONFIGS

    from lora_lab.kernels import KernelConfig, fused_lora_linear

    M, K, N, r = SMOKE_LINEAR_CELL if smoke else cell
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(M, K, generator=gen, device=device).to(dtype).requires_grad_(True)
    dy = torch.randn(M, N, generator=gen, device=device).to(dtype)
    lin = nn.Linear(K, N, bias=False, device=device, dtype=dtype).requires_grad_(False)
    A = (torch.randn(r, K, generator=gen, device=device) / K**0.5).to(dtype).requires_grad_(True)
    B = (torch.randn(N, r, generator=gen, device=device) * 0.02).to(dtype).requires_grad_(True)
    shipped = KernelConfig.from_env()

    def fused(cfg):
        return lambda: torch.autograd.grad(fused_lora_linear(x, lin.weight, None, A, B, 2.0, config=cfg), [x, A, B], dy)

    steps = {"base": lambda: torch.autograd.grad(lin(x), [x], dy)}
    steps |= {v: fused(shipped.replace(**FUSED_CONFIGS[v])) for v in LINEAR_VARIANTS if v != "base"}
    return {v: (lambda: None, steps[v]) for v in LINEAR_VARIANTS if v in variants}, f"M={M} K={K} N={N} r={r}"


def moe_steps(mode: str, variants, device, dtype, smoke: bool, shape_name: str = MOE_SHAPE,
              tokens: int = MOE_TOKENS):
    """{implementation: (prepare, step)} for one MoE case, all on one layer (``prepare`` switches it to the
    implementation, outside the profiled steps)."""
    shape = LAYER_SHAPES[shape_name].scaled(**SMOKE_MOE) if smoke else LAYER_SHAPES[shape_name]
    tokens = SMOKE_MOE_TOKENS if smoke else tokens
    holder, experts, params = layer_holder(shape, mode, device, dtype, seed=0)
    gen = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(tokens, shape.hidden, generator=gen, device=device).to(dtype).requires_grad_(True)
    index, weights = random_routing(tokens, shape, device, dtype, seed=0)
    grad_out = torch.randn(tokens, shape.hidden, generator=gen, device=device).to(dtype)
    wanted = [v for v in MOE_VARIANTS
              if v in variants and not (v == LIGER and (mode != "full" or not liger_available()))]

    def step():
        return torch.autograd.grad(holder(x, index, weights), [x, weights, *params], grad_out)

    return {impl: (lambda impl=impl: set_implementation(holder, experts, impl), step) for impl in wanted}, (
        f"{shape.name} T={tokens} {mode}")


def loss_steps(head: str, variants, device, dtype, smoke: bool, shape_name: str = LOSS_SHAPE,
               tokens: int = LOSS_TOKENS):
    """{variant: (prepare, step)} for a loss case: one forward + backward of ``bench_loss.py``'s method on that
    script's inputs (``bench_loss.make_inputs``), the head trainable or frozen. A method that cannot run here (Liger
    off CUDA) is left out."""
    hidden, vocab = (bench_loss.SMOKE_SHAPES if smoke else bench_loss.SHAPES)[shape_name]
    tokens = bench_loss.SMOKE_TOKENS[0] if smoke else tokens
    trainable = head == "trainable"
    h, w, y, gen = bench_loss.make_inputs(hidden, vocab, tokens, device, dtype, seed=0)
    h.requires_grad_(True)
    w.requires_grad_(trainable)
    steps = {}
    for variant, method in LOSS_VARIANTS.items():
        if variant not in variants:
            continue
        try:
            loss_fn, _mode, _version = bench_loss.resolve(method, device)
        except bench_loss.Unavailable as err:
            print(f"loss_{head} {variant}: skipped ({err})", flush=True)
            continue
        steps[variant] = (lambda: None, bench_loss.make_step(method, loss_fn, h, w, y, trainable, gen))
    return steps, f"{shape_name} d={hidden} V={vocab} N={tokens} {head}"


def all_kernel_rows(prof, cuda: bool, steps: int) -> list[dict]:
    """Every kernel (CUDA) or operator (CPU) of a profile: launches and microseconds per profiled step (its own time:
    the device's for a kernel, the CPU's for an operator), largest first."""
    rows = []
    for event in prof.key_averages():
        if event.key == idle_gaps.STEP_MARK:  # the step's own range (host and device timelines), not a kernel
            continue
        if cuda:
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(event, "self_device_time_total", None)
            us = us if us is not None else event.self_cuda_time_total
        else:
            us = event.self_cpu_time_total
        if us > 0:
            rows.append({"kernel": event.key, "calls_per_step": event.count / steps, "us_per_step": us / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows


def kernel_rows(prof, cuda: bool, steps: int) -> list[dict]:
    """The :data:`TOP_KERNELS` largest of :func:`all_kernel_rows` and one row for the rest, each with its share."""
    rows = all_kernel_rows(prof, cuda, steps)
    total = sum(r["us_per_step"] for r in rows) or 1.0
    top, rest = rows[:TOP_KERNELS], rows[TOP_KERNELS:]
    if rest:
        top.append({"kernel": "(other kernels)", "calls_per_step": sum(r["calls_per_step"] for r in rest),
                    "us_per_step": sum(r["us_per_step"] for r in rest)})
    for r in top:
        r["share"] = r["us_per_step"] / total
    return top


def profile_step(step, steps: int, cuda: bool) -> tuple[list[dict], float, float, list[dict]]:
    """(kernel rows, wall milliseconds per profiled step, the user's-loop milliseconds per step, idle-gap rows) of
    ``steps`` profiled calls after the warm-up. The loop figure is the median of ``steps`` unprofiled calls by
    ``measure.loop_ms`` (CUDA events, synchronised after each call) — kernel time and host time side by side. The
    profiled calls are synchronised one by one too, each inside a ``record_function`` range, so that the gaps
    (:mod:`idle_gaps`: where the device waits inside a step, and for what) are the ones the user's loop pays."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(WARMUP_STEPS):
        step()
    if cuda:
        torch.cuda.synchronize()
    loop_ms = statistics.median(measure.loop_ms(step, calls=steps, warmup=0))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(idle_gaps.STEP_MARK):
                step()
                if cuda:
                    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    gaps = []
    if cuda:
        try:  # a diagnostic on top of the kernel rows: a trace it cannot read must not lose them
            with tempfile.TemporaryDirectory() as tmp:
                trace = Path(tmp) / "trace.json"
                prof.export_chrome_trace(str(trace))
                gaps = idle_gaps.step_gaps(idle_gaps.load_trace(trace), MIN_GAP_US)
        except Exception as err:
            print(f"  idle gaps not read from the trace: {error_text(err)[:200]}", flush=True)
    return kernel_rows(prof, cuda, steps), wall_ms, loop_ms, gaps


# one Hopper SM (H100 / H200): the limits that decide how many copies of a kernel's program it holds at once
SM_REGISTERS, SM_SHARED_BYTES, SM_MAX_WARPS, SM_MAX_BLOCKS = 65536, 228 * 1024, 64, 32


def occupancy(num_warps: int, regs_per_thread: int, shared_bytes: int) -> dict:
    """Programs (thread blocks) one Hopper SM can hold at once, what limits them, and the share of the SM's warp
    slots they fill. Registers are allocated per warp in units of 256 (8 per thread)."""
    regs_per_warp = -(-max(regs_per_thread, 1) * 32 // 256) * 256
    limits = {"registers": SM_REGISTERS // (regs_per_warp * num_warps),
              "shared memory": SM_SHARED_BYTES // shared_bytes if shared_bytes else SM_MAX_BLOCKS + 1,
              "warps": SM_MAX_WARPS // num_warps, "blocks": SM_MAX_BLOCKS}
    blocks = min(limits.values())
    limiter = min(limits, key=limits.get)
    return {"blocks_per_sm": blocks, "occupancy_limited_by": limiter,
            "warp_occupancy": blocks * num_warps / SM_MAX_WARPS}


def kernel_objects():
    """(module-qualified name, JITFunction, Autotuners wrapping it) for every Triton kernel in ``lora_lab.kernels``
    (autotuned and heuristic wrappers unwrapped)."""
    import importlib
    import pkgutil

    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    import lora_lab.kernels as package

    found = {}
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        module = importlib.import_module(info.name)
        objects = list(vars(module).values())
        # the MoE kernels keep their autotuned forms in dicts ({persistent: Autotuner}, launch.make_tuned)
        objects += [v for obj in list(objects) if isinstance(obj, dict) for v in obj.values()]
        for obj in objects:
            fn, tuners = obj, []
            while not isinstance(fn, JITFunction) and hasattr(fn, "fn"):
                tuners += [fn] if isinstance(fn, Autotuner) else []
                fn = fn.fn
            if not isinstance(fn, JITFunction):
                continue
            qualified = f"{fn.__module__}.{fn.__name__}"
            entry = found.setdefault(id(fn), (qualified, fn, []))
            entry[2].extend(t for t in tuners if all(t is not known for known in entry[2]))
    return list(found.values())


def autotuner_picks() -> list[dict]:
    """What each lora_lab autotuner picked in this process, per tuning key (the key's values as the autotuner
    lists them: the shapes and flags it tunes on, then the dtypes)."""
    rows = []
    for qualified, _fn, tuners in kernel_objects():
        for tuner in tuners:
            for key, config in getattr(tuner, "cache", {}).items():
                rows.append({"function": qualified, "key": " ".join(map(str, key)),
                             "config": " ".join(f"{k}={v}" for k, v in sorted(config.kwargs.items())),
                             "num_warps": config.num_warps, "num_stages": config.num_stages})
    return rows


def compiled_kernel_rows() -> list[dict]:
    """Every compiled variant of every lora_lab Triton kernel this process launched, autotuning candidates
    included: launch settings, tile sizes, registers and spills per thread, and the occupancy they allow
    (``occupancy``). ``autotuner_picks`` says which settings each tuning key got. Empty under the interpreter."""
    rows = []
    for qualified, fn, tuners in kernel_objects():
        for caches in getattr(fn, "device_caches", {}).values():
            for compiled in list(caches[0].values()):
                try:
                    if getattr(compiled, "n_regs", None) is None and hasattr(compiled, "_init_handles"):
                        compiled._init_handles()
                    meta = compiled.metadata
                    warps, stages, shared = int(meta.num_warps), int(getattr(meta, "num_stages", 0)), int(meta.shared)
                    regs, spills = int(compiled.n_regs), int(compiled.n_spills)
                    constants = getattr(getattr(compiled, "src", None), "constants", {}) or {}
                    constexprs = {fn.arg_names[k[0]] if isinstance(k, tuple) else k: v for k, v in constants.items()}
                except Exception as err:  # another Triton's layout: say so, keep the others
                    rows.append({"function": qualified, "status": "error", "error": error_text(err)})
                    continue
                tiles = {k: v for k, v in constexprs.items() if isinstance(v, int) and k.isupper()}
                rows.append({"function": qualified, "kernel": getattr(meta, "name", fn.__name__), "status": "ok",
                             "autotuned": bool(tuners),
                             "num_warps": warps, "num_stages": stages, "num_ctas": int(getattr(meta, "num_ctas", 1)),
                             "shared_bytes": shared, "regs_per_thread": regs, "spills": spills,
                             **occupancy(warps, regs, shared),
                             "constexprs": " ".join(f"{k}={v}" for k, v in sorted(tiles.items()))})
    return rows


def plot(rows, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["case"], r["impl"]) for r in rows))
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(groups)), 5))
    for i, (case, impl) in enumerate(groups):
        bottom = 0.0
        for r in (r for r in rows if (r["case"], r["impl"]) == (case, impl)):
            ms = r["us_per_step"] / 1e3
            ax.bar(i, ms, bottom=bottom, color="0.8" if r["kernel"] == "(other kernels)" else None, edgecolor="k",
                   lw=0.3)
            if r["share"] >= 0.08:
                ax.text(i, bottom + ms / 2, r["kernel"][:28], ha="center", va="center", fontsize=6)
            bottom += ms
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{c}\n{i}" for c, i in groups], fontsize=8)
    ax.set_ylabel("kernel time per step (ms)")
    ax.set_title("Where a step's kernel time goes (largest kernels labelled)")
    fig.tight_layout()
    fig.savefig(out / "profile_kernels.png", dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(ap, ALL_VARIANTS, DEFAULT_VARIANTS, "tiny shapes")
    ap.add_argument("--cases", nargs="+", default=CASES, choices=CASES, help="what to profile (default: all)")
    ap.add_argument("--moe-shape", default=MOE_SHAPE, choices=sorted(LAYER_SHAPES),
                    help=f"the MoE cases' layer (default {MOE_SHAPE})")
    ap.add_argument("--moe-tokens", type=int, default=MOE_TOKENS, help=f"the MoE cases' tokens (default {MOE_TOKENS})")
    ap.add_argument("--loss-shape", default=LOSS_SHAPE, choices=list(bench_loss.SHAPES),
                    help=f"the loss cases' head (default {LOSS_SHAPE})")
    ap.add_argument("--loss-tokens", type=int, default=LOSS_TOKENS,
                    help=f"the loss cases' tokens (default {LOSS_TOKENS})")
    args = ap.parse_args(argv)
    args.variants = chosen_variants(ap, args, ALL_VARIANTS, DEFAULT_VARIANTS)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device = check_device(args.smoke)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32  # the interpreter's bf16 dot is wrong
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(device_line(device, dtype, args.repetitions, f"profiled steps {args.repetitions}"), flush=True)
    rows, gap_rows = [], []
    for case in args.cases:
        if case.startswith("lora_linear"):
            cell = LINEAR_8K_CELL if case == "lora_linear_8k" else LINEAR_CELL
            steps, where = linear_steps(args.variants, device, dtype, args.smoke, cell)
        elif case.startswith("loss_"):
            steps, where = loss_steps(case.removeprefix("loss_"), args.variants, device, dtype, args.smoke,
                                      args.loss_shape, args.loss_tokens)
        else:
            steps, where = moe_steps(case.removeprefix("moe_"), args.variants, device, dtype, args.smoke,
                                     args.moe_shape, args.moe_tokens)
        for impl, (prepare, step) in steps.items():
            base = {"case": case, "impl": impl, "shape": where, "smoke": args.smoke}
            try:
                prepare()
                kernels, wall_ms, loop_ms, gaps = profile_step(step, args.repetitions, cuda)
            except Exception as err:  # one implementation that cannot run must not lose the others' profiles
                rows.append({**base, "status": "error", "error": error_text(err)})
                print(f"{case} {impl}: failed: {rows[-1]['error'][:200]}", flush=True)
            else:
                total_ms = sum(k["us_per_step"] for k in kernels) / 1e3
                rows += [{**base, "status": "ok", "wall_ms_per_step": wall_ms, "loop_ms_per_step": loop_ms,
                          "kernel_ms_per_step": total_ms, **k} for k in kernels]
                top = ", ".join(f"{k['kernel'][:40]} {k['share']:.0%}" for k in kernels[:4])
                print(f"{case} {impl} ({where}): {total_ms:.3f} ms of kernels per step, {loop_ms:.3f} ms per step "
                      f"in the user's loop ({wall_ms:.3f} ms wall under the profiler); {top}", flush=True)
                for k in kernels:  # the whole table in the log too
                    print(f"    {k['us_per_step']:10.1f} us {k['calls_per_step']:5.1f} calls {k['share']:6.1%}  "
                          f"{k['kernel'][:100]}", flush=True)
                if cuda:
                    idle_us, grouped = idle_gaps.summarise(gaps, args.repetitions)
                    gap_rows += [{**base, "idle_us_per_step": idle_us, **g} for g in grouped]
                    print(f"  idle inside the synchronised step (under the profiler): {idle_us / 1e3:.3f} ms per "
                          f"step in {len(gaps) / args.repetitions:.1f} gaps; the largest:", flush=True)
                    for g in grouped[:TOP_GAPS]:
                        lag = g["mean_launch_lag_us"]
                        lag = "" if lag is None else f", launched {lag:.1f} us into the gap"
                        waits = f", host waits: {g['host_waits']}" if g["host_waits"] else ""
                        print(f"    {g['per_step_us']:9.1f} us/step at +{g['mean_start_us']:.0f} us before "
                              f"{g['next_kernel'][:50]} (from {g['launched_by'][:90]}{lag}{waits})", flush=True)
                    torch.cuda.empty_cache()
            measure.write_csv(rows, out / CSV)  # after every implementation: a run cut short keeps what it measured
            if gap_rows:
                measure.write_csv(gap_rows, out / GAPS_CSV)
    if any(r["status"] == "ok" for r in rows):
        plot([r for r in rows if r["status"] == "ok"], out)
    if cuda:
        compiled = compiled_kernel_rows()
        measure.write_csv(compiled, out / COMPILED_CSV)
        picks = autotuner_picks()
        measure.write_csv(picks, out / PICKS_CSV)
        for r in picks:
            print(f"autotuner pick {r['function']} [{r['key']}]: {r['config']} {r['num_warps']} warps "
                  f"{r['num_stages']} stages", flush=True)
        for r in (r for r in compiled if r["status"] == "ok"):
            print(f"compiled {r['kernel']}: {r['constexprs']}; {r['num_warps']} warps, "
                  f"{r['num_stages']} stages, {r['shared_bytes'] // 1024} KiB shared, {r['regs_per_thread']} regs, "
                  f"{r['spills']} spills -> "
                  f"{r['blocks_per_sm']} per SM ({r['occupancy_limited_by']}), {r['warp_occupancy']:.0%} of warps",
                  flush=True)
    print(f"wrote {out / CSV} ({len(rows)} rows)", flush=True)


if __name__ == "__main__":
    main()

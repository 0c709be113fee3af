"""Profile: where a full-depth training step's time goes, by kernel category, beside the step's matrix-product floor.

``bench_peers_step.py`` says how fast each implementation's step is; this says where each spends it. For one model
and checkpointing setting it builds each implementation of ``bench_peers_step`` (lora_lab's recipe, PEFT, PEFT +
Liger, axolotl, unsloth: ``--impls``; one at a time, freed before the next), runs a few untimed steps, times
``--steps`` steps in the user's loop (``measure.loop_ms``) and profiles as many more (``torch.profiler``). Every GPU
kernel's device time is summed per step and sorted into a category by its name (:data:`CATEGORIES`: matrix
products by cuBLAS/CUTLASS, lora_lab's Triton GEMMs and rank-r passes, attention, the loss, norms, activations,
rotary embedding, the optimizer, copies, other element-wise work). The step's floor (its matrix products' FLOPs at
the dense bf16 rate of an 8192³ product timed in the same process, :mod:`lora_lab.experiments.step_floor`) is
given beside it, by part: the products' share of the floor against the time the matrix-product kernels took says
how far they run from the dense rate; the rest of the step (norms, activations, copies, the optimizer, idle time)
has no floor and is what fusing can remove. With ``--smoke`` (CPU, tiny configs) the categories are read from CPU
operator names instead: the code path only.

Writes into --out: profile_step.csv (one row per implementation and category: milliseconds per step and share of
the kernels' time, with the step's loop time and floor), profile_step_kernels.csv (the ``--top`` kernels of each
implementation), and prints both.

    python benchmarks/profile_step.py --out DIR                                    # Llama-3-8B shape, ckpt on
    python benchmarks/profile_step.py --out DIR --model qwen3_30b_a3b --layers 24 --impls ours unsloth
    TRITON_INTERPRET=1 python benchmarks/profile_step.py --out DIR --smoke --impls ours peft
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
from pathlib import Path

import bench_peers_step as peers_step
import bench_whole_step as whole
import profile_kernels
import torch
from bench_common import check_device, device_line, error_text

from lora_lab.experiments import step_floor
from lora_lab.lab import measure

CSV, KERNELS_CSV = "profile_step.csv", "profile_step_kernels.csv"
WARMUP_STEPS = 2
# (category, pattern): the first pattern found in a kernel's (or, on CPU, an operator's) name, lower-cased, decides
CATEGORIES = [
    # lora_lab's LoRA kernels (on CPU: its autograd Functions, the interpreter running inside them)
    ("lora_triton", r"_lora_gemm|_rank_projection|_rank_reduction|_q_and_db|_dropout_mask|_dora_row_norm|lora"),
    ("moe_triton", r"_gate_up_silu|_down_backward_silu|_expert_weight_grad|_grouped_rows_gemm|_kgrouped_weight_grad"
                   r"|_route_|_unsort_sum|_zero_empty_experts"),
    ("loss", r"cross_entropy|crossentropy|fwdgrad|logit_grad|lse_partials|logsumexp|_lse|flce|nll_loss|log_softmax"),
    ("attention", r"flash|fmha|attention|attn|sdpa|_efficient_"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|sm90_|sm80_|cublas|wgmma|aten::mm|aten::addmm|aten::bmm|aten::matmul"
               r"|aten::linear|grouped_mm|mmbackward"),
    ("norm", r"rms|layer_norm|layernorm|_norm"),
    ("rope", r"rope|rotary"),
    ("activation", r"silu|swiglu|geglu|gelu|sigmoid"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("copy", r"copy|memcpy|memset|cat_|catarray|transpose|contiguous|aten::to\b|aten::_to_copy|aten::clone"),
    ("elementwise", r"elementwise|vectorized|reduce|index|scatter|gather|fill|aten::"),
]
ORDER = [name for name, _ in CATEGORIES] + ["other"]
_COMPILED = [(name, re.compile(pattern)) for name, pattern in CATEGORIES]


def category(name: str) -> str:
    """The category of a kernel or operator name (:data:`CATEGORIES`; ``other`` when none matches)."""
    low = name.lower()
    return next((cat for cat, pattern in _COMPILED if pattern.search(low)), "other")


def kernel_times(prof, cuda: bool, steps: int) -> list[dict]:
    """Per kernel (CUDA) or CPU operator (``profile_kernels.all_kernel_rows``): calls and milliseconds per step,
    with its category, largest first."""
    return [{"kernel": r["kernel"], "category": category(r["kernel"]), "calls_per_step": r["calls_per_step"],
             "ms_per_step": r["us_per_step"] / 1e3} for r in profile_kernels.all_kernel_rows(prof, cuda, steps)]


def by_category(kernels: list[dict]) -> list[dict]:
    """Milliseconds per step and share of the kernels' time for every category, in :data:`ORDER`."""
    total = sum(k["ms_per_step"] for k in kernels) or 1.0
    sums = dict.fromkeys(ORDER, 0.0)
    for k in kernels:
        sums[k["category"]] += k["ms_per_step"]
    return [{"category": cat, "ms_per_step": ms, "share": ms / total} for cat, ms in sums.items()]


def profile_model(model, steps: int, cuda: bool) -> tuple[float, list[dict]]:
    """(the step's median milliseconds in the user's loop, its kernels) for ``steps`` profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(WARMUP_STEPS):
        model.step()
    loop_ms = statistics.median(measure.loop_ms(model.step, calls=steps, warmup=0))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            model.step()
            if cuda:
                torch.cuda.synchronize()
    return loop_ms, kernel_times(prof, cuda, steps)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama3_8b", choices=list(peers_step.MODELS))
    ap.add_argument("--impls", nargs="+", default=["ours", "unsloth", "peft_liger"], choices=list(peers_step.IMPLS))
    ap.add_argument("--checkpointing", default="on", choices=["off", "on"])
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's own)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3, help="steps timed in the loop, and again under the profiler")
    ap.add_argument("--top", type=int, default=15, help="kernels per implementation in profile_step_kernels.csv")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="unsloth's random-init checkpoints (default: OUT/checkpoints)")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1: tiny configs, fp32, 1 layer")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.top < 1:
        ap.error("--steps and --top must be >= 1")
    if args.smoke:
        args.batch, args.seq, args.steps = 2, 16, 1
    args.checkpointing_now = args.checkpointing
    args.layers = 1 if args.smoke else (args.layers or peers_step.MODELS[args.model][1])
    args.checkpoint_dir = str(Path(args.checkpoint_dir or Path(args.out) / "checkpoints").resolve())
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = check_device(args.smoke)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(device_line(device, dtype, 1, f"profiled steps {args.steps}"), flush=True)
    tflops = peers_step.matmul_tflops(device, dtype)
    family = peers_step.MODELS[args.model][0]
    floor = step_floor.floor_rows(args.model, whole.model_config(family, args.layers, args.smoke), args.batch,
                                  args.seq, args.checkpointing, tflops, lora_experts=family == "qwen3_moe")
    matmul_floor = (floor["flops_projections"] + floor["flops_lora"] + floor["flops_head"] + floor["flops_router"]
                    + floor["flops_experts"])
    base = dict(model=args.model, checkpointing=args.checkpointing, layers=args.layers, batch=args.batch,
                seq=args.seq, smoke=args.smoke, matmul_tflops=tflops, floor_ms=floor["floor_ms"],
                floor_matmul_ms=step_floor.floor_ms(matmul_floor, tflops) if tflops else None,
                floor_attention_ms=step_floor.floor_ms(floor["flops_attention"], tflops) if tflops else None)
    if tflops:
        print(f"{args.model}, {args.layers} layers, checkpointing {args.checkpointing}: "
              f"floor {floor['floor_ms']:.0f} ms at {tflops:.0f} TFLOP/s (matrix products outside attention "
              f"{base['floor_matmul_ms']:.0f} ms, attention {base['floor_attention_ms']:.0f} ms)", flush=True)
    rows, top_rows = [], []
    for impl in args.impls:
        peer = None
        if impl in ("axolotl", "unsloth"):
            peer = peers_step.peer_loader.load(impl, "model", device)
            if isinstance(peer, peers_step.peer_loader.PeerSkip):
                rows.append(dict(base, impl=impl, status="skipped", error=peer.error))
                print(f"{impl}: skipped: {peer.error[:200]}", flush=True)
                continue
        try:
            model = peers_step.PeerModel(args.model, impl, args, device, dtype, peer)
            loop_ms, kernels = profile_model(model, args.steps, cuda)
        except Exception as err:  # one implementation that cannot run must not lose the others' profiles
            rows.append(dict(base, impl=impl, status="error", error=error_text(err)))
            print(f"{impl}: failed: {rows[-1]['error'][:200]}", flush=True)
        else:
            kernel_ms = sum(k["ms_per_step"] for k in kernels)
            cats = by_category(kernels)
            rows += [dict(base, impl=impl, status="ok", loop_ms=loop_ms, kernel_ms=kernel_ms, **c) for c in cats]
            top_rows += [dict(base, impl=impl, **k) for k in kernels[:args.top]]
            print(f"{impl}: {loop_ms:.1f} ms per step in the loop, {kernel_ms:.1f} ms of kernels", flush=True)
            for c in cats:
                if c["ms_per_step"] > 0:
                    print(f"    {c['category']:12s} {c['ms_per_step']:9.2f} ms  {c['share']:6.1%}", flush=True)
        finally:
            model = None
            whole.free_memory()
        measure.write_csv(rows, out / CSV)  # after every implementation: a run cut short keeps what it measured
        measure.write_csv(top_rows, out / KERNELS_CSV)
    measure.write_csv(rows, out / CSV)  # a skipped implementation last in the list is written too
    print(f"wrote {out / CSV} and {out / KERNELS_CSV}", flush=True)


if __name__ == "__main__":
    main()

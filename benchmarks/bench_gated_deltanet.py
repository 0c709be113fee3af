"""Benchmark: the LoRA projections of one Qwen3.5 GatedDeltaNet layer (hidden 4096), forward + backward, bf16.

The group, as transformers' ``Qwen3_5GatedDeltaNet`` uses it: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a`` read the layer input X; ``out_proj`` reads the core's output C. LoRA r=16 (alpha 32) on all five.
One step = the five projections forward, then ``torch.autograd.grad`` of fixed output gradients for X, C and the
LoRA factors. The delta-rule core itself is not timed: it is the same in every variant.

Variants (same layer weights, X, C and output gradients; default: base, peft, fused; ``--variants all``):
  base                 frozen projections (no LoRA)
  peft                 PEFT default (fp32 adapters, input cast)
  peft_nocast          PEFT with bf16 adapters
  chained              chained-cuBLAS Function per projection
  fused                the PEFT model with bf16 adapters after lora_lab.kernels.patch_model, shipped KernelConfig
                       (one shared-input op for the four input projections, the fused linear for out_proj)
  fused_fp32_adapters  the same with PEFT's default fp32 adapters (A, B cast per call, never X)
  fused_*_base[_overlap]  the patched layer with KernelConfig(base_gemm=triton|cublas, overlap=off|on)

Repetitions: ``--repetitions N`` complete side-by-side loops, each timing every variant once, order rotating:
``fwd_bwd_ms`` is the primary figure, the median of ``--calls`` calls of the step in the user's loop
(``measure.loop_ms``: CUDA events around each call, synchronised after it, so host time counts); ``kernel_ms``
(profiler device time per call) and ``back_to_back_ms`` (``do_bench``) stand beside it as labelled secondary columns
where ``--secondary`` asks for them (none by default). Peak memory (``measure.peak_bytes``) and the bytes saved for
backward (deduplicated by storage, parameters excluded) are measured once per variant. ``--check-seq N`` also
compares the whole patched layer (core included) with the unpatched PEFT layer at sequence N.

Writes into --out: 05_gated_deltanet.csv (one row per variant and repetition), 05_gated_deltanet_summary.csv,
05_gated_deltanet_layer_check.csv (with --check-seq) and 05_gated_deltanet.png.

    python benchmarks/bench_gated_deltanet.py --out DIR [--seq 32768] [--variants all]
    TRITON_INTERPRET=1 python benchmarks/bench_gated_deltanet.py --out DIR --smoke
"""
from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
from bench_common import (
    add_common_arguments,
    add_timing_arguments,
    check_device,
    chosen_variants,
    device_line,
    repetition_dots,
    time_call,
    write_summary,
)
from torch import nn

from lora_lab.lab import measure
from lora_lab.layer import SingleChild, fill_lora_B
from lora_lab.memory import saved_bytes_excluding

CSV, SUMMARY_CSV = "05_gated_deltanet.csv", "05_gated_deltanet_summary.csv"
CHECK_CSV = "05_gated_deltanet_layer_check.csv"
IN_PROJ = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]
TARGETS = IN_PROJ + ["out_proj"]
DEFAULT_VARIANTS = ["base", "peft", "fused"]
PATCHED_CONFIGS = {  # patched variants: KernelConfig fields changed from the shipped settings
    "fused": {},
    "fused_fp32_adapters": {},
    "fused_triton_base": {"base_gemm": "triton", "overlap": "off"},
    "fused_triton_base_overlap": {"base_gemm": "triton", "overlap": "on"},
    "fused_cublas_base": {"base_gemm": "cublas", "overlap": "off"},
    "fused_cublas_base_overlap": {"base_gemm": "cublas", "overlap": "on"},
}
ALL_VARIANTS = ["base", "peft", "peft_nocast", "chained", *PATCHED_CONFIGS]
# --smoke: a GatedDeltaNet layer of hidden 32 (fewer, smaller heads), sequence / 1024
SMOKE_LAYER = dict(hidden_size=32, linear_num_key_heads=2, linear_key_head_dim=16, linear_num_value_heads=2,
                   linear_value_head_dim=16)
SMOKE_SEQ_DIVISOR = 1024


def gated_deltanet(hidden: int, dtype, device, smoke: bool):
    """transformers' Qwen3.5 GatedDeltaNet (its config's defaults are the hidden-4096 model: 16 key heads and
    32 value heads of 128), weights ~ N(0, 1/hidden), frozen."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    sizes = SMOKE_LAYER if smoke else {"hidden_size": hidden}
    cfg = Qwen3_5TextConfig(num_hidden_layers=1, layer_types=["linear_attention"], **sizes)
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(cfg, layer_idx=0)
    with torch.no_grad():
        for m in layer.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=cfg.hidden_size**-0.5)
    return layer.to(device=device, dtype=dtype).requires_grad_(False)


def peft_wrap(layer, r, fp32_adapters):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)  # the same A in every wrapped copy
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS)
    model = get_peft_model(SingleChild(copy.deepcopy(layer), "layer"), config, autocast_adapter_dtype=fp32_adapters)
    torch.manual_seed(2)
    fill_lora_B(model, 0.02)
    if not fp32_adapters:
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.data = p.data.to(layer.out_proj.weight.dtype)
    return model


def projection_group(layer, x, c):
    """The five projections as the layer calls them: four of X, then out_proj of the core output."""
    return [getattr(layer, n)(x) for n in IN_PROJ] + [layer.out_proj(c)]


def chained_group(layer, factors, x, c):
    from lora_lab.kernels import chained_lora_linear

    return [chained_lora_linear(c if n == "out_proj" else x, getattr(layer, n).weight, None, *factors[n], 2.0)
            for n in TARGETS]


def build_variants(names, layer, rank, shipped):
    """{name: (model or None, forward(x, c) → outputs, trainable parameters, config text)}."""
    from lora_lab.kernels import patch_model

    nocast = peft_wrap(layer, rank, False)
    variants = {}
    for name in names:
        if name == "base":
            variants[name] = (layer, lambda x, c: projection_group(layer, x, c), [], "")
            continue
        if name == "chained":
            factors = {n: (getattr(nocast.base_model.model.layer, n).lora_A["default"].weight,
                           getattr(nocast.base_model.model.layer, n).lora_B["default"].weight) for n in TARGETS}
            variants[name] = (None, lambda x, c, f=factors: chained_group(layer, f, x, c),
                              [p for pair in factors.values() for p in pair], "")
            continue
        fp32 = name in ("peft", "fused_fp32_adapters")
        model = peft_wrap(layer, rank, True) if fp32 else (nocast if name == "peft_nocast" else copy.deepcopy(nocast))
        text = "adapters " + str(next(p.dtype for p in model.parameters() if p.requires_grad))
        if name in PATCHED_CONFIGS:
            cfg = shipped.replace(**PATCHED_CONFIGS[name])
            print(f"{name}: patch_model", patch_model(model, config=cfg), flush=True)
            text += f" {cfg!r}"
        inner = model.base_model.model.layer
        variants[name] = (model, lambda x, c, m=inner: projection_group(m, x, c),
                          [p for p in model.parameters() if p.requires_grad], text)
    return variants, nocast


def layer_check(nocast, fused, hidden, seq, dtype, device):
    """The whole layer (core included): patched vs unpatched PEFT layer, the same bf16 adapters."""
    from lora_lab.numerics import cosine, rel_l2

    g = torch.Generator(device="cpu").manual_seed(3)
    xs = torch.randn(1, seq, hidden, generator=g).to(device, dtype)
    xr, xf = xs.clone().requires_grad_(), xs.clone().requires_grad_()
    yr, yf = nocast(xr), fused(xf)
    gy = torch.randn(yr.shape, generator=g).to(device, dtype)
    yr.backward(gy)
    yf.backward(gy)
    ref = dict(nocast.named_parameters())
    worst = max(rel_l2(p.grad, ref[n].grad) for n, p in fused.named_parameters() if p.grad is not None)
    return {"check_seq": seq, "layer_out_cosine": cosine(yf, yr), "layer_dx_rel_l2": rel_l2(xf.grad, xr.grad),
            "layer_lora_grad_worst_rel_l2": worst}


def summary_rows(rows):
    out = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        ms = measure.summarize(r["fwd_bwd_ms"] for r in mine)
        time_vs_base = measure.summarize(
            measure.repetition_ratios(rows, "fwd_bwd_ms", {"variant": variant}, {"variant": "base"}))
        speedup = measure.summarize(
            measure.repetition_ratios(rows, "fwd_bwd_ms", {"variant": "peft"}, {"variant": variant}))
        peft_saved = next(r["saved_activation_bytes"] for r in rows if r["variant"] == "peft")
        out.append({"variant": variant, "fwd_bwd_ms": ms["median"], "ms_ci95_low": ms["ci95"][0],
                    "ms_ci95_high": ms["ci95"][1], "n": ms["n"], "time_vs_base": time_vs_base["median"],
                    "speedup_vs_peft": speedup["median"], "peak_bytes": mine[0]["peak_bytes"],
                    "saved_activation_bytes": mine[0]["saved_activation_bytes"],
                    "saved_bytes_less_than_peft": peft_saved - mine[0]["saved_activation_bytes"]})
    return out


def plot(summary, rows, out: Path, seq: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s["variant"] for s in summary]
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 1.3 * len(names) * 2), 3.8))
    axes[0].bar(names, [s["fwd_bwd_ms"] for s in summary], color="tab:blue", alpha=0.8)
    for i, name in enumerate(names):
        repetition_dots(axes[0], i, [r["fwd_bwd_ms"] for r in rows if r["variant"] == name])
    axes[0].set_ylabel("fwd+bwd ms (bars: median, dots: repetitions)")
    axes[0].set_title(f"GatedDeltaNet projections, seq {seq}")
    axes[1].bar(names, [s["saved_activation_bytes"] / 2**30 for s in summary], color="tab:orange")
    axes[1].set_ylabel("saved for backward (GiB)")
    axes[1].set_title("activation memory per layer")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(out / "05_gated_deltanet.png", dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(ap, ALL_VARIANTS, DEFAULT_VARIANTS,
                         "the whole code path on a hidden-32 layer, seq / 1024, fp32")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--rank", type=int, default=16)
    add_timing_arguments(ap, secondary=())  # no metric reads the secondary columns: opt in with --secondary
    ap.add_argument("--check-seq", type=int, default=0, help="sequence of the whole-layer check (0: none)")
    return ap


def main(argv=None):
    start = time.perf_counter()
    ap = build_parser()
    args = ap.parse_args(argv)
    names = chosen_variants(ap, args, ALL_VARIANTS, DEFAULT_VARIANTS)
    device = check_device(args.smoke)
    from lora_lab.kernels import KernelConfig

    shipped = KernelConfig.from_env()
    dtype = torch.float32 if args.smoke else torch.bfloat16
    seq = max(16, args.seq // SMOKE_SEQ_DIVISOR) if args.smoke else args.seq
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    layer = gated_deltanet(args.hidden, dtype, device, args.smoke)
    hidden = layer.out_proj.out_features
    print(device_line(device, dtype, args.repetitions, f"hidden {hidden}, seq {seq}, rank {args.rank}, "
                      f"variants {' '.join(names)}, shipped {shipped}"), flush=True)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, seq, hidden, generator=g).to(device, dtype).requires_grad_()
    c = torch.randn(1, seq, layer.out_proj.in_features, generator=g).to(device, dtype).requires_grad_()
    with torch.no_grad():
        grads = [torch.randn_like(o) for o in projection_group(layer, x, c)]
    variants, nocast = build_variants(names, layer, args.rank, shipped)
    all_params = [p for m in [layer, nocast, *(v[0] for v in variants.values() if v[0] is not None)]
                  for p in m.parameters()]
    steps, once = {}, {}
    for name, (_, fwd, params, _) in variants.items():
        steps[name] = lambda fwd=fwd, params=params: torch.autograd.grad(fwd(x, c), [x, c, *params], grads)
        steps[name]()  # compile / autotune outside the timed loops
        peak = measure.peak_bytes(steps[name]) if device.type == "cuda" else (None, None)  # CUDA only
        once[name] = {"peak_bytes": peak[0], "resident_bytes": peak[1],
                      "saved_activation_bytes": saved_bytes_excluding(lambda fwd=fwd: fwd(x, c), all_params)}
    rows = []
    for rep in range(args.repetitions):
        for name in measure.rotation(variants, rep):
            timed = time_call(steps[name], args)
            rows.append({"variant": name, "rep": rep, "seq": seq, "hidden": hidden, "rank": args.rank,
                         "dtype": str(dtype).removeprefix("torch."), "smoke": args.smoke,
                         "fwd_bwd_ms": timed.pop("ms"), **timed, **once[name], "config": variants[name][3]})
    measure.write_csv(rows, out / CSV)
    summary = summary_rows(rows)
    write_summary(summary, out / SUMMARY_CSV, args)
    if args.check_seq:
        check = layer_check(nocast, variants["fused"][0], hidden, args.check_seq, dtype, device)
        print("whole layer check:", check, flush=True)
        measure.write_csv([check], out / CHECK_CSV)
    plot(summary, rows, out, seq)
    print(f"{'variant':>26} {'fwd+bwd ms':>11} {'/ base':>7} {'peft /':>7} {'saved GiB':>10} {'peak GiB':>9}")
    for s in summary:
        peak = f"{s['peak_bytes'] / 2**30:9.2f}" if s["peak_bytes"] is not None else "        -"
        print(f"{s['variant']:>26} {s['fwd_bwd_ms']:11.3f} {s['time_vs_base']:7.3f} {s['speedup_vs_peft']:7.3f} "
              f"{s['saved_activation_bytes'] / 2**30:10.4f} {peak}")
    print(f"wrote {out / CSV} ({len(rows)} rows) in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()

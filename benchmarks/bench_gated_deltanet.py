"""Benchmark: the LoRA projections of one Qwen3.5 GatedDeltaNet layer (hidden 4096), forward + backward, bf16.

The group, as the layer uses it: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` read the
layer input X; ``out_proj`` reads the core's output C. LoRA r=16 (alpha 32) on all five. One step =
the five projections forward, then backward from fixed output gradients (dX, dC and the LoRA grads).
The delta-rule core itself is not timed (transformers' reference path here; see the notebook).

Variants (same layer weights, same X, C and output gradients):
  base         frozen projections (no LoRA)
  peft         PEFT default (fp32 adapters, input cast)
  peft_nocast  PEFT with bf16 adapters
  chained      chained-cuBLAS Function per projection
  fused        PEFT model (bf16 adapters) patched by lora_lab.kernels.patch_model (one shared-input op + fused
               out_proj), kernel switches as shipped (the group: cuBLAS GEMMs onto a Triton-written rank-r
               term, dA/dB on a side stream; out_proj: one Triton GEMM)
  fused_fp32_adapters  the same with PEFT's default fp32 adapters (A, B cast per call, never X)
  fused_triton_base    every big GEMM in Triton with the rank-r term in its K loop, no side stream
                       (LORA_LAB_BASE_GEMM=triton, LORA_LAB_OVERLAP=0); fused_triton_base_overlap with the stream
  fused_cublas_base    every big GEMM (out_proj too) by cuBLAS, no side stream; fused_cublas_base_overlap with it

Also: bytes saved for backward per layer (deduplicated by storage, parameters excluded) and a correctness
check of the whole patched layer (core included) against the unpatched PEFT layer at a shorter sequence.

    python benchmarks/bench_gated_deltanet.py --out outputs/gpu [--seq 32768] [--check-seq 2048]
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # lora_lab without installing
from bench_timing import environment_line, median_ms, out_dir, peak_bytes, set_kernel_switches, write_csv  # noqa: E402
from lora_lab.memory import saved_bytes_excluding  # noqa: E402
from lora_lab.layer import SingleChild, fill_lora_B  # noqa: E402

IN_PROJ = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]
TARGETS = IN_PROJ + ["out_proj"]
# kernel switches per variant of the patched layer (names without LORA_LAB_; the rest as shipped)
SWITCHES = {
    "fused_triton_base": {"BASE_GEMM": "triton", "OVERLAP": "0"},
    "fused_triton_base_overlap": {"BASE_GEMM": "triton", "OVERLAP": "1"},
    "fused_cublas_base": {"BASE_GEMM": "cublas", "OVERLAP": "0"},
    "fused_cublas_base_overlap": {"BASE_GEMM": "cublas", "OVERLAP": "1"},
}


def gated_deltanet(hidden: int, dtype, device):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    # Qwen3_5TextConfig's defaults are the hidden-4096 model: 16 key heads and 32 value heads of 128
    cfg = Qwen3_5TextConfig(hidden_size=hidden, num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(cfg, layer_idx=0)
    with torch.no_grad():
        for m in layer.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=hidden**-0.5)
    return layer.to(device=device, dtype=dtype)


def peft_wrap(layer, r, fp32_adapters):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)  # same A init in every wrapped copy
    model = get_peft_model(SingleChild(layer, "layer"), LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS),
                           autocast_adapter_dtype=fp32_adapters)
    torch.manual_seed(2)
    fill_lora_B(model, 0.02)
    if not fp32_adapters:
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.data = p.data.to(layer.out_proj.weight.dtype)
    return model


def projection_group(layer, x, c):
    """The five projections as the layer calls them: four of X, then out_proj of the core output."""
    outs = [getattr(layer, n)(x) for n in IN_PROJ]
    outs.append(layer.out_proj(c))
    return outs


def chained_group(layer, params, x, c):
    from lora_lab.kernels import chained_lora_linear

    outs = []
    for n in IN_PROJ:
        A, B = params[n]
        outs.append(chained_lora_linear(x, getattr(layer, n).weight, None, A, B, 2.0))
    A, B = params["out_proj"]
    outs.append(chained_lora_linear(c, layer.out_proj.weight, None, A, B, 2.0))
    return outs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--check-seq", type=int, default=2048, help="sequence for the whole-layer check (0: skip)")
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--variants", nargs="+", default=None,
                    help="measure only these variants (base and peft always; default: all)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gated_deltanet needs a CUDA GPU")
    from lora_lab.kernels import patch_model

    out = out_dir(args.out)
    print(environment_line(), flush=True)
    dtype, dev = torch.bfloat16, "cuda"
    layer = gated_deltanet(args.hidden, dtype, dev)
    for p in layer.parameters():
        p.requires_grad_(False)
    value_dim = layer.out_proj.in_features
    T = args.seq
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, T, args.hidden, device=dev, dtype=dtype, generator=g).requires_grad_()
    c = torch.randn(1, T, value_dim, device=dev, dtype=dtype, generator=g).requires_grad_()
    with torch.no_grad():
        grads = [torch.randn_like(o) for o in projection_group(layer, x, c)]

    peft_model = peft_wrap(copy.deepcopy(layer), args.rank, True)
    nocast_model = peft_wrap(copy.deepcopy(layer), args.rank, False)
    fused_model = copy.deepcopy(nocast_model)
    summary = patch_model(fused_model)
    print("patch_model:", summary, flush=True)
    fused32_model = peft_wrap(copy.deepcopy(layer), args.rank, True)  # PEFT's default fp32 adapters, patched
    patch_model(fused32_model)
    chained_params = {}
    for n in TARGETS:
        lin = getattr(nocast_model.base_model.model.layer, n)
        chained_params[n] = (lin.lora_A["default"].weight, lin.lora_B["default"].weight)

    variants = {
        "base": (lambda: projection_group(layer, x, c), []),
        "peft": (lambda: projection_group(peft_model.base_model.model.layer, x, c),
                 [p for p in peft_model.parameters() if p.requires_grad]),
        "peft_nocast": (lambda: projection_group(nocast_model.base_model.model.layer, x, c),
                        [p for p in nocast_model.parameters() if p.requires_grad]),
        "chained": (lambda: chained_group(layer, chained_params, x, c),
                    [p for pair in chained_params.values() for p in pair]),
        "fused": (lambda: projection_group(fused_model.base_model.model.layer, x, c),
                  [p for p in fused_model.parameters() if p.requires_grad]),
        "fused_fp32_adapters": (lambda: projection_group(fused32_model.base_model.model.layer, x, c),
                                [p for p in fused32_model.parameters() if p.requires_grad]),
    }
    # the same patched layer with other kernel switches (see SWITCHES)
    for name in SWITCHES:
        variants.setdefault(name, variants["fused"])
    if args.variants:  # a subset (the ratios need base and peft)
        keep = {"base", "peft", *args.variants}
        variants = {k: v for k, v in variants.items() if k in keep}
    all_params = [p for m in (layer, peft_model, nocast_model, fused_model, fused32_model) for p in m.parameters()]
    rows = []
    for name, (fwd, params) in variants.items():
        set_kernel_switches(**SWITCHES.get(name, {}))

        def step():
            torch.autograd.backward(fwd(), grads)

        step()
        t = median_ms(step, grad_to_none=[x, c] + params, warmup=args.warmup, rep=args.rep)
        for tns in [x, c] + params:
            tns.grad = None
        peak, before = peak_bytes(step)
        for tns in [x, c] + params:
            tns.grad = None
        saved = saved_bytes_excluding(fwd, all_params)
        set_kernel_switches()
        rows.append({"variant": name, "seq": T, "hidden": args.hidden, "rank": args.rank, "fwd_bwd_ms": round(t, 4),
                     "peak_bytes": peak, "resident_bytes": before, "saved_activation_bytes": saved})
        print(f"{name:12s} fwd+bwd {t:8.3f} ms  peak {peak / 2**30:6.2f} GiB  saved {saved / 2**30:6.3f} GiB",
              flush=True)
    base = rows[0]
    peft = rows[1]
    for r in rows:
        r["time_vs_base"] = round(r["fwd_bwd_ms"] / base["fwd_bwd_ms"], 4)
        r["speedup_vs_peft"] = round(peft["fwd_bwd_ms"] / r["fwd_bwd_ms"], 4)
        r["saved_bytes_less_than_peft"] = peft["saved_activation_bytes"] - r["saved_activation_bytes"]
        r["peak_bytes_less_than_peft"] = peft["peak_bytes"] - r["peak_bytes"]
    write_csv(rows, out / "05_gated_deltanet.csv")

    # the whole layer (core included), patched vs unpatched PEFT layer, at a shorter sequence
    if args.check_seq:
        xs = torch.randn(1, args.check_seq, args.hidden, device=dev, dtype=dtype, generator=g)
        xr, xf = xs.clone().requires_grad_(), xs.clone().requires_grad_()
        yr = nocast_model(xr)
        yf = fused_model(xf)
        gy = torch.randn_like(yr)
        yr.backward(gy)
        yf.backward(gy)

        def cos(a, b):
            return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()

        def rel(a, b):
            return ((a.double() - b.double()).norm() / b.double().norm()).item()

        names_r = dict(nocast_model.named_parameters())
        worst = max(rel(p.grad, names_r[n].grad) for n, p in fused_model.named_parameters() if p.grad is not None)
        check = [{"check_seq": args.check_seq, "layer_out_cosine": cos(yf, yr), "layer_dx_rel_l2": rel(xf.grad, xr.grad),
                  "layer_lora_grad_worst_rel_l2": worst}]
        print("whole layer check:", check[0], flush=True)
        write_csv(check, out / "05_gated_deltanet_layer_check.csv")
    plot(rows, out)
    print("wrote", out / "05_gated_deltanet.csv")


def plot(rows, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    names = [r["variant"] for r in rows]
    axes[0].bar(names, [r["fwd_bwd_ms"] for r in rows], color="tab:blue")
    axes[0].set_ylabel("fwd+bwd ms")
    axes[0].set_title(f"GatedDeltaNet projections, seq {rows[0]['seq']}")
    axes[1].bar(names, [r["saved_activation_bytes"] / 2**30 for r in rows], color="tab:orange")
    axes[1].set_ylabel("saved for backward (GiB)")
    axes[1].set_title("activation memory per layer")
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(out / "05_gated_deltanet.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()

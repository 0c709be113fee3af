"""Benchmark: a full LoRA training step (forward, loss, backward, AdamW) with PEFT vs the fused kernels.

Models (random init, bf16, sdpa attention), LoRA r=16 alpha=32 on every attention and MLP projection:
  qwen3-4096   Qwen3-shaped, hidden 4096, intermediate 12288, 32 heads / 8 KV heads of 128, vocab 151936,
               --layers layers (default 4)
  qwen2.5-0.5b the exact Qwen2.5-0.5B shape (lora_lab's random:qwen2.5-0.5b)

Variants, each starting from the same adapter weights with a fresh AdamW:
  peft              PEFT default (fp32 adapters, input cast)
  fused             the same model after lora_lab.kernels.patch_model (kernel switches as shipped)
  fused_overlap     patched, dA/dB reductions on a side CUDA stream everywhere (LORA_LAB_OVERLAP=1)
  fused_triton_base patched, every big GEMM in Triton, no side stream (LORA_LAB_BASE_GEMM=triton, OVERLAP=0)
  peft_nocast       PEFT with bf16 adapters
  fused_bf16        bf16 adapters, patched

Writes <out>/05_train_step.csv (tokens/s, peak memory, the first losses of each variant) and a plot.

    python benchmarks/bench_lora_train_step.py --out outputs/gpu [--models qwen3-4096 qwen2.5-0.5b]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # lora_lab without installing
from bench_timing import environment_line, out_dir, set_kernel_switches, write_csv  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# kernel switches per patched variant (names without LORA_LAB_; the rest as shipped)
SWITCHES = {"fused_overlap": {"OVERLAP": "1"}, "fused_triton_base": {"BASE_GEMM": "triton", "OVERLAP": "0"}}


def build_model(name: str, layers: int):
    from transformers import AutoModelForCausalLM

    if name == "qwen3-4096":
        from transformers import Qwen3Config

        cfg = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                          max_position_embeddings=32768, tie_word_embeddings=False, use_cache=False)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
        return model
    if name == "qwen2.5-0.5b":
        import lora_lab

        return lora_lab.load_model("random:qwen2.5-0.5b", dtype=torch.bfloat16, device="cuda",
                                   attn_implementation="sdpa")
    raise SystemExit(f"unknown model {name!r}")


def run_variant(model, ids, steps, warmup):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    model.train()
    times, losses = [], []
    peak = 0
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        torch.cuda.synchronize()
        losses.append(loss.item())
        if i >= warmup:
            times.append(start.elapsed_time(end))
            peak = max(peak, torch.cuda.max_memory_allocated())
    del opt
    return statistics.median(times), peak, losses


def bench_model(name, layers, batch, seq, steps, warmup, variants=None):
    from peft import LoraConfig, get_peft_model

    from lora_lab.kernels import patch_model, unpatch_model
    from lora_lab.layer import fill_lora_B

    base = build_model(name, layers)
    torch.manual_seed(1)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0))
    fill_lora_B(model, 0.02)
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda", generator=g)
    rows = []

    def reset(dtype):
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in init:
                    p.data = init[n].to(dtype).clone()

    all_variants = [("peft", torch.float32, False), ("fused", torch.float32, True),
                    ("fused_overlap", torch.float32, True), ("fused_triton_base", torch.float32, True),
                    ("peft_nocast", torch.bfloat16, False), ("fused_bf16", torch.bfloat16, True)]
    keep = {"peft", "peft_nocast", *(variants or [v for v, _, _ in all_variants])}  # ratios need both PEFTs
    for variant, dtype, patched in [v for v in all_variants if v[0] in keep]:
        reset(dtype)
        set_kernel_switches(**SWITCHES.get(variant, {}))
        if patched:
            patch_model(model)
        gc.collect()
        torch.cuda.empty_cache()
        ms, peak, losses = run_variant(model, ids, steps, warmup)
        if patched:
            unpatch_model(model)
        set_kernel_switches()
        tokens = batch * seq
        rows.append({"model": name, "layers": model.config.num_hidden_layers, "variant": variant, "batch": batch,
                     "seq": seq, "step_ms": round(ms, 3), "tokens_per_s": round(tokens / ms * 1e3, 1),
                     "peak_bytes": peak, "adapter_dtype": str(dtype),
                     "losses": " ".join(f"{v:.5f}" for v in losses[:5])})
        print(f"{name} {variant:12s} step {ms:8.2f} ms  {tokens / ms * 1e3:10.0f} tok/s  "
              f"peak {peak / 2**30:6.2f} GiB  losses {rows[-1]['losses']}", flush=True)
    peft = rows[0]
    nocast = next(r for r in rows if r["variant"] == "peft_nocast")
    for r in rows:
        ref = nocast if r["adapter_dtype"] == "torch.bfloat16" else peft
        r["tokens_per_s_vs_peft"] = round(r["tokens_per_s"] / peft["tokens_per_s"], 4)
        r["peak_vs_peft"] = round(r["peak_bytes"] / peft["peak_bytes"], 4)
        lr = [float(v) for v in ref["losses"].split()]
        lf = [float(v) for v in r["losses"].split()]
        r["max_loss_rel_diff_vs_same_dtype_peft"] = round(max(abs(a - b) / abs(a) for a, b in zip(lr, lf)), 6)
    del model, base
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def plot(rows, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.8), squeeze=False)
    for ax, m in zip(axes[0], models):
        rs = [r for r in rows if r["model"] == m]
        ax.bar([r["variant"] for r in rs], [r["tokens_per_s"] / 1e3 for r in rs])
        ax.set_ylabel("k tokens / s")
        ax.set_title(f"{m}: LoRA training step")
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(out / "05_train_step.png", dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", nargs="+", default=["qwen3-4096", "qwen2.5-0.5b"])
    ap.add_argument("--layers", type=int, default=4, help="layers of the qwen3-4096 model")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=None,
                    help="measure only these variants (peft and peft_nocast always; default: all)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_lora_train_step needs a CUDA GPU")
    out = out_dir(args.out)
    print(environment_line(), flush=True)
    rows = []
    for m in args.models:
        rows += bench_model(m, args.layers, args.batch, args.seq, args.steps, args.warmup, args.variants)
        write_csv(rows, out / "05_train_step.csv")
    plot(rows, out)
    print("wrote", out / "05_train_step.csv")


if __name__ == "__main__":
    main()

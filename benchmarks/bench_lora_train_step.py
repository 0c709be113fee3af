"""Benchmark: a full LoRA training step (forward, loss, backward, AdamW) with PEFT and with the fused kernels.

Whether the per-projection gains survive in a whole step, where the LM head, the loss, attention and the
optimizer take their share. Models (random init, bf16, sdpa attention), LoRA r=16 alpha=32 on every attention and
MLP projection, batch 4 × 2048 tokens:
  qwen3-4096    Qwen3-shaped, hidden 4096, intermediate 12288, 32 heads / 8 KV heads of 128, vocab 151936,
                --layers layers (default 4)
  qwen2.5-0.5b  the Qwen2.5-0.5B shape (lora_lab's random:qwen2.5-0.5b)

Variants (default: peft, fused; ``--variants all``), each from the same adapter weights with a fresh AdamW:
  peft               PEFT default (fp32 adapters, input cast)
  fused              the same model after lora_lab.kernels.patch_model, shipped KernelConfig
  fused_overlap      patched, KernelConfig(overlap="on"): dA/dB on a side CUDA stream everywhere
  fused_triton_base  patched, KernelConfig(base_gemm="triton", overlap="off")
  fused_merged       patched, KernelConfig(base_gemm="merged"): every big GEMM on W + s·B A, merged per call
  peft_nocast        PEFT with bf16 adapters;  fused_bf16: bf16 adapters, patched

Repetitions: ``--repetitions N`` side-by-side loops per model. In each, every variant (order rotating) gets its
adapters reset, a fresh optimizer, one untimed warm-up step, then ``--steps`` whole optimizer steps in the user's loop
(``measure.loop_ms``: CUDA events around each step, synchronised after it, so host time counts); its tokens/s is the
median step's. Peak memory (``measure.peak_bytes`` of one more
untimed step) is measured in the first repetition.

Under a GPU memory cap (``$LORA_LAB_MEMORY_CAP_GIB``, the capped gpu profiles) a model whose step lora_lab's byte model
says cannot fit is not run (its rows: status ``skipped``, with the estimate), and one that runs out of memory anyway
gets ``oom`` rows; neither is shrunk (a smaller batch changes the head's and the loss's share of the step, which is
what the comparison is about).

Writes into --out: 05_train_step.csv (one row per model, variant and repetition), 05_train_step_summary.csv and
05_train_step.png.

    python benchmarks/bench_lora_train_step.py --out DIR [--models qwen3-4096 qwen2.5-0.5b] [--variants all]
    TRITON_INTERPRET=1 python benchmarks/bench_lora_train_step.py --out DIR --smoke
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import torch
from bench_common import (
    add_common_arguments,
    check_device,
    chosen_variants,
    device_line,
    error_text,
    is_oom,
    repetition_dots,
    write_summary,
)

from lora_lab.lab import measure
from lora_lab.memory import budget

CSV, SUMMARY_CSV = "05_train_step.csv", "05_train_step_summary.csv"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODELS = ["qwen3-4096", "qwen2.5-0.5b"]
# name: (adapters in bf16?, KernelConfig fields changed from the shipped settings, or None: not patched)
VARIANTS = {
    "peft": (False, None),
    "fused": (False, {}),
    "fused_overlap": (False, {"overlap": "on"}),
    "fused_triton_base": (False, {"base_gemm": "triton", "overlap": "off"}),
    "fused_merged": (False, {"base_gemm": "merged"}),
    "peft_nocast": (True, None),
    "fused_bf16": (True, {}),
}
DEFAULT_VARIANTS = ["peft", "fused"]


def build_model(name: str, layers: int, device, dtype, smoke: bool):
    """The model behind ``name``; with ``smoke`` a tiny stand-in of the same family (the label stays)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    import lora_lab

    if name == "qwen2.5-0.5b":
        spec = "random:tiny-qwen2" if smoke else "random:qwen2.5-0.5b"
        return lora_lab.load_model(spec, dtype=dtype, device=device, attn_implementation="sdpa")
    if name != "qwen3-4096":
        raise SystemExit(f"unknown model {name!r} (known: {' '.join(MODELS)})")
    sizes = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936)
    if smoke:
        sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, vocab_size=128)
    cfg = Qwen3Config(**sizes, max_position_embeddings=32768, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")


def estimated_peak_bytes(config, batch: int, seq: int) -> int:
    """Peak bytes of one training step of the model with ``config`` (its own loss, LoRA r=16 on TARGETS, fp32
    adapters, bf16, flash attention), from lora_lab's byte model (``lora_lab.memory.byte_model``): an estimate."""
    from lora_lab.memory.byte_model import ModelShape, TrainingSetup, analytic_memory

    setup = TrainingSetup(batch, seq, "bf16", "lora", lora_r=16, lora_targets=tuple(TARGETS), attention="flash",
                          loss="standard")
    return analytic_memory(ModelShape.from_config(config), setup).peak


def over_memory_cap(name: str, config, args, device) -> str | None:
    """Under a GPU memory cap on CUDA: why model ``name`` is skipped when :func:`estimated_peak_bytes` does not fit
    the cap, else None (and None without a cap, or off CUDA)."""
    if budget.memory_cap_gib() is None or device.type != "cuda":
        return None
    peak = estimated_peak_bytes(config, args.batch, args.seq)
    decision = budget.skip_or_shrink(name, [f"batch {args.batch} x {args.seq}"], lambda _: peak, device=device)
    return f"{decision.reason} (lora_lab's byte model)" if decision.skipped else None


def not_run_rows(name: str, args, status: str, reason: str) -> list[dict]:
    """One row per variant and repetition of a model that did not run: ``status`` (skipped, oom) and why."""
    return [{"model": name, "variant": variant, "rep": rep, "batch": args.batch, "seq": args.seq,
             "smoke": args.smoke, "status": status, "error": reason}
            for rep in range(args.repetitions) for variant in args.variants]


def run_variant(model, ids, steps: int, measure_peak: bool):
    """(step milliseconds, losses, peak bytes or None): ``measure.training_step_ms`` with the model's own loss."""
    return measure.training_step_ms(model, lambda m: m(input_ids=ids, labels=ids).loss, steps,
                                    measure_peak=measure_peak)


def bench_model(name, args, shipped, device, dtype):
    """Rows of one model: every variant once per repetition, order rotating."""
    from peft import LoraConfig, get_peft_model

    from lora_lab.kernels import patch_model, unpatch_model
    from lora_lab.layer import fill_lora_B

    base = build_model(name, args.layers, device, dtype, args.smoke)
    skip = over_memory_cap(name, base.config, args, device)
    if skip is not None:
        print(f"   {name}: {skip}", flush=True)
        return not_run_rows(name, args, "skipped", skip)
    torch.manual_seed(1)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0))
    fill_lora_B(model, 0.02)
    model.train()
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g).to(device)
    tokens = args.batch * args.seq
    peaks, rows = {}, []
    for rep in range(args.repetitions):
        for variant in measure.rotation(args.variants, rep):
            bf16_adapters, changes = VARIANTS[variant]
            adapter_dtype = dtype if bf16_adapters else torch.float32
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n in init:
                        p.data = init[n].to(adapter_dtype).clone()
            cfg = None if changes is None else shipped.replace(**changes)
            if cfg is not None:
                patch_model(model, config=cfg)
            # peak memory once per variant, CUDA only (None in CPU smoke runs)
            times, losses, peak = run_variant(model, ids, args.steps, device.type == "cuda" and variant not in peaks)
            peaks.setdefault(variant, peak)
            if cfg is not None:
                unpatch_model(model)
            ms = statistics.median(times)
            rows.append({"model": name, "layers": model.config.num_hidden_layers, "variant": variant, "rep": rep,
                         "status": "ok", "batch": args.batch, "seq": args.seq, "smoke": args.smoke, "step_ms": ms,
                         "step_ms_each": " ".join(f"{t:.3f}" for t in times), "tokens_per_s": tokens / ms * 1e3,
                         "peak_bytes": peaks[variant], "adapter_dtype": str(adapter_dtype).removeprefix("torch."),
                         "losses": " ".join(f"{v:.5f}" for v in losses), "config": "" if cfg is None else repr(cfg)})
    return rows


def summary_rows(rows):
    """One row per (model, variant): median tokens/s, the per-repetition ratio to PEFT, peak and loss agreement
    with the PEFT variant of the same adapter dtype (first repetition)."""
    out = []
    for model, variant in dict.fromkeys((r["model"], r["variant"]) for r in rows):
        mine = [r for r in rows if r["model"] == model and r["variant"] == variant]
        first = mine[0]
        tps = measure.summarize(r["tokens_per_s"] for r in mine)
        vs = measure.summarize(measure.repetition_ratios(rows, "tokens_per_s", {"model": model, "variant": variant},
                                                         {"model": model, "variant": "peft"}))
        peft = next(r for r in rows if r["model"] == model and r["variant"] == "peft")
        same = next((r for r in rows if r["model"] == model and r["variant"] in ("peft", "peft_nocast")
                     and r["adapter_dtype"] == first["adapter_dtype"]), None)
        loss_diff = None
        if same is not None:
            pairs = zip(str(same["losses"]).split(), str(first["losses"]).split())
            loss_diff = max(abs(float(a) - float(b)) / abs(float(a)) for a, b in pairs)
        out.append({"model": model, "variant": variant, "tokens_per_s": tps["median"],
                    "tokens_per_s_ci95_low": tps["ci95"][0], "tokens_per_s_ci95_high": tps["ci95"][1], "n": tps["n"],
                    "tokens_per_s_vs_peft": vs["median"], "peak_bytes": first["peak_bytes"],
                    "peak_vs_peft": None if first["peak_bytes"] is None else first["peak_bytes"] / peft["peak_bytes"],
                    "adapter_dtype": first["adapter_dtype"], "max_loss_rel_diff_vs_same_dtype_peft": loss_diff})
    return out


def plot(summary, rows, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(s["model"] for s in summary))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.8), squeeze=False)
    for ax, m in zip(axes[0], models):
        mine = [s for s in summary if s["model"] == m]
        ax.bar([s["variant"] for s in mine], [s["tokens_per_s"] / 1e3 for s in mine], alpha=0.8)
        for i, s in enumerate(mine):
            repetition_dots(ax, i, [r["tokens_per_s"] / 1e3 for r in rows
                                    if r["model"] == m and r["variant"] == s["variant"]])
        ax.set_ylabel("k tokens / s (bars: median, dots: repetitions)")
        ax.set_title(f"{m}: LoRA training step")
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(out / "05_train_step.png", dpi=120)
    plt.close(fig)


def main(argv=None):
    start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(ap, list(VARIANTS), DEFAULT_VARIANTS,
                         "the whole code path on tiny stand-ins of the models, fp32, batch 2 x 16, one timed step")
    ap.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    ap.add_argument("--layers", type=int, default=4, help="layers of the qwen3-4096 model")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant and repetition (after one warm-up)")
    args = ap.parse_args(argv)
    args.variants = chosen_variants(ap, args, list(VARIANTS), DEFAULT_VARIANTS)
    device = check_device(args.smoke)
    if args.smoke:
        args.batch, args.seq, args.steps = 2, 16, 1
    from lora_lab.kernels import KernelConfig

    shipped = KernelConfig.from_env()
    dtype = torch.float32 if args.smoke else torch.bfloat16
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(device_line(device, dtype, args.repetitions, f"batch {args.batch} x {args.seq}, {args.steps} timed steps, "
                      f"variants {' '.join(args.variants)}, shipped {shipped}"), flush=True)
    rows = []
    for name in args.models:
        t0 = time.perf_counter()
        failure = None
        try:
            rows += bench_model(name, args, shipped, device, dtype)
        except Exception as err:  # under a memory cap an OOM is a recorded result (on the whole card: a crash)
            if budget.memory_cap_gib() is None or not is_oom(err):
                raise
            failure = error_text(err)
        if failure is not None:  # outside the except block: the traceback's frames (and tensors) are gone
            print(f"   {name}: out of memory under the memory cap: {failure[:200]}", flush=True)
            rows += not_run_rows(name, args, "oom", failure)
        gc.collect()  # the model goes before the next one is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
        measure.write_csv(rows, out / CSV)
        print(f"{name}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    ran = [r for r in rows if r["status"] == "ok"]
    summary = summary_rows(ran)
    write_summary(summary, out / SUMMARY_CSV, args)
    if summary:
        plot(summary, ran, out)
    for r in {(r["model"], r["status"], r["error"]): r for r in rows if r["status"] != "ok"}.values():
        print(f"{r['model']}: {r['status']}: {r['error'][:200]}", flush=True)
    print(f"{'model':>13} {'variant':>18} {'tokens/s':>10} {'/ peft':>7} {'peak/peft':>9} {'loss diff':>9}")
    for s in summary:
        peak = f"{s['peak_vs_peft']:9.3f}" if s["peak_vs_peft"] is not None else "        -"
        loss = f"{s['max_loss_rel_diff_vs_same_dtype_peft']:9.2e}" \
            if s["max_loss_rel_diff_vs_same_dtype_peft"] is not None else "        -"
        print(f"{s['model']:>13} {s['variant']:>18} {s['tokens_per_s']:10.0f} {s['tokens_per_s_vs_peft']:7.3f} "
              f"{peak} {loss}")
    print(f"wrote {out / CSV} ({len(rows)} rows) in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()

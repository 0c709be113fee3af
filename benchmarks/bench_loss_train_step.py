"""Benchmark: a whole LoRA training step of the Qwen2.5-0.5B shape with each loss: standard, chunked, fused, Liger's.

What the loss block's savings (``bench_loss.py``) are worth in a step, where the decoder, the recomputation of
gradient checkpointing and the optimizer take their share. Model: lora_lab's ``random:qwen2.5-0.5b`` (random init,
bf16, sdpa attention; tied embeddings, so the head is the frozen embedding matrix), LoRA r=16 alpha=32 on every
attention and MLP projection (``--rank``, ``--targets``; notebook 04 measured r=8 on q_proj, v_proj), gradient
checkpointing (non-reentrant, transformers' default), AdamW (lr 1e-4) on the adapters, batch 4 x 4096 random token
ids, labels = the ids (shifted inside the loss).

Variants (default: standard, chunked, fused, peft_liger; ``--variants all`` adds the others):
  standard       lora_lab.add_lora (its default since #25: fp32 adapters on a bf16 model);
                 causal_lm_loss(chunked=False) = model(ids, labels=ids).loss:
                 transformers' loss over all [tokens x vocab] logits
  chunked        lora_lab.add_lora; causal_lm_loss(chunked=True): lora_lab.loss.chunked_cross_entropy
  fused          lora_lab.add_lora; causal_lm_loss(fused=True): lora_lab.kernels.loss.linear_cross_entropy (its
                 dispatch rule picks the path)
  fused_fwdgrad  the same with LORA_LAB_LOSS_IMPL=fwdgrad (gradients in forward, cuBLAS GEMMs) forced
  fused_recompute  the same with LORA_LAB_LOSS_IMPL=recompute (the Triton kernels that recompute the logits)
  peft_liger     PEFT LoRA, same targets, PEFT's defaults (fp32 adapters, inputs cast to them); the decoder body's
                 hidden states, the head weight and the shifted labels into
                 liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss() (defaults)
  peft_standard  PEFT LoRA with the standard loss: PEFT's adapter layers alone, to tell them apart from Liger's loss
Every variant starts from the same adapter weights (A ~ U(±1/sqrt(in)), PEFT's init; B ~ N(0, 0.02²), so every
gradient is non-zero), drawn once in bf16 from a seeded generator (PEFT holds them in fp32: the same values). Both
families run with the input-require-grads hook that transformers' gradient_checkpointing_enable and PEFT install.
peft_standard against standard is the cost of PEFT's adapters, peft_liger against peft_standard that of the loss.

Repetitions: ``--repetitions N`` side-by-side loops; in each, every variant (order rotating) gets its adapters
attached, a fresh AdamW, one untimed warm-up step (compile / autotune the first time), in the first repetition one
more untimed step for peak memory (``measure.peak_bytes``: the whole step's peak, weights included), then
``--steps`` steps timed by CUDA events (``measure.event_ms``); its tokens/s is the median step's. A variant that
runs out of memory is a row with status "oom"; one that cannot run here (not installed, needs CUDA) is "skipped".

Writes into --out: 07_train_step.csv (one row per variant and repetition), 07_train_step_summary.csv (median
tokens/s and its interval, the per-repetition ratio to standard, peak, losses against standard's) and
07_train_step.png.

    python benchmarks/bench_loss_train_step.py --out DIR [--variants all] [--batch 4] [--seq 4096]
    TRITON_INTERPRET=1 python benchmarks/bench_loss_train_step.py --out DIR --smoke
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import time
import traceback
from importlib import metadata
from pathlib import Path

import torch
from bench_common import (
    add_common_arguments,
    check_device,
    chosen_variants,
    device_line,
    failed_cell,
    repetition_dots,
    write_summary,
)

from lora_lab.lab import measure

CSV, SUMMARY_CSV, PNG = "07_train_step.csv", "07_train_step_summary.csv", "07_train_step.png"
GIB = 2**30
MODEL = "qwen2.5-0.5b"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, B_STD = 16, 0.02  # alpha = 2 x rank
# name: (adapter implementation, loss)
VARIANTS = {
    "standard": ("lora_lab", "standard"),
    "chunked": ("lora_lab", "chunked"),
    "fused": ("lora_lab", "fused"),
    "fused_fwdgrad": ("lora_lab", "fused_fwdgrad"),
    "fused_recompute": ("lora_lab", "fused_recompute"),
    "peft_liger": ("peft", "liger"),
    "peft_standard": ("peft", "standard"),
}
DEFAULT_VARIANTS = ["standard", "chunked", "fused", "peft_liger"]
LOSS_IMPL = {
    "standard": "causal_lm_loss(chunked=False): model(ids, labels=ids).loss",
    "chunked": "causal_lm_loss(chunked=True): chunked_cross_entropy",
    "fused": "causal_lm_loss(fused=True): lora_lab.kernels.loss.linear_cross_entropy",
    "fused_fwdgrad": "causal_lm_loss(fused=True) with LORA_LAB_LOSS_IMPL=fwdgrad",
    "fused_recompute": "causal_lm_loss(fused=True) with LORA_LAB_LOSS_IMPL=recompute",
    "liger": "LigerFusedLinearCrossEntropyLoss()(head.weight, body hidden states, shift_labels(ids))",
}


class Unavailable(Exception):
    """A variant that cannot run here: its rows are recorded as skipped, with the reason."""


def check_available(variant: str, device: torch.device) -> str:
    """The versions the variant runs on, or raises Unavailable."""
    family, loss = VARIANTS[variant]
    versions = []
    if family == "peft":
        try:
            versions.append(f"peft {metadata.version('peft')}")
        except metadata.PackageNotFoundError:
            raise Unavailable("peft is not installed") from None
    if loss.startswith("fused"):
        import inspect

        from lora_lab.loss import causal_lm_loss

        if "fused" not in inspect.signature(causal_lm_loss).parameters:
            raise Unavailable("lora_lab.loss.causal_lm_loss has no fused= keyword yet")
        try:
            import lora_lab.kernels.loss  # noqa: F401 - only whether it imports
        except ImportError as exc:
            raise Unavailable(f"lora_lab.kernels.loss is not importable ({exc})") from None
    if loss == "liger":
        if device.type != "cuda":
            raise Unavailable("Liger's kernels need CUDA (smoke run on the CPU)")
        try:
            versions.append(f"liger-kernel {metadata.version('liger-kernel')}")
            import liger_kernel.transformers  # noqa: F401 - only whether it imports
        except (ImportError, metadata.PackageNotFoundError) as exc:
            raise Unavailable(f"liger-kernel is not installed ({exc})") from None
    return ", ".join(versions)


def adapter_init(model, rank: int, targets, device, dtype, seed: int = 0) -> dict:
    """{target module name: (A [r, in], B [out, r])}: the adapter weights every variant starts from."""
    from lora_lab.layer import find_target_linears

    g = torch.Generator(device="cpu").manual_seed(seed)
    init = {}
    for name, linear in find_target_linears(model, targets):
        bound = 1.0 / math.sqrt(linear.in_features)  # PEFT's (and lora_lab's) Kaiming-uniform bound, a = sqrt(5)
        a = (torch.rand(rank, linear.in_features, generator=g) * 2 - 1) * bound
        b = torch.randn(linear.out_features, rank, generator=g) * B_STD
        init[name] = (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
    return init


def attach(model, family: str, init: dict, rank: int, targets):
    """(the model to train, a call that detaches the adapters again): LoRA on ``model`` from ``init``."""
    with torch.no_grad():
        if family == "lora_lab":
            from lora_lab.layer import add_lora, remove_lora

            add_lora(model, r=rank, alpha=2 * rank, targets=targets)
            for name, (a, b) in init.items():
                layer = model.get_submodule(name)
                layer.lora_A.copy_(a)
                layer.lora_B.copy_(b)
            return model, lambda: remove_lora(model)
        from peft import LoraConfig, get_peft_model

        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                                      lora_dropout=0.0))  # PEFT's default: fp32 adapters
        for name, (a, b) in init.items():
            layer = model.get_submodule(name)
            layer.lora_A["default"].weight.copy_(a)
            layer.lora_B["default"].weight.copy_(b)
        return peft_model, peft_model.unload


def loss_function(loss: str):
    """``fn(model, ids) -> scalar loss`` for a loss name."""
    from lora_lab.loss import causal_lm_loss, shift_labels

    if loss == "standard":
        return lambda model, ids: causal_lm_loss(model, ids, chunked=False)
    if loss == "chunked":
        return lambda model, ids: causal_lm_loss(model, ids, chunked=True)
    if loss == "fused":
        return lambda model, ids: causal_lm_loss(model, ids, fused=True)
    if loss.startswith("fused_"):
        from lora_lab.kernels.loss.linear_ce import IMPL_ENV

        impl = loss.removeprefix("fused_")

        def forced(model, ids):
            before = os.environ.get(IMPL_ENV)
            os.environ[IMPL_ENV] = impl  # read by linear_cross_entropy's dispatch at each call
            try:
                return causal_lm_loss(model, ids, fused=True)
            finally:
                if before is None:
                    os.environ.pop(IMPL_ENV, None)
                else:
                    os.environ[IMPL_ENV] = before

        return forced
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    liger = LigerFusedLinearCrossEntropyLoss()

    def liger_loss(peft_model, ids):
        lm = peft_model.get_base_model()
        body = getattr(lm, lm.base_model_prefix)
        hidden = body(input_ids=ids, use_cache=False).last_hidden_state
        head = lm.get_output_embeddings().weight
        return liger(head, hidden.reshape(-1, hidden.shape[-1]), shift_labels(ids).reshape(-1))

    return liger_loss


def run_variant(model, loss_fn, ids, steps: int, measure_peak: bool):
    """(step milliseconds, losses, peak bytes or None) of ``steps`` steps: ``measure.training_step_ms``."""
    return measure.training_step_ms(model, lambda m: loss_fn(m, ids), steps, measure_peak=measure_peak)


def bench(args, variants, available, device, dtype):
    """Rows: every variant once per repetition, order rotating."""
    import lora_lab

    spec = "random:tiny-qwen2" if args.smoke else f"random:{MODEL}"
    model = lora_lab.load_model(spec, dtype=dtype, device=device, attn_implementation="sdpa")
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    init = adapter_init(model, args.rank, args.targets, device, dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=g).to(device)
    tokens = args.batch * args.seq
    first, rows = {}, []
    for rep in range(args.repetitions):
        line = []
        for variant in measure.rotation(variants, rep):
            family, loss = VARIANTS[variant]
            row = {"model": MODEL, "variant": variant, "rep": rep, "status": "ok", "batch": args.batch,
                   "seq": args.seq, "tokens": tokens, "step_ms": None, "step_ms_each": "", "tokens_per_s": None,
                   "peak_bytes": None, "peak_gib": None, "losses": "", "adapters": family, "rank": args.rank,
                   "targets": " ".join(args.targets), "adapter_dtype": "", "loss_impl": LOSS_IMPL[loss],
                   "versions": "", "smoke": args.smoke, "note": ""}
            if isinstance(available[variant], Unavailable):
                row.update(status="skipped", note=str(available[variant]))
                rows.append(row)
                continue
            row["versions"] = available[variant]
            if variant in first and first[variant]["status"] != "ok":  # out of memory or failed before
                row.update(status=first[variant]["status"], note=first[variant]["note"])
                rows.append(row)
                continue
            failure = result = None
            trained, detach = attach(model, family, init, args.rank, args.targets)
            row["adapter_dtype"] = " ".join(sorted({str(p.dtype).removeprefix("torch.")
                                                    for p in trained.parameters() if p.requires_grad}))
            try:
                result = run_variant(trained, loss_function(loss), ids, args.steps,
                                     device.type == "cuda" and variant not in first)
            except Exception as exc:  # noqa: BLE001 - a failing variant is a recorded result, not a crash
                failure = failed_cell(exc)
                if failure[0] == "error":
                    traceback.print_exc()
            # outside the except block: the traceback's frames (and the tensors they hold) are gone
            model.zero_grad(set_to_none=True)
            detach()
            trained = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if failure is not None:
                first[variant] = {"status": failure[0], "note": f"{failure[1]} (rep {rep}; not retried)"}
                row.update(status=failure[0], note=first[variant]["note"])
                rows.append(row)
                line.append(f"{variant} {failure[0]}")
                continue
            times, losses, peak = result
            first.setdefault(variant, {"status": "ok", "peak": peak})
            ms = statistics.median(times)
            peak = first[variant]["peak"]
            row.update(step_ms=ms, step_ms_each=" ".join(f"{t:.3f}" for t in times), tokens_per_s=tokens / ms * 1e3,
                       peak_bytes=peak, peak_gib=None if peak is None else peak / GIB,
                       losses=" ".join(f"{v:.6f}" for v in losses))
            rows.append(row)
            line.append(f"{variant} {ms:.1f}")
        print(f"  rep {rep}: " + ", ".join(line) + " (ms per step)", flush=True)
    return rows


def summary_rows(rows):
    """One row per variant: median tokens/s and its interval, the per-repetition ratio to standard, peak and its
    ratio to standard's, and the losses' largest relative difference from standard's (first repetition: the same
    adapters, the same data, step by step)."""
    out = []
    standard = [r for r in rows if r["variant"] == "standard" and r["status"] == "ok"]
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        ran = [r for r in mine if r["status"] == "ok"]
        row = {"model": mine[0]["model"], "variant": variant, "status": mine[0]["status"], "note": mine[0]["note"],
               "tokens": mine[0]["tokens"], "adapters": mine[0]["adapters"],
               "adapter_dtype": (ran[0] if ran else mine[0])["adapter_dtype"], "loss_impl": mine[0]["loss_impl"],
               "versions": mine[0]["versions"]}
        if ran:
            tps = measure.summarize(r["tokens_per_s"] for r in ran)
            row.update({"tokens_per_s": tps["median"], "tokens_per_s_ci95_low": tps["ci95"][0],
                        "tokens_per_s_ci95_high": tps["ci95"][1], "n": tps["n"],
                        "step_ms": statistics.median(r["step_ms"] for r in ran),
                        "peak_gib": ran[0]["peak_gib"]})
            if standard:
                try:
                    vs = measure.summarize(measure.repetition_ratios(rows, "tokens_per_s", {"variant": variant},
                                                                     {"variant": "standard"}))
                    row.update(tokens_per_s_vs_standard=vs["median"], tokens_per_s_vs_standard_ci95_low=vs["ci95"][0],
                               tokens_per_s_vs_standard_ci95_high=vs["ci95"][1])
                except ValueError:  # not measured in the same repetitions
                    pass
                base = standard[0]
                if ran[0]["peak_bytes"] is not None and base["peak_bytes"] is not None:
                    row["peak_vs_standard"] = ran[0]["peak_bytes"] / base["peak_bytes"]
                pairs = list(zip(str(base["losses"]).split(), str(ran[0]["losses"]).split()))
                row["first_loss_rel_diff_vs_standard"] = abs(float(pairs[0][1]) - float(pairs[0][0])) / float(
                    pairs[0][0])
                row["max_loss_rel_diff_vs_standard"] = max(abs(float(b) - float(a)) / abs(float(a)) for a, b in pairs)
        out.append(row)
    return out


def plot(summary, rows, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [s for s in summary if s["status"] == "ok"]
    fig, (ax_speed, ax_peak) = plt.subplots(1, 2, figsize=(11, 4))
    names = [s["variant"] for s in ran]
    ax_speed.bar(names, [s["tokens_per_s"] / 1e3 for s in ran], alpha=0.8)
    for i, s in enumerate(ran):
        repetition_dots(ax_speed, i, [r["tokens_per_s"] / 1e3 for r in rows
                                      if r["variant"] == s["variant"] and r["status"] == "ok"])
    ax_speed.set_ylabel("k tokens / s (bars: median, dots: repetitions)")
    ax_speed.set_title(f"{MODEL}: LoRA step, {ran[0]['tokens'] if ran else 0} tokens" if ran else MODEL)
    peaks = [s.get("peak_gib") for s in ran]
    ax_peak.bar(names, [p or 0 for p in peaks], alpha=0.8, color="C1")
    for i, p in enumerate(peaks):
        ax_peak.text(i, p or 0, "-" if p is None else f"{p:.1f}", ha="center", va="bottom", fontsize=8)
    ax_peak.set_ylabel("peak GiB (whole step, weights included)")
    ax_peak.set_title("peak memory")
    for ax in (ax_speed, ax_peak):
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(out / PNG, dpi=120)
    plt.close(fig)


def main(argv=None):
    start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(ap, list(VARIANTS), DEFAULT_VARIANTS,
                         "the whole code path on lora_lab's random:tiny-qwen2, fp32, batch 2 x 16, one timed step; "
                         "Liger skipped on a CPU")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant and repetition (after one warm-up)")
    ap.add_argument("--rank", type=int, default=RANK, help="LoRA rank r (alpha = 2r; default %(default)s)")
    ap.add_argument("--targets", nargs="+", default=list(TARGETS), help="LoRA target projections (default: all)")
    args = ap.parse_args(argv)
    variants = chosen_variants(ap, args, list(VARIANTS), DEFAULT_VARIANTS)
    device = check_device(args.smoke)
    if args.smoke:
        args.batch, args.seq, args.steps = 2, 16, 1
    dtype = torch.float32 if args.smoke else torch.bfloat16
    available = {}
    for variant in variants:
        try:
            available[variant] = check_available(variant, device)
        except Unavailable as exc:
            available[variant] = exc
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(device_line(device, dtype, args.repetitions, f"batch {args.batch} x {args.seq}, {args.steps} timed steps, "
                      f"variants {' '.join(variants)}"), flush=True)
    for variant in variants:
        if isinstance(available[variant], Unavailable):
            print(f"  {variant}: skipped: {available[variant]}", flush=True)
    rows = bench(args, variants, available, device, dtype)
    measure.write_csv(rows, out / CSV)
    summary = summary_rows(rows)
    write_summary(summary, out / SUMMARY_CSV, args)
    plot(summary, rows, out)
    print(f"{'variant':>14} {'tokens/s':>10} {'/ standard':>10} {'peak GiB':>8} {'/ standard':>10} {'loss diff':>9}")
    for s in summary:
        if s["status"] != "ok":
            print(f"{s['variant']:>14} {s['status']:>10} {s['note'][:90]}")
            continue

        def fmt(key, spec, s=s):
            return "-" if s.get(key) is None else format(s[key], spec)

        print(f"{s['variant']:>14} {s['tokens_per_s']:10.0f} {fmt('tokens_per_s_vs_standard', '10.3f')} "
              f"{fmt('peak_gib', '8.2f')} {fmt('peak_vs_standard', '10.3f')} "
              f"{fmt('max_loss_rel_diff_vs_standard', '9.2e')}")
    print(f"wrote {out / CSV} ({len(rows)} rows) in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()

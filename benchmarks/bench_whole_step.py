"""Benchmark: the whole LoRA training step a user runs — PEFT, Liger-Kernel, lora_lab, and lora_lab + Liger.

Models (random init, bf16, sdpa, at their real vocabulary sizes, ``--layers`` decoder layers, default 2):
  llama      Llama-3-8B-like: hidden 4096, intermediate 14336, 32 heads / 8 KV heads of 128, vocab 128,256
  qwen2      Qwen2-7B-like: hidden 3584, intermediate 18944, 28 heads / 4 KV heads of 128, q/k/v bias, vocab 151,936
  qwen3_moe  Qwen3-30B-A3B-like: hidden 2048, 128 experts (top 8) of intermediate 768, 32 heads / 4 KV heads of 128,
             vocab 151,936
LoRA r=16 (alpha 32) on every projection: q/k/v/o and gate/up/down (dense), q/k/v/o and the experts' gate_up_proj
and down_proj (MoE, PEFT ``target_parameters``); B filled with N(0, 0.02²) so the adapters matter. AdamW over the
LoRA parameters. Batch ``--batch`` × ``--seq`` tokens (default 2 × 4,096).

Variants (each built fresh from the same seeds: same weights, same adapters, same token ids):
  peft                            PEFT
  peft_liger                      Liger-Kernel on the model (RMSNorm, RoPE, SwiGLU / experts, fused linear CE), PEFT
  peft_patch                      PEFT + ``lora_lab.kernels.patch_model``
  peft_patch_fused_loss           PEFT + ``patch_model(fused_loss=True)`` (lora_lab's fused linear CE)
  peft_liger_patch                Liger + PEFT + ``patch_model(fused_loss="liger")`` (Liger's loss)
  peft_liger_patch_lora_lab_loss  Liger + PEFT + ``patch_model(fused_loss="lora_lab")`` (lora_lab's loss)
  peft_liger_patch_cublas_base    the recipe with ``KernelConfig(base_gemm="cublas")`` (on request: not a default)
  peft_liger_patch_pure_cublas    the recipe with ``KernelConfig(base_gemm="cublas", rank_ops="torch")`` (on request)
  peft_liger_patch_quack          the recipe with ``KernelConfig(base_gemm="quack")`` (on request; QuACK installed)
Liger is applied as its users call it (``apply_liger_kernel_to_<model>(model=...)``, through
``lora_lab.kernels.liger.apply_liger``), with its module-level changes (RoPE) active only around its variants' steps,
so variants built later in the process stay plain. The last two variants differ only in the loss: their ratio is the
entry ``lora_lab.kernels.liger.LOSS_TABLE`` wants for the model's head shape (printed at the end).

Timing — the user's loop: every variant's model stays built; in each of ``--repetitions`` repetitions the variants
run in rotated order (``measure.rotation``), each ``--steps`` whole optimizer steps (forward, loss, backward, AdamW
step, zero_grad) after one untimed step, each step between CUDA events and synchronised after it
(``measure.loop_ms``); a row's ``step_ms`` is the median step. The repetitions run in ``--sessions`` separate
processes (this script again, one after another) and are pooled (``measure.pool_sessions``): every summary interval
spans sessions. Peak memory and the first steps' losses come from a separate pass, in the first session only (both
are fixed by the code and the shapes), in which each variant is built alone (``torch.cuda.max_memory_allocated`` of
its second step, nothing else resident). A variant that fails or runs
out of memory is an ``error`` / ``oom`` row, not a crash. Under a GPU memory cap (``$LORA_LAB_MEMORY_CAP_GIB``, the
capped gpu profiles) a dense model whose variants, all built at once, lora_lab's byte model says cannot fit runs at the
first smaller token shape that fits (batch 1 at the asked length, then the length halved down to 1,024): its rows
carry those tokens and a ``shrunk`` column saying from what and why (the notebook grades no prediction on them).
Where none fits, a variant's memory pass, or the model's whole timing pass, gets ``skipped`` rows with the estimate.

Writes into --out: whole_step.csv (one row per model, variant, session and repetition), whole_step_memory.csv (one
row per model, variant and session), whole_step_summary.csv; the summary table is printed last.

    python benchmarks/bench_whole_step.py --out DIR                        # 3 models, 5 repetitions, 2 sessions
    python benchmarks/bench_whole_step.py --out DIR --models llama --quick # one model, fewer steps and repetitions
    TRITON_INTERPRET=1 python benchmarks/bench_whole_step.py --out DIR --smoke   # CPU: tiny configs, fp32
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from bench_common import add_ledger_argument, check_device, error_text, is_oom, session_argv, write_summary

from lora_lab.lab import measure

CSV, MEMORY_CSV, SUMMARY_CSV = "whole_step.csv", "whole_step_memory.csv", "whole_step_summary.csv"
MODELS = ["llama", "qwen2", "qwen3_moe"]
# name: (Liger applied?, patch_model's fused_loss, or None: not patched)
VARIANTS = {
    "peft": (False, None),
    "peft_liger": (True, None),
    "peft_patch": (False, False),
    "peft_patch_fused_loss": (False, True),
    "peft_liger_patch": (True, "liger"),
    "peft_liger_patch_lora_lab_loss": (True, "lora_lab"),
    "peft_liger_patch_cublas_base": (True, "liger"),
    "peft_liger_patch_pure_cublas": (True, "liger"),
    "peft_liger_patch_quack": (True, "liger"),
}
# a variant's KernelConfig for patch_model beyond the defaults: the recipe with the LoRA linear's big GEMMs by cuBLAS
# (KernelConfig(base_gemm="cublas"): Triton writes the rank-r terms, cuBLAS adds X Wᵀ onto them with beta = 1), and
# with every product of the LoRA linear a cuBLAS call (rank_ops="torch" too: no Triton kernel in the linear), and with
# its big GEMMs on QuACK, the rank-r term in their epilogue (base_gemm="quack": kernels/lora/quack_gemm)
VARIANT_CONFIGS = {"peft_liger_patch_cublas_base": {"base_gemm": "cublas"},
                   "peft_liger_patch_pure_cublas": {"base_gemm": "cublas", "rank_ops": "torch"},
                   "peft_liger_patch_quack": {"base_gemm": "quack"}}
# the variants timed unless --variants names others (notebook 10's): those of other kernel configs on request only
DEFAULT_VARIANTS = [v for v in VARIANTS if v not in VARIANT_CONFIGS]
DENSE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MOE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
MOE_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
FIRST_LOSSES = 3  # losses of the first steps recorded per variant (the memory pass)
# the loss each variant's step computes, as lora_lab's byte model names it (Liger's fused linear CE: chunked)
BYTE_MODEL_LOSS = {"peft": "standard", "peft_liger": "chunked", "peft_patch": "standard",
                   "peft_patch_fused_loss": "fused", "peft_liger_patch": "chunked",
                   "peft_liger_patch_lora_lab_loss": "fused", "peft_liger_patch_cublas_base": "chunked",
                   "peft_liger_patch_pure_cublas": "chunked", "peft_liger_patch_quack": "chunked"}
SMOKE_LIGER = {"rms_norm": False, "swiglu": False}  # Liger's RMSNorm / SiLU·mul kernels do not run in the interpreter


def model_config(name: str, layers: int, smoke: bool):
    """A transformers config of the model family ``name`` (tiny with ``smoke``: the same family, vocab 256)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3MoeConfig

    tiny = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=256,
                num_hidden_layers=1)
    if name == "llama":
        sizes = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=128256, num_hidden_layers=layers, rope_theta=500000.0)
        cfg = LlamaConfig(**(dict(sizes, **tiny, intermediate_size=64) if smoke else sizes))
    elif name == "qwen2":
        sizes = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                     vocab_size=151936, num_hidden_layers=layers)
        cfg = Qwen2Config(**(dict(sizes, **{k: v for k, v in tiny.items() if k != "head_dim"}, intermediate_size=64)
                             if smoke else sizes))
    elif name == "qwen3_moe":
        sizes = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     vocab_size=151936, num_hidden_layers=layers, norm_topk_prob=True, output_router_logits=False)
        if smoke:
            sizes = dict(sizes, **tiny, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                         num_experts_per_tok=2)
        cfg = Qwen3MoeConfig(**sizes)
    else:
        raise SystemExit(f"unknown model {name!r} (known: {' '.join(MODELS)})")
    cfg.tie_word_embeddings = False
    cfg.use_cache = False
    cfg.max_position_embeddings = 32768
    return cfg


class Variant:
    """One variant of one model, built fresh: the model, its optimizer, the Liger patch (or None), its step."""

    def __init__(self, model_name: str, variant: str, args, device, dtype):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from lora_lab.kernels import KernelConfig, patch_model
        from lora_lab.kernels import liger as liger_mod
        from lora_lab.layer import fill_lora_B

        use_liger, fused_loss = VARIANTS[variant]
        cfg = model_config(model_name, args.layers, args.smoke)
        torch.manual_seed(0)
        with torch.device(device):
            base = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        self.liger = None
        if use_liger:
            if not liger_mod.liger_installed():
                raise ImportError("liger-kernel is not installed (pip install 'lora_lab[liger]')")
            self.liger = liger_mod.apply_liger(base, keep_globals=False, **(SMOKE_LIGER if args.smoke else {}))
        moe = model_name == "qwen3_moe"
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=MOE_TARGETS if moe else DENSE_TARGETS,
                          target_parameters=MOE_PARAMETERS if moe else None)
        torch.manual_seed(1)
        self.model = get_peft_model(base, lora).train()
        fill_lora_B(self.model, 0.02)
        self.summary = None
        if fused_loss is not None:
            with self._scope():
                config = KernelConfig(**VARIANT_CONFIGS[variant]) if variant in VARIANT_CONFIGS else None
                self.summary = patch_model(self.model, fused_loss=fused_loss, config=config)
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-4)
        g = torch.Generator(device="cpu").manual_seed(2)
        self.ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(device)
        self.losses: list[torch.Tensor] = []
        self.head = (cfg.hidden_size, cfg.vocab_size)
        self.smoke = args.smoke

    def _scope(self):
        return self.liger.active() if self.liger is not None else torch.enable_grad()

    def step(self):
        with self._scope():
            loss = self.model(input_ids=self.ids, labels=self.ids).loss
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(loss.detach())

    def describe(self) -> dict:
        s = self.summary or {}
        liger = s.get("liger") or {}
        return {"loss_impl": s.get("loss") or ("liger" if self.liger is not None else "torch"),
                "lora_layers_fused": s.get("lora_layers", 0), "moe_experts_fused": s.get("moe_experts", 0),
                "liger_swiglu_lora_fused": liger.get("swiglu_lora_fused"),
                "liger_parts": "" if self.liger is None else "rope+flce" if self.smoke else "all",
                "hidden": self.head[0], "vocab": self.head[1]}


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _row_base(model_name, variant, args, dtype) -> dict:
    return {"model": model_name, "variant": variant, "batch": args.batch, "seq": args.seq, "layers": args.layers,
            "dtype": str(dtype).removeprefix("torch."), "smoke": args.smoke}


def estimated_bytes(model_name: str, variants, args) -> dict[str, tuple[int, int]] | None:
    """{variant: (fixed bytes, peak bytes)} of one step of each variant built alone, from lora_lab's byte model
    (``lora_lab.memory.byte_model``: a dense Llama / Qwen2 decoder, flash attention, bf16); None for a model it does
    not describe (qwen3_moe). An estimate: PEFT's and Liger's own buffers are not modelled one by one."""
    from lora_lab.memory.byte_model import ModelShape, TrainingSetup, analytic_memory

    if model_name == "qwen3_moe":
        return None
    shape = ModelShape.from_config(model_config(model_name, args.layers, args.smoke))
    out = {}
    for variant in variants:
        setup = TrainingSetup(args.batch, args.seq, "bf16", "lora", lora_r=16, lora_targets=tuple(DENSE_TARGETS),
                              attention="flash", loss=BYTE_MODEL_LOSS[variant])
        predicted = analytic_memory(shape, setup)
        out[variant] = (predicted.fixed, predicted.peak)
    return out


def timing_bytes(estimates: dict[str, tuple[int, int]]) -> int:
    """The timing pass's peak from :func:`estimated_bytes`: every variant's fixed memory at once, plus the largest
    step's working memory above its own."""
    return sum(fixed for fixed, _ in estimates.values()) + max(peak - fixed for fixed, peak in estimates.values())


def shrink_shapes(args) -> list[tuple[int, int]]:
    """The token shapes (batch, seq) a capped run tries for a model, the asked one first: batch 1 at the asked
    length, then the length halved while it stays at 1,024 or more; none larger than asked."""
    shapes = [(args.batch, args.seq)]
    if args.batch > 1:
        shapes.append((1, args.seq))
    seq = args.seq
    while seq // 2 >= 1024:
        seq //= 2
        shapes.append((1, seq))
    return shapes


def with_tokens(args, batch: int, seq: int):
    """A copy of ``args`` with another batch and sequence length (what a shrunk model runs with)."""
    return argparse.Namespace(**{**vars(args), "batch": batch, "seq": seq})


def over_memory_cap(model_name: str, variants, args, device) -> tuple[dict[str, str], str | None, object, str]:
    """Under a GPU memory cap on CUDA: ({variant: why its memory pass is skipped}, why the model's timing pass is
    skipped or None, the args to run the model with, why they are shrunk or ""), from :func:`estimated_bytes`. The
    variants are timed built at once: the first of :func:`shrink_shapes` at which that fits is run (every variant
    alone then fits too); where none does, the asked shape's passes are skipped as the estimates say. Without a
    cap, off CUDA or for a model without a byte model: ({}, None, args, "") (what runs out of memory is then
    recorded as ``oom``)."""
    from lora_lab.memory import budget

    if budget.memory_cap_gib() is None or device.type != "cuda":
        return {}, None, args, ""
    shapes = shrink_shapes(args)
    by_shape = {shape: estimated_bytes(model_name, variants, with_tokens(args, *shape)) for shape in shapes}
    estimates = by_shape[shapes[0]]  # the asked shape's
    if estimates is None:
        return {}, None, args, ""
    labels = {f"{len(estimates)} variants built at once, batch {b} x {q}": (b, q) for b, q in shapes}
    sized = {label: timing_bytes(by_shape[shape]) for label, shape in labels.items()}
    together = budget.skip_or_shrink(model_name, list(labels), sized.__getitem__, device=device)
    if not together.skipped:
        if not together.shrunk:
            return {}, None, args, ""
        return {}, None, with_tokens(args, *labels[together.shape]), f"{together.reason} (lora_lab's byte model)"
    tokens = f"batch {args.batch} x {args.seq}"
    alone = {}
    for variant, (_, peak) in estimates.items():
        decision = budget.skip_or_shrink(f"{model_name}_{variant}", [f"{variant} alone, {tokens}"],
                                         lambda _, peak=peak: peak, device=device)
        if decision.skipped:
            alone[variant] = f"memory pass {decision.reason} (lora_lab's byte model)"
    return alone, f"timing pass {together.reason} (lora_lab's byte model)", args, ""


def memory_pass(model_name, variants, args, device, dtype, skip: dict[str, str] | None = None) -> list[dict]:
    """Each variant alone: build, first steps (their losses), the peak of its second step; a variant in ``skip``
    gets a ``skipped`` row with the reason instead."""
    rows = []
    for variant in variants:
        row = _row_base(model_name, variant, args, dtype)
        if skip and variant in skip:
            rows.append({**row, "status": "skipped", "error": skip[variant]})
            print(f"   {model_name} {variant}: skipped: {skip[variant]}", flush=True)
            continue
        built = None
        try:
            built = Variant(model_name, variant, args, device, dtype)
            built.step()
            peak = measure.peak_bytes(built.step)[0] if device.type == "cuda" else None
            while len(built.losses) < FIRST_LOSSES:
                built.step()
            losses = [float(v) for v in built.losses[:FIRST_LOSSES]]
            row.update(status="ok", peak_gib=None if peak is None else peak / 2**30,
                       losses_first=" ".join(f"{v:.6f}" for v in losses), loss_first=losses[0], **built.describe())
        except Exception as err:  # a variant that cannot run is a recorded result
            row.update(status="oom" if is_oom(err) else "error", error=error_text(err))
            print(f"   {model_name} {variant}: {row['status']}: {row['error'][:200]}", flush=True)
        del built
        free_memory()
        rows.append(row)
    return rows


def timing_pass(model_name, variants, args, device, dtype, skip: str | None = None) -> list[dict]:
    """Every variant built (fresh, once), then ``--repetitions`` rotated side-by-side loops of whole steps; with
    ``skip`` (why), ``skipped`` rows instead."""
    if skip is not None:
        print(f"   {model_name}: {skip}", flush=True)
        return [{**_row_base(model_name, variant, args, dtype), "rep": rep, "status": "skipped", "error": skip}
                for variant in variants for rep in range(args.repetitions)]
    built, failed = {}, {}
    for variant in variants:
        try:
            v = Variant(model_name, variant, args, device, dtype)
            v.step()  # optimizer state, compile / autotune: untimed
            built[variant] = v
        except Exception as err:
            failed[variant] = ("oom" if is_oom(err) else "error", error_text(err))
            free_memory()
    rows = []
    tokens = args.batch * args.seq
    for rep in range(args.repetitions):
        for variant in measure.rotation(list(built), rep):
            row = {**_row_base(model_name, variant, args, dtype), "rep": rep}
            try:
                times = measure.loop_ms(built[variant].step, calls=args.steps, warmup=1)
            except Exception as err:
                failed[variant] = ("oom" if is_oom(err) else "error", error_text(err))
                del built[variant]
                free_memory()
                continue
            ms = statistics.median(times)
            rows.append({**row, "status": "ok", "step_ms": ms, "step_ms_each": " ".join(f"{t:.3f}" for t in times),
                         "tokens_per_s": tokens / ms * 1e3, "timing": "loop", **built[variant].describe()})
    for variant, (status, message) in failed.items():
        rows += [{**_row_base(model_name, variant, args, dtype), "rep": rep, "status": status, "error": message}
                 for rep in range(args.repetitions)]
    del built
    free_memory()
    return rows


def summarize(rows, memory) -> list[dict]:
    """Per (model, variant): median step and interval (pooled sessions), speedups vs PEFT and vs PEFT + Liger,
    peak GiB (the memory pass's; a median where more than one session ran it), the first losses against PEFT's."""
    out = []
    for model_name in dict.fromkeys(r["model"] for r in rows + memory):
        mine = [r for r in rows if r["model"] == model_name]
        mem = [r for r in memory if r["model"] == model_name]
        ok = {r["variant"] for r in mine if r["status"] == "ok" and r.get("step_ms") is not None}
        peft_losses = [r for r in mem if r["variant"] == "peft" and r["status"] == "ok"]
        for variant in VARIANTS:
            vrows = [r for r in mine if r["variant"] == variant]
            vmem = [r for r in mem if r["variant"] == variant]
            if not vrows and not vmem:
                continue
            entry = {"model": model_name, "variant": variant}
            timed = [r for r in vrows if r["status"] == "ok" and r.get("step_ms") is not None]
            if timed:
                s = measure.summarize([r["step_ms"] for r in timed], sessions=measure.sessions_in(timed))
                entry.update(status="ok", step_ms=s["median"], ci95_low=s["ci95"][0], ci95_high=s["ci95"][1],
                             n=s["n"], sessions=s["sessions"], loss_impl=timed[0].get("loss_impl"))
                for base in ("peft", "peft_liger"):
                    if base in ok and base != variant:
                        r = measure.ratio_summary(mine, "step_ms", {"variant": base}, {"variant": variant})
                        entry[f"speedup_vs_{base}"] = r["median"]
                        entry[f"speedup_vs_{base}_ci95"] = f"{r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}"
            else:
                bad = next((r for r in vrows + vmem if r["status"] != "ok"), {})
                entry.update(status=bad.get("status", "error"), error=bad.get("error", ""))
            peaks = [r["peak_gib"] for r in vmem if r["status"] == "ok" and r.get("peak_gib") is not None]
            entry["peak_gib"] = statistics.median(peaks) if peaks else None
            firsts = [r for r in vmem if r["status"] == "ok"]
            if firsts:
                entry["losses_first"] = firsts[0]["losses_first"]
                if peft_losses:
                    ref = [float(v) for v in peft_losses[0]["losses_first"].split()]
                    got = [float(v) for v in firsts[0]["losses_first"].split()]
                    entry["loss_max_rel_diff_vs_peft"] = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
            elif "status" not in entry or entry["status"] == "ok":
                bad = next((r for r in vmem if r["status"] != "ok"), None)
                if bad:
                    entry["memory_pass"] = f"{bad['status']}: {bad.get('error', '')[:120]}"
            out.append(entry)
    return out


def loss_table_lines(rows, summary) -> list[str]:
    """What the run says for ``lora_lab.kernels.liger.LOSS_TABLE``: Liger's vs lora_lab's loss in the same step."""
    lines = []
    for model_name in dict.fromkeys(r["model"] for r in summary):
        mine = [r for r in rows if r["model"] == model_name and r["status"] == "ok"]
        have = {r["variant"] for r in mine}
        if not {"peft_liger_patch", "peft_liger_patch_lora_lab_loss"} <= have:
            continue
        r = measure.ratio_summary(mine, "step_ms", {"variant": "peft_liger_patch_lora_lab_loss"},
                                  {"variant": "peft_liger_patch"})
        low, high = r["ci95"]
        verdict = "liger" if low > 1.0 else "lora_lab" if high < 1.0 else "inconclusive (keep Liger's)"
        head = next(x for x in mine if x["variant"] == "peft_liger_patch")
        lines.append(f"{model_name} head ({head['hidden']}, {head['vocab']}), {head['batch']}x{head['seq']} tokens: "
                     f"step with lora_lab's loss / with Liger's = {r['median']:.3f} (95% {low:.3f}-{high:.3f}, "
                     f"{r['n']} repetitions, {r['sessions']} sessions) -> faster: {verdict}")
    return lines


def print_table(summary) -> None:
    print(f"{'model':>10} {'variant':>31} {'step ms':>9} {'95% interval':>17} {'vs PEFT':>8} {'vs Liger':>8} "
          f"{'peak GiB':>9} {'loss':>9} {'dloss':>8}  status")
    for s in summary:
        ms = f"{s['step_ms']:9.2f}" if s.get("step_ms") is not None else f"{'-':>9}"
        ci = f"{s['ci95_low']:.2f}-{s['ci95_high']:.2f}" if s.get("step_ms") is not None else "-"
        vp = f"{s['speedup_vs_peft']:8.3f}" if s.get("speedup_vs_peft") is not None else f"{'-':>8}"
        vl = f"{s['speedup_vs_peft_liger']:8.3f}" if s.get("speedup_vs_peft_liger") is not None else f"{'-':>8}"
        pk = f"{s['peak_gib']:9.2f}" if s.get("peak_gib") is not None else f"{'-':>9}"
        loss = s.get("losses_first", "").split()
        lo = f"{float(loss[0]):9.4f}" if loss else f"{'-':>9}"
        dl = f"{s['loss_max_rel_diff_vs_peft']:8.1e}" if s.get("loss_max_rel_diff_vs_peft") is not None else f"{'-':>8}"
        status = s["status"] + (f" ({s['error'][:60]})" if s.get("error") else "")
        print(f"{s['model']:>10} {s['variant']:>31} {ms} {ci:>17} {vp} {vl} {pk} {lo} {dl}  {status}")


def runs_memory_pass(args) -> bool:
    """Whether this process runs the memory pass: the first session (or the only one) does, later sessions only time
    (a peak and the first losses are the same in every session)."""
    return not args.session_index


def run_session(args, out: Path) -> None:
    """One process's share: the memory pass (first session) and the timing repetitions of every model."""
    device = check_device(args.smoke)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    rows, memory = [], []
    for model_name in args.models:
        started = time.perf_counter()
        skip_alone, skip_timing, run_args, shrunk = over_memory_cap(model_name, args.variants, args, device)
        if shrunk:
            print(f"   {model_name}: {shrunk}", flush=True)
        mark = {"shrunk": shrunk} if shrunk else {}  # the rows say they ran at other tokens than asked, and why
        if runs_memory_pass(args):
            memory += [{**r, **mark} for r in memory_pass(model_name, args.variants, run_args, device, dtype,
                                                          skip_alone)]
            measure.write_csv(memory, out / MEMORY_CSV)
        rows += [{**r, **mark} for r in timing_pass(model_name, args.variants, run_args, device, dtype, skip_timing)]
        measure.write_csv(rows, out / CSV)  # after every model: a run cut short keeps what it measured
        print(f"{model_name}: session done in {time.perf_counter() - started:.0f} s", flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--repetitions", type=int, default=measure.MIN_REPETITIONS, help="rotated loops per session")
    ap.add_argument("--sessions", type=int, default=measure.MIN_SESSIONS, help="separate processes, pooled")
    ap.add_argument("--steps", type=int, default=5, help="timed whole steps per variant and repetition")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--quick", action="store_true", help="3 repetitions of 3 steps per session")
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1: tiny configs, fp32, vocab 256, "
                                                         "batch 2 x 16, Liger's RoPE and fused linear CE only")
    ap.add_argument("--session-index", type=int, default=None, help=argparse.SUPPRESS)
    add_ledger_argument(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.repetitions, args.steps = min(args.repetitions, 3), min(args.steps, 3)
    if args.smoke:
        args.batch, args.seq, args.steps = 2, 16, min(args.steps, 2)
    if args.repetitions < 1 or args.sessions < 1 or args.steps < 1:
        ap.error("--repetitions, --sessions and --steps must be >= 1")
    if "peft" not in args.variants:
        args.variants = ["peft", *args.variants]  # the baseline of every ratio
    return args, argv


def main(argv=None) -> None:
    start = time.perf_counter()
    args, raw = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.session_index is not None or args.sessions == 1:
        run_session(args, out)
        if args.session_index is not None:
            return
        parts = [out]
    else:
        raw = list(sys.argv[1:] if raw is None else raw)
        parts = []
        env = session_environment()
        for k in range(args.sessions):
            part = measure.process_folder(out, k)
            cmd = [sys.executable, str(Path(__file__).resolve()), *_replace_out(raw, part), "--session-index", str(k)]
            print(f"--- process {k + 1} of {args.sessions}: {' '.join(cmd[1:])}", flush=True)
            done = subprocess.run(cmd, env=env)
            if done.returncode != 0 and not (part / CSV).exists():
                raise SystemExit(f"process {k + 1} of {args.sessions} failed (exit {done.returncode}) "
                                 f"before writing {part / CSV}")
            parts.append(part)
    rows = measure.pool_sessions([measure.read_csv(p / CSV) for p in parts])
    memory = measure.pool_sessions([measure.read_csv(p / MEMORY_CSV) for p in parts if (p / MEMORY_CSV).is_file()])
    measure.write_csv(rows, out / CSV)
    measure.write_csv(memory, out / MEMORY_CSV)
    summary = summarize(rows, memory)
    write_summary(summary, out / SUMMARY_CSV, args)
    import triton

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)"
    print(f"torch {torch.__version__}, triton {triton.__version__}, {dev}; {len(parts)} session(s) x "
          f"{args.repetitions} repetitions x {args.steps} steps; batch {args.batch} x {args.seq}", flush=True)
    for line in loss_table_lines(rows, summary):
        print("LOSS_TABLE" + (" (smoke: the interpreter's times, not a measurement)" if args.smoke else "") + ":", line)
    print(f"wrote {out / CSV} ({len(rows)} rows), {out / SUMMARY_CSV} in {time.perf_counter() - start:.0f} s")
    print_table(summary)


def session_environment() -> dict[str, str]:
    """The sessions' environment: this one with Triton's disk cache of autotuning results on
    (``TRITON_CACHE_AUTOTUNING=1`` unless set otherwise), as bench_moe.py sets it for its sessions. Liger's fused MoE
    autotunes for minutes at a cold (hidden, intermediate) key; with the cache a later session, or this benchmark after
    bench_moe.py tuned the same layer shape, reuses the picks. Only timed steps after warm-up are measured here, so
    the cache changes how long a session takes, not what it measures."""
    return {**os.environ, "TRITON_CACHE_AUTOTUNING": os.environ.get("TRITON_CACHE_AUTOTUNING", "1")}


def _replace_out(argv: list[str], new: Path) -> list[str]:
    """``argv`` with ``--out`` pointing at ``new`` (and without ``--sessions``: a child is one session)."""
    return [*session_argv(argv, new), "--sessions", "1"]


if __name__ == "__main__":
    main()

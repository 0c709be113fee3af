"""Notebook 10 (the whole step): the recipe lora_lab + Liger-Kernel built on a small model, and the metrics of
``benchmarks/bench_whole_step.py``.

The *recipe* is what a user writes: Liger-Kernel applied to the transformers model, PEFT's LoRA on every projection,
then :func:`lora_lab.kernels.patch_model` with ``fused_loss=True`` — which routes every LoRA projection through the
fused kernels and picks whose fused loss runs (:func:`lora_lab.kernels.liger.choose_loss`). In the benchmark that is
the variant ``peft_liger_patch_lora_lab_loss`` wherever ``LOSS_TABLE`` names lora_lab's loss — since the H200 runs
of a9f0a02 and bec6a1b, at all three heads measured there — and ``peft_liger_patch`` (Liger's loss, the recipe as
first registered, ``RECIPE``) elsewhere; the two differ only in the loss.
"""
from __future__ import annotations

import statistics
from pathlib import Path

import torch

from lora_lab.lab import measure
from lora_lab.memory import budget

__all__ = ["RECIPE", "tiny_llama", "build_variant", "save_tiny_llama", "lora_weights", "load_lora_weights",
           "train_losses", "benchmark_metrics", "MODELS"]

RECIPE = "peft_liger_patch"
# the recipe once LOSS_TABLE names lora_lab's loss at the head (after notebook 10's first H200 run)
RECIPE_LORA_LAB_LOSS = "peft_liger_patch_lora_lab_loss"
MODELS = ("llama", "qwen2", "qwen3_moe")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Liger's RMSNorm and SiLU·mul kernels do not run in Triton's interpreter: on the CPU the recipe applies Liger's RoPE
# and fused linear cross-entropy only (the GPU applies all of it): apply_liger_kernel_to_llama(model=..., **CPU_LIGER)
CPU_LIGER = {"rms_norm": False, "swiglu": False}


def tiny_llama(device, dtype, seed: int = 0, vocab: int = 512, hidden: int = 64, layers: int = 2):
    """A small Llama-family causal LM (random init, untied head, sdpa attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=256,
                      tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).train()


def save_tiny_llama(folder: Path | str, seed: int = 0) -> Path:
    """:func:`tiny_llama` (fp32) saved as a transformers checkpoint in ``folder``, which is returned: what
    ``AutoModelForCausalLM.from_pretrained`` loads in the recipe's first line."""
    folder = Path(folder)
    tiny_llama("cpu", torch.float32, seed).save_pretrained(folder)
    return folder


def lora_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every LoRA factor of ``model`` (parameters named ``lora_A`` / ``lora_B``), by parameter name."""
    return {name: p.detach().clone() for name, p in _lora_parameters(model).items()}


def load_lora_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> int:
    """Copy ``weights`` (:func:`lora_weights` of a model with the same adapters) into ``model``'s LoRA factors, so
    two models train from the same adapters; returns how many were copied. A factor missing on either side, or of
    another shape, is an error that names it."""
    mine = _lora_parameters(model)
    if set(mine) != set(weights):
        only_here, only_there = sorted(set(mine) - set(weights)), sorted(set(weights) - set(mine))
        raise ValueError(f"the LoRA factors differ: only in the model {only_here[:4]}, only in the weights "
                         f"{only_there[:4]}")
    with torch.no_grad():
        for name, p in mine.items():
            if p.shape != weights[name].shape:
                raise ValueError(f"LoRA factor {name}: shape {tuple(weights[name].shape)} given, the model's is "
                                 f"{tuple(p.shape)}")
            p.copy_(weights[name])
    return len(mine)


def _lora_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if "lora_A" in name or "lora_B" in name}


def build_variant(device, dtype, liger: bool, fused_loss, seed: int = 0, r: int = 8):
    """The small model as a variant of the benchmark: (PEFT model, Liger patch or None, patch_model summary or None).

    ``liger``: apply Liger-Kernel first; ``fused_loss``: None = no ``patch_model``, else its ``fused_loss`` argument.
    """
    from peft import LoraConfig, get_peft_model

    from lora_lab.kernels import liger as liger_mod
    from lora_lab.kernels import patch_model
    from lora_lab.layer import fill_lora_B

    base = tiny_llama(device, dtype, seed)
    patch = None
    if liger:
        extra = CPU_LIGER if torch.device(device).type == "cpu" else {}
        patch = liger_mod.apply_liger(base, keep_globals=False, **extra)
    torch.manual_seed(seed + 1)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=TARGETS))
    fill_lora_B(model, 0.02)
    summary = None
    if fused_loss is not None:
        with patch.active() if patch is not None else torch.enable_grad():
            summary = patch_model(model, fused_loss=fused_loss)
    return model, patch, summary


def train_losses(model, patch, ids, steps: int = 3, lr: float = 1e-3) -> list[float]:
    """Losses of ``steps`` AdamW steps on one batch (labels = ids), Liger's module-level changes active."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        with patch.active() if patch is not None else torch.enable_grad():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _ratio(rows: list[dict], numerator: str, denominator: str) -> dict | None:
    have = {r["variant"] for r in rows}
    if not {numerator, denominator} <= have:
        return None
    return measure.ratio_summary(rows, "step_ms", {"variant": numerator}, {"variant": denominator})


def _peak(memory: list[dict], variant: str) -> float | None:
    peaks = [float(r["peak_gib"]) for r in memory if r["variant"] == variant and r.get("status") == "ok"
             and r.get("peak_gib") not in (None, "")]
    return statistics.median(peaks) if peaks else None


def _first_losses(memory: list[dict], variant: str) -> list[float] | None:
    for r in memory:
        if r["variant"] == variant and r.get("status") == "ok" and r.get("losses_first"):
            return [float(v) for v in str(r["losses_first"]).split()]
    return None


def _short_failure(status: str, error: str) -> str:
    """What a skipped or out-of-memory row says, short: an OOM as the allocation it was refused and, where the row
    kept it, the allocator's split of what the process held (allocated, and reserved but unallocated: under a cap,
    the second is fragmentation the cap counts). The card's free memory around it says nothing under a cap."""
    if status == "oom":
        figures = budget.oom_figures(error)
        if not figures:
            return "out of memory" + (f": {error[:120]}" if error else "")
        said = [f"{label} {figures[label]}" for label in ("asked for", "allocated by PyTorch",
                                                           "reserved but unallocated") if label in figures]
        return f"out of memory ({', '.join(said)})"
    return error[:240]


def note_capped_models(rows: list[dict]) -> dict[str, str]:
    """Under a GPU memory cap (:mod:`lora_lab.memory.budget`): each model with a variant that ran out of memory, or
    whose pass was skipped as not fitting, kept as a skipped cell under the model's name (the prefix of its metrics),
    so its missing metrics grade void with the reason; a model the benchmark ran at fewer tokens than asked (its
    rows' ``shrunk``) is kept the same way, with the shrink. The variants that failed alike share one clause
    (``peft, peft_liger skipped: timing pass skipped: ...``). Returns {model: reason}; without a cap nothing is
    kept (an OOM on the whole card is the measurement's own result)."""
    cap = budget.memory_cap_gib()
    if cap is None:
        return {}
    found: dict[str, dict[tuple[str, str], dict[str, None]]] = {}
    shrunk = {str(r["model"]): str(r["shrunk"]) for r in rows if r.get("shrunk")}
    for model, why in shrunk.items():
        found.setdefault(model, {})[("shrunk", why)] = {}
    for r in rows:
        if r.get("status") in ("oom", "skipped"):
            what = (str(r["status"]), _short_failure(str(r["status"]), str(r.get("error") or "")))
            found.setdefault(str(r["model"]), {}).setdefault(what, {})[str(r["variant"])] = None
    noted = {}
    for model, failures in found.items():
        clauses = [why if status == "shrunk" else f"{', '.join(variants)} {status}" + (f": {why}" if why else "")
                   for (status, why), variants in failures.items()]
        noted[model] = f"under the {cap:g} GiB memory cap (${budget.MEMORY_CAP_ENV}): " + "; ".join(clauses)
        budget.note_skipped(model, noted[model])
    return noted


def benchmark_metrics(bench_dir: Path | str) -> dict:
    """Metrics of one run of ``bench_whole_step.py`` (its CSVs in ``bench_dir``), per model ``m``:

    * ``{m}_recipe_speedup_vs_peft`` / ``_vs_peft_liger``: PEFT's (PEFT + Liger's) step time over the recipe's,
      repetition by repetition, pooled over sessions (a repeated measurement with ``sessions``);
    * ``{m}_recipe_peak_vs_peft_liger``: the recipe's peak over PEFT + Liger's (from the memory pass);
    * ``{m}_recipe_lora_lab_loss_*``: the same three for the recipe with lora_lab's loss (``RECIPE_LORA_LAB_LOSS``),
      what ``patch_model(fused_loss=True)`` runs where ``LOSS_TABLE`` names lora_lab's loss;
    * ``{m}_fused_loss_speedup_vs_patch``: step time with ``patch_model`` over that with
      ``patch_model(fused_loss=True)`` (lora_lab's fused loss, no Liger): above 1 when the fused loss speeds it up;
    * ``{m}_lora_lab_loss_time_vs_liger_loss``: the recipe's step with lora_lab's loss over with Liger's;
    * ``{m}_losses_max_rel_diff_vs_peft``: the largest relative difference of the first steps' losses of any variant
      from PEFT's;
    * ``{m}_{variant}_step_ms`` (median, pooled) and ``{m}_{variant}_peak_gib``.

    Under a GPU memory cap a variant that ran out of memory or was skipped leaves its metrics out, and its model is
    kept as a skipped cell with the reason (:func:`note_capped_models`); a model the benchmark shrank to fewer tokens
    has its metrics named ``{m}_{batch}x{seq}_...`` instead, so none is graded against the asked shape's
    predictions.
    """
    bench_dir = Path(bench_dir)
    every = measure.read_csv(bench_dir / "whole_step.csv")
    rows = [r for r in every if r.get("status") == "ok"]
    memory = measure.read_csv(bench_dir / "whole_step_memory.csv")
    capped = note_capped_models(every + memory)
    metrics: dict = {}
    for model in dict.fromkeys(r["model"] for r in rows + memory):
        mine = [r for r in rows if r["model"] == model]
        mem = [r for r in memory if r["model"] == model]
        shrunk = next((r for r in mine + mem if r.get("shrunk")), None)
        # a model run at fewer tokens than asked answers another question: its metrics carry the tokens in their
        # names (``llama_1x2048_...``), and the predictions on the asked shape grade void with the shrink
        m = model if shrunk is None else f"{model}_{shrunk['batch']}x{shrunk['seq']}"
        for variant in dict.fromkeys(r["variant"] for r in mine):
            times = [float(r["step_ms"]) for r in mine if r["variant"] == variant]
            metrics[f"{m}_{variant}_step_ms"] = statistics.median(times)
        for variant in dict.fromkeys(r["variant"] for r in mem):
            peak = _peak(mem, variant)
            if peak is not None or model not in capped:  # under a cap: no peak, no metric (it grades void, with why)
                metrics[f"{m}_{variant}_peak_gib"] = peak
        for key, (num, den) in {"recipe_speedup_vs_peft": ("peft", RECIPE),
                                "recipe_speedup_vs_peft_liger": ("peft_liger", RECIPE),
                                "fused_loss_speedup_vs_patch": ("peft_patch", "peft_patch_fused_loss"),
                                "lora_lab_loss_time_vs_liger_loss": (RECIPE_LORA_LAB_LOSS, RECIPE),
                                "recipe_lora_lab_loss_speedup_vs_peft": ("peft", RECIPE_LORA_LAB_LOSS),
                                "recipe_lora_lab_loss_speedup_vs_peft_liger": ("peft_liger", RECIPE_LORA_LAB_LOSS),
                                }.items():
            ratio = _ratio(mine, num, den)
            if ratio is not None:
                metrics[f"{m}_{key}"] = ratio
        liger_peak = _peak(mem, "peft_liger")
        for key, variant in (("recipe", RECIPE), ("recipe_lora_lab_loss", RECIPE_LORA_LAB_LOSS)):
            peak = _peak(mem, variant)
            if peak is not None and liger_peak:
                metrics[f"{m}_{key}_peak_vs_peft_liger"] = peak / liger_peak
        reference = _first_losses(mem, "peft")
        if reference:
            diffs = []
            for variant in dict.fromkeys(r["variant"] for r in mem):
                got = _first_losses(mem, variant)
                if got and variant != "peft":
                    diffs += [abs(a - b) / abs(b) for a, b in zip(got, reference)]
            if diffs:
                metrics[f"{m}_losses_max_rel_diff_vs_peft"] = max(diffs)
    return metrics

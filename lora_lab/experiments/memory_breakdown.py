"""Notebook 04's sweep: training configurations run one by one on a reused model, the byte model per
row, tables and plots. An out-of-memory configuration becomes a recorded result, not a crash."""
from __future__ import annotations

import gc
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from lora_lab.layer import add_lora, remove_lora
from lora_lab.memory import (
    GIB,
    AnalyticMemory,
    ModelShape,
    TrainingSetup,
    analytic_memory,
    budget,
    dtype_of,
    peak_memory,
)


@dataclass(frozen=True)
class MemoryConfig:
    """One row of the sweep."""

    dtype: str
    batch: int
    seq_len: int
    method: str  # "full" | "lora"
    checkpointing: bool = False
    loss: str = "standard"
    chunk_size: int = 1024

    @property
    def mode(self) -> str:
        parts = ([self.method] + (["ckpt"] if self.checkpointing else [])
                 + (["chunked"] if self.loss == "chunked" else []))
        return "_".join(parts)

    @property
    def name(self) -> str:
        suffix = f"_c{self.chunk_size}" if self.loss == "chunked" and self.chunk_size != 1024 else ""
        return f"{self.dtype}_b{self.batch}_l{self.seq_len}_{self.mode}{suffix}"

    def setup(self, attention: str, lora_r: int = 8,
              lora_targets: Sequence[str] = ("q_proj", "v_proj")) -> TrainingSetup:
        return TrainingSetup(batch=self.batch, seq_len=self.seq_len, dtype=self.dtype, method=self.method,
                             lora_r=lora_r, lora_targets=tuple(lora_targets), attention=attention,
                             checkpointing=self.checkpointing, loss=self.loss, chunk_size=self.chunk_size)


def prepare_model(model: nn.Module, config: MemoryConfig, lora_r: int = 8, lora_alpha: float = 16,
                  lora_targets: Sequence[str] = ("q_proj", "v_proj")) -> nn.Module:
    """Put a (reused) model into ``config``'s training mode: LoRA or all weights trainable,
    gradient checkpointing (non-reentrant, transformers' default) on or off, train mode."""
    remove_lora(model)
    model.zero_grad(set_to_none=True)
    if config.method == "full":
        for p in model.parameters():
            p.requires_grad_(True)
    else:
        add_lora(model, r=lora_r, alpha=lora_alpha, targets=tuple(lora_targets))
    if config.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
        if hasattr(model, "disable_input_require_grads"):
            model.disable_input_require_grads()
    model.config.use_cache = False
    return model.train()


def _standard_loss(model, batch):
    return model(**batch, use_cache=False).loss


def _loss_fn_for(config: MemoryConfig):
    if config.loss == "standard":
        return _standard_loss
    from lora_lab.loss import causal_lm_loss

    def chunked(model, batch):
        return causal_lm_loss(model, batch["input_ids"], batch.get("labels"), chunked=True,
                              chunk_size=config.chunk_size)

    return chunked


def over_memory_cap(model: nn.Module, config: MemoryConfig, device: torch.device, **lora) -> str | None:
    """Under a GPU memory cap (:mod:`lora_lab.memory.budget`, the capped gpu profiles): why ``config`` is skipped,
    when the byte model's peak for it does not fit (kept as a skipped cell under ``config.name``); else None.
    Without a cap, or off CUDA: None (the sweep runs, and an OOM is its result)."""
    if budget.memory_cap_gib() is None or device.type != "cuda":
        return None
    attention = "flash" if config.dtype in ("bf16", "fp16") else "efficient"  # what SDPA picks on CUDA
    setup = config.setup(attention, lora_r=lora.get("lora_r", 8),
                         lora_targets=lora.get("lora_targets", ("q_proj", "v_proj")))
    predicted = analytic_memory(ModelShape.from_config(model.config), setup).peak
    decision = budget.skip_or_shrink(config.name, [config.name], lambda _: predicted, device=device)
    return decision.reason if decision.skipped else None


def run_memory_config(model: nn.Module, config: MemoryConfig, steps: int = 3, seed: int = 0,
                      account: bool = True, **lora) -> dict:
    """Measure one configuration on a prepared-in-place model; an out-of-memory error becomes a result.

    Returns a flat dict: the config, ``oom`` (bool), ``error`` (first line of the OOM message) and,
    when it ran, the measured bytes (peak, phase peaks, before_forward, layers, head_loss, fixed by
    category) and, with ``account`` and no checkpointing, the saved-tensor accounting of step 1.
    """
    row: dict = {"name": config.name, **asdict(config), "mode": config.mode, "oom": False, "error": None}
    device = next(model.parameters()).device
    skip = over_memory_cap(model, config, device, **lora)
    if skip is not None:  # under a capped profile: named as skipped, never run into an OOM
        # not run: the byte model's estimate is no measurement, so the row says skipped (and the sweep leaves it out)
        row["oom"], row["error"], row["skipped"] = True, skip, True
        return row
    prepare_model(model, config, **lora)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (config.batch, config.seq_len), generator=gen).to(device)
    batch = {"input_ids": ids, "labels": ids}
    account_step = 1 if (account and steps > 1 and not config.checkpointing) else None
    measured = None
    try:
        measured = peak_memory(model, batch, steps=steps, loss_fn=_loss_fn_for(config), account_step=account_step)
    except torch.OutOfMemoryError as exc:
        row["oom"] = True
        row["error"] = str(exc).strip().splitlines()[0][:300]
    except RuntimeError as exc:  # cuBLAS / cuDNN report a failed workspace allocation as a RuntimeError
        text = str(exc)
        if not any(s in text for s in ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")):
            raise
        row["oom"] = True
        row["error"] = text.strip().splitlines()[0][:300]
    if row["oom"] and budget.memory_cap_gib() is not None:
        budget.note_skipped(config.name, f"ran out of memory under the {budget.memory_cap_gib():g} GiB memory cap "
                                         f"(${budget.MEMORY_CAP_ENV}): {row['error']}")
    # outside the except block: the traceback (and the tensors its frames hold) is gone
    model.zero_grad(set_to_none=True)
    del batch, ids
    gc.collect()
    torch.cuda.empty_cache()
    if measured is not None:
        row.update({
            "peak": measured.peak, "step_peaks": measured.step_peaks, "peak_phase": measured.peak_phase,
            "forward_peak": measured.forward_peak, "backward_peak": measured.backward_peak,
            "optimizer_peak": measured.optimizer_peak, "before_forward": measured.before_forward,
            "after_body": measured.after_body, "after_forward": measured.after_forward,
            "layers": measured.layers, "head_loss": measured.head_loss,
            "weights": measured.fixed_after_backward.weights,
            "gradients": measured.fixed_after_backward.gradients,
            "optimizer_states": measured.fixed_after_backward.optimizer_states,
        })
        if measured.accounting is not None:
            row["saved_per_layer"] = measured.accounting.per_layer
            row["saved_summary"] = measured.accounting.summary()
    return row


def memory_sweep(configs: Sequence[MemoryConfig], build_model: Callable[[str], nn.Module], steps: int = 3,
                 progress: bool = True, on_row: Callable[[dict], None] | None = None, **kwargs) -> list[dict]:
    """Run ``configs`` in order, building one model per dtype (``build_model(dtype)``) and reusing it.

    Each row is :func:`run_memory_config`'s dict; ``on_row`` is called after each (e.g. to record
    it at once, so partial results survive). A tqdm progress bar shows the configuration running.
    Under a memory cap, a configuration the byte model says cannot fit is not run: it is a skipped cell
    (:func:`lora_lab.memory.budget.skipped_cells`, with its reason), left out of the rows and never passed to
    ``on_row``, so that no metric records an estimate as if it were measured; one that runs out of memory under
    the cap anyway is a row (``oom`` true, a measurement) and a skipped cell.
    """
    from tqdm.auto import tqdm

    rows = []
    model, model_dtype = None, None
    bar = tqdm(configs, desc="memory sweep", disable=not progress)
    for config in bar:
        bar.set_postfix_str(config.name)
        if model_dtype != config.dtype:
            model = None
            gc.collect()
            torch.cuda.empty_cache()
            model, model_dtype = build_model(config.dtype), config.dtype
        row = run_memory_config(model, config, steps=steps, **kwargs)
        if row.get("skipped"):
            continue
        rows.append(row)
        if on_row is not None:
            on_row(row)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# Helpers for the notebook: the sweep grid, the byte model per row, summaries and plots
# ---------------------------------------------------------------------------------------------

MODES = {
    "full": ("full", False, "standard"),
    "lora": ("lora", False, "standard"),
    "lora_ckpt": ("lora", True, "standard"),
    "lora_ckpt_chunked": ("lora", True, "chunked"),
    "full_ckpt_chunked": ("full", True, "chunked"),
    "lora_chunked": ("lora", False, "chunked"),
    "full_ckpt": ("full", True, "standard"),
    "full_chunked": ("full", False, "chunked"),
}


def config_for(dtype: str, batch: int, seq_len: int, mode: str, chunk_size: int = 1024) -> MemoryConfig:
    """The MemoryConfig of a named mode (``full``, ``lora``, ``lora_ckpt``, ``lora_ckpt_chunked``, ...)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {sorted(MODES)}")
    method, ckpt, loss = MODES[mode]
    dtype_of(dtype)
    return MemoryConfig(dtype=dtype, batch=batch, seq_len=seq_len, method=method, checkpointing=ckpt,
                        loss=loss, chunk_size=chunk_size)


def sweep_configs(dtypes: Sequence[str], batch: int, lengths: Sequence[int], modes: Sequence[str],
                  extra: Sequence[Sequence] = (), chunk_size: int = 1024,
                  extra_chunk_sizes: Sequence[int] = (),
                  extra_chunk_point: Sequence = ("bf16", 4, 4096)) -> list[MemoryConfig]:
    """The sweep grid, grouped by dtype (one model build per dtype): every (batch, length) point,
    then ``extra`` (dtype, batch, length) points, times ``modes``; plus ``lora_ckpt_chunked`` at
    ``extra_chunk_point`` with each of ``extra_chunk_sizes``."""
    configs = []
    for dtype in dtypes:
        points = [(batch, t) for t in lengths] + [(b, t) for d, b, t in extra if d == dtype]
        for b, t in points:
            configs.extend(config_for(dtype, b, t, mode, chunk_size) for mode in modes)
        d, b, t = extra_chunk_point
        if d == dtype:
            configs.extend(config_for(d, b, t, "lora_ckpt_chunked", c) for c in extra_chunk_sizes if c != chunk_size)
    return configs


def analytic_row(config: MemoryConfig, shape: ModelShape, attention: str, lora_r: int = 8,
                 lora_targets: Sequence[str] = ("q_proj", "v_proj")) -> AnalyticMemory:
    """The byte model's prediction for one sweep row."""
    return analytic_memory(shape, config.setup(attention, lora_r=lora_r, lora_targets=lora_targets))


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured."""
    return (predicted - measured) / measured


def format_table(header: Sequence[str], rows: Sequence[Sequence], floatfmt: str = ".2f") -> str:
    """A plain-text table (no pandas needed)."""
    def cell(v):
        if isinstance(v, float):
            return "nan" if math.isnan(v) else format(v, floatfmt)
        return "-" if v is None else str(v)

    text = [[cell(v) for v in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in text)) if text else len(str(h)) for i, h in enumerate(header)]

    def line(items):
        return "  ".join(str(x).rjust(w) for x, w in zip(items, widths))

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in text])


def plot_memory_bars(entries: Sequence[tuple[str, dict[str, float] | None]], title: str, ax=None,
                     capacity_gib: float | None = None):
    """Stacked bars fixed / layers / head+loss (GiB) per labelled entry; ``None`` bars read 'OOM' ('OOM / skipped'
    under a memory cap, where an entry without bars may also be a configuration skipped before it ran)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(max(6, 0.45 * len(entries)), 4))
    colors = {"fixed": "#4c72b0", "layers": "#55a868", "head_loss": "#c44e52"}
    names = {"fixed": "fixed (weights + optimizer states)", "layers": "layers (held at end of decoder)",
             "head_loss": "logits + loss + backward at the peak"}
    xs = range(len(entries))
    for part in ("fixed", "layers", "head_loss"):
        bottoms = [sum(b[p] for p in ("fixed", "layers", "head_loss")[: ("fixed", "layers", "head_loss").index(part)])
                   if b else 0 for _, b in entries]
        heights = [b[part] if b else 0 for _, b in entries]
        ax.bar(xs, heights, bottom=bottoms, color=colors[part], label=names[part])
    missing = "OOM" if budget.memory_cap_gib() is None else "OOM / skipped"
    for x, (_, b) in zip(xs, entries):
        if b is None:
            ax.text(x, 0, missing, rotation=90, ha="center", va="bottom", fontsize=8, color="black")
    if capacity_gib:
        ax.axhline(capacity_gib, color="grey", ls=":", lw=1)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([n for n, _ in entries], rotation=90, fontsize=7)
    ax.set_ylabel("GiB")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return ax


def byte_model_kernel(kernels: Sequence[str]) -> str:
    """The byte model's attention kernel for what :func:`sdpa_kernels_used` saw (no SDPA call: eager)."""
    if not kernels:
        return "eager"
    # one kernel is the normal case; if several ran, the byte model takes the one that saves the most
    for kernel in ("math", "efficient", "cudnn", "flash", "cpu_flash"):
        if kernel in kernels:
            return kernel
    return "flash"  # an out-of-tree fused kernel ("overrideable"): saves what flash saves


def row_metrics(row: dict, prefix: str = "gpu_") -> dict:
    """Flat metrics of one sweep row: ``<prefix><name>_oom`` and, when it ran, peak / fixed / layers /
    head_loss / fixed_after_backward (GiB) and the peak phase. A row skipped before it ran (under a memory cap)
    has none: what it would have used is an estimate, not a measurement."""
    if row.get("skipped"):
        return {}
    key = prefix + row["name"]
    out = {f"{key}_oom": int(bool(row["oom"]))}
    if not row["oom"]:
        out.update({
            f"{key}_peak_gib": row["peak"] / GIB,
            f"{key}_fixed_gib": row["before_forward"] / GIB,
            f"{key}_layers_gib": None if row["layers"] is None else row["layers"] / GIB,
            f"{key}_head_loss_gib": None if row["head_loss"] is None else row["head_loss"] / GIB,
            f"{key}_fixed_after_backward_gib": (row["weights"] + row["gradients"] + row["optimizer_states"]) / GIB,
            f"{key}_peak_phase": row["peak_phase"],
        })
    return out

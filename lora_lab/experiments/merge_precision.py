"""What merging a LoRA adapter does to the numbers, in fp32 and in bf16.

Merging replaces ``h = W x + b + s B A x`` (s = alpha / r) by ``h = W' x + b`` with

    W' = W + s B A.

In exact arithmetic the two are the same model. In floating point they differ in where rounding
happens, and this module measures exactly that:

* logit comparisons between two models over token positions (max and mean |diff|, top-1
  agreement, loss), restricted to real tokens or over every position;
* the share of entries of ``s B A`` that vanish when added to a low-precision ``W`` (too small to
  move it by half an ulp);
* PEFT's ``safe_merge`` against its default merge (one rounding vs two);
* the bf16 drift experiments: a projection module that computes one LoRA-carrying projection
  (q_proj / v_proj) by a named *recipe*, e.g. "fp32 everywhere except one bf16 rounding of the base
  output", swapped into every LoRA site of an fp32 or a bf16 host model. Comparing each recipe's
  logits with the fp32 adapter model's, position by position, says which rounding causes how much
  drift.

Notation in the recipes: ``rnd(t)`` is ``t`` rounded to the low dtype (bf16) and read back in the
dtype it came from; ``x16`` is the projection input rounded to bf16; ``W16, b16, A16, B16`` are the
bf16 roundings of the fp32 reference weights; ``D = s B A`` is formed in fp32.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from lora_lab.experiments.drift_statistics import (  # noqa: F401  (re-exported: notebook 03 calls them here)
    bootstrap_ratio_ci,
    sequence_bootstrap_mean_ci,
    sequence_bootstrap_ratio_ci,
    share_of_subsets_with_gap,
)
from lora_lab.layer import LoRALinear, lora_layers, replace_module
from lora_lab.models import model_logits

__all__ = [
    "RECIPES",
    "DRIFT_VARIANTS",
    "RoundedLoRAProjection",
    "projections_swapped",
    "random_token_batch",
    "model_logits",
    "per_position_loss",
    "PositionDiff",
    "compare_logits",
    "summarise_positions",
    "logit_comparison",
    "vanishing_entries",
    "model_vanishing_share",
    "peft_merged_model",
    "peft_merged_weights",
    "low_precision_merged_weights",
    "bootstrap_ratio_ci",
    "sequence_bootstrap_ratio_ci",
    "sequence_bootstrap_mean_ci",
    "share_of_subsets_with_gap",
    "DriftResult",
    "run_drift_experiments",
    "drift_verdict",
]


def rnd(t: torch.Tensor, low: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``t`` rounded to ``low`` (round-to-nearest-even) and read back in ``t``'s dtype."""
    return t.to(low).to(t.dtype)


# --------------------------------------------------------------------------------------------
# Recipes: one LoRA projection computed with rounding at chosen points
# --------------------------------------------------------------------------------------------

RECIPES: dict[str, str] = {
    # -- in the host's dtype (an fp32 host gives the fp32 forward with one injected rounding) --
    "exact": "W x + b + s B (A x)                      no rounding: the control",
    "base_only": "W x + b in the input's dtype            no adapter (for the bf16 floor)",
    "round_input": "W rnd(x) + b + s B (A rnd(x))            the projection input rounded",
    "round_base_weight": "rnd(W) x + b + s B (A x)                 the base weight rounded",
    "round_base_out": "rnd(W x + b) + s B (A x)                 the base output rounded",
    "round_lora_weights": "W x + b + s rnd(B) (rnd(A) x)            the adapter weights rounded",
    "round_lora_mid": "W x + b + s B rnd(A x)                   the LoRA intermediate (M x r) rounded",
    "round_lora_out": "W x + b + rnd(s B (A x))                 the LoRA branch output rounded",
    "round_sum": "rnd(W x + b + s B (A x))                 the sum rounded (single-rounding unmerged)",
    "round_merged_weight": "rnd(W + D) x + b                         the merged weight rounded once",
    # -- bf16 compositions: input rounded to bf16, output returned in the host's dtype --
    "bf16_adapter": "W16 x16 + b16 + s B16 (A16 x16)          all bf16 (our LoRALinear in bf16)",
    "bf16_fp32_lora": "[W16 x16 + b16] + s B (A x16) in fp32    PEFT default: fp32 branch, one final rounding",
    "bf16_merged": "rnd(W16 + D) x16 + b16                   merged into bf16 W (PEFT default merge)",
    "bf16_single_round": "rnd(W16 x16 + b16 + s B (A x16)), fp32 sums   bf16 weights, one rounding",
    "bf16_exact_qv": "rnd(W x16 + b + s B (A x16)), fp32 weights  the best a bf16 model can get here",
}


class RoundedLoRAProjection(nn.Module):
    """A LoRA projection computed by a named recipe (see ``RECIPES``) from a reference LoRALinear.

    The reference's tensors are used as given (an fp32 reference for the drift experiments); the
    rounded copies each recipe needs are made once here. The output has the input's dtype, so the
    module drops into an fp32 or a bf16 host model.
    """

    def __init__(self, reference: LoRALinear, recipe: str, low_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if recipe not in RECIPES:
            raise ValueError(f"unknown rounding recipe {recipe!r}; known: {', '.join(RECIPES)}")
        if not isinstance(reference, LoRALinear):
            raise TypeError(f"reference must be a LoRALinear, got {type(reference).__name__}")
        if reference.magnitude is not None:
            raise ValueError("reference is a DoRA layer (use_dora=True); the recipes round plain LoRA, W + s B A")
        if not low_dtype.is_floating_point or torch.finfo(low_dtype).bits >= 32:
            raise ValueError(f"low_dtype must be a 16-bit float dtype, got {low_dtype}")
        self.recipe = recipe
        self.low = low_dtype
        self.scaling = reference.scaling
        with torch.no_grad():
            W = reference.base.weight.detach()
            b = None if reference.base.bias is None else reference.base.bias.detach()
            A = reference.lora_A.detach()
            B = reference.lora_B.detach()
            self.W, self.b, self.A, self.B = W, b, A, B
            if recipe.startswith("bf16_"):
                self.W16 = W.to(low_dtype)
                self.b16 = None if b is None else b.to(low_dtype)
                # fp32 copies of the adapter (exact upcasts when the reference is already bf16)
                self.A32, self.B32 = A.float(), B.float()
            if recipe == "bf16_adapter":
                self.A16, self.B16 = A.to(low_dtype), B.to(low_dtype)
            if recipe == "bf16_merged":
                # D = s B A in fp32, added to the bf16 weight in fp32 and rounded once
                delta = (self.B32 @ self.A32) * self.scaling
                self.W_merged16 = (self.W16.float() + delta).to(low_dtype)
            if recipe == "bf16_exact_qv":
                self.W32 = W.float()
                self.b32 = None if b is None else b.float()
            if recipe == "round_base_weight":
                self.W_rounded = rnd(W, low_dtype)
            if recipe == "round_lora_weights":
                self.A_rounded, self.B_rounded = rnd(A, low_dtype), rnd(B, low_dtype)
            if recipe == "round_merged_weight":
                self.W_merged_rounded = rnd(W + (B @ A) * self.scaling, low_dtype)

    def _lora(self, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        # s * (x A^T) B^T, in PEFT's (and LoRALinear's) order of operations
        return F.linear(F.linear(x, A), B) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r, low = self.recipe, self.low
        W, b, A, B = self.W, self.b, self.A, self.B
        if r == "base_only":  # the host's own base projection: W and b in the input's dtype
            return F.linear(x, W.to(x.dtype), None if b is None else b.to(x.dtype))
        if not r.startswith("bf16_") and x.dtype != W.dtype:
            raise TypeError(f"recipe {r!r} needs the input in the reference dtype {W.dtype}, got {x.dtype}")
        if r == "exact":
            return F.linear(x, W, b) + self._lora(x, A, B)
        if r == "round_input":
            x = rnd(x, low)
            return F.linear(x, W, b) + self._lora(x, A, B)
        if r == "round_base_weight":
            return F.linear(x, self.W_rounded, b) + self._lora(x, A, B)
        if r == "round_base_out":
            return rnd(F.linear(x, W, b), low) + self._lora(x, A, B)
        if r == "round_lora_weights":
            return F.linear(x, W, b) + self._lora(x, self.A_rounded, self.B_rounded)
        if r == "round_lora_mid":
            return F.linear(x, W, b) + F.linear(rnd(F.linear(x, A), low), B) * self.scaling
        if r == "round_lora_out":
            return F.linear(x, W, b) + rnd(self._lora(x, A, B), low)
        if r == "round_sum":
            return rnd(F.linear(x, W, b) + self._lora(x, A, B), low)
        if r == "round_merged_weight":
            return F.linear(x, self.W_merged_rounded, b)

        host = x.dtype
        x16 = x.to(low)
        if r == "bf16_adapter":
            out = F.linear(x16, self.W16, self.b16) + self._lora(x16, self.A16, self.B16)
        elif r == "bf16_fp32_lora":
            # bf16 GEMM output (rounded) + fp32 branch -> the sum is formed in fp32, then rounded once
            out = (F.linear(x16, self.W16, self.b16) + self._lora(x16.float(), self.A32, self.B32)).to(low)
        elif r == "bf16_merged":
            out = F.linear(x16, self.W_merged16, self.b16)
        elif r == "bf16_single_round":
            # products of bf16 numbers are exact in fp32; only the fp32 accumulation rounds (as in a
            # bf16 GEMM with an fp32 accumulator), then one rounding of the whole sum to bf16
            x32 = x16.float()
            b32 = None if self.b16 is None else self.b16.float()
            out = (F.linear(x32, self.W16.float(), b32) + self._lora(x32, self.A32, self.B32)).to(low)
        else:  # bf16_exact_qv
            x32 = x16.float()
            out = (F.linear(x32, self.W32, self.b32) + self._lora(x32, self.A32, self.B32)).to(low)
        return out.to(host)

    def extra_repr(self) -> str:
        return f"recipe={self.recipe!r}, low_dtype={self.low}"


@contextmanager
def projections_swapped(
    host: nn.Module, reference: nn.Module, recipe: str, low_dtype: torch.dtype = torch.bfloat16
) -> Iterator[nn.Module]:
    """Within the block, every LoRALinear of ``host`` is computed by ``recipe`` from the LoRALinear
    of the same name in ``reference`` (which may be ``host`` itself). Restored afterwards."""
    host_layers = dict(lora_layers(host))
    ref_layers = dict(lora_layers(reference))
    if not host_layers:
        raise ValueError(f"host {type(host).__name__} carries no LoRA layer to swap")
    if set(host_layers) != set(ref_layers):
        missing = sorted(set(host_layers) ^ set(ref_layers))
        raise ValueError(f"host and reference carry LoRA at different modules, e.g. {missing[0]}")
    swapped = {name: RoundedLoRAProjection(ref_layers[name], recipe, low_dtype) for name in host_layers}
    try:
        for name, module in swapped.items():
            replace_module(host, name, module)
        yield host
    finally:
        for name, layer in host_layers.items():
            replace_module(host, name, layer)


# --------------------------------------------------------------------------------------------
# Logits, losses and position-wise comparisons
# --------------------------------------------------------------------------------------------


def random_token_batch(vocab_size: int, batch: int, length: int, seed: int = 0, device="cpu") -> dict:
    """``batch`` sequences of ``length`` token ids drawn uniformly from the vocabulary (no padding)."""
    if min(vocab_size, batch, length) <= 0:
        raise ValueError(f"vocab_size, batch and length must be positive, got {vocab_size}, {batch}, {length}")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": ids.clone().to(device)}


@torch.no_grad()
def per_position_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of position t predicting labels[t+1] (batch x seq; NaN where there is no target).

    The mean over the finite entries is transformers' causal-LM loss (labels -100 are ignored).
    """
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on batch x seq")
    target = F.pad(labels, (0, 1), value=-100)[:, 1:]
    loss = F.cross_entropy(
        logits.float().flatten(0, 1), target.flatten(), ignore_index=-100, reduction="none"
    ).view_as(target)
    return loss.masked_fill(target == -100, float("nan"))


@dataclass
class PositionDiff:
    """Per-position comparison of two logit tensors (all tensors: batch x seq, on the CPU)."""

    max_abs: torch.Tensor     # max over the vocabulary of |logits - ref|
    mean_abs: torch.Tensor    # mean over the vocabulary of |logits - ref|
    top1_agree: torch.Tensor  # argmax equal (bool)


@torch.no_grad()
def compare_logits(logits: torch.Tensor, ref: torch.Tensor, chunk: int = 1) -> PositionDiff:
    """Position-wise |diff| statistics of ``logits`` against ``ref`` (same shape), ``chunk`` rows at a time."""
    if logits.shape != ref.shape:
        raise ValueError(f"cannot compare logits of shape {tuple(logits.shape)} with {tuple(ref.shape)}")
    maxes, means, agree = [], [], []
    for i in range(0, logits.shape[0], chunk):
        a, b = logits[i:i + chunk].float(), ref[i:i + chunk].float()
        d = (a - b).abs_()
        maxes.append(d.amax(-1).cpu())
        means.append(d.mean(-1).cpu())
        agree.append((a.argmax(-1) == b.argmax(-1)).cpu())
    return PositionDiff(torch.cat(maxes), torch.cat(means), torch.cat(agree))


def summarise_positions(values: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    """mean, median, p99 and max of a per-position statistic over the positions where ``mask`` is set."""
    v = values.flatten().double()
    if mask is not None:
        v = v[mask.flatten().bool().cpu()]
    v = v[~torch.isnan(v)]
    if v.numel() == 0:
        raise ValueError("no positions to summarise (empty mask)")
    return {
        "mean": float(v.mean()),
        "p50": float(torch.quantile(v, 0.5)),
        "p99": float(torch.quantile(v, 0.99)),
        "max": float(v.max()),
        "n": int(v.numel()),
    }


def logit_comparison(
    logits: torch.Tensor, ref: torch.Tensor, batch: Mapping[str, torch.Tensor]
) -> dict[str, float]:
    """The article's comparison of two models on one batch: max |diff| over every position (padding
    included) and over real tokens only, mean |diff| over real tokens, top-1 agreement and flips on
    real tokens, and each model's causal-LM loss."""
    diff = compare_logits(logits, ref)
    mask = batch.get("attention_mask")
    real = torch.ones_like(diff.top1_agree) if mask is None else mask.bool().cpu()
    labels = batch.get("labels", batch["input_ids"])
    loss_a, loss_ref = per_position_loss(logits, labels), per_position_loss(ref, labels)
    return {
        "max_abs_all": float(diff.max_abs.max()),
        "max_abs_real": float(diff.max_abs[real].max()),
        "mean_abs_real": float(diff.mean_abs[real].double().mean()),
        "top1_agree_real": float(diff.top1_agree[real].double().mean()),
        "top1_flips_real": int((~diff.top1_agree[real]).sum()),
        "n_real": int(real.sum()),
        "n_positions": int(real.numel()),
        "loss": float(loss_a[~torch.isnan(loss_a)].double().mean()),
        "loss_ref": float(loss_ref[~torch.isnan(loss_ref)].double().mean()),
        "max_abs_logit_real": float(ref.abs().amax(-1).cpu()[real].max()),
    }


# --------------------------------------------------------------------------------------------
# Merging into bf16: vanishing entries, PEFT's safe_merge
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def vanishing_entries(weight_low: torch.Tensor, delta: torch.Tensor) -> tuple[int, int]:
    """(vanished, nonzero): entries with delta != 0 for which round(weight + delta) == weight.

    ``weight_low`` is the low-precision weight (e.g. bf16), ``delta`` the fp32 update s B A; the sum
    is formed in fp32 and rounded once, as PEFT's default merge and ``LoRALinear.merge`` do.
    """
    if weight_low.shape != delta.shape:
        raise ValueError(f"weight {tuple(weight_low.shape)} and delta {tuple(delta.shape)} differ in shape")
    if weight_low.dtype == torch.float32 or not weight_low.is_floating_point():
        raise ValueError(f"weight_low must be a low-precision float tensor, got {weight_low.dtype}")
    merged = (weight_low.float() + delta.float()).to(weight_low.dtype)
    nonzero = delta != 0
    vanished = (merged == weight_low) & nonzero
    return int(vanished.sum()), int(nonzero.sum())


@torch.no_grad()
def model_vanishing_share(model: nn.Module, low_dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Over every LoRA layer of an (fp32) model: how many entries of s B A vanish in ``low_dtype`` W."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} carries no LoRA layer")
    vanished = nonzero = total = 0
    for _, layer in layers:
        delta = layer.delta_weight(torch.float32)
        v, n = vanishing_entries(layer.base.weight.to(low_dtype), delta)
        vanished, nonzero, total = vanished + v, nonzero + n, total + delta.numel()
    return {"vanished": vanished, "nonzero": nonzero, "total": total, "share": vanished / max(nonzero, 1)}


@torch.no_grad()
def peft_merged_model(peft_model, safe_merge: bool) -> nn.Module:
    """A merged plain model from a deep copy of a PEFT LoRA model (the input is untouched):
    ``merge_and_unload(safe_merge=...)``. With an fp32 adapter on a bf16 base, the default merge adds
    the fp32 delta into W in fp32 and rounds once; ``safe_merge`` casts the delta to bf16 first and
    rounds the sum again."""
    from peft.tuners.lora import LoraLayer

    work = copy.deepcopy(peft_model)
    if not any(isinstance(m, LoraLayer) for m in work.modules()):
        raise ValueError("the PEFT model has no LoRA layer")
    return work.merge_and_unload(safe_merge=safe_merge)


@torch.no_grad()
def peft_merged_weights(peft_model, safe_merge: bool) -> dict[str, torch.Tensor]:
    """The merged weights of a PEFT LoRA model's targets (see ``peft_merged_model``), keyed like
    lora_lab's module names ("model.layers.0.self_attn.q_proj")."""
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    names = [n[len(prefix):] if n.startswith(prefix) else n
             for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)]
    merged = peft_merged_model(peft_model, safe_merge)
    return {n: merged.get_submodule(n).weight.detach().clone() for n in names}


@torch.no_grad()
def low_precision_merged_weights(model: nn.Module, low_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """lora_lab's merge of an fp32 LoRA model into a ``low_dtype`` base: round(W16 + D) with D = s B A
    formed in fp32 and the sum formed in fp32 (``LoRALinear.merge`` on the low-precision base)."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} carries no LoRA layer")
    return {
        name: (layer.base.weight.to(low_dtype).float() + layer.delta_weight(torch.float32)).to(low_dtype)
        for name, layer in layers
    }


# --------------------------------------------------------------------------------------------
# The drift experiments
# --------------------------------------------------------------------------------------------

# name -> (host, recipe). host "fp32": the fp32 adapter model itself, so only the q/v projections
# change; host "low": a bf16 copy of it, so everything else is rounded as well.
DRIFT_VARIANTS: dict[str, tuple[str, str]] = {
    "exact": ("fp32", "exact"),
    "inj_input": ("fp32", "round_input"),
    "inj_base_weight": ("fp32", "round_base_weight"),
    "inj_base_out": ("fp32", "round_base_out"),
    "inj_lora_weights": ("fp32", "round_lora_weights"),
    "inj_lora_mid": ("fp32", "round_lora_mid"),
    "inj_lora_out": ("fp32", "round_lora_out"),
    "inj_sum": ("fp32", "round_sum"),
    "inj_merged_weight": ("fp32", "round_merged_weight"),
    "qv_bf16_adapter": ("fp32", "bf16_adapter"),
    "qv_bf16_fp32_lora": ("fp32", "bf16_fp32_lora"),
    "qv_bf16_merged": ("fp32", "bf16_merged"),
    "qv_bf16_single_round": ("fp32", "bf16_single_round"),
    "full_bf16_adapter": ("low", "bf16_adapter"),
    "full_bf16_fp32_lora": ("low", "bf16_fp32_lora"),
    "full_bf16_merged": ("low", "bf16_merged"),
    "full_bf16_single_round": ("low", "bf16_single_round"),
    "full_bf16_exact_qv": ("low", "bf16_exact_qv"),
}
FLOOR = "floor_bf16_base"  # bf16 base model vs fp32 base model, both without the adapter


@dataclass
class DriftResult:
    """One variant against its reference, per position (batch x seq tensors on the CPU)."""

    name: str
    diff: PositionDiff
    loss: torch.Tensor  # per-position loss of the variant (NaN where no target)
    logits: torch.Tensor | None = field(default=None, repr=False)

    def summary(self, mask: torch.Tensor | None = None) -> dict[str, float]:
        s = summarise_positions(self.diff.max_abs, mask)
        m = torch.ones_like(self.diff.top1_agree) if mask is None else mask.bool().cpu()
        loss = self.loss[m]
        return {
            "mean": s["mean"], "p50": s["p50"], "p99": s["p99"], "max": s["max"], "n": s["n"],
            "elem_mean": float(self.diff.mean_abs[m].double().mean()),
            "top1_agree": float(self.diff.top1_agree[m].double().mean()),
            "loss": float(loss[~torch.isnan(loss)].double().mean()),
        }


@torch.no_grad()
def run_drift_experiments(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    variants: Sequence[str] | None = None,
    low_dtype: torch.dtype = torch.bfloat16,
    include_floor: bool = True,
    keep_logits: Sequence[str] = (),
) -> dict[str, DriftResult]:
    """Run each drift variant on ``batch`` and compare with the fp32 adapter model ``model``.

    ``model`` must be an fp32 model carrying LoRALinear layers (the reference). Variants on the
    "low" host run on a ``low_dtype`` copy of it. The floor compares the ``low_dtype`` base model with
    the fp32 base model (adapter removed from both). ``keep_logits`` names variants whose logits are
    returned too (fp32, on the model's device); "reference" keeps the reference logits.
    """
    names = list(DRIFT_VARIANTS) if variants is None else list(variants)
    unknown = [n for n in names if n not in DRIFT_VARIANTS]
    if unknown:
        raise ValueError(f"unknown drift variant {unknown[0]!r}; known: {', '.join(DRIFT_VARIANTS)}")
    if not lora_layers(model):
        raise ValueError("the reference model carries no LoRALinear layer")
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:
        raise ValueError(f"the reference model must be fp32, found parameter dtypes {sorted(map(str, dtypes))}")
    was_training = model.training
    model.eval()
    labels = batch.get("labels", batch["input_ids"])
    ref = model_logits(model, batch)
    results: dict[str, DriftResult] = {}
    if "reference" in keep_logits:
        results["reference"] = DriftResult(
            "reference", compare_logits(ref, ref), per_position_loss(ref, labels).cpu(), ref
        )
    low_host = None
    if any(DRIFT_VARIANTS[n][0] == "low" for n in names) or include_floor:
        low_host = copy.deepcopy(model).to(low_dtype).eval()
    for name in names:
        host_kind, recipe = DRIFT_VARIANTS[name]
        host = model if host_kind == "fp32" else low_host
        with projections_swapped(host, model, recipe, low_dtype):
            logits = model_logits(host, batch)
        results[name] = DriftResult(
            name, compare_logits(logits, ref), per_position_loss(logits, labels).cpu(),
            logits if name in keep_logits else None,
        )
        del logits
    if include_floor:
        with projections_swapped(model, model, "base_only", low_dtype):
            base_ref = model_logits(model, batch)
        with projections_swapped(low_host, model, "base_only", low_dtype):
            base_low = model_logits(low_host, batch)
        results[FLOOR] = DriftResult(FLOOR, compare_logits(base_low, base_ref),
                                     per_position_loss(base_low, labels).cpu())
        del base_ref, base_low
    del low_host
    model.train(was_training)
    return results


def drift_verdict(ratio: float, low: float, high: float, margin: float = 1.1) -> str:
    """The pre-declared decision rule for 'does the bf16 adapter model drift further than the merged one?'

    ``ratio`` = mean drift (adapter) / mean drift (merged) with its bootstrap CI [low, high]:
    "adapter drifts further" if low > margin; "merged drifts further" if high < 1 / margin;
    otherwise "no systematic difference".
    """
    if not (math.isfinite(low) and math.isfinite(high) and low <= ratio <= high):
        raise ValueError(f"inconsistent ratio and interval: {ratio} in [{low}, {high}]?")
    if low > margin:
        return "adapter drifts further"
    if high < 1 / margin:
        return "merged drifts further"
    return "no systematic difference"

"""VeRA (Kopiczko et al. 2024): one pair of frozen random matrices shared by every adapted layer, and two
trainable vectors per layer.

    h = W x + b + lambda_b * (B_s ((lambda_d * (A_s x))))      A: r x in_max,  B: out_max x r  (shared, frozen)

A_s = A[:, :in] and B_s = B[:out, :] are the slices that fit the layer; lambda_d (r) scales the rank
dimension, lambda_b (out) the output. As PEFT 0.21's ``VeraConfig`` builds them: A and B are Kaiming-uniform
(gain sqrt(2), fan = the number of columns) drawn one after the other from ``torch.Generator().manual_seed(
projection_prng_key)`` on the CPU in fp32, sized for the largest targeted layer; lambda_b starts at 0 (so a
fresh layer computes W x + b) and lambda_d at ``d_initial``. The merged weight is W + (lambda_b * B_s)
(lambda_d * A_s), the vectors broadcast over rows.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lora_lab.adapter_layer import AdapterLinear, adapter_layers, install_adapter_layers, resolve_adapter_dtype
from lora_lab.dtypes import as_float_dtype
from lora_lab.targets import _matched_linears

__all__ = ["VeRALinear", "add_vera", "vera_layers", "vera_projections"]


def vera_projections(r: int, in_features: int, out_features: int, projection_prng_key: int = 0,
                     model_dtype: torch.dtype = torch.float32):
    """The shared (A, B) = (r x in, out x r), drawn as PEFT draws them (see the module docstring), in fp32 and
    rounded to ``model_dtype`` (PEFT casts them to the base layer's dtype before it widens the adapter to fp32)."""
    generator = torch.Generator(device="cpu").manual_seed(projection_prng_key)

    def kaiming(shape):
        bound = math.sqrt(3.0) * math.sqrt(2) / math.sqrt(shape[1])  # gain sqrt(2), fan_in = columns
        return torch.empty(shape).uniform_(-bound, bound, generator=generator)

    a = kaiming((r, in_features))
    b = kaiming((out_features, r))
    if model_dtype in (torch.bfloat16, torch.float16):
        a, b = a.to(model_dtype).float(), b.to(model_dtype).float()
    return a, b


class VeRALinear(AdapterLinear):
    """``h = base(x) + lambda_b * F.linear(lambda_d * F.linear(dropout(x), A_s), B_s)`` around a frozen
    ``nn.Linear``; ``vera_A``/``vera_B`` are the shared projections (buffers, not saved with the module),
    ``lambda_b``/``lambda_d`` the trainable vectors, on the base weight's device, in the dtype of ``vera_A``
    (``add_vera`` puts the projections and vectors in fp32 on a bf16/fp16 model, as PEFT does, unless
    ``adapter_dtype`` says otherwise). The branch runs in that dtype; the output is rounded once to the input's
    dtype."""

    kind = "VeRA"

    def __init__(self, base: nn.Linear, vera_A: torch.Tensor, vera_B: torch.Tensor, dropout: float = 0.0,
                 d_initial: float = 0.1):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"VeRALinear wraps an nn.Linear, got {type(base).__name__}")
        r = vera_A.shape[0]
        if vera_B.shape[1] != r or vera_A.shape[1] < base.in_features or vera_B.shape[0] < base.out_features:
            raise ValueError(
                f"VeRA projections A {tuple(vera_A.shape)}, B {tuple(vera_B.shape)} do not cover a "
                f"{base.in_features} -> {base.out_features} layer with one rank"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"VeRA dropout must be in [0, 1), got {dropout!r}")
        self.base = base
        self.r = r
        self.dropout_p = float(dropout)
        self.in_features, self.out_features = base.in_features, base.out_features
        w = base.weight
        self.register_buffer("vera_A", vera_A, persistent=False)
        self.register_buffer("vera_B", vera_B, persistent=False)
        dtype = vera_A.dtype
        self.lambda_b = nn.Parameter(torch.zeros(base.out_features, device=w.device, dtype=dtype))
        self.lambda_d = nn.Parameter(torch.full((r,), float(d_initial), device=w.device, dtype=dtype))
        for p in self.base.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        if self.dropout_p > 0 and self.training:
            x = F.dropout(x, p=self.dropout_p, training=True)
        a = self.vera_A[:, : self.in_features]
        b = self.vera_B[: self.out_features, :]
        x = x.to(a.dtype)  # fp32 adapter on a bf16 model: the branch in fp32, one rounding at the end (PEFT's order)
        return (result + self.lambda_b * F.linear(self.lambda_d * F.linear(x, a), b)).to(result.dtype)

    @torch.no_grad()
    def merge(self, compute_dtype: torch.dtype | str = torch.float32) -> nn.Linear:
        """A plain ``nn.Linear`` with W' = W + (lambda_b * B_s) (lambda_d * A_s), formed in ``compute_dtype`` (a dtype
        or a name such as "fp32")."""
        compute_dtype = as_float_dtype(compute_dtype, "compute_dtype")
        w = self.base.weight
        a = self.vera_A[:, : self.in_features].to(compute_dtype)
        b = self.vera_B[: self.out_features, :].to(compute_dtype)
        delta = (self.lambda_b.to(compute_dtype)[:, None] * b) @ (self.lambda_d.to(compute_dtype)[:, None] * a)
        merged_w = (w.to(compute_dtype) + delta).to(w.dtype)
        if not torch.isfinite(merged_w).all():
            raise FloatingPointError(f"merging VeRA into a {tuple(w.shape)} weight produced non-finite values")
        out = nn.Linear(self.in_features, self.out_features, bias=self.base.bias is not None,
                        device=w.device, dtype=w.dtype)
        out.weight.copy_(merged_w)
        if self.base.bias is not None:
            out.bias.copy_(self.base.bias)
        out.requires_grad_(False)
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, "
                f"dropout={self.dropout_p}")


def vera_layers(model: nn.Module) -> list[tuple[str, VeRALinear]]:
    """All VeRA layers of a model, with their module names."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, VeRALinear)]


def add_vera(
    model: nn.Module,
    r: int = 256,
    targets: Sequence[str] | str = ("q_proj", "v_proj"),
    dropout: float = 0.0,
    exclude: Sequence[str] | str | None = None,
    *,
    projection_prng_key: int = 0,
    d_initial: float = 0.1,
    adapter_dtype: torch.dtype | str | None = None,
) -> nn.Module:
    """Freeze ``model`` and wrap every ``nn.Linear`` matching ``targets`` (minus ``exclude``, PEFT's rules as in
    ``add_lora``) in a VeRALinear sharing one pair of projections sized for the largest of them. Defaults are
    ``VeraConfig``'s (r=256, projection_prng_key=0, d_initial=0.1). All targets come in one call: a model that
    already has VeRA layers is refused (their projections could not grow). ``adapter_dtype``: the dtype of the
    projections and trainable vectors, as in ``add_lora`` (default: fp32 on a bf16/fp16 model, else the weight's).
    Returns the model, changed in place.
    """
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(f"VeRA rank r must be a positive integer, got r={r!r}")
    if isinstance(projection_prng_key, bool) or not isinstance(projection_prng_key, int):
        raise TypeError(f"projection_prng_key must be an integer, got projection_prng_key={projection_prng_key!r}")
    if isinstance(d_initial, bool) or not isinstance(d_initial, (int, float)) or not math.isfinite(d_initial):
        raise ValueError(f"d_initial must be a finite number, got d_initial={d_initial!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"VeRA dropout must be in [0, 1), got {dropout!r}")
    if adapter_dtype is not None:
        as_float_dtype(adapter_dtype, "adapter_dtype")
    lora = [n for n, m in adapter_layers(model) if not isinstance(m, VeRALinear)]
    if lora:
        raise ValueError(f"{type(model).__name__} carries LoRA layers ({lora[0]}, ...); LoRA and VeRA do not mix in "
                         "one model (an adapter file holds one kind)")
    if vera_layers(model):
        raise ValueError(
            f"{type(model).__name__} already has VeRA layers; VeRA's projections are shared and sized for every "
            "target at once: pass all targets to one add_vera call"
        )
    _, _, matched = _matched_linears(model, targets, exclude, "VeRALinear")
    out_max = max(m.out_features for _, m in matched)
    in_max = max(m.in_features for _, m in matched)
    w = matched[0][1].weight
    a, b = vera_projections(r, in_max, out_max, projection_prng_key, w.dtype)
    dtype = resolve_adapter_dtype(w.dtype, adapter_dtype)
    a, b = a.to(device=w.device, dtype=dtype), b.to(device=w.device, dtype=dtype)
    wrapped = [(n, VeRALinear(m, a, b, dropout=dropout, d_initial=d_initial)) for n, m in matched]
    install_adapter_layers(model, wrapped)
    model._lora_lab_vera = {"projection_prng_key": projection_prng_key, "d_initial": float(d_initial)}
    return model

"""The measurements notebook 05 reports about the fused LoRA kernels, as plain functions.

* :func:`linear_numerics`     — fused LoRA linear vs the fp64 reference: worst cosine and relative L2 errors
* :func:`shared_input_numerics` — the same for the shared-input op (GatedDeltaNet-like four projections)
* :func:`saved_bytes_per_linear` — bytes autograd keeps for backward: PEFT default vs fused
* :func:`patched_training_losses` — losses of a PEFT model trained unpatched and patched from the same start
* :func:`dora_is_refused`     — patch_model refuses DoRA and changes nothing
* :func:`benchmark_ratios`    — the ratios the GPU benchmarks wrote to CSV (benchmarks/bench_*.py)
"""
from __future__ import annotations

import copy
import csv
from pathlib import Path

import torch
from torch import nn

from lora_lab.kernels import (
    KernelConfig,
    UnsupportedLoRAError,
    dropout_keep_mask,
    fused_lora_linear,
    fused_shared_input_lora,
    lora_linear_reference,
    patch_model,
    patched_layers,
    shared_input_lora_reference,
)
from lora_lab.layer import SingleChild
from lora_lab.memory import saved_bytes_excluding
from lora_lab.numerics import cosine, rel_l2

__all__ = [
    "linear_numerics",
    "shared_input_numerics",
    "saved_bytes_per_linear",
    "patched_training_losses",
    "train_losses",
    "dora_is_refused",
    "benchmark_ratios",
]


def triton_everywhere() -> KernelConfig:
    """The kernels' own numerics, whatever engine a shape would be dispatched to (other settings as configured)."""
    return KernelConfig.from_env(dispatch="triton")


def _one_linear_case(M, K, N, r, dtype, device, bias, p, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(N, K, generator=g) / K**0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if bias else None
    A = (torch.randn(r, K, generator=g) / K**0.5).to(device, dtype).requires_grad_()
    B = (torch.randn(N, r, generator=g) / r**0.5).to(device, dtype).requires_grad_()
    dropout_seed = 1000 + seed
    y = fused_lora_linear(x, w, b, A, B, 2.0, dropout_p=p, seed=dropout_seed if p else None,
                          config=triton_everywhere())
    mask = dropout_keep_mask(dropout_seed, M, K, p, device) if p else None
    xr, Ar, Br = (t.detach().double().requires_grad_() for t in (x, A, B))
    yr = lora_linear_reference(xr, w, b, Ar, Br, 2.0, keep_mask=mask, dropout_p=p, dtype=torch.float64)
    gy = torch.randn(yr.shape, generator=g, dtype=torch.float64).to(device)
    y.backward(gy.to(dtype))
    yr.backward(gy)
    return {"fwd_cosine": cosine(y, yr), "y_rel_l2": rel_l2(y, yr), "dx_rel_l2": rel_l2(x.grad, xr.grad),
            "da_rel_l2": rel_l2(A.grad, Ar.grad), "db_rel_l2": rel_l2(B.grad, Br.grad)}


def linear_numerics(cases, dtype, device) -> dict:
    """Worst errors over ``cases`` = [(M, K, N, r, bias, dropout_p), ...]: min cosine, max relative L2s."""
    worst = {"fwd_cosine": 1.0, "y_rel_l2": 0.0, "dx_rel_l2": 0.0, "da_rel_l2": 0.0, "db_rel_l2": 0.0}
    rows = []
    for i, (M, K, N, r, bias, p) in enumerate(cases):
        res = _one_linear_case(M, K, N, r, dtype, device, bias, p, seed=i)
        rows.append({"M": M, "K": K, "N": N, "r": r, "bias": bias, "dropout": p, **res})
        worst["fwd_cosine"] = min(worst["fwd_cosine"], res["fwd_cosine"])
        for k in ("y_rel_l2", "dx_rel_l2", "da_rel_l2", "db_rel_l2"):
            worst[k] = max(worst[k], res[k])
    return {"worst": worst, "cases": rows}


def shared_input_numerics(lead, K, splits, ranks, dtype, device, seed=0) -> dict:
    """Shared-input op vs separate fp64 projections: worst output cosine and worst gradient relative L2."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, K, generator=g).to(device, dtype).requires_grad_()
    Ws = [(torch.randn(n, K, generator=g) / K**0.5).to(device, dtype) for n in splits]
    As = [(torch.randn(r, K, generator=g) / K**0.5).to(device, dtype).requires_grad_() if r else None for r in ranks]
    Bs = [(torch.randn(n, r, generator=g) / max(r, 1) ** 0.5).to(device, dtype).requires_grad_() if r else None
          for n, r in zip(splits, ranks)]
    scalings = [2.0] * len(splits)
    outs = fused_shared_input_lora(x, torch.cat(Ws), None, splits, As, Bs, scalings, config=triton_everywhere())
    xr = x.detach().double().requires_grad_()
    Ar = [a.detach().double().requires_grad_() if a is not None else None for a in As]
    Br = [b.detach().double().requires_grad_() if b is not None else None for b in Bs]
    refs = shared_input_lora_reference(xr, Ws, [None] * len(Ws), Ar, Br, scalings, dtype=torch.float64)
    gys = [torch.randn(r.shape, generator=g, dtype=torch.float64).to(device) for r in refs]
    sum((o * gy.to(dtype)).sum() for o, gy in zip(outs, gys)).backward()
    sum((r * gy).sum() for r, gy in zip(refs, gys)).backward()
    grad_errs = [rel_l2(x.grad, xr.grad)]
    for a, ar, b, br in zip(As, Ar, Bs, Br):
        if a is not None:
            grad_errs += [rel_l2(a.grad, ar.grad), rel_l2(b.grad, br.grad)]
    return {"fwd_cosine": min(cosine(o, r) for o, r in zip(outs, refs)), "grad_max_rel_l2": max(grad_errs)}


def saved_bytes_per_linear(M, K, N, r, dtype, device) -> dict:
    """Bytes saved for backward by one LoRA linear (parameters excluded), PEFT default (fp32 adapters) vs fused."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    lin = nn.Linear(K, N, bias=False, device=device, dtype=dtype)
    model = get_peft_model(SingleChild(lin, "proj"), LoraConfig(r=r, lora_alpha=2 * r, target_modules=["proj"]))
    fused = copy.deepcopy(model)
    patch_model(fused)
    x = torch.randn(M, K, device=device, dtype=dtype, requires_grad=True)
    params = list(model.parameters()) + list(fused.parameters())
    peft_bytes = saved_bytes_excluding(lambda: model(x), params + [x])
    fused_bytes = saved_bytes_excluding(lambda: fused(x), params + [x])
    x_bytes = x.numel() * x.element_size()
    # X itself is saved by both (excluded above, as the layer's input is kept by whoever produced it anyway):
    # count it once for each so the ratio compares what each layer keeps alive
    return {"peft": peft_bytes + x_bytes, "fused": fused_bytes + x_bytes,
            "adapter_dtype": str(model.base_model.model.proj.lora_A["default"].weight.dtype)}


def train_losses(model, ids, steps, lr=1e-3) -> list[float]:
    """``steps`` AdamW steps of a causal LM on one batch (``ids`` as inputs and labels); the loss of each step."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def patched_training_losses(model, ids, steps, lr=1e-3) -> tuple[list[float], list[float]]:
    """Train a copy unpatched and a copy patched from the same weights (train mode); returns both loss lists."""
    fused = copy.deepcopy(model)
    patch_model(fused, config=triton_everywhere())  # the Triton kernels, not the small-shape cuBLAS dispatch
    model.train()
    fused.train()
    ref_losses = train_losses(model, ids, steps, lr)
    fused_losses = train_losses(fused, ids, steps, lr)
    return ref_losses, fused_losses


def dora_is_refused(model_factory) -> bool:
    """True iff patch_model raises UnsupportedLoRAError naming DoRA and leaves every layer unpatched."""
    model = model_factory()
    try:
        patch_model(model)
    except UnsupportedLoRAError as err:
        return "DoRA" in str(err) and patched_layers(model) == []
    return False


def _read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def benchmark_ratios(directory) -> dict:
    """Ratios from the benchmark CSVs in ``directory`` (those present); keys are notebook 05's metric names."""
    d = Path(directory)
    out = {}
    p = d / "05_lora_linear.csv"
    if p.exists():
        rows = _read_csv(p)

        def cell(M, K, N, r, variant):
            for row in rows:
                if (int(row["M"]), int(row["K"]), int(row["N"]), int(row["r"]), row["variant"]) == (M, K, N, r, variant):
                    return row
            return None

        fused, peft, base = (cell(32768, 4096, 4096, 16, v) for v in ("fused", "peft", "base"))
        if fused and peft and base:
            out["lora_linear_time_vs_base_32k_4096x4096_r16"] = float(fused["time_vs_base"])
            out["lora_linear_peak_vs_base_32k_4096x4096_r16"] = float(fused["peak_vs_base"])
            out["lora_linear_speedup_vs_peft_32k_4096x4096_r16"] = float(peft["fwd_bwd_ms"]) / float(fused["fwd_bwd_ms"])
            out["peft_time_vs_base_32k_4096x4096_r16"] = float(peft["time_vs_base"])
        fused_rows = [r for r in rows if r["variant"] == "fused"]
        if fused_rows:
            out["lora_linear_worst_time_vs_base"] = max(float(r["time_vs_base"]) for r in fused_rows)
            out["lora_linear_cells"] = len(fused_rows)
    p = d / "05_gated_deltanet.csv"
    if p.exists():
        rows = {r["variant"]: r for r in _read_csv(p)}
        if {"fused", "base", "peft"} <= rows.keys():
            out["gdn_time_vs_base"] = float(rows["fused"]["time_vs_base"])
            out["gdn_speedup_vs_peft"] = float(rows["fused"]["speedup_vs_peft"])
            out["gdn_saved_gib_less_than_peft"] = float(rows["fused"]["saved_bytes_less_than_peft"]) / 2**30
            out["gdn_peft_time_vs_base"] = float(rows["peft"]["time_vs_base"])
    p = d / "05_train_step.csv"
    if p.exists():
        rows = _read_csv(p)
        for model, key in (("qwen3-4096", "qwen3_4096"), ("qwen2.5-0.5b", "qwen2_5_0_5b")):
            f = [r for r in rows if r["model"] == model and r["variant"] == "fused"]
            if f:
                out[f"train_speedup_vs_peft_{key}"] = float(f[0]["tokens_per_s_vs_peft"])
                out[f"train_peak_vs_peft_{key}"] = float(f[0]["peak_vs_peft"])
    return out

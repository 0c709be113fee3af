"""Shared-input LoRA projections (lora_lab.kernels.lora.shared_input) against separate plain-torch projections.

CPU: interpreter, fp32/fp16, odd widths, segments without LoRA, outputs without gradient, M = 0.
GPU (@pytest.mark.gpu): bf16 at GatedDeltaNet-like proportions.
"""
import pytest
import torch

from lora_lab.kernels.lora.shared_input import fused_shared_input_lora, shared_input_lora_reference
from lora_lab.numerics import rel_l2

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _triton_engine(monkeypatch):
    # these tests are about the Triton kernels: no small-shape dispatch to cuBLAS, and the one-Triton-GEMM form
    # (the shipped cuBLAS-base form and the small-shape engine are tested on their own below)
    monkeypatch.setenv("LORA_LAB_DISPATCH", "triton")
    monkeypatch.setenv("LORA_LAB_BASE_GEMM", "triton")
TOL = {
    torch.float32: {"y": 1e-5, "dx": 1e-5, "dA": 1e-5, "dB": 1e-5},
    torch.float16: {"y": 2e-3, "dx": 1e-2, "dA": 5e-3, "dB": 5e-3},
    torch.bfloat16: {"y": 1e-2, "dx": 1e-2, "dA": 5e-3, "dB": 5e-3},
}



def build(lead, K, splits, ranks, dtype, bias=True, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, K, generator=g).to(device, dtype)
    Ws = [(torch.randn(n, K, generator=g) / K**0.5).to(device, dtype) for n in splits]
    bs = [torch.randn(n, generator=g).to(device, dtype) if bias else None for n in splits]
    As = [(torch.randn(r, K, generator=g) / K**0.5).to(device, dtype).requires_grad_() if r else None for r in ranks]
    Bs = [(torch.randn(n, r, generator=g) / max(r, 1) ** 0.5).to(device, dtype).requires_grad_() if r else None
          for n, r in zip(splits, ranks)]
    return x, Ws, bs, As, Bs


def check(x, Ws, bs, As, Bs, scalings, tol, grad_mask=None):
    x = x.detach().requires_grad_()
    bias_cat = torch.cat(bs) if bs[0] is not None else None
    outs = fused_shared_input_lora(x, torch.cat(Ws), bias_cat, [w.shape[0] for w in Ws], As, Bs, scalings)
    xr = x.detach().double().requires_grad_()
    Ar = [a.detach().double().requires_grad_() if a is not None else None for a in As]
    Br = [b.detach().double().requires_grad_() if b is not None else None for b in Bs]
    refs = shared_input_lora_reference(xr, Ws, bs, Ar, Br, scalings, dtype=torch.float64)
    grad_mask = grad_mask or [True] * len(Ws)
    gen = torch.Generator().manual_seed(11)
    gs = [torch.randn(r.shape, generator=gen, dtype=torch.float64).to(r.device) for r in refs]
    for o, r in zip(outs, refs):
        assert o.shape == r.shape and o.dtype == x.dtype
        assert rel_l2(o, r) <= tol["y"]
    used = [i for i, m in enumerate(grad_mask) if m]
    if not used:
        return outs
    sum((outs[i] * gs[i].to(x.dtype)).sum() for i in used).backward()
    sum((refs[i] * gs[i]).sum() for i in used).backward()
    if x.numel():
        assert rel_l2(x.grad, xr.grad) <= tol["dx"]
    for a, ar, b, br in zip(As, Ar, Bs, Br):
        if a is None:
            continue
        if ar.grad is None:  # output without gradient: zero LoRA gradients
            assert torch.count_nonzero(a.grad) == 0 and torch.count_nonzero(b.grad) == 0
            continue
        if x.numel():
            assert rel_l2(a.grad, ar.grad) <= tol["dA"]
            assert rel_l2(b.grad, br.grad) <= tol["dB"]
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_four_segments_like_gated_deltanet(dtype):
    # in_proj_qkv / z / b / a proportions: two wide, two tiny; one segment without LoRA
    x, Ws, bs, As, Bs = build((2, 19), 40, [72, 36, 5, 5], [8, 0, 1, 16], dtype)
    check(x, Ws, bs, As, Bs, [2.0, 1.0, 0.5, 3.0], TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_qkv_and_gate_up(dtype):
    x, Ws, bs, As, Bs = build((37,), 48, [48, 16, 16], [4, 4, 4], dtype)
    check(x, Ws, bs, As, Bs, [2.0, 2.0, 2.0], TOL[dtype])
    x, Ws, bs, As, Bs = build((33,), 36, [50, 50], [128, 2], dtype, bias=False)
    check(x, Ws, bs, As, Bs, [0.25, 4.0], TOL[dtype])


def test_outputs_without_gradient_and_zero_rows():
    x, Ws, bs, As, Bs = build((25,), 32, [40, 24, 8], [4, 2, 3], torch.float32)
    check(x, Ws, bs, As, Bs, [1.0, 1.0, 1.0], TOL[torch.float32], grad_mask=[True, False, True])
    x, Ws, bs, As, Bs = build((0,), 32, [40, 24], [4, 2], torch.float32)
    check(x, Ws, bs, As, Bs, [1.0, 1.0], TOL[torch.float32])


def test_non_contiguous_input():
    big = torch.randn(3, 11, 64, device=DEVICE)
    x = big[..., ::2]
    _, Ws, bs, As, Bs = build((1,), 32, [20, 12], [3, 5], torch.float32)
    check(x, Ws, bs, As, Bs, [1.0, 2.0], TOL[torch.float32])


def test_bad_inputs_are_named():
    x, Ws, bs, As, Bs = build((4,), 16, [8, 8], [2, 2], torch.float32)
    W = torch.cat(Ws)
    with pytest.raises(ValueError, match="rows"):
        fused_shared_input_lora(x, W[:15], None, [8, 8], As, Bs, [1.0, 1.0])
    with pytest.raises(ValueError, match="one entry per segment"):
        fused_shared_input_lora(x, W, None, [8, 8], As[:1], Bs, [1.0, 1.0])
    with pytest.raises(ValueError, match="only one of"):
        fused_shared_input_lora(x, W, None, [8, 8], [As[0], None], Bs, [1.0, 1.0])
    with pytest.raises(ValueError, match="frozen"):
        fused_shared_input_lora(x, W.requires_grad_(), None, [8, 8], As, Bs, [1.0, 1.0])
    with pytest.raises(ValueError, match="last dimension"):
        fused_shared_input_lora(x[:, :15], W.detach(), None, [8, 8], As, Bs, [1.0, 1.0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_gated_deltanet_proportions(dtype):
    # hidden 1024 stand-in for 4096: qkv 2048, z 1024, b 8, a 8; LoRA r=16 on all four
    x, Ws, bs, As, Bs = build((2, 999), 1024, [2048, 1024, 8, 8], [16, 16, 16, 16], dtype, bias=False,
                              device="cuda")
    check(x, Ws, bs, As, Bs, [2.0] * 4, TOL[dtype])


@pytest.mark.gpu
def test_gpu_qkv_bias_odd():
    x, Ws, bs, As, Bs = build((1531,), 896, [896, 128, 128], [8, 0, 8], torch.bfloat16, device="cuda")
    check(x, Ws, bs, As, Bs, [2.0, 1.0, 2.0], TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_side_stream_overlap(monkeypatch):
    monkeypatch.setenv("LORA_LAB_OVERLAP", "1")
    x, Ws, bs, As, Bs = build((1, 1500), 512, [1024, 512, 8, 8], [16, 16, 16, 0], torch.bfloat16, bias=False,
                              device="cuda")
    check(x, Ws, bs, As, Bs, [2.0] * 4, TOL[torch.bfloat16])


def check_edge_cases_fp32():
    """Segments without LoRA, outputs without gradient, bias and none, M = 0 — fp32 against the reference."""
    x, Ws, bs, As, Bs = build((2, 19), 40, [72, 36, 5, 5], [8, 0, 1, 16], torch.float32)
    check(x, Ws, bs, As, Bs, [2.0, 1.0, 0.5, 3.0], TOL[torch.float32])
    x, Ws, bs, As, Bs = build((25,), 32, [40, 24, 8], [4, 2, 3], torch.float32, bias=False)
    check(x, Ws, bs, As, Bs, [1.0, 1.0, 1.0], TOL[torch.float32], grad_mask=[True, False, True])
    x, Ws, bs, As, Bs = build((0,), 32, [40, 24], [4, 2], torch.float32)
    check(x, Ws, bs, As, Bs, [1.0, 1.0], TOL[torch.float32])


def test_cublas_engine_matches_reference(monkeypatch):
    # the small-shape engine (cuBLAS calls)
    monkeypatch.setenv("LORA_LAB_DISPATCH", "cublas")
    check_edge_cases_fp32()


@pytest.mark.gpu
def test_gpu_bf16_cublas_engine(monkeypatch):
    monkeypatch.setenv("LORA_LAB_DISPATCH", "cublas")
    x, Ws, bs, As, Bs = build((1531,), 896, [896, 128, 128], [8, 0, 8], torch.bfloat16, device="cuda")
    check(x, Ws, bs, As, Bs, [2.0, 1.0, 2.0], TOL[torch.bfloat16])


@pytest.mark.parametrize("narrow", [16, 0], ids=["narrow16", "all_wide"])
def test_cublas_base_gemm_option(monkeypatch, narrow):
    # LORA_LAB_BASE_GEMM=cublas: rank-r term (and narrow dY_i) written by Triton, wide GEMMs added by cuBLAS
    from lora_lab.kernels.lora import shared_input as lora_shared_input

    monkeypatch.setenv("LORA_LAB_BASE_GEMM", "cublas")
    monkeypatch.setattr(lora_shared_input, "_NARROW_SEGMENT", narrow)
    check_edge_cases_fp32()


@pytest.mark.gpu
@pytest.mark.parametrize("base_gemm,ranks", [("cublas", [16, 16, 16, 16]), ("merged", [16, 16, 0, 16])])
def test_gpu_bf16_base_gemm_options(monkeypatch, base_gemm, ranks):
    monkeypatch.setenv("LORA_LAB_BASE_GEMM", base_gemm)
    x, Ws, bs, As, Bs = build((1, 4001), 1024, [2048, 1024, 32, 32], ranks, torch.bfloat16,
                              bias=False, device="cuda")
    check(x, Ws, bs, As, Bs, [2.0] * 4, TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_merged_base_gemm_option(monkeypatch, dtype):
    # LORA_LAB_BASE_GEMM=merged: both big GEMMs on [W_1 + s_1·B_1 A_1; …], a frozen segment copied, merged per call
    monkeypatch.setenv("LORA_LAB_BASE_GEMM", "merged")
    x, Ws, bs, As, Bs = build((2, 19), 40, [72, 36, 5, 5], [8, 0, 1, 16], dtype)
    check(x, Ws, bs, As, Bs, [2.0, 1.0, 0.5, 3.0], TOL[dtype])
    x, Ws, bs, As, Bs = build((25,), 32, [40, 24, 8], [4, 2, 3], dtype, bias=False)
    check(x, Ws, bs, As, Bs, [1.0, 1.0, 1.0], TOL[dtype], grad_mask=[True, False, True])
    x = x.detach().float().requires_grad_()  # X's gradient only (frozen factors): dX without Q
    Ws, As, Bs = [w.float() for w in Ws], [a.detach().float() for a in As], [b.detach().float() for b in Bs]
    outs = fused_shared_input_lora(x, torch.cat(Ws), None, [40, 24, 8], As, Bs, [1.0, 1.0, 1.0])
    sum(o.sum() for o in outs).backward()
    ref = sum(torch.ones(25, w.shape[0], dtype=torch.float64) @ (w.double() + b.double() @ a.double())
              for w, a, b in zip(Ws, As, Bs))
    assert rel_l2(x.grad, ref) <= 1e-5


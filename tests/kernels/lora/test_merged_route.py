"""The LoRA linear on a weight merged per call (KernelConfig(base_gemm="merged"), lora_lab.kernels.lora.merged;
where a test takes ``route``, its stacked form too, base_gemm="stacked") against the fp64 reference: forward and
every gradient, odd shapes; its forward error held to the unfused layer's (the same two roundings); what it keeps
for backward; the fallback where it cannot run.
CPU: Triton interpreter (the rank-r passes) and CPU GEMMs, fp32 and fp16. GPU (@pytest.mark.gpu): bf16.
"""
import warnings

import pytest
import torch
from test_lora_linear import DEVICE, TOL, TRITON, make_case, run_and_compare

from lora_lab.kernels import fused_lora_linear
from lora_lab.kernels.lora import linear, merged, stacked
from lora_lab.kernels.lora.linear import lora_linear_reference, lora_linear_unfused
from lora_lab.numerics import rel_l2

MERGED = TRITON.replace(base_gemm="merged")
# (M, K, N, r, bias): no dimension a multiple of the interpreter's tiles; ranks 1, 5 (the stacked route pads it to
# 8), 16, 64
CASES = [(37, 45, 53, 1, True), (70, 96, 80, 16, False), (29, 40, 36, 5, True), (5, 33, 17, 64, True)]


@pytest.mark.parametrize("route", ["merged", "stacked"])
@pytest.mark.parametrize("rank_ops", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("M,K,N,r,bias", CASES, ids=lambda v: str(v))
def test_merged_route_matches_reference(M, K, N, r, bias, dtype, rank_ops, route):
    x, w, b, A, B = make_case(M, K, N, r, dtype, bias=bias)
    run_and_compare(x, w, b, A, B, 2.0, tol=TOL[dtype], config=TRITON.replace(base_gemm=route, rank_ops=rank_ops))


def test_merged_route_with_q_and_db_in_one_pass_and_a_3d_input():
    x, w, b, A, B = make_case(2 * 19, 40, 24, 16, torch.float32)
    x3 = x.reshape(19, 2, 40).transpose(0, 1)  # 2×19×40, not contiguous
    run_and_compare(x3, w, b, A, B, 2.0, tol=TOL[torch.float32], config=MERGED.replace(fuse_q_db=True))


def test_merged_route_forward_error_is_the_unfused_layers():
    # W + s·B A rounded to fp16, then Y rounded: two roundings, as the unfused layer's base output and rank-r term
    # rounded apart; a B of the size training gives (the term a few percent of Y), so the merge's rounding shows
    x, w, b, A, B = make_case(256, 512, 384, 16, torch.float16, seed=3)
    with torch.no_grad():
        B.mul_(0.05)
        ref = lora_linear_reference(x, w, b, A, B, 2.0, dtype=torch.float64)
        got = rel_l2(fused_lora_linear(x, w, b, A, B, 2.0, config=MERGED), ref)
        unfused = rel_l2(lora_linear_unfused(x, w, b, A, B, 2.0), ref)
        fused = rel_l2(fused_lora_linear(x, w, b, A, B, 2.0, config=TRITON), ref)
    assert got <= 1.1 * unfused, (got, unfused)
    assert fused <= got  # the Triton route rounds each output once


def test_merged_route_runs_no_triton_gemm_and_keeps_no_merged_weight(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton GEMM ran on the merged route")

    merges = []

    def counted(*args, **kwargs):
        out = merged_weight(*args, **kwargs)
        merges.append(out.shape)
        return out

    merged_weight = merged.merged_weight
    monkeypatch.setattr(linear, "lora_gemm", refuse)
    monkeypatch.setattr(merged, "merged_weight", counted)
    x, w, b, A, B = make_case(33, 40, 48, 16, torch.float32)
    x = x.requires_grad_()
    y = fused_lora_linear(x, w, b, A, B, 2.0, config=MERGED)
    saved = y.grad_fn.saved_tensors
    assert [tuple(t.shape) for t in saved if t is not None] == [(33, 40), (33, 16), (48, 40), (48,), (16, 40),
                                                                  (48, 16)]  # X, P, W, b, A, B: no W + s·B A
    y.sum().backward()
    assert merges == [(48, 40), (48, 40)]  # merged once for the forward, once for dX


@pytest.mark.parametrize("route", ["merged", "stacked"])
def test_merged_route_without_input_gradient(route):
    # X needs no gradient: no dX GEMM, no second merge (on the stacked route Q then comes from a pass over dY);
    # dA and dB as the Triton route's
    x, w, b, A, B = make_case(38, 40, 24, 16, torch.float32)
    dy = torch.randn(38, 24, generator=torch.Generator().manual_seed(1)).to(x.device)
    fused_lora_linear(x, w, b, A, B, 2.0, config=TRITON.replace(base_gemm=route)).backward(dy)
    got = (A.grad.clone(), B.grad.clone())
    A.grad = B.grad = None
    fused_lora_linear(x, w, b, A, B, 2.0, config=TRITON).backward(dy)
    torch.testing.assert_close(got, (A.grad, B.grad), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("route,module", [("merged", merged), ("stacked", stacked)], ids=["merged", "stacked"])
def test_merged_route_falls_back_naming_why(route, module):
    module._WARNED.clear()
    config = TRITON.replace(base_gemm=route)
    x, w, b, A, B = make_case(21, 32, 24, 8, torch.float32)
    with pytest.warns(RuntimeWarning, match=f"base_gemm='{route}' cannot run here.*dropout"):
        run_and_compare(x, w, b, A, B, 2.0, p=0.25, seed=5, tol=TOL[torch.float32], config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per reason, not one per call
        run_and_compare(x, w, b, A, B, 2.0, p=0.25, seed=5, tol=TOL[torch.float32], config=config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("N,K,r", [(53, 45, 1), (70, 200, 16), (129, 33, 5), (17, 130, 128)], ids=str)
def test_triton_merge_is_the_weight_plus_the_scaled_product_rounded_once(N, K, r, dtype):
    from lora_lab.kernels.lora.rank_ops import merge_weight

    g = torch.Generator().manual_seed(N + K + r)
    w, a, b = (torch.randn(*shape, generator=g).to(DEVICE, dtype) for shape in ((N, K), (r, K), (N, r)))
    exact = w.double() + 0.75 * (b.double() @ a.double())
    got = merge_weight(w, a, b, 0.75)
    assert got.dtype == dtype and got.shape == (N, K)
    ulp = torch.finfo(dtype).eps
    # one rounding of the result, and the fp32 sum's own error (relative to the sum of the terms' sizes)
    size = w.double().abs() + 0.75 * (b.double().abs() @ a.double().abs())
    for merge in (got, merged.merged_weight(w, a, b, 0.75, "torch")):  # the Triton pass, then cuBLAS's addmm
        assert ((merge.double() - exact).abs() <= ulp / 2 * exact.abs() + 1e-6 * size).all()


def test_merge_engine_follows_rank_ops_and_the_rank(monkeypatch):
    engines = []
    real = merged.merge_weight

    def spy(*args, **kwargs):
        engines.append("triton")
        return real(*args, **kwargs)

    monkeypatch.setattr(merged, "merge_weight", spy)
    for r, rank_ops in ((16, "triton"), (16, "torch"), (160, "triton")):
        engines.clear()
        x, w, b, A, B = make_case(24, 40, 32, r, torch.float32)
        run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.float32], config=MERGED.replace(rank_ops=rank_ops))
        assert engines == (["triton", "triton"] if (r, rank_ops) == (16, "triton") else []), (r, rank_ops)


@pytest.mark.gpu
@pytest.mark.parametrize("rank_ops", ["triton", "torch"])
@pytest.mark.parametrize("M,K,N,r,bias", [(4097, 1032, 2056, 16, True), (1000, 1024, 1030, 8, False),
                                          (777, 512, 384, 64, True), (4096, 4096, 4096, 16, False)],
                         ids=lambda v: str(v))
def test_gpu_merged_route_bf16(M, K, N, r, bias, rank_ops):
    x, w, b, A, B = make_case(M, K, N, r, torch.bfloat16, bias=bias, device="cuda")
    run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.bfloat16], config=MERGED.replace(rank_ops=rank_ops))


def test_merged_route_launches_each_big_gemm_before_the_rank_passes(monkeypatch):
    # Y needs no P and dX no Q: each GEMM goes first, so the passes' launches are prepared while it runs
    order = []

    def recorded(name, fn):
        def wrapper(*args, **kwargs):
            order.append(name)
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(merged, "merged_weight", recorded("merge", merged.merged_weight))
    monkeypatch.setattr(linear, "rank_projection", recorded("pass", linear.rank_projection))
    monkeypatch.setattr(linear, "rank_reduction", recorded("pass", linear.rank_reduction))
    x, w, b, A, B = make_case(33, 40, 48, 16, torch.float32)
    x = x.requires_grad_()
    y = fused_lora_linear(x, w, b, A, B, 2.0, config=MERGED)
    assert order == ["merge", "pass"]  # Y, then P
    y.sum().backward()
    assert order[2:] == ["merge", "pass", "pass", "pass"]  # dX, then Q, dB and dA


def test_merged_route_with_overlap_on_a_cpu_runs_on_one_stream():
    # overlap="on" puts the merged route's rank-r passes on a side CUDA stream; a CPU has none, and the op is unchanged
    x, w, b, A, B = make_case(45, 40, 36, 8, torch.float32)
    run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.float32], config=MERGED.replace(overlap="on", fuse_q_db=True))


@pytest.mark.gpu
@pytest.mark.parametrize("rank_ops,fuse_q_db", [("triton", True), ("triton", False), ("torch", False)])
@pytest.mark.parametrize("M,K,N,r,bias", [(4097, 1032, 2056, 16, True), (777, 512, 384, 64, False)],
                         ids=lambda v: str(v))
def test_gpu_merged_route_with_the_rank_passes_beside_the_gemms_bf16(monkeypatch, M, K, N, r, bias, rank_ops,
                                                                     fuse_q_db):
    """overlap="on": P beside the forward GEMM, Q, dB and dA beside the dX GEMM, on the side stream; the results are
    the same op's (forward and every gradient against the reference), and the main stream waits for them."""
    from lora_lab.kernels.lora import dispatch

    streams = []

    def recorded(fn):
        def wrapper(*args, **kwargs):
            streams.append(torch.cuda.current_stream())
            return fn(*args, **kwargs)
        return wrapper

    for name in ("rank_projection", "rank_reduction", "q_and_db", "_scaled_mm", "_wide_mm"):
        monkeypatch.setattr(linear, name, recorded(getattr(linear, name)))
    config = MERGED.replace(rank_ops=rank_ops, fuse_q_db=fuse_q_db, overlap="on")
    x, w, b, A, B = make_case(M, K, N, r, torch.bfloat16, bias=bias, device="cuda")
    run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.bfloat16], config=config)
    side = dispatch.side_stream(x.device, config)
    assert streams and all(s == side for s in streams), streams
    assert torch.cuda.current_stream() != side

"""Fused LoRA linear (lora_lab.kernels.lora.linear) against its plain-torch reference.

CPU: Triton interpreter, fp32 and fp16 (the interpreter's bf16 dot is wrong), odd shapes, r = 1 and 128,
non-contiguous input, M = 0, bias, dropout. GPU (@pytest.mark.gpu): the same in bf16 at larger odd shapes.
"""
import pytest
import torch

from lora_lab.kernels import (
    KernelConfig,
    dropout_keep_mask,
    fused_lora_linear,
    lora_linear_reference,
    lora_linear_unfused,
)
from lora_lab.kernels.lora.dispatch import LINEAR_DEEP_K_TRITON_MIN_VOLUME, engine_for, linear_route
from lora_lab.numerics import cosine, rel_l2

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# these tests are about the Triton kernels: no small-shape dispatch to cuBLAS (tested on its own below)
TRITON = KernelConfig.from_env(dispatch="triton")

# per-dtype tolerances on relative L2 error against the fp64 reference (the kernels' bars for bf16)
TOL = {
    torch.float32: {"y": 1e-5, "dx": 1e-5, "dA": 1e-5, "dB": 1e-5},
    torch.float16: {"y": 2e-3, "dx": 1e-2, "dA": 5e-3, "dB": 5e-3},
    torch.bfloat16: {"y": 1e-2, "dx": 1e-2, "dA": 5e-3, "dB": 5e-3},
}



def make_case(M, K, N, r, dtype, bias=True, adapter_dtype=None, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    adapter_dtype = adapter_dtype or dtype
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if bias else None
    A = (torch.randn(r, K, generator=g) / K**0.5).to(device, adapter_dtype).requires_grad_()
    B = (torch.randn(N, r, generator=g) / max(r, 1) ** 0.5).to(device, adapter_dtype).requires_grad_()
    return x, w, b, A, B


def run_and_compare(x, w, b, A, B, s, p=0.0, seed=None, tol=None, config=TRITON):
    """Fused forward+backward vs the fp64 reference on the same inputs (and the same dropout mask)."""
    x = x.detach().requires_grad_()
    A.grad = B.grad = None
    y = fused_lora_linear(x, w, b, A, B, s, dropout_p=p, seed=seed, config=config)
    M = x.numel() // x.shape[-1]
    mask = dropout_keep_mask(seed, M, x.shape[-1], p, x.device) if p > 0 else None
    xr = x.detach().double().requires_grad_()
    Ar = A.detach().double().requires_grad_()
    Br = B.detach().double().requires_grad_()
    yr = lora_linear_reference(xr, w, b, Ar, Br, s, keep_mask=mask, dropout_p=p, dtype=torch.float64)
    g = torch.randn(yr.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(yr.device)
    y.backward(g.to(y.dtype))
    yr.backward(g)
    errs = {"y": rel_l2(y, yr), "dx": rel_l2(x.grad, xr.grad), "dA": rel_l2(A.grad, Ar.grad),
            "dB": rel_l2(B.grad, Br.grad)}
    assert y.dtype == x.dtype and y.shape == yr.shape
    assert A.grad.dtype == A.dtype and B.grad.dtype == B.dtype and x.grad.dtype == x.dtype
    if tol is not None:
        for k, v in errs.items():
            assert v <= tol[k], f"{k}: relative L2 error {v:.3g} > {tol[k]:.3g} ({errs})"
    return y, yr, errs


CPU_DTYPES = [torch.float32, torch.float16]
# (M, K, N, r, bias, dropout) — none of M, K, N a multiple of the interpreter's 32/16 tiles
CPU_CASES = [
    (37, 45, 53, 1, True, 0.0),
    (70, 96, 80, 16, False, 0.0),
    (5, 33, 17, 128, True, 0.0),
    (61, 50, 41, 8, True, 0.25),
]


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("M,K,N,r,bias,p", CPU_CASES)
def test_matches_reference(M, K, N, r, bias, p, dtype):
    x, w, b, A, B = make_case(M, K, N, r, dtype, bias=bias)
    y, yr, _ = run_and_compare(x, w, b, A, B, 1.75, p=p, seed=1234 if p else None, tol=TOL[dtype])
    assert cosine(y, yr) >= 0.99999


TORCH_RANK_OPS = KernelConfig.from_env(dispatch="triton", rank_ops="torch")


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("M,K,N,r,bias,p", CPU_CASES)
def test_torch_rank_ops_match_reference(M, K, N, r, bias, p, dtype, monkeypatch):
    # rank_ops="torch": P, Q, dA, dB as cuBLAS (here CPU) calls around the Triton GEMMs; with dropout the
    # Triton rank kernels stay (they regenerate the mask), without it they are never launched
    from lora_lab.kernels.lora import linear

    if p == 0.0:
        def refuse(*args, **kwargs):
            raise AssertionError("a Triton rank kernel ran under rank_ops='torch'")

        monkeypatch.setattr(linear, "rank_projection", refuse)
        monkeypatch.setattr(linear, "rank_reduction", refuse)
    x, w, b, A, B = make_case(M, K, N, r, dtype, bias=bias)
    y, yr, _ = run_and_compare(x, w, b, A, B, 1.75, p=p, seed=1234 if p else None, tol=TOL[dtype],
                               config=TORCH_RANK_OPS)
    assert cosine(y, yr) >= 0.99999


def test_torch_rank_ops_with_fp32_adapters_and_the_environment(monkeypatch):
    x, w, b, A, B = make_case(29, 40, 36, 4, torch.float16, adapter_dtype=torch.float32)
    run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.float16], config=TORCH_RANK_OPS)
    monkeypatch.setenv("LORA_LAB_RANK_OPS", "torch")
    assert KernelConfig.from_env().rank_ops == "torch"
    monkeypatch.setenv("LORA_LAB_RANK_OPS", "cublas")
    with pytest.raises(ValueError, match="LORA_LAB_RANK_OPS"):
        KernelConfig.from_env()
    with pytest.raises(ValueError, match="rank_ops must be one of auto, triton, torch"):
        KernelConfig(rank_ops="cuda")


def test_fp32_adapters_with_fp16_input():
    # PEFT's default keeps adapters in fp32: the kernel casts A, B (tiny), never X, and returns fp32 grads
    x, w, b, A, B = make_case(29, 40, 36, 4, torch.float16, adapter_dtype=torch.float32)
    run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.float16])


def test_non_contiguous_and_3d_input():
    dtype = torch.float32
    _, w, b, A, B = make_case(1, 44, 30, 3, dtype)
    big = torch.randn(3, 13, 88, dtype=dtype, device=DEVICE)
    x = big[:, :, ::2]  # strided last dimension, 3-D
    assert not x.is_contiguous()
    y, yr, errs = run_and_compare(x, w, b, A, B, 0.5, tol=TOL[dtype])
    assert y.shape == (3, 13, 30)
    xt = torch.randn(44, 21, dtype=dtype, device=DEVICE).t()  # transposed 2-D view
    run_and_compare(xt, w, b, A, B, 0.5, tol=TOL[dtype])


def test_zero_rows():
    x, w, b, A, B = make_case(0, 40, 24, 4, torch.float32)
    x.requires_grad_()
    y = fused_lora_linear(x, w, b, A, B, 2.0, config=TRITON)
    assert y.shape == (0, 24)
    y.sum().backward()
    assert x.grad.shape == (0, 40)
    assert torch.count_nonzero(A.grad) == 0 and torch.count_nonzero(B.grad) == 0


def test_dropout_mask_regenerated_and_seeded():
    dtype = torch.float32
    x, w, b, A, B = make_case(64, 48, 32, 4, dtype)
    p = 0.5
    mask = dropout_keep_mask(99, 64, 48, p, x.device)
    assert 0.4 < mask.float().mean().item() < 0.6
    y1 = fused_lora_linear(x, w, b, A, B, 1.0, dropout_p=p, seed=99, config=TRITON)
    y2 = fused_lora_linear(x, w, b, A, B, 1.0, dropout_p=p, seed=99, config=TRITON)
    y3 = fused_lora_linear(x, w, b, A, B, 1.0, dropout_p=p, seed=100, config=TRITON)
    assert torch.equal(y1, y2)
    assert not torch.equal(y1, y3)
    # not training: no dropout at all
    y_eval = fused_lora_linear(x, w, b, A, B, 1.0, dropout_p=p, training=False, config=TRITON)
    y_ref = lora_linear_reference(x, w, b, A.detach(), B.detach(), 1.0).to(dtype)
    assert rel_l2(y_eval, y_ref) < 1e-5
    # seed drawn from torch's generator when not given: reproducible under manual_seed
    torch.manual_seed(5)
    ya = fused_lora_linear(x, w, b, A, B, 1.0, dropout_p=p, config=TRITON)
    torch.manual_seed(5)
    yb = fused_lora_linear(x, w, b, A, B, 1.0, dropout_p=p, config=TRITON)
    assert torch.equal(ya, yb)


def test_reference_gradcheck_fp64():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, generator=g, dtype=torch.float64)
    b = torch.randn(4, generator=g, dtype=torch.float64)
    A = torch.randn(2, 6, generator=g, dtype=torch.float64, requires_grad=True)
    B = torch.randn(4, 2, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(5, 6, generator=g) > 0.3
    assert torch.autograd.gradcheck(
        lambda x, A, B: lora_linear_reference(x, w, b, A, B, 1.5, keep_mask=mask, dropout_p=0.3,
                                              dtype=torch.float64), (x, A, B))


def test_bad_inputs_are_named():
    x, w, b, A, B = make_case(8, 16, 12, 2, torch.float32)
    with pytest.raises(ValueError, match="last dimension"):
        fused_lora_linear(x[:, :15], w, b, A, B, 1.0)
    with pytest.raises(ValueError, match="lora_A"):
        fused_lora_linear(x, w, b, A[:, :15], B, 1.0)
    with pytest.raises(ValueError, match="lora_B"):
        fused_lora_linear(x, w, b, A, B[:11], 1.0)
    with pytest.raises(TypeError, match="weight dtype"):
        fused_lora_linear(x, w.half(), b, A, B, 1.0)
    with pytest.raises(TypeError, match="not supported"):
        fused_lora_linear(x.double(), w.double(), b, A, B, 1.0)
    with pytest.raises(ValueError, match="bias"):
        fused_lora_linear(x, w, b[:5], A, B, 1.0)
    with pytest.raises(ValueError, match="dropout_p"):
        fused_lora_linear(x, w, b, A, B, 1.0, dropout_p=1.0)


# The persistent TMA GEMM (opt-in: gemm_loads="persistent"): forward and every gradient through it (the base GEMM
# and dX), on row-major operands with 16-byte aligned rows (TMA's condition) and odd M.
PERSISTENT_CASES = [
    (37, 48, 56, 8, True, 0.0),
    (1, 32, 40, 1, False, 0.0),
    (70, 96, 80, 16, True, 0.25),
]


@pytest.mark.parametrize("loads", ["persistent"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("M,K,N,r,bias,p", PERSISTENT_CASES)
def test_persistent_gemm_matches_reference(M, K, N, r, bias, p, dtype, loads):
    x, w, b, A, B = make_case(M, K, N, r, dtype, bias=bias)
    config = TRITON.replace(gemm_loads=loads, base_gemm="triton")
    run_and_compare(x, w, b, A, B, 0.5, p=p, seed=3 if p else None, tol=TOL[dtype], config=config)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("M,K,N,r,bias", [(37, 48, 56, 1, True), (70, 96, 80, 16, False), (9, 32, 40, 64, True)])
def test_folded_projection_matches_reference(M, K, N, r, bias, dtype, monkeypatch):
    """fold_projection: P = s·X Aᵀ inside the forward GEMM and Q = s·dY B inside dX's; the separate projection
    passes are not called at all."""
    import lora_lab.kernels.lora.linear as linear

    def no_projection_pass(*args, **kwargs):
        raise AssertionError("rank_projection ran although the projection is folded into the GEMM")

    monkeypatch.setattr(linear, "rank_projection", no_projection_pass)
    x, w, b, A, B = make_case(M, K, N, r, dtype, bias=bias)
    config = TRITON.replace(gemm_loads="persistent", base_gemm="triton", fold_projection=True)
    run_and_compare(x, w, b, A, B, 0.5, tol=TOL[dtype], config=config)


@pytest.mark.parametrize("r,p", [(128, 0.0), (8, 0.25)], ids=["rank-128", "dropout"])
def test_folded_projection_falls_back_where_it_cannot_fold(r, p):
    # rank > 64 or dropout: the separate passes, with the same results
    x, w, b, A, B = make_case(33, 48, 40, r, torch.float32)
    config = TRITON.replace(gemm_loads="persistent", base_gemm="triton", fold_projection=True)
    run_and_compare(x, w, b, A, B, 0.5, p=p, seed=3 if p else None, tol=TOL[torch.float32], config=config)


# The persistent forms take every input the default form takes. An input TMA cannot read as it is (the
# stride-0 gradient of y.sum(), a transposed view) is copied into a packed row-major buffer; operands no copy makes
# readable (rows of a byte width not a multiple of 16) run on the default form. Results equal the default form's.
def _persistent_calls(monkeypatch):
    """Spy on the persistent kernel's launcher: how many GEMMs ran on it."""
    import lora_lab.kernels.lora.gemm as gemm

    calls = []
    real = gemm._persistent_gemm

    def spy(out, segments, *args, **kwargs):
        calls.append([tuple(inp.stride()) for inp, _ in segments])
        return real(out, segments, *args, **kwargs)

    monkeypatch.setattr(gemm, "_persistent_gemm", spy)
    return calls


def _forward_backward(x, w, b, A, B, config, grad):
    """(y, dx, dA, dB) of one call; ``grad``: 'sum' (y.sum().backward(): an expanded, stride-0 gradient) or a
    tensor."""
    x = x.detach().requires_grad_()
    A.grad = B.grad = None
    y = fused_lora_linear(x, w, b, A, B, 0.5, config=config)
    if isinstance(grad, str):
        y.sum().backward()
    else:
        y.backward(grad)
    return y.detach(), x.grad, A.grad.clone(), B.grad.clone()


@pytest.mark.parametrize("fold", [False, True], ids=["persistent", "folded"])
@pytest.mark.parametrize("grad", ["sum", "transposed"])
def test_persistent_gemm_takes_an_expanded_or_transposed_gradient(grad, fold, monkeypatch):
    x, w, b, A, B = make_case(37, 48, 56, 8, torch.float32)
    if grad == "transposed":  # a real gradient, column-major
        grad = torch.randn(56, 37, generator=torch.Generator().manual_seed(3)).t()
    default = _forward_backward(x, w, b, A, B, TRITON.replace(base_gemm="triton"), grad)
    calls = _persistent_calls(monkeypatch)
    config = TRITON.replace(gemm_loads="persistent", base_gemm="triton", fold_projection=fold)
    mine = _forward_backward(x, w, b, A, B, config, grad)
    assert len(calls) == 2  # forward and dX both on the persistent kernel (dX on a packed copy of dY)
    assert calls[1] == [(56, 1)]
    for name, got, want in zip(["y", "dx", "dA", "dB"], mine, default):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("fold", [False, True], ids=["persistent", "folded"])
def test_persistent_gemm_runs_the_default_form_where_tma_cannot_read(fold, monkeypatch):
    # fp32 rows of 45 values are 180 bytes: not a multiple of 16, no copy helps; the default form runs instead
    x, w, b, A, B = make_case(9, 45, 24, 4, torch.float32)
    calls = _persistent_calls(monkeypatch)
    config = TRITON.replace(gemm_loads="persistent", base_gemm="triton", fold_projection=fold)
    _, _, errs = run_and_compare(x, w, b, A, B, 0.5, tol=TOL[torch.float32], config=config)
    assert calls == []  # X (forward) and W (dX) have 180-byte rows: neither GEMM can go through TMA
    default = _forward_backward(x, w, b, A, B, TRITON.replace(base_gemm="triton"), "sum")
    mine = _forward_backward(x, w, b, A, B, config, "sum")
    for name, got, want in zip(["y", "dx", "dA", "dB"], mine, default):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.needs_tma
@pytest.mark.parametrize("fold", [False, True], ids=["persistent", "folded"])
@pytest.mark.parametrize("grad", ["sum", "random"])
@pytest.mark.parametrize("M,K,N", [(4101, 1024, 2048), (1000, 1024, 1030)], ids=["aligned", "n-1030"])
def test_gpu_persistent_gemm_bf16_with_sum_and_random_gradients(M, K, N, grad, fold):
    """H200 failures once seen at a moderate shape: y.sum().backward() (a stride-0 gradient, refused before) and
    a random gradient, bf16, against the fp64 reference; N = 1030 (2060-byte rows) runs dX on the default form."""
    x, w, b, A, B = make_case(M, K, N, 16, torch.bfloat16, device="cuda")
    config = TRITON.replace(gemm_loads="persistent", base_gemm="triton", fold_projection=fold)
    g = "sum" if grad == "sum" else torch.randn(M, N, generator=torch.Generator().manual_seed(5)).to("cuda",
                                                                                                     torch.bfloat16)
    y, dx, dA, dB = _forward_backward(x, w, b, A, B, config, g)
    xr, Ar, Br = (t.detach().double().requires_grad_() for t in (x, A, B))
    yr = lora_linear_reference(xr, w, b, Ar, Br, 0.5, dtype=torch.float64)
    yr.backward(torch.ones_like(yr) if grad == "sum" else g.double())
    tol = TOL[torch.bfloat16]
    for name, got, want in (("y", y, yr), ("dx", dx, xr.grad), ("dA", dA, Ar.grad), ("dB", dB, Br.grad)):
        assert rel_l2(got, want) <= tol[name], (name, rel_l2(got, want))


def test_warp_specialised_gemm_form_is_refused_naming_the_supported_values(monkeypatch):
    # gemm_loads="persistent_ws" failed to compile on the H200 (PassManager::run failed) and is no option
    with pytest.raises(ValueError, match=r"gemm_loads must be one of auto, tma, pointer, persistent; got "
                                         r"'persistent_ws' \(the warp-specialised persistent form was removed"):
        KernelConfig(gemm_loads="persistent_ws")
    monkeypatch.setenv("LORA_LAB_GEMM", "persistent_ws")
    with pytest.raises(ValueError, match="LORA_LAB_GEMM='persistent_ws': expected one of auto, tma, pointer, "
                                         "persistent"):
        KernelConfig.from_env()


# ------------------------------------------------------------------------------------------- GPU
GPU_CASES = [
    (1000, 1030, 2051, 16, True, 0.0),
    (777, 512, 384, 1, False, 0.0),
    (513, 384, 640, 128, True, 0.0),
    (2048, 1024, 1536, 64, False, 0.1),
]


@pytest.mark.gpu
@pytest.mark.needs_tma
@pytest.mark.parametrize("r", [16, 64])
def test_gpu_folded_projection_bf16(r):
    x, w, b, A, B = make_case(1000, 1024, 2056, r, torch.bfloat16)
    config = TRITON.replace(gemm_loads="persistent", base_gemm="triton", fold_projection=True)
    run_and_compare(x, w, b, A, B, 0.5, tol=TOL[torch.bfloat16], config=config)


@pytest.mark.gpu
@pytest.mark.needs_tma
@pytest.mark.parametrize("loads", ["persistent"])
@pytest.mark.parametrize("M,K,N,r,bias,p", [(1000, 1024, 2056, 16, True, 0.0), (777, 512, 384, 1, False, 0.1)])
def test_gpu_persistent_gemm_bf16(M, K, N, r, bias, p, loads):
    x, w, b, A, B = make_case(M, K, N, r, torch.bfloat16, bias=bias)
    config = TRITON.replace(gemm_loads=loads, base_gemm="triton")
    run_and_compare(x, w, b, A, B, 0.5, p=p, seed=3 if p else None, tol=TOL[torch.bfloat16], config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,N,r,bias,p", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_matches_reference(M, K, N, r, bias, p, dtype):
    x, w, b, A, B = make_case(M, K, N, r, dtype, bias=bias, device="cuda")
    y, yr, errs = run_and_compare(x, w, b, A, B, 2.0, p=p, seed=4321 if p else None, tol=TOL[dtype])
    assert cosine(y, yr) >= 0.99999


@pytest.mark.gpu
def test_gpu_bf16_forward_vs_unfused_bf16():
    # Our single rounding vs an unfused bf16 chain: both near the fp32 truth, ours at least as near
    x, w, b, A, B = make_case(4096, 2048, 2048, 16, torch.bfloat16, device="cuda")
    y = fused_lora_linear(x, w, b, A, B, 2.0, config=TRITON)
    yu = lora_linear_unfused(x, w, b, A.detach(), B.detach(), 2.0)
    yr = lora_linear_reference(x, w, b, A.detach(), B.detach(), 2.0)
    assert cosine(y, yr) >= 0.99999
    assert rel_l2(y, yr) <= rel_l2(yu, yr) * 1.05


@pytest.mark.gpu
def test_gpu_fp32_adapters_bf16_input_and_3d_noncontiguous():
    x, w, b, A, B = make_case(1, 1024, 768, 16, torch.bfloat16, adapter_dtype=torch.float32, device="cuda")
    big = torch.randn(4, 300, 2048, device="cuda", dtype=torch.bfloat16)
    run_and_compare(big[..., ::2], w, b, A, B, 2.0, tol=TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_side_stream_overlap_gives_the_same_gradients():
    x, w, b, A, B = make_case(3000, 1024, 1536, 16, torch.bfloat16, device="cuda")
    grads = []
    for flag in ("off", "on"):
        xx = x.detach().requires_grad_()
        A.grad = B.grad = None
        fused_lora_linear(xx, w, b, A, B, 2.0, config=TRITON.replace(overlap=flag)).float().square().sum().backward()
        torch.cuda.synchronize()
        grads.append((xx.grad.clone(), A.grad.clone(), B.grad.clone()))
    for g0, g1 in zip(*grads):
        assert torch.equal(g0, g1)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_one_pass_q_and_db_option(dtype):
    # fuse_q_db: Q and dB from one pass over dY (atomic adds for dB)
    x, w, b, A, B = make_case(70, 40, 96, 16, dtype)
    run_and_compare(x, w, b, A, B, 2.0, tol=TOL[dtype], config=TRITON.replace(fuse_q_db=True))


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: "x".join(map(str, c)))
def test_cublas_base_gemm_option(dtype, case):
    # base_gemm="cublas": the rank-r term written first, the base GEMM added by cuBLAS (beta = 1);
    # with dropout the backward's dX keeps the Triton GEMM (the mask multiplies the rank-r term only)
    M, K, N, r, bias, p = case
    x, w, b, A, B = make_case(M, K, N, r, dtype, bias=bias)
    run_and_compare(x, w, b, A, B, 2.0, p=p, seed=11 if p else None, tol=TOL[dtype],
                    config=TRITON.replace(base_gemm="cublas"))


# odd shapes at the ranks the benchmark's grid and common adapters use
ROUTE_CASES = [(37, 45, 53, 8, True), (29, 40, 36, 16, False), (9, 33, 70, 64, True)]


@pytest.mark.parametrize("case,qdb", [*((c, True) for c in ROUTE_CASES), (ROUTE_CASES[2], False)],
                         ids=lambda v: str(v))
def test_cublas_base_gemm_with_one_pass_q_and_db(case, qdb):
    # base_gemm="cublas" with fuse_q_db (and without it at r = 64, beyond CPU_CASES): the rank-r terms by Triton,
    # Q and dB in one pass, the GEMMs added by cuBLAS
    M, K, N, r, bias = case
    x, w, b, A, B = make_case(M, K, N, r, torch.float32, bias=bias)
    run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.float32],
                    config=TRITON.replace(base_gemm="cublas", fuse_q_db=qdb))


@pytest.mark.parametrize("M,K,N,r,bias", ROUTE_CASES, ids=lambda c: str(c))
def test_every_gemm_by_cublas_launches_no_triton_kernel(M, K, N, r, bias, monkeypatch):
    # base_gemm="cublas" with rank_ops="torch": the rank-r terms written by cuBLAS calls too, then the base GEMMs
    # added onto them (beta = 1); no Triton kernel runs in forward or backward
    from lora_lab.kernels.lora import linear

    def refuse(*args, **kwargs):
        raise AssertionError("a Triton kernel ran on the pure cuBLAS route")

    for name in ("lora_gemm", "rank_projection", "rank_reduction", "q_and_db"):
        monkeypatch.setattr(linear, name, refuse)
    x, w, b, A, B = make_case(M, K, N, r, torch.float32, bias=bias)
    y, yr, _ = run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.float32],
                               config=TRITON.replace(base_gemm="cublas", rank_ops="torch"))
    assert cosine(y, yr) >= 0.99999


def test_environment_seeds_the_defaults_and_bad_values_are_named(monkeypatch):
    monkeypatch.setenv("LORA_LAB_BASE_GEMM", "cutlass")
    x, w, b, A, B = make_case(8, 16, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="LORA_LAB_BASE_GEMM"):
        fused_lora_linear(x, w, b, A, B, 2.0)
    monkeypatch.setenv("LORA_LAB_BASE_GEMM", "cublas")
    monkeypatch.setenv("LORA_LAB_DISPATCH", "triton")
    run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.float32], config=None)  # env-seeded defaults


@pytest.mark.gpu
@pytest.mark.parametrize("fields", [{"fuse_q_db": True}, {"rank_ops": "torch"}], ids=["qdb", "pure-cublas"])
@pytest.mark.parametrize("K,N", [(1030, 2051), (1032, 2056), (4096, 4096)], ids=lambda v: str(v))
def test_gpu_cublas_base_gemm_routes_bf16(fields, K, N):
    # K and N multiples of 8 too: at 1032 × 2056 cuBLAS's dYᵀ P left out the last token (linear._wide_mm's note)
    x, w, b, A, B = make_case(4097, K, N, 16, torch.bfloat16, device="cuda")
    y, yr, _ = run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.bfloat16],
                               config=TRITON.replace(base_gemm="cublas", **fields))
    assert cosine(y, yr) >= 0.99999


@pytest.mark.parametrize("depth", [1, 63, 64, 65, 130, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_token_reductions_split_at_an_aligned_depth(depth, dtype, monkeypatch):
    # dA = Qᵀ X and dB = dYᵀ P: on CUDA the head (a multiple of REDUCTION_ALIGN rows) goes to cuBLAS and the tail is
    # added in fp32; here the split is forced on the CPU, on transposed views as the op passes them
    from lora_lab.kernels.lora import linear

    monkeypatch.setattr(linear, "_reduction_head", lambda a: a.shape[1] - a.shape[1] % linear.REDUCTION_ALIGN)
    g = torch.Generator().manual_seed(depth)
    dy, p = torch.randn(depth, 48, generator=g).to(dtype), torch.randn(depth, 5, generator=g).to(dtype)
    for a, b in ((dy.t(), p), (p.t(), dy)):
        got = linear._wide_mm(a, b)
        assert got.shape == (a.shape[0], b.shape[1])
        assert rel_l2(got, a.double() @ b.double()) <= (1e-6 if dtype == torch.float32 else 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,r", [(4097, 2056, 16), (8193, 2048, 16), (4097, 2064, 16), (4096, 2056, 16),
                                   (4097, 1032, 64)], ids=lambda v: str(v))
def test_gpu_token_reductions_at_odd_counts(M, N, r):
    # dB = dYᵀ P and its transpose Pᵀ dY, bf16 operands and an fp32 result, against fp64: every token's term in
    from lora_lab.kernels.lora.linear import _wide_mm

    g = torch.Generator().manual_seed(0)
    dy = torch.randn(M, N, generator=g).to("cuda", torch.bfloat16)
    p = torch.randn(M, r, generator=g).to("cuda", torch.bfloat16)
    exact = dy.double().t() @ p.double()
    assert rel_l2(_wide_mm(dy.t(), p), exact) <= 1e-4
    assert rel_l2(_wide_mm(p.t(), dy).t(), exact) <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_gpu_cublas_base_gemm_bf16(p):
    x, w, b, A, B = make_case(4097, 1030, 2051, 16, torch.bfloat16, device="cuda")
    y, yr, _ = run_and_compare(x, w, b, A, B, 2.0, p=p, seed=5 if p else None, tol=TOL[torch.bfloat16],
                               config=TRITON.replace(base_gemm="cublas"))
    assert cosine(y, yr) >= 0.99999


# ------------------------------------------------------------------------------ engine dispatch
def test_engine_dispatch_by_gemm_volume():
    auto = KernelConfig(dispatch="auto")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert engine_for(8192, 896, 896, cuda, auto) == "cublas"  # hidden-896 model: host-bound in Triton
    assert engine_for(8192, 4096, 4096, cuda, auto) == "cublas"  # forward: Triton from ~3e11 up
    assert engine_for(8192, 4096, 12288, cuda, auto) == "triton"
    assert engine_for(8192, 4096, 4096, cuda, auto, backward=True) == "cublas"  # backward: from ~5e11 up
    assert engine_for(32768, 4096, 4096, cuda, auto, backward=True) == "triton"
    assert engine_for(8, 8, 8, cpu, auto) == "triton"  # the interpreter always runs the kernels
    assert engine_for(32768, 4096, 4096, cuda, KernelConfig(dispatch="cublas")) == "cublas"
    with pytest.raises(ValueError, match="dispatch"):
        KernelConfig(dispatch="fast")


def test_linear_route_on_defaults_and_by_hand():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    auto = KernelConfig.from_env({})
    assert auto.rank_ops == "auto"

    def route(M, K, N, config=auto, device=cuda):
        routed = linear_route(M, K, N, device, config)
        return routed.base_gemm, routed.rank_ops

    pure, kernels = ("cublas", "torch"), ("auto", "triton")
    assert route(8192, 4096, 12288) == pure  # wide output: every product on cuBLAS
    assert route(8192, 12288, 4096) == pure  # deep K, but below the volume
    assert route(32768, 4096, 4096) == pure
    assert route(16384, 14336, 4096) == kernels  # a Llama-3-8B down projection: the Triton GEMM
    assert route(32768, 12288, 4096) == kernels
    m = int(LINEAR_DEEP_K_TRITON_MIN_VOLUME // (12288 * 4096))
    assert route(m, 12288, 4096) == pure and route(m + 1, 12288, 4096) == kernels
    assert route(8192, 4096, 12288, device=cpu) == kernels  # the interpreter runs the kernels
    assert linear_route(8192, 4096, 12288, cuda, auto) is linear_route(8192, 4096, 12288, cuda, auto)  # cached
    # anything set by hand is kept, rank_ops="auto" then meaning triton
    for fields in ({"dispatch": "triton"}, {"base_gemm": "triton"}, {"gemm_loads": "persistent"},
                   {"fold_projection": True}):
        config = auto.replace(**fields)
        assert route(8192, 4096, 12288, config) == (config.base_gemm, "triton"), fields
    assert route(8192, 4096, 12288, auto.replace(base_gemm="cublas")) == ("cublas", "triton")
    assert route(8192, 4096, 12288, auto.replace(rank_ops="triton")) == ("auto", "triton")
    assert route(16384, 14336, 4096, auto.replace(rank_ops="torch")) == ("auto", "torch")


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,N,route", [(8195, 4096, 12290, ("cublas", "torch")),
                                         (10243, 14338, 4100, ("auto", "triton"))], ids=["pure-cublas", "deep-k"])
def test_gpu_default_routes_bf16(M, K, N, route):
    # the op with the shipped settings at a shape on each side of the rule, in bf16 against the fp64 reference
    cuda = torch.device("cuda")
    routed = linear_route(M, K, N, cuda, KernelConfig.from_env({}))
    assert (routed.base_gemm, routed.rank_ops) == route
    x, w, b, A, B = make_case(M, K, N, 16, torch.bfloat16, device="cuda")
    y, yr, _ = run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.bfloat16], config=KernelConfig.from_env({}))
    assert cosine(y, yr) >= 0.99999


@pytest.mark.parametrize("M,K,N,r,bias", [(37, 45, 53, 1, True), (70, 96, 80, 16, False), (0, 33, 17, 4, True)])
def test_cublas_engine_matches_reference(M, K, N, r, bias):
    # the small-shape engine: the same formulas as cuBLAS calls, same saved tensors, same gradients
    cublas = TRITON.replace(dispatch="cublas")
    x, w, b, A, B = make_case(M, K, N, r, torch.float32, bias=bias)
    if M == 0:
        y = fused_lora_linear(x.requires_grad_(), w, b, A, B, 2.0, config=cublas)
        y.sum().backward()
        assert y.shape == (0, N) and x.grad.shape == x.shape and torch.count_nonzero(A.grad) == 0
        return
    run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.float32], config=cublas)
    # dropout always takes the Triton kernels (the mask is regenerated from the seed there)
    run_and_compare(*make_case(M, K, N, r, torch.float32, bias=bias), 2.0, p=0.25, seed=99,
                    tol=TOL[torch.float32], config=cublas)


@pytest.mark.gpu
@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_bf16_cublas_engine(adapter_dtype):
    x, w, b, A, B = make_case(1000, 1030, 2051, 16, torch.bfloat16, adapter_dtype=adapter_dtype, device="cuda")
    y, yr, _ = run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.bfloat16], config=TRITON.replace(dispatch="cublas"))
    assert cosine(y, yr) >= 0.99999


@pytest.mark.parametrize("fold,want", [(False, 6), (True, 4)], ids=["separate-passes", "folded"])
def test_triton_launches_per_forward_and_backward(fold, want, monkeypatch):
    """The launch count, checked without a GPU: the kernels replaced by stubs that record each launch. The
    shipped Triton path launches P and the GEMM forward, Q, dB, dA and the dX GEMM backward (six); folding P and Q
    into the persistent GEMMs leaves four."""
    import lora_lab.kernels.lora.gemm as gemm
    import lora_lab.kernels.lora.rank_ops as rank_ops

    launches = []

    class Stub:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(self.name)

    for module, names in ((gemm, ["_lora_gemm_kernel", "_lora_gemm_tma_kernel", "_lora_gemm_persistent_kernel"]),
                          (rank_ops, ["_rank_projection_kernel", "_rank_reduction_kernel", "_q_and_db_kernel"])):
        for name in names:
            monkeypatch.setattr(module, name, Stub(name))
    x, w, b, A, B = make_case(40, 64, 48, 8, torch.float32)
    config = TRITON.replace(gemm_loads="persistent", base_gemm="triton", fold_projection=fold)
    fused_lora_linear(x.requires_grad_(), w, b, A, B, 0.5, config=config).sum().backward()
    assert len(launches) == want, launches


def descriptor_gemm_call(shape, dtype, loads):
    """(inputs, y, g, grads) of one fused call on the descriptor GEMM (``gemm_loads``), fp32 adapters, a fallback
    RuntimeWarning raised as an error."""
    import warnings

    x, w, bias, A, B = make_case(*shape, dtype, adapter_dtype=torch.float32)
    x.requires_grad_(True)
    config = KernelConfig.from_env(dispatch="triton", gemm_loads=loads, autotune=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        y = fused_lora_linear(x, w, bias, A, B, 2.0, config=config)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y)
        grads = torch.autograd.grad(y, [x, A, B], g)
    return (x, w, bias, A, B), y, g, grads


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter check; the GPU tests cover the compiled path")
@pytest.mark.parametrize("loads", ["tma", "persistent"])
def test_descriptor_gemm_encodes_only_the_segments_it_uses(loads, monkeypatch):
    # fp16 takes the TMA-descriptor GEMM; a one-segment call passes None for the three unused segments (the
    # launcher encodes no descriptor for them) and still matches the fp64 reference, with no fallback warning
    from lora_lab.kernels.lora import gemm

    built = []
    real = gemm._descriptors
    monkeypatch.setattr(gemm, "_descriptors", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    (x, w, bias, A, B), y, g, (dx, dA, dB) = descriptor_gemm_call((96, 64, 80, 8), torch.float16, loads)
    assert len(built) == 2 and all(d[3:] == [None, None, 0] * 3 for d in built)  # forward Y and backward dX
    xr, Ar, Br = (t.detach().double().requires_grad_(True) for t in (x, A, B))
    yr = lora_linear_reference(xr, w, bias, Ar, Br, 2.0, dtype=torch.float64)
    dxr, dAr, dBr = torch.autograd.grad(yr, [xr, Ar, Br], g.double())
    tol = TOL[torch.float16]
    assert rel_l2(y, yr) < tol["y"] and rel_l2(dx, dxr) < tol["dx"]
    assert rel_l2(dA, dAr) < tol["dA"] and rel_l2(dB, dBr) < tol["dB"]


@pytest.mark.gpu
@pytest.mark.needs_tma
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("loads", ["tma", "persistent"])
def test_gpu_descriptor_gemm_compiles_with_unused_segments_as_none(loads):
    # the compiled TMA kernels take None for the unused segments; a failure would fall back to the pointer kernel
    # with a RuntimeWarning (and a slower GEMM), so the warning is an error here
    from lora_lab.kernels.lora import gemm

    (x, w, bias, A, B), y, _, _ = descriptor_gemm_call((1000, 1024, 2056, 16), torch.bfloat16, loads)
    torch.cuda.synchronize()
    assert torch.bfloat16 not in gemm._TMA_STATE
    yr = lora_linear_reference(x.detach(), w, bias, A.detach(), B.detach(), 2.0)
    assert rel_l2(y, yr) < TOL[torch.bfloat16]["y"]


# The Ampere path (LORA_LAB_ARCH=sm80 on a GPU) in the interpreter: pointer loads where TMA would read, the tile
# table pruned to that class's shared memory; still the reference's results.
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter; on a GPU, LORA_LAB_ARCH=sm80 with -m gpu")
def test_the_ampere_class_reads_through_pointers_and_refuses_tma_forms(ampere_path):
    from lora_lab import gpu_arch
    from lora_lab.kernels.lora.gemm import gemm_loads_for

    cpu = torch.device("cpu")
    assert gpu_arch.gpu_class(cpu) == "ampere" and not gpu_arch.has_tma(cpu) and not gpu_arch.grouped_mm_fast(cpu)
    assert gpu_arch.tile_shared_memory_budget(cpu) == 144 * 1024
    assert gemm_loads_for("auto", cpu) == "pointer"
    with pytest.raises(ValueError, match="reads through TMA descriptors, which GPU class 'ampere'"):
        gemm_loads_for("persistent", cpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter; on a GPU, LORA_LAB_ARCH=sm80 with -m gpu")
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("M,K,N,r,bias", [(37, 48, 56, 8, True), (70, 96, 80, 16, False)])
def test_lora_linear_on_the_ampere_path(M, K, N, r, bias, dtype, ampere_path, monkeypatch):
    from lora_lab.kernels.lora import gemm

    loads = []
    real = gemm.gemm_loads_for
    monkeypatch.setattr(gemm, "gemm_loads_for", lambda requested, device: loads.append(real(requested, device))
                        or loads[-1])
    run_and_compare(*make_case(M, K, N, r, dtype, bias=bias), 0.5, tol=TOL[dtype], config=TRITON)
    assert loads and set(loads) == {"pointer"}  # fp16 would take the descriptor GEMM on the CPU's own path

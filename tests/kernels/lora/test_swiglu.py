"""The fused SiLU·up (lora_lab.kernels.lora.swiglu) against ``F.silu(g) * u``: forward and both gradients.

CPU: interpreter, fp32 and fp16, odd widths, 3-D inputs, empty inputs, gate and up as column blocks of one buffer
(the gate/up output of the shared-input projections, and the whole LoRA MLP built on it).
GPU (@pytest.mark.gpu): bf16 at a Llama-like width.
"""
import pytest
import torch

from lora_lab.kernels.lora.shared_input import fused_shared_input_lora, shared_input_lora_reference
from lora_lab.kernels.lora.swiglu import _adjacent_blocks, silu_mul, silu_mul_reference
from lora_lab.numerics import rel_l2

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _pair(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = (3 * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)  # past |g| = 6: both tails of σ
    u = torch.randn(*shape, generator=gen).to(DEVICE, dtype)
    dh = torch.randn(*shape, generator=gen).to(DEVICE, dtype)
    return g, u, dh


def _check(g, u, dh, tol):
    g, u = g.detach().requires_grad_(), u.detach().requires_grad_()
    h = silu_mul(g, u)
    gr, ur = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    hr = silu_mul_reference(gr, ur)
    assert h.shape == hr.shape and h.dtype == g.dtype
    h.backward(dh)
    hr.backward(dh.double())
    if h.numel():
        assert rel_l2(h, hr) <= tol
        assert rel_l2(g.grad, gr.grad) <= tol
        assert rel_l2(u.grad, ur.grad) <= tol
    return g.grad, u.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(7, 1), (5, 1029), (2, 3, 77), (1, 2048)])
def test_matches_torch(shape, dtype):
    _check(*_pair(shape, dtype), TOL[dtype])


def test_empty_input():
    g, u, dh = _pair((0, 33), torch.float32)
    dg, du = _check(g, u, dh, TOL[torch.float32])
    assert dg.shape == du.shape == (0, 33)


def test_column_blocks_of_one_buffer():
    # gate and up as the two halves of one M x 2I output: read in place, gradients as the two halves of one buffer
    gen = torch.Generator().manual_seed(3)
    M, n = 9, 130
    y = torch.randn(M, 2 * n, generator=gen).to(DEVICE).requires_grad_()
    dh = torch.randn(M, n, generator=gen).to(DEVICE)
    assert _adjacent_blocks(y[:, :n], y[:, n:]) and not _adjacent_blocks(y[:, n:], y[:, :n])
    silu_mul(y[:, :n], y[:, n:]).backward(dh)
    yr = y.detach().double().requires_grad_()
    silu_mul_reference(yr[:, :n], yr[:, n:]).backward(dh.double())
    assert rel_l2(y.grad, yr.grad) <= TOL[torch.float32]


def test_strided_rows_not_blocks():
    # every other row of a buffer: not adjacent blocks, still right (two gradient tensors)
    g, u, dh = _pair((10, 64), torch.float32, seed=4)
    _check(g[::2], u[::2], dh[::2], TOL[torch.float32])


def test_lora_mlp_on_the_shared_input_projections():
    # gate/up through fused_shared_input_lora (one buffer [g | u]), then silu_mul: x's and every factor's gradient
    gen = torch.Generator().manual_seed(5)
    M, K, n, r = 33, 40, 72, 8
    x = torch.randn(M, K, generator=gen).requires_grad_()
    Ws = [torch.randn(n, K, generator=gen) / K**0.5 for _ in range(2)]
    As = [(torch.randn(r, K, generator=gen) / K**0.5).requires_grad_() for _ in range(2)]
    Bs = [(torch.randn(n, r, generator=gen) / r**0.5).requires_grad_() for _ in range(2)]
    dh = torch.randn(M, n, generator=gen)
    g, u = fused_shared_input_lora(x.to(DEVICE), torch.cat(Ws).to(DEVICE), None, [n, n],
                                   [a.to(DEVICE) for a in As], [b.to(DEVICE) for b in Bs], [2.0, 0.5])
    silu_mul(g, u).backward(dh.to(DEVICE))
    xr = x.detach().double().requires_grad_()
    Ar = [a.detach().double().requires_grad_() for a in As]
    Br = [b.detach().double().requires_grad_() for b in Bs]
    gr, ur = shared_input_lora_reference(xr, Ws, [None, None], Ar, Br, [2.0, 0.5], dtype=torch.float64)
    silu_mul_reference(gr, ur).backward(dh.double())
    assert rel_l2(x.grad, xr.grad) <= 1e-5
    for mine, ref in zip([*As, *Bs], [*Ar, *Br]):
        assert rel_l2(mine.grad, ref.grad) <= 1e-5


@pytest.mark.parametrize("bad, message", [
    (lambda g, u: (g, u[:, :-1]), "same shape"),
    (lambda g, u: (g, u.half()), "dtype"),
    (lambda g, u: (g.int(), u.int()), "not supported"),
    (lambda g, u: (g[0, 0], u[0, 0]), "at least one dimension"),
])
def test_bad_input_names_the_problem(bad, message):
    g, u, _ = _pair((4, 8), torch.float32)
    with pytest.raises((TypeError, ValueError), match=message):
        silu_mul(*bad(g, u))


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's bf16 refusal")
def test_bf16_refused_in_the_interpreter():
    g, u, _ = _pair((4, 8), torch.float32)
    with pytest.raises(TypeError, match="bf16"):
        silu_mul(g.bfloat16(), u.bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4099, 11008), (2, 1000, 12288)])
def test_bf16_on_gpu(shape):
    _check(*_pair(shape, torch.bfloat16), TOL[torch.bfloat16])

"""The merged route with P and Q as more output columns of its GEMMs (KernelConfig(base_gemm="stacked"),
lora_lab.kernels.lora.stacked): a scale that is no power of two, which passes it runs and what it keeps, merging
into a block of a larger buffer. Against the fp64 reference at odd shapes and padded ranks, without an input
gradient, and the fallback where it cannot run: test_merged_route.py, for both merged routes.
CPU: Triton interpreter (the merge and the token reductions) and CPU GEMMs, fp32 and fp16. GPU (@pytest.mark.gpu):
bf16.
"""
import pytest
import torch
from test_lora_linear import DEVICE, TOL, TRITON, make_case, run_and_compare

from lora_lab.kernels import fused_lora_linear
from lora_lab.kernels.lora import linear, merged, stacked
from lora_lab.kernels.lora.rank_ops import merge_weight, stack_weight

STACKED = TRITON.replace(base_gemm="stacked")


def test_stacked_route_with_a_scale_that_is_no_power_of_two_and_a_3d_input():
    # s·A and s·B are rounded into the stacked weights: exact for s = 2, one rounding more for s = 0.3
    x, w, b, A, B = make_case(2 * 19, 40, 24, 16, torch.float32)
    x3 = x.reshape(19, 2, 40).transpose(0, 1)  # 2×19×40, not contiguous
    y, _, _ = run_and_compare(x3, w, b, A, B, 0.3, tol=TOL[torch.float32], config=STACKED)
    assert y.shape == (2, 19, 24)


def test_stacked_route_takes_p_and_q_from_the_gemms(monkeypatch):
    # no pass over X for P and none over dY for Q: the only rank-r passes are the token reductions dB and dA;
    # the stacked weights are merged twice and kept by neither pass; backward keeps P, not [Y | P]
    passes, merges = [], []

    def refuse(*args, **kwargs):
        raise AssertionError("a projection pass ran on the stacked route")

    def recorded(name, fn, into):
        def wrapper(*args, **kwargs):
            into.append(name)
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(linear, "lora_gemm", refuse)
    monkeypatch.setattr(linear, "rank_projection", refuse)
    monkeypatch.setattr(linear, "q_and_db", refuse)
    monkeypatch.setattr(linear, "rank_reduction", recorded("reduction", linear.rank_reduction, passes))
    monkeypatch.setattr(stacked, "merged_weight", refuse)  # the Triton engine writes each stack in one pass
    monkeypatch.setattr(stacked, "stack_weight", recorded("merge", stacked.stack_weight, merges))
    x, w, b, A, B = make_case(33, 40, 48, 5, torch.float32)
    x = x.requires_grad_()
    y = fused_lora_linear(x, w, b, A, B, 2.0, config=STACKED.replace(fuse_q_db=True))
    assert y.shape == (33, 48) and y.stride() == (48 + 8, 1)  # the first N columns of [Y | P], rank padded to 8
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    assert [tuple(t.shape) for t in saved] == [(33, 40), (33, 5), (48, 40), (48,), (5, 40), (48, 5)]
    assert saved[1].is_contiguous() and saved[1].untyped_storage().nbytes() == 33 * 5 * 4  # P alone, no Y
    y.sum().backward()
    assert merges == ["merge", "merge"] and passes == ["reduction", "reduction"]  # dB, dA
    assert x.grad.shape == (33, 40)


@pytest.mark.parametrize("engine", ["triton", "torch"])
def test_merge_into_a_block_of_a_larger_buffer(engine):
    # the stacked weights' W + s·B A is written in place: rows of [W' ; s·A], columns of [W' | s·B]
    g = torch.Generator().manual_seed(4)
    w, a, b = (torch.randn(*shape, generator=g).to(DEVICE) for shape in ((37, 45), (5, 45), (37, 5)))
    alone = merged.merged_weight(w, a, b, 0.75, engine)
    for buffer, block in ((torch.full((45, 45), 7.0, device=DEVICE), lambda t: t[:37]),
                          (torch.full((37, 53), 7.0, device=DEVICE), lambda t: t[:, :45])):
        merged.merged_weight(w, a, b, 0.75, engine, out=block(buffer))
        torch.testing.assert_close(block(buffer), alone)
        rest = buffer[37:] if buffer.shape[0] == 45 else buffer[:, 45:]
        assert (rest == 7.0).all()  # nothing outside the block written


@pytest.mark.parametrize("side", ["rows", "cols"])
@pytest.mark.parametrize("N,K,r,padded", [(37, 45, 5, 8), (64, 128, 16, 16), (70, 33, 3, 16)])
def test_stack_weight_writes_the_merge_the_scaled_factor_and_zeros(side, N, K, r, padded):
    # one pass writes [W + s·B A ; s·A ; 0] or [W + s·B A | s·B | 0]; fp32 against a float64 reference
    g = torch.Generator().manual_seed(N + K)
    w, a, b = (torch.randn(*shape, generator=g).to(DEVICE) for shape in ((N, K), (r, K), (N, r)))
    got = stack_weight(w, a, b, 0.3, side, padded)
    wd, ad, bd = w.double(), a.double(), b.double()
    merged_ref = wd + 0.3 * bd @ ad
    if side == "rows":
        want = torch.cat([merged_ref, 0.3 * ad, torch.zeros(padded - r, K, dtype=torch.float64, device=DEVICE)])
    else:
        want = torch.cat([merged_ref, 0.3 * bd, torch.zeros(N, padded - r, dtype=torch.float64, device=DEVICE)], 1)
    assert got.shape == want.shape and got.dtype == w.dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    extra = got[N + r:] if side == "rows" else got[:, K + r:]
    assert (extra == 0).all()


def test_stack_weight_names_bad_input():
    w, a, b = torch.zeros(6, 8, device=DEVICE), torch.zeros(2, 8, device=DEVICE), torch.zeros(6, 2, device=DEVICE)
    with pytest.raises(ValueError, match="side is 'rows' or 'cols'"):
        stack_weight(w, a, b, 1.0, "both", 8)
    with pytest.raises(ValueError, match="padded >= r"):
        stack_weight(w, a, b, 1.0, "rows", 1)
    with pytest.raises(ValueError, match="A must be r×8 and B 6×r"):
        stack_weight(w, a.t(), b, 1.0, "cols", 8)


def test_merge_weight_names_a_wrong_output():
    w, a, b = torch.zeros(6, 8, device=DEVICE), torch.zeros(2, 8, device=DEVICE), torch.zeros(6, 2, device=DEVICE)
    with pytest.raises(ValueError, match="out must be 6×8"):
        merge_weight(w, a, b, 1.0, out=torch.zeros(8, 6, device=DEVICE))
    with pytest.raises(ValueError, match="out must be 6×8 torch.float32"):
        merge_weight(w, a, b, 1.0, out=torch.zeros(6, 8, device=DEVICE, dtype=torch.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("rank_ops", ["triton", "torch"])
@pytest.mark.parametrize("M,K,N,r,bias", [(4097, 1032, 2056, 16, True), (1000, 1024, 1030, 8, False),
                                          (777, 512, 384, 64, True), (4096, 4096, 4096, 16, False),
                                          (513, 520, 264, 5, True)],
                         ids=lambda v: str(v))
def test_gpu_stacked_route_bf16(M, K, N, r, bias, rank_ops):
    x, w, b, A, B = make_case(M, K, N, r, torch.bfloat16, bias=bias, device="cuda")
    run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.bfloat16], config=STACKED.replace(rank_ops=rank_ops))

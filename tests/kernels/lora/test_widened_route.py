"""The LoRA linear's widened-reduction route (KernelConfig(base_gemm="wide"), lora_lab.kernels.lora.widened) against
the fp64 reference: forward and every gradient, odd shapes, ranks that need padding to a multiple of 8 and ranks
that do not; the passes that build [X | P] and [dY | Q]; the fallback where the route cannot run.
CPU: Triton interpreter, fp32 and fp16. GPU (@pytest.mark.gpu): bf16.
"""
import warnings

import pytest
import torch
from test_lora_linear import DEVICE, TOL, TRITON, make_case, run_and_compare

from lora_lab.kernels import fused_lora_linear
from lora_lab.kernels.lora import linear, widened
from lora_lab.kernels.lora.rank_ops import q_and_db, rank_projection

WIDE = TRITON.replace(base_gemm="wide")
# (M, K, N, r, bias): no dimension a multiple of the interpreter's tiles; r = 1 and 5 padded to 8, 8 and 16 not
CASES = [(37, 45, 53, 1, True), (70, 96, 80, 16, False), (29, 40, 36, 5, True), (9, 33, 70, 8, False),
         (5, 33, 17, 128, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("M,K,N,r,bias", CASES, ids=lambda v: str(v))
def test_widened_route_matches_reference(M, K, N, r, bias, dtype):
    x, w, b, A, B = make_case(M, K, N, r, dtype, bias=bias)
    run_and_compare(x, w, b, A, B, 2.0, tol=TOL[dtype], config=WIDE)


def test_widened_route_runs_one_pass_and_one_gemm_each_way(monkeypatch):
    # forward: one pass writes [X | P], one GEMM; backward: one pass writes [dY | Q] and dB, one GEMM, and dA;
    # the Triton GEMM never runs
    calls = []

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton GEMM ran on the widened route")

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls.append((name, kwargs.get("copy_to") is not None))
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(linear, "lora_gemm", refuse)
    monkeypatch.setattr(widened, "rank_projection", counted("rank_projection", rank_projection))
    monkeypatch.setattr(widened, "q_and_db", counted("q_and_db", q_and_db))
    x, w, b, A, B = make_case(33, 40, 48, 16, torch.float32)
    run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.float32], config=WIDE)
    assert calls == [("rank_projection", True), ("q_and_db", True)]


def test_widened_route_keeps_the_widened_input_only():
    # backward keeps X and P as the two column blocks of one [X | P] buffer, nothing of size M×K besides
    x, w, b, A, B = make_case(40, 48, 24, 5, torch.float32)
    x = x.requires_grad_()
    y = fused_lora_linear(x, w, b, A, B, 2.0, config=WIDE)
    x2, p = y.grad_fn.saved_tensors[:2]
    assert x2.shape == (40, 48) and p.shape == (40, 5)
    assert x2.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
    assert x2.stride() == (48 + 8, 1) and p.storage_offset() == 48


def test_widened_route_without_input_gradient_and_with_3d_input():
    # X needs no gradient: the backward takes the Triton passes on the saved views; a 3-D, non-contiguous input
    x, w, b, A, B = make_case(2 * 19, 40, 24, 16, torch.float32)
    y = fused_lora_linear(x, w, b, A, B, 2.0, config=WIDE)
    y.square().sum().backward()
    got = (A.grad.clone(), B.grad.clone())
    A.grad = B.grad = None
    fused_lora_linear(x, w, b, A, B, 2.0, config=TRITON).square().sum().backward()
    torch.testing.assert_close(got, (A.grad, B.grad), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(24, 2, 40).transpose(0, 1)  # 2×24×40, not contiguous
    run_and_compare(x3, w, b, A, B, 2.0, tol=TOL[torch.float32], config=WIDE)


@pytest.mark.parametrize("r,p,reason", [(8, 0.25, "dropout"), (160, 0.0, "rank 160")])
def test_widened_route_falls_back_naming_why(r, p, reason):
    widened._WARNED.clear()
    x, w, b, A, B = make_case(21, 32, 24, r, torch.float32)
    with pytest.warns(RuntimeWarning, match=f"base_gemm='wide' cannot run here.*{reason}"):
        run_and_compare(x, w, b, A, B, 2.0, p=p, seed=5 if p else None, tol=TOL[torch.float32], config=WIDE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per reason, not one per call
        run_and_compare(x, w, b, A, B, 2.0, p=p, seed=5 if p else None, tol=TOL[torch.float32], config=WIDE)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_rank_projection_copies_its_input_as_read(dropout):
    x = torch.randn(37, 45, device=DEVICE)
    a = torch.randn(5, 45, device=DEVICE)
    wide = torch.full((37, 45 + 8), float("nan"), device=DEVICE)
    p = rank_projection(x, a.t(), 2.0, out=wide[:, 45:50], copy_to=wide[:, :45], dropout_p=dropout, seed=3)
    torch.testing.assert_close(wide[:, :45], x, rtol=0, atol=0)  # X before dropout
    if not dropout:
        torch.testing.assert_close(p, 2.0 * x @ a.t(), rtol=1e-5, atol=1e-5)
    assert p.data_ptr() == wide[:, 45:].data_ptr()


def test_q_and_db_writes_q_into_a_view_and_copies_dy():
    dy = torch.randn(29, 36, device=DEVICE)
    b = torch.randn(36, 16, device=DEVICE)
    p = torch.randn(29, 16, device=DEVICE)
    wide = torch.empty(29, 36 + 16, device=DEVICE)
    q, dbt = q_and_db(dy, b, p, 0.5, q_out=wide[:, 36:], copy_to=wide[:, :36])
    torch.testing.assert_close(wide[:, :36], dy, rtol=0, atol=0)
    torch.testing.assert_close(wide[:, 36:], 0.5 * dy @ b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dbt, p.t() @ dy, rtol=1e-5, atol=1e-5)


def test_a_copy_or_q_buffer_of_the_wrong_shape_is_named():
    x = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="copy_to must match the input"):
        rank_projection(x, torch.randn(16, 4, device=DEVICE), 1.0, copy_to=torch.empty(8, 15, device=DEVICE))
    with pytest.raises(ValueError, match="q_out must be 8×4"):
        q_and_db(x, torch.randn(16, 4, device=DEVICE), torch.randn(8, 4, device=DEVICE), 1.0,
                 q_out=torch.empty(8, 5, device=DEVICE))


def test_padded_rank():
    assert [widened.padded_rank(r) for r in (1, 5, 8, 9, 16, 64, 127)] == [8, 8, 8, 16, 16, 64, 128]


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,N,r,bias", [(4097, 1032, 2056, 16, True), (1000, 1024, 1030, 5, False),
                                          (777, 512, 384, 64, True), (2048, 1030, 520, 8, False)],
                         ids=lambda v: str(v))
def test_gpu_widened_route_bf16(M, K, N, r, bias):
    x, w, b, A, B = make_case(M, K, N, r, torch.bfloat16, bias=bias, device="cuda")
    run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.bfloat16], config=WIDE)


def test_passes_that_copy_their_input_run_unpipelined(monkeypatch):
    # Triton 3.6 computed wrong dots on an H100 when a loop that stores its tile was software-pipelined (rank
    # blocks >= 48): with COPY the pruner keeps each tile with num_stages 1, and COPY is part of the tuning key
    import triton

    from lora_lab.kernels.lora import rank_ops, tuning

    monkeypatch.setattr(tuning, "running_in_interpreter", lambda: False)
    configs = [triton.Config({"BLOCK_M": 64, "BLOCK_D": 128}, num_warps=4, num_stages=4),
               triton.Config({"BLOCK_M": 64, "BLOCK_D": 128}, num_warps=4, num_stages=3),
               triton.Config({"BLOCK_M": 128, "BLOCK_D": 64}, num_warps=8, num_stages=3)]
    x = torch.empty(8, 16, dtype=torch.bfloat16)
    kept = tuning._prune_configs(configs, {"in_ptr": x, "TUNE": 1}, BLOCK_R=64, COPY=True)
    assert [(c.kwargs["BLOCK_M"], c.num_warps, c.num_stages) for c in kept] == [(64, 4, 1), (128, 8, 1)]
    assert {c.num_stages for c in tuning._prune_configs(configs, {"in_ptr": x, "TUNE": 1}, BLOCK_R=64)} == {3, 4}
    for kernel in (rank_ops._rank_projection_kernel, rank_ops._q_and_db_kernel):
        assert "COPY" in kernel.keys

"""``KernelConfig(base_gemm="quack")``: QuACK's GEMM with the rank-r term in its epilogue (kernels/lora/quack_gemm).

CPU: QuACK needs a Hopper GPU, so the route runs against a stand-in for QuACK's epilogue frontend that evaluates the
generated epilogue function itself with torch broadcasting (the function QuACK traces into its kernel): the route's
formulas, operand layouts and every gradient against the fp64 reference, and each reason the route falls back to the
Triton route, named in a warning. GPU (``@pytest.mark.gpu``, where QuACK is installed): bf16 against the reference,
r in {8, 16, 32}, with and without bias, Q and dB from one pass (``fuse_q_db``), and a rank above ``MAX_RANK``
falling back.
"""
import re
import warnings

import pytest
import torch
from test_lora_linear import TOL, make_case, run_and_compare

from lora_lab.kernels import KernelConfig
from lora_lab.kernels.lora import linear, quack_gemm
from lora_lab.numerics import cosine

QUACK = KernelConfig.from_env(dispatch="triton", base_gemm="quack")


class _VecLoad:
    kind = None

    def __init__(self, name):
        self.name = name


class _ColVecLoad(_VecLoad):
    kind = "col"  # one value per output row


class _RowVecLoad(_VecLoad):
    kind = "row"  # one value per output column


class _EpilogueGemm:
    """QuACK's EpiMod as the route calls it: ``mod(A, B, out={"D": buf}, tuned=..., **operands)``."""

    calls, configs = [], []

    def __init__(self, fn, ops):
        self.fn, self.ops = fn, ops

    def __call__(self, A, B, C=None, *, out=None, tuned=True, config=None, **operands):
        assert C is None and set(operands) == set(self.ops), sorted(operands)
        # what TMA reads: a row-major A, B row- or column-major (W or Wᵀ), no expanded or strided operand
        assert A.is_contiguous() and (B.is_contiguous() or B.t().is_contiguous()), (A.stride(), B.stride())
        assert not tuned and config[0].endswith("tiles for rank") and config[1] == len(self.ops) // 2, config
        _EpilogueGemm.configs.append(config[0])
        acc = A.double() @ B.double()
        values = {}
        for name, op in self.ops.items():
            v = operands[name]
            assert v.dim() == 2 and v.shape[0] == 1 and v.stride(1) == 1, (name, v.shape, v.stride())
            assert v.shape[1] == (acc.shape[0] if op.kind == "col" else acc.shape[1]), (name, v.shape)
            values[name] = v.double().reshape(-1, 1) if op.kind == "col" else v.double().reshape(1, -1)
        out["D"].copy_(self.fn(acc, **values)["D"])
        _EpilogueGemm.calls.append((tuple(A.shape), tuple(B.shape), len(operands)))
        return out


def _fake_gemm_epilogue(ops=None, **kwargs):
    return lambda fn: _EpilogueGemm(fn, ops)


@pytest.fixture
def fake_quack(monkeypatch):
    """The route on the CPU: QuACK's frontend replaced, the device accepted, fp32 allowed (the exact check)."""
    monkeypatch.setattr(quack_gemm, "_frontend", lambda: (_fake_gemm_epilogue, _ColVecLoad, _RowVecLoad))
    monkeypatch.setattr(quack_gemm, "_device_problem", lambda device: None)
    monkeypatch.setattr(quack_gemm, "gemm_config", lambda rank, schedule="cooperative": (
        "tiles for rank" if schedule == "cooperative" else f"{schedule} tiles for rank", rank))
    monkeypatch.setattr(quack_gemm, "DTYPES", (torch.bfloat16, torch.float16, torch.float32))
    monkeypatch.setattr(quack_gemm, "_EPILOGUES", {})
    monkeypatch.setattr(quack_gemm, "_WARNED", set())
    _EpilogueGemm.calls, _EpilogueGemm.configs = [], []
    yield _EpilogueGemm.calls
    for name in [n for n in vars(quack_gemm) if n.startswith("lora_rank")]:  # the stand-in's epilogues, bound
        delattr(quack_gemm, name)


def _refuse_triton(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a Triton kernel ran on the QuACK route")

    for name in ("lora_gemm", "rank_projection", "rank_reduction", "q_and_db"):
        monkeypatch.setattr(linear, name, refuse)


@pytest.mark.parametrize("M,K,N,r,bias", [(40, 48, 56, 1, True), (72, 96, 80, 16, False), (16, 32, 24, 32, True)])
def test_route_matches_reference_with_the_epilogue_evaluated(M, K, N, r, bias, fake_quack, monkeypatch):
    _refuse_triton(monkeypatch)
    x, w, b, A, B = make_case(M, K, N, r, torch.float32, bias=bias)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the route runs: no fallback warning
        y, yr, _ = run_and_compare(x, w, b, A, B, 1.5, tol=TOL[torch.float32], config=QUACK)
    assert cosine(y, yr) >= 0.99999
    # forward: X (M×K) against Wᵀ (K×N); dX: dY (M×N) against W (N×K); 2r vectors (+ bias in the forward)
    assert fake_quack == [((M, K), (K, N), 2 * r + bias), ((M, N), (N, K), 2 * r)]


def test_route_takes_3d_input_and_fp32_adapters(fake_quack):
    x, w, b, A, B = make_case(48, 32, 40, 8, torch.float32)
    run_and_compare(x.reshape(2, 24, 32), w, b, A, B, 2.0, tol=TOL[torch.float32], config=QUACK)
    assert len(fake_quack) == 2


def test_route_with_fuse_q_db_takes_q_and_db_from_one_pass(fake_quack, monkeypatch):
    """``fuse_q_db=True``: Q and dB from the one Triton pass over dY (in the interpreter here), the rest as before."""
    passes = []
    one_pass = linear.q_and_db
    monkeypatch.setattr(linear, "q_and_db", lambda *a, **k: passes.append(a[0].shape) or one_pass(*a, **k))
    x, w, b, A, B = make_case(72, 48, 40, 8, torch.float32, bias=True)
    config = KernelConfig.from_env(dispatch="triton", base_gemm="quack", fuse_q_db=True)
    y, yr, _ = run_and_compare(x, w, b, A, B, 1.5, tol=TOL[torch.float32], config=config)
    assert cosine(y, yr) >= 0.99999
    assert passes == [(72, 40)] and len(fake_quack) == 2


def test_route_packs_an_expanded_gradient_and_a_strided_input(fake_quack):
    """``y.sum()``'s gradient is expanded (stride 0) and a sliced input is strided: both are packed for QuACK."""
    x, w, b, A, B = make_case(48, 64, 40, 8, torch.float32)
    for inp in (x, torch.cat([x, x], dim=1)[:, ::2]):  # the second: stride 2 along K
        inp = inp.detach().requires_grad_()
        A.grad = B.grad = None
        y = linear.fused_lora_linear(inp, w, b, A, B, 2.0, config=QUACK)
        y.sum().backward()
        xr, Ar, Br = (t.detach().double().requires_grad_() for t in (inp, A, B))
        linear.lora_linear_reference(xr, w, b, Ar, Br, 2.0, dtype=torch.float64).sum().backward()
        for got, want in ((inp.grad, xr.grad), (A.grad, Ar.grad), (B.grad, Br.grad)):
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert len(fake_quack) == 4


def test_the_route_runs_the_cooperative_schedule_and_a_call_may_ask_for_ping_pong(fake_quack):
    x, w, _, A, B = make_case(24, 16, 32, 4, torch.float32)
    p_t, b_t = (x @ A.t()).t().contiguous(), B.t().contiguous()
    for schedule in ("cooperative", "pingpong"):
        y = torch.empty(24, 32)
        quack_gemm.gemm_with_rank_epilogue(y, x, w.t(), p_t, b_t, schedule=schedule)
        torch.testing.assert_close(y.double(), x.double() @ w.double().t() + p_t.double().t() @ b_t.double())
    assert _EpilogueGemm.configs == ["tiles for rank", "pingpong tiles for rank"]


def test_gemm_config_names_the_schedules(monkeypatch):
    import sys
    import types
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class GemmConfig:  # QuACK's fields that the route sets
        tile_m: int = 128
        tile_n: int = 192
        pingpong: bool = True
        cluster_m: int = 2
        cluster_n: int = 1

    module = types.ModuleType("quack.gemm_config")
    module.GemmConfig = GemmConfig
    monkeypatch.setitem(sys.modules, "quack", types.ModuleType("quack"))
    monkeypatch.setitem(sys.modules, "quack.gemm_config", module)
    assert quack_gemm.gemm_config(16) == GemmConfig(tile_n=256, pingpong=False)
    assert quack_gemm.gemm_config(16, "pingpong") == GemmConfig()  # QuACK's own default tile and schedule
    with pytest.raises(ValueError, match="schedule must be one of cooperative, pingpong; got 'stream_k'"):
        quack_gemm.gemm_config(16, "stream_k")


def test_epilogue_source_is_the_rank_r_sum():
    assert quack_gemm.epilogue_source(2, True) == (
        "def lora_rank2_bias_epilogue(acc, p0, p1, b0, b1, bias):\n"
        "    x = acc\n"
        "    x = x + p0 * b0\n"
        "    x = x + p1 * b1\n"
        "    x = x + bias\n"
        '    return {"D": x}\n')


def test_epilogue_is_built_once_and_bound_where_quack_finds_it(fake_quack):
    first = quack_gemm.rank_epilogue(4, False)
    assert quack_gemm.rank_epilogue(4, False) is first
    assert quack_gemm.lora_rank4_epilogue is first  # a module global under the function's name
    assert first.fn.__name__ == "lora_rank4_epilogue" and first.fn.__module__ == quack_gemm.__name__
    assert [type(op).__name__ for op in first.ops.values()] == ["_ColVecLoad"] * 4 + ["_RowVecLoad"] * 4


@pytest.mark.parametrize("change,reason", [
    (dict(r=quack_gemm.MAX_RANK + 1), "above the epilogue's"),
    (dict(K=44), "in_features (K) = 44 is not a multiple of 8"),
    (dict(M=42), "rows (M) = 42"),
    (dict(p=0.25), "dropout needs the Triton route"),
])
def test_route_falls_back_to_triton_naming_why(change, reason, fake_quack):
    dims = dict(M=40, K=48, N=32, r=4, p=0.0)
    dims.update(change)
    x, w, b, A, B = make_case(dims["M"], dims["K"], dims["N"], dims["r"], torch.float32)
    with pytest.warns(RuntimeWarning, match=re.escape(reason)):
        run_and_compare(x, w, b, A, B, 2.0, p=dims["p"], seed=5 if dims["p"] else None, tol=TOL[torch.float32],
                        config=QUACK)
    assert fake_quack == []  # the Triton route computed it


def test_unavailable_reasons_without_the_stand_in(monkeypatch):
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert "CUDA devices" in quack_gemm.unavailable_reason(16, 32, 24, 8, bf16, cpu)
    assert "bf16 or fp16" in quack_gemm.unavailable_reason(16, 32, 24, 8, torch.float32, cpu)
    monkeypatch.setattr(quack_gemm, "_device_problem", lambda device: None)

    def missing():
        raise ModuleNotFoundError("No module named 'quack'")

    monkeypatch.setattr(quack_gemm, "_frontend", missing)
    reason = quack_gemm.unavailable_reason(16, 32, 24, 8, bf16, cpu)
    assert "QuACK cannot be imported" in reason and "pip install quack-kernels==0.6.5" in reason


def test_shared_input_op_takes_its_default_for_quack():
    from lora_lab.kernels.lora.dispatch import base_gemm_engine

    assert base_gemm_engine(QUACK, default="cublas") == "cublas"
    assert base_gemm_engine(QUACK, supported=("triton", "cublas", "quack")) == "quack"
    assert base_gemm_engine(QUACK.replace(base_gemm="auto"), default="cublas") == "cublas"


def test_warning_once_per_reason(fake_quack):
    counts = []
    for _ in range(2):
        x, w, b, A, B = make_case(40, 44, 32, 4, torch.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.float32], config=QUACK)
        counts.append(sum("base_gemm='quack'" in str(c.message) for c in caught))
    assert counts == [1, 0]


def _quack_on_gpu():
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    return quack_gemm.unavailable_reason(8, 8, 8, 8, torch.bfloat16, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("r", [8, 16, 32])
@pytest.mark.parametrize("bias", [True, False])
def test_gpu_route_bf16(r, bias):
    reason = _quack_on_gpu()
    if reason:
        pytest.skip(reason)
    x, w, b, A, B = make_case(4104, 1032, 2056, r, torch.bfloat16, bias=bias, device="cuda")
    with warnings.catch_warnings():
        # the route must run, not fall back to Triton with a warning. Only that warning is an error: the first
        # backward of a process on this route met torch's "no current CUDA context" warning (cuBLAS in the autograd
        # thread, which torch mends by setting the primary context), not a fault of the route
        warnings.filterwarnings("error", message="lora_lab: base_gemm='quack' cannot run here")
        y, yr, _ = run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.bfloat16], config=QUACK)
    assert cosine(y, yr) >= 0.99999


@pytest.mark.gpu
def test_gpu_route_bf16_with_q_and_db_in_one_pass():
    reason = _quack_on_gpu()
    if reason:
        pytest.skip(reason)
    x, w, b, A, B = make_case(4104, 1032, 2056, 16, torch.bfloat16, bias=True, device="cuda")
    config = KernelConfig.from_env(dispatch="triton", base_gemm="quack", fuse_q_db=True)
    y, yr, _ = run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.bfloat16], config=config)
    assert cosine(y, yr) >= 0.99999


@pytest.mark.gpu
def test_gpu_rank_above_the_epilogue_falls_back():
    reason = _quack_on_gpu()
    if reason:
        pytest.skip(reason)
    x, w, b, A, B = make_case(1032, 520, 776, 64, torch.bfloat16, device="cuda")
    with pytest.warns(RuntimeWarning, match="above the epilogue's"):
        run_and_compare(x, w, b, A, B, 2.0, tol=TOL[torch.bfloat16], config=QUACK)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", quack_gemm.SCHEDULES)
def test_gpu_gemm_with_rank_epilogue_on_each_schedule(schedule):
    reason = _quack_on_gpu()
    if reason:
        pytest.skip(reason)
    gen = torch.Generator(device="cuda").manual_seed(0)
    M, K, N, r = 4104, 1032, 2056, 16
    x, w = (torch.randn(*s, device="cuda", generator=gen).bfloat16() for s in ((M, K), (N, K)))
    low_t, rt = (torch.randn(r, n, device="cuda", generator=gen).bfloat16() for n in (M, N))
    y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    quack_gemm.gemm_with_rank_epilogue(y, x, w.t(), low_t, rt, schedule=schedule)
    ref = x.double() @ w.double().t() + low_t.double().t() @ rt.double()
    assert cosine(y, ref) >= 0.99999

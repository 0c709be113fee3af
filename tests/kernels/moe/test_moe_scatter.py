"""The Triton engine's two scatter GEMMs (down forward, dX) on ``torch._grouped_mm`` plus the un-sort pass
(``KernelConfig.moe_scatter``): the rule as a pure function, the inverse routing map, the un-sort's row range, and
the layer against the plain-torch reference, forward and every gradient.

CPU: Triton's interpreter and torch's ``_grouped_mm`` fallback, fp32, odd shapes, empty experts, sentinel ids.
GPU (@pytest.mark.gpu): bf16 on Hopper against an fp32 reference on the same rounded inputs."""

from __future__ import annotations

import pytest
import torch
from test_moe_engine import reference_grads
from test_moe_kernels import BF16_MAX_REL_L2, BF16_MIN_COSINE, assert_close_all, interpreter, make_problem, run_both

from lora_lab.kernels.config import KernelConfig
from lora_lab.kernels.moe import engine, experts
from lora_lab.kernels.moe.experts import dw1_on_grouped_mm, scatter_engine
from lora_lab.kernels.moe.routing import route_experts, route_experts_torch
from lora_lab.kernels.moe.silu_backward import unsort_sum
from lora_lab.numerics import cosine, rel_l2

BF16 = torch.bfloat16
HOPPER = (9, 0)
QWEN3_30B = dict(hidden=2048, intermediate=768)
needs_grouped_mm = pytest.mark.skipif(not engine.grouped_mm_available(), reason="torch has no _grouped_mm")
SCATTER = KernelConfig(moe_engine="triton", moe_scatter="grouped_mm")


def assert_bf16_close_to_fp32(got, x, index, weights, w1, w2):
    """Output and every gradient of a bf16 GPU run (``run_both``'s first result) finite and within the stated
    thresholds of the fp32 reference on the same rounded inputs (``reference_grads``, same upstream gradient)."""
    ref = reference_grads(x.float(), index, weights.float(), w1.float(), w2.float())
    for name, a, b in zip(["out", "dx", "d_weights", "d_gate_up", "d_down"], got, ref):
        assert torch.isfinite(a).all(), name
        assert cosine(a, b) >= BF16_MIN_COSINE, (name, cosine(a, b))
        assert rel_l2(a, b) <= BF16_MAX_REL_L2, (name, rel_l2(a, b))


def rule(**overrides):
    args = dict(requested="auto", dtype=BF16, capability=HOPPER, has_lora=False, available=True) | QWEN3_30B
    return scatter_engine(**(args | overrides))


def test_auto_takes_grouped_mm_for_bf16_full_fine_tuning_on_hopper_only():
    assert rule() == "grouped_mm"
    assert rule(capability=(10, 0)) == "grouped_mm"
    assert rule(capability=(8, 0)) == "triton" and rule(capability=None) == "triton"
    assert rule(dtype=torch.float16) == "triton" and rule(dtype=torch.float32) == "triton"
    assert rule(has_lora=True) == "triton"  # the Triton kernels add LoRA's terms inside their accumulators
    assert rule(available=False) == "triton"
    assert rule(hidden=2044) == "triton" and rule(intermediate=766) == "triton"  # 16-byte strides


def test_requested_scatter_wins_and_impossible_requests_name_why():
    assert rule(requested="triton") == "triton"
    assert rule(requested="grouped_mm", capability=None, dtype=torch.float32) == "grouped_mm"
    with pytest.raises(ValueError, match="LoRA on the experts"):
        rule(requested="grouped_mm", has_lora=True)
    with pytest.raises(ValueError, match="multiples of 8"):
        rule(requested="grouped_mm", hidden=2044)
    with pytest.raises(ValueError, match="has no torch._grouped_mm"):
        rule(requested="grouped_mm", available=False)
    with pytest.raises(ValueError, match="moe_scatter must be one of auto, triton, grouped_mm; got 'cutlass'"):
        rule(requested="cutlass")
    with pytest.raises(ValueError, match="KernelConfig.moe_scatter must be one of"):
        KernelConfig(moe_scatter="atomic")
    assert KernelConfig.from_env({"LORA_LAB_MOE_SCATTER": "triton"}).moe_scatter == "triton"
    with pytest.raises(ValueError, match="LORA_LAB_MOE_SCATTER='x'"):
        KernelConfig.from_env({"LORA_LAB_MOE_SCATTER": "x"})


def _check_position(routing, num_assignments):
    position = routing.position
    assert position is not None and position.dtype == torch.int32 and position.shape == (num_assignments,)
    # the inverse of sorted_slot: assignment s sits at sorted row position[s]
    assert routing.sorted_slot[position.long()].tolist() == list(range(num_assignments))


@interpreter
def test_route_experts_with_position_gives_the_inverse_map():
    gen = torch.Generator().manual_seed(3)
    E, T, K = 6, 23, 3
    index = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    index[4, 2], index[9, 0] = E, -1  # expert-parallel sentinels sort outside every expert
    _check_position(route_experts(index, E, 16, with_position=True), T * K)
    _check_position(route_experts_torch(index, E, 16, with_position=True), T * K)
    assert route_experts(index, E, 16).position is None


@interpreter
def test_unsort_sum_skips_rows_outside_the_range_even_when_they_hold_nan():
    T, K, N = 5, 2, 7
    rows = torch.randn(T * K, N)
    position = torch.randperm(T * K, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    row_range = torch.tensor([2, 5, T * K - 1], dtype=torch.int32)  # rows 0, 1 and 9 belong to no expert
    rows[[0, 1, 9]] = float("nan")
    got = unsort_sum(rows, position, T, K, row_range=row_range)
    keep = ((position >= 2) & (position < T * K - 1)).float()[:, None]
    expected = (torch.nan_to_num(rows[position.long()]) * keep).view(T, K, N).sum(1)
    torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match="row_range must be a 1-D int32 tensor"):
        unsort_sum(rows, position, T, K, row_range=row_range.long())


@interpreter
@needs_grouped_mm
@pytest.mark.parametrize("T,H,I,E,K,routing", [
    (37, 20, 12, 5, 2, "random"),      # odd token count, several experts
    (12, 16, 8, 6, 1, "one_expert"),   # experts 0, 2..5 receive no row
    (1, 8, 4, 4, 4, "random"),         # one token, top-k = E
])
def test_scatter_on_grouped_mm_matches_reference_fp32(T, H, I, E, K, routing):
    problem = make_problem(T, H, I, E, K, routing=routing)
    got, ref = run_both(*problem, config=SCATTER)
    assert_close_all(got[:5], ref[:5])


@interpreter
@needs_grouped_mm
def test_scatter_on_grouped_mm_drops_sentinel_expert_ids():
    x, index, weights, w1, w2, _ = make_problem(10, 16, 8, 4, 2)
    index = index.clone()
    index[0, 1], index[3, 0] = 4, -1  # outside [0, E): the rows of no expert, never summed back
    got, ref = run_both(x, index, weights, w1, w2, None, config=SCATTER)
    assert_close_all(got[:5], ref[:5])
    assert got[2][0, 1] == 0 and got[2][3, 0] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < HOPPER,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("T,H,I,E,K", [(1000, 264, 136, 16, 4), (777, 512, 384, 64, 8), (5, 64, 32, 8, 2)])
def test_scatter_on_grouped_mm_bf16_gpu_against_fp32_reference(T, H, I, E, K):
    x, index, weights, w1, w2, _ = make_problem(T, H, I, E, K, device="cuda", dtype=BF16)
    index = index.clone()
    index[0, 0] = E  # a sentinel: its rows are written by nobody and must not reach the output
    got, _ = run_both(x, index, weights, w1, w2, None, config=KernelConfig(moe_engine="triton"))  # auto: grouped_mm
    assert_bf16_close_to_fp32(got, x, index, weights, w1, w2)


def test_dw1_goes_to_grouped_mm_under_auto_where_the_scatter_rule_would_send_the_scatter_gemms():
    args = dict(dtype=BF16, capability=HOPPER, has_lora=False, available=True) | QWEN3_30B
    assert dw1_on_grouped_mm(weight_grad="auto", **args)
    for other in ("per_tile", "kgrouped", "grouped_mm"):  # an explicit engine goes through expert_weight_grad
        assert not dw1_on_grouped_mm(weight_grad=other, **args)
    for change in (dict(capability=(8, 0)), dict(capability=None), dict(dtype=torch.float32), dict(has_lora=True),
                   dict(available=False), dict(hidden=2044)):
        assert not dw1_on_grouped_mm(weight_grad="auto", **(args | change)), change


@interpreter
@needs_grouped_mm
@pytest.mark.parametrize("scatter,weight_grad,grouped_calls", [
    ("grouped_mm", "auto", 3), ("grouped_mm", "per_tile", 2), ("triton", "auto", 1), ("triton", "per_tile", 0)])
def test_dw1_on_grouped_mm_is_its_own_rule(scatter, weight_grad, grouped_calls, monkeypatch):
    # where the rule holds (forced here: on CPU it needs bf16 on Hopper), dW1 is one more torch._grouped_mm, with
    # either scatter form; dW2 stays on the per-tile kernel
    monkeypatch.setattr(experts, "dw1_on_grouped_mm", lambda **k: k["weight_grad"] == "auto")
    x, index, weights, w1, w2, _ = make_problem(19, 144, 72, 5, 2)  # both dW1 sides > 128: not rank-sized
    index = index.clone()
    index[2, 0], index[7, 1] = -1, 5  # out-of-range ids sort after the last expert: never inside a group
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    config = SCATTER.replace(moe_scatter=scatter, moe_weight_grad=weight_grad)
    got, ref = run_both(x, index, weights, w1, w2, None, config=config)
    assert len(calls) == grouped_calls
    assert_close_all(got[:5], ref[:5])


def test_down_backward_rule_follows_the_scatter_rule_and_impossible_requests_name_why():
    args = dict(dtype=BF16, capability=HOPPER, has_lora=False, available=True) | QWEN3_30B
    # auto: CUTLASS for bf16 on Hopper (an H200 benchmark of 3746665), the fused kernel wherever the scatter GEMMs
    # stay on Triton
    assert experts.down_backward_engine(requested="auto", **args) == "grouped_mm"
    for other in (dict(dtype=torch.float32), dict(capability=(8, 0)), dict(capability=None), dict(has_lora=True),
                  dict(available=False), dict(intermediate=766)):
        assert experts.down_backward_engine(requested="auto", **(args | other)) == "triton", other
        assert experts.scatter_engine(requested="auto", **(args | other)) == "triton", other
    assert experts.down_backward_engine(requested="triton", **args) == "triton"
    assert experts.down_backward_engine(requested="grouped_mm", **args) == "grouped_mm"
    assert experts.down_backward_engine(requested="grouped_mm", **(args | dict(dtype=torch.float32,
                                                                                 capability=None))) == "grouped_mm"
    with pytest.raises(ValueError, match="moe_down_backward='grouped_mm' cannot run this layer: LoRA on the experts"):
        experts.down_backward_engine(requested="grouped_mm", **(args | dict(has_lora=True)))
    with pytest.raises(ValueError, match="multiples of 8"):
        experts.down_backward_engine(requested="grouped_mm", **(args | dict(intermediate=766)))
    with pytest.raises(ValueError, match="moe_down_backward must be one of auto, triton, grouped_mm"):
        experts.down_backward_engine(requested="cutlass", **args)
    assert KernelConfig.from_env({"LORA_LAB_MOE_DOWN_BACKWARD": "grouped_mm"}).moe_down_backward == "grouped_mm"


@interpreter
@needs_grouped_mm
@pytest.mark.parametrize("scatter,weight_grad", [("grouped_mm", "auto"), ("triton", "per_tile")])
@pytest.mark.parametrize("T,H,I,E,K,routing", [
    (37, 20, 12, 5, 2, "random"),      # odd token count, several experts
    (12, 16, 8, 6, 1, "one_expert"),   # experts 0, 2..5 receive no row
    (1, 8, 4, 4, 4, "random"),         # one token, top-k = E
])
def test_down_backward_on_grouped_mm_matches_reference_fp32(T, H, I, E, K, routing, scatter, weight_grad):
    problem = make_problem(T, H, I, E, K, routing=routing)
    config = SCATTER.replace(moe_scatter=scatter, moe_weight_grad=weight_grad, moe_down_backward="grouped_mm")
    got, ref = run_both(*problem, config=config)
    assert_close_all(got[:5], ref[:5])


@interpreter
@needs_grouped_mm
def test_down_backward_on_grouped_mm_drops_sentinel_ids_and_their_router_gradient(monkeypatch):
    x, index, weights, w1, w2, _ = make_problem(10, 16, 8, 4, 2)
    index = index.clone()
    index[0, 1], index[3, 0] = 4, -1
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    config = SCATTER.replace(moe_down_backward="grouped_mm")
    got, ref = run_both(x, index, weights, w1, w2, None, config=config)
    assert len(calls) == 4  # down forward, D, dW2 (K-grouped over the gathered dOut), dX (dW1 per-tile on a CPU)
    assert_close_all(got[:5], ref[:5])
    assert got[2][0, 1] == 0 and got[2][3, 0] == 0


@interpreter
@needs_grouped_mm
def test_down_backward_on_grouped_mm_frees_gate_up_before_the_dw2_gemm(monkeypatch):
    # [g | u] (S x 2I) has its last use in SiLU·up's backward: it is released before dW2's K-grouped GEMM allocates
    # its (E, H, I) output, not after it (a lower peak of this path)
    T, H, I, E, K = 10, 16, 8, 4, 2
    events = []
    real_free, real_k = experts.free_saved, experts.k_grouped_mm
    monkeypatch.setattr(experts, "free_saved", lambda t: events.append(("free", tuple(t.shape))) or real_free(t))
    monkeypatch.setattr(experts, "k_grouped_mm", lambda *a, **k: events.append(("dw2",)) or real_k(*a, **k))
    got, ref = run_both(*make_problem(T, H, I, E, K), config=SCATTER.replace(moe_down_backward="grouped_mm"))
    assert_close_all(got[:5], ref[:5])
    assert ("dw2",) in events and ("free", (T * K, 2 * I)) in events
    assert events.index(("free", (T * K, 2 * I))) < events.index(("dw2",)), events


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < HOPPER,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("T,H,I,E,K", [(1000, 264, 136, 16, 4), (777, 512, 384, 64, 8)])
def test_down_backward_on_grouped_mm_bf16_gpu_against_fp32_reference(T, H, I, E, K):
    x, index, weights, w1, w2, _ = make_problem(T, H, I, E, K, device="cuda", dtype=BF16)
    index = index.clone()
    index[0, 0] = -1  # a sentinel: sorted after the last expert, its row read by no GEMM
    config = KernelConfig(moe_engine="triton", moe_down_backward="grouped_mm")
    got, _ = run_both(x, index, weights, w1, w2, None, config=config)
    assert_bf16_close_to_fp32(got, x, index, weights, w1, w2)

"""The expert weight gradients through ``torch._grouped_mm`` (``KernelConfig.moe_weight_grad='grouped_mm'``)
against an fp64 reference and against the default Triton kernel.

CPU: torch's own ``_grouped_mm`` in fp32 (its CPU path), the Triton kernels in the interpreter where the test
compares against them. GPU (@pytest.mark.gpu): bf16 against an fp32 reference.
"""

from __future__ import annotations

import pytest
import torch
from test_moe_kgrouped_weight_grad import (
    interpreter,
    moe_gradients,
    needs_cuda,
    operands,
    reference_fp64,
    routing_of,
)

from lora_lab.experiments.fused_moe import make_moe_problem
from lora_lab.kernels.config import KernelConfig
from lora_lab.kernels.moe.engine import grouped_mm_available
from lora_lab.kernels.moe.expert_weight_grad import expert_weight_grad, grouped_mm_weight_grad, weight_grad_engine
from lora_lab.kernels.moe.routing import route_experts

GROUPED = KernelConfig(moe_weight_grad="grouped_mm", moe_autotune=False)
needs_grouped_mm = pytest.mark.skipif(not grouped_mm_available(), reason="this torch has no _grouped_mm")


def counting_grouped_mm(monkeypatch) -> list:
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    return calls


@needs_grouped_mm
@pytest.mark.parametrize("piece", ["gate_up", "down"])
@pytest.mark.parametrize("T,H,I,E,K,kind", [
    (29, 144, 136, 6, 2, "random"),  # both sides > 128, 16-byte rows in fp32; experts 4 and 5 receive no rows
    (24, 160, 132, 4, 1, "one_expert"),  # every row on one expert
])
def test_grouped_mm_matches_fp64_with_exact_zeros_for_empty_experts(T, H, I, E, K, kind, piece, monkeypatch):
    _, routing = routing_of(kind, T, E, K)
    a, b, gather_a, gather_b, row_weight = operands(routing, H, I, torch.float32, piece)
    calls = counting_grouped_mm(monkeypatch)
    got = expert_weight_grad(a, b, routing, gather_a=gather_a, gather_b=gather_b, row_weight=row_weight, scale=0.5,
                             config=GROUPED)
    assert len(calls) == 1  # one grouped GEMM, no Triton kernel
    ref = reference_fp64(a, b, routing, gather_a=gather_a, gather_b=gather_b, row_weight=row_weight, scale=0.5)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    empty = [e for e in range(E) if e not in {e for e, _, _ in routing.nonempty_experts()}]
    assert empty and (got[empty] == 0).all()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@needs_grouped_mm
@pytest.mark.parametrize("piece", ["gate_up", "down"])
def test_rows_of_out_of_range_expert_ids_add_nothing(piece, monkeypatch):
    # negative ids and ids >= E sort after the last expert (offsets[0] = 0): outside every group of the grouped
    # GEMM, so their sorted rows are never read (NaN there proves it) and reach no dW
    index = torch.randint(0, 5, (23, 2), generator=torch.Generator().manual_seed(5))
    index[::4, 0] = -1
    index[1::5, 1] = 7
    routing = route_experts(index, 5, 16)
    end = int(routing.expert_offsets[-1])
    assert int(routing.expert_offsets[0]) == 0 and end < routing.num_assignments
    a, b, gather_a, gather_b, row_weight = operands(routing, 144, 136, torch.float32, piece)
    for operand, gathered in ((a, gather_a), (b, gather_b)):
        if not gathered:
            operand[end:] = float("nan")
    before = (a.clone(), b.clone())
    calls = counting_grouped_mm(monkeypatch)
    got = expert_weight_grad(a, b, routing, gather_a=gather_a, gather_b=gather_b, row_weight=row_weight,
                             config=GROUPED)
    ref = reference_fp64(a, b, routing, gather_a=gather_a, gather_b=gather_b, row_weight=row_weight)
    assert len(calls) == 1
    # the operands are left as they were (no mask pass; a routing weight goes on A's gathered copy)
    assert a.isnan().equal(before[0].isnan()) and torch.equal(a.nan_to_num(), before[0].nan_to_num())
    assert b.isnan().equal(before[1].isnan()) and torch.equal(b.nan_to_num(), before[1].nan_to_num())
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@interpreter
@needs_grouped_mm
@pytest.mark.parametrize("H,I", [(37, 19), (36, 144), (144, 100)])
def test_rank_sized_or_unaligned_shapes_stay_on_the_triton_kernel(H, I, monkeypatch):
    # a side <= 128 (the LoRA factors' gradients) or rows not a multiple of 16 bytes: the default kernel runs
    _, routing = routing_of("random", 11, 5, 2)
    a, b, gather_a, gather_b, row_weight = operands(routing, H, I, torch.float32, "down")
    calls = counting_grouped_mm(monkeypatch)
    got = expert_weight_grad(a, b, routing, gather_a=gather_a, gather_b=gather_b, row_weight=row_weight,
                             config=GROUPED)
    default = expert_weight_grad(a, b, routing, gather_a=gather_a, gather_b=gather_b, row_weight=row_weight,
                                 config=GROUPED.replace(moe_weight_grad="per_tile"))
    assert calls == [] and torch.equal(got, default)


@interpreter
@needs_grouped_mm
@pytest.mark.parametrize("rank", [0, 3])
def test_moe_layer_gradients_match_the_default_setting(rank, monkeypatch):
    # dW1 and dW2 by _grouped_mm (the test asks for the expert weights' gradients); the LoRA factors' gradients,
    # rank-sized, stay on the Triton kernel
    problem = make_moe_problem(21, 144, 136, 5, 2, rank=rank, routing="random", dtype=torch.float32)
    default = moe_gradients(problem, KernelConfig(moe_autotune=False))
    calls = counting_grouped_mm(monkeypatch)
    got = moe_gradients(problem, GROUPED)
    assert len(calls) == 2
    for name, g, d in zip(["out", "dx", "d_weights", "dW1", "dW2", "dA1", "dB1", "dA2", "dB2"], got, default):
        torch.testing.assert_close(g, d, rtol=2e-5, atol=2e-5 * d.abs().max().item(), msg=name)


def test_auto_takes_per_tile_and_a_setting_is_taken_as_given():
    # notebook 06's H200 run of a6cdfd4: per_tile faster than grouped_mm at 2,185, 3,072 and 4,096 rows per expert
    # (Qwen1.5-MoE-, DeepSeek-V2-Lite- and OLMoE-like layers at 32k tokens), a tie at GPT-OSS-20B's 4,096: the rule
    # no longer looks at the device, the dtype or the rows per expert
    assert KernelConfig().moe_weight_grad == "auto"
    for explicit in ("per_tile", "kgrouped", "grouped_mm"):
        assert weight_grad_engine(KernelConfig(moe_weight_grad=explicit)) == explicit
    assert weight_grad_engine(KernelConfig(moe_weight_grad="auto")) == "per_tile"


@needs_grouped_mm
def test_grouped_mm_leaves_a_sorted_operand_untouched():
    # dW1's A (dGU) is read in sorted order, not gathered: the out-of-range mask and any routing weight are applied
    # to a copy, never to the caller's tensor
    _, routing = routing_of("random", 48, 6, 2)
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(routing.num_assignments, 144, generator=gen)
    b = torch.randn(routing.num_assignments, 136, generator=gen)
    weight = torch.rand(routing.num_assignments, generator=gen)
    before = a.clone()
    out = grouped_mm_weight_grad(a, b, routing, gather_a=False, gather_b=False, row_weight=weight, scale=1.0)
    assert out is not None and out.shape == (6, 144, 136)
    assert torch.equal(a, before)
    ref = reference_fp64(a, b, routing, gather_a=False, gather_b=False, row_weight=weight)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_the_setting_is_validated():
    assert KernelConfig(moe_weight_grad="grouped_mm").moe_weight_grad == "grouped_mm"
    with pytest.raises(ValueError, match="moe_weight_grad"):
        KernelConfig(moe_weight_grad="grouped")


@pytest.mark.gpu
@needs_cuda
@needs_grouped_mm
@pytest.mark.parametrize("piece", ["gate_up", "down"])
def test_grouped_mm_bf16_gpu_against_fp32_reference(piece):
    index, _ = routing_of("random", 2048, 64, 8)
    routing = route_experts(index.cuda(), 64, 16)
    a, b, gather_a, gather_b, row_weight = operands(routing, 2048, 768, torch.bfloat16, piece)
    a, b = a.cuda(), b.cuda()
    row_weight = row_weight.cuda() if row_weight is not None else None
    got = expert_weight_grad(a, b, routing, gather_a=gather_a, gather_b=gather_b, row_weight=row_weight,
                             config=GROUPED)
    ref = reference_fp64(a.float(), b.float(), routing, gather_a=gather_a, gather_b=gather_b,
                         row_weight=None if row_weight is None else row_weight.float())
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2

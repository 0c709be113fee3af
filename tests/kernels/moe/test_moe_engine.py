"""The engine dispatch of the fused MoE layer: the rule as a pure function, and the CUTLASS
grouped-GEMM engine (``torch._grouped_mm``) against the plain-torch reference, forward and every gradient.

CPU: torch's ``_grouped_mm`` fallback in fp32 (no Triton involved). GPU (@pytest.mark.gpu): bf16 on Hopper."""

from __future__ import annotations

import pytest
import torch
from test_moe_kernels import BF16_MAX_REL_L2, BF16_MIN_COSINE, assert_close_all, make_problem, run_both

from lora_lab.kernels.config import KernelConfig
from lora_lab.kernels.moe import engine
from lora_lab.kernels.moe.experts import moe_experts_reference
from lora_lab.numerics import cosine, rel_l2

BF16 = torch.bfloat16
HOPPER = (9, 0)
# (experts, tokens · top-k, hidden, intermediate) of notebook 06's layers at 8,192 tokens
MIXTRAL = dict(num_experts=8, num_assignments=8192 * 2, hidden=4096, intermediate=14336)
QWEN3_30B = dict(num_experts=128, num_assignments=8192 * 8, hidden=2048, intermediate=768)
QWEN15_MOE = dict(num_experts=60, num_assignments=8192 * 4, hidden=2048, intermediate=1408)
GPT_OSS_20B = dict(num_experts=32, num_assignments=8192 * 4, hidden=2880, intermediate=2880)
MIXTRAL_8X22B = dict(num_experts=8, num_assignments=8192 * 2, hidden=6144, intermediate=16384)


def reference_grads(x, index, weights, w1, w2, grad_seed=1):
    """What ``run_both`` returns for the reference (output and every gradient, the same upstream gradient), without
    running the fused kernels in that dtype too."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, weights, w1, w2)]
    out = moe_experts_reference(leaves[0], index, leaves[1], leaves[2], leaves[3], None)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out)
    return [out.detach(), *torch.autograd.grad(out, leaves, g)]


def choose(layer, **overrides):
    args = dict(dtype=BF16, capability=HOPPER, requested="auto", available=True) | layer | overrides
    return engine.choose_engine(**args)


def test_coarse_experts_and_lora_go_to_grouped_mm_and_fine_grained_full_layers_stay_on_triton():
    assert choose(MIXTRAL) == "grouped_mm" and choose(MIXTRAL_8X22B) == "grouped_mm"
    # GPT-OSS-20B-like (E 32, I 2880): the Triton kernels ran slower than grouped_mm in notebook 06 (bec6a1b)
    assert choose(GPT_OSS_20B) == "grouped_mm"
    assert choose(QWEN3_30B) == "triton" and choose(QWEN15_MOE) == "triton"
    assert choose(GPT_OSS_20B, num_experts=33) == "triton" and choose(GPT_OSS_20B, intermediate=2040) == "triton"
    # the same coarse layer off its fast path stays on Triton
    # LoRA on the experts goes there at every shape class (coarse: notebook 06, 6c94d2c, 1.77-2.56x the Triton
    # kernels; fine-grained: a diagnostic of 67c6617, 1.38x and 1.40x at 8k tokens), unless a rank breaks the 16-byte
    # strides or the layer is off the fast path
    assert choose(MIXTRAL, ranks=(16, 16)) == "grouped_mm" and choose(GPT_OSS_20B, ranks=(8,)) == "grouped_mm"
    assert choose(QWEN3_30B, ranks=(16, 16)) == "grouped_mm" and choose(QWEN15_MOE, ranks=(16, 16)) == "grouped_mm"
    assert choose(MIXTRAL, num_assignments=8 * 1000, ranks=(16, 16)) == "grouped_mm"  # few rows per expert too
    assert choose(MIXTRAL, ranks=(16, 4)) == "triton" and choose(MIXTRAL, ranks=(3,)) == "triton"
    assert choose(QWEN3_30B, ranks=(16, 4)) == "triton"
    assert choose(QWEN3_30B, ranks=(16, 16), capability=(8, 0)) == "triton"
    assert choose(QWEN3_30B, ranks=(16, 16), dtype=torch.float16) == "triton"
    assert choose(QWEN3_30B, ranks=(16, 16), available=False) == "triton"
    assert choose(MIXTRAL, capability=(8, 0)) == "triton" and choose(MIXTRAL, capability=None) == "triton"
    assert choose(MIXTRAL, dtype=torch.float16) == "triton" and choose(MIXTRAL, dtype=torch.float32) == "triton"
    assert choose(MIXTRAL, available=False) == "triton"
    assert choose(MIXTRAL, num_assignments=8 * 1000) == "triton"  # 1,000 rows per expert: too few
    assert choose(MIXTRAL, intermediate=2000) == "triton"


def test_requested_engine_wins_and_impossible_requests_name_why():
    assert choose(MIXTRAL, requested="triton") == "triton"
    assert choose(QWEN3_30B, requested="grouped_mm") == "grouped_mm"
    assert choose(QWEN3_30B, requested="grouped_mm", capability=None, dtype=torch.float32) == "grouped_mm"
    assert choose(MIXTRAL, requested="grouped_mm", ranks=(16, 8)) == "grouped_mm"
    with pytest.raises(ValueError, match="LoRA rank 16, 4 must be a multiple of 8"):
        choose(MIXTRAL, requested="grouped_mm", ranks=(16, 4))
    with pytest.raises(ValueError, match="multiples of 8"):
        choose(MIXTRAL, requested="grouped_mm", hidden=4100)
    with pytest.raises(ValueError, match="has no torch._grouped_mm"):
        choose(MIXTRAL, requested="grouped_mm", available=False)
    with pytest.raises(ValueError, match="moe_engine must be one of"):
        choose(MIXTRAL, requested="cutlass")
    with pytest.raises(ValueError, match="moe_engine"):
        KernelConfig(moe_engine="cutlass")
    assert KernelConfig.from_env({"LORA_LAB_MOE_ENGINE": "grouped_mm"}).moe_engine == "grouped_mm"


needs_grouped_mm = pytest.mark.skipif(not engine.grouped_mm_available(), reason="torch has no _grouped_mm")


@needs_grouped_mm
@pytest.mark.parametrize("T,H,I,E,K,routing", [
    (37, 20, 12, 5, 2, "random"),      # odd token count, several experts
    (12, 16, 8, 6, 1, "one_expert"),   # experts 0, 2..5 receive no row
    (1, 8, 4, 4, 4, "random"),         # one token, top-k = E
])
def test_grouped_mm_engine_matches_reference_fp32(T, H, I, E, K, routing):
    problem = make_problem(T, H, I, E, K, routing=routing)
    got, ref = run_both(*problem, config=KernelConfig(moe_engine="grouped_mm"))
    assert_close_all(got[:5], ref[:5])


@needs_grouped_mm
@pytest.mark.parametrize("T,H,I,E,K,rank,routing", [
    (37, 20, 12, 5, 2, 4, "random"),     # odd token count, LoRA on both expert weights (fp32: rank 4 = 16 bytes)
    (12, 16, 8, 6, 1, 8, "one_expert"),  # experts without rows: exact zero gradients for their factors too
    (1, 8, 4, 4, 4, 4, "random"),        # one token, top-k = E
])
def test_grouped_mm_engine_with_lora_matches_reference_fp32(T, H, I, E, K, rank, routing):
    """LoRA on the experts through the grouped-GEMM engine (moe_engine='grouped_mm'): output and all nine gradients
    (x, routing weights, both expert weights, the four factors) against the plain-torch reference."""
    problem = make_problem(T, H, I, E, K, rank=rank, routing=routing)
    got, ref = run_both(*problem, config=KernelConfig(moe_engine="grouped_mm"))
    assert_close_all(got, ref)
    unused = torch.bincount(problem[1].reshape(-1), minlength=E) == 0
    assert unused.any() == (routing == "one_expert")
    for name, grad in zip(["dA1", "dB1", "dA2", "dB2"], got[5:]):
        assert torch.all(grad[unused] == 0), name  # an expert without rows: exact zeros


@needs_grouped_mm
@pytest.mark.skipif(not __import__("lora_lab.kernels.triton_helpers", fromlist=["x"]).running_in_interpreter(),
                    reason="the factored LoRA pieces live in the Triton passes (TRITON_INTERPRET=1 on CPU)")
@pytest.mark.parametrize("pieces", [("gate_up_term",), ("p2",), ("d_term",), ("q1",), engine.LORA_PIECES])
def test_grouped_mm_engine_with_factored_lora_pieces_matches_reference_fp32(monkeypatch, pieces):
    """Each LoRA piece the SiLU·up passes can make from factors (engine.FACTORED_LORA_PIECES), alone and all four:
    output and all nine gradients against the reference, with an expert that gets no row."""
    monkeypatch.setattr(engine, "FACTORED_LORA_PIECES", frozenset(pieces))
    for problem in (make_problem(37, 20, 12, 5, 2, rank=4, routing="random"),
                    make_problem(12, 16, 8, 6, 1, rank=8, routing="one_expert")):
        got, ref = run_both(*problem, config=KernelConfig(moe_engine="grouped_mm"))
        assert_close_all(got, ref)


@needs_grouped_mm
def test_grouped_mm_engine_with_one_lora_half_and_frozen_experts_fp32():
    """LoRA on gate_up only, and the PEFT case (frozen expert weights: no dW1 / dW2 asked for)."""
    from lora_lab.kernels.moe.experts import fused_moe_experts
    from lora_lab.kernels.moe.lora import ExpertLoRA

    x, index, weights, w1, w2, lora = make_problem(21, 16, 8, 4, 2, rank=4)
    config = KernelConfig(moe_engine="grouped_mm")
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, weights, w1, w2, lora.gate_up_A, lora.gate_up_B)]
    half = ExpertLoRA(leaves[4], leaves[5], lora.gate_up_scale)
    out = fused_moe_experts(leaves[0], index, leaves[1], leaves[2], leaves[3], lora=half, config=config)
    want = moe_experts_reference(leaves[0], index, leaves[1], leaves[2], leaves[3], half)
    g = torch.randn_like(out)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.autograd.grad(out, leaves, g), torch.autograd.grad(want, leaves, g),
                               rtol=1e-4, atol=1e-5)
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, lora.gate_up_A, lora.gate_up_B, lora.down_A,
                                                                 lora.down_B)]
    full = ExpertLoRA(leaves[1], leaves[2], lora.gate_up_scale, leaves[3], leaves[4], lora.down_scale)
    out = fused_moe_experts(leaves[0], index, weights, w1, w2, lora=full, config=config)
    want = moe_experts_reference(leaves[0], index, weights, w1, w2, full)
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, leaves, g), torch.autograd.grad(want, leaves, g),
                               rtol=1e-4, atol=1e-5)


def test_keep_sorted_x_rule():
    rule = engine.keep_sorted_x
    assert rule(num_experts=128, lora_gate_up=True, full_fine_tuning=False)
    assert rule(num_experts=engine.KEEP_SORTED_X_MIN_EXPERTS, lora_gate_up=True, full_fine_tuning=False)
    assert not rule(num_experts=8, lora_gate_up=True, full_fine_tuning=False)  # coarse: the peak is close already
    assert not rule(num_experts=128, lora_gate_up=False, full_fine_tuning=False)  # nothing in backward reads it
    assert not rule(num_experts=128, lora_gate_up=True, full_fine_tuning=True)  # dW1's backward gathers again


@needs_grouped_mm
@pytest.mark.parametrize("E,keep", [(19, True), (6, False)])
def test_grouped_mm_engine_keeps_sorted_x_for_lora_on_frozen_fine_grained_experts_fp32(E, keep):
    """LoRA on frozen experts, more than 16 experts: the forward's sorted X is saved (the last saved tensor) and dA1
    reads it; the gradients match the reference either way, experts without rows included."""
    from lora_lab.kernels.moe.experts import fused_moe_experts
    from lora_lab.kernels.moe.lora import ExpertLoRA

    x, index, weights, w1, w2, lora = make_problem(29, 16, 8, E, 3, rank=4)
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, weights, lora.gate_up_A, lora.gate_up_B,
                                                                 lora.down_A, lora.down_B)]
    factors = ExpertLoRA(leaves[2], leaves[3], lora.gate_up_scale, leaves[4], leaves[5], lora.down_scale)
    out = fused_moe_experts(leaves[0], index, leaves[1], w1, w2, lora=factors,
                            config=KernelConfig(moe_engine="grouped_mm"))
    kept = out.grad_fn.saved_tensors[-1]
    if keep:
        torch.testing.assert_close(kept, x.index_select(0, out.grad_fn.saved_tensors[6].long()), rtol=0, atol=0)
    else:
        assert kept is None
    want = moe_experts_reference(leaves[0], index, leaves[1], w1, w2, factors)
    g = torch.randn_like(out)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.autograd.grad(out, leaves, g), torch.autograd.grad(want, leaves, g),
                               rtol=1e-4, atol=1e-5)


@needs_grouped_mm
def test_grouped_mm_engine_frees_gate_up_after_backward_and_says_so_on_a_second_one():
    """[g | u] is freed inside backward (peak memory): a second backward through the same graph is
    refused by name instead of reading a freed buffer."""
    x, index, weights, w1, w2, _ = make_problem(37, 20, 12, 5, 2, routing="random")
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, weights, w1, w2)]
    out = engine.grouped_mm_experts(leaves[0], index, leaves[1], leaves[2], leaves[3])
    grad = torch.randn_like(out)
    first = torch.autograd.grad(out, leaves, grad, retain_graph=True)
    assert all(g is not None and torch.isfinite(g).all() for g in first)
    with pytest.raises(RuntimeError, match="cannot run backward twice"):
        torch.autograd.grad(out, leaves, grad)


def test_free_saved_releases_only_a_tensor_that_owns_its_storage():
    from lora_lab.kernels.moe.routing import free_saved

    fresh = torch.randn(6, 4)
    free_saved(fresh)
    assert fresh.untyped_storage().nbytes() == 0
    whole = torch.randn(6, 4)
    view = whole[2:]
    free_saved(view)  # a view: left alone
    assert whole.untyped_storage().nbytes() == whole.numel() * whole.element_size()


@needs_grouped_mm
def test_grouped_mm_engine_plain_torch_passes_match_reference_fp32(monkeypatch):
    """The engine's torch fallback for its elementwise passes (a CPU without the interpreter)."""
    monkeypatch.setattr(engine, "_triton_runs", lambda t: False)
    problem = make_problem(37, 20, 12, 5, 2, routing="random")
    got, ref = run_both(*problem, config=KernelConfig(moe_engine="grouped_mm"))
    assert_close_all(got[:5], ref[:5])


@pytest.mark.skipif(not __import__("lora_lab.kernels.triton_helpers", fromlist=["x"]).running_in_interpreter(),
                    reason="the Triton passes run in TRITON_INTERPRET=1 on CPU")
@pytest.mark.parametrize("weighted", [True, False])
def test_unsort_sum_and_silu_mul_match_torch_fp32(weighted):
    from lora_lab.kernels.moe.silu_backward import silu_mul, unsort_sum

    gen = torch.Generator().manual_seed(1)
    T, K, N = 7, 3, 45
    rows = torch.randn(T * K, N, generator=gen)
    position = torch.randperm(T * K, generator=gen)
    weight = torch.rand(T * K, generator=gen) if weighted else None
    want = rows[position] * (weight[:, None] if weighted else 1)
    torch.testing.assert_close(unsort_sum(rows, position, T, K, weight), want.view(T, K, N).sum(1))
    gu = torch.randn(11, 2 * 37, generator=gen)
    g, u = gu.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gu), torch.nn.functional.silu(g) * u)
    row_weight = torch.rand(11, generator=gen)  # the engine's forward folds the routing weight into h
    torch.testing.assert_close(silu_mul(gu, row_weight), torch.nn.functional.silu(g) * u * row_weight[:, None])
    with pytest.raises(ValueError, match="weight"):
        silu_mul(gu, row_weight[:-1])
    # a LoRA term read in the same pass: the un-sort sums rows + s·extra; SiLU·up adds s·extra to [g | u] in place
    extra = torch.randn(T * K, N, generator=gen)
    want = (rows + 0.7 * extra)[position] * (weight[:, None] if weighted else 1)
    torch.testing.assert_close(unsort_sum(rows, position, T, K, weight, extra, 0.7), want.view(T, K, N).sum(1))
    extra_gu = torch.randn(11, 2 * 37, generator=gen)
    summed = gu + 0.3 * extra_gu
    h = silu_mul(gu, row_weight, extra_gu, 0.3)
    torch.testing.assert_close(gu, summed)  # written back: backward's SiLU·up reads the sum
    gs, us = summed.chunk(2, dim=-1)
    torch.testing.assert_close(h, torch.nn.functional.silu(gs) * us * row_weight[:, None])
    with pytest.raises(ValueError, match="extra"):
        unsort_sum(rows, position, T, K, weight, extra[:, :-1])
    with pytest.raises(ValueError, match="extra"):
        silu_mul(gu, None, extra_gu[:-1])
    with pytest.raises(ValueError, match="do not fit"):
        unsort_sum(rows, position[:-1], T, K)
    with pytest.raises(ValueError, match="silu_mul needs"):
        silu_mul(gu[:, :-1])


@needs_grouped_mm
def test_grouped_mm_engine_drops_sentinel_expert_ids():
    x, index, weights, w1, w2, _ = make_problem(10, 16, 8, 4, 2)
    index = index.clone()
    index[0, 1], index[3, 0] = 4, -1  # expert-parallel sentinels: outside [0, E)
    got, ref = run_both(x, index, weights, w1, w2, None, config=KernelConfig(moe_engine="grouped_mm"))
    assert_close_all(got[:5], ref[:5])
    assert got[2][0, 1] == 0 and got[2][3, 0] == 0  # no router gradient for a dropped choice


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < HOPPER,
                    reason="needs a Hopper GPU")
# one coarse shape (E <= 16, I >= 4096: the rule's grouped_mm class), kept small: T 1024 (an H200 run of
# this test timed out at 120 s with T 4096, mostly in an fp32 pass of the Triton kernels, autotuned, that the
# reference never needed), one fine-grained and one tiny shape
@pytest.mark.parametrize("T,H,I,E,K", [(1000, 264, 136, 16, 4), (1024, 1024, 4096, 8, 2), (5, 64, 32, 8, 2)])
def test_grouped_mm_engine_bf16_gpu_against_fp32_reference(T, H, I, E, K):
    problem = make_problem(T, H, I, E, K, device="cuda", dtype=BF16)
    x, index, weights, w1, w2, _ = problem
    got, _ = run_both(*problem, config=KernelConfig(moe_engine="grouped_mm"))
    ref = reference_grads(x.float(), index, weights.float(), w1.float(), w2.float())
    for name, a, b in zip(["out", "dx", "d_weights", "d_gate_up", "d_down"], got, ref):
        assert cosine(a, b) >= BF16_MIN_COSINE, (name, cosine(a, b))
        assert rel_l2(a, b) <= BF16_MAX_REL_L2, (name, rel_l2(a, b))


@pytest.mark.skipif(not __import__("lora_lab.kernels.triton_helpers", fromlist=["x"]).running_in_interpreter(),
                    reason="the Triton pass runs in TRITON_INTERPRET=1 on CPU")
@pytest.mark.parametrize("weight_h", [False, True])
@pytest.mark.parametrize("compute_router_grad", [True, False])
def test_fused_silu_backward_matches_torch_fp32(compute_router_grad, weight_h):
    from lora_lab.kernels.moe.silu_backward import silu_backward, silu_backward_reference

    gen = torch.Generator().manual_seed(0)
    S, I = 37, 45  # neither a multiple of the tile
    d, g, u = (torch.randn(S, I, generator=gen) for _ in range(3))
    gu = torch.cat([g, u], dim=-1)
    weight = torch.rand(S, generator=gen)
    valid = torch.rand(S, generator=gen) > 0.2
    got = silu_backward(d, gu, weight, valid, compute_router_grad=compute_router_grad, weight_h=weight_h)
    ref = silu_backward_reference(d, gu, weight, valid, compute_router_grad=compute_router_grad, weight_h=weight_h)
    # D = d + s·extra read in the same pass equals the pass on the summed D
    extra = torch.randn(S, I, generator=gen)
    with_extra = silu_backward(d, gu, weight, valid, compute_router_grad=compute_router_grad, weight_h=weight_h,
                               extra=extra, extra_scale=0.4)
    on_sum = silu_backward(d + 0.4 * extra, gu, weight, valid, compute_router_grad=compute_router_grad,
                           weight_h=weight_h)
    for a, b in zip(with_extra, on_sum):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    h = torch.nn.functional.silu(g) * u
    torch.testing.assert_close(got[1], h * weight[:, None] if weight_h else h, rtol=1e-5, atol=1e-5)
    if compute_router_grad:  # the router gradient takes the unweighted h either way
        torch.testing.assert_close(got[2], torch.where(valid, (d * h).sum(-1), 0), rtol=1e-4, atol=1e-4)
    for a, b in zip(got, ref):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # write_h=False (a caller that saved h in forward): no h, the same dGU and router gradient
    dgu, no_h, dw = silu_backward(d, gu, weight, valid, compute_router_grad=compute_router_grad, weight_h=weight_h,
                                  write_h=False)
    assert no_h is None
    torch.testing.assert_close(dgu, got[0], rtol=0, atol=0)
    if compute_router_grad:
        torch.testing.assert_close(dw, got[2], rtol=0, atol=0)
    if compute_router_grad:
        assert torch.all(got[2][~valid] == 0) and torch.any(got[2][valid] != 0)
    with pytest.raises(ValueError, match="do not fit"):
        silu_backward(d, gu[:, :-1], weight, valid, compute_router_grad=True)


def _low_rank_term_dense(p, factor, offsets):
    """The (S, N) term of a LowRankRows, expert by expert in plain torch."""
    out = torch.zeros(p.shape[0], factor.shape[2])
    for e in range(factor.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        out[lo:hi] = p[lo:hi] @ factor[e]
    return out


@pytest.mark.skipif(not __import__("lora_lab.kernels.triton_helpers", fromlist=["x"]).running_in_interpreter(),
                    reason="the Triton passes run in TRITON_INTERPRET=1 on CPU")
@pytest.mark.parametrize("counts,rank,inter", [
    ((3, 0, 40, 1, 7), 8, 37),  # an empty expert, one-row experts, a tile crossing three experts
    ((0, 0, 9), 16, 20),  # leading empty experts
    ((33,), 4, 16),  # one expert
    ((20, 17, 0, 0, 2, 30), 24, 45),  # a rank that pads to 32
])
def test_low_rank_term_made_in_the_silu_passes_matches_the_dense_term_fp32(counts, rank, inter):
    """SiLU·up forward and backward given a LoRA term as its factors (rank-r rows and each expert's factor) equal the
    same passes given the dense (S, N) term, and the rank-r products they sum of the rows they write equal the dense
    products, on sorted rows whose tiles cross expert boundaries."""
    from lora_lab.kernels.moe.silu_backward import LowRankOut, LowRankRows, silu_backward, silu_mul

    gen = torch.Generator().manual_seed(len(counts) * 100 + rank)
    num_experts, rows = len(counts), sum(counts)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    gu = torch.randn(rows, 2 * inter, generator=gen)
    weight = torch.rand(rows, generator=gen)
    p = torch.randn(rows, rank, generator=gen)
    b1 = torch.randn(num_experts, 2 * inter, rank, generator=gen)  # the engine's layout: (E, 2I, r), read transposed
    dense = _low_rank_term_dense(p, b1.transpose(1, 2), offsets)
    gu_dense, gu_factored = gu.clone(), gu.clone()
    want = silu_mul(gu_dense, weight, dense, 0.3)
    got = silu_mul(gu_factored, weight, None, 0.3, low_rank=LowRankRows(p, b1.transpose(1, 2), offsets))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gu_factored, gu_dense, rtol=1e-5, atol=1e-5)  # [g | u] + s·term, in place
    torch.testing.assert_close(gu_dense, gu + 0.3 * dense, rtol=1e-5, atol=1e-5)

    d = torch.randn(rows, inter, generator=gen)
    q2 = torch.randn(rows, rank, generator=gen)
    a2 = torch.randn(num_experts, rank, inter, generator=gen)
    valid = torch.rand(rows, generator=gen) > 0.2
    kw = dict(compute_router_grad=True, weight_h=True, extra_scale=0.7)
    want = silu_backward(d, gu, weight, valid, extra=_low_rank_term_dense(q2, a2, offsets), **kw)
    got = silu_backward(d, gu, weight, valid, low_rank=LowRankRows(q2, a2, offsets), **kw)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)

    # the rank-r product of the rows a pass writes, summed by that pass: P2 = h A2_e^T (forward), Q1 = dGU B1_e
    p2 = torch.zeros(rows, rank)
    h = silu_mul(gu.clone(), weight, low_rank_out=LowRankOut(a2.transpose(1, 2), offsets, p2))
    torch.testing.assert_close(p2, _low_rank_term_dense(h, a2.transpose(1, 2), offsets), rtol=1e-5, atol=1e-4)
    q1 = torch.zeros(rows, rank)
    dgu, _, _ = silu_backward(d, gu, weight, valid, low_rank=LowRankRows(q2, a2, offsets),
                              low_rank_out=LowRankOut(b1, offsets, q1), **kw)
    torch.testing.assert_close(dgu, want[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(q1, _low_rank_term_dense(dgu, b1, offsets), rtol=1e-5, atol=1e-4)


def test_low_rank_term_refuses_shapes_dtypes_and_two_terms():
    from lora_lab.kernels.moe.silu_backward import LowRankOut, LowRankRows, silu_backward, silu_mul

    rows, inter, rank = 6, 5, 4
    offsets = torch.tensor([0, 2, 6], dtype=torch.int32)
    gu = torch.randn(rows, 2 * inter)
    d, weight, valid = torch.randn(rows, inter), torch.rand(rows), torch.ones(rows, dtype=torch.bool)
    p, b1 = torch.randn(rows, rank), torch.randn(2, 2 * inter, rank)
    with pytest.raises(ValueError, match="do not fit"):  # the factor's N is not 2I
        silu_mul(gu, low_rank=LowRankRows(p, b1[:, :-1].transpose(1, 2), offsets))
    with pytest.raises(ValueError, match="do not fit"):  # offsets for another number of experts
        silu_mul(gu, low_rank=LowRankRows(p, b1.transpose(1, 2), offsets[:-1]))
    with pytest.raises(ValueError, match="do not fit"):  # p's rows
        silu_mul(gu, low_rank=LowRankRows(p[:-1], b1.transpose(1, 2), offsets))
    with pytest.raises(TypeError, match="int32"):
        silu_mul(gu, low_rank=LowRankRows(p, b1.transpose(1, 2), offsets.long()))
    with pytest.raises(TypeError, match="factor"):
        silu_mul(gu, low_rank=LowRankRows(p, b1.transpose(1, 2).double(), offsets))
    with pytest.raises(ValueError, match="not both"):
        silu_mul(gu, None, gu.clone(), low_rank=LowRankRows(p, b1.transpose(1, 2), offsets))
    with pytest.raises(ValueError, match="not both"):
        silu_backward(d, gu, weight, valid, compute_router_grad=False, extra=d.clone(),
                      low_rank=LowRankRows(p, torch.randn(2, rank, inter), offsets))
    a2t = torch.randn(2, rank, inter).transpose(1, 2)
    with pytest.raises(TypeError, match="fp32"):
        silu_mul(gu, low_rank_out=LowRankOut(a2t, offsets, torch.zeros(rows, rank, dtype=torch.float64)))
    with pytest.raises(ValueError, match="do not fit"):  # the factor's N is not I
        silu_mul(gu, low_rank_out=LowRankOut(b1, offsets, torch.zeros(rows, rank)))
    with pytest.raises(ValueError, match="do not fit"):  # the buffer's rank
        silu_backward(d, gu, weight, valid, compute_router_grad=False,
                      low_rank_out=LowRankOut(b1, offsets, torch.zeros(rows, rank + 1)))


@needs_grouped_mm
def test_grouped_mm_engine_takes_peft_strided_lora_views_fp32():
    """PEFT's flat expert LoRA weights become strided views (B's expert index is its fastest); the engine copies
    them into a plain layout for _grouped_mm and its gradients reach the flat PEFT weights."""
    from lora_lab.kernels.moe.experts import fused_moe_experts
    from lora_lab.kernels.moe.lora import ExpertLoRA, peft_expert_factors

    T, H, I, E, K, r = 19, 16, 8, 4, 2, 4
    x, index, weights, w1, w2, _ = make_problem(T, H, I, E, K)
    gen = torch.Generator().manual_seed(3)
    flat = [torch.randn(E * r, H, generator=gen), torch.randn(2 * I, r * E, generator=gen),
            torch.randn(E * r, I, generator=gen), torch.randn(H, r * E, generator=gen)]
    results = []
    for run in ("engine", "reference"):
        leaves = [t.clone().requires_grad_(True) for t in flat]
        a1, b1 = peft_expert_factors(leaves[0], leaves[1], E)
        a2, b2 = peft_expert_factors(leaves[2], leaves[3], E)
        assert not b1.is_contiguous()
        lora = ExpertLoRA(a1, b1, 0.5, a2, b2, 2.0)
        if run == "engine":
            out = fused_moe_experts(x, index, weights, w1, w2, lora=lora, config=KernelConfig(moe_engine="grouped_mm"))
        else:
            out = moe_experts_reference(x, index, weights, w1, w2, lora)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        results.append([out.detach(), *torch.autograd.grad(out, leaves, g)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < HOPPER,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("T,H,I,E,K", [(1024, 1024, 4096, 8, 2), (1000, 264, 136, 16, 4)])
def test_grouped_mm_engine_with_lora_bf16_gpu_against_fp32_reference(T, H, I, E, K):
    """LoRA (rank 16) on the grouped-GEMM engine in bf16 against the plain-torch reference in fp32 on the same
    rounded inputs (the reference only: no fp32 pass of the fused kernels), output and all nine gradients."""
    from lora_lab.kernels.moe.lora import ExpertLoRA

    problem = make_problem(T, H, I, E, K, rank=16, device="cuda", dtype=BF16)
    x, index, weights, w1, w2, lora = problem
    got, _ = run_both(*problem, config=KernelConfig(moe_engine="grouped_mm"))
    tensors = [t.detach().float().requires_grad_(True) for t in (x, weights, w1, w2, lora.gate_up_A, lora.gate_up_B,
                                                                  lora.down_A, lora.down_B)]
    lora32 = ExpertLoRA(tensors[4], tensors[5], lora.gate_up_scale, tensors[6], tensors[7], lora.down_scale)
    out = moe_experts_reference(tensors[0], index, tensors[1], tensors[2], tensors[3], lora32)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(BF16).to(out)  # run_both's, rounded
    ref = [out.detach(), *torch.autograd.grad(out, tensors, g)]
    for name, a, b in zip(["out", "dx", "d_weights", "d_gate_up", "d_down", "dA1", "dB1", "dA2", "dB2"], got, ref):
        assert cosine(a, b) >= BF16_MIN_COSINE, (name, cosine(a, b))
        assert rel_l2(a, b) <= BF16_MAX_REL_L2, (name, rel_l2(a, b))

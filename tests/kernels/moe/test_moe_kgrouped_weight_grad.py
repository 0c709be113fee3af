"""The K-grouped expert weight gradient (``KernelConfig.moe_weight_grad='kgrouped'``) against plain torch and against
the default kernel (``'per_tile'``).

CPU: Triton interpreter, fp32 and fp16 (the interpreter's bf16 ``tl.dot`` is wrong), tiny shapes, against an fp64
reference. GPU (@pytest.mark.gpu): bf16 against an fp32 reference.
"""

from __future__ import annotations

import pytest
import torch

from lora_lab.experiments.fused_moe import make_moe_problem
from lora_lab.kernels.config import KernelConfig
from lora_lab.kernels.moe import expert_weight_grad as weight_grad_module
from lora_lab.kernels.moe.expert_weight_grad import expert_weight_grad, expert_weight_grad_reference
from lora_lab.kernels.moe.experts import ExpertLoRA, fused_moe_experts
from lora_lab.kernels.moe.routing import route_experts
from lora_lab.kernels.triton_helpers import running_in_interpreter
from lora_lab.numerics import cosine, rel_l2

interpreter = pytest.mark.skipif(not running_in_interpreter(), reason="CPU tests run the kernels in TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

KGROUPED = KernelConfig(moe_weight_grad="kgrouped", moe_autotune=False)


def reference_fp64(a, b, routing, *, gather_a, gather_b, row_weight=None, scale=1.0):
    """G_e = scale · Σ_{j ∈ e} (w_j A[src_a(j)])ᵀ B[src_b(j)] in fp64, one expert at a time (the package's
    reference loop, computed in fp64)."""
    return expert_weight_grad_reference(a, b, routing, gather_a=gather_a, gather_b=gather_b, row_weight=row_weight,
                                        scale=scale, dtype=torch.float64)


def routing_of(kind: str, num_tokens: int, num_experts: int, top_k: int):
    gen = torch.Generator().manual_seed(7)
    if kind == "random":  # distinct experts per token, some experts left without rows
        index = torch.stack([torch.randperm(num_experts - 2, generator=gen)[:top_k] for _ in range(num_tokens)])
    elif kind == "one_expert":  # top-1, every row on expert 2; the others get none
        index = torch.full((num_tokens, top_k), 2)
    else:
        raise ValueError(kind)
    return index, route_experts(index, num_experts, 16)


def operands(routing, hidden, inter, dtype, piece):
    """(a, b, gather_a, gather_b, row_weight) of dW1 = dGUᵀ X (gate/up: SiLU·up backward output, weights already in
    it) or dW2 = (w · dOut)ᵀ h (down: routing weight applied on the gathered dOut rows)."""
    gen = torch.Generator().manual_seed(11)
    rows, tokens = routing.num_assignments, routing.num_tokens
    if piece == "gate_up":
        return (torch.randn(rows, 2 * inter, generator=gen).to(dtype), torch.randn(tokens, hidden, generator=gen)
                .to(dtype), False, True, None)
    weight = torch.rand(rows, generator=gen).to(dtype)
    return (torch.randn(tokens, hidden, generator=gen).to(dtype), torch.randn(rows, inter, generator=gen).to(dtype),
            True, False, weight)


@pytest.fixture
def nan_filled_outputs(monkeypatch):
    """Every floating ``torch.empty`` starts as NaN: a tile the kernel never writes shows up."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("piece", ["gate_up", "down"])
@pytest.mark.parametrize("loads", ["pointer", "persistent"])
@pytest.mark.parametrize("T,H,I,E,K,kind", [
    (13, 37, 19, 6, 2, "random"),  # odd H and I, top-2, experts 4 and 5 receive no rows
    (40, 150, 9, 4, 1, "one_expert"),  # 40 rows on one expert (2 K-steps of 32), H > 128: several tiles per expert
])
def test_kgrouped_matches_fp64_and_the_default_kernel(T, H, I, E, K, kind, loads, piece, dtype, nan_filled_outputs):
    _, routing = routing_of(kind, T, E, K)
    a, b, gather_a, gather_b, row_weight = operands(routing, H, I, dtype, piece)
    config = KGROUPED.replace(moe_loads=loads)
    got = expert_weight_grad(a, b, routing, gather_a=gather_a, gather_b=gather_b, row_weight=row_weight, scale=0.5,
                             config=config)
    ref = reference_fp64(a, b, routing, gather_a=gather_a, gather_b=gather_b, row_weight=row_weight, scale=0.5)
    assert got.dtype == dtype and got.shape == ref.shape
    assert torch.isfinite(got).all()  # every (expert, tile) written, over the NaN the output started as
    empty = [e for e in range(E) if e not in {e for e, _, _ in routing.nonempty_experts()}]
    assert empty and (got[empty] == 0).all()  # experts without rows: exact zeros, written by the kernel
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # fp16: operands exact, one rounding of the fp32 sum
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    # same sums in the same order as the default kernel (same tiles): identical in the interpreter
    default = expert_weight_grad(a, b, routing, gather_a=gather_a, gather_b=gather_b, row_weight=row_weight,
                                 scale=0.5, config=config.replace(moe_weight_grad="per_tile"))
    assert torch.equal(got, default)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kgrouped_reads_sorted_rows_through_tma_and_never_past_the_expert(dtype, monkeypatch):
    """moe_loads='persistent': aligned sorted operands go through TMA descriptors; a block of rows that runs past
    its expert's end must count as zero even when the next expert's rows hold NaN."""
    described = []
    real = weight_grad_module.row_descriptor
    monkeypatch.setattr(weight_grad_module, "row_descriptor", lambda rows: described.append(rows.shape) or real(rows))
    index = torch.tensor([[e] for e in [0] * 5 + [1] * 9 + [2] * 6])
    routing = route_experts(index, 3, 16)
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(20, n, generator=gen).to(dtype) for n in (32, 16))
    weight = torch.rand(20, generator=gen).to(dtype)
    lo, hi = routing.expert_offsets[1].item(), routing.expert_offsets[2].item()
    poisoned_a, poisoned_b = a.clone(), b.clone()
    poisoned_a[lo:hi] = float("nan")
    poisoned_b[lo:hi] = float("nan")
    for row_weight in (None, weight):
        got = expert_weight_grad(poisoned_a, poisoned_b, routing, gather_a=False, gather_b=False,
                                 row_weight=row_weight, config=KGROUPED.replace(moe_loads="persistent"))
        ref = reference_fp64(a, b, routing, gather_a=False, gather_b=False, row_weight=row_weight)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got[[0, 2]].double(), ref[[0, 2]], rtol=tol, atol=tol * ref.abs().max().item())
    assert len(described) == 4  # both operands, both calls


def moe_gradients(problem, config):
    """Output and the gradients of x, the routing weights, W1, W2 and the LoRA factors through the public op."""
    x, index, weights, w1, w2, lora = problem
    factors = [] if lora is None else [lora.gate_up_A, lora.gate_up_B, lora.down_A, lora.down_B]
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, weights, w1, w2, *factors)]
    lo = None if lora is None else ExpertLoRA(leaves[4], leaves[5], lora.gate_up_scale, leaves[6], leaves[7],
                                              lora.down_scale)
    out = fused_moe_experts(leaves[0], index, leaves[1], leaves[2], leaves[3], lora=lo, config=config)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    return [out.detach(), *torch.autograd.grad(out, leaves, g)]


@interpreter
@pytest.mark.parametrize("T,H,I,E,K,rank,routing,dtype", [
    (9, 37, 19, 5, 2, 0, "random", torch.float32),  # full fine-tuning: dW1, dW2; odd sizes
    (9, 37, 19, 5, 2, 3, "random", torch.float32),  # + LoRA on both expert weights: dA1, dB1, dA2, dB2 too
    (12, 32, 16, 6, 1, 2, "one_expert", torch.float32),  # experts without rows
    (9, 37, 19, 5, 3, 3, "random", torch.float16),
])
def test_moe_layer_gradients_match_the_default_setting(T, H, I, E, K, rank, routing, dtype, monkeypatch):
    problem = make_moe_problem(T, H, I, E, K, rank=rank, routing=routing, dtype=dtype)
    default = moe_gradients(problem, KernelConfig(moe_autotune=False))
    launches = []
    real = weight_grad_module.launch_kgrouped_weight_grad
    monkeypatch.setattr(weight_grad_module, "launch_kgrouped_weight_grad",
                        lambda *args, **kwargs: launches.append(kwargs["m_dim"]) or real(*args, **kwargs))
    got = moe_gradients(problem, KGROUPED)
    assert len(launches) == 2 + 4 * bool(rank)  # dW1, dW2 (+ the four LoRA factors) through the K-grouped kernel
    assert len(got) == len(default) == (4 + 4 * bool(rank)) + 1
    for name, g, d in zip(["out", "dx", "d_weights", "dW1", "dW2", "dA1", "dB1", "dA2", "dB2"], got, default):
        assert torch.equal(g, d), name


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("loads", ["pointer", pytest.param("persistent", marks=pytest.mark.needs_tma)])
@pytest.mark.parametrize("autotune", [False, True])
def test_kgrouped_bf16_gpu_against_fp32_reference(loads, autotune):
    """bf16 on the GPU (uneven experts, one empty; 264·2- and 136·2-byte rows: TMA-aligned) against fp32 on the same
    rounded inputs: cosine >= 0.999, relative L2 <= 2e-2, empty experts exactly zero."""
    T, H, I, E, K = 1000, 264, 136, 16, 4
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(T, E, generator=gen)
    logits[:, 0] += 3.0  # expert 0 takes most tokens
    logits[:, E - 1] = -1e9  # expert E-1 none
    index = torch.topk(logits, K, dim=-1).indices.cuda()
    routing = route_experts(index, E, 64)
    config = KernelConfig(moe_weight_grad="kgrouped", moe_loads=loads, moe_autotune=autotune)
    for piece in ("gate_up", "down"):
        a, b, gather_a, gather_b, row_weight = operands(routing, H, I, torch.bfloat16, piece)
        a, b = a.cuda(), b.cuda()
        row_weight = None if row_weight is None else row_weight.cuda()
        got = expert_weight_grad(a, b, routing, gather_a=gather_a, gather_b=gather_b, row_weight=row_weight,
                                 config=config).float()
        ref = reference_fp64(a.float(), b.float(), routing, gather_a=gather_a, gather_b=gather_b,
                             row_weight=None if row_weight is None else row_weight.float()).float()
        assert cosine(got, ref) >= 0.999 and rel_l2(got, ref) <= 2e-2, (piece, cosine(got, ref), rel_l2(got, ref))
        assert (got[E - 1] == 0).all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rank", [0, 16])
def test_kgrouped_moe_layer_bf16_gpu_against_fp32(rank):
    """The whole layer in bf16 with the K-grouped weight gradients, against the default setting in fp32."""
    problem = make_moe_problem(1000, 264, 136, 16, 4, rank=rank, device="cuda", dtype=torch.bfloat16)
    x, index, weights, w1, w2, lora = problem

    def up(t):
        return t.float()

    lora32 = None if lora is None else ExpertLoRA(up(lora.gate_up_A), up(lora.gate_up_B), lora.gate_up_scale,
                                                  up(lora.down_A), up(lora.down_B), lora.down_scale)
    # the Triton engine forced: on Hopper the rule would send the bf16 LoRA layer to the grouped-GEMM engine, which
    # has no K-grouped Triton kernel
    got = moe_gradients(problem, KernelConfig(moe_weight_grad="kgrouped", moe_engine="triton"))
    ref = moe_gradients((up(x), index, up(weights), up(w1), up(w2), lora32), KernelConfig())
    for g, r in zip(got, ref):
        assert cosine(g.float(), r) >= 0.999 and rel_l2(g.float(), r) <= 2e-2

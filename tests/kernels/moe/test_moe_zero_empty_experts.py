"""``zero_empty_experts_``: the pass that gives an expert without rows an exact-zero block after the K-grouped GEMM,
writing nothing else (CPU: Triton's interpreter; GPU: bf16 on CUDA)."""

from __future__ import annotations

import pytest
import torch

from lora_lab.kernels.moe.silu_backward import zero_empty_experts_


def ends_of(counts) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("counts", [
    (3, 0, 5, 0, 0, 2),  # empty experts in the middle, two in a row
    (0, 4, 1),  # a leading empty expert (its start is read as 0)
    (2, 7, 0),  # the last expert empty
    (0, 0, 0),  # no rows at all
    (1, 1, 1),  # none empty: nothing changes
])
@pytest.mark.parametrize("M,N", [(37, 19), (64, 300), (1, 1)])  # odd sizes, N past one 256-column block
def test_zeroes_exactly_the_empty_experts_blocks(counts, M, N):
    out = torch.randn(len(counts), M, N, generator=torch.Generator().manual_seed(M * N))
    out[0, 0, 0] = float("nan")  # a NaN in a block that is kept must stay (nothing but stores of zero happen)
    before = out.clone()
    assert zero_empty_experts_(out, ends_of(counts)) is out
    for e, count in enumerate(counts):
        if count == 0:
            assert (out[e] == 0).all(), f"expert {e} has no rows but its block is not zero"
        else:
            torch.testing.assert_close(out[e], before[e], rtol=0, atol=0, equal_nan=True)


def test_strided_output():
    # (E, M, N) viewed through a transpose of a contiguous (E, N, M): the strides are honoured
    base = torch.randn(4, 23, 41)
    out = base.transpose(1, 2)
    before = out.clone()
    zero_empty_experts_(out, ends_of((5, 0, 0, 9)))
    assert (out[1:3] == 0).all() and (base[1:3] == 0).all()
    assert torch.equal(out[0], before[0]) and torch.equal(out[3], before[3])


def test_bad_input_is_refused_by_name():
    out = torch.zeros(3, 4, 5)
    with pytest.raises(ValueError, match=r"out must be \(E, M, N\) and ends \(E,\)"):
        zero_empty_experts_(out, ends_of((1, 2)))
    with pytest.raises(ValueError, match=r"ends must be int32"):
        zero_empty_experts_(out, ends_of((1, 2, 3)).long())


@pytest.mark.gpu
def test_bf16_on_cuda_zeroes_only_empty_experts():
    counts = (700, 0, 3, 0, 1200, 0, 0, 9)
    out = torch.randn(len(counts), 768, 2048, device="cuda", dtype=torch.bfloat16)
    before = out.clone()
    zero_empty_experts_(out, ends_of(counts).cuda())
    for e, count in enumerate(counts):
        assert (out[e] == 0).all() if count == 0 else torch.equal(out[e], before[e])

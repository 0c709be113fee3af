"""lora_lab.numerics: the sliced fp64 sums give the whole-tensor fp64 figures, whatever the slice size."""
import pytest
import torch

from lora_lab import numerics


def whole(got, ref):
    g, r = got.double().flatten(), ref.double().flatten()
    return {"max_abs": float((g - r).abs().max()), "rel_l2": float((g - r).norm() / r.norm()),
            "cosine": float(torch.nn.functional.cosine_similarity(g, r, dim=0))}


@pytest.mark.parametrize("chunk", [7, 1000, numerics.CHUNK])
@pytest.mark.parametrize("shape", [(1,), (13, 7), (301, 33)])
def test_sliced_sums_match_the_whole_tensor(monkeypatch, chunk, shape):
    monkeypatch.setattr(numerics, "CHUNK", chunk)
    gen = torch.Generator().manual_seed(sum(shape))
    ref = torch.randn(shape, generator=gen)
    got = (ref + 1e-2 * torch.randn(shape, generator=gen)).bfloat16()
    expected, stats = whole(got, ref), numerics.error_stats(got, ref)
    assert stats["max_abs"] == expected["max_abs"]
    assert stats["rel_l2"] == pytest.approx(expected["rel_l2"], rel=1e-12)
    assert stats["cosine"] == pytest.approx(expected["cosine"], rel=1e-12)
    assert numerics.rel_l2(got, ref) == stats["rel_l2"] and numerics.cosine(got, ref) == stats["cosine"]


def test_zero_and_empty_and_mismatched():
    zeros = torch.zeros(5)
    assert numerics.error_stats(zeros, zeros) == {"max_abs": 0.0, "rel_l2": 0.0, "cosine": 1.0}
    assert numerics.rel_l2(torch.ones(4), zeros[:4]) == 2.0  # the plain difference norm when ref is zero
    assert numerics.max_abs_diff(torch.zeros(0), torch.zeros(0)) == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        numerics.max_abs_diff(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="sizes differ"):
        numerics.rel_l2(torch.zeros(4), torch.zeros(5))

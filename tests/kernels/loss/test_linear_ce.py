"""The fused linear cross-entropy against its plain-torch definition: loss and every gradient.

CPU (Triton's interpreter): fp32 for every option (reductions, label smoothing, z-loss, softcap, ignored rows,
frozen and trainable head), fp16 for the chunked fp32-accumulator paths (the interpreter's bf16 dots are wrong),
odd shapes (one token, a vocabulary that is not a multiple of the tile, every label ignored, 3-D input,
non-contiguous hidden states), both accumulation modes, and the input checks.
GPU (@pytest.mark.gpu): bf16 and fp16 at real vocabulary sizes, against the fp32 reference, with the issue's
tolerances (loss relative error <= 1e-3, dH and dW relative L2 <= 1e-2).
"""
import math

import pytest
import torch

from lora_lab.experiments.loss_block import OPTIONS, loss_inputs
from lora_lab.kernels.loss import LossKernelConfig, linear_cross_entropy, linear_cross_entropy_reference
from lora_lab.numerics import rel_l2

SMALL = LossKernelConfig(fwd_block_m=16, fwd_block_v=32, fwd_block_k=16, bwd_block_m=16, bwd_block_v=32,
                         bwd_block_k=16, bwd_block_d=16, group_m=2, chunk_rows=48, slab_vocab=96, programs_per_sm=1)
# (the default in the interpreter has the same tiles and automatic chunk / slab sizes)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(n, d, vocab, dtype, device=DEVICE, seed=0, ignored=(3,), weight_scale=0.3):
    return loss_inputs(n, d, vocab, dtype, device, seed=seed, weight_scale=weight_scale, ignored=ignored)


def _compare(h, w, y, trainable, config=None, grad_seed=1, **options):
    """Loss, dH and (trainable) dW of the op on (h, w) against the fp32 reference on the same values."""
    hk = h.clone().requires_grad_()
    wk = w.clone().requires_grad_(trainable)
    hr = h.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_(trainable)
    loss = linear_cross_entropy(hk, wk, y, config=config, **options)
    ref = linear_cross_entropy_reference(hr, wr, y, **options)
    gen = torch.Generator().manual_seed(grad_seed)
    g = torch.randn(ref.shape, generator=gen, dtype=torch.float64).to(ref.device)
    (loss.double() * g).sum().backward()
    (ref * g).sum().backward()
    out = {"loss": rel_l2(loss.detach().double(), ref.detach()), "dh": rel_l2(hk.grad.double(), hr.grad)}
    if trainable:
        out["dw"] = rel_l2(wk.grad.double(), wr.grad)
    assert hk.grad.dtype == h.dtype and hk.grad.shape == h.shape
    if trainable:
        assert wk.grad.dtype == w.dtype and wk.grad.shape == w.shape
    return out




@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_fp32_matches_reference(trainable, options):
    h, w, y = _inputs(37, 40, 203, torch.float32)
    err = _compare(h, w, y, trainable, config=SMALL, **options)
    assert err["loss"] <= 1e-5
    assert err["dh"] <= 1e-5
    if trainable:
        assert err["dw"] <= 1e-5


@pytest.mark.parametrize("accumulate", ["atomic", "auto"])
@pytest.mark.parametrize("head", ["frozen", "one_pass", "two_pass"])
def test_fp16_fp32_accumulators_over_chunks_and_slabs(accumulate, head):
    # 100 rows > chunk_rows=48 (dH: three row chunks) and 203 entries > slab_vocab=96 (dW: three slabs)
    h, w, y = _inputs(100, 40, 203, torch.float16)
    trainable = head != "frozen"
    cfg = SMALL.replace(accumulate=accumulate, trainable_plan="two_pass" if head == "two_pass" else "one_pass")
    err = _compare(h, w, y, trainable, config=cfg, label_smoothing=0.1, z_loss=1e-3, softcap=6.0)
    assert err["loss"] <= 1e-5  # fp32 logits from fp16 inputs: exact products, fp32 sums
    assert err["dh"] <= 2e-3  # dz rounded to fp16 before the products, as the standard path does
    if trainable:
        assert err["dw"] <= 2e-3


def test_fp16_mean_over_many_rows_does_not_underflow():
    # dz = (p - onehot)/N is ~1/(V·N) = 2e-7: subnormal in fp16 (6e-8 apart) unless scaled before the rounding
    h, w, y = _inputs(600, 16, 8000, torch.float16, weight_scale=0.1)
    cfg = SMALL.replace(bwd_block_m=64, bwd_block_v=128, fwd_block_m=64, fwd_block_v=128, chunk_rows=None,
                        slab_vocab=None)
    err = _compare(h, w, y, True, config=cfg)
    assert err["dh"] <= 5e-4 and err["dw"] <= 5e-4  # unscaled: 1.6e-3 and 1.5e-3 here


@pytest.mark.parametrize("n, vocab", [(1, 50), (17, 31), (64, 257)])
def test_odd_shapes(n, vocab):
    h, w, y = _inputs(n, 24, vocab, torch.float32, ignored=())
    err = _compare(h, w, y, True, config=SMALL)
    assert max(err.values()) <= 1e-5


def test_default_interpreter_config_and_three_dim_noncontiguous_hidden():
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(2, 40, 13, generator=gen).to(DEVICE)
    h = base.transpose(1, 2)  # [2, 13, 40], not contiguous
    w = (torch.randn(70, 40, generator=gen) * 0.2).to(DEVICE)
    y = torch.randint(0, 70, (2, 13), generator=gen).to(DEVICE)
    y[1, :4] = -100
    hk = h.clone().requires_grad_()
    loss = linear_cross_entropy(h.requires_grad_(), w, y)
    ref = linear_cross_entropy_reference(hk, w, y)
    loss.backward()
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert rel_l2(h.grad, hk.grad) <= 1e-5
    per_row = linear_cross_entropy(h.detach(), w, y, reduction="none")
    assert per_row.shape == y.shape and torch.all(per_row[1, :4] == 0)


def test_every_label_ignored():
    h, w, y = _inputs(9, 16, 40, torch.float32, ignored=range(9))
    hk = h.clone().requires_grad_()
    mean = linear_cross_entropy(hk, w, y, config=SMALL)
    assert math.isnan(mean.item())  # as F.cross_entropy: 0 / 0
    assert torch.isnan(linear_cross_entropy_reference(h, w, y)).item()
    total = linear_cross_entropy(hk, w, y, reduction="sum", config=SMALL)
    total.backward()
    assert total.item() == 0.0 and torch.count_nonzero(hk.grad) == 0


def test_zero_rows():
    h = torch.zeros(0, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(40, 16, device=DEVICE, requires_grad=True)
    y = torch.zeros(0, dtype=torch.long, device=DEVICE)
    total = linear_cross_entropy(h, w, y, reduction="sum")
    total.backward()
    assert total.item() == 0.0 and h.grad.shape == (0, 16) and torch.count_nonzero(w.grad) == 0


def test_int32_labels_and_frozen_head_has_no_weight_grad():
    h, w, y = _inputs(20, 16, 45, torch.float32)
    hk = h.clone().requires_grad_()
    linear_cross_entropy(hk, w, y.to(torch.int32), config=SMALL).backward()
    assert w.grad is None and hk.grad is not None


@pytest.mark.parametrize("bad, message", [
    (lambda h, w, y: (h, w[:, :-1], y), "last dimension"),
    (lambda h, w, y: (h, w, y[:-1]), "labels shape"),
    (lambda h, w, y: (h, w, y.float()), "int64"),
    (lambda h, w, y: (h, w.double(), y), "one dtype"),
    (lambda h, w, y: (h.double(), w.double(), y), "one dtype"),
    (lambda h, w, y: (h, w[0], y), r"\[vocab, hidden\]"),
])
def test_bad_inputs_are_named(bad, message):
    h, w, y = _inputs(8, 16, 30, torch.float32)
    with pytest.raises((TypeError, ValueError), match=message):
        linear_cross_entropy(*bad(h, w, y))


@pytest.mark.parametrize("options, message", [
    ({"reduction": "avg"}, "reduction"),
    ({"label_smoothing": 1.5}, "label_smoothing"),
    ({"z_loss": -1.0}, "z_loss"),
    ({"softcap": 0.0}, "softcap"),
    ({"ignore_index": 1.5}, "ignore_index"),
    ({"config": {"fwd_block_m": 64}}, "LossKernelConfig"),
])
def test_bad_options_are_named(options, message):
    h, w, y = _inputs(8, 16, 30, torch.float32)
    with pytest.raises((TypeError, ValueError), match=message):
        linear_cross_entropy(h, w, y, **options)


def test_label_outside_vocabulary():
    h, w, y = _inputs(8, 16, 30, torch.float32)
    y[2] = 30
    with pytest.raises(IndexError, match="label 30 is outside the vocabulary"):
        linear_cross_entropy(h, w, y)


def test_config_rejects_bad_tiles():
    with pytest.raises(ValueError, match="power of two"):
        LossKernelConfig(bwd_block_d=48)
    with pytest.raises(ValueError, match="accumulate"):
        LossKernelConfig(accumulate="lock")
    with pytest.raises(ValueError, match="trainable_plan"):
        LossKernelConfig(trainable_plan="both")
    with pytest.raises(ValueError, match="chunk_rows"):
        LossKernelConfig(chunk_rows=0)


def test_automatic_chunk_and_slab_sizes():
    cfg = LossKernelConfig()
    assert cfg.rows_per_chunk(16384) == 512 and cfg.rows_per_chunk(100) == 100 and cfg.rows_per_chunk(4096) == 256
    assert cfg.vocab_per_slab(151_936) == 4864 and cfg.vocab_per_slab(500) == 500


# ------------------------------------------------------------------------------------------------------------
# GPU: 16-bit at real vocabulary sizes, the tolerances
# ------------------------------------------------------------------------------------------------------------
GPU_SHAPES = [(1, 896, 151_936), (1000, 896, 151_936), (4097, 1024, 32_003), (2048, 4096, 128_256)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
@pytest.mark.parametrize("n, d, vocab", GPU_SHAPES)
def test_gpu_16bit_matches_fp32_reference(n, d, vocab, trainable, dtype):
    h, w, y = _inputs(n, d, vocab, dtype, device="cuda", weight_scale=0.02, ignored=(0, 5, 77))
    if n == 1:
        y[0] = 7  # one token, labelled
    err = _compare(h, w, y, trainable)
    assert err["loss"] <= 1e-3
    assert err["dh"] <= 1e-2
    if trainable:
        assert err["dw"] <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", ["atomic", pytest.param("tma", marks=pytest.mark.needs_tma)])
def test_gpu_bf16_options_and_accumulation(accumulate):
    h, w, y = _inputs(3001, 512, 50_257, torch.bfloat16, device="cuda", weight_scale=0.05)
    for plan in ("one_pass", "two_pass"):
        cfg = LossKernelConfig(accumulate=accumulate, chunk_rows=1000, slab_vocab=20_000, trainable_plan=plan)
        for options in ({"label_smoothing": 0.1, "z_loss": 1e-4}, {"softcap": 30.0, "reduction": "sum"}):
            err = _compare(h, w, y, True, config=cfg, **options)
            assert err["loss"] <= 1e-3 and err["dh"] <= 1e-2 and err["dw"] <= 1e-2, (plan, options, err)


@pytest.mark.gpu
def test_gpu_fp32_is_exact_to_fp32_rounding():
    h, w, y = _inputs(1500, 256, 10_007, torch.float32, device="cuda", weight_scale=0.1)
    err = _compare(h, w, y, True)
    assert max(err.values()) <= 1e-5


# The Ampere path (LORA_LAB_ARCH=sm80 on a GPU) in the interpreter: dW accumulated with atomics.
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter; on a GPU, LORA_LAB_ARCH=sm80 with -m gpu")
@pytest.mark.parametrize("trainable", [True, False])
def test_loss_on_the_ampere_path(trainable, ampere_path, monkeypatch):
    from lora_lab.kernels.loss import linear_ce

    modes = []
    real = linear_ce._accumulate_mode
    monkeypatch.setattr(linear_ce, "_accumulate_mode", lambda cfg, h: modes.append(real(cfg, h)) or modes[-1])
    h, w, y = _inputs(37, 24, 101, torch.float32)
    err = _compare(h, w, y, trainable)
    assert max(err.values()) <= 1e-5, err
    assert modes and set(modes) == {"atomic"}

"""Peer projects' test cases for a fused linear cross-entropy, ported: their case parameters and
tolerances, this project's test code.

* Liger-Kernel, ``test/transformers/test_fused_linear_cross_entropy.py`` (linkedin/Liger-Kernel at ead96b61):
  ``test_correctness`` / ``test_correctness_with_forward_only`` (shapes x (reduction, dtype, atol, rtol) x the
  plain and the all-options row), ``test_correctness_functional`` (shapes x dtypes) and ``test_amp`` (shapes x
  cast dtype x accumulation dtype). Not ported: bias and ce_weight (this op has neither: the patch refuses a
  biased lm_head), return_z_loss (no separate z-loss output), token accuracy and token scaling. Weight
  ``U(0, 1)``, hidden ``N(0, 1)``, a random number of labels set to ignore_index; checks ``allclose(ours, torch,
  atol, rtol)`` against torch in the same dtype with fp32 logits. On a CPU the large shape (8, 128, 1024, 4096)
  is run at (8, 16, 256, 1024) (the interpreter's time), the original on a GPU.
* Apple's Cut Cross-Entropy, ``tests/test_cce_loss_forward.py`` and ``tests/test_cce_loss_backward.py``
  (apple/ml-cross-entropy): dtype x softcap x shift x ignored rows x reduction x shape; ``e ~ N(0, 1/D)``, ``c ~ N(0,
  1)`` with its first rows equal to e's; the check is elementwise ``|ours - fp32| <= |torch in dtype - fp32| +
  tol``. Not ported: bias. On a CPU the shapes (256, 512, 128), (252, 507, 128), (252, 507, 123) are run at (32,
  64, 32), (28, 63, 32), (28, 63, 31), dtypes fp32 and fp16 (the interpreter's bf16 dots are wrong); bf16 at the
  original shapes on a GPU.

Each case runs on both paths where they apply: ``recompute`` always, ``fwdgrad`` for a scalar loss with gradients.
"""
import pytest
import torch

from lora_lab.kernels.loss import LossKernelConfig, linear_ce, linear_cross_entropy, linear_cross_entropy_reference

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
FWD = LossKernelConfig(impl="fwdgrad", ce_block_v=1024 if not GPU else 4096)
# the recomputing kernels with the tiles the op picks by itself (the interpreter's small ones on a CPU; fp32's
# smaller ones on a GPU, where the 16-bit tiles would not fit in shared memory)
REC = linear_ce._config(None, torch.bfloat16).replace(impl="recompute")
REC32 = linear_ce._config(None, torch.float32).replace(impl="recompute")


def _paths(dtype, reduction="mean"):
    """The paths a case runs on here: fwdgrad for a scalar loss; recompute except bf16 in the interpreter."""
    out = []
    if reduction != "none":
        out.append(FWD)
    if GPU or dtype != torch.bfloat16:
        out.append(REC32 if dtype == torch.float32 else REC)
    return out


def _rec(dtype):
    return REC32 if dtype == torch.float32 else REC


# ------------------------------------------------------------------------------------------------------------
# Liger-Kernel
# ------------------------------------------------------------------------------------------------------------
LIGER_SHAPES = [(8, 128, 1024, 4096), (4, 47, 31, 123)]
LIGER_TOL = [("mean", torch.bfloat16, 5e-3, 5e-2), ("mean", torch.float32, 1e-5, 5e-4),
             ("sum", torch.bfloat16, 5e-0, 5e1), ("sum", torch.float32, 1e-3, 5e-2)]
LIGER_OPTIONS = [dict(label_smoothing=0.0, ignore_index=-100, z_loss=0.0, softcap=None),
                 dict(label_smoothing=0.1, ignore_index=42, z_loss=1e-4, softcap=30.0)]


def _liger_shape(shape):
    return (8, 16, 256, 1024) if (shape == (8, 128, 1024, 4096) and not GPU) else shape


def _liger_inputs(shape, dtype, ignore_index, seed=42):
    B, T, H, V = _liger_shape(shape)
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(V, H, generator=gen).to(DEVICE, dtype)
    x = torch.randn(B * T, H, generator=gen).to(DEVICE, dtype)
    y = torch.randint(0, V, (B * T,), generator=gen)
    k = int(torch.randint(1, B * T // 2, (1,), generator=gen))
    y[torch.randperm(B * T, generator=gen)[:k]] = ignore_index
    return x, w, y.to(DEVICE)


def _allclose(got, ref, atol, rtol):
    assert torch.allclose(got.float(), ref.float(), atol=atol, rtol=rtol), \
        f"max |diff| {(got.float() - ref.float()).abs().max().item():.3e}"


def _liger_case(shape, reduction, dtype, atol, rtol, options, config, forward_only=False):
    x, w, y = _liger_inputs(shape, dtype, options["ignore_index"])
    kw = dict(reduction=reduction, **options)
    if forward_only:
        with torch.no_grad():
            _allclose(linear_cross_entropy(x, w, y, config=config, **kw),
                      linear_cross_entropy_reference(x, w, y, **kw), atol, rtol)
        return
    xo, wo = x.clone().requires_grad_(), w.clone().requires_grad_()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ours = linear_cross_entropy(xo, wo, y, config=config, **kw)
    ref = linear_cross_entropy_reference(xr, wr, y, **kw)
    _allclose(ours, ref, atol, rtol)
    ours.backward()
    ref.backward()
    _allclose(xo.grad, xr.grad, atol, rtol)
    _allclose(wo.grad, wr.grad, atol, rtol)


def _liger_params():
    for shape in LIGER_SHAPES:
        for reduction, dtype, atol, rtol in LIGER_TOL:
            for i, options in enumerate(LIGER_OPTIONS):
                yield pytest.param(shape, reduction, dtype, atol, rtol, options,
                                   id=f"{shape}-{reduction}-{str(dtype)[6:]}-{'plain' if i == 0 else 'options'}")


@pytest.mark.parametrize("shape, reduction, dtype, atol, rtol, options", list(_liger_params()))
def test_liger_correctness(shape, reduction, dtype, atol, rtol, options):
    for config in _paths(dtype, reduction):
        if config is not FWD and _liger_shape(shape)[2] > 64 and not GPU:
            continue  # the recomputing kernels at H 256 take minutes in the interpreter: the small shape covers them
        _liger_case(shape, reduction, dtype, atol, rtol, options, config)


@pytest.mark.parametrize("shape, reduction, dtype, atol, rtol, options", list(_liger_params()))
def test_liger_correctness_forward_only(shape, reduction, dtype, atol, rtol, options):
    # no gradient: the dispatch rule's inference case (recompute); fwdgrad forced once as well
    for config in _paths(dtype, reduction):
        if config is not FWD and _liger_shape(shape)[2] > 64 and not GPU:
            continue
        _liger_case(shape, reduction, dtype, atol, rtol, options, config, forward_only=True)


@pytest.mark.parametrize("shape", [(2, 2, 8, 8), (9, 7, 41, 41)])
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.bfloat16, 5e-3, 5e-2), (torch.float32, 1e-5, 5e-4)])
def test_liger_functional(shape, dtype, atol, rtol):
    for config in _paths(dtype):
        _liger_case(shape, "mean", dtype, atol, rtol, LIGER_OPTIONS[0], config)


@pytest.mark.parametrize("shape", LIGER_SHAPES)
@pytest.mark.parametrize("cast_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dw_accumulate", ["auto", "upcast"])  # Liger's accum_dtype None / fp32
def test_liger_amp(shape, cast_dtype, dw_accumulate):
    # Liger's amp case: fp32 parameters, the op under autocast; here the inputs cast to the autocast dtype
    # (the op takes one dtype), against torch on the same cast inputs; Liger's tolerance 5e-3 / 5e-2
    x, w, y = _liger_inputs(shape, torch.float32, -100)
    x, w = x.to(cast_dtype) * 0.1, w.to(cast_dtype)  # Liger scales fp32 inputs into range for the 16-bit GEMM
    for config in _paths(cast_dtype):
        if config is not FWD and (_liger_shape(shape)[2] > 64 and not GPU):
            continue
        cfg = config.replace(dw_accumulate=dw_accumulate, fwdgrad_chunk_rows=64) if config is FWD else config
        xo, wo = x.clone().requires_grad_(), w.clone().requires_grad_()
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        ours = linear_cross_entropy(xo, wo, y, config=cfg)
        ref = linear_cross_entropy_reference(xr, wr, y)
        _allclose(ours, ref, 5e-3, 5e-2)
        ours.backward()
        ref.backward()
        _allclose(xo.grad, xr.grad, 5e-3, 5e-2)
        _allclose(wo.grad, wr.grad, 5e-3, 5e-2)


# ------------------------------------------------------------------------------------------------------------
# Apple's Cut Cross-Entropy
# ------------------------------------------------------------------------------------------------------------
CCE_SHAPES = [(256, 512, 128), (252, 507, 128), (252, 507, 123)] if GPU else [(32, 64, 32), (28, 63, 32),
                                                                              (28, 63, 31)]
CCE_FWD_DTYPES = [(torch.float32, 1e-5), (torch.float16, 1e-3), (torch.bfloat16, 1e-2)]
CCE_BWD_DTYPES = [(torch.float16, 1e-3), (torch.bfloat16, 1e-2)]  # CCE runs bf16; fp16 (its commented row) here


def _cce_inputs(shape, dtype, invalids, seed=0):
    N, V, D = shape
    gen = torch.Generator().manual_seed(seed)
    e = torch.randn(N, D, generator=gen) / D**0.5
    c = torch.randn(V, D, generator=gen)
    c[: min(N, V) // 2] = e[: min(N, V) // 2]
    y = torch.randint(0, V, (N,), generator=gen)
    if invalids:
        y[torch.randperm(N, generator=gen)[: int(0.2 * N)]] = -100
    return e.to(DEVICE, dtype).view(4, -1, D), c.to(DEVICE, dtype), y.to(DEVICE).view(4, -1)


def _cce_skip(dtype):
    if dtype == torch.bfloat16 and not GPU:
        pytest.skip("bf16: the CPU port runs fp32 and fp16 (Triton's interpreter has wrong bf16 dots)")


def _shifted(e, y, shift):
    return (e[:, :-shift], y[:, shift:]) if shift else (e, y)


@pytest.mark.parametrize("shape", CCE_SHAPES)
@pytest.mark.parametrize("invalids", [False, True])
@pytest.mark.parametrize("shift", [0, 2])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("dtype, tol", CCE_FWD_DTYPES, ids=["fp32", "fp16", "bf16"])
def test_cce_loss_forward(dtype, tol, softcap, shift, invalids, shape):
    _cce_skip(dtype)
    e, c, y = _cce_inputs(shape, dtype, invalids)
    e, y = _shifted(e, y, shift)
    gt = linear_cross_entropy_reference(e.float(), c.float(), y, softcap=softcap, reduction="none")
    ref = linear_cross_entropy_reference(e, c, y, softcap=softcap, reduction="none")
    ours = linear_cross_entropy(e, c, y, softcap=softcap, reduction="none", config=_rec(dtype))
    assert ((ours - gt).abs() <= (ref - gt).abs() + tol).all()
    if GPU or dtype != torch.bfloat16:  # the mean through the fwdgrad path too
        mean = linear_cross_entropy(e, c, y, softcap=softcap, config=FWD)
        assert (mean - gt[y != -100].mean()).abs() <= (ref[y != -100].mean() - gt[y != -100].mean()).abs() + tol


def _cce_grads(e, c, y, softcap, shift, reduction, config=None, upcast=False):
    e = e.detach().clone().requires_grad_()
    c = c.detach().clone().requires_grad_()
    es, ys = _shifted(e, y, shift)
    if config is None:
        loss = linear_cross_entropy_reference(es.float() if upcast else es, c.float() if upcast else c, ys,
                                              softcap=softcap, reduction=reduction)
    else:
        loss = linear_cross_entropy(es, c, ys, softcap=softcap, reduction=reduction, config=config)
    if reduction == "sum":
        loss = loss / (ys != -100).count_nonzero()
    loss.mean().backward()
    return e.grad, c.grad


@pytest.mark.parametrize("shape", CCE_SHAPES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("invalids", [False, True])
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("dtype, tol", CCE_BWD_DTYPES, ids=["fp16", "bf16"])
def test_cce_loss_backward(dtype, tol, softcap, shift, invalids, reduction, shape):
    _cce_skip(dtype)
    e, c, y = _cce_inputs(shape, dtype, invalids)
    gt = _cce_grads(e, c, y, softcap, shift, reduction, upcast=True)
    ref = _cce_grads(e, c, y, softcap, shift, reduction)
    for config in _paths(dtype, reduction):
        cfg = config.replace(fwdgrad_chunk_rows=32, dw_accumulate="partial" if not GPU else "auto") \
            if config is FWD else config
        ours = _cce_grads(e, c, y, softcap, shift, reduction, config=cfg)
        for i, (g, r, o) in enumerate(zip(gt, ref, ours)):
            worst = ((o.float() - g).abs() - (r.float() - g).abs() - tol).max().item()
            assert worst <= 0, (i, config.impl, worst)

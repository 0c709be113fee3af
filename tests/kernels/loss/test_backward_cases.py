"""Backward cases of linear_cross_entropy on both paths: a mean over no labelled row (zero gradients, as
F.cross_entropy) and a second backward through the same graph (retain_graph=True).

CPU: Triton's interpreter, fp32 (and fp16, where the interpreter's dots are right); each case forces its path.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from lora_lab.experiments.loss_block import loss_inputs
from lora_lab.kernels.loss import LossKernelConfig, chosen_impl, linear_ce, linear_cross_entropy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FWD = LossKernelConfig(impl="fwdgrad", fwdgrad_chunk_rows=16, ce_block_v=64)  # 37 rows: chunks of 16, 16, 5
REC = linear_ce._config(None, torch.float32).replace(impl="recompute")
PATHS = {"fwdgrad": FWD, "recompute": REC}


def _leaves(h, w, trainable=True):
    return h.clone().requires_grad_(), w.clone().requires_grad_(trainable)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("path", list(PATHS))
def test_mean_over_no_labelled_row_gives_zero_gradients(path, dtype):
    h, w, y = loss_inputs(37, 16, 40, dtype, DEVICE, ignored=range(37))
    hk, wk = _leaves(h, w)
    assert chosen_impl(hk, wk, config=PATHS[path]) == path
    loss = linear_cross_entropy(hk, wk, y, config=PATHS[path])
    logits = (h.float() @ w.float().t()).requires_grad_()
    ref = F.cross_entropy(logits, y)
    ref.backward()
    assert math.isnan(loss.item()) and math.isnan(ref.item())  # 0 / 0, as F.cross_entropy
    assert torch.count_nonzero(logits.grad) == 0  # torch's gradient: exact zeros
    loss.backward()
    for g in (hk.grad, wk.grad):
        assert not torch.isnan(g).any() and torch.count_nonzero(g) == 0


def _two_backwards(path, trainable, first_grad=1.0, second_grad=1.0):
    h, w, y = loss_inputs(37, 24, 203, torch.float32, DEVICE, ignored=(3, 20))
    hk, wk = _leaves(h, w, trainable)
    assert chosen_impl(hk, wk, config=PATHS[path]) == path
    loss = linear_cross_entropy(hk, wk, y, config=PATHS[path])
    loss.backward(torch.tensor(first_grad), retain_graph=True)
    once = (hk.grad.clone(), wk.grad.clone() if trainable else None)
    loss.backward(torch.tensor(second_grad))
    return once, (hk.grad, wk.grad)


@pytest.mark.parametrize("trainable", [False, True], ids=["frozen_head", "trainable_head"])
@pytest.mark.parametrize("path", list(PATHS))
def test_second_backward_through_a_retained_graph_adds_the_gradient_again(path, trainable):
    once, twice = _two_backwards(path, trainable)
    torch.testing.assert_close(twice[0], 2 * once[0], rtol=1e-6, atol=0)
    if trainable:
        torch.testing.assert_close(twice[1], 2 * once[1], rtol=1e-6, atol=0)
    # a different incoming gradient the second time
    once, twice = _two_backwards(path, trainable, second_grad=-0.5)
    torch.testing.assert_close(twice[0], 0.5 * once[0], rtol=1e-5, atol=1e-7)


def test_second_backward_with_the_fp32_dw_accumulator():
    # fp16 over three chunks: dW is accumulated in an fp32 buffer that backward scales and rounds out of place
    h, w, y = loss_inputs(37, 24, 203, torch.float16, DEVICE, weight_scale=0.1, ignored=(3,))
    hk, wk = _leaves(h, w)
    loss = linear_cross_entropy(hk, wk, y, config=FWD.replace(dw_accumulate="partial"))
    assert loss.grad_fn.saved_tensors[1].dtype == torch.float32  # the accumulator is what was saved
    loss.backward(retain_graph=True)
    once = hk.grad.clone(), wk.grad.clone()
    loss.backward(torch.tensor(3.0))
    torch.testing.assert_close(hk.grad.float(), 4 * once[0].float(), rtol=2e-3, atol=1e-6)
    torch.testing.assert_close(wk.grad.float(), 4 * once[1].float(), rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("path", list(PATHS))
def test_autograd_grad_with_retain_graph_then_backward(path):
    h, w, y = loss_inputs(37, 24, 203, torch.float32, DEVICE, ignored=(3, 20))
    hk, wk = _leaves(h, w, trainable=False)
    loss = linear_cross_entropy(hk, wk, y, config=PATHS[path])
    (first,) = torch.autograd.grad(loss, hk, retain_graph=True)
    kept = first.clone()
    loss.backward()
    assert hk.grad is not None
    torch.testing.assert_close(hk.grad, kept, rtol=0, atol=0)
    torch.testing.assert_close(first, kept, rtol=0, atol=0)  # the first result is not overwritten


def test_second_backward_after_a_scaled_first_one_is_refused_by_name():
    h, w, y = loss_inputs(37, 24, 203, torch.float32, DEVICE, ignored=(3,))
    hk, wk = _leaves(h, w, trainable=False)
    loss = linear_cross_entropy(hk, wk, y, config=FWD)
    loss.backward(torch.tensor(2.0), retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward.*impl='recompute'"):
        loss.backward()
    # the recomputing path takes it
    hk.grad = None
    loss = linear_cross_entropy(hk, wk, y, config=REC)
    loss.backward(torch.tensor(2.0), retain_graph=True)
    once = hk.grad.clone()
    loss.backward()
    torch.testing.assert_close(hk.grad, 1.5 * once, rtol=1e-6, atol=0)


def test_without_retain_graph_the_saved_gradients_are_released_before_they_are_passed_on():
    # W.grad takes dW's own buffer (no copy), and a second backward is refused by autograd as for any op
    h, w, y = loss_inputs(37, 24, 203, torch.float32, DEVICE, ignored=(3,))
    hk, wk = _leaves(h, w)
    loss = linear_cross_entropy(hk, wk, y, config=FWD)
    dh, dw = loss.grad_fn.saved_tensors
    pointers = dh.data_ptr(), dw.data_ptr()
    del dh, dw
    loss.backward()
    assert (hk.grad.data_ptr(), wk.grad.data_ptr()) == pointers
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()

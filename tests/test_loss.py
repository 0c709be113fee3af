"""The chunked causal-LM loss against the standard one (all logits, fp32 cross-entropy)."""
import pytest
import torch
import torch.nn.functional as F

import lora_lab
from lora_lab.loss import (
    causal_lm_loss,
    chunked_cross_entropy,
    reference_cross_entropy,
    shift_labels,
)


def _inputs(n=37, d=24, vocab=101, dtype=torch.float32, device="cpu", seed=0, ignore_every=5):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen).to(device=device, dtype=dtype)
    weight = (0.3 * torch.randn(vocab, d, generator=gen)).to(device=device, dtype=dtype)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    if ignore_every:
        labels[::ignore_every] = -100
    return hidden.requires_grad_(), weight.requires_grad_(), labels.to(device)


def _loss_and_grads(fn, hidden, weight, labels, **kw):
    hidden.grad = weight.grad = None
    loss = fn(hidden, weight, labels, **kw)
    loss.backward()
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("chunk_size", [1, 8, 37, 1000])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_matches_reference_fp32(chunk_size, reduction):
    h, w, y = _inputs()
    ref = _loss_and_grads(reference_cross_entropy, h, w, y, reduction=reduction)
    got = _loss_and_grads(chunked_cross_entropy, h, w, y, chunk_size=chunk_size, reduction=reduction)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-7)


def test_reference_is_torch_cross_entropy():
    # the reference itself is F.cross_entropy on the upcast logits with ignore_index=-100
    h, w, y = _inputs()
    expected = F.cross_entropy((h @ w.T).float(), y, ignore_index=-100)
    torch.testing.assert_close(reference_cross_entropy(h, w, y), expected)


def test_leading_dims_and_ignored_rows_get_zero_gradient():
    h, w, y = _inputs(n=24)
    h3, y3 = h.detach().reshape(2, 12, -1).requires_grad_(), y.reshape(2, 12)
    loss = chunked_cross_entropy(h3, w, y3, chunk_size=5)
    loss.backward()
    ref = reference_cross_entropy(h.detach(), w.detach(), y)
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-6, atol=1e-6)
    assert h3.grad.shape == h3.shape
    ignored = (y3 == -100)
    assert ignored.any()
    assert torch.all(h3.grad[ignored] == 0)
    assert torch.all(h3.grad[~ignored].abs().sum(-1) > 0)


def test_gradcheck_fp64():
    h, w, y = _inputs(n=7, d=5, vocab=11, dtype=torch.float64, ignore_every=3)
    assert torch.autograd.gradcheck(lambda a, b: chunked_cross_entropy(a, b, y, chunk_size=3), (h, w))


def test_bf16_close_to_reference():
    h, w, y = _inputs(dtype=torch.bfloat16)
    ref = _loss_and_grads(reference_cross_entropy, h, w, y)
    got = _loss_and_grads(chunked_cross_entropy, h, w, y, chunk_size=8)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)  # fp32 softmax in both
    torch.testing.assert_close(got[1], ref[1])  # same bf16 logits gradient, same GEMM
    # dW: per-chunk bf16 products summed in fp32 vs one bf16 GEMM: within a few bf16 ulps
    torch.testing.assert_close(got[2].float(), ref[2].float(), rtol=2e-2, atol=2e-3)


def test_frozen_weight_gets_no_gradient():
    h, w, y = _inputs()
    w.requires_grad_(False)
    loss = chunked_cross_entropy(h, w, y, chunk_size=4)
    loss.backward()
    assert w.grad is None
    ref_h = h.detach().clone().requires_grad_()
    reference_cross_entropy(ref_h, w, y).backward()
    torch.testing.assert_close(h.grad, ref_h.grad, rtol=1e-5, atol=1e-7)


def test_all_rows_ignored_gives_nan_like_torch():
    h, w, y = _inputs(n=6)
    y[:] = -100
    assert torch.isnan(chunked_cross_entropy(h, w, y)) and torch.isnan(reference_cross_entropy(h, w, y))


def test_never_saves_a_tokens_by_vocab_tensor():
    n, vocab = 64, 300
    h, w, y = _inputs(n=n, vocab=vocab, ignore_every=0)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_cross_entropy(h, w, y, chunk_size=16)
    chunked_largest = max(saved)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        reference_cross_entropy(h, w, y)
    assert max(saved) >= n * vocab  # the standard loss keeps the [N, V] log-softmax
    assert chunked_largest == vocab * h.shape[1]  # the weight itself; nothing of size N x V
    assert chunked_largest < n * vocab


def test_shift_labels_like_transformers():
    labels = torch.tensor([[5, 6, 7, 8]])
    assert shift_labels(labels).tolist() == [[6, 7, 8, -100]]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(labels=torch.zeros(36, dtype=torch.long)), ValueError, "labels shape"),
        (dict(labels=torch.zeros(37)), TypeError, "int64"),
        (dict(weight=torch.randn(101, 23)), ValueError, "last dimension"),
        (dict(weight=torch.randn(101, 24, dtype=torch.float64)), TypeError, "dtype"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(reduction="none"), ValueError, "reduction"),
    ],
)
def test_bad_input_is_named(kwargs, error, match):
    h, w, y = _inputs()
    args = dict(hidden=h, weight=w, labels=y)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        chunked_cross_entropy(**args)


def test_label_outside_vocabulary_is_named():
    h, w, y = _inputs()
    y[3] = 101
    with pytest.raises(IndexError, match="label 101 is outside the vocabulary"):
        chunked_cross_entropy(h, w, y)


@pytest.fixture(scope="module")
def tiny_model():
    return lora_lab.load_model("random:tiny-qwen2", attn_implementation="sdpa").train()


@pytest.mark.parametrize("method", ["full", "lora"])
def test_causal_lm_loss_matches_transformers_loss(tiny_model, method):
    import copy

    model = copy.deepcopy(tiny_model)
    if method == "lora":
        lora_lab.add_lora(model, r=4, alpha=8)
        with torch.no_grad():  # B != 0 so that the LoRA gradients are not trivially equal
            for _, layer in lora_lab.lora_layers(model):
                layer.lora_B.normal_(0, 0.02)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 19), generator=gen)
    labels = ids.clone()
    labels[0, :4] = -100
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    standard = causal_lm_loss(model, ids, labels, chunked=False)
    standard.backward()
    ref_grads = {n: p.grad.clone() for n, p in trainable}
    model.zero_grad(set_to_none=True)
    chunked = causal_lm_loss(model, ids, labels, chunked=True, chunk_size=7)
    chunked.backward()

    torch.testing.assert_close(chunked, standard, rtol=1e-6, atol=1e-6)
    for n, p in trainable:
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_causal_lm_loss_rejects_head_with_bias(tiny_model):
    import copy

    model = copy.deepcopy(tiny_model)
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    ids = torch.randint(0, 100, (1, 8))
    with pytest.raises(ValueError, match="without bias"):
        causal_lm_loss(model, ids)
    with pytest.raises(ValueError, match="labels shape"):
        causal_lm_loss(tiny_model, ids, labels=ids[:, :4])


@pytest.mark.gpu
def test_bf16_on_cuda_matches_reference():
    h, w, y = _inputs(n=999, d=64, vocab=5003, dtype=torch.bfloat16, device="cuda")
    ref = _loss_and_grads(reference_cross_entropy, h, w, y)
    got = _loss_and_grads(chunked_cross_entropy, h, w, y, chunk_size=128)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1].float(), ref[1].float(), rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(got[2].float(), ref[2].float(), rtol=2e-2, atol=1e-3)

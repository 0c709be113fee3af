"""graphed_lora_linear (lora_lab.kernels.lora.graphs): the clear errors everywhere; on a GPU (@pytest.mark.gpu) the
graphed step's output and gradients against the plain-torch reference in bf16, replayed with new data."""
import pytest
import torch
from torch import nn

from lora_lab.kernels import KernelConfig, fused_lora_linear, graphed_lora_linear, lora_linear_reference
from lora_lab.numerics import rel_l2


class Fused(nn.Module):
    def __init__(self, weight, A, B, config):
        super().__init__()
        self.register_buffer("weight", weight)
        self.A, self.B, self.config = nn.Parameter(A), nn.Parameter(B), config

    def forward(self, x):
        return fused_lora_linear(x, self.weight, None, self.A, self.B, 2.0, config=self.config)


def test_a_function_is_refused_naming_why():
    with pytest.raises(TypeError, match="must be an nn.Module, got function.*parameters"):
        graphed_lora_linear(lambda x: x, torch.zeros(2, 2))


def test_sample_x_must_be_a_tensor():
    with pytest.raises(TypeError, match="sample_x must be a tensor, got list"):
        graphed_lora_linear(nn.Linear(2, 2), [[0.0, 1.0]])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA error: needs a machine without CUDA")
def test_without_cuda_the_error_says_so():
    with pytest.raises(RuntimeError, match="no CUDA device is available"):
        graphed_lora_linear(nn.Linear(4, 3), torch.randn(5, 4))


def test_warmup_iterations_must_be_positive():
    with pytest.raises(ValueError, match="num_warmup_iters must be >= 1"):
        graphed_lora_linear(nn.Linear(4, 3), torch.randn(5, 4), num_warmup_iters=0)


def test_a_cpu_input_or_a_parameter_elsewhere_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the checks before any CUDA call
    with pytest.raises(ValueError, match="sample_x is on cpu"):
        graphed_lora_linear(nn.Linear(4, 3), torch.randn(5, 4))


def _case(M, K, N, r, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / K**0.5).to("cuda", torch.bfloat16)
    A = (torch.randn(r, K, generator=g) / K**0.5).to("cuda", torch.bfloat16)
    B = (torch.randn(N, r, generator=g) / r**0.5).to("cuda", torch.bfloat16)
    return x, w, A, B


@pytest.mark.gpu
@pytest.mark.parametrize("fields", [{}, {"base_gemm": "cublas"}, {"base_gemm": "cublas", "rank_ops": "torch"}],
                         ids=["shipped", "cublas-base", "pure-cublas"])
def test_gpu_graphed_step_matches_the_reference_bf16(fields):
    M, K, N, r = 4099, 1030, 2051, 16
    x, w, A, B = _case(M, K, N, r)
    layer = Fused(w, A, B, KernelConfig.from_env(dispatch="triton", **fields))
    graphed = graphed_lora_linear(layer, x.clone().requires_grad_())
    for seed in (1, 2):  # new data each call: copied into the graph's buffers, replayed
        xs = torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)
        xs.requires_grad_()
        dy = torch.randn(M, N, generator=torch.Generator().manual_seed(10 + seed)).to("cuda", torch.bfloat16)
        y = graphed(xs)
        dx, da, db = torch.autograd.grad(y, [xs, layer.A, layer.B], dy)
        xr, Ar, Br = (t.detach().double().requires_grad_() for t in (xs, layer.A, layer.B))
        yr = lora_linear_reference(xr, w, None, Ar, Br, 2.0, dtype=torch.float64)
        yr.backward(dy.double())
        assert rel_l2(y, yr) < 1e-2
        assert rel_l2(dx, xr.grad) < 1e-2 and rel_l2(da, Ar.grad) < 5e-3 and rel_l2(db, Br.grad) < 5e-3


@pytest.mark.gpu
def test_gpu_another_shape_is_refused_naming_the_captured_one():
    x, w, A, B = _case(64, 32, 48, 4)
    graphed = graphed_lora_linear(Fused(w, A, B, KernelConfig.from_env()), x.clone().requires_grad_())
    with pytest.raises(ValueError, match=r"captured for an input of shape \(64, 32\).*got shape \(65, 32\).*one "
                                         "fixed shape"):
        graphed(torch.randn(65, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True))
    with pytest.raises(ValueError, match="requires_grad=False"):
        graphed(x)

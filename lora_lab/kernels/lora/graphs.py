"""One LoRA layer's forward and backward as two CUDA graphs: a step costs the host two graph launches instead of
every kernel's launch (``torch.cuda.make_graphed_callables``).

    layer = graphed_lora_linear(module, sample_x)   # captures forward + backward at sample_x's shape
    y = layer(x)                                    # x: the same shape, dtype, device and requires_grad
    y.backward(dy)                                  # gradients reach x and the module's parameters

A graph replays fixed addresses and shapes, so:

* one graph serves one input shape: another shape is refused with an error (capture another layer for it);
* the output and the gradients are the graph's own buffers, overwritten by the next call (``clone`` what you keep);
  a parameter's ``.grad`` set by ``backward`` may be that buffer too, so clear gradients with
  ``optimizer.zero_grad(set_to_none=True)`` (torch's default) between steps rather than accumulating over several;
* the module's parameters must keep their storage (in-place optimizer updates are fine, reassigning ``.data`` not);
* whatever the forward draws on the host is frozen into the graph: the fused op's dropout seed, for one, would give
  every replay the same mask, so graph a layer with dropout 0;
* the input is copied into the graph's input buffer unless it is that buffer (``sample_x`` itself), and the
  incoming gradient likewise: a graphed frozen layer pays the same copies, so it is the fair reference.

In the other training mode than the captured one (``eval()`` after capturing in train mode) the module runs
eagerly.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["GraphedLayer", "graphed_lora_linear"]


class _Call(nn.Module):
    """The user's module as a child: ``make_graphed_callables`` replaces this holder's ``forward``, not theirs."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


class GraphedLayer(nn.Module):
    """A module whose forward and backward replay CUDA graphs captured for one input signature."""

    def __init__(self, module: nn.Module, sample_x: torch.Tensor, num_warmup_iters: int = 3):
        super().__init__()
        self.name = type(module).__name__
        self.signature = _signature(sample_x)
        self.call = _Call(module)
        self.call.train(module.training)
        # replaces self.call's forward by the graphs' replay (in the captured training mode)
        torch.cuda.make_graphed_callables(self.call, (sample_x,), num_warmup_iters=num_warmup_iters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"graphed {self.name}: the input must be a tensor, got {type(x).__name__}")
        got = _signature(x)
        if got != self.signature:
            raise ValueError(
                f"graphed {self.name}: captured for an input of {_describe(self.signature)}, got {_describe(got)}; "
                "a CUDA graph replays one fixed shape: capture another graphed layer for this input "
                "(graphed_lora_linear(module, x)) or call the module itself")
        return self.call(x)


def graphed_lora_linear(module: nn.Module, sample_x: torch.Tensor, num_warmup_iters: int = 3) -> GraphedLayer:
    """``module``'s forward and backward captured as CUDA graphs at ``sample_x``'s shape (see the module notes).

    ``module``: any ``nn.Module`` of one tensor (a patched PEFT layer, a lora_lab LoRA layer, ``nn.Linear``); its
    trainable tensors must be its parameters, so the backward graph returns their gradients. The capture runs
    ``num_warmup_iters`` eager forward + backward passes first (compiling and autotuning outside the graph); those
    passes' gradients are not accumulated into ``.grad``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"graphed_lora_linear: module must be an nn.Module, got {type(module).__name__}: the graph's backward "
            "returns gradients for the module's parameters only, so a function's trainable tensors would get none; "
            "hold them as nn.Parameters of a module")
    if not isinstance(sample_x, torch.Tensor):
        raise TypeError(f"graphed_lora_linear: sample_x must be a tensor, got {type(sample_x).__name__}")
    if num_warmup_iters < 1:
        raise ValueError(f"graphed_lora_linear: num_warmup_iters must be >= 1 (compiling and autotuning must happen "
                         f"before the capture), got {num_warmup_iters}")
    if not torch.cuda.is_available():
        raise RuntimeError("graphed_lora_linear: CUDA graphs capture GPU kernels, and no CUDA device is available "
                           "here; call the module itself")
    if sample_x.device.type != "cuda":
        raise ValueError(f"graphed_lora_linear: sample_x is on {sample_x.device}; a CUDA graph needs the input on a "
                         "CUDA device")
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.device != sample_x.device:
            raise ValueError(f"graphed_lora_linear: {type(module).__name__}'s {name} is on {t.device} but sample_x is "
                             f"on {sample_x.device}")
    return GraphedLayer(module, sample_x, num_warmup_iters)


def _signature(x: torch.Tensor) -> tuple:
    return tuple(x.shape), x.dtype, x.device, x.requires_grad


def _describe(signature: tuple) -> str:
    shape, dtype, device, requires_grad = signature
    return (f"shape {shape}, {str(dtype).removeprefix('torch.')} on {device}, "
            f"requires_grad={requires_grad}")

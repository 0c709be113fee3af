"""Input checks of :func:`~lora_lab.kernels.loss.linear_ce.linear_cross_entropy`: its arguments (types, shapes,
dtypes, device, options) and its labels' range, the latter queued on the GPU so the op need not wait for it before
its first GEMM."""
from __future__ import annotations

import math

import torch

from lora_lab.kernels.triton_helpers import check_kernel_device

__all__ = ["DTYPES", "REDUCTIONS", "LabelCheck", "check_inputs"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
REDUCTIONS = ("mean", "sum", "none")


def check_inputs(hidden, weight, labels, ignore_index, reduction, label_smoothing, z_loss, softcap):
    """The arguments of :func:`~.linear_ce.linear_cross_entropy`, refused with a message that names the problem."""
    if not all(isinstance(t, torch.Tensor) for t in (hidden, weight, labels)):
        raise TypeError("hidden, weight and labels must be torch.Tensors")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [vocab, hidden], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden's last dimension (shape {tuple(hidden.shape)}) must equal weight's second "
                         f"dimension (shape {tuple(weight.shape)})")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal hidden's leading dimensions "
                         f"{tuple(hidden.shape[:-1])}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be int64 (or int32) class indices, got {labels.dtype}")
    if hidden.dtype not in DTYPES or weight.dtype != hidden.dtype:
        raise TypeError(f"hidden and weight must share one dtype of fp32, fp16, bf16; got {hidden.dtype} and "
                        f"{weight.dtype}")
    if hidden.device != weight.device or labels.device != hidden.device:
        raise ValueError(f"hidden, weight and labels must be on one device, got {hidden.device}, {weight.device}, "
                         f"{labels.device}")
    check_kernel_device(hidden, "hidden, weight and labels")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}; got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be a number in [0, 1]; got {label_smoothing!r}")
    if not isinstance(z_loss, (int, float)) or z_loss < 0.0 or not math.isfinite(z_loss):
        raise ValueError(f"z_loss must be a finite number >= 0; got {z_loss!r}")
    if softcap is not None and (not isinstance(softcap, (int, float)) or not softcap > 0.0
                                or not math.isfinite(softcap)):
        raise ValueError(f"softcap must be None or a finite number > 0; got {softcap!r}")


class LabelCheck:
    """The check that every label is ``ignore_index`` or in [0, vocab), in two steps: :meth:`queue` queues it and
    calling the object finishes it (queueing it first if need be), raising IndexError naming the first bad label.
    On CUDA the verdict is copied to pinned host memory behind an event, so the caller can queue GPU work before it
    waits (a plain ``bool(bad.any())`` would leave the GPU idle from that sync until the host queues the next
    kernel); elsewhere it is read at once. The gradients-in-forward path queues its first logit GEMM before this
    check's kernels, so the GPU starts the GEMM while the host queues the check and the small kernels after it.
    Both steps are idempotent."""

    def __init__(self, flat_labels: torch.Tensor, vocab: int, ignore_index: int):
        self.labels, self.vocab, self.ignore_index = flat_labels, vocab, ignore_index
        self._bad = self._verdict = self._ready = None
        self._done = False

    def queue(self) -> LabelCheck:
        if self._bad is None:
            y = self.labels
            self._bad = (y != self.ignore_index) & ((y < 0) | (y >= self.vocab))
            if y.device.type == "cuda":
                self._verdict = torch.empty((), dtype=torch.bool, pin_memory=True)
                self._verdict.copy_(self._bad.any(), non_blocking=True)
                self._ready = torch.cuda.Event()
                self._ready.record()
            else:
                self._verdict = self._bad.any()
        return self

    def __call__(self) -> None:
        if self._done:
            return
        self.queue()
        if self._ready is not None:
            self._ready.synchronize()
        if bool(self._verdict):
            first = int(self.labels[self._bad][0])
            raise IndexError(f"label {first} is outside the vocabulary [0, {self.vocab}) and is not "
                             f"ignore_index={self.ignore_index}")
        self._done = True


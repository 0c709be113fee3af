"""Measured peaks on CUDA, and which scaled-dot-product-attention kernel ran.

* :func:`peak_memory` -- the original article's loop: a few steps of forward, backward, AdamW step,
  ``zero_grad(set_to_none=True)``, with ``reset_peak_memory_stats`` before each step; the last step
  is read (AdamW creates its two states at the first step). Besides the peak it reads
  ``memory_allocated`` before the forward, at the end of the decoder body and after the loss, which
  splits the peak into *fixed* (weights + optimizer states), *layers* (activations the decoder holds
  for backward) and *head + loss* (what the lm_head, the loss and the backward add at the peak).
* :func:`sdpa_kernels_used` -- the SDPA implementation(s) that actually ran, from the profiler's op names.
"""
from __future__ import annotations

import contextlib
import gc
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .accounting import GIB, FixedMemory, SavedActivationReport, SavedTensorAccounting, fixed_memory_by_category

__all__ = ["PeakMemory", "peak_memory", "sdpa_kernels_used", "SDPA_OPS"]


#: profiler op name -> kernel family
SDPA_OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "cpu_flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_attention_math_for_mps": "math",
}


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence file descriptor 2 (native code's stderr) for the duration; Python's stderr is flushed first."""
    import os
    import sys

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def sdpa_kernels_used(fn: Callable[[], object]) -> dict:
    """Run ``fn()`` under ``torch.profiler`` and report which SDPA implementation(s) ran.

    Returns ``{"kernels": sorted kernel families (keys of SDPA_OPS' values), "ops": {op name:
    calls}, "device_kernels": [GPU kernel names that look like attention]}``. The families are
    read from the dispatcher op names, which name the implementation the SDPA dispatcher chose.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    with _quiet_native_stderr():  # some profiler builds log a line to fd 2 at start and stop
        prof.__enter__()
    try:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    finally:
        with _quiet_native_stderr():
            prof.__exit__(None, None, None)
    ops: Counter = Counter()
    device_kernels = set()
    for event in prof.events():
        name = event.name
        if name in SDPA_OPS or "scaled_dot_product" in name:
            ops[name] += 1
        if getattr(event, "device_type", None) is not None and str(event.device_type).endswith("CUDA"):
            low = name.lower()
            if any(s in low for s in ("flash", "fmha", "attention", "cutlass", "cudnn")):
                device_kernels.add(name)
    kernels = sorted({SDPA_OPS[n] for n in ops if n in SDPA_OPS})
    return {"kernels": kernels, "ops": dict(ops), "device_kernels": sorted(device_kernels)}


@dataclass
class PeakMemory:
    """One configuration's measured memory (bytes), read on the last step."""

    step_peaks: list[int]
    forward_peak: int
    backward_peak: int
    optimizer_peak: int
    before_forward: int
    after_body: int | None
    after_forward: int
    fixed_after_backward: FixedMemory
    accounting: SavedActivationReport | None = None

    @property
    def peak(self) -> int:
        return self.step_peaks[-1]

    @property
    def peak_phase(self) -> str:
        phases = {"forward": self.forward_peak, "backward": self.backward_peak, "optimizer": self.optimizer_peak}
        return max(phases, key=phases.get)

    @property
    def layers(self) -> int | None:
        return None if self.after_body is None else self.after_body - self.before_forward

    @property
    def head_loss(self) -> int | None:
        return None if self.after_body is None else self.peak - self.after_body

    def bars(self) -> dict[str, float]:
        return {"fixed": self.before_forward / GIB, "layers": (self.layers or 0) / GIB,
                "head_loss": (self.head_loss or 0) / GIB}


def _require_cuda(model: nn.Module) -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError(
            "peak_memory measures torch.cuda.max_memory_allocated and needs a CUDA device; none is "
            "available. On other devices use SavedTensorAccounting (saved activations) and analytic_memory."
        )
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError("peak_memory needs the whole model on one CUDA device, "
                         f"found parameters on {sorted(map(str, devices))}")
    return next(iter(devices))


def _standard_loss(model, batch):
    return model(**batch, use_cache=False).loss


def peak_memory(
    model: nn.Module,
    batch: dict[str, torch.Tensor] | torch.Tensor,
    steps: int = 3,
    loss_fn: Callable[[nn.Module, dict], torch.Tensor] | None = None,
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    account_step: int | None = None,
) -> PeakMemory:
    """Peak CUDA memory of a training step, the original article's way.

    ``steps`` times: ``reset_peak_memory_stats``; forward (``loss_fn(model, batch)``, default
    ``model(**batch).loss`` -- the output object is dropped, only the loss is kept); backward;
    ``optimizer.step()``; ``zero_grad(set_to_none=True)``. The last step is read (AdamW creates
    its state at the first). The peak is also reset at the phase boundaries, so the last step's
    forward / backward / optimizer peaks are known separately (the step peak is their maximum).
    A forward hook on the decoder body reads ``memory_allocated`` at the end of the body.
    ``account_step`` (an index < steps) runs that step's forward under SavedTensorAccounting.
    ``batch`` is a dict of model inputs (e.g. input_ids, labels) or a tensor of token ids
    (then used as labels too). Optimizer: AdamW(lr=1e-5) over the parameters that require grad.
    """
    device = _require_cuda(model)
    if isinstance(batch, torch.Tensor):
        batch = {"input_ids": batch, "labels": batch}
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if account_step is not None and not 0 <= account_step < steps:
        raise ValueError(f"account_step must be in [0, {steps}), got {account_step}")
    bad = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.device != device]
    if bad:
        raise ValueError(f"batch tensors {bad} are not on the model's device {device}")
    loss_fn = loss_fn or _standard_loss
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("no parameter of the model requires grad: nothing to train")
    optimizer = optimizer_factory(params) if optimizer_factory else torch.optim.AdamW(params, lr=1e-5)
    body = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    marks: dict[str, int] = {}

    def mark_body(module, args, output):
        marks["after_body"] = torch.cuda.memory_allocated(device)

    handle = body.register_forward_hook(mark_body) if isinstance(body, nn.Module) and body is not model else None
    step_peaks: list[int] = []
    report = None
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()
    try:
        for step in range(steps):
            marks.pop("after_body", None)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            if step == account_step:
                with SavedTensorAccounting(model) as acc:
                    loss = loss_fn(model, batch)
                report = acc.report
            else:
                loss = loss_fn(model, batch)
            after_forward = torch.cuda.memory_allocated(device)
            forward_peak = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            loss.backward()
            backward_peak = torch.cuda.max_memory_allocated(device)
            fixed = fixed_memory_by_category(model, optimizer)
            torch.cuda.reset_peak_memory_stats(device)
            optimizer.step()
            optimizer_peak = torch.cuda.max_memory_allocated(device)
            optimizer.zero_grad(set_to_none=True)
            del loss
            torch.cuda.synchronize(device)
            step_peaks.append(max(forward_peak, backward_peak, optimizer_peak))
    finally:
        if handle is not None:
            handle.remove()
    result = PeakMemory(
        step_peaks=step_peaks, forward_peak=forward_peak, backward_peak=backward_peak,
        optimizer_peak=optimizer_peak, before_forward=before, after_body=marks.get("after_body"),
        after_forward=after_forward, fixed_after_backward=fixed, accounting=report,
    )
    del optimizer
    return result

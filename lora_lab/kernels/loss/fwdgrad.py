"""The gradients-in-forward path of the fused linear cross-entropy: cuBLAS GEMMs on large row chunks, one Triton pass.

The loss is the last op of a training step, so its forward can compute the gradients too and its backward only
scales them by the incoming (scalar) gradient. Per chunk of ``rows`` rows (``H_c`` [rows, d]):

    Z_c  = H_c Wᵀ                    cuBLAS, into one reused [rows, V] buffer in the input dtype
    G_c  = ∂ℓ/∂Z_c  (in place)       :func:`~lora_lab.kernels.loss.kernels.logit_grad_kernel`: per row lse, loss
                                     and the gradient s·(a·softmax - b·onehot - e), written over Z_c
    dH_c = G_c W                     cuBLAS, straight into dH's rows
    dW  += G_cᵀ H_c                  cuBLAS, accumulated in fp32 (see ``dw_accumulate``); one chunk: dW = G_cᵀ H_c
                                     (the first chunk writes the accumulator instead of adding to zeros: no
                                     memset and no read of an fp32 [V, d] matrix)

Three GEMMs (two for a frozen head) at cuBLAS speed plus one memory-bound pass over the chunk (read twice,
written once), against the four GEMMs of the recomputing path (:mod:`.linear_ce`), which never holds a logit but
rebuilds them in backward. The price is memory: the logits chunk (``rows · V`` in the input dtype) and, for a
trainable head over more than one chunk, an fp32 [V, d] accumulator.

``dw_accumulate`` (how ``dW += G_cᵀ H_c`` keeps fp32 for 16-bit inputs; fp32 inputs accumulate in dW itself):
``"out_dtype"``: ``torch.addmm(acc, G_cᵀ, H_c, out_dtype=torch.float32, out=acc)``, 16-bit operands and an fp32
C matrix in one cuBLAS call (CUDA builds of torch that have ``aten::addmm.dtype_out``; the first chunk is
``torch.mm(G_cᵀ, H_c, out_dtype=torch.float32, out=acc)``, no C matrix read); ``"partial"``: the chunk's
product in the input dtype into a reused [V, d] buffer, then ``acc += partial`` (one more rounding per chunk,
V·d·2 more bytes); ``"upcast"``: fp32 copies of the chunk's operands and an fp32 GEMM (exact, slow, rows·V·4 more
bytes); ``"input_dtype"``: no fp32 buffer, dW accumulated in its own dtype by cuBLAS (``dW.addmm_``: one rounding
per chunk, Liger's default; the least memory, for memory-capped runs); ``"auto"``: ``out_dtype`` where it runs
(probed once per device and dtype), else ``partial``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from lora_lab.dtypes import addmm_fp32_out_works
from lora_lab.kernels.loss.kernels import (
    SCALE_BLOCK,
    SCALE_CAST_BLOCK,
    SCALE_MAX_PROGRAMS,
    logit_grad_kernel,
    scale_cast_kernel,
    scale_unless_one_kernel,
)

__all__ = ["FusedPlan", "plan_chunks", "dw_accumulate_mode", "fwdgrad_loss_and_grads", "scale_unless_one_",
           "FwdGradLinearCrossEntropyFunction"]

GIB = 2**30
ROW_MULTIPLE = 256  # chunk rows are a multiple of this (or all the rows): whole 128/256-row GEMM tiles


@dataclass(frozen=True)
class FusedPlan:
    """Rows per chunk and the bytes the path allocates beyond its inputs (dH and dW, the gradients it returns,
    included): ``logits`` (the reused chunk buffer), ``accumulator`` (fp32 dW, or the fp32 copies of ``upcast``,
    or the partial product of ``partial``), ``grads`` (dH, dW), ``per_row`` (loss, lse)."""

    rows: int
    chunks: int
    need_h: bool
    need_w: bool
    dw_mode: str | None
    logits: int
    accumulator: int
    grads: int
    per_row: int

    @property
    def total(self) -> int:
        return self.logits + self.accumulator + self.grads + self.per_row


def dw_accumulate_mode(requested: str, dtype: torch.dtype, device: torch.device) -> str:
    """The dW accumulation actually used: ``"direct"`` for fp32 inputs (dW is its own fp32 accumulator), else
    ``requested`` (``"auto"`` resolved); ``"out_dtype"`` where it cannot run is refused."""
    if dtype == torch.float32:
        return "direct"
    if requested == "auto":
        return "out_dtype" if addmm_fp32_out_works(device, dtype) else "partial"
    if requested == "out_dtype" and not addmm_fp32_out_works(device, dtype):
        raise ValueError(f"LossKernelConfig(dw_accumulate='out_dtype') needs torch.addmm(..., out_dtype=float32) for "
                         f"{dtype} on {device}, which this torch build does not run; use 'partial' or 'upcast'")
    return requested


def _rows_per_chunk(n: int, vocab: int, itemsize: int, cfg, need_w: bool = True) -> int:
    if cfg.fwdgrad_chunk_rows is not None:
        return max(1, min(n, cfg.fwdgrad_chunk_rows))
    by_bytes = cfg.fwdgrad_chunk_bytes // max(1, vocab * itemsize)
    most = cfg.fwdgrad_max_rows if need_w else min(cfg.fwdgrad_max_rows, cfg.fwdgrad_frozen_max_rows)
    rows = min(most, by_bytes) // ROW_MULTIPLE * ROW_MULTIPLE
    return max(1, min(n, max(ROW_MULTIPLE, rows)))


def plan_chunks(n: int, d: int, vocab: int, dtype: torch.dtype, need_h: bool, need_w: bool, cfg,
                device: torch.device | None = None, rows: int | None = None) -> FusedPlan:
    """The chunk plan (rows per chunk, bytes) of :func:`fwdgrad_loss_and_grads` for these sizes and settings."""
    device = torch.device("cpu") if device is None else device
    itemsize = torch.empty(0, dtype=dtype).element_size()
    rows = _rows_per_chunk(n, vocab, itemsize, cfg, need_w) if rows is None else max(1, min(n, rows))
    chunks = -(-n // rows) if n else 0
    dw_mode = dw_accumulate_mode(cfg.dw_accumulate, dtype, device) if need_w else None
    accumulator = 0
    if need_w and chunks > 1:
        accumulator = {"direct": 0, "input_dtype": 0, "out_dtype": 4 * vocab * d,
                       "partial": (4 + itemsize) * vocab * d,
                       "upcast": 4 * vocab * d + 4 * rows * (vocab + d)}[dw_mode]
    grads = (n * d * itemsize if need_h else 0) + (vocab * d * itemsize if need_w else 0)
    return FusedPlan(rows=rows, chunks=chunks, need_h=need_h, need_w=need_w, dw_mode=dw_mode,
                     logits=rows * vocab * itemsize, accumulator=accumulator, grads=grads, per_row=8 * n + 16)


_DRIVER_FREE: dict[tuple[str, int], tuple[int, int]] = {}  # device -> (driver's free bytes, torch's reserved bytes)
ESTIMATE_HEADROOM = 2 * GIB  # an estimate is trusted only with this much (or a quarter of the need) to spare


def free_bytes(device: torch.device, need: int | None = None) -> int | None:
    """Bytes a new allocation can take on ``device``: what torch's allocator holds unused plus free device memory;
    None off CUDA (the interpreter's CPU runs are not planned).

    With ``need``, the driver is not asked when a cheaper figure covers it: first the allocator's unused bytes
    alone; then an estimate from the driver's last answer on this device, less what torch's allocator has reserved
    since (``cudaMemGetInfo`` is a driver call made before the op's first kernel is queued, about 0.5 ms on an
    H200, during which a synchronised loop's GPU idles). The estimate is used only when it covers ``need`` with
    ``max(ESTIMATE_HEADROOM, need / 4)`` to spare, since memory taken outside torch's allocator since that answer
    (another process, a library's own cudaMalloc) is not in it; short of that, the driver is asked again. Without
    ``need``, the driver is always asked (the figure an error message reports)."""
    if device.type != "cuda":
        return None
    # the nested statistics: torch.cuda.memory_stats flattens the same dict into some 150 dotted keys in Python,
    # host time spent before the op's first kernel is queued
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    reserved = int(stats.get("reserved_bytes", {}).get("all", {}).get("current", 0))
    held = reserved - int(stats.get("allocated_bytes", {}).get("all", {}).get("current", 0))
    if need is not None and held >= need:
        return held
    key = (device.type, torch.cuda.current_device() if device.index is None else device.index)
    if need is not None and key in _DRIVER_FREE:
        driver_then, reserved_then = _DRIVER_FREE[key]
        estimate = driver_then - (reserved - reserved_then) + held
        if estimate >= need + max(ESTIMATE_HEADROOM, need // 4):
            return estimate
    free, _ = torch.cuda.mem_get_info(device)
    _DRIVER_FREE[key] = (int(free), reserved)
    return int(free) + held


def fitting_plan(n, d, vocab, dtype, need_h, need_w, cfg, device) -> tuple[FusedPlan, bool]:
    """The configured plan, or (automatic chunk size) the largest chunk down to 256 rows that fits in free memory;
    and whether it fits."""
    plan = plan_chunks(n, d, vocab, dtype, need_h, need_w, cfg, device)
    free = free_bytes(device, need=plan.total)
    if free is None or plan.total <= free:
        return plan, True
    rows = plan.rows
    while cfg.fwdgrad_chunk_rows is None and rows > ROW_MULTIPLE:
        rows = max(ROW_MULTIPLE, rows // 2 // ROW_MULTIPLE * ROW_MULTIPLE)
        smaller = plan_chunks(n, d, vocab, dtype, need_h, need_w, cfg, device, rows=rows)
        if smaller.total <= free:
            return smaller, True
        plan = smaller
    return plan, False


def plan_error(plan: FusedPlan, free: int | None, n: int, vocab: int, d: int, device) -> str:
    return (f"linear_cross_entropy (gradients-in-forward path) cannot fit its chunk plan on {device}: "
            f"{plan.total / GIB:.2f} GiB needed for {n} rows x {vocab} vocabulary entries x d={d} "
            f"(logits chunk of {plan.rows} rows {plan.logits / GIB:.2f} GiB, dW accumulator "
            f"{plan.accumulator / GIB:.2f} GiB, gradients {plan.grads / GIB:.2f} GiB), "
            f"{(free or 0) / GIB:.2f} GiB free; set LossKernelConfig(fwdgrad_chunk_rows=...) smaller or "
            "impl='recompute' (no logits held)")


def _unwritten(shape, dtype, device) -> torch.Tensor:
    """A buffer the chunk loop writes whole before it reads it (tests fill it with NaN to prove it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _accumulate_dw(g_t, h_c, dw, acc, partial, dw_mode, first: bool) -> None:
    """dW (or its fp32 accumulator) ``+= G_cᵀ H_c``; ``first``: ``=`` instead (the buffers start unwritten)."""
    if dw is not None:
        if first:
            torch.mm(g_t, h_c, out=dw)  # one chunk: dW = G_cᵀ H_c, rounded once
        else:
            dw.addmm_(g_t, h_c)  # fp32: dW is its own accumulator (input_dtype: rounded per chunk)
    elif dw_mode == "out_dtype":
        if first:
            torch.mm(g_t, h_c, out_dtype=torch.float32, out=acc)
        else:
            torch.addmm(acc, g_t, h_c, out_dtype=torch.float32, out=acc)
    elif dw_mode == "partial":
        torch.mm(g_t, h_c, out=partial)
        if first:
            acc.copy_(partial)
        else:
            acc.add_(partial)
    elif first:  # upcast
        torch.mm(g_t.float(), h_c.float(), out=acc)
    else:
        acc.addmm_(g_t.float(), h_c.float())


def fwdgrad_loss_and_grads(hidden, weight, labels, ignore_index, reduction, label_smoothing, z_loss, softcap,
                           need_h, need_w, cfg, plan: FusedPlan, cast_dw: bool = True,
                           labels_checked: Callable[[], None] | None = None):
    """(loss, dH or None, dW or None) for an incoming gradient of 1: the chunk loop of the module docstring.

    ``hidden`` [N, d] and ``weight`` [V, d] in one dtype, ``labels`` [N] int64; ``reduction`` "mean" or "sum".
    ``cast_dw=False``: where dW was accumulated in an fp32 buffer, that buffer is returned as dW, uncast (the
    autograd function scales it by the incoming gradient and rounds it to the input dtype in one pass).
    ``labels_checked``: called once the first chunk's logit GEMM is queued and before any kernel reads a label (the
    caller's label range check, which raises on a label outside the vocabulary). Where it has a ``queue`` method
    (:class:`~lora_lab.kernels.loss.checks.LabelCheck`), that is called first, right after the GEMM is queued: the
    check's kernels queue behind the GEMM, the host waits for the GEMM and the check together, and the GPU idles
    only for the launch of the softmax-gradient kernel after the GEMM instead of for every small kernel before it.
    """
    n, d = hidden.shape
    vocab = weight.shape[0]
    dtype, device = hidden.dtype, hidden.device
    # the first chunk's logit GEMM is queued before anything else: the small kernels below (the label check, the
    # label count, the scale) and the host work between them then run while the GPU computes the GEMM, instead of
    # each one leaving the GPU idle until the host queues the next (an H200 kernel profile of adcb417 found about
    # 2 ms per step of such gaps before the first GEMM, under the profiler). The price: the label check now queues
    # behind this GEMM, so the host waits for the GEMM too and the GPU idles for one launch (the softmax pass's)
    # after it.
    # In a whole training step, where the host runs ahead of the GPU through the model's forward, the old order hid
    # the small kernels anyway and paid nothing; there this order costs that one launch. A check on a side stream,
    # waiting only for the work queued before the GEMM, would pay neither (not written yet: it needs a GPU to test).
    logits = torch.empty((plan.rows, vocab), dtype=dtype, device=device) if n else None
    if n:
        torch.mm(hidden[: min(n, plan.rows)], weight.t(), out=logits[: min(n, plan.rows)])  # Z_0 = H_0 Wᵀ
    queue = getattr(labels_checked, "queue", None)
    if queue is not None:
        queue()
    valid = labels != ignore_index
    count = valid.sum()
    ones = torch.ones(1, dtype=torch.float32, device=device)
    # no labelled row: zero gradients, as F.cross_entropy (a factor of 1/0 would make fp16's post-scaling 0 · inf)
    scale = (ones / count.clamp(min=1).to(torch.float32)) if reduction == "mean" else ones
    # fp16's range: dz/N underflows (as in the recomputing path); its gradient stays unscaled (O(1)) and the
    # GEMMs' results are scaled once afterwards. bf16 and fp32 take the factor inside the kernel.
    post_scale = scale if (dtype == torch.float16 and reduction == "mean") else None
    kernel_scale = ones if post_scale is not None else scale
    write_grad = need_h or need_w
    loss_rows = torch.empty(n, dtype=torch.float32, device=device)
    lse = torch.empty(n, dtype=torch.float32, device=device)
    dh = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_h else None
    dw = acc = partial = None
    if need_w:
        # every buffer below is written whole by the first chunk's GEMM (no rows: zeros, the gradient of nothing)
        alloc = _unwritten if n else torch.zeros
        if plan.chunks <= 1 or plan.dw_mode in ("direct", "input_dtype"):
            dw = alloc(weight.shape, dtype=dtype, device=device)
        else:
            acc = alloc(weight.shape, dtype=torch.float32, device=device)
            if plan.dw_mode == "partial":
                partial = _unwritten(weight.shape, dtype=dtype, device=device)
    block_v = min(cfg.ce_block_v, max(16, 1 << (vocab - 1).bit_length()))
    for r0 in range(0, n, plan.rows):
        r1 = min(n, r0 + plan.rows)
        h_c = hidden[r0:r1]
        z = logits[: r1 - r0]
        if r0 > 0:
            torch.mm(h_c, weight.t(), out=z)  # Z_c = H_c Wᵀ (the first chunk's is queued above)
        elif labels_checked is not None:
            labels_checked()  # the kernel below loads z[label] unmasked: no label reaches it unchecked
        logit_grad_kernel[(r1 - r0,)](
            z, z.stride(0), labels[r0:r1], loss_rows[r0:r1], lse[r0:r1], kernel_scale,
            vocab, ignore_index, float(label_smoothing), float(z_loss), float(softcap or 0.0),
            HAS_SOFTCAP=softcap is not None, SMOOTHING=label_smoothing > 0.0, Z_LOSS=z_loss > 0.0,
            WRITE_GRAD=write_grad, BLOCK_V=block_v, num_warps=cfg.ce_warps,
        )
        if need_h:
            torch.mm(z, weight, out=dh[r0:r1])  # dH_c = G_c W
        g_t = z.t()
        if need_w:
            _accumulate_dw(g_t, h_c, dw, acc, partial, plan.dw_mode, first=r0 == 0)
    if post_scale is not None:
        if dh is not None:
            dh.mul_(post_scale)
        if acc is not None:
            acc.mul_(post_scale)
        elif dw is not None:
            dw.mul_(post_scale)
    if n == 0 and labels_checked is not None:
        labels_checked()
    z = g_t = logits = partial = None  # the chunk buffer is freed before dW's fp32 -> input-dtype copy
    if acc is not None:
        dw = acc.to(dtype) if cast_dw else acc
        del acc
    total = loss_rows.sum()
    loss = total / count.to(torch.float32) if reduction == "mean" else total
    return loss, dh, dw


def scale_unless_one_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x *= scale`` in place (fp32 product, one rounding), with no pass over ``x`` when ``scale`` is exactly 1
    (:func:`~.kernels.scale_unless_one_kernel`: the GPU reads the scale, the host never waits for it); ``x``
    contiguous, ``scale`` one fp32 on its device."""
    if not (x.is_contiguous() and scale.numel() == 1 and scale.dtype == torch.float32):
        raise ValueError(f"scale_unless_one_ needs a contiguous tensor and one fp32 scale; got {x.dtype} "
                         f"{tuple(x.shape)} (contiguous: {x.is_contiguous()}), scale {scale.dtype} x{scale.numel()}")
    n = x.numel()
    if n:
        programs = min(triton.cdiv(n, SCALE_BLOCK), SCALE_MAX_PROGRAMS)
        scale_unless_one_kernel[(programs,)](x, scale, n, BLOCK=SCALE_BLOCK, num_warps=8)
    return x


def scale_cast_(src: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = src · scale`` rounded once to ``out``'s dtype (:func:`~.kernels.scale_cast_kernel`); ``src`` a
    contiguous fp32 tensor, ``scale`` one fp32 on its device, ``out`` contiguous, of ``src``'s shape."""
    if not (src.is_contiguous() and out.is_contiguous() and src.shape == out.shape and src.dtype == torch.float32
            and scale.numel() == 1 and scale.dtype == torch.float32):
        raise ValueError(f"scale_cast_ needs contiguous fp32 src and out of one shape and one fp32 scale; got "
                         f"{src.dtype} {tuple(src.shape)}, {out.dtype} {tuple(out.shape)}, scale {scale.dtype} "
                         f"x{scale.numel()}")
    n = src.numel()
    if n:
        scale_cast_kernel[(triton.cdiv(n, SCALE_CAST_BLOCK),)](src, out, scale, n, BLOCK=SCALE_CAST_BLOCK,
                                                                num_warps=8)
    return out


class FwdGradLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper of the gradients-in-forward path: forward computes the loss and the gradients of the
    inputs that need them (for an incoming gradient of 1); backward multiplies them, in place, by the incoming
    scalar gradient. Nothing of H or W is saved. A dW accumulated in fp32 stays fp32 until backward, which scales
    and rounds it in one pass (into a buffer of W's dtype) instead of a cast in forward and a scaling
    pass over the cast dW in backward: one read and write of a [V, d] matrix less (the peak is the same: the fp32
    buffer and dW coexisted during the cast as well), in one streaming Triton pass (:func:`scale_cast_`).

    A second backward through the same graph (``retain_graph=True``, or ``torch.autograd.grad(...,
    retain_graph=True)`` then ``backward``): the gradients are saved with ``ctx.save_for_backward``, so autograd
    frees them with the graph: right after a backward without ``retain_graph`` (before the gradients are passed on,
    so ``W.grad`` still takes dW's buffer without a copy), else when the graph is freed. With ``retain_graph`` they
    stay held until then: dH (N·d in the input dtype; 16,384 rows x 4,096 in bf16: 128 MiB) and, for a trainable
    head, dW (V·d in the input dtype, or 4·V·d bytes as the fp32 accumulator: 1.96 GiB at 128,256 x 4,096), and
    autograd copies them instead of taking them over; each later backward allocates its own scaled copy. A later
    backward returns the gradient times its incoming gradient, as a fresh tensor, provided the first backward's
    incoming gradient was exactly 1 (the common ``loss.backward(retain_graph=True)``): a first backward with
    another factor scales dH (and a dW kept in W's dtype: fp32, one chunk, ``input_dtype``) in place, and the
    later one is refused, naming ``impl='recompute'``, which supports it. Saved-tensor hooks
    (``torch.autograd.graph.save_on_cpu``, a checkpoint around the loss) see the gradients as they see any saved
    tensor."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, reduction, label_smoothing, z_loss, softcap, config, plan,
                labels_checked=None):
        loss, dh, dw = fwdgrad_loss_and_grads(hidden, weight, labels, ignore_index, reduction, label_smoothing,
                                              z_loss, softcap, plan.need_h, plan.need_w, config, plan,
                                              cast_dw=False, labels_checked=labels_checked)
        ctx.save_for_backward(dh, dw)  # freed by autograd with the graph (after backward unless retain_graph)
        ctx.dw_dtype = weight.dtype
        ctx.first_grad = None  # the first backward's incoming gradient, once it has run
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dh, dw = ctx.saved_tensors
        g = grad_loss.to(torch.float32).reshape(1)
        if ctx.first_grad is not None:
            return (*_scaled_copies(ctx, dh, dw, g), None, None, None, None, None, None, None, None, None)
        ctx.first_grad = g.clone()
        if dh is not None:
            scale_unless_one_(dh, g)  # fp32 factor, one rounding; no pass at all when it is 1
        if dw is not None and dw.dtype != ctx.dw_dtype:  # the fp32 accumulator: scaled and rounded once
            acc, dw = dw, torch.empty(dw.shape, dtype=ctx.dw_dtype, device=dw.device)
            scale_cast_(acc, g, dw)
            del acc
        elif dw is not None:
            scale_unless_one_(dw, g)
        return dh, dw, None, None, None, None, None, None, None, None, None


def _scaled_copies(ctx, dh, dw, g):
    """A later backward through a retained graph: fresh copies of the saved gradients times ``g``; refused where the
    first backward scaled them in place by a factor other than 1."""
    scaled_in_place = dh is not None or (dw is not None and dw.dtype == ctx.dw_dtype)
    if scaled_in_place and not bool((ctx.first_grad == 1.0).all()):
        raise RuntimeError(
            "linear_cross_entropy (gradients-in-forward path): a second backward through the same graph after a "
            f"first backward whose incoming gradient was {float(ctx.first_grad):g}, not 1; that backward scaled the "
            "saved gradients in place. Use LossKernelConfig(impl='recompute') (or LORA_LAB_LOSS_IMPL=recompute), "
            "which supports any number of backwards, or make the first backward's incoming gradient 1")
    out_dh = out_dw = None
    if dh is not None:
        out_dh = scale_unless_one_(dh.clone(memory_format=torch.contiguous_format), g)
    if dw is not None and dw.dtype != ctx.dw_dtype:
        out_dw = scale_cast_(dw, g, torch.empty(dw.shape, dtype=ctx.dw_dtype, device=dw.device))
    elif dw is not None:
        out_dw = scale_unless_one_(dw.clone(memory_format=torch.contiguous_format), g)
    return out_dh, out_dw

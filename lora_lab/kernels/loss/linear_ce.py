"""Fused linear cross-entropy: ``cross_entropy(H Wᵀ, y)`` from the hidden states, never holding the logits.

With N rows (tokens), hidden size d and vocabulary V, the logits ``Z = H Wᵀ`` are N·V numbers: 4.6 GiB in bf16 for
16,384 tokens of a 152k vocabulary, before the fp32 copy the standard loss makes. Two paths, one contract
(:func:`choose_impl` picks; ``LossKernelConfig.impl`` or ``LORA_LAB_LOSS_IMPL`` force one):

* ``fwdgrad`` (:mod:`.fwdgrad`): a training step's scalar loss; the gradients are computed in forward on cuBLAS
  GEMMs over large row chunks, one logits chunk at a time, and backward only scales them;
* ``recompute`` (this module and :mod:`.kernels`): keeps only O(N) numbers between forward and backward (``lse``)
  and builds the logits tile by tile in registers, twice: once for the log-sum-exp, once more in backward for the
  gradient. The rest of this docstring is about this path.

The loss, per row ``i`` with a label (``y_i != ignore_index``), ``p_i = softmax(z_i)``, ``lse_i = log Σ_v exp z_iv``:

    ℓ_i = lse_i - (1-ε)·z_{i,y_i} - (ε/V)·Σ_v z_iv + λ·lse_i²

(``ε`` = ``label_smoothing``, ``λ`` = ``z_loss``; with ``softcap`` c, z is replaced by c·tanh(z/c) first), reduced
by mean over labelled rows, sum, or none. Its gradient with respect to the logits is

    ∂ℓ_i/∂z_iv = (1 + 2λ·lse_i)·p_iv - (1-ε)·[v = y_i] - ε/V      (softcap: times 1 - (z_iv/c)²)

which the backward kernel forms per tile as ``a_i·p - b_i·[v = y_i] - e_i``, the per-row ``a, b, e`` holding the
incoming gradient and the reduction's 1/|labelled rows|.

Exact, nothing skipped: every tile of the gradient is computed (no filtering of small probabilities), the
logits are accumulated and kept in fp32 (the standard path rounds them to the model dtype first, so this op is
the closer of the two to an fp32 computation), and the gradients are accumulated in fp32 and rounded once. The
fp32 accumulators are the only memory beyond the gradients themselves: for a frozen head (the LoRA case) a
[chunk_rows x d] buffer reused over row chunks; for a trainable head either a [N x d] one for dH plus a
[slab_vocab x d] one reused over vocabulary slabs for dW (``trainable_plan="one_pass"``) or only the two small
buffers, at the price of recomputing the logits once more (``"two_pass"``). For fp32 inputs the gradients are
their own accumulators.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from lora_lab import gpu_arch
from lora_lab.kernels.loss.checks import LabelCheck, check_inputs
from lora_lab.kernels.loss.fwdgrad import FwdGradLinearCrossEntropyFunction, fitting_plan, free_bytes, plan_error
from lora_lab.kernels.loss.kernels import grad_kernel, lse_partials_kernel
from lora_lab.kernels.triton_helpers import (
    check_interpreter_dtype,
    dot_precision,
    running_in_interpreter,
)

__all__ = ["LossKernelConfig", "LinearCrossEntropyFunction", "linear_cross_entropy",
           "linear_cross_entropy_reference", "choose_impl", "requested_impl", "chosen_impl"]

_ACCUMULATE = {"atomic": 0, "tma": 1}
_PLANS = ("one_pass", "two_pass")
_IMPLS = ("auto", "fwdgrad", "recompute")
_CHOICES = {"impl": _IMPLS, "dw_accumulate": ("auto", "out_dtype", "partial", "upcast", "input_dtype")}
IMPL_ENV = "LORA_LAB_LOSS_IMPL"  # forces a path where the config says "auto" (benchmarks of a whole step)


@dataclass(frozen=True)
class LossKernelConfig:
    """Tile sizes and memory plan of the two kernels (defaults: the fastest 16-bit settings of the H200 sweeps of
    ``benchmarks/tune_loss.py``, in ``outputs/gpu/measurements.csv`` as benchmark tune_loss; fp32 and the
    interpreter get smaller tiles unless a config is given).

    ``chunk_rows``: rows per pass of the dH accumulation (its fp32 buffer is ``chunk_rows x d``); None: N/32
    (at least 256), a buffer of 1/16 of dH's own bytes;
    ``slab_vocab``: vocabulary entries per pass of the dW accumulation (its fp32 buffer is ``slab_vocab x d``);
    None: V/32 (at least 1024), 1/16 of dW's bytes;
    ``trainable_plan``: a trainable head's backward in ``"one_pass"`` (dH and dW from the same recomputed tiles;
    dH then needs a full [N x d] fp32 accumulator) or ``"two_pass"`` (dH in row chunks, then dW in vocabulary
    slabs: the logits are recomputed once more, the buffers stay small);
    ``accumulate``: how programs add into those buffers: ``"atomic"`` (fp32 atomics, element by element), ``"tma"``
    (Hopper's bulk tensor reduction, tile by tile; CUDA with compute capability >= 9 and d a multiple of 4) or
    ``"auto"`` (``"tma"`` where it can run, else ``"atomic"``).

    The gradients-in-forward path (:mod:`.fwdgrad`) and the choice between the two paths:
    ``impl``: ``"auto"`` (:func:`choose_impl`'s rule; the environment variable ``LORA_LAB_LOSS_IMPL`` overrides
    it), ``"fwdgrad"`` or ``"recompute"`` (the two kernels above) forced;
    ``fwdgrad_chunk_rows``: rows per chunk of the fwdgrad path; None: as many as fit ``fwdgrad_chunk_bytes`` of
    logits in the input dtype, a multiple of 256, at most ``fwdgrad_max_rows`` (placeholders until the H200 runs:
    QuACK's 4,096 rows; a 256k vocabulary's 4,096 bf16 rows take 1.95 GiB);
    ``fwdgrad_frozen_max_rows``: the same bound for a frozen head (no dW), 1,024 rows by default. With no dW to
    accumulate, a smaller chunk costs only more, smaller GEMM launches. At 16,384 tokens on an H200, 1,024-row
    chunks ran within 2% of 4,096-row ones at the Llama-3-8B and Qwen2.5-0.5B heads and held 0.37 and 0.32 GiB
    extra instead of 1.10 and 1.19 (the ledger's loss rows of commit 606d2f0, one session). A trainable
    head keeps ``fwdgrad_max_rows``: there every chunk adds into the fp32 [V, d] dW accumulator, and 1,024-row
    chunks were 8-11% slower;
    ``dw_accumulate``: how a trainable head's dW is accumulated in fp32 over the chunks (:mod:`.fwdgrad`);
    ``ce_block_v``, ``ce_warps``: the softmax pass's vocabulary block and warps (an H200 sweep of one 4,096-row
    chunk at the Llama-3-8B head found every setting within 0.844-0.908 ms, against 0.657 ms for its bytes at
    4.8 TB/s: the ledger's tune_loss rows of commit fbf05b3, one repetition). Programs
    walking several rows each, and a second read from the row's end, both meant for L2 to serve that read, were
    slower there (1.318-2.064 ms) or no faster, and were dropped.
    """

    fwd_block_m: int = 128
    fwd_block_v: int = 256
    fwd_block_k: int = 64
    fwd_warps: int = 8
    fwd_stages: int = 3
    bwd_block_m: int = 128
    bwd_block_v: int = 256
    bwd_block_k: int = 64
    bwd_block_d: int = 64
    bwd_warps: int = 8
    bwd_stages: int = 3
    group_m: int = 8
    accumulate: str = "auto"
    chunk_rows: int | None = None
    slab_vocab: int | None = None
    trainable_plan: str = "one_pass"
    programs_per_sm: int = 2
    impl: str = "auto"
    fwdgrad_chunk_rows: int | None = None
    fwdgrad_max_rows: int = 4096
    fwdgrad_frozen_max_rows: int = 1024
    fwdgrad_chunk_bytes: int = 2 * 2**30
    dw_accumulate: str = "auto"
    ce_block_v: int = 4096
    ce_warps: int = 8

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _CHOICES:
                if value not in _CHOICES[f.name]:
                    raise ValueError(f"LossKernelConfig.{f.name} must be one of {', '.join(_CHOICES[f.name])}; "
                                     f"got {value!r}")
            elif f.name == "accumulate":
                if value not in (*_ACCUMULATE, "auto"):
                    raise ValueError(f"LossKernelConfig.accumulate must be one of auto, {', '.join(_ACCUMULATE)}; "
                                     f"got {value!r}")
            elif f.name == "trainable_plan":
                if value not in _PLANS:
                    raise ValueError(f"LossKernelConfig.trainable_plan must be one of {', '.join(_PLANS)}; "
                                     f"got {value!r}")
            elif f.name in ("chunk_rows", "slab_vocab", "fwdgrad_chunk_rows") and value is None:
                continue
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LossKernelConfig.{f.name} must be a positive integer; got {value!r}")
        for name in ("fwd_block_m", "fwd_block_v", "fwd_block_k", "bwd_block_m", "bwd_block_v", "bwd_block_k",
                     "bwd_block_d", "ce_block_v"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"LossKernelConfig.{name} must be a power of two >= 16; got {value}")

    def replace(self, **changes) -> LossKernelConfig:
        return dataclasses.replace(self, **changes)

    def rows_per_chunk(self, n: int) -> int:
        if self.chunk_rows is not None:
            return min(n, self.chunk_rows)
        return min(n, max(256, triton.cdiv(triton.cdiv(n, 32), self.bwd_block_m) * self.bwd_block_m))

    def vocab_per_slab(self, vocab: int) -> int:
        if self.slab_vocab is not None:
            return min(vocab, self.slab_vocab)
        return min(vocab, max(1024, triton.cdiv(triton.cdiv(vocab, 32), self.bwd_block_v) * self.bwd_block_v))


# The interpreter runs every program on the CPU one after the other: small tiles keep the tests quick.
_INTERPRETER_CONFIG = LossKernelConfig(fwd_block_m=16, fwd_block_v=32, fwd_block_k=16, bwd_block_m=16,
                                       bwd_block_v=32, bwd_block_k=16, bwd_block_d=16, group_m=2, programs_per_sm=1,
                                       ce_block_v=64)


# fp32 operands take twice the shared memory per tile: the 16-bit tiles would not fit (228 KiB on Hopper)
_FP32_CONFIG = LossKernelConfig(fwd_block_v=128, fwd_block_k=32, fwd_stages=2, bwd_block_m=64, bwd_block_v=128,
                                bwd_block_k=32, bwd_block_d=32, bwd_warps=4, bwd_stages=2)


# 16-bit tiles for GPUs with about 99 KiB of shared memory per block (sm86, sm89, sm120; lora_lab.gpu_arch), where
# the default's 144 KiB of pipelined operand tiles overflow: 72 KiB (untimed guesses, not a tuned table); only classes
# whose budget is below SMALL_SM_BELOW take them
_SMALL_SM_CONFIG = LossKernelConfig(fwd_block_m=64, fwd_block_v=128, fwd_block_k=64, fwd_warps=4, fwd_stages=3,
                                    bwd_block_m=64, bwd_block_v=128, bwd_block_k=64, bwd_block_d=64, bwd_warps=4,
                                    bwd_stages=3)
SMALL_SM_BELOW = 100 * 1024


def tile_shared_memory_bytes(cfg: LossKernelConfig, element_size: int) -> int:
    """Bytes of shared memory the pipelined operand tiles of the forward or the backward kernel (the larger) take
    with ``cfg``: per stage a BLOCK_M x BLOCK_K tile of H and a BLOCK_V x BLOCK_K tile of W (an estimate: the
    epilogue's buffers are not counted)."""
    fwd = (cfg.fwd_block_m + cfg.fwd_block_v) * cfg.fwd_block_k * cfg.fwd_stages
    bwd = (cfg.bwd_block_m + cfg.bwd_block_v) * cfg.bwd_block_k * cfg.bwd_stages
    return max(fwd, bwd) * element_size


def default_configs(dtype: torch.dtype, device: torch.device | str | None) -> list[LossKernelConfig]:
    """The tile configs the default may take for ``dtype`` on ``device``'s GPU class, best first: those whose tiles
    fit the class's shared memory (:func:`lora_lab.gpu_arch.tile_shared_memory_budget`); the small-SM tiles only on
    a class below ``SMALL_SM_BELOW``. Never empty: the smallest one when none fits."""
    size = torch.empty((), dtype=dtype).element_size()
    budget = gpu_arch.tile_shared_memory_budget(device)
    table = [_FP32_CONFIG] if dtype == torch.float32 else [LossKernelConfig()]
    if budget < SMALL_SM_BELOW:
        table.append(_SMALL_SM_CONFIG)
    kept = [cfg for cfg in table if tile_shared_memory_bytes(cfg, size) <= budget]
    return kept or [min(table, key=lambda cfg: tile_shared_memory_bytes(cfg, size))]


def _config(config: LossKernelConfig | None, dtype: torch.dtype = torch.bfloat16,
            device: torch.device | str | None = None) -> LossKernelConfig:
    if config is None:
        if running_in_interpreter():
            return _INTERPRETER_CONFIG
        return default_configs(dtype, device)[0]
    if not isinstance(config, LossKernelConfig):
        raise TypeError(f"config must be a LossKernelConfig or None; got {type(config).__name__}")
    return config


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _lse_and_target(h, w, labels, softcap, need_zsum, cfg: LossKernelConfig):
    """Per row: lse, the target logit and (label smoothing) the sum of the logits, all fp32."""
    n, d = h.shape
    vocab = w.shape[0]
    row_tiles = triton.cdiv(n, cfg.fwd_block_m)
    vocab_tiles = triton.cdiv(vocab, cfg.fwd_block_v)
    # split the vocabulary so that the grid fills the GPU, with no split left empty
    wanted = max(1, math.ceil(cfg.programs_per_sm * _sm_count(h.device) / row_tiles))
    per_split = triton.cdiv(vocab_tiles, min(wanted, vocab_tiles))
    splits = triton.cdiv(vocab_tiles, per_split)
    parts = torch.empty((4 if need_zsum else 3, splits, n), dtype=torch.float32, device=h.device)
    m, s, t = parts[0], parts[1], parts[2]
    zsum = parts[3] if need_zsum else parts[2]
    lse_partials_kernel[(row_tiles, splits)](
        h, h.stride(0), h.stride(1), w, w.stride(0), w.stride(1), labels, m, s, t, zsum,
        n, vocab, d, per_split, float(softcap or 0.0),
        HAS_SOFTCAP=softcap is not None, NEED_ZSUM=need_zsum, PRECISION=dot_precision(h.dtype),
        BLOCK_M=cfg.fwd_block_m, BLOCK_V=cfg.fwd_block_v, BLOCK_K=cfg.fwd_block_k,
        num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages,
    )
    # combine the splits: lse = M + log Σ_split s·exp(m - M)
    top = m.amax(dim=0)
    lse = top + torch.log((s * torch.exp(m - top)).sum(dim=0))
    return lse, t.sum(dim=0), (zsum.sum(dim=0) if need_zsum else None)


def _tma_possible(t: torch.Tensor) -> bool:
    if running_in_interpreter() or t.device.type != "cuda" or t.shape[1] % 4:
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401  (triton >= 3.4)
    except ImportError:
        return False
    return gpu_arch.has_tma(t.device)  # compute capability >= 9, after $LORA_LAB_ARCH


def _accumulate_mode(cfg: LossKernelConfig, h: torch.Tensor) -> str:
    if cfg.accumulate == "auto":
        return "tma" if _tma_possible(h) else "atomic"
    if cfg.accumulate == "tma" and not _tma_possible(h):
        raise ValueError("LossKernelConfig(accumulate='tma') needs a CUDA device of compute capability >= 9, "
                         f"Triton >= 3.4 and a hidden size divisible by 4 (got {h.device}, d={h.shape[1]})")
    return cfg.accumulate


def _dz_scale(h, a, b, e):
    """One fp32 on the device: 1 except for fp16, where it is the largest per-row factor of dz (so that dz/scale
    is O(1) and does not underflow fp16 when rounded; the kernel multiplies the products back)."""
    if h.dtype != torch.float16 or a.numel() == 0:
        return torch.ones(1, dtype=torch.float32, device=h.device)
    top = torch.maximum(a.abs().amax(), b.abs().amax())
    if e is not None:
        top = torch.maximum(top, e.abs().amax())
    return torch.where(top > 0, top, 1.0).reshape(1)


def _launch_grad(h, w, labels, lse, a, b, e, dh, dw, v_offset, v_total, softcap, cfg: LossKernelConfig, scale):
    n, d = h.shape
    v_local = w.shape[0]
    row_tiles = triton.cdiv(n, cfg.bwd_block_m)
    vocab_tiles = triton.cdiv(v_local, cfg.bwd_block_v)
    mode = _accumulate_mode(cfg, h)
    dh_desc = dw_desc = lse  # placeholders where unused
    if mode == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        if dh is not None:
            dh_desc = TensorDescriptor(dh, list(dh.shape), [dh.stride(0), 1], [cfg.bwd_block_m, cfg.bwd_block_d])
        if dw is not None:
            dw_desc = TensorDescriptor(dw, list(dw.shape), [dw.stride(0), 1], [cfg.bwd_block_v, cfg.bwd_block_d])
    grad_kernel[(row_tiles * vocab_tiles,)](
        h, h.stride(0), h.stride(1), w, w.stride(0), w.stride(1), labels, lse, a, b, e if e is not None else a, scale,
        dh if dh is not None else lse, dh.stride(0) if dh is not None else 0,
        dw if dw is not None else lse, dw.stride(0) if dw is not None else 0,
        dh_desc, dw_desc, n, v_local, v_total, v_offset, d, float(softcap or 0.0),
        HAS_SOFTCAP=softcap is not None, NEED_DH=dh is not None, NEED_DW=dw is not None, SMOOTHING=e is not None,
        ACCUMULATE=_ACCUMULATE[mode], PRECISION=dot_precision(h.dtype), GROUP_M=cfg.group_m,
        BLOCK_M=cfg.bwd_block_m, BLOCK_V=cfg.bwd_block_v, BLOCK_K=cfg.bwd_block_k, BLOCK_D=cfg.bwd_block_d,
        num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages,
    )


def _accumulate_in_pieces(dtype, total: int, piece: int, d: int, device, launch):
    """A [total x d] gradient in ``dtype``, accumulated in fp32: as its own accumulator when ``dtype`` is fp32 (one
    ``launch(0, total, out)``), else ``piece`` rows at a time in one reused fp32 buffer, each piece rounded into
    the output once (``launch(start, stop, buffer)`` adds rows [start, stop) into the buffer)."""
    if dtype == torch.float32:
        out = torch.zeros((total, d), dtype=torch.float32, device=device)
        launch(0, total, out)
        return out
    out = torch.empty((total, d), dtype=dtype, device=device)
    buffer = torch.empty((min(total, piece), d), dtype=torch.float32, device=device)
    for start in range(0, total, piece):
        stop = min(total, start + piece)
        acc = buffer[: stop - start]
        acc.zero_()
        launch(start, stop, acc)
        out[start:stop].copy_(acc)
    return out


def _dh_by_row_chunks(h, w, labels, lse, a, b, e, softcap, cfg: LossKernelConfig):
    """dH only: row chunks, each accumulated over the whole vocabulary in one fp32 [chunk x d] buffer."""
    n, d = h.shape
    scale = _dz_scale(h, a, b, e)

    def launch(r0, r1, acc):
        _launch_grad(h[r0:r1], w, labels[r0:r1], lse[r0:r1], a[r0:r1], b[r0:r1], None if e is None else e[r0:r1],
                     acc, None, 0, w.shape[0], softcap, cfg, scale)

    return _accumulate_in_pieces(h.dtype, n, cfg.rows_per_chunk(n), d, h.device, launch)


def _dw_by_vocab_slabs(h, w, labels, lse, a, b, e, softcap, cfg: LossKernelConfig, dh_acc=None):
    """dW (and, into ``dh_acc``, dH from the same tiles): vocabulary slabs, each accumulated over all rows in one
    fp32 [slab x d] buffer."""
    vocab, d = w.shape
    scale = _dz_scale(h, a, b, e)

    def launch(v0, v1, acc):
        _launch_grad(h, w[v0:v1], labels, lse, a, b, e, dh_acc, acc, v0, vocab, softcap, cfg, scale)

    return _accumulate_in_pieces(w.dtype, vocab, cfg.vocab_per_slab(vocab), d, w.device, launch)


def _gradients(h, w, labels, lse, a, b, e, need_h, need_w, softcap, cfg: LossKernelConfig):
    """dH and dW (None where not needed) in the inputs' dtype, accumulated in fp32."""
    if not need_w:
        return _dh_by_row_chunks(h, w, labels, lse, a, b, e, softcap, cfg), None
    if not need_h:
        return None, _dw_by_vocab_slabs(h, w, labels, lse, a, b, e, softcap, cfg)
    if cfg.trainable_plan == "two_pass":
        dh = _dh_by_row_chunks(h, w, labels, lse, a, b, e, softcap, cfg)
        return dh, _dw_by_vocab_slabs(h, w, labels, lse, a, b, e, softcap, cfg)
    # one pass: every tile adds into dW's slab buffer and into a full fp32 dH accumulator
    dh_acc = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    dw = _dw_by_vocab_slabs(h, w, labels, lse, a, b, e, softcap, cfg, dh_acc=dh_acc)
    return (dh_acc if h.dtype == torch.float32 else dh_acc.to(h.dtype)), dw


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper: saves H, W, the labels and lse [N] (fp32); recomputes logit tiles in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, reduction, label_smoothing, z_loss, softcap, config):
        cfg = _config(config, hidden.dtype, hidden.device)
        n = hidden.shape[0]
        vocab = weight.shape[0]
        valid = labels != ignore_index
        if n:
            lse, target, zsum = _lse_and_target(hidden, weight, labels, softcap, label_smoothing > 0.0, cfg)
        else:
            lse = target = zsum = hidden.new_zeros(0, dtype=torch.float32)
        per_row = lse - (1.0 - label_smoothing) * target
        if label_smoothing > 0.0:
            per_row = per_row - (label_smoothing / vocab) * zsum
        if z_loss > 0.0:
            per_row = per_row + z_loss * lse * lse
        per_row = torch.where(valid, per_row, 0.0)
        count = valid.sum()
        if reduction == "none":
            loss = per_row
        elif reduction == "sum":
            loss = per_row.sum()
        else:
            loss = per_row.sum() / count  # nan when every label is ignored, as F.cross_entropy
        ctx.save_for_backward(hidden, weight, labels, lse, count)
        ctx.settings = (ignore_index, reduction, label_smoothing, z_loss, softcap, cfg)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, labels, lse, count = ctx.saved_tensors
        ignore_index, reduction, label_smoothing, z_loss, softcap, cfg = ctx.settings
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w) or hidden.shape[0] == 0:
            dh = torch.zeros_like(hidden) if need_h else None
            dw = torch.zeros_like(weight) if need_w else None
            return dh, dw, None, None, None, None, None, None, None
        vocab = weight.shape[0]
        valid = (labels != ignore_index).to(torch.float32)
        grad = grad_loss.to(torch.float32)
        if reduction == "mean":  # no labelled row: zero gradients, as F.cross_entropy (not 0 · 1/0)
            grad = grad / count.clamp(min=1).to(torch.float32)
        coef = valid * grad  # per row: the incoming gradient (and 1/count), 0 on ignored rows
        a = (coef * (1.0 + 2.0 * z_loss * lse) if z_loss > 0.0 else coef).contiguous()
        b = (coef * (1.0 - label_smoothing)).contiguous()
        e = (coef * (label_smoothing / vocab)).contiguous() if label_smoothing > 0.0 else None
        dh, dw = _gradients(hidden, weight, labels, lse, a, b, e, need_h, need_w, softcap, cfg)
        return dh, dw, None, None, None, None, None, None, None


# The dispatch rule's thresholds: PLACEHOLDERS until measured on the H200 (benchmarks/bench_loss.py times both
# paths side by side; the rule is to be re-derived from that run, not from these guesses).
FWDGRAD_MIN_LOGITS = 2**22  # rows x vocabulary below this: both paths are a few launches, keep the old one
FWDGRAD_MIN_HIDDEN = 64     # d below this: the GEMMs are memory-bound and the logits' traffic dominates


def choose_impl(rows: int, hidden: int, vocab: int, *, reduction: str, need_grad: bool, impl: str = "auto",
                plan_fits: bool = True, dtype: torch.dtype | None = None) -> tuple[str, str]:
    """Which path computes the loss: ``("fwdgrad" | "recompute", why)``.

    The rule, in order:

    1. ``impl`` forced (``LossKernelConfig.impl`` or, where that is "auto", the environment variable
       ``LORA_LAB_LOSS_IMPL``): that path (``"fwdgrad"`` with ``reduction="none"`` is refused by the caller);
    2. no gradient will be taken (grad mode off, or neither hidden nor weight requires grad): ``recompute`` — its
       forward is one lse kernel that writes O(N) numbers, while fwdgrad would write every logit and compute
       gradients nobody reads;
    3. ``reduction="none"``: ``recompute`` — each row's incoming gradient is only known in backward, so the
       gradients cannot be formed in forward;
    4. fp16 inputs: ``recompute`` — fwdgrad keeps an fp16 gradient unscaled (1/N would underflow) and scales the
       GEMMs' results afterwards, so a one-chunk dW (or a ``partial`` product) summed over many rows of one
       frequent label could overflow fp16's 65504; the recomputing kernels scale inside and accumulate in fp32;
    5. a small problem (rows·vocab < ``FWDGRAD_MIN_LOGITS`` or hidden < ``FWDGRAD_MIN_HIDDEN``): ``recompute``;
    6. the fwdgrad chunk plan does not fit in free device memory even at 256 rows per chunk: ``recompute`` (it
       holds O(N) numbers and small fp32 buffers);
    7. otherwise ``fwdgrad``: three cuBLAS GEMMs (two for a frozen head) and one pass over each logits chunk,
       against the recomputing path's four (three) GEMM-sized Triton loops.

    The thresholds of 5 are placeholders until the H200 benchmark has timed both paths side by side.
    """
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {', '.join(_IMPLS)}; got {impl!r}")
    if impl != "auto":
        return impl, "forced"
    if not need_grad:
        return "recompute", "no gradient is needed (inference / evaluation)"
    if reduction == "none":
        return "recompute", "reduction='none': per-row incoming gradients are known only in backward"
    if dtype == torch.float16:
        return "recompute", "fp16 (range): the recomputing kernels scale the gradient inside"
    if rows * vocab < FWDGRAD_MIN_LOGITS or hidden < FWDGRAD_MIN_HIDDEN:
        return "recompute", "small problem"
    if not plan_fits:
        return "recompute", "the fwdgrad chunk plan does not fit in free memory"
    return "fwdgrad", "training step with a scalar loss"


def requested_impl(cfg: LossKernelConfig) -> str:
    """``cfg.impl``, or where that is "auto" the environment's ``LORA_LAB_LOSS_IMPL`` (checked)."""
    if cfg.impl != "auto":
        return cfg.impl
    env = os.environ.get(IMPL_ENV, "auto").strip().lower() or "auto"
    if env not in _IMPLS:
        raise ValueError(f"{IMPL_ENV} must be one of {', '.join(_IMPLS)}; got {env!r}")
    return env


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    config: LossKernelConfig | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels`` without materialising the logits.

    ``hidden`` [..., d] and ``weight`` [V, d] (an lm_head without bias) in one of fp32, fp16, bf16, on a CUDA
    device (or the CPU under ``TRITON_INTERPRET=1``); ``labels`` [...] int, ``ignore_index`` marking rows without a
    target (labels are used as given: shift them first for next-token prediction). Same value and gradients as
    :func:`linear_cross_entropy_reference` (``F.cross_entropy`` of fp32 logits, plus ``z_loss``·lse² per labelled
    row, logits soft-capped first when ``softcap`` is set). The head is trainable when ``weight.requires_grad``
    and frozen otherwise (no dW is computed). ``reduction="none"`` returns one value per row (0 where ignored).
    """
    check_inputs(hidden, weight, labels, ignore_index, reduction, label_smoothing, z_loss, softcap)
    d = hidden.shape[-1]
    flat_labels = labels.reshape(-1).to(torch.int64).contiguous()
    # queued later: by the fwdgrad path once its first GEMM is queued (the GPU starts on the GEMM while the host
    # queues the check), else at once below
    labels_checked = LabelCheck(flat_labels, weight.shape[0], ignore_index)
    flat_hidden = hidden.reshape(-1, d)
    options = (ignore_index, reduction, float(label_smoothing), float(z_loss),
               None if softcap is None else float(softcap))
    try:
        fused = _fwdgrad_plan(flat_hidden, weight, reduction, config)
    except BaseException:
        labels_checked()  # a bad label is reported first, as before the check became asynchronous
        raise
    if fused is not None:  # the fwdgrad path queues and finishes the check once its first GEMM is queued
        return FwdGradLinearCrossEntropyFunction.apply(flat_hidden, weight, flat_labels, *options, *fused,
                                                       labels_checked)
    labels_checked()
    # the recomputing kernels' tiles are tl.dot products, wrong in bf16 under the interpreter (the fwdgrad path's GEMMs
    # are torch's, and its Triton pass has no dot)
    check_interpreter_dtype(flat_hidden, weight, op="linear_cross_entropy (the recomputing kernels)")
    loss = LinearCrossEntropyFunction.apply(flat_hidden, weight, flat_labels, *options, config)
    return loss.reshape(labels.shape) if reduction == "none" else loss


def _fwdgrad_plan(hidden: torch.Tensor, weight: torch.Tensor, reduction: str, config):
    """(config, chunk plan) when :func:`choose_impl` picks the fwdgrad path for this call, else None; a forced
    fwdgrad whose plan cannot fit raises torch.OutOfMemoryError before allocating anything."""
    cfg = _config(config, hidden.dtype, hidden.device)
    impl = requested_impl(cfg)
    n, d = hidden.shape
    vocab = weight.shape[0]
    need_h = hidden.requires_grad and torch.is_grad_enabled()
    need_w = weight.requires_grad and torch.is_grad_enabled()
    if impl == "fwdgrad" and reduction == "none":
        raise ValueError("impl='fwdgrad' computes gradients in forward and needs a scalar loss (reduction 'mean' or "
                         "'sum'); reduction='none' runs on impl='recompute' (or 'auto')")
    if impl == "recompute" or n == 0:
        return None
    plan, fits = fitting_plan(n, d, vocab, hidden.dtype, need_h, need_w, cfg, hidden.device)
    choice, _ = choose_impl(n, d, vocab, reduction=reduction, need_grad=need_h or need_w, impl=impl, plan_fits=fits,
                            dtype=hidden.dtype)
    if choice != "fwdgrad":
        return None
    if not fits:
        raise torch.OutOfMemoryError(plan_error(plan, free_bytes(hidden.device), n, vocab, d, hidden.device))
    return cfg, plan


def chosen_impl(hidden: torch.Tensor, weight: torch.Tensor, *, reduction: str = "mean",
                config: LossKernelConfig | None = None) -> str:
    """The path :func:`linear_cross_entropy` takes for these inputs now (grad mode and requires_grad included):
    "fwdgrad" or "recompute"."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return "recompute" if _fwdgrad_plan(flat, weight, reduction, config) is None else "fwdgrad"


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """The plain-torch definition: all logits at once, fp32, ``F.cross_entropy`` (+ the z-loss term)."""
    logits = F.linear(hidden, weight).float().reshape(-1, weight.shape[0])
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    flat = labels.reshape(-1).long()
    loss = F.cross_entropy(logits, flat, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    if z_loss > 0.0:
        valid = flat != ignore_index
        z_term = torch.where(valid, z_loss * torch.logsumexp(logits, dim=-1) ** 2, 0.0)
        if reduction == "none":
            loss = loss + z_term
        elif reduction == "sum":
            loss = loss + z_term.sum()
        else:
            loss = loss + z_term.sum() / valid.sum()
    return loss.reshape(labels.shape) if reduction == "none" else loss

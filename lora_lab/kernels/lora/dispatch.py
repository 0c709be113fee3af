"""Who runs a LoRA op's GEMMs: Triton kernels or cuBLAS calls, and whether dA/dB use a side CUDA stream.

Every Triton launch costs host time (argument binding, the autotuner's lookup, TMA descriptors) that a cuBLAS
call does not, and the backward makes four of them. When the GEMMs are small the GPU finishes before the host
has launched the next kernel, so below a GEMM volume M·K·N the same formulas run as cuBLAS calls
(:func:`engine_for`); forward and backward choose separately, and both engines save the same tensors (X, P).
The thresholds and each op's defaults were chosen from side-by-side H200 benchmarks (the LoRA linear's route rule,
:func:`linear_route`, from H100 runs beside axolotl's kernels too); ``benchmarks/`` measures every setting, and
notebook 05 shows the result.
"""
from __future__ import annotations

import warnings

import torch

from lora_lab.kernels.config import KernelConfig

__all__ = ["engine_for", "base_gemm_engine", "linear_route", "side_stream", "join_side_stream", "warn_route_fallback",
           "FORWARD_TRITON_MIN_VOLUME", "BACKWARD_TRITON_MIN_VOLUME", "LINEAR_DEEP_K_TRITON_MIN_VOLUME"]

# GEMM volumes M·K·N from which the Triton engine is used (below: cuBLAS calls)
FORWARD_TRITON_MIN_VOLUME = 3.0e11
BACKWARD_TRITON_MIN_VOLUME = 5.0e11

# The LoRA linear on the Triton engine, left on its defaults (linear_route): every product a cuBLAS call, except a
# GEMM whose reduction is deeper than its output is wide (K > N) from this volume M·K·N up, which keeps the Triton
# GEMM with the rank-r step in its K loop. Chosen from side-by-side runs on an H100 beside axolotl's kernels (two
# processes per setting) and in the Llama-3-8B-shaped step, agreeing with notebook 05's route table on the H200:
# cuBLAS was faster at 8k tokens × 4096 × 12288 both ways (volume 4.1e11) and at 32k × 4096², Triton for the step's
# down projection (K 14,336, N 4096, 9.6e11) and at 32k × 12288 × 4096, r 16. The threshold lies between the two.
LINEAR_DEEP_K_TRITON_MIN_VOLUME = 6.0e11

_SIDE_STREAMS: dict = {}
_LINEAR_ROUTES: dict = {}


def engine_for(M: int, K: int, N: int, device: torch.device, config: KernelConfig, backward: bool = False) -> str:
    """'triton' or 'cublas' for a GEMM of volume M·K·N (``config.dispatch``; ``auto`` by volume).

    In Triton's CPU interpreter ``auto`` means Triton: the interpreter proves the kernels' correctness.
    """
    if config.dispatch != "auto":
        return config.dispatch
    if device.type != "cuda":
        return "triton"
    threshold = BACKWARD_TRITON_MIN_VOLUME if backward else FORWARD_TRITON_MIN_VOLUME
    return "triton" if float(M) * K * N >= threshold else "cublas"


def base_gemm_engine(config: KernelConfig, default: str = "triton", supported=("triton", "cublas")) -> str:
    """Who runs the big GEMM on the Triton engine (``config.base_gemm``; ``auto``, or an engine the op does not
    have (not in ``supported``: the shared-input op has no ``quack`` route), is the op's ``default``).

    ``triton``: one Triton GEMM with the rank-r term as the last step of its K loop. ``cublas``: a Triton pass
    writes the rank-r term (P Bᵀ + b, or Q A) into the output, then cuBLAS adds the base GEMM onto it with
    β = 1 (``addmm_``): the GEMM is cuBLAS's, at the price of one M×N write. The backward's dX takes this path
    only without dropout (the mask multiplies the rank-r term alone). ``wide`` (the LoRA linear only,
    :mod:`lora_lab.kernels.lora.widened`): one cuBLAS GEMM over a widened reduction, ``[X | P] · [W | B]ᵀ`` and
    ``[dY | Q] · [W ; A]``, the widened activation written by the pass that computes P (or Q and dB) from the
    same read: one M×K (M×N) write per GEMM where ``cublas`` writes the rank-r term and reads it back.
    ``quack`` (the LoRA linear only): QuACK's GEMM adds the rank-r term in its epilogue
    (:mod:`lora_lab.kernels.lora.quack_gemm`): cuBLAS-class GEMMs with no extra pass over the output.
    ``merged`` (the LoRA linear only, :mod:`lora_lab.kernels.lora.merged`): the frozen layer's cuBLAS GEMMs on
    ``W + s·B A``, merged per call (one pass over W, whatever the tokens), never kept. ``stacked`` (the LoRA linear
    only, :mod:`lora_lab.kernels.lora.stacked`): the same GEMMs with P and Q as r more output columns
    (``[Y | P] = X · [W' ; s·A]ᵀ``, ``[dX | Q] = dY · [W' | s·B]``).
    """
    return config.base_gemm if config.base_gemm in supported else default


def warn_route_fallback(warned: set, route: str, reason: str) -> None:
    """One RuntimeWarning per distinct ``reason`` (kept in ``warned``): the op was asked for ``base_gemm=route`` and
    runs the Triton route instead."""
    if reason in warned:
        return
    warned.add(reason)
    warnings.warn(f"lora_lab: base_gemm='{route}' cannot run here ({reason}); using the Triton route",
                  RuntimeWarning, stacklevel=5)


def linear_route(M: int, K: int, N: int, device: torch.device, config: KernelConfig) -> KernelConfig:
    """The settings the LoRA linear runs a Triton-engine call with: ``config`` with ``rank_ops="auto"`` resolved.

    Where the op is left on its defaults (``dispatch``, ``base_gemm``, ``rank_ops`` and ``gemm_loads`` on ``auto``,
    no ``fold_projection``), a CUDA call runs every product on cuBLAS (``base_gemm="cublas"``,
    ``rank_ops="torch"``) unless K > N and M·K·N >= ``LINEAR_DEEP_K_TRITON_MIN_VOLUME``, where it keeps the Triton
    GEMM (``base_gemm`` left on ``auto``, the op's Triton default, and ``rank_ops="triton"``). Anything set by hand
    is kept, ``rank_ops="auto"`` then meaning ``triton``; in Triton's CPU interpreter the rule means Triton (the
    interpreter proves the kernels)."""
    if config.rank_ops != "auto":
        return config
    on_defaults = (config.dispatch == config.base_gemm == config.gemm_loads == "auto"
                   and not config.fold_projection and device.type == "cuda")
    pure_cublas = on_defaults and not (K > N and float(M) * K * N >= LINEAR_DEEP_K_TRITON_MIN_VOLUME)
    key = (config, pure_cublas)
    routed = _LINEAR_ROUTES.get(key)
    if routed is None:
        routed = _LINEAR_ROUTES[key] = (config.replace(base_gemm="cublas", rank_ops="torch") if pure_cublas
                                        else config.replace(rank_ops="triton"))
    return routed


def side_stream(device: torch.device, config: KernelConfig, default: bool = False):
    """The side stream for ``device`` when overlap is on (CUDA only), else None; ``default`` is the op's
    choice under ``overlap="auto"``."""
    on = default if config.overlap == "auto" else config.overlap == "on"
    if not on or device.type != "cuda":
        return None
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[key]


def join_side_stream(side, main, *made_on_side) -> None:
    """Main stream waits for the side stream; tensors made there are marked as used by main."""
    main.wait_stream(side)
    for t in made_on_side:
        if t is not None:
            t.record_stream(main)

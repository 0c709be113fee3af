"""Who runs a LoRA op's GEMMs: Triton kernels or cuBLAS calls, and whether dA/dB use a side CUDA stream.

Every Triton launch costs host time (argument binding, the autotuner's lookup, TMA descriptors) that a cuBLAS
call does not, and the backward makes four of them. When the GEMMs are small the GPU finishes before the host
has launched the next kernel, so below a GEMM volume M·K·N the same formulas run as cuBLAS calls
(:func:`engine_for`); forward and backward choose separately, and both engines save the same tensors (X, P).
The thresholds and each op's defaults were chosen from side-by-side H200 benchmarks; ``benchmarks/`` measures
every setting, and notebook 05 shows the result.
"""
from __future__ import annotations

import torch

from lora_lab.kernels.config import KernelConfig

__all__ = ["engine_for", "base_gemm_engine", "side_stream", "join_side_stream",
           "FORWARD_TRITON_MIN_VOLUME", "BACKWARD_TRITON_MIN_VOLUME"]

# GEMM volumes M·K·N from which the Triton engine is used (below: cuBLAS calls)
FORWARD_TRITON_MIN_VOLUME = 3.0e11
BACKWARD_TRITON_MIN_VOLUME = 5.0e11

_SIDE_STREAMS: dict = {}


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
    only without dropout (the mask multiplies the rank-r term alone). One cuBLAS GEMM over a widened K,
    ``[X | P] · [W | B]ᵀ`` (and ``[dY | Q] · [W; A]`` for dX), is not offered: X and P are separate buffers, so
    building ``[X | P]`` reads and writes X (M×K) every step, as much traffic as the M×N write and β = 1 read it
    saves when K = N, and more when K > N; no copy-free arrangement exists inside one layer's call.
    ``quack`` (the LoRA linear only): QuACK's GEMM adds the rank-r term in its epilogue
    (:mod:`lora_lab.kernels.lora.quack_gemm`): cuBLAS-class GEMMs with no extra pass over the output.
    """
    return config.base_gemm if config.base_gemm in supported else default


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

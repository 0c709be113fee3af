"""The LoRA linear's two big GEMMs on QuACK's Hopper GEMM, the rank-r term added in its epilogue.

``KernelConfig(base_gemm="quack")``. QuACK (``quack-kernels``, a CuTe-DSL kernel library) lets a GEMM's epilogue
be a plain Python function of the fp32 accumulator element and of broadcast vectors: one value per output row
(a column-broadcast vector, length M) or one per output column (a row-broadcast vector, length N). A rank-r
product is r such pairs::

    Y[m, n]  = Σ_k X[m, k] W[n, k]  + b[n] + Σ_j P[m, j] B[n, j]        P = s · X Aᵀ   (M×r)
    dX[m, k] = Σ_n dY[m, n] W[n, k]        + Σ_j Q[m, j] A[j, k]        Q = s · dY B   (M×r)

so the epilogue generated here for rank r reads ``acc + p0·b0 + … + p(r-1)·b(r-1) (+ bias)``: r fused
multiply-adds per output element on the CUDA cores. In the cooperative schedule this route uses (:func:`gemm_config`)
the MMA warp groups run them between tiles while QuACK's producer warp already loads the next tile's operands; they
are not hidden behind the next tile's MMAs as a ping-pong schedule would hide them. Y and dX are written once, by
the GEMM; no pass reads them back (the β = 1 route reads its rank-r term back, the Triton route runs the GEMM in
Triton).

P and Q are cuBLAS calls that write them transposed (r×M: each rank a contiguous row, the epilogue's vector for
that rank); dA = Qᵀ X and dB = Pᵀ dY (transposed back) are cuBLAS calls too. The passes left over X and dY are
the four memory-bound rank-r products, as on the other routes; ``KernelConfig(fuse_q_db=True)`` makes Q and dB one
Triton pass over dY (three passes).

Where the route cannot run, :func:`unavailable_reason` says why and the op takes the Triton route with one
warning naming it: QuACK not importable, a device before Hopper (``$LORA_LAB_ARCH`` forcing an older class counts),
a dtype other than bf16/fp16, dropout (a cuBLAS call cannot regenerate the mask), rows not 16-byte aligned (TMA),
or a rank above ``MAX_RANK`` (each rank is two vector operands in the epilogue's shared memory and registers).
Versions this was written against: ``quack-kernels==0.6.5`` with ``nvidia-cutlass-dsl==4.7.1``.
"""
from __future__ import annotations

import torch

from lora_lab import gpu_arch
from lora_lab.kernels.lora.dispatch import warn_route_fallback

__all__ = ["MAX_RANK", "DTYPES", "QUACK_PINS", "SCHEDULES", "unavailable_reason", "rank_epilogue",
           "epilogue_source", "gemm_config", "gemm_with_rank_epilogue"]

MAX_RANK = 32
DTYPES = (torch.bfloat16, torch.float16)
QUACK_PINS = ("quack-kernels==0.6.5", "nvidia-cutlass-dsl==4.7.1")  # the versions this route was written against
_EPILOGUES: dict = {}
_WARNED: set = set()


def _frontend():
    """QuACK's epilogue frontend and its vector-load ops (imported on first use: an optional dependency)."""
    from quack.epilogue.frontend import gemm_epilogue
    from quack.epilogue.ops import ColVecLoad, RowVecLoad

    return gemm_epilogue, ColVecLoad, RowVecLoad


def _import_problem() -> str | None:
    try:
        _frontend()
    except Exception as err:  # ImportError, or a CUTLASS-DSL build that fails while importing
        return (f"QuACK cannot be imported ({type(err).__name__}: {str(err)[:160]}); "
                f"pip install {' '.join(QUACK_PINS)}")
    return None


def _device_problem(device: torch.device) -> str | None:
    """Why ``device`` cannot run QuACK's Hopper GEMM (None: it can)."""
    if device.type != "cuda":
        return f"QuACK's GEMM runs on CUDA devices; this input is on {device}"
    cap = gpu_arch.capability(device)
    if cap is None or cap < gpu_arch.TMA_MIN:
        return (f"QuACK's route is written for Hopper and newer; the kernels write for GPU class "
                f"{gpu_arch.gpu_class(device)!r}")
    return None


def unavailable_reason(M: int, K: int, N: int, rank: int, dtype: torch.dtype, device: torch.device,
                       dropout_p: float = 0.0) -> str | None:
    """Why ``base_gemm="quack"`` cannot run a call (None: it can): input M×K, weight N×K, LoRA rank ``rank``."""
    if dropout_p:
        return "dropout needs the Triton route (its kernels regenerate the mask; a cuBLAS call for P cannot)"
    if dtype not in DTYPES:
        return f"QuACK's route takes bf16 or fp16, not {dtype}"
    if rank > MAX_RANK:
        return (f"rank {rank} is above the epilogue's {MAX_RANK} (each rank is two vector operands in its shared "
                "memory and registers)")
    for name, size in (("rows (M)", M), ("in_features (K)", K), ("out_features (N)", N)):
        if size % 8:
            return f"{name} = {size} is not a multiple of 8 (TMA reads 16-byte aligned rows)"
    problem = _device_problem(torch.device(device))
    if problem is None:
        problem = _import_problem()
    return problem


def warn_fallback(reason: str) -> None:
    """One RuntimeWarning per distinct reason: the op asked for QuACK and runs the Triton route instead."""
    warn_route_fallback(_WARNED, "quack", reason)


def _names(rank: int) -> tuple[list[str], list[str]]:
    return [f"p{j}" for j in range(rank)], [f"b{j}" for j in range(rank)]


def epilogue_name(rank: int, has_bias: bool) -> str:
    return f"lora_rank{rank}{'_bias' if has_bias else ''}_epilogue"


def epilogue_source(rank: int, has_bias: bool) -> str:
    """The epilogue function's source: ``acc`` plus each rank's column value times its row value (plus the bias)."""
    lows, rts = _names(rank)
    params = ["acc", *lows, *rts, *(["bias"] if has_bias else [])]
    body = ["x = acc", *(f"x = x + {p} * {b}" for p, b in zip(lows, rts))]
    if has_bias:
        body.append("x = x + bias")
    body.append('return {"D": x}')
    return f"def {epilogue_name(rank, has_bias)}({', '.join(params)}):\n" + "".join(f"    {ln}\n" for ln in body)


def rank_epilogue(rank: int, has_bias: bool):
    """QuACK's epilogue module (an ``EpiMod``) for rank ``rank``, built once per (rank, bias).

    The function is generated (QuACK reads an epilogue's operands from its parameter names, so each rank is a
    parameter) and bound to a global of this module under its own name, where QuACK's compile cache finds it."""
    key = (rank, has_bias)
    if key not in _EPILOGUES:
        gemm_epilogue, ColVecLoad, RowVecLoad = _frontend()
        name = epilogue_name(rank, has_bias)
        namespace = {"__name__": __name__}
        exec(compile(epilogue_source(rank, has_bias), f"<lora_lab {name}>", "exec"), namespace)
        lows, rts = _names(rank)
        ops = {**{p: ColVecLoad(p) for p in lows}, **{b: RowVecLoad(b) for b in rts}}
        if has_bias:
            ops["bias"] = RowVecLoad("bias")
        module = gemm_epilogue(ops=ops)(namespace[name])
        globals()[name] = module
        _EPILOGUES[key] = module
    return _EPILOGUES[key]


SCHEDULES = ("cooperative", "pingpong")


def gemm_config(rank: int, schedule: str = "cooperative"):
    """QuACK's tile and schedule for a rank-``rank`` epilogue on Hopper. ``cooperative`` (the route's): 128×256,
    both consumer warp groups on one tile. ``pingpong``: QuACK's own default, 128×192, the two warp groups on
    alternate tiles, so one tile's epilogue overlaps the next tile's main loop. ``ptxas -v`` on the sm_90a code
    (``tools/quack_epilogue_spills.py``) reports spills for the ping-pong tile at ranks 8 to 32 and none for the
    cooperative one; whether the overlap pays for the spills is what notebook 05's component table times
    (``quack_*_gemm_pingpong`` beside ``quack_*_gemm``)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"QuACK schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    from quack.gemm_config import GemmConfig

    if schedule == "pingpong":
        return GemmConfig(tile_m=128, tile_n=192, pingpong=True, cluster_m=2, cluster_n=1)
    return GemmConfig(tile_m=128, tile_n=256, pingpong=False, cluster_m=2, cluster_n=1)


def _packed(t: torch.Tensor, transposed_ok: bool = False) -> torch.Tensor:
    """``t`` where TMA can read it as it is (row-major, or with ``transposed_ok`` column-major; 16-byte aligned
    base), else a packed row-major copy: an expanded gradient (``y.sum()``'s, stride 0), a strided or offset view."""
    laid_out = t.is_contiguous() or (transposed_ok and t.t().is_contiguous())
    if laid_out and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def gemm_with_rank_epilogue(out: torch.Tensor, inp: torch.Tensor, mat: torch.Tensor, low_t: torch.Tensor,
                            rt: torch.Tensor, bias: torch.Tensor | None = None,
                            schedule: str = "cooperative") -> torch.Tensor:
    """``out = inp @ mat + low_tᵀ @ rt (+ bias)`` in one QuACK GEMM.

    ``inp``: M×D; ``mat``: D×N (any layout QuACK reads, e.g. ``W.t()``); ``low_t``: r×M and ``rt``: r×N, both
    row-major (each row one vector operand); ``bias``: N or None; ``out``: M×N, written; ``schedule``: one of
    :data:`SCHEDULES` (:func:`gemm_config`). An operand TMA cannot read as laid out (an expanded gradient, a strided
    view) is packed first (:func:`_packed`)."""
    rank = low_t.shape[0]
    M, N = out.shape
    if low_t.shape != (rank, M) or rt.shape != (rank, N):
        raise ValueError(f"gemm_with_rank_epilogue: low_t must be r×{M} and rt r×{N}; got {tuple(low_t.shape)} "
                         f"and {tuple(rt.shape)}")
    if low_t.stride(1) != 1 or rt.stride(1) != 1:
        raise ValueError("gemm_with_rank_epilogue: low_t and rt must be row-major (each rank a contiguous row)")
    lows, rts = _names(rank)
    operands = {**{p: low_t[j:j + 1] for j, p in enumerate(lows)}, **{b: rt[j:j + 1] for j, b in enumerate(rts)}}
    if bias is not None:
        operands["bias"] = bias.reshape(1, N)
    rank_epilogue(rank, bias is not None)(_packed(inp), _packed(mat, transposed_ok=True), out={"D": out},
                                          tuned=False, config=gemm_config(rank, schedule), **operands)
    return out

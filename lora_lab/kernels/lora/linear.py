"""Fused LoRA linear layer: forward and backward in Triton, no dtype round trip.

The layer (W frozen, A and B trained, s = alpha / r, drop = inverted dropout on the LoRA input)::

    Y = X Wᵀ + b + s · (drop(X) Aᵀ) Bᵀ          X: M×K, W: N×K, A: r×K, B: N×r, Y: M×N

We fold the scale into the two rank-r products the layer keeps, so every later formula is free of ``s``::

    P = s · drop(X) Aᵀ          (M×r, saved for backward)
    Y = X Wᵀ + b + P Bᵀ         (one GEMM; the rank-r term is an extra depth-r step of its K loop)

Backward, given dY (M×N)::

    Q  = s · dY B               (M×r)
    dB = dYᵀ P                  (N×r)
    dA = Qᵀ drop(X)             (r×K; the dropout mask is regenerated from the seed, never stored)
    dX = dY W + (Q A) ⊙ keep/(1-p)   (one GEMM; the rank-r term again rides at the end of its loop)

Saved for backward: X, P (M×r), and the parameters. Nothing else of size M×K, no fp32 copy of X.
The input stays in its dtype end to end (bf16, fp16 or fp32); the tensor cores accumulate in fp32 and
each output is rounded once.

The work is done by :mod:`.rank_ops` (the memory-bound rank-r passes P, Q, dA, dB) and :mod:`.gemm` (the GEMM
with the rank-r term in its epilogue); :mod:`.dispatch` picks Triton or cuBLAS per call and size (left on its
defaults, a GPU call runs every product on cuBLAS except a large GEMM with K > N: :func:`.dispatch.linear_route`),
and :class:`lora_lab.kernels.KernelConfig` holds every setting.
"""
from __future__ import annotations

import contextlib

import torch

from lora_lab.dtypes import addmm_fp32_out_works
from lora_lab.kernels.config import KernelConfig, resolve_config
from lora_lab.kernels.lora import merged, quack_gemm, stacked, widened
from lora_lab.kernels.lora.dispatch import base_gemm_engine, engine_for, join_side_stream, linear_route, side_stream
from lora_lab.kernels.lora.gemm import lora_gemm
from lora_lab.kernels.lora.rank_ops import q_and_db, rank_projection, rank_reduction
from lora_lab.kernels.triton_helpers import check_interpreter_dtype, check_kernel_device

__all__ = [
    "FusedLoRALinearFunction",
    "fused_lora_linear",
    "lora_linear_reference",
    "lora_linear_unfused",
    "check_lora_args",
    "SUPPORTED_DTYPES",
]

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------
# Argument checks shared with the shared-input op: bad input → an error naming the problem.
# ----------------------------------------------------------------------------------------------
def check_lora_args(x, weight, bias, lora_A, lora_B, name="fused_lora_linear"):
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: input dtype {x.dtype} not supported (bf16, fp16, fp32)")
    if weight.dim() != 2:
        raise ValueError(f"{name}: weight must be 2-D (out_features × in_features), got shape {tuple(weight.shape)}")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"{name}: input's last dimension {x.shape[-1]} != weight in_features {K}")
    if weight.dtype != x.dtype:
        raise TypeError(f"{name}: weight dtype {weight.dtype} != input dtype {x.dtype}; cast the base layer "
                        "(these kernels never round-trip the input through another dtype)")
    if lora_A.dim() != 2 or lora_A.shape[1] != K:
        raise ValueError(f"{name}: lora_A must be r × {K}, got {tuple(lora_A.shape)}")
    r = lora_A.shape[0]
    if lora_B.dim() != 2 or lora_B.shape != (N, r):
        raise ValueError(f"{name}: lora_B must be {N} × {r}, got {tuple(lora_B.shape)}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"{name}: bias must have shape ({N},), got {tuple(bias.shape)}")
    for t, what in ((weight, "weight"), (lora_A, "lora_A"), (lora_B, "lora_B"), (bias, "bias")):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: {what} is on {t.device} but the input is on {x.device}")
    for t, what in ((lora_A, "lora_A"), (lora_B, "lora_B"), (bias, "bias")):
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: {what} dtype {t.dtype} not supported")
    check_kernel_device(x, "the input")
    check_interpreter_dtype(x, op=name)  # LoRA factors are cast to x's dtype: x's is the one the kernels see


def _folds(config: KernelConfig, dropout_p: float, rank: int) -> bool:
    """Whether P (forward) and Q (dX) are computed inside the GEMMs (``config.fold_projection``): the persistent
    kernel on the Triton base-GEMM route, no dropout (the mask applies to X's tiles), rank <= 64 (registers)."""
    return (config.fold_projection and config.gemm_loads == "persistent"
            and base_gemm_engine(config) == "triton" and dropout_p == 0.0 and rank <= 64)


def _cublas_forward(x2, weight, bias, a, b, scaling):
    """(Y, P) with P = s · X Aᵀ and Y = X Wᵀ + b + P Bᵀ, as three cuBLAS calls (no dropout)."""
    p = _scaled_mm(x2, a.t(), scaling)
    y = torch.addmm(bias, x2, weight.t()) if bias is not None else torch.mm(x2, weight.t())
    y.addmm_(p, b.t())
    return y, p


def _quack_route(config: KernelConfig, x2: torch.Tensor, weight: torch.Tensor, rank: int, dropout_p: float) -> bool:
    """Whether this call runs its big GEMMs on QuACK (``base_gemm="quack"``, :mod:`.quack_gemm`); where the route
    cannot run, one warning names why and the call takes the Triton route."""
    if config.base_gemm != "quack":
        return False
    reason = quack_gemm.unavailable_reason(x2.shape[0], x2.shape[1], weight.shape[0], rank, x2.dtype, x2.device,
                                           dropout_p)
    if reason is not None:
        quack_gemm.warn_fallback(reason)
        return False
    return True


def _wide_route(config: KernelConfig, rank: int, dropout_p: float) -> bool:
    """Whether this call takes the K-widened route (``base_gemm="wide"``); with dropout (the mask multiplies the
    backward's rank-r term alone, which a widened GEMM cannot) or a rank above 128, one warning names why and the
    call takes the Triton route."""
    if config.base_gemm != "wide":
        return False
    reason = ("dropout needs the Triton route (the mask multiplies dX's rank-r term alone)" if dropout_p
              else f"rank {rank} is above the widening passes' 128" if rank > 128 else None)
    if reason is not None:
        widened.warn_fallback(reason)
        return False
    return True


def _merged_route(config: KernelConfig, dropout_p: float, route: str = "merged") -> bool:
    """Whether this call runs its big GEMMs on the merged weight W + s·B A: ``route="merged"``
    (``base_gemm="merged"``, :mod:`.merged`) or ``"stacked"`` (``base_gemm="stacked"``, :mod:`.stacked`: P and Q as
    more output columns of those GEMMs). With dropout, one warning names why and the call takes the Triton route."""
    if config.base_gemm != route:
        return False
    reason = merged.unavailable_reason(dropout_p)
    if reason is not None:
        (stacked if route == "stacked" else merged).warn_fallback(reason)
        return False
    return True


def _merge_engine(config: KernelConfig, dropout_p: float) -> str:
    """Who forms W + s·B A on the merged route: cuBLAS with ``rank_ops="torch"``, else a Triton pass."""
    return "torch" if _torch_rank_ops(config, dropout_p) else "triton"


def _torch_rank_ops(config: KernelConfig, dropout_p: float) -> bool:
    """Whether P, Q, dA and dB run as cuBLAS calls (``KernelConfig(rank_ops="torch")``, no dropout: the Triton
    kernels regenerate the dropout mask from its seed, a cuBLAS call cannot)."""
    return config.rank_ops == "torch" and dropout_p == 0.0


def _scaled_mm(inp: torch.Tensor, mat: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale · inp @ mat`` in one cuBLAS call (the scale applied to the fp32 accumulator, one rounding)."""
    out = torch.empty((inp.shape[0], mat.shape[1]), device=inp.device, dtype=inp.dtype)
    return torch.addmm(out, inp, mat, beta=0.0, alpha=scale, out=out)


def _low_rank_fill(out: torch.Tensor, low: torch.Tensor, rt: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """``out = low @ rt (+ bias)`` in one cuBLAS call: the rank-r term the base GEMM is then added onto (β = 1).
    With ``base_gemm="cublas"`` and ``rank_ops="torch"`` a step launches no Triton kernel at all."""
    if bias is None:
        torch.mm(low, rt, out=out)
    else:
        torch.addmm(bias, low, rt, out=out)


# The reductions over the tokens (dA = Qᵀ X, dB = dYᵀ P) are split at a multiple of REDUCTION_ALIGN on CUDA: the
# head by cuBLAS, the last M mod REDUCTION_ALIGN rows in fp32, added onto it. On an H100 (torch 2.11, CUDA 13.0)
# cuBLAS returned dYᵀ P without the last token's term for some odd token counts (the bf16 GPU tests at
# 4097 × 1032 → 2056, r 16, of the cuBLAS routes), with a bf16 or an fp32 result alike, where the product over an
# even count, or over a contiguous copy of dYᵀ, was right. test_gpu_token_reductions_at_odd_counts checks it.
REDUCTION_ALIGN = 64


def _reduction_head(a: torch.Tensor) -> int:
    """How many of ``a @ b``'s reduction rows cuBLAS takes (the rest go to :func:`_wide_mm`'s fp32 tail)."""
    depth = a.shape[1]
    return depth - depth % REDUCTION_ALIGN if a.is_cuda and a.dtype != torch.float32 else depth


def _wide_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` — a reduction over the tokens, dA or dB — with an fp32 result for 16-bit operands where this
    torch build accumulates into one (:func:`~lora_lab.dtypes.addmm_fp32_out_works`: CUDA; one rounding, as the
    Triton reduction's fp32 output), else in the operands' dtype; on CUDA the last rows of an unaligned depth are
    added in fp32 (``REDUCTION_ALIGN``, above)."""
    depth, head = a.shape[1], _reduction_head(a)
    if head == depth:
        return _mm_fp32_out(a, b)
    tail = a[:, head:].float() @ b[head:].float()
    return tail.add_(_mm_fp32_out(a[:, :head], b[:head])) if head else tail


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype != torch.float32 and addmm_fp32_out_works(a.device, a.dtype):
        out = torch.empty((a.shape[0], b.shape[1]), device=a.device, dtype=torch.float32)
        return torch.addmm(out, a, b, beta=0.0, out_dtype=torch.float32, out=out)
    return torch.mm(a, b)


def _on_stream(stream):
    """``torch.cuda.stream(stream)``, or a context that changes nothing when ``stream`` is None."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------
# The autograd Function.
# ----------------------------------------------------------------------------------------------
class FusedLoRALinearFunction(torch.autograd.Function):
    """Y = X Wᵀ + b + s·(drop(X) Aᵀ) Bᵀ with W (and b) frozen unless they require grad."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_A, lora_B, scaling, dropout_p, seed, config: KernelConfig):
        K = x.shape[-1]
        N = weight.shape[0]
        x2 = x.reshape(-1, K)  # a view whenever the input's layout allows it
        M = x2.shape[0]
        cdt = x.dtype
        # LoRA weights kept in another dtype (PEFT keeps fp32 adapters) are cast once per call — r×K and
        # N×r, tiny — so the M×K input never leaves its dtype.
        a = lora_A.to(cdt)
        b = lora_B.to(cdt)

        # the Triton engine's route (rank_ops="auto": a rule), resolved once and saved for backward
        config = linear_route(M, K, N, x.device, config)
        if dropout_p == 0.0 and engine_for(M, K, N, x.device, config) == "cublas":
            # small GEMMs: the same P and Y from cuBLAS calls (host-bound otherwise, see the module notes)
            y, p = _cublas_forward(x2, weight, bias, a, b, scaling)
        elif _wide_route(config, a.shape[0], dropout_p):
            # [X | P] written by the pass that computes P, then Y = [X | P] · [W | B]ᵀ + b in one cuBLAS GEMM
            y, x2, p = widened.forward(x2, weight, bias, a, b, scaling, config.autotune)
        elif _quack_route(config, x2, weight, a.shape[0], dropout_p):
            # Pᵀ = s · A Xᵀ (r×M, cuBLAS), then Y = X Wᵀ + b + P Bᵀ in one QuACK GEMM (rank-r term in its epilogue)
            p_t = _scaled_mm(a, x2.t(), scaling)
            y = torch.empty((M, N), device=x.device, dtype=cdt)
            quack_gemm.gemm_with_rank_epilogue(y, x2, weight.t(), p_t, b.t().contiguous(), bias)
            p = p_t.t()
        elif _folds(config, dropout_p, a.shape[0]):
            # P = s · X Aᵀ inside the GEMM's K loop (the X tiles it loads anyway), written out for backward
            p = torch.empty((M, a.shape[0]), device=x.device, dtype=cdt)
            y = torch.empty((M, N), device=x.device, dtype=cdt)
            lora_gemm(y, [(x2, weight.t())], rt=b.t(), bias=bias, project=(a.t(), scaling, p), config=config)
        elif _merged_route(config, dropout_p, route="stacked"):
            # [Y | P] = X [W + s·B A ; s·A]ᵀ + [b | 0]: P as r more output columns of the frozen layer's GEMM
            y, p = stacked.forward_gemm(x2, weight, bias, a, b, scaling, _merge_engine(config, dropout_p))
        else:
            merged_gemm = _merged_route(config, dropout_p)
            # with overlap on, the merged route's P pass (memory-bound) runs on a side stream beside its GEMM
            side = side_stream(x.device, config) if merged_gemm else None
            if side is not None:
                main = torch.cuda.current_stream(x.device)
                side.wait_stream(main)
            if merged_gemm:
                # Y = X (W + s·B A)ᵀ + b: the frozen layer's GEMM on a weight merged for this call. Launched before
                # P, which Y does not need: the host then prepares P's pass while the GEMM runs
                y = merged.forward_gemm(x2, weight, bias, a, b, scaling, _merge_engine(config, dropout_p))
            # P = s · drop(X) Aᵀ          (M×r)
            with _on_stream(side):
                if _torch_rank_ops(config, dropout_p):
                    p = _scaled_mm(x2, a.t(), scaling)
                else:
                    p = rank_projection(x2, a.t(), scaling, dropout_p=dropout_p, seed=seed, tune=config.autotune)
            if side is not None:
                join_side_stream(side, main, p)
            if merged_gemm:
                pass  # Y is done
            elif base_gemm_engine(config) == "cublas":
                # Y = P Bᵀ + b (one write: Triton, or cuBLAS with rank_ops="torch"), then Y += X Wᵀ (cuBLAS, β = 1)
                y = torch.empty((M, N), device=x.device, dtype=cdt)
                if _torch_rank_ops(config, dropout_p):
                    _low_rank_fill(y, p, b.t(), bias)
                else:
                    lora_gemm(y, [(p, b.t())], bias=bias, config=config)
                y.addmm_(x2, weight.t())
            else:
                # Y = X Wᵀ + b + P Bᵀ     (one GEMM, rank-r step at the end of its K loop)
                y = torch.empty((M, N), device=x.device, dtype=cdt)
                lora_gemm(y, [(x2, weight.t())], low=p, rt=b.t(), bias=bias, config=config)

        # the factors as the kernels read them (cast once here; a no-op when they are in x's dtype already):
        # backward reuses them instead of casting again, and their dtypes say what the gradients return as
        ctx.save_for_backward(x2, p, weight, bias, a, b)
        ctx.factor_dtypes = (lora_A.dtype, lora_B.dtype)
        ctx.scaling, ctx.dropout_p, ctx.seed, ctx.config = scaling, dropout_p, seed, config
        ctx.x_shape = x.shape
        return y.reshape(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, dy):
        x2, p, weight, bias, a, b = ctx.saved_tensors
        a_dtype, b_dtype = ctx.factor_dtypes
        config = ctx.config
        N, K = weight.shape
        dy2 = dy.reshape(-1, N)
        cdt = x2.dtype
        if dy2.dtype != cdt:
            dy2 = dy2.to(cdt)
        need_x, need_w, need_b, need_a, need_lb = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                                   ctx.needs_input_grad[2], ctx.needs_input_grad[3],
                                                   ctx.needs_input_grad[4])
        dx = da = db = None
        # the frozen base's own gradients, only when it is trained too (not LoRA's usual setting); every path alike
        dw = (dy2.t() @ x2).to(weight.dtype) if need_w else None  # dW = dYᵀ X
        dbias = dy2.sum(0, dtype=torch.float32).to(bias.dtype) if need_b else None

        if ctx.dropout_p == 0.0 and engine_for(x2.shape[0], K, N, dy2.device, config, backward=True) == "cublas":
            # small GEMMs: the same formulas as cuBLAS calls (the Triton launches would leave the GPU idle)
            q = _scaled_mm(dy2, b, ctx.scaling) if (need_x or need_a) else None  # Q = s · dY B
            if need_lb:
                db = _wide_mm(dy2.t(), p).to(b_dtype)  # dB = dYᵀ P
            if need_a:
                da = _wide_mm(q.t(), x2).to(a_dtype)  # dA = Qᵀ X
            if need_x:
                dx = torch.mm(dy2, weight).addmm_(q, a).reshape(ctx.x_shape)  # dX = dY W + Q A
            return dx, dw, dbias, da, db, None, None, None, None

        if need_x and _wide_route(config, a.shape[0], ctx.dropout_p):
            # [dY | Q] written by the pass that computes Q (and dB), then dX = [dY | Q] · [W ; A] in one cuBLAS GEMM
            dx, q, dbt = widened.backward(dy2, p, weight, a, b, ctx.scaling, need_lb, config.autotune)
            da = _wide_mm(q.t(), x2).to(a_dtype) if need_a else None  # dA = Qᵀ X
            db = dbt.t().to(b_dtype) if need_lb else None
            return dx.reshape(ctx.x_shape), dw, dbias, da, db, None, None, None, None

        if (need_x or need_a) and _quack_route(config, x2, weight, a.shape[0], ctx.dropout_p):
            # Qᵀ = s · Bᵀ dYᵀ (r×M, cuBLAS); dX = dY W + Q A in one QuACK GEMM; dA = Qᵀ X, dB = (Pᵀ dY)ᵀ by cuBLAS;
            # with fuse_q_db, Q and dB come from one Triton pass over dY instead of two cuBLAS calls
            if need_lb and config.fuse_q_db:  # the route's ranks (<= quack_gemm.MAX_RANK) all fit q_and_db
                q, dbt = q_and_db(dy2, b, p, ctx.scaling, tune=config.autotune)
                q_t, db = q.t().contiguous(), dbt.t().to(b_dtype)
            else:
                q_t = _scaled_mm(b.t(), dy2.t(), ctx.scaling)
            if need_x:
                dx = torch.empty((dy2.shape[0], K), device=dy2.device, dtype=cdt)
                quack_gemm.gemm_with_rank_epilogue(dx, dy2, weight, q_t, a.contiguous())
                dx = dx.reshape(ctx.x_shape)
            if need_a:
                da = _wide_mm(q_t, x2).to(a_dtype)
            if need_lb and db is None:
                db = _wide_mm(p.t(), dy2).t().to(b_dtype)
            return dx, dw, dbias, da, db, None, None, None, None

        merged_dx = merged_side = stacked_q = None
        if need_x and ctx.dropout_p == 0.0 and config.base_gemm == "stacked":
            # [dX | Q] = dY [W + s·B A | s·B]: Q as r more output columns of the dX GEMM; dA and dB below read it
            merged_dx, stacked_q = stacked.input_grad_gemm(dy2, weight, a, b, ctx.scaling,
                                                           _merge_engine(config, ctx.dropout_p))
            merged_dx = merged_dx.reshape(ctx.x_shape)
            need_x = False
        elif need_x and ctx.dropout_p == 0.0 and config.base_gemm == "merged":
            # dX = dY (W + s·B A), the weight merged again (never kept between forward and backward). It needs no Q,
            # so it is launched first and the rank-r passes below, for dA and dB alone, are prepared while it runs
            # (with overlap on, they run on a side stream beside it: memory-bound passes next to a compute-bound GEMM)
            merged_side = side_stream(dy2.device, config) if (need_a or need_lb) else None
            if merged_side is not None:
                main = torch.cuda.current_stream(dy2.device)
                merged_side.wait_stream(main)
            merged_dx = merged.input_grad_gemm(dy2, weight, a, b, ctx.scaling,
                                               _merge_engine(config, ctx.dropout_p)).reshape(ctx.x_shape)
            need_x = False
        with _on_stream(merged_side):  # every rank-r pass below, on the merged route's side stream if any
            # Q = s · dY B               (M×r)
            fold = need_x and _folds(config, ctx.dropout_p, a.shape[0])
            fused_q_db = need_lb and b.shape[1] <= 128 and config.fuse_q_db and not fold and stacked_q is None
            if stacked_q is not None:
                q = stacked_q  # from the dX GEMM
            elif fold:
                # Q inside the dX GEMM's K loop (over N: the dY tiles it loads anyway); dA and dB wait for it
                q = torch.empty((dy2.shape[0], a.shape[0]), device=dy2.device, dtype=cdt)
                dx = torch.empty((dy2.shape[0], K), device=dy2.device, dtype=cdt)
                lora_gemm(dx, [(dy2, weight)], rt=a, project=(b, ctx.scaling, q), config=config)
                dx = dx.reshape(ctx.x_shape)
            elif fused_q_db:  # experimental: Q and dB in one pass over dY (atomic, non-deterministic dB)
                q, dbt = q_and_db(dy2, b, p, ctx.scaling, tune=config.autotune)
                db = dbt.t().to(b_dtype)
            elif _torch_rank_ops(config, ctx.dropout_p):
                q = _scaled_mm(dy2, b, ctx.scaling) if (need_x or need_a) else None
            else:
                q = rank_projection(dy2, b, ctx.scaling, tune=config.autotune) if (need_x or need_a) else None

            def low_rank_grads():
                grads = [None, db if fused_q_db else None]
                if _torch_rank_ops(config, ctx.dropout_p):  # cuBLAS, fp32 results where the build allows
                    if need_lb and not fused_q_db:
                        grads[1] = _wide_mm(dy2.t(), p).to(b_dtype)  # dB = dYᵀ P
                    if need_a:
                        grads[0] = _wide_mm(q.t(), x2).to(a_dtype)  # dA = Qᵀ X
                    return grads
                if need_lb and not fused_q_db:
                    # dB = dYᵀ P = (Pᵀ dY)ᵀ    (N×r)
                    grads[1] = rank_reduction(p, dy2, tune=config.autotune).t().to(b_dtype)
                if need_a:
                    # dA = Qᵀ drop(X)          (r×K, mask regenerated from the seed)
                    grads[0] = rank_reduction(q, x2, ctx.dropout_p, ctx.seed, tune=config.autotune).to(a_dtype)
                return grads

            def input_grad():
                # dX = dY W + (Q A) ⊙ keep/(1-p)
                out = torch.empty((dy2.shape[0], K), device=dy2.device, dtype=cdt)
                if ctx.dropout_p == 0.0 and base_gemm_engine(config) == "cublas":
                    # dX = Q A (one write: Triton, or cuBLAS with rank_ops="torch"), then dX += dY W (cuBLAS, β = 1)
                    if _torch_rank_ops(config, ctx.dropout_p):
                        _low_rank_fill(out, q, a)
                    else:
                        lora_gemm(out, [(q, a)], config=config)
                    out.addmm_(dy2, weight)
                else:
                    lora_gemm(out, [(dy2, weight)], low=q, rt=a, dropout_p=ctx.dropout_p, seed=ctx.seed, config=config)
                return out.reshape(ctx.x_shape)

            # dA and dB only read memory; the dX GEMM is compute-bound: optionally run them side by side
            side = side_stream(dy2.device, config) if need_x and (need_a or need_lb) and not fold else None
            if side is not None:
                main = torch.cuda.current_stream(dy2.device)
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    da, db = low_rank_grads()
                dx = input_grad()
                join_side_stream(side, main, da, db)
            elif need_x and not fold:
                # one stream: the dX GEMM is launched first, right after Q, so the host time of the dA / dB launches
                # is spent while it runs instead of in front of it (the GPU would idle while the host prepares them)
                dx = input_grad()
                da, db = low_rank_grads()
            else:
                da, db = low_rank_grads()
        if merged_side is not None:
            join_side_stream(merged_side, main, da, db)
        return dx if merged_dx is None else merged_dx, dw, dbias, da, db, None, None, None, None


def _draw_seed() -> int:
    # from torch's CPU generator: reproducible under torch.manual_seed, and restored by activation
    # checkpointing's RNG-state preservation so a recomputed forward sees the same mask
    return int(torch.randint(0, 2**31 - 1, (1,)).item())


def fused_lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_A: torch.Tensor,
                      lora_B: torch.Tensor, scaling: float, dropout_p: float = 0.0, training: bool = True,
                      seed: int | None = None, config: KernelConfig | None = None) -> torch.Tensor:
    """Y = X Wᵀ + b + scaling · (dropout(X) lora_Aᵀ) lora_Bᵀ, fused (forward and backward) in Triton.

    ``dropout_p`` applies only when ``training``; the mask comes from ``seed`` (drawn from torch's RNG when
    None) and is regenerated in backward, never stored. ``config``: kernel settings (:class:`KernelConfig`;
    None: the defaults, seeded from the environment).
    """
    check_lora_args(x, weight, bias, lora_A, lora_B)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"fused_lora_linear: dropout_p must be in [0, 1), got {dropout_p}")
    p = float(dropout_p) if training else 0.0
    if p > 0.0:
        M = x.numel() // max(x.shape[-1], 1)
        if M * x.shape[-1] >= 2**31:
            raise ValueError("fused_lora_linear: dropout offsets are int32; input has ≥ 2^31 elements")
        if seed is None:
            seed = _draw_seed()
    return FusedLoRALinearFunction.apply(x, weight, bias, lora_A, lora_B, float(scaling), p, seed,
                                         resolve_config(config))


# ----------------------------------------------------------------------------------------------
# Plain-torch references.
# ----------------------------------------------------------------------------------------------
def lora_linear_reference(x, weight, bias, lora_A, lora_B, scaling, keep_mask=None, dropout_p=0.0,
                          dtype=torch.float32):
    """The layer in plain torch, every tensor upcast to ``dtype`` (fp32 or fp64): the numerics yardstick."""
    xr = x.to(dtype)
    xd = xr if keep_mask is None else xr * keep_mask.reshape(xr.shape).to(dtype) / (1.0 - dropout_p)
    y = xr @ weight.to(dtype).t() + scaling * ((xd @ lora_A.to(dtype).t()) @ lora_B.to(dtype).t())
    if bias is not None:
        y = y + bias.to(dtype)
    return y


def lora_linear_unfused(x, weight, bias, lora_A, lora_B, scaling):
    """What an unfused implementation computes in x's dtype: base, then (X Aᵀ) Bᵀ, scaled, added."""
    a = lora_A.to(x.dtype)
    b = lora_B.to(x.dtype)
    base = torch.nn.functional.linear(x, weight, bias)
    return base + (x @ a.t() @ b.t()) * scaling

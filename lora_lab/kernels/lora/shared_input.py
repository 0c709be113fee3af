"""Shared-input LoRA projections: several LoRA linears that read the same X, as one fused op.

Projections such as q/k/v, gate/up, or Qwen3.5 GatedDeltaNet's ``in_proj_qkv``/``in_proj_z``/
``in_proj_b``/``in_proj_a`` all read the same input X (M×K). With segments i = 1..S (output widths N_i,
ranks r_i, some of them frozen plain linears with r_i = 0)::

    W = [W_1; …; W_S]                  (N×K, N = Σ N_i — one frozen buffer the members' weights are views of)
    A = [A_1; …; A_S]                  (R×K, R = Σ r_i)
    B = blockdiag(B_1, …, B_S)         (N×R)
    P = drop(X) Aᵀ · diag(s)           (M×R: ONE pass over X for every adapter)
    [Y_1 … Y_S] = X Wᵀ + b + P Bᵀ      (ONE GEMM; a tile adds only the ranks of the segments it spans)

Backward, with dY_i the gradient of Y_i (absent ones skipped)::

    Q_i  = s_i · dY_i B_i              (M×r_i, stacked into Q: M×R)
    dB_i = dY_iᵀ P_i
    dA   = Qᵀ X                        (ONE pass over X for every adapter)
    dX   = Σ_i dY_i W_i + Q A          (ONE GEMM reading every dY_i: dX is accumulated once, not S times)

By default (``KernelConfig(base_gemm="auto")``) the big GEMMs are cuBLAS's, added with β = 1 onto the rank-r
term a Triton pass wrote (and the narrow dY_i), with dA/dB on a side stream: the form the H200 benchmarks of the
GatedDeltaNet group favoured (``benchmarks/bench_gated_deltanet.py`` measures both). With
``KernelConfig(base_gemm="merged")`` both big GEMMs are cuBLAS's on ``[W_1 + s_1·B_1 A_1; …]``, merged per call and
never kept (:mod:`.merged`), and dX has no Q A term.

Saved for backward: X, P (M×R) and the parameters. Dropout is not fused here (each PEFT projection draws its
own mask); :func:`lora_lab.kernels.patch_model` keeps projections with dropout on the single-projection kernel.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from lora_lab.kernels.config import KernelConfig, resolve_config
from lora_lab.kernels.lora import merged
from lora_lab.kernels.lora.dispatch import base_gemm_engine, engine_for, join_side_stream, side_stream
from lora_lab.kernels.lora.gemm import lora_gemm
from lora_lab.kernels.lora.linear import SUPPORTED_DTYPES, _wide_mm
from lora_lab.kernels.lora.rank_ops import rank_projection, rank_reduction
from lora_lab.kernels.triton_helpers import check_interpreter_dtype, check_kernel_device

__all__ = [
    "SharedInputLoRAFunction",
    "fused_shared_input_lora",
    "shared_input_lora_reference",
    "MAX_SEGMENTS",
]

_FIRST_LORA = 7  # position of the first LoRA factor among the Function's inputs
MAX_SEGMENTS = 4  # the dX GEMM takes up to four dY segments in one launch
_NARROW_SEGMENT = 256  # base_gemm='cublas': dY_i this narrow joins the Triton pass instead of a cuBLAS call


_LAYOUT_CACHE: dict = {}


def _segment_layout(splits: Sequence[int], ranks: Sequence[int], device):
    """Offsets of each segment in the stacked N and R axes, and the per-column rank range tables.

    Cached per (splits, ranks, device): building the tables means a host-to-device copy, which would make
    the host wait for the GPU on every call.
    """
    key = (tuple(splits), tuple(ranks), str(device))
    hit = _LAYOUT_CACHE.get(key)
    if hit is not None:
        return hit
    n_off, r_off = [0], [0]
    for n, r in zip(splits, ranks):
        n_off.append(n_off[-1] + n)
        r_off.append(r_off[-1] + r)
    # columns of segment i may only use ranks [r_off[i], r_off[i] + r_i)
    lo = torch.repeat_interleave(torch.tensor(r_off[:-1], dtype=torch.int32), torch.tensor(list(splits)))
    hi = torch.repeat_interleave(torch.tensor(r_off[1:], dtype=torch.int32), torch.tensor(list(splits)))
    _LAYOUT_CACHE[key] = (n_off, r_off, lo.to(device), hi.to(device))
    return _LAYOUT_CACHE[key]


_COL_SCALE_CACHE: dict = {}


def _column_scales(ranks, scalings, device) -> torch.Tensor:
    """fp32 vector of each stacked rank column's scale s_i (cached: it only changes with the config)."""
    key = (tuple(ranks), tuple(scalings), str(device))
    if key not in _COL_SCALE_CACHE:
        cols = [s for r, s in zip(ranks, scalings) for _ in range(r)]
        _COL_SCALE_CACHE[key] = torch.tensor(cols, dtype=torch.float32).to(device)
    return _COL_SCALE_CACHE[key]


def _merged_weight_cat(weight_cat, n_off, ranks, scalings, As, Bs) -> torch.Tensor:
    """``[W_1 + s_1·B_1 A_1; …]`` (N×K) in the weight's dtype, each LoRA segment in one call (B_i A_i accumulated
    with W_i in fp32, rounded once), a frozen segment copied: ``base_gemm="merged"`` (:mod:`.merged`)."""
    out = torch.empty_like(weight_cat)
    j = 0
    for i, r in enumerate(ranks):
        rows = slice(n_off[i], n_off[i + 1])
        if r > 0:
            merged.merged_weight(weight_cat[rows], As[j], Bs[j], scalings[i], out=out[rows])
            j += 1
        else:
            out[rows].copy_(weight_cat[rows])
    return out


class SharedInputLoRAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_cat, bias_cat, splits, ranks, scalings, config: KernelConfig, *lora_params):
        # lora_params: A_1, B_1, A_2, B_2, … for the segments with r_i > 0, in order
        K = x.shape[-1]
        x2 = x.reshape(-1, K)
        M = x2.shape[0]
        cdt = x.dtype
        n_off, r_off, rank_lo, rank_hi = _segment_layout(splits, ranks, x.device)
        N, R = n_off[-1], r_off[-1]
        lora_segments = [i for i, r in enumerate(ranks) if r > 0]
        As = [lora_params[2 * j].to(cdt) for j in range(len(lora_segments))]
        Bs = [lora_params[2 * j + 1].to(cdt) for j in range(len(lora_segments))]

        if engine_for(M, K, N, x.device, config) == "cublas":
            # small GEMMs: the same Y and P from cuBLAS calls (Triton launches would leave the GPU idle)
            y = torch.addmm(bias_cat, x2, weight_cat.t()) if bias_cat is not None else torch.mm(x2, weight_cat.t())
            if R > 0:
                col_scale = _column_scales(ranks, scalings, x.device)
                # P = X Aᵀ diag(s)
                p = torch.mm(x2, torch.cat(As, 0).t()).mul_(col_scale)
                for j, i in enumerate(lora_segments):
                    # Y_i += P_i B_iᵀ, in place in Y's columns of segment i
                    y[:, n_off[i]:n_off[i + 1]].addmm_(p[:, r_off[i]:r_off[i + 1]], Bs[j].t())
            else:
                p = torch.empty((M, 0), device=x.device, dtype=cdt)
        elif R > 0:
            if config.base_gemm == "merged":
                # [Y_1 … Y_S] = X [W_1 + s_1·B_1 A_1; …]ᵀ + b: one cuBLAS GEMM on a weight merged for this call,
                # launched before P (which Y does not need), so that P's pass is prepared while it runs
                wm = _merged_weight_cat(weight_cat, n_off, ranks, scalings, As, Bs)
                y = torch.addmm(bias_cat, x2, wm.t()) if bias_cat is not None else torch.mm(x2, wm.t())
            else:
                y = torch.empty((M, N), device=x.device, dtype=cdt)
            a_cat = torch.cat(As, 0)  # R×K (tiny)
            b_diag = torch.zeros((N, R), device=x.device, dtype=cdt)  # blockdiag(B_i), N×R (tiny)
            for j, i in enumerate(lora_segments):
                b_diag[n_off[i]:n_off[i + 1], r_off[i]:r_off[i + 1]] = Bs[j]
            col_scale = _column_scales(ranks, scalings, x.device)
            # P = X Aᵀ diag(s): one pass over X for all adapters
            p = rank_projection(x2, a_cat.t(), 1.0, col_scale=col_scale, tune=config.autotune)
            if config.base_gemm == "merged":
                pass  # Y is done
            elif base_gemm_engine(config, default="cublas") == "cublas":
                # [Y_1 … Y_S] = P Bᵀ + b (Triton, one write), then += X Wᵀ (cuBLAS, β = 1)
                lora_gemm(y, [(p, b_diag.t())], bias=bias_cat, config=config)
                y.addmm_(x2, weight_cat.t())
            else:
                # [Y_1 … Y_S] = X Wᵀ + b + P Bᵀ (block-diagonal B, rank range per tile)
                lora_gemm(y, [(x2, weight_cat.t())], low=p, rt=b_diag.t(), bias=bias_cat,
                          rank_lo=rank_lo, rank_hi=rank_hi, config=config)
        else:
            y = torch.empty((M, N), device=x.device, dtype=cdt)
            p = torch.empty((M, 0), device=x.device, dtype=cdt)
            lora_gemm(y, [(x2, weight_cat.t())], bias=bias_cat, config=config)

        ctx.save_for_backward(x2, p, weight_cat, *lora_params)
        ctx.splits, ctx.ranks, ctx.scalings = list(splits), list(ranks), list(scalings)
        ctx.n_off, ctx.r_off = n_off, r_off
        ctx.x_shape = x.shape
        ctx.config = config
        ctx.has_bias = bias_cat is not None
        lead = x.shape[:-1]
        return tuple(y[:, n_off[i]:n_off[i + 1]].reshape(*lead, splits[i]) for i in range(len(splits)))

    @staticmethod
    def backward(ctx, *grads):
        x2, p, weight_cat, *lora_params = ctx.saved_tensors
        splits, ranks, scalings, n_off, r_off = ctx.splits, ctx.ranks, ctx.scalings, ctx.n_off, ctx.r_off
        config = ctx.config
        K = x2.shape[1]
        M = x2.shape[0]
        cdt = x2.dtype
        R = r_off[-1]
        lora_segments = [i for i, r in enumerate(ranks) if r > 0]
        dys = [None if g is None else g.reshape(-1, splits[i]).to(cdt) for i, g in enumerate(grads)]
        lora_grads = [None] * len(lora_params)
        need_x = ctx.needs_input_grad[0]
        need_lora = any(ctx.needs_input_grad[_FIRST_LORA:])
        if engine_for(M, K, weight_cat.shape[0], x2.device, config, backward=True) == "cublas":
            return _cublas_backward(ctx, x2, p, weight_cat, lora_params, dys, need_x)

        merged_gemm = config.base_gemm == "merged" and R > 0
        dx = None
        if merged_gemm and need_x:
            # dX = Σ_i dY_i (W_i + s_i·B_i A_i), the weight merged again (never kept). It needs no Q, so it is
            # launched first and the rank-r passes below, for dA and dB alone, are prepared while it runs
            wm = _merged_weight_cat(weight_cat, n_off, ranks, scalings,
                                    [lora_params[2 * j].to(cdt) for j in range(len(lora_segments))],
                                    [lora_params[2 * j + 1].to(cdt) for j in range(len(lora_segments))])
            with_grad = [i for i in range(len(splits)) if dys[i] is not None]
            if not with_grad:
                dx = torch.zeros((M, K), device=x2.device, dtype=cdt)
            else:
                dx = torch.mm(dys[with_grad[0]], wm[n_off[with_grad[0]]:n_off[with_grad[0] + 1]])
                for i in with_grad[1:]:
                    dx.addmm_(dys[i], wm[n_off[i]:n_off[i + 1]])
            dx = dx.reshape(ctx.x_shape)
            need_x = False

        q = None
        lora_work = R > 0 and (need_x or need_lora)
        if lora_work:
            missing = any(dys[i] is None for i in lora_segments)
            q = (torch.zeros if missing else torch.empty)((M, R), device=x2.device, dtype=cdt)
            for j, i in enumerate(lora_segments):
                if dys[i] is not None:
                    # Q_i = s_i · dY_i B_i, written into its columns of Q
                    rank_projection(dys[i], lora_params[2 * j + 1].to(cdt), scalings[i],
                                    out=q[:, r_off[i]:r_off[i + 1]], tune=config.autotune)

        def low_rank_grads():
            for j, i in enumerate(lora_segments):
                if dys[i] is not None and ctx.needs_input_grad[_FIRST_LORA + 2 * j + 1]:
                    # dB_i = dY_iᵀ P_i
                    p_i = p[:, r_off[i]:r_off[i + 1]]
                    lora_grads[2 * j + 1] = rank_reduction(p_i, dys[i], tune=config.autotune).t().to(
                        lora_params[2 * j + 1].dtype)
            if any(ctx.needs_input_grad[_FIRST_LORA + 2 * j] for j in range(len(lora_segments))):
                # dA = Qᵀ X: one pass over X for all adapters
                da = rank_reduction(q, x2, tune=config.autotune)
                for j, i in enumerate(lora_segments):
                    if ctx.needs_input_grad[_FIRST_LORA + 2 * j]:
                        lora_grads[2 * j] = da[r_off[i]:r_off[i + 1]].to(lora_params[2 * j].dtype)

        # the memory-bound reductions may run on a side stream next to the dX GEMM (config.overlap; by default
        # when the dX GEMM is cuBLAS's, the pairing the benchmarks favoured)
        base = base_gemm_engine(config, default="cublas")
        side = (side_stream(x2.device, config, default=base == "cublas")
                if (lora_work and need_x and need_lora) else None)
        if side is not None:
            main = torch.cuda.current_stream(x2.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                low_rank_grads()
        elif lora_work:
            low_rank_grads()
        if need_x:
            segs = [(dys[i], weight_cat[n_off[i]:n_off[i + 1]]) for i in range(len(splits)) if dys[i] is not None]
            dx = torch.empty((M, K), device=x2.device, dtype=cdt)
            a_cat = torch.cat([lora_params[2 * j].to(cdt) for j in range(len(lora_segments))], 0) \
                if R > 0 else None
            # base_gemm='cublas': narrow segments (N_i ≤ 256) and Q A in one Triton pass writing dX,
            # then cuBLAS adds each wide dY_i W_i onto it (β = 1)
            wide = [sg for sg in segs if sg[0].shape[1] > _NARROW_SEGMENT]
            fill = [sg for sg in segs if sg[0].shape[1] <= _NARROW_SEGMENT] + ([(q, a_cat)] if R > 0 else [])
            if not segs:
                dx.zero_()
            elif base == "cublas" and wide and len(fill) <= MAX_SEGMENTS:
                if fill:
                    lora_gemm(dx, fill, config=config)
                else:
                    torch.mm(*wide[0], out=dx)
                    wide = wide[1:]
                for dy_i, w_i in wide:
                    dx.addmm_(dy_i, w_i)
            else:
                # dX = Σ_i dY_i W_i + Q A: every dY_i in one GEMM (chunks of four segments per launch)
                first = True
                for c in range(0, len(segs), 4):
                    chunk = segs[c:c + 4]
                    target = dx if first else torch.empty_like(dx)
                    lora_gemm(target, chunk, low=q if first else None, rt=a_cat if first else None,
                              config=config)
                    if not first:
                        dx += target
                    first = False
            dx = dx.reshape(ctx.x_shape)
        if side is not None:
            join_side_stream(side, main, *lora_grads)
        for j, i in enumerate(lora_segments):  # a segment whose output got no gradient: zero LoRA grads
            if dys[i] is None:
                if ctx.needs_input_grad[_FIRST_LORA + 2 * j] and lora_grads[2 * j] is None:
                    lora_grads[2 * j] = torch.zeros_like(lora_params[2 * j])
                if ctx.needs_input_grad[_FIRST_LORA + 2 * j + 1]:
                    lora_grads[2 * j + 1] = torch.zeros_like(lora_params[2 * j + 1])
        dbias = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            raise RuntimeError("fused_shared_input_lora: the concatenated bias must be frozen")
        return (dx, None, dbias, None, None, None, None, *lora_grads)


def _cublas_backward(ctx, x2, p, weight_cat, lora_params, dys, need_x):
    """The backward's formulas as cuBLAS calls (small GEMMs; see :func:`.dispatch.engine_for`)."""
    splits, ranks, scalings, n_off, r_off = ctx.splits, ctx.ranks, ctx.scalings, ctx.n_off, ctx.r_off
    M, K = x2.shape
    cdt = x2.dtype
    R = r_off[-1]
    lora_segments = [i for i, r in enumerate(ranks) if r > 0]
    lora_grads = [None] * len(lora_params)
    q = None
    if R > 0:
        # Q_i = s_i · dY_i B_i   (zero where Y_i got no gradient)
        q = torch.cat([torch.mm(dys[i], lora_params[2 * j + 1].to(cdt)).mul_(scalings[i]) if dys[i] is not None
                       else torch.zeros((M, ranks[i]), device=x2.device, dtype=cdt)
                       for j, i in enumerate(lora_segments)], 1)
        if any(ctx.needs_input_grad[_FIRST_LORA + 2 * j] for j in range(len(lora_segments))):
            da = _wide_mm(q.t(), x2)  # dA = Qᵀ X, every adapter at once (linear._wide_mm: its note)
        for j, i in enumerate(lora_segments):
            if ctx.needs_input_grad[_FIRST_LORA + 2 * j]:
                lora_grads[2 * j] = da[r_off[i]:r_off[i + 1]].to(lora_params[2 * j].dtype)
            if ctx.needs_input_grad[_FIRST_LORA + 2 * j + 1]:
                # dB_i = dY_iᵀ P_i
                lora_grads[2 * j + 1] = (_wide_mm(dys[i].t(), p[:, r_off[i]:r_off[i + 1]]).to(
                    lora_params[2 * j + 1].dtype) if dys[i] is not None else torch.zeros_like(lora_params[2 * j + 1]))
    dx = None
    if need_x:
        # dX = Σ_i dY_i W_i + Q A
        terms = [(dys[i], weight_cat[n_off[i]:n_off[i + 1]]) for i in range(len(splits)) if dys[i] is not None]
        if R > 0:
            terms.append((q, torch.cat([lora_params[2 * j].to(cdt) for j in range(len(lora_segments))], 0)))
        if not terms:
            dx = torch.zeros((M, K), device=x2.device, dtype=cdt)
        else:
            dx = torch.mm(*terms[0])
            for left, right in terms[1:]:
                dx.addmm_(left, right)
        dx = dx.reshape(ctx.x_shape)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        raise RuntimeError("fused_shared_input_lora: the concatenated bias must be frozen")
    return (dx, None, None, None, None, None, None, *lora_grads)


def fused_shared_input_lora(x: torch.Tensor, weight_cat: torch.Tensor, bias_cat: torch.Tensor | None,
                            splits: Sequence[int], lora_As: Sequence[torch.Tensor | None],
                            lora_Bs: Sequence[torch.Tensor | None], scalings: Sequence[float],
                            config: KernelConfig | None = None):
    """Outputs ``(Y_1, …, Y_S)`` of S LoRA projections of the same ``x``, fused.

    ``weight_cat`` is the frozen ``[W_1; …; W_S]`` (Σ N_i × K) and ``bias_cat`` the frozen concatenated bias
    (or None); segment i has ``splits[i]`` output features, LoRA factors ``lora_As[i]`` (r_i×K) and
    ``lora_Bs[i]`` (N_i×r_i), or None for both when it is a plain frozen linear, and scale ``scalings[i]``.
    Each Y_i is a view into one (M × Σ N_i) output buffer. ``config``: kernel settings (None: the defaults).
    """
    S = len(splits)
    if not (len(lora_As) == len(lora_Bs) == len(scalings) == S) or S == 0:
        raise ValueError("fused_shared_input_lora: splits, lora_As, lora_Bs and scalings need one entry per segment")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"fused_shared_input_lora: input dtype {x.dtype} not supported (bf16, fp16, fp32)")
    if weight_cat.dim() != 2 or weight_cat.shape[0] != sum(splits):
        raise ValueError(f"fused_shared_input_lora: weight_cat must have Σ splits = {sum(splits)} rows, "
                         f"got shape {tuple(weight_cat.shape)}")
    K = weight_cat.shape[1]
    if x.shape[-1] != K:
        raise ValueError(f"fused_shared_input_lora: input's last dimension {x.shape[-1]} != in_features {K}")
    if weight_cat.dtype != x.dtype:
        raise TypeError(f"fused_shared_input_lora: weight dtype {weight_cat.dtype} != input dtype {x.dtype}")
    if weight_cat.requires_grad or (bias_cat is not None and bias_cat.requires_grad):
        raise ValueError("fused_shared_input_lora: the base weights (and bias) must be frozen")
    if bias_cat is not None and bias_cat.shape != (sum(splits),):
        raise ValueError(f"fused_shared_input_lora: bias_cat must have shape ({sum(splits)},)")
    for t, what in ((weight_cat, "weight_cat"), (bias_cat, "bias_cat")):
        if t is not None and t.device != x.device:
            raise ValueError(f"fused_shared_input_lora: {what} is on {t.device} but the input is on {x.device}")
    ranks, params = [], []
    for i, (a, b) in enumerate(zip(lora_As, lora_Bs)):
        if (a is None) != (b is None):
            raise ValueError(f"fused_shared_input_lora: segment {i} has only one of lora_A / lora_B")
        if a is None:
            ranks.append(0)
            continue
        r = a.shape[0]
        if a.dim() != 2 or a.shape[1] != K or b.shape != (splits[i], r):
            raise ValueError(f"fused_shared_input_lora: segment {i}: lora_A must be r×{K} and lora_B "
                             f"{splits[i]}×r, got {tuple(a.shape)} and {tuple(b.shape)}")
        if a.device != x.device or b.device != x.device:
            raise ValueError(f"fused_shared_input_lora: segment {i}'s LoRA factors are not on {x.device}")
        ranks.append(r)
        params += [a, b]
    check_kernel_device(x, "the input")
    check_interpreter_dtype(x, op="fused_shared_input_lora")
    return SharedInputLoRAFunction.apply(x, weight_cat, bias_cat, tuple(int(n) for n in splits), tuple(ranks),
                                         tuple(float(s) for s in scalings), resolve_config(config), *params)


def shared_input_lora_reference(x, weights, biases, lora_As, lora_Bs, scalings, dtype=torch.float32):
    """Plain torch, each projection on its own, in ``dtype``: Y_i = X W_iᵀ + b_i + s_i (X A_iᵀ) B_iᵀ."""
    xr = x.to(dtype)
    outs = []
    for w, b, a, lb, s in zip(weights, biases, lora_As, lora_Bs, scalings):
        y = xr @ w.to(dtype).t()
        if b is not None:
            y = y + b.to(dtype)
        if a is not None:
            y = y + s * ((xr @ a.to(dtype).t()) @ lb.to(dtype).t())
        outs.append(y)
    return outs

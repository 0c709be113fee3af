"""Go / no-go for the MoE LoRA speed target: the LoRA terms of frozen experts folded into CUTLASS's grouped GEMMs by
widening their K, against the grouped-GEMM engine as it is (``lora_lab.kernels.moe.engine``), side by side in one
process. No notebook reads it; nothing in the package uses the widened form yet.

Why. The engine's LoRA terms are four (S, N) tensors per call, each made by a rank-r grouped GEMM, written once and
read once by the next pass: s1 P1 B1ᵀ (S, 2I) and s2 P2 B2ᵀ (S, H) in forward, s2 Q2 A2 (S, I) and s1 Q1 A1 (S, H) in
backward. ``torch._grouped_mm`` has no epilogue to add them inside the base GEMM, but a GEMM over a K widened by r
computes base and term in one:

    [X | s1 P1] · [W1 | B1]ᵀ = X W1ᵀ + s1 P1 B1ᵀ            (forward gate/up; K = H + r)
    [h | s2 P2] · [W2 | B2]ᵀ = h W2ᵀ + s2 P2 B2ᵀ            (forward down;    K = I + r)
    [dOut | s2 Q2] · [W2 ; A2] = dOut W2 + s2 Q2 A2          (backward D;      K = H + r)
    [dGU | s1 Q1] · [W1 ; A1] = dGU W1 + s1 Q1 A1            (backward dX;     K = 2I + r)

Each weight lives in one buffer that serves both of its GEMMs through strided views (CUTLASS takes any leading
dimension that keeps 16-byte alignment): buf1 (E, 2I + r, H + r) = [[W1, B1], [A1, 0]] and buf2 (E, H + r, I + r) =
[[W2, B2], [A2, 0]]. In a real integration the frozen W would live in that buffer (the parameter a view of it), so
the form costs r (3I + 2H) + 2r² numbers per expert of memory, and the factors' copy into the margins each call (E r
(3I + 2H) numbers). Here the buffers are built once per cell from the weights (this tool does not measure memory).

What it times (fwd + bwd of one layer call with LoRA on both expert weights, a synchronised loop, host time in):
  engine      ``_GroupedMmExperts`` as notebook 06 runs it
  kaug        the widened form, correct: the activations [X | s1 P1], [dOut | s2 Q2] gathered straight into the
              wide buffers (``index_select(out=...)``), but SiLU·up's h and its backward's dGU copied into theirs,
              because those Triton passes write only their own (S, I) / (S, 2I) outputs today (one extra read and
              write of each: the price of not changing the package)
  kaug_model  the same calls with those two copies left out: numerically wrong (not checked), a timing model of the
              form once the two passes write into the wide buffers (their stores are the same either way)

On CPU it checks ``kaug`` against ``engine`` (fp32; every output and gradient; torch's _grouped_mm fallback, and the
engine's plain-torch twins or, with TRITON_INTERPRET=1, its Triton passes) and times nothing:

    python tools/moe_lora_kaug_bench.py --check              # CPU: the equivalence check on small odd shapes
    python tools/moe_lora_kaug_bench.py --out DIR            # GPU: the fine-grained LoRA cells of notebook 06
"""
from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

import torch

from lora_lab.experiments.fused_moe import LAYER_SHAPES, MoeLayerShape, random_routing
from lora_lab.kernels.moe.engine import (
    _GroupedMmExperts,
    _silu_backward,
    _sort_by_expert,
    _triton_runs,
    _unsort_sum,
    k_grouped_mm,
)
from lora_lab.kernels.moe.routing import refuse_second_backward
from lora_lab.kernels.moe.silu_backward import silu_mul
from lora_lab.lab import measure

FINE_GRAINED = ("qwen3_30b_a3b", "qwen1_5_moe_a2_7b", "olmoe_1b_7b", "deepseek_v2_lite")


def gmm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offsets)


class WideWeights:
    """buf1 (E, 2I + r, H + r) = [[W1, B1], [A1, 0]], buf2 (E, H + r, I + r) = [[W2, B2], [A2, 0]] (see the module
    docstring)."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, rank: int):
        num_experts, two_i, hidden = w1.shape
        inter = w2.shape[2]
        self.two_i, self.hidden, self.inter, self.rank = two_i, hidden, inter, rank
        self.buf1 = w1.new_zeros(num_experts, two_i + rank, hidden + rank)
        self.buf2 = w2.new_zeros(num_experts, hidden + rank, inter + rank)
        with torch.no_grad():
            self.buf1[:, :two_i, :hidden] = w1
            self.buf2[:, :hidden, :inter] = w2

    def scratch(self, name: str, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        """A zeroed (rows, cols) buffer made once and reused: ``kaug_model``'s wide buffers, whose left part no pass
        writes (so no memset or stale values enter its timing)."""
        buf = getattr(self, f"_{name}", None)
        if buf is None or buf.shape != (rows, cols):
            buf = like.new_zeros(rows, cols)
            setattr(self, f"_{name}", buf)
        return buf

    def load(self, a1, b1, a2, b2) -> None:
        """The factors' current values into the margins (once per call; gradients flow to the factors themselves)."""
        n1, h, i = self.two_i, self.hidden, self.inter
        with torch.no_grad():
            self.buf1[:, :n1, h:] = b1
            self.buf1[:, n1:, :h] = a1
            self.buf2[:, :h, i:] = b2
            self.buf2[:, h:, :i] = a2


class _WideLoRAExperts(torch.autograd.Function):
    """Frozen experts with LoRA on both weights, every LoRA term inside a K-widened grouped GEMM. Inputs: x, the
    routing, the :class:`WideWeights` (already loaded), the factors a1 (E, r, H), b1 (E, 2I, r), a2 (E, r, I),
    b2 (E, H, r) and their scales; ``model`` skips the two copies (module docstring: a timing model only)."""

    @staticmethod
    def forward(ctx, x, top_k_index, top_k_weights, wide, a1, b1, a2, b2, s1, s2, model):
        num_tokens, top_k = top_k_index.shape
        h_dim, i_dim, r = wide.hidden, wide.inter, wide.rank
        position, token, expert_offsets, weight, valid = _sort_by_expert(top_k_index, top_k_weights,
                                                                         wide.buf1.shape[0])
        offsets = expert_offsets[1:]
        rows = token.numel()
        xw = x.new_empty(rows, h_dim + r)  # [X | s1 P1]
        xs = torch.index_select(x, 0, token, out=xw[:, :h_dim])
        p1 = gmm(xs, a1.transpose(1, 2), offsets)  # (S, r)
        xw[:, h_dim:] = p1 * s1
        gu = gmm(xw, wide.buf1[:, :wide.two_i, :].transpose(1, 2), offsets)  # X W1ᵀ + s1 P1 B1ᵀ, (S, 2I)
        if _triton_runs(gu):
            h = silu_mul(gu, weight)
        else:
            g, u = gu.chunk(2, dim=-1)
            h = (torch.nn.functional.silu(g) * u * weight[:, None]).to(gu.dtype)
        if model:  # the timing model: h is not copied in (module docstring)
            hw = wide.scratch("hw", rows, i_dim + r, h)
        else:
            hw = h.new_empty(rows, i_dim + r)  # [h | s2 P2]
            hw[:, :i_dim] = h
        p2 = gmm(h, a2.transpose(1, 2), offsets)  # (S, r)
        hw[:, i_dim:] = p2 * s2
        del h
        y = gmm(hw, wide.buf2[:, :h_dim, :].transpose(1, 2), offsets)  # h W2ᵀ + s2 P2 B2ᵀ, (S, H)
        ctx.save_for_backward(gu, weight, position, token, expert_offsets, valid, a1, b1, a2, b2, p1, p2, xw)
        ctx.wide, ctx.shape, ctx.scales, ctx.model = wide, (num_tokens, top_k, top_k_weights.dtype), (s1, s2), model
        return _unsort_sum(y, position, num_tokens, top_k)

    @staticmethod
    def backward(ctx, grad_out):
        gu, weight, position, token, expert_offsets, valid, a1, b1, a2, b2, p1, p2, xw = ctx.saved_tensors
        refuse_second_backward(ctx, "the K-widened LoRA experts")
        wide, (s1, s2), model = ctx.wide, ctx.scales, ctx.model
        num_tokens, top_k, weights_dtype = ctx.shape
        h_dim, i_dim, r, n1 = wide.hidden, wide.inter, wide.rank, wide.two_i
        offsets = expert_offsets[1:]
        rows = token.numel()
        grad_out = grad_out.to(gu.dtype).contiguous()
        dw_ = grad_out.new_empty(rows, h_dim + r)  # [dOut | s2 Q2]
        dout = torch.index_select(grad_out, 0, token, out=dw_[:, :h_dim])
        q2 = gmm(dout, b2, offsets)  # (S, r)
        dw_[:, h_dim:] = q2 * s2
        d = gmm(dw_, wide.buf2[:, :, :i_dim], offsets)  # dOut W2 + s2 Q2 A2, (S, I)
        dgu, h, dw_sorted = _silu_backward(d, gu, weight, valid, compute_router_grad=True)
        del d
        db2 = k_grouped_mm(dout, p2, offsets, s2)  # (E, H, r)
        da2 = k_grouped_mm(q2, h, offsets, s2)  # (E, r, I)
        del h, dw_, dout, q2
        if model:  # the timing model: dGU is not copied in
            gw = wide.scratch("gw", rows, n1 + r, dgu)
        else:
            gw = dgu.new_empty(rows, n1 + r)  # [dGU | s1 Q1]
            gw[:, :n1] = dgu
        q1 = gmm(dgu, b1, offsets)  # (S, r)
        gw[:, n1:] = q1 * s1
        dx_rows = gmm(gw, wide.buf1[:, :, :h_dim], offsets)  # dGU W1 + s1 Q1 A1, (S, H)
        del gw
        dx = _unsort_sum(dx_rows, position, num_tokens, top_k)
        del dx_rows
        db1 = k_grouped_mm(dgu, p1, offsets, s1)  # (E, 2I, r)
        da1 = k_grouped_mm(q1, xw[:, :h_dim], offsets, s1)  # (E, r, H)
        d_weights = dw_sorted.index_select(0, position).view(num_tokens, top_k).to(weights_dtype)
        return dx, None, d_weights, None, da1, db1, da2, db2, None, None, None


def make_cell(shape: MoeLayerShape, tokens: int, rank: int, device, dtype, seed: int = 0):
    """(x, index, weights, w1, w2, factors [a1, b1, a2, b2], s1, s2, grad_out) for one LoRA cell, PEFT's init scale."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate

    def randn(*size, std=1.0):
        return (torch.randn(*size, generator=gen) * std).to(device=device, dtype=dtype)

    x = randn(tokens, h).requires_grad_(True)
    index, weights = random_routing(tokens, shape, device, dtype, seed=seed)
    w1, w2 = randn(e, 2 * i, h, std=0.02), randn(e, h, i, std=0.02)
    factors = [randn(e, rank, h, std=0.02), randn(e, 2 * i, rank, std=0.01), randn(e, rank, i, std=0.02),
               randn(e, h, rank, std=0.01)]
    for f in factors:
        f.requires_grad_(True)
    return x, index, weights, w1, w2, factors, 2.0, 2.0, randn(tokens, h)


def steps(cell, rank: int):
    """name -> a callable running fwd + bwd of one call and returning (out, grads of x, weights, a1, b1, a2, b2)."""
    x, index, weights, w1, w2, factors, s1, s2, grad_out = cell
    wide = WideWeights(w1, w2, rank)
    inputs = [x, weights, *factors]

    def engine():
        out = _GroupedMmExperts.apply(x, index, weights, w1, w2, *factors, s1, s2)
        return (out.detach(), *torch.autograd.grad(out, inputs, grad_out))

    def widened(model: bool):
        def run():
            wide.load(*factors)
            out = _WideLoRAExperts.apply(x, index, weights, wide, *factors, s1, s2, model)
            return (out.detach(), *torch.autograd.grad(out, inputs, grad_out))
        return run

    return {"engine": engine, "kaug": widened(False), "kaug_model": widened(True)}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def check(rank: int = 8, tokens: int = 37) -> list[str]:
    """fp32, CPU: kaug against the engine on small odd shapes (an empty expert included). Returns the failures."""
    failures = []
    names = ("out", "dx", "d_weights", "da1", "db1", "da2", "db2")
    for e, top_k, h, i in ((5, 2, 24, 40), (7, 3, 32, 56)):
        shape = MoeLayerShape("check", h, e, top_k, i, True, "qwen3_moe")
        cell = make_cell(shape, tokens, rank, "cpu", torch.float32, seed=e)
        index = cell[1]
        index[index == e - 1] = 0  # the last expert gets no rows
        run = steps(cell, rank)
        ref, got = run["engine"](), run["kaug"]()
        for name, a, b in zip(names, got, ref):
            err = rel_l2(a, b)
            status = "ok" if err <= 1e-5 else "FAIL"
            print(f"E={e} K={top_k} H={h} I={i} r={rank} T={tokens}: {name:10s} rel. L2 {err:.2e} {status}")
            if status != "ok":
                failures.append(f"{name} at E={e}: {err:.2e}")
    return failures


def timed(fns: dict, calls: int, reps: int) -> dict[str, list[float]]:
    """Per round, the median ms of ``calls`` calls of each callable, taken in turns as a user's loop pays them
    (:func:`lora_lab.lab.measure.interleaved_loop_ms`: events around each call, synchronised after it), the order
    rotated round by round (:func:`~lora_lab.lab.measure.rotation`)."""
    out = {name: [] for name in fns}
    for rep in range(reps):
        order = measure.rotation(list(fns), rep)
        times = measure.interleaved_loop_ms({name: fns[name] for name in order}, calls=calls, warmup=2)
        for name, each in times.items():
            out[name].append(statistics.median(each))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="CPU: kaug against the engine in fp32, no timing")
    ap.add_argument("--out", type=Path, help="folder for kaug.csv (GPU)")
    ap.add_argument("--shapes", nargs="+", default=list(FINE_GRAINED), choices=sorted(LAYER_SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--calls", type=int, default=10, help="timed calls per callable and round")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    if args.check:
        failures = check()
        raise SystemExit(f"kaug differs from the engine: {failures}" if failures else 0)
    if not torch.cuda.is_available():
        raise SystemExit("no GPU: timing needs CUDA (use --check for the CPU equivalence test)")
    if args.out is None:
        raise SystemExit("--out DIR is required for the timing run")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, rank {args.rank}, "
          f"{args.calls} calls x {args.reps} rounds, each call synchronised", flush=True)
    for shape in args.shapes:
        for tokens in args.tokens:
            cell = make_cell(LAYER_SHAPES[shape], tokens, args.rank, "cuda", torch.bfloat16)
            run = steps(cell, args.rank)
            ref, got = run["engine"](), run["kaug"]()
            errs = {n: rel_l2(a, b) for n, a, b in zip(("out", "dx", "dw", "da1", "db1", "da2", "db2"), got, ref)}
            times = timed(run, args.calls, args.reps)
            ratios = [e / k for e, k in zip(times["engine"], times["kaug"])]
            model = [e / k for e, k in zip(times["engine"], times["kaug_model"])]
            line = (f"{shape:18s} T={tokens:6d} engine {statistics.median(times['engine']):8.3f} ms  kaug "
                    f"{statistics.median(times['kaug']):8.3f} ms ({statistics.median(ratios):.3f}x, "
                    f"{min(ratios):.3f}-{max(ratios):.3f})  kaug_model {statistics.median(times['kaug_model']):8.3f}"
                    f" ms ({statistics.median(model):.3f}x)  worst rel. L2 vs engine {max(errs.values()):.1e}")
            print(line, flush=True)
            for rep in range(args.reps):
                rows.append(dict(shape=shape, tokens=tokens, rank=args.rank, rep=rep,
                                 **{f"{k}_ms": times[k][rep] for k in times},
                                 worst_rel_l2_vs_engine=max(errs.values())))
            del cell, run, ref, got
            torch.cuda.empty_cache()
    with open(args.out / "kaug.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out / 'kaug.csv'}")


if __name__ == "__main__":
    main()

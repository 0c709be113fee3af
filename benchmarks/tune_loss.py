"""Tile sizes of the fused linear cross-entropy: time each kernel with several configurations, on the GPU.

The forward kernel (log-sum-exp) and the gradient kernel are timed separately, at the issue's shapes, so that
the defaults of :class:`lora_lab.kernels.loss.LossKernelConfig` rest on a measurement. Every row also carries
cuBLAS's time for one [tokens x vocab x hidden] GEMM on the same operands, the yardstick: the forward kernel does
one such GEMM's work, the gradient kernel three (frozen head: two).

``--fwdgrad`` tunes the gradients-in-forward path instead (:mod:`lora_lab.kernels.loss.fwdgrad`): the softmax
pass alone on one [rows x V] logits chunk for each (ce_block_v, ce_warps), against the bytes it must move (read the
chunk twice, write it once) at the GPU's bandwidth; one chunk's dW GEMM into bf16, into fp32 and added into fp32
(the price of the fp32 accumulator); then the whole op (fwd + bwd) for each chunk size and dW accumulation mode, in
the user's loop (median of 10 synchronised calls) beside its kernel time, against its 3-GEMM (frozen: 2) cuBLAS
floor. Rows go to 07_loss_fwdgrad_tuning.csv.

Writes 07_loss_tuning.csv (one row per shape, head, kernel, configuration and repetition) into --out.

    python benchmarks/tune_loss.py --out DIR [--tokens 16384] [--repetitions 3] [--fwdgrad]
    TRITON_INTERPRET=1 python benchmarks/tune_loss.py --out DIR --smoke [--fwdgrad]
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch
from bench_common import check_device

from lora_lab.lab import measure

SHAPES = {"qwen2.5-0.5b": (896, 151_936), "llama3-8b": (4096, 128_256)}
FORWARD = [  # (block_m, block_v, block_k, warps, stages)
    (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (64, 256, 64, 4, 3),
    (256, 128, 64, 8, 3), (128, 128, 128, 8, 2), (128, 64, 64, 4, 4),
]
BACKWARD = [  # (block_m, block_v, block_k, block_d, warps, stages, accumulate)
    (128, 256, 64, 64, 8, 3, "tma"), (128, 256, 64, 64, 8, 3, "atomic"), (128, 256, 64, 128, 8, 3, "tma"),
    (128, 256, 64, 32, 8, 3, "tma"), (256, 128, 64, 64, 8, 3, "tma"), (128, 128, 64, 64, 8, 3, "tma"),
    (64, 256, 64, 64, 4, 3, "tma"), (128, 256, 64, 64, 8, 4, "tma"),
]
# (chunk_rows, slab_vocab, trainable_plan); None: the automatic sizes (N/32 rows, V/32 entries)
MEMORY_PLANS = [(None, None, "one_pass"), (None, None, "two_pass"), (2048, 16384, "one_pass"),
                (4096, 32768, "one_pass")]


FWDGRAD_SHAPES = {**SHAPES, "gemma2-2b": (2304, 256_000), "qwen2.5-14b": (5120, 152_064)}
SOFTMAX_PASS = [(1024, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16), (16384, 32)]  # (ce_block_v, ce_warps)
FWDGRAD_PLANS = [(2048, "auto"), (4096, "auto"), (8192, "auto"), (4096, "partial"),
                 (4096, "input_dtype")]  # (chunk rows, dw_accumulate)



def loss_inputs(tokens: int, d: int, vocab: int, device, dtype):
    """Seeded hidden states [tokens, d], a head [vocab, d] of scale 0.02 and labels: every sweep's inputs."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, d, generator=gen).to(device, dtype)
    w = (0.02 * torch.randn(vocab, d, generator=gen)).to(device, dtype)
    y = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    return h, w, y

def _softmax_pass_ms(z0, y, setting, timed) -> float:
    """ms of the softmax pass over the chunk ``z0`` with ``setting`` = (ce_block_v, ce_warps) (each call first
    restores the logits it overwrites; the copy's own time is subtracted)."""
    import triton

    from lora_lab.kernels.loss.kernels import logit_grad_kernel

    block_v, warps = setting
    rows, vocab = z0.shape
    z = torch.empty_like(z0)
    per_row = torch.empty(2, rows, dtype=torch.float32, device=z0.device)
    one = torch.ones(1, dtype=torch.float32, device=z0.device)

    def run():
        z.copy_(z0)
        logit_grad_kernel[(rows,)](z, z.stride(0), y, per_row[0], per_row[1], one, vocab, -100, 0.0, 0.0, 0.0,
                                   HAS_SOFTCAP=False, SMOOTHING=False, Z_LOSS=False, WRITE_GRAD=True,
                                   BLOCK_V=min(block_v, triton.next_power_of_2(vocab)), num_warps=warps)

    return timed(run) - timed(lambda: z.copy_(z0))


def _dw_gemm_rows(shape, g, h, rep, timed) -> list[dict]:
    """One chunk's dW GEMM G_cᵀ H_c three ways: into bf16 (what the floor's single GEMM writes), into fp32
    (``mm(out_dtype=float32)``: the first chunk), added into fp32 (``addmm(out_dtype=float32)``: every later
    chunk): the price of the fp32 C matrix per chunk."""
    acc = torch.empty(g.shape[1], h.shape[1], dtype=torch.float32, device=g.device)
    out16 = torch.empty(g.shape[1], h.shape[1], dtype=g.dtype, device=g.device)
    ways = {"bf16_out": lambda: torch.mm(g.T, h, out=out16),
            "fp32_out": lambda: torch.mm(g.T, h, out_dtype=torch.float32, out=acc),
            "fp32_accumulate": lambda: torch.addmm(acc, g.T, h, out_dtype=torch.float32, out=acc)}
    rows = []
    for name, fn in ways.items():
        try:
            ms, status = timed(fn), "ok"
        except Exception as exc:  # recorded, not fatal
            ms, status = float("nan"), f"{type(exc).__name__}: {str(exc)[:120]}"
        rows.append({"shape": shape, "tokens": g.shape[0], "head": "trainable", "kernel": "dw_chunk_gemm",
                     "config": name, "repetition": rep, "ms": ms, "floor_ms": float("nan"), "status": status})
        print(f"{shape} dW chunk GEMM {name}: {ms:.3f} ms {status}", flush=True)
    return rows


def _floor_ms(h, w, trainable, timed) -> float:
    """The cuBLAS GEMMs of the op: Z = H Wᵀ, dH = G W and (trainable) dW = Gᵀ H, G a random [N x V]."""
    g = torch.randn(h.shape[0], w.shape[0], dtype=h.dtype, device=h.device) * 1e-4
    total = timed(lambda: h @ w.T) + timed(lambda: g @ w)
    return total + (timed(lambda: g.T @ h) if trainable else 0.0)


def _fwdgrad_op_ms(h, w, y, trainable, cfg, timed) -> tuple[float, float]:
    """(the user's loop: median ms of 10 synchronised fwd + bwd calls; the kernel time of one call)."""
    import statistics

    from lora_lab.kernels.loss import linear_cross_entropy

    hg = h.detach().requires_grad_()
    wg = w.detach().requires_grad_(trainable)

    def step():
        hg.grad = wg.grad = None
        linear_cross_entropy(hg, wg, y, config=cfg).backward()

    return statistics.median(measure.loop_ms(step, calls=10, warmup=2)), timed(step)


def tune_fwdgrad(args, device, dtype, timed) -> list[dict]:
    """Rows of the gradients-in-forward sweep (see the module docstring)."""
    from lora_lab.kernels.loss import LossKernelConfig

    shapes = {"smoke": (32, 300)} if args.smoke else FWDGRAD_SHAPES
    tokens = 64 if args.smoke else args.tokens
    passes = [(64, 1)] if args.smoke else SOFTMAX_PASS
    plans = [(24, "partial"), (64, "partial")] if args.smoke else FWDGRAD_PLANS
    bandwidth = 4.8e12  # H200 HBM3e, bytes/s: the pass's yardstick
    out = []
    for shape, (d, vocab) in shapes.items():
        h, w, y = loss_inputs(tokens, d, vocab, device, dtype)
        chunk = min(tokens, 4096)
        z0 = h[:chunk] @ w.T
        moved_ms = 3 * z0.numel() * z0.element_size() / bandwidth * 1e3  # read twice, written once
        for rep in range(args.repetitions):
            for setting in passes:
                ms = _softmax_pass_ms(z0, y[:chunk], setting, timed)
                out.append({"shape": shape, "tokens": chunk, "head": "-", "kernel": "softmax_pass",
                            "config": str(setting), "repetition": rep, "ms": ms, "floor_ms": moved_ms,
                            "status": "ok"})
                print(f"{shape} softmax pass {chunk} rows {setting}: {ms:.3f} ms (its bytes at "
                      f"{bandwidth / 1e12:.1f} TB/s: {moved_ms:.3f} ms)", flush=True)
            if device.type == "cuda":  # one chunk's dW GEMM: bf16 out (the floor's), fp32 out, fp32 += (beta 1)
                out += _dw_gemm_rows(shape, z0, h[:chunk], rep, timed)
            for trainable in (False, True):
                head = "trainable" if trainable else "frozen"
                floor_ms = _floor_ms(h, w, trainable, timed)
                for plan in plans:
                    chunk_rows, dw_mode = plan
                    cfg = LossKernelConfig(impl="fwdgrad", fwdgrad_chunk_rows=chunk_rows, dw_accumulate=dw_mode,
                                           ce_block_v=64 if args.smoke else 4096)
                    try:
                        (ms, kernel), status = _fwdgrad_op_ms(h, w, y, trainable, cfg, timed), "ok"
                    except Exception as exc:  # a plan that does not fit or run is a recorded result
                        ms, kernel, status = float("nan"), float("nan"), f"{type(exc).__name__}: {str(exc)[:120]}"
                    out.append({"shape": shape, "tokens": tokens, "head": head, "kernel": "fwdgrad_op",
                                "config": str(plan), "repetition": rep, "ms": ms, "kernel_ms": kernel,
                                "floor_ms": floor_ms, "status": status})
                    print(f"{shape} fwdgrad {head} {plan}: {ms:.2f} ms in the user's loop, {kernel:.2f} ms kernel "
                          f"time (GEMM floor {floor_ms:.2f} ms) {status}", flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--skip-forward", action="store_true", help="time the gradient kernel only")
    ap.add_argument("--fwdgrad", action="store_true", help="tune the gradients-in-forward path instead")
    args = ap.parse_args()
    device = check_device(args.smoke)

    from lora_lab.kernels.loss import linear_ce as lce

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    shapes = {"smoke": (32, 300)} if args.smoke else SHAPES
    tokens = 64 if args.smoke else args.tokens
    forward = [(16, 32, 16, 1, 1)] if args.smoke else FORWARD
    backward = [(16, 32, 16, 16, 1, 1, "atomic")] if args.smoke else BACKWARD
    if args.skip_forward:
        forward = []
    plans = [(48, 96, "one_pass"), (48, 96, "two_pass")] if args.smoke else MEMORY_PLANS
    base = lce._config(None)

    def timed(fn):
        if device.type == "cuda":
            return measure.kernel_loop_ms(fn, warmup_ms=10, rep_ms=60)  # kernel time: picks a kernel config
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    if args.fwdgrad:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        measure.write_csv(tune_fwdgrad(args, device, dtype, timed), out / "07_loss_fwdgrad_tuning.csv")
        return
    rows = []
    for shape, (d, vocab) in shapes.items():
        h, w, y = loss_inputs(tokens, d, vocab, device, dtype)
        gemm_ms = timed(lambda h=h, w=w: h @ w.T) if device.type == "cuda" else float("nan")
        lse = lce._lse_and_target(h, w, y, None, False, base)[0]
        a = torch.full((tokens,), 1.0 / tokens, device=device)
        for rep in range(args.repetitions):
            for cfg_tuple in forward:
                bm, bv, bk, warps, stages = cfg_tuple
                cfg = base.replace(fwd_block_m=bm, fwd_block_v=bv, fwd_block_k=bk, fwd_warps=warps,
                                   fwd_stages=stages)
                ms = timed(lambda cfg=cfg, h=h, w=w, y=y: lce._lse_and_target(h, w, y, None, False, cfg))
                rows.append({"shape": shape, "tokens": tokens, "head": "-", "kernel": "forward",
                             "config": str(cfg_tuple), "plan": "-", "repetition": rep, "ms": ms, "gemm_ms": gemm_ms})
                print(f"{shape} forward {cfg_tuple}: {ms:.2f} ms (cuBLAS GEMM {gemm_ms:.2f} ms)", flush=True)
            for trainable in (False, True):
                head = "trainable" if trainable else "frozen"
                for cfg_tuple in backward:
                    for plan in (plans if cfg_tuple == backward[0] and trainable else plans[:1]):
                        bm, bv, bk, bd, warps, stages, acc = cfg_tuple
                        cfg = base.replace(bwd_block_m=bm, bwd_block_v=bv, bwd_block_k=bk, bwd_block_d=bd,
                                           bwd_warps=warps, bwd_stages=stages, accumulate=acc,
                                           chunk_rows=plan[0], slab_vocab=plan[1], trainable_plan=plan[2])
                        try:
                            ms = timed(lambda cfg=cfg, trainable=trainable, h=h, w=w, y=y, lse=lse, a=a: lce._gradients(
                                h, w, y, lse, a, a, None, True, trainable, None, cfg))
                            status = "ok"
                        except Exception as exc:  # a configuration that does not compile is a recorded result
                            ms, status = float("nan"), f"{type(exc).__name__}: {str(exc)[:120]}"
                        rows.append({"shape": shape, "tokens": tokens, "head": head, "kernel": "backward",
                                     "config": str(cfg_tuple), "plan": str(plan), "repetition": rep, "ms": ms,
                                     "gemm_ms": gemm_ms, "status": status})
                        print(f"{shape} backward {head} {cfg_tuple} plan {plan}: {ms:.2f} ms {status}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r.setdefault("status", "ok")
    measure.write_csv(rows, out / "07_loss_tuning.csv")
    print("defaults:", dataclasses.asdict(base))


if __name__ == "__main__":
    main()

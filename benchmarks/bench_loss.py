"""Benchmark: the LM-head loss block, cross_entropy(H W^T, y), forward + backward, every implementation side by side.

The block a causal-LM step ends with: hidden states H [N, d] (bf16), the head weight W [V, d], labels y [N] (int64,
about 1% ``ignore_index``), loss = mean_i (lse_i - z_{i,y_i}) over labelled rows with Z = H W^T. One call is the
forward and the backward: dL/dH always, dL/dW when the head is trainable (``--heads trainable``; ``frozen`` is the
LoRA case, W.requires_grad False). Inputs (the same for every method of a cell): H ~ N(0, 1), W ~ N(0, 0.02²),
drawn in bf16 from a seeded generator; labels uniform over the vocabulary, every 97th set to ``ignore_index``.

Methods (all by default; ``--methods`` picks some):
  torch_fp32            F.cross_entropy((H @ W.T).float(), y): bf16 logits, fp32 copy, fp32 log-softmax (transformers)
  torch_bf16            F.cross_entropy(H @ W.T, y) on the bf16 logits
  chunked               lora_lab.loss.chunked_cross_entropy (1024 rows at a time, logits recomputed in backward)
  lora_lab              lora_lab.kernels.loss.linear_cross_entropy (the fused op), its default LossKernelConfig: the
                        dispatch rule (choose_impl) picks the path
  lora_lab_fwdgrad      the same, impl="fwdgrad" forced: gradients in forward, cuBLAS GEMMs on row chunks, one Triton
                        softmax-gradient pass per chunk; backward only scales the saved gradients
  lora_lab_fwdgrad_lowmem  lora_lab_fwdgrad with dw_accumulate="input_dtype" (a trainable head's dW accumulated in
                        bf16 by cuBLAS, no fp32 buffer: the memory-capped setting)
  lora_lab_fwdgrad_r256, lora_lab_fwdgrad_r1024  lora_lab_fwdgrad with fwdgrad_chunk_rows 256 or 1024 (opt-in): the
                        logits chunk, the path's largest buffer, 16x or 4x smaller than the default 4,096 rows, for
                        the time it costs (target: extra peak at most Liger's, whose chunks are 128-512 rows here)
  lora_lab_fwdgrad_r4096  the same with 4,096-row chunks for a frozen head too (opt-in; the default gives a frozen
                        head 1,024): whether the frozen small-d head's dH GEMM, [rows, V] x [V, d] with few output
                        tiles at 1,024 rows, is what keeps it at 1.37x its floor in notebook 07
  lora_lab_recompute    the same, impl="recompute" forced: the Triton kernels that never hold a logit (4 GEMM-sized
                        loops trainable, 3 frozen)
  lora_lab_two_pass     the same with trainable_plan="two_pass" (dH, then dW: logits recomputed once more, small
                        buffers); trainable head only (the plan changes nothing for a frozen one: skipped there)
  liger                 liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss() with its defaults: gradients
                        computed in the forward, chunk by chunk; dW accumulated in W's dtype (accum_dtype=None)
  cce                   cut_cross_entropy.linear_cross_entropy with its defaults: impl="cce", filter_eps="high"
                        (backward skips logit blocks whose |softmax - onehot| < bf16 eps / 32, vocabulary sorted
                        by mean logit first: an approximation of the gradient)
  cce_exact             the same with filter_eps=None: no gradient filtering, no sorting
  gemm_floor            not a loss: the op's own GEMMs at cuBLAS speed, outputs preallocated: Z = H W^T,
                        dH = G W and (trainable head) dW = G^T H, G a random bf16 [N, V] -- 3 GEMMs (frozen: 2)
  gemm_floor_recompute  the same plus one more Z = H W^T: the GEMMs of a fused op that stores no logits and
                        recomputes them in backward -- 4 GEMMs (frozen: 3)

Cells: shapes qwen2.5-0.5b (d 896, V 151936), gemma2-2b (d 2304, V 256000), llama3-8b (d 4096, V 128256) and
qwen2.5-14b (d 5120, V 152064) x tokens N in {4096, 16384, 65536} x head {trainable, frozen} (notebook 07's panel).
A method whose [N x V] buffers cannot fit the GPU (torch_fp32: about 5 N V bf16-sized buffers, torch_bf16: 3) gets
"oom" rows without being tried (under a GPU memory cap, ``$LORA_LAB_MEMORY_CAP_GIB``: cannot fit the cap); ``--quick``
runs the llama3-8b head at 16,384 tokens only, with the panel's methods.

Per cell and method:
  ms          milliseconds per call (CUDA events, ``measure.event_ms``): the median of the calls of one repetition.
              The number of calls fills about ``--call-budget-ms`` (at most ``--max-calls``, at least 1), set once
              per cell and method from a probe call in the first repetition. The first repetition starts with an
              untimed call (compile / autotune); later ones do so only for a method whose extra peak is >= 1 GiB
              (that call takes its large blocks from the allocator, so the timed ones find them cached: memory is
              not handed back to CUDA between methods, except after a failure and between cells).
  tflops      useful FLOP/s: 2 N V d per GEMM of the loss's own (3 trainable, 2 frozen), the same count for every
              method (a method that recomputes logits does more work than it is credited with).
  peak        extra peak memory of one call above what was allocated before it (inputs, weights; the gradients
              are not allocated yet): ``measure.peak_bytes``, once, in the first repetition; not for the GEMM
              floors (their buffers are preallocated).
  grad floor  the bytes of the gradients the call must return: dH (N d, bf16) plus dW (V d) when trainable;
              peak_vs_floor = peak / floor (1.0: nothing but the gradients).
  errors      in the first repetition, of the untimed call's results, in cells of at most ``--check-tokens`` tokens
              (the fp32 reference costs more than every method together at the large cells): the relative error
              of the loss and the relative L2 errors of dH and dW against an fp32 reference computed at the start
              of the cell (the same bf16 inputs upcast, fp32 GEMMs without TF32, chunked_cross_entropy); and
              loss_vs_torch_fp32, the loss's relative difference from torch_fp32's where that fits in memory.
Repetitions: ``--repetitions N`` independent side-by-side loops over the methods per cell, the order rotated by one
each time (``measure.rotation``). A method that runs out of memory (torch.OutOfMemoryError) gets rows with status
"oom" and is not retried in later repetitions; a method that cannot run here (not installed, needs CUDA) gets rows
with status "skipped" and the reason; any other failure is recorded as "error" (the traceback goes to stderr).

Writes into --out: 07_loss_block.csv (one row per shape, tokens, head, method and repetition),
07_loss_block_summary.csv (median and 95% bootstrap interval of ms per call; per-repetition time ratios to the
fastest baseline of the cell and to the GEMM floors), 07_loss_time.png and 07_loss_memory.png.

    python benchmarks/bench_loss.py --out DIR [--shapes ...] [--tokens ...] [--heads ...] [--methods ...]
    TRITON_INTERPRET=1 python benchmarks/bench_loss.py --out DIR --smoke
"""
from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_common import (
    add_ledger_argument,
    check_device,
    device_line,
    failed_cell,
    repetition_dots,
    write_summary,
)

from lora_lab.lab import measure
from lora_lab.memory import budget

CSV, SUMMARY_CSV = "07_loss_block.csv", "07_loss_block_summary.csv"
TIME_PNG, MEMORY_PNG = "07_loss_time.png", "07_loss_memory.png"
GIB = 2**30
IGNORE_INDEX = -100
IGNORE_EVERY = 97  # labels[::97] = ignore_index: about 1% of the rows carry no target
WARMUP_PEAK_BYTES = GIB  # after the first repetition, an untimed call precedes the timed ones above this peak
W_STD = 0.02
SHAPES = {"qwen2.5-0.5b": (896, 151936), "gemma2-2b": (2304, 256000), "llama3-8b": (4096, 128256),
          "qwen2.5-14b": (5120, 152064)}  # name: (hidden d, vocab V)
# tiny stand-ins under the same names; no size a multiple of the interpreter's tiles (16 / 32), so masks are used
SMOKE_SHAPES = {"qwen2.5-0.5b": (20, 100), "gemma2-2b": (24, 130), "llama3-8b": (40, 72), "qwen2.5-14b": (44, 90)}
TOKENS, SMOKE_TOKENS = [4096, 16384, 65536], [24]
HEADS = ["trainable", "frozen"]
BASELINES = ["torch_fp32", "torch_bf16", "chunked", "liger", "cce", "cce_exact"]
FLOORS = ["gemm_floor", "gemm_floor_recompute"]
CHUNK_ROWS = {"lora_lab_fwdgrad_r256": 256, "lora_lab_fwdgrad_r1024": 1024,  # opt-in: the fwdgrad chunk's rows
              "lora_lab_fwdgrad_r4096": 4096}
METHODS = ["torch_fp32", "torch_bf16", "chunked", "lora_lab", "lora_lab_fwdgrad", "lora_lab_fwdgrad_lowmem",
           *CHUNK_ROWS, "lora_lab_recompute", "lora_lab_two_pass", "liger", "cce", "cce_exact", *FLOORS]
# the panel: ours (both paths), torch bf16, Liger, CCE, the 3-GEMM (2 frozen) floor
PANEL_METHODS = ["lora_lab_fwdgrad", "lora_lab_recompute", "torch_bf16", "liger", "cce", "gemm_floor"]
OURS = ("lora_lab", "lora_lab_fwdgrad", "lora_lab_fwdgrad_lowmem", *CHUNK_ROWS, "lora_lab_recompute",
        "lora_lab_two_pass")
LOGIT_BUFFERS = {"torch_fp32": 5, "torch_bf16": 3}  # [N x V] bf16-sized buffers alive at the standard paths' peak
TRAINABLE_ONLY = {"lora_lab_two_pass": "the plan only changes a trainable head's backward (frozen: same as lora_lab)",
                  "lora_lab_fwdgrad_lowmem": "dW's accumulation only matters for a trainable head (frozen: same as "
                                             "lora_lab_fwdgrad)"}
EXPECTED_VERSIONS = {"liger-kernel": "0.8.5", "cut-cross-entropy": "25.1.1"}


class Unavailable(Exception):
    """A method that cannot run here (not installed, needs CUDA): its rows are recorded as skipped."""


# ---------------------------------------------------------------------------------------------------------------
# The methods: each is (loss_fn(h, w, y) -> scalar loss, mode, version); a GEMM floor has no loss_fn
# ---------------------------------------------------------------------------------------------------------------

def _torch_fp32(h, w, y):
    # transformers' path: Z = H W^T in bf16, an fp32 copy, cross_entropy in fp32
    return F.cross_entropy((h @ w.T).float(), y, ignore_index=IGNORE_INDEX)


def _torch_bf16(h, w, y):
    return F.cross_entropy(h @ w.T, y, ignore_index=IGNORE_INDEX)


def _package_version(name: str) -> str:
    version = metadata.version(name)
    expected = EXPECTED_VERSIONS.get(name)
    if expected and version != expected:
        print(f"warning: {name} {version} is installed; this benchmark was written for {expected}", flush=True)
    return version


def resolve(method: str, device: torch.device):
    """(loss_fn or None for a GEMM floor, mode: what runs, version); raises Unavailable."""
    if method == "torch_fp32":
        return _torch_fp32, "F.cross_entropy((h @ w.T).float(), y)", torch.__version__
    if method == "torch_bf16":
        return _torch_bf16, "F.cross_entropy(h @ w.T, y): logits in the input dtype", torch.__version__
    if method == "chunked":
        from lora_lab.loss import DEFAULT_CHUNK_SIZE, chunked_cross_entropy

        def chunked(h, w, y):
            return chunked_cross_entropy(h, w, y, ignore_index=IGNORE_INDEX)

        return chunked, f"lora_lab.loss.chunked_cross_entropy(chunk_size={DEFAULT_CHUNK_SIZE})", ""
    if method in OURS:
        try:
            from lora_lab.kernels.loss import linear_ce, linear_cross_entropy
        except ImportError as exc:
            raise Unavailable(f"lora_lab.kernels.loss is not importable ({exc})") from None
        # the settings the op uses when given none (the interpreter's small tiles on a CPU), with the plan changed
        config = linear_ce._config(None)
        if method == "lora_lab_two_pass":
            config = config.replace(trainable_plan="two_pass", impl="recompute")
        elif method == "lora_lab_fwdgrad":
            config = config.replace(impl="fwdgrad")
        elif method == "lora_lab_fwdgrad_lowmem":
            config = config.replace(impl="fwdgrad", dw_accumulate="input_dtype")
        elif method in CHUNK_ROWS:
            config = config.replace(impl="fwdgrad", fwdgrad_chunk_rows=CHUNK_ROWS[method])
        elif method == "lora_lab_recompute":
            config = config.replace(impl="recompute")

        def fused(h, w, y):
            return linear_cross_entropy(h, w, y, ignore_index=IGNORE_INDEX, config=config)

        return fused, f"linear_cross_entropy(config={config!r})", ""
    if method == "liger":
        if device.type != "cuda":
            raise Unavailable("Liger's kernels need CUDA (smoke run on the CPU)")
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        except ImportError as exc:
            raise Unavailable(f"liger-kernel is not installed ({exc})") from None
        liger_loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)

        def liger(h, w, y):
            return liger_loss(w, h, y)  # Liger takes the weight first

        return (liger, "LigerFusedLinearCrossEntropyLoss(): defaults, accum_dtype=None (dW accumulated in W's dtype), "
                "grads computed in forward", _package_version("liger-kernel"))
    if method in ("cce", "cce_exact"):
        if device.type != "cuda":
            raise Unavailable("CCE's kernels need CUDA (smoke run on the CPU)")
        try:
            from cut_cross_entropy import linear_cross_entropy as cce_linear_cross_entropy
        except ImportError as exc:
            raise Unavailable(f"cut-cross-entropy is not installed ({exc})") from None
        filter_eps = "high" if method == "cce" else None  # "high" is the package's default

        def cce(h, w, y):
            return cce_linear_cross_entropy(h, w, y, ignore_index=IGNORE_INDEX, impl="cce", filter_eps=filter_eps)

        mode = ("impl='cce', filter_eps='high' (default: gradient filtering below bf16 eps/32, vocabulary sorted)"
                if method == "cce" else "impl='cce', filter_eps=None (no gradient filtering)")
        return cce, mode, _package_version("cut-cross-entropy")
    if method in FLOORS:
        extra = " + 1 logits recompute" if method == "gemm_floor_recompute" else ""
        return None, f"cuBLAS torch.mm, preallocated outputs: Z=HW^T, dH=GW, dW=G^TH (trainable){extra}", ""
    raise ValueError(f"unknown method {method!r}")


def gemm_count(method: str, trainable: bool) -> int:
    """GEMMs a method's floor runs: Z, dH (+ dW when trainable) (+ a recomputed Z)."""
    return 2 + int(trainable) + int(method == "gemm_floor_recompute")


def make_step(method, loss_fn, h, w, y, trainable: bool, generator):
    """A no-argument call: one forward + backward of ``method`` (grads reset first), returning the loss or None."""
    if loss_fn is None:  # a GEMM floor: the GEMMs alone, into preallocated buffers
        n, vocab = h.shape[0], w.shape[0]
        hd, wd = h.detach(), w.detach()
        logits = torch.empty(n, vocab, dtype=h.dtype, device=h.device)
        # G stands in for dL/dZ: random, since all-zero operands make a GEMM run faster than real data does
        grad_logits = torch.randn(n, vocab, dtype=h.dtype, device=h.device, generator=generator).mul_(1e-4)
        dh = torch.empty_like(hd)
        dw = torch.empty_like(wd) if trainable else None
        recompute = method == "gemm_floor_recompute"

        @torch.no_grad()
        def floor_step():
            torch.mm(hd, wd.t(), out=logits)           # forward:   Z  = H W^T   [N, V]
            if recompute:
                torch.mm(hd, wd.t(), out=logits)       # backward:  Z  = H W^T again (logits not stored)
            torch.mm(grad_logits, wd, out=dh)          # backward:  dH = G W     [N, d]
            if dw is not None:
                torch.mm(grad_logits.t(), hd, out=dw)  # backward:  dW = G^T H   [V, d]
            return None

        return floor_step

    params = [h, w] if trainable else [h]

    def step():
        for p in params:
            p.grad = None
        loss = loss_fn(h, w, y)
        loss.backward()
        return loss.detach()

    return step


# ---------------------------------------------------------------------------------------------------------------
# One cell
# ---------------------------------------------------------------------------------------------------------------

def make_inputs(hidden: int, vocab: int, tokens: int, device, dtype, seed: int):
    """H [N, d] ~ N(0, 1), W [V, d] ~ N(0, 0.02²) (both drawn in ``dtype``), labels [N] with ignore_index rows."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(vocab, hidden, device=device, dtype=dtype, generator=g).mul_(W_STD)
    h = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=g)
    y = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    y[::IGNORE_EVERY] = IGNORE_INDEX
    return h, w, y, g


def rel_l2(x: torch.Tensor, ref: torch.Tensor, rows: int = 8192) -> float:
    """||x - ref|| / ||ref|| in fp32, ``rows`` rows at a time (no fp32 copy of a whole [V, d] gradient)."""
    num = den = 0.0
    for start in range(0, ref.shape[0], rows):
        a, b = x[start:start + rows].float(), ref[start:start + rows].float()
        num += float((a - b).square().sum())
        den += float(b.square().sum())
    return math.sqrt(num / den) if den > 0 else float("nan")


def free_memory(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reference(h, w, y, trainable: bool):
    """(loss, dH, dW or None) in fp32 throughout, from the same (bf16) inputs: chunked_cross_entropy on fp32 copies,
    fp32 GEMMs (no TF32). The yardstick of every method's errors, torch_fp32's included (which rounds the logits
    to bf16 before its fp32 softmax)."""
    from lora_lab.loss import chunked_cross_entropy

    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        hf = h.detach().float().requires_grad_(True)
        wf = w.detach().float().requires_grad_(trainable)
        loss = chunked_cross_entropy(hf, wf, y, ignore_index=IGNORE_INDEX)
        loss.backward()
    finally:
        torch.set_float32_matmul_precision(precision)
    return float(loss.detach()), hf.grad, wf.grad if trainable else None


def memory_limit(device) -> tuple[int | None, str]:
    """(bytes a method's [N x V] buffers must fit, whose limit that is in words): the GPU's memory, or the memory
    cap's where one is set ($LORA_LAB_MEMORY_CAP_GIB, the capped gpu profiles); (None, "") off CUDA."""
    if device.type != "cuda":
        return None, ""
    return budget.capacity_bytes(device), "the memory cap's" if budget.memory_cap_gib() is not None else "the GPU's"


def bench_cell(shape, hidden, vocab, tokens, head, methods, resolved, args, device, dtype, seed):
    """Rows of one cell: every method once per repetition (order rotating), plus the per-method facts of rep 0."""
    trainable = head == "trainable"
    h, w, y, g = make_inputs(hidden, vocab, tokens, device, dtype, seed)
    h.requires_grad_(True)
    w.requires_grad_(trainable)
    if args.smoke or tokens <= args.check_tokens:
        ref_loss, ref_dh, ref_dw = reference(h, w, y, trainable)
    else:
        ref_loss = ref_dh = ref_dw = None
    capacity, limit = memory_limit(device)
    flops_per_gemm = 2 * tokens * vocab * hidden
    loss_flops = (2 + int(trainable)) * flops_per_gemm
    floor_bytes = h.numel() * h.element_size() + (w.numel() * w.element_size() if trainable else 0)
    base = {"shape": shape, "hidden": hidden, "vocab": vocab, "tokens": tokens, "head": head}
    first: dict[str, dict] = {}   # method -> what rep 0 found (status, note, peak, errors)
    rows = []
    for rep in range(args.repetitions):
        line = []
        for method in measure.rotation(methods, rep):
            loss_fn, mode, version = resolved[method] if not isinstance(resolved[method], str) else (None, "", "")
            known = first.get(method)
            row = {**base, "method": method, "rep": rep, "status": "ok", "ms": None, "ms_each": "", "calls": None,
                   "tflops": None, "peak_extra_bytes": None, "peak_extra_gib": None,
                   "grad_floor_bytes": floor_bytes, "grad_floor_gib": floor_bytes / GIB, "peak_vs_floor": None,
                   "loss": None, "loss_rel_err": None, "loss_vs_torch_fp32": None, "dh_rel_err": None,
                   "dw_rel_err": None,
                   "gemms": gemm_count(method, trainable) if method in FLOORS else 2 + int(trainable),
                   "loss_flops": loss_flops, "dtype": str(dtype).removeprefix("torch."), "smoke": args.smoke,
                   "mode": mode, "version": version, "note": ""}
            if isinstance(resolved[method], str) or (method in TRAINABLE_ONLY and not trainable):
                row.update(status="skipped", note=resolved[method] if isinstance(resolved[method], str)
                           else TRAINABLE_ONLY[method])
                rows.append(row)
                continue
            if known is not None and known["status"] != "ok":  # out of memory or failed in rep 0: not retried
                row.update({k: known[k] for k in ("status", "note")})
                rows.append(row)
                continue
            need = LOGIT_BUFFERS.get(method, 0) * tokens * vocab * 2
            if capacity is not None and need > capacity:  # never tried: the allocation alone would not fit
                first[method] = {"status": "oom", "note": f"predicted: {LOGIT_BUFFERS[method]} [N x V] buffers "
                                 f"need {need / GIB:.0f} GiB > {limit} {capacity / GIB:.0f} GiB (not tried)"}
                row.update(first[method])
                rows.append(row)
                line.append(f"{method} oom")
                continue
            failure = None
            step = None
            try:
                step = make_step(method, loss_fn, h, w, y, trainable, g)
                if known is None:
                    loss = step()  # untimed: compile / autotune; its results are checked against the reference
                    known = first[method] = measure_first(method, step, loss, h, w, trainable, ref_loss, ref_dh,
                                                          ref_dw, device, args)
                elif (known["peak_extra_bytes"] or 0) >= WARMUP_PEAK_BYTES:
                    step()  # untimed: takes this method's large blocks from the allocator
                times = measure.event_ms(step, calls=known["calls"])
            except Exception as exc:  # noqa: BLE001 - a failing method is a recorded result, not a crash
                failure = failed_cell(exc)
                if failure[0] == "error":
                    traceback.print_exc()
            # outside the except block: the traceback's frames (and the tensors they hold) are gone
            step = None
            h.grad = w.grad = None
            if failure is not None:
                free_memory(device)
                status, note = failure
                first[method] = {"status": status, "note": f"{note} (rep {rep}; not retried)"}
                row.update(status=status, note=first[method]["note"])
                rows.append(row)
                line.append(f"{method} {status}")
                continue
            ms = statistics.median(times)
            row.update(ms=ms, ms_each=" ".join(f"{t:.3f}" for t in times), calls=len(times),
                       tflops=loss_flops / (ms * 1e-3) / 1e12,
                       **{k: known[k] for k in ("peak_extra_bytes", "loss", "loss_rel_err", "dh_rel_err",
                                                "dw_rel_err")})
            if known["peak_extra_bytes"] is not None:
                row["peak_extra_gib"] = known["peak_extra_bytes"] / GIB
                row["peak_vs_floor"] = known["peak_extra_bytes"] / floor_bytes
            rows.append(row)
            line.append(f"{method} {ms:.2f}")
        print(f"  {shape} N={tokens} {head} rep {rep}: " + ", ".join(line) + " (ms)", flush=True)
    torch_fp32 = first.get("torch_fp32", {}).get("loss")
    for row in rows:  # the brief's yardstick: the standard path's loss, where it fit in memory
        if row["loss"] is not None and torch_fp32 is not None:
            row["loss_vs_torch_fp32"] = abs(row["loss"] - torch_fp32) / abs(torch_fp32)
    del h, w, y, ref_dh, ref_dw
    free_memory(device)
    return rows


def measure_first(method, step, loss, h, w, trainable, ref_loss, ref_dh, ref_dw, device, args) -> dict:
    """Rep 0's facts about a method in a cell: loss and gradient errors (of the warm-up call's results), peak
    memory (one untimed call; CUDA only, not for the GEMM floors) and how many calls fill the time budget."""
    found = {"status": "ok", "note": "", "peak_extra_bytes": None, "loss": None, "loss_rel_err": None,
             "dh_rel_err": None, "dw_rel_err": None}
    if loss is not None:
        found["loss"] = float(loss)
    if loss is not None and ref_loss is not None:
        found["loss_rel_err"] = abs(float(loss) - ref_loss) / abs(ref_loss)
        found["dh_rel_err"] = rel_l2(h.grad, ref_dh)
        if trainable:
            found["dw_rel_err"] = rel_l2(w.grad, ref_dw)
    h.grad = w.grad = None
    if device.type == "cuda":
        if method in FLOORS:
            probe = measure.event_ms(step)[0]
        else:
            wall = []

            def timed_step():
                begin = time.perf_counter()
                step()
                torch.cuda.synchronize()
                wall.append(1e3 * (time.perf_counter() - begin))

            peak, before = measure.peak_bytes(timed_step)
            probe = wall[0]
            found["peak_extra_bytes"] = peak - before
            h.grad = w.grad = None
        found["calls"] = max(args.min_calls, min(args.max_calls, round(args.call_budget_ms / max(probe, 1e-3))))
    else:
        found["calls"] = 1  # CPU smoke: the interpreter's time means nothing
    return found


# ---------------------------------------------------------------------------------------------------------------
# Summary, plots, main
# ---------------------------------------------------------------------------------------------------------------

def cells_of(rows):
    return list(dict.fromkeys((r["shape"], r["tokens"], r["head"]) for r in rows))


def _time_ratio(cell_rows, medians, method, other):
    """summarize() of ``method``'s ms / ``other``'s, repetition by repetition, or None where they do not pair."""
    if other is None or method not in medians or other not in medians:
        return None
    try:
        return measure.summarize(measure.repetition_ratios(cell_rows, "ms", {"method": method}, {"method": other}))
    except ValueError:  # the two were not measured in the same repetitions
        return None


def summary_rows(rows):
    """One row per cell and method: median ms and its interval, TFLOP/s, per-repetition time ratios to the fastest
    baseline of the cell and to the two GEMM floors, peak and errors (rep 0)."""
    out = []
    for shape, tokens, head in cells_of(rows):
        mine = [r for r in rows if (r["shape"], r["tokens"], r["head"]) == (shape, tokens, head)]
        ran = {m: [r for r in mine if r["method"] == m and r["status"] == "ok"]
               for m in dict.fromkeys(r["method"] for r in mine)}
        medians = {m: statistics.median(r["ms"] for r in rs) for m, rs in ran.items() if rs}
        fastest = min((m for m in BASELINES if m in medians), key=medians.get, default=None)
        for method, rs in ran.items():
            first = next(r for r in mine if r["method"] == method)
            row = {"shape": shape, "tokens": tokens, "head": head, "method": method, "status": first["status"],
                   "note": first["note"], "time_vs_liger": None}
            if rs:
                ms = measure.summarize(r["ms"] for r in rs)
                vs_fast = _time_ratio(mine, medians, method, fastest)
                vs_floor = _time_ratio(mine, medians, method, "gemm_floor")
                vs_floor_rc = _time_ratio(mine, medians, method, "gemm_floor_recompute")
                vs_liger = _time_ratio(mine, medians, method, "liger")
                row.update({"ms": ms["median"], "ms_ci95_low": ms["ci95"][0], "ms_ci95_high": ms["ci95"][1],
                            "n": ms["n"], "tflops": statistics.median(r["tflops"] for r in rs),
                            "fastest_baseline": fastest,
                            "time_vs_fastest_baseline": vs_fast and vs_fast["median"],
                            "time_vs_fastest_baseline_ci95_low": vs_fast and vs_fast["ci95"][0],
                            "time_vs_fastest_baseline_ci95_high": vs_fast and vs_fast["ci95"][1],
                            "time_vs_gemm_floor": vs_floor and vs_floor["median"],
                            "time_vs_liger": vs_liger and vs_liger["median"],
                            "time_vs_gemm_floor_recompute": vs_floor_rc and vs_floor_rc["median"]})
            for key in ("peak_extra_gib", "grad_floor_gib", "peak_vs_floor", "loss_rel_err", "loss_vs_torch_fp32",
                        "dh_rel_err", "dw_rel_err", "mode", "version"):
                row[key] = (rs[0] if rs else first)[key]
            out.append(row)
    return out


def _grid(rows):
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    heads = list(dict.fromkeys(r["head"] for r in rows))
    return shapes, heads


def plot_time(rows, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes, heads = _grid(rows)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(len(shapes), len(heads), figsize=(6 * len(heads), 4.2 * len(shapes)), squeeze=False)
    for ax, (shape, head) in zip(axes.flat, [(s, hd) for s in shapes for hd in heads]):
        for method in methods:
            mine = [r for r in rows if (r["shape"], r["head"], r["method"]) == (shape, head, method)
                    and r["status"] == "ok"]
            tokens = sorted({r["tokens"] for r in mine})
            if not tokens:
                continue
            med = [statistics.median(r["ms"] for r in mine if r["tokens"] == t) for t in tokens]
            style = ":" if method in FLOORS else "-"
            ax.plot(tokens, med, style, marker="o", ms=3, label=method)
            for t in tokens:
                repetition_dots(ax, t, [r["ms"] for r in mine if r["tokens"] == t])
        if not ax.lines:  # nothing measured here (every cell out of memory, skipped or not run)
            ax.set_title(f"{shape}, {head} head: nothing measured", fontsize=10)
            continue
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens N")
        ax.set_ylabel("ms per forward + backward")
        ax.set_title(f"{shape}, {head} head (lines: medians, dots: repetitions)", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / TIME_PNG, dpi=120)
    plt.close(fig)


def plot_memory(summary, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes, heads = _grid(summary)
    methods = [m for m in dict.fromkeys(s["method"] for s in summary) if m not in FLOORS]
    fig, axes = plt.subplots(len(shapes), len(heads), figsize=(6 * len(heads), 4.2 * len(shapes)), squeeze=False)
    width = 0.8 / max(len(methods), 1)
    for ax, (shape, head) in zip(axes.flat, [(s, hd) for s in shapes for hd in heads]):
        mine = [s for s in summary if (s["shape"], s["head"]) == (shape, head)]
        tokens = sorted({s["tokens"] for s in mine})
        for i, method in enumerate(methods):
            for j, t in enumerate(tokens):
                s = next((s for s in mine if (s["method"], s["tokens"]) == (method, t)), None)
                x = j + (i - (len(methods) - 1) / 2) * width
                if s is not None and s["peak_extra_gib"] is not None:
                    ax.bar(x, s["peak_extra_gib"], width, color=f"C{i}", label=method if j == 0 else None)
                elif s is not None and s["status"] in ("oom", "skipped", "error"):  # no bar: say why, at the bottom
                    ax.text(x, 0.02, s["status"], rotation=90, ha="center", va="bottom", fontsize=6,
                            transform=ax.get_xaxis_transform())
        if not ax.patches:  # no bar: nothing measured here
            ax.set_title(f"{shape}, {head} head: nothing measured")
            continue
        for j, t in enumerate(tokens):
            floor = next((s["grad_floor_gib"] for s in mine if s["tokens"] == t and s["grad_floor_gib"]), None)
            if floor is None:
                continue
            ax.hlines(floor, j - 0.45, j + 0.45, colors="k", linestyles="--",
                      label="gradient floor (dH + dW)" if j == 0 else None)
        ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
        ax.set_yscale("log")
        ax.set_xlabel("tokens N")
        ax.set_ylabel("extra peak GiB above the inputs")
        ax.set_title(f"{shape}, {head} head: peak vs the gradients' bytes")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / MEMORY_PNG, dpi=120)
    plt.close(fig)


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory for the CSVs and plots")
    ap.add_argument("--repetitions", type=int, default=measure.MIN_REPETITIONS,
                    help="independent side-by-side loops per cell (default %(default)s = measure.MIN_REPETITIONS)")
    ap.add_argument("--smoke", action="store_true",
                    help="the whole code path on tiny stand-in shapes (d 20 / 40, V 100 / 72, N 24), fp32 "
                         "(CPU: set TRITON_INTERPRET=1); no peak memory; Liger and CCE skipped on a CPU")
    ap.add_argument("--methods", nargs="+", default=[m for m in METHODS if m not in CHUNK_ROWS], choices=METHODS,
                    help="methods to time (default: all but the opt-in fixed-chunk ones, "
                         + ", ".join(CHUNK_ROWS) + ")")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=TOKENS, help="token counts N (default %(default)s)")
    ap.add_argument("--heads", nargs="+", default=HEADS, choices=HEADS)
    ap.add_argument("--call-budget-ms", type=float, default=80.0,
                    help="timed calls per method and repetition fill about this many ms (default %(default)s)")
    # 5 calls: each repetition's median is one sample; the repetitions (and sessions) give the intervals, and a
    # call here takes 14-310 ms on an H200, far above the event timer's resolution
    ap.add_argument("--max-calls", type=int, default=5, help="at most this many timed calls (default %(default)s)")
    ap.add_argument("--min-calls", type=int, default=5,
                    help="at least this many timed calls per method and repetition (default %(default)s)")
    ap.add_argument("--check-tokens", type=int, default=4096,
                    help="loss / dH / dW errors against the fp32 reference only in cells of at most this many "
                         "tokens (default %(default)s; smoke: every cell)")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="start no new cell after this many seconds: the cells left get rows with status "
                         "'not_run' (the CSV is written after every cell anyway)")
    ap.add_argument("--quick", action="store_true",
                    help="the llama3-8b head at 16,384 tokens, both heads, the panel's methods (a few minutes)")
    add_ledger_argument(ap)
    return ap


def main(argv=None):
    start = time.perf_counter()
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.shapes, args.tokens = ["llama3-8b"], [16384]
        if args.methods == METHODS:
            args.methods = PANEL_METHODS
    if args.repetitions < 1:
        ap.error("--repetitions must be >= 1")
    device = check_device(args.smoke)
    methods = [m for m in METHODS if m in args.methods]
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    tokens_list = SMOKE_TOKENS if args.smoke else args.tokens
    dtype = torch.float32 if args.smoke else torch.bfloat16
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    resolved = {}
    for method in methods:  # a method that cannot run here keeps the reason instead
        try:
            resolved[method] = resolve(method, device)
        except Unavailable as exc:
            resolved[method] = str(exc)
    print(device_line(device, dtype, args.repetitions, f"methods {' '.join(methods)}"), flush=True)
    for method in methods:
        entry = resolved[method]
        print(f"  {method:>21}: " + (f"skipped: {entry}" if isinstance(entry, str)
                                     else f"{entry[1]}{' ' + entry[2] if entry[2] else ''}"), flush=True)
    rows = []
    for s, shape in enumerate(args.shapes):
        hidden, vocab = shapes[shape]
        for tokens in tokens_list:
            for head in args.heads:
                t0 = time.perf_counter()
                if args.time_budget_s is not None and t0 - start > args.time_budget_s:
                    rows += [{"shape": shape, "hidden": hidden, "vocab": vocab, "tokens": tokens, "head": head,
                              "method": m, "rep": rep, "status": "not_run", "ms": None, "peak_extra_gib": None,
                              "grad_floor_gib": None, "peak_vs_floor": None, "loss": None, "loss_rel_err": None,
                              "loss_vs_torch_fp32": None, "dh_rel_err": None, "dw_rel_err": None, "mode": "",
                              "version": "", "smoke": args.smoke, "tflops": None, "calls": None,
                              "note": f"--time-budget-s {args.time_budget_s:.0f} spent before this cell"}
                             for m in methods for rep in range(args.repetitions)]
                    measure.write_csv(rows, out / CSV)
                    print(f"{shape} N={tokens} {head}: not run (time budget)", flush=True)
                    continue
                rows += bench_cell(shape, hidden, vocab, tokens, head, methods, resolved, args, device, dtype,
                                   seed=1000 * s + tokens)
                measure.write_csv(rows, out / CSV)  # after every cell: partial results survive
                print(f"{shape} d={hidden} V={vocab} N={tokens} {head}: {time.perf_counter() - t0:.0f} s", flush=True)
    summary = summary_rows(rows)
    write_summary(summary, out / SUMMARY_CSV, args)
    plot_time(rows, out)
    plot_memory(summary, out)
    print(f"{'shape':>13} {'N':>6} {'head':>9} {'method':>21} {'ms':>9} {'TFLOP/s':>7} {'/fastest':>8} "
          f"{'/floor':>6} {'/floor4':>7} {'/liger':>6} {'peak GiB':>8} {'/gradfl':>7} {'loss err':>8} {'dH err':>8} "
          f"{'dW err':>8}")
    for r in summary:
        print(f"{r['shape']:>13} {r['tokens']:>6} {r['head']:>9} {r['method']:>21} "
              + (f"{r['status']:>9} {r['note'][:80]}" if r["status"] != "ok" else
                 f"{r['ms']:9.3f} {r['tflops']:7.1f} {_fmt(r['time_vs_fastest_baseline'], '8.3f')} "
                 f"{_fmt(r['time_vs_gemm_floor'], '6.2f')} {_fmt(r['time_vs_gemm_floor_recompute'], '7.2f')} "
                 f"{_fmt(r['time_vs_liger'], '6.2f')} "
                 f"{_fmt(r['peak_extra_gib'], '8.2f')} {_fmt(r['peak_vs_floor'], '7.2f')} "
                 f"{_fmt(r['loss_rel_err'], '8.1e')} {_fmt(r['dh_rel_err'], '8.1e')} {_fmt(r['dw_rel_err'], '8.1e')}"))
    errors = [r for r in summary if r["status"] == "error"]
    for r in errors:
        print(f"ERROR {r['shape']} N={r['tokens']} {r['head']} {r['method']}: {r['note']}", file=sys.stderr)
    print(f"wrote {out / CSV} ({len(rows)} rows) in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()

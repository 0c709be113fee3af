"""What accumulating a trainable head's dW in bf16 costs in accuracy, by the number of row chunks.

The gradients-in-forward path (``lora_lab.kernels.loss.fwdgrad``) adds one ``G_cᵀ H_c`` per row chunk into dW. By
default it keeps that sum in fp32 (``dw_accumulate="auto"``: ``out_dtype`` on CUDA, ``partial`` elsewhere);
``"input_dtype"`` (Liger's choice, bench_loss.py's ``lora_lab_fwdgrad_lowmem``) adds into the 16-bit dW itself, one
rounding per chunk. On an H200 at 65,536 tokens (16 chunks of 4,096 rows) that ran 1.4-1.8% faster and held one
[V, d] buffer less (the ledger's loss rows of commit bdf912c). This measures the other side:
dW's relative L2 error against the fp64 reference for 1 to 64 chunks on the same inputs, per accumulation mode.

Two sources of dW:

* ``op``: the package's own op, ``linear_cross_entropy(impl="fwdgrad")`` with a fixed chunk size. Right on a GPU in
  any dtype and on a CPU in fp16/fp32. Not bf16 on a CPU: Triton's interpreter *truncates* fp32 to bf16 on store
  (twice the error of rounding to nearest; ``test_loss_dw_accumulation_tool.py`` shows it), and the op stores its
  logit gradient and its final dW with Triton, so a CPU bf16 run would blame the kernels for the interpreter.
* ``model``: the same arithmetic in plain torch, with the GPU's rounding: logits from a 16-bit GEMM (fp32 products,
  rounded once), the gradient ``(softmax - onehot) / n`` in fp32 rounded to the dtype (fp16: unscaled, dW scaled by
  ``1 / n`` at the end, as the op does against underflow), then dW per mode
  (``out_dtype`` / ``upcast``: exact fp32 products summed in fp32, rounded once at the end; ``partial``: each
  chunk's product rounded to the dtype, summed in fp32; ``input_dtype``: ``dW = round(dW + G_cᵀ H_c)`` per chunk).
  In fp16 on a CPU both sources run, and the tool reports how far they differ: the check that the model is the op.

Inputs are ``loss_block.loss_inputs`` (hidden N(0, 1), head weights N(0, weight_scale²), uniform labels). A real
model's hidden states and labels are not uniform: the figures are the trend with the chunk count, not a model's error.
A numerics study, never a timing.

    python tools/loss_dw_accumulation.py --out DIR             # bf16 model (+ fp16 op and model on a CPU)
    python tools/loss_dw_accumulation.py --chunks 1 4 16 --rows 512 --sources op --dtype bf16   # on a GPU
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lora_lab.experiments.loss_block import loss_inputs  # noqa: E402
from lora_lab.kernels.loss import LossKernelConfig, linear_cross_entropy, linear_cross_entropy_reference  # noqa: E402
from lora_lab.numerics import rel_l2  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MODES = ("out_dtype", "partial", "upcast", "input_dtype")
FIELDS = ["source", "dtype", "mode", "chunks", "rows", "tokens", "hidden", "vocab", "dw_rel_err", "dw_floor"]


def reference_dw(h, w, y) -> torch.Tensor:
    """dW of the mean cross-entropy in fp64 on the same input values."""
    wr = w.detach().double().requires_grad_()
    linear_cross_entropy_reference(h.detach().double(), wr, y).backward()
    return wr.grad


def op_dw(h, w, y, rows: int, mode: str) -> torch.Tensor:
    """dW from the package's op, ``rows`` rows per chunk, accumulated by ``mode``."""
    if h.device.type == "cpu" and h.dtype == torch.bfloat16:
        raise ValueError("source 'op' in bf16 needs a GPU: Triton's CPU interpreter truncates fp32 to bf16 on "
                         "store (use source 'model', or fp16 on a CPU)")
    cfg = LossKernelConfig(impl="fwdgrad", fwdgrad_chunk_rows=rows, dw_accumulate=mode)
    wk = w.clone().requires_grad_()
    linear_cross_entropy(h, wk, y, config=cfg).backward()
    return wk.grad


def model_dw(h, w, y, rows: int, mode: str) -> torch.Tensor:
    """dW from the op's arithmetic in plain torch, with round-to-nearest wherever the op rounds."""
    if mode not in MODES:
        raise ValueError(f"unknown dw_accumulate mode {mode!r} (known: {', '.join(MODES)})")
    dtype, n = h.dtype, h.shape[0]
    valid = int((y != -100).sum())
    post_scale = dtype == torch.float16
    acc = torch.zeros(w.shape, dtype=torch.float32 if mode != "input_dtype" else dtype, device=h.device)
    for start in range(0, n, rows):
        hc, yc = h[start:start + rows], y[start:start + rows]
        logits = (hc @ w.T).float()  # a 16-bit GEMM: fp32 products, rounded once to the dtype
        grad = torch.softmax(logits, dim=-1)
        keep = yc != -100
        grad[keep, yc[keep]] -= 1.0
        grad[~keep] = 0.0
        # the softmax pass rounds its gradient on store; fp16 stores it unscaled (dz / N would underflow) and the
        # op scales the GEMMs' results once at the end
        grad = (grad if post_scale else grad / max(valid, 1)).to(dtype)
        if mode in ("out_dtype", "upcast"):
            acc += grad.float().T @ hc.float()
        elif mode == "partial":
            acc += (grad.T @ hc).float()
        else:
            acc = (acc.float() + grad.float().T @ hc.float()).to(dtype)  # addmm: C + AB in fp32, rounded once
    if post_scale:
        acc = acc.float() / max(valid, 1)
    return acc.to(dtype)


def run(chunks_list, rows, hidden, vocab, cells, device, weight_scale, progress=print) -> list[dict]:
    """``cells``: (source, dtype, mode) triples; one fp64 reference per chunk count and dtype."""
    out = []
    for chunks in chunks_list:
        for dtype in dict.fromkeys(c[1] for c in cells):
            h, w, y = loss_inputs(chunks * rows, hidden, vocab, dtype, device, weight_scale=weight_scale,
                                  ignored=())
            ref = reference_dw(h, w, y)
            floor = rel_l2(ref.to(dtype), ref)
            for source, _, mode in (c for c in cells if c[1] == dtype):
                dw = (op_dw if source == "op" else model_dw)(h, w, y, rows, mode)
                row = {"source": source, "dtype": str(dtype).removeprefix("torch."), "mode": mode, "chunks": chunks,
                       "rows": rows, "tokens": chunks * rows, "hidden": hidden, "vocab": vocab,
                       "dw_rel_err": rel_l2(dw, ref), "dw_floor": floor}
                progress(f"{source:>5} {row['dtype']:>8} {mode:>11} chunks {chunks:3d}  dW rel. L2 "
                         f"{row['dw_rel_err']:.2e}  (the exact dW rounded once: {floor:.2e})")
                out.append(row)
    return out


def markdown(rows: list[dict]) -> str:
    """One table per (source, dtype): dW's rel. L2 by chunk count (rows) and mode (columns)."""
    blocks = []
    for source, dtype in dict.fromkeys((r["source"], r["dtype"]) for r in rows):
        mine = [r for r in rows if (r["source"], r["dtype"]) == (source, dtype)]
        modes = list(dict.fromkeys(r["mode"] for r in mine))
        lines = [f"**{source}, {dtype}**: dW rel. L2 against fp64", "",
                 "| chunks | tokens | exact dW rounded once | " + " | ".join(modes) + " |",
                 "|---|---|---|" + "---|" * len(modes)]
        for chunks in dict.fromkeys(r["chunks"] for r in mine):
            cell = {r["mode"]: r for r in mine if r["chunks"] == chunks}
            first = next(iter(cell.values()))
            lines.append(f"| {chunks} | {first['tokens']} | {first['dw_floor']:.2e} | "
                         + " | ".join(f"{cell[m]['dw_rel_err']:.2e}" for m in modes) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--rows", type=int, default=256, help="rows per chunk (default %(default)s)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--weight-scale", type=float, default=0.1,
                    help="head weights ~ N(0, s²): logits' std about s·sqrt(hidden) (default %(default)s)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=None,
                    help="dw_accumulate modes (default: out_dtype on CUDA, else upcast; partial; input_dtype)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--sources", nargs="+", choices=["op", "model"], default=None,
                    help="default: op on a GPU; on a CPU the model in --dtype, and op and model in fp16")
    ap.add_argument("--out", help="write dw_accumulation.csv and dw_accumulation.md here")
    args = ap.parse_args(argv)
    if min(args.chunks) < 1 or args.rows < 1 or args.hidden < 1 or args.vocab < 2:
        ap.error("--chunks, --rows and --hidden must be >= 1 and --vocab >= 2")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    modes = args.modes or ["out_dtype" if device == "cuda" else "upcast", "partial", "input_dtype"]
    dtype = DTYPES[args.dtype]
    if args.sources:
        if "op" in args.sources and device == "cpu" and dtype == torch.bfloat16:
            ap.error("--sources op with --dtype bf16 needs a GPU: Triton's CPU interpreter truncates fp32 to bf16 "
                     "on store; use --sources model, or --dtype fp16")
        cells = [(s, dtype, m) for s in args.sources for m in modes]
    elif device == "cuda":
        cells = [("op", dtype, m) for m in modes]
    else:
        cells = [("model", dtype, m) for m in modes]
        cells += [(s, torch.float16, m) for s in ("op", "model") for m in modes if (s, torch.float16, m) not in cells]
    rows = run(args.chunks, args.rows, args.hidden, args.vocab, cells, device, args.weight_scale)
    table = markdown(rows)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "dw_accumulation.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        command = " ".join(["python tools/loss_dw_accumulation.py", *(sys.argv[1:] if argv is None else argv)])
        (out / "dw_accumulation.md").write_text(
            f"{device}; d {args.hidden}, V {args.vocab}, {args.rows}-row chunks, head weights N(0, "
            f"{args.weight_scale}²); `{command}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

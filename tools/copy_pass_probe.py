"""Does software pipelining break the rank-r pass that copies its input on the way?

``rank_projection(copy_to=...)`` (the widened route's forward pass) stores each X tile it loads into ``[X | P]``
and feeds the same tile to ``tl.dot``. Its bf16 GPU test failed at rank 64 with a wrong P while the plain pass was
right, so ``tuning._prune_configs`` now runs the copying passes unpipelined. This tool launches that kernel with
one fixed tile at ``num_stages`` 1 and 4 (past the autotuner and its pruner), with and without the copy, at ranks
16 to 128, and compares P with an fp32 product of the same bf16 inputs: the relative L2 error of P and whether the
copy equals X. CUDA only.

    python tools/copy_pass_probe.py [--rows 777] [--depth 512] [--ranks 16 32 48 64 128] [--ledger FILE.csv]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

STAGES = (1, 4)
TILE = {"BLOCK_M": 64, "BLOCK_D": 128, "num_warps": 4}  # the first of tuning.skinny_configs' GPU tiles


def launch(torch, x, a, rank: int, stages: int, copy: bool):
    """(P, copy buffer or None): the copying P pass (``_rank_projection_kernel``) with TILE and ``stages``."""
    from lora_lab.kernels.lora import rank_ops
    from lora_lab.kernels.lora.rank_ops import _rank_projection_kernel
    from lora_lab.kernels.triton_helpers import cdiv, dot_precision, rank_block, row_bucket

    M, D = x.shape
    wide = torch.zeros((M, D + rank), device=x.device, dtype=x.dtype)
    out, dest = wide[:, D:], wide[:, :D]
    at = a.t()
    block_r = rank_block(rank, cap=128)
    kernel = _rank_projection_kernel.fn  # the jitted function under the autotuner
    kernel[(cdiv(M, TILE["BLOCK_M"]), cdiv(rank, block_r))](
        x, x.stride(0), x.stride(1), at, at.stride(0), at.stride(1), out, out.stride(0), out.stride(1),
        *rank_ops._copy_args(dest if copy else None, out), M, D, rank, row_bucket(M), 0,
        2.0, out, 0, 0.0, 1.0, HAS_COL_SCALE=False, DROPOUT=False, COPY=copy, PRECISION=dot_precision(x.dtype),
        BLOCK_R=block_r, BLOCK_M=TILE["BLOCK_M"], BLOCK_D=TILE["BLOCK_D"], num_warps=TILE["num_warps"],
        num_stages=stages)
    return out, (dest if copy else None)


def probe(torch, rows: int, depth: int, ranks, seed: int = 0, device: str = "cuda", dtype=None) -> list[dict]:
    """One result per rank, stage count and copy setting: P's relative L2 error and whether the copy is exact
    (bf16 on the GPU; the CPU tests run it in Triton's interpreter in fp32, where stages mean nothing)."""
    dtype = dtype or torch.bfloat16
    gen = torch.Generator().manual_seed(seed)
    results = []
    for rank in ranks:
        x = torch.randn(rows, depth, generator=gen).to(device, dtype)
        a = (torch.randn(rank, depth, generator=gen) / depth ** 0.5).to(device, dtype)
        ref = 2.0 * x.float() @ a.float().t()
        for stages in STAGES:
            for copy in (False, True):
                p, dest = launch(torch, x, a, rank, stages, copy)
                if device == "cuda":
                    torch.cuda.synchronize()
                err = ((p.float() - ref).norm() / ref.norm()).item()
                results.append({"rank": rank, "stages": stages, "copy": copy, "p_rel_l2": err,
                                "copy_exact": None if dest is None else bool(torch.equal(dest, x))})
    return results


def ledger_rows(results, rows: int, depth: int) -> list[dict]:
    out = []
    for r in results:
        cell = f"M={rows};D={depth};r={r['rank']};dtype=bfloat16;BLOCK_M={TILE['BLOCK_M']};BLOCK_D={TILE['BLOCK_D']}"
        cell += f";num_warps={TILE['num_warps']}"
        method = f"{'copy' if r['copy'] else 'no_copy'}_stages{r['stages']}"
        base = {"benchmark": "copy_pass_probe", "cell": cell, "method": method, "n": 1,
                "source": "tools/copy_pass_probe.py"}
        out.append({**base, "statistic": "p_rel_l2", "value": r["p_rel_l2"], "unit": "ratio"})
        if r["copy_exact"] is not None:
            out.append({**base, "statistic": "copy_exact", "value": float(r["copy_exact"]), "unit": "bool"})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=777)
    ap.add_argument("--depth", type=int, default=512)
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 48, 64, 128])
    ap.add_argument("--ledger", help="append the results to this measurement ledger (a CSV file)")
    args = ap.parse_args(argv)
    if min(args.rows, args.depth, *args.ranks) < 1 or max(args.ranks) > 128:
        ap.error("--rows and --depth must be positive, --ranks between 1 and 128")
    import torch

    if not torch.cuda.is_available():
        print("copy_pass_probe: needs a CUDA device (the miscompile is the GPU compiler's)", file=sys.stderr)
        return 2
    results = probe(torch, args.rows, args.depth, args.ranks)
    print(f"{torch.cuda.get_device_name()}: P of the copying pass, {args.rows}x{args.depth}, tile {TILE}")
    for r in results:
        print(f"r {r['rank']:4d} stages {r['stages']} copy {str(r['copy']):5s}: P rel. L2 {r['p_rel_l2']:.4f}"
              + ("" if r["copy_exact"] is None else f", copy exact {r['copy_exact']}"))
    if args.ledger:
        from lora_lab.lab.ledger import append_measurements

        print("appended to", append_measurements(ledger_rows(results, args.rows, args.depth), ledger=args.ledger))
    return 0


if __name__ == "__main__":
    sys.exit(main())

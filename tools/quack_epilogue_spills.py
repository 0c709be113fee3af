"""Compile the LoRA linear's QuACK epilogue for Hopper without a GPU and report what ptxas says of each kernel.

For each rank and QuACK tile/schedule asked for, a fresh process compiles ``lora_lab.kernels.lora.quack_gemm``'s GEMM
with its rank-r epilogue for sm_90a (``QUACK_ARCH`` / ``CUTE_DSL_ARCH``), keeps the PTX (``CUTE_DSL_KEEP=ptx``) and
stops where the launch needs a GPU; ``ptxas -v`` then reports the kernel's registers and spill bytes. This is how
``quack_gemm.gemm_config`` chose its tiles: a schedule whose epilogue spills is not the default.

    pip install quack-kernels==0.6.5 "nvidia-cutlass-dsl[cu12]==4.7.1" nvidia-cuda-nvcc-cu12 triton torch
    python tools/quack_epilogue_spills.py --ranks 8 16 32 --tiles 128x192:pingpong 128x256:cooperative

``--ptxas`` names the ptxas binary (default: the nvidia-cuda-nvcc wheel's, else the one on PATH). Exit status 0
when every kernel compiled and was reported, 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# run in the child: compile one (rank, tile, schedule) and stop at the launch (no GPU here)
CHILD = r"""
import sys, torch
import quack.gemm_runtime.host as host
host.get_max_active_clusters = lambda cluster_size: 132  # the H100/H200 SM count: asked of the driver otherwise
from quack.gemm_config import GemmConfig
from lora_lab.kernels.lora import quack_gemm
rank, tile_m, tile_n, pingpong = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "pingpong"
quack_gemm.gemm_config = lambda r: GemmConfig(tile_m=tile_m, tile_n=tile_n, pingpong=pingpong, cluster_m=2)
M, K, N = 4096, 1024, 2048
t = lambda *shape: torch.randn(*shape, dtype=torch.bfloat16)
try:
    quack_gemm.gemm_with_rank_epilogue(t(M, N), t(M, K), t(N, K).t(), t(rank, M), t(rank, N))
except Exception as err:
    if "expected device_type=cuda" not in str(err):
        raise
"""


def _ptxas(given: str | None) -> str:
    if given:
        return given
    try:
        import nvidia.cuda_nvcc  # noqa: F401  (the nvidia-cuda-nvcc wheel)

        for base in nvidia.cuda_nvcc.__path__:
            candidate = Path(base) / "bin" / "ptxas"
            if candidate.is_file():
                return str(candidate)
    except ImportError:
        pass
    found = shutil.which("ptxas")
    if not found:
        sys.exit("quack_epilogue_spills: no ptxas (pip install nvidia-cuda-nvcc-cu12, or pass --ptxas)")
    return found


def _tile(text: str) -> tuple[int, int, str]:
    match = re.fullmatch(r"(\d+)x(\d+):(pingpong|cooperative)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MxN:pingpong or MxN:cooperative, "
                                         "e.g. 128x256:cooperative")
    return int(match[1]), int(match[2]), match[3]


def report(rank: int, tile: tuple[int, int, str], ptxas: str) -> str | None:
    """ptxas's register and spill line for one kernel, or None (the compile or ptxas failed; printed)."""
    with tempfile.TemporaryDirectory() as dump:
        env = {**os.environ, "QUACK_ARCH": "sm_90", "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx",
               "CUTE_DSL_DUMP_DIR": dump, "QUACK_CACHE_ENABLED": "0",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, "-c", CHILD, str(rank), str(tile[0]), str(tile[1]), tile[2]], env=env,
                              capture_output=True, text=True)
        ptx = sorted(Path(dump).glob("*.ptx"))
        if done.returncode != 0 or not ptx:
            print(f"rank {rank} {tile}: did not compile\n{done.stderr[-1500:]}", file=sys.stderr)
            return None
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx[0]), "-o", os.devnull], capture_output=True,
                             text=True)
        lines = [ln.split(":", 1)[-1].strip() for ln in out.stderr.splitlines() if "spill" in ln or "registers" in ln]
        return "; ".join(lines) if out.returncode == 0 and lines else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", nargs="+", type=int, default=[8, 16, 32])
    ap.add_argument("--tiles", nargs="+", type=_tile, default=[_tile("128x192:pingpong"), _tile("128x256:cooperative"),
                                                               _tile("128x128:cooperative")])
    ap.add_argument("--ptxas", default=None)
    args = ap.parse_args(argv)
    ptxas = _ptxas(args.ptxas)
    failed = 0
    for rank in args.ranks:
        for tile in args.tiles:
            line = report(rank, tile, ptxas)
            failed += line is None
            print(f"rank {rank:3d}  {tile[0]}x{tile[1]} {tile[2]:12s} {line or 'no report'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

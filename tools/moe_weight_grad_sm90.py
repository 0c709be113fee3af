"""Whether Triton software-pipelines the MoE weight-gradient kernels on Hopper, checked without a GPU.

Compiles ``per_tile`` (``expert_weight_grad``'s kernel) and ``kgrouped`` (``kgrouped_weight_grad``'s) for sm_90 with
this machine's Triton (its bundled ptxas; no device needed), at the layer's tile (128 x 128 x 64, 8 warps), bf16,
for dW1 (B gathered by token) and dW2 (A gathered and routing-weighted), and reads the TTGIR of the K loop: the loop
is software-pipelined when it issues asynchronous copies after its MMA (the next step's rows, loaded while this
step's MMA runs) or waits leaving copies in flight (``num`` > 0); a loop whose every copy is issued, then waited on,
before the MMA that uses it is not. The JIT's specialisation is mimicked: unit strides as constants, 16-divisible
pointers, sizes and row strides.

    env -u TRITON_INTERPRET python tools/moe_weight_grad_sm90.py            # one line per kernel, GEMM and depth
"""
from __future__ import annotations

import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compile, do not interpret

TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, DOT_PRECISION="tf32", A_TMA=False, B_TMA=False)
PIECES = {"dW1": dict(GATHER_A=False, GATHER_B=True, ROW_WEIGHT=False),
          "dW2": dict(GATHER_A=True, GATHER_B=False, ROW_WEIGHT=True)}
UNIT_STRIDES = dict(stride_a_m=1, stride_b_n=1, stride_out_n=1)  # what the JIT specialises (ints == 1)


def compile_sm90(kernel, constexprs: dict, num_stages: int, num_warps: int = 8):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {**constexprs, **UNIT_STRIDES}
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*bf16" if name in ("a_ptr", "b_ptr", "out_ptr", "row_weight_ptr") else "*i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name == "scale" else "i32"
            if name in ("M", "N") or name.endswith(("_row", "_e", "_m")):
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 128),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def k_loop(ttgir: str) -> str:
    """The text of the K loop: from the last ``scf.for`` to the wait for its last MMA after it."""
    start = ttgir.rfind("scf.for")
    end = re.search(r"warp_group_dot_wait [^{\n]*\{pendings = 0 : i32\}", ttgir[start:])
    return ttgir[start:start + end.start()] if end else ttgir[start:]


def pipelined(loop: str) -> bool:
    """Copies issued after the loop's MMA (for a later step), or waits that leave copies in flight."""
    mma = loop.find("warp_group_dot ")
    ahead = mma >= 0 and "async_copy_global_to_local" in loop[mma:]
    return ahead or any(int(n) > 0 for n in re.findall(r"ttg\.async_wait .*?\{num = (\d+)", loop))


def report() -> list[dict]:
    from lora_lab.kernels.moe import expert_weight_grad, kgrouped_weight_grad

    kernels = {
        "per_tile": (expert_weight_grad._expert_weight_grad_kernel, dict(PERSISTENT=False, NUM_SMS=1)),
        "kgrouped": (kgrouped_weight_grad._kgrouped_weight_grad_kernel, dict(NUM_SMS=132, BLOCK_E=128)),
    }
    rows = []
    for name, (kernel, extra) in kernels.items():
        for piece, flags in PIECES.items():
            for stages in (3, 4):
                compiled = compile_sm90(kernel, {**TILE, **flags, **extra}, stages)
                ttgir = compiled.asm["ttgir"]
                rows.append({"kernel": name, "gemm": piece, "num_stages": stages,
                             "shared_bytes": compiled.metadata.shared,
                             "buffers": sorted(set(re.findall(r"memdesc<(\d+x\d+x\d+xbf16)", ttgir))),
                             "pipelined": pipelined(k_loop(ttgir))})
    return rows


def main() -> int:
    for row in report():
        print(f"{row['kernel']:>9} {row['gemm']} stages={row['num_stages']} shared={row['shared_bytes']:6d} B "
              f"buffers={row['buffers']} pipelined={row['pipelined']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

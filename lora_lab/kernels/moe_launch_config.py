"""Launch settings shared by the MoE kernels: tile sizes, Hopper autotune configs, interpreter mode.

Every MoE kernel is launched either

* with one fixed, reasonable config (CPU interpreter, unit tests, tiny LoRA-rank GEMMs), or
* through ``triton.autotune`` over a handful of Hopper configs (benchmarks, real training).

``LORA_LAB_MOE_AUTOTUNE=0`` forces the fixed configs on a GPU (tests use it so that dozens of
tiny shapes do not each trigger a tuning sweep); the interpreter never autotunes.
"""

from __future__ import annotations

import contextlib
import inspect
import os

import torch
import triton


def triton_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def autotune_enabled() -> bool:
    """Autotune on a real GPU unless ``LORA_LAB_MOE_AUTOTUNE=0``; never in the interpreter."""
    if triton_interpreting():
        return False
    return os.environ.get("LORA_LAB_MOE_AUTOTUNE", "1") not in ("0", "false", "False")


@contextlib.contextmanager
def fixed_launch_configs():
    """Within the block, GPU launches use the fixed configs (as ``LORA_LAB_MOE_AUTOTUNE=0``).

    For correctness checks over many small shapes: each new shape would otherwise start a tuning
    sweep (compile + time every config), which costs time and proves nothing about correctness.
    """
    saved = os.environ.get("LORA_LAB_MOE_AUTOTUNE")
    os.environ["LORA_LAB_MOE_AUTOTUNE"] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LORA_LAB_MOE_AUTOTUNE", None)
        else:
            os.environ["LORA_LAB_MOE_AUTOTUNE"] = saved


def unspecialized_twin(kernel):
    """The same ``@triton.jit`` kernel without value specialisation of its integer arguments.

    Triton compiles one variant per pattern of "int == 1" / "int % 16 == 0" over all sizes and
    strides; the correctness checks sweep many small odd shapes, and each shape would compile every
    kernel again. The twin (sizes and strides not specialised, pointers still are) compiles once per
    set of constexprs. Launched only when tuning is off on a GPU (``fixed_kernel``), so the tuned,
    specialised kernels that the benchmarks time are unchanged.
    """
    names = [
        name for name, param in inspect.signature(kernel.fn).parameters.items()
        if not name.endswith("_ptr") and "constexpr" not in str(param.annotation)
    ]
    return triton.jit(kernel.fn, do_not_specialize=names)


def fixed_kernel(specialized, unspecialized):
    """Kernel for a fixed-config launch: the unspecialised twin when tuning is off on a GPU."""
    if triton_interpreting() or autotune_enabled():
        return specialized
    return unspecialized


def narrow_block_size(size: int) -> int:
    """Tile side for a GEMM dimension <= 128 (LoRA rank, tiny test shapes): one tile covers it.

    A power of two >= 16 (tl.dot's minimum). With the unspecialised twins (tuning off on a GPU) the
    side is at least 64, so the many small shapes of the correctness checks share compiled variants.
    """
    floor = 16 if triton_interpreting() or autotune_enabled() else 64
    return max(floor, triton.next_power_of_2(size))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 GEMMs are true fp32 ("ieee", not TF32) so fp32 runs are a tight reference; 16-bit ignores it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def row_block_size(num_assignments: int, num_experts: int) -> int:
    """BLOCK_M for the row tiles: the routing is built for it, so every row-tiled kernel shares it.

    Small in the interpreter (fast CPU tests); on a GPU 128 when an expert gets >= 192 rows on
    average, else 64 (less padding waste on the last, partial tile of each expert).
    ``LORA_LAB_MOE_BLOCK_M`` overrides it (power of two, >= 16) for tuning experiments.
    """
    if triton_interpreting():
        return 16
    forced = os.environ.get("LORA_LAB_MOE_BLOCK_M")
    if forced:
        return int(forced)
    rows_per_expert = num_assignments / max(num_experts, 1)
    return 128 if rows_per_expert >= 192 else 64


def rank_block_size(rank: int) -> int:
    """Padded LoRA rank: tl.dot needs every tile side >= 16 and a power of two."""
    if rank > 128:
        raise ValueError(f"LoRA rank {rank} > 128 is not supported by the fused MoE kernels")
    return max(16, triton.next_power_of_2(rank))


def fixed_meta(kind: str) -> dict:
    """The single config used when not autotuning, per kernel kind."""
    if triton_interpreting():
        return {"BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1} | (
            {"BLOCK_M": 32} if kind == "weight_grad" else {}
        )
    table = {
        "rows": {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
        "gate_up": {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
        "down_backward": {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
        "weight_grad": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    }
    return dict(table[kind])


def autotune_configs(kind: str) -> list:
    """A few Hopper-friendly configs per kernel kind (BLOCK_M of row kernels comes from the routing)."""
    c = triton.Config
    if triton_interpreting():
        meta = fixed_meta(kind)
        warps, stages = meta.pop("num_warps"), meta.pop("num_stages")
        return [c(meta, num_warps=warps, num_stages=stages)]
    if kind == "rows":
        return [
            c({"BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
            c({"BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
            c({"BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=3),
            c({"BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4),
        ]
    if kind in ("gate_up", "down_backward"):
        return [
            c({"BLOCK_N": 64, "BLOCK_K": 64}, num_warps=8, num_stages=3),
            c({"BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4),
            c({"BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
        ]
    if kind == "weight_grad":
        return [
            c({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
            c({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
            c({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=3),
        ]
    raise KeyError(kind)

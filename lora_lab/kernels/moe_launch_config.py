"""Launch settings shared by the MoE kernels: tile sizes, Hopper autotune configs, interpreter mode.

Every MoE kernel is launched either

* with one fixed, reasonable config (CPU interpreter, unit tests, tiny LoRA-rank GEMMs), or
* through ``triton.autotune`` over a handful of Hopper configs (benchmarks, real training).

``LORA_LAB_MOE_AUTOTUNE=0`` forces the fixed configs on a GPU (tests use it so that dozens of
tiny shapes do not each trigger a tuning sweep); the interpreter never autotunes.
"""

from __future__ import annotations

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

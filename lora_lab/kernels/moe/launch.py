"""Launch settings shared by the MoE kernels: tile sizes and Hopper autotune configs.

Every MoE kernel is launched either

* with one fixed, reasonable config (CPU interpreter, unit tests, tiny LoRA-rank GEMMs), or
* through ``triton.autotune`` over a handful of Hopper configs (benchmarks, real training).

``KernelConfig(moe_autotune=False)`` forces the fixed configs on a GPU (correctness checks over dozens of tiny
shapes would otherwise each start a tuning sweep); the interpreter never autotunes.
"""

from __future__ import annotations

import inspect

import triton

from lora_lab.kernels.config import KernelConfig
from lora_lab.kernels.triton_helpers import next_power_of_2, rank_block, running_in_interpreter


def autotune_enabled(config: KernelConfig) -> bool:
    """Autotune on a real GPU unless ``config.moe_autotune`` is off; never in the interpreter."""
    return config.moe_autotune and not running_in_interpreter()


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


def fixed_kernel(specialized, unspecialized, config: KernelConfig):
    """Kernel for a fixed-config launch: the unspecialised twin when tuning is off on a GPU."""
    if running_in_interpreter() or autotune_enabled(config):
        return specialized
    return unspecialized


def narrow_block_size(size: int, config: KernelConfig) -> int:
    """Tile side for a GEMM dimension <= 128 (LoRA rank, tiny test shapes): one tile covers it.

    A power of two >= 16 (tl.dot's minimum). With the unspecialised twins (tuning off on a GPU) the
    side is at least 64, so the many small shapes of the correctness checks share compiled variants.
    """
    floor = 16 if running_in_interpreter() or autotune_enabled(config) else 64
    return max(floor, next_power_of_2(size))


def row_block_size(num_assignments: int, num_experts: int, config: KernelConfig) -> int:
    """BLOCK_M for the row tiles: the routing is built for it, so every row-tiled kernel shares it.

    Small in the interpreter (fast CPU tests); on a GPU 128 when an expert gets >= 192 rows on
    average, else 64 (less padding waste on the last, partial tile of each expert).
    ``config.moe_block_m`` overrides it (power of two, >= 16) for tuning experiments.
    """
    if running_in_interpreter():
        return 16
    if config.moe_block_m is not None:
        return config.moe_block_m
    rows_per_expert = num_assignments / max(num_experts, 1)
    return 128 if rows_per_expert >= 192 else 64


MAX_RANK = 128  # the whole LoRA rank is one tile in the MoE kernels


def rank_block_size(rank: int) -> int:
    """Padded LoRA rank, one tile wide (:func:`~lora_lab.kernels.triton_helpers.rank_block` without a cap)."""
    if rank > MAX_RANK:
        raise ValueError(f"LoRA rank {rank} > {MAX_RANK} is not supported by the fused MoE kernels")
    return rank_block(rank)


def fixed_meta(kind: str) -> dict:
    """The single config used when not autotuning, per kernel kind."""
    if running_in_interpreter():
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


def set_expert_block_shape(nargs: dict) -> None:
    """Autotune pre-hook (persistent form): each TMA descriptor gets the block shape of the config being run.

    A 3-D descriptor is an expert matrix ((E, N, K) when MAT_NK, else (E, K, N)); a 2-D one is a sorted row
    operand of the weight-gradient kernel, read BLOCK_K rows at a time (``a_ptr``: BLOCK_M columns, ``b_ptr``:
    BLOCK_N).
    """
    for name, value in nargs.items():
        if type(value).__name__ != "TensorDescriptor":
            continue
        bk, bn = nargs["BLOCK_K"], nargs["BLOCK_N"]
        if len(value.shape) == 3:
            value.block_shape = [1, bn, bk] if nargs["MAT_NK"] else [1, bk, bn]
        else:
            value.block_shape = [bk, nargs["BLOCK_M"] if name == "a_ptr" else bn]


def autotune_configs(kind: str) -> list:
    """A few Hopper-friendly configs per kernel kind (BLOCK_M of row kernels comes from the routing)."""
    def c(meta, num_warps, num_stages):
        return triton.Config(meta, num_warps=num_warps, num_stages=num_stages, pre_hook=set_expert_block_shape)

    if running_in_interpreter():
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

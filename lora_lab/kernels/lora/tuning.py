"""Tile configurations and autotuning shared by the LoRA kernels (:mod:`.rank_ops`, :mod:`.gemm`).

A handful of Hopper-friendly tiles on the GPU, one tiny tile in the interpreter (correctness, not speed). The
pruner keeps the tiles that fit the GPU class's shared memory (:func:`lora_lab.gpu_arch.tile_shared_memory_budget`);
on a GPU with about 99 KiB per block (sm86, sm89, sm120), where none of those fits, it tries three smaller GEMM tiles
instead, which every other class drops.
Each autotuned kernel takes an integer argument ``TUNE`` (part of the autotune key): with ``TUNE=0``
(``KernelConfig(autotune=False)``) the pruner keeps only the first tile that fits, so quick runs skip the
tuning sweep without touching the tuned entries.
"""
from __future__ import annotations

import inspect

import triton
import triton.testing

from lora_lab import gpu_arch
from lora_lab.kernels.triton_helpers import autotune_cache_kwargs, running_in_interpreter

__all__ = ["gemm_configs", "skinny_configs", "autotune"]


# GEMM tiles for GPUs with about 99 KiB of shared memory per block (bf16 operand buffers: 48, 64 and 72 KiB); the
# pruner keeps them only where the budget is below SMALL_SM_BELOW (they are untimed guesses, not a tuned table)
_SMALL_SM_GEMM = (
    ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, 4, 3),
    ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, 8, 2),
    ({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, 4, 3),
)
SMALL_SM_BELOW = 100 * 1024


def _config_key(kwargs: dict, num_warps: int, num_stages: int) -> tuple:
    return tuple(sorted(kwargs.items())), num_warps, num_stages


_SMALL_SM_KEYS = frozenset(_config_key(*tile) for tile in _SMALL_SM_GEMM)


def gemm_configs():
    if running_in_interpreter():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}, num_warps=4)]
    return [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
        *(triton.Config(dict(kw), num_warps=warps, num_stages=stages) for kw, warps, stages in _SMALL_SM_GEMM),
    ]


def skinny_configs():
    if running_in_interpreter():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_D": 32}, num_warps=4)]
    return [
        triton.Config({"BLOCK_M": 64, "BLOCK_D": 128}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_D": 64}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_M": 128, "BLOCK_D": 128}, num_warps=8, num_stages=3),
    ]


def _tuning_bench(kernel_call, quantiles):
    # short autotuning runs: a few configs per shape, each timed over ~25 ms
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


_SHARED_MEMORY_BUDGET = 200 * 1024  # bytes per program on Hopper (227 KiB allowed); lora_lab.gpu_arch: other classes


def _prune_configs(configs, named_args, **kwargs):
    """Drop tiles whose pipelined operand buffers overflow shared memory for this dtype (fp32 needs smaller
    tiles than bf16); ``TUNE=0`` keeps only the first survivor (quick test runs)."""
    if running_in_interpreter():
        return configs
    ref = named_args.get("in0_ptr", named_args.get("in_ptr"))
    if ref is None:  # the TMA GEMM: its operands arrive as descriptors over a tensor (``base``)
        ref = getattr(named_args.get("in0_desc"), "base", None)
    elsize = ref.element_size() if hasattr(ref, "element_size") else 2
    budget = gpu_arch.tile_shared_memory_budget(ref.device) if hasattr(ref, "device") else _SHARED_MEMORY_BUDGET
    block_r = kwargs.get("BLOCK_R", 16)
    small_sm = budget < SMALL_SM_BELOW
    kept = []
    for c in configs:
        kw = c.kwargs
        if not small_sm and _config_key(kw, c.num_warps, c.num_stages) in _SMALL_SM_KEYS:
            continue  # the small-SM tiles: tried only where the class's own tiles cannot fit
        if "BLOCK_N" in kw:  # the GEMM: In tile BM×BK and Mat tile BK×BN per stage
            tile = kw["BLOCK_M"] * kw["BLOCK_K"] + kw["BLOCK_K"] * kw["BLOCK_N"]
        else:  # the skinny kernels: In tile BM×BD and a rank tile BD×BR (or BR×BM) per stage
            tile = kw["BLOCK_M"] * kw["BLOCK_D"] + max(kw["BLOCK_D"], kw["BLOCK_M"]) * block_r
        if tile * elsize * max(c.num_stages, 1) <= budget:
            kept.append(c)
    if not kept:  # fp32 with wide tiles: a small safe tile
        first = dict(configs[0].kwargs)
        if "BLOCK_N" in first:
            first.update(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32)
        else:
            first.update(BLOCK_M=64, BLOCK_D=64)
        kept = [triton.Config(first, num_warps=4, num_stages=2, pre_hook=configs[0].pre_hook)]
    if kwargs.get("COPY"):
        # a loop that stores the tile it feeds to tl.dot gives a wrong P when software-pipelined (Triton 3.6 on an
        # H100, tools/copy_pass_probe.py, ledger benchmark copy_pass_probe: with 4 stages P's relative L2 error was
        # about 0.04 at r 48 and 64 and 0.22 at r 128, against 0.0017 unpipelined or without the copy; r 16 and 32
        # were right either way), so the passes that copy their input on the way (rank_ops' copy_to) run unpipelined
        unique = {}
        for c in kept:
            unique.setdefault(_config_key(c.kwargs, c.num_warps, 1),
                              triton.Config(dict(c.kwargs), num_warps=c.num_warps, num_stages=1, pre_hook=c.pre_hook))
        kept = list(unique.values())
    if not named_args.get("TUNE", 1):
        kept = kept[:1]
    return kept


def autotune(configs, key, reset_to_zero=None):
    kwargs = {"prune_configs_by": {"early_config_prune": _prune_configs}, "reset_to_zero": reset_to_zero,
              **autotune_cache_kwargs()}
    if "do_bench" in inspect.signature(triton.autotune).parameters:
        kwargs["do_bench"] = _tuning_bench
    return triton.autotune(configs=configs, key=key, **kwargs)

"""Timing and memory measurement shared by the LoRA kernel benchmarks (GPU only).

Every variant of a comparison is measured in the same process, on the same inputs, one after another:
time = median of ``triton.testing.do_bench`` (CUDA events, warm-up first, L2 flushed between runs);
peak = ``torch.cuda.max_memory_allocated`` during one step, everything the step needs already allocated.
"""
from __future__ import annotations

import csv
import gc
import os
from pathlib import Path

import torch


def median_ms(fn, grad_to_none=None, warmup: int = 25, rep: int = 100) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none,
                                         return_mode="median"))


def peak_bytes(fn) -> tuple[int, int]:
    """(peak allocated during one call of ``fn``, bytes allocated before it)."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated()), int(before)


def write_csv(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return path


def out_dir(arg: str | None) -> Path:
    d = Path(arg or os.environ.get("LORA_LAB_BENCH_OUT", "outputs/gpu"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def environment_line() -> str:
    import triton

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return f"torch {torch.__version__}, triton {triton.__version__}, device {dev}"


# the environment switches of lora_lab's LoRA kernels (read at call time), as shipped
SHIPPED_SWITCHES = {"LORA_LAB_OVERLAP": "auto", "LORA_LAB_FUSE_QDB": "0", "LORA_LAB_DISPATCH": "auto",
                    "LORA_LAB_BASE_GEMM": "auto"}


def set_kernel_switches(**overrides: str) -> None:
    """Set every LoRA kernel switch: the shipped defaults, with ``overrides`` (names without LORA_LAB_)."""
    for k, v in SHIPPED_SWITCHES.items():
        os.environ[k] = v
    for k, v in overrides.items():
        os.environ[f"LORA_LAB_{k}"] = v

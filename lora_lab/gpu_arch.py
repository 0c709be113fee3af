"""Which GPU class the kernels write for, and the one switch that forces an older class's code path.

Every kernel choice that depends on the GPU generation asks this module, never
``torch.cuda.get_device_capability`` directly:

* TMA descriptors (the Triton GEMM's ``gemm_loads`` 'tma' / 'persistent', the MoE kernels' ``moe_loads='persistent'``,
  the loss kernels' ``accumulate='tma'``): Hopper and newer (:func:`has_tma`);
* the CUTLASS path of ``torch._grouped_mm`` (the MoE grouped-GEMM engine and its pieces): bf16 on Hopper and newer
  (:func:`grouped_mm_fast`);
* the shared memory a tile may use when the LoRA, MoE and loss kernels prune their tile tables
  (:func:`tile_shared_memory_budget`).

``LORA_LAB_ARCH`` (``sm80``, ``sm86``, ``sm89``, ``sm90``, or ``ampere`` = sm80, ``ada`` = sm89, ``hopper`` = sm90;
empty or ``native``: the device's own) makes every one of these choices as on that GPU. It only goes down: it cannot
give a GPU features it lacks. What a forced run cannot show: the hardware is still the newer one (its shared memory,
its cache, its speed), so a tile that overflows an Ada SM's shared memory still compiles on an H200.

Imports torch only (not Triton), so the lab can report the class without importing the kernels.
"""
from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["ARCH_ENV", "ARCH_CHOICES", "arch_override", "capability", "gpu_class", "has_tma", "grouped_mm_fast",
           "tile_shared_memory_budget", "describe", "dispatch_rule"]

ARCH_ENV = "LORA_LAB_ARCH"
# accepted values of $LORA_LAB_ARCH -> the compute capability whose path the kernels take
ARCH_CHOICES: dict[str, tuple[int, int]] = {
    "sm80": (8, 0), "sm86": (8, 6), "sm89": (8, 9), "sm90": (9, 0),
    "ampere": (8, 0), "ada": (8, 9), "hopper": (9, 0),
}
_NATIVE = ("", "native")
TMA_MIN = (9, 0)  # TMA descriptors and CUTLASS's grouped GEMM: Hopper and newer
# bytes of shared memory one program's pipelined tiles may take when the LoRA kernels prune their tiles, below each
# generation's per-block maximum (sm80 163 KiB, sm86 / sm89 / sm120 99 KiB, sm90 / sm100 227 KiB)
_TILE_BUDGETS = (((9, 0), 200 * 1024), ((8, 0), 144 * 1024))
_SMALL_SM_BUDGET = 88 * 1024
_SMALL_SM = ((8, 6), (8, 7), (8, 9), (12, 0), (12, 1))


def arch_override(environ: dict | None = None) -> tuple[int, int] | None:
    """The capability ``$LORA_LAB_ARCH`` asks for, or None (unset, empty or ``native``); a ValueError naming the
    allowed values for anything else."""
    text = (os.environ if environ is None else environ).get(ARCH_ENV, "")
    value = text.strip().lower()
    if value in _NATIVE:
        return None
    if value not in ARCH_CHOICES:
        raise ValueError(f"${ARCH_ENV}={text!r} is not a GPU class this project knows; use one of "
                         f"{', '.join(ARCH_CHOICES)} (or leave it empty / 'native' for the device's own)")
    return ARCH_CHOICES[value]


def _device_capability(device: torch.device) -> tuple[int, int]:
    """The hardware's (major, minor) (tests replace this)."""
    return tuple(torch.cuda.get_device_capability(device))


def _resolve(device: torch.device | str | None) -> torch.device:
    """``device`` as a torch.device; None: the current CUDA device, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


def capability(device: torch.device | str | None = None) -> tuple[int, int] | None:
    """The (major, minor) the kernels write for on ``device`` (None: the current device): the device's own, or
    ``$LORA_LAB_ARCH``'s when that is older; None off CUDA (the CPU, Triton's interpreter). Forcing a newer class
    than the device's is a ValueError."""
    device = _resolve(device)
    if device.type != "cuda":
        return None
    real = _device_capability(device)
    forced = arch_override()
    if forced is None:
        return real
    if forced > real:
        raise ValueError(f"${ARCH_ENV}={os.environ.get(ARCH_ENV)!r} asks for compute capability "
                         f"{forced[0]}.{forced[1]}, newer than {device}'s {real[0]}.{real[1]}: the switch only "
                         "forces an older GPU class's path")
    return forced


def _class_of(cap: tuple[int, int] | None) -> str:
    if cap is None:
        return "cpu"
    if cap >= (10, 0):
        return "blackwell"
    if cap >= (9, 0):
        return "hopper"
    if cap == (8, 9):
        return "ada"
    if cap >= (8, 0):
        return "ampere"
    return "pre-ampere"


def gpu_class(device: torch.device | str | None = None) -> str:
    """'cpu', 'pre-ampere', 'ampere', 'ada', 'hopper' or 'blackwell' for ``device`` (default: the current CUDA
    device, else 'cpu'), after ``$LORA_LAB_ARCH``."""
    return _class_of(capability(device))


def has_tma(device: torch.device | str | None) -> bool:
    """Whether the kernels may use TMA descriptors on ``device``. Off CUDA: True (Triton's interpreter runs those
    forms as before, for their tests)."""
    cap = capability(device)
    return cap is None or cap >= TMA_MIN


def grouped_mm_fast(device: torch.device | str | None) -> bool:
    """Whether ``torch._grouped_mm`` takes its CUTLASS path on ``device`` (Hopper and newer); False off CUDA."""
    cap = capability(device)
    return cap is not None and cap >= TMA_MIN


def tile_shared_memory_budget(device: torch.device | str | None) -> int:
    """Bytes of shared memory the LoRA, MoE and loss kernels let one program's pipelined tiles take on ``device``."""
    cap = capability(device)
    if cap is None:
        return _TILE_BUDGETS[0][1]
    if cap in _SMALL_SM:
        return _SMALL_SM_BUDGET
    for least, budget in _TILE_BUDGETS:
        if cap >= least:
            return budget
    return _SMALL_SM_BUDGET


def dispatch_rule(device: torch.device | str | None = None) -> dict[str, str]:
    """The kernels' generation-dependent choices on ``device``, in words: {setting: what ``auto`` takes}."""
    device = _resolve(device)
    tma, cutlass = has_tma(device), grouped_mm_fast(device)
    budget = tile_shared_memory_budget(device) // 1024
    return {
        "gemm_loads auto": "TMA descriptors (16-bit)" if tma else "pointer loads (no TMA)",
        "gemm_loads tma / persistent": "available" if tma else "refused (needs Hopper)",
        "moe_engine auto": ("grouped_mm for bf16 LoRA or coarse experts" if cutlass
                            else "triton (no CUTLASS grouped GEMM)"),
        "moe_scatter / moe_down_backward auto": "grouped_mm for bf16" if cutlass else "triton",
        "moe_loads persistent": "available" if tma else "refused (needs Hopper)",
        "loss accumulate auto": "tma" if tma and capability(device) is not None else "atomic",
        "LoRA tile shared memory": f"<= {budget} KiB per program",
    }


def describe(device: torch.device | str | None = None) -> dict[str, Any]:
    """What the kernels write for here: {'gpu_class', 'capability', 'device_capability', 'arch_override'} (the
    override as given, '' when unset)."""
    device = _resolve(device)
    cap = capability(device)
    real = _device_capability(device) if device.type == "cuda" else None
    return {
        "gpu_class": _class_of(cap),
        "capability": None if cap is None else f"{cap[0]}.{cap[1]}",
        "device_capability": None if real is None else f"{real[0]}.{real[1]}",
        "arch_override": os.environ.get(ARCH_ENV, "").strip(),
    }

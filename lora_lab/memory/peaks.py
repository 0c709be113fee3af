"""The most GPU memory each process of a notebook's run held: what a reader's rerun needs.

While ``$LORA_LAB_PEAK_DIR`` names a folder (``lora-lab run`` sets it for a notebook's kernel, so every process the
notebook starts inherits it: benchmark sessions, worker processes), each process that imports lora_lab and used
CUDA writes one JSON file there as it exits: its command, and the most memory PyTorch's caching allocator reserved and
allocated on any GPU. ``lab.finish_run`` adds the notebook's own process and records :func:`summary` in the run's
provenance (``gpu_memory``). Memory outside the allocator (the CUDA context, NCCL's buffers) is not counted, and
processes that ran at the same time are not added up.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

import torch

from lora_lab.memory.budget import GIB

__all__ = ["PEAK_DIR_ENV", "process_peak", "install", "collect", "summary"]

PEAK_DIR_ENV = "LORA_LAB_PEAK_DIR"


def process_peak() -> dict | None:
    """This process's peaks on its busiest GPU (bytes), or None when it never initialised CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    devices = range(torch.cuda.device_count())
    return {"pid": os.getpid(), "command": " ".join(Path(a).name if i == 0 else a for i, a in enumerate(sys.argv[:2])),
            "reserved_bytes": max(torch.cuda.max_memory_reserved(d) for d in devices),
            "allocated_bytes": max(torch.cuda.max_memory_allocated(d) for d in devices)}


def _write(directory: str, peak: dict | None = None) -> Path | None:
    try:  # an exit hook must not raise: CUDA torn down early, the run's folder gone -> nothing recorded
        peak = process_peak() if peak is None else peak
        if not peak:
            return None
        path = Path(directory) / f"process-{peak['pid']}.json"
        path.write_text(json.dumps(peak) + "\n")
        return path
    except Exception:  # noqa: BLE001
        return None


def install() -> bool:
    """At exit, write this process's peaks into ``$LORA_LAB_PEAK_DIR`` when it is set (``import lora_lab`` calls
    this); True when a folder was named."""
    directory = os.environ.get(PEAK_DIR_ENV, "").strip()
    if directory:
        atexit.register(_write, directory)
    return bool(directory)


def collect(directory: Path | str) -> list[dict]:
    """The peaks the processes wrote into ``directory`` (a file that is not one of theirs is skipped)."""
    out = []
    for path in sorted(Path(directory).glob("process-*.json")) if Path(directory).is_dir() else ():
        try:
            peak = json.loads(path.read_text())
            out.append({"pid": int(peak["pid"]), "command": str(peak.get("command", "")),
                        "reserved_bytes": int(peak["reserved_bytes"]), "allocated_bytes": int(peak["allocated_bytes"])})
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def summary(peaks: list[dict]) -> dict | None:
    """The largest process of ``peaks`` (by reserved bytes) in GiB, with how many processes used a GPU; None if none
    did."""
    if not peaks:
        return None
    largest = max(peaks, key=lambda p: p["reserved_bytes"])
    return {"processes": len(peaks), "largest_reserved_gib": round(largest["reserved_bytes"] / GIB, 3),
            "largest_allocated_gib": round(max(p["allocated_bytes"] for p in peaks) / GIB, 3),
            "largest_command": largest["command"]}

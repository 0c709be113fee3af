"""Benchmark sessions that finished, marked in their folders, so a later run keeps them instead of running them again.

A benchmark run split over calls of a lent GPU goes on where the last call stopped: each session (one process of a
script's ``--sessions``) that exits cleanly writes :data:`SESSION_COMPLETE` into its folder, holding what must match
for the session to count in a later pooled run — the script, its arguments, the session's index, the code hash and
the GPU with what the process forces (memory cap, GPU class). Anything else (no marker, an unreadable one, other
code, another card) is not done, so a pooled interval never mixes code or cards. Used by
:func:`lora_lab.lab.measure.run_script_sessions` and ``benchmarks/bench_moe.py``.
"""
from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

SESSION_COMPLETE = "session_complete.json"


def gpu_label() -> str:
    """The GPU a benchmark process times on, with what this process forces, e.g. ``NVIDIA H200 [memory cap 22
    GiB]``; ``"no CUDA device"`` without one. ``nvidia-smi`` names the first visible card where it can, so a parent
    that has not started CUDA (and should not: a context would hold memory beside its child's) and a child that has
    give the same name; else torch does."""
    from lora_lab.lab.provenance import forced_settings

    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return "no CUDA device"
    if not torch.cuda.is_available():
        return "no CUDA device"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", visible],
                              capture_output=True, text=True, timeout=30)
        name = done.stdout.strip().splitlines()[0].strip() if done.returncode == 0 and done.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        name = ""
    name = name or torch.cuda.get_device_name(torch.cuda.current_device())
    forced = forced_settings()
    return f"{name} [{forced}]" if forced else name


def session_key(script: str, args: Sequence[str], index: int) -> dict:
    """What a finished session's marker holds: ``script`` (its file name), ``args`` (those that shape the result,
    without the ones naming folders), the session ``index``, this code's hash and :func:`gpu_label`."""
    from lora_lab.lab import provenance

    return {"script": script, "args": [str(a) for a in args], "index": index, "code_hash": provenance.code_hash(),
            "device": gpu_label()}


def mark_done(part: Path | str, key: dict) -> None:
    """Mark the session folder ``part`` finished under ``key`` (call it once the session exited cleanly)."""
    Path(part).mkdir(parents=True, exist_ok=True)
    (Path(part) / SESSION_COMPLETE).write_text(json.dumps(key, indent=1) + "\n", encoding="utf-8")


def is_done(part: Path | str, key: dict) -> bool:
    """Whether ``part`` holds a session marked finished under exactly ``key``."""
    try:
        return json.loads((Path(part) / SESSION_COMPLETE).read_text(encoding="utf-8")) == key
    except (OSError, ValueError):
        return False


def clear(part: Path | str) -> None:
    """Drop ``part``'s marker before its session runs again (a run stopped part-way leaves none)."""
    (Path(part) / SESSION_COMPLETE).unlink(missing_ok=True)

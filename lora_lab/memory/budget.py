"""A GPU memory cap for the whole process, and the cells that shrink or skip under it.

``$LORA_LAB_MEMORY_CAP_GIB`` (set by the runner for the ``gpu-24g`` / ``gpu-40g`` profiles, or by hand) caps what
PyTorch's caching allocator may hold on each GPU: ``import lora_lab`` calls :func:`apply_memory_cap`, which sets
``torch.cuda.set_per_process_memory_fraction(cap / total)`` when CUDA initialises (before the first allocation),
in the notebook's kernel and in every benchmark process it starts. An allocation past the cap raises
``torch.OutOfMemoryError`` as on a card of that size. The CUDA context and memory that bypasses the allocator are
outside the cap: a real card of that size has a little less.

Sweep code asks :func:`fits` / :func:`skip_or_shrink` before a cell that would not fit, and runs it at a stated
smaller shape or skips it by name. :func:`note_skipped` keeps what was skipped and why; the recording adds it to
the run's metrics file (``skipped_cells``) and grading names it when a prediction's metric is missing.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MEMORY_CAP_ENV", "memory_cap_gib", "apply_memory_cap", "capacity_bytes", "fits", "Decision",
           "skip_or_shrink", "note_skipped", "note_out_of_memory", "skipped_cells", "clear_skipped", "worker_cap_gib",
           "OOM_FIGURES", "oom_figures"]

MEMORY_CAP_ENV = "LORA_LAB_MEMORY_CAP_GIB"
GIB = 1024 ** 3

_SIZE = r"([0-9.]+ [KMGT]?i?B)"
# the figures of a CUDA out-of-memory error, each as PyTorch's message words it and as :func:`oom_figures`' compact
# text (a benchmark row's) words it, in the order the compact text gives them
OOM_FIGURES = {
    "asked for": (rf"[Tt]ried to allocate {_SIZE}", rf"asked for {_SIZE}"),
    "the process held": (rf"this process has {_SIZE} memory in use", rf"the process held {_SIZE}"),
    "allocated by PyTorch": (rf"{_SIZE} is allocated by PyTorch", rf"allocated by PyTorch {_SIZE}"),
    "reserved but unallocated": (rf"{_SIZE} is reserved by PyTorch but unallocated",
                                 rf"reserved but unallocated {_SIZE}"),
}


def oom_figures(message: str) -> dict[str, str]:
    """The figures of a CUDA out-of-memory message (PyTorch's own, or the compact ``label size; ...`` text a
    benchmark row records), by :data:`OOM_FIGURES` label: what was asked for, what the process held, and the
    allocator's split of it, allocated against reserved but unallocated (under a cap, the second is fragmentation:
    memory the cap counts that no tensor uses). Labels not in the message are left out."""
    found = {}
    for label, patterns in OOM_FIGURES.items():
        match = next((m for p in patterns if (m := re.search(p, message))), None)
        if match:
            found[label] = match.group(1)
    return found


_skipped: dict[str, str] = {}


def memory_cap_gib(environ: dict | None = None) -> float | None:
    """The cap in GiB from ``$LORA_LAB_MEMORY_CAP_GIB``, or None (unset or empty); a ValueError naming the variable
    for anything but a positive number."""
    text = (os.environ if environ is None else environ).get(MEMORY_CAP_ENV, "").strip()
    if not text:
        return None
    try:
        cap = float(text)
    except ValueError:
        cap = float("nan")
    if not cap > 0 or cap == float("inf"):
        raise ValueError(f"${MEMORY_CAP_ENV}={text!r}: expected a positive number of GiB (e.g. 22), or nothing")
    return cap


def _fraction(cap_gib: float, total_bytes: int) -> float:
    return min(1.0, cap_gib * GIB / total_bytes)


def apply_memory_cap(cap_gib: float | None = None) -> float | None:
    """Cap the caching allocator of every visible GPU at ``cap_gib`` (default: ``$LORA_LAB_MEMORY_CAP_GIB``) once CUDA
    initialises (at once if it already has); returns the cap, or None when there is none. Without CUDA nothing
    happens."""
    cap = memory_cap_gib() if cap_gib is None else float(cap_gib)
    if cap is None:
        return None

    def set_fractions():
        for index in range(torch.cuda.device_count()):
            total = torch.cuda.get_device_properties(index).total_memory
            torch.cuda.set_per_process_memory_fraction(_fraction(cap, total), index)

    lazy = getattr(torch.cuda, "_lazy_call", None)
    if lazy is not None:
        lazy(set_fractions)  # queued until CUDA initialises; run now if it already has
    elif torch.cuda.is_available():
        set_fractions()
    return cap


def worker_cap_gib(workers: int, device: torch.device | str | None = None) -> float | None:
    """The cap each of ``workers`` processes started now should apply (:func:`apply_memory_cap`) so that, with what
    this process holds on ``device``, together they stay under ``$LORA_LAB_MEMORY_CAP_GIB``, as they would have to
    on a card of that size: None without a cap; a ValueError when nothing is left to share."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    cap = memory_cap_gib()
    if cap is None:
        return None
    device = torch.device(device) if device is not None else torch.device("cpu")
    held = torch.cuda.memory_reserved(device) / GIB if device.type == "cuda" else 0.0
    share = (cap - held) / workers
    if share <= 0:
        raise ValueError(f"the {cap:g} GiB cap leaves nothing for {workers} worker processes: this process holds "
                         f"{held:.1f} GiB on {device}")
    return share


def capacity_bytes(device: torch.device | str | None = None) -> int | None:
    """Bytes the process may hold on ``device``: the cap, or the GPU's total memory when smaller (or when there is no
    cap); None on the CPU without a cap (no limit this module knows)."""
    cap = memory_cap_gib()
    cap_bytes = None if cap is None else int(cap * GIB)
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return total if cap_bytes is None else min(total, cap_bytes)
    return cap_bytes


def fits(estimated_bytes: int | float, device: torch.device | str | None = None, capacity: int | None = None) -> bool:
    """Whether a cell that needs ``estimated_bytes`` at its peak fits ``capacity`` (default :func:`capacity_bytes`;
    None: no limit)."""
    if not estimated_bytes >= 0:
        raise ValueError(f"estimated_bytes must be a number >= 0; got {estimated_bytes!r}")
    limit = capacity_bytes(device) if capacity is None else capacity
    return limit is None or estimated_bytes <= limit


def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def _limit_text(capacity: int) -> str:
    cap = memory_cap_gib()
    source = f"the memory cap (${MEMORY_CAP_ENV}={cap:g})" if cap is not None else "this GPU"
    return f"{source} allows {_gib(capacity)}"


@dataclass(frozen=True)
class Decision:
    """What :func:`skip_or_shrink` decided for one cell: its ``shape`` (None: skipped) and, unless it runs as asked,
    ``reason``."""

    cell: str
    shape: Any
    reason: str = ""

    @property
    def skipped(self) -> bool:
        return self.shape is None

    @property
    def shrunk(self) -> bool:
        return self.shape is not None and bool(self.reason)


def skip_or_shrink(cell: str, shapes: Sequence[Any], estimate: Callable[[Any], float],
                   device: torch.device | str | None = None, capacity: int | None = None) -> Decision:
    """The first of ``shapes`` (the cell's own shape first, then the stated smaller ones) whose ``estimate(shape)``
    bytes fit, or a skip; a shrink or a skip is kept by :func:`note_skipped` under ``cell``, with the reason."""
    if not isinstance(cell, str) or not cell:
        raise ValueError(f"cell must be a non-empty name; got {cell!r}")
    if not shapes:
        raise ValueError(f"cell {cell!r}: give at least one shape")
    limit = capacity_bytes(device) if capacity is None else capacity
    needs = []
    for index, shape in enumerate(shapes):
        need = estimate(shape)
        if fits(need, capacity=limit):
            if index == 0:
                return Decision(cell, shape)
            reason = (f"shrunk from {shapes[0]!r} (needs about {_gib(needs[0])}) to {shape!r}: "
                      f"{_limit_text(limit)}")
            note_skipped(cell, reason)
            return Decision(cell, shape, reason)
        needs.append(need)
    tried = ", ".join(f"{shape!r} about {_gib(need)}" for shape, need in zip(shapes, needs))
    reason = f"skipped: needs more than {_limit_text(limit)} ({tried})"
    note_skipped(cell, reason)
    return Decision(cell, None, reason)


def note_skipped(cell: str, reason: str) -> None:
    """Keep that ``cell`` was skipped or shrunk, and why (the run's recording reads :func:`skipped_cells`)."""
    if not isinstance(cell, str) or not cell:
        raise ValueError(f"cell must be a non-empty name; got {cell!r}")
    _skipped[cell] = str(reason)


def note_out_of_memory(cell: str, what: str) -> None:
    """Under a memory cap, keep that ``what`` (an implementation, a variant) ran out of memory in ``cell``; the names
    of one cell gather in one reason. Without a cap nothing is kept: an OOM on the whole card is the measurement's
    own result."""
    cap = memory_cap_gib()
    if cap is None:
        return
    prefix = f"ran out of memory under the {cap:g} GiB memory cap (${MEMORY_CAP_ENV}): "
    earlier = _skipped.get(cell, "")
    names = earlier[len(prefix):].split(", ") if earlier.startswith(prefix) else []
    if what not in names:
        names.append(what)
    note_skipped(cell, prefix + ", ".join(names))


def skipped_cells() -> dict[str, str]:
    """{cell: reason} of the cells skipped or shrunk in this process since :func:`clear_skipped`."""
    return dict(_skipped)


def clear_skipped() -> None:
    _skipped.clear()

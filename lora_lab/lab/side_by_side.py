"""Which notebooks run side by side on one GPU (``lora-lab run --parallel``, ``tools/gpu_queue.py``), and running
a group of them at once."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lora_lab.lab.kernel_processes import interrupt_kernels
from lora_lab.lab.profiles import get_profile

__all__ = ["SHARES_THE_GPU", "side_by_side_allowed", "side_by_side_groups", "run_side_by_side"]

# notebooks whose verdicts are numerics, memory (each process's own peak) and counts, never a time: run side by side
# under --parallel. A notebook not listed runs alone
SHARES_THE_GPU = frozenset({"01", "02", "03", "04"})


def side_by_side_allowed(profile: str, parallel: int) -> int:
    """How many notebooks may run at once on ``profile``: ``parallel``, or 1 under a memory cap (it stands for one
    card's memory, which processes side by side would share)."""
    return 1 if get_profile(profile).memory_cap_gib is not None else parallel


def side_by_side_groups(notebooks: list[Path], parallel: int, alone: set[Path] | None = None) -> list[list[Path]]:
    """``notebooks`` in order, cut into what runs at once: consecutive notebooks of :data:`SHARES_THE_GPU` together,
    up to ``parallel`` in a group, every other one (and each in ``alone``) in a group of its own."""
    groups: list[list[Path]] = []
    previous_shares = False
    for path in notebooks:
        shares = parallel > 1 and path.stem[:2] in SHARES_THE_GPU and path not in (alone or set())
        if shares and previous_shares and len(groups[-1]) < parallel:
            groups[-1].append(path)
        else:
            groups.append([path])
        previous_shares = shares
    return groups


def run_side_by_side(run_one: Callable, plans: list, profile: str, output_dir: Path,
                     cell_timeout: float | None) -> list:
    """``run_one`` (the runner's ``run_notebook``) for each plan at once, each in a thread of its own (its kernel a
    process of its own); the results in the plans' order. Ctrl-C (here, in the main thread) interrupts every kernel,
    and each notebook ends recorded as interrupted."""
    with ThreadPoolExecutor(max_workers=len(plans), thread_name_prefix="notebook") as pool:
        futures = [pool.submit(run_one, plan, profile, output_dir, cell_timeout, False) for plan in plans]
        results = []
        for future in futures:
            while True:
                try:
                    results.append(future.result())
                    break
                except KeyboardInterrupt:
                    interrupt_kernels()  # and wait for the notebooks to record it
    return results

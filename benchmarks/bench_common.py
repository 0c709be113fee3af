"""Command-line plumbing shared by the benchmark scripts (timing and CSVs are :mod:`lora_lab.lab.measure`'s).

* :func:`check_device` — CUDA, or for ``--smoke`` the CPU with Triton's interpreter;
* :func:`add_common_arguments` / :func:`chosen_variants` — ``--out``, ``--repetitions``, ``--smoke`` and
  ``--variants`` the same way in every script;
* :func:`repetition_dots` — every repetition's value as a point over a bar or line (the spread a median hides);
* :func:`is_oom` — whether an exception is the GPU running out of memory (a recorded result, not a crash);
* :func:`error_text` — an exception as the one-line text an ``error`` row records.
"""
from __future__ import annotations

import argparse
import os

import torch

from lora_lab.lab import measure


def check_device(smoke: bool) -> torch.device:
    """CUDA when present; without it only ``--smoke`` runs, on the CPU, with the kernels in Triton's interpreter
    (``TRITON_INTERPRET=1`` must be set before Triton is imported, so the caller sets it, not this script)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not smoke:
        raise SystemExit("this benchmark needs a CUDA GPU (--smoke runs its code path on the CPU)")
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--smoke on a CPU runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    torch.set_num_threads(1)  # tiny tensors: more threads only spin-wait, the more so on a shared CPU
    return torch.device("cpu")


def device_line(device: torch.device, dtype, repetitions: int, extra: str = "") -> str:
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    return (f"torch {torch.__version__}, triton {triton.__version__}, {name}, {str(dtype).removeprefix('torch.')}, "
            f"{repetitions} repetitions{', ' + extra if extra else ''}")


def add_common_arguments(ap: argparse.ArgumentParser, all_variants, default_variants, smoke_help: str) -> None:
    ap.add_argument("--out", required=True, help="output directory for the CSVs and plots")
    ap.add_argument("--repetitions", type=int, default=measure.MIN_REPETITIONS,
                    help="independent side-by-side loops (default %(default)s = measure.MIN_REPETITIONS)")
    ap.add_argument("--variants", nargs="+", default=list(default_variants),
                    help=f"what to time besides {', '.join(default_variants)} (always), 'all' for every one: "
                         + " ".join(all_variants))
    ap.add_argument("--smoke", action="store_true", help=smoke_help + " (CPU: set TRITON_INTERPRET=1); no peak memory")


def chosen_variants(ap: argparse.ArgumentParser, args, all_variants, default_variants) -> list[str]:
    """The variants to time, in ``all_variants``' order: the defaults plus those asked for."""
    if args.repetitions < 1:
        ap.error("--repetitions must be >= 1")
    wanted = set(all_variants) if "all" in args.variants else set(args.variants)
    unknown = wanted - set(all_variants)
    if unknown:
        ap.error(f"unknown variants: {', '.join(sorted(unknown))} (known: {' '.join(all_variants)})")
    return [v for v in all_variants if v in wanted | set(default_variants)]


def repetition_dots(ax, x: float, values) -> None:
    """Every repetition's value as a small black dot at ``x``."""
    values = [v for v in values if v is not None]
    ax.plot([x] * len(values), values, "k.", ms=3, zorder=3)


def is_oom(exc: BaseException) -> bool:
    """True for torch's out-of-memory error, and for cuBLAS reporting a failed workspace allocation (a plain
    RuntimeError)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(
        s in str(exc) for s in ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED"))


def error_text(exc: BaseException, limit: int = 300) -> str:
    """``exc`` as the text an ``error`` row records: its type and message, cut to ``limit`` characters."""
    return f"{type(exc).__name__}: {exc}"[:limit]

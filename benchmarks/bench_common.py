"""Command-line plumbing shared by the benchmark scripts (timing and CSVs are :mod:`lora_lab.lab.measure`'s).

* :func:`check_device` — CUDA, or for ``--smoke`` the CPU with Triton's interpreter;
* :func:`add_common_arguments` / :func:`chosen_variants` — ``--out``, ``--repetitions``, ``--smoke`` and
  ``--variants`` the same way in every script;
* :func:`add_timing_arguments` / :func:`time_call` — the primary figure, the same way in every script: the median of
  ``measure.loop_ms`` (CUDA events around each whole call, synchronised after each, so host time counts), with
  labelled secondary columns: ``kernel_ms`` (``measure.kernel_ms``, profiler device time per call) and
  ``back_to_back_ms`` (``measure.kernel_loop_ms``, ``do_bench``'s unsynchronised loop);
* :func:`repetition_dots` — every repetition's value as a point over a bar or line (the spread a median hides);
* :func:`is_oom` — whether an exception is the GPU running out of memory (a recorded result, not a crash);
* :func:`error_text` — an exception as the one-line text an ``error`` row records (a CUDA OOM as its figures,
  :func:`oom_text`, so the allocator's split is never cut away); :func:`failed_cell` — a failed cell's status and text;
* :func:`session_argv` — a script's own arguments for one child session (``--out`` replaced, ``--sessions`` dropped);
* :func:`without_options` — arguments less some options and their values;
* :func:`add_ledger_argument` / :func:`write_summary` — ``--ledger``: the summary CSV's figures also appended to
  the measurement ledger (:mod:`lora_lab.lab.ledger`); off unless asked for.
"""
from __future__ import annotations

import argparse
import os

import torch

from lora_lab.lab import measure
from lora_lab.memory import budget


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


def gpu_arch_text(device: torch.device) -> str:
    """The GPU class the kernels write for, whether ``$LORA_LAB_ARCH`` forced it, and the memory cap if one is set:
    e.g. ``class ampere, forced by LORA_LAB_ARCH=sm80 (device 9.0); memory cap 22 GiB``."""
    from lora_lab import gpu_arch
    from lora_lab.memory import budget

    about = gpu_arch.describe(device)
    text = f"class {about['gpu_class']}"
    if about["arch_override"]:
        text += f", forced by {gpu_arch.ARCH_ENV}={about['arch_override']} (device {about['device_capability']})"
    cap = budget.memory_cap_gib()
    return text + (f"; memory cap {cap:g} GiB" if cap is not None else "")


def device_line(device: torch.device, dtype, repetitions: int, extra: str = "") -> str:
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)"
    if device.type == "cuda":
        name += f" ({gpu_arch_text(device)})"
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
    add_ledger_argument(ap)


def add_ledger_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--ledger", default=None, metavar="cpu|gpu|FILE.csv",
                    help="also append the summary's figures to the measurement ledger: outputs/<cpu|gpu>/"
                         "measurements.csv, or a ledger file (e.g. one to bring back from another machine)")


def write_summary(rows: list[dict], path, args, benchmark: str | None = None):
    """``measure.write_csv(rows, path)``; with ``--ledger``, every figure of the written table (as
    :func:`lora_lab.lab.ledger.table_figures` reads it) also goes into the ledger, filed under ``benchmark``
    (default: the table's name, :func:`lora_lab.lab.ledger.table_name`). Returns the CSV's path."""
    path = measure.write_csv(rows, path)
    ledger_csv(path, args, benchmark)
    return path


def ledger_csv(path, args, benchmark: str | None = None, repetitions: bool = False) -> int:
    """With ``--ledger``, the figures of the CSV at ``path`` appended to the ledger it names, filed under
    ``benchmark`` (default: :func:`lora_lab.lab.ledger.table_name`): a summary table's figures
    (:func:`lora_lab.lab.ledger.table_figures`), or with ``repetitions`` a table of repetitions' (``rep`` and
    ``ms`` columns, e.g. a components table: each method's median and 95% interval,
    :func:`lora_lab.lab.ledger.repetition_figures`). Returns how many were appended (0 without ``--ledger``)."""
    from pathlib import Path

    target = getattr(args, "ledger", None)
    if not target:
        return 0
    from lora_lab.lab import ledger

    read = ledger.repetition_figures if repetitions else ledger.table_figures
    figures = read(measure.read_csv(path, require_current=False),
                   benchmark=benchmark or ledger.table_name(path), source=Path(path).name)
    profile = "gpu" if torch.cuda.is_available() else "cpu"
    where = ledger.append_measurements(figures, profile=target if target in ledger.PROFILES else profile,
                                       ledger=None if target in ledger.PROFILES else Path(target))
    print(f"{len(figures)} figures appended to {where}", flush=True)
    return len(figures)


SECONDARY = ("kernel", "back_to_back")


def add_timing_arguments(ap: argparse.ArgumentParser, calls: int = 10, warmup: int = 3,
                         secondary=SECONDARY) -> None:
    """``--calls``/``--warmup`` of the primary loop and ``--secondary``: which labelled secondary columns."""
    ap.add_argument("--calls", type=int, default=calls,
                    help="measure.loop_ms: timed calls per variant and repetition; the primary figure is their median")
    ap.add_argument("--warmup", type=int, default=warmup, help="measure.loop_ms: untimed calls before them")
    ap.add_argument("--secondary", nargs="*", default=list(secondary), choices=list(SECONDARY),
                    help="labelled secondary columns: kernel = kernel_ms (torch.profiler device time per call), "
                         "back_to_back = back_to_back_ms (triton do_bench, calls queued without synchronisation)")
    ap.add_argument("--rep-ms", type=float, default=50.0, help="back_to_back: milliseconds of do_bench's timed calls")
    ap.add_argument("--warmup-ms", type=float, default=10.0, help="back_to_back: milliseconds of do_bench's warm-up")


def time_call(step, args, calls: int | None = None) -> dict:
    """One variant's timing in one repetition: ``ms`` (median of ``measure.loop_ms``, the primary figure),
    ``ms_each`` (every timed call) and, as ``args.secondary`` asks, ``kernel_ms`` / ``back_to_back_ms``."""
    import statistics

    if args.calls < 1 or args.warmup < 0:
        raise SystemExit(f"--calls must be >= 1 and --warmup >= 0 (got {args.calls}, {args.warmup})")
    calls = calls or args.calls
    smoke = getattr(args, "smoke", False)  # the interpreter: the code path with as few calls as it takes
    times = measure.loop_ms(step, calls=min(calls, 2) if smoke else calls, warmup=0 if smoke else args.warmup)
    row = {"ms": statistics.median(times), "ms_each": " ".join(f"{t:.4f}" for t in times), "timing": "loop"}
    if "kernel" in args.secondary:
        row["kernel_ms"] = measure.kernel_ms(step, calls=1 if smoke else min(calls, 3), warmup=0)
    if "back_to_back" in args.secondary:  # do_bench needs CUDA: no such column on a CPU
        row["back_to_back_ms"] = (measure.kernel_loop_ms(step, args.warmup_ms, args.rep_ms)
                                  if torch.cuda.is_available() else None)
    return row


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


def oom_text(exc: BaseException) -> str | None:
    """A CUDA out-of-memory error as its figures alone (``OutOfMemoryError: CUDA out of memory: asked for 3.91 GiB;
    the process held 20.05 GiB; allocated by PyTorch 19.40 GiB; reserved but unallocated 0.12 GiB``,
    :func:`budget.oom_figures`), or None when the message holds none of them. PyTorch's message gives the card's
    free memory and other processes first and the allocator's split last, past what a cut row keeps; under a memory
    cap that split is what tells fragmentation (reserved but unallocated) from need."""
    found = budget.oom_figures(str(exc))
    if not found:
        return None
    figures = "; ".join(f"{label} {value}" for label, value in found.items())
    return f"{type(exc).__name__}: CUDA out of memory: {figures}"


def error_text(exc: BaseException, limit: int = 300) -> str:
    """``exc`` as the text an ``error`` row records: its type and message, cut to ``limit`` characters; a CUDA
    out-of-memory error as its figures (:func:`oom_text`), so none is cut away."""
    compact = oom_text(exc) if is_oom(exc) else None
    return (compact or f"{type(exc).__name__}: {exc}")[:limit]


def failed_cell(exc: BaseException) -> tuple[str, str]:
    """A failed cell's ``(status, error)``: ``oom`` with :func:`error_text`, else ``error`` with the message's first
    line (the traceback is printed apart)."""
    if is_oom(exc):
        return "oom", error_text(exc)
    return "error", f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"


def without_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` without the options ``names`` and their values (both spellings, ``--x v`` and ``--x=v``)."""
    result, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        if a.startswith(tuple(f"{n}=" for n in names)):
            continue
        result.append(a)
    return result


def session_argv(argv: list[str], out) -> list[str]:
    """``argv`` without its ``--out`` and ``--sessions`` (both spellings, ``--x v`` and ``--x=v``), then
    ``--out out``: the arguments of one child session of a script that runs itself once per session."""
    return [*without_options(argv, ("--out", "--sessions")), "--out", str(out)]

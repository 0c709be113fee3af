"""Timing, repetitions and benchmark CSVs: one module for every benchmark and notebook that measures speed.

* :func:`cuda_ms` — milliseconds per call of a function, by CUDA events after a warm-up (the median of
  ``triton.testing.do_bench`` when Triton is there); one *timed loop*.
* :func:`repeat` — a timing verdict never rests on one loop: it runs the whole side-by-side comparison
  ``n`` times (independent loops, variants interleaved) and :func:`summarize` gives the median and a 95%
  bootstrap interval of each quantity — what :func:`lora_lab.lab.record` stores and grading reads.
* :func:`event_ms` — milliseconds of each of a few calls by CUDA events around each: for calls too long for
  ``do_bench``'s estimate loop (a training step, a Python loop over experts).
* :func:`write_csv` / :func:`read_csv` — every row carries the code hash of the package that wrote it, and
  ``read_csv`` refuses rows written by other code.
* :func:`rotation` — the order of the variants within one repetition of a side-by-side loop.
* :func:`by_repetition` / :func:`repetition_ratios` — a benchmark CSV holds one row per (cell, variant,
  repetition); these pair the rows of two variants repetition by repetition (the samples of a ratio).
"""
from __future__ import annotations

import csv
import gc
import math
import random
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

__all__ = [
    "MIN_REPETITIONS",
    "cuda_ms",
    "event_ms",
    "peak_bytes",
    "training_step_ms",
    "repeat",
    "rotation",
    "summarize",
    "bootstrap_median_ci",
    "write_csv",
    "read_csv",
    "by_repetition",
    "repetition_ratios",
    "StaleResultError",
]

MIN_REPETITIONS = 5  # a time or throughput prediction is graded on at least this many independent loops


class StaleResultError(RuntimeError):
    """A results file was written by other code than the code reading it."""


def _cuda():
    import torch

    return torch if torch.cuda.is_available() else None


def cuda_ms(fn: Callable[[], object], warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """Median milliseconds per call of ``fn`` over about ``rep_ms`` of calls (CUDA events; L2 flushed by
    ``triton.testing.do_bench``). Without CUDA, the median wall time of a few calls (CPU smoke runs)."""
    torch = _cuda()
    if torch is None:
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def event_ms(fn: Callable[[], object], calls: int = 1, warmup: int = 0) -> list[float]:
    """Milliseconds of each of ``calls`` consecutive calls of ``fn`` after ``warmup`` untimed ones (CUDA events
    around each call, synchronised after it). For long calls, where ``cuda_ms``'s estimate loop would spend
    seconds of device time. Without CUDA, the wall time of each call (CPU smoke runs)."""
    if calls < 1:
        raise ValueError(f"event_ms needs calls >= 1, got {calls}")
    for _ in range(warmup):
        fn()
    torch = _cuda()
    times = []
    if torch is None:
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return times
    torch.cuda.synchronize()
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(float(start.elapsed_time(end)))
    return times


def peak_bytes(fn: Callable[[], object]) -> tuple[int, int]:
    """(peak bytes allocated during one call of ``fn``, bytes allocated before it); CUDA only."""
    torch = _cuda()
    if torch is None:
        raise RuntimeError("peak_bytes reads torch.cuda.max_memory_allocated and needs a CUDA device")
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated()), int(before)


def training_step_ms(model, loss_fn: Callable[[object], object], steps: int, lr: float = 1e-4,
                     measure_peak: bool = True) -> tuple[list[float], list[float], int | None]:
    """Time training steps of ``model``: ``loss_fn(model)`` → backward → AdamW (a fresh one over the trainable
    parameters, torch defaults besides ``lr``). One untimed warm-up step (optimizer state; compile / autotune the
    first time), with ``measure_peak`` (CUDA) one more untimed step for :func:`peak_bytes`, then ``steps`` steps
    timed by :func:`event_ms`. Returns (milliseconds of each timed step, the loss of every step, peak bytes or
    None)."""
    import torch

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []

    def step():
        loss = loss_fn(model)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    step()
    peak = peak_bytes(step)[0] if measure_peak else None
    times = event_ms(step, calls=steps)
    return times, [float(v) for v in losses], peak


def bootstrap_median_ci(samples: Sequence[float], level: float = 0.95, n_boot: int = 4000,
                        seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of ``samples`` (resampled with replacement)."""
    values = [float(v) for v in samples]
    if not values:
        raise ValueError("no samples")
    if len(values) == 1:
        return values[0], values[0]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n_boot))
    tail = (1.0 - level) / 2.0
    low = medians[int(math.floor(tail * (n_boot - 1)))]
    high = medians[int(math.ceil((1.0 - tail) * (n_boot - 1)))]
    return low, high


def summarize(samples: Iterable[float]) -> dict:
    """``{"median", "ci95": [low, high], "level", "min", "max", "n", "samples"}`` of repeated measurements.

    This is the form of a repeated metric: :func:`lora_lab.lab.record` stores it as is, grading compares the
    interval with a prediction's threshold (an interval that straddles it grades *inconclusive*).
    """
    values = [float(v) for v in samples]
    if not values or not all(math.isfinite(v) for v in values):
        raise ValueError(f"summarize needs finite samples, got {values!r}")
    low, high = bootstrap_median_ci(values, level=0.95)
    return {"median": statistics.median(values), "ci95": [low, high], "level": 0.95, "min": min(values),
            "max": max(values), "n": len(values), "samples": values}


def repeat(measure_once: Callable[[], dict], n: int = MIN_REPETITIONS, progress: str | None = None) -> dict:
    """Run ``measure_once()`` — one complete side-by-side loop returning ``{quantity: value}`` — ``n`` times and
    summarise each quantity over the repetitions (``{quantity: summarize(...)}``)."""
    if n < 1:
        raise ValueError(f"repeat needs n >= 1, got {n}")
    from tqdm.auto import tqdm

    runs = [measure_once() for _ in tqdm(range(n), desc=progress or "repetitions", disable=progress is None)]
    keys = list(dict.fromkeys(k for run in runs for k in run))
    return {k: summarize(run[k] for run in runs if k in run) for k in keys}


def rotation(names: Sequence, rep: int) -> list:
    """The variants' order in repetition ``rep`` of a side-by-side loop: rotated by one each repetition, so no
    variant always runs first (or right after the same neighbour)."""
    names = list(names)
    k = rep % len(names) if names else 0
    return names[k:] + names[:k]


def write_csv(rows: list[dict], path: Path | str, code_hash: str | None = None) -> Path:
    """Write ``rows`` with provenance columns ``code_hash``, ``git_commit`` and ``git_dirty`` in every row."""
    from lora_lab.lab.provenance import code_hash as current_code_hash
    from lora_lab.lab.provenance import git_state

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    git = git_state()
    stamp = {"code_hash": code_hash or current_code_hash(), "git_commit": git["git_commit"] or "",
             "git_dirty": "" if git["git_dirty"] is None else git["git_dirty"]}
    keys: list[str] = []
    for row in rows:
        keys.extend(k for k in row if k not in keys)
    keys += [k for k in stamp if k not in keys]
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows({**row, **stamp} for row in rows)
    return path


def read_csv(path: Path | str, require_current: bool = True) -> list[dict]:
    """Rows of a CSV written by :func:`write_csv`; numbers parsed. Refuses (``StaleResultError``) a file
    whose rows carry another code hash than the package reading it, or none."""
    from lora_lab.lab.provenance import code_hash as current_code_hash

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such results file (run the benchmark that writes it first)")
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    if require_current:
        current = current_code_hash()
        hashes = {row.get("code_hash") for row in rows}
        if hashes != {current}:
            found = ", ".join(sorted(str(h)[:12] for h in hashes)) or "none"
            raise StaleResultError(
                f"{path} was written by other code (code hash {found}; this code is {current[:12]}): "
                "run its benchmark again with this code"
            )
    return [{k: _parse(v) for k, v in row.items()} for row in rows]


def _parse(text):
    if text is None or text == "":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(text, text)


def by_repetition(rows: Iterable[dict], value: str, **match) -> dict[int, float]:
    """``{rep: row[value]}`` over the rows whose columns equal ``match`` (one row per repetition; rows whose
    ``value`` is empty — a variant that ran out of memory — are left out)."""
    found: dict[int, float] = {}
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()) and row.get(value) is not None:
            rep = int(row["rep"])
            if rep in found:
                raise ValueError(f"two rows for repetition {rep} of {match}")
            found[rep] = float(row[value])
    return found


def repetition_ratios(rows: Iterable[dict], value: str, numerator: dict, denominator: dict) -> list[float]:
    """``numerator[value] / denominator[value]`` per repetition (rows paired by their ``rep``), in rep order.

    Both sides must have been measured in the same repetitions: a ratio pairs two variants timed in the same
    side-by-side loop, never numbers from different loops."""
    rows = list(rows)
    top = by_repetition(rows, value, **numerator)
    bottom = by_repetition(rows, value, **denominator)
    if not top or top.keys() != bottom.keys():
        raise ValueError(f"{value}: repetitions of {numerator} ({sorted(top)}) and {denominator} "
                         f"({sorted(bottom)}) do not pair up")
    return [top[rep] / bottom[rep] for rep in sorted(top)]

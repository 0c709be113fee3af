"""Timing, repetitions and benchmark CSVs: one module for every benchmark and notebook that measures speed.

The primary figure of every timed comparison is what a user's loop pays (DESIGN.md, "Measuring"):

* :func:`loop_ms` — milliseconds of each of ``calls`` calls of the whole call a user makes (fwd + bwd, or a whole
  optimizer step): CUDA events around each call and ``torch.cuda.synchronize()`` after it, so the call's host time
  (Python, launches, an op's own syncs) counts; warm-up first. Without CUDA, ``time.perf_counter`` per call.
* :func:`kernel_ms` — a second, labelled figure: device time of the kernels one call launches (``torch.profiler``,
  summed over the calls, divided by their number). Host time is not in it.
* :func:`kernel_loop_ms` — the old back-to-back figure (``triton.testing.do_bench``: calls queued with no
  synchronisation, so an op's host time hides behind its own GPU work). Only as a labelled secondary column.
* :func:`repeat` — a timing verdict never rests on one loop: it runs the whole side-by-side comparison
  ``n`` times (independent loops, variants in :func:`rotation` order) and :func:`summarize` gives the median and a
  95% bootstrap interval of each quantity — what :func:`lora_lab.lab.record` stores and grading reads.
* :func:`repeat_in_processes` — the same, the repetitions split over ``n_sessions`` separate Python processes
  (``python -m lora_lab.lab.measure``, one after another) and pooled: an interval then spans session-to-session
  spread too. Every summary carries ``"sessions"``: how many processes its samples came from.
* :func:`run_script_sessions` — a benchmark script run once per session in processes of its own, pooled; a
  session that this code already finished with the same arguments on the same GPU (:mod:`lora_lab.lab.resume_marks`)
  is kept, so a run cut short by a time limit resumes where it stopped, on the next call of a lent GPU.
* :func:`write_csv` / :func:`read_csv` — every row carries the code hash of the package that wrote it, and
  ``read_csv`` refuses rows written by other code.
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

from lora_lab.lab import resume_marks
from lora_lab.lab.host_time import _cuda, host_ms_busy, host_profile  # the host's time behind a busy device

__all__ = [
    "MIN_REPETITIONS",
    "loop_ms",
    "kernel_ms",
    "kernel_loop_ms",
    "event_ms",
    "host_ms",
    "host_ms_busy",
    "host_profile",
    "peak_bytes",
    "training_step_ms",
    "repeat",
    "repeat_in_processes",
    "pool_sessions",
    "sessions_in",
    "pool_csv_sessions",
    "run_script_sessions",
    "process_folder",
    "ratio_summary",
    "MIN_SESSIONS",
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
MIN_SESSIONS = 2  # a speed ratio's interval spans at least this many separate processes


class StaleResultError(RuntimeError):
    """A results file was written by other code than the code reading it."""


def _timed_call(torch, fn: Callable[[], object]) -> float:
    """Milliseconds of one call of ``fn`` as the user's loop pays it: CUDA events around it and a synchronisation
    after it (the caller starts it on an idle device), or ``time.perf_counter`` without CUDA."""
    if torch is None:
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end))


def _turns(fns: dict[str, Callable[[], object]], calls: int, warmup: int, name: str) -> dict[str, list[float]]:
    """The timed loop of :func:`loop_ms` and :func:`interleaved_loop_ms` (``name`` says which, in errors)."""
    if calls < 1:
        raise ValueError(f"{name} needs calls >= 1, got {calls}")
    if warmup < 0:
        raise ValueError(f"{name} needs warmup >= 0, got {warmup}")
    torch = _cuda()
    for _ in range(warmup):
        for fn in fns.values():
            fn()
            if torch is not None:
                torch.cuda.synchronize()
    if torch is not None:
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {key: [] for key in fns}
    for _ in range(calls):
        for key, fn in fns.items():
            times[key].append(_timed_call(torch, fn))
    return times


def loop_ms(fn: Callable[[], object], calls: int = 10, warmup: int = 2) -> list[float]:
    """Milliseconds of each of ``calls`` calls of ``fn`` after ``warmup`` untimed ones: the user's loop.

    On CUDA each call sits between two CUDA events and is followed by ``torch.cuda.synchronize()``, so the next
    call starts on an idle device and everything the call costs — host time, launches, its own syncs, GPU work —
    is inside its interval. Without CUDA, ``time.perf_counter`` around each call (CPU smoke runs).
    """
    return _turns({"call": fn}, calls, warmup, "loop_ms")["call"]


def interleaved_loop_ms(fns: dict[str, Callable[[], object]], calls: int = 10,
                        warmup: int = 2) -> dict[str, list[float]]:
    """:func:`loop_ms` of several callables taken in turns: round k times call k of each, in ``fns``' order.

    Each call is timed exactly as :func:`loop_ms` times it (events around it, synchronised after it), so every
    figure is still the user's loop; only the order differs. Consecutive blocks of one callable sit seconds apart,
    and whatever drifts in between (clocks, temperature, the allocator's state, other processes on the host) lands
    on one of them; in turns, it lands on all of them alike, so a ratio of two medians compares like with like.
    ``warmup`` untimed rounds first. Returns ``{name: [ms of each timed call]}``."""
    if not fns:
        raise ValueError("interleaved_loop_ms needs at least one callable")
    return _turns(fns, calls, warmup, "interleaved_loop_ms")


def host_ms(fn: Callable[[], object], calls: int = 10, warmup: int = 2) -> list[float]:
    """Host milliseconds of each of ``calls`` calls of ``fn``: ``time.perf_counter`` from the call to its return,
    the device synchronised before each call and after it (outside the interval). What the call costs the CPU —
    Python, checks, allocations, launches — while its kernels run; a host time above the call's GPU time makes a
    step host-bound. Shown beside :func:`loop_ms`, never instead of it."""
    if calls < 1:
        raise ValueError(f"host_ms needs calls >= 1, got {calls}")
    if warmup < 0:
        raise ValueError(f"host_ms needs warmup >= 0, got {warmup}")
    torch = _cuda()

    def sync():
        if torch is not None:
            torch.cuda.synchronize()

    for _ in range(warmup):
        fn()
        sync()
    times = []
    for _ in range(calls):
        sync()
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
        sync()
    return times


def event_ms(fn: Callable[[], object], calls: int = 1, warmup: int = 0) -> list[float]:
    """:func:`loop_ms` with the defaults of its older name (one call, no warm-up): kept for callers that use it."""
    return loop_ms(fn, calls=calls, warmup=warmup)


def kernel_ms(fn: Callable[[], object], calls: int = 5, warmup: int = 2) -> float:
    """Kernel-only milliseconds per call of ``fn``: the device time of every kernel the calls launched
    (``torch.profiler``, summed), divided by ``calls``. A second column beside :func:`loop_ms`, labelled as kernel
    time: host time and gaps between kernels are not in it. Without CUDA, the CPU operators' self time instead
    (the code path only)."""
    if calls < 1:
        raise ValueError(f"kernel_ms needs calls >= 1, got {calls}")
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    return _profiled_us(prof, cuda) / 1e3 / calls


def _profiled_us(prof, cuda: bool) -> float:
    """Microseconds of device kernels (CUDA) or of CPU operators' self time (no CUDA) in a profile."""
    import torch

    total = 0.0
    for event in prof.key_averages():
        if cuda:
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(event, "self_device_time_total", None)
            total += us if us is not None else event.self_cuda_time_total
        else:
            total += event.self_cpu_time_total
    return float(total)


def kernel_loop_ms(fn: Callable[[], object], warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """The back-to-back figure: median milliseconds per call of ``fn`` by ``triton.testing.do_bench`` (calls queued
    without synchronisation, L2 flushed between them). An op's host time hides behind its own GPU work here unless
    the op synchronises, so this is never a primary figure — only a labelled secondary column. Without CUDA, the
    median wall time of a few calls."""
    torch = _cuda()
    if torch is None:
        return statistics.median(loop_ms(fn, calls=3, warmup=1))
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


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
    timed by :func:`loop_ms`. Returns (milliseconds of each timed step, the loss of every step, peak bytes or
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
    times = loop_ms(step, calls=steps, warmup=0)
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


def summarize(samples: Iterable[float], sessions: int = 1) -> dict:
    """``{"median", "ci95": [low, high], "level", "min", "max", "n", "samples", "sessions"}`` of repeated
    measurements; ``sessions`` is how many separate processes the samples came from (one unless pooled by
    :func:`repeat_in_processes` / :func:`pool_sessions`).

    This is the form of a repeated metric: :func:`lora_lab.lab.record` stores it as is, grading compares the
    interval with a prediction's threshold (an interval that straddles it grades *inconclusive*).
    """
    values = [float(v) for v in samples]
    if not values or not all(math.isfinite(v) for v in values):
        raise ValueError(f"summarize needs finite samples, got {values!r}")
    if isinstance(sessions, bool) or not isinstance(sessions, int) or sessions < 1:
        raise ValueError(f"summarize needs sessions >= 1 (separate processes), got {sessions!r}")
    low, high = bootstrap_median_ci(values, level=0.95)
    return {"median": statistics.median(values), "ci95": [low, high], "level": 0.95, "min": min(values),
            "max": max(values), "n": len(values), "samples": values, "sessions": sessions}


def repeat(measure_once: Callable[[], dict], n: int = MIN_REPETITIONS, progress: str | None = None) -> dict:
    """Run ``measure_once()`` — one complete side-by-side loop returning ``{quantity: value}`` — ``n`` times in
    this process and summarise each quantity over the repetitions (``{quantity: summarize(...)}``, one session)."""
    if n < 1:
        raise ValueError(f"repeat needs n >= 1, got {n}")
    from tqdm.auto import tqdm

    runs = [measure_once() for _ in tqdm(range(n), desc=progress or "repetitions", disable=progress is None)]
    return _summarize_runs([runs])


def _summarize_runs(sessions: list[list[dict]]) -> dict:
    """``{quantity: summarize(...)}`` over the runs of every session; ``sessions`` counts those that had it."""
    keys = list(dict.fromkeys(k for runs in sessions for run in runs for k in run))
    out = {}
    for k in keys:
        values = [run[k] for runs in sessions for run in runs if k in run]
        had = sum(1 for runs in sessions if any(k in run for run in runs))
        out[k] = summarize(values, sessions=had)
    return out


def _import_target(target: str):
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"target must be 'package.module:function', got {target!r}")
    import importlib

    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def repeat_in_processes(target: str, n_sessions: int = MIN_SESSIONS, n: int = MIN_REPETITIONS,
                        kwargs: dict | None = None, python: str | None = None, sys_path: Sequence[str] = (),
                        timeout_s: float | None = None, env: dict | None = None) -> dict:
    """:func:`repeat` with its repetitions run in ``n_sessions`` separate Python processes, one after another
    (never at once: they would share the device), and pooled.

    ``target`` is ``"package.module:function"``; in each process ``function(**kwargs)`` builds what it measures and
    returns ``measure_once`` (one complete side-by-side loop → ``{quantity: value}``), which runs ``n`` times. The
    child is ``python -m lora_lab.lab.measure`` (``sys_path``: folders put first on its import path, e.g.
    ``benchmarks``); it writes its runs as JSON. Returns ``{quantity: summarize(...)}`` over the ``n_sessions × n``
    runs, each with ``"sessions"`` (processes that measured it). A failing session raises, with its stderr.
    """
    import json
    import os
    import subprocess
    import sys
    import tempfile

    if n_sessions < 1 or n < 1:
        raise ValueError(f"repeat_in_processes needs n_sessions >= 1 and n >= 1, got {n_sessions}, {n}")
    if target.count(":") != 1 or not all(target.partition(":")[::2]):
        raise ValueError(f"target must be 'package.module:function', got {target!r}")
    payload = json.dumps(kwargs or {})  # fails here, not in a child, when kwargs are not JSON
    child_env = dict(os.environ if env is None else env)
    paths = [str(Path(p).resolve()) for p in sys_path]
    if paths:
        child_env["PYTHONPATH"] = os.pathsep.join([*paths, child_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    sessions = []
    with tempfile.TemporaryDirectory(prefix="lora_lab_sessions_") as tmp:
        for k in range(n_sessions):
            out = Path(tmp) / f"session{k}.json"
            cmd = [python or sys.executable, "-m", "lora_lab.lab.measure", "--target", target, "--n", str(n),
                   "--kwargs", payload, "--out", str(out)]
            done = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=timeout_s)
            if done.returncode != 0 or not out.is_file():
                raise RuntimeError(f"session {k} of {target} failed (exit {done.returncode}):\n"
                                   f"{done.stderr[-4000:]}")
            sessions.append(json.loads(out.read_text())["runs"])
    return _summarize_runs(sessions)


def pool_sessions(sessions: Sequence[Sequence[dict]]) -> list[dict]:
    """Benchmark rows of several sessions (separate processes) as one table: each row gets ``session`` (its
    process, 0-based) and its ``rep`` renumbered to stay unique across sessions (``rep + session × reps``), so
    :func:`repetition_ratios` pairs rows within a repetition as before. :func:`sessions_in` counts them back."""
    pooled = []
    offset = 0
    for k, rows in enumerate(sessions):
        reps = [int(r["rep"]) for r in rows if r.get("rep") is not None]
        for row in rows:
            new = {**row, "session": k}
            if row.get("rep") is not None:
                new["rep"] = int(row["rep"]) + offset
            pooled.append(new)
        offset += (max(reps) + 1) if reps else 0
    return pooled


def pool_csv_sessions(parts: Sequence[Path | str], out: Path | str, names: Sequence[str]) -> dict[str, int]:
    """Pool the CSVs ``names`` that one benchmark wrote into each of the ``parts`` folders (one per session: the
    script run once per process) into ``out`` (:func:`pool_sessions`; rows without ``rep`` keep theirs). A name
    missing from every part is skipped; one missing from only some is an error. Returns {name: pooled rows}."""
    out = Path(out)
    written = {}
    for name in names:
        found = [Path(p) / name for p in parts]
        have = [f.is_file() for f in found]
        if not any(have):
            continue
        if not all(have):
            missing = [str(f) for f, h in zip(found, have) if not h]
            raise FileNotFoundError(f"{name}: written by only some sessions ({missing} missing)")
        rows = pool_sessions([read_csv(f) for f in found])
        write_csv(rows, out / name)
        written[name] = len(rows)
    return written


def process_folder(out: Path | str, k: int) -> Path:
    """The folder a benchmark's ``k``-th timing process (0-based) writes into, under ``out``."""
    return Path(out) / f"process{k}"


def run_script_sessions(script: Path | str, args: Sequence[str], out: Path | str, csv_names: Sequence[str],
                        sessions: int = MIN_SESSIONS, cwd: Path | str | None = None, tail: int = 14,
                        python: str | None = None) -> list[Path]:
    """Run the benchmark ``script`` once per session — separate processes, one after another — each into its own
    folder ``out/<script stem>_processes/process<k>`` (``--out`` is appended to ``args``), print each session's
    last ``tail`` lines of output and time, then pool the CSVs ``csv_names`` into ``out``
    (:func:`pool_csv_sessions`). A session that finished is marked in its folder (:mod:`lora_lab.lab.resume_marks`);
    a later call keeps it instead of running it again when the script, arguments, code and GPU are the same, so a
    run stopped by a time limit resumes on the next call with its folder carried back. A failing session raises
    with its stderr; the sessions already written stay on disk. Returns the session folders."""
    import subprocess
    import sys

    if sessions < 1:
        raise ValueError(f"run_script_sessions needs sessions >= 1, got {sessions}")
    script, out = Path(script), Path(out)
    if not script.is_file():
        raise FileNotFoundError(f"{script}: no such benchmark script")
    parts = [process_folder(out / f"{script.stem}_processes", k) for k in range(sessions)]
    first = resume_marks.session_key(script.name, args, 0)  # the code hash and the GPU, read once
    for k, part in enumerate(parts):
        key = {**first, "index": k}
        if resume_marks.is_done(part, key):
            print(f"--- {script.name}, process {k + 1} of {sessions}: kept (finished earlier with these arguments, "
                  f"this code, on {key['device']})")
            continue
        resume_marks.clear(part)
        started = time.monotonic()
        done = subprocess.run([python or sys.executable, str(script), *args, "--out", str(part)], cwd=cwd,
                              capture_output=True, text=True)
        print(f"--- {script.name}, process {k + 1} of {sessions} ({time.monotonic() - started:.0f} s, "
              f"exit {done.returncode})")
        if tail:
            print("\n".join(done.stdout.strip().splitlines()[-tail:]))
        if done.returncode != 0:
            raise RuntimeError(f"{script.name} failed in process {k + 1} of {sessions} (exit {done.returncode}):\n"
                               f"{done.stderr[-3000:]}")
        resume_marks.mark_done(part, key)
    pool_csv_sessions(parts, out, csv_names)
    return parts


def sessions_in(rows: Iterable[dict]) -> int:
    """How many sessions (separate processes) the rows came from: distinct ``session`` values, 1 without any."""
    found = {row.get("session") for row in rows if row.get("session") is not None}
    return max(len(found), 1)


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

    A ratio pairs two variants timed in the same side-by-side loop, never numbers from different loops: only the
    repetitions that hold both sides count. A repetition where one side has no value (a budget skipped it, or it
    ran out of memory) gives no sample; no repetition in common is an error."""
    return [top / bottom for _, top, bottom in _paired(rows, value, numerator, denominator)]


def _paired(rows: Iterable[dict], value: str, numerator: dict, denominator: dict) -> list[tuple[int, float, float]]:
    """``(rep, numerator's value, denominator's value)`` for the repetitions that hold both, in rep order."""
    rows = list(rows)
    top = by_repetition(rows, value, **numerator)
    bottom = by_repetition(rows, value, **denominator)
    common = sorted(top.keys() & bottom.keys())
    if not common:
        raise ValueError(f"{value}: repetitions of {numerator} ({sorted(top)}) and {denominator} "
                         f"({sorted(bottom)}) do not pair up: no repetition holds both")
    return [(rep, top[rep], bottom[rep]) for rep in common]



def ratio_summary(rows: Iterable[dict], value: str, numerator: dict, denominator: dict) -> dict:
    """:func:`summarize` of :func:`repetition_ratios`, with ``sessions`` counted from the rows (pooled by
    :func:`pool_sessions`) of the repetitions that gave a sample: a session whose rows of either variant were
    skipped or ran out of memory gave no sample and does not count."""
    rows = list(rows)
    pairs = _paired(rows, value, numerator, denominator)
    reps = {rep for rep, _, _ in pairs}
    used = [r for r in rows if r.get(value) is not None and int(r["rep"]) in reps
            and (all(r.get(k) == v for k, v in numerator.items())
                 or all(r.get(k) == v for k, v in denominator.items()))]
    return summarize([top / bottom for _, top, bottom in pairs], sessions=sessions_in(used))

def _session_main(argv=None) -> None:
    """One session of :func:`repeat_in_processes`: build with the target, run ``n`` repetitions, write JSON."""
    import argparse
    import json
    import os

    ap = argparse.ArgumentParser(description="one session (process) of lora_lab.lab.measure.repeat_in_processes")
    ap.add_argument("--target", required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--kwargs", default="{}")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    measure_once = _import_target(args.target)(**json.loads(args.kwargs))
    runs = [measure_once() for _ in range(args.n)]
    Path(args.out).write_text(json.dumps({"runs": runs, "pid": os.getpid()}))


if __name__ == "__main__":
    _session_main()

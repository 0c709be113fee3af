"""The host's side of a call, beyond :func:`lora_lab.lab.measure.host_ms` (its time from an idle device): its time
with the device kept busy, and where that time goes.

Why: a host time measured from an idle device grows with the call's GPU work, even for a replayed CUDA graph, so
it may hold waits for the device as well as the CPU's own work. :func:`host_ms_busy` queues a sleep kernel before
each call, so no launch waits for an idle device, and counts the calls that still waited (a call that
synchronises); :func:`host_profile` lists the host-side events per call (operators, the autograd engine, CUDA
runtime calls), to tell a blocking launch or a synchronisation from Python work.
"""
from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["host_ms_busy", "host_profile"]


def host_ms_busy(fn: Callable[[], object], calls: int = 10, warmup: int = 2,
                 busy_ms: float = 25.0) -> tuple[list[float], int]:
    """Host milliseconds of each of ``calls`` calls of ``fn`` made while the device is still busy: before each call
    a sleep kernel of about ``busy_ms`` is queued on the current stream, so every kernel the call launches lands
    behind it and nothing in the call waits for the device, unless the call synchronises with it (an ``.item()``,
    a copy to the host, a ``cudaFree``). It was meant to leave the CPU's own cost of the call (Python, checks, the
    autograd engine, launches), but it does not: ``tools/host_busy_probe.py`` (ledger rows ``host_busy_probe``,
    an H100) found one tiny kernel launch about ten times as costly to the host behind the sleep kernel as from
    an idle device, and the frozen layer's host time nearly doubled. A launch behind a busy queue costs the host
    more, not less, so this measure carries a cost of its own; :func:`measure.host_ms` (each call from an idle
    device) is the host time to quote.

    Returns ``(times, waited)``: ``waited`` counts the timed calls that returned after the sleep had finished (an
    event recorded behind it had completed): such a call either waited for the device or took longer than
    ``busy_ms`` on the host, and its time is no longer the host's alone. CUDA only (``torch.cuda._sleep``)."""
    if calls < 1:
        raise ValueError(f"host_ms_busy needs calls >= 1, got {calls}")
    if warmup < 0:
        raise ValueError(f"host_ms_busy needs warmup >= 0, got {warmup}")
    if not busy_ms > 0:
        raise ValueError(f"host_ms_busy needs busy_ms > 0, got {busy_ms}")
    torch = _cuda()
    if torch is None:
        raise RuntimeError("host_ms_busy keeps a CUDA device busy while the host calls fn; no CUDA device here "
                           "(host_ms times the call without one)")
    cycles = max(1, int(busy_ms * _sleep_cycles_per_ms(torch)))
    for _ in range(warmup):
        fn()
        torch.cuda.synchronize()
    times, waited = [], 0
    for _ in range(calls):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        slept = torch.cuda.Event()
        slept.record()
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
        waited += bool(slept.query())
        torch.cuda.synchronize()
    return times, waited


def host_profile(fn: Callable[[], object], calls: int = 5, warmup: int = 2, top: int = 15) -> list[dict]:
    """Where the host's time per call of ``fn`` goes: the host-side events ``torch.profiler`` records over ``calls``
    calls, each started on an idle device as :func:`measure.host_ms` starts them (operators, the autograd engine's
    functions and, with CUDA, the runtime's calls: ``cudaLaunchKernel``, ``cudaGraphLaunch``, a
    ``cudaStreamSynchronize`` the call makes). The ``top`` events by self CPU time, as ``{"event", "per_call",
    "self_cpu_us"}`` rows (occurrences and self CPU microseconds per call), largest first. Exactly one
    ``cudaDeviceSynchronize`` per call is this function's own, after the call; a launch that costs far more than
    its usual microseconds, or a synchronisation of the call's own, is where a host time that grows with the
    device's work comes from."""
    if calls < 1 or warmup < 0 or top < 1:
        raise ValueError(f"host_profile needs calls >= 1, warmup >= 0 and top >= 1, got {calls}, {warmup}, {top}")
    import torch as _torch
    from torch.profiler import ProfilerActivity, profile

    torch = _cuda()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch is not None else [])
    for _ in range(warmup):
        fn()
        if torch is not None:
            torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
            if torch is not None:
                torch.cuda.synchronize()
    rows = [{"event": e.key, "per_call": e.count / calls, "self_cpu_us": e.self_cpu_time_total / calls}
            for e in prof.key_averages() if e.device_type == _torch.autograd.DeviceType.CPU]
    return sorted(rows, key=lambda r: -r["self_cpu_us"])[:top]


_SLEEP_CYCLES_PER_MS: dict[int, float] = {}


def _sleep_cycles_per_ms(torch) -> float:
    """Clock cycles of ``torch.cuda._sleep`` per millisecond on the current device (measured once per device)."""
    device = torch.cuda.current_device()
    if device not in _SLEEP_CYCLES_PER_MS:
        probe = 10_000_000
        torch.cuda._sleep(probe // 10)  # first launch outside the timing
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
        if not ms > 0:
            raise RuntimeError(f"torch.cuda._sleep({probe}) took {ms} ms: cannot calibrate the busy device")
        _SLEEP_CYCLES_PER_MS[device] = probe / ms
    return _SLEEP_CYCLES_PER_MS[device]


def _cuda():
    """``torch`` where a CUDA device is available, else None (:mod:`lora_lab.lab.measure` takes it from here)."""
    import torch

    return torch if torch.cuda.is_available() else None

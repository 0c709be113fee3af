"""Where a synchronised step leaves the GPU idle, from a ``torch.profiler`` Chrome trace (used by profile_kernels.py).

A step timed the user's way (CUDA events around it, synchronised after it) costs its kernels' time plus every
moment the device has nothing to run: before the first kernel is launched, between kernels when the host falls
behind or waits, and after the last one until the host sees it finish. profile_kernels.py wraps each profiled step
in a ``record_function`` range named :data:`STEP_MARK` and synchronises after it, as the user's loop does; this
module reads the exported trace and, for each step, finds the intervals inside that range in which no kernel, copy
or memset runs. Each gap is described by what ended it:

* ``next_kernel``: the device event that ended the gap (``(end of step)`` for the time after the last one);
* ``launched_by``: the host operators around that event's launch, innermost first (``aten::mm <
  FwdGradLinearCrossEntropyFunction``), found through the launch's correlation id;
* ``launch_lag_us``: launch time minus gap start. Close to the gap's length: the device waited for the host to
  launch (host-bound). Near zero or negative: the launch was there in time and the device waited on something
  else (a dependency, a copy);
* ``host_waits``: CUDA runtime or driver calls of the host inside the gap that block or may block it
  (synchronisations, blocking copies, allocations and frees, memory queries).

Gaps are summed per step and grouped over the steps by (position in the step, next_kernel, launched_by), so a
gap that recurs every step is one row with its mean length. Times are the profiler's, which adds host time per
operator: absolute gaps are larger than in an unprofiled loop, while their order and causes carry over.
"""
from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

STEP_MARK = "profile_kernels.step"
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
HOST_OP_CATEGORIES = frozenset({"cpu_op", "user_annotation", "python_function"})
# runtime / driver calls that can hold the host (and so the next launch) back
WAIT_NAMES = ("Synchronize", "Memcpy", "Malloc", "Free", "MemGetInfo", "HostAlloc", "HostRegister", "EventQuery",
              "StreamWait", "StreamQuery")


def load_trace(path: str | Path) -> list[dict]:
    """The complete events ("ph" "X", with a start and a duration) of a Chrome trace file."""
    with open(path) as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def _end(event: dict) -> float:
    return float(event["ts"]) + float(event["dur"])


def _correlation(event: dict):
    return (event.get("args") or {}).get("correlation")


def _launch_context(launch: dict | None, host_ops: list[dict], depth: int = 3) -> str:
    """Names of the host operators enclosing ``launch`` on its thread, innermost first (at most ``depth``)."""
    if launch is None:
        return "(launch not in trace)"
    t = float(launch["ts"])
    around = [op for op in host_ops if op.get("tid") == launch.get("tid") and op.get("pid") == launch.get("pid")
              and float(op["ts"]) <= t <= _end(op) and op.get("name") != STEP_MARK]
    around.sort(key=lambda op: (float(op["dur"]), -float(op["ts"])))  # the shortest enclosing range is innermost
    names = [op["name"] for op in around[:depth]]
    return " < ".join(names) if names else "(no host operator)"


def step_gaps(events: list[dict], min_gap_us: float = 5.0) -> list[dict]:
    """One row per idle interval of at least ``min_gap_us`` inside each :data:`STEP_MARK` range of the trace:
    ``step``, ``position`` (its order among the step's gaps), ``start_us`` (from the step's start), ``gap_us``,
    ``next_kernel``, ``launched_by``, ``launch_lag_us`` and ``host_waits`` (see the module docstring)."""
    steps = sorted((e for e in events if e.get("name") == STEP_MARK and e.get("cat") in HOST_OP_CATEGORIES),
                   key=lambda e: float(e["ts"]))
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: float(e["ts"]))
    calls = [e for e in events if e.get("cat") in LAUNCH_CATEGORIES]
    launches = {_correlation(e): e for e in calls if _correlation(e) is not None}
    host_ops = [e for e in events if e.get("cat") in HOST_OP_CATEGORIES]
    rows = []
    for index, step in enumerate(steps):
        s0, s1 = float(step["ts"]), _end(step)
        idle, cursor = [], s0  # (start, stop, the device event that ends it or None)
        for e in (e for e in device if float(e["ts"]) < s1 and _end(e) > s0):
            start = max(float(e["ts"]), s0)
            if start > cursor:
                idle.append((cursor, start, e))
            cursor = max(cursor, min(_end(e), s1))
        idle.append((cursor, s1, None))
        for position, (start, stop, nxt) in enumerate(g for g in idle if g[1] - g[0] >= min_gap_us):
            launch = launches.get(_correlation(nxt)) if nxt is not None else None
            waits = sorted({c["name"] for c in calls if float(c["ts"]) < stop and _end(c) > start
                            and any(w in c["name"] for w in WAIT_NAMES)})
            rows.append({
                "step": index, "position": position, "start_us": start - s0, "gap_us": stop - start,
                "next_kernel": nxt["name"] if nxt is not None else "(end of step)",
                "launched_by": _launch_context(launch, host_ops) if nxt is not None else "(step returns)",
                "launch_lag_us": (float(launch["ts"]) - start) if launch is not None else None,
                "host_waits": " ".join(waits),
            })
    return rows


def summarise(rows: list[dict], steps: int) -> tuple[float, list[dict]]:
    """(idle microseconds per step, the gaps grouped over steps by position, next kernel and launcher, longest
    first, each with ``mean_gap_us``, ``count`` and ``per_step_us``: its share of a step's idle time)."""
    if steps <= 0:
        return 0.0, []
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["position"], r["next_kernel"], r["launched_by"])].append(r)
    out = []
    for (position, kernel, launcher), members in groups.items():
        lags = [m["launch_lag_us"] for m in members if m["launch_lag_us"] is not None]
        waits = sorted({w for m in members for w in m["host_waits"].split() if w})
        out.append({"position": position, "next_kernel": kernel, "launched_by": launcher, "count": len(members),
                     "mean_gap_us": statistics.fmean(m["gap_us"] for m in members),
                     "per_step_us": sum(m["gap_us"] for m in members) / steps,
                     "mean_start_us": statistics.fmean(m["start_us"] for m in members),
                     "mean_launch_lag_us": statistics.fmean(lags) if lags else None,
                     "host_waits": " ".join(waits)})
    out.sort(key=lambda r: -r["per_step_us"])
    return sum(r["gap_us"] for r in rows) / steps, out

"""The GPU timeline of one traced call from a ``tools/moe_host_profile.py`` trace (``<impl>_trace.json.gz``): every
kernel, memset and copy with its start (µs from the call's start on the host), the GPU idle gap before it and its
duration, then a summary line: the first kernel, the first kernel of at least ``--big`` µs (where the expert GEMMs
begin), the idle total and the call's end. A diagnostic; no notebook reads it.

    python tools/moe_trace_timeline.py DIR/ours_trace.json.gz [--call -1] [--big 100]
"""
from __future__ import annotations

import argparse
import gzip
import json


def timeline(path: str, call: int = -1, big: float = 100.0) -> str:
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    calls = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                    and e.get("name", "").startswith("call_")), key=lambda e: e["ts"])
    if not calls:
        raise SystemExit(f"{path}: no call_<i> annotations (not a moe_host_profile trace?)")
    start = calls[call]["ts"]
    following = [c["ts"] for c in calls if c["ts"] > start]
    stop = following[0] if following else float("inf")
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")
                  and start <= e["ts"] < stop), key=lambda e: e["ts"])
    lines, end, idle, first_big = [], start, 0.0, None
    for e in gpu:
        gap = max(0.0, e["ts"] - end)
        idle += gap
        if first_big is None and e["dur"] >= big:
            first_big = e["ts"] - start
        lines.append(f"{e['ts'] - start:9.1f} gap {gap:7.1f} dur {e['dur']:8.1f}  {e['name'][:100]}")
        end = max(end, e["ts"] + e["dur"])
    first = gpu[0]["ts"] - start if gpu else float("nan")
    lines.append(f"summary: {len(gpu)} GPU events; first at {first:.1f} us, first >= {big:g} us at "
                 f"{first_big if first_big is not None else float('nan'):.1f} us; idle {idle:.1f} us (from the call's "
                 f"start); GPU done at {end - start:.1f} us")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--call", type=int, default=-1, help="which traced call (default: the last)")
    ap.add_argument("--big", type=float, default=100.0)
    args = ap.parse_args(argv)
    print(timeline(args.trace, args.call, args.big))


if __name__ == "__main__":
    main()

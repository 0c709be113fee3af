"""The sessions that really hold samples, for each repeated metric of a notebook-06 run (bench_moe's layer CSV).

Until measure.ratio_summary was fixed, a ratio counted the sessions of every row of its two implementations,
rows a session's budget skipped (no ``ms``) included, so a cell timed in one session only was recorded as
pooled over two. This prints the ``predictions/errata.yaml`` entry that lowers each such metric's ``sessions``
to what its rows hold (nothing when none is overstated).

    python tools/moe_errata_from_layer_csv.py RUN_DIR    # holding 06_fused_moe.metrics.json and 06_moe_layer.csv
"""
from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path


def _impls(rest: str) -> tuple[str, ...] | None:
    """The implementations (layer CSV ``impl`` values) a metric's samples come from, from its key's tail."""
    for pattern, impls in ((r"^speedup_vs_(\w+)$", lambda m: (m.group(1), "ours")),
                           (r"^(\w+)_speedup_vs_ours$", lambda m: ("ours", m.group(1))),
                           (r"^(\w+)_slowdown_vs_ours$", lambda m: (m.group(1), "ours")),
                           (r"^ours_fraction_of_peak$", lambda m: ("ours",)),
                           (r"^(\w+)_tflops$", lambda m: (m.group(1),))):
        match = re.match(pattern, rest)
        if match:
            return impls(match)
    return None


def overstated(run_dir: Path) -> tuple[str, dict[str, int]]:
    payload = json.loads((run_dir / "06_fused_moe.metrics.json").read_text())
    with open(run_dir / "06_moe_layer.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    cells = sorted({r["cell"] for r in rows}, key=len, reverse=True)
    fixed = {}
    for key, value in (payload.get("metrics") or {}).items():
        if not (isinstance(value, dict) and isinstance(value.get("sessions"), int) and value["sessions"] > 1):
            continue
        cell = next((c for c in cells if key.startswith(c + "_")), None)
        impls = _impls(key[len(cell) + 1:]) if cell else None
        if impls is None:
            continue
        held = {r["session"] for r in rows
                if r["cell"] == cell and r["impl"] in impls and r.get("ms") not in ("", None)}
        if len(held) < value["sessions"]:
            fixed[key] = max(len(held), 1)
    return str((payload.get("provenance") or {}).get("git_commit") or ""), fixed


def main(argv=None) -> None:
    run_dir = Path((argv or sys.argv[1:])[0])
    commit, fixed = overstated(run_dir)
    if not fixed:
        print("# no metric overstates its sessions")
        return
    print(f"- notebook: 06_fused_moe\n  git_commit: {commit[:12]}")
    print('  why: "measure.ratio_summary counted the sessions of rows a budget skipped (no sample); fixed in '
          'the commit that adds this entry"')
    print("  sessions:")
    for key, count in sorted(fixed.items()):
        print(f"    {key}: {count}")


if __name__ == "__main__":
    main()

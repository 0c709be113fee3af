"""What each published run of a profile took: wall time, the largest GPU process, the device, the cap, the commit, and
whether it ran the code as it is now (its recorded code hash against this checkout's).

``lora-lab runs --profile gpu`` prints it. The seconds are the runner's (``run_summary.json``: the notebook's wall time,
its benchmark processes included); the memory is the most PyTorch's allocator reserved in any one process of the run
(``gpu_memory`` in the metrics file's provenance, :mod:`lora_lab.memory.peaks`), absent for runs made before that was
recorded. The total is the notebooks' seconds added up: a reader's rerun of them one after another.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["run_rows", "runs_table"]


def run_rows(out_dir: Path | str) -> list[dict[str, Any]]:
    """One row per notebook published in ``out_dir`` (``outputs/<profile>``), in notebook order."""
    from lora_lab.lab.grading import RUN_SUMMARY_NAME, read_json
    from lora_lab.lab.provenance import CODE_HASH_SCOPE, code_hash

    out_dir = Path(out_dir)
    summary, why = read_json(out_dir / RUN_SUMMARY_NAME)
    if summary is None:
        raise FileNotFoundError(f"{out_dir / RUN_SUMMARY_NAME}: no published runs of this profile ({why})")
    rows, current = [], code_hash()
    for stem, entry in sorted((summary.get("notebooks") or {}).items()):
        metrics, _ = read_json(out_dir / f"{stem}.metrics.json")
        provenance = (metrics or {}).get("provenance") or {}
        gpu = provenance.get("gpu_memory") or {}
        # this code: lora_lab/ and benchmarks/ as they are now (a run hashed over lora_lab/ alone cannot say)
        this_code = provenance.get("code_hash_scope") == CODE_HASH_SCOPE and provenance.get("code_hash") == current
        rows.append({"notebook": stem, "status": entry.get("status"), "seconds": entry.get("seconds"),
                     "gpu_reserved_gib": gpu.get("largest_reserved_gib"), "gpu_processes": gpu.get("processes"),
                     "device": provenance.get("device"), "memory_cap_gib": provenance.get("memory_cap_gib"),
                     "gpu_class": provenance.get("gpu_class"), "commit": (provenance.get("git_commit") or "")[:7],
                     "this_code": this_code, "finished": (provenance.get("finished") or "")[:10]})
    return rows


def runs_table(out_dir: Path | str) -> str:
    """:func:`run_rows` as a markdown table, with the total of the seconds."""
    rows = run_rows(out_dir)
    lines = ["| notebook | status | wall time, s | largest GPU process, GiB reserved | GPU processes | device "
             "| cap, GiB | GPU class | commit | this code | finished |", "|---" * 11 + "|"]
    for r in rows:
        cells = [r["notebook"], r["status"] or "-", _num(r["seconds"], ".1f"), _num(r["gpu_reserved_gib"], ".2f"),
                 _num(r["gpu_processes"], "d"), r["device"] or "-", _num(r["memory_cap_gib"], "g"),
                 r["gpu_class"] or "-", r["commit"] or "-", "yes" if r["this_code"] else "no", r["finished"] or "-"]
        lines.append("| " + " | ".join(cells) + " |")
    seconds = [r["seconds"] for r in rows if isinstance(r["seconds"], (int, float))]
    commits = sorted({r["commit"] for r in rows if r["commit"]})
    lines.append("")
    lines.append(f"{len(rows)} notebooks, {sum(seconds):.0f} s of wall time one after another "
                 f"({sum(seconds) / 60:.1f} min), from {len(commits)} commit(s): {', '.join(commits) or '-'}; "
                 f"{sum(r['this_code'] for r in rows)} of them ran this code "
                 "(lora_lab/ and benchmarks/ as they are now)")
    return "\n".join(lines)


def _num(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)

"""Errata: corrections grading applies to a published run whose recorded metrics overstate their evidence.

A published run is never rewritten: its metrics file stays what the run recorded. When a bug found later means a
recorded value claims more than its samples hold, ``predictions/errata.yaml`` says so, and grading (every
scoreboard, the run history, ``lora-lab grade``) reads the corrected value. An erratum may only **lower** what a
value claims; it never changes a median, an interval or a threshold. One kind exists:

* ``sessions`` — the number of separate processes a repeated measurement's samples came from. A speed ratio
  recorded from one session is void (:mod:`lora_lab.lab.grading`); an erratum that lowers a value to one session
  voids its predictions and keeps the interval's own outcome beside the void, as for any one-session ratio.

The file is an append-only YAML list::

    - notebook: 06_fused_moe
      git_commit: bec6a1b            # the commit the run started from (a prefix of >= 7 hex digits)
      why: "ratio_summary counted sessions whose rows were skipped (fixed in measure.ratio_summary)"
      sessions:                      # metric key: the number of sessions its samples came from
        olmoe_1b_7b_t8192_full_speedup_vs_grouped_mm: 1

A malformed entry is a ValueError that names the entry and the field.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["ERRATA_NAME", "load_errata", "parse_errata", "apply_errata", "default_errata_path"]

ERRATA_NAME = "errata.yaml"
_SHA = re.compile(r"^[0-9a-f]{7,40}$")
_FIELDS = {"notebook", "git_commit", "why", "sessions"}


def default_errata_path() -> Path:
    """``predictions/errata.yaml`` of the checkout the package is imported from."""
    return Path(__file__).resolve().parents[2] / "predictions" / ERRATA_NAME


def parse_errata(entries: Any, where: str = ERRATA_NAME) -> list[dict]:
    """Validated errata entries (a list of mappings; None: none)."""
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise ValueError(f"{where}: a YAML list of errata entries expected, got {type(entries).__name__}")
    out = []
    for index, entry in enumerate(entries):
        at = f"{where}: entry {index}"
        if not isinstance(entry, dict):
            raise ValueError(f"{at}: a mapping expected, got {type(entry).__name__}")
        unknown = set(entry) - _FIELDS
        missing = _FIELDS - set(entry)
        if unknown or missing:
            raise ValueError(f"{at}: fields {sorted(missing)} missing, {sorted(unknown)} unknown "
                             f"(an erratum has exactly {sorted(_FIELDS)})")
        if not isinstance(entry["notebook"], str) or not entry["notebook"]:
            raise ValueError(f"{at}: 'notebook' must be a notebook stem, got {entry['notebook']!r}")
        commit = str(entry["git_commit"])
        if not _SHA.match(commit):
            raise ValueError(f"{at}: 'git_commit' must be 7-40 lowercase hex digits, got {entry['git_commit']!r}")
        if not isinstance(entry["why"], str) or not entry["why"].strip():
            raise ValueError(f"{at}: 'why' must say what was wrong")
        sessions = entry["sessions"]
        if not isinstance(sessions, dict) or not sessions:
            raise ValueError(f"{at}: 'sessions' must map metric keys to session counts")
        for metric, count in sessions.items():
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ValueError(f"{at}: sessions of {metric!r} must be an integer >= 1, got {count!r}")
        out.append({**entry, "git_commit": commit})
    return out


@lru_cache(maxsize=8)
def _load(path: str, mtime: float) -> tuple:
    import yaml

    text = Path(path).read_text(encoding="utf-8")
    return tuple(parse_errata(yaml.safe_load(text), path))


def load_errata(path: Path | str | None = None) -> list[dict]:
    """The errata of ``path`` (default :func:`default_errata_path`); none when the file does not exist."""
    path = Path(path) if path is not None else default_errata_path()
    if not path.is_file():
        return []
    return list(_load(str(path), path.stat().st_mtime))


def apply_errata(payload: dict[str, Any], errata: list[dict] | None = None) -> dict[str, Any]:
    """``payload`` (a metrics file's content) with the errata naming its run applied: a shallow copy whose listed
    repeated measurements record at most the erratum's sessions, each with a note saying why. Unchanged (the same
    object) when no erratum names the run."""
    errata = load_errata() if errata is None else errata
    notebook = payload.get("notebook")
    commit = str((payload.get("provenance") or {}).get("git_commit") or "")
    mine = [e for e in errata if e["notebook"] == notebook and commit and commit.startswith(e["git_commit"])]
    if not mine:
        return payload
    metrics = dict(payload.get("metrics") or {})
    notes = dict(payload.get("notes") or {})
    for entry in mine:
        for metric, count in entry["sessions"].items():
            value = metrics.get(metric)
            if isinstance(value, dict) and "median" in value:
                recorded = value.get("sessions") if isinstance(value.get("sessions"), int) else 1
                if count < recorded:
                    metrics[metric] = {**value, "sessions": count}
                    notes[metric] = f"erratum: recorded {recorded} sessions, {count} hold samples ({entry['why']})"
    return {**payload, "metrics": metrics, "notes": notes}

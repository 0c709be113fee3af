"""A notebook's own verdicts: every prediction registered for it, graded against this run's metrics.

The last cell of each notebook calls :func:`show_verdicts`. It renders, for the run's profile, one row per
prediction — claim, predicted, measured (median and interval for repeated measurements), outcome — with
the misses first, so a reader sees them where they read. Nothing in it is typed by hand: it is
:mod:`lora_lab.lab.grading` applied to the metrics file this run just wrote.
"""
from __future__ import annotations

from pathlib import Path

from lora_lab.lab.grading import RUN_SUMMARY_NAME, GradedRow, grade_row, read_json, uncommitted_change
from lora_lab.lab.predictions import load_predictions, repository_root, superseded_ids
from lora_lab.lab.provenance import find_repo_root
from lora_lab.lab.recording import last_run

__all__ = ["notebook_verdicts", "show_verdicts", "verdicts_markdown"]

_ORDER = {"miss": 0, "inconclusive": 1, "void": 2, "hit": 3}


def notebook_verdicts(notebook: str, profile: str, metrics_file: Path | str,
                      predictions_path: Path | str | None = None) -> tuple[list[GradedRow], list[str]]:
    """(rows graded for ``profile``, notes) for the live (not superseded) predictions of ``notebook``."""
    # the notebook's folder (Jupyter and the runner start the kernel there), else the package's checkout
    root = find_repo_root() or repository_root()
    predictions_path = Path(predictions_path or root / "predictions" / "predictions.yaml")
    notes = []
    change = uncommitted_change(predictions_path)
    if change is not None:
        notes.append(f"predictions.yaml is {change}: these verdicts are provisional")
    predictions = load_predictions(predictions_path, notebooks_dir=root / "notebooks")
    replaced = superseded_ids(predictions)
    metrics_file = Path(metrics_file)
    summary, _ = read_json(metrics_file.parent / RUN_SUMMARY_NAME)
    rows = [grade_row(p, profile, metrics_file, summary or {})
            for p in predictions if p.notebook == notebook and p.applies_to(profile) and p.id not in replaced]
    others = sum(p.notebook == notebook and not p.applies_to(profile) and p.id not in replaced for p in predictions)
    if others:
        notes.append(f"{others} more prediction(s) of this notebook apply to other profiles")
    rows.sort(key=lambda row: _ORDER.get(row.outcome, 9))
    return rows, notes


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def verdicts_markdown(rows: list[GradedRow], notes: list[str], profile: str) -> str:
    counts = {outcome: sum(row.outcome == outcome for row in rows) for outcome in _ORDER}
    head = (f"**Verdicts, profile `{profile}`:** {counts['hit']} hit, {counts['miss']} miss, "
            f"{counts['inconclusive']} inconclusive, {counts['void']} void")
    lines = [head, "", "| outcome | prediction | claim | predicted | measured | blind? |", "|---|---|---|---|---|---|"]
    for row in rows:
        outcome = row.outcome.upper() if row.outcome in ("miss", "inconclusive") else row.outcome
        measured = row.measured_text() + (f" — {row.why}" if row.why else "")
        lines.append("| " + " | ".join(_cell(c) for c in (
            f"**{outcome}**", f"`{row.id}`", row.claim, row.predicted, measured,
            "blind" if row.blind else f"informed: {row.informed_by}")) + " |")
    lines += [f"\n*{note}*" for note in notes]
    return "\n".join(lines)


def show_verdicts(run=None) -> list[GradedRow]:
    """Grade and display this notebook's predictions for the run (default: the run finished last)."""
    run = run or last_run()
    rows, notes = notebook_verdicts(run.notebook, run.name, run.path)
    text = verdicts_markdown(rows, notes, run.name)
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display

        if get_ipython() is None:
            raise ImportError
        display(Markdown(text))
    except ImportError:
        print(text)
    return rows

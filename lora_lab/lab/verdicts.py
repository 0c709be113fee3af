"""A notebook's own verdicts: its predictions graded against this run's metrics.

The last cell of each notebook calls :func:`show_verdicts`. It renders, for the run's profile, the predictions that
answer the notebook's question (``predictions/reader_tables.yaml``, :mod:`lora_lab.lab.reader_tables`): claim in
plain words, measured (median and 95% interval for repeated measurements), target, verdict — then one line saying
how many more predictions, and how many of them void, the profile's scoreboard lists. ``full=True`` renders every
live prediction instead (claim as registered, misses first), as does a notebook without a reader table. Nothing in
either is typed by hand: it is :mod:`lora_lab.lab.grading` applied to the metrics file this run just wrote.
"""
from __future__ import annotations

import re
from pathlib import Path

from lora_lab.lab.grading import (
    RUN_SUMMARY_NAME,
    SCOREBOARD_MD,
    GradedRow,
    format_value,
    grade_row,
    read_json,
    uncommitted_change,
)
from lora_lab.lab.predictions import Prediction, format_number, load_predictions, repository_root, superseded_ids
from lora_lab.lab.provenance import find_repo_root
from lora_lab.lab.reader_tables import ReaderTable, load_reader_tables, reader_tables_path
from lora_lab.lab.recording import last_run

__all__ = ["notebook_verdicts", "reader_verdicts", "show_verdicts", "verdicts_markdown", "reader_markdown"]

_ORDER = {"miss": 0, "inconclusive": 1, "void": 2, "hit": 3}
_OTHER_PROFILES = "apply to other profiles"  # the note the full table adds and the reader's table leaves out


def _predictions_path(predictions_path: Path | str | None) -> tuple[Path, Path]:
    """(checkout root, predictions file): the notebook's folder (Jupyter and the runner start the kernel there), else
    the package's checkout."""
    root = find_repo_root() or repository_root()
    return root, Path(predictions_path or root / "predictions" / "predictions.yaml")


def notebook_verdicts(notebook: str, profile: str, metrics_file: Path | str,
                      predictions_path: Path | str | None = None) -> tuple[list[GradedRow], list[str]]:
    """(rows graded for ``profile``, notes) for the live (not superseded) predictions of ``notebook``."""
    rows, notes, _ = _graded(notebook, profile, metrics_file, predictions_path)
    return rows, notes


def _graded(notebook: str, profile: str, metrics_file: Path | str,
            predictions_path: Path | str | None) -> tuple[list[GradedRow], list[str], list[Prediction]]:
    root, predictions_path = _predictions_path(predictions_path)
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
        notes.append(f"{others} more prediction(s) of this notebook {_OTHER_PROFILES}")
    rows.sort(key=lambda row: _ORDER.get(row.outcome, 9))
    return rows, notes, predictions


def reader_verdicts(notebook: str, profile: str, metrics_file: Path | str,
                    predictions_path: Path | str | None = None,
                    ) -> tuple[list[tuple[str, GradedRow]], list[GradedRow], list[str], ReaderTable | None]:
    """(shown, rest, notes, table): the reader table's rows that apply to ``profile`` as (plain claim, graded row) in
    the table's order, the notebook's other live rows for the profile, the notes, and the table (None, and nothing
    shown, when the notebook has none)."""
    rows, notes, predictions = _graded(notebook, profile, metrics_file, predictions_path)
    _, predictions_path = _predictions_path(predictions_path)
    table = load_reader_tables(reader_tables_path(predictions_path), predictions).get(notebook)
    if table is None:
        return [], rows, notes, None
    by_id = {row.id: row for row in rows}
    shown = [(entry.claim, by_id[entry.id]) for entry in table.rows if entry.id in by_id]
    chosen = {row.id for _, row in shown}
    return shown, [row for row in rows if row.id not in chosen], notes, table


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


def scoreboard_link(profile: str) -> str:
    """A markdown link to the profile's scoreboard, relative to where the profile's executed notebooks are published:
    ``notebooks/`` for the gpu profile, ``outputs/<profile>/`` (beside the scoreboard) for the others."""
    target = f"../outputs/{profile}/{SCOREBOARD_MD}" if profile == "gpu" else SCOREBOARD_MD
    return f"[outputs/{profile}/{SCOREBOARD_MD}]({target})"


def reader_measured(row: GradedRow) -> str:
    """The measured value, and for a repeated measurement its 95% interval: ``1.24 [1.18, 1.33]``."""
    text = format_value(row.value)
    if row.interval is not None:
        text += f" [{format_number(row.interval[0])}, {format_number(row.interval[1])}]"
    return text


def reader_markdown(shown: list[tuple[str, GradedRow]], rest: list[GradedRow], notes: list[str], profile: str) -> str:
    """The reader's table — claim, measured, target, verdict — and one line pointing to the scoreboard for the rest."""
    counts = {outcome: sum(row.outcome == outcome for _, row in shown) for outcome in _ORDER}
    which = "the prediction that answers" if len(shown) == 1 else f"the {len(shown)} predictions that answer"
    head = (f"**Verdicts, profile `{profile}`:** {which} this notebook's question — "
            f"{counts['hit']} hit, {counts['miss']} miss, {counts['inconclusive']} inconclusive, {counts['void']} void")
    lines = [head, "", "| claim | measured (95% interval) | target | verdict |", "|---|---|---|---|"]
    if not shown:
        lines = [f"**Verdicts, profile `{profile}`:** none of the predictions that answer this notebook's question "
                 f"apply to this profile"]
    for claim, row in shown:
        verdict = f"**{row.outcome}**" if row.outcome == "miss" else row.outcome
        if row.outcome == "void" and row.why:
            verdict += ": " + re.sub(r"metric '[^']*'", "the measurement", row.why)
        lines.append("| " + " | ".join(_cell(c) for c in (claim, reader_measured(row), row.predicted, verdict)) + " |")
    void = sum(row.outcome == "void" for row in rest)
    lines.append("")
    if rest:
        lines.append(f"{len(rest)} more prediction{'s' if len(rest) != 1 else ''} ({void} void) in "
                     f"{scoreboard_link(profile)}, each with its claim as registered, its runs and its provenance.")
    else:
        lines.append(f"No more predictions; each one's runs and provenance are in {scoreboard_link(profile)}.")
    lines += [f"\n*{note}*" for note in notes if _OTHER_PROFILES not in note]
    return "\n".join(lines)


def show_verdicts(run=None, full: bool = False) -> list[GradedRow]:
    """Grade and display this notebook's predictions for the run (default: the run finished last): the reader's
    table (``full=False``, see :func:`reader_markdown`) or every live prediction (``full=True``). Returns the graded
    rows of every live prediction either way."""
    run = run or last_run()
    # run.name: the profile's full name (a capped profile grades and links under its own name)
    shown, rest, notes, table = reader_verdicts(run.notebook, run.name, run.path)
    rows = [row for _, row in shown] + rest
    if full or table is None:
        rows.sort(key=lambda row: _ORDER.get(row.outcome, 9))
        text = verdicts_markdown(rows, notes, run.name)
    else:
        text = reader_markdown(shown, rest, notes, run.name)
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display

        if get_ipython() is None:
            raise ImportError
        display(Markdown(text))
    except ImportError:
        print(text)
    return rows

"""The verdicts a notebook shows its reader: ``predictions/reader_tables.yaml``.

A notebook registers many predictions (dozens for a benchmark notebook). Its last cell shows only the ones that
answer its question — hits and misses alike, at most :data:`MAX_ROWS` on a profile — each with its claim said in
plain words; every prediction, void or superseded, with its provenance and history, stays in
``outputs/<profile>/scoreboard.md``. One entry per notebook::

    05_fused_lora_kernels:
      shown:                             # in the order the table shows them
        - id: p05-loop-time-vs-base-target
          claim: "The fused layer's forward + backward costs at most 1.10x the frozen layer's"
          ungraded: "why it is shown"    # optional: required (by the tests) when no run has graded it
      not_shown:                         # a prediction a run graded miss that the table leaves out, and why
        p05-single-time-vs-base-loose: "the same measurement at a looser threshold"

Reading the file checks it against the predictions and names every problem: an unknown prediction or notebook,
a prediction of another notebook or a superseded one, an empty claim or one that names ids, issues, sessions or
commits, more than :data:`MAX_ROWS` rows on a profile, a reason missing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from lora_lab.lab.predictions import Prediction, PredictionError, PredictionsLoader, superseded_ids
from lora_lab.lab.recording import PROFILES

READER_TABLES_NAME = "reader_tables.yaml"
MAX_ROWS = 10
ROW_FIELDS = ("id", "claim", "ungraded")
TABLE_FIELDS = ("shown", "not_shown")

# what a reader's claim must not lean on: a prediction id, an issue number, a working session, a commit hash
_JARGON = (
    (re.compile(r"\bp\d\d-[a-z0-9]"), "a prediction id"),
    (re.compile(r"#\d+|\bissue\b", re.IGNORECASE), "an issue"),
    (re.compile(r"\bsession\b", re.IGNORECASE), "a working session"),
    (re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"), "a commit hash"),
)


class ReaderTableError(PredictionError):
    """The reader tables file is malformed; ``problems`` lists every message."""


@dataclass(frozen=True)
class ReaderRow:
    id: str
    claim: str
    ungraded: str = ""  # why it is shown although no run has graded it ("" = not said)


@dataclass(frozen=True)
class ReaderTable:
    notebook: str
    rows: tuple[ReaderRow, ...]
    not_shown: dict[str, str] = field(default_factory=dict)  # {prediction id: why the table leaves it out}

    @property
    def ids(self) -> list[str]:
        return [row.id for row in self.rows]


def reader_tables_path(predictions_path: Path | str) -> Path:
    """The reader tables file beside a predictions file."""
    return Path(predictions_path).parent / READER_TABLES_NAME


def jargon_in(claim: str) -> list[str]:
    """What of :data:`_JARGON` a claim contains (empty: plain words)."""
    return [what for pattern, what in _JARGON if pattern.search(claim)]


def _check_row(notebook: str, number: int, row, by_id: dict[str, Prediction], replaced: dict[str, str],
               problems: list[str]) -> ReaderRow | None:
    where = f"{notebook}, shown row {number}"
    if not isinstance(row, dict):
        problems.append(f"{where}: a row is a mapping with 'id' and 'claim', not a {type(row).__name__}")
        return None
    unknown = sorted(set(map(str, row)) - set(ROW_FIELDS))
    if unknown:
        problems.append(f"{where}: unknown field(s) {', '.join(unknown)} (a row has {', '.join(ROW_FIELDS)})")
    prediction_id, claim, ungraded = row.get("id"), row.get("claim"), row.get("ungraded", "")
    if not isinstance(prediction_id, str) or not prediction_id:
        problems.append(f"{where}: 'id' is missing")
        return None
    where = f"{notebook}, shown row {number} ({prediction_id})"
    problem = _prediction_problem(prediction_id, notebook, by_id)
    if problem:
        problems.append(f"{where}: {problem}")
    elif prediction_id in replaced:
        problems.append(f"{where}: superseded by {replaced[prediction_id]!r}, which is the one to show")
    if not isinstance(claim, str) or not claim.strip():
        problems.append(f"{where}: empty claim (say in plain words what it predicts)")
        claim = ""
    else:
        for what in jargon_in(claim):
            problems.append(f"{where}: the claim names {what}; say it in plain words")
    if not isinstance(ungraded, str):
        problems.append(f"{where}: 'ungraded' must be text (why it is shown though no run graded it)")
        ungraded = ""
    return ReaderRow(prediction_id, " ".join(claim.split()), ungraded.strip())


def _prediction_problem(prediction_id, notebook: str, by_id: dict[str, Prediction]) -> str:
    """Why ``prediction_id`` cannot stand in ``notebook``'s table (unknown, or another notebook's), or ""."""
    prediction = by_id.get(prediction_id)
    if prediction is None:
        return f"unknown prediction id {prediction_id!r}"
    if prediction.notebook != notebook:
        return f"a prediction of notebook {prediction.notebook}, not of {notebook}"
    return ""


def _check_table(notebook: str, entry, by_id: dict[str, Prediction], replaced: dict[str, str],
                 problems: list[str]) -> ReaderTable | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("shown"), list):
        problems.append(f"{notebook}: needs 'shown', a list of rows (id and claim)")
        return None
    unknown = sorted(set(map(str, entry)) - set(TABLE_FIELDS))
    if unknown:
        problems.append(f"{notebook}: unknown field(s) {', '.join(unknown)} (a table has {', '.join(TABLE_FIELDS)})")
    rows = [_check_row(notebook, number, row, by_id, replaced, problems)
            for number, row in enumerate(entry["shown"], 1)]
    rows = [row for row in rows if row is not None]
    if not rows:
        problems.append(f"{notebook}: 'shown' is empty")
    ids = [row.id for row in rows]
    for twice in sorted({i for i in ids if ids.count(i) > 1}):
        problems.append(f"{notebook}: {twice!r} is shown twice")
    for profile in PROFILES:
        count = sum(row.id in by_id and profile in by_id[row.id].profiles for row in rows)
        if count > MAX_ROWS:
            problems.append(f"{notebook}: {count} rows on the {profile} profile, more than {MAX_ROWS}")
    not_shown = entry.get("not_shown") or {}
    if not isinstance(not_shown, dict):
        problems.append(f"{notebook}: 'not_shown' is a mapping of prediction id to the reason it is left out")
        not_shown = {}
    for prediction_id, reason in not_shown.items():
        where = f"{notebook}, not_shown {prediction_id!r}"
        problem = _prediction_problem(prediction_id, notebook, by_id)
        if problem:
            problems.append(f"{where}: {problem}")
        if prediction_id in ids:
            problems.append(f"{where}: it is also shown")
        if not isinstance(reason, str) or not reason.strip():
            problems.append(f"{where}: the reason it is left out is missing")
    return ReaderTable(notebook, tuple(rows), {str(k): str(v) for k, v in not_shown.items()})


def parse_reader_tables(text: str, predictions: Iterable[Prediction], source: str = READER_TABLES_NAME,
                        notebooks: Iterable[str] | None = None) -> dict[str, ReaderTable]:
    """The tables of a reader tables file's ``text``, checked against ``predictions`` (and, when given, the
    notebook stems that exist). Every problem found is listed in one ReaderTableError."""
    try:
        data = yaml.load(text, Loader=PredictionsLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        raise ReaderTableError(source, [f"not valid YAML: {str(error).splitlines()[0]}"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ReaderTableError(source, [f"the file must map notebook names to tables, not be a {type(data).__name__}"])
    predictions = list(predictions)
    by_id = {prediction.id: prediction for prediction in predictions}
    replaced = superseded_ids(predictions)
    known = set(notebooks) if notebooks is not None else None
    problems: list[str] = []
    tables = {}
    for notebook, entry in data.items():
        notebook = str(notebook)
        if known is not None and notebook not in known:
            problems.append(f"{notebook}: no such notebook (known: {', '.join(sorted(known))})")
        table = _check_table(notebook, entry, by_id, replaced, problems)
        if table is not None:
            tables[notebook] = table
    if problems:
        raise ReaderTableError(source, problems)
    return tables


def load_reader_tables(path: Path | str, predictions: Iterable[Prediction],
                       notebooks: Iterable[str] | None = None) -> dict[str, ReaderTable]:
    """Read and check a reader tables file (a missing file: no tables)."""
    path = Path(path)
    if not path.is_file():
        return {}
    return parse_reader_tables(path.read_text(encoding="utf-8"), predictions, source=str(path), notebooks=notebooks)

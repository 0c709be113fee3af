"""Grade the predictions that apply to one profile against the metrics its run recorded.

Each prediction gets one outcome:

- ``hit`` / ``miss``: the recorded value does / does not satisfy ``value <comparator> threshold``;
- ``void``: it could not be graded, and ``why`` says so (not run, notebook failed, run
  unfinished, metric missing, metric null, value not a number);
- ``superseded``: a later entry replaced it; shown, never graded.

Hit rate = hits / (hits + misses). Brier score = mean over hits and misses of
(confidence - outcome)^2 with outcome 1 for a hit and 0 for a miss (0 is perfect, 0.25 is what
always saying 0.5 earns). A miss is a finding, not a failure: grading never fails a build on one.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lora_lab.lab.predictions import Prediction, format_number, load_predictions, superseded_ids
from lora_lab.lab.recording import STATUS_COMPLETED, STATUS_FAILED, STATUS_RUNNING, find_repo_root

RUN_SUMMARY_NAME = "run_summary.json"
SCOREBOARD_MD = "scoreboard.md"
SCOREBOARD_PNG = "scoreboard.png"
OUTCOMES = ("hit", "miss", "void", "superseded")


@dataclass
class GradedRow:
    id: str
    claim: str
    notebook: str
    metric: str
    value: Any
    comparator: str
    threshold: Any
    predicted: str  # e.g. ">= 0.99999" or "in [1, 2]"
    confidence: float
    outcome: str
    why: str = ""
    registered: str = ""  # "<short commit> <date>" from git, "" if unknown


@dataclass
class Scoreboard:
    profile: str
    rows: list[GradedRow] = field(default_factory=list)
    generated: str = ""

    def count(self, outcome: str) -> int:
        return sum(row.outcome == outcome for row in self.rows)

    @property
    def graded(self) -> list[GradedRow]:
        return [row for row in self.rows if row.outcome in ("hit", "miss")]

    @property
    def hit_rate(self) -> float | None:
        graded = self.graded
        return sum(row.outcome == "hit" for row in graded) / len(graded) if graded else None

    @property
    def brier(self) -> float | None:
        graded = self.graded
        if not graded:
            return None
        return sum((row.confidence - (1.0 if row.outcome == "hit" else 0.0)) ** 2 for row in graded) / len(graded)

    def summary_line(self) -> str:
        rate = "n/a" if self.hit_rate is None else f"{self.hit_rate:.1%} ({self.count('hit')}/{len(self.graded)})"
        brier = "n/a" if self.brier is None else f"{self.brier:.4f}"
        return (
            f"profile {self.profile}: {self.count('hit')} hit, {self.count('miss')} miss, {self.count('void')} void, "
            f"{self.count('superseded')} superseded; hit rate {rate}; Brier score {brier}"
        )

    def table_text(self, claim_width: int = 48) -> str:
        if not self.rows:
            return f"no predictions apply to profile {self.profile}"
        header = ("id", "outcome", "value", "predicted", "conf", "claim / why")
        body = []
        for row in self.rows:
            claim = row.claim if len(row.claim) <= claim_width else row.claim[: claim_width - 1] + "…"
            detail = claim + (f"  [{row.why}]" if row.why else "")
            body.append((row.id, row.outcome.upper(), format_value(row.value), row.predicted, f"{row.confidence:.2f}", detail))
        widths = [max(len(str(line[column])) for line in [header, *body]) for column in range(len(header) - 1)]

        def render(line: tuple) -> str:
            return "  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1]

        return "\n".join([render(header), render(tuple("-" * width for width in widths) + ("-" * 11,)), *map(render, body)])

    def markdown(self) -> str:
        lines = [
            f"# Scoreboard: profile `{self.profile}`",
            "",
            f"Generated {self.generated} by `lora-lab grade --profile {self.profile}`.",
            "",
            f"**{self.summary_line()}**",
            "",
            "Hit rate and Brier score count hits and misses only; void predictions say why they could not be graded; "
            "superseded ones are shown, not graded.",
            "",
            "| id | notebook | claim | metric | value | predicted | confidence | outcome | why | registered |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in self.rows:
            cells = (
                f"`{row.id}`",
                row.notebook,
                row.claim,
                f"`{row.metric}`",
                format_value(row.value),
                row.predicted,
                f"{row.confidence:.2f}",
                f"**{row.outcome}**",
                row.why,
                row.registered,
            )
            lines.append("| " + " | ".join(escape_cell(cell) for cell in cells) + " |")
        if not self.rows:
            lines.append(f"| (no predictions apply to profile {self.profile}) | | | | | | | | | |")
        return "\n".join(lines) + "\n"


def escape_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def format_value(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, (list, dict)):
        text = json.dumps(value)
        return text if len(text) <= 40 else text[:39] + "…"
    return format_number(value)


# --------------------------------------------------------------------------------------------
# Reading a profile's outputs
# --------------------------------------------------------------------------------------------


def read_json(path: Path) -> tuple[dict[str, Any] | None, str]:
    """(payload, "") or (None, why it could not be read)."""
    if not path.is_file():
        return None, "missing"
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return None, f"unreadable ({error})"
    if not isinstance(payload, dict):
        return None, "not a JSON object"
    return payload, ""


def describe_error(error: dict[str, Any] | None) -> str:
    if not error:
        return ""
    where = f" (cell {error['cell_index']})" if error.get("cell_index") is not None else ""
    message = str(error.get("evalue") or "").strip().splitlines()
    message_text = f": {message[0][:120]}" if message else ""
    return f"{error.get('ename', 'error')}{message_text}{where}"


def why_void(
    prediction: Prediction, profile: str, metrics_file: Path, run_summary: dict[str, Any]
) -> tuple[str, Any]:
    """("", value) if the prediction can be graded, else (why it is void, value if any)."""
    summary_entry = (run_summary.get("notebooks") or {}).get(prediction.notebook, {})
    payload, problem = read_json(metrics_file)
    if payload is None:
        if summary_entry.get("status") == "failed":
            return f"notebook failed before recording: {describe_error(summary_entry.get('error'))}", None
        if problem == "missing":
            return f"not run: no {metrics_file.name}", None
        return f"metrics file {problem}", None

    provenance = payload.get("provenance") or {}
    status = provenance.get("status")
    metrics = payload.get("metrics") or {}
    value = metrics.get(prediction.metric) if isinstance(metrics, dict) else None
    if payload.get("profile") not in (None, profile):
        return f"metrics file records profile {payload.get('profile')!r}, not {profile!r}", value
    if status == STATUS_FAILED:
        error = provenance.get("error") or summary_entry.get("error")
        return f"notebook failed: {describe_error(error)}".rstrip(": "), value
    if status == STATUS_RUNNING:
        return "run unfinished: finish_run() was not called, or the kernel died", value
    if status != STATUS_COMPLETED:
        return f"run status {status!r} is not {STATUS_COMPLETED!r}", value
    if not isinstance(metrics, dict) or prediction.metric not in metrics:
        recorded = sorted(metrics) if isinstance(metrics, dict) else []
        shown = ", ".join(recorded[:6]) + (", …" if len(recorded) > 6 else "")
        return f"metric {prediction.metric!r} not recorded (recorded: {shown or 'nothing'})", None
    if value is None:
        note = (payload.get("notes") or {}).get(prediction.metric)
        return f"metric {prediction.metric!r} is null" + (f" ({note})" if note else ""), None
    if isinstance(value, bool) or (isinstance(value, (int, float)) and math.isfinite(value)):
        return "", value
    return f"metric {prediction.metric!r} is not a number: {format_value(value)}", value


# --------------------------------------------------------------------------------------------
# Grading
# --------------------------------------------------------------------------------------------


def registered_labels(predictions_path: Path) -> dict[str, str]:
    """``{id: "<commit> <date>"}`` from git history; empty when git cannot tell."""
    from lora_lab.lab.verify import GitError, registrations, repository_root

    try:
        root = repository_root(predictions_path.parent)
        relative = predictions_path.resolve().relative_to(root.resolve()).as_posix()
        return {entry_id: f"{reg.short} {reg.date[:10]}" for entry_id, reg in registrations(root, relative).items()}
    except (GitError, ValueError, OSError):
        return {}


def grade_predictions(
    predictions: list[Prediction], profile: str, profile_dir: Path | str, registered: dict[str, str] | None = None
) -> Scoreboard:
    """Grade ``predictions`` that apply to ``profile`` against the files in ``profile_dir``."""
    profile_dir = Path(profile_dir)
    registered = registered or {}
    run_summary, _ = read_json(profile_dir / RUN_SUMMARY_NAME)
    run_summary = run_summary or {}
    replaced_by = superseded_ids(predictions)
    board = Scoreboard(profile=profile, generated=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    for prediction in predictions:
        if not prediction.applies_to(profile):
            continue
        row = GradedRow(
            id=prediction.id,
            claim=prediction.claim,
            notebook=prediction.notebook,
            metric=prediction.metric,
            value=None,
            comparator=prediction.comparator,
            threshold=prediction.threshold,
            predicted=prediction.threshold_text(),
            confidence=prediction.confidence,
            outcome="void",
            registered=registered.get(prediction.id, ""),
        )
        if prediction.id in replaced_by:
            row.outcome, row.why = "superseded", f"superseded by {replaced_by[prediction.id]}"
        else:
            why, value = why_void(prediction, profile, profile_dir / f"{prediction.notebook}.metrics.json", run_summary)
            row.value = value
            if why:
                row.why = why
            else:
                row.outcome = "hit" if prediction.holds_for(value) else "miss"
        board.rows.append(row)
    return board


def plot_scoreboard(board: Scoreboard, path: Path) -> Path:
    """Outcome counts and a calibration view (confidence vs hit) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"hit": "#2e7d32", "miss": "#c62828", "void": "#9e9e9e", "superseded": "#bdbdbd"}
    figure, (counts_axis, calibration_axis) = plt.subplots(1, 2, figsize=(10, 4))
    counts = [board.count(outcome) for outcome in OUTCOMES]
    counts_axis.bar(OUTCOMES, counts, color=[colours[outcome] for outcome in OUTCOMES])
    for position, count in enumerate(counts):
        counts_axis.text(position, count, str(count), ha="center", va="bottom")
    counts_axis.set_ylim(0, max(counts + [1]) * 1.15)
    counts_axis.set_ylabel("predictions")
    counts_axis.set_title(f"profile {board.profile}: outcomes")

    graded = board.graded
    calibration_axis.plot([0, 1], [0, 1], linestyle="--", color="#757575", linewidth=1, label="perfect calibration")
    if graded:
        for index, row in enumerate(graded):
            jitter = ((index % 7) - 3) * 0.012
            outcome = 1.0 if row.outcome == "hit" else 0.0
            calibration_axis.scatter(row.confidence, outcome + jitter, color=colours[row.outcome], zorder=3)
        edges = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0001]
        centres, rates = [], []
        for low, high in zip(edges, edges[1:]):
            in_bin = [row for row in graded if low <= row.confidence < high]
            if in_bin:
                centres.append(sum(row.confidence for row in in_bin) / len(in_bin))
                rates.append(sum(row.outcome == "hit" for row in in_bin) / len(in_bin))
        calibration_axis.plot(centres, rates, marker="o", color="#1565c0", label="observed hit rate per bin")
    else:
        calibration_axis.text(0.5, 0.5, "nothing graded yet", ha="center", va="center")
    brier = "n/a" if board.brier is None else f"{board.brier:.3f}"
    calibration_axis.set_title(f"confidence vs outcome (Brier {brier})")
    calibration_axis.set_xlabel("confidence")
    calibration_axis.set_ylabel("hit (1) / miss (0)")
    calibration_axis.set_xlim(-0.05, 1.05)
    calibration_axis.set_ylim(-0.1, 1.1)
    calibration_axis.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def write_scoreboard(board: Scoreboard, profile_dir: Path | str) -> tuple[Path, Path]:
    profile_dir = Path(profile_dir)
    profile_dir.mkdir(parents=True, exist_ok=True)
    markdown_path = profile_dir / SCOREBOARD_MD
    markdown_path.write_text(board.markdown(), encoding="utf-8")
    return markdown_path, plot_scoreboard(board, profile_dir / SCOREBOARD_PNG)


def grade(
    profile: str,
    predictions_path: Path | str | None = None,
    outputs_root: Path | str | None = None,
    notebooks_dir: Path | str | None = None,
    known_notebooks: set[str] | None = None,
    write: bool = True,
    echo: bool = True,
) -> Scoreboard:
    """Load and validate predictions, grade ``profile``, write scoreboard.md/.png, print the table."""
    root = find_repo_root() or Path.cwd().resolve()
    predictions_path = Path(predictions_path) if predictions_path is not None else root / "predictions" / "predictions.yaml"
    profile_dir = (Path(outputs_root) if outputs_root is not None else root / "outputs") / profile
    predictions = load_predictions(predictions_path, notebooks_dir=notebooks_dir, known=known_notebooks)
    board = grade_predictions(predictions, profile, profile_dir, registered_labels(predictions_path))
    if write:
        markdown_path, png_path = write_scoreboard(board, profile_dir)
    if echo:
        print(board.table_text())
        print()
        print(board.summary_line())
        if write:
            print(f"wrote {markdown_path} and {png_path}")
    return board

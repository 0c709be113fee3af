"""Grade the predictions that apply to one profile against the metrics its run recorded.

Each prediction gets one outcome:

- ``hit`` / ``miss``: the recorded value does / does not satisfy ``value <comparator> threshold``;
  for a repeated measurement (median and 95% interval over >= 5 independent repetitions, see
  :mod:`lora_lab.lab.measure`) the whole interval must satisfy it (hit) or none of it (miss);
- ``inconclusive``: the interval straddles the threshold — the runs cannot tell;
- ``void``: it could not be graded, and ``why`` says so (not run, notebook failed or interrupted, run
  unfinished, run with parameters other than the registered ones, metric missing or null, fewer than
  five repetitions, value not a number, a speed ratio measured in one session only — see below);
- ``superseded``: a later entry replaced it; shown, never graded.

**Speed ratios need two sessions.** The interval of a repeated measurement taken in one process says nothing
about the spread between processes, and republished speed ratios moved by more than their intervals. So a
prediction whose metric is a speed ratio (``Prediction.is_speed_ratio``: ``kind: speed_ratio`` or a metric key
naming a timing ratio) is ``void`` unless its value records ``"sessions": k`` with k >= 2 — the number of
separate processes whose repetitions the interval pools (:data:`SESSIONS_KEY`; a value without the key, or a
plain number, counts as one session). The outcome the one-session interval would have had is kept beside
the void (``one_session_outcome``) and shown in the run history. (A rule since 76030ca: earlier runs are graded
without it, see below.)

**Run history.** Every published run of a notebook is kept (:mod:`lora_lab.lab.history`,
``outputs/<profile>/run_history.json``). A prediction's first run that graded it (hit, miss or inconclusive)
is its **registered test**; later runs are **replications**; runs before it that were void do not count. The
headline outcome (and value) of a prediction is its registered test's, never replaced by a later run; the
history column lists every run's outcome, and a prediction whose outcomes differ between runs is **unstable**
(counted in the summary). A prediction no recorded run graded is graded on the current metrics file.

**Rules of the run's day.** Each recorded run is graded by the rules in force at the commit it ran from, and by the
grading amendments registered by then (:mod:`lora_lab.lab.rules`); a later rule never regrades it. Where today's
rules would grade a headline run otherwise, the row says so beside it (``later``), and the summary counts them.
A superseded prediction whose first run graded it before it was superseded keeps that outcome beside it
(``first_run``); the summary counts those apart, next to the headline.

Hit rate = hits / (hits + misses) over the headline outcomes, i.e. the registered tests. Brier score = mean
over those hits and misses of (confidence - outcome)^2 with outcome 1 for a hit and 0 for a miss (0 is
perfect, 0.25 is what always saying 0.5 earns); inconclusive outcomes count apart; replications do not enter
either. Blind predictions (registered before any related result) and informed ones (``informed_by``, given
in the entry or by a later label amendment) are scored separately as well as together. A miss is a finding,
not a failure: grading never fails a build on one.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lora_lab.lab.git_history import GitError, registrations, repository_root
from lora_lab.lab.history import load_history
from lora_lab.lab.predictions import Prediction, PredictionError, format_number, load_predictions, superseded_ids
from lora_lab.lab.rules import (  # noqa: F401 - MIN_SESSIONS and why_void_payload: public here too
    MIN_SESSIONS,
    ONE_SESSION_WHY,
    RULES,
    SESSIONS_KEY,
    describe_error,
    format_value,
    is_repeated,
    outcome_of,
    sessions_of,
    why_void_payload,
)
from lora_lab.lab.scoreboard_files import (  # noqa: F401 - SCOREBOARD_MD/PNG and plot_scoreboard: public here too
    SCOREBOARD_MD,
    SCOREBOARD_PNG,
    plot_scoreboard,
    scoreboard_is_current,
    write_scoreboard,
)

RUN_SUMMARY_NAME = "run_summary.json"
OUTCOMES = ("hit", "miss", "inconclusive", "void", "superseded")
GRADED_OUTCOMES = ("hit", "miss", "inconclusive")
AWAITING_WHY = "its test is the next run"  # the end of a void's why: registered after the latest run began


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
    informed_by: str = ""
    interval: tuple[float, float] | None = None  # 95% interval of a repeated measurement
    repetitions: int | None = None
    sessions: int | None = None  # separate processes a repeated measurement pools (None: not recorded)
    one_session_outcome: str = ""  # a one-session speed ratio's void: what its interval alone gives
    amended: str = ""  # why its label was amended ("" = not amended)
    ran: str = ""  # "ran <commit>" when the published run's code differs from the working tree's
    history: list[dict] = field(default_factory=list)  # every recorded run that graded it, oldest first
    rules: int | None = None  # the rules version its headline run was graded under (None: today's, no history)
    later: str = ""  # what today's rules give its headline run, when that differs ("void: why")
    first_run: str = ""  # a superseded prediction's graded first run: its outcome ("" = none)

    @property
    def unstable(self) -> bool:
        """True when recorded runs disagree (one-session voids count by what their interval gave)."""
        return len({run["effective"] for run in self.history if run["effective"]}) >= 2

    def history_text(self) -> str:
        """``r1 <commit>: miss (test) → r2 <commit>: hit (replication); **unstable**`` ("" without history);
        ``x*``: a one-session speed ratio (void) whose interval alone gave x."""
        parts = []
        for number, run in enumerate(self.history, 1):
            outcome = f"{run['one_session_outcome']}*" if run.get("one_session_outcome") else run["outcome"]
            role = f" ({run['role']})" if run["role"] in ("test", "replication") else ""
            parts.append(f"r{number} {run['commit'] or '?'}: {outcome}{role}")
        if not parts:
            return ""
        return " → ".join(parts) + ("; **unstable**" if self.unstable else "")

    @property
    def blind(self) -> bool:
        return not self.informed_by

    def measured_text(self) -> str:
        text = format_value(self.value)
        if self.interval is not None:
            sessions = f", {self.sessions} sessions" if self.sessions is not None else ""
            text += (f" [{format_number(self.interval[0])}, {format_number(self.interval[1])}] "
                     f"(n={self.repetitions}{sessions})")
        return text


@dataclass
class Scoreboard:
    profile: str
    rows: list[GradedRow] = field(default_factory=list)
    generated: str = ""

    def count(self, outcome: str, rows: list[GradedRow] | None = None) -> int:
        return sum(row.outcome == outcome for row in (self.rows if rows is None else rows))

    @property
    def graded(self) -> list[GradedRow]:
        return [row for row in self.rows if row.outcome in ("hit", "miss")]

    @staticmethod
    def _hit_rate(graded: list[GradedRow]) -> float | None:
        return sum(row.outcome == "hit" for row in graded) / len(graded) if graded else None

    @staticmethod
    def _brier(graded: list[GradedRow]) -> float | None:
        if not graded:
            return None
        return sum((row.confidence - (1.0 if row.outcome == "hit" else 0.0)) ** 2 for row in graded) / len(graded)

    @property
    def hit_rate(self) -> float | None:
        return self._hit_rate(self.graded)

    @property
    def brier(self) -> float | None:
        return self._brier(self.graded)

    def group_line(self, label: str, rows: list[GradedRow]) -> str:
        graded = [row for row in rows if row.outcome in ("hit", "miss")]
        rate, brier = self._hit_rate(graded), self._brier(graded)
        rate_text = "n/a" if rate is None else f"{rate:.1%} ({self.count('hit', rows)}/{len(graded)})"
        brier_text = "n/a" if brier is None else f"{brier:.4f}"
        awaiting = sum(row.outcome == "void" and row.why.endswith(AWAITING_WHY) for row in rows)
        waiting = f" ({awaiting} of them awaiting their first run)" if awaiting else ""
        return (f"{label}: {self.count('hit', rows)} hit, {self.count('miss', rows)} miss, "
                f"{self.count('inconclusive', rows)} inconclusive, {self.count('void', rows)} void{waiting}; "
                f"hit rate {rate_text}; Brier score {brier_text}; "
                f"{sum(row.unstable for row in rows)} unstable across runs")

    def summary_line(self) -> str:
        live = [row for row in self.rows if row.outcome != "superseded"]
        return (self.group_line(f"profile {self.profile}", live)
                + f"; {self.count('superseded')} superseded")

    def with_superseded_first_runs(self) -> list[GradedRow]:
        """The live rows, plus each superseded prediction whose first run graded it (before it was superseded),
        counted by that run's outcome."""
        live = [row for row in self.rows if row.outcome != "superseded"]
        return live + [GradedRow(**{**row.__dict__, "outcome": row.first_run}) for row in self.rows
                       if row.outcome == "superseded" and row.first_run]

    def split_lines(self) -> list[str]:
        live = [row for row in self.rows if row.outcome != "superseded"]
        superseded = sum(row.outcome == "superseded" and bool(row.first_run) for row in self.rows)
        later = [row for row in live if row.later]
        return [self.group_line("blind", [row for row in live if row.blind]),
                self.group_line("informed", [row for row in live if not row.blind]),
                self.group_line(f"counting the graded first runs of {superseded} superseded predictions",
                                self.with_superseded_first_runs()),
                f"today's rules would grade {len(later)} headline run(s) otherwise "
                f"({sum(row.later.startswith('void') for row in later)} void); each headline stands, graded by "
                "the rules of its run"]

    def table_text(self, claim_width: int = 48) -> str:
        if not self.rows:
            return f"no predictions apply to profile {self.profile}"
        header = ("id", "outcome", "value", "predicted", "conf", "claim / why")
        body = []
        for row in self.rows:
            claim = row.claim if len(row.claim) <= claim_width else row.claim[: claim_width - 1] + "…"
            detail = claim + (f"  [{row.why}]" if row.why else "")
            detail += "  [UNSTABLE across runs]" if row.unstable else ""
            body.append((row.id, row.outcome.upper(), row.measured_text(), row.predicted, f"{row.confidence:.2f}",
                         detail))
        widths = [max(len(str(line[column])) for line in [header, *body]) for column in range(len(header) - 1)]

        def render(line: tuple) -> str:
            return "  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1]

        rule = render(tuple("-" * width for width in widths) + ("-" * 11,))
        return "\n".join([render(header), rule, *map(render, body)])

    def markdown(self) -> str:
        lines = [
            f"# Scoreboard: profile `{self.profile}`",
            "",
            f"Generated {self.generated} by `lora-lab grade --profile {self.profile}`.",
            "",
            f"**{self.summary_line()}**",
            "",
            *[f"- {line}" for line in self.split_lines()],
            "",
            "Hit rate and Brier score count hits and misses only, each prediction by its registered test: the "
            "first published run that graded it (the headline outcome and measured value); later runs are "
            "replications, listed under *history* (r1, r2, … with the commit each ran), and a prediction whose "
            "runs disagree is **unstable**. *Inconclusive*: the 95% interval of repeated measurements straddles "
            "the threshold. Void predictions say why they could not be graded (a speed ratio needs an interval "
            "pooled over ≥ 2 sessions; `x*` in a history is what a one-session interval gave); superseded ones are "
            "shown, not graded, with the outcome of their first run when it graded them before they were superseded "
            "(counted apart above). Each run is graded by the rules in force at the commit it ran from "
            "(`lora_lab.lab.rules`: " + "; ".join(f"v{item.version} {item.commit} {item.date}: {item.rule}"
                                                 for item in RULES)
            + "); a later rule never regrades an earlier run: where today's rules would grade a headline run "
            "otherwise, *why* says so beside it. *Informed*: registered after a related result was seen (what, in the "
            "column; "
            "*amended*: relabelled by a later label amendment). *Run*: `ran <commit>` when the published run's "
            "code differs from this commit's.",
            "",
            "| id | notebook | claim | metric | measured | predicted | confidence | outcome | why | informed by "
            "| registered | run | history |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in self.rows:
            cells = (
                f"`{row.id}`",
                row.notebook,
                row.claim,
                f"`{row.metric}`",
                row.measured_text(),
                row.predicted,
                f"{row.confidence:.2f}",
                f"**{row.outcome}**" + (f" (first run: {row.first_run})" if row.first_run else ""),
                "; ".join(filter(None, [row.why, f"graded by rules v{row.rules}; today's rules: {row.later}"
                                        if row.later else ""])),
                (row.informed_by + (f" (amended: {row.amended})" if row.amended else "")) or "blind",
                row.registered,
                row.ran,
                row.history_text(),
            )
            lines.append("| " + " | ".join(escape_cell(cell) for cell in cells) + " |")
        if not self.rows:
            lines.append(f"| (no predictions apply to profile {self.profile}) | | | | | | | | | | | | |")
        return "\n".join(lines) + "\n"


def escape_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")



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
    return why_void_payload(prediction, profile, payload, summary_entry)



# --------------------------------------------------------------------------------------------
# Grading
# --------------------------------------------------------------------------------------------


def registered_labels(predictions_path: Path) -> dict[str, str]:
    """``{id: "<commit> <date>"}`` from git history; empty when git cannot tell."""
    try:
        root = repository_root(predictions_path.parent)
        relative = predictions_path.resolve().relative_to(root.resolve()).as_posix()
        return {entry_id: f"{reg.short} {reg.date[:10]}" for entry_id, reg in registrations(root, relative).items()}
    except (GitError, ValueError, OSError):
        return {}


def registration_times(predictions_path: Path) -> dict[str, str]:
    """``{id: ISO date of the commit that registered it}`` from git history; empty when git cannot tell."""
    try:
        root = repository_root(predictions_path.parent)
        relative = predictions_path.resolve().relative_to(root.resolve()).as_posix()
        return {entry_id: reg.date for entry_id, reg in registrations(root, relative).items()}
    except (GitError, ValueError, OSError):
        return {}


def _instant(text: Any) -> _dt.datetime | None:
    try:
        moment = _dt.datetime.fromisoformat(str(text))
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=_dt.timezone.utc)


def registered_after_run(registered_at: str | None, metrics_file: Path) -> str:
    """Why a metrics file cannot be a prediction's test — the prediction was registered after that run started —
    or ""; a prediction is graded only by runs that began after it was committed."""
    when = _instant(registered_at) if registered_at else None
    payload, _ = read_json(metrics_file)
    started = _instant(((payload or {}).get("provenance") or {}).get("started")) if payload else None
    if when is None or started is None or when <= started:
        return ""
    return (f"registered {when.isoformat(timespec='minutes')}, after this run started "
            f"({started.isoformat(timespec='minutes')}): {AWAITING_WHY}")


def grade_row(prediction: Prediction, profile: str, metrics_file: Path, run_summary: dict[str, Any],
              superseded_by: str | None = None, registered: str = "") -> GradedRow:
    """One prediction graded against one metrics file."""
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
        registered=registered,
        informed_by=prediction.informed_by,
        amended=prediction.amended,
    )
    if superseded_by is not None:
        row.outcome, row.why = "superseded", f"superseded by {superseded_by}"
        return row
    why, value = why_void(prediction, profile, metrics_file, run_summary)
    return fill_outcome(row, prediction, why, value)


def fill_outcome(row: GradedRow, prediction: Prediction, why: str, value: Any) -> GradedRow:
    """Set ``row``'s value, interval, sessions and outcome from :func:`why_void`'s answer."""
    if is_repeated(value):
        row.value, row.interval, row.repetitions = value["median"], tuple(value["ci95"]), value["n"]
        row.sessions = sessions_of(value) if SESSIONS_KEY in value else None
    else:
        row.value = value
    if why:
        row.why = why
        if why.startswith(ONE_SESSION_WHY):
            row.one_session_outcome = outcome_of(prediction, value)
    else:
        row.outcome = outcome_of(prediction, value)
    return row


def grade_predictions(
    predictions: list[Prediction], profile: str, profile_dir: Path | str, registered: dict[str, str] | None = None,
    history: list[dict] | None = None, registered_at: dict[str, str] | None = None,
) -> Scoreboard:
    """Grade ``predictions`` that apply to ``profile`` against the files in ``profile_dir``; with a run
    ``history`` (default: ``profile_dir``'s run_history.json, if any), each prediction's headline is its
    registered test and its row lists every recorded run (see the module docstring)."""
    profile_dir = Path(profile_dir)
    registered = registered or {}
    history = load_history(profile_dir) if history is None else history
    run_summary, _ = read_json(profile_dir / RUN_SUMMARY_NAME)
    run_summary = run_summary or {}
    replaced_by = superseded_ids(predictions)
    board = Scoreboard(profile=profile, generated=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    ran_labels: dict[str, str] = {}
    for prediction in predictions:
        if prediction.applies_to(profile):
            metrics_file = profile_dir / f"{prediction.notebook}.metrics.json"
            row = grade_row(prediction, profile, metrics_file, run_summary, replaced_by.get(prediction.id),
                            registered.get(prediction.id, ""))
            if prediction.notebook not in ran_labels:
                ran_labels[prediction.notebook] = ran_label(metrics_file)
            row.ran = ran_labels[prediction.notebook]
            if row.outcome == "superseded":
                first = GradedRow(**{**row.__dict__, "outcome": "void", "history": []})
                apply_history(first, prediction, history)
                test = next((run for run in first.history if run["role"] == "test"), None)
                replaced_at = _instant((registered_at or {}).get(replaced_by[prediction.id]))
                published = _instant(test.get("published")) if test else None
                before = replaced_at is None or published is None or published <= replaced_at
                row.first_run = first.outcome if first.outcome in GRADED_OUTCOMES and before else ""
                row.history, row.value, row.interval = first.history, first.value, first.interval
                row.repetitions, row.sessions, row.rules = first.repetitions, first.sessions, first.rules
            else:
                apply_history(row, prediction, history)
                tested = any(run["role"] == "test" for run in row.history)
                late = "" if tested else registered_after_run((registered_at or {}).get(prediction.id), metrics_file)
                if late and row.outcome in GRADED_OUTCOMES:
                    row.outcome, row.why, row.one_session_outcome = "void", late, ""
                elif late and row.outcome == "void":  # not graded anyway: say that no run has tested it yet
                    row.why, row.one_session_outcome = late, ""
            board.rows.append(row)
    return board


def ran_label(metrics_file: Path) -> str:
    """``ran <commit>`` when the run's recorded code hash differs from the working tree's (same hash scope);
    ``current code`` when it matches; "" when the file or its hash is missing."""
    from lora_lab.lab.provenance import code_hash, code_hash_scope_of

    payload, _ = read_json(metrics_file)
    provenance = (payload or {}).get("provenance") or {}
    recorded = provenance.get("code_hash")
    if not recorded:
        return ""
    try:
        current = code_hash(scope=code_hash_scope_of(provenance))
    except ValueError:
        current = None
    if recorded == current:
        return "current code"
    return f"ran {str(provenance.get('git_commit') or 'unknown commit')[:7]}"


def apply_history(row: GradedRow, prediction: Prediction, history: list[dict]) -> None:
    """Fill ``row.history`` from the recorded runs that graded ``prediction``; the headline becomes the
    registered test's (the first run that graded it), replications are labelled so."""
    runs = [run for run in history if run.get("notebook") == prediction.notebook
            and prediction.id in (run.get("graded") or {})]
    test = next((index for index, run in enumerate(runs)
                 if run["graded"][prediction.id].get("outcome") in GRADED_OUTCOMES), None)
    for index, run in enumerate(runs):
        graded = run["graded"][prediction.id]
        role = "void" if test is None or index < test else "test" if index == test else "replication"
        outcome = graded.get("outcome", "void")
        effective = outcome if outcome in GRADED_OUTCOMES else graded.get("one_session_outcome") or ""
        commit = str(run.get("git_commit") or "")[:7] or (  # early runs recorded no commit: where they were published
            f"published in {str(run['published_in'])[:7]}" if run.get("published_in") else "")
        row.history.append({"commit": commit, "outcome": outcome, "published": run.get("published"),
                            "one_session_outcome": graded.get("one_session_outcome") or "", "role": role,
                            "effective": effective})
    if test is not None:
        graded = runs[test]["graded"][prediction.id]
        row.outcome, row.why = graded["outcome"], graded.get("why") or ""
        row.value = graded.get("value")
        row.interval = tuple(graded["ci95"]) if graded.get("ci95") else None
        row.repetitions, row.sessions, row.one_session_outcome = graded.get("n"), graded.get("sessions"), ""
        row.rules, row.later = runs[test].get("rules"), graded.get("later") or ""


def uncommitted_change(predictions_path: Path) -> str | None:
    """Why ``predictions_path`` does not match the last commit (None when it does, or git cannot tell)."""
    import subprocess

    path = Path(predictions_path).resolve()
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--", path.name], cwd=path.parent,
                                capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if status.returncode != 0:
        return None  # not a repository: nothing to compare with
    line = status.stdout.strip()
    if not line:
        return None
    return "not committed yet" if line.startswith("??") else "changed since the last commit"


def grade(
    profile: str,
    predictions_path: Path | str | None = None,
    outputs_root: Path | str | None = None,
    notebooks_dir: Path | str | None = None,
    known_notebooks: set[str] | None = None,
    write: bool = True,
    echo: bool = True,
    require_committed: bool = True,
) -> Scoreboard:
    """Load and validate predictions, grade ``profile``, write scoreboard.md/.png, print the table.

    Refuses (PredictionError) a predictions file with uncommitted changes: a prediction is registered by
    committing it, and grading against an edit would grade what nobody registered.
    """
    from lora_lab.lab.predictions import repository_root

    root = repository_root() if predictions_path is None or outputs_root is None else None
    predictions_path = (Path(predictions_path) if predictions_path is not None
                        else root / "predictions" / "predictions.yaml")
    profile_dir = (Path(outputs_root) if outputs_root is not None else root / "outputs") / profile
    if require_committed:
        change = uncommitted_change(predictions_path)
        if change is not None:
            raise PredictionError(str(predictions_path), [
                f"{change}: commit the predictions before grading (a prediction counts from the commit that "
                "registers it)"])
    predictions = load_predictions(predictions_path, notebooks_dir=notebooks_dir, known=known_notebooks)
    board = grade_predictions(predictions, profile, profile_dir, registered_labels(predictions_path),
                              registered_at=registration_times(predictions_path))
    if write:
        unchanged = scoreboard_is_current(board, profile_dir)
        markdown_path, png_path = write_scoreboard(board, profile_dir)
    if echo:
        print(board.table_text())
        print()
        print(board.summary_line())
        for line in board.split_lines():
            print("  " + line)
        if write:
            print(f"{markdown_path} and {png_path} unchanged (same grading)" if unchanged
                  else f"wrote {markdown_path} and {png_path}")
    return board

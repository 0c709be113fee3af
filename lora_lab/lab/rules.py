"""The grading rules, versioned: a run is graded by the rules in force at the commit it ran from.

A rule added later applies to later runs only; it never regrades a run that came before it. Each version names
the commit that brought it in; a run is under version *v* when that commit is an ancestor of (or is) the commit
the run started from (a run that recorded no commit: a strict ancestor of the commit that published it).

=======  =========  ==========  ==========================================================================
version  commit     date        rule added
=======  =========  ==========  ==========================================================================
1        ef99a94    2026-11-29  a recorded value is graded hit or miss against the threshold; void says why
                                it could not be graded (not run, failed, unfinished, metric missing or null)
2        629a759    2026-11-30  a repeated measurement is graded on its 95% interval (inconclusive when it
                                straddles the threshold) and needs >= 5 repetitions; a run with parameters
                                other than the registered ones is void
3        76030ca    2026-12-01  a speed ratio measured in one session is void
4        67a2ad7    2026-12-01  a prediction registered after a run started is not graded by that run
=======  =========  ==========  ==========================================================================

Under version 1 a repeated measurement is graded on its median (no run under it recorded one). Errata
(:mod:`lora_lab.lab.errata`) are not rules: they correct what a run recorded, and apply to the run they name.
The grade a later version would give a run is kept beside it (the scoreboard says so), never in its place.

A label amendment that changes how a prediction is graded (``kind``) is versioned the same way: it applies to
the runs whose commit descends from the commit that registered it; one that only relabels (``informed_by``)
applies to every run.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from lora_lab.lab.errata import apply_errata
from lora_lab.lab.measure import MIN_REPETITIONS
from lora_lab.lab.predictions import Prediction, format_number
from lora_lab.lab.recording import STATUS_COMPLETED, STATUS_FAILED, STATUS_INTERRUPTED, STATUS_RUNNING

SESSIONS_KEY = "sessions"  # in a repeated measurement: how many separate processes its samples pool
MIN_SESSIONS = 2
ONE_SESSION_WHY = "one session: a speed ratio needs ≥ 2"
GRADING_AMENDMENT_FIELDS = ("kind",)  # an amendment of these changes how a prediction is graded


@dataclass(frozen=True)
class RuleVersion:
    version: int
    commit: str  # the commit that brought the rule in (a prefix)
    date: str
    rule: str


RULES = (
    RuleVersion(1, "ef99a94", "2026-11-29", "a value is graded hit or miss; void says why it could not be"),
    RuleVersion(2, "629a759", "2026-11-30", "a repeated measurement is graded on its interval (>= 5 repetitions)"),
    RuleVersion(3, "76030ca", "2026-12-01", "a speed ratio measured in one session is void"),
    RuleVersion(4, "67a2ad7", "2026-12-01", "a prediction registered after a run started is not graded by it"),
)
CURRENT = RULES[-1].version
INTERVALS, SPEED_RATIO_SESSIONS, REGISTERED_BEFORE_START = 2, 3, 4


def rule(version: int) -> RuleVersion:
    return RULES[version - 1]


def version_of_run(run: dict, in_history: Any) -> int:
    """The rules version in force for ``run`` (a run-history entry). ``in_history(older, newer, strict)`` tells
    whether commit ``older`` is an ancestor of ``newer`` (``strict``: and not equal to it)."""
    commit, published = run.get("git_commit"), run.get("published_in")
    version = 1
    for candidate in RULES[1:]:
        if commit and in_history(candidate.commit, str(commit), False):
            version = candidate.version
        elif not commit and published and in_history(candidate.commit, str(published), True):
            version = candidate.version
    return version


def in_force(prediction: Prediction, amendments_in_force: set[str] | None) -> Prediction:
    """``prediction`` as graded by a run under which only the amendments ``amendments_in_force`` had been registered
    (None: all of them): a grading amendment registered later is undone."""
    if amendments_in_force is None:
        return prediction
    changes = {name: old for key, name, old in prediction.grading_amendments if key not in amendments_in_force}
    return dataclasses.replace(prediction, **changes) if changes else prediction


def is_repeated(value: Any) -> bool:
    """A repeated measurement as :func:`lora_lab.lab.measure.summarize` writes it."""
    return isinstance(value, dict) and {"median", "ci95", "n"} <= set(value)


def sessions_of(value: Any) -> int:
    """How many separate processes (sessions) a recorded value pools: ``value["sessions"]``, else 1."""
    if is_repeated(value) and isinstance(value.get(SESSIONS_KEY), int) and not isinstance(value[SESSIONS_KEY], bool):
        return value[SESSIONS_KEY]
    return 1


def outcome_of(prediction: Prediction, value: Any, version: int = CURRENT) -> str:
    if is_repeated(value):
        if version < INTERVALS:
            return "hit" if prediction.holds_for(value["median"]) else "miss"
        low, high = value["ci95"]
        return prediction.outcome_for_interval(float(low), float(high))
    return "hit" if prediction.holds_for(value) else "miss"


def format_value(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, (list, dict)):
        text = json.dumps(value)
        return text if len(text) <= 40 else text[:39] + "…"
    return format_number(value)


def describe_error(error: dict[str, Any] | None) -> str:
    if not error:
        return ""
    where = f" (cell {error['cell_index']})" if error.get("cell_index") is not None else ""
    message = str(error.get("evalue") or "").strip().splitlines()
    message_text = f": {message[0][:120]}" if message else ""
    return f"{error.get('ename', 'error')}{message_text}{where}"


def skipped_cell_of(metric: str, payload: dict[str, Any]) -> tuple[str, str] | None:
    """(cell, why) of the cell the run skipped or shrank (its ``skipped_cells``, :mod:`lora_lab.memory.budget`) whose
    name is part of ``metric``'s key (between underscores, or the whole key), the longest such name; else None."""
    skipped = payload.get("skipped_cells")
    if not isinstance(skipped, dict):
        return None
    padded = f"_{metric}_"
    named = [cell for cell in skipped if isinstance(cell, str) and cell and f"_{cell}_" in padded]
    if not named:
        return None
    cell = max(named, key=len)
    return cell, str(skipped[cell])


def why_void_payload(
    prediction: Prediction, profile: str, payload: dict[str, Any], summary_entry: dict[str, Any] | None = None,
    version: int = CURRENT,
) -> tuple[str, Any]:
    """("", value) if the prediction can be graded against a metrics file already read (``payload``; the errata
    naming its run applied), else (why it is void, value if any); under the rules of ``version``."""
    summary_entry = summary_entry or {}
    payload = apply_errata(payload)
    provenance = payload.get("provenance") or {}
    status = provenance.get("status")
    metrics = payload.get("metrics") or {}
    value = metrics.get(prediction.metric) if isinstance(metrics, dict) else None
    if payload.get("profile") not in (None, profile):
        return f"metrics file records profile {payload.get('profile')!r}, not {profile!r}", value
    if status == STATUS_FAILED:
        error = provenance.get("error") or summary_entry.get("error")
        return f"notebook failed: {describe_error(error)}".rstrip(": "), value
    if status == STATUS_INTERRUPTED:
        return "run interrupted before the end", value
    if status == STATUS_RUNNING:
        return "run unfinished: finish_run() was not called, or the kernel died", value
    if status != STATUS_COMPLETED:
        return f"run status {status!r} is not {STATUS_COMPLETED!r}", value
    if not isinstance(metrics, dict) or prediction.metric not in metrics:
        skipped = skipped_cell_of(prediction.metric, payload)
        if skipped is not None:
            return f"metric {prediction.metric!r} not recorded: cell {skipped[0]!r} {skipped[1]}", None
        recorded = sorted(metrics) if isinstance(metrics, dict) else []
        shown = ", ".join(recorded[:6]) + (", …" if len(recorded) > 6 else "")
        cap = provenance.get("memory_cap_gib")
        under = f"; the run capped GPU memory at {cap:g} GiB" if isinstance(cap, (int, float)) else ""
        return f"metric {prediction.metric!r} not recorded (recorded: {shown or 'nothing'}){under}", None
    overrides = provenance.get("parameter_overrides") or {}
    if overrides and version >= INTERVALS:
        shown = ", ".join(f"{name}={value!r}" for name, value in sorted(overrides.items()))
        return f"run with parameters other than the registered ones ({shown})", value
    if value is None:
        note = (payload.get("notes") or {}).get(prediction.metric)
        return f"metric {prediction.metric!r} is null" + (f" ({note})" if note else ""), None
    if is_repeated(value):
        if value["n"] < MIN_REPETITIONS and version >= INTERVALS:
            return (f"metric {prediction.metric!r} has {value['n']} repetition(s); a timing claim is graded on "
                    f">= {MIN_REPETITIONS}"), value
    elif not (isinstance(value, bool) or (isinstance(value, (int, float)) and math.isfinite(value))):
        return f"metric {prediction.metric!r} is not a number: {format_value(value)}", value
    if version >= SPEED_RATIO_SESSIONS and prediction.is_speed_ratio and sessions_of(value) < MIN_SESSIONS:
        note = str((payload.get("notes") or {}).get(prediction.metric) or "")
        erratum = f"; {note}" if note.startswith("erratum:") else ""
        return f"{ONE_SESSION_WHY} (recorded from {sessions_of(value)}{erratum})", value
    return "", value


def _number(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float)) or value is None else None


def grade_record(prediction: Prediction, why: str, value: Any, version: int = CURRENT) -> dict[str, Any]:
    """A grade as the run history keeps it, from :func:`why_void_payload`'s answer: outcome, value (the median of a
    repeated measurement), ci95, n, sessions, why, one_session_outcome (a one-session speed ratio's void: what its
    interval alone gives)."""
    record = {"outcome": "void", "value": value, "ci95": None, "n": None, "sessions": None, "why": why,
              "one_session_outcome": ""}
    if is_repeated(value):
        record.update(value=value["median"], ci95=list(value["ci95"]), n=value["n"],
                      sessions=sessions_of(value) if SESSIONS_KEY in value else None)
    if why:
        if why.startswith(ONE_SESSION_WHY):
            record["one_session_outcome"] = outcome_of(prediction, value, version)
    else:
        record["outcome"] = outcome_of(prediction, value, version)
    return record


def grade_payload(prediction: Prediction, profile: str, payload: dict[str, Any], version: int = CURRENT,
                  amendments_in_force: set[str] | None = None) -> dict[str, Any]:
    """One prediction graded against one metrics payload under the rules of ``version``, as a history record
    (values that are not plain numbers dropped)."""
    prediction = in_force(prediction, amendments_in_force)
    why, value = why_void_payload(prediction, profile, payload, version=version)
    record = grade_record(prediction, why, value, version)
    record["value"] = _number(record["value"])
    return record

"""Every published run kept: ``outputs/<profile>/run_history.json``.

Publishing a notebook replaces its metrics file; the run history keeps the run. One entry per published run::

    {"notebook": "05_fused_lora_kernels", "git_commit": "<sha the run started from>", "code_hash": "…",
     "code_hash_scope": "lora_lab", "notebook_hash": "…", "device": "NVIDIA H200", "started": "…",
     "finished": "…", "published_in": "<sha of the commit that published it, or null>", "published": "<its date>",
     "source": "git" | "publish", "rules": 4, "grading_amendments": ["amends p09-x #1"],
     "graded": {"<prediction id>": {"outcome": "hit", "value": 1.4, "ci95": [1.3, 1.5], "n": 5,
                                    "sessions": null, "why": "", "one_session_outcome": ""}}}

``graded`` holds every prediction registered (committed) before the run was published that applies to the
profile and the notebook, graded by the rules in force at the commit it ran from (:mod:`lora_lab.lab.rules`):
``rules`` is their version, ``grading_amendments`` the amendments that changed how its predictions are graded,
and ``later`` (beside a grade, when it differs) what today's rules would give. ``lora-lab publish`` appends an
entry (source ``publish``); :func:`seed_history` rebuilds the entries of every run ever committed from git history
(source ``git``: each committed version of ``outputs/<profile>/<notebook>.metrics.json``), keeping published
entries git does not hold yet. ``python tools/seed_run_history.py`` regenerates the committed files.

The history also says which commit ran a published result: ``lora-lab verify`` accepts a published run whose
code differs from HEAD only when its history entry names the commit and code hash it ran (see
:mod:`lora_lab.lab.verify`), and the scoreboard labels it ``ran <commit>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lora_lab.lab.git_history import (
    amendment_registrations,
    commits_touching,
    file_at,
    git,
    is_ancestor,
    registrations,
    repository_root,
)
from lora_lab.lab.predictions import Prediction
from lora_lab.lab.recording import write_json_atomically
from lora_lab.lab.rules import CURRENT, version_of_run
from lora_lab.lab.rules import grade_payload as grade_under_rules

HISTORY_NAME = "run_history.json"
SCHEMA = 1

__all__ = ["HISTORY_NAME", "load_history", "write_history", "history_entry", "append_runs", "seed_history",
           "run_key", "runs_naming"]


def history_path(profile_dir: Path | str) -> Path:
    return Path(profile_dir) / HISTORY_NAME


def parse_history(text: str | None, where: str = HISTORY_NAME) -> list[dict]:
    """The runs of a history file's text (None or empty: no runs); a malformed file is a ValueError."""
    if not text:
        return []
    payload = json.loads(text)
    runs = payload.get("runs") if isinstance(payload, dict) else None
    if not isinstance(runs, list) or not all(isinstance(run, dict) for run in runs):
        raise ValueError(f"{where}: not a run history (a JSON object with a list 'runs' of objects)")
    return runs


def load_history(profile_dir: Path | str) -> list[dict]:
    """The recorded runs of a profile folder, oldest first (none when there is no history file)."""
    path = history_path(profile_dir)
    return parse_history(path.read_text(encoding="utf-8"), str(path)) if path.is_file() else []


def write_history(profile_dir: Path | str, profile: str, runs: list[dict]) -> Path:
    path = history_path(profile_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomically(path, {"schema": SCHEMA, "profile": profile, "runs": runs})
    return path


def run_key(run: dict) -> tuple:
    """What identifies one run: notebook, start and end times, code and notebook hashes."""
    return tuple(str(run.get(key)) for key in ("notebook", "started", "finished", "code_hash", "notebook_hash"))


def grade_payload(prediction: Prediction, profile: str, payload: dict[str, Any], version: int = CURRENT,
                  amendments_in_force: set[str] | None = None) -> dict[str, Any]:
    """One prediction graded against one metrics payload under the rules of ``version`` and the grading
    amendments registered before the run, as a history record; ``later``: what today's rules and amendments give,
    when that differs (kept beside the grade, never in its place)."""
    record = grade_under_rules(prediction, profile, payload, version, amendments_in_force)
    now = grade_under_rules(prediction, profile, payload)
    if now["outcome"] != record["outcome"]:
        record["later"] = f"{now['outcome']}: {now['why']}" if now["why"] else now["outcome"]
    return record


def history_entry(payload: dict[str, Any], profile: str, predictions: list[Prediction],
                  registered: set[str] | None = None, published_in: str | None = None,
                  published: str | None = None, source: str = "publish", version: int = CURRENT,
                  amendments_in_force: set[str] | None = None) -> dict[str, Any]:
    """The history entry of one run (its metrics ``payload``), graded against the ``predictions`` of its
    notebook that apply to ``profile`` and, when ``registered`` is given, whose ids are in it; under the rules of
    ``version`` and the grading amendments ``amendments_in_force`` (None: all), see :mod:`lora_lab.lab.rules`."""
    provenance = payload.get("provenance") or {}
    notebook = payload.get("notebook")
    chosen = [prediction for prediction in predictions
              if prediction.notebook == notebook and prediction.applies_to(profile)
              and (registered is None or prediction.id in registered)]
    graded = {prediction.id: grade_payload(prediction, profile, payload, version, amendments_in_force)
              for prediction in chosen}
    applied = sorted(key for prediction in chosen for key, _, _ in prediction.grading_amendments
                     if amendments_in_force is None or key in amendments_in_force)
    return {
        "notebook": notebook,
        "git_commit": provenance.get("git_commit"),
        "git_dirty": provenance.get("git_dirty"),
        "code_hash": provenance.get("code_hash"),
        "code_hash_scope": provenance.get("code_hash_scope"),
        "notebook_hash": provenance.get("notebook_hash"),
        "device": provenance.get("device"),
        "started": provenance.get("started"),
        "finished": provenance.get("finished"),
        "published_in": published_in,
        "published": published,
        "source": source,
        "rules": version,
        "grading_amendments": applied,
        "graded": dict(sorted(graded.items())),
    }


def append_runs(profile_dir: Path | str, profile: str, entries: list[dict]) -> Path:
    """Append ``entries`` to the profile's history (an entry already recorded, same :func:`run_key`, is not
    added twice)."""
    runs = load_history(profile_dir)
    known = {run_key(run) for run in runs}
    runs += [entry for entry in entries if run_key(entry) not in known]
    return write_history(profile_dir, profile, runs)


def runs_naming(runs: list[dict], notebook: str, commit: str, code_hash: str) -> list[dict]:
    """The recorded runs of ``notebook`` that name ``commit`` (full sha or a prefix of it) and ``code_hash``."""
    return [run for run in runs if run.get("notebook") == notebook and run.get("code_hash") == code_hash
            and run.get("git_commit") and (str(run["git_commit"]).startswith(commit)
                                           or commit.startswith(str(run["git_commit"])))]


# --------------------------------------------------------------------------------------------
# Seeding from git
# --------------------------------------------------------------------------------------------


def _committed_before(repo: Path, sha: str, predictions_path: str) -> set[str]:
    """Commits that touched the predictions file and are strict ancestors of ``sha``."""
    done = git(repo, "rev-list", "--full-history", f"{sha}^@", "--", predictions_path, check=False)
    return set(done.stdout.split()) if done.returncode == 0 else set()


def ancestry(repo: Path):
    """``in_history(older, newer, strict)``: is commit ``older`` an ancestor of ``newer`` (``strict``: other than
    it)? A commit this repository does not have (a rule's commit, seen from a history that never held it) counts as
    an ancestor: its rule is in force from the start."""
    known: dict[str, bool] = {}
    answers: dict[tuple[str, str, bool], bool] = {}

    def exists(sha: str) -> bool:
        if sha not in known:
            known[sha] = git(repo, "cat-file", "-e", f"{sha}^{{commit}}", check=False).returncode == 0
        return known[sha]

    def in_history(older: str, newer: str, strict: bool) -> bool:
        if (older, newer, strict) not in answers:
            if not exists(older):
                answers[older, newer, strict] = True
            elif strict and git(repo, "rev-parse", older).stdout.strip() == git(repo, "rev-parse", newer,
                                                                                 check=False).stdout.strip():
                answers[older, newer, strict] = False
            else:
                answers[older, newer, strict] = is_ancestor(repo, older, newer)
        return answers[older, newer, strict]

    return in_history


def seed_history(repo: Path | str, profile: str, predictions: list[Prediction],
                 predictions_path: str = "predictions/predictions.yaml", outputs: str = "outputs") -> list[dict]:
    """Every run of ``profile`` ever committed under ``<outputs>/<profile>/`` in HEAD's history, oldest first.

    Each committed version of a ``<notebook>.metrics.json`` is one run (a version whose run — same
    :func:`run_key` — was committed before is not counted again). It is graded against ``predictions``
    restricted to the ids registered in a strict ancestor of the commit that published it — what had been
    predicted before that result was committed — under the rules in force at the commit it ran from and the
    grading amendments registered by then (:mod:`lora_lab.lab.rules`); label amendments apply to every run.
    """
    root = repository_root(repo)
    registered = registrations(root, predictions_path)
    amendments = amendment_registrations(root, predictions_path)
    in_history = ancestry(root)
    folder = f"{outputs.rstrip('/')}/{profile}"
    listing = git(root, "log", "--format=", "--name-only", "HEAD", "--", f"{folder}/").stdout.split()
    depth = folder.count("/") + 1
    paths = sorted({path for path in listing if path.endswith(".metrics.json") and path.count("/") == depth})
    runs, seen = [], set()
    for path in paths:
        for commit in commits_touching(root, path):
            text = file_at(root, commit.sha, path)
            if text is None:
                continue
            try:
                payload = json.loads(text)
            except ValueError:
                continue
            if not isinstance(payload, dict):
                continue
            payload.setdefault("notebook", Path(path).name.removesuffix(".metrics.json"))
            entry = history_entry(payload, profile, predictions, set(), commit.sha, commit.date, "git")
            if run_key(entry) in seen:
                continue
            seen.add(run_key(entry))
            before = _committed_before(root, commit.sha, predictions_path)
            ids = {entry_id for entry_id, registration in registered.items() if registration.commit in before}
            version = version_of_run(entry, in_history)
            ran = entry.get("git_commit")
            in_force = {key for key, registration in amendments.items()
                        if in_history(registration.commit, str(ran or commit.sha), not ran)}
            runs.append(history_entry(payload, profile, predictions, ids, commit.sha, commit.date, "git", version,
                                      in_force))
    runs.sort(key=lambda run: (str(run["published"]), str(run["finished"]), str(run["notebook"])))
    return runs


def regenerate(repo: Path | str, profile: str, predictions: list[Prediction], profile_dir: Path | str,
               predictions_path: str = "predictions/predictions.yaml", outputs: str = "outputs") -> Path:
    """Rewrite ``profile_dir``'s history: the runs git holds (:func:`seed_history`), then the recorded runs git
    does not hold yet (published, not committed), in their order."""
    seeded = seed_history(repo, profile, predictions, predictions_path, outputs)
    known = {run_key(run) for run in seeded}
    pending = [run for run in load_history(profile_dir) if run_key(run) not in known]
    return write_history(profile_dir, profile, seeded + pending)

"""Check from git history that the pre-registration was honest.

Six invariants:

1. **Append-only.** For every commit C that touched ``predictions/predictions.yaml`` and every
   parent P of C: each id in the file at P is in the file at C, unchanged (compared as parsed
   YAML, so comments and formatting may change); so is each label amendment (``amends:`` items, keyed
   ``amends <id> #k``, the k-th amendment of that id). The working tree is checked against HEAD the
   same way, so an edit is caught before it is committed.
2. **Predicted before measured.** For every blind prediction that grading would grade (it applies to
   the profile and is not superseded) and whose metric appears in a committed
   ``outputs/<profile>/<notebook>.metrics.json``: the commit that first added the prediction must
   be a strict ancestor of the first commit whose metrics file holds that metric. An *informed* prediction
   (``informed_by``, in the entry or by a label amendment) may postdate its metric — it says what it saw, and
   the scoreboard scores it apart — and is listed as a note.

3. **Results tie to code.** Every committed ``outputs/<profile>/*.metrics.json`` that names the commit it ran
   (``git_commit``) and carries a ``code_hash`` must have been run by exactly the code committed there:
   the hash recomputed from that commit, over the files of the run's ``code_hash_scope`` (``lora_lab/`` and
   ``benchmarks/`` for newer runs; ``lora_lab/`` for older ones, which record no scope), equals the recorded one.

4. **Results say which code ran them.** A published run whose code (same scope) differs from HEAD's fails,
   unless the profile's committed run history (``outputs/<profile>/run_history.json``) has an entry of that
   notebook naming the run's commit and code hash: then it stays published, labelled ``ran <commit>``.

5. **Graded by the rules of its day.** Each run of a committed ``run_history.json`` names the rules version that
   graded it (``rules``), no later than the version in force at its commit, and applies a grading amendment
   (``kind``) only when the commit that registered it is an ancestor of the run's (:mod:`lora_lab.lab.rules`).

6. **The published notebook is what ran.** The code cells of ``outputs/<profile>/NN_*.ipynb`` hash to those the run
   executed (its recorded ``code_cells_hash``; for older runs, the code cells of the notebook at the run's commit,
   when that version's notebook hash is the recorded one). Markdown may change after a run; code may not. A run
   listed in ``predictions/stale_runs.yaml`` (shrink-only, printed on every verify) is a note, not a violation.

A prediction's registration date and commit (shown on the scoreboard) are the first commit,
in topological order, whose predictions file holds its id. The predictions file is followed
by its path only (a rename starts a new history). A shallow clone cannot be verified.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lora_lab.lab.git_history import (  # noqa: F401 - the git helpers: public here too
    Commit,
    GitError,
    Registration,
    UnreadableVersion,
    amendment_registrations,
    commits_touching,
    entries_by_id,
    file_at,
    git,
    has_commits,
    is_amendment,
    is_ancestor,
    is_shallow,
    parents_of,
    registrations,
    repository_root,
)
from lora_lab.lab.predictions import DEFAULT_PREDICTIONS_PATH
from lora_lab.lab.profiles import profile_applies
from lora_lab.lab.provenance import code_cells_hash, code_hash_at, code_hash_scope_of, notebook_text_hash

DEFAULT_OUTPUTS = Path("outputs")


def describe_edit(old: Any, new: Any) -> str:
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return f"{old!r} -> {new!r}"
    changes = []
    for key in sorted(set(old) | set(new), key=str):
        if key not in new:
            changes.append(f"field '{key}' removed (was {old[key]!r})")
        elif key not in old:
            changes.append(f"field '{key}' added ({new[key]!r})")
        elif old[key] != new[key]:
            changes.append(f"field '{key}' {old[key]!r} -> {new[key]!r}")
    return "; ".join(changes)


@dataclass
class VerifyReport:
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked_ids: int = 0
    checked_grades: int = 0
    checked_runs: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations

    def text(self) -> str:
        lines = [f"note: {note}" for note in self.notes]
        lines += [f"VIOLATION: {violation}" for violation in self.violations]
        plural = "s" if len(self.violations) != 1 else ""
        verdict = "OK" if self.ok else f"FAILED ({len(self.violations)} violation{plural})"
        lines.append(
            f"verify {verdict}: {self.checked_ids} registered prediction(s) checked append-only, "
            f"{self.checked_grades} graded metric(s) checked predicted-before-measured, "
            f"{self.checked_runs} published run(s) tied to their commit's code"
        )
        return "\n".join(lines)


def check_append_only(repo: Path, predictions_path: str, report: VerifyReport) -> None:
    history = commits_touching(repo, predictions_path)
    parents = parents_of(repo, [commit.sha for commit in history])
    cache: dict[str, dict[str, Any]] = {}

    def version(sha: str) -> dict[str, Any]:
        if sha not in cache:
            cache[sha] = entries_by_id(file_at(repo, sha, predictions_path), f"{predictions_path} at commit {sha[:10]}")
        return cache[sha]

    seen: set[str] = set()
    for commit in history:
        try:
            new = version(commit.sha)
        except UnreadableVersion as error:
            report.violations.append(f"cannot check across an unreadable version: {error}")
            continue
        seen.update(new)
        for parent in parents.get(commit.sha, []):
            try:
                old = version(parent)
            except UnreadableVersion:
                continue  # reported when that commit itself was visited
            for entry_id, entry in old.items():
                if entry_id not in new:
                    report.violations.append(
                        f"{_what(entry_id)} was removed in commit {commit.short} ({commit.date}); "
                        "predictions are append-only: supersede it with a new entry instead"
                    )
                elif new[entry_id] != entry:
                    report.violations.append(
                        f"{_what(entry_id)} was edited in commit {commit.short} ({commit.date}): "
                        f"{describe_edit(entry, new[entry_id])}; predictions are append-only: add a new entry "
                        "with 'supersedes' instead"
                    )
    report.checked_ids = sum(not is_amendment(key) for key in seen)

    working_file = repo / predictions_path
    if has_commits(repo):
        try:
            committed = version("HEAD")
            working = entries_by_id(
                working_file.read_text(encoding="utf-8") if working_file.is_file() else None,
                f"{predictions_path} (working tree)",
            )
        except UnreadableVersion as error:
            report.violations.append(f"cannot check the working tree: {error}")
            return
        for entry_id, entry in committed.items():
            if entry_id not in working:
                report.violations.append(f"{_what(entry_id)} is removed in the working tree (uncommitted)")
            elif working[entry_id] != entry:
                report.violations.append(
                    f"{_what(entry_id)} is edited in the working tree (uncommitted): "
                    f"{describe_edit(entry, working[entry_id])}"
                )


def _what(key: str) -> str:
    """How a violation names an entry: ``prediction 'p01-a'`` or ``label amendment 'amends p01-a #1'``."""
    return f"label amendment {key!r}" if is_amendment(key) else f"prediction {key!r}"


def first_commit_with_metric(repo: Path, metrics_path: str, metric: str, cache: dict) -> Commit | None:
    if metrics_path not in cache:
        versions = []
        for commit in commits_touching(repo, metrics_path):
            text = file_at(repo, commit.sha, metrics_path)
            try:
                metrics = json.loads(text).get("metrics", {}) if text else {}
            except (ValueError, AttributeError):
                metrics = {}
            versions.append((commit, set(metrics) if isinstance(metrics, dict) else set()))
        cache[metrics_path] = versions
    for commit, keys in cache[metrics_path]:
        if metric in keys:
            return commit
    return None


def check_predicted_before_measured(repo: Path, predictions_path: str, outputs: str, report: VerifyReport) -> None:
    working_file = repo / predictions_path
    try:
        current = entries_by_id(
            working_file.read_text(encoding="utf-8") if working_file.is_file() else None, predictions_path
        )
    except UnreadableVersion as error:
        report.violations.append(f"cannot read the current predictions: {error}")
        return
    superseded = set()
    amended_informed = {}
    for key, entry in current.items():
        old = entry.get("supersedes")
        superseded.update([old] if isinstance(old, str) else old if isinstance(old, list) else [])
        if is_amendment(key) and isinstance(entry.get("informed_by"), str):
            amended_informed[str(entry["amends"])] = entry["informed_by"]
    current = {key: ({**entry, "informed_by": amended_informed[key]} if key in amended_informed else entry)
               for key, entry in current.items() if not is_amendment(key)}
    registered = registrations(repo, predictions_path)
    listing = git(repo, "ls-tree", "-d", "--name-only", "HEAD", f"{outputs}/", check=False).stdout.split() \
        if has_commits(repo) else []
    profiles = sorted(Path(item).name for item in listing)
    cache: dict = {}
    for profile in profiles:
        for entry_id, entry in current.items():
            profiles_of_entry = entry.get("profiles") or []
            if (entry_id in superseded or not isinstance(profiles_of_entry, list)
                    or not profile_applies(profiles_of_entry, profile)):
                continue
            notebook, metric = entry.get("notebook"), entry.get("metric")
            if not isinstance(notebook, str) or not isinstance(metric, str):
                continue
            metrics_path = f"{outputs}/{profile}/{notebook}.metrics.json"
            measured = first_commit_with_metric(repo, metrics_path, metric, cache)
            if measured is None:
                continue
            report.checked_grades += 1
            registration = registered.get(entry_id)
            if registration is None:
                report.violations.append(
                    f"prediction {entry_id!r} is not committed, but its metric {metric!r} already is "
                    f"({metrics_path}, commit {measured.short}, {measured.date})"
                )
            elif registration.commit == measured.sha or not is_ancestor(repo, registration.commit, measured.sha):
                if entry.get("informed_by"):  # registered after a related result, and says so: scored apart
                    report.notes.append(
                        f"prediction {entry_id!r} is informed ({entry['informed_by']}): registered in "
                        f"{registration.short}, after its metric {metric!r} was first committed ({measured.short})"
                    )
                    continue
                report.violations.append(
                    f"prediction {entry_id!r} (registered in commit {registration.short}, {registration.date}) "
                    f"did not land before its metric {metric!r} ({metrics_path}, first committed in "
                    f"{measured.short}, {measured.date}): a prediction must be committed strictly before "
                    "the results that grade it"
                )


def check_results_tie_to_code(repo: Path, outputs: str, report: VerifyReport) -> None:
    from lora_lab.lab.history import HISTORY_NAME, parse_history, runs_naming

    listing = git(repo, "ls-tree", "-r", "--name-only", "HEAD", f"{outputs}/", check=False).stdout.split() \
        if has_commits(repo) else []
    hashes: dict[tuple[str, str], str | None] = {}
    histories: dict[str, list[dict]] = {}

    def hash_at(commit: str, scope: str) -> str | None:
        if (commit, scope) not in hashes:
            hashes[commit, scope] = code_hash_at(repo, commit, scope)
        return hashes[commit, scope]

    for path in sorted(item for item in listing if item.endswith(".metrics.json")):
        try:
            provenance = json.loads(file_at(repo, "HEAD", path) or "{}").get("provenance") or {}
        except ValueError:
            report.violations.append(f"{path}: not valid JSON")
            continue
        commit, recorded = provenance.get("git_commit"), provenance.get("code_hash")
        if not commit or not recorded:
            report.notes.append(f"{path}: no {'code hash' if commit else 'commit'} recorded; not tied to code")
            continue
        try:
            scope = code_hash_scope_of(provenance)
            committed = hash_at(commit, scope)
        except ValueError as error:
            report.violations.append(f"{path}: {error}")
            continue
        if committed is None:
            report.violations.append(f"{path}: names commit {commit[:10]}, which this repository does not have")
            continue
        if committed != recorded:
            report.violations.append(
                f"{path}: run by code that differs from commit {commit[:10]} (code hash {recorded[:12]}, the commit's "
                f"{committed[:12]}): publish runs of committed code only"
            )
            continue
        report.checked_runs += 1
        if hash_at("HEAD", scope) == recorded:
            continue
        history_file = f"{Path(path).parent.as_posix()}/{HISTORY_NAME}"
        if history_file not in histories:
            try:
                histories[history_file] = parse_history(file_at(repo, "HEAD", history_file), history_file)
            except ValueError as error:
                report.violations.append(f"{history_file}: {error}")
                histories[history_file] = []
        notebook = Path(path).name.removesuffix(".metrics.json")
        if runs_naming(histories[history_file], notebook, commit, recorded):
            report.notes.append(f"{path}: ran {commit[:7]} (code differs from HEAD's; the run history records it)")
        else:
            report.violations.append(
                f"{path}: its code ({scope}, hash {recorded[:12]} from commit {commit[:10]}) differs from HEAD's and "
                f"{history_file} has no entry of {notebook} naming that commit and hash: run it again, or record the "
                "run in the history (python tools/seed_run_history.py)"
            )


def check_history_rules(repo: Path, predictions_path: str, outputs: str, report: VerifyReport) -> None:
    """Each committed run history grades every run by the rules in force at its commit, and applies an amendment
    that changes grading (``kind``) only to runs whose commit descends from the commit that registered it."""
    from lora_lab.lab.history import HISTORY_NAME, ancestry, parse_history
    from lora_lab.lab.rules import CURRENT, version_of_run

    listing = git(repo, "ls-tree", "-r", "--name-only", "HEAD", f"{outputs}/", check=False).stdout.split() \
        if has_commits(repo) else []
    files = sorted(item for item in listing if Path(item).name == HISTORY_NAME)
    if not files:
        return
    amendments = amendment_registrations(repo, predictions_path)
    in_history = ancestry(repo)
    for path in files:
        try:
            runs = parse_history(file_at(repo, "HEAD", path), path)
        except ValueError as error:
            report.violations.append(f"{path}: {error}")
            continue
        for run in runs:
            ran, published = run.get("git_commit"), run.get("published_in")
            where = f"{path}: the run of {run.get('notebook')} at {str(ran or published or '?')[:7]}"
            if not isinstance(run.get("rules"), int) or not isinstance(run.get("grading_amendments"), list):
                report.violations.append(f"{where} does not say which rules graded it (rules, grading_amendments): "
                                         "regenerate the history (python tools/seed_run_history.py)")
                continue
            if ran or published:
                due = version_of_run(run, in_history)
                if run["rules"] > due:
                    report.violations.append(f"{where} is graded by rules v{run['rules']}, which came after it "
                                             f"(v{due} was in force): a later rule applies to later runs only")
            elif run["rules"] != CURRENT:
                report.violations.append(f"{where} names no commit, yet is graded by rules v{run['rules']}")
            for key in run["grading_amendments"]:
                registration = amendments.get(key)
                if registration is None:
                    report.violations.append(f"{where} applies amendment {key!r}, which {predictions_path} never held")
                elif not (ran or published) or not in_history(registration.commit, str(ran or published), not ran):
                    report.violations.append(
                        f"{where} is graded with {key!r} (it changes how the prediction is graded), registered in "
                        f"{registration.short} ({registration.date}), after that run: an amendment that changes "
                        "grading applies to later runs only")


STALE_RUNS = "predictions/stale_runs.yaml"


def ran_code_cells(repo: Path, profile_dir: str, notebook: str, provenance: dict) -> str | None:
    """The hash of the code cells a published run executed, computed here: those of ``notebooks/<notebook>.ipynb``
    at the commit it ran from when that version's notebook hash is the recorded one (both sides hashed by this
    Python), else the recorded ``code_cells_hash``; None when neither tells."""
    commit, recorded = provenance.get("git_commit"), provenance.get("notebook_hash")
    text = file_at(repo, str(commit), f"notebooks/{notebook}.ipynb") if commit and recorded else None
    if text is not None and notebook_text_hash(text) == recorded:
        return code_cells_hash(text)
    if provenance.get("code_cells_hash"):
        return str(provenance["code_cells_hash"])
    return None


def load_stale_runs(text: str | None, where: str = STALE_RUNS) -> dict[tuple[str, str, str], str]:
    """``{(profile, notebook, commit prefix): why}`` of the known-stale list (see :func:`check_published_notebooks`)."""
    entries = yaml.safe_load(text) if text else []
    if not isinstance(entries, list):
        raise ValueError(f"{where}: not a list")
    found = {}
    for index, entry in enumerate(entries):
        fields = ("profile", "notebook", "git_commit", "why")
        if not isinstance(entry, dict) or not all(isinstance(entry.get(name), str) and entry[name] for name in fields):
            raise ValueError(f"{where}: entry #{index + 1} needs text fields {', '.join(fields)}")
        found[entry["profile"], entry["notebook"], entry["git_commit"]] = entry["why"]
    return found


def check_published_notebooks(repo: Path, outputs: str, report: VerifyReport) -> None:
    """Every published notebook (``outputs/<profile>/NN_*.ipynb``, and ``notebooks/NN_*.ipynb`` for the gpu profile,
    which publishes there too) holds the code cells its run executed (comments aside). A run whose
    notebook was edited after it ran fails, unless it is listed in ``predictions/stale_runs.yaml`` (profile,
    notebook, the commit it ran from, why): a list that may only shrink, printed on every verify."""
    listing = git(repo, "ls-tree", "-r", "--name-only", "HEAD", f"{outputs}/", check=False).stdout.split() \
        if has_commits(repo) else []
    try:
        listed = load_stale_runs(file_at(repo, "HEAD", STALE_RUNS))
        versions = [load_stale_runs(file_at(repo, commit.sha, STALE_RUNS), f"{STALE_RUNS} at {commit.short}")
                    for commit in commits_touching(repo, STALE_RUNS)]
        working = repo / STALE_RUNS
        if working.is_file():
            listed = load_stale_runs(working.read_text(encoding="utf-8"), f"{STALE_RUNS} (working tree)")
            versions.append(listed)
    except ValueError as error:
        report.violations.append(str(error))
        return
    for before, after in zip(versions, versions[1:]):
        for key in sorted(set(after) - set(before)):
            report.violations.append(f"{STALE_RUNS}: {'/'.join(key)} was added after the list was first committed: "
                                     "the list of known-stale published runs may only shrink; republish the run")
    used = set()
    for path in sorted(item for item in listing if item.endswith(".ipynb") and item.count("/") == 2):
        profile, notebook = path.split("/")[1], Path(path).stem
        try:
            payload = json.loads(file_at(repo, "HEAD", f"{outputs}/{profile}/{notebook}.metrics.json") or "{}")
        except ValueError:
            continue  # reported by check_results_tie_to_code
        provenance = payload.get("provenance") or {}
        ran = ran_code_cells(repo, f"{outputs}/{profile}", notebook, provenance)
        if ran is None:
            report.notes.append(f"{path}: its run recorded no code-cell hash, and the notebook at the commit it ran "
                                "from does not match its notebook hash: cannot tell which code cells ran")
            continue
        # the gpu profile's publication also puts the executed notebook in notebooks/: that copy is checked too
        copies = [path] + ([f"notebooks/{notebook}.ipynb"] if profile == "gpu" else [])
        commit = str(provenance.get("git_commit") or "")
        key = next((key for key in listed if key[:2] == (profile, notebook) and key[2] and commit.startswith(key[2])),
                   None)
        for copy in copies:
            text = file_at(repo, "HEAD", copy)
            if text is None or code_cells_hash(text) == ran:
                continue
            ran_from = commit[:7] or "an unknown commit"
            problem = f"{copy}: code cells differ from the run (of {ran_from}); republish needed"
            if key is None:
                report.violations.append(problem)
            else:
                used.add(key)
                report.notes.append(f"{problem} (known stale, {STALE_RUNS}: {listed[key]})")
    for key in sorted(set(listed) - used):
        report.violations.append(f"{STALE_RUNS}: {'/'.join(key)} is not a stale published run (republished, or its "
                                 "code cells match): remove the entry")


def verify(
    repo: Path | str = ".",
    predictions_path: str = str(DEFAULT_PREDICTIONS_PATH),
    outputs: str = str(DEFAULT_OUTPUTS),
) -> VerifyReport:
    """Run both checks on the repository containing ``repo``; paths are relative to its root."""
    root = repository_root(repo)
    if is_shallow(root):
        raise GitError("this is a shallow clone: verify needs the full history "
                       "(git fetch --unshallow, or fetch-depth: 0 in CI)")
    report = VerifyReport()
    if not has_commits(root):
        report.notes.append("the repository has no commits yet: nothing is registered")
    check_append_only(root, predictions_path, report)
    check_predicted_before_measured(root, predictions_path, outputs.rstrip("/"), report)
    check_results_tie_to_code(root, outputs.rstrip("/"), report)
    check_history_rules(root, predictions_path, outputs.rstrip("/"), report)
    check_published_notebooks(root, outputs.rstrip("/"), report)
    return report

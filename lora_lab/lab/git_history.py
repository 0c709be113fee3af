"""What git history says: the commits that touched a file, a file's text at a commit, ancestry, and when each
prediction (and each label amendment) was first committed. The lab's lowest floor for git: grading, the run
history and ``lora-lab verify`` read history through it.
"""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_lab.lab.predictions import DEFAULT_PREDICTIONS_PATH, PredictionError, parse_predictions_yaml


class GitError(RuntimeError):
    """git is missing, the directory is not a repository, or a git command failed."""


def git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=False)
    except OSError as error:
        raise GitError(f"cannot run git: {error}") from error
    if check and done.returncode != 0:
        raise GitError(f"git {' '.join(args)} failed in {repo}: {done.stderr.strip()}")
    return done


def repository_root(path: Path | str) -> Path:
    done = git(Path(path), "rev-parse", "--show-toplevel", check=False)
    if done.returncode != 0:
        raise GitError(f"{path} is not inside a git repository ({done.stderr.strip()})")
    return Path(done.stdout.strip())


def has_commits(repo: Path) -> bool:
    return git(repo, "rev-parse", "--verify", "-q", "HEAD", check=False).returncode == 0


def is_shallow(repo: Path) -> bool:
    return git(repo, "rev-parse", "--is-shallow-repository", check=False).stdout.strip() == "true"


@dataclass(frozen=True)
class Commit:
    sha: str
    date: str  # committer date, ISO 8601

    @property
    def short(self) -> str:
        return self.sha[:10]


def commits_touching(repo: Path, relative_path: str) -> list[Commit]:
    """Commits of HEAD's history that changed ``relative_path``, oldest first (topological)."""
    if not has_commits(repo):
        return []
    done = git(repo, "log", "--full-history", "--topo-order", "--reverse", "--format=%H %cI", "HEAD", "--",
               relative_path)
    commits = []
    for line in done.stdout.splitlines():
        sha, _, date = line.partition(" ")
        commits.append(Commit(sha, date))
    return commits


def parents_of(repo: Path, shas: list[str]) -> dict[str, list[str]]:
    if not shas:
        return {}
    done = git(repo, "rev-list", "--parents", "--no-walk=unsorted", *shas)
    parents: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        sha, *rest = line.split()
        parents[sha] = rest
    return parents


def file_at(repo: Path, sha: str, relative_path: str) -> str | None:
    """The text of ``relative_path`` at commit ``sha``, or None if it does not exist there."""
    done = git(repo, "show", f"{sha}:{relative_path}", check=False)
    return done.stdout if done.returncode == 0 else None


def is_ancestor(repo: Path, older: str, newer: str) -> bool:
    return git(repo, "merge-base", "--is-ancestor", older, newer, check=False).returncode == 0


class UnreadableVersion(Exception):
    """A committed version of the predictions file that does not parse."""


def entries_by_id(text: str | None, where: str) -> dict[str, Any]:
    """``{id: raw entry}`` of one version of the predictions file (missing file: empty)."""
    if text is None:
        return {}
    try:
        entries, _ = parse_predictions_yaml(text, source=where)
    except PredictionError as error:
        raise UnreadableVersion(f"{where}: {'; '.join(error.problems)}") from None
    found: dict[str, Any] = {}
    amendments: dict[str, int] = {}
    for entry in entries:
        if isinstance(entry, dict) and "amends" in entry:
            target = str(entry["amends"])
            amendments[target] = amendments.get(target, 0) + 1
            found[f"amends {target} #{amendments[target]}"] = entry
        elif isinstance(entry, dict) and isinstance(entry.get("id"), str) and entry["id"] not in found:
            found[entry["id"]] = entry
    return found


def is_amendment(key: str) -> bool:
    return key.startswith("amends ")


@dataclass(frozen=True)
class Registration:
    commit: str
    date: str

    @property
    def short(self) -> str:
        return self.commit[:10]


@functools.lru_cache(maxsize=4096)
def _keys_at(repo: Path, sha: str, short: str, predictions_path: str) -> tuple[str, ...]:
    """The entry keys of the predictions file at commit ``sha`` (none when that version does not parse). A commit's
    content never changes, so each version is read and parsed once per process (verify, grading and the history
    read the whole file history several times)."""
    try:
        return tuple(entries_by_id(file_at(repo, sha, predictions_path), f"{predictions_path}@{short}"))
    except UnreadableVersion:
        return ()


def registrations(repo: Path | str, predictions_path: str = str(DEFAULT_PREDICTIONS_PATH)) -> dict[str, Registration]:
    """``{id: Registration}``: the first commit whose predictions file holds each id."""
    repo = repository_root(repo)
    found: dict[str, Registration] = {}
    for commit in commits_touching(repo, predictions_path):
        for entry_id in _keys_at(repo, commit.sha, commit.short, predictions_path):
            if not is_amendment(entry_id):
                found.setdefault(entry_id, Registration(commit.sha, commit.date))
    return found


def amendment_registrations(repo: Path | str,
                            predictions_path: str = str(DEFAULT_PREDICTIONS_PATH)) -> dict[str, Registration]:
    """``{"amends <id> #k": Registration}``: the first commit whose predictions file holds each label amendment."""
    repo = repository_root(repo)
    found: dict[str, Registration] = {}
    for commit in commits_touching(repo, predictions_path):
        for key in _keys_at(repo, commit.sha, commit.short, predictions_path):
            if is_amendment(key):
                found.setdefault(key, Registration(commit.sha, commit.date))
    return found

"""provenance.git_state: the repository's HEAD, unless a declared commit says the tree is a copy of another one."""
from __future__ import annotations

import subprocess

from lora_lab.lab import provenance


def _repo(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f.txt").write_text("x")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "f.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    return subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_declaration_that_disagrees_with_a_copied_git_wins(tmp_path, monkeypatch):
    head = _repo(tmp_path)
    monkeypatch.delenv(provenance.DECLARED_COMMIT_ENV, raising=False)
    assert provenance.git_state(tmp_path)["git_commit"] == head
    monkeypatch.setenv(provenance.DECLARED_COMMIT_ENV, head)  # agrees: the repository's own state
    assert provenance.git_state(tmp_path)["git_source"] == "repository"
    monkeypatch.setenv(provenance.DECLARED_COMMIT_ENV, "a" * 40)  # a stale .git came with the copy
    state = provenance.git_state(tmp_path)
    assert state["git_commit"] == "a" * 40 and state["git_dirty"] is None
    assert state["git_source"].startswith("declared") and head in state["git_source"]

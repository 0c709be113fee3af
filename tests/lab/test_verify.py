"""lora_lab.verify on temporary git repositories: append-only, and predicted before measured."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from lora_lab.lab.cli import main
from lora_lab.lab.grading import registered_labels
from lora_lab.lab.history import write_history
from lora_lab.lab.provenance import code_hash, code_hash_at
from lora_lab.lab.verify import GitError, registrations, verify

ENTRY = """\
- id: {id}
  notebook: 01_demo
  claim: "{metric} is small"
  metric: {metric}
  comparator: "<"
  threshold: {threshold}
  profiles: [cpu]
  confidence: 0.8
  rationale: "because"
"""
GIT_ENV = {
    "GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@example.com",
    "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@example.com",
    "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
}


class Repo:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.git("init", "-q", "-b", "main")

    def git(self, *args: str) -> str:
        done = subprocess.run(["git", *args], cwd=self.root, capture_output=True, text=True,
                              env={**os.environ, **GIT_ENV})
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def write(self, relative: str, text: str) -> None:
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def predictions(self, *entries: dict) -> None:
        self.write("predictions/predictions.yaml", "".join(ENTRY.format(**entry) for entry in entries) or "[]\n")

    def metrics(self, notebook: str = "01_demo", provenance: dict | None = None, **values) -> None:
        payload = {"notebook": notebook, "profile": "cpu", "metrics": values,
                   "provenance": {"status": "completed", **(provenance or {})}}
        self.write(f"outputs/cpu/{notebook}.metrics.json", json.dumps(payload))

    def commit(self, message: str) -> str:
        self.git("add", "-A")
        self.git("commit", "-q", "-m", message)
        return self.git("rev-parse", "HEAD")


A = {"id": "p01-a", "metric": "loss", "threshold": 0.5}
B = {"id": "p01-b", "metric": "error", "threshold": 0.1}


@pytest.fixture
def repo(tmp_path):
    return Repo(tmp_path / "repo")


def test_honest_history_passes(repo):
    repo.predictions()
    repo.commit("empty predictions")
    repo.predictions(A)
    registered = repo.commit("register p01-a")
    repo.predictions(A, B)  # appending is fine
    repo.commit("register p01-b")
    repo.metrics(loss=0.3, error=0.2)
    repo.commit("results")
    repo.write("predictions/predictions.yaml",
               "# comments and quoting may change\n" + ENTRY.format(**A).replace("0.8", "8.0e-1") + ENTRY.format(**B))
    repo.commit("reformat")
    report = verify(repo.root)
    assert report.ok, report.text()
    assert report.checked_ids == 2 and report.checked_grades == 2
    assert registrations(repo.root)["p01-a"].commit == registered
    date = repo.git("show", "-s", "--format=%cI", registered)[:10]
    assert registered_labels(repo.root / "predictions" / "predictions.yaml")["p01-a"] == f"{registered[:10]} {date}"
    assert "verify OK" in report.text()


def test_edited_prediction_is_caught(repo):
    repo.predictions(A)
    repo.commit("register")
    repo.predictions({**A, "threshold": 0.9})
    edit = repo.commit("move the goalposts")
    report = verify(repo.root)
    assert not report.ok
    [violation] = report.violations
    assert f"prediction 'p01-a' was edited in commit {edit[:10]}" in violation
    assert "field 'threshold' 0.5 -> 0.9" in violation


def test_removed_prediction_is_caught(repo):
    repo.predictions(A, B)
    repo.commit("register")
    repo.predictions(B)
    repo.commit("drop a")
    [violation] = verify(repo.root).violations
    assert "prediction 'p01-a' was removed in commit" in violation


def test_uncommitted_edit_is_caught(repo):
    repo.predictions(A)
    repo.commit("register")
    repo.predictions({**A, "threshold": 0.7})
    [violation] = verify(repo.root).violations
    assert "prediction 'p01-a' is edited in the working tree (uncommitted): field 'threshold' 0.5 -> 0.7" in violation


def test_edit_on_a_merged_branch_is_caught(repo):
    repo.predictions(A)
    repo.commit("register")
    repo.git("checkout", "-q", "-b", "side")
    repo.predictions({**A, "threshold": 0.9})
    repo.commit("edit on a branch")
    repo.git("checkout", "-q", "main")
    repo.write("notes.txt", "x")
    repo.commit("unrelated")
    repo.git("merge", "-q", "--no-edit", "side")
    assert any("was edited in commit" in violation for violation in verify(repo.root).violations)


def test_metrics_committed_before_the_prediction_are_caught(repo):
    repo.predictions()
    repo.commit("start")
    repo.metrics(loss=0.3)
    measured = repo.commit("results first")
    repo.predictions(A)
    repo.commit("then the prediction")
    report = verify(repo.root)
    [violation] = report.violations
    assert "prediction 'p01-a'" in violation and "did not land before its metric 'loss'" in violation
    assert f"first committed in {measured[:10]}" in violation


def test_prediction_and_metrics_in_the_same_commit_are_caught(repo):
    repo.predictions(A)
    repo.metrics(loss=0.3)
    repo.commit("both at once")
    [violation] = verify(repo.root).violations
    assert "must be committed strictly before" in violation


def test_uncommitted_prediction_with_committed_metrics_is_caught(repo):
    repo.metrics(loss=0.3)
    repo.commit("results")
    repo.predictions(A)
    [violation] = verify(repo.root).violations
    assert "prediction 'p01-a' is not committed, but its metric 'loss' already is" in violation


def test_superseding_after_the_results_is_caught_but_the_superseded_entry_is_not_graded(repo):
    repo.predictions(A)
    repo.commit("register")
    repo.metrics(loss=0.3)
    repo.commit("results")
    late = repo.root / "predictions/predictions.yaml"
    late.write_text(late.read_text() + ENTRY.format(id="p01-c", metric="loss", threshold=0.4) + "  supersedes: p01-a\n")
    repo.commit("supersede after seeing the result")
    [violation] = verify(repo.root).violations
    assert "prediction 'p01-c'" in violation and "did not land before its metric 'loss'" in violation


def test_an_informed_prediction_may_postdate_its_metric_and_is_listed(repo):
    repo.predictions(A)
    repo.commit("register")
    repo.metrics(loss=0.3)
    repo.commit("results")
    late = repo.root / "predictions/predictions.yaml"
    late.write_text(late.read_text() + ENTRY.format(id="p01-c", metric="loss", threshold=0.4)
                    + "  supersedes: p01-a\n  informed_by: \"the first run showed 0.3\"\n")
    repo.commit("relabel as informed")
    report = verify(repo.root)
    assert report.ok, report.violations
    assert any("'p01-c' is informed (the first run showed 0.3)" in note for note in report.notes)


def test_a_metric_added_to_an_existing_file_later_is_dated_by_its_own_commit(repo):
    repo.predictions(A)
    repo.commit("register a")
    repo.metrics(loss=0.3)
    repo.commit("first results")
    repo.predictions(A, B)
    repo.commit("register b, about a metric not measured yet")
    repo.metrics(loss=0.3, error=0.05)
    repo.commit("second results")
    report = verify(repo.root)
    assert report.ok, report.text()
    assert report.checked_grades == 2


def test_published_runs_must_match_their_commits_code(repo):
    repo.write("pyproject.toml", '[project]\nname = "demo"\n')
    repo.write("lora_lab/__init__.py", "from lora_lab.core import answer\n")
    repo.write("lora_lab/core.py", "def answer():\n    return 42\n")
    repo.predictions(A)
    ran = repo.commit("code, and the prediction its run grades")
    committed_code = code_hash_at(repo.root, ran)
    assert committed_code is not None and committed_code == code_hash(repo.root / "lora_lab")

    repo.metrics(loss=0.3, provenance={"git_commit": ran, "code_hash": committed_code})
    repo.commit("results of the committed code")
    report = verify(repo.root)
    assert report.ok, report.text()
    assert report.checked_runs == 1 and report.checked_grades == 1
    assert "1 published run(s) tied to their commit's code" in report.text()

    # run with an uncommitted edit of the package, but recorded as the commit it started from
    repo.write("lora_lab/core.py", "def answer():\n    return 43\n")
    edited_code = code_hash(repo.root / "lora_lab")
    assert edited_code != committed_code
    repo.metrics("02_edited", provenance={"git_commit": ran, "code_hash": edited_code})
    # a commit this repository does not have (e.g. run from an unpushed branch)
    repo.metrics("03_elsewhere", provenance={"git_commit": "f" * 40, "code_hash": committed_code})
    # no commit recorded: nothing to tie it to, which is a note only
    repo.metrics("04_no_commit", provenance={"code_hash": committed_code})
    repo.commit("the edited code, and more results")
    report = verify(repo.root)
    assert not report.ok
    assert report.checked_runs == 1
    head_differs, edited, elsewhere = report.violations
    # the first run's code is no longer HEAD's, and no run history says which commit ran it (no scope: legacy)
    assert head_differs.startswith("outputs/cpu/01_demo.metrics.json: its code (lora_lab, hash ")
    assert "has no entry of 01_demo naming that commit and hash" in head_differs
    assert edited.startswith("outputs/cpu/02_edited.metrics.json: run by code that differs from commit")
    assert (f"differs from commit {ran[:10]} (code hash {edited_code[:12]}, "
            f"the commit's {committed_code[:12]})") in edited
    assert elsewhere == (
        f"outputs/cpu/03_elsewhere.metrics.json: names commit {'f' * 10}, which this repository does not have"
    )
    assert "outputs/cpu/04_no_commit.metrics.json: no commit recorded; not tied to code" in report.notes
    assert not any("04_no_commit" in violation for violation in report.violations)


def test_repository_without_commits_and_outside_git(repo, tmp_path):
    repo.predictions(A)
    report = verify(repo.root)
    assert report.ok and "no commits yet" in report.text()
    outside = tmp_path / "plain"
    outside.mkdir()
    with pytest.raises(GitError, match="not inside a git repository"):
        verify(outside)


def test_verify_command_exit_codes(repo, tmp_path, capsys):
    repo.predictions(A)
    repo.commit("register")
    assert main(["verify", "--repo", str(repo.root)]) == 0
    repo.predictions({**A, "threshold": 0.9})
    repo.commit("edit")
    assert main(["verify", "--repo", str(repo.root)]) == 1
    assert "VIOLATION: prediction 'p01-a' was edited" in capsys.readouterr().out
    plain = tmp_path / "plain"
    plain.mkdir()
    assert main(["verify", "--repo", str(plain)]) == 2


def _package(repo: Repo, answer: int = 42, bench: str = "N = 1\n") -> None:
    repo.write("pyproject.toml", '[project]\nname = "demo"\n')
    repo.write("lora_lab/__init__.py", "from lora_lab.core import answer\n")
    repo.write("lora_lab/core.py", f"def answer():\n    return {answer}\n")
    repo.write("benchmarks/bench.py", bench)


def test_a_run_whose_code_differs_from_head_needs_a_history_entry_naming_its_commit(repo):
    _package(repo)
    repo.predictions(A)
    ran = repo.commit("code, and the prediction its run grades")
    recorded = code_hash(repo.root / "lora_lab")
    repo.metrics(loss=0.3, provenance={"git_commit": ran, "code_hash": recorded,
                                       "code_hash_scope": "lora_lab+benchmarks"})
    repo.commit("results of the committed code")
    assert verify(repo.root).ok

    _package(repo, answer=43)
    repo.commit("the code changes after the run")
    report = verify(repo.root)
    assert len(report.violations) == 1 and "01_demo.metrics.json: its code" in report.violations[0]

    run = {"notebook": "01_demo", "git_commit": ran, "code_hash": "0" * 64, "rules": 4, "grading_amendments": [],
           "graded": {}}
    write_history(repo.root / "outputs" / "cpu", "cpu", [run])  # names the commit, but another hash
    repo.commit("a history entry that does not match")
    assert not verify(repo.root).ok

    write_history(repo.root / "outputs" / "cpu", "cpu", [{**run, "code_hash": recorded}])
    repo.commit("the run history says which commit ran it")
    report = verify(repo.root)
    assert report.ok, report.text()
    assert f"outputs/cpu/01_demo.metrics.json: ran {ran[:7]} (code differs from HEAD's; the run history records " \
           "it)" in report.notes


def test_benchmarks_are_hashed_for_new_runs_while_old_runs_keep_their_scope(repo):
    _package(repo)
    repo.predictions(A, B)
    ran = repo.commit("code and benchmarks")
    new_scope = code_hash(repo.root / "lora_lab")
    legacy = code_hash(repo.root / "lora_lab", scope="lora_lab")
    assert new_scope != legacy  # benchmarks/bench.py is in the new scope only
    assert code_hash_at(repo.root, ran, "lora_lab") == legacy and code_hash_at(repo.root, ran) == new_scope
    repo.metrics(loss=0.3, provenance={"git_commit": ran, "code_hash": new_scope,
                                       "code_hash_scope": "lora_lab+benchmarks"})
    repo.metrics("02_old", error=0.01, provenance={"git_commit": ran, "code_hash": legacy})  # no scope: legacy
    repo.commit("results")
    report = verify(repo.root)
    assert report.ok and report.checked_runs == 2, report.text()

    _package(repo, bench="N = 2\n")  # only a benchmark changes
    assert code_hash(repo.root / "lora_lab", scope="lora_lab") == legacy
    assert code_hash(repo.root / "lora_lab") != new_scope
    repo.commit("a benchmark changes")
    report = verify(repo.root)
    assert [violation.split(":")[0] for violation in report.violations] == ["outputs/cpu/01_demo.metrics.json"]


def test_label_amendments_are_append_only(repo):
    repo.predictions(A)
    amendment = '- amends: p01-a\n  informed_by: "a dev run"\n  reason: "quoted in the rationale"\n'
    with open(repo.root / "predictions" / "predictions.yaml", "a") as handle:
        handle.write(amendment)
    repo.commit("register and amend")
    assert verify(repo.root).ok
    text = (repo.root / "predictions" / "predictions.yaml").read_text()
    (repo.root / "predictions" / "predictions.yaml").write_text(text.replace("a dev run", "nothing"))
    repo.commit("edit the amendment")
    report = verify(repo.root)
    assert any(violation.startswith("label amendment 'amends p01-a #1' was edited in commit")
               for violation in report.violations), report.text()
    (repo.root / "predictions" / "predictions.yaml").write_text(text.replace(amendment, ""))
    report = verify(repo.root)
    assert "label amendment 'amends p01-a #1' is removed in the working tree (uncommitted)" in report.violations

"""Versioned grading rules (lora_lab.lab.rules): a later rule or grading amendment never regrades an earlier run."""
import json

from test_verify import A, Repo

from lora_lab.lab.grading import grade_predictions
from lora_lab.lab.history import history_entry, seed_history, write_history
from lora_lab.lab.predictions import load_predictions
from lora_lab.lab.rules import SPEED_RATIO_SESSIONS
from lora_lab.lab.verify import verify

RATIO = """\
- id: p01-ratio
  notebook: 01_demo
  claim: "ours is at least 1.2x faster"
  metric: ours_speedup_vs_peer
  comparator: ">="
  threshold: 1.2
  profiles: [cpu]
  confidence: 0.7
  rationale: "because"
"""
SUPERSEDER = RATIO.replace("p01-ratio", "p01-ratio-new").replace("1.2", "1.0") + "  supersedes: p01-ratio\n"


def _payload(started: str, value: dict) -> dict:
    return {"notebook": "01_demo", "profile": "cpu", "metrics": {"ours_speedup_vs_peer": value},
            "provenance": {"status": "completed", "started": started, "finished": started}}


def _predictions(tmp_path, text: str):
    path = tmp_path / "predictions.yaml"
    path.write_text(text)
    return load_predictions(path, known={"01_demo"})


def test_a_later_rule_leaves_the_first_runs_grade_standing(tmp_path):
    predictions = _predictions(tmp_path, RATIO)
    one_session_miss = {"median": 1.05, "ci95": [1.0, 1.1], "n": 5}  # before the two-session rule: a miss
    two_session_hit = {"median": 1.3, "ci95": [1.25, 1.35], "n": 10, "sessions": 2}
    history = [history_entry(_payload("t1", one_session_miss), "cpu", predictions, version=SPEED_RATIO_SESSIONS - 1),
               history_entry(_payload("t2", two_session_hit), "cpu", predictions)]
    assert history[0]["graded"]["p01-ratio"]["later"].startswith("void: one session")

    board = grade_predictions(predictions, "cpu", tmp_path, history=history)
    (row,) = board.rows
    assert (row.outcome, row.value, row.rules) == ("miss", 1.05, SPEED_RATIO_SESSIONS - 1)
    assert row.later.startswith("void") and [run["role"] for run in row.history] == ["test", "replication"]
    assert "today's rules: void" in board.markdown()
    assert "would grade 1 headline run(s) otherwise (1 void)" in board.split_lines()[3]


def test_a_superseded_predictions_graded_first_run_is_counted_beside_the_headline(tmp_path):
    predictions = _predictions(tmp_path, RATIO + SUPERSEDER)
    first = history_entry(_payload("t1", {"median": 1.05, "ci95": [1.0, 1.1], "n": 5, "sessions": 2}), "cpu",
                          predictions, registered={"p01-ratio"}, published="2026-01-01T00:00:00+00:00")
    board = grade_predictions(predictions, "cpu", tmp_path, history=[first],
                              registered_at={"p01-ratio-new": "2026-01-02T00:00:00+00:00"})
    rows = {row.id: row for row in board.rows}
    assert rows["p01-ratio"].outcome == "superseded" and rows["p01-ratio"].first_run == "miss"
    assert "superseded** (first run: miss)" in board.markdown()
    assert board.split_lines()[2].startswith(
        "counting the graded first runs of 1 superseded predictions: 0 hit, 1 miss")
    assert board.summary_line().startswith("profile cpu: 0 hit, 0 miss")  # the headline itself: live entries only


def _metrics(repo: Repo, started: str, commit: str, value: dict) -> None:
    payload = {"notebook": "01_demo", "profile": "cpu", "metrics": {"loss": value},
               "provenance": {"status": "completed", "git_commit": commit, "started": started, "finished": started}}
    repo.write("outputs/cpu/01_demo.metrics.json", json.dumps(payload))


AMEND_KIND = "- amends: p01-a\n  kind: speed_ratio\n  reason: a ratio of times\n"
ONE_SESSION_MISS = {"median": 0.7, "ci95": [0.6, 0.8], "n": 5}


def _amended_after_the_first_run(repo: Repo) -> list:
    repo.predictions(A)
    registered = repo.commit("register A")
    _metrics(repo, "t1", registered, ONE_SESSION_MISS)
    repo.commit("run 1")
    repo.predictions(A)
    repo.write("predictions/predictions.yaml", (repo.root / "predictions/predictions.yaml").read_text() + AMEND_KIND)
    amended = repo.commit("amend A: a speed ratio")
    _metrics(repo, "t2", amended, ONE_SESSION_MISS)
    repo.commit("run 2")
    return load_predictions(repo.root / "predictions" / "predictions.yaml", known={"01_demo"})


def test_a_grading_amendment_applies_to_later_runs_only(tmp_path):
    repo = Repo(tmp_path / "repo")
    predictions = _amended_after_the_first_run(repo)
    runs = seed_history(repo.root, "cpu", predictions)
    assert [run["grading_amendments"] for run in runs] == [[], ["amends p01-a #1"]]
    assert runs[0]["graded"]["p01-a"]["outcome"] == "miss"  # before the amendment: graded as it was registered
    assert runs[0]["graded"]["p01-a"]["later"].startswith("void: one session")
    assert runs[1]["graded"]["p01-a"]["outcome"] == "void"  # after it: a one-session speed ratio
    write_history(repo.root / "outputs" / "cpu", "cpu", runs)
    repo.commit("history")
    report = verify(repo.root)
    assert report.ok, report.text()


def test_verify_refuses_a_grading_amendment_applied_backwards(tmp_path):
    repo = Repo(tmp_path / "repo")
    predictions = _amended_after_the_first_run(repo)
    runs = seed_history(repo.root, "cpu", predictions)
    runs[0]["grading_amendments"] = ["amends p01-a #1"]  # as if the amendment had regraded the first run
    write_history(repo.root / "outputs" / "cpu", "cpu", runs)
    repo.commit("history")
    report = verify(repo.root)
    assert not report.ok
    assert any("'amends p01-a #1'" in violation and "applies to later runs only" in violation
               for violation in report.violations), report.text()


def test_verify_refuses_a_history_that_does_not_name_its_rules(tmp_path):
    repo = Repo(tmp_path / "repo")
    predictions = _amended_after_the_first_run(repo)
    runs = seed_history(repo.root, "cpu", predictions)
    del runs[1]["rules"]
    write_history(repo.root / "outputs" / "cpu", "cpu", runs)
    repo.commit("history")
    assert any("does not say which rules graded it" in violation for violation in verify(repo.root).violations)

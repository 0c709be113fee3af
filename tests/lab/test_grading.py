"""lora_lab.lab.grading: hit / miss / inconclusive / void / superseded, hit rate, Brier score, blind vs informed."""
import json
from pathlib import Path

import pytest

from lora_lab.lab import recording
from lora_lab.lab.cli import main
from lora_lab.lab.grading import grade, grade_predictions
from lora_lab.lab.predictions import load_predictions

FIXTURES = Path(__file__).parent / "fixtures"
EVERY_COMPARATOR = FIXTURES / "predictions" / "every_comparator.yaml"
FIXTURE_NOTEBOOKS = FIXTURES / "notebooks"

# What the fixture predictions must grade to on the cpu profile when the three fixture notebooks
# ran with default parameters (02 failing after its first record). Shared with test_runner.py.
EXPECTED_CPU_OUTCOMES = {
    "p01-answer-lt": "hit",
    "p01-answer-le": "miss",
    "p01-ratio-gt": "hit",
    "p01-ratio-ge": "hit",
    "p01-answer-eq": "hit",
    "p01-exact-eq-bool": "hit",
    "p03-total-in-range": "hit",
    "p03-steps-in-range-miss": "miss",
    "p03-total-gt-miss": "miss",
    "p01-label-not-number": "void",
    "p01-missing-metric": "void",
    "p02-before-failure": "void",
    "p01-old": "superseded",
    "p01-new": "hit",
}
# (confidence - outcome)^2 over the 7 hits and 3 misses above
EXPECTED_CPU_BRIER = (
    sum((1 - c) ** 2 for c in (0.9, 0.8, 0.7, 0.95, 0.9, 0.8, 0.85)) + sum(c**2 for c in (0.6, 0.3, 0.5))
) / 10


@pytest.fixture
def profile_dir(tmp_path, monkeypatch):
    directory = tmp_path / "outputs" / "cpu"
    monkeypatch.setattr(recording, "scratch_dir", lambda profile: directory)
    monkeypatch.delenv(recording.RUN_CONTEXT_ENV, raising=False)
    monkeypatch.setattr(recording, "_current", None)
    return directory


def record_like_the_fixtures(directory: Path) -> None:
    """The metrics files the three fixture notebooks write (02 fails after its first record)."""
    recording.start_run("01_records_metrics", profile="cpu", parameters={"SCALE": 2, "LABEL": "base"})
    recording.record({"answer": 42, "ratio": 0.5, "exact": True, "label": "base", "pair": [1.5, 2.5]})
    recording.finish_run()
    recording.start_run("02_fails_at_known_cell", profile="cpu", parameters={})
    recording.record("before_failure", 1.0)
    recording.mark_run_ended(
        directory / "02_fails_at_known_cell.metrics.json", "failed",
        {"cell_index": 4, "ename": "ValueError", "evalue": "deliberate failure in cell 4"},
    )
    recording._current = None
    recording.start_run("03_records_after_failure", profile="cpu", parameters={"STEPS": 3})
    recording.record({"steps": 3, "total": 6})
    recording.finish_run()


def fixture_predictions():
    return load_predictions(EVERY_COMPARATOR, notebooks_dir=FIXTURE_NOTEBOOKS)


def outcomes(board):
    return {row.id: row.outcome for row in board.rows}


def test_every_comparator_is_graded_and_scores_are_right(profile_dir):
    record_like_the_fixtures(profile_dir)
    board = grade_predictions(fixture_predictions(), "cpu", profile_dir)
    assert outcomes(board) == EXPECTED_CPU_OUTCOMES
    assert board.hit_rate == pytest.approx(0.7)
    assert board.brier == pytest.approx(EXPECTED_CPU_BRIER)
    rows = {row.id: row for row in board.rows}
    assert rows["p01-answer-le"].value == 42 and rows["p01-answer-le"].predicted == "<= 41"
    assert rows["p03-total-in-range"].predicted == "in [5, 7]"
    assert rows["p01-old"].why == "superseded by p01-new"
    assert rows["p01-missing-metric"].why.startswith("metric 'nonexistent' not recorded (recorded: answer, exact")
    assert rows["p01-label-not-number"].why == "metric 'label' is not a number: base"
    assert rows["p02-before-failure"].why == "notebook failed: ValueError: deliberate failure in cell 4 (cell 4)"


def test_only_predictions_for_the_profile_are_graded(tmp_path, monkeypatch):
    monkeypatch.setattr(recording, "_current", None)
    gpu_dir = tmp_path / "outputs" / "gpu"
    payload = {"notebook": "01_records_metrics", "profile": "gpu", "parameters": {}, "metrics": {"answer": 42},
               "notes": {}, "provenance": {"status": "completed"}}
    gpu_dir.mkdir(parents=True)
    (gpu_dir / "01_records_metrics.metrics.json").write_text(json.dumps(payload))
    board = grade_predictions(fixture_predictions(), "gpu", gpu_dir)
    assert outcomes(board) == {"p01-answer-lt": "hit", "p01-gpu-only": "hit"}
    assert board.brier == pytest.approx(((1 - 0.9) ** 2 + (1 - 0.99) ** 2) / 2)


def test_nothing_run_means_every_prediction_is_void_not_run(tmp_path):
    board = grade_predictions(fixture_predictions(), "cpu", tmp_path / "empty")
    graded = {row.id: row for row in board.rows if row.outcome != "superseded"}
    assert {row.outcome for row in graded.values()} == {"void"}
    assert graded["p01-answer-lt"].why == "not run: no 01_records_metrics.metrics.json"
    assert board.hit_rate is None and board.brier is None
    assert "hit rate n/a; Brier score n/a" in board.summary_line()


def test_void_reasons(profile_dir):
    recording.start_run("01_records_metrics", profile="cpu", parameters={})
    recording.record({"answer": float("nan")})  # stored as null with a note
    recording.finish_run()
    recording.start_run("03_records_after_failure", profile="cpu", parameters={})
    recording.record("total", 6)  # finish_run never called
    recording._current = None
    summary = {"notebooks": {"02_fails_at_known_cell": {"status": "failed", "error": {
        "cell_index": 2, "ename": "ModuleNotFoundError", "evalue": "No module named 'x'"}}}}
    (profile_dir / "run_summary.json").write_text(json.dumps(summary))
    rows = {row.id: row for row in grade_predictions(fixture_predictions(), "cpu", profile_dir).rows}
    assert rows["p01-answer-lt"].outcome == "void"
    assert rows["p01-answer-lt"].why.startswith(
        "metric 'answer' is null (non-finite value(s) stored as null: answer=nan")
    assert rows["p03-total-in-range"].why == "run unfinished: finish_run() was not called, or the kernel died"
    assert rows["p02-before-failure"].why == (
        "notebook failed before recording: ModuleNotFoundError: No module named 'x' (cell 2)"
    )


def test_metrics_of_another_profile_are_not_graded(profile_dir):
    profile_dir.mkdir(parents=True)
    payload = {"notebook": "03_records_after_failure", "profile": "gpu", "metrics": {"total": 6},
               "provenance": {"status": "completed"}}
    (profile_dir / "03_records_after_failure.metrics.json").write_text(json.dumps(payload))
    rows = {row.id: row for row in grade_predictions(fixture_predictions(), "cpu", profile_dir).rows}
    assert rows["p03-total-in-range"].why == "metrics file records profile 'gpu', not 'cpu'"


def test_grade_writes_scoreboard_and_prints_the_table(profile_dir, capsys):
    record_like_the_fixtures(profile_dir)
    board = grade("cpu", predictions_path=EVERY_COMPARATOR, outputs_root=profile_dir.parent,
                  notebooks_dir=FIXTURE_NOTEBOOKS)
    printed = capsys.readouterr().out
    assert "profile cpu: 7 hit, 3 miss, 0 inconclusive, 3 void; hit rate 70.0% (7/10)" in printed
    assert "; 1 superseded" in printed and "blind: 7 hit, 3 miss" in printed
    assert f"Brier score {EXPECTED_CPU_BRIER:.4f}" in printed
    assert "p03-total-gt-miss" in printed and "MISS" in printed
    markdown = (profile_dir / "scoreboard.md").read_text()
    for row in board.rows:
        assert f"| `{row.id}` |" in markdown
    assert "p01-gpu-only" not in markdown
    assert "| **superseded** | superseded by p01-new | blind |" in markdown
    png = (profile_dir / "scoreboard.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_grade_command_exits_zero_with_misses_and_two_on_bad_predictions(profile_dir, tmp_path, capsys):
    record_like_the_fixtures(profile_dir)
    common = ["--profile", "cpu", "--outputs-dir", str(profile_dir.parent), "--notebooks-dir", str(FIXTURE_NOTEBOOKS)]
    assert main(["grade", "--predictions", str(EVERY_COMPARATOR), *common]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(EVERY_COMPARATOR.read_text().replace("notebook: 03_records_after_failure",
                                                        "notebook: 07_missing", 1))
    assert main(["grade", "--predictions", str(bad), *common]) == 2
    assert "unknown notebook '07_missing'" in capsys.readouterr().err


def test_grade_command_grades_the_gpu_profile_without_a_gpu(tmp_path, monkeypatch, capsys):
    """Grading reads recorded metrics: `--profile gpu` must work on a CPU-only machine (CI, a laptop)."""
    import lora_lab.lab.recording as recording

    monkeypatch.setattr(recording, "cuda_available", lambda: False)
    _write_metrics(tmp_path / "gpu", "01_records_metrics", {"answer": 42})
    common = ["--outputs-dir", str(tmp_path), "--notebooks-dir", str(FIXTURE_NOTEBOOKS), "--no-write"]
    assert main(["grade", "--profile", "gpu", "--predictions", str(EVERY_COMPARATOR), *common]) == 0
    assert "profile gpu:" in capsys.readouterr().out


def _write_metrics(directory: Path, notebook: str, metrics: dict, **provenance) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    payload = {"notebook": notebook, "profile": "cpu", "parameters": {}, "metrics": metrics, "notes": {},
               "provenance": {"status": "completed", **provenance}}
    (directory / f"{notebook}.metrics.json").write_text(json.dumps(payload))


def _prediction(comparator, threshold, informed_by=""):
    from lora_lab.lab.predictions import Prediction

    return Prediction(id="p", notebook="01_records_metrics", claim="c", metric="answer", comparator=comparator,
                      threshold=threshold, profiles=("cpu",), confidence=0.5, rationale="r", informed_by=informed_by)


@pytest.mark.parametrize("comparator, threshold, interval, outcome", [
    (">=", 1.3, (1.31, 1.40), "hit"),
    (">=", 1.3, (1.25, 1.35), "inconclusive"),  # the interval straddles the threshold: the runs cannot tell
    (">=", 1.3, (1.10, 1.29), "miss"),
    ("<=", 1.15, (1.12, 1.16), "inconclusive"),
    ("<", 2.0, (2.0, 2.1), "miss"),
    ("in_range", (1.4, 1.9), (1.5, 1.6), "hit"),
    ("in_range", (1.4, 1.9), (1.8, 2.0), "inconclusive"),
    ("in_range", (1.4, 1.9), (2.3, 2.5), "miss"),
    ("==", 1.0, (1.0, 1.0), "hit"),
])
def test_repeated_measurements_grade_by_their_interval(tmp_path, comparator, threshold, interval, outcome):
    from lora_lab.lab.grading import grade_row

    low, high = interval
    value = {"median": (low + high) / 2, "ci95": [low, high], "n": 5, "samples": [low, high, low, high, low]}
    _write_metrics(tmp_path, "01_records_metrics", {"answer": value})
    row = grade_row(_prediction(comparator, threshold), "cpu", tmp_path / "01_records_metrics.metrics.json", {})
    assert row.outcome == outcome
    assert row.interval == (low, high) and row.repetitions == 5 and row.value == value["median"]


def test_too_few_repetitions_are_void_and_summarize_builds_the_form(tmp_path):
    from lora_lab.lab.grading import grade_row
    from lora_lab.lab.measure import summarize

    value = summarize([1.0, 1.1, 0.9])
    assert value["n"] == 3 and value["median"] == 1.0 and value["ci95"][0] <= 1.0 <= value["ci95"][1]
    _write_metrics(tmp_path, "01_records_metrics", {"answer": value})
    row = grade_row(_prediction(">=", 0.5), "cpu", tmp_path / "01_records_metrics.metrics.json", {})
    assert row.outcome == "void" and "3 repetition(s)" in row.why


def test_overridden_parameters_and_interrupted_runs_are_void(tmp_path):
    from lora_lab.lab.grading import grade_row

    _write_metrics(tmp_path, "01_records_metrics", {"answer": 42}, parameter_overrides={"SCALE": 5})
    row = grade_row(_prediction("<", 50), "cpu", tmp_path / "01_records_metrics.metrics.json", {})
    assert row.outcome == "void" and row.why == "run with parameters other than the registered ones (SCALE=5)"
    _write_metrics(tmp_path, "01_records_metrics", {"answer": 42})
    payload = json.loads((tmp_path / "01_records_metrics.metrics.json").read_text())
    payload["provenance"]["status"] = "interrupted"
    (tmp_path / "01_records_metrics.metrics.json").write_text(json.dumps(payload))
    row = grade_row(_prediction("<", 50), "cpu", tmp_path / "01_records_metrics.metrics.json", {})
    assert row.outcome == "void" and row.why == "run interrupted before the end"


def test_blind_and_informed_are_scored_apart(tmp_path):
    from lora_lab.lab.grading import Scoreboard, grade_row

    _write_metrics(tmp_path, "01_records_metrics", {"answer": 42})
    path = tmp_path / "01_records_metrics.metrics.json"
    board = Scoreboard("cpu", [grade_row(_prediction("<", 50), "cpu", path, {}),
                               grade_row(_prediction(">", 50, informed_by="a dev run showed 42"), "cpu", path, {})])
    blind, informed = board.split_lines()[:2]
    assert blind.startswith("blind: 1 hit, 0 miss, 0 inconclusive") and "100.0% (1/1)" in blind
    assert informed.startswith("informed: 0 hit, 1 miss") and "0.0% (0/1)" in informed
    assert "| a dev run showed 42 |" in board.markdown() and "| blind |" in board.markdown()


def test_grade_refuses_an_uncommitted_predictions_file(tmp_path):
    import subprocess

    from lora_lab.lab.predictions import PredictionError

    repo = tmp_path / "repo"
    (repo / "predictions").mkdir(parents=True)
    (repo / "predictions" / "predictions.yaml").write_text(EVERY_COMPARATOR.read_text())
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    with pytest.raises(PredictionError, match="not committed yet: commit the predictions before grading"):
        grade("cpu", predictions_path=repo / "predictions" / "predictions.yaml", outputs_root=tmp_path / "o",
              notebooks_dir=FIXTURE_NOTEBOOKS, write=False, echo=False)
    subprocess.run(["git", "add", "."], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "register"], cwd=repo,
                   check=True)
    grade("cpu", predictions_path=repo / "predictions" / "predictions.yaml", outputs_root=tmp_path / "o",
          notebooks_dir=FIXTURE_NOTEBOOKS, write=False, echo=False)
    with open(repo / "predictions" / "predictions.yaml", "a") as handle:
        handle.write("\n# an edit\n")
    with pytest.raises(PredictionError, match="changed since the last commit"):
        grade("cpu", predictions_path=repo / "predictions" / "predictions.yaml", outputs_root=tmp_path / "o",
              notebooks_dir=FIXTURE_NOTEBOOKS, write=False, echo=False)


def _ratio(metric="answer_speedup_vs_x", kind="", comparator=">=", threshold=1.3, pid="p"):
    from lora_lab.lab.predictions import Prediction

    return Prediction(id=pid, notebook="01_records_metrics", claim="c", metric=metric, comparator=comparator,
                      threshold=threshold, profiles=("cpu",), confidence=0.5, rationale="r", kind=kind)


@pytest.mark.parametrize("sessions, outcome", [(None, "void"), (1, "void"), (2, "hit"), (3, "hit")])
def test_a_speed_ratio_needs_an_interval_from_two_sessions(tmp_path, sessions, outcome):
    from lora_lab.lab.grading import ONE_SESSION_WHY, grade_row

    value = {"median": 1.4, "ci95": [1.35, 1.45], "n": 5, "samples": [1.4] * 5}
    if sessions is not None:
        value["sessions"] = sessions
    _write_metrics(tmp_path, "01_records_metrics", {"answer_speedup_vs_x": value, "answer": value})
    path = tmp_path / "01_records_metrics.metrics.json"
    row = grade_row(_ratio(), "cpu", path, {})
    assert row.outcome == outcome
    if outcome == "void":
        assert row.why.startswith(ONE_SESSION_WHY) and row.one_session_outcome == "hit"
    else:
        assert row.why == "" and row.one_session_outcome == "" and row.sessions == sessions
        assert f"(n=5, {sessions} sessions)" in row.measured_text()
    # declared by kind (a key that does not say so), and not a speed ratio at all
    assert grade_row(_ratio("answer", kind="speed_ratio"), "cpu", path, {}).outcome == outcome
    assert grade_row(_ratio("answer"), "cpu", path, {}).outcome == "hit"


def test_a_plain_number_speed_ratio_is_one_session(tmp_path):
    from lora_lab.lab.grading import grade_row

    _write_metrics(tmp_path, "01_records_metrics", {"step_time_vs_base": 0.9})
    row = grade_row(_ratio("step_time_vs_base", comparator="<", threshold=1.0), "cpu",
                    tmp_path / "01_records_metrics.metrics.json", {})
    assert (row.outcome, row.one_session_outcome) == ("void", "hit")


def _run(commit, outcome, value, one_session=""):
    return {"notebook": "01_records_metrics", "git_commit": commit,
            "graded": {"p": {"outcome": outcome, "value": value, "ci95": None, "n": None, "sessions": None,
                             "why": "" if outcome != "void" else "not run", "one_session_outcome": one_session}}}


def test_the_headline_is_the_registered_test_and_a_flip_is_unstable(tmp_path):
    _write_metrics(tmp_path, "01_records_metrics", {"answer": 42})  # the latest run: a hit
    prediction = _prediction("<", 40)
    prediction = type(prediction)(**{**prediction.__dict__, "confidence": 0.8})
    history = [_run("aaaaaaa1", "void", None), _run("bbbbbbb2", "miss", 45), _run("ccccccc3", "hit", 39)]
    board = grade_predictions([prediction], "cpu", tmp_path, history=history)
    [row] = board.rows
    assert (row.outcome, row.value) == ("miss", 45)  # the first run that graded it, not the latest
    assert [run["role"] for run in row.history] == ["void", "test", "replication"]
    assert row.unstable
    assert row.history_text() == ("r1 aaaaaaa: void → r2 bbbbbbb: miss (test) → r3 ccccccc: hit (replication); "
                                  "**unstable**")
    assert board.brier == pytest.approx(0.8 ** 2)  # scored on the registered test (a miss)
    assert board.summary_line().endswith("1 unstable across runs; 0 superseded")
    assert "r2 bbbbbbb: miss (test)" in board.markdown() and "[UNSTABLE across runs]" in board.table_text()

    stable = grade_predictions([prediction], "cpu", tmp_path, history=history[:2] + [_run("c", "miss", 41)])
    assert not stable.rows[0].unstable and "0 unstable" in stable.summary_line()
    # one-session voids count by what their interval gave
    flips = [_run("a", "void", 1.0, one_session="miss"), _run("b", "void", 2.0, one_session="hit")]
    [row] = grade_predictions([prediction], "cpu", tmp_path, history=flips).rows
    assert row.unstable and (row.outcome, row.value) == ("miss", 42)  # no run graded it: the current file's
    assert row.history_text() == "r1 a: miss* → r2 b: hit*; **unstable**"


def test_the_run_label_says_which_commit_ran_other_code(tmp_path):
    from lora_lab.lab.grading import Scoreboard, ran_label
    from lora_lab.lab.provenance import CODE_HASH_SCOPE, code_hash

    _write_metrics(tmp_path, "01_records_metrics", {"answer": 42}, code_hash="0" * 64, git_commit="abcdef123456")
    assert ran_label(tmp_path / "01_records_metrics.metrics.json") == "ran abcdef1"
    _write_metrics(tmp_path, "01_records_metrics", {"answer": 42}, code_hash=code_hash(), git_commit="abcdef123456",
                   code_hash_scope=CODE_HASH_SCOPE)
    assert ran_label(tmp_path / "01_records_metrics.metrics.json") == "current code"
    _write_metrics(tmp_path, "01_records_metrics", {"answer": 42}, code_hash=code_hash(scope="lora_lab"),
                   git_commit="abcdef123456")  # a legacy run (no scope) compares in its own scope
    assert ran_label(tmp_path / "01_records_metrics.metrics.json") == "current code"
    [row] = grade_predictions([_prediction("<", 50)], "cpu", tmp_path, history=[]).rows
    assert row.ran == "current code" and "| current code |" in Scoreboard("cpu", [row]).markdown()


def test_scoreboard_plot_has_a_colour_for_every_outcome_in_order():
    from lora_lab.lab.grading import OUTCOMES
    from lora_lab.lab.scoreboard_files import OUTCOME_COLOURS

    assert tuple(OUTCOME_COLOURS) == OUTCOMES


def test_a_prediction_registered_after_the_latest_run_awaits_its_first_run(tmp_path):
    """Registered after the run began and its metric absent: void, saying its test is the next run (not 'metric not
    recorded'), and the summary line counts it apart from the other voids."""
    from lora_lab.lab.grading import AWAITING_WHY, grade_predictions

    _write_metrics(tmp_path, "01_records_metrics", {"answer": 2.0}, started="2026-12-01T10:00:00+00:00")
    late, early = _ratio(metric="absent", pid="late"), _ratio(metric="absent_too", pid="early")
    board = grade_predictions([late, early], "cpu", tmp_path, history=[],
                              registered_at={"late": "2026-12-02T10:00:00+00:00", "early": "2026-11-30T10:00:00+00:00"})
    rows = {row.id: row for row in board.rows}
    assert rows["late"].outcome == "void" and rows["late"].why.endswith(AWAITING_WHY)
    assert rows["early"].outcome == "void" and "not recorded" in rows["early"].why
    assert "2 void (1 of them awaiting their first run)" in board.summary_line()

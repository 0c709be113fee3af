"""lora_lab.grading: hit / miss / void / superseded, hit rate, Brier score, the scoreboard files."""
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
    monkeypatch.setenv(recording.OUTPUT_DIR_ENV, str(directory))
    monkeypatch.delenv(recording.NOTEBOOK_ENV, raising=False)
    monkeypatch.setattr(recording, "_current", None)
    return directory


def record_like_the_fixtures(directory: Path) -> None:
    """The metrics files the three fixture notebooks write (02 fails after its first record)."""
    recording.start_run("01_records_metrics", profile="cpu", parameters={"SCALE": 2, "LABEL": "base"})
    recording.record({"answer": 42, "ratio": 0.5, "exact": True, "label": "base", "pair": [1.5, 2.5]})
    recording.finish_run()
    recording.start_run("02_fails_at_known_cell", profile="cpu")
    recording.record("before_failure", 1.0)
    recording.mark_run_failed(
        directory / "02_fails_at_known_cell.metrics.json",
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
    recording.start_run("01_records_metrics", profile="cpu")
    recording.record({"answer": float("nan")})  # stored as null with a note
    recording.finish_run()
    recording.start_run("03_records_after_failure", profile="cpu")
    recording.record("total", 6)  # finish_run never called
    recording._current = None
    summary = {"notebooks": {"02_fails_at_known_cell": {"status": "failed", "error": {
        "cell_index": 2, "ename": "ModuleNotFoundError", "evalue": "No module named 'x'"}}}}
    (profile_dir / "run_summary.json").write_text(json.dumps(summary))
    rows = {row.id: row for row in grade_predictions(fixture_predictions(), "cpu", profile_dir).rows}
    assert rows["p01-answer-lt"].outcome == "void"
    assert rows["p01-answer-lt"].why.startswith("metric 'answer' is null (non-finite value(s) stored as null: answer=nan")
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
    board = grade("cpu", predictions_path=EVERY_COMPARATOR, outputs_root=profile_dir.parent, notebooks_dir=FIXTURE_NOTEBOOKS)
    printed = capsys.readouterr().out
    assert "profile cpu: 7 hit, 3 miss, 3 void, 1 superseded; hit rate 70.0% (7/10)" in printed
    assert f"Brier score {EXPECTED_CPU_BRIER:.4f}" in printed
    assert "p03-total-gt-miss" in printed and "MISS" in printed
    markdown = (profile_dir / "scoreboard.md").read_text()
    for row in board.rows:
        assert f"| `{row.id}` |" in markdown
    assert "p01-gpu-only" not in markdown
    assert "| **superseded** | superseded by p01-new |" in markdown
    png = (profile_dir / "scoreboard.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_grade_command_exits_zero_with_misses_and_two_on_bad_predictions(profile_dir, tmp_path, capsys):
    record_like_the_fixtures(profile_dir)
    common = ["--profile", "cpu", "--outputs-dir", str(profile_dir.parent), "--notebooks-dir", str(FIXTURE_NOTEBOOKS)]
    assert main(["grade", "--predictions", str(EVERY_COMPARATOR), *common]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(EVERY_COMPARATOR.read_text().replace("notebook: 03_records_after_failure", "notebook: 07_missing", 1))
    assert main(["grade", "--predictions", str(bad), *common]) == 2
    assert "unknown notebook '07_missing'" in capsys.readouterr().err


def test_grade_command_grades_the_gpu_profile_without_a_gpu(tmp_path, monkeypatch, capsys):
    """Grading reads recorded metrics: `--profile gpu` must work on a CPU-only machine (CI, a laptop)."""
    import lora_lab.lab.recording as recording

    monkeypatch.setattr(recording, "cuda_available", lambda: False)
    (tmp_path / "gpu").mkdir()
    common = ["--outputs-dir", str(tmp_path), "--notebooks-dir", str(FIXTURE_NOTEBOOKS), "--no-write"]
    assert main(["grade", "--profile", "gpu", "--predictions", str(EVERY_COMPARATOR), *common]) == 0
    assert "profile gpu:" in capsys.readouterr().out

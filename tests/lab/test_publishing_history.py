"""lora-lab publish appends every published run to outputs/<profile>/run_history.json."""
import json
import shutil
from pathlib import Path

import nbformat

from lora_lab.lab.history import load_history
from lora_lab.lab.provenance import CODE_HASH_SCOPE, code_hash, notebook_hash
from lora_lab.lab.publishing import publish

FIXTURES = Path(__file__).parent / "fixtures"
PREDICTION = """\
- id: p01-answer
  notebook: 01_records_metrics
  claim: "the answer is 42"
  metric: answer
  comparator: "=="
  threshold: 42
  profiles: [cpu]
  confidence: 0.9
  rationale: "21 x 2"
"""


def _executed_run(runs: Path, notebooks: Path, answer: int, started: str) -> None:
    """A run folder as `lora-lab run` leaves it: the executed notebook and its completed metrics."""
    run_dir = runs / "cpu"
    run_dir.mkdir(parents=True, exist_ok=True)
    executed = nbformat.read(str(notebooks / "01_records_metrics.ipynb"), as_version=4)
    for count, cell in enumerate((cell for cell in executed.cells if cell.cell_type == "code"), 1):
        cell.execution_count = count
    nbformat.write(executed, str(run_dir / "01_records_metrics.ipynb"))
    provenance = {"status": "completed", "runner": True, "parameter_overrides": {}, "code_hash": code_hash(),
                  "code_hash_scope": CODE_HASH_SCOPE, "git_commit": "a" * 40, "device": "cpu",
                  "notebook_hash": notebook_hash(notebooks / "01_records_metrics.ipynb"), "started": started,
                  "finished": started}
    payload = {"notebook": "01_records_metrics", "profile": "cpu", "parameters": {}, "metrics": {"answer": answer},
               "notes": {}, "provenance": provenance}
    (run_dir / "01_records_metrics.metrics.json").write_text(json.dumps(payload))


def test_each_publication_is_appended_to_the_run_history(tmp_path):
    notebooks = tmp_path / "notebooks"
    shutil.copytree(FIXTURES / "notebooks", notebooks)
    (tmp_path / "predictions").mkdir()
    (tmp_path / "predictions" / "predictions.yaml").write_text(PREDICTION)
    runs, outputs = tmp_path / "runs", tmp_path / "outputs"

    _executed_run(runs, notebooks, 42, "t1")
    publish("cpu", runs_root=runs, outputs_root=outputs, notebooks_dir=notebooks, to_notebooks=False)
    _executed_run(runs, notebooks, 41, "t2")
    publish("cpu", runs_root=runs, outputs_root=outputs, notebooks_dir=notebooks, to_notebooks=False)
    publish("cpu", runs_root=runs, outputs_root=outputs, notebooks_dir=notebooks, to_notebooks=False)  # same run

    history = load_history(outputs / "cpu")
    assert [run["started"] for run in history] == ["t1", "t2"]
    assert [run["graded"]["p01-answer"]["outcome"] for run in history] == ["hit", "miss"]
    assert history[0]["git_commit"] == "a" * 40 and history[0]["code_hash"] == code_hash()
    assert history[0]["source"] == "publish" and history[0]["published_in"] is None
    metrics = json.loads((outputs / "cpu" / "01_records_metrics.metrics.json").read_text())
    assert metrics["metrics"]["answer"] == 41  # the metrics file holds the last run; the history keeps both


def _git(repo: Path, *args: str) -> str:
    import subprocess

    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_a_run_naming_a_commit_the_repository_lacks_or_other_code_is_refused(tmp_path):
    """A declared commit once mistyped on the device (4467ddf1 for 4467ddf2...); publish took the run and
    only verify, after the commit, would have said the commit does not exist. Now publish says it first."""
    import pytest

    from lora_lab.lab.publishing import PublishError

    notebooks = tmp_path / "notebooks"
    shutil.copytree(FIXTURES / "notebooks", notebooks)
    (tmp_path / "predictions").mkdir()
    (tmp_path / "predictions" / "predictions.yaml").write_text(PREDICTION)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "notebooks")
    runs, outputs = tmp_path / "runs", tmp_path / "outputs"
    _executed_run(runs, notebooks, 42, "t1")  # names commit aaaa...: not in this repository
    with pytest.raises(PublishError, match="names commit 'a{40}', which this repository does not have"):
        publish("cpu", runs_root=runs, outputs_root=outputs, notebooks_dir=notebooks, to_notebooks=False)
    metrics = runs / "cpu" / "01_records_metrics.metrics.json"
    payload = json.loads(metrics.read_text())
    payload["provenance"]["git_commit"] = _git(tmp_path, "rev-parse", "HEAD")  # a real commit without this code
    metrics.write_text(json.dumps(payload))
    with pytest.raises(PublishError, match="is not the code that ran"):
        publish("cpu", runs_root=runs, outputs_root=outputs, notebooks_dir=notebooks, to_notebooks=False)
    assert not outputs.exists()


def test_publishing_appends_the_run_s_benchmark_figures_to_the_ledger_once(tmp_path):
    import csv

    from lora_lab.lab.ledger import read_measurements

    notebooks = tmp_path / "notebooks"
    shutil.copytree(FIXTURES / "notebooks", notebooks)
    (tmp_path / "predictions").mkdir()
    (tmp_path / "predictions" / "predictions.yaml").write_text(PREDICTION)
    runs, outputs = tmp_path / "runs", tmp_path / "outputs"
    _executed_run(runs, notebooks, 42, "2026-12-04T08:33:47+00:00")
    with open(runs / "cpu" / "01_cells.csv", "w", newline="") as handle:  # a benchmark's table of repetitions
        writer = csv.writer(handle)
        writer.writerow(["cell", "method", "rep", "ms"])
        writer.writerows([["c1", "ours", rep, 1.0 + rep] for rep in range(3)])
    for _ in range(2):  # the same run published twice: its figures are in the ledger once
        publish("cpu", runs_root=runs, outputs_root=outputs, notebooks_dir=notebooks, to_notebooks=False)
    rows = read_measurements(ledger=outputs / "cpu" / "measurements.csv")
    assert [(r["statistic"], r["value"], r["n"]) for r in rows] == [("median", 2.0, 3), ("ci_low", 1.0, 3),
                                                                    ("ci_high", 3.0, 3)]
    assert {(r["benchmark"], r["cell"], r["method"], r["date"], r["device"], r["commit"], r["code_hash"],
             r["published"], r["source"]) for r in rows} == {
        ("cells", "cell=c1", "ours", "2026-12-04", "cpu", "a" * 40, code_hash(), True, "outputs/cpu/01_cells.csv")}


def test_a_run_whose_csv_makes_no_valid_ledger_row_publishes_nothing(tmp_path):
    import pytest

    from lora_lab.lab.publishing import PublishError

    notebooks = tmp_path / "notebooks"
    shutil.copytree(FIXTURES / "notebooks", notebooks)
    (tmp_path / "predictions").mkdir()
    (tmp_path / "predictions" / "predictions.yaml").write_text(PREDICTION)
    runs, outputs = tmp_path / "runs", tmp_path / "outputs"
    _executed_run(runs, notebooks, 42, "t1")  # no date the ledger can file the figures under
    (runs / "cpu" / "01_cells.csv").write_text("cell,method,rep,ms\nc1,ours,0,1.0\n")
    with pytest.raises(PublishError, match="01_records_metrics: its benchmark CSVs do not make ledger rows: .*date"):
        publish("cpu", runs_root=runs, outputs_root=outputs, notebooks_dir=notebooks, to_notebooks=False)
    assert not (outputs / "cpu").exists()

"""nbval guards checked verdict cells: `pytest --nbval-lax` fails when a committed verdict changes.

Each case runs pytest in a subprocess on a copy of tests/fixtures/nbval/checked_verdict.ipynb,
whose committed outputs were produced by executing it. Only the `# NBVAL_CHECK_OUTPUT` cell is
compared; the others (a timestamp, a random number) differ on every run and must not matter.
"""
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "nbval" / "checked_verdict.ipynb"
VERDICT_LINE = "sum of squares matches: True\n"


def run_nbval(notebook: nbformat.NotebookNode, directory: Path) -> subprocess.CompletedProcess:
    path = directory / "checked_verdict.ipynb"
    nbformat.write(notebook, str(path))
    (directory / "pytest.ini").write_text("[pytest]\n")  # keep the repo's pytest options out
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider",
         "-q", "-c", str(directory / "pytest.ini"), str(path)],
        cwd=directory, capture_output=True, text=True, timeout=300,
    )


def checked_cell(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    [cell] = [cell for cell in notebook.cells if cell.source.startswith("# NBVAL_CHECK_OUTPUT")]
    return cell


def test_fixture_has_one_checked_cell_with_a_committed_verdict():
    notebook = nbformat.read(str(FIXTURE), as_version=4)
    assert checked_cell(notebook).outputs[0]["text"].startswith(VERDICT_LINE)


def test_unchanged_verdict_passes(tmp_path):
    done = run_nbval(nbformat.read(str(FIXTURE), as_version=4), tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "passed" in done.stdout


@pytest.mark.parametrize("change", ["committed output", "code"])
def test_changed_verdict_fails(tmp_path, change):
    notebook = nbformat.read(str(FIXTURE), as_version=4)
    cell = checked_cell(notebook)
    if change == "committed output":  # the notebook was committed with another verdict than it now prints
        cell.outputs[0]["text"] = cell.outputs[0]["text"].replace(VERDICT_LINE, "sum of squares matches: False\n")
    else:  # a regression: the code now computes a different verdict
        cell.source = cell.source.replace("== 50", "== 51")
    done = run_nbval(notebook, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed" in done.stdout and "Cell outputs differ" in done.stdout
    assert "sum of squares matches" in done.stdout

"""nbval's checks against an executed copy (``-p lora_lab.lab.nbval_executed --nbval-lax --nbval-executed DIR``):
what ``make test`` runs on the notebooks the cpu batch has executed, instead of executing them a second time.

Each case runs pytest in a subprocess on a copy of tests/lab/fixtures/nbval/checked_verdict.ipynb and an executed
copy made by papermill (as ``lora-lab run`` makes it, with an injected-parameters cell). Only the
``# NBVAL_CHECK_OUTPUT`` cell is compared; the others (a timestamp, a random number) differ on every run.
"""
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "nbval" / "checked_verdict.ipynb"
VERDICT_LINE = "sum of squares matches: True\n"
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # papermill: "Input notebook does not contain ..."


def execute(notebook: nbformat.NotebookNode, directory: Path) -> Path:
    """``notebook`` executed by papermill into ``directory/checked_verdict.ipynb`` (with a parameter injected)."""
    import papermill

    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "source.ipynb"
    nbformat.write(notebook, str(source))
    executed = directory / "checked_verdict.ipynb"
    papermill.execute_notebook(str(source), str(executed), parameters={"UNUSED": 1}, kernel_name="python3",
                               progress_bar=False, cwd=str(directory))
    source.unlink()
    return executed


@pytest.fixture(scope="module")
def executed_fixture(tmp_path_factory) -> nbformat.NotebookNode:
    """The fixture notebook as papermill executes it (once per module)."""
    path = execute(nbformat.read(str(FIXTURE), as_version=4), tmp_path_factory.mktemp("executed"))
    return nbformat.read(str(path), as_version=4)


def run_check(notebook: nbformat.NotebookNode, executed: nbformat.NotebookNode | None,
              directory: Path) -> subprocess.CompletedProcess:
    """pytest with the plugin on ``notebook`` against ``executed`` (None: no executed copy)."""
    (directory / "executed").mkdir(parents=True)
    path = directory / "checked_verdict.ipynb"
    nbformat.write(notebook, str(path))
    if executed is not None:
        nbformat.write(executed, str(directory / "executed" / path.name))
    (directory / "pytest.ini").write_text("[pytest]\n")  # keep the repo's pytest options out
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "lora_lab.lab.nbval_executed", "--nbval-lax", "--nbval-executed",
         str(directory / "executed"), "-p", "no:cacheprovider", "-q", "-c", str(directory / "pytest.ini"), str(path)],
        cwd=directory, capture_output=True, text=True, timeout=300,
    )


def fixture_notebook() -> nbformat.NotebookNode:
    return nbformat.read(str(FIXTURE), as_version=4)


def checked_cell(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    [cell] = [cell for cell in notebook.cells if cell.source.startswith("# NBVAL_CHECK_OUTPUT")]
    return cell


def test_the_executed_copy_has_an_injected_cell_and_other_unchecked_outputs(executed_fixture):
    tags = [cell.metadata.get("tags", []) for cell in executed_fixture.cells]
    assert ["injected-parameters"] in tags
    stored = [cell.outputs for cell in fixture_notebook().cells if cell.cell_type == "code"]
    ran = [cell.outputs for cell in executed_fixture.cells
           if cell.cell_type == "code" and not cell.metadata.get("tags")]
    assert stored[0] != ran[0]  # the timestamp: only the checked cell may be compared


def test_unchanged_verdict_passes_without_running_a_kernel(executed_fixture, tmp_path):
    done = run_check(fixture_notebook(), executed_fixture, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    cells = sum(cell.cell_type == "code" for cell in fixture_notebook().cells)
    assert f"{cells} passed" in done.stdout


@pytest.mark.parametrize("change", ["committed output", "code"])
def test_changed_verdict_fails(executed_fixture, tmp_path, change):
    notebook, executed = fixture_notebook(), executed_fixture
    cell = checked_cell(notebook)
    if change == "committed output":  # the notebook was committed with another verdict than the run printed
        cell.outputs[0]["text"] = cell.outputs[0]["text"].replace(VERDICT_LINE, "sum of squares matches: False\n")
    else:  # a regression: the code now computes a different verdict, and the batch ran that code
        cell.source = cell.source.replace("== 50", "== 51")
        executed = nbformat.read(str(execute(notebook, tmp_path / "run")), as_version=4)
    done = run_check(notebook, executed, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed" in done.stdout and "Cell outputs differ" in done.stdout
    assert "sum of squares matches" in done.stdout


def test_a_cell_that_raised_or_did_not_run_fails(executed_fixture, tmp_path):
    executed = nbformat.from_dict(executed_fixture)
    first, *_, last = [cell for cell in executed.cells if cell.cell_type == "code" and not cell.metadata.get("tags")]
    first.outputs = [nbformat.v4.new_output("error", ename="RuntimeError", evalue="made-up failure",
                                            traceback=["RuntimeError: made-up failure"])]
    last.outputs, last.execution_count = [], None  # papermill leaves the cells after a failure unrun
    last.metadata.setdefault("papermill", {})["status"] = "pending"
    done = run_check(fixture_notebook(), executed, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 failed" in done.stdout
    assert "Cell execution caused an exception" in done.stdout and "made-up failure" in done.stdout
    assert "Cell did not run in the executed copy" in done.stdout


def test_an_execution_of_other_sources_or_none_is_an_error(executed_fixture, tmp_path):
    notebook = fixture_notebook()
    checked_cell(notebook).source += "\nprint('one more line')"  # edited after the batch ran
    done = run_check(notebook, executed_fixture, tmp_path / "stale")
    assert done.returncode == 1 and "is not an execution of" in done.stdout, done.stdout + done.stderr
    done = run_check(fixture_notebook(), None, tmp_path / "none")
    assert done.returncode == 1 and "no executed copy" in done.stdout, done.stdout + done.stderr


def test_the_option_needs_an_nbval_mode(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "lora_lab.lab.nbval_executed", "--nbval-executed",
                           str(tmp_path), "-c", str(tmp_path / "pytest.ini"), str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 4 and "--nbval-executed needs --nbval or --nbval-lax" in done.stderr, done.stderr

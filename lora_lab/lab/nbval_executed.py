"""nbval's checks on notebooks that have already run, instead of running them again.

``pytest -p lora_lab.lab.nbval_executed --nbval-lax --nbval-executed DIR notebooks/`` collects each notebook as
nbval does (one test per code cell, the same markers and tags), but takes each cell's outputs from ``DIR``'s copy
of the notebook, executed by ``lora-lab run``, instead of from a kernel. A cell's test fails, with nbval's
report, when

- the executed notebook is missing, or its code cells are not the notebook's (the run is of other sources);
- the cell did not run (an earlier cell failed, or the run stopped), or it raised;
- nbval checks its outputs (``--nbval-lax``: the cells marked ``# NBVAL_CHECK_OUTPUT``; ``--nbval``: every
  unmarked cell too) and they differ from the outputs stored in the notebook, compared by nbval's own code.

papermill's ``injected-parameters`` cell is not a cell of the notebook and is left out. Without
``--nbval-executed`` the plugin does nothing and nbval runs the notebooks in a kernel as usual.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from nbval.plugin import IPyNbCell, IPyNbFile, coalesce_streams

INJECTED_TAG = "injected-parameters"  # papermill's tag (lora_lab.lab.runner.INJECTED_TAG)
MODE_KEY = pytest.StashKey[str]()  # "lax" or "full": the nbval mode asked for


def pytest_addoption(parser):
    parser.getgroup("nbval").addoption(
        "--nbval-executed", metavar="DIR", default=None,
        help="check the notebooks against their executed copies in DIR (same file names) instead of running them")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    option = config.option
    if option.nbval_executed is None:
        return
    if not (option.nbval or option.nbval_lax):
        raise pytest.UsageError("--nbval-executed needs --nbval or --nbval-lax (which cells' outputs to compare)")
    if not Path(option.nbval_executed).is_dir():
        raise pytest.UsageError(f"--nbval-executed {option.nbval_executed}: no such folder")
    config.stash[MODE_KEY] = "lax" if option.nbval_lax else "full"
    # nbval's own collector would also collect the notebooks (and start a kernel for each): this plugin's replaces it
    option.nbval = option.nbval_lax = False


def pytest_collect_file(file_path, parent):
    if MODE_KEY in parent.config.stash and file_path.suffix == ".ipynb":
        return ExecutedNotebook.from_parent(parent, path=file_path)
    return None


def code_cells(notebook) -> list:
    """The notebook's code cells, without papermill's injected-parameters cell."""
    return [cell for cell in notebook.cells
            if cell.cell_type == "code" and INJECTED_TAG not in (cell.get("metadata", {}).get("tags") or [])]


class ExecutedNotebook(IPyNbFile):
    """A notebook whose cells are checked against its executed copy; no kernel is started."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compare_outputs = self.config.stash[MODE_KEY] == "full"  # nbval's default for unmarked cells
        self.executed_cells: list | None = None

    def collect(self):
        for item in super().collect():  # nbval's items, as this class's
            yield ExecutedCell.from_parent(self, name=item.name, cell_num=item.cell_num, cell=item.cell,
                                           options=item.options)

    def setup(self):
        import nbformat

        self.setup_sanitize_files()
        executed_path = Path(self.config.option.nbval_executed) / self.path.name
        if not executed_path.is_file():
            raise FileNotFoundError(f"{self.path.name}: no executed copy at {executed_path} (run it first: "
                                    f"lora-lab run --outputs-dir ...)")
        executed = code_cells(nbformat.read(str(executed_path), as_version=4))
        source = code_cells(self.nb)
        if [cell.source for cell in executed] != [cell.source for cell in source]:
            differ = next((index for index, (a, b) in enumerate(zip(source, executed)) if a.source != b.source),
                          min(len(source), len(executed)))
            raise ValueError(f"{executed_path} is not an execution of {self.path}: code cell {differ} differs "
                             f"({len(executed)} code cells there, {len(source)} here)")
        self.executed_cells = executed


class ExecutedCell(IPyNbCell):
    """nbval's cell test, with the outputs of the executed copy in place of a kernel's."""

    def runtest(self):
        if self.options["skip"]:
            pytest.skip()
        executed = self.parent.executed_cells[self.cell_num]
        outs = copy.deepcopy(list(executed.outputs))
        self.test_outputs = outs
        pending = executed.get("metadata", {}).get("papermill", {}).get("status") == "pending"
        if pending or (executed.execution_count is None and executed.source.strip()):
            self.raise_cell_error("Cell did not run in the executed copy (an earlier cell failed or the run stopped)")
        errors = [out for out in outs if out.output_type == "error"]
        if errors and not self.options["check_exception"]:
            self.raise_cell_error("Cell execution caused an exception", "\n" + "\n".join(errors[0].traceback))
        outs[:] = coalesce_streams(outs)
        unrun = self.cell.execution_count is None
        if unrun and self.cell.outputs:
            self.raise_cell_error("Unrun reference cell has outputs")
        if self.options["check"] and not unrun:
            if not self.compare_outputs(outs, coalesce_streams(copy.deepcopy(list(self.cell.outputs)))):
                self.raise_cell_error("Cell outputs differ", "\n".join(self.comparison_traceback))

"""What an executed notebook (papermill's output) says about its run: the tags papermill puts on the cells it adds,
and where a failed run stopped (the failing cell's index in the *source* notebook, its execution count, the
exception). Read by the runner (a failed notebook's report) and by publishing (what a run executed)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["INJECTED_TAG", "PAPERMILL_ERROR_TAG", "failing_cell_index", "failure_details", "read_notebook"]

INJECTED_TAG = "injected-parameters"  # papermill's cell with the overridden parameters
PAPERMILL_ERROR_TAG = "papermill-error-cell-tag"  # papermill's banner cell before a failed cell


def failing_cell_index(cells: list) -> int | None:
    """The cell a run stopped in: the first with an error output or papermill exception flag,
    else (a dead kernel leaves no error output) the last code cell that started executing."""
    for index, cell in enumerate(cells):
        if any(output.get("output_type") == "error" for output in cell.get("outputs", [])):
            return index
        if cell.get("metadata", {}).get("papermill", {}).get("exception"):
            return index
    started = [
        index
        for index, cell in enumerate(cells)
        if cell.cell_type == "code" and cell.get("metadata", {}).get("papermill", {}).get("start_time")
    ]
    return started[-1] if started else None


def read_notebook(path: Path) -> Any:
    import nbformat

    return nbformat.read(str(path), as_version=4)


def failure_details(error: BaseException, executed_path: Path) -> dict[str, Any]:
    """Failing cell (index in the *source* notebook), exec count, exception name and message."""
    details: dict[str, Any] = {
        "cell_index": None,
        "exec_count": None,
        "ename": getattr(error, "ename", None) or type(error).__name__,
        "evalue": getattr(error, "evalue", None) or str(error).strip()[:2000],
        "cell_source_first_line": None,
    }
    executed_index = getattr(error, "cell_index", None)
    try:
        executed = read_notebook(executed_path)
    except Exception:  # noqa: BLE001 - the output may be missing or half written: report without it
        executed = None
    if executed is not None:
        tags = [cell.get("metadata", {}).get("tags") or [] for cell in executed.cells]
        cells = [cell for cell, cell_tags in zip(executed.cells, tags) if PAPERMILL_ERROR_TAG not in cell_tags]
        if executed_index is None:
            executed_index = failing_cell_index(cells)
        if executed_index is not None and executed_index < len(cells):
            injected_before = sum(
                INJECTED_TAG in (cell.get("metadata", {}).get("tags") or []) for cell in cells[:executed_index]
            )
            cell = cells[executed_index]
            details["cell_index"] = executed_index - injected_before
            details["exec_count"] = cell.get("execution_count")
            first_line = next((line for line in cell.source.splitlines() if line.strip()), "")
            details["cell_source_first_line"] = first_line[:200]
    elif executed_index is not None:
        details["cell_index"] = executed_index
    if details["exec_count"] is None:
        details["exec_count"] = getattr(error, "exec_count", None)
    return details

"""The numbered notebooks as files: finding them, and reading their ``parameters`` cell (plain JSON, no kernel).

A notebook's parameters cell holds literals only (``R = 8  # LoRA rank``); papermill replaces values, so a
value derived from another would go stale. These literals are the *registered* parameters: a run with other
values is recorded as overridden and its predictions are not graded.
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

__all__ = [
    "NOTEBOOK_NAME",
    "NotebookError",
    "discover_notebooks",
    "read_cells",
    "parameters_cell_index",
    "declared_parameters",
    "METADATA_KEY",
    "required_gpus",
]

NOTEBOOK_NAME = re.compile(r"^(\d\d)_[A-Za-z0-9_\-]+\.ipynb$")
METADATA_KEY = "lora_lab"  # notebook-level metadata of the lab: {"lora_lab": {"gpus": 2}}


class NotebookError(ValueError):
    """A notebook file that breaks the contract (no parameters cell, a cell that is not Python, ...)."""


def discover_notebooks(notebooks_dir: Path | str) -> list[Path]:
    """``NN_*.ipynb`` files of ``notebooks_dir``, sorted by name."""
    directory = Path(notebooks_dir)
    if not directory.is_dir():
        raise NotebookError(f"notebooks directory {directory} does not exist")
    return sorted(path for path in directory.iterdir() if NOTEBOOK_NAME.match(path.name))


def read_cells(path: Path | str) -> list[dict]:
    try:
        cells = json.loads(Path(path).read_text(encoding="utf-8")).get("cells")
    except (OSError, ValueError) as error:
        raise NotebookError(f"{Path(path).name}: cannot read the notebook ({error})") from None
    if not isinstance(cells, list):
        raise NotebookError(f"{Path(path).name}: not a notebook (no list of cells)")
    return cells


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def _tags(cell: dict) -> list[str]:
    return list(cell.get("metadata", {}).get("tags") or [])


def parameters_cell_index(cells: list[dict]) -> int | None:
    for index, cell in enumerate(cells):
        if "parameters" in _tags(cell):
            return index
    return None


def declared_parameters(path: Path | str) -> dict[str, Any]:
    """``{name: literal default}`` of the cell tagged ``parameters``; a non-literal value is an error."""
    path = Path(path)
    cells = read_cells(path)
    index = parameters_cell_index(cells)
    if index is None:
        raise NotebookError(f"{path.name}: no cell is tagged 'parameters' (the notebook contract requires one, "
                            "with PROFILE)")
    try:
        tree = ast.parse(_source(cells[index]))
    except SyntaxError as error:
        raise NotebookError(f"{path.name}: the parameters cell is not valid Python: {error}") from None
    declared: dict[str, Any] = {}
    for statement in tree.body:
        if isinstance(statement, ast.Assign):
            targets, value = statement.targets, statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            targets, value = [statement.target], statement.value
        else:
            continue
        for target in targets:
            if not isinstance(target, ast.Name):
                continue
            try:
                declared[target.id] = ast.literal_eval(value)
            except ValueError:
                raise NotebookError(
                    f"{path.name}: parameter {target.id} is not a literal ({ast.unparse(value)}); papermill replaces "
                    "values, so derived values belong in the next cell"
                ) from None
    return declared


def required_gpus(path: Path | str) -> int:
    """How many GPUs the notebook needs: its notebook-level metadata ``{"lora_lab": {"gpus": N}}``, 0 without it.

    On the gpu profile a notebook that needs N GPUs runs only on a machine with at least N; ``lora-lab run`` skips
    it elsewhere and says why. The cpu profile runs it (its cpu path), as every notebook.
    """
    path = Path(path)
    try:
        metadata = json.loads(path.read_text(encoding="utf-8")).get("metadata") or {}
    except (OSError, ValueError) as error:
        raise NotebookError(f"{path.name}: cannot read the notebook ({error})") from None
    lab = metadata.get(METADATA_KEY) or {}
    if not isinstance(lab, dict):
        raise NotebookError(f"{path.name}: metadata {METADATA_KEY!r} must be an object like "
                            f"{{\"gpus\": 2}}, got {lab!r}")
    gpus = lab.get("gpus", 0)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise NotebookError(f"{path.name}: metadata {METADATA_KEY}.gpus must be a non-negative integer, got {gpus!r}")
    return gpus

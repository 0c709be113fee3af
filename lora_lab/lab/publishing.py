"""Publish executed notebooks: copy ``outputs/<profile>/NN_*.ipynb`` over ``notebooks/NN_*.ipynb``.

The published notebook keeps every cell's source, outputs and execution count from the run;
it loses what papermill added (the injected-parameters cell, error banners, papermill and
timing metadata), so that its parameters cell still reads ``PROFILE = "auto"`` and nbval can
re-execute it on the CPU. Publishing refuses a notebook whose run failed, and one whose source
changed since the run (its outputs would no longer belong to its code).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_lab.lab.runner import INJECTED_TAG, NOTEBOOK_NAME, PAPERMILL_ERROR_TAG, KERNEL_NAME, read_notebook

PAPERMILL_CELL_METADATA = ("papermill", "execution")


class PublishError(ValueError):
    """A notebook cannot be published; the message says which and why."""


@dataclass
class Published:
    notebook: str
    source: Path
    destination: Path


def _tags(cell: Any) -> list[str]:
    return list(cell.get("metadata", {}).get("tags") or [])


def strip_papermill(executed: Any) -> Any:
    """A copy of ``executed`` without papermill's cells and metadata; outputs and counts kept."""
    notebook = copy.deepcopy(executed)
    notebook.cells = [
        cell for cell in notebook.cells if INJECTED_TAG not in _tags(cell) and PAPERMILL_ERROR_TAG not in _tags(cell)
    ]
    notebook.metadata.pop("papermill", None)
    for cell in notebook.cells:
        for key in PAPERMILL_CELL_METADATA:
            cell.metadata.pop(key, None)
    kernelspec = notebook.metadata.setdefault("kernelspec", {})
    kernelspec["name"] = KERNEL_NAME
    kernelspec.setdefault("display_name", "Python 3")
    kernelspec.setdefault("language", "python")
    return notebook


def run_failed(executed: Any) -> bool:
    if executed.metadata.get("papermill", {}).get("exception"):
        return True
    for cell in executed.cells:
        if PAPERMILL_ERROR_TAG in _tags(cell):
            return True
        if any(output.get("output_type") == "error" for output in cell.get("outputs", [])):
            return True
    return False


def sources(notebook: Any) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in notebook.cells]


def publish(
    profile: str,
    outputs_root: Path | str,
    notebooks_dir: Path | str,
    only: list[str] | None = None,
    force: bool = False,
) -> list[Published]:
    """Copy the executed notebooks of ``profile`` into ``notebooks_dir``; all checks happen first."""
    import nbformat

    from lora_lab.lab.runner import select_notebooks

    profile_dir = Path(outputs_root) / profile
    notebooks_dir = Path(notebooks_dir)
    executed_paths = sorted(path for path in profile_dir.glob("*.ipynb") if NOTEBOOK_NAME.match(path.name))
    if not executed_paths:
        raise PublishError(f"no executed NN_*.ipynb notebooks in {profile_dir}: run `lora-lab run --profile {profile}` first")
    executed_paths = select_notebooks(executed_paths, only)
    problems: list[str] = []
    plan: list[tuple[Path, Path, Any]] = []
    for executed_path in executed_paths:
        destination = notebooks_dir / executed_path.name
        executed = read_notebook(executed_path)
        if run_failed(executed):
            problems.append(f"{executed_path}: the run failed; fix it and run again before publishing")
            continue
        if not destination.is_file():
            problems.append(f"{executed_path.name}: there is no {destination} to publish over")
            continue
        published = strip_papermill(executed)
        if not force and sources(published) != sources(read_notebook(destination)):
            problems.append(
                f"{destination} changed since the {profile} run (cell sources differ): run it again "
                "(or pass --force to publish the old run's code and outputs)"
            )
            continue
        plan.append((executed_path, destination, published))
    if problems:
        raise PublishError("nothing published:\n  - " + "\n  - ".join(problems))
    done = []
    for executed_path, destination, published in plan:
        nbformat.write(published, str(destination))
        done.append(Published(executed_path.stem, executed_path, destination))
    return done

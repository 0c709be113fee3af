"""Run the numbered notebooks in batch with papermill, one profile at a time.

For each selected ``notebooks/NN_name.ipynb`` the runner

- validates every ``-p NAME VALUE`` against the notebook's ``parameters`` cell *before anything
  runs* (unknown name, or a value whose type does not fit the default -> error);
- passes ``PROFILE=<resolved profile>`` plus the parameters that notebook declares;
- sets ``LORA_LAB_OUTPUT_DIR=<outputs>/<profile>`` and ``LORA_LAB_NOTEBOOK=<stem>`` for the
  kernel, so the metrics land in ``<outputs>/<profile>/<stem>.metrics.json``; on the ``cpu``
  profile it also sets ``TRITON_INTERPRET=1`` unless already set (Triton kernels run in its
  interpreter there); ``MPLBACKEND=Agg`` is not passed on, so figures stay in the notebook;
- removes the notebook's previous metrics file (stale results must not be graded), executes it
  into ``<outputs>/<profile>/<stem>.ipynb`` with kernel ``python3``;
- on failure reports the notebook, the failing cell (index in the source notebook, counting
  from 0) and the exception, marks its metrics file ``failed`` if it had started recording,
  and goes on with the next notebook.

``<outputs>/<profile>/run_summary.json`` keeps one entry per notebook (entries of notebooks not
run this time are kept). The exit code is non-zero if any notebook failed.
"""

from __future__ import annotations

import ast
import datetime as _dt
import json
import os
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from lora_lab.lab.recording import (
    NOTEBOOK_ENV,
    OUTPUT_DIR_ENV,
    mark_run_failed,
    metrics_path,
    read_metrics,
    resolve_profile,
    write_json_atomically,
)

NOTEBOOK_NAME = re.compile(r"^(\d\d)_[A-Za-z0-9_\-]+\.ipynb$")
KERNEL_NAME = "python3"
RUN_SUMMARY_NAME = "run_summary.json"
INJECTED_TAG = "injected-parameters"
PAPERMILL_ERROR_TAG = "papermill-error-cell-tag"


class RunnerError(ValueError):
    """Bad selection or parameters: reported before any notebook runs."""


# --------------------------------------------------------------------------------------------
# Finding notebooks and their parameters
# --------------------------------------------------------------------------------------------


def discover_notebooks(notebooks_dir: Path | str) -> list[Path]:
    """``NN_*.ipynb`` files of ``notebooks_dir``, sorted by name."""
    directory = Path(notebooks_dir)
    if not directory.is_dir():
        raise RunnerError(f"notebooks directory {directory} does not exist")
    return sorted(path for path in directory.iterdir() if NOTEBOOK_NAME.match(path.name))


def select_notebooks(notebooks: list[Path], only: list[str] | None) -> list[Path]:
    """Keep the notebooks named in ``only`` by number prefix (``03``, ``3``) or stem."""
    if not only:
        return list(notebooks)
    selected: list[Path] = []
    for wanted in only:
        wanted = wanted.strip()
        if wanted.endswith(".ipynb"):
            wanted = wanted[: -len(".ipynb")]
        matches = [
            path
            for path in notebooks
            if path.stem == wanted or (wanted.isdigit() and int(path.stem[:2]) == int(wanted))
        ]
        if not matches:
            available = ", ".join(path.stem for path in notebooks) or "none"
            raise RunnerError(f"--only {wanted!r} matches no notebook (available: {available})")
        selected.extend(path for path in matches if path not in selected)
    return sorted(selected)


def parse_only(text: str | None) -> list[str] | None:
    if not text:
        return None
    return [item for item in (part.strip() for part in text.split(",")) if item]


def read_notebook(path: Path) -> Any:
    import nbformat

    return nbformat.read(str(path), as_version=4)


def parameters_cell_index(notebook: Any) -> int | None:
    for index, cell in enumerate(notebook.cells):
        if "parameters" in (cell.get("metadata", {}).get("tags") or []):
            return index
    return None


def declared_parameters(path: Path) -> dict[str, Any]:
    """``{name: default}`` of the cell tagged ``parameters`` (literal defaults; others: None)."""
    notebook = read_notebook(path)
    index = parameters_cell_index(notebook)
    if index is None:
        raise RunnerError(f"{path.name}: no cell is tagged 'parameters' (the notebook contract requires one, with PROFILE)")
    source = notebook.cells[index].source
    try:
        tree = ast.parse(source)
    except SyntaxError as error:
        raise RunnerError(f"{path.name}: the parameters cell is not valid Python: {error}") from None
    declared: dict[str, Any] = {}
    for statement in tree.body:
        targets: list[ast.expr] = []
        value_node = None
        if isinstance(statement, ast.Assign):
            targets, value_node = statement.targets, statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            targets, value_node = [statement.target], statement.value
        for target in targets:
            if isinstance(target, ast.Name):
                try:
                    declared[target.id] = ast.literal_eval(value_node)
                except ValueError:
                    declared[target.id] = None
    return declared


def parse_value(text: str) -> Any:
    """A command-line value as a Python literal (``512``, ``1e-3``, ``[1, 2]``, ``True``), else text."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def fits_default(value: Any, default: Any) -> bool:
    if default is None:
        return True
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple))
    return isinstance(value, type(default))


def plan_parameters(
    notebooks: list[Path], overrides: dict[str, Any], profile: str
) -> dict[Path, dict[str, Any]]:
    """Parameters for each notebook; raises RunnerError (all problems at once) before anything runs.

    A name must be declared by at least one selected notebook; it is passed to those that declare it.
    """
    problems: list[str] = []
    if "PROFILE" in overrides:
        problems.append("PROFILE is set with --profile, not -p")
    declared: dict[Path, dict[str, Any]] = {}
    for path in notebooks:
        try:
            declared[path] = declared_parameters(path)
        except RunnerError as error:
            problems.append(str(error))
            continue
        if "PROFILE" not in declared[path]:
            problems.append(f"{path.name}: the parameters cell has no PROFILE (it must declare PROFILE = \"auto\")")
    for name, value in overrides.items():
        if name == "PROFILE":
            continue
        owners = [path for path in declared if name in declared[path]]
        if not owners:
            listing = "; ".join(f"{path.stem}: {', '.join(sorted(names)) or '-'}" for path, names in declared.items())
            problems.append(
                f"unknown parameter {name!r}: no selected notebook declares it in its parameters cell ({listing})"
            )
        for path in owners:
            default = declared[path][name]
            if not fits_default(value, default):
                problems.append(
                    f"{path.stem}: parameter {name!r} defaults to {type(default).__name__} {default!r}; "
                    f"got {type(value).__name__} {value!r}"
                )
    if problems:
        raise RunnerError("; ".join(problems) if len(problems) == 1 else "\n  - " + "\n  - ".join(problems))
    return {
        path: {"PROFILE": profile, **{name: value for name, value in overrides.items() if name in names}}
        for path, names in declared.items()
    }


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


@dataclass
class NotebookResult:
    notebook: str
    status: str  # "ok" | "failed"
    seconds: float
    started: str
    finished: str
    parameters: dict[str, Any]
    executed_notebook: str
    metrics_file: str | None
    error: dict[str, Any] | None = None
    warnings: list[str] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key != "notebook"}

    def error_text(self) -> str:
        if not self.error:
            return ""
        cell = self.error.get("cell_index")
        where = f"cell {cell}" if cell is not None else "unknown cell"
        if self.error.get("exec_count") is not None:
            where += f" (In [{self.error['exec_count']}])"
        evalue = str(self.error.get("evalue") or "").strip().splitlines()
        return f"{where}: {self.error.get('ename')}: {evalue[0] if evalue else ''}".rstrip(": ")


@contextmanager
def kernel_environment(values: dict[str, str], defaults: dict[str, str], unset: tuple[str, ...] = ()) -> Iterator[None]:
    """Set (or unset) environment variables the kernel inherits; restore them afterwards."""
    saved = {name: os.environ.get(name) for name in (*values, *defaults, *unset)}
    for name in unset:
        os.environ.pop(name, None)
    os.environ.update(values)
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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
    executed = None
    try:
        executed = read_notebook(executed_path)
    except Exception:  # noqa: BLE001 - the output may be missing or half written
        executed = None
    if executed is not None:
        cells = [cell for cell in executed.cells if PAPERMILL_ERROR_TAG not in (cell.get("metadata", {}).get("tags") or [])]
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


def progress_disabled(explicit: bool | None = None) -> bool:
    if explicit is not None:
        return explicit
    return os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false", "no")


def run_notebook(
    path: Path,
    parameters: dict[str, Any],
    profile: str,
    output_dir: Path,
    cell_timeout: float | None = None,
    show_cell_progress: bool = False,
) -> NotebookResult:
    import papermill

    stem = path.stem
    executed_path = output_dir / f"{stem}.ipynb"
    metrics_file = metrics_path(output_dir, stem)
    metrics_file.unlink(missing_ok=True)
    started_clock = time.monotonic()
    started = _now()
    error_details = None
    environment = {OUTPUT_DIR_ENV: str(output_dir), NOTEBOOK_ENV: stem}
    defaults = {"TRITON_INTERPRET": "1"} if profile == "cpu" else {}
    # MPLBACKEND=Agg (set for headless CI) would keep every figure out of the executed notebook;
    # without it ipykernel uses the inline backend.
    unset = ("MPLBACKEND",) if os.environ.get("MPLBACKEND", "").lower() == "agg" else ()
    with kernel_environment(environment, defaults, unset):
        try:
            papermill.execute_notebook(
                str(path),
                str(executed_path),
                parameters=parameters,
                kernel_name=KERNEL_NAME,
                progress_bar={"leave": False, "position": 1, "desc": stem} if show_cell_progress else False,
                log_output=False,
                cwd=str(path.parent),
                execution_timeout=cell_timeout,
            )
        except Exception as error:  # noqa: BLE001 - any failure is reported, the batch goes on
            error_details = failure_details(error, executed_path)
    finished = _now()
    warnings: list[str] = []
    if error_details is not None:
        mark_run_failed(metrics_file, error_details)
    elif not metrics_file.is_file():
        warnings.append(f"no {metrics_file.name}: the notebook never called lora_lab.start_run({stem!r}, ...)")
    else:
        status = read_metrics(metrics_file).get("provenance", {}).get("status")
        if status != "completed":
            warnings.append(f"{metrics_file.name} has status {status!r}: the notebook did not call lora_lab.finish_run()")
    return NotebookResult(
        notebook=stem,
        status="failed" if error_details else "ok",
        seconds=round(time.monotonic() - started_clock, 2),
        started=started,
        finished=finished,
        parameters=parameters,
        executed_notebook=str(executed_path),
        metrics_file=str(metrics_file) if metrics_file.is_file() else None,
        error=error_details,
        warnings=warnings or None,
    )


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def update_run_summary(output_dir: Path, profile: str, results: list[NotebookResult]) -> Path:
    """Merge this batch's results into ``run_summary.json`` (other notebooks' entries are kept)."""
    path = output_dir / RUN_SUMMARY_NAME
    summary: dict[str, Any] = {}
    if path.is_file():
        try:
            summary = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            summary = {}
    notebooks = summary.get("notebooks") if isinstance(summary.get("notebooks"), dict) else {}
    for result in results:
        notebooks[result.notebook] = result.as_dict()
    summary = {"profile": profile, "updated": _now(), "notebooks": dict(sorted(notebooks.items()))}
    write_json_atomically(path, summary)
    return path


def run(
    profile: str = "auto",
    only: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    notebooks_dir: Path | str = "notebooks",
    outputs_root: Path | str = "outputs",
    cell_timeout: float | None = None,
    disable_progress: bool | None = None,
    stream=None,
) -> int:
    """Run the selected notebooks; print a report; return 0 if all succeeded, 1 otherwise.

    Selection and parameter problems raise RunnerError before anything runs.
    """
    from tqdm.auto import tqdm

    stream = stream or sys.stdout
    resolved = resolve_profile(profile)
    notebooks = select_notebooks(discover_notebooks(notebooks_dir), only)
    if not notebooks:
        print(f"no NN_*.ipynb notebooks in {notebooks_dir}: nothing to run", file=stream)
        return 0
    plan = plan_parameters(notebooks, dict(overrides or {}), resolved)
    output_dir = Path(outputs_root).resolve() / resolved
    output_dir.mkdir(parents=True, exist_ok=True)
    disabled = progress_disabled(disable_progress)
    print(f"running {len(notebooks)} notebook(s) on profile {resolved} into {output_dir}", file=stream)
    results: list[NotebookResult] = []
    bar = tqdm(notebooks, desc="notebooks", unit="nb", disable=disabled, file=sys.stderr)
    for path in bar:
        bar.set_postfix_str(path.stem)
        result = run_notebook(path.resolve(), plan[path], resolved, output_dir, cell_timeout, show_cell_progress=not disabled)
        results.append(result)
        update_run_summary(output_dir, resolved, results)
        if result.status == "failed":
            tqdm.write(f"FAILED {path.name}: {result.error_text()}", file=stream)
    bar.close()
    summary_path = update_run_summary(output_dir, resolved, results)

    width = max(len(result.notebook) for result in results)
    print(f"\nrun summary (profile {resolved}):", file=stream)
    for result in results:
        line = f"  {result.notebook:<{width}}  {result.status.upper():<6}  {result.seconds:8.1f} s"
        if result.error:
            line += f"  {result.error_text()}"
        print(line, file=stream)
        for warning in result.warnings or []:
            print(f"  {'':<{width}}  warning: {warning}", file=stream)
    failed = [result for result in results if result.status == "failed"]
    print(
        f"{len(results) - len(failed)} ok, {len(failed)} failed; executed notebooks, metrics and {summary_path.name} in {output_dir}",
        file=stream,
    )
    return 1 if failed else 0

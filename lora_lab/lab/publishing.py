"""Publish a run: copy what ``lora-lab run`` wrote (scratch, ``build/runs/<profile>/``) into the committed
``outputs/<profile>/`` and, for the gpu profile, the executed notebooks into ``notebooks/``.

Every check happens first, on the files themselves (not on a summary another run may have left), and a
single problem publishes nothing:

* the executed notebook ran to the end: every code cell has an execution count and no error output;
* its metrics file says ``completed``, was written by the runner with the registered parameters (no
  overrides), and its **code hash** and **notebook hash** equal those of the working tree — the published
  outputs belong to the code published with them;
* it was run from committed code: its provenance names a git commit and does not say ``git_dirty: true``
  (committing the same code afterwards does not make such a run reproducible from a commit; a copy of a
  committed tree, whose commit is declared and whose dirty state is unknown, is accepted);
* where the notebooks live in a git repository, that commit is one of its commits and its committed code is the
  run's code (a declared commit is typed in on the device, and a mistyped one would otherwise only be caught by
  ``lora-lab verify`` after the commit).

The published notebook keeps every cell's source, outputs and execution count; it loses what papermill
added (the injected-parameters cell, error banners, papermill and timing metadata), so that its parameters
cell still reads ``PROFILE = "auto"`` and nbval can re-execute it. A notebook's files in the run folder are
its executed notebook, its metrics and every file or folder whose name starts with its number (``05_*``).

Publishing replaces a notebook's files but not its past: each published run is appended to the profile's run
history (``outputs/<profile>/run_history.json``, :mod:`lora_lab.lab.history`) with the commit and code that ran
it and the outcome of every prediction registered (committed) for it, so a republished notebook's earlier
outcomes stay on the scoreboard. The figures of its benchmark CSVs are appended to the profile's measurement ledger
(``outputs/<profile>/measurements.csv``, :mod:`lora_lab.lab.ledger`) as published, with the run's date, device,
commit and code hash.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_lab.lab.executed_notebooks import INJECTED_TAG, PAPERMILL_ERROR_TAG, read_notebook
from lora_lab.lab.history import append_runs, history_entry
from lora_lab.lab.ledger import LEDGER_NAME, LedgerError, append_measurements, check_measurements, csv_figures
from lora_lab.lab.notebooks import NOTEBOOK_NAME
from lora_lab.lab.provenance import CODE_HASH_SCOPES, code_hash, code_hash_at, code_hash_scope_of, notebook_hash
from lora_lab.lab.recording import STATUS_COMPLETED, read_metrics, write_json_atomically
from lora_lab.lab.runner import KERNEL_NAME, RUN_SUMMARY_NAME
from lora_lab.lab.verify import GitError, has_commits, repository_root

PAPERMILL_CELL_METADATA = ("papermill", "execution")


class PublishError(ValueError):
    """A run cannot be published; the message says which notebook and why."""


@dataclass
class Published:
    notebook: str
    source: Path
    destination: Path  # the notebook's folder in outputs/<profile>/
    notebook_destination: Path | None  # notebooks/<stem>.ipynb when published there


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


def incomplete_reason(executed: Any) -> str | None:
    """Why an executed notebook is not a complete run (None when it is)."""
    if executed.metadata.get("papermill", {}).get("exception"):
        return "the run raised an exception"
    code_cells = [cell for cell in executed.cells if cell.cell_type == "code" and INJECTED_TAG not in _tags(cell)]
    for index, cell in enumerate(executed.cells):
        if PAPERMILL_ERROR_TAG in _tags(cell):
            return "the run failed (papermill's error banner is in it)"
        if any(output.get("output_type") == "error" for output in cell.get("outputs", [])):
            return f"cell {index} ended in an error"
    unexecuted = [cell for cell in code_cells if cell.get("execution_count") is None]
    if unexecuted:
        return (f"{len(unexecuted)} of {len(code_cells)} code cells never ran (interrupted?), the first: "
                f"{unexecuted[0].source.splitlines()[0][:80] if unexecuted[0].source else '(empty)'!r}")
    return None


def sources(notebook: Any) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in notebook.cells]


def notebook_files(run_dir: Path, stem: str) -> list[Path]:
    """The executed notebook, the metrics and every ``NN_*`` artifact of notebook ``stem`` in ``run_dir``."""
    number = stem[:2]
    return sorted(path for path in run_dir.iterdir() if path.name.startswith(f"{number}_"))


def check_run(executed_path: Path, notebooks_dir: Path, current_code: str | dict[str, str]) -> list[str]:
    """Why the run of ``executed_path`` cannot be published ([] when it can). ``current_code``: the working
    tree's code hash, or ``{scope: hash}`` to compare each run in the hash scope it recorded."""
    stem = executed_path.stem
    problems = []
    source_path = notebooks_dir / executed_path.name
    if not source_path.is_file():
        return [f"{stem}: there is no {source_path} to publish over"]
    try:
        executed = read_notebook(executed_path)
    except Exception as error:  # noqa: BLE001 - a half-written notebook is reported, not raised
        return [f"{stem}: the executed notebook cannot be read ({error})"]
    why = incomplete_reason(executed)
    if why:
        problems.append(f"{stem}: not a complete run: {why}")
    metrics_file = executed_path.with_name(f"{stem}.metrics.json")
    if not metrics_file.is_file():
        return problems + [f"{stem}: no {metrics_file.name} next to the executed notebook"]
    provenance = read_metrics(metrics_file).get("provenance") or {}
    if provenance.get("status") != STATUS_COMPLETED:
        problems.append(f"{stem}: its metrics say {provenance.get('status')!r}, not 'completed'")
    if not provenance.get("runner"):
        problems.append(f"{stem}: not run by `lora-lab run` (a scratch run cannot be published)")
    if provenance.get("parameter_overrides"):
        problems.append(f"{stem}: run with overridden parameters {provenance['parameter_overrides']}; publish a run "
                        "with the registered ones")
    if isinstance(current_code, dict):
        current_code = current_code.get(code_hash_scope_of(provenance), "?")
    if provenance.get("git_dirty") is True or not provenance.get("git_commit"):
        state = "uncommitted changes" if provenance.get("git_dirty") is True else "no git commit"
        problems.append(f"{stem}: run from code with {state} (provenance git_dirty="
                        f"{provenance.get('git_dirty')}, git_commit={provenance.get('git_commit')}): commit the code, "
                        "then run it again; a published run must name the commit that produced it")
    elif (repo := _repository_of(notebooks_dir)) is not None:
        commit = str(provenance["git_commit"])
        committed = code_hash_at(repo, commit, code_hash_scope_of(provenance))
        if committed is None:
            problems.append(f"{stem}: its provenance names commit {commit!r}, which this repository does not have "
                            "(a mistyped declared commit?): run it again, declaring `git rev-parse HEAD`")
        elif committed != provenance.get("code_hash"):
            problems.append(f"{stem}: commit {commit[:10]}'s code (hash {committed[:12]}) is not the code that ran "
                            f"(hash {str(provenance.get('code_hash'))[:12]}): run it again, declaring the commit "
                            "of the code you sent")
    if provenance.get("code_hash") != current_code:
        problems.append(f"{stem}: run by other code (code hash {str(provenance.get('code_hash'))[:12]}, working tree "
                        f"{current_code[:12]}): run it again")
    if provenance.get("notebook_hash") != notebook_hash(source_path):
        problems.append(f"{stem}: {source_path.name} changed since the run (cell sources differ): run it again")
    elif sources(strip_papermill(executed)) != sources(read_notebook(source_path)):
        problems.append(f"{stem}: the executed notebook's cells differ from {source_path.name}")
    return problems


def _repository_of(path: Path) -> Path | None:
    """The root of the git repository holding ``path`` with at least one commit (None outside one)."""
    try:
        root = repository_root(path)
        return root if has_commits(root) else None
    except GitError:
        return None


def published_figures(run_dir: Path, stem: str, profile: str) -> list[dict[str, Any]]:
    """Ledger rows (published) of the benchmark CSVs notebook ``stem`` wrote into ``run_dir``: every ``NN_*.csv``,
    a table of repetitions left out where its ``_summary`` table is there, each row with the run's date (when it
    finished), device, commit and code hash unless its CSV names the commit and code hash itself; ``source`` is
    the CSV's published path ``outputs/<profile>/<name>``."""
    provenance = read_metrics(run_dir / f"{stem}.metrics.json").get("provenance") or {}
    run = {"date": str(provenance.get("finished") or provenance.get("started") or "")[:10] or None,
           "device": provenance.get("device"), "commit": provenance.get("git_commit"),
           "code_hash": provenance.get("code_hash")}
    rows = []
    for path in notebook_files(run_dir, stem):
        if path.suffix != ".csv" or path.is_dir() or path.with_name(f"{path.stem}_summary.csv").is_file():
            continue
        for row in csv_figures(path, source=f"outputs/{profile}/{path.name}", published=True):
            rows.append({**{k: v for k, v in run.items() if v}, **row})
    return rows


def publish(
    profile: str,
    runs_root: Path | str,
    outputs_root: Path | str,
    notebooks_dir: Path | str,
    only: list[str] | None = None,
    to_notebooks: bool | None = None,
    predictions_path: Path | str | None = None,
) -> list[Published]:
    """Copy ``<runs_root>/<profile>``'s notebooks into ``<outputs_root>/<profile>`` (and, by default for the gpu
    profile, into ``notebooks_dir``) and append each run to the profile's run history, graded against
    ``predictions_path`` (default: ``predictions/predictions.yaml`` beside ``notebooks_dir``); every check
    happens first."""
    import nbformat

    from lora_lab.lab.runner import select_notebooks

    run_dir = Path(runs_root) / profile
    out_dir = Path(outputs_root) / profile
    notebooks_dir = Path(notebooks_dir)
    to_notebooks = (profile == "gpu") if to_notebooks is None else to_notebooks
    if not run_dir.is_dir():
        raise PublishError(f"no run folder {run_dir}: run `lora-lab run --profile {profile}` first")
    executed_paths = sorted(path for path in run_dir.glob("*.ipynb") if NOTEBOOK_NAME.match(path.name))
    if not executed_paths:
        raise PublishError(f"no executed NN_*.ipynb notebooks in {run_dir}: "
                           f"run `lora-lab run --profile {profile}` first")
    executed_paths = select_notebooks(executed_paths, only)
    current_code = {scope: code_hash(scope=scope) for scope in CODE_HASH_SCOPES}
    problems = [problem for path in executed_paths for problem in check_run(path, notebooks_dir, current_code)]
    predictions_path = (Path(predictions_path) if predictions_path is not None
                        else notebooks_dir.parent / "predictions" / "predictions.yaml")
    try:
        predictions, registered = predictions_for_history(predictions_path, notebooks_dir)
    except ValueError as error:
        problems.append(f"the run history cannot grade the runs: {error}")
    figures = []
    for path in executed_paths if not problems else ():
        try:
            figures += check_measurements(published_figures(run_dir, path.stem, profile), profile)
        except (LedgerError, OSError, ValueError) as error:
            problems.append(f"{path.stem}: its benchmark CSVs do not make ledger rows: {error}")
    if problems:
        raise PublishError("nothing published:\n  - " + "\n  - ".join(problems))
    history_entries = [history_entry(read_metrics(path.with_name(f"{path.stem}.metrics.json")), profile, predictions,
                                     registered) for path in executed_paths]

    done = []
    out_dir.mkdir(parents=True, exist_ok=True)
    summary_in = json.loads((run_dir / RUN_SUMMARY_NAME).read_text()) if (run_dir / RUN_SUMMARY_NAME).is_file() else {}
    summary_path = out_dir / RUN_SUMMARY_NAME
    summary_out = json.loads(summary_path.read_text()) if summary_path.is_file() else {"notebooks": {}}
    for executed_path in executed_paths:
        stem = executed_path.stem
        for old in notebook_files(out_dir, stem):  # the previous publication's files of this notebook
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        for item in notebook_files(run_dir, stem):
            target = out_dir / item.name
            shutil.copytree(item, target) if item.is_dir() else shutil.copy2(item, target)
        entry = (summary_in.get("notebooks") or {}).get(stem)
        if entry is not None:
            summary_out.setdefault("notebooks", {})[stem] = entry
        notebook_destination = None
        if to_notebooks:
            notebook_destination = notebooks_dir / executed_path.name
            nbformat.write(strip_papermill(read_notebook(executed_path)), str(notebook_destination))
        done.append(Published(stem, executed_path, out_dir, notebook_destination))
    summary_out["profile"] = profile
    summary_out["notebooks"] = dict(sorted(summary_out.get("notebooks", {}).items()))
    write_json_atomically(summary_path, summary_out)
    append_runs(out_dir, profile, history_entries)
    if figures:
        append_measurements(figures, profile, ledger=out_dir / LEDGER_NAME, skip_present=True)
    return done


def predictions_for_history(predictions_path: Path, notebooks_dir: Path) -> tuple[list, set[str] | None]:
    """(predictions, ids registered in git — None when git cannot tell) to grade published runs with; no
    predictions file: nothing to grade. An invalid file is a ValueError (PredictionError)."""
    from lora_lab.lab.predictions import load_predictions
    from lora_lab.lab.verify import GitError, registrations, repository_root

    if not predictions_path.is_file():
        return [], None
    predictions = load_predictions(predictions_path, notebooks_dir=notebooks_dir)
    try:
        root = repository_root(predictions_path.parent)
        relative = predictions_path.resolve().relative_to(root.resolve()).as_posix()
        registered = set(registrations(root, relative))
    except (GitError, ValueError, OSError):
        registered = None
    return predictions, registered

"""Run the numbered notebooks in batch with papermill, one profile at a time.

For each selected ``notebooks/NN_name.ipynb`` the runner

- validates every ``-p NAME VALUE`` against the notebook's ``parameters`` cell *before anything runs*
  (unknown name, a value whose type does not fit the default, or a value its rule in
  :data:`lora_lab.lab.notebooks.PARAMETER_RULES` refuses, such as ``R 0`` -> error naming the rule);
- hands the notebook's kernel **one context** (the environment variable ``LORA_LAB_RUN``, JSON): the
  notebook's stem, the resolved profile, the output folder and the effective parameters, with the ones
  that differ from the parameters cell marked as overrides; papermill injects only those overrides;
- on the ``cpu`` profile starts the kernel with ``TRITON_INTERPRET=1`` (Triton's CPU interpreter must be on
  before Triton is imported); ``MPLBACKEND=Agg`` is not passed on, so figures stay in the notebook;
- on the ``gpu`` profile skips a notebook whose metadata asks for more GPUs than the machine has
  (``{"lora_lab": {"gpus": 2}}``; the cpu profile runs every notebook's cpu path), saying so, and removes its old
  metrics file from the output folder; a skip is not a failure;
- moves the notebook's previous metrics file out of the grader's way (stale results must not be graded): a
  completed one to ``.<stem>.metrics.previous.json``, removed when this run completes and kept when it fails; then
  executes the notebook into ``<outputs>/<profile>/<stem>.ipynb``;
- on failure reports the notebook, the failing cell (index in the source notebook, counting from 0) and
  the exception, marks its metrics ``failed``, and goes on with the next notebook; on Ctrl-C marks the one
  running ``interrupted``, says so in one line and stops;
- with ``parallel`` above 1 (``lora-lab run --parallel N``; ``make run`` passes 4 on the gpu profiles) runs
  consecutive notebooks that time nothing (:mod:`lora_lab.lab.side_by_side`) up to N at once, each in its own
  kernel; every other notebook runs alone, so its timings share the GPU with nothing (and under a memory cap every
  one does: the cap stands for one card's memory). Ctrl-C interrupts every kernel of the group.

The default output root is ``build/runs`` (scratch, ignored by git): ``lora-lab publish`` is the only way
results reach the committed ``outputs/`` and ``notebooks/``. ``<outputs>/<profile>/run_summary.json``
keeps one entry per notebook (entries of notebooks not run this time are kept).
"""

from __future__ import annotations

import ast
import datetime as _dt
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_lab.lab.executed_notebooks import (  # noqa: F401 - INJECTED_TAG, failing_cell_index: public here too
    INJECTED_TAG,
    PAPERMILL_ERROR_TAG,
    failing_cell_index,
    failure_details,
    read_notebook,
)
from lora_lab.lab.kernel_processes import kernel_manager_with, quiet_orphaned_kernel_tasks
from lora_lab.lab.notebooks import NOTEBOOK_NAME, NotebookError, discover_notebooks, parameter_problem, required_gpus
from lora_lab.lab.notebooks import declared_parameters as _declared_parameters
from lora_lab.lab.profiles import base_profile, get_profile
from lora_lab.lab.recording import (
    RUN_CONTEXT_ENV,
    STATUS_FAILED,
    STATUS_INTERRUPTED,
    mark_run_ended,
    metrics_path,
    read_metrics,
    resolve_profile,
    write_json_atomically,
)
from lora_lab.lab.side_by_side import run_side_by_side, side_by_side_allowed, side_by_side_groups
from lora_lab.memory.peaks import PEAK_DIR_ENV

__all__ = [
    "DEFAULT_RUNS_DIR",
    "NOTEBOOK_NAME",
    "RunnerError",
    "declared_parameters",
    "discover_notebooks",
    "parse_only",
    "parse_value",
    "plan_parameters",
    "run",
    "select_notebooks",
    "gpus_available",
    "skip_reason",
]

DEFAULT_RUNS_DIR = Path("build") / "runs"
KERNEL_NAME = "python3"
RUN_SUMMARY_NAME = "run_summary.json"
EXIT_INTERRUPTED = 130


class RunnerError(ValueError):
    """Bad selection or parameters: reported before any notebook runs."""


# --------------------------------------------------------------------------------------------
# Selecting notebooks and planning their parameters
# --------------------------------------------------------------------------------------------


def declared_parameters(path: Path) -> dict[str, Any]:
    """``{name: literal default}`` of the notebook's parameters cell (a RunnerError if it breaks the contract)."""
    try:
        return _declared_parameters(path)
    except NotebookError as error:
        raise RunnerError(str(error)) from None


def select_notebooks(notebooks: list[Path], only: list[str] | None) -> list[Path]:
    """Keep the notebooks named in ``only`` by number prefix (``03``, ``3``) or stem; None keeps all."""
    if only is None:
        return list(notebooks)
    if not only:
        raise RunnerError("--only names no notebook (give numbers or stems, e.g. --only 01,03)")
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
    """``"01,03"`` -> ``["01", "03"]``; None -> None (all); an empty selection is an error."""
    if text is None:
        return None
    items = [item for item in (part.strip() for part in text.split(",")) if item]
    if not items:
        raise RunnerError(f"--only {text!r} names no notebook (give numbers or stems, e.g. --only 01,03)")
    return items


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


@dataclass
class NotebookPlan:
    path: Path
    parameters: dict[str, Any]  # every declared parameter with its effective value (PROFILE: the profile)
    overrides: dict[str, Any]  # the ones given with -p that differ from the parameters cell


def plan_parameters(notebooks: list[Path], overrides: dict[str, Any], profile: str) -> dict[Path, NotebookPlan]:
    """Each notebook's parameters; raises RunnerError (all problems at once) before anything runs.

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
        misfits = [path for path in owners if not fits_default(value, declared[path][name])]
        for path in misfits:
            default = declared[path][name]
            problems.append(
                f"{path.stem}: parameter {name!r} defaults to {type(default).__name__} {default!r}; "
                f"got {type(value).__name__} {value!r}"
            )
        if owners and not misfits and (problem := parameter_problem(name, value)) is not None:
            problems.append(f"{problem} (declared by {', '.join(path.stem for path in owners)})")
    if problems:
        raise RunnerError("; ".join(problems) if len(problems) == 1 else "\n  - " + "\n  - ".join(problems))
    plans = {}
    for path, names in declared.items():
        given = {name: value for name, value in overrides.items() if name in names}
        effective = {**names, **given, "PROFILE": profile}
        changed = {name: value for name, value in given.items() if value != names[name]}
        plans[path] = NotebookPlan(path, effective, changed)
    return plans


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def gpus_available(profile: str) -> int:
    """GPUs a notebook may use on ``profile``: every CUDA device on a gpu profile, none on the cpu profile."""
    if base_profile(profile) != "gpu":
        return 0
    import torch

    return torch.cuda.device_count()


def skip_reason(path: Path, profile: str) -> str | None:
    """Why the notebook cannot run here (its gpu profile declares more GPUs than this machine has), or None.

    The marker concerns the gpu profile only: on the cpu profile every notebook runs its cpu path (a notebook
    that needs several GPUs there stands them in with gloo processes on the CPU)."""
    try:
        needed = required_gpus(path)
    except NotebookError as error:
        raise RunnerError(str(error)) from None
    if base_profile(profile) != "gpu":
        return None
    have = gpus_available(profile)
    if needed <= have:
        return None
    return (f"needs {needed} GPUs (notebook metadata lora_lab.gpus); profile {profile} here has {have}: "
            f"run it with --profile {profile} on a machine with {needed} or more")


@dataclass
class NotebookResult:
    notebook: str
    status: str  # "ok" | "failed" | "interrupted" | "skipped"
    seconds: float
    started: str
    finished: str
    parameters: dict[str, Any]
    overrides: dict[str, Any]
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


def profile_environment(profile: str) -> dict[str, str]:
    """What the notebook's kernel (and every process it starts) gets from ``profile``: a capped profile's
    ``$LORA_LAB_MEMORY_CAP_GIB``, read by ``import lora_lab`` (:mod:`lora_lab.memory.budget`), and a forced GPU
    class's ``$LORA_LAB_ARCH`` (:mod:`lora_lab.gpu_arch`). Either one already set in this process's environment must
    agree with the profile's (a RunnerError otherwise), so a run's folder always names what it forced."""
    from lora_lab import gpu_arch
    from lora_lab.memory.budget import MEMORY_CAP_ENV, memory_cap_gib

    chosen = get_profile(profile)
    if chosen.base != "gpu":
        return {}  # no GPU: nothing to cap or force
    cap = chosen.memory_cap_gib
    inherited = memory_cap_gib()
    if inherited is not None and inherited != cap:
        raise RunnerError(f"${MEMORY_CAP_ENV}={inherited:g} is set, but profile {profile!r} runs with "
                          f"{'no cap' if cap is None else f'a {cap:g} GiB cap'}: unset it, or pick the profile of "
                          "that cap (--profile gpu-24g, gpu-40g)")
    env = {} if cap is None else {MEMORY_CAP_ENV: f"{cap:g}"}
    try:
        forced = gpu_arch.arch_override()
    except ValueError as error:
        raise RunnerError(str(error)) from None
    wanted = gpu_arch.ARCH_CHOICES[chosen.arch] if chosen.arch else None
    if forced is not None and forced != wanted:
        path = "the device's own path" if wanted is None else f"the {chosen.arch} path"
        raise RunnerError(f"${gpu_arch.ARCH_ENV}={os.environ[gpu_arch.ARCH_ENV].strip()} is set, but profile "
                          f"{profile!r} takes {path}: unset it, or run the profile of that path (--profile gpu-sm80)")
    env[gpu_arch.ARCH_ENV] = chosen.arch or ""
    return env


def progress_disabled(explicit: bool | None = None) -> bool:
    if explicit is not None:
        return explicit
    return os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false", "no")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def inject_overrides(path: Path, overrides: dict[str, Any], executed_path: Path) -> Path:
    """Write ``path`` with papermill's ``injected-parameters`` cell for ``overrides`` to ``executed_path``; the
    runner then executes that file in place.

    Why not ``papermill.execute_notebook(parameters=...)``: given parameters, papermill first re-reads the
    parameters cell with a line parser that takes any line holding two ``=`` for an unparsable one, and so warns
    "Unable to parse line 2 'MODEL = ""  # "" = the profile's model ...'" (the ``=`` is in the comment) and, with
    ``-p MODEL ...``, "Passed unknown parameter: MODEL" — about names this runner has already checked against
    the cell with Python's own parser (:func:`plan_parameters`). The injected cell is papermill's, unchanged.
    """
    from papermill.iorw import load_notebook_node, write_ipynb
    from papermill.parameterize import parameterize_notebook

    notebook = parameterize_notebook(load_notebook_node(str(path)), dict(overrides), kernel_name=KERNEL_NAME,
                                     language="python")
    write_ipynb(notebook, str(executed_path))
    return executed_path


def check_cell_timeout(cell_timeout: Any) -> int | None:
    """``--cell-timeout`` as the whole number of seconds nbclient takes (its timeout is an integer), checked before
    anything runs; None: no limit."""
    if cell_timeout is None:
        return None
    whole = isinstance(cell_timeout, int) or isinstance(cell_timeout, float) and cell_timeout.is_integer()
    if isinstance(cell_timeout, bool) or not whole or not cell_timeout > 0:
        raise RunnerError(f"--cell-timeout must be a positive whole number of seconds (the notebook executor takes "
                          f"an integer); got {cell_timeout!r}")
    return int(cell_timeout)


def check_writable(directory: Path, option: str) -> None:
    """Create ``directory`` if needed and write a file into it, or raise RunnerError naming the folder (and the
    option that chose it), before anything runs."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-check-"):
            pass
    except OSError as error:
        where = Path(error.filename) if error.filename else directory
        raise RunnerError(f"cannot write into {directory} ({error.strerror or error} at {where}): give a writable "
                          f"folder with {option}") from None


def _set_aside(output_dir: Path, stem: str) -> Path:
    """Move an earlier completed result of ``stem`` to a hidden name that nothing grades or publishes (not
    ``*.metrics.json``), kept if this run fails; an earlier failed result is dropped. Returns the hidden path."""
    metrics_file, kept = metrics_path(output_dir, stem), output_dir / f".{stem}.metrics.previous.json"
    if metrics_file.is_file():
        try:
            completed = read_metrics(metrics_file).get("provenance", {}).get("status") == "completed"
        except (OSError, ValueError, AttributeError):
            completed = False
        if completed:
            os.replace(metrics_file, kept)
        else:
            metrics_file.unlink()
    return kept


def run_notebook(
    plan: NotebookPlan,
    profile: str,
    output_dir: Path,
    cell_timeout: float | None = None,
    show_cell_progress: bool = False,
) -> NotebookResult:
    import papermill

    path = plan.path
    stem = path.stem
    executed_path = output_dir / f"{stem}.ipynb"
    metrics_file = metrics_path(output_dir, stem)
    kept = _set_aside(output_dir, stem)  # stale results must not be graded, but a failing run must not lose them
    started_clock = time.monotonic()
    started = _now()
    context = {"notebook": stem, "profile": profile, "output_dir": str(output_dir), "notebook_path": str(path),
               "parameters": plan.parameters, "overrides": plan.overrides}
    peak_dir = output_dir / f".{stem}.peaks"  # each process of the run writes its GPU memory peak here at exit
    shutil.rmtree(peak_dir, ignore_errors=True)
    peak_dir.mkdir(parents=True)
    env = {RUN_CONTEXT_ENV: json.dumps(context), PEAK_DIR_ENV: str(peak_dir)}
    if profile == "cpu":
        env["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET") or "1"
    env.update(profile_environment(profile))
    # MPLBACKEND=Agg (set for headless CI) would keep every figure out of the executed notebook;
    # without it ipykernel uses the inline backend.
    unset = ("MPLBACKEND",) if os.environ.get("MPLBACKEND", "").lower() == "agg" else ()
    status, error_details = "ok", None
    try:
        source = inject_overrides(path, plan.overrides, executed_path) if plan.overrides else path
        papermill.execute_notebook(
            str(source),
            str(executed_path),
            parameters=None,  # injected above: papermill's own injection re-parses the parameters cell (see there)
            kernel_name=KERNEL_NAME,
            progress_bar={"leave": False, "position": 1, "desc": stem} if show_cell_progress else False,
            log_output=False,
            cwd=str(path.parent),
            execution_timeout=cell_timeout,
            kernel_manager_class=kernel_manager_with(env, unset, output_dir / f".{stem}.kernel.log"),
        )
    except KeyboardInterrupt:
        status = "interrupted"
        error_details = {"ename": "KeyboardInterrupt", "evalue": "interrupted (Ctrl-C) while running",
                         "cell_index": None, "exec_count": None, "cell_source_first_line": None}
    except Exception as error:  # noqa: BLE001 - any failure of one notebook is reported; the batch goes on
        error_details = failure_details(error, executed_path)
        # Ctrl-C reaches the kernel too: the cell running then ends in KeyboardInterrupt
        status = "interrupted" if error_details["ename"] == "KeyboardInterrupt" else "failed"
    finished = _now()
    warnings: list[str] = []
    if status == "interrupted":
        quiet_orphaned_kernel_tasks()
    if status == "ok" and metrics_file.is_file():
        kept.unlink(missing_ok=True)  # replaced by this run's result
    elif kept.is_file():
        warnings.append(f"the earlier completed result of {stem} is kept as {kept.name} (not graded)")
    if status != "ok":
        mark_run_ended(metrics_file, STATUS_INTERRUPTED if status == "interrupted" else STATUS_FAILED, error_details)
    elif not metrics_file.is_file():
        warnings.append(f"no {metrics_file.name}: the notebook never called lora_lab.lab.start_run({stem!r}, ...)")
    else:
        recorded = read_metrics(metrics_file).get("provenance", {}).get("status")
        if recorded != "completed":
            warnings.append(f"{metrics_file.name} has status {recorded!r}: "
                            "the notebook did not call lora_lab.lab.finish_run()")
    return NotebookResult(
        notebook=stem,
        status=status,
        seconds=round(time.monotonic() - started_clock, 2),
        started=started,
        finished=finished,
        parameters=plan.parameters,
        overrides=plan.overrides,
        executed_notebook=str(executed_path),
        metrics_file=str(metrics_file) if metrics_file.is_file() else None,
        error=error_details,
        warnings=warnings or None,
    )


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
    outputs_root: Path | str = DEFAULT_RUNS_DIR,
    cell_timeout: float | None = None,
    disable_progress: bool | None = None,
    stream=None,
    parallel: int = 1,
) -> int:
    """Run the selected notebooks; print a report; return 0 if all succeeded, 1 if one failed, 130 on Ctrl-C.

    ``parallel``: up to this many notebooks that time nothing side by side (:mod:`lora_lab.lab.side_by_side`; 1: one
    after another).
    Selection and parameter problems raise RunnerError before anything runs.
    """
    from tqdm.auto import tqdm

    stream = stream or sys.stdout
    if not isinstance(parallel, int) or parallel < 1:
        raise RunnerError(f"parallel must be a whole number of notebooks, 1 or more; got {parallel!r}")
    cell_timeout = check_cell_timeout(cell_timeout)
    resolved = resolve_profile(profile)
    try:
        notebooks = select_notebooks(discover_notebooks(notebooks_dir), only)
    except NotebookError as error:
        raise RunnerError(str(error)) from None
    if not notebooks:
        print(f"no NN_*.ipynb notebooks in {notebooks_dir}: nothing to run", file=stream)
        return 0
    plans = plan_parameters(notebooks, dict(overrides or {}), resolved)
    profile_environment(resolved)  # a conflicting cap is refused before anything runs
    skipped = {path: reason for path in notebooks if (reason := skip_reason(path, resolved)) is not None}
    output_dir = Path(outputs_root).resolve() / resolved
    check_writable(output_dir, "--outputs-dir")
    disabled = progress_disabled(disable_progress)
    print(f"running {len(notebooks)} notebook(s) on profile {resolved} into {output_dir}", file=stream)
    allowed = side_by_side_allowed(resolved, parallel)
    if allowed < parallel:
        print(f"one notebook at a time: side by side, each process could hold the "
              f"{get_profile(resolved).memory_cap_gib:g} GiB the card has", file=stream)
    parallel = allowed
    results: list[NotebookResult] = []
    bar = tqdm(total=len(notebooks), desc="notebooks", unit="nb", disable=disabled, file=sys.stderr)
    for group in side_by_side_groups(notebooks, parallel, alone=set(skipped)):
        if len(group) > 1:
            bar.set_postfix_str(" + ".join(path.stem[:2] for path in group))
            tqdm.write(f"side by side: {', '.join(path.stem for path in group)}", file=stream)
            group_results = run_side_by_side(run_notebook, [plans[path] for path in group], resolved, output_dir,
                                             cell_timeout)
            results.extend(group_results)
            update_run_summary(output_dir, resolved, results)
            bar.update(len(group))
            for result in group_results:
                if result.status == "failed":
                    tqdm.write(f"FAILED {result.notebook}.ipynb: {result.error_text()}", file=stream)
            stopped = [result.notebook for result in group_results if result.status == "interrupted"]
            if stopped:
                bar.close()
                quiet_orphaned_kernel_tasks()
                print(f"interrupted: {', '.join(stopped)} stopped and recorded as interrupted; the notebooks after "
                      f"them did not run", file=stream)
                return EXIT_INTERRUPTED
            continue
        (path,) = group
        bar.set_postfix_str(path.stem)
        if path in skipped:
            # a result from an earlier run elsewhere must not be graded as this run's
            metrics_path(output_dir, path.stem).unlink(missing_ok=True)
            now = _now()
            result = NotebookResult(path.stem, "skipped", 0.0, now, now, plans[path].parameters,
                                    plans[path].overrides, "", None, warnings=[skipped[path]])
            results.append(result)
            update_run_summary(output_dir, resolved, results)
            tqdm.write(f"SKIPPED {path.name}: {skipped[path]}", file=stream)
            bar.update(1)
            continue
        result = run_notebook(plans[path], resolved, output_dir, cell_timeout, show_cell_progress=not disabled)
        results.append(result)
        update_run_summary(output_dir, resolved, results)
        bar.update(1)
        if result.status == "failed":
            tqdm.write(f"FAILED {path.name}: {result.error_text()}", file=stream)
        if result.status == "interrupted":
            bar.close()
            print(f"interrupted: {path.name} stopped after {result.seconds:.0f} s and is recorded as interrupted; "
                  f"the notebooks after it did not run", file=stream)
            return EXIT_INTERRUPTED
    bar.close()
    summary_path = update_run_summary(output_dir, resolved, results)

    width = max(len(result.notebook) for result in results)
    print(f"\nrun summary (profile {resolved}):", file=stream)
    for result in results:
        line = f"  {result.notebook:<{width}}  {result.status.upper():<6}  {result.seconds:8.1f} s"
        if result.error:
            line += f"  {result.error_text()}"
        if result.overrides:
            line += "  (parameters overridden: " + ", ".join(f"{k}={v!r}" for k, v in result.overrides.items()) + ")"
        print(line, file=stream)
        for warning in result.warnings or []:
            print(f"  {'':<{width}}  warning: {warning}", file=stream)
    failed = [result for result in results if result.status == "failed"]
    passed = sum(result.status == "ok" for result in results)
    print(
        f"{passed} ok, {len(failed)} failed" + (f", {len(skipped)} skipped" if skipped else "") + "; "
        f"executed notebooks, metrics and {summary_path.name} in {output_dir}",
        file=stream,
    )
    return 1 if failed else 0

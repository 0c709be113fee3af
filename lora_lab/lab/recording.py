"""Recording what a notebook run measured, with enough provenance to tie it to the code that measured it.

A notebook calls, in this order::

    run = lora_lab.lab.start_run("05_fused_lora_kernels", PROFILE)   # profile, output folder, parameters
    lora_lab.lab.record("fwd_cosine_bf16", cosine)                   # or lora_lab.lab.record({"a": 1, "b": 2})
    lora_lab.lab.record("time_vs_base", summarize(samples))          # a repeated measurement: median + interval
    lora_lab.lab.finish_run()
    lora_lab.lab.show_verdicts()                                      # the predictions that answer its question

and the run lands in ``<output folder>/<notebook>.metrics.json``::

    {"notebook", "profile", "parameters", "metrics": {...}, "notes": {...},
     "provenance": {"device", "versions", "code_hash", "notebook_hash", "git_commit", "git_dirty",
                    "parameter_overrides", "runner", "started", "finished", "status"}}

**Where the run goes.** Under ``lora-lab run`` the runner hands the notebook one context (the environment
variable ``LORA_LAB_RUN``): its profile, its output folder and its parameters. Run any other way (Jupyter,
``papermill``, ``pytest --nbval``), results go to a scratch folder, ``<repo>/build/scratch/<profile>/`` (the
checkout around the current folder, else the one the package lives in: :func:`checkout`): the
committed ``outputs/`` only ever receive what ``lora-lab publish`` copies there after its checks.

**Parameters** are read from the notebook's own ``parameters`` cell (names) and the caller's namespace
(values), so a notebook never lists them twice; values that differ from the cell's literals are recorded as
``parameter_overrides`` and such a run is not graded against the registered predictions.

The file is rewritten atomically at every ``record`` so the values measured before a crash survive it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

from lora_lab.lab.notebooks import NotebookError, declared_parameters
from lora_lab.lab.profiles import PROFILES, base_profile, get_profile
from lora_lab.lab.provenance import cpu_name, find_repo_root, package_versions, provenance

PROFILE_CHOICES = ("auto",) + PROFILES
RUN_CONTEXT_ENV = "LORA_LAB_RUN"  # set by the runner for the notebook's kernel: JSON, see RunContext
SCRATCH_DIR = Path("build") / "scratch"

STATUS_RUNNING = "running"
STATUS_COMPLETED = "completed"
STATUS_FAILED = "failed"
STATUS_INTERRUPTED = "interrupted"
STATUSES = (STATUS_RUNNING, STATUS_COMPLETED, STATUS_FAILED, STATUS_INTERRUPTED)


# --------------------------------------------------------------------------------------------
# Profiles and where results go
# --------------------------------------------------------------------------------------------


def cuda_available() -> bool:
    """True iff torch sees a CUDA device (imports torch)."""
    import torch

    return bool(torch.cuda.is_available())


def resolve_profile(profile: str = "auto") -> str:
    """Map ``"auto"`` or a profile's name (:data:`PROFILES`: ``cpu``, ``gpu``, the capped ``gpu-24g``, ``gpu-40g``)
    to a profile's name.

    ``auto`` is ``gpu`` iff CUDA is available. Asking for a gpu profile without a CUDA device is an
    error rather than a silent fall back: the gpu profile's sizes do not fit a CPU run.
    """
    if not isinstance(profile, str):
        raise TypeError(f"profile must be a string, one of {PROFILE_CHOICES}; got {profile!r}")
    name = profile.strip().lower()
    if name not in PROFILE_CHOICES:
        raise ValueError(f"unknown profile {profile!r}: expected one of {', '.join(PROFILE_CHOICES)}")
    if name == "auto":
        return "gpu" if cuda_available() else "cpu"
    if base_profile(name) == "gpu" and not cuda_available():
        raise RuntimeError(f"profile {name!r} needs a CUDA device, and torch sees none (use 'cpu' or 'auto')")
    return name


def _package_dir() -> Path:
    """The folder of the imported ``lora_lab`` package."""
    return Path(__file__).resolve().parents[1]


def checkout() -> Path | None:
    """The checkout a run outside the runner belongs to: the one around the current directory (Jupyter starts the
    kernel in the notebook's folder), else the one the imported ``lora_lab`` package lives in (``papermill`` or a
    script started from another folder), else None."""
    return find_repo_root() or find_repo_root(_package_dir())


def scratch_dir(profile: str) -> Path:
    """Where a run outside the runner writes: ``<checkout>/build/scratch/<profile>`` (:func:`checkout`); with no
    checkout, a temporary folder named after the package's location, so two installations never share one."""
    root = checkout()
    if root is not None:
        return root / SCRATCH_DIR / profile
    tag = hashlib.sha256(str(_package_dir()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"lora_lab_scratch_{tag}" / profile


def metrics_path(output_directory: Path | str, notebook: str) -> Path:
    return Path(output_directory) / f"{notebook}.metrics.json"


def run_context() -> dict[str, Any] | None:
    """The runner's context for this process (``$LORA_LAB_RUN``), or None outside the runner."""
    text = os.environ.get(RUN_CONTEXT_ENV)
    if not text:
        return None
    try:
        context = json.loads(text)
    except ValueError:
        raise RuntimeError(f"${RUN_CONTEXT_ENV} is not JSON: {text[:200]!r}") from None
    missing = {"notebook", "profile", "output_dir", "parameters"} - set(context)
    if missing:
        raise RuntimeError(f"${RUN_CONTEXT_ENV} lacks {sorted(missing)}")
    return context


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def environment_report() -> dict[str, Any]:
    """Print and return python/torch/triton/transformers/peft versions and the device."""
    import platform

    import torch

    report: dict[str, Any] = dict(package_versions())
    report["cuda_available"] = bool(torch.cuda.is_available())
    if report["cuda_available"]:
        report["device"] = torch.cuda.get_device_name(torch.cuda.current_device())
        report["cuda"] = torch.version.cuda
        report["device_count"] = torch.cuda.device_count()
    else:
        report["device"] = cpu_name()
    report.update(arch_report())
    cap = get_memory_cap()
    if cap is not None:
        report["memory_cap_gib"] = cap
    report["platform"] = platform.platform()
    width = max(len(key) for key in report)
    for key, value in report.items():
        if isinstance(value, dict):  # the kernels' dispatch rule for this GPU class: one line per setting
            print(f"{key:<{width}} :")
            for name, choice in value.items():
                print(f"  {name:<{width + 14}} {choice}")
        else:
            print(f"{key:<{width}} : {value}")
    return report


def get_memory_cap() -> float | None:
    """The GPU memory cap this process runs under (GiB; ``$LORA_LAB_MEMORY_CAP_GIB``), or None."""
    from lora_lab.memory.budget import memory_cap_gib

    return memory_cap_gib()


def arch_report() -> dict[str, Any]:
    """The GPU class the kernels write for (after ``$LORA_LAB_ARCH``) and their generation-dependent rule
    (:func:`lora_lab.gpu_arch.dispatch_rule`), as provenance records and :func:`environment_report` prints them."""
    import torch

    from lora_lab import gpu_arch

    if not torch.cuda.is_available():
        return {"gpu_class": "cpu"}
    about = gpu_arch.describe()
    report: dict[str, Any] = {"gpu_class": about["gpu_class"], "compute_capability": about["device_capability"]}
    if about["arch_override"]:
        report["arch_override"] = (f"{gpu_arch.ARCH_ENV}={about['arch_override']} "
                                   f"(kernels write for {about['capability']})")
    report["dispatch"] = gpu_arch.dispatch_rule()
    return report


# --------------------------------------------------------------------------------------------
# Values: what may be recorded
# --------------------------------------------------------------------------------------------


class RecordingError(ValueError):
    """A value or key that cannot be recorded as JSON."""


def to_json_value(value: Any, key: str, notes: dict[str, str] | None = None) -> Any:
    """``value`` as plain JSON data, or a RecordingError naming ``key``.

    numpy / torch scalars become Python numbers, arrays and tensors become (nested) lists, tuples
    become lists. NaN and +-inf are not JSON: they are stored as null and ``notes[key]`` says so.
    """
    found_non_finite: list[str] = []

    def convert(item: Any, where: str) -> Any:
        if item is None or isinstance(item, (bool, str)):
            return item
        if isinstance(item, int):
            return int(item)
        if isinstance(item, float):
            if math.isfinite(item):
                return float(item)
            found_non_finite.append(f"{where}={item!r}")
            return None
        module = type(item).__module__.split(".")[0]
        if module in ("numpy", "torch"):
            if module == "torch" and hasattr(item, "detach"):
                item = item.detach().cpu()
            if hasattr(item, "tolist"):
                return convert(item.tolist(), where)
            if hasattr(item, "item"):
                return convert(item.item(), where)
        if isinstance(item, (list, tuple)):
            return [convert(element, f"{where}[{index}]") for index, element in enumerate(item)]
        if isinstance(item, dict):
            converted = {}
            for sub_key, sub_value in item.items():
                if not isinstance(sub_key, str):
                    raise RecordingError(
                        f"cannot record {key!r}: dict key {sub_key!r} at {where} is not a string"
                    )
                converted[sub_key] = convert(sub_value, f"{where}[{sub_key!r}]")
            return converted
        raise RecordingError(
            f"cannot record {key!r}: {where} is a {type(item).__module__}.{type(item).__qualname__}, "
            "which is not JSON-able (record numbers, strings, booleans, lists or dicts of them)"
        )

    converted = convert(value, key)
    if found_non_finite and notes is not None:
        notes[key] = "non-finite value(s) stored as null: " + ", ".join(found_non_finite[:5]) + (
            f" (+{len(found_non_finite) - 5} more)" if len(found_non_finite) > 5 else ""
        )
    return converted


def _check_key(key: Any) -> str:
    if not isinstance(key, str) or not key.strip():
        raise RecordingError(f"metric key must be a non-empty string; got {key!r}")
    return key


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def write_json_atomically(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` (mode 0644) so that readers see the old or the new file, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=2, allow_nan=False)
            handle.write("\n")
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


class Run:
    """One notebook run being recorded: what ``start_run`` returns.

    ``name``: the profile the run belongs to (its folder, its metrics file, its grading: ``gpu-24g``);
    ``profile``: that profile's shape set, ``cpu`` or ``gpu``, which the notebook's code asks for."""

    def __init__(self, notebook: str, profile: str, parameters: dict[str, Any], directory: Path,
                 overrides: dict[str, Any] | None = None, runner: bool = False, notebook_path: Path | None = None):
        from lora_lab.memory import budget

        self.notebook = notebook
        self.name = get_profile(profile).name
        self.profile = base_profile(profile)
        budget.clear_skipped()  # what an earlier run of this process skipped is not this run's
        self.directory = directory
        self.path = metrics_path(directory, notebook)
        self.notes: dict[str, str] = {}
        self.parameters = {
            name: to_json_value(value, f"parameter {name}", self.notes) for name, value in parameters.items()
        }
        self.metrics: dict[str, Any] = {}
        self.provenance: dict[str, Any] = {
            **provenance(profile, notebook_path),
            "parameter_overrides": {k: to_json_value(v, f"override {k}") for k, v in (overrides or {}).items()},
            "runner": runner,
            **self._machine_settings(),
            "started": _now(),
            "finished": None,
            "status": STATUS_RUNNING,
        }

    def _machine_settings(self) -> dict[str, Any]:
        """The profile's name, its GPU memory cap and the GPU class the kernels wrote for (``$LORA_LAB_ARCH``)."""
        from lora_lab.memory import budget

        settings: dict[str, Any] = {"profile": self.name}
        if self.profile != "gpu":
            return settings  # no GPU: nothing capped, no class forced
        cap = get_memory_cap()
        expected = get_profile(self.name).memory_cap_gib
        if expected is not None and cap is None:
            raise RuntimeError(f"profile {self.name!r} caps GPU memory at {expected:g} GiB through "
                               f"${budget.MEMORY_CAP_ENV}, which this process lacks: run it with lora-lab run "
                               f"--profile {self.name}, or start Jupyter / papermill with "
                               f"{budget.MEMORY_CAP_ENV}={expected:g}")
        if cap != expected:
            runs = "no GPU memory cap" if expected is None else f"a GPU memory cap of {expected:g} GiB"
            raise RuntimeError(f"profile {self.name!r} runs with {runs}, but this process has "
                               f"${budget.MEMORY_CAP_ENV}={cap:g}: unset it, or use the profile of that cap "
                               "(gpu-24g, gpu-40g)")
        if cap is not None:
            settings["memory_cap_gib"] = cap
        self._check_arch(get_profile(self.name).arch)
        arch = arch_report()
        settings["gpu_class"] = arch["gpu_class"]
        if "arch_override" in arch:
            settings["arch_override"] = arch["arch_override"]
        return settings

    def _check_arch(self, wanted: str | None) -> None:
        """``$LORA_LAB_ARCH`` must be what the profile forces (nothing, or ``gpu-sm80``'s sm80)."""
        from lora_lab import gpu_arch

        forced = gpu_arch.arch_override()
        if forced != (gpu_arch.ARCH_CHOICES[wanted] if wanted else None):
            shown = os.environ.get(gpu_arch.ARCH_ENV, "").strip() or "nothing"
            path = f"the {wanted} path" if wanted else "the device's own path"
            raise RuntimeError(f"profile {self.name!r} takes {path}, but ${gpu_arch.ARCH_ENV} is {shown}: run it with "
                               f"lora-lab run --profile {self.name}, or pick the profile of that path (gpu-sm80)")

    @property
    def device(self) -> str:
        """The torch device this profile computes on: ``"cuda"`` or ``"cpu"``."""
        return "cuda" if self.profile == "gpu" else "cpu"

    def as_dict(self) -> dict[str, Any]:
        payload = {
            "notebook": self.notebook,
            "profile": self.name,
            "parameters": self.parameters,
            "metrics": self.metrics,
            "notes": self.notes,
            "provenance": self.provenance,
        }
        from lora_lab.memory import budget

        skipped = budget.skipped_cells()
        if skipped:
            payload["skipped_cells"] = skipped
        return payload

    def save(self) -> Path:
        write_json_atomically(self.path, self.as_dict())
        return self.path

    def __repr__(self) -> str:
        return f"Run({self.notebook!r}, profile={self.name!r}, path={str(self.path)!r})"


_current: Run | None = None
_last_finished: Run | None = None


def _check_stem(notebook_stem: Any) -> str:
    if not isinstance(notebook_stem, str) or not notebook_stem or any(sep in notebook_stem for sep in "/\\"):
        raise ValueError(f"notebook_stem must be a file stem like '05_fused_lora_kernels'; got {notebook_stem!r}")
    if notebook_stem.endswith(".ipynb"):
        raise ValueError(f"notebook_stem is the name without '.ipynb'; got {notebook_stem!r}")
    return notebook_stem


def _parameters_from_notebook(notebook_path: Path | None, namespace: dict[str, Any] | None):
    """(values, overrides) of the notebook's declared parameters, read from ``namespace``."""
    if notebook_path is None or not notebook_path.is_file() or namespace is None:
        return {}, {}
    try:
        declared = declared_parameters(notebook_path)
    except NotebookError:
        return {}, {}
    values, overrides = {}, {}
    for name, default in declared.items():
        if name in namespace:
            values[name] = namespace[name]
            if name != "PROFILE" and namespace[name] != default:
                overrides[name] = namespace[name]
    return values, overrides


# Warnings a notebook's reader cannot act on, printed by libraries the notebooks import (matched by their text):
# tqdm's notice that ipywidgets is missing (a kernel without widgets; the bars print as text), and torch's notice that
# the first cuBLAS call of a backward pass found no CUDA context on autograd's thread and set the primary one.
READER_NOISE = ("IProgress not found", "Attempting to run cuBLAS, but there was no current CUDA context")


def quiet_reader_noise() -> None:
    """Ignore the warnings of :data:`READER_NOISE` for the rest of the process (every other warning still prints)."""
    for text in READER_NOISE:
        warnings.filterwarnings("ignore", message=f".*{text}")


def start_run(notebook_stem: str, profile: str = "auto", parameters: dict[str, Any] | None = None, *,
              namespace: dict[str, Any] | None = None, output_directory: Path | str | None = None) -> Run:
    """Begin recording for ``notebook_stem`` (e.g. ``"05_fused_lora_kernels"``); writes the file at once.

    Under ``lora-lab run`` the profile, output folder and parameters come from the runner (and ``profile`` must
    agree with it). Otherwise ``profile`` is resolved here, results go to :func:`scratch_dir` (or
    ``output_directory``), and the parameters are the names of the notebook's parameters cell with their
    values in ``namespace`` (default: the caller's globals, i.e. the notebook's). ``parameters`` gives them
    explicitly instead (scripts, tests). Starting again replaces the previous run of this process. The warnings
    of :data:`READER_NOISE` are ignored from here on (:func:`quiet_reader_noise`).
    """
    global _current
    _check_stem(notebook_stem)
    quiet_reader_noise()
    context = run_context()
    root = checkout()
    notebook_path = root / "notebooks" / f"{notebook_stem}.ipynb" if root is not None else None
    overrides: dict[str, Any] = {}
    if context is not None:
        if context["notebook"] != notebook_stem:
            raise ValueError(
                f"start_run({notebook_stem!r}) inside notebook {context['notebook']!r}: the stem must match the "
                "notebook's file name, or its metrics cannot be found"
            )
        asked = resolve_profile(profile) if profile != "auto" else context["profile"]
        if asked != context["profile"]:
            raise ValueError(f"start_run(profile={profile!r}) but the runner runs profile {context['profile']!r}")
        resolved, directory = context["profile"], Path(context["output_dir"])
        values = dict(context["parameters"])
        overrides = dict(context.get("overrides") or {})
        if context.get("notebook_path"):
            notebook_path = Path(context["notebook_path"])
    else:
        resolved = resolve_profile(profile)
        directory = Path(output_directory) if output_directory is not None else scratch_dir(resolved)
        if parameters is not None:
            values = dict(parameters)
        else:
            if namespace is None:
                namespace = sys._getframe(1).f_globals  # the notebook's namespace when called from a cell
            values, overrides = _parameters_from_notebook(notebook_path, namespace)
    run = Run(notebook_stem, resolved, values, directory.resolve(), overrides=overrides, runner=context is not None,
              notebook_path=notebook_path)
    run.save()
    _current = run
    return run


def _record_peaks(run: Run) -> None:
    """The run's largest GPU process into its provenance, said in one line: this process and, under ``lora-lab run``,
    every process the notebook started (each wrote its peak into ``$LORA_LAB_PEAK_DIR`` as it exited,
    :mod:`lora_lab.memory.peaks`)."""
    from lora_lab.memory import peaks

    folder = os.environ.get(peaks.PEAK_DIR_ENV, "").strip()
    found = [p for p in (peaks.collect(folder) if folder else []) if p["pid"] != os.getpid()]
    own = peaks.process_peak()
    gpu = peaks.summary(found + ([own] if own else []))
    if gpu is not None:
        run.provenance["gpu_memory"] = gpu
        print(f"GPU memory: the largest of this run's {gpu['processes']} GPU process(es) reserved "
              f"{gpu['largest_reserved_gib']:.2f} GiB ({gpu['largest_command']})")


def current_run() -> Run:
    if _current is None:
        raise RuntimeError("no run in progress: call lora_lab.lab.start_run(notebook_stem, PROFILE) first")
    return _current


_NO_VALUE = object()


def record(key: str | dict[str, Any], value: Any = _NO_VALUE, *, overwrite: bool = False) -> None:
    """Store one metric (``record("loss", 0.1)``) or several (``record({"a": 1, "b": 2})``).

    The metrics file is rewritten at once. Recording a key twice is an error (two cells measuring the same
    thing) unless ``overwrite=True``.
    """
    run = current_run()
    if isinstance(key, dict):
        if value is not _NO_VALUE:
            raise TypeError("record(dict) takes no second argument")
        items = list(key.items())
    else:
        if value is _NO_VALUE:
            raise TypeError(f"record({key!r}) needs a value: record(key, value) or record({{key: value}})")
        items = [(key, value)]
    notes: dict[str, str] = {}
    converted = {_check_key(name): to_json_value(item, name, notes) for name, item in items}
    again = sorted(name for name in converted if name in run.metrics)
    if again and not overwrite:
        raise RecordingError(f"metric(s) {', '.join(map(repr, again))} already recorded in this run; "
                             "pass overwrite=True to replace")
    for name in converted:
        run.notes.pop(name, None)
    run.metrics.update(converted)
    run.notes.update(notes)
    run.save()


def finish_run(status: str = STATUS_COMPLETED) -> Path:
    """Close the current run (status ``completed`` unless told otherwise) and return the metrics path."""
    global _current, _last_finished
    if status not in (STATUS_COMPLETED, STATUS_FAILED):
        raise ValueError(f"status must be {STATUS_COMPLETED!r} or {STATUS_FAILED!r}; got {status!r}")
    run = current_run()
    _record_peaks(run)
    run.provenance["finished"] = _now()
    run.provenance["status"] = status
    path = run.save()
    _current, _last_finished = None, run
    return path


def last_run() -> Run:
    """The run in progress, else the one finished last in this process."""
    run = _current or _last_finished
    if run is None:
        raise RuntimeError("no run in this process: call lora_lab.lab.start_run(...) first")
    return run


def output_dir(profile: str | None = None) -> Path:
    """Where the current run saves plots and tables (created if missing).

    Without a run in progress: the scratch folder a run on ``profile`` (default ``auto``) would use.
    """
    if _current is not None and profile in (None, _current.profile, _current.name):
        directory = _current.directory
    else:
        directory = scratch_dir(resolve_profile(profile or "auto"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def read_metrics(path: Path | str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def mark_run_ended(path: Path | str, status: str, error: dict[str, Any] | None = None) -> bool:
    """Mark a metrics file whose notebook failed or was interrupted; keep what it recorded.

    Returns False if there is no such file (the notebook stopped before ``start_run``).
    """
    if status not in (STATUS_FAILED, STATUS_INTERRUPTED):
        raise ValueError(f"status must be {STATUS_FAILED!r} or {STATUS_INTERRUPTED!r}; got {status!r}")
    path = Path(path)
    if not path.is_file():
        return False
    payload = read_metrics(path)
    prov = payload.setdefault("provenance", {})
    prov["status"] = status
    prov["finished"] = prov.get("finished") or _now()
    if error is not None:
        prov["error"] = error
    write_json_atomically(path, payload)
    return True


__all__ = [
    "PROFILES",
    "Run",
    "RecordingError",
    "current_run",
    "environment_report",
    "finish_run",
    "last_run",
    "mark_run_ended",
    "output_dir",
    "read_metrics",
    "record",
    "resolve_profile",
    "run_context",
    "scratch_dir",
    "start_run",
]

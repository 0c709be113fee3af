"""Recording what a notebook run measured, with enough provenance to trust it later.

A notebook calls, in this order::

    profile = lora_lab.resolve_profile(PROFILE)          # "auto" -> "gpu" iff CUDA is present
    lora_lab.start_run("05_fused_lora_kernels", profile=profile, parameters={...})
    lora_lab.record("fwd_cosine_bf16", cosine)           # or lora_lab.record({"a": 1, "b": 2})
    lora_lab.finish_run()

and the run lands in ``<output dir>/<notebook>.metrics.json``::

    {"notebook", "profile", "parameters", "metrics": {...}, "notes": {...},
     "provenance": {"device", "versions", "git_commit", "git_dirty", "started", "finished", "status"}}

The file is rewritten (atomically: temp file + rename) at every ``record`` so that the values
measured before a crash survive it. The output directory is ``$LORA_LAB_OUTPUT_DIR`` when set
(the batch runner sets it), else ``<repo>/outputs/<profile>/``.

Nothing here imports torch unless it has to (``resolve_profile("auto")``, a gpu device name,
``environment_report``), so recording stays cheap in small notebooks and tests.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

PROFILES = ("cpu", "gpu")
PROFILE_CHOICES = ("auto",) + PROFILES
OUTPUT_DIR_ENV = "LORA_LAB_OUTPUT_DIR"
NOTEBOOK_ENV = "LORA_LAB_NOTEBOOK"  # set by the runner: the stem of the notebook it executes
VERSIONED_PACKAGES = ("torch", "triton", "transformers", "peft")

STATUS_RUNNING = "running"
STATUS_COMPLETED = "completed"
STATUS_FAILED = "failed"


# --------------------------------------------------------------------------------------------
# Profiles and where results go
# --------------------------------------------------------------------------------------------


def cuda_available() -> bool:
    """True iff torch sees a CUDA device (imports torch)."""
    import torch

    return bool(torch.cuda.is_available())


def resolve_profile(profile: str = "auto") -> str:
    """Map ``"auto" | "cpu" | "gpu"`` to ``"cpu"`` or ``"gpu"``.

    ``auto`` is ``gpu`` iff CUDA is available. Asking for ``gpu`` without a CUDA device is an
    error rather than a silent fall back: the gpu profile's sizes do not fit a CPU run.
    """
    if not isinstance(profile, str):
        raise TypeError(f"profile must be a string, one of {PROFILE_CHOICES}; got {profile!r}")
    name = profile.strip().lower()
    if name not in PROFILE_CHOICES:
        raise ValueError(f"unknown profile {profile!r}: expected one of {', '.join(PROFILE_CHOICES)}")
    if name == "auto":
        return "gpu" if cuda_available() else "cpu"
    if name == "gpu" and not cuda_available():
        raise RuntimeError("profile 'gpu' needs a CUDA device, and torch sees none (use 'cpu' or 'auto')")
    return name


def find_repo_root(start: Path | None = None) -> Path | None:
    """The nearest directory at or above ``start`` (default: cwd) holding pyproject.toml and lora_lab/."""
    here = Path(start or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        if (candidate / "pyproject.toml").is_file() and (candidate / "lora_lab").is_dir():
            return candidate
    return None


def default_output_dir(profile: str) -> Path:
    """``$LORA_LAB_OUTPUT_DIR`` if set, else ``<repo>/outputs/<profile>`` (fallback ``cwd/outputs/<profile>``)."""
    from_env = os.environ.get(OUTPUT_DIR_ENV)
    if from_env:
        return Path(from_env).expanduser().resolve()
    root = find_repo_root() or Path.cwd().resolve()
    return root / "outputs" / profile


def metrics_path(output_directory: Path | str, notebook: str) -> Path:
    return Path(output_directory) / f"{notebook}.metrics.json"


# --------------------------------------------------------------------------------------------
# Provenance
# --------------------------------------------------------------------------------------------


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def package_versions() -> dict[str, str | None]:
    """Installed versions of python and the packages results depend on (None if absent)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cpu_name() -> str:
    """The CPU model as the OS names it, with the number of cores torch/numpy may use."""
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.lower().startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    return f"{model} ({os.cpu_count()} cores)"


def device_name(profile: str) -> str:
    if profile == "gpu":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(torch.cuda.current_device())
        return "no CUDA device"
    return cpu_name()


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state(start: Path | None = None) -> dict[str, Any]:
    """``{"git_commit": sha or None, "git_dirty": bool or None}`` of the repo around ``start`` (default:
    cwd), else of the repo holding this package (the code that produced the results)."""
    root = find_repo_root(start) or find_repo_root(Path(__file__).parent) or Path(start or Path.cwd())
    commit = _git(["rev-parse", "HEAD"], root)
    if commit is None:
        return {"git_commit": None, "git_dirty": None}
    porcelain = _git(["status", "--porcelain", "--untracked-files=no"], root)
    return {"git_commit": commit, "git_dirty": bool(porcelain) if porcelain is not None else None}


def environment_report() -> dict[str, Any]:
    """Print and return python/torch/triton/transformers/peft versions and the device."""
    import torch

    report: dict[str, Any] = dict(package_versions())
    report["cuda_available"] = bool(torch.cuda.is_available())
    if report["cuda_available"]:
        report["device"] = torch.cuda.get_device_name(torch.cuda.current_device())
        report["cuda"] = torch.version.cuda
        report["device_count"] = torch.cuda.device_count()
    else:
        report["device"] = cpu_name()
    report["platform"] = platform.platform()
    width = max(len(key) for key in report)
    for key, value in report.items():
        print(f"{key:<{width}} : {value}")
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
    """Write ``payload`` to ``path`` so that readers see the old or the new file, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=2, allow_nan=False)
            handle.write("\n")
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


class Run:
    """One notebook run being recorded: what ``start_run`` returns."""

    def __init__(self, notebook: str, profile: str, parameters: dict[str, Any], directory: Path):
        self.notebook = notebook
        self.profile = profile
        self.directory = directory
        self.path = metrics_path(directory, notebook)
        self.notes: dict[str, str] = {}
        self.parameters = {
            name: to_json_value(value, f"parameter {name}", self.notes) for name, value in parameters.items()
        }
        self.metrics: dict[str, Any] = {}
        self.provenance: dict[str, Any] = {
            "device": device_name(profile),
            "versions": package_versions(),
            **git_state(),
            "started": _now(),
            "finished": None,
            "status": STATUS_RUNNING,
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "notebook": self.notebook,
            "profile": self.profile,
            "parameters": self.parameters,
            "metrics": self.metrics,
            "notes": self.notes,
            "provenance": self.provenance,
        }

    def save(self) -> Path:
        write_json_atomically(self.path, self.as_dict())
        return self.path

    def __repr__(self) -> str:
        return f"Run({self.notebook!r}, profile={self.profile!r}, path={str(self.path)!r})"


_current: Run | None = None


def start_run(notebook_stem: str, profile: str = "auto", parameters: dict[str, Any] | None = None) -> Run:
    """Begin recording for ``notebook_stem`` (e.g. ``"05_fused_lora_kernels"``); writes the file at once.

    Starting again replaces the previous run of this process (re-running a notebook top to bottom).
    """
    global _current
    if not isinstance(notebook_stem, str) or not notebook_stem or any(sep in notebook_stem for sep in "/\\"):
        raise ValueError(f"notebook_stem must be a file stem like '05_fused_lora_kernels'; got {notebook_stem!r}")
    if notebook_stem.endswith(".ipynb"):
        raise ValueError(f"notebook_stem is the name without '.ipynb'; got {notebook_stem!r}")
    expected = os.environ.get(NOTEBOOK_ENV)
    if expected and expected != notebook_stem:
        raise ValueError(
            f"start_run({notebook_stem!r}) inside notebook {expected!r}: the stem must match the "
            "notebook's file name, or its metrics cannot be found"
        )
    parameters = dict(parameters or {})
    resolved = resolve_profile(profile)
    run = Run(notebook_stem, resolved, parameters, default_output_dir(resolved))
    run.save()
    _current = run
    return run


def current_run() -> Run:
    if _current is None:
        raise RuntimeError("no run in progress: call lora_lab.start_run(notebook_stem, profile=...) first")
    return _current


_NO_VALUE = object()


def record(key: str | dict[str, Any], value: Any = _NO_VALUE) -> None:
    """Store one metric (``record("loss", 0.1)``) or several (``record({"a": 1, "b": 2})``).

    The metrics file is rewritten at once. Recording a key again replaces its value.
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
    for name in converted:
        run.notes.pop(name, None)
    run.metrics.update(converted)
    run.notes.update(notes)
    run.save()


def finish_run(status: str = STATUS_COMPLETED) -> Path:
    """Close the current run (status ``completed`` unless told otherwise) and return the metrics path."""
    global _current
    if status not in (STATUS_COMPLETED, STATUS_FAILED):
        raise ValueError(f"status must be {STATUS_COMPLETED!r} or {STATUS_FAILED!r}; got {status!r}")
    run = current_run()
    run.provenance["finished"] = _now()
    run.provenance["status"] = status
    path = run.save()
    _current = None
    return path


def output_dir(profile: str | None = None) -> Path:
    """Where the current run saves plots and tables (created if missing).

    Without a run in progress: the directory a run on ``profile`` (default ``auto``) would use.
    """
    if _current is not None and profile in (None, _current.profile):
        directory = _current.directory
    else:
        directory = default_output_dir(resolve_profile(profile or "auto"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def read_metrics(path: Path | str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def mark_run_failed(path: Path | str, error: dict[str, Any]) -> bool:
    """Mark a metrics file written by a notebook that later failed; keep what it recorded.

    Returns False if there is no such file (the notebook failed before ``start_run``).
    """
    path = Path(path)
    if not path.is_file():
        return False
    payload = read_metrics(path)
    provenance = payload.setdefault("provenance", {})
    provenance["status"] = STATUS_FAILED
    provenance["finished"] = provenance.get("finished") or _now()
    provenance["error"] = error
    write_json_atomically(path, payload)
    return True


__all__ = [
    "PROFILES",
    "Run",
    "RecordingError",
    "current_run",
    "environment_report",
    "finish_run",
    "mark_run_failed",
    "output_dir",
    "read_metrics",
    "record",
    "resolve_profile",
    "start_run",
]

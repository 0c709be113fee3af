"""lora_lab.lab.recording: profiles, where runs go, the metrics file, value conversion, provenance."""
import json
import math

import numpy as np
import pytest
import torch

from lora_lab import lab
from lora_lab.lab import recording
from lora_lab.lab.recording import RecordingError


@pytest.fixture
def out_dir(tmp_path, monkeypatch):
    """A fresh scratch directory, no runner context and no run left over from another test."""
    directory = tmp_path / "out"
    monkeypatch.setattr(recording, "scratch_dir", lambda profile: directory)
    monkeypatch.delenv(recording.RUN_CONTEXT_ENV, raising=False)
    monkeypatch.setattr(recording, "_current", None)
    return directory


def read(directory, stem="01_demo"):
    return json.loads((directory / f"{stem}.metrics.json").read_text())


def test_public_names_are_exported_by_the_lab_package():
    for name in ("resolve_profile", "start_run", "record", "finish_run", "output_dir", "environment_report"):
        assert getattr(lab, name) is getattr(recording, name)


def test_resolve_profile():
    assert recording.resolve_profile("cpu") == "cpu"
    assert recording.resolve_profile(" CPU ") == "cpu"
    assert recording.resolve_profile("auto") == ("gpu" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="unknown profile 'tpu'.*auto, cpu, gpu"):
        recording.resolve_profile("tpu")
    with pytest.raises(TypeError):
        recording.resolve_profile(None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_gpu_profile_without_cuda_is_an_error():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        recording.resolve_profile("gpu")


def test_run_writes_metrics_at_every_record_and_finishes(out_dir):
    run = lab.start_run("01_demo", profile="cpu", parameters={"SEQ": np.int64(8), "NAME": "x"})
    payload = read(out_dir)
    assert run.path == out_dir / "01_demo.metrics.json"
    assert payload["notebook"] == "01_demo" and payload["profile"] == "cpu"
    assert payload["parameters"] == {"SEQ": 8, "NAME": "x"}
    assert payload["metrics"] == {}
    provenance = payload["provenance"]
    assert provenance["status"] == "running" and provenance["finished"] is None
    assert set(provenance["versions"]) == {"python", "torch", "triton", "transformers", "peft"}
    assert provenance["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert provenance["device"] and provenance["started"]
    assert "git_commit" in provenance

    lab.record("loss", 0.25)
    assert read(out_dir)["metrics"] == {"loss": 0.25}  # partial results survive a later crash
    lab.record({"steps": 3, "ok": True})
    with pytest.raises(RecordingError, match="'loss' already recorded"):
        lab.record("loss", 0.5)  # two cells measuring the same thing is a mistake...
    lab.record("loss", 0.125, overwrite=True)  # ...unless said so
    path = lab.finish_run()
    assert (path.stat().st_mode & 0o777) == 0o644  # readable by others, not 0600 like a temp file
    payload = read(out_dir)
    assert payload["metrics"] == {"loss": 0.125, "steps": 3, "ok": True}
    assert payload["provenance"]["status"] == "completed" and payload["provenance"]["finished"]
    assert path == run.path
    assert sorted(item.name for item in out_dir.iterdir()) == ["01_demo.metrics.json"]  # no temp files left


def test_numpy_and_torch_values_become_python(out_dir):
    lab.start_run("01_demo", profile="cpu")
    lab.record(
        {
            "np_float": np.float32(0.5),
            "np_int": np.int16(7),
            "np_bool": np.bool_(True),
            "np_array": np.array([[1, 2], [3, 4]]),
            "torch_scalar": torch.tensor(2.5, requires_grad=True) * 2,
            "torch_half": torch.tensor([1.0, 2.0], dtype=torch.float16),
            "tuple": (1, "a"),
            "nested": {"a": [np.float64(1.5)]},
        }
    )
    metrics = read(out_dir)["metrics"]
    assert metrics == {
        "np_float": 0.5,
        "np_int": 7,
        "np_bool": True,
        "np_array": [[1, 2], [3, 4]],
        "torch_scalar": 5.0,
        "torch_half": [1.0, 2.0],
        "tuple": [1, "a"],
        "nested": {"a": [1.5]},
    }
    assert type(metrics["np_int"]) is int and type(metrics["np_bool"]) is bool


def test_nan_and_inf_are_stored_as_null_with_a_note(out_dir):
    lab.start_run("01_demo", profile="cpu")
    lab.record("loss", float("nan"))
    lab.record("curve", [1.0, math.inf, torch.tensor(float("nan"))])
    payload = read(out_dir)
    assert payload["metrics"] == {"loss": None, "curve": [1.0, None, None]}
    assert "nan" in payload["notes"]["loss"]
    assert "curve[1]=inf" in payload["notes"]["curve"]
    lab.record("loss", 1.0, overwrite=True)  # a finite value clears the note
    assert "loss" not in read(out_dir)["notes"]


def test_values_that_are_not_json_are_rejected_naming_the_key(out_dir):
    lab.start_run("01_demo", profile="cpu")
    lab.record("kept", 1)
    with pytest.raises(RecordingError, match=r"cannot record 'model'.*builtins.object"):
        lab.record("model", object())
    with pytest.raises(RecordingError, match=r"cannot record 'table'.*dict key 3"):
        lab.record("table", {3: "x"})
    with pytest.raises(RecordingError, match=r"cannot record 'b': b\[1\] is a builtins.set"):
        lab.record({"a": 1, "b": [1, {2}]})
    with pytest.raises(RecordingError, match="non-empty string"):
        lab.record("", 1)
    with pytest.raises(TypeError, match="needs a value"):
        lab.record("forgot")
    assert read(out_dir)["metrics"] == {"kept": 1}  # a rejected dict stores nothing


def test_record_before_start_and_finish_twice_are_errors(out_dir):
    with pytest.raises(RuntimeError, match="start_run"):
        lab.record("x", 1)
    lab.start_run("01_demo", profile="cpu")
    lab.finish_run()
    with pytest.raises(RuntimeError, match="no run in progress"):
        lab.finish_run()


def test_start_run_checks_the_stem(out_dir, monkeypatch):
    with pytest.raises(ValueError, match="without '.ipynb'"):
        lab.start_run("01_demo.ipynb", profile="cpu")
    with pytest.raises(ValueError, match="file stem"):
        lab.start_run("notebooks/01_demo", profile="cpu")
    context = {"notebook": "02_other", "profile": "cpu", "output_dir": str(out_dir), "parameters": {}}
    monkeypatch.setenv(recording.RUN_CONTEXT_ENV, json.dumps(context))
    with pytest.raises(ValueError, match="inside notebook '02_other'"):
        lab.start_run("01_demo", profile="cpu")
    run = lab.start_run("02_other")  # the runner's profile, folder and parameters
    assert (run.profile, run.directory, run.provenance["runner"]) == ("cpu", out_dir.resolve(), True)


@pytest.fixture
def bare_repo(tmp_path, monkeypatch):
    """An empty checkout (pyproject.toml, lora_lab/, notebooks/), no runner context, no run left over."""
    monkeypatch.setattr(recording, "_current", None)
    monkeypatch.delenv(recording.RUN_CONTEXT_ENV, raising=False)
    repo = tmp_path / "repo"
    (repo / "lora_lab").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("")
    (repo / "notebooks").mkdir()
    return repo


def test_parameters_come_from_the_parameters_cell_and_overrides_are_marked(bare_repo, monkeypatch):
    import nbformat

    repo = bare_repo
    cell = nbformat.v4.new_code_cell('PROFILE = "auto"\nR = 8  # rank\nNAME = "x"')
    cell.metadata["tags"] = ["parameters"]
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), str(repo / "notebooks" / "01_demo.ipynb"))
    monkeypatch.chdir(repo / "notebooks")
    run = lab.start_run("01_demo", "cpu", namespace={"PROFILE": "auto", "R": 8, "NAME": "x", "other": 1})
    assert run.parameters == {"PROFILE": "auto", "R": 8, "NAME": "x"} and run.provenance["parameter_overrides"] == {}
    assert run.directory == repo.resolve() / "build" / "scratch" / "cpu"  # never the committed outputs/
    run = lab.start_run("01_demo", "cpu", namespace={"PROFILE": "auto", "R": 4, "NAME": "x"})
    assert run.provenance["parameter_overrides"] == {"R": 4}
    assert len(run.provenance["notebook_hash"]) == 64
    lab.finish_run()


def test_output_dir_is_scratch_outside_the_runner(bare_repo, tmp_path, monkeypatch):
    repo = bare_repo
    monkeypatch.chdir(repo / "notebooks")
    assert lab.output_dir("cpu") == repo.resolve() / "build" / "scratch" / "cpu"
    run = lab.start_run("01_demo", profile="cpu", parameters={})
    assert run.path == repo.resolve() / "build" / "scratch" / "cpu" / "01_demo.metrics.json"
    assert lab.output_dir() == run.directory
    lab.finish_run()
    assert not (repo / "outputs").exists()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert not str(lab.output_dir("cpu")).startswith(str(elsewhere))  # the package's checkout, not cwd


def test_a_run_started_outside_the_checkout_records_its_overrides_in_the_packages_checkout(bare_repo, tmp_path,
                                                                                          monkeypatch):
    """papermill started from another folder: the kernel's cwd holds no checkout, so the package's checkout gives
    the parameters cell (the override is recorded, the run voided) and the scratch folder (never one shared)."""
    import nbformat

    repo = bare_repo
    cell = nbformat.v4.new_code_cell('PROFILE = "auto"\nR = 8')
    cell.metadata["tags"] = ["parameters"]
    nbformat.write(nbformat.v4.new_notebook(cells=[cell]), str(repo / "notebooks" / "01_demo.ipynb"))
    monkeypatch.setattr(recording, "_package_dir", lambda: repo / "lora_lab")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    run = lab.start_run("01_demo", "cpu", namespace={"PROFILE": "auto", "R": 4})
    assert run.parameters == {"PROFILE": "auto", "R": 4} and run.provenance["parameter_overrides"] == {"R": 4}
    assert run.directory == repo.resolve() / "build" / "scratch" / "cpu"
    lab.finish_run()


def test_without_any_checkout_the_scratch_folder_is_the_installations_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(recording, "_package_dir", lambda: tmp_path / "site-packages" / "lora_lab")
    one = recording.scratch_dir("cpu")
    monkeypatch.setattr(recording, "_package_dir", lambda: tmp_path / "other-venv" / "lora_lab")
    assert one.name == "cpu" and one != recording.scratch_dir("cpu")


def test_mark_run_ended_keeps_what_was_recorded(out_dir):
    lab.start_run("01_demo", profile="cpu")
    lab.record("before", 1.0)
    error = {"cell_index": 4, "ename": "ValueError", "evalue": "boom"}
    assert recording.mark_run_ended(out_dir / "01_demo.metrics.json", "failed", error)
    payload = read(out_dir)
    assert payload["metrics"] == {"before": 1.0}
    assert payload["provenance"]["status"] == "failed" and payload["provenance"]["error"] == error
    assert recording.mark_run_ended(out_dir / "01_demo.metrics.json", "interrupted")
    assert read(out_dir)["provenance"]["status"] == "interrupted"
    assert not recording.mark_run_ended(out_dir / "missing.metrics.json", "failed", error)


def test_environment_report_prints_versions_and_device(capsys):
    report = lab.environment_report()
    printed = capsys.readouterr().out
    for key in ("python", "torch", "triton", "transformers", "peft", "device"):
        assert key in report
        assert key in printed
    assert report["torch"] and str(report["device"]) in printed
    assert report["cuda_available"] == torch.cuda.is_available()


def test_a_run_ignores_the_warnings_a_reader_cannot_act_on_and_no_other(out_dir):
    """tqdm's missing-ipywidgets notice and torch's no-CUDA-context notice stay out of a notebook's output once its
    run starts; any other warning, of the same categories too, still prints."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lab.start_run("01_demo", profile="cpu", parameters={})
        warnings.warn("IProgress not found. Please update jupyter and ipywidgets.", RuntimeWarning, stacklevel=1)
        warnings.warn("Attempting to run cuBLAS, but there was no current CUDA context! Attempting to set the primary "
                      "context...", UserWarning, stacklevel=1)
        warnings.warn("something the reader should see", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something the reader should see"]

"""The `lora-lab` command itself: its version, and where it looks for the repository."""
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import lora_lab
from lora_lab.lab.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_version_prints_the_package_version(capsys):
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert lora_lab.__version__ == declared  # the version the package reports is the one it is built with
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"lora-lab {declared}"


def test_version_from_the_command_line():
    done = subprocess.run([sys.executable, "-m", "lora_lab", "--version"], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0 and done.stdout.strip() == f"lora-lab {lora_lab.__version__}", done.stderr


def lora_lab_command(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lora_lab", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, check=False)


def test_validate_and_grade_from_outside_the_repository_read_the_packages_checkout(tmp_path):
    """Run from an unrelated directory, they once looked for predictions/predictions.yaml under it."""
    done = lora_lab_command("validate", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(str(ROOT / "predictions" / "predictions.yaml") + ": ")
    done = lora_lab_command("grade", "--profile", "cpu", "--no-write", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "profile cpu:" in done.stdout and not (tmp_path / "outputs").exists()


def test_without_a_repository_the_error_says_so(tmp_path, monkeypatch, capsys):
    from lora_lab.lab import predictions

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(predictions, "_package_dir", lambda: tmp_path / "site-packages" / "lora_lab")
    for argv in (["validate"], ["grade", "--profile", "cpu"], ["check-prose"], ["verify"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: no lora_lab repository found") and str(tmp_path.resolve()) in err, err
    with pytest.raises(predictions.RepositoryNotFound, match="run inside a clone"):
        predictions.default_predictions_path()


def test_repository_root_prefers_the_given_path_then_the_package(tmp_path, monkeypatch):
    from lora_lab.lab.predictions import repository_root

    other = tmp_path / "other"
    (other / "lora_lab").mkdir(parents=True)
    (other / "pyproject.toml").write_text("")
    (other / "notebooks").mkdir()
    monkeypatch.chdir(other / "notebooks")
    assert repository_root(other / "notebooks" / "01_x.ipynb") == other.resolve()
    assert repository_root() == ROOT  # the code that runs reads its own checkout
    monkeypatch.setattr("lora_lab.lab.predictions._package_dir", lambda: tmp_path / "site-packages" / "lora_lab")
    assert repository_root() == other.resolve()  # an installed package run inside a clone


def test_a_notebooks_verdicts_outside_the_repository_use_the_packages_predictions(tmp_path, monkeypatch):
    import json

    from lora_lab.lab import recording
    from lora_lab.lab.verdicts import notebook_verdicts

    monkeypatch.setattr(recording, "_current", None)
    monkeypatch.chdir(tmp_path)  # e.g. papermill started from another folder
    metrics = tmp_path / "01_build_lora_layer.metrics.json"
    metrics.write_text(json.dumps({"notebook": "01_build_lora_layer", "profile": "cpu", "parameters": {},
                                   "metrics": {}, "notes": {}, "provenance": {"status": "completed"}}))
    rows, _ = notebook_verdicts("01_build_lora_layer", "cpu", metrics)
    assert rows and all(row.notebook == "01_build_lora_layer" for row in rows)


def test_grade_refuses_a_folder_without_metrics_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "cpu").mkdir()
    for extra in ([], ["--no-write"]):
        assert main(["grade", "--profile", "cpu", "--outputs-dir", str(tmp_path), *extra]) == 2
        err = capsys.readouterr().err
        assert f"error: no *.metrics.json in {tmp_path / 'cpu'}: nothing to grade" in err
    assert list((tmp_path / "cpu").iterdir()) == []


def _unwritable(tmp_path):
    """A folder no one can write into, root included: a path below a plain file."""
    (tmp_path / "a_file").write_text("")
    return tmp_path / "a_file" / "runs"


def test_run_into_an_unwritable_folder_names_it_before_anything_runs(tmp_path, capsys):
    fixtures = Path(__file__).parent / "fixtures" / "notebooks"
    runs = _unwritable(tmp_path)
    code = main(["run", "--profile", "cpu", "--notebooks-dir", str(fixtures), "--outputs-dir", str(runs),
                 "--only", "01"])
    err = capsys.readouterr().err
    assert code == 2 and f"error: cannot write into {runs / 'cpu'} (" in err and "--outputs-dir" in err, err
    assert "Traceback" not in err and "nothing was run" in err


def test_grade_into_an_unwritable_folder_names_it(tmp_path, monkeypatch, capsys):
    import tempfile

    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "01_records_metrics.metrics.json").write_text("{}")

    def refuse(*args, **kwargs):  # a read-only folder (chmod does not stop root, who may run the tests)
        raise PermissionError(13, "Permission denied", str(tmp_path / "cpu"))

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refuse)
    assert main(["grade", "--profile", "cpu", "--outputs-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot write into {tmp_path / 'cpu'} (Permission denied" in err and "--no-write" in err, err
    assert list((tmp_path / "cpu").iterdir()) == [tmp_path / "cpu" / "01_records_metrics.metrics.json"]


@pytest.mark.parametrize("config, says", [("{bad", "--config: '{bad' is not valid JSON"),
                                          ("[1]", "--config must be a JSON object, got list"),
                                          ("@/no/such/file.json", "--config @/no/such/file.json: cannot read")])
def test_launch_names_a_bad_config(config, says, capsys):
    assert main(["launch", "lora_lab.distributed.jobs:train_lora", "--config", config]) == 2
    assert f"error: {says}" in capsys.readouterr().err

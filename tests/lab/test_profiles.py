"""The capped gpu profiles (gpu-24g, gpu-40g): resolution, the runner's environment, provenance, and grading of
predictions registered for gpu, with a skipped cell named in the void."""
import json
from pathlib import Path

import pytest

from lora_lab import gpu_arch
from lora_lab.lab import recording, runner
from lora_lab.lab.grading import grade_predictions
from lora_lab.lab.notebooks import parameter_problem
from lora_lab.lab.predictions import load_predictions
from lora_lab.lab.profiles import PROFILES, base_profile, get_profile, profile_applies
from lora_lab.lab.rules import skipped_cell_of
from lora_lab.memory import budget

FIXTURES = Path(__file__).parent / "fixtures"
CAPPED = FIXTURES / "predictions" / "capped_profile.yaml"


@pytest.fixture
def no_cap(monkeypatch):
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "")  # restored (unset) after the test, whatever the code sets
    monkeypatch.setenv(gpu_arch.ARCH_ENV, "")
    monkeypatch.delenv(recording.RUN_CONTEXT_ENV, raising=False)
    monkeypatch.setattr(recording, "_current", None)
    budget.clear_skipped()
    yield
    budget.clear_skipped()


def test_capped_profiles_inherit_gpu_and_unknown_names_are_refused():
    assert {"cpu", "gpu", "gpu-24g", "gpu-40g", "gpu-sm80"} <= set(PROFILES)
    assert base_profile("gpu-24g") == base_profile("gpu-40g") == base_profile("gpu-sm80") == "gpu"
    assert base_profile("cpu") == "cpu"
    assert get_profile("gpu-sm80").arch == "sm80" and get_profile("gpu-sm80").memory_cap_gib is None
    assert get_profile("gpu-24g").memory_cap_gib < 24 <= get_profile("gpu-40g").memory_cap_gib < 40
    assert get_profile("gpu").memory_cap_gib is None
    with pytest.raises(ValueError, match="unknown profile 'gpu-8g'.*gpu-24g"):
        get_profile("gpu-8g")
    assert parameter_problem("PROFILE", "gpu-24g") is None  # a notebook may be run with PROFILE = "gpu-24g"


def test_resolve_profile_keeps_the_capped_name_and_needs_cuda(monkeypatch):
    monkeypatch.setattr(recording, "cuda_available", lambda: True)
    assert recording.resolve_profile("gpu-24g") == "gpu-24g"
    assert recording.resolve_profile("GPU-40G") == "gpu-40g"
    monkeypatch.setattr(recording, "cuda_available", lambda: False)
    with pytest.raises(RuntimeError, match="profile 'gpu-24g' needs a CUDA device"):
        recording.resolve_profile("gpu-24g")


def test_predictions_for_gpu_apply_to_the_capped_profiles_not_the_reverse():
    assert profile_applies(["gpu"], "gpu-24g") and profile_applies(["gpu"], "gpu-40g")
    assert profile_applies(["gpu-24g"], "gpu-24g")
    assert not profile_applies(["cpu"], "gpu-24g")
    assert not profile_applies(["gpu-24g"], "gpu") and not profile_applies(["gpu-24g"], "gpu-40g")


def test_runner_passes_the_profile_cap_to_the_kernel_and_refuses_a_conflicting_one(no_cap, monkeypatch):
    cap, arch = budget.MEMORY_CAP_ENV, gpu_arch.ARCH_ENV
    assert runner.profile_environment("gpu-24g") == {cap: "22", arch: ""}
    assert runner.profile_environment("gpu-40g") == {cap: "39", arch: ""}
    assert runner.profile_environment("gpu") == {arch: ""} and runner.profile_environment("cpu") == {}
    assert runner.profile_environment("gpu-sm80") == {arch: "sm80"}
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "30")
    with pytest.raises(runner.RunnerError, match="LORA_LAB_MEMORY_CAP_GIB=30 is set, but profile 'gpu-24g' runs "
                                                 "with a 22 GiB cap"):
        runner.profile_environment("gpu-24g")
    with pytest.raises(runner.RunnerError, match="profile 'gpu' runs with no cap"):
        runner.profile_environment("gpu")
    assert runner.profile_environment("cpu") == {}


def test_runner_passes_the_forced_class_and_refuses_one_the_profile_does_not_name(no_cap, monkeypatch):
    monkeypatch.setenv(gpu_arch.ARCH_ENV, "ampere")
    assert runner.profile_environment("gpu-sm80") == {gpu_arch.ARCH_ENV: "sm80"}  # the same class, named otherwise
    with pytest.raises(runner.RunnerError, match="LORA_LAB_ARCH=ampere is set, but profile 'gpu' takes the device's "
                                                 "own path.*--profile gpu-sm80"):
        runner.profile_environment("gpu")
    assert runner.profile_environment("cpu") == {}  # no GPU: nothing to force
    monkeypatch.setenv(gpu_arch.ARCH_ENV, "sm89")
    with pytest.raises(runner.RunnerError, match="profile 'gpu-sm80' takes the sm80 path"):
        runner.profile_environment("gpu-sm80")
    monkeypatch.setenv(gpu_arch.ARCH_ENV, "volta")
    with pytest.raises(runner.RunnerError, match="LORA_LAB_ARCH='volta' is not a GPU class"):
        runner.profile_environment("gpu")


def test_gpu_profiles_use_the_gpu_device_and_skip_by_their_base(monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "gpus_available", lambda profile: 1)
    notebook = tmp_path / "08_two.ipynb"
    notebook.write_text(json.dumps({"cells": [], "metadata": {"lora_lab": {"gpus": 2}}, "nbformat": 4,
                                    "nbformat_minor": 5}))
    assert "--profile gpu-24g" in runner.skip_reason(notebook, "gpu-24g")
    assert runner.skip_reason(notebook, "cpu") is None


def test_a_capped_run_records_its_name_cap_and_gpu_class_and_computes_as_gpu(no_cap, monkeypatch, tmp_path):
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "22")
    monkeypatch.setattr(recording, "arch_report", lambda: {"gpu_class": "hopper"})
    run = recording.Run("01_records_metrics", "gpu-24g", {}, tmp_path)
    assert (run.name, run.profile, run.device) == ("gpu-24g", "gpu", "cuda")  # notebooks' code asks profile == "gpu"
    payload = json.loads(run.save().read_text())
    assert payload["profile"] == "gpu-24g"
    prov = payload["provenance"]
    assert prov["profile"] == "gpu-24g" and prov["memory_cap_gib"] == 22 and prov["gpu_class"] == "hopper"
    assert "arch_override" not in prov and "skipped_cells" not in payload
    budget.note_skipped("bf16_b4_l4096_full", "skipped: needs more than the cap")
    assert json.loads(run.save().read_text())["skipped_cells"] == {"bf16_b4_l4096_full": "skipped: needs more than "
                                                                                          "the cap"}


def test_a_forced_class_run_records_the_class_and_the_switch(no_cap, monkeypatch, tmp_path):
    monkeypatch.setenv(gpu_arch.ARCH_ENV, "sm80")
    forced = {"gpu_class": "ampere", "arch_override": "LORA_LAB_ARCH=sm80 (kernels write for 8.0)"}
    monkeypatch.setattr(recording, "arch_report", lambda: forced)
    prov = recording.Run("05_x", "gpu-sm80", {}, tmp_path).provenance
    assert prov["profile"] == "gpu-sm80" and prov["gpu_class"] == "ampere"
    assert prov["arch_override"].startswith("LORA_LAB_ARCH=sm80") and "memory_cap_gib" not in prov
    with pytest.raises(RuntimeError, match="profile 'gpu' takes the device's own path, but \\$LORA_LAB_ARCH is sm80"):
        recording.Run("05_x", "gpu", {}, tmp_path)
    monkeypatch.setenv(gpu_arch.ARCH_ENV, "")
    with pytest.raises(RuntimeError, match="profile 'gpu-sm80' takes the sm80 path, but \\$LORA_LAB_ARCH is nothing"):
        recording.Run("05_x", "gpu-sm80", {}, tmp_path)


def test_a_capped_run_without_its_cap_says_how_to_start_it(no_cap, monkeypatch, tmp_path):
    monkeypatch.setattr(recording, "arch_report", lambda: {"gpu_class": "hopper"})
    with pytest.raises(RuntimeError, match="profile 'gpu-40g' caps GPU memory at 39 GiB.*lora-lab run --profile "
                                           "gpu-40g, or start Jupyter / papermill with LORA_LAB_MEMORY_CAP_GIB=39"):
        recording.Run("01_records_metrics", "gpu-40g", {}, tmp_path)


def test_a_cap_that_does_not_match_the_profile_is_refused(no_cap, monkeypatch, tmp_path):
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "22")
    monkeypatch.setattr(recording, "arch_report", lambda: {"gpu_class": "hopper"})
    with pytest.raises(RuntimeError, match="profile 'gpu' runs with no GPU memory cap, but this process has "
                                           "\\$LORA_LAB_MEMORY_CAP_GIB=22"):
        recording.Run("01_records_metrics", "gpu", {}, tmp_path)
    payload = recording.Run("01_records_metrics", "cpu", {}, tmp_path).as_dict()  # no GPU: the cap means nothing
    assert "memory_cap_gib" not in payload["provenance"] and payload["provenance"]["profile"] == "cpu"


def write_capped_run(directory: Path) -> None:
    directory.mkdir(parents=True)
    payload = {"notebook": "01_records_metrics", "profile": "gpu-24g", "parameters": {},
               "metrics": {"answer": 42, "gpu_bf16_b4_l4096_full_oom": 1}, "notes": {},
               "skipped_cells": {"bf16_b4_l4096_full": "skipped: needs more than the memory cap "
                                                       "($LORA_LAB_MEMORY_CAP_GIB=22) allows 22.0 GiB"},
               "provenance": {"status": "completed", "profile": "gpu-24g", "memory_cap_gib": 22.0}}
    (directory / "01_records_metrics.metrics.json").write_text(json.dumps(payload))


def test_gpu_predictions_grade_on_a_capped_run_and_a_skipped_cell_voids_with_its_name(tmp_path):
    directory = tmp_path / "outputs" / "gpu-24g"
    write_capped_run(directory)
    predictions = load_predictions(CAPPED, notebooks_dir=FIXTURES / "notebooks")
    rows = {row.id: row for row in grade_predictions(predictions, "gpu-24g", directory).rows}
    assert set(rows) == {"p01-gpu-answer", "p01-gpu-skipped-peak", "p01-gpu-missing"}  # not the cpu-only one
    assert rows["p01-gpu-answer"].outcome == "hit"
    skipped = rows["p01-gpu-skipped-peak"]
    assert skipped.outcome == "void"
    assert "cell 'bf16_b4_l4096_full' skipped: needs more than the memory cap" in skipped.why
    missing = rows["p01-gpu-missing"]
    assert missing.outcome == "void" and "not recorded" in missing.why
    assert "the run capped GPU memory at 22 GiB" in missing.why


def test_skipped_cell_matches_whole_name_parts_and_prefers_the_longest():
    payload = {"skipped_cells": {"lora": "a", "bf16_b4_l4096_lora": "b", "bf16_b4_l4096_lora_ckpt": "c"}}
    assert skipped_cell_of("gpu_bf16_b4_l4096_lora_ckpt_peak_gib", payload) == ("bf16_b4_l4096_lora_ckpt", "c")
    assert skipped_cell_of("gpu_bf16_b4_l4096_lora_peak_gib", payload) == ("bf16_b4_l4096_lora", "b")
    assert skipped_cell_of("gpu_fp32_b4_l4096_loraplus", {"skipped_cells": {"lora": "a"}}) is None
    assert skipped_cell_of("anything", {}) is None


def fake_h200(monkeypatch):
    import torch

    from lora_lab import gpu_arch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(gpu_arch, "_device_capability", lambda device: (9, 0))


def test_the_device_names_what_the_process_forces(no_cap, monkeypatch):
    from lora_lab.lab.provenance import device_name

    fake_h200(monkeypatch)
    monkeypatch.setenv("LORA_LAB_ARCH", "")
    assert device_name("gpu") == "NVIDIA H200"  # ledger rows and runs of the plain gpu profile: as before
    monkeypatch.setenv("LORA_LAB_ARCH", "sm80")
    monkeypatch.setenv(budget.MEMORY_CAP_ENV, "22")
    assert device_name("gpu-24g") == "NVIDIA H200 [class ampere forced by LORA_LAB_ARCH=sm80; memory cap 22 GiB]"


def test_the_environment_report_prints_the_class_and_its_dispatch_rule(no_cap, monkeypatch, capsys):
    import torch

    fake_h200(monkeypatch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("LORA_LAB_ARCH", "sm80")
    report = recording.environment_report()
    printed = capsys.readouterr().out
    assert report["gpu_class"] == "ampere" and report["compute_capability"] == "9.0"
    assert report["arch_override"] == "LORA_LAB_ARCH=sm80 (kernels write for 8.0)"
    assert report["dispatch"]["gemm_loads auto"] == "pointer loads (no TMA)"
    assert "pointer loads (no TMA)" in printed and "ampere" in printed
    monkeypatch.setenv("LORA_LAB_ARCH", "")
    assert recording.environment_report()["dispatch"]["gemm_loads auto"] == "TMA descriptors (16-bit)"


def test_the_runner_runs_a_capped_profile_end_to_end(no_cap, monkeypatch, tmp_path):
    """The runner process believes in a GPU; the notebook's kernel (no CUDA here) records under gpu-24g with the
    cap it received, into its own folder, and predictions for gpu grade there."""
    monkeypatch.setattr(recording, "cuda_available", lambda: True)
    monkeypatch.setattr(runner, "gpus_available", lambda profile: 1)
    outputs = tmp_path / "runs"
    with open(tmp_path / "log.txt", "w") as log:
        code = runner.run(profile="gpu-24g", only=["1"], notebooks_dir=FIXTURES / "notebooks", outputs_root=outputs,
                          disable_progress=True, stream=log)
    assert code == 0, (tmp_path / "log.txt").read_text()
    payload = json.loads((outputs / "gpu-24g" / "01_records_metrics.metrics.json").read_text())
    prov = payload["provenance"]
    assert payload["profile"] == prov["profile"] == "gpu-24g" and prov["memory_cap_gib"] == 22
    assert prov["status"] == "completed" and not (outputs / "gpu").exists()
    predictions = load_predictions(CAPPED, notebooks_dir=FIXTURES / "notebooks")
    rows = {row.id: row for row in grade_predictions(predictions, "gpu-24g", outputs / "gpu-24g").rows}
    assert rows["p01-gpu-answer"].outcome == "hit"

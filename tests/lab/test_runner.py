"""lora_lab.lab.runner (papermill on the fixture notebooks), publishing, and the run/publish commands."""
import io
import json
import logging
import shutil
import sys
from pathlib import Path

import nbformat
import pytest
import torch
from test_grading import EXPECTED_CPU_OUTCOMES

from lora_lab.lab.cli import main
from lora_lab.lab.grading import grade_predictions
from lora_lab.lab.predictions import load_predictions
from lora_lab.lab.publishing import PublishError, publish
from lora_lab.lab.runner import (
    RunnerError,
    declared_parameters,
    discover_notebooks,
    failing_cell_index,
    parse_only,
    parse_value,
    plan_parameters,
    progress_disabled,
    run,
    select_notebooks,
)

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE_NOTEBOOKS = FIXTURES / "notebooks"
EVERY_COMPARATOR = FIXTURES / "predictions" / "every_comparator.yaml"
STALE = {"notebook": "02_fails_at_known_cell", "profile": "cpu", "metrics": {"after_failure": 2.0},
         "provenance": {"status": "completed"}}


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """All three fixture notebooks run once on cpu; 02 fails at cell 4. A stale 02 result is planted first."""
    outputs = tmp_path_factory.mktemp("outputs")
    (outputs / "cpu").mkdir()
    (outputs / "cpu" / "02_fails_at_known_cell.metrics.json").write_text(json.dumps(STALE))
    (outputs / "cpu" / ".01_records_metrics.peaks").mkdir()  # an earlier run's peaks: not this run's
    (outputs / "cpu" / ".01_records_metrics.peaks" / "process-1.json").write_text("{}")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MPLBACKEND", "Agg")  # as in CI: the runner must still keep figures in the notebooks
        code = run(profile="cpu", notebooks_dir=FIXTURE_NOTEBOOKS, outputs_root=outputs, disable_progress=True,
                   stream=printed)
    return code, outputs / "cpu", printed.getvalue()


def metrics(directory: Path, stem: str) -> dict:
    return json.loads((directory / f"{stem}.metrics.json").read_text())


def test_a_failing_notebook_is_reported_and_the_others_survive(batch):
    code, cpu, printed = batch
    assert code == 1
    assert "FAILED 02_fails_at_known_cell.ipynb: cell 4 (In [" in printed
    assert "ValueError: deliberate failure in cell 4" in printed
    assert "2 ok, 1 failed" in printed

    summary = json.loads((cpu / "run_summary.json").read_text())
    assert summary["profile"] == "cpu"
    entries = summary["notebooks"]
    assert [entries[stem]["status"] for stem in sorted(entries)] == ["ok", "failed", "ok"]
    error = entries["02_fails_at_known_cell"]["error"]
    assert error["cell_index"] == 4  # index in the source notebook: papermill's injected cell is not counted
    assert (error["ename"], error["evalue"]) == ("ValueError", "deliberate failure in cell 4")
    assert error["cell_source_first_line"] == 'raise ValueError("deliberate failure in cell 4")'

    first, failed, third = (metrics(cpu, stem) for stem in sorted(entries))
    assert first["provenance"]["status"] == third["provenance"]["status"] == "completed"
    assert first["metrics"] == {"answer": 42, "ratio": 0.5, "exact": True, "label": "base", "pair": [1.5, 2.5]}
    assert third["metrics"] == {"steps": 3, "total": 6}
    assert failed["provenance"]["status"] == "failed" and failed["provenance"]["error"]["cell_index"] == 4
    assert failed["metrics"] == {"before_failure": 1.0}  # the stale after_failure is gone
    assert first["parameters"] == {"PROFILE": "cpu", "SCALE": 2, "LABEL": "base"}
    provenance = first["provenance"]
    assert provenance["versions"]["python"] and provenance["runner"] is True
    assert provenance["parameter_overrides"] == {} and len(provenance["code_hash"]) == 64
    assert len(provenance["notebook_hash"]) == 64 and "git_commit" in provenance
    for stem in sorted(entries):
        assert (cpu / f"{stem}.ipynb").is_file()
    assert (cpu / "01_records_metrics.txt").read_text() == "profile=cpu\n"  # lab.output_dir() is the run folder
    assert (cpu / "01_line.png").is_file()


def test_each_notebook_gets_a_fresh_hidden_folder_for_its_processes_gpu_peaks(batch):
    _, out, _ = batch
    for stem in ("01_records_metrics", "02_fails_at_known_cell", "03_records_after_failure"):
        folder = out / f".{stem}.peaks"  # $LORA_LAB_PEAK_DIR of the notebook's kernel (lora_lab.memory.peaks)
        assert folder.is_dir() and not list(folder.glob("process-*.json"))  # emptied; no process used a GPU here


def test_a_failing_run_keeps_the_earlier_completed_result_aside(batch, tmp_path):
    """The planted completed result of 02 is not graded (02 failed this time), but not lost either; a run that
    completes replaces the kept one."""
    _, cpu, printed = batch
    kept = cpu / ".02_fails_at_known_cell.metrics.previous.json"
    assert json.loads(kept.read_text()) == STALE
    assert "the earlier completed result of 02_fails_at_known_cell is kept as " + kept.name in printed
    assert metrics(cpu, "02_fails_at_known_cell")["provenance"]["status"] == "failed"
    shutil.copytree(cpu, tmp_path / "cpu")
    assert run(profile="cpu", only=["3"], notebooks_dir=FIXTURE_NOTEBOOKS, outputs_root=tmp_path,
               disable_progress=True, stream=io.StringIO()) == 0
    assert not list((tmp_path / "cpu").glob(".03_*previous*"))  # completed again: nothing kept


def test_figures_stay_in_the_executed_notebook_even_with_mplbackend_agg(batch):
    _, cpu, _ = batch
    executed = nbformat.read(str(cpu / "01_records_metrics.ipynb"), as_version=4)
    [plot_cell] = [cell for cell in executed.cells if "plt.show()" in cell.source]
    assert any("image/png" in output.get("data", {}) for output in plot_cell.outputs)


def test_the_batch_grades_as_expected(batch):
    _, cpu, _ = batch
    predictions = load_predictions(EVERY_COMPARATOR, notebooks_dir=FIXTURE_NOTEBOOKS)
    board = grade_predictions(predictions, "cpu", cpu)
    assert {row.id: row.outcome for row in board.rows} == EXPECTED_CPU_OUTCOMES
    [failed] = [row for row in board.rows if row.id == "p02-before-failure"]
    assert failed.why.startswith("notebook failed: ValueError: deliberate failure in cell 4")


def test_parameters_and_only_rerun_one_notebook_and_keep_the_rest(batch, tmp_path):
    _, cpu, _ = batch
    shutil.copytree(cpu, tmp_path / "cpu")
    printed = io.StringIO()
    code = run(profile="cpu", only=["1"], overrides={"SCALE": 5}, notebooks_dir=FIXTURE_NOTEBOOKS,
               outputs_root=tmp_path, disable_progress=True, stream=printed)
    assert code == 0, printed.getvalue()
    assert metrics(tmp_path / "cpu", "01_records_metrics")["metrics"]["answer"] == 105
    assert metrics(tmp_path / "cpu", "01_records_metrics")["parameters"]["SCALE"] == 5
    assert metrics(tmp_path / "cpu", "01_records_metrics")["provenance"]["parameter_overrides"] == {"SCALE": 5}
    summary = json.loads((tmp_path / "cpu" / "run_summary.json").read_text())["notebooks"]
    assert summary["01_records_metrics"]["parameters"] == {"PROFILE": "cpu", "SCALE": 5, "LABEL": "base"}
    assert summary["01_records_metrics"]["overrides"] == {"SCALE": 5}
    # a run with other parameters than the registered ones is not graded against them
    board = grade_predictions(load_predictions(EVERY_COMPARATOR, notebooks_dir=FIXTURE_NOTEBOOKS), "cpu",
                              tmp_path / "cpu")
    [row] = [row for row in board.rows if row.id == "p01-answer-lt"]
    assert row.outcome == "void" and "SCALE=5" in row.why
    assert summary["02_fails_at_known_cell"]["status"] == "failed"  # kept from the earlier batch
    assert metrics(tmp_path / "cpu", "03_records_after_failure")["metrics"] == {"steps": 3, "total": 6}


def test_parameters_cell_is_read():
    assert declared_parameters(FIXTURE_NOTEBOOKS / "01_records_metrics.ipynb") == {
        "PROFILE": "auto", "SCALE": 2, "LABEL": "base"}
    assert [path.name for path in discover_notebooks(FIXTURE_NOTEBOOKS)] == [
        "01_records_metrics.ipynb", "02_fails_at_known_cell.ipynb", "03_records_after_failure.ipynb"]


@pytest.mark.parametrize("text, value", [("512", 512), ("1e-3", 1e-3), ("[1, 2]", [1, 2]), ("True", True),
                                         ("random:tiny-qwen2", "random:tiny-qwen2"), ("'07'", "07")])
def test_command_line_values_are_python_literals_else_text(text, value):
    assert parse_value(text) == value


def test_parameter_problems_are_caught_before_anything_runs(tmp_path):
    notebooks = discover_notebooks(FIXTURE_NOTEBOOKS)
    plan = plan_parameters(notebooks, {"SCALE": 3, "STEPS": 4}, "cpu")
    assert plan[notebooks[0]].parameters == {"PROFILE": "cpu", "SCALE": 3, "LABEL": "base"}
    assert plan[notebooks[0]].overrides == {"SCALE": 3}
    assert plan[notebooks[1]].parameters == {"PROFILE": "cpu"} and plan[notebooks[1]].overrides == {}
    assert plan[notebooks[2]].overrides == {"STEPS": 4}
    assert plan[notebooks[2]].parameters == {"PROFILE": "cpu", "STEPS": 4}
    with pytest.raises(RunnerError, match=r"unknown parameter 'SCAEL'.*01_records_metrics: LABEL, PROFILE, SCALE"):
        plan_parameters(notebooks, {"SCAEL": 3}, "cpu")
    with pytest.raises(RunnerError, match=r"01_records_metrics: parameter 'SCALE' defaults to int 2; got str 'big'"):
        plan_parameters(notebooks, {"SCALE": "big"}, "cpu")
    with pytest.raises(RunnerError, match="PROFILE is set with --profile"):
        plan_parameters(notebooks, {"PROFILE": "gpu"}, "cpu")
    with pytest.raises(RunnerError, match=r"--only '09' matches no notebook \(available: 01_records_metrics"):
        select_notebooks(notebooks, ["09"])
    assert select_notebooks(notebooks, ["03_records_after_failure", "01"]) == [notebooks[0], notebooks[2]]
    with pytest.raises(RunnerError, match="names no notebook"):
        parse_only("")
    with pytest.raises(RunnerError, match="names no notebook"):
        parse_only(" , ")
    assert parse_only(None) is None
    with pytest.raises(RunnerError, match="cell-timeout must be a positive"):
        run(profile="cpu", notebooks_dir=FIXTURE_NOTEBOOKS, outputs_root=tmp_path / "out", cell_timeout=-1)

    bare = tmp_path / "nb"
    bare.mkdir()
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")]), str(bare / "01_bare.ipynb"))
    with pytest.raises(RunnerError, match="01_bare.ipynb: no cell is tagged 'parameters'"):
        run(profile="cpu", notebooks_dir=bare, outputs_root=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_run_command_rejects_unknown_parameter_without_running(tmp_path, capsys):
    code = main(["run", "--profile", "cpu", "--notebooks-dir", str(FIXTURE_NOTEBOOKS),
                 "--outputs-dir", str(tmp_path), "-p", "NOPE", "1"])
    assert code == 2
    assert "unknown parameter 'NOPE'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["300.5", "0", "-3", "nan", "inf"])
def test_a_bad_cell_timeout_is_refused_before_anything_runs_and_loses_no_result(tmp_path, capsys, value):
    good = {"notebook": "01_records_metrics", "profile": "cpu", "metrics": {"answer": 42},
            "provenance": {"status": "completed"}}
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "01_records_metrics.metrics.json").write_text(json.dumps(good))
    code = main(["run", "--profile", "cpu", "--notebooks-dir", str(FIXTURE_NOTEBOOKS), "--outputs-dir", str(tmp_path),
                 "--only", "01", "--cell-timeout", value])
    assert code == 2
    assert "--cell-timeout must be a positive whole number of seconds" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "cpu").iterdir()] == ["01_records_metrics.metrics.json"]
    assert metrics(tmp_path / "cpu", "01_records_metrics") == good


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_gpu_profile_without_cuda_runs_nothing(tmp_path, capsys):
    code = main(["run", "--profile", "gpu", "--notebooks-dir", str(FIXTURE_NOTEBOOKS), "--outputs-dir", str(tmp_path)])
    assert code == 2 and "needs a CUDA device" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_no_notebooks_is_not_an_error(tmp_path, capsys):
    assert main(["run", "--profile", "cpu", "--notebooks-dir", str(tmp_path),
                 "--outputs-dir", str(tmp_path / "o")]) == 0
    assert "nothing to run" in capsys.readouterr().out


def test_failing_cell_is_found_without_an_exception_index():
    def cell(started=True, error=False):
        code = nbformat.v4.new_code_cell("x")
        code.metadata["papermill"] = {"start_time": "2025-01-01T00:00:00" if started else None, "exception": False}
        code.outputs = [nbformat.v4.new_output("error", ename="E", evalue="", traceback=[])] if error else []
        return code

    markdown = nbformat.v4.new_markdown_cell("# title")
    assert failing_cell_index([markdown, cell(), cell(error=True), cell(started=False)]) == 2  # e.g. a cell timeout
    assert failing_cell_index([markdown, cell(), cell(), cell(started=False)]) == 2  # the kernel died in cell 2
    assert failing_cell_index([markdown, cell(started=False)]) is None


def test_progress_bar_follows_tqdm_disable(monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "0")
    assert progress_disabled() is False
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert progress_disabled() is True
    assert progress_disabled(False) is False


COMMITTED = {"git_commit": "1" * 40, "git_dirty": False, "git_source": "repository"}


def committed_copy(cpu: Path, runs: Path, **provenance) -> Path:
    """The batch's run folder copied to ``runs/cpu`` with its provenance saying "run from a clean commit" (the
    batch itself records the state of the checkout the tests run in, which may hold uncommitted edits), then
    ``provenance`` on top."""
    shutil.copytree(cpu, runs / "cpu")
    for path in (runs / "cpu").glob("*.metrics.json"):
        payload = json.loads(path.read_text())
        payload["provenance"].update({**COMMITTED, **provenance})
        path.write_text(json.dumps(payload))
    return runs / "cpu"


def test_publish_checks_the_run_then_strips_papermill_and_keeps_outputs(batch, tmp_path):
    _, batch_cpu, _ = batch
    cpu = committed_copy(batch_cpu, tmp_path / "runs")
    notebooks = tmp_path / "notebooks"
    shutil.copytree(FIXTURE_NOTEBOOKS, notebooks)
    outputs = tmp_path / "outputs"
    [done] = publish("cpu", runs_root=cpu.parent, outputs_root=outputs, notebooks_dir=notebooks, only=["01"],
                     to_notebooks=True)
    published = nbformat.read(str(done.notebook_destination), as_version=4)
    original = nbformat.read(str(FIXTURE_NOTEBOOKS / "01_records_metrics.ipynb"), as_version=4)
    assert [cell.source for cell in published.cells] == [cell.source for cell in original.cells]
    assert "papermill" not in published.metadata
    assert all("papermill" not in cell.metadata and "execution" not in cell.metadata for cell in published.cells)
    code_cells = [cell for cell in published.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code_cells] == [1, 2, 3, 4, 5]  # no injected cell: no overrides
    assert published.metadata.kernelspec.name == "python3"
    assert sorted(p.name for p in (outputs / "cpu").iterdir()) == [
        "01_line.png", "01_records_metrics.ipynb", "01_records_metrics.metrics.json", "01_records_metrics.txt",
        "run_history.json", "run_summary.json"]

    def refused(only, match):
        with pytest.raises(PublishError, match=match):
            publish("cpu", runs_root=cpu.parent, outputs_root=outputs, notebooks_dir=notebooks, only=only)

    refused(["02"], "02_fails_at_known_cell: not a complete run.*\n.*its metrics say .failed.")
    changed = nbformat.read(str(notebooks / "03_records_after_failure.ipynb"), as_version=4)
    changed.cells[-1].source += "\nprint('edited after the run')"
    nbformat.write(changed, str(notebooks / "03_records_after_failure.ipynb"))
    refused(["03"], "03_records_after_failure.ipynb changed since the run")


def test_publish_refuses_stale_code_overrides_and_half_runs(batch, tmp_path):
    _, cpu, _ = batch
    runs = tmp_path / "runs"
    committed_copy(cpu, runs)
    notebooks = tmp_path / "notebooks"
    shutil.copytree(FIXTURE_NOTEBOOKS, notebooks)
    path = runs / "cpu" / "01_records_metrics.metrics.json"
    payload = json.loads(path.read_text())

    def attempt():
        return main(["publish", "--profile", "cpu", "--from", str(runs), "--outputs-dir", str(tmp_path / "out"),
                     "--notebooks-dir", str(notebooks), "--only", "01"])

    payload["provenance"]["code_hash"] = "0" * 64  # written by other code
    path.write_text(json.dumps(payload))
    assert attempt() == 2
    payload["provenance"]["code_hash"] = json.loads((cpu / path.name).read_text())["provenance"]["code_hash"]
    payload["provenance"]["parameter_overrides"] = {"SCALE": 5}
    path.write_text(json.dumps(payload))
    assert attempt() == 2
    payload["provenance"]["parameter_overrides"] = {}
    path.write_text(json.dumps(payload))
    executed = nbformat.read(str(runs / "cpu" / "01_records_metrics.ipynb"), as_version=4)
    executed.cells[-1].execution_count = None  # an interrupted re-run: the last cells never ran
    executed.cells[-1].outputs = []
    nbformat.write(executed, str(runs / "cpu" / "01_records_metrics.ipynb"))
    assert attempt() == 2
    assert not (tmp_path / "out").exists()  # nothing published by any refused attempt


@pytest.mark.parametrize("provenance, says", [
    ({"git_dirty": True}, "run from code with uncommitted changes (provenance git_dirty=True"),
    ({"git_commit": None, "git_dirty": None, "git_source": None}, "run from code with no git commit"),
])
def test_publish_refuses_a_run_of_uncommitted_code(batch, tmp_path, capsys, provenance, says):
    """Committing the code after the run makes the hashes match; the run's own git state still says it came from
    an uncommitted tree, and publishing it would name a commit that did not produce it."""
    _, cpu, _ = batch
    runs = tmp_path / "runs"
    committed_copy(cpu, runs, **provenance)
    notebooks = tmp_path / "notebooks"
    shutil.copytree(FIXTURE_NOTEBOOKS, notebooks)
    code = main(["publish", "--profile", "cpu", "--from", str(runs), "--outputs-dir", str(tmp_path / "out"),
                 "--notebooks-dir", str(notebooks), "--only", "01"])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "commit the code, then run it again" in err
    assert not (tmp_path / "out").exists()
    # a copy of a committed tree (commit declared, dirty state unknown: the GPU machine) is accepted
    committed_copy(cpu, tmp_path / "declared", git_dirty=None, git_source="declared")
    [done] = publish("cpu", runs_root=tmp_path / "declared", outputs_root=tmp_path / "out2", notebooks_dir=notebooks,
                     only=["01"])
    assert done.notebook == "01_records_metrics"


def test_scratch_runs_stay_out_of_outputs(tmp_path, monkeypatch):
    """Run outside the runner (Jupyter, papermill, nbval): results go to build/scratch/<profile>."""
    from lora_lab.lab import recording

    monkeypatch.delenv(recording.RUN_CONTEXT_ENV, raising=False)
    monkeypatch.setattr(recording, "_current", None)
    run_ = recording.start_run("01_demo", "cpu", parameters={})
    assert run_.directory.parts[-3:] == ("build", "scratch", "cpu")
    assert run_.provenance["runner"] is False
    recording.finish_run()


def test_ctrl_c_records_the_running_notebook_as_interrupted_in_one_line(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    params = nbformat.v4.new_code_cell('PROFILE = "auto"')
    params.metadata["tags"] = ["parameters"]
    # 'before' is recorded by the cell that then sleeps: once the file shows it, the kernel is busy in that cell.
    # (Recorded one cell earlier, the interrupt could land between the two cells under load: a CI run of 17f96e6
    # then waited out its 120 s on the runner.)
    cells = [params, nbformat.v4.new_code_cell("import time\nfrom lora_lab import lab\n"
                                               "run = lab.start_run('01_sleeps', PROFILE)"),
             nbformat.v4.new_code_cell("lab.record('before', 1)\ntime.sleep(120)"),
             nbformat.v4.new_code_cell("lab.finish_run()")]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), str(notebooks / "01_sleeps.ipynb"))
    command = [sys.executable, "-m", "lora_lab", "run", "--profile", "cpu", "--notebooks-dir", str(notebooks),
               "--outputs-dir", str(tmp_path / "runs")]
    # the runner as a terminal starts it: Ctrl-C at its default action. A signal the test process ignores is
    # ignored by its children too (and Python then never raises KeyboardInterrupt); this pytest worker's
    # disposition is reported if the runner does not stop.
    disposition = signal.getsignal(signal.SIGINT)
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, env={**os.environ, "TQDM_DISABLE": "1"},
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    metrics_file = tmp_path / "runs" / "cpu" / "01_sleeps.metrics.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "before" not in (metrics_file.read_text() if metrics_file.exists() else ""):
        time.sleep(0.5)
    seen = "before" in (metrics_file.read_text() if metrics_file.exists() else "")
    os.killpg(child.pid, signal.SIGINT)  # Ctrl-C reaches the runner and the kernel alike
    try:
        out, _ = child.communicate(timeout=120)
    except subprocess.TimeoutExpired as expired:  # say what state the run was in, then stop it
        os.killpg(child.pid, signal.SIGKILL)
        kernel_logs = {p.name: p.read_text()[-2000:] for p in (tmp_path / "runs" / "cpu").glob(".*.kernel.log")}
        pytest.fail(f"the runner did not stop within 120 s of Ctrl-C ('before' recorded when it was sent: {seen}; "
                    f"SIGINT in the test process: {disposition!r}); "
                    f"its output: {expired.output!r}; kernel logs: {kernel_logs}")
    assert child.returncode == 130
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[-1].startswith("interrupted: 01_sleeps.ipynb stopped after") and "Traceback" not in out
    assert metrics(tmp_path / "runs" / "cpu", "01_sleeps")["provenance"]["status"] == "interrupted"
    assert metrics(tmp_path / "runs" / "cpu", "01_sleeps")["metrics"] == {"before": 1}  # kept


def test_an_orphaned_dead_kernel_task_is_not_printed_after_an_interrupt(capsys):
    # what a CI run printed after the one-line report: nbclient's pending task ending in DeadKernelError
    import asyncio
    import gc

    from nbclient.exceptions import CellExecutionError, DeadKernelError

    from lora_lab.lab import kernel_processes

    async def dies():
        raise DeadKernelError("Kernel died")

    async def interrupted_cell():  # the kernel answered the interrupted cell before it was shut down
        raise CellExecutionError("traceback", "KeyboardInterrupt", "")

    async def failed_cell():
        raise CellExecutionError("traceback", "ValueError", "a real failure, still reported")

    async def other():
        raise ValueError("still reported")

    def orphan(coroutine):
        loop = asyncio.new_event_loop()
        task = loop.create_task(coroutine)
        loop.run_until_complete(asyncio.wait([task]))
        loop.close()
        del task, loop
        gc.collect()

    logger = logging.getLogger("asyncio")
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    try:
        orphan(dies())
        assert "DeadKernelError" in capsys.readouterr().err  # asyncio reports it without the filter
        kernel_processes.quiet_orphaned_kernel_tasks()
        kernel_processes.quiet_orphaned_kernel_tasks()  # once is enough; twice adds nothing
        assert logger.filters.count(kernel_processes._ORPHAN_FILTER) == 1
        orphan(dies())
        orphan(interrupted_cell())
        orphan(other())
        orphan(failed_cell())
        err = capsys.readouterr().err
        assert "DeadKernelError" not in err and "KeyboardInterrupt" not in err
        assert "still reported" in err and "a real failure, still reported" in err
    finally:
        logger.removeHandler(handler)
        logger.removeFilter(kernel_processes._ORPHAN_FILTER)


def test_a_notebook_that_needs_two_gpus_is_skipped_on_a_smaller_gpu_machine_and_says_why(tmp_path, monkeypatch,
                                                                                           capsys):
    from lora_lab.lab import runner
    from lora_lab.lab.notebooks import required_gpus

    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    notebook = nbformat.read(str(FIXTURE_NOTEBOOKS / "01_records_metrics.ipynb"), as_version=4)
    notebook.metadata["lora_lab"] = {"gpus": 2}
    nbformat.write(notebook, str(notebooks / "08_needs_two_gpus.ipynb"))
    assert required_gpus(notebooks / "08_needs_two_gpus.ipynb") == 2
    assert required_gpus(FIXTURE_NOTEBOOKS / "01_records_metrics.ipynb") == 0
    # the cpu profile runs it (every notebook has a cpu path)
    assert runner.skip_reason(notebooks / "08_needs_two_gpus.ipynb", "cpu") is None
    # on the gpu profile: skipped with one GPU (saying why, dropping stale metrics), run with two
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    why = runner.skip_reason(notebooks / "08_needs_two_gpus.ipynb", "gpu")
    assert why.startswith("needs 2 GPUs (notebook metadata lora_lab.gpus); profile gpu here has 1")
    outputs = tmp_path / "runs"
    (outputs / "gpu").mkdir(parents=True)
    stale = outputs / "gpu" / "08_needs_two_gpus.metrics.json"
    stale.write_text(json.dumps({"notebook": "08_needs_two_gpus", "metrics": {}}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    code = main(["run", "--profile", "gpu", "--notebooks-dir", str(notebooks), "--outputs-dir", str(outputs),
                 "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0 and "SKIPPED 08_needs_two_gpus.ipynb: needs 2 GPUs" in printed
    assert "0 ok, 0 failed, 1 skipped" in printed and not stale.exists()
    summary = json.loads((outputs / "gpu" / "run_summary.json").read_text())
    assert summary["notebooks"]["08_needs_two_gpus"]["status"] == "skipped"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert runner.skip_reason(notebooks / "08_needs_two_gpus.ipynb", "gpu") is None
    # a malformed marker is refused before anything runs
    notebook.metadata["lora_lab"] = {"gpus": "two"}
    nbformat.write(notebook, str(notebooks / "08_needs_two_gpus.ipynb"))
    assert main(["run", "--profile", "cpu", "--notebooks-dir", str(notebooks), "--outputs-dir", str(outputs)]) == 2
    assert "lora_lab.gpus must be a non-negative integer" in capsys.readouterr().err


REPO_NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


@pytest.mark.parametrize("name, text, says", [
    ("R", "0", "parameter R = 0 is not an integer >= 1"),  # once a ZeroDivisionError in a cell (ALPHA / R)
    ("TARGETS", "qproj", "parameter TARGETS = 'qproj' is not comma-separated, distinct names of linear layers, "
                         "from q_proj, k_proj"),  # once an IndexError in a cell
    ("TARGETS", "", "parameter TARGETS = '' is not comma-separated"),
    ("ALPHA", "-16", "parameter ALPHA = -16 is not a number > 0"),
    ("MODEL", "random:no-such-config", "parameter MODEL = 'random:no-such-config' is not"),
    ("TOKENS", "0", "parameter TOKENS = 0 is not an integer >= 1"),
])
def test_parameter_values_are_checked_against_their_rule_before_anything_runs(tmp_path, capsys, name, text, says):
    code = main(["run", "--profile", "cpu", "--only", "01", "--notebooks-dir", str(REPO_NOTEBOOKS),
                 "--outputs-dir", str(tmp_path), "-p", name, text])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "(declared by 01_build_lora_layer)" in err and "nothing was run" in err
    assert list(tmp_path.iterdir()) == []


def test_accepted_values_pass_their_rule():
    [notebook] = select_notebooks(discover_notebooks(REPO_NOTEBOOKS), ["01"])
    plan = plan_parameters([notebook], {"R": 4, "ALPHA": 8, "TARGETS": "q_proj,k_proj,v_proj,o_proj",
                                        "MODEL": "random:tiny-qwen2"}, "cpu")[notebook]
    assert plan.overrides == {"R": 4, "ALPHA": 8, "TARGETS": "q_proj,k_proj,v_proj,o_proj",
                              "MODEL": "random:tiny-qwen2"}


def test_every_notebook_parameter_has_a_rule_its_default_passes():
    from lora_lab.lab.notebooks import PARAMETER_RULES, parameter_problem

    notebooks = discover_notebooks(REPO_NOTEBOOKS)
    assert notebooks
    for path in notebooks:
        for name, default in declared_parameters(path).items():
            assert name in PARAMETER_RULES, f"{path.name}: parameter {name} has no rule in PARAMETER_RULES"
            assert parameter_problem(name, default) is None, f"{path.name}: the registered {name}={default!r}"


def test_papermill_parses_every_notebooks_parameters_cell(caplog):
    """`papermill NB out -p NAME VALUE` run directly reads the parameters cell with its own line parser, which takes
    a line whose comment holds "=" (or ">=") for an unparsable one and warns: every line must parse."""
    from papermill.translators import PythonTranslator

    for path in discover_notebooks(REPO_NOTEBOOKS):
        cell = next(c for c in nbformat.read(str(path), as_version=4).cells
                    if "parameters" in (c.metadata.get("tags") or []))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="papermill"):
            names = [parameter.name for parameter in PythonTranslator.inspect(cell)]
        assert "Unable to parse" not in caplog.text, f"{path.name}: {caplog.text}"
        assert names == list(declared_parameters(path)), path.name


def test_overrides_print_no_papermill_parse_warning(tmp_path, caplog, capfd):
    """A parameters cell whose comment holds "=" (as notebooks 01-03's MODEL line) once made every `-p` print
    papermill's "Unable to parse line 2 'MODEL = ...'"."""
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    params = nbformat.v4.new_code_cell('PROFILE = "auto"  # auto | cpu | gpu\n'
                                       'MODEL = ""  # "" = the profile\'s model\nR = 8  # rank, = 8 by default')
    params.metadata["tags"] = ["parameters"]
    body = nbformat.v4.new_code_cell(
        "from lora_lab.lab.recording import finish_run, record, start_run\n"
        "start_run('01_parse', PROFILE)\nrecord({'model': MODEL, 'r': R})\nfinish_run()")
    kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nbformat.v4.new_notebook(cells=[params, body], metadata={"kernelspec": kernelspec}),
                   str(notebooks / "01_parse.ipynb"))
    printed = io.StringIO()
    with caplog.at_level(logging.WARNING, logger="papermill"):
        code = run(profile="cpu", overrides={"MODEL": "random:tiny-qwen2", "R": 4}, notebooks_dir=notebooks,
                   outputs_root=tmp_path / "runs", disable_progress=True, stream=printed)
    assert code == 0, printed.getvalue()
    logged = caplog.text + "".join(capfd.readouterr())
    assert "Unable to parse" not in logged and "unknown parameter" not in logged.lower()
    recorded = metrics(tmp_path / "runs" / "cpu", "01_parse")
    assert recorded["metrics"] == {"model": "random:tiny-qwen2", "r": 4}
    assert recorded["provenance"]["parameter_overrides"] == {"MODEL": "random:tiny-qwen2", "R": 4}
    executed = nbformat.read(str(tmp_path / "runs" / "cpu" / "01_parse.ipynb"), as_version=4)
    assert [cell.metadata.get("tags") for cell in executed.cells][:2] == [["parameters"], ["injected-parameters"]]


def test_moe_notebook_rules_name_bad_shapes_and_budgets():
    from lora_lab.lab.notebooks import parameter_problem

    assert parameter_problem("NUMERICS_SHAPES", ("qwen3_30b_a3b",)) is None
    assert "LAYER_SHAPES" in parameter_problem("NUMERICS_SHAPES", ("no_such_layer",))
    assert parameter_problem("NUMERICS_SHAPES", ()) is not None
    assert parameter_problem("NUMERICS_SHAPES", ("qwen3_30b_a3b", "qwen3_30b_a3b")) is not None
    assert parameter_problem("BUDGET_S", 120) is None and parameter_problem("BUDGET_S", (260, 60)) is None
    assert "seconds > 0" in parameter_problem("BUDGET_S", 0)
    assert parameter_problem("BUDGET_S", (120, -1)) is not None and parameter_problem("BUDGET_S", True) is not None


def _sleeping_notebook(folder: Path, stem: str, seconds: float, record_first: bool = True) -> None:
    params = nbformat.v4.new_code_cell('PROFILE = "auto"')
    params.metadata["tags"] = ["parameters"]
    cells = [params, nbformat.v4.new_code_cell(f"import time\nfrom lora_lab import lab\n"
                                               f"run = lab.start_run({stem!r}, PROFILE)"),
             nbformat.v4.new_code_cell(("lab.record('before', 1)\n" if record_first else "")
                                       + f"time.sleep({seconds})"),
             nbformat.v4.new_code_cell("lab.record('after', 1)\nlab.finish_run()")]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), str(folder / f"{stem}.ipynb"))


def test_side_by_side_groups_hold_consecutive_notebooks_that_time_nothing():
    from lora_lab.lab.side_by_side import SHARES_THE_GPU, side_by_side_groups

    assert {"01", "02", "03", "04"} == SHARES_THE_GPU
    paths = [Path(f"{n}_x.ipynb") for n in ("01", "02", "03", "04", "05", "06", "08")]
    stems = lambda groups: [[p.stem[:2] for p in g] for g in groups]  # noqa: E731
    assert stems(side_by_side_groups(paths, 4)) == [["01", "02", "03", "04"], ["05"], ["06"], ["08"]]
    assert stems(side_by_side_groups(paths, 3)) == [["01", "02", "03"], ["04"], ["05"], ["06"], ["08"]]
    assert stems(side_by_side_groups(paths, 1)) == [[n] for n in ("01", "02", "03", "04", "05", "06", "08")]
    assert stems(side_by_side_groups(paths, 4, alone={paths[1]})) == [["01"], ["02"], ["03", "04"], ["05"], ["06"],
                                                                      ["08"]]
    shuffled = [paths[0], paths[4], paths[1], paths[2]]  # 05 between them: 02 and 03 do not join 01
    assert stems(side_by_side_groups(shuffled, 4)) == [["01"], ["05"], ["02", "03"]]



def test_no_notebooks_side_by_side_under_a_memory_cap():
    from lora_lab.lab.side_by_side import side_by_side_allowed

    assert side_by_side_allowed("gpu", 4) == side_by_side_allowed("gpu-sm80", 4) == 4
    assert side_by_side_allowed("gpu-24g", 4) == side_by_side_allowed("gpu-40g", 4) == 1
    assert side_by_side_allowed("cpu", 2) == 2


def test_parallel_runs_notebooks_that_time_nothing_side_by_side_and_records_each(tmp_path):
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    for stem in ("01_first", "02_second"):
        _sleeping_notebook(notebooks, stem, 4)
    printed = io.StringIO()
    code = run(profile="cpu", notebooks_dir=notebooks, outputs_root=tmp_path / "runs", disable_progress=True,
               stream=printed, parallel=2)
    assert code == 0, printed.getvalue()
    assert "side by side: 01_first, 02_second" in printed.getvalue()
    summary = json.loads((tmp_path / "runs" / "cpu" / "run_summary.json").read_text())["notebooks"]
    first, second = summary["01_first"], summary["02_second"]
    assert first["status"] == second["status"] == "ok"
    assert second["started"] < first["finished"] and first["started"] < second["finished"]  # at the same time
    for stem in ("01_first", "02_second"):
        assert metrics(tmp_path / "runs" / "cpu", stem)["metrics"] == {"before": 1, "after": 1}
    # both kernels shut down: none of their process ids is left for a later Ctrl-C to signal
    from lora_lab.lab import kernel_processes
    assert not kernel_processes._LIVE_KERNELS
    with pytest.raises(RunnerError, match="parallel must be a whole number"):
        run(profile="cpu", notebooks_dir=notebooks, outputs_root=tmp_path / "runs", parallel=0)


def test_ctrl_c_interrupts_every_notebook_running_side_by_side(tmp_path):
    import os
    import signal
    import subprocess
    import time

    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    for stem in ("01_sleeps", "02_sleeps_too"):
        _sleeping_notebook(notebooks, stem, 120)
    _sleeping_notebook(notebooks, "05_never_runs", 1)
    command = [sys.executable, "-m", "lora_lab", "run", "--profile", "cpu", "--notebooks-dir", str(notebooks),
               "--outputs-dir", str(tmp_path / "runs"), "--parallel", "4"]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, env={**os.environ, "TQDM_DISABLE": "1"},
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    files = [tmp_path / "runs" / "cpu" / f"{stem}.metrics.json" for stem in ("01_sleeps", "02_sleeps_too")]
    deadline = time.monotonic() + 180
    busy = lambda: all("before" in (f.read_text() if f.exists() else "") for f in files)  # noqa: E731
    while time.monotonic() < deadline and not busy():
        time.sleep(0.5)
    seen = busy()
    os.killpg(child.pid, signal.SIGINT)  # Ctrl-C reaches the runner; the kernels run in sessions of their own
    try:
        out, _ = child.communicate(timeout=120)
    except subprocess.TimeoutExpired as expired:
        os.killpg(child.pid, signal.SIGKILL)
        pytest.fail(f"the runner did not stop within 120 s of Ctrl-C (both kernels busy when it was sent: {seen}); "
                    f"its output: {expired.output!r}")
    assert child.returncode == 130, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[-1] == ("interrupted: 01_sleeps, 02_sleeps_too stopped and recorded as interrupted; the notebooks "
                         "after them did not run")
    for stem in ("01_sleeps", "02_sleeps_too"):
        recorded = metrics(tmp_path / "runs" / "cpu", stem)
        assert recorded["provenance"]["status"] == "interrupted" and recorded["metrics"] == {"before": 1}
    assert not (tmp_path / "runs" / "cpu" / "05_never_runs.metrics.json").exists()

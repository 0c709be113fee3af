"""tools/gpu_queue.py: timing notebooks alone, the others side by side, only what fits the call's time, and the next
call resumes from the state file (a fake `lora-lab` that sleeps stands in for the notebooks)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "gpu_queue.py"

FAKE = """
import json, sys, time
from pathlib import Path
args = sys.argv[1:]
job, out = args[args.index("--only") + 1], Path(args[args.index("--outputs-dir") + 1])
plan = json.loads(Path(sys.argv[0]).with_name("plan.json").read_text())[job]
start = time.time()
marker = Path(sys.argv[0]).with_name(f"began_{job}")
pause = plan["sleep"] if marker.exists() or "first_sleep" not in plan else plan["first_sleep"]
marker.write_text("x")
time.sleep(pause)
out.mkdir(parents=True, exist_ok=True)
(out / "done.txt").write_text("x")
(out / "gpu").mkdir(exist_ok=True)
(out / "gpu" / "run_summary.json").write_text(json.dumps(
    {"notebooks": {f"{job}_nb": {"status": "ok", "seconds": round(time.time() - start, 1)}}}))
with open(Path(sys.argv[0]).with_name("spans.txt"), "a") as f:
    f.write(f"{job} {start} {time.time()}\\n")
sys.exit(plan.get("exit", 0))
"""


def _setup(tmp_path, plan, published):
    fake = tmp_path / "fake_lora_lab.py"
    fake.write_text(FAKE)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    outputs = tmp_path / "outputs" / "gpu"
    outputs.mkdir(parents=True)
    (outputs / "run_summary.json").write_text(json.dumps(
        {"notebooks": {f"{job}_nb": {"seconds": seconds} for job, seconds in published.items()}}))
    return fake


def _queue(tmp_path, fake, *args):
    common = ["--state", str(tmp_path / "state.json"), "--runs", str(tmp_path / "runs"),
              "--outputs", str(tmp_path / "outputs")]
    return subprocess.run([sys.executable, str(TOOL), *args, *common, "--lora-lab", sys.executable, str(fake)],
                          capture_output=True, text=True, timeout=120)


def _spans(tmp_path):
    spans = {}
    for line in (tmp_path / "spans.txt").read_text().splitlines():
        job, start, end = line.split()
        spans[job] = (float(start), float(end))
    return spans


def _overlap(a, b):
    return a[0] < b[1] and b[0] < a[1]


def test_timing_notebooks_run_alone_the_others_side_by_side(tmp_path):
    plan = {"05": {"sleep": 0.6}, "01": {"sleep": 0.6}, "02": {"sleep": 0.6}, "06": {"sleep": 0.3}}
    fake = _setup(tmp_path, plan, {"05": 1, "01": 1, "02": 1, "06": 1})
    done = _queue(tmp_path, fake, "run", "--jobs", "05,01,02,06", "--limit", "60", "--slack", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    spans = _spans(tmp_path)
    assert _overlap(spans["01"], spans["02"])  # side by side
    for timing in ("05", "06"):
        assert not any(_overlap(spans[timing], spans[other]) for other in spans if other != timing)
    assert spans["05"][1] <= spans["01"][0] and spans["02"][1] <= spans["06"][0]  # the queue's order
    state = json.loads((tmp_path / "state.json").read_text())["jobs"]
    assert {j: s["status"] for j, s in state.items()} == {"05": "done", "01": "done", "02": "done", "06": "done"}
    assert (tmp_path / "runs" / "05" / "done.txt").is_file()  # each notebook in its own runs root


def test_a_memory_capped_profile_runs_one_notebook_at_a_time(tmp_path):
    plan = {"01": {"sleep": 0.6}, "02": {"sleep": 0.6}}
    fake = _setup(tmp_path, plan, {"01": 1, "02": 1})
    done = _queue(tmp_path, fake, "run", "--profile", "gpu-24g", "--jobs", "01,02", "--limit", "60", "--slack", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpu-24g: one notebook at a time" in done.stdout
    spans = _spans(tmp_path)
    assert not _overlap(spans["01"], spans["02"])


def test_what_does_not_fit_waits_for_the_next_call_and_failures_are_kept(tmp_path):
    plan = {"05": {"sleep": 0.1}, "06": {"sleep": 0.1, "exit": 1}, "07": {"sleep": 0.1}}
    fake = _setup(tmp_path, plan, {"05": 100, "06": 1})  # 05 expected 100 s; 07 never ran: --default
    first = _queue(tmp_path, fake, "run", "--jobs", "05,06,07", "--limit", "30", "--slack", "0", "--margin", "1",
                   "--default", "10")
    assert first.returncode == 3  # not all done
    assert "06: FAILED (exit 1)" in first.stdout and "05: waits for the next call (expected 100 s)" in first.stdout
    state = json.loads((tmp_path / "state.json").read_text())["jobs"]
    assert set(state) == {"06", "07"} and state["07"]["status"] == "done"
    second = _queue(tmp_path, fake, "run", "--jobs", "05,06,07", "--limit", "200", "--slack", "0", "--margin", "1")
    state = json.loads((tmp_path / "state.json").read_text())["jobs"]
    assert state["05"]["status"] == "done" and state["06"]["status"] == "failed"  # a failure is not retried
    assert "queue: 1 to run of 3 (05)" in second.stdout
    third = _queue(tmp_path, fake, "run", "--jobs", "05,06,07", "--limit", "200", "--retry-failed")
    assert "queue: 1 to run of 3 (06)" in third.stdout


def test_a_notebook_longer_than_a_call_gets_a_whole_call_and_expect_overrides(tmp_path):
    plan = {"05": {"sleep": 0.1}, "06": {"sleep": 0.1}}
    fake = _setup(tmp_path, plan, {"05": 900, "06": 900})
    first = _queue(tmp_path, fake, "run", "--jobs", "05,06", "--limit", "30")
    assert "05: expected 1055 s, more than this call's" in first.stdout
    assert "06: waits for the next call" in first.stdout
    state = json.loads((tmp_path / "state.json").read_text())["jobs"]
    assert set(state) == {"05"}  # alone: nothing after it in the same call
    second = _queue(tmp_path, fake, "run", "--jobs", "05,06", "--limit", "30", "--expect", "06=5")
    assert second.returncode == 0 and "running 06 (expected 5 s" in second.stdout
    bad = _queue(tmp_path, fake, "run", "--jobs", "05", "--limit", "30", "--expect", "05=soon")
    assert bad.returncode == 2 and "--expect takes NN=SECONDS" in bad.stderr


def test_bad_arguments_name_the_problem(tmp_path):
    fake = _setup(tmp_path, {}, {})
    done = _queue(tmp_path, fake, "run", "--jobs", "5,x", "--limit", "10")
    assert done.returncode == 2 and "--jobs takes notebook numbers" in done.stderr
    (tmp_path / "state.json").write_text("{broken")
    done = _queue(tmp_path, fake, "run", "--jobs", "05", "--limit", "10")
    assert done.returncode == 2 and "not a queue state file" in done.stderr


def test_the_notebooks_that_time_something_are_the_ones_run_alone():
    """A notebook that starts a benchmark or times in processes of its own must not share the GPU, nor one that
    needs every GPU: the notebooks run side by side (lora_lab.lab.side_by_side.SHARES_THE_GPU, which gpu_queue and
    `lora-lab run --parallel` read) are exactly the others of notebooks/."""
    import re

    from lora_lab.lab.notebooks import required_gpus
    from lora_lab.lab.side_by_side import SHARES_THE_GPU

    shares = set()
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        timing = re.search(r"benchmarks|bench_\w+\.py|repeat_in_processes|run_script_sessions|loop_ms", code)
        if not timing and required_gpus(path) <= 1:
            shares.add(path.name[:2])
    assert shares == SHARES_THE_GPU


def test_a_run_resumed_in_a_later_call_records_every_calls_seconds(tmp_path):
    """A notebook stopped at the end of one call and finished in the next (its benchmarks resumed): its run summary
    entry gets the number of calls and their seconds added up, which the run tables show."""
    from lora_lab.lab.run_table import _matrix_cell

    plan = {"05": {"first_sleep": 5, "sleep": 0.1}}
    fake = _setup(tmp_path, plan, {"05": 1})
    first = _queue(tmp_path, fake, "run", "--jobs", "05", "--limit", "1", "--slack", "0")
    assert "05: FAILED (exit timeout)" in first.stdout
    second = _queue(tmp_path, fake, "run", "--jobs", "05", "--limit", "30", "--retry-failed")
    assert second.returncode == 0, second.stdout + second.stderr
    calls = json.loads((tmp_path / "state.json").read_text())["jobs"]["05"]["calls"]
    assert [c["exit"] for c in calls] == ["timeout", 0]
    entry = json.loads((tmp_path / "runs" / "05" / "gpu" / "run_summary.json").read_text())["notebooks"]["05_nb"]
    assert entry["calls"] == 2 and entry["seconds_all_calls"] == round(sum(c["seconds"] for c in calls), 1)
    assert entry["seconds_all_calls"] >= 1.0 > entry["seconds"]  # the runner's own seconds: the last call's
    row = {"status": "ok", "seconds": entry["seconds_all_calls"], "calls": 2, "gpu_reserved_gib": None, "skipped": 0}
    assert _matrix_cell(row) == f"{entry['seconds_all_calls']:.0f} s over 2 calls"


def test_a_state_file_without_calls_counts_its_attempt(tmp_path):
    """A state file written before calls were kept: its failed attempt's seconds still count when the job finishes."""
    fake = _setup(tmp_path, {"05": {"sleep": 0.1}}, {"05": 1})
    (tmp_path / "state.json").write_text(json.dumps(
        {"jobs": {"05": {"status": "failed", "exit": "timeout", "seconds": 400.0}}}))
    done = _queue(tmp_path, fake, "run", "--jobs", "05", "--limit", "30", "--retry-failed")
    assert done.returncode == 0, done.stdout + done.stderr
    entry = json.loads((tmp_path / "runs" / "05" / "gpu" / "run_summary.json").read_text())["notebooks"]["05_nb"]
    assert entry["calls"] == 2 and 400.0 < entry["seconds_all_calls"] < 410.0

"""lora_lab.memory.peaks: a process started during a run writes its GPU memory peak at exit, and finish_run records the
largest in the run's provenance (processes that never used CUDA, as on this CPU machine, write nothing)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from lora_lab import lab
from lora_lab.memory import peaks

GIB = 2 ** 30


def test_a_process_that_imports_lora_lab_writes_its_peak_at_exit(tmp_path):
    code = ("import lora_lab.memory.peaks as p\n"
            "p.process_peak = lambda: {'pid': 7, 'command': 'bench.py --x', 'reserved_bytes': 5 * 2**30, "
            "'allocated_bytes': 4 * 2**30}\n")
    env = {**os.environ, peaks.PEAK_DIR_ENV: str(tmp_path)}
    subprocess.run([sys.executable, "-c", "import lora_lab\n" + code], env=env, check=True)
    assert peaks.collect(tmp_path) == [{"pid": 7, "command": "bench.py --x", "reserved_bytes": 5 * GIB,
                                        "allocated_bytes": 4 * GIB}]
    env.pop(peaks.PEAK_DIR_ENV)
    other = tmp_path / "unset"
    other.mkdir()
    subprocess.run([sys.executable, "-c", "import lora_lab\n" + code], env=env, check=True, cwd=other)
    assert list(other.iterdir()) == []  # no folder named: nothing written anywhere


def test_collect_skips_what_is_not_a_peak_and_summary_takes_the_largest(tmp_path):
    for pid, reserved, allocated in ((1, 3, 2), (2, 9, 6), (3, 4, 4)):
        peaks._write(str(tmp_path), {"pid": pid, "command": f"p{pid}", "reserved_bytes": reserved * GIB,
                                     "allocated_bytes": allocated * GIB})
    (tmp_path / "process-9.json").write_text("{not json")
    (tmp_path / "notes.txt").write_text("x")
    found = peaks.collect(tmp_path)
    assert [p["pid"] for p in found] == [1, 2, 3]
    assert peaks.summary(found) == {"processes": 3, "largest_reserved_gib": 9.0, "largest_allocated_gib": 6.0,
                                    "largest_command": "p2"}
    assert peaks.summary([]) is None and peaks.collect(tmp_path / "absent") == []
    assert peaks.process_peak() is None or "reserved_bytes" in peaks.process_peak()
    assert peaks._write(str(tmp_path / "gone" / "deeper"), {"pid": 1}) is None  # an exit hook never raises


def test_finish_run_records_the_largest_process_of_the_run(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "peaks"  # what lora-lab run names for the notebook's kernel and every process it starts
    folder.mkdir()
    monkeypatch.setenv(peaks.PEAK_DIR_ENV, str(folder))
    lab.start_run("01_demo", "cpu", parameters={}, output_directory=tmp_path)
    peaks._write(str(folder), {"pid": 11, "command": "bench_moe.py --out", "reserved_bytes": 30 * GIB,
                               "allocated_bytes": 25 * GIB})
    path = lab.finish_run()
    gpu = json.loads(path.read_text())["provenance"]["gpu_memory"]
    assert gpu == {"processes": 1, "largest_reserved_gib": 30.0, "largest_allocated_gib": 25.0,
                   "largest_command": "bench_moe.py --out"}
    said = capsys.readouterr().out
    assert "the largest of this run's 1 GPU process(es) reserved 30.00 GiB (bench_moe.py --out)" in said
    monkeypatch.delenv(peaks.PEAK_DIR_ENV)
    lab.start_run("01_demo", "cpu", parameters={}, output_directory=tmp_path)
    path = lab.finish_run()  # no process used a GPU, and none is named: nothing recorded
    assert "gpu_memory" not in json.loads(path.read_text())["provenance"]

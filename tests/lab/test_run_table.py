"""lora-lab runs: a profile's published runs tabled from run_summary.json and each metrics file's provenance."""
from __future__ import annotations

import json

from lora_lab.lab import cli
from lora_lab.lab.provenance import CODE_HASH_SCOPE, code_hash
from lora_lab.lab.run_table import run_rows, runs_table


def _outputs(tmp_path):
    out = tmp_path / "outputs" / "gpu-24g"
    out.mkdir(parents=True)
    (out / "run_summary.json").write_text(json.dumps({"profile": "gpu-24g", "notebooks": {
        "05_fused_lora_kernels": {"status": "ok", "seconds": 300.04},
        "01_build_lora_layer": {"status": "ok", "seconds": 20.0}}}))
    (out / "05_fused_lora_kernels.metrics.json").write_text(json.dumps({"provenance": {
        "device": "NVIDIA H200", "memory_cap_gib": 22.0, "gpu_class": "hopper", "git_commit": "abcdef1234",
        "finished": "2026-12-06T01:02:03+00:00",
        "gpu_memory": {"processes": 3, "largest_reserved_gib": 20.5, "largest_allocated_gib": 19.0,
                       "largest_command": "bench_lora_linear.py --out"},
        "code_hash": code_hash(), "code_hash_scope": CODE_HASH_SCOPE}}))
    return out


def test_rows_and_table_from_the_summary_and_the_provenance(tmp_path):
    out = _outputs(tmp_path)
    rows = run_rows(out)
    assert [r["notebook"] for r in rows] == ["01_build_lora_layer", "05_fused_lora_kernels"]
    assert rows[1]["gpu_reserved_gib"] == 20.5 and rows[1]["commit"] == "abcdef1" and rows[0]["device"] is None
    table = runs_table(out)
    row = "| 05_fused_lora_kernels | ok | 300.0 | 20.50 | 3 | NVIDIA H200 | 22 | hopper | abcdef1 | yes | 2026-12-06 |"
    assert row in table
    assert "| 01_build_lora_layer | ok | 20.0 | - | - | - | - | - | - | no | - |" in table
    assert ("2 notebooks, 320 s of wall time one after another (5.3 min), from 1 commit(s): abcdef1; 1 of them ran "
            "this code") in table


def test_the_command_prints_it_or_names_a_profile_without_runs(tmp_path, capsys):
    _outputs(tmp_path)
    assert cli.main(["runs", "--profile", "gpu-24g", "--outputs-dir", str(tmp_path / "outputs")]) == cli.EXIT_OK
    assert "20.50" in capsys.readouterr().out
    assert cli.main(["runs", "--profile", "gpu-40g", "--outputs-dir", str(tmp_path / "outputs")]) == cli.EXIT_BAD_INPUT
    assert "gpu-40g/run_summary.json: no published runs of this profile" in capsys.readouterr().err

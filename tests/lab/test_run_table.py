"""lora-lab runs: a profile's published runs tabled from run_summary.json and each metrics file's provenance."""
from __future__ import annotations

import json

import pytest

from lora_lab.lab import cli
from lora_lab.lab.provenance import CODE_HASH_SCOPE, code_hash
from lora_lab.lab.run_table import (
    MATRIX_END,
    MATRIX_START,
    matrix_block,
    run_rows,
    runs_matrix,
    runs_table,
    write_matrix,
)


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


def _profile(outputs, profile, notebooks):
    """``outputs/<profile>`` with a run summary and a metrics file per ``{stem: (seconds, GiB, device, skipped)}``."""
    out = outputs / profile
    out.mkdir(parents=True)
    summary = {stem: {"status": "ok", "seconds": seconds} for stem, (seconds, _, _, _) in notebooks.items()}
    (out / "run_summary.json").write_text(json.dumps({"profile": profile, "notebooks": summary}))
    for stem, (_, gib, device, skipped) in notebooks.items():
        provenance = {"device": device, "gpu_memory": {"processes": 1, "largest_reserved_gib": gib} if gib else None}
        (out / f"{stem}.metrics.json").write_text(json.dumps(
            {"provenance": provenance, "skipped_cells": {f"cell{i}": "over the cap" for i in range(skipped)}}))


def test_the_matrix_tables_each_notebook_on_each_profile_with_totals_and_devices(tmp_path):
    outputs = tmp_path / "outputs"
    _profile(outputs, "gpu", {"01_build_lora_layer": (23.2, 10.37, "NVIDIA H200", 0),
                              "05_fused_lora_kernels": (578.6, None, "NVIDIA H200", 0)})
    capped = "NVIDIA H100 80GB HBM3 [memory cap 22 GiB]"
    _profile(outputs, "gpu-24g", {"05_fused_lora_kernels": (480.4, 20.5, capped, 3)})
    table = runs_matrix(outputs)
    assert table.splitlines()[:5] == [
        "| notebook | `gpu` | `gpu-24g` |", "|---|---|---|",
        "| 01_build_lora_layer | 23 s, 10.4 GiB | - |",
        "| 05_fused_lora_kernels | 579 s | 480 s, 20.5 GiB, 3 skipped or shrunk |",
        "| all, one after another | 10.0 min (2 notebooks) | 8.0 min (1 notebooks) |"]
    assert "- `gpu-24g` ran on NVIDIA H100 80GB HBM3 (05)" in table  # the cap's note after the name left out
    assert "- `gpu` ran on NVIDIA H200 (01, 05)" in table
    with pytest.raises(FileNotFoundError, match="no published runs of gpu, gpu-40g"):
        runs_matrix(tmp_path / "elsewhere")


def test_write_matrix_replaces_the_block_between_its_markers_only(tmp_path):
    outputs = tmp_path / "outputs"
    _profile(outputs, "gpu-40g", {"07_loss_block": (125.1, 26.39, "NVIDIA H100 80GB HBM3", 0)})
    doc = tmp_path / "gpu.md"
    doc.write_text(f"# Before\n\n{MATRIX_START}\nold table\n{MATRIX_END}\n\nAfter.\n")
    assert write_matrix(doc, outputs) is True
    assert doc.read_text() == f"# Before\n\n{matrix_block(outputs)}\n\nAfter.\n"
    assert "| 07_loss_block | 125 s, 26.4 GiB |" in doc.read_text()
    assert write_matrix(doc, outputs) is False  # already current: the file is left alone
    doc.write_text("# no markers\n")
    with pytest.raises(ValueError, match="needs one line"):
        write_matrix(doc, outputs)


def test_the_command_prints_or_writes_the_matrix(tmp_path, capsys):
    outputs = tmp_path / "outputs"
    _profile(outputs, "gpu-sm80", {"06_fused_moe": (319.5, 38.89, "NVIDIA H100 80GB HBM3", 0)})
    assert cli.main(["runs", "--matrix", "--outputs-dir", str(outputs)]) == cli.EXIT_OK
    assert "| 06_fused_moe | 320 s, 38.9 GiB |" in capsys.readouterr().out
    doc = tmp_path / "page.md"
    doc.write_text(f"{MATRIX_START}\n{MATRIX_END}\n")
    assert cli.main(["runs", "--matrix", "--write", str(doc), "--outputs-dir", str(outputs)]) == cli.EXIT_OK
    assert "rewritten" in capsys.readouterr().out and "06_fused_moe" in doc.read_text()
    assert cli.main(["runs", "--profile", "gpu", "--write", str(doc)]) == cli.EXIT_BAD_INPUT
    assert "--write goes with --matrix" in capsys.readouterr().err


def test_publish_into_the_checkouts_outputs_rewrites_the_table_in_docs_gpu(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from lora_lab.lab import publishing

    _profile(tmp_path / "outputs", "gpu-24g", {"07_loss_block": (173.3, 20.19, "NVIDIA H100 80GB HBM3", 0)})
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "gpu.md"
    doc.write_text(f"# GPU\n{MATRIX_START}\n{MATRIX_END}\n")
    monkeypatch.setattr(cli, "repo_root", lambda: tmp_path)
    done = [SimpleNamespace(notebook="07_loss_block", destination="outputs/gpu-24g", notebook_destination=None)]
    monkeypatch.setattr(publishing, "publish", lambda *args, **kwargs: done)
    assert cli.main(["publish", "--profile", "gpu-24g"]) == cli.EXIT_OK
    assert "| 07_loss_block | 173 s, 20.2 GiB |" in doc.read_text()
    assert "docs/gpu.md: the table of runs per profile rewritten" in capsys.readouterr().out
    doc.write_text(f"# GPU\n{MATRIX_START}\n{MATRIX_END}\n")  # a publish into other outputs leaves it alone
    assert cli.main(["publish", "--profile", "gpu-24g", "--outputs-dir", str(tmp_path / "outputs")]) == cli.EXIT_OK
    assert "07_loss_block" not in doc.read_text()

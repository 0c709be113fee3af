"""tools/copy_pass_probe.py: its launches of the copying P pass run (Triton's interpreter, fp32: there the stage
count means nothing and every P is right), its ledger rows pass the ledger's checks, and without CUDA it refuses
by name (the miscompile it looks for is the GPU compiler's)."""

import pytest
import torch

from lora_lab.lab.ledger import check_measurements


@pytest.fixture(scope="module")
def tool(load_tool):
    return load_tool("copy_pass_probe")


def test_the_probe_launches_the_copying_pass(tool):
    results = tool.probe(torch, 37, 45, [5, 16], device="cpu", dtype=torch.float32)
    assert [(r["rank"], r["stages"], r["copy"]) for r in results] == [
        (rank, stages, copy) for rank in (5, 16) for stages in tool.STAGES for copy in (False, True)]
    assert all(r["p_rel_l2"] < 1e-5 for r in results)
    assert [r["copy_exact"] for r in results if r["copy"]] == [True] * 4
    assert all(r["copy_exact"] is None for r in results if not r["copy"])


def test_ledger_rows_pass_the_ledger_checks(tool):
    results = [{"rank": 64, "stages": 4, "copy": True, "p_rel_l2": 0.04, "copy_exact": True},
               {"rank": 64, "stages": 1, "copy": False, "p_rel_l2": 0.002, "copy_exact": None}]
    rows = tool.ledger_rows(results, 777, 512)
    assert [(r["method"], r["statistic"]) for r in rows] == [
        ("copy_stages4", "p_rel_l2"), ("copy_stages4", "copy_exact"), ("no_copy_stages1", "p_rel_l2")]
    check_measurements([{**r, "date": "2026-12-06", "commit": "0" * 40, "code_hash": "0" * 64,
                         "device": "NVIDIA H100 80GB HBM3"} for r in rows], "gpu")


def test_without_cuda_it_refuses_by_name(tool, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tool.main(["--ranks", "16"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.main(["--ranks", "256"])

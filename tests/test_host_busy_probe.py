"""tools/host_busy_probe.py: its probes run, its ledger rows pass the ledger's checks, and without CUDA it refuses by
name (the timings themselves need a GPU)."""
import argparse

import pytest
import torch

from lora_lab.lab.ledger import check_measurements


@pytest.fixture(scope="module")
def probe(load_tool):
    return load_tool("host_busy_probe")


def test_each_probe_runs(probe):
    calls = probe.probes(torch, 8, 4, 6, device="cpu")
    assert list(calls) == ["noop", "one_launch", "eight_launches", "frozen_layer"]
    for call in calls.values():
        call()


def test_ledger_rows_pass_the_ledger_checks(probe):
    results = {"noop": {"host_ms": [0.01, 0.02, 0.03], "host_ms_busy": [0.02, 0.02, 0.05]},
               "frozen_layer": {"host_ms": [0.4, 0.5, 0.3], "host_ms_busy": [0.7, 0.8, 0.6]}}
    rows = check_measurements(probe.ledger_rows(results, 32, 16, 8), profile="gpu")
    assert {r["statistic"] for r in rows} == {"median", "ci_low", "ci_high"} and {r["n"] for r in rows} == {"3"}
    rows = [r for r in rows if r["statistic"] == "median"]
    assert [(r["cell"], r["method"], float(r["value"])) for r in rows] == [
        ("probe=noop", "host_ms", 0.02), ("probe=noop", "host_ms_busy", 0.02),
        ("probe=frozen_layer;M=32;K=16;N=8;dtype=bfloat16", "host_ms", 0.4),
        ("probe=frozen_layer;M=32;K=16;N=8;dtype=bfloat16", "host_ms_busy", 0.7)]


@pytest.mark.parametrize("text", ["32768,4096", "a,b,c", "0,4,4"])
def test_a_bad_cell_is_refused_by_name(probe, text):
    with pytest.raises(argparse.ArgumentTypeError, match="--cell"):
        probe.parse_cell(text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a CUDA device")
def test_without_cuda_it_refuses(probe, capsys):
    assert probe.main(["--calls", "2"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err

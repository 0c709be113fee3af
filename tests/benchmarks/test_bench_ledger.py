"""bench_common.write_summary: the summary CSV as always; with --ledger, its figures appended to the ledger too."""
import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_common  # noqa: E402

from lora_lab.lab.ledger import LedgerError, read_measurements  # noqa: E402

SUMMARY = [{"cell": "M8192", "variant": "ours", "ms": 1.5, "ms_ci95_low": 1.4, "ms_ci95_high": 1.6, "n": 5},
           {"cell": "M8192", "variant": "peft", "ms": 2.5, "ms_ci95_low": 2.4, "ms_ci95_high": 2.6, "n": 5}]


def parse(*argv):
    ap = argparse.ArgumentParser()
    bench_common.add_ledger_argument(ap)
    return ap.parse_args(list(argv))


def test_without_ledger_only_the_csv(tmp_path):
    path = bench_common.write_summary(SUMMARY, tmp_path / "out" / "s.csv", parse())
    assert path.is_file() and sorted(p.name for p in tmp_path.rglob("*.csv")) == ["s.csv"]


def test_ledger_file_receives_every_figure(tmp_path, capsys):
    ledger = tmp_path / "measurements.csv"
    bench_common.write_summary(SUMMARY, tmp_path / "05_lora_linear_summary.csv", parse("--ledger", str(ledger)))
    rows = read_measurements(ledger=ledger, benchmark="lora_linear")
    assert {(r["method"], r["statistic"], r["value"], r["n"]) for r in rows} == {
        ("ours", "median", 1.5, 5), ("ours", "ci_low", 1.4, 5), ("ours", "ci_high", 1.6, 5),
        ("peft", "median", 2.5, 5), ("peft", "ci_low", 2.4, 5), ("peft", "ci_high", 2.6, 5)}
    assert {r["cell"] for r in rows} == {"cell=M8192"} and {r["source"] for r in rows} == {"05_lora_linear_summary.csv"}
    assert "6 figures appended" in capsys.readouterr().out


def test_a_ledger_that_is_not_one_is_refused(tmp_path):
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(LedgerError, match="not a measurement ledger"):
        bench_common.write_summary(SUMMARY, tmp_path / "s.csv", parse("--ledger", str(other)))

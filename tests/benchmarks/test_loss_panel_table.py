"""benchmarks/loss_panel_table.py: the loss panel table and target verdicts, from synthetic bench_loss.py CSVs."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from lora_lab.lab import measure

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def table(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import loss_panel_table

    return loss_panel_table


def _rows(shape, hidden, tokens, head, times: dict[str, list[float]], peaks: dict[str, float] | None = None,
          status="ok"):
    """Raw rows of one cell: ``times[method]`` one ms per repetition (same repetitions for every method)."""
    peaks = peaks or {}
    return [{"shape": shape, "hidden": hidden, "vocab": 1000, "tokens": tokens, "head": head, "method": m, "rep": rep,
             "status": status, "ms": ms if status == "ok" else None, "peak_extra_gib": peaks.get(m),
             "dh_rel_err": 2e-4 if m == "lora_lab" else None, "note": ""}
            for m, values in times.items() for rep, ms in enumerate(values)]


def _write(tmp_path, name, rows, code_hash="c0de"):
    folder = tmp_path / name
    measure.write_csv(rows, folder / "07_loss_block.csv", code_hash=code_hash)
    return folder


def test_verdicts_per_cell(table, tmp_path):
    rows = (
        # d 4096: ours 1.05x the floor on every repetition (met), 0.7x Liger (met), less extra peak (met)
        _rows("big", 4096, 4096, "trainable",
              {"lora_lab": [10.5, 10.5, 10.5], "liger": [15.0, 15.0, 15.0], "gemm_floor": [10.0, 10.0, 10.0]},
              {"lora_lab": 1.0, "liger": 2.0})
        # d 896: 1.3x the floor (missed against 1.25), Liger at 1.05x the floor: 0.9x Liger is under the floor
        + _rows("small", 896, 4096, "frozen",
                {"lora_lab": [13.0, 13.0, 13.0], "liger": [10.5, 10.5, 10.5], "gemm_floor": [10.0, 10.0, 10.0]},
                {"lora_lab": 0.5, "liger": 0.1})
        # straddling 1.10: 1.05 and 1.15 and 1.10 over repetitions
        + _rows("big", 4096, 16384, "frozen",
                {"lora_lab": [10.5, 11.5, 11.0], "liger": [20.0, 20.0, 20.0], "gemm_floor": [10.0, 10.0, 10.0]})
        + _rows("big", 4096, 65536, "frozen", {"lora_lab": [0, 0], "liger": [0, 0]}, status="not_run")
    )
    out = table.panel(table.load([str(_write(tmp_path, "a", rows))]))
    by_cell = {(r["shape"], r["tokens"], r["head"]): r for r in out}
    first = by_cell[("big", 4096, "trainable")]
    assert first["vs_floor"] == pytest.approx(1.05) and first["vs_liger"] == pytest.approx(0.7)
    assert (first["floor_verdict"], first["liger_verdict"], first["peak_verdict"]) == ("met", "met", "met")
    assert first["floor_target"] == 1.10 and first["lora_lab_ms"] == pytest.approx(10.5)
    small = by_cell[("small", 4096, "frozen")]
    assert small["floor_target"] == 1.25 and small["floor_verdict"] == "missed"
    assert small["liger_verdict"] == "missed, infeasible" and small["peak_verdict"] == "missed"
    assert by_cell[("big", 16384, "frozen")]["floor_verdict"] == "inconclusive"
    assert by_cell[("big", 16384, "frozen")]["peak_verdict"] == "n/a"
    assert by_cell[("big", 65536, "frozen")]["status"] == "not_run"
    text = table.markdown(out)
    assert text.count("\n") == len(out) + 1 and "not_run" in text and "≤1.25: missed" in text


def test_main_writes_csv_and_refuses_mixed_code(table, tmp_path, capsys):
    cell = {"lora_lab": [10.5, 10.5], "liger": [15.0, 15.0], "gemm_floor": [10.0, 10.0]}
    a = _write(tmp_path, "a", _rows("big", 4096, 4096, "trainable", cell), code_hash="aaaa")
    b = _write(tmp_path, "b", _rows("big", 4096, 16384, "trainable", cell), code_hash="bbbb")
    assert table.main([str(a), str(b)]) == 2
    assert "2 versions of the code" in capsys.readouterr().err
    out_csv = tmp_path / "panel.csv"
    assert table.main([str(a), str(b), "--mixed-code", "--out", str(out_csv)]) == 0
    with open(out_csv, newline="", encoding="utf-8") as handle:
        written = list(csv.DictReader(handle))
    assert [int(r["tokens"]) for r in written] == [4096, 16384]
    assert {r["code_hash"] for r in written} == {"mixed:aaaa,bbbb"}  # the measuring code, not the tabling code
    assert table.main([str(a), "--out", str(out_csv)]) == 0
    with open(out_csv, newline="", encoding="utf-8") as handle:
        assert {r["code_hash"] for r in csv.DictReader(handle)} == {"aaaa"}


def test_refuses_a_csv_that_is_not_bench_loss(table, tmp_path, capsys):
    path = measure.write_csv([{"case": "x", "ms": 1.0}], tmp_path / "other.csv", code_hash="c0de")
    assert table.main([str(path)]) == 2
    assert "not a bench_loss.py raw CSV" in capsys.readouterr().err


def test_ours_column_is_the_chosen_method(table, tmp_path):
    """--method X: the "ours" column, the ratios and the peak are X's, and the header names X."""
    cell = {"lora_lab": [20.0, 20.0], "lora_lab_fwdgrad_lowmem": [12.0, 12.0], "liger": [15.0, 15.0],
            "gemm_floor": [10.0, 10.0]}
    rows = table.load([str(_write(tmp_path, "a", _rows("big", 4096, 4096, "trainable", cell,
                                                        {"lora_lab_fwdgrad_lowmem": 0.5, "liger": 1.0})))])
    default, = table.panel(rows)
    assert default["ours_ms"] == pytest.approx(20.0) and default["vs_liger"] == pytest.approx(20 / 15)
    assert "| ours ms |" in table.markdown([default])
    variant, = table.panel(rows, "lora_lab_fwdgrad_lowmem")
    assert variant["ours_ms"] == pytest.approx(12.0) and variant["lora_lab_ms"] == pytest.approx(20.0)
    assert variant["vs_liger"] == pytest.approx(0.8) and variant["peak_verdict"] == "met"
    text = table.markdown([variant])
    assert "| ours (lora_lab_fwdgrad_lowmem) ms |" in text
    assert "| 12.00 [12.00, 12.00] | 15.00 [15.00, 15.00] |" in text and "20.00" not in text

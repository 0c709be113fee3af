"""tools/loss_variant_table.py: a variant's own time and its per-repetition ratios to lora_lab, Liger and the floor,
from synthetic bench_loss.py CSVs (benchmarks/loss_panel_table.py's "ours ms" column is lora_lab's whatever
``--method`` says; this table carries the variant's own)."""
from __future__ import annotations

import pytest

from lora_lab.lab import measure


@pytest.fixture
def tool(load_tool):
    return load_tool("loss_variant_table")


def _rows(head, times: dict[str, list[float]], peaks: dict[str, float]):
    return [{"shape": "big", "hidden": 4096, "vocab": 1000, "tokens": 65536, "head": head, "method": m, "rep": rep,
             "status": "ok", "ms": ms, "peak_extra_gib": peaks.get(m), "note": ""}
            for m, values in times.items() for rep, ms in enumerate(values)]


def test_variant_rows(tool, tmp_path, capsys):
    rows = (_rows("trainable", {"lora_lab": [100.0, 102.0, 101.0], "lora_lab_fwdgrad_lowmem": [98.0, 99.96, 98.98],
                                "liger": [100.0, 100.0, 100.0], "gemm_floor": [90.0, 90.0, 90.0]},
                  {"lora_lab": 3.0, "lora_lab_fwdgrad_lowmem": 2.0, "liger": 1.5})
            + _rows("frozen", {"lora_lab": [50.0, 50.0, 50.0], "liger": [49.0, 49.0, 49.0]}, {}))
    measure.write_csv(rows, tmp_path / "07_loss_block.csv", code_hash="c0de")
    assert tool.main([str(tmp_path), "--variants", "lora_lab_fwdgrad_lowmem"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3  # header, rule, the one cell where the variant ran (none in the frozen cell)
    assert "| big | 65536 | trainable | lora_lab_fwdgrad_lowmem | 98.98 [98.00, 99.96] |" in out[2]
    assert "0.980 [0.980, 0.980]" in out[2]  # 0.98x lora_lab on every repetition
    assert "1.100 [1.089, 1.111]" in out[2]  # over the floor: 98/90, 99.96/90, 98.98/90
    assert out[2].endswith("| 2.00 / 3.00 / 1.50 |")


def test_nothing_to_table_and_unknown_names(tool, tmp_path, capsys):
    measure.write_csv(_rows("frozen", {"lora_lab": [1.0], "liger": [1.0]}, {}), tmp_path / "07_loss_block.csv",
                      code_hash="c0de")
    assert tool.main([str(tmp_path), "--variants", "lora_lab_fwdgrad_r4096"]) == 1
    assert "none of lora_lab_fwdgrad_r4096 ran" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.main([str(tmp_path), "--variants", "lora_lab_fast"])

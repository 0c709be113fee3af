"""tools/lora_host_profile.py: on the CPU (Triton's interpreter) it runs the code path of the variants it is asked
for, the frozen layer always among them, and writes a row per variant and repetition; an unknown variant is refused
by name (the timings themselves need a GPU)."""
import csv

import pytest


@pytest.fixture(scope="module")
def tool(load_tool):
    return load_tool("lora_host_profile")


def test_the_asked_variants_and_the_frozen_layer_are_profiled(tool, tmp_path):
    tool.main(["--out", str(tmp_path), "--variants", "fused_stacked", "fused_merged_qdb", "--calls", "2",
               "--traced", "1", "--repetitions", "1", "--adapters", "input"])
    with open(tmp_path / "lora_host_profile.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert sorted(r["variant"] for r in rows) == ["base", "fused_merged_qdb", "fused_stacked"]
    assert all(float(r["host_ms"]) > 0 for r in rows)
    assert {p.name for p in tmp_path.glob("*_host_ops.txt")} == {
        "base_host_ops.txt", "fused_merged_qdb_host_ops.txt", "fused_stacked_host_ops.txt"}


def test_an_unknown_variant_is_refused(tool, tmp_path, capsys):
    with pytest.raises(SystemExit):
        tool.main(["--out", str(tmp_path), "--variants", "fused_stackd"])
    assert "fused_stackd" in capsys.readouterr().err

"""docs/gpu.md keeps the table of what each notebook's published run took on each GPU profile as
``lora-lab runs --matrix`` writes it from outputs/ (``lora-lab publish`` rewrites it); typed by hand or left stale
after a publish, it fails here."""
from pathlib import Path

from lora_lab.lab.run_table import MATRIX_END, MATRIX_START, matrix_block

ROOT = Path(__file__).resolve().parents[1]


def test_docs_gpu_holds_the_current_table_of_runs_per_profile():
    text = (ROOT / "docs" / "gpu.md").read_text(encoding="utf-8")
    start, end = text.index(MATRIX_START), text.index(MATRIX_END) + len(MATRIX_END)
    assert text[start:end] == matrix_block(ROOT / "outputs"), \
        "docs/gpu.md: the table of runs is stale; run `lora-lab runs --matrix --write docs/gpu.md`"

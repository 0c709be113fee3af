"""tools/token_reduction_probe.py: the ledger figures of each way of computing dYᵀ P, and the signature of a product
that left out the last token (small against the product without it, large against the whole)."""
from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("token_reduction_probe", ROOT / "tools" / "token_reduction_probe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_smoke_run_writes_both_figures_of_every_method_at_every_cell(probe, tmp_path):
    ledger = tmp_path / "ledger.csv"
    assert probe.main(["--smoke", "--ledger", str(ledger)]) == 0
    rows = list(csv.DictReader(ledger.open()))
    cells = {f"M={M};N={N};r={r};dtype=bfloat16" for M in probe.SMOKE_TOKENS for N in probe.SMOKE_WIDTHS
             for r in probe.SMOKE_RANKS}
    figures = {(row["cell"], row["method"], row["statistic"]): float(row["value"]) for row in rows}
    assert set(figures) == {(c, m, s) for c in cells for m in probe.METHODS
                            for s in ("rel_l2", "rel_l2_without_last")}
    for cell in cells:  # on the CPU every way is right: within bf16 rounding, far from the product missing a token
        for method in probe.METHODS:
            assert figures[cell, method, "rel_l2"] < 5e-3
            assert figures[cell, method, "rel_l2_without_last"] > 10 * figures[cell, method, "rel_l2"]


def test_a_product_without_the_last_token_shows_as_such(probe, monkeypatch):
    real = probe.products

    def dropping(torch_module, dy, p):
        out = real(torch_module, dy, p)
        out["cublas"] = dy[:-1].t() @ p[:-1]  # the last token's term left out
        return out

    monkeypatch.setattr(probe, "products", dropping)
    result = probe.probe_cell(torch, 65, 24, 4, torch.device("cpu"), torch.bfloat16)
    whole, without_last = result["cublas"]
    assert without_last < 5e-3 < whole
    assert result["lora_lab"][0] < 5e-3 < result["lora_lab"][1]


def test_a_gpu_run_needs_cuda(probe, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert probe.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err

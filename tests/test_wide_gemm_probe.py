"""tools/wide_gemm_probe.py: its operands are the widened route's products with the stride asked for, its timed
variants cover each extra depth packed and padded, its ledger rows pass the ledger's checks, and without CUDA it
refuses by name."""

import pytest
import torch

from lora_lab.lab.ledger import check_measurements


@pytest.fixture(scope="module")
def tool(load_tool):
    return load_tool("wide_gemm_probe")


@pytest.mark.parametrize("form", ["forward", "dx"])
def test_operands_are_the_routes_products_with_the_stride_asked_for(tool, form):
    act, weight = tool.operands(torch, form, 9, 24, 40, 8, 64, "cpu", torch.float32)
    inner = (24 if form == "forward" else 40) + 8
    assert act.shape == (9, inner) and act.stride() == (64, 1)
    out = tool.product(torch, form, act, weight)
    assert out.shape == (9, 40 if form == "forward" else 24)
    dense = act.contiguous()
    expected = dense @ weight.t() if form == "forward" else dense @ weight
    assert torch.allclose(out, expected)
    packed, _ = tool.operands(torch, form, 9, 24, 40, 8, None, "cpu", torch.float32)
    assert packed.is_contiguous()
    with pytest.raises(ValueError, match="shorter than the row"):
        tool.operands(torch, form, 9, 24, 40, 8, inner - 1, "cpu", torch.float32)


def test_unknown_form_is_named(tool):
    with pytest.raises(ValueError, match="unknown form 'dw'"):
        tool.operands(torch, "dw", 9, 24, 40, 8, None, "cpu", torch.float32)


def test_the_probe_times_each_variant_against_extra_zero(tool):
    results = tool.probe(torch, 16, 24, 40, [8, 16], 16, repetitions=2, calls=1, device="cpu", dtype=torch.float32)
    seen = {(r["form"], r["extra"], r["layout"], r["stride"]) for r in results}
    assert seen == {("forward", 0, "packed", 24), ("forward", 8, "packed", 32), ("forward", 16, "packed", 40),
                    ("forward", 16, "stride16", 48), ("forward", 0, "stride16", 32),
                    ("dx", 0, "packed", 40), ("dx", 8, "packed", 48), ("dx", 16, "packed", 56),
                    ("dx", 0, "stride16", 48), ("dx", 16, "stride16", 64)}
    for r in results:
        assert len(r["ms"]) == len(r["ratio"]) == 2
        if r["extra"] == 0 and r["layout"] == "packed":
            assert r["ratio"] == [1.0, 1.0]


def test_ledger_rows_pass_the_ledger_checks(tool):
    results = [{"form": "forward", "extra": 16, "layout": "stride64", "stride": 4160, "ms": [1.6, 1.5, 1.7],
                "ratio": [1.1, 1.05, 1.12]}]
    rows = tool.ledger_rows(results, 32768, 4096, 4096)
    assert {(r["method"], r["unit"], r["statistic"]) for r in rows} == {
        (method, unit, s) for s in ("median", "ci_low", "ci_high")
        for method, unit in (("cublas_stride64_ld4160", "ms"), ("cublas_stride64_ld4160/extra0", "ratio"))}
    check_measurements([{**r, "date": "2026-12-06", "commit": "0" * 40, "code_hash": "0" * 64,
                         "device": "NVIDIA H100 80GB HBM3"} for r in rows], "gpu")


def test_without_cuda_it_refuses_by_name(tool, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tool.main(["--extras", "16"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.main(["--stride-multiple", "12"])

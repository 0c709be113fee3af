"""Answer cells quote the run's own figures, formatted, and name a figure the run did not record."""
import pytest

from lora_lab import lab
from lora_lab.lab.answers import Figures, MissingFigure, show_answer

SUMMARY = {"median": 1.5700004, "ci95": [1.5577919, 1.5775837], "level": 0.95, "min": 1.53, "max": 1.6, "n": 6,
           "samples": [1.57] * 6, "sessions": 2}


@pytest.fixture
def fig():
    return Figures({"ratio": SUMMARY, "peak_gib": 5.5886807, "tokens": 16384, "share": 0.4471, "tiny": 2.368e-4,
                    "ok": True, "table": {"a": 1}, "nan": float("nan")}, "gpu")


def test_formats(fig):
    assert fig.x("ratio") == "1.570×"
    assert fig.interval("ratio") == "[1.558, 1.578]"
    assert fig.sessions("ratio") == 2
    assert fig.num("peak_gib", 1) == "5.6"
    assert fig.num("tokens", 0) == "16,384"
    assert fig.pct("share") == "44.7%"
    assert fig.sci("tiny") == "2.37e-4"
    assert fig["ok"] == 1.0
    assert fig.interval("peak_gib") == ""


def test_standing_against_a_threshold(fig):
    assert fig.above("ratio", 1.5) == "above"
    assert fig.above("ratio", 1.6) == "below"
    assert fig.above("ratio", 1.57) == "level with"


def test_missing_figures_are_named(fig):
    assert fig.has("ratio", "peak_gib") and not fig.has("ratio", "absent") and not fig.has("nan")
    assert fig.get("absent", 7.0) == 7.0
    with pytest.raises(MissingFigure, match="'ratio_vs_peft', which this run \\(gpu\\) did not record"):
        fig.x("ratio_vs_peft")
    with pytest.raises(MissingFigure, match="is a table"):
        fig["table"]


def test_figures_of_the_run_in_progress(tmp_path, capsys):
    lab.start_run("01_build_lora_layer", "cpu", parameters={}, output_directory=tmp_path)
    try:
        lab.record("speedup", SUMMARY)
        assert lab.figures().x("speedup") == "1.570×"
    finally:
        lab.finish_run()
    show_answer("**The answer.** 1.570×")
    assert "**The answer.** 1.570×" in capsys.readouterr().out

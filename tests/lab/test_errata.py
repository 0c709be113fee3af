"""Errata (predictions/errata.yaml) and registration order: what grading refuses to read from a published run."""
from __future__ import annotations

import pytest

from lora_lab.lab.errata import apply_errata, load_errata, parse_errata
from lora_lab.lab.grading import why_void_payload
from lora_lab.lab.predictions import Prediction

RATIO = {"median": 1.26, "ci95": [1.25, 1.29], "n": 5, "sessions": 2, "samples": [1.26] * 5}


def payload(commit="bec6a1ba8d46d6a4"):
    return {"notebook": "06_fused_moe", "profile": "gpu",
            "provenance": {"status": "completed", "git_commit": commit},
            "metrics": {"olmoe_t8192_full_speedup_vs_grouped_mm": dict(RATIO), "other_speedup_vs_x": dict(RATIO)}}


ERRATUM = [{"notebook": "06_fused_moe", "git_commit": "bec6a1b", "why": "skipped rows counted",
            "sessions": {"olmoe_t8192_full_speedup_vs_grouped_mm": 1}}]


def prediction(metric):
    return Prediction(id="p06-test", notebook="06_fused_moe", claim="c", metric=metric, comparator=">=",
                      threshold=1.2, profiles=("gpu",), confidence=0.5, rationale="r")


def test_an_erratum_lowers_sessions_and_voids_the_speed_ratio_with_the_reason():
    fixed = apply_errata(payload(), parse_errata(ERRATUM))
    assert fixed["metrics"]["olmoe_t8192_full_speedup_vs_grouped_mm"]["sessions"] == 1
    assert fixed["metrics"]["other_speedup_vs_x"]["sessions"] == 2  # not named: untouched
    assert payload()["metrics"]["olmoe_t8192_full_speedup_vs_grouped_mm"]["sessions"] == 2  # no mutation
    assert "erratum" in fixed["notes"]["olmoe_t8192_full_speedup_vs_grouped_mm"]


def test_an_erratum_applies_only_to_the_run_it_names_and_never_raises_sessions():
    errata = parse_errata(ERRATUM)
    other = payload(commit="0123456789abcdef")
    assert apply_errata(other, errata) is other
    up = parse_errata([{**ERRATUM[0], "sessions": {"olmoe_t8192_full_speedup_vs_grouped_mm": 3}}])
    assert apply_errata(payload(), up)["metrics"]["olmoe_t8192_full_speedup_vs_grouped_mm"]["sessions"] == 2


def test_grading_reads_the_repository_errata(monkeypatch):
    import lora_lab.lab.errata as errata_mod

    monkeypatch.setattr(errata_mod, "load_errata", lambda path=None: parse_errata(ERRATUM))
    why, value = why_void_payload(prediction("olmoe_t8192_full_speedup_vs_grouped_mm"), "gpu", payload())
    assert "session" in why and "erratum" in why and value["sessions"] == 1
    why, _ = why_void_payload(prediction("other_speedup_vs_x"), "gpu", payload())
    assert why == ""


@pytest.mark.parametrize("entry, message", [
    ({**ERRATUM[0], "git_commit": "xyz"}, "git_commit"),
    ({**ERRATUM[0], "sessions": {"m": 0}}, ">= 1"),
    ({k: v for k, v in ERRATUM[0].items() if k != "why"}, "missing"),
    ({**ERRATUM[0], "extra": 1}, "unknown"),
])
def test_a_malformed_erratum_names_the_field(entry, message):
    with pytest.raises(ValueError, match=message):
        parse_errata([entry], "errata.yaml")


def test_the_committed_errata_file_parses():
    assert all(entry["sessions"] for entry in load_errata())


def test_a_prediction_registered_after_a_run_started_is_not_graded_by_that_run(tmp_path):
    import json

    from lora_lab.lab.grading import registered_after_run

    metrics = tmp_path / "10_the_whole_step.metrics.json"
    metrics.write_text(json.dumps({"provenance": {"started": "2026-12-01T18:53:27+00:00"}}))
    why = registered_after_run("2026-12-01T19:40:00+00:00", metrics)
    assert "after this run started" in why and "next run" in why
    assert registered_after_run("2026-12-01T10:00:00+00:00", metrics) == ""
    assert registered_after_run(None, metrics) == ""  # git cannot tell: graded as before

"""The committed scoreboards show the grading of the committed outputs.

`lora-lab publish` alone does not grade (`make publish` does). Publishing notebooks 07 and 10 with
`lora-lab publish` once left outputs/gpu/scoreboard.md as notebook 06's publication had graded it: three predictions
read void that the published run had graded. This test fails on such a stale board.
"""
from pathlib import Path

import pytest

from lora_lab.lab.grading import grade, registration_times
from lora_lab.lab.scoreboard_files import SCOREBOARD_MD, scoreboard_is_current

ROOT = Path(__file__).resolve().parents[2]
PREDICTIONS = ROOT / "predictions" / "predictions.yaml"


@pytest.mark.parametrize("profile", ["cpu", "gpu"], ids=["outputs-cpu", "outputs-h200"])
def test_committed_scoreboard_is_current(profile):  # ids without "gpu": a "gpu" keyword means "needs CUDA" here
    profile_dir = ROOT / "outputs" / profile
    if not (profile_dir / SCOREBOARD_MD).is_file():
        pytest.skip(f"outputs/{profile} has no scoreboard")
    if not registration_times(PREDICTIONS):
        pytest.skip("git cannot tell when predictions were registered (no history): the board's dates differ")
    board = grade(profile, predictions_path=PREDICTIONS, outputs_root=ROOT / "outputs", write=False, echo=False,
                  require_committed=False)
    assert scoreboard_is_current(board, profile_dir), (
        f"outputs/{profile}/{SCOREBOARD_MD} does not show the grading of outputs/{profile}: run "
        f"`lora-lab grade --profile {profile}` (make publish grades after publishing) and commit the scoreboard")

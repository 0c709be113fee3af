"""The device route's declared commit: tools/device/declare_commit.sh moves a copy's stale .git aside and declares
the commit, and provenance.git_state then records that commit (source "declared", dirty unknown) instead of the
stale repository's (which made session 17's notebook 07 run unpublishable)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "device" / "declare_commit.sh"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_declare_commit_hides_the_stale_git_and_git_state_records_the_declared_commit(tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "lora_lab", copy / "lora_lab", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["git", "init", "-q", str(copy)], check=True)  # the stale repository of a device copy
    probe = ("from pathlib import Path; from lora_lab.lab.provenance import git_state; "
             "print(git_state(Path('.')))")
    env = {k: v for k, v in os.environ.items() if k != "LORA_LAB_SOURCE_COMMIT"}
    env["PYTHONPATH"] = str(copy)
    commit = "abc1234" + "0" * 33
    done = subprocess.run(["bash", "-c", f"source {SCRIPT} {commit} && {sys.executable} -c \"{probe}\""],
                          cwd=copy, env=env, capture_output=True, text=True, check=True)
    assert not (copy / ".git").exists()
    assert f"declared commit {commit}" in done.stdout
    assert f"'git_commit': '{commit}'" in done.stdout and "'git_source': 'declared'" in done.stdout
    refused = subprocess.run(["bash", "-c", f"source {SCRIPT}"], cwd=copy, env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and "give the commit" in refused.stderr
    short = subprocess.run(["bash", "-c", f"source {SCRIPT} abc1234"], cwd=copy, env=env, capture_output=True,
                           text=True)  # a short prefix is refused: session 18 typed one that named no commit
    assert short.returncode == 2 and "full 40-digit commit" in short.stderr

"""The `lora-lab` command itself: its version, and where it looks for the repository."""
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import lora_lab
from lora_lab.lab.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_version_prints_the_package_version(capsys):
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert lora_lab.__version__ == declared  # the version the package reports is the one it is built with
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"lora-lab {declared}"


def test_version_from_the_command_line():
    done = subprocess.run([sys.executable, "-m", "lora_lab", "--version"], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0 and done.stdout.strip() == f"lora-lab {lora_lab.__version__}", done.stderr

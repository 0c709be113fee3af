"""tools/quack_epilogue_spills.py: its command line (the compile itself needs QuACK and the CUTLASS DSL, which CI does
not install; the tool's docstring says how to run it)."""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "quack_epilogue_spills.py"


@pytest.fixture
def tool():
    spec = importlib.util.spec_from_file_location("quack_epilogue_spills", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiles_parse_and_a_bad_one_is_named(tool):
    assert tool._tile("128x256:cooperative") == (128, 256, "cooperative")
    assert tool._tile("128x192:pingpong") == (128, 192, "pingpong")
    with pytest.raises(argparse.ArgumentTypeError, match="'128x256': expected MxN:pingpong or MxN:cooperative"):
        tool._tile("128x256")

"""tools/quack_epilogue_spills.py: its command line (the compile itself needs QuACK and the CUTLASS DSL, which CI does
not install; the tool's docstring says how to run it)."""
from __future__ import annotations

import argparse

import pytest


@pytest.fixture
def tool(load_tool):
    return load_tool("quack_epilogue_spills")


def test_tiles_parse_and_a_bad_one_is_named(tool):
    assert tool._tile("128x256:cooperative") == (128, 256, "cooperative")
    assert tool._tile("128x192:pingpong") == (128, 192, "pingpong")
    with pytest.raises(argparse.ArgumentTypeError, match="'128x256': expected MxN:pingpong or MxN:cooperative"):
        tool._tile("128x256")

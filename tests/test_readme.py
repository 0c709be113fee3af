"""Every ```python block of README.md and docs/*.md runs as written, and the README stays short.

Each block runs on its own, in a fresh interpreter (a subprocess) in an empty temporary working directory, so it
may use nothing another block or the test defines, its state (a process group, a recorded run) cannot leak into
the test process, and it must leave that directory as it found it (a block that writes ``adapter/`` there fails
when run twice). A block runs the way its text says: on a machine without CUDA, ``TRITON_INTERPRET=1`` is set
only for the blocks whose section (the text from the heading above the block down to it) names
``TRITON_INTERPRET=1``; every other block runs without it, so a kernel example that does not say it needs
Triton's interpreter on a CPU fails here.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_CHARS = 12_000
INTERPRETER_NOTE = "TRITON_INTERPRET=1"
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
HEADING = re.compile(r"^#{1,6} +(.+)$", re.M)
RELATIVE_LINK = re.compile(r"\]\((?!https?://|#)([^)\s#]+)(?:#[^)\s]*)?\)")


def markdown_files() -> list[Path]:
    """README.md, then every page of docs/, in name order."""
    return [README, *sorted(DOCS.glob("*.md"))]


def python_blocks(text: str) -> list[tuple[str, str, bool]]:
    """(section, source, needs_interpreter) of every ```python block of ``text``: the section is the slug of the
    heading above the block; the block needs Triton's interpreter on a CPU when the section's text before it
    names ``TRITON_INTERPRET=1``."""
    blocks = []
    for match in BLOCK.finditer(text):
        headings = list(HEADING.finditer(text, 0, match.start()))
        section_start = headings[-1].start() if headings else 0
        title = headings[-1].group(1) if headings else "top"
        section = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
        blocks.append((section, match.group(1), INTERPRETER_NOTE in text[section_start:match.start()]))
    return blocks


def all_blocks() -> list[tuple[str, str, bool]]:
    """(id, source, needs_interpreter) of every block of :func:`markdown_files`, the id naming file and section."""
    found = []
    for path in markdown_files():
        name = path.relative_to(ROOT).as_posix()
        for number, (section, source, needs) in enumerate(python_blocks(path.read_text(encoding="utf-8")), 1):
            found.append((f"{name}:{number}-{section}", source, needs))
    return found


BLOCKS = all_blocks()


def block_environment(needs_interpreter: bool, cuda: bool) -> dict[str, str]:
    """The environment a block runs in: this one, without ``TRITON_INTERPRET`` unless the block's text asks for it
    and there is no CUDA device (tests/conftest.py sets it for the test process itself)."""
    environment = {**os.environ, "MPLBACKEND": "Agg", "TQDM_DISABLE": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    environment.pop("TRITON_INTERPRET", None)
    if needs_interpreter and not cuda:
        environment["TRITON_INTERPRET"] = "1"
    return environment


def test_the_readme_is_short():
    length = len(README.read_text(encoding="utf-8"))
    assert length <= README_MAX_CHARS, (f"README.md has {length} characters, at most {README_MAX_CHARS} are allowed: "
                                        "move detail to a page of docs/")


def test_the_readme_and_docs_have_python_blocks():
    files = {block_id.split(":")[0] for block_id, _, _ in BLOCKS}
    assert "README.md" in files, "README.md has no ```python block: its package example is missing"
    assert len(BLOCKS) >= 8, [block_id for block_id, _, _ in BLOCKS]
    assert any(needs for _, _, needs in BLOCKS), "no block says it needs TRITON_INTERPRET=1 on a CPU"


def test_relative_links_point_to_files():
    broken = [f"{path.relative_to(ROOT).as_posix()}: {target}"
              for path in [*markdown_files(), ROOT / "benchmarks" / "README.md"]
              for target in RELATIVE_LINK.findall(path.read_text(encoding="utf-8"))
              if not (path.parent / target).exists()]
    assert not broken, broken


def test_the_interpreter_note_applies_to_its_own_section_only():
    text = ("# Page\n\nOn a CPU: `TRITON_INTERPRET=1 python example.py`.\n\n```python\nkernel()\n```\n\n"
            "Still the same section.\n\n```python\nkernel_again()\n```\n\n## Next\n\n```python\nplain()\n```\n")
    assert [(section, needs) for section, _, needs in python_blocks(text)] == [
        ("page", True), ("page", True), ("next", False)]
    assert block_environment(True, cuda=False)["TRITON_INTERPRET"] == "1"
    assert "TRITON_INTERPRET" not in block_environment(True, cuda=True)
    assert "TRITON_INTERPRET" not in block_environment(False, cuda=False)


# runs one block in a fresh interpreter, as written
RUNNER = """
import sys
source = sys.stdin.read()
exec(compile(source, {name!r}, "exec"), {{"__name__": "__docs_block__"}})
"""


@pytest.mark.slow
@pytest.mark.parametrize(("source", "needs_interpreter"), [(source, needs) for _, source, needs in BLOCKS],
                         ids=[block_id for block_id, _, _ in BLOCKS])
def test_block_runs_as_written(source, needs_interpreter, tmp_path, request):
    name = request.node.callspec.id
    compile(source, name, "exec")  # a syntax error fails here
    environment = block_environment(needs_interpreter, torch.cuda.is_available())
    done = subprocess.run([sys.executable, "-c", RUNNER.format(name=name)], input=source, capture_output=True,
                          text=True, cwd=tmp_path, env=environment, timeout=900, check=False)
    assert done.returncode == 0, f"the block failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    left = sorted(path.name for path in tmp_path.iterdir())
    assert not left, f"the block left {left} in its working directory: write into a tempfile.TemporaryDirectory()"

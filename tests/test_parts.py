"""tools/parts.py: a file cut into parts that travel in separate calls comes back byte for byte once every part has
arrived, and not before; a damaged part or manifest is refused by name."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "parts.py"


def _run(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True)


def _file(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    return path


def test_parts_dealt_to_calls_assemble_only_when_all_have_arrived(tmp_path):
    big = _file(tmp_path / "weights-0.1-py3-none-any.whl", 5 * 1024 * 1024 + 123)
    small = _file(tmp_path / "reader-1.0-py3-none-any.whl", 1000)
    done = _run("split", big, small, "--out", tmp_path / "parts", "--part-mib", 2, "--calls", 2)
    assert done.returncode == 0, done.stderr
    calls = [tmp_path / "parts" / "1", tmp_path / "parts" / "2"]
    carried = [sorted(p.name for p in call.iterdir() if not p.name.endswith(".parts.json")) for call in calls]
    assert sorted(carried[0] + carried[1]) == sorted(
        [f"{big.name}.part0{k}of3" for k in (1, 2, 3)] + [f"{small.name}.part01of1"])
    assert all(carried)  # both calls carry something
    sizes = [sum((call / n).stat().st_size for n in names) for call, names in zip(calls, carried)]
    assert max(sizes) - min(sizes) <= 2 * 1024 * 1024  # dealt out evenly (within one part), not all in one call

    store, out = tmp_path / "store", tmp_path / "assembled"
    assert _run("gather", calls[0], "--store", store).returncode == 0
    first = _run("assemble", "--store", store, "--out", out)
    assert first.returncode == 3
    missing = [n for n in carried[1] if n.startswith(big.name)]
    if missing:
        assert "incomplete: " + big.name in first.stdout and missing[0] in first.stdout
        assert not (out / big.name).exists()

    assert _run("gather", calls[1], "--store", store).returncode == 0
    second = _run("assemble", "--store", store, "--out", out)
    assert second.returncode == 0, second.stdout + second.stderr
    assert (out / big.name).read_bytes() == big.read_bytes()
    assert (out / small.name).read_bytes() == small.read_bytes()
    assert not list(out.glob("*.partial"))


def test_a_damaged_part_is_refused_by_name(tmp_path):
    big = _file(tmp_path / "w.bin", 3000)
    assert _run("split", big, "--out", tmp_path / "parts", "--part-mib", 0.001).returncode == 0
    part = tmp_path / "parts" / "w.bin.part02of3"
    part.write_bytes(b"x" + part.read_bytes()[1:])
    done = _run("gather", tmp_path / "parts", "--store", tmp_path / "store")
    assert done.returncode == 2
    assert "w.bin.part02of3" in done.stderr and "damaged" in done.stderr


def test_a_manifest_naming_a_path_or_missing_a_key_is_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.parts.json").write_text(json.dumps({"name": "../a", "size": 1, "sha256": "0", "parts": []}))
    done = _run("gather", src, "--store", tmp_path / "store")
    assert done.returncode == 2 and "names files only" in done.stderr
    (src / "a.parts.json").write_text(json.dumps({"name": "a", "size": 1}))
    done = _run("gather", src, "--store", tmp_path / "store2")
    assert done.returncode == 2 and "a.parts.json: not a parts manifest" in done.stderr


def test_bad_arguments_name_the_problem(tmp_path):
    done = _run("split", tmp_path / "absent.whl", "--out", tmp_path / "parts")
    assert done.returncode == 2 and "absent.whl: no such file" in done.stderr
    done = _run("split", _file(tmp_path / "f", 10), "--out", tmp_path / "parts", "--part-mib", 0)
    assert done.returncode == 2 and "--part-mib must be positive" in done.stderr
    done = _run("assemble", "--store", tmp_path / "nothing", "--out", tmp_path / "o")
    assert done.returncode == 2 and "nothing was gathered" in done.stderr
